"""Ahead-of-time compile of the pretraining step for a TPU slice or a GPU host, on any machine: does it fit, what
will it cost.

The function the job runs (`pretraining.job.build_job_step`, the builder the pretraining loop trains with: the
job's model, optimizer, mesh, logical-axis rules and shardings) is lowered for the slice's compile-only devices
(libtpu through jax.experimental.topologies) and compiled by XLA:TPU (`pretraining.job.compile_step`), or for a
GPU host's (`gpus.py`: deviceless XLA:GPU from the card's target config). Its memory analysis (per chip) says
whether it fits HBM, its cost analysis (per chip; none on GPU) counts the FLOPs XLA will run, and the step time
and estimated MFU come from the compiled program: XLA:TPU's own cycle estimates (`estimate.py`), or on GPU each
kernel priced on the card (`gpu_estimate.py`); the hours and chip-hours (GPU-hours) follow (or from an MFU the
user assumes with --mfu), each a range: the low end the estimate, the high end with every instruction the estimate
leaves unpriced charged its bytes at HBM bandwidth (`StepEstimate.high_seconds`; on GPU every kernel is priced, so
the two are one). A program larger than HBM fails to compile (RESOURCE_EXHAUSTED); that is reported as
not fitting, with the size. On a GPU host it also says when the program runs bertjax's Pallas kernels that have
not passed their check on that card (`model/gpu_kernel_check.py`), and how to check them.
"""
from __future__ import annotations

import dataclasses
import math
import re
import time

from bertjax.cloud import gpus
from bertjax.cloud.estimate import Interconnect, StepEstimate, estimate_program
from bertjax.cloud.gpu_estimate import price_program
from bertjax.cloud.topologies import ACCEPTED as TPU_ACCEPTED
from bertjax.cloud.topologies import GENERATIONS, Topology, parse_topology
from bertjax.cloud.topologies import compile_only_devices as tpu_devices
from bertjax.runtime.console import duration
from bertjax.data.tokenizers import load_tokenizer
from bertjax.model import shapes
from bertjax.runtime.outputs import replaced_when_whole
from bertjax.pretraining import metrics
from bertjax.pretraining.config import PretrainConfig, validate
from bertjax.pretraining.job import CompiledStep, compile_step

# BERT's uncased WordPiece vocabulary: the vocab size assumed when the config names neither a size nor a vocab.
DEFAULT_VOCAB_SIZE = 30522


def parse_target(name: str, num_slices: int = 1) -> Topology:
    """A TPU slice (`v5p-128`, `v5e:4x4`) or a GPU host (`h200`, `h100x8`) by name. A name of neither is an error
    that gives the forms of both (`8xh100`: the host's own spelling, h100x8)."""
    if not isinstance(name, str):
        return parse_topology(name, num_slices)  # its own error
    if gpus.is_gpu_topology(name):
        return gpus.parse_gpu_host(name, num_slices)
    text = name.strip().lower()
    if (swapped := re.fullmatch(r"(\d+)\s*x\s*([a-z]\d{3})", text)) and swapped[2] in gpus.CARDS:
        raise ValueError(f"unknown target {name!r}: {swapped[1]} {swapped[2]} cards on one host are written "
                         f"{swapped[2]}x{swapped[1]}; {gpus.ACCEPTED}")
    if not re.match(r"v\d", text):  # every TPU generation's name is v<digit>...
        raise ValueError(f"unknown target {name!r}: a TPU slice ({TPU_ACCEPTED}) or a GPU host ({gpus.ACCEPTED})")
    return parse_topology(name, num_slices)


def is_gpu(topology: Topology) -> bool:
    return topology.generation in gpus.CARDS


def compile_only_devices(topology: Topology) -> list:
    return gpus.compile_only_devices(topology) if is_gpu(topology) else tpu_devices(topology)


def estimate_step(topology: Topology, hlo_text: str) -> StepEstimate:
    """The compiled step's estimated time per chip: XLA:TPU's cycle estimates, or each GPU kernel priced."""
    if is_gpu(topology):
        card = gpus.CARDS[topology.generation]
        return price_program(hlo_text, peak_flops=card.peak_flops, hbm_bytes_per_second=card.hbm_bytes_per_second,
                             link_bytes_per_second=card.nvlink_bytes_per_second)
    generation = GENERATIONS[topology.generation]
    return estimate_program(hlo_text, clock_hz=generation.clock_hz, peak_flops=generation.peak_flops_per_chip,
                            hbm_bytes_per_second=generation.hbm_bytes_per_second,
                            interconnect=Interconnect(generation.ici_link_bytes_per_second, generation.ici_ports))


def job_for_topology(config: PretrainConfig, topology: Topology) -> PretrainConfig:
    """The job's config on `topology`: a multi-slice topology spreads the data axis over its slices."""
    if topology.num_slices > 1 and config.mesh.dcn_data == 1:
        config = dataclasses.replace(config, mesh=dataclasses.replace(config.mesh, dcn_data=topology.num_slices))
    if config.mesh.dcn_data != topology.num_slices:
        raise ValueError(f"mesh.dcn_data={config.mesh.dcn_data} but the topology has {topology.num_slices} slice(s)")
    validate(config, topology.chips, require_data=False)
    return config


def vocab_size_of(config: PretrainConfig) -> int:
    if config.model.vocab_size:
        return config.model.vocab_size
    return len(load_tokenizer(config.data.vocab, config.data.lower_case).vocab) if config.data.vocab else \
        DEFAULT_VOCAB_SIZE


def report(config: PretrainConfig, topology: Topology, mfu: float | None, compiled: CompiledStep,
           vocab_size: int, top: int = 15) -> dict:
    """The fit and cost figures of one compiled configuration (the keys `bertjax compile --json` prints).

    Step time, tokens/s and hours come from the estimate of the compiled step (`estimate_step`) unless `mfu` is
    given, which assumes that MFU instead (`step_time_source` says which). The step priced is the full batch's; a
    batch-size warmup's steps (`batch_warmup`) are counted in the hours at their share of its microbatches.
    """
    chips = topology.chips
    data, fsdp, tensor = config.mesh.shape(chips)
    bert_config = config.bert_config(vocab_size)
    seq_len = config.data.max_seq_length
    model_flops = config.train.batch_size * metrics.train_flops_per_sequence(
        bert_config, seq_len, config.data.max_predictions_per_seq)
    fits = compiled.fits and compiled.hbm_bytes_per_chip <= topology.usable_hbm_bytes_per_chip
    step = None if compiled.hlo_text is None else estimate_step(topology, compiled.hlo_text)
    estimated_mfu = None if step is None else model_flops / (chips * topology.peak_flops_per_chip * step.seconds)
    if mfu is not None:
        step_seconds, source = model_flops / (chips * topology.peak_flops_per_chip * mfu), "assumed"
    else:
        step_seconds, source = (None, "none") if step is None else (step.seconds, "estimated")
    # The range's high end: only where the step time is the estimate's (an assumed MFU is one figure).
    high_seconds = step.high_seconds if source == "estimated" else None
    batches = config.batch_schedule()
    # A warmup step of k of the K microbatches at k / K of the full step's time (its update's fixed cost aside).
    full_steps = batches.full_steps_before(config.train.steps)
    total_hours = None if step_seconds is None else full_steps * step_seconds / 3600
    total_hours_high = None if high_seconds is None else full_steps * high_seconds / 3600
    return {
        "topology": topology.topology, "accelerator_type": topology.accelerator_type,
        "chip": "GPU" if is_gpu(topology) else "chip",
        "num_slices": topology.num_slices, "chips": chips, "hosts": topology.hosts,
        "mesh": {"data": data, "fsdp": fsdp, "tensor": tensor, "dcn_data": config.mesh.dcn_data,
                 "shard_optimizer": compiled.update_sharded},
        "global_batch": config.train.batch_size, "grad_accum_steps": config.train.grad_accum_steps,
        "per_chip_batch": config.train.batch_size // config.train.grad_accum_steps / (data * fsdp),
        "seq_len": seq_len, "vocab_size": vocab_size,
        "fits": fits,
        "hbm_capacity_bytes_per_chip": topology.usable_hbm_bytes_per_chip,
        "hbm_published_bytes_per_chip": topology.hbm_bytes_per_chip,
        "hbm_bytes_per_chip": compiled.hbm_bytes_per_chip,
        "argument_bytes_per_chip": compiled.argument_bytes_per_chip,
        "temp_bytes_per_chip": compiled.temp_bytes_per_chip,
        # XLA's cost analysis counts a loop's body once: the accumulation scan's microbatch is scaled by its trip
        # count (which counts the optimizer update, under 1% of a step, that many times too).
        "xla_flops_per_step": None if compiled.xla_flops_per_chip is None else
        compiled.xla_flops_per_chip * chips * config.train.grad_accum_steps,
        "model_flops_per_step": model_flops,
        "peak_flops_per_chip": topology.peak_flops_per_chip,
        "clock_hz": None if is_gpu(topology) else GENERATIONS[topology.generation].clock_hz,
        "estimated_cycles_per_step": None if step is None else step.cycles,
        "estimated_step_seconds": None if step is None else step.seconds,
        # The high end: every instruction the estimate left unpriced charged its bytes at HBM bandwidth; their
        # share of that step, and what they are ({kind: count, bytes, seconds per step}).
        "estimated_step_seconds_high": None if step is None else step.high_seconds,
        "estimated_unpriced_share": None if step is None or not step.high_seconds else
        step.unpriced_seconds / step.high_seconds,
        "estimated_unpriced": {} if step is None else step.unpriced,
        "estimated_compute_seconds": None if step is None else step.compute_seconds,
        "estimated_communication_seconds": None if step is None else {
            "exposed": step.exposed_communication_seconds, "total": step.communication_seconds},
        "collectives": {} if step is None else step.collectives_by_kind(),
        "estimated_mfu": estimated_mfu,
        "estimate_breakdown": [] if step is None else [
            [name, seconds, seconds / step.seconds] for name, seconds in list(step.by_op_name.items())[:top]],
        "estimate_coverage": {} if step is None else step.coverage if is_gpu(topology) else dict(
            step.coverage, pallas_kernel_seconds=step.kernel_seconds),
        "mfu_assumed": mfu,
        "step_time_source": source,
        "step_seconds": step_seconds,
        "tokens_per_second": None if step_seconds is None else config.train.batch_size * seq_len / step_seconds,
        "step_seconds_high": high_seconds,
        "steps": config.train.steps, "tokens": batches.tokens_before(config.train.steps),
        "batch_warmup": None if not batches.warming else {
            "sizes": [[size * batches.microbatch_rows, steps] for size, steps in batches.warmup],
            "steps": batches.warmup_steps, "tokens": batches.tokens_before(batches.warmup_steps),
            "full_step_equivalents": full_steps, "description": batches.describe(config.train.steps)},
        "total_hours": total_hours,
        "chip_hours": None if total_hours is None else total_hours * chips,
        "total_hours_high": total_hours_high,
        "chip_hours_high": None if total_hours_high is None else total_hours_high * chips,
        "detail": compiled.detail,
        "gpu_kernels": gpu_kernels_report(topology, compiled.hlo_text),
    }


def gpu_kernels_report(topology: Topology, hlo_text: str | None) -> dict | None:
    """On a GPU host, bertjax's Pallas kernels in the compiled program and whether they passed their check on the
    card (`model/gpu_kernel_check.py`): `note` says how to check them when not (None off GPU)."""
    if not is_gpu(topology) or hlo_text is None:
        return None
    from bertjax.model import gpu_kernel_check

    card = gpus.CARDS[topology.generation].device_kind
    return {"card": card, "in_program": gpu_kernel_check.kernels_in_program(hlo_text),
            "checked": gpu_kernel_check.passed(card), "note": gpu_kernel_check.compile_note(card, hlo_text)}


def with_cost(report: dict, price_per_chip_hour: float | None) -> dict:
    """The report with `price_per_chip_hour` (USD, the user's: no price list is built in), `cost_usd` and
    `cost_usd_high`, its chip-hours at that price at either end of the estimate (None without a price or a step
    time); a --fit-batch proposal in it gets the same."""
    def at_price(chip_hours: float | None) -> float | None:
        return None if price_per_chip_hour is None or chip_hours is None else chip_hours * price_per_chip_hour

    report = dict(report, price_per_chip_hour=price_per_chip_hour, cost_usd=at_price(report.get("chip_hours")),
                  cost_usd_high=at_price(report.get("chip_hours_high")))
    if report.get("fit"):
        report["fit"] = with_cost(report["fit"], price_per_chip_hour)
    return report


def chip_hours_text(report: dict) -> str:
    """`5,120.00 chip-hours` (`GPU-hours` on a GPU host), or `5,120.00-5,400.00 chip-hours` where the estimate's high
    end differs: the run's chip-hours at one rounding, wherever a line shows them."""
    hours = _range(report["chip_hours"], report.get("chip_hours_high"), "{:,.2f}")
    return f"{hours} {report.get('chip', 'chip')}-hours"


def cost_text(report: dict) -> str:
    """`5,120.00 chip-hours x $1.2 per chip-hour = $6,144.00`, or as a range `5,120.00-5,400.00 chip-hours x ... =
    $6,144.00-$6,480.00` where the estimate's high end differs (empty without a step time or a price)."""
    if report.get("cost_usd") is None:
        return ""
    return (f"{chip_hours_text(report)} x ${report['price_per_chip_hour']:g} per {report.get('chip', 'chip')}-hour = "
            f"{_range(report['cost_usd'], report.get('cost_usd_high'), '${:,.2f}')}")


def _range(low: float, high: float | None, form: str) -> str:
    """`form` of `low`, or `low-high` where the high end is another figure at that precision."""
    shown = form.format(low)
    return shown if high is None or form.format(high) == shown else f"{shown}-{form.format(high)}"


# A step whose activations alone need this many times a chip's HBM is refused uncompiled: XLA took hours or the
# host's memory (or overflowed) to tell what the floor already says.
ABSURD_FACTOR = 64


def check_batch(config: PretrainConfig, topology: Topology) -> None:
    """Refuses, before any compile, a batch whose per-chip microbatch's activations alone (their floor,
    shapes.activation_floor_bytes) need more than ABSURD_FACTOR times a chip's HBM, naming the accumulation from
    which the floor fits."""
    config = job_for_topology(config, topology)
    data, fsdp, _ = config.mesh.shape(topology.chips)
    per_chip = config.train.batch_size // (data * fsdp)
    accum = config.train.grad_accum_steps
    model = config.bert_config(vocab_size_of(config))
    seq, hbm = config.data.max_seq_length, topology.usable_hbm_bytes_per_chip

    def floor(rows: int) -> int:
        return shapes.activation_floor_bytes(model, rows, seq)

    if per_chip < 1 or floor(per_chip // accum) <= ABSURD_FACTOR * hbm:
        return
    fitting = next((a for a in _divisors(per_chip) if a >= accum and floor(per_chip // a) <= hbm), None)
    hint = (f"train.grad_accum_steps={fitting} (microbatches of {per_chip // fitting} a chip) is the least "
            f"accumulation whose activations could fit" if fitting else "not even one row a chip fits")
    raise ValueError(f"train.batch_size={config.train.batch_size}: a chip's microbatch of {per_chip // accum:,} rows "
                     f"of {seq} tokens needs at least {floor(per_chip // accum) / 2**30:,.0f} GiB of activations, "
                     f"more than {ABSURD_FACTOR} times its {hbm / 2**30:.2f} GiB of HBM; not compiled: {hint} (or "
                     "give a smaller batch, more chips)")


def _divisors(n: int) -> list[int]:
    """n's divisors, ascending (O(sqrt n): a per-chip batch can be large)."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return small + [n // d for d in reversed(small) if d * d != n]


def compile_for_topology(config: PretrainConfig, topology: Topology, mfu: float | None = None,
                         dump_hlo: str = "") -> dict:
    """Compile the job's step for `topology` and report (see `report`); `dump_hlo`: write the compiled HLO text
    to this file."""
    check_batch(config, topology)
    config = job_for_topology(config, topology)
    vocab_size = vocab_size_of(config)
    compiled = compile_step(config, compile_only_devices(topology), vocab_size)
    if dump_hlo and compiled.hlo_text is not None:
        with replaced_when_whole(dump_hlo) as partial, open(partial, "w", encoding="utf-8") as f:
            f.write(compiled.hlo_text)
    return report(config, topology, mfu, compiled, vocab_size)


def fit_batch(config: PretrainConfig, topology: Topology, mfu: float | None = None,
              requested: dict | None = None, log=lambda line: None) -> dict:
    """The smallest grad_accum_steps (the largest per-chip microbatch, same global batch) whose step fits HBM,
    found by compiling (a binary search: more accumulation never needs more memory); the report of that
    configuration, or of the most accumulated one when none fits (its `fits` is then False). `requested`: the
    report of `config` itself if already compiled (not compiled again). `log`: a line per compile, before and
    after it (a BERT-base compile takes minutes)."""
    config = job_for_topology(config, topology)
    vocab_size = vocab_size_of(config)
    devices = compile_only_devices(topology)
    data, fsdp, _ = config.mesh.shape(topology.chips)
    per_step = config.train.batch_size // (data * fsdp)
    warmup_min = config.train.batch_size_warmup_min  # stays a whole number of microbatches
    choices = [a for a in _divisors(per_step) if a >= config.train.grad_accum_steps
               and warmup_min % (config.train.batch_size // a) == 0]
    results = {} if requested is None else {requested["grad_accum_steps"]: requested}

    def compiled(accum: int) -> dict:
        if accum not in results:
            candidate = dataclasses.replace(config, train=dataclasses.replace(config.train, grad_accum_steps=accum))
            log(f"--fit-batch: compiling with grad_accum_steps={accum} (per-chip microbatch "
                f"{per_step // accum}) ...")
            started = time.perf_counter()
            results[accum] = report(candidate, topology, mfu, compile_step(candidate, devices, vocab_size),
                                    vocab_size)
            found, seconds = results[accum], time.perf_counter() - started
            log(f"--fit-batch: grad_accum_steps={accum} needs {found['hbm_bytes_per_chip'] / 2**30:.2f} GiB of "
                f"{found['hbm_capacity_bytes_per_chip'] / 2**30:.2f} per chip: "
                f"{'fits' if found['fits'] else 'does not fit'} (compiled in {duration(seconds)})")
        return results[accum]

    low, high = 0, len(choices) - 1
    if not compiled(choices[high])["fits"]:
        return results[choices[high]]
    while low < high:  # choices[high] fits; find the first that does
        middle = (low + high) // 2
        if compiled(choices[middle])["fits"]:
            high = middle
        else:
            low = middle + 1
    return compiled(choices[high])


def describe(result: dict) -> str:
    """The report as lines for a person."""
    gib = 2**30
    where = (f"{result['accelerator_type']}: {result['chips']} GPU(s) on one host" if result.get("chip") == "GPU" else
             f"{result['accelerator_type']} x{result['num_slices']} ({result['topology']}): {result['chips']} chips, "
             f"{result['hosts']} hosts")
    lines = [
        f"{where}; mesh {result['mesh']}",
        f"batch {result['global_batch']} (per chip {result['per_chip_batch']:g} per microbatch, "
        f"grad_accum_steps {result['grad_accum_steps']}), seq {result['seq_len']}",
        f"HBM per chip: needs {result['hbm_bytes_per_chip'] / gib:.2f} GiB of "
        f"{result['hbm_capacity_bytes_per_chip'] / gib:.2f} GiB usable: "
        + ("fits" if result["fits"] else
           f"DOES NOT FIT (over by {(result['hbm_bytes_per_chip'] - result['hbm_capacity_bytes_per_chip']) / gib:.2f}"
           " GiB)"),
        f"FLOPs per step: model {result['model_flops_per_step']:.4g}"
        + ("" if result["xla_flops_per_step"] is None else
           f", XLA {result['xla_flops_per_step']:.4g} "
           f"({result['xla_flops_per_step'] / result['model_flops_per_step']:.3f}x)"),
    ]
    if result["estimated_step_seconds"] is not None and result["clock_hz"] is None:
        lines += _describe_gpu_estimate(result)
    elif result["estimated_step_seconds"] is not None:
        coverage = result["estimate_coverage"]
        communication = result["estimated_communication_seconds"]
        lines.append(
            f"XLA:TPU's estimate (not a measurement): {result['estimated_cycles_per_step']:,} cycles at "
            f"{result['clock_hz'] / 1e9:g} GHz = {result['estimated_compute_seconds'] * 1e3:.1f} ms of compute "
            f"+ {communication['exposed'] * 1e3:.1f} ms of communication not hidden (of "
            f"{communication['total'] * 1e3:.1f} ms at the ICI ring bandwidth) = "
            f"{result['estimated_step_seconds'] * 1e3:.1f} ms/step, {100 * result['estimated_mfu']:.1f}% MFU")
        lines += _collectives_and_breakdown(result, per="chip", priced="estimated")
        unestimated = ", ".join(f"{name} x{count}" for name, count in list(coverage["without_estimate"].items())[:6])
        unestimated += ", ..." if len(coverage["without_estimate"]) > 6 else ""
        lines.append(f"  coverage: {coverage['instructions_estimated']} instructions estimated by XLA"
                     + (f", {coverage['pallas_kernels_from_cost_estimate']} Pallas kernel(s) priced by their "
                        f"declared CostEstimate ({coverage['pallas_kernel_seconds'] * 1e3:.2f} ms)"
                        if coverage["pallas_kernels_from_cost_estimate"] else "")
                     + (f"; without estimate: {unestimated}" if unestimated else ""))
        lines.append(_unpriced_line(result))
    if result["step_seconds"] is not None:
        high = result.get("step_seconds_high")
        ranged = high is not None and f"{high * 1e3:.1f}" != f"{result['step_seconds'] * 1e3:.1f}"
        basis = (f"at an assumed {100 * result['mfu_assumed']:g}% MFU" if result["step_time_source"] == "assumed"
                 else "by the estimate, low to high" if ranged else "by the estimate")
        warmup = result.get("batch_warmup")
        counted = ("" if not warmup or not warmup["sizes"] else
                   f" ({warmup['steps']:,} of them the warmup's, each at its share of the full step's microbatches: "
                   f"{warmup['full_step_equivalents']:,.0f} full steps' worth)")
        lines.append(f"{basis}: {_range(result['step_seconds'] * 1e3, high and high * 1e3, '{:.1f}')} ms/step, "
                     f"{result['tokens_per_second']:,.0f} tokens/s{' at the low end' if ranged else ''}; "
                     f"{result['steps']} steps{counted} = "
                     f"{_range(result['total_hours'], result.get('total_hours_high'), '{:.2f}')} h, "
                     f"{chip_hours_text(result)}")
        lines.append(f"cost: {cost_text(result)} (--price-per-chip-hour)" if result.get("cost_usd") is not None else
                     "cost: give --price-per-chip-hour USD (no price list is built in; see docs/performance.md)")
    if result.get("batch_warmup"):
        lines.insert(2, result["batch_warmup"]["description"])
    if (result.get("gpu_kernels") or {}).get("note"):
        lines.append(result["gpu_kernels"]["note"])
    return "\n".join(lines)


def _unpriced_line(result: dict) -> str:
    """The estimate's range: what it left unpriced (the kinds moving most bytes), those bytes at HBM bandwidth,
    their share of the high end."""
    unpriced = result["estimated_unpriced"]
    if not unpriced:
        return "  every instruction priced: the estimate is one figure, no range"
    kinds = ", ".join(f"{kind} x{entry['count']:,} ({entry['bytes'] / 2**20:,.0f} MiB)"
                      for kind, entry in list(unpriced.items())[:4]) + (", ..." if len(unpriced) > 4 else "")
    moved = sum(entry["bytes"] for entry in unpriced.values())
    extra = result["estimated_step_seconds_high"] - result["estimated_step_seconds"]
    return (f"  range: {result['estimated_step_seconds'] * 1e3:.1f} ms (low: unpriced instructions at 0) to "
            f"{result['estimated_step_seconds_high'] * 1e3:.1f} ms (high: their {moved / 2**20:,.0f} MiB at HBM "
            f"bandwidth, +{extra * 1e3:.1f} ms, {100 * result['estimated_unpriced_share']:.1f}% of the high step); "
            f"unpriced: {kinds}")


def _collectives_and_breakdown(result: dict, *, per: str, priced: str) -> list[str]:
    """The report's lines for each collective (count, bytes per `per` device, time, time not hidden) and for where
    the `priced` time goes by op_name."""
    lines = []
    for kind, entry in result["collectives"].items():
        dtypes = ", ".join(f"{dtype} {size / 2**20:.1f} MiB" for dtype, size in entry["bytes_by_dtype"].items())
        lines.append(f"  {kind}: {entry['count']} per step ({entry['async']} async), {dtypes} per {per}; "
                     f"{entry['seconds'] * 1e3:.2f} ms, {entry['exposed_seconds'] * 1e3:.2f} ms not hidden")
    lines.append(f"  where the {priced} time goes (op_name, layers merged):")
    return lines + [f"  {100 * share:5.1f}%  {seconds * 1e3:8.3f} ms  {name}"
                    for name, seconds, share in result["estimate_breakdown"]]


def _describe_gpu_estimate(result: dict) -> list[str]:
    """The lines of a GPU host's priced step (`gpu_estimate.py`)."""
    coverage, communication = result["estimate_coverage"], result["estimated_communication_seconds"]
    kernels = coverage["kernels"]
    lines = [f"priced per kernel on the card (an estimate, not a measurement): "
             f"{result['estimated_compute_seconds'] * 1e3:.1f} ms of kernels ({kernels.get('matmul', 0)} matmuls, "
             f"{kernels.get('memory-bound', 0)} memory-bound, launches included) + {communication['exposed'] * 1e3:.1f}"
             f" ms of communication not hidden (of {communication['total'] * 1e3:.1f} ms over NVLink) = "
             f"{result['estimated_step_seconds'] * 1e3:.1f} ms/step, {100 * result['estimated_mfu']:.1f}% MFU"]
    lines.append(f"  matmuls {coverage['matmul_seconds'] * 1e3:.1f} ms; outside matmuls "
                 f"{coverage['non_matmul_bytes'] / 1e9:.2f} GB moved, {coverage['non_matmul_seconds'] * 1e3:.1f} ms; "
                 f"launches {coverage['launch_seconds'] * 1e3:.1f} ms; the memory-bound kernels moving most:")
    lines += [f"  {entry['bytes'] / 1e9:7.3f} GB  {entry['kernel']}  {entry['op_name']}"
              for entry in coverage["top_non_matmul"]]
    lines += _collectives_and_breakdown(result, per="GPU", priced="priced")
    lines.append(_unpriced_line(result))
    if coverage["unknown_trip_counts"]:
        lines.append(f"  loops counted once (trip count unknown): {', '.join(coverage['unknown_trip_counts'])}")
    return lines
