"""`bertjax compile`: the job's train step compiled by XLA:TPU for real TPU topologies (libtpu's compile-only
devices) on this CPU machine; fit, FLOPs and cost figures."""
import functools
import json
import re

import numpy as np
import pytest

pytest.importorskip("libtpu", reason="bertjax compile needs libtpu (pip install -e '.[test]' installs jax[tpu])")
# Compile-only executables cannot be read back from the suite's cache by a compile-only process: not written.
pytestmark = pytest.mark.usefixtures("no_cache_writes")

from bertjax.cli import main as bertjax_main  # noqa: E402
from bertjax.cloud import compile as tpu_compile
from bertjax.cloud import topologies
from bertjax.pretraining import metrics  # noqa: E402
from bertjax.pretraining.config import load_config  # noqa: E402

REQUIRED_KEYS = {"topology", "chips", "hosts", "mesh", "per_chip_batch", "fits", "hbm_capacity_bytes_per_chip",
                 "estimated_step_seconds", "estimated_mfu", "estimate_breakdown", "estimate_coverage", "step_time_source",
                 "hbm_bytes_per_chip", "xla_flops_per_step", "model_flops_per_step", "mfu_assumed", "step_seconds",
                 "tokens_per_second", "total_hours", "chip_hours"}


# bert-tiny cut to one layer: XLA:TPU compiles it in about half the time of two, and every figure checked here is
# per layer or per parameter (a second layer would only repeat the first). bf16 compute, as the TPU presets run:
# one program serves the default's checks and the update sharding's.
ONE_LAYER = "model.num_hidden_layers=1"
BF16 = "model.dtype=bfloat16"


def _tiny(*overrides):
    return load_config("bert-tiny", [ONE_LAYER, BF16, *overrides], require_data=False)


@functools.cache
def _compiled_step(name: str, *overrides: str, num_slices: int = 1):
    """bert-tiny with `overrides` compiled for `name`, as `compile_for_topology` does (each configuration compiled
    once per test session): (config, topology, vocab size, compiled step)."""
    topology = topologies.parse_topology(name, num_slices)
    config = tpu_compile.job_for_topology(_tiny(*overrides), topology)
    vocab_size = tpu_compile.vocab_size_of(config)
    return config, topology, vocab_size, tpu_compile.compile_step(config, topologies.compile_only_devices(topology),
                                                                  vocab_size)


def _compiled(name: str, *overrides: str, num_slices: int = 1, mfu: float | None = 0.5) -> dict:
    """The report of `_compiled_step`'s program: step time at an assumed `mfu`, or XLA:TPU's estimate (None)."""
    config, topology, vocab_size, compiled = _compiled_step(name, *overrides, num_slices=num_slices)
    return tpu_compile.report(config, topology, mfu, compiled, vocab_size)


def _param_bytes(config) -> int:
    import jax

    from bertjax.model.bert.model import BertForPreTraining, init_params

    bert = config.bert_config(tpu_compile.DEFAULT_VOCAB_SIZE)
    shapes = jax.eval_shape(lambda: init_params(BertForPreTraining(bert), bert, jax.random.key(0), length=8,
                                                num_masked=2))
    return sum(4 * int(np.prod(x.shape)) for x in jax.tree_util.tree_leaves(shapes))


# v4 and v6e slow-marked, for the default suite's time: the same compile path; their compile-only devices are
# exercised by test_dropout_attention.py's Mosaic compiles (v4-8) and their figures by test_topologies.py.
@pytest.mark.parametrize("name, chips, hosts", [("v5e:2x2", 4, 1),
                                                pytest.param("v4-8", 4, 1, marks=pytest.mark.slow),
                                                pytest.param("v6e-8", 8, 1, marks=pytest.mark.slow)])
def test_tiny_step_compiles_for_two_generations_and_reports_its_cost(name, chips, hosts):
    config = _tiny()
    result = _compiled(name)
    assert REQUIRED_KEYS <= set(result)
    assert (result["chips"], result["hosts"], result["fits"]) == (chips, hosts, True)
    # On TPU the update is split over the data axis by default (the priced estimate's choice).
    assert result["mesh"] == {"data": chips, "fsdp": 1, "tensor": 1, "dcn_data": 1, "shard_optimizer": True}
    assert result["per_chip_batch"] == 32 / chips
    # Every chip holds a slice of the params and both Adam moments (float32), and gathers the params it computes
    # with for the step.
    assert 3 * _param_bytes(config) / chips <= result["argument_bytes_per_chip"] < 3 * _param_bytes(config) / 2
    assert result["hbm_bytes_per_chip"] < result["hbm_capacity_bytes_per_chip"]
    expected = 32 * metrics.train_flops_per_sequence(config.bert_config(30522), 128, 20)
    assert result["model_flops_per_step"] == expected
    # XLA also counts what the analytic count leaves out (softmax, LayerNorm, GELU, the optimizer): a little more.
    assert 1.0 < result["xla_flops_per_step"] / expected < 1.2
    peak = topologies.parse_topology(name).peak_flops_per_chip
    assert result["step_seconds"] == pytest.approx(expected / (chips * peak * 0.5))
    assert result["chip_hours"] == pytest.approx(result["total_hours"] * chips)
    assert result["total_hours"] == pytest.approx(300 * result["step_seconds"] / 3600)


def test_update_sharding_reduces_each_gradient_once_and_gathers_the_params_in_the_compute_dtype():
    replicated = _compiled("v5e:2x2", "mesh.shard_optimizer=false")
    sharded = _compiled("v5e:2x2")
    assert (replicated["mesh"]["shard_optimizer"], sharded["mesh"]["shard_optimizer"]) == (False, True)
    params = _param_bytes(_tiny())  # float32
    # Data parallel: every chip holds the params and both Adam moments; split over 4 chips: a quarter of them.
    assert replicated["argument_bytes_per_chip"] >= 3 * params
    assert sharded["argument_bytes_per_chip"] < 0.3 * 3 * params
    # One reduction per gradient per step: the reduce-scatters' operands (+ the few all-reduced whole) add up to
    # the params once, in the dtype the backward gives them (bf16 matmul operands, float32 LayerNorm and biases:
    # between half and all of the float32 bytes); the replicated step all-reduces the tied word-embedding table's
    # gradient twice (bf16 from the output layer, float32 from the lookup).
    kinds = sharded["collectives"]
    reduced = kinds["reduce-scatter"]["bytes"] + kinds.get("all-reduce", {}).get("bytes", 0)
    assert params / 2 <= reduced <= 0.6 * params, kinds
    word_table = 30522 * _tiny().bert_config(30522).hidden_size * 4
    assert replicated["collectives"]["all-reduce"]["bytes"] >= reduced + 0.9 * word_table
    # The params are gathered once, the matmul operands in bf16: about half the float32 bytes.
    assert params / 2 * 0.9 <= kinds["all-gather"]["bytes"] <= 0.6 * params, kinds
    # What the schedule does not hide is priced into the step (with communication, never below compute alone).
    assert sharded["estimated_step_seconds"] >= sharded["estimated_compute_seconds"]


@pytest.mark.slow  # a compile of its own (~60 CPU-s); fsdp's sharding rules and step: test_train_step.py
def test_fsdp_splits_the_params_and_moments_over_chips():
    sharded = _compiled("v5e:2x2", "mesh.data=1", "mesh.fsdp=4")
    assert sharded["mesh"] == {"data": 1, "fsdp": 4, "tensor": 1, "dcn_data": 1, "shard_optimizer": False}
    replicated = _compiled("v5e:2x2", "mesh.shard_optimizer=false")
    state = 3 * _param_bytes(_tiny())  # params and both Adam moments, float32
    # Data parallel: every chip holds the whole state; fsdp: a quarter of it (LayerNorm and bias vectors,
    # a small part, stay whole). The step's total need shrinks less: it gathers the params it computes with.
    assert replicated["argument_bytes_per_chip"] >= state
    assert sharded["argument_bytes_per_chip"] < 0.3 * state
    assert sharded["hbm_bytes_per_chip"] < replicated["hbm_bytes_per_chip"]


@pytest.mark.slow  # ~38 s of compiles, for the default suite's time
def test_two_slices_spread_the_data_axis_over_the_slices():
    result = _compiled("v5e:2x2", num_slices=2)
    assert (result["chips"], result["hosts"], result["num_slices"], result["fits"]) == (8, 2, 2, True)
    assert result["mesh"] == {"data": 8, "fsdp": 1, "tensor": 1, "dcn_data": 2, "shard_optimizer": True}
    # The same global batch over twice the chips: XLA's per-chip count halves, so the step's total stays (up to
    # the optimizer update, which every data-parallel chip repeats: ~0.3% of this step per 4 chips).
    one_slice = _compiled("v5e:2x2")
    assert result["xla_flops_per_step"] == pytest.approx(one_slice["xla_flops_per_step"], rel=0.03)


def test_a_state_over_hbm_exits_1_with_the_size_and_no_accumulation_helps(capsys):
    # A 12M-token vocabulary: params and Adam moments alone (~18 GB a chip, data parallel) exceed a v5e chip.
    args = ["compile", "--config", "bert-tiny", "--topology", "v5e:2x2", "--set", "model.vocab_size=12000000",
            "--set", ONE_LAYER, "--fit-batch"]
    assert bertjax_main(args) == 1
    captured = capsys.readouterr()
    # Said before and timed after: the compile and the --fit-batch search.
    assert re.search(r"compiling bert-tiny's train step for v5e:2x2 with XLA:TPU .*\n.*compiled in \S+\n.*"
                     r"--fit-batch: compiling with more gradient accumulation steps until the step fits \.\.\.\n"
                     r"(.*\n)*.*--fit-batch: searched in \S+\n", captured.out), captured.out
    # ... and each compile of the search, said before and after with what it found (bert-tiny's 32 sequences
    # over 4 chips: 8 a chip, at most 8 microbatches of one; the most accumulated does not fit either).
    assert re.search(r"--fit-batch: compiling with grad_accum_steps=8 \(per-chip microbatch 1\) \.\.\.\n.*"
                     r"--fit-batch: grad_accum_steps=8 needs [\d.]+ GiB of 15\.75 per chip: does not fit \(compiled in "
                     r"\S+\)\n", captured.out), captured.out
    assert "DOES NOT FIT" in captured.out
    assert "does not fit HBM" in captured.err and "no grad_accum_steps fits either" in captured.err
    over = float(captured.err.split("HBM: ")[1].split(" GiB")[0])
    assert over > 2.0  # 1.5e9 params x 12 bytes = 18 GB against 15.75 GiB usable


@pytest.mark.slow
def test_a_step_over_hbm_exits_1_with_the_size_and_fit_batch_finds_one_that_fits(capsys):
    # 65536 sequences of BERT-tiny activations at once do not fit a v5e chip's 16 GiB; in 8 microbatches they do.
    args = ["compile", "--config", "bert-tiny", "--topology", "v5litepod-4", "--set", "train.batch_size=65536",
            "--set", "train.steps=1000", "--json", "--fit-batch"]
    assert bertjax_main(args) == 1
    captured = capsys.readouterr()
    result = json.loads(captured.out)
    assert result["fits"] is False and result["hbm_bytes_per_chip"] > result["hbm_capacity_bytes_per_chip"]
    assert "does not fit HBM" in captured.err and "GiB per chip over" in captured.err
    fit = result["fit"]
    assert fit["fits"] is True and fit["grad_accum_steps"] > 1 and fit["global_batch"] == 65536
    # The proposal is the report of that configuration's own compile: it fits with room to spare.
    assert f"--set train.grad_accum_steps={fit['grad_accum_steps']}" in captured.err
    # ... with the step time and cost of the configuration that fits (progress lines on stderr: stdout is JSON)
    assert (f"step {fit['step_seconds'] * 1e3:.1f} ms, 1000 steps = {fit['total_hours']:.2f} h, "
            f"{fit['chip_hours']:,.2f} chip-hours)") in captured.err, captured.err
    assert "compiled in" in captured.err
    assert fit["per_chip_batch"] == 65536 / 4 / fit["grad_accum_steps"]
    assert fit["hbm_bytes_per_chip"] <= fit["hbm_capacity_bytes_per_chip"] < result["hbm_bytes_per_chip"]


def _tiny_chip_hours() -> float:
    """300 steps of bert-tiny on 4 v5e chips at an assumed 50% MFU, the step time from the model FLOPs (hand
    formula)."""
    flops = 32 * metrics.train_flops_per_sequence(_tiny().bert_config(30522), 128, 20)
    return 300 * flops / (4 * topologies.parse_topology("v5e:2x2").peak_flops_per_chip * 0.5) / 3600 * 4


def test_the_cost_is_the_chip_hours_at_the_price_given(capsys):
    """`--price-per-chip-hour`: the chip-hours at that price, on one line; without a price, how to give one."""
    chip_hours = _tiny_chip_hours()
    priced = tpu_compile.with_cost(_compiled("v5e:2x2"), 1.5)
    assert (priced["price_per_chip_hour"], priced["cost_usd"]) == (1.5, pytest.approx(chip_hours * 1.5))
    assert f"cost: {chip_hours:,.2f} chip-hours x $1.5 per chip-hour = ${chip_hours * 1.5:,.2f} " \
           "(--price-per-chip-hour)" in tpu_compile.describe(priced).splitlines()
    # One rounding of the run's chip-hours on every line that shows them (the step line said 7.9 where the cost
    # line said 7.93), for an assumed MFU and for the estimate's range alike.
    for report in (priced, tpu_compile.with_cost(_compiled("v5e:2x2", mfu=None), 1.5)):
        shown = re.findall(r"([\d,.]+(?:-[\d,.]+)?) chip-hours", tpu_compile.describe(report))
        assert len(shown) == 2 and shown[0] == shown[1] == tpu_compile.chip_hours_text(report).split()[0], shown
    unpriced = tpu_compile.with_cost(_compiled("v5e:2x2"), None)
    assert unpriced["cost_usd"] is None
    assert "cost: give --price-per-chip-hour USD (no price list is built in; see docs/performance.md)" in \
        tpu_compile.describe(unpriced).splitlines()
    for price in ("-1", "0"):  # refused at parsing, as every number a command takes (options.floats)
        with pytest.raises(SystemExit) as refused:
            bertjax_main(["compile", "--config", "bert-tiny", "--topology", "v5e:2x2", "--price-per-chip-hour", price])
        assert refused.value.code == 2
        assert f"argument --price-per-chip-hour: must be > 0, got {price}" in capsys.readouterr().err


@pytest.mark.slow  # a compile of its own through the command (~1-3 min here)
def test_the_command_prints_the_cost_in_json(capsys):
    assert bertjax_main(["compile", "--config", "bert-tiny", "--topology", "v5e:2x2", "--mfu", "0.5",
                         "--price-per-chip-hour", "1.5", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert (result["price_per_chip_hour"], result["cost_usd"]) == (1.5, pytest.approx(_tiny_chip_hours() * 1.5))


def test_bad_mesh_or_batch_is_an_error_before_compiling(capsys):
    assert bertjax_main(["compile", "--config", "bert-tiny", "--topology", "v5e:2x2", "--set", "mesh.data=3"]) == 2
    assert "mesh" in capsys.readouterr().err
    assert bertjax_main(["compile", "--config", "bert-tiny", "--topology", "v5e:2x2",
                         "--set", "train.batch_size=30"]) == 2
    assert "not divisible by the data-parallel size 4" in capsys.readouterr().err
    assert bertjax_main(["compile", "--config", "bert-tiny", "--topology", "v9z-16"]) == 2
    assert "unknown TPU generation" in capsys.readouterr().err


def test_an_absurd_batch_or_a_dump_into_a_missing_directory_is_one_line_before_compiling(tmp_path, capsys,
                                                                                         monkeypatch):
    """A --dump-hlo whose directory is missing was found only when the compile was done; a batch whose
    activations alone need more than 64 times a chip's HBM took XLA hours or the host's memory (or overflowed) to
    refuse. Each is one line before anything is compiled (here a compile would fail the test), the batch's naming
    the accumulation whose activations could fit."""
    def compile_step(*args, **kwargs):
        raise AssertionError("compiled")

    monkeypatch.setattr(tpu_compile, "compile_step", compile_step)
    dump = tmp_path / "missing" / "step.hlo"
    assert bertjax_main(["compile", "--config", "bert-tiny", "--topology", "v5e:2x2", "--dump-hlo", str(dump)]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"bertjax compile: error: --dump-hlo {dump}: no directory {tmp_path / 'missing'}; create it first")
    assert bertjax_main(["compile", "--config", "bert-tiny", "--topology", "v5e:2x2",
                         "--set", "train.batch_size=2000000000"]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "bertjax compile: error: train.batch_size=2000000000: a chip's microbatch of 500,000,000 rows of 128 tokens "
        "needs at least 1,159,668 GiB of activations, more than 64 times its 15.75 GiB of HBM; not compiled: "
        "train.grad_accum_steps=78125 (microbatches of 6400 a chip) is the least accumulation whose activations could "
        "fit (or give a smaller batch, more chips)")


@pytest.mark.slow
@pytest.mark.parametrize("preset, seq", [("bert-base-phase1", 128), ("bert-base-phase2", 512)])
def test_bert_base_fits_v5e_4x4_and_xla_counts_the_model_flops(preset, seq):
    result = tpu_compile.compile_for_topology(load_config(preset, require_data=False),
                                              topologies.parse_topology("v5e:4x4"))
    assert result["fits"] and result["seq_len"] == seq
    assert result["xla_flops_per_step"] == pytest.approx(result["model_flops_per_step"], rel=0.10)


def _pallas_kernels(result: dict) -> tuple[int, int]:
    """Pallas kernel calls per step: (priced by the CostEstimate they declare, declaring none)."""
    coverage = result["estimate_coverage"]
    return (coverage["pallas_kernels_from_cost_estimate"],
            coverage["without_estimate"].get("Pallas kernel without a CostEstimate", 0))


def test_compiling_for_tpu_on_this_cpu_uses_the_tpu_attention_kernels_and_estimates_the_step():
    # `auto` picks the TPU kernels for the TPU the program is compiled for, although JAX's default backend here is
    # the CPU (the program compiled is the one the TPU would run), each run per chip (Mosaic calls are not
    # partitioned by XLA). With BERT's attention dropout from seq 128: the dropout kernel, forward, dq and dk/dv per
    # layer (here 1 layer; bert-tiny's 2 heads of 64 share one 128-lane block).
    assert _pallas_kernels(_compiled("v5e:2x2")) == (3 * 1, 0)
    # The step time comes from XLA:TPU's estimate unless an MFU is assumed.
    estimated = _compiled("v5e:2x2", mfu=None)
    assert estimated["step_time_source"] == "estimated" and estimated["mfu_assumed"] is None
    assert estimated["step_seconds"] == estimated["estimated_step_seconds"] > 0
    assert 0 < estimated["estimated_mfu"] < 1
    shares = [share for _, _, share in estimated["estimate_breakdown"]]
    assert shares == sorted(shares, reverse=True) and 0 < sum(shares) <= 1 + 1e-9


def _hand_bytes(array_type: str) -> int:
    """Bytes of one printed HLO array type, e.g. `bf16[128,512]{1,0:T(8,128)(2,1)S(1)}`, counted by hand."""
    dtype, dims = re.match(r"(\w+)\[([\d,]*)\]", array_type).groups()
    size = {"bf16": 2, "f32": 4, "s32": 4, "u32": 4, "s8": 1, "u8": 1, "pred": 1}[dtype]
    return int(np.prod([int(d) for d in dims.split(",") if d])) * size


def test_the_estimate_is_a_range_whose_high_end_charges_the_unpriced_bytes_at_hbm_bandwidth():
    """The low end prices what XLA:TPU left without an estimate at 0; the high end charges it its bytes at HBM
    bandwidth; `compile` prints both, their share, and the hours and cost as a range."""
    from bertjax.cloud.estimate import estimate_program

    config, topology, vocab_size, compiled = _compiled_step("v5e:2x2")
    result = tpu_compile.with_cost(_compiled("v5e:2x2", mfu=None), 1e6)  # a price that shows the cents apart
    unpriced, hbm = result["estimated_unpriced"], topologies.GENERATIONS["v5e"].hbm_bytes_per_second
    # What the issue found in the budget step is in this one too: async copies, slices, ConcatBitcast.
    assert {"copy-start", "slice-start", "custom-call:ConcatBitcast"} <= set(unpriced)
    low, high = result["estimated_step_seconds"], result["estimated_step_seconds_high"]
    assert high == pytest.approx(low + sum(entry["bytes"] for entry in unpriced.values()) / hbm)
    assert result["estimated_unpriced_share"] == pytest.approx((high - low) / high) and high > low
    assert result["step_seconds"] == low and result["step_seconds_high"] == high
    assert result["total_hours_high"] == pytest.approx(result["steps"] * high / 3600)
    assert result["chip_hours_high"] == pytest.approx(result["total_hours_high"] * 4)
    assert result["cost_usd_high"] == pytest.approx(result["chip_hours_high"] * 1e6)
    lines = tpu_compile.describe(result).splitlines()
    assert f"  range: {low * 1e3:.1f} ms (low: unpriced instructions at 0) to {high * 1e3:.1f} ms (high: " in \
        next(line for line in lines if line.startswith("  range: "))
    assert f"{100 * result['estimated_unpriced_share']:.1f}% of the high step" in "\n".join(lines)
    assert f"= ${result['cost_usd']:,.2f}-${result['cost_usd_high']:,.2f} (--price-per-chip-hour)" in lines[-1]
    # An assumed MFU is one figure: no range.
    assumed = tpu_compile.with_cost(_compiled("v5e:2x2", mfu=0.5), 1.5)
    assert assumed["step_seconds_high"] is None and assumed["cost_usd_high"] is None
    # One real instruction by hand: the program's first async copy reads its operand and writes its destination
    # (its tuple's first element; the second aliases the operand), plus the 4-byte context.
    line = next(line for line in compiled.hlo_text.splitlines() if " copy-start(" in line)
    result_type = re.search(r"= \((.*?)\) copy-start\(", line)[1]
    destination, source, context = [t.strip() for t in re.split(r",\s*(?=[a-z]+\d*\[)", result_type)]
    assert destination.split("{")[0] == source.split("{")[0] and context.startswith("u32[]")
    operand = re.search(r"copy-start\(%([\w.\-]+)\)", line)[1]
    module = (f"HloModule one\n\nENTRY %main (p: {source.split('{')[0]}) -> u32[] {{\n"
              f"  %{operand} = {source} parameter(0)\n{line}\n}}\n")
    alone = estimate_program(module, clock_hz=1e9, peak_flops=1e12, hbm_bytes_per_second=hbm)
    by_hand = 2 * _hand_bytes(source) + 4
    assert alone.unpriced == {"copy-start": {"count": 1, "bytes": by_hand, "seconds": by_hand / hbm}}


@pytest.mark.slow  # two compiles of their own (~70 CPU-s); `auto`'s choice per platform, seq and dropout, and the
# splash kernel: test_attention.py; a kernel without a CostEstimate counted: test_estimate.py
def test_below_seq_128_the_reference_and_without_attention_dropout_splash_are_compiled_for_tpu():
    # Below seq 128 the reference attention (the kernel unmeasured there); without attention dropout: splash.
    assert _pallas_kernels(_compiled("v5e:2x2", "data.max_seq_length=64", "train.batch_size=4")) == (0, 0)
    # JAX's splash kernel declares no cost: it is counted as without estimate (and said so in the report). In float32:
    # the suite's JAX_DEFAULT_MATMUL_PRECISION=highest asks splash's bf16 matmuls for fp32 contraction, which Mosaic
    # refuses ("Bad lhs type").
    assert _pallas_kernels(_compiled("v5e:2x2", "model.attention_probs_dropout_prob=0", "model.dtype=float32"))[1] > 0


@pytest.mark.slow  # a compile of its own (~20 CPU-s); trip counts read from a loop's condition: test_estimate.py
def test_the_estimate_counts_every_microbatch_of_gradient_accumulation():
    # The same 32 sequences in 4 microbatches: the scan's while loop has no known_trip_count in XLA's config; its
    # condition (counter < 4) gives the trip count, so the step is estimated at about the same time, not a quarter.
    accumulated = _compiled("v5e:2x2", "train.grad_accum_steps=4")
    assert accumulated["estimate_coverage"]["trip_counts_from_condition"] == [4]
    assert accumulated["estimate_coverage"]["unknown_trip_counts"] == []
    ratio = accumulated["estimated_step_seconds"] / _compiled("v5e:2x2")["estimated_step_seconds"]
    assert 0.8 < ratio < 2.0


@pytest.mark.slow  # a compile of its own (~20 CPU-s: 4 microbatches); the report's warmup lines without a compile:
# test_batch_warmup.py
def test_the_command_prices_the_full_step_and_names_a_batch_size_warmups_steps(capsys):
    assert bertjax_main(["compile", "--config", "bert-tiny", "--topology", "v5e:2x2", "--mfu", "0.5",
                         "--set", ONE_LAYER, "--set", BF16, "--set", "train.grad_accum_steps=4",
                         "--set", "train.batch_size_warmup_tokens=12288"]) == 0
    out = capsys.readouterr().out
    assert "batch 32 (per chip 2 per microbatch, grad_accum_steps 4), seq 128" in out  # the full step's program
    assert ("batch-size warmup: 6 steps at 3 size(s) from 8 to 24 rows (a microbatch of 8 at a time, 2 steps each), "
            "12,288 tokens; then 32 rows a step") in out
    assert "300 steps (6 of them the warmup's, each at its share of the full step's microbatches: 297 full steps' " \
           "worth) = " in out
