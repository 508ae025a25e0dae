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
  custom calls (index hints) are counted as without estimate.
- Collectives (all-reduce, all-gather, reduce-scatter, all-to-all, collective-permute) carry no estimate either;
  they are priced here (`Interconnect`): each one's bytes per chip over the ring bandwidth of the links its
  algorithm uses (the "colors" of the `collective_algorithm_config` XLA:TPU chose, one ring per color; all the
  chip's ports where it names none), with a ring's traffic (all-reduce 2(n-1)/n x bytes, all-gather and
  all-to-all (n-1)/n x the result, reduce-scatter (n-1)/n x the operand, for a group of n chips; a
  collective-permute its result over one link). Only what the
  schedule does not hide counts in the step: a synchronous collective all of it, an async pair (`*-start` ...
  `*-done`) what exceeds the estimated compute scheduled between its start and its done. The bandwidth term only:
  a collective's start-up latency (microseconds) is not counted.
- The instructions that carry no estimate and are not priced here (async copies and slices between memory spaces,
  XLA:TPU's ConcatBitcast custom calls, index hints, a kernel without a CostEstimate) count nothing in `seconds`,
  the low end. The high end (`high_seconds`) charges each of them its bytes, operands read plus result written (an
  async start's result less the operands it aliases; a slice reads only its part), at the chip's HBM bandwidth, one
  after another, whichever memory they are in: more than they could add where the schedule hides them or they stay
  in VMEM. `unpriced` says what they are, how many, and their bytes.
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
_COLORS = re.compile(r"colors:(\d+)")
_NUM_PARTITIONS = re.compile(r"\bnum_partitions=(\d+)")
_GROUPS_LIST = re.compile(r"replica_groups=\{\{([\d,]*)\}")
_GROUPS_IOTA = re.compile(r"replica_groups=\[(\d+),(\d+)\]")
_GROUPS_MESH = re.compile(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}")
# Instructions that do no work of their own (or whose work is their callees').
_FREE = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "while", "conditional", "call",
         "after-all", "partition-id", "replica-id", "opt-barrier", "copy-done", "slice-done", "async-done"}
PALLAS_TARGET = "tpu_custom_call"
_SLICES = ("slice", "dynamic-slice", "slice-start")   # they read only the part they write


@dataclasses.dataclass(frozen=True)
class Interconnect:
    """A TPU generation's chip-to-chip links (ICI), as Google's tables give them (see topologies.GENERATIONS)."""

    link_bytes_per_second: float   # one link, one direction
    ports: int                     # links per chip

    def ring_bytes_per_second(self, colors: int | None) -> float:
        """What one chip sends per second in a collective of `colors` rings (each uses one outgoing link);
        all its ports where the algorithm is not named."""
        return self.link_bytes_per_second * min(colors or self.ports, self.ports)


@dataclasses.dataclass
class Collective:
    """One collective as the program runs it (`times` runs per step), and its price on the interconnect."""

    kind: str                      # all-reduce, all-gather, reduce-scatter, all-to-all, collective-permute
    dtypes: str                    # the element types it moves, e.g. "bf16" or "bf16+f32"
    bytes: int                     # per chip: the result (the operand for a reduce-scatter), per run
    group_size: int
    colors: int | None             # rings of XLA:TPU's algorithm, where the HLO names them
    seconds: float                 # per run, on the ring bandwidth
    exposed_seconds: float         # per run: what the schedule does not hide
    is_async: bool
    times: int
    op_name: str


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
    operands: tuple = ()


@dataclasses.dataclass
class StepEstimate:
    """The estimated time of one run of a program on one chip, and where it goes."""

    seconds: float                       # compute + the communication the schedule does not hide
    cycles: int                          # the sum of XLA's estimates (each times its loop trip count)
    kernel_seconds: float                # the Pallas kernels' share of `seconds` (from their CostEstimate)
    by_op_name: dict[str, float]         # op_name group (layer numbers merged) -> seconds, largest first;
                                         # exposed communication as "communication: <kind> <dtypes>" rows
    coverage: dict                       # what was estimated how, and what had no estimate
    compute_seconds: float = 0.0         # estimated cycles / clock + the kernels' rooflines
    communication_seconds: float = 0.0   # every collective at the ring bandwidth, hidden or not
    exposed_communication_seconds: float = 0.0
    collectives: list = dataclasses.field(default_factory=list)   # [Collective], in program order
    # The instructions left without a price, by kind: {kind: {"count", "bytes", "seconds"}} per step, the seconds
    # their bytes at HBM bandwidth (the high end's addition; see the module docstring). Empty where all are priced.
    unpriced: dict = dataclasses.field(default_factory=dict)

    @property
    def unpriced_seconds(self) -> float:
        return sum(entry["seconds"] for entry in self.unpriced.values())

    @property
    def high_seconds(self) -> float:
        """The step with every unpriced instruction charged its bytes at HBM bandwidth: the estimate's high end."""
        return self.seconds + self.unpriced_seconds

    def collectives_by_kind(self) -> dict:
        """{kind: count, bytes per step (by dtype), seconds and exposed seconds per step}, per chip."""
        out = {}
        for c in self.collectives:
            entry = out.setdefault(c.kind, {"count": 0, "bytes": 0, "bytes_by_dtype": {}, "seconds": 0.0,
                                            "exposed_seconds": 0.0, "async": 0})
            entry["count"] += c.times
            entry["bytes"] += c.bytes * c.times
            entry["bytes_by_dtype"][c.dtypes] = entry["bytes_by_dtype"].get(c.dtypes, 0) + c.bytes * c.times
            entry["seconds"] += c.seconds * c.times
            entry["exposed_seconds"] += c.exposed_seconds * c.times
            entry["async"] += c.times if c.is_async else 0
        return out


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


def _operands(rest: str, opcode: str) -> tuple:
    """The names an instruction reads: the `%name`s inside the parentheses after its opcode."""
    start = rest.find(opcode + "(")
    if start < 0:
        return ()
    depth, begin = 0, start + len(opcode)
    for i in range(begin, len(rest)):
        depth += (rest[i] == "(") - (rest[i] == ")")
        if depth == 0:
            return tuple(re.findall(r"%([\w.\-]+)", rest[begin:i]))
    return ()


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
                                    int(trips[1]) if trips else None, line, _operands(rest, opcode)))
    if entry is None:
        raise ValueError("no ENTRY computation in the HLO text")
    return computations, entry


def collective_seconds(kind: str, size: int, group_size: int, bytes_per_second: float) -> float:
    """A ring collective's time on one chip: `size` is the result's bytes (the operand's for a reduce-scatter)."""
    if group_size <= 1 or size == 0:
        return 0.0
    share = (group_size - 1) / group_size
    traffic = {"all-reduce": 2 * share * size, "all-gather": share * size, "reduce-scatter": share * size,
               "all-to-all": share * size}.get(kind, size)  # collective-permute: the whole result once
    return traffic / bytes_per_second


def _group_size(line: str, num_partitions: int) -> int:
    """The chips in each replica group of a collective (every partition where the groups are empty)."""
    if match := _GROUPS_MESH.search(line):
        sizes = dict((name.strip("'"), int(size)) for name, size in
                     (item.split("=") for item in match[1].split(",")))
        count = 1
        for axis in match[2].split(","):
            count *= sizes.get(axis.strip().strip("'"), 1)
        return count
    if match := _GROUPS_IOTA.search(line):
        return int(match[2])
    if (match := _GROUPS_LIST.search(line)) and match[1]:
        return len(match[1].split(","))
    return num_partitions


def _dtypes(result_type: str) -> str:
    return "+".join(sorted(set(dtype for dtype, _ in _ARRAY.findall(result_type)))) or "?"


def estimate_program(hlo_text: str, *, clock_hz: float, peak_flops: float, hbm_bytes_per_second: float,
                     interconnect: Interconnect | None = None) -> StepEstimate:
    """The program's estimated seconds per run on one chip of a generation with this clock, bf16 peak, HBM
    bandwidth and interconnect (None: collectives listed but not priced); see the module docstring."""
    computations, entry = parse_hlo(hlo_text)
    partitions = _NUM_PARTITIONS.search(hlo_text[:20000])
    num_partitions = int(partitions[1]) if partitions else 1
    without_estimate, unknown_trip_counts, trip_counts_from_condition = collections.Counter(), [], []
    # Bytes and counts of the instructions without a price, per kind: one table per conditional branch walked (only
    # the branch the estimate takes joins its caller's).
    unpriced_tables = [collections.defaultdict(lambda: [0, 0])]

    def charge(kind: str, instruction: _Instruction, by_name: dict, times: int) -> None:
        entry = unpriced_tables[-1][kind]
        entry[0] += times
        entry[1] += times * unpriced_bytes(instruction, by_name)
    collective_bytes, collectives = collections.Counter(), []

    def price(instruction: _Instruction, inner: _Instruction, times: int) -> Collective:
        """`inner`: the collective itself (the instruction, or the one inside its fusion or async wrapper)."""
        kind = inner.opcode.removesuffix("-start")
        group = _group_size(inner.line, num_partitions)
        size = _moved_bytes(kind, inner.opcode, inner.result_type, group)
        colors = _COLORS.search(instruction.line) or _COLORS.search(inner.line)
        colors = int(colors[1]) if colors else None
        # A collective-permute sends to one neighbour: one link (XLA:TPU's decomposed gathers run two at once, in
        # opposite directions, each on its own link).
        bandwidth = None if interconnect is None else (
            interconnect.link_bytes_per_second if kind == "collective-permute"
            else interconnect.ring_bytes_per_second(colors))
        seconds = 0.0 if interconnect is None else collective_seconds(kind, size, group, bandwidth)
        collective_bytes[kind] += size * times
        collective = Collective(kind, _dtypes(_moved_type(inner.opcode, inner.result_type)), size, group,
                                colors, seconds, seconds, _is_async_start(instruction), times,
                                instruction.op_name or inner.op_name)
        collectives.append(collective)
        return collective

    def walk(name: str, times: int) -> list[tuple[str, float, int, float]]:
        """(op_name group, cycles, count, seconds beyond the cycles) of each instruction that costs, `times` runs
        each: kernels' rooflines and exposed communication are in the seconds."""
        costs, open_pairs = [], {}
        by_name = {i.name: i for i in computations.get(name, [])}
        for instruction in computations.get(name, []):
            opcode, callees = instruction.opcode, instruction.callees
            own, opened = [], None
            inner = _collective_of(instruction, computations)
            if _is_async_done(instruction):
                started = _started_by(instruction.name, open_pairs, by_name)
                if started is not None:
                    collective, hidden_by = open_pairs.pop(started)
                    collective.exposed_seconds = max(0.0, collective.seconds - hidden_by / times)
                    costs.append((f"communication: {collective.kind} {collective.dtypes} (async, exposed)", 0,
                                  times, collective.exposed_seconds * times))
            elif inner is not None:
                if _is_async_start(instruction):
                    opened = [price(instruction, inner, times), 0.0]
                else:
                    collective = price(instruction, inner, times)
                    costs.append((f"communication: {collective.kind} {collective.dtypes} (synchronous)", 0, times,
                                  collective.seconds * times))
            if instruction.cycles is not None:
                own.append((op_name_group(instruction.op_name), instruction.cycles * times, times, 0.0))
            elif inner is not None or _is_async_done(instruction):
                pass
            elif opcode == "custom-call" and PALLAS_TARGET in instruction.line:
                kernel = _KERNEL_COST.search(instruction.line)
                if kernel:
                    flops, _, bytes_accessed = map(int, kernel.groups())
                    seconds = max(flops / peak_flops, bytes_accessed / hbm_bytes_per_second)
                    own.append((op_name_group(instruction.op_name), 0, times, seconds * times))
                else:
                    without_estimate["Pallas kernel without a CostEstimate"] += times
                    charge("Pallas kernel without a CostEstimate", instruction, by_name, times)
            elif opcode not in _FREE and not opcode.endswith("-done"):
                target = _CUSTOM_TARGET.search(instruction.line)
                kind = f"{opcode}:{target[1]}" if target else opcode
                without_estimate[kind] += times
                charge(kind, instruction, by_name, times)
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
                    own += walk(body, times * trips)
                for condition in callees.get("condition", []):
                    own += walk(condition, times * (trips + 1))
            elif opcode == "conditional":
                branches = callees.get("branches") or callees.get("true_computation", []) + callees.get(
                    "false_computation", [])
                walked = []
                for branch in branches:
                    unpriced_tables.append(collections.defaultdict(lambda: [0, 0]))
                    walked.append((walk(branch, times), unpriced_tables.pop()))
                if walked:
                    taken, its_unpriced = max(walked, key=lambda w: sum(c[1] / clock_hz + c[3] for c in w[0]))
                    own += taken
                    for kind, (count, size) in its_unpriced.items():
                        unpriced_tables[-1][kind][0] += count
                        unpriced_tables[-1][kind][1] += size
            elif opcode == "call" or (opcode.endswith("-start") and instruction.cycles is None and inner is None):
                for callee in callees.get("to_apply", []) + callees.get("calls", []):
                    own += walk(callee, times)
            # Compute scheduled while an async collective is in flight hides it.
            busy = sum(c[1] / clock_hz + c[3] for c in own if not c[0].startswith("communication:"))
            for pair in open_pairs.values():
                pair[1] += busy
            if opened is not None:  # hidden by what is scheduled after its start, not by the start itself
                open_pairs[instruction.name] = opened
            costs += own
        for collective, _ in open_pairs.values():   # a start without its done here: nothing hides it
            costs.append((f"communication: {collective.kind} {collective.dtypes} (async, exposed)", 0,
                          collective.times, collective.seconds * collective.times))
        return costs

    costs = walk(entry, 1)
    by_op_name = collections.Counter()
    for group, cycles, _, extra_seconds in costs:
        by_op_name[group] += cycles / clock_hz + extra_seconds
    cycles = sum(c[1] for c in costs)
    communication = [c for c in costs if c[0].startswith("communication:")]
    exposed = sum(c[3] for c in communication)
    kernel_seconds = sum(c[3] for c in costs if not c[0].startswith("communication:"))
    compute = cycles / clock_hz + kernel_seconds
    coverage = {
        "instructions_estimated": sum(c[2] for c in costs if c[3] == 0.0 and c[1]),
        "pallas_kernels_from_cost_estimate": sum(c[2] for c in costs if c[3] > 0.0 and c not in communication),
        "without_estimate": dict(without_estimate.most_common()),
        "collective_bytes": dict(collective_bytes.most_common()),
        "collectives_priced": interconnect is not None,
        "unknown_trip_counts": unknown_trip_counts,
        "trip_counts_from_condition": trip_counts_from_condition,
    }
    unpriced = {kind: {"count": count, "bytes": size, "seconds": size / hbm_bytes_per_second}
                for kind, (count, size) in sorted(unpriced_tables[0].items(), key=lambda item: -item[1][1])}
    return StepEstimate(compute + exposed, cycles, kernel_seconds, dict(by_op_name.most_common()), coverage,
                        compute_seconds=compute,
                        communication_seconds=sum(c.seconds * c.times for c in collectives),
                        exposed_communication_seconds=exposed, collectives=collectives, unpriced=unpriced)


def unpriced_bytes(instruction: _Instruction, by_name: dict) -> int:
    """What an instruction without a price moves: its operands' bytes and its result's, where an async start's
    result (a tuple holding the operands it aliases, the output and a context) counts less those operands, and a
    slice reads only what it writes."""
    read = sum(array_bytes(by_name[name].result_type) for name in instruction.operands if name in by_name)
    written = array_bytes(instruction.result_type)
    if instruction.opcode.endswith("-start") and instruction.result_type.startswith("("):
        written = max(written - read, 0)
    if instruction.opcode in _SLICES:
        read = written
    return read + written


def _collective_of(instruction: _Instruction, computations: dict) -> _Instruction | None:
    """The collective an instruction runs: itself (sync or `-start`), or the one inside the computation it wraps
    (an `async-start`, or XLA:TPU's async collective fusions); None for anything else (a `-done` included)."""
    opcode = instruction.opcode
    if opcode.removesuffix("-start") in _COLLECTIVES and not opcode.endswith("-done"):
        return instruction
    if opcode in ("async-start", "fusion") and not _is_async_done(instruction) \
            and not _is_continuation(instruction):
        for callee in instruction.callees.get("calls", []):
            for inner in computations.get(callee, []):
                if inner.opcode in _COLLECTIVES:
                    return inner
    return None


def _is_async_start(instruction: _Instruction) -> bool:
    return instruction.opcode.endswith("-start") or instruction.name.startswith("async-collective-start")


def _is_async_done(instruction: _Instruction) -> bool:
    return instruction.opcode.endswith("-done") or instruction.name.startswith("async-collective-done")


def _is_continuation(instruction: _Instruction) -> bool:
    """XLA:TPU's fusions that carry an async collective's state between its start and done (with compute)."""
    return any(c.startswith("async_collective_fusion") for c in instruction.callees.get("calls", []))


def _started_by(name: str, open_pairs: dict, by_name: dict, depth: int = 0) -> str | None:
    """The open start a done (or what it reads) descends from, through tuple elements and continuations."""
    if name in open_pairs:
        return name
    instruction = by_name.get(name)
    if instruction is None or depth > 64:
        return None
    if depth and not (instruction.opcode == "get-tuple-element" or _is_continuation(instruction)):
        return None
    for operand in instruction.operands:
        if (found := _started_by(operand, open_pairs, by_name, depth + 1)) is not None:
            return found
    return None


def _moved_type(opcode: str, result_type: str) -> str:
    """The result part of a collective's shape (an async start's shape also holds its operands and context)."""
    if opcode.endswith("-start") and opcode != "all-reduce-start" and result_type.startswith("("):
        return _tuple_elements(result_type)[1]
    return result_type


def _moved_bytes(kind: str, opcode: str, result_type: str, group_size: int) -> int:
    """Per chip: a collective's result bytes (its operand's for a reduce-scatter). An async start's shape is a
    tuple (operands, results, context...), except all-reduce-start's, which is its results'."""
    if opcode.endswith("-start") and opcode != "all-reduce-start" and result_type.startswith("("):
        operands, results = _tuple_elements(result_type)[:2]
        return array_bytes(operands if kind == "reduce-scatter" else results)
    size = array_bytes(result_type)
    return size * group_size if kind == "reduce-scatter" else size


def _tuple_elements(type_text: str) -> list[str]:
    """The top-level element types of a tuple type `(a, (b, c), d)`."""
    inner, elements, depth, start = re.sub(r"/\*.*?\*/", "", type_text[1:-1]), [], 0, 0
    for i, char in enumerate(inner):
        depth += (char in "([{") - (char in ")]}")
        if char == "," and depth == 0:
            elements.append(inner[start:i].strip())
            start = i + 1
    elements.append(inner[start:].strip())
    return [e for e in elements if e] or [type_text]


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
