"""A compiled XLA:GPU program's time on one card, priced kernel by kernel from its optimized HLO text.

XLA:GPU's compiled text carries no time estimate (and deviceless, `cost_analysis()` is None), so each kernel the
program launches is priced here, in schedule order, on a `gpus.Card`:
- A matmul (a cuBLAS/cuBLASLt custom call, or a fusion whose computation holds a `dot`: XLA's Triton gemm
  fusions) at its FLOPs (2 x result elements x contracted size) over the card's peak times the efficiency of its
  shape class (`MATMUL_EFFICIENCY`, by the smallest of M, N and K), or its bytes over HBM bandwidth if that is
  longer.
- Every other kernel (fusions, copies, other custom calls such as cuDNN's) at its bytes moved (operands + results
  by their HLO shapes; an operand the fusion only slices counts its slices, an in-place dynamic-update-slice its
  update, a buffer passed to a custom call more than once its bytes once) over HBM bandwidth at `HBM_EFFICIENCY`.
- Each launch adds `LAUNCH_SECONDS` (the start, the tail, the gap to the next kernel on the stream).
- A while loop counts its body `known_trip_count` times (or N for `counter < N`, as in estimate.py); a
  conditional its costliest branch.
- Collectives over NVLink at a ring's traffic (estimate.collective_seconds: all-reduce 2(n-1)/n x bytes...) over
  the card's one-way NVLink bandwidth; an async pair (`*-start` ... `*-done`) counts only what exceeds the
  kernels scheduled between them (XLA:GPU runs them on their own stream), a synchronous one all of it.
The constants are calibrated on the real H200 profile of the BERT-base step (../shared/gpu beside the project, a
program without bertjax's Pallas GPU kernels; the numbers: docs/performance-history.md, "The GPU step, priced"): an
*estimate*, never a measurement.
"""
from __future__ import annotations

import collections
import re

from bertjax.cloud.estimate import (_ARRAY, _COLLECTIVES, _CUSTOM_TARGET, _FREE, _NUM_PARTITIONS, Collective,
                                    StepEstimate, _group_size, _Instruction, _moved_bytes, _moved_type,
                                    _trip_count_from_condition, _tuple_elements, array_bytes, collective_seconds,
                                    op_name_group, parse_hlo)

# Share of the card's dense bf16 peak a matmul reaches, by the smallest of its M, N and K. Calibrated on the H200
# profile of the BERT-base step: its projections and weight gradients (M, N, K >= 768; cuBLAS and Triton
# together) ran 17.5 TFLOP in 22.3 ms, 79% of peak; attention's batched matmuls (a 64-wide side) 84-125 TFLOP/s,
# ~10%. The middle class (128-511) has no calibration point: 50% is assumed. The class, not the kernel XLA named,
# sets the rate: a deviceless compile cannot autotune, so it names Triton where the real card picks cuBLAS.
MATMUL_EFFICIENCY = ((512, 0.78), (128, 0.50), (0, 0.10))
# Of the datasheet bandwidth, for memory-bound kernels: the median of the H200 profile's named fusions (~3.1 TB/s
# of 4.8; transposes and LayerNorm reductions ~2.3-3.5, elementwise up to 4.5).
HBM_EFFICIENCY = 0.65
# Per kernel launch: a small kernel's floor (2.1 us for 6 KB on the H200) plus the gap to the next one on the
# stream (63 ms a step against 61 ms of kernels over ~1,470 launches: ~1.4 us).
LAUNCH_SECONDS = 3.0e-6
TOP_NON_MATMUL = 15   # the memory-bound kernels reported by bytes moved
_MATMUL_TARGETS = ("__cublas$gemm", "__cublas$lt$matmul", "__cublas$lt$matmul$fp8")
_CONTRACTING = re.compile(r'lhs_contracting_dim(?:ension)?s["=:]*\{?\[?([\d",\s]*)')
_SLICING = ("slice", "dynamic-slice", "gather")


# Our Pallas attention kernels (Triton: no cost estimate in the custom call) declare the query-key pairs they compute
# in their names; their matmuls are priced from it: the forward's two (Q K^T, P V), the backward's seven (its key
# loop recomputes S, dP and takes dV, dK; its query loop S, dP and dQ), 2 x head_dim FLOPs per pair each, at
# FLASH_EFFICIENCY of the peak. An assumption, not a calibration: FlashAttention-2 reaches 35-50% of an H100's
# peak at head size 64; these kernels were never tuned on a GPU.
_DECLARED_PAIRS = re.compile(r"flash_dropout_gpu_(fwd|bwd)_p(\d+)")
_PAIR_MATMULS = {"fwd": 2, "bwd": 7}
FLASH_EFFICIENCY = 0.35


def matmul_efficiency(smallest_dimension: int) -> float:
    return next(share for bound, share in MATMUL_EFFICIENCY if smallest_dimension >= bound)


def price_program(hlo_text: str, *, peak_flops: float, hbm_bytes_per_second: float,
                  link_bytes_per_second: float | None) -> StepEstimate:
    """The program's priced seconds per run on one card (see the module docstring); `link_bytes_per_second`:
    what one card sends over NVLink per second (None: collectives listed, not priced)."""
    computations, entry = parse_hlo(hlo_text)
    partitions = _NUM_PARTITIONS.search(hlo_text[:20000])
    num_partitions = int(partitions[1]) if partitions else 1
    by_op_name, kinds = collections.Counter(), collections.Counter()
    matmul_flops, collectives, unknown_trip_counts = [0], [], []
    # Per category: seconds of launches (each kernel's LAUNCH_SECONDS apart), and the memory-bound kernels' bytes
    # by (kernel name, op_name group): what "fewer passes over memory" is measured by.
    category_seconds = collections.Counter()
    non_matmul = collections.Counter()

    def kernel_seconds(instruction: _Instruction, types: dict, times: int) -> float:
        """Of `times` launches."""
        seconds, flops = price_kernel(instruction, types, computations, peak_flops=peak_flops,
                                      hbm_bytes_per_second=hbm_bytes_per_second)
        matmul_flops[0] += flops * times
        kinds["matmul" if flops else "memory-bound"] += times
        category_seconds["matmul" if flops else "memory-bound"] += (seconds - LAUNCH_SECONDS) * times
        category_seconds["launches"] += LAUNCH_SECONDS * times
        if not flops:
            moved = _bytes_moved(instruction, types, computations) * times
            non_matmul[(re.sub(r"\.\d+$", "", instruction.name), op_name_group(instruction.op_name))] += moved
        return seconds * times

    def walk(name: str, times: int) -> tuple[float, float]:
        """(kernel seconds, exposed communication seconds) of `times` runs of computation `name`."""
        instructions = computations.get(name, [])
        types = {i.name: i.result_type for i in instructions}
        compute = exposed = 0.0
        open_pairs = {}    # start name -> [Collective, kernel seconds since]
        for instruction in instructions:
            opcode, seconds = instruction.opcode, 0.0
            if opcode.removesuffix("-start") in _COLLECTIVES:
                collective = _collective(instruction, num_partitions, link_bytes_per_second, times)
                collectives.append(collective)
                if opcode.endswith("-start") and not _is_sync(instruction):
                    open_pairs[instruction.name] = [collective, 0.0]
                else:
                    exposed += collective.seconds * times
                    by_op_name[f"communication: {collective.kind} {collective.dtypes}"] += collective.seconds * times
                continue
            if opcode.endswith("-done") and instruction.operands and instruction.operands[0] in open_pairs:
                collective, hidden_by = open_pairs.pop(instruction.operands[0])
                collective.exposed_seconds = max(0.0, collective.seconds - hidden_by)
                exposed += collective.exposed_seconds * times
                by_op_name[f"communication: {collective.kind} {collective.dtypes}"] += \
                    collective.exposed_seconds * times
                continue
            if opcode == "while":
                trips = instruction.trip_count or _trip_count_from_condition(
                    computations.get(instruction.callees.get("condition", [""])[0], []))
                if trips is None:
                    unknown_trip_counts.append(instruction.op_name or "while")
                for body in instruction.callees.get("body", []):
                    body_compute, body_exposed = walk(body, times * (trips or 1))
                    seconds, exposed = body_compute, exposed + body_exposed
            elif opcode == "conditional":
                branches = instruction.callees.get("branches") or (
                    instruction.callees.get("true_computation", []) + instruction.callees.get("false_computation", []))
                priced = [walk(branch, times) for branch in branches]
                if priced:
                    branch_compute, branch_exposed = max(priced, key=sum)
                    seconds, exposed = branch_compute, exposed + branch_exposed
            elif opcode == "call":
                for callee in instruction.callees.get("to_apply", []) + instruction.callees.get("calls", []):
                    called_compute, called_exposed = walk(callee, times)
                    seconds, exposed = seconds + called_compute, exposed + called_exposed
            elif opcode not in _FREE and opcode != "bitcast" and not opcode.endswith("-done"):   # a kernel
                seconds = kernel_seconds(instruction, types, times)
                by_op_name[op_name_group(instruction.op_name)] += seconds
            compute += seconds
            for pair in open_pairs.values():
                pair[1] += seconds / times
        for collective, _ in open_pairs.values():   # a start without its done here: nothing hides it
            exposed += collective.seconds * times
        return compute, exposed

    compute, exposed = walk(entry, 1)
    return StepEstimate(
        compute + exposed, 0, compute, dict(by_op_name.most_common()),
        {"kernels": dict(kinds), "matmul_flops": matmul_flops[0], "unknown_trip_counts": unknown_trip_counts,
         "collectives_priced": link_bytes_per_second is not None,
         "matmul_seconds": category_seconds["matmul"], "non_matmul_seconds": category_seconds["memory-bound"],
         "launch_seconds": category_seconds["launches"], "non_matmul_bytes": sum(non_matmul.values()),
         "top_non_matmul": [{"kernel": kernel, "op_name": op_name, "bytes": moved}
                            for (kernel, op_name), moved in non_matmul.most_common(TOP_NON_MATMUL)]},
        compute_seconds=compute, communication_seconds=sum(c.seconds * c.times for c in collectives),
        exposed_communication_seconds=exposed, collectives=collectives)


def price_kernel(instruction: _Instruction, types: dict, computations: dict, *, peak_flops: float,
                 hbm_bytes_per_second: float) -> tuple[float, int]:
    """(seconds, matmul FLOPs) of one kernel launch; `types`: the result types of its computation's
    instructions (what its operands are)."""
    moved = _bytes_moved(instruction, types, computations) / (hbm_bytes_per_second * HBM_EFFICIENCY)
    declared = _DECLARED_PAIRS.search(instruction.op_name) if instruction.opcode == "custom-call" else None
    if declared:
        head_dim = _head_dim(_operand_type(_operand_names(instruction)[1], types))
        flops = _PAIR_MATMULS[declared[1]] * 2 * head_dim * int(declared[2])
        return max(flops / (peak_flops * FLASH_EFFICIENCY), moved) + LAUNCH_SECONDS, flops
    flops, smallest = _matmul(instruction, types, computations)
    if flops:
        return max(flops / (peak_flops * matmul_efficiency(smallest)), moved) + LAUNCH_SECONDS, flops
    return moved + LAUNCH_SECONDS, 0


def _head_dim(array_type: str) -> int:
    """The last dimension of an HLO array type (q's head_dim in [B, S, H, D])."""
    dims = _ARRAY.findall(array_type)
    return int(dims[0][1].split(",")[-1]) if dims and dims[0][1] else 0


def _is_sync(instruction: _Instruction) -> bool:
    return '"is_sync":true' in instruction.line


def _collective(instruction: _Instruction, num_partitions: int, link_bytes_per_second: float | None,
                times: int) -> Collective:
    kind = instruction.opcode.removesuffix("-start")
    group = _group_size(instruction.line, num_partitions)
    size = _moved_bytes(kind, instruction.opcode, instruction.result_type, group)
    seconds = 0.0 if link_bytes_per_second is None else collective_seconds(kind, size, group, link_bytes_per_second)
    dtypes = "+".join(sorted({d for d, _ in _ARRAY.findall(_moved_type(instruction.opcode,
                                                                        instruction.result_type))})) or "?"
    return Collective(kind, dtypes, size, group, None, seconds, seconds, instruction.opcode.endswith("-start"),
                      times, instruction.op_name)


def _operand_type(operand: str, types: dict) -> str:
    """The type an operand reads: `%x` or an element `%x#1` of a multi-output instruction."""
    name, _, index = operand.partition("#")
    result_type = types.get(name, "")
    if index and result_type.startswith("("):
        elements = _tuple_elements(result_type)
        return elements[int(index)] if int(index) < len(elements) else ""
    return result_type


def _operand_names(instruction: _Instruction) -> list[str]:
    """The operands as written, `#N` element suffixes kept (estimate._operands drops them)."""
    text = instruction.line.split(f" {instruction.opcode}(", 1)[-1]
    depth, end = 1, len(text)
    for i, char in enumerate(text):
        depth += (char == "(") - (char == ")")
        if depth == 0:
            end = i
            break
    return re.findall(r"%([\w.\-]+(?:#\d+)?)", text[:end])


def _written_type(instruction: _Instruction) -> str:
    """What a kernel writes: its result, less a custom call's scratch (cuBLAS returns (result, workspace))."""
    if instruction.opcode == "custom-call" and instruction.result_type.startswith("("):
        return _tuple_elements(instruction.result_type)[0]
    return instruction.result_type


def _written_bytes(instruction: _Instruction) -> int:
    """Bytes a kernel writes: every result of a custom call but its s8/u8 scratch (a Pallas kernel's dk, dv and
    lse count beside its first result; cuBLAS's and cuDNN's workspace does not)."""
    if instruction.opcode == "custom-call" and instruction.result_type.startswith("("):
        return sum(array_bytes(element) for element in _tuple_elements(instruction.result_type)
                   if not re.match(r"[su]8\[", element))
    return array_bytes(instruction.result_type)


def _bytes_moved(instruction: _Instruction, types: dict, computations: dict) -> int:
    """Operands read + results written, by their shapes; a fused operand only sliced counts its slices' bytes, an
    in-place dynamic-update-slice root its update's; a buffer a custom call takes more than once counts once (the
    GPU attention's q/k/v stacked in one array, passed as three operands each read in its own third)."""
    operands = _operand_names(instruction)
    fused = next(iter(instruction.callees.get("calls", [])), None)
    body = computations.get(fused, []) if instruction.opcode == "fusion" else []
    parameters = {}
    for inner in body:
        if inner.opcode == "parameter" and (number := re.search(r"parameter\((\d+)\)", inner.line)):
            parameters[int(number[1])] = inner.name
    users = collections.defaultdict(list)
    for inner in body:
        for operand in inner.operands:
            users[operand].append(inner)
    written = _written_bytes(instruction)
    updated_in_place = set()
    root = next((i for i in body if i.line.lstrip().startswith("ROOT")), None)
    if root is not None and root.opcode == "dynamic-update-slice" and len(root.operands) >= 2:
        updated_in_place.add(root.operands[0])
        written = array_bytes(next((i.result_type for i in body if i.name == root.operands[1]), ""))
    read, seen = 0, set()
    for index, operand in enumerate(operands):
        parameter = parameters.get(index)
        if parameter in updated_in_place or (not body and operand in seen):
            continue
        seen.add(operand)
        uses = users.get(parameter, [])
        if uses and all(u.opcode in _SLICING and u.operands and u.operands[0] == parameter for u in uses):
            read += sum(array_bytes(u.result_type) for u in uses)
        else:
            read += array_bytes(_operand_type(operand, types))
    return read + written


def _matmul(instruction: _Instruction, types: dict, computations: dict) -> tuple[int, int]:
    """(FLOPs, the smallest of M, N, K) of a matmul kernel; (0, 0) for anything else."""
    if instruction.opcode == "custom-call":
        target = _CUSTOM_TARGET.search(instruction.line)
        if not target or target[1] not in _MATMUL_TARGETS:
            return 0, 0
        lhs = _operand_type(_operand_names(instruction)[0], types)
        return _dot_flops(_written_type(instruction), lhs, instruction.line)
    if instruction.opcode != "fusion":
        return 0, 0
    flops, smallest = 0, 0
    for callee in instruction.callees.get("calls", []):
        body = computations.get(callee, [])
        body_types = {i.name: i.result_type for i in body}
        for inner in body:
            if inner.opcode == "dot" and inner.operands:
                f, s = _dot_flops(inner.result_type, body_types.get(inner.operands[0], ""), inner.line)
                flops, smallest = flops + f, max(smallest, s)
            elif inner.opcode == "fusion":   # Triton's nested gemm fusions hold the dot one level down
                f, s = _matmul(inner, body_types, computations)
                flops, smallest = flops + f, max(smallest, s)
    return flops, smallest


def _dims(array_type: str) -> list[int]:
    match = _ARRAY.search(array_type)
    return [int(d) for d in match[2].split(",") if d] if match else []


def _dot_flops(result_type: str, lhs_type: str, line: str) -> tuple[int, int]:
    contracting = _CONTRACTING.search(line)
    lhs = _dims(lhs_type)
    axes = [int(a) for a in re.findall(r"\d+", contracting[1])] if contracting else []
    k = 1
    for axis in axes:
        k *= lhs[axis] if axis < len(lhs) else 1
    out = _dims(result_type)
    elements = 1
    for d in out:
        elements *= d
    # M and N: the result's last two dimensions (batch dimensions lead).
    mn = out[-2:] if len(out) >= 2 else out + [1]
    return 2 * elements * k, min(mn + [k])
