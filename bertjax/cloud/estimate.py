"""XLA:TPU's own estimate of a compiled program's time on a chip, read from the compiled HLO text.

Every instruction XLA:TPU schedules (fusions, and unfused converts, copies...) carries `"estimated_cycles":"N"`
in its backend_config, also when compiled for libtpu's compile-only devices. Summed over the program as it runs,
with each generation's clock (`topologies.Generation.clock_hz`), that is the compiler's estimate of a step's time
per chip: the best view of TPU speed without a TPU, and an *estimate*, never a measurement.

What the text holds (jax 0.10.2, libtpu 0.0.42.1):
- Estimates sit on instructions of scheduled computations only: ENTRY, while bodies and conditions, conditional
  branches, called computations. A fusion's estimate covers its fused computation, which is not descended into.
- A while loop's body counts `known_trip_count` times (from its backend_config), or, where XLA recorded none (the
  gradient-accumulation scan), N times for a condition `counter < N` on a constant N (JAX's loops count from 0);
  otherwise once, and said so. A conditional counts its most expensive branch (the normal path: the update branch of the non-finite skip).
- No estimate on custom calls: a Pallas (Mosaic) kernel is priced by the roofline of the `pl.CostEstimate` it
  declares (max of FLOPs at the chip's peak and bytes at its HBM bandwidth), and said so in the coverage; other
  custom calls (index hints) are counted as without estimate. Collectives (all-reduce, all-gather...) carry
  none either: XLA overlaps them with compute; their bytes are reported, not priced.
"""
from __future__ import annotations

import collections
import dataclasses
import re

_HEADER = re.compile(r"^(ENTRY )?%([^\s(]+) ")
_INSTRUCTION = re.compile(r"^\s+(?:ROOT )?%(\S+) = (.*)$")
_CYCLES = re.compile(r'"estimated_cycles":"(\d+)"')
_TRIP_COUNT = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_CALLEE = re.compile(r"\b(calls|body|condition|to_apply|true_computation|false_computation)=%([^\s,})]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_CUSTOM_TARGET = re.compile(r'custom_call_target="([^"]*)"')
# The kernel's declared CostEstimate in its backend_config (numbers quoted in compiled HLO, bare when lowered).
_KERNEL_COST = re.compile(r'"flops":\s*"?(\d+)"?,\s*"transcendentals":\s*"?(\d+)"?,\s*"bytes_accessed":\s*"?(\d+)"?')
_ARRAY = re.compile(r"\b(pred|s8|u8|s16|u16|s32|u32|s64|u64|bf16|f16|f32|f64)\[([\d,]*)\]")
_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "bf16": 2, "f16": 2, "s32": 4, "u32": 4, "f32": 4,
          "s64": 8, "u64": 8, "f64": 8}
_COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
# Instructions that do no work of their own (or whose work is their callees').
_FREE = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "while", "conditional", "call",
         "after-all", "partition-id", "replica-id", "opt-barrier", "copy-done", "slice-done", "async-done"}
PALLAS_TARGET = "tpu_custom_call"


@dataclasses.dataclass
class _Instruction:
    name: str
    opcode: str
    result_type: str
    cycles: int | None
    op_name: str
    callees: dict
    trip_count: int | None
    line: str


@dataclasses.dataclass
class StepEstimate:
    """The estimated time of one run of a program on one chip, and where it goes."""

    seconds: float                       # estimated cycles / clock + Pallas kernels' declared rooflines
    cycles: int                          # the sum of XLA's estimates (each times its loop trip count)
    kernel_seconds: float                # the Pallas kernels' share of `seconds` (from their CostEstimate)
    by_op_name: dict[str, float]         # op_name group (layer numbers merged) -> seconds, largest first
    coverage: dict                       # what was estimated how, and what had no estimate


def op_name_group(op_name: str) -> str:
    """An op_name without the jit wrapper and with every `layer_<i>` as `layer_N`, so layers add up."""
    name = re.sub(r"^jit\([^)]*\)/", "", op_name)
    name = re.sub(r"layer_\d+", "layer_N", name)
    return name or "(no op_name)"


def array_bytes(result_type: str) -> int:
    total = 0
    for dtype, dims in _ARRAY.findall(result_type):
        count = 1
        for size in filter(None, dims.split(",")):
            count *= int(size)
        total += count * _BYTES[dtype]
    return total


def _result_type(text: str) -> tuple[str, str]:
    """(result type, rest) of an instruction's right-hand side; tuple types nest parentheses."""
    if text.startswith("("):
        depth = 0
        for i, char in enumerate(text):
            depth += (char == "(") - (char == ")")
            if depth == 0:
                return text[:i + 1], text[i + 1:]
    type_text, _, rest = text.partition(" ")
    return type_text, " " + rest


def parse_hlo(text: str) -> tuple[dict[str, list[_Instruction]], str]:
    """{computation: its instructions} and the ENTRY computation's name, from `compiled.as_text()`."""
    computations, entry, current = {}, None, None
    for line in text.splitlines():
        if header := _HEADER.match(line):
            current = computations.setdefault(header[2], [])
            entry = header[2] if header[1] else entry
            continue
        match = _INSTRUCTION.match(line)
        if not match or current is None:
            continue
        result_type, rest = _result_type(match[2])
        opcode = re.match(r"\s*([\w-]+)", rest)[1]
        callees = collections.defaultdict(list)
        for kind, callee in _CALLEE.findall(line):
            callees[kind].append(callee)
        if branches := _BRANCHES.search(line):
            callees["branches"] = [b.strip().lstrip("%") for b in branches[1].split(",")]
        cycles, trips, op_name = _CYCLES.search(line), _TRIP_COUNT.search(line), _OP_NAME.search(line)
        current.append(_Instruction(match[1], opcode, result_type, int(cycles[1]) if cycles else None,
                                    op_name[1] if op_name else "", dict(callees),
                                    int(trips[1]) if trips else None, line))
    if entry is None:
        raise ValueError("no ENTRY computation in the HLO text")
    return computations, entry


def estimate_program(hlo_text: str, *, clock_hz: float, peak_flops: float, hbm_bytes_per_second: float) -> StepEstimate:
    """The program's estimated seconds per run on one chip of a generation with this clock, bf16 peak and HBM
    bandwidth (see the module docstring for what is counted how)."""
    computations, entry = parse_hlo(hlo_text)
    without_estimate, unknown_trip_counts, trip_counts_from_condition = collections.Counter(), [], []
    collective_bytes = collections.Counter()

    def walk(name: str, times: int) -> list[tuple[str, float, int, float]]:
        """(op_name group, cycles, count, kernel seconds) of each instruction that costs, `times` runs each."""
        costs = []
        for instruction in computations.get(name, []):
            opcode, callees = instruction.opcode, instruction.callees
            if instruction.cycles is not None:
                costs.append((op_name_group(instruction.op_name), instruction.cycles * times, times, 0.0))
            elif opcode == "custom-call" and PALLAS_TARGET in instruction.line:
                kernel = _KERNEL_COST.search(instruction.line)
                if kernel:
                    flops, _, bytes_accessed = map(int, kernel.groups())
                    seconds = max(flops / peak_flops, bytes_accessed / hbm_bytes_per_second)
                    costs.append((op_name_group(instruction.op_name), 0, times, seconds * times))
                else:
                    without_estimate["Pallas kernel without a CostEstimate"] += times
            elif opcode.startswith(_COLLECTIVES):
                if not opcode.endswith("-done"):
                    collective_bytes[opcode.removesuffix("-start")] += array_bytes(instruction.result_type) * times
            elif opcode not in _FREE:
                target = _CUSTOM_TARGET.search(instruction.line)
                without_estimate[f"{opcode}:{target[1]}" if target else opcode] += times
            if opcode == "while":
                trips = instruction.trip_count
                if trips is None:
                    trips = _trip_count_from_condition(computations.get(callees.get("condition", [""])[0], []))
                    if trips is None:
                        unknown_trip_counts.append(instruction.op_name or "while")
                        trips = 1
                    else:
                        trip_counts_from_condition.append(trips)
                for body in callees.get("body", []):
                    costs += walk(body, times * trips)
                for condition in callees.get("condition", []):
                    costs += walk(condition, times * (trips + 1))
            elif opcode == "conditional":
                branches = callees.get("branches") or callees.get("true_computation", []) + callees.get(
                    "false_computation", [])
                walked = [walk(branch, times) for branch in branches]
                if walked:
                    costs += max(walked, key=lambda branch: sum(c[1] / clock_hz + c[3] for c in branch))
            elif opcode == "call" or (opcode.endswith("-start") and instruction.cycles is None):
                for callee in callees.get("to_apply", []) + callees.get("calls", []):
                    costs += walk(callee, times)
        return costs

    costs = walk(entry, 1)
    by_op_name = collections.Counter()
    for group, cycles, _, kernel_seconds in costs:
        by_op_name[group] += cycles / clock_hz + kernel_seconds
    cycles = sum(c[1] for c in costs)
    kernel_seconds = sum(c[3] for c in costs)
    coverage = {
        "instructions_estimated": sum(c[2] for c in costs if c[3] == 0.0),
        "pallas_kernels_from_cost_estimate": sum(c[2] for c in costs if c[3] > 0.0),
        "without_estimate": dict(without_estimate.most_common()),
        "collective_bytes": dict(collective_bytes.most_common()),
        "unknown_trip_counts": unknown_trip_counts,
        "trip_counts_from_condition": trip_counts_from_condition,
    }
    return StepEstimate(cycles / clock_hz + kernel_seconds, cycles, kernel_seconds,
                        dict(by_op_name.most_common()), coverage)


def _trip_count_from_condition(condition: list[_Instruction]) -> int | None:
    """N for a loop condition `counter < N` with N a constant of the condition computation, else None."""
    constants = {i.name: int(m[1]) for i in condition
                 if i.opcode == "constant" and (m := re.search(r"constant\((-?\d+)\)", i.line))}
    for instruction in condition:
        if instruction.opcode == "compare" and "direction=LT" in instruction.line:
            operands = re.findall(r"%([^\s,()]+)", instruction.line.split("compare(", 1)[1].split(")", 1)[0])
            if len(operands) == 2 and operands[1] in constants:
                return constants[operands[1]]
    return None
