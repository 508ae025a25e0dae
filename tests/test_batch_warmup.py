"""The batch-size warmup (`train.batch_size_warmup_tokens`): its sizes against ModernBERT's published schedule and
hand-computed cases, the learning rate counted in tokens against its formula, a run equal step for step to steps
assembled by hand from the same rows at each smaller batch, a run stopped mid-warmup resuming across a size change to
the same bits, and the refusal to warm a continued model's batch up again.

The runs are bert-tiny in this process on its devices (8 by default, 1 on `make test`'s one-device workers): the
microbatch is one row a device, the full batch three microbatches."""
import contextlib
import io
import math
import signal

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bertjax.data.demo_corpus import write_demo_corpus
from bertjax.pretraining import optim
from bertjax.pretraining.batch_schedule import BatchSchedule, warmup_sizes
from bertjax.pretraining.config import load_config, validate
from bertjax.runtime.preemption import STOPPED_EXIT
from tests.test_pretrain import _final_params, _in_process, _losses, _message, _run_here, _run_until, _step_records


def _modernbert_thresholds(start: int, full: int, tokens: int) -> list[int]:
    """BatchSizeWarmupScheduler._calculate_step_thresholds (AnswerDotAI/ModernBERT, src/sequence_packer.py) as
    published: the tokens below which each size from `start` to `full` - 1 is used (a float product, ceil'ed)."""
    per_unit = tokens / sum(range(start, full))
    thresholds, cumulative = [], 0
    for size in range(start, full):
        cumulative += size
        thresholds.append(math.ceil(per_unit * cumulative))
    return thresholds


def _modernbert_sizes(start: int, full: int, tokens: int, microbatch_tokens: int, steps: int) -> list[int]:
    """The size (microbatches) of each of the first `steps` steps as ModernBERT's scheduler picks them: before each
    batch, from the tokens emitted so far (its __call__), a step of size b adding b microbatches' tokens."""
    thresholds, sizes, done = _modernbert_thresholds(start, full, tokens), [], 0
    for _ in range(steps):
        size = full if done >= tokens else next((start + i for i, t in enumerate(thresholds) if done < t), full)
        sizes.append(size)
        done += size * microbatch_tokens
    return sizes


def _sizes(schedule: BatchSchedule, steps: int) -> list[int]:
    return [schedule.microbatches_at(step) for step in range(steps)]


@pytest.mark.parametrize("start, full, tokens, microbatch_tokens", [
    (1, 4, 6000, 100),                     # thresholds 1000, 3000, 6000: 10 steps at each size
    (2, 5, 1001, 30),                      # thresholds ceil(222.4) = 223, ceil(556.1) = 557, 1001
    (1, 9, 50_000_000_000, 512 * 1024),    # modernbert-base: 9 microbatches of 512 rows of 1024 tokens
    (1, 6, 50_000_000_000, 768 * 1024),    # ModernBERT's own run: 8 GPUs x 96 rows, 6 microbatches a device
])
def test_the_sizes_are_modernberts(start, full, tokens, microbatch_tokens):
    segments = warmup_sizes(start, full, tokens, microbatch_tokens)
    schedule = BatchSchedule(microbatch_tokens, full, 1, segments)
    steps = schedule.warmup_steps + 3
    assert _sizes(schedule, steps) == _modernbert_sizes(start, full, tokens, microbatch_tokens, steps)
    assert [size for size, _ in segments] == list(range(start, full))  # a microbatch at a time, none skipped here
    # The warmup trains at least its tokens, and its last step started below them.
    assert schedule.tokens_before(schedule.warmup_steps) >= tokens > schedule.tokens_before(schedule.warmup_steps - 1)


def test_hand_computed_sizes_steps_and_tokens():
    # (2, 5, 1001 tokens, 30 a microbatch): size 2 (60 a step) while below 223: 4 steps, 240 tokens; size 3 (90)
    # below 557: ceil(317 / 90) = 4 steps, 600; size 4 (120) below 1001: ceil(401 / 120) = 4 steps, 1080.
    assert warmup_sizes(2, 5, 1001, 30) == ((2, 4), (3, 4), (4, 4))
    schedule = BatchSchedule(30, 5, 1, warmup_sizes(2, 5, 1001, 30))
    assert [schedule.tokens_before(s) for s in (0, 4, 8, 12, 13)] == [0, 240, 600, 1080, 1230]
    assert [schedule.full_steps_before(s) for s in (0, 4, 8, 12, 13)] == [0, 8 / 5, 20 / 5, 36 / 5, 41 / 5]
    # From one microbatch the warmup takes about twice its tokens' worth of full steps, whatever the microbatch:
    # ModernBERT's 50B tokens at 4,608 x 1,024 a full step are 21,194 steps in 9 microbatches and in 6.
    assert warmup_sizes(1, 9, 50_000_000_000, 512 * 1024) == ((1, 2650),) + ((2, 2649), (3, 2649), (4, 2649)) + (
        (5, 2650), (6, 2649), (7, 2649), (8, 2649))
    assert sum(n for _, n in warmup_sizes(1, 6, 50_000_000_000, 768 * 1024)) == 21_194
    assert 0 < 21_194 - 2 * 50e9 / (4608 * 1024) < 8  # 2W / (B x seq), each size's steps rounded up
    # A size whose share the smaller ones already trained is skipped (ModernBERT's scheduler passes over it too);
    # a warmup starting at the full batch has no step.
    assert warmup_sizes(1, 4, 300, 100) == ((1, 1), (2, 1))
    assert _sizes(BatchSchedule(100, 4, 1, ((1, 1), (2, 1))), 4) == _modernbert_sizes(1, 4, 300, 100, 4)
    assert warmup_sizes(3, 3, 10**9, 100) == ()


def test_every_size_is_a_multiple_of_the_data_parallel_width_and_bad_settings_are_one_line():
    config = load_config("modernbert-base", require_data=False)
    validate(config, 16, require_data=False)  # v5litepod-16: data 16
    schedule = config.batch_schedule()
    assert (schedule.microbatch_rows, schedule.warmup_steps) == (512, 21_194)
    assert {schedule.rows_at(s) for s in range(0, 22_000, 50)} == set(range(512, 4609, 512))
    assert all(schedule.rows_at(s) % 16 == 0 for s in range(0, 22_000, 50))
    # The preset's steps train ModernBERT's 1.719T tokens (the yaml's max_duration) and no step more.
    assert schedule.tokens_before(config.train.steps) >= 1_719_000_000_000 > schedule.tokens_before(
        config.train.steps - 1)
    for overrides, message in [
        (["train.batch_size_warmup_min=700"], "train.batch_size_warmup_min=700 must be a multiple of the microbatch "
                                              "(train.batch_size / grad_accum_steps = 512) and at most "
                                              "train.batch_size=4608 (0: one microbatch)"),
        (["train.batch_size_warmup_min=5120"], "train.batch_size_warmup_min=5120 must be a multiple"),
        (["optimizer.warmup_steps=370000"], "optimizer.warmup_steps=370000 must be in [0, train.steps=374901] (with "
                                            "the batch-size warmup the schedule counts tokens: train.steps=374901 "
                                            "are 364,303.7 full steps' worth)"),
    ]:
        with pytest.raises(ValueError) as refused:
            load_config("modernbert-base", overrides, require_data=False)
        assert message in str(refused.value) and "\n" not in str(refused.value)
    # The microbatch itself must split over the data-parallel width (as without a warmup).
    with pytest.raises(ValueError, match="512 sequences per microbatch is not divisible by the data-parallel size "
                                         "24"):
        validate(config, 24, require_data=False)


def test_the_learning_rate_counts_tokens():
    # Sizes 2, 3, 4 of 5 microbatches, 4 steps each; a linear schedule with a warmup of 2 full steps' worth over a
    # run of 13 steps = 41 / 5 = 8.2 full steps' worth: lr * e / 2 below e = 2, then lr * (1 - (e - 2) / 6.2).
    schedule = BatchSchedule(30, 5, 1, ((2, 4), (3, 4), (4, 4)))
    config = optim.OptimizerConfig(learning_rate=1.0, warmup_steps=2, decay="linear")
    _, rate = optim.make_optimizer(config, schedule.full_steps_before(13),
                                   steps_done=schedule.traced_full_steps_before)
    done = {0: 0.0, 1: 0.4, 4: 1.6, 5: 2.2, 8: 4.0, 12: 7.2, 13: 8.2}   # microbatches before the step / 5
    want = {s: e / 2 if e < 2 else 1 - (e - 2) / 6.2 for s, e in done.items()}
    got = {s: float(jax.jit(rate)(jnp.int32(s))) for s in done}
    assert got == pytest.approx(want, abs=1e-6)
    assert got[13] == pytest.approx(0.0, abs=1e-6)  # 0 at the end of the run's last step
    # Without a warmup the clock is the step count: the schedule as it always was.
    plain = BatchSchedule(30, 5, 1)
    assert [plain.full_steps_before(s) for s in (0, 3, 7)] == [0, 3, 7]
    assert float(plain.traced_full_steps_before(jnp.int32(7))) == 7.0


def test_compile_prices_the_full_step_and_counts_the_warmups_steps_at_their_share():
    """The report of a full step (its figures given: `compile` prices the full batch's program as without a warmup,
    test_tpu_compile.py compiles one) for bert-tiny's 32 rows of 128 in 4 microbatches of 1,024 tokens, warmed up
    over 12,288 tokens: sizes 1, 2, 3 below 2,048, 6,144 and 12,288 tokens, 2 steps each; its 300 steps are
    2 + 4 + 6 + 294 x 4 = 1,188 microbatches = 297 full steps' worth of time."""
    from bertjax.cloud import compile as tpu_compile
    from bertjax.cloud.topologies import parse_topology
    from bertjax.pretraining.job import CompiledStep

    config = load_config("bert-tiny", ["train.grad_accum_steps=4", "train.batch_size_warmup_tokens=12288"],
                         require_data=False)
    topology = parse_topology("v5e:2x2")
    config = tpu_compile.job_for_topology(config, topology)
    result = tpu_compile.report(config, topology, 0.5, CompiledStep(True, 2**30, None), 30522)
    assert result["batch_warmup"]["sizes"] == [[8, 2], [16, 2], [24, 2]]
    assert (result["batch_warmup"]["steps"], result["batch_warmup"]["tokens"]) == (6, 12288)
    assert result["tokens"] == 1188 * 8 * 128 and result["steps"] == 300
    assert result["total_hours"] == pytest.approx(297 * result["step_seconds"] / 3600)
    lines = tpu_compile.describe(result).splitlines()
    assert lines[2] == ("batch-size warmup: 6 steps at 3 size(s) from 8 to 24 rows (a microbatch of 8 at a time, 2 "
                        "steps each), 12,288 tokens; then 32 rows a step")
    assert (f"300 steps (6 of them the warmup's, each at its share of the full step's microbatches: 297 full steps' "
            f"worth) = {result['total_hours']:.2f} h") in tpu_compile.describe(result)


# ---- runs -------------------------------------------------------------------------------------------------------

STEPS, EVERY = 9, 3
# One row a device a microbatch (the data-parallel width), three microbatches the full batch; the warmup's 384 tokens
# a device: size 1 (64 tokens a device a step) below ceil(384 / 3) = 128: 2 steps; size 2 below 384: 2 steps.
SIZES = [1, 1, 2, 2, 3, 3, 3, 3, 3]
# The learning rate: 1e-3, a warmup of 2 full steps' worth, linear to 0 over the run's 21 / 3 = 7 full steps' worth.
DONE = np.cumsum([0] + SIZES[:-1]).astype(np.float32) / np.float32(3)   # full steps' worth before each step


@pytest.fixture(scope="module")
def corpus(tmp_path_factory, minilm_dir):
    train_path, _ = write_demo_corpus(str(tmp_path_factory.mktemp("corpus")))
    return train_path, str(minilm_dir / "vocab.txt")


def _argv(workdir, corpus, *extra):
    devices = jax.device_count()
    train_path, vocab = corpus
    return ["pretrain", "--config", "bert-tiny", "--workdir", str(workdir), "--set", f"data.input={train_path}",
            "--set", f"data.vocab={vocab}", "--set", "data.max_seq_length=64",
            "--set", "data.max_predictions_per_seq=10",
            "--set", "data.doc_buffer_size=40", "--set", "data.shuffle_buffer=100", "--set", f"train.steps={STEPS}",
            "--set", f"train.batch_size={3 * devices}", "--set", "train.grad_accum_steps=3",
            "--set", f"train.batch_size_warmup_tokens={384 * devices}", "--set", "train.log_every=1",
            "--set", f"checkpoint.every={EVERY}", "--set", "optimizer.learning_rate=1e-3",
            "--set", "optimizer.warmup_steps=2", *extra]


def _overrides(argv) -> list[str]:
    return [argv[i + 1] for i, arg in enumerate(argv) if arg == "--set"]


@pytest.fixture(scope="module")
def warm_run(tmp_path_factory, corpus):
    """(workdir, console output) of the whole run, in this process (as test_pretrain.py's `_run_here`, for the
    module: capsys is a test's)."""
    from bertjax import cli

    workdir, out = tmp_path_factory.mktemp("warm"), io.StringIO()
    with pytest.MonkeyPatch.context() as monkeypatch, contextlib.redirect_stdout(out):
        monkeypatch.setattr(cli.host_memory, "keep_freed_memory_if_cpu_job", lambda environ: False)
        code = cli.main(_argv(workdir, corpus))
    assert code == 0, out.getvalue()[-3000:]
    return workdir, out.getvalue()


def test_the_run_takes_each_steps_size_and_counts_its_rows(warm_run, corpus):
    workdir, output = warm_run
    devices = jax.device_count()
    schedule = load_config("bert-tiny", _overrides(_argv(workdir, corpus))).batch_schedule()
    assert _sizes(schedule, STEPS) == SIZES
    lines = [_message(line) for line in output.splitlines()]
    assert (f"batch-size warmup: 4 steps at 2 size(s) from {devices:,} to {2 * devices:,} rows (a microbatch of "
            f"{devices:,} at a time, 2 steps each), {384 * devices:,} tokens; then {3 * devices:,} rows a step") \
        in lines
    # The first step at each new size compiles its program: said, timed apart, charged to compile_s.
    assert f"compiling the train step for {2 * devices:,} rows (step 3 includes it) ..." in lines
    assert f"compiling the train step for {3 * devices:,} rows (step 5 includes it) ..." in lines
    records = {r["step"]: r for r in _step_records(workdir)}
    timed = [s for s in records if "sequences_per_s" in records[s]]
    assert timed == [2, 4, 6, 7, 8, 9]  # not 1, 3, 5: each compiled a program
    for step in timed:  # the rows of that step (one step an interval), and its tokens
        record = records[step]
        rows = SIZES[step - 1] * devices
        assert record["sequences_per_s"] / record["steps_per_s"] == pytest.approx(rows)
        assert record["tokens_per_s"] / record["steps_per_s"] == pytest.approx(rows * 64)
    # The learning rate counted in tokens: each step's the schedule at the full steps' worth before it.
    want = [1e-3 * (e / 2 if e < 2 else 1 - (e - 2) / 5) for e in DONE]
    np.testing.assert_allclose([records[s]["learning_rate"] for s in range(1, STEPS + 1)], want, rtol=1e-6,
                               atol=1e-12)


def test_the_run_equals_steps_assembled_by_hand_at_each_smaller_batch(warm_run, corpus, minilm_dir):
    """The reference: the train step without a warmup (grad_accum_steps = k, the batch k microbatches) on rows
    taken by hand from the input pipeline, k(s) microbatches for step s as SIZES says, the learning rate from the
    hand-computed DONE: the run's losses, step for step, and its final weights, to the bit."""
    from bertjax import checkpoint as checkpoint_lib
    from bertjax import sharding
    from bertjax.data import input_source
    from bertjax.data import pipeline as pipeline_lib
    from bertjax.pretraining import state as train_state
    from bertjax.pretraining import step as train_step
    from bertjax.pretraining.job import build_job_step

    workdir, _ = warm_run
    config = load_config("bert-tiny", _overrides(_argv(workdir, corpus)))
    mesh = config.mesh.build()
    vocab = (minilm_dir / "vocab.txt").read_text().splitlines()
    job = build_job_step(config, mesh, len(vocab))
    state = train_state.init_sharded_state(job.rng, job.shardings, mesh, **job.state_args)
    optimizer, schedule = optim.make_optimizer(config.optimizer, 7.0,
                                               steps_done=lambda count: jnp.asarray(DONE)[count])
    steps = {k: train_step.compile_steps(model=job.state_args["model"], optimizer=optimizer, schedule=schedule,
                                         grad_accum_steps=k, nsp_loss=config.train.nsp_loss,
                                         state_shardings_tree=job.shardings,
                                         mesh=mesh)[0] for k in sorted(set(SIZES))}
    source = input_source.resolve(config.data)
    microbatches = iter(pipeline_lib.make_pretraining_dataset(source, jax.device_count()))
    losses = []
    with sharding.activate(mesh):
        for k in SIZES:
            taken = [{key: value.numpy() for key, value in next(microbatches).items()} for _ in range(k)]
            # The step without a warmup takes rows j * k + i as its microbatch i: interleaved.
            rows = {key: np.stack([t[key] for t in taken], axis=1).reshape((-1,) + taken[0][key].shape[1:])
                    for key in taken[0]}
            state, metrics = steps[k](state, sharding.global_batch(rows, mesh))
            losses.append(float(metrics["loss"]))
    run = _losses(workdir)
    assert [run[s] for s in range(1, STEPS + 1)] == losses
    saved = checkpoint_lib.restore_train_state(str(workdir / "checkpoints" / str(STEPS)), job.abstract_state)
    for a, b in zip(jax.tree_util.tree_leaves(saved.params), jax.tree_util.tree_leaves(state.params), strict=True):
        assert np.array_equal(np.asarray(a), np.asarray(b))


def test_stopped_mid_warmup_it_resumes_across_a_size_change_to_the_same_bits(warm_run, corpus, tmp_path,
                                                                            monkeypatch, capsys):
    """Stopped at step 3 (a checkpoint inside the second size), resumed: steps 4 (that size, the resumed run's
    first) and 5 onwards (the full batch, a new program) as the uninterrupted run's."""
    whole, _ = warm_run
    workdir = tmp_path / "stopped"
    stopped = _run_here(_argv(workdir, corpus, "--max-steps-this-run", "3"), monkeypatch, capsys,
                        status=STOPPED_EXIT)
    assert f"stopped at step 3/{STEPS}" in stopped
    resumed = _run_here(_argv(workdir, corpus), monkeypatch, capsys)
    assert f"resumed from {workdir}/checkpoints/3" in resumed
    expected, got = _losses(whole), _losses(workdir)
    assert [got[s] for s in range(4, STEPS + 1)] == [expected[s] for s in range(4, STEPS + 1)]
    for a, b in zip(_final_params(workdir, STEPS), _final_params(whole, STEPS), strict=True):
        assert np.array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.slow  # a run in a process of its own, SIGTERMed, then resumed (~1 min); the fast check above stops it
def test_sigterm_mid_warmup_then_resume_is_bit_exact(warm_run, corpus, tmp_path, monkeypatch, capsys):
    import sys

    whole, _ = warm_run
    workdir = tmp_path / "preempted"
    argv = [sys.executable, "-m", "bertjax.cli", *_argv(workdir, corpus)]
    code, output = _run_until(argv, "step 3/", signal.SIGTERM, devices=jax.device_count())
    assert code == STOPPED_EXIT, output[-3000:]
    stopped_at = int(output.split("preempted at step ")[1].split("/")[0])
    assert 3 <= stopped_at < 5, output[-3000:]  # inside the warmup: the full batch's first step still to come
    _run_here(_argv(workdir, corpus), monkeypatch, capsys)
    expected, got = _losses(whole), _losses(workdir)
    assert [got[s] for s in range(stopped_at + 1, STEPS + 1)] == [expected[s] for s in range(stopped_at + 1,
                                                                                             STEPS + 1)]
    for a, b in zip(_final_params(workdir, STEPS), _final_params(whole, STEPS), strict=True):
        assert np.array_equal(np.asarray(a), np.asarray(b))


def test_a_phase_from_init_refuses_to_warm_the_batch_up_again(warm_run, corpus, tmp_path, monkeypatch, capsys):
    whole, _ = warm_run
    workdir = tmp_path / "next_phase"
    code, _, err = _in_process(_argv(workdir, corpus, "--init", str(whole / "checkpoints" / str(STEPS))),
                               monkeypatch, capsys)
    devices = jax.device_count()
    assert code == 2 and "Traceback" not in err, err[-3000:]
    assert err.strip().splitlines()[-1] == (
        f"bertjax pretrain: error: --init {whole}/checkpoints/{STEPS}: train.batch_size_warmup_tokens={384 * devices} "
        f"would warm the batch up again (4 steps from {devices:,} rows), which is for a training from scratch: set "
        f"train.batch_size_warmup_tokens=0 for a phase that continues a model")
