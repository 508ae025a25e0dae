"""The pieces the pretraining loop calls, each on hand-made inputs: the step clock's throughput (against FLOPs
counted by hand from the formula in metrics.train_flops' docstring), the goodput account's charges, the
non-finite guard, and the resume's choice of step. The loop itself is tested end to end in test_pretrain.py."""
import logging
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bertjax.checkpoint import JOB_CONFIG, PARAMS, ResumeRefused, StepCheckpointer
from bertjax.runtime.console import Console
from bertjax.model.config import BertConfig
from bertjax.pretraining import goodput, progress
from bertjax.pretraining.batch_schedule import BatchSchedule
from bertjax.pretraining.config import check_resume_config, load_config
from bertjax.pretraining.loop import _NonFiniteGuard, majority_nsp_accuracy
from bertjax.pretraining.metrics import MetricsWriter
from bertjax.pretraining.step import TooManyNonFiniteSteps

BATCH, SEQ_LEN, PEAK = 2, 6, 1e9
# hidden 4, 1 layer, intermediate 8, vocabulary 10, rows of 6: per real token 8*16 + 4*4*8 + 4*6*4 = 352 forward
# FLOPs, per masked token 2*16 + 2*4*10 = 112, per instance 2*16 + 2*4*2 = 48; training is 3x the forward.
CONFIG = BertConfig(vocab_size=10, hidden_size=4, num_hidden_layers=1, num_attention_heads=1, intermediate_size=8)


def _counts(real, masked, instances):
    return {"real_tokens": jnp.float32(real), "masked_tokens": jnp.float32(masked), "instances": jnp.float32(instances)}


@pytest.fixture
def clock(tmp_path):
    account = goodput.RunAccount(str(tmp_path), enabled=False)
    writer = MetricsWriter(str(tmp_path), 100, enabled=False, console=Console(enabled=False))
    return progress.StepClock(0, 100, batches=BatchSchedule(BATCH, 1, SEQ_LEN), seq_len=SEQ_LEN, bert_config=CONFIG,
                              peak_flops=PEAK,
                              sbo=False, run_start=time.perf_counter(), account=account, writer=writer,
                              console=Console(enabled=False))


def _per_step(values: dict) -> dict:
    """Each rate divided by steps_per_s: the amount per step, whatever the seconds were."""
    return {k: v / values["steps_per_s"] for k, v in values.items() if k != "steps_per_s"}


def test_the_clock_times_the_steps_after_the_compiling_one(clock):
    clock.before_step(0)
    clock.after_step(1, _counts(1000, 1000, 1000))  # compiles: neither timed nor counted
    assert clock.account.timed_steps == 0 and clock.account.clock.seconds["compile_s"] > 0
    clock.after_step(2, _counts(10, 3, 2))
    clock.after_step(3, _counts(8, 2, 1))
    per_step = _per_step(clock.interval())
    flops = 3 * ((10 + 8) * 352 + (3 + 2) * 112 + (2 + 1) * 48) / 2  # 10560 per step
    assert per_step == pytest.approx({"sequences_per_s": BATCH, "tokens_per_s": BATCH * SEQ_LEN,
                                      "real_tokens_per_s": 9, "instances_per_s": 1.5,
                                      "tflops_per_device": flops / jax.device_count() / 1e12,
                                      "mfu": flops / jax.device_count() / PEAK}, rel=1e-5)
    assert clock.account.timed_steps == 2
    assert clock.interval() == {}  # no step since: nothing to report, nothing added to the run's mean
    clock.after_step(4, _counts(12, 4, 3))
    clock.interval()
    mean = _per_step(clock.mean())
    assert mean["real_tokens_per_s"] == pytest.approx(30 / 3)
    assert mean["instances_per_s"] == pytest.approx(6 / 3)
    assert mean["sequences_per_s"] == pytest.approx(BATCH)


def test_a_batch_size_warmups_next_size_compiles_apart_and_each_step_counts_its_rows(tmp_path):
    """Steps of 1 then 2 microbatches of BATCH rows: the first step at 2 compiles its program, so it is charged to
    compile_s and left out of the interval and the ETA; the timed steps count their own rows."""
    account = goodput.RunAccount(str(tmp_path), enabled=False)
    writer = MetricsWriter(str(tmp_path), 100, enabled=False, console=Console(enabled=False))
    lines = []
    console = Console(enabled=False)
    console.line = lines.append
    clock = progress.StepClock(0, 100, batches=BatchSchedule(BATCH, 2, SEQ_LEN, ((1, 2),)), seq_len=SEQ_LEN,
                               bert_config=CONFIG, peak_flops=PEAK, sbo=False, run_start=time.perf_counter(),
                               account=account, writer=writer, console=console)
    for step, counts in enumerate([_counts(1, 1, 1), _counts(10, 3, 2), _counts(1000, 1000, 1000),
                                   _counts(20, 6, 4)]):
        clock.before_step(step)
        clock.after_step(step + 1, counts)
    assert lines[2:] == [f"compiling the train step for {2 * BATCH} rows (step 3 includes it) ...",
                         lines[3]] and lines[3].startswith("step 3 compiled and ran in ")
    assert account.timed_steps == 2 and writer._aside_steps == 1.0  # step 3: one full step's worth set aside
    per_step = _per_step(clock.interval())  # steps 2 and 4: BATCH and 2 BATCH rows
    assert per_step["sequences_per_s"] == pytest.approx(1.5 * BATCH)
    assert per_step["tokens_per_s"] == pytest.approx(1.5 * BATCH * SEQ_LEN)
    assert per_step["real_tokens_per_s"] == pytest.approx(15)


def test_the_summary_says_how_far_how_fast_and_where(clock, tmp_path):
    assert clock.mean() is None
    lines = progress.summary("preempted", 7, clock, {"loss": 2.5}, [(0, {"mlm_accuracy": 0.1,
                             "most_frequent_token_accuracy": 0.05}), (4, {"mlm_accuracy": 0.3,
                             "most_frequent_token_accuracy": 0.05})], 5, str(tmp_path), clock.writer)
    assert lines[0].startswith("preempted at step 7/100: 7 steps in ") and "timed steps" not in lines[0]
    assert lines[1] == "  last step: loss=2.5"
    assert lines[2] == ("  eval mlm_accuracy: 0.1 at step 0 -> 0.3 at step 4 (best 0.3 at step 4; most frequent "
                        "token 0.05)")
    assert lines[3] == f"  checkpoints: {tmp_path}/checkpoints (newest: step 5)"
    assert lines[4].startswith("  metrics: ") and len(lines) == 5  # how to go on: the run's last line (loop.py)
    with_nsp = progress.summary("completed", 7, clock, {}, [(4, {"mlm_accuracy": 0.3, "nsp_accuracy": 0.625,
                                "most_frequent_token_accuracy": 0.05, "majority_nsp_accuracy": 0.6})], 5,
                                str(tmp_path), clock.writer)
    assert "  eval nsp_accuracy: 0.625 at step 4 (most frequent label 0.6)" in with_nsp


def test_the_nsp_baseline_is_the_share_of_the_most_frequent_label():
    """Hand-counted: 3 of 5 unpacked rows are random next sentences (label 1): 0.6. Packed rows hold up to 2
    instances, the weights saying which are real: 3 real, 2 of them label 0: 2/3."""
    unpacked = [{"next_sentence_labels": np.array([[1], [0], [1]])}, {"next_sentence_labels": np.array([[1], [0]])}]
    assert majority_nsp_accuracy(unpacked) == pytest.approx(0.6)
    packed = [{"next_sentence_labels": np.array([[0, 1], [0, 1]]),
               "next_sentence_weights": np.array([[1, 1], [1, 0]])}]
    assert majority_nsp_accuracy(packed) == pytest.approx(2 / 3)


def test_a_charge_splits_the_time_between_the_steps_and_its_category(tmp_path):
    account = goodput.RunAccount(str(tmp_path), enabled=False, start=time.time())
    account.mark("startup_s")
    time.sleep(0.05)  # the loop's own time since the last mark: productive
    with account.charged_to("eval_s"):
        time.sleep(0.1)
    seconds = account.clock.seconds
    assert seconds["step_s"] >= 0.05 and seconds["eval_s"] >= 0.1
    eval_before = seconds["eval_s"]
    with pytest.raises(RuntimeError), account.charged_to("eval_s"):
        raise RuntimeError("a failed eval")
    assert seconds["eval_s"] == eval_before  # what a failure took goes to the next mark (the run's end)
    record = account.record()
    assert sum(record[k] for k in goodput.CATEGORIES) == pytest.approx(record["wall_s"], abs=0.01)


def test_the_guard_stops_once_the_limit_of_non_finite_steps_in_a_row_is_reached():
    guard = _NonFiniteGuard(limit=3)
    for step, consecutive in enumerate([0, 1, 2, 0, 1, 2], start=1):
        guard.check(step, {"nonfinite_consecutive": jnp.int32(consecutive)})
    guard.check(7, {"nonfinite_consecutive": jnp.int32(3)})  # read one step late: step 7's count not yet
    with pytest.raises(TooManyNonFiniteSteps, match=r"^3 consecutive steps had a non-finite gradient \(up to "
                                                    r"step 7\)"):
        guard.check(8, {"nonfinite_consecutive": jnp.int32(0)})


def test_resume_sets_an_unreadable_step_aside_but_lets_a_refused_config_through(tmp_path):
    """restore_newest, which the pretraining and fine-tune resumes call: a step whose files are cut is set aside
    and the one before it restored; a config the steps refuse is the config's fault, so it propagates and no step
    is set aside."""
    saved = load_config("bert-tiny", ["data.input=x", "data.vocab=v"]).to_dict()
    checkpointer = StepCheckpointer(tmp_path / "steps", keep=3)
    for step in (1, 2):
        checkpointer.save_items(step, {PARAMS: {"w": np.full(4096, step, np.float32)}, JOB_CONFIG: saved})
    abstract = {PARAMS: {"w": jax.ShapeDtypeStruct((4096,), np.float32)}, JOB_CONFIG: None}
    bigger = load_config("bert-tiny", ["data.input=x", "data.vocab=v", "train.steps=600"]).to_dict()

    def restore(step, current):
        items = checkpointer.restore_items(step, abstract)
        check_resume_config(items[JOB_CONFIG], current, allow_changes=False, where=checkpointer.step_dir(step))
        return items[PARAMS]["w"]

    lines = []
    with pytest.raises(ResumeRefused, match=r"train\.steps: 300 -> 600"):
        checkpointer.restore_newest(lambda step: restore(step, bigger), lines.append)
    assert lines == [] and checkpointer.steps() == [1, 2]
    assert sorted(p.name for p in (tmp_path / "steps").iterdir()) == ["1", "2"]

    for path in (tmp_path / "steps" / "2" / PARAMS).rglob("*"):
        if path.is_file() and path.stat().st_size > 64:
            path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    step, values = checkpointer.restore_newest(lambda step: restore(step, saved), lines.append)
    assert step == 1 and np.all(np.asarray(values) == 1)
    [warning] = lines
    assert f"cannot restore {tmp_path}/steps/2 (" in warning and f"moved it to {tmp_path}/steps/2.corrupt" in warning
    assert checkpointer.steps() == [1] and (tmp_path / "steps" / "2.corrupt").is_dir()
    checkpointer.close()


def test_reads_a_failed_restore_leaves_in_flight_complete_without_a_traceback(tmp_path, monkeypatch):
    """Orbax closes a restore's event loop when its first read fails; TensorStore completes the other reads on it
    later, each an unraisable RuntimeError('Event loop is closed') (a dozen tracebacks after the set-aside
    warning). After restore_newest those are dropped, and only those."""
    import asyncio
    import sys

    import tensorstore as ts

    reported = []
    monkeypatch.setattr(sys, "unraisablehook", reported.append)
    StepCheckpointer(tmp_path / "steps", keep=1).restore_newest(lambda step: None, print)

    def read_completed_after_its_loop_closed():
        promise, read = ts.Promise.new()

        async def wait_for_read():
            return await read

        async def restore():
            asyncio.ensure_future(wait_for_read())  # another read, in flight
            await asyncio.sleep(0.01)
            raise ValueError("the first read failed")

        loop = asyncio.new_event_loop()
        with pytest.raises(ValueError):
            loop.run_until_complete(restore())
        loop.close()
        promise.set_result(1)  # TensorStore's thread completes the read: call_soon_threadsafe on the closed loop

    read_completed_after_its_loop_closed()
    assert reported == []
    sys.unraisablehook(type("Unraisable", (), dict(exc_type=RuntimeError, exc_value=RuntimeError("other"),
                                                   exc_traceback=None))())
    assert [str(u.exc_value) for u in reported] == ["other"]  # anything else is still reported


def test_a_failed_restores_abandoned_reads_are_not_logged_as_unretrieved_task_exceptions(tmp_path, caplog):
    """The other reads of a failed restore fail too (the same damaged files); Orbax never awaits them, so asyncio
    logged each as 'Task exception was never retrieved' with a traceback when collected (a CI run's stderr). After
    restore_newest those are dropped; any other task's failure is still logged."""
    import asyncio
    import gc

    import tensorstore as ts

    StepCheckpointer(tmp_path / "steps", keep=1).restore_newest(lambda step: None, print)

    async def read_missing_array():
        await ts.open({"driver": "zarr", "kvstore": {"driver": "file", "path": str(tmp_path / "missing")}},
                      open=True)

    async def fail_otherwise():
        raise ValueError("not a read")

    async def restore():
        asyncio.ensure_future(read_missing_array())  # abandoned, never awaited
        asyncio.ensure_future(fail_otherwise())
        await asyncio.sleep(0.5)

    loop = asyncio.new_event_loop()
    with caplog.at_level(logging.ERROR, logger="asyncio"):
        loop.run_until_complete(restore())
        loop.close()
        gc.collect()
    unretrieved = [r for r in caplog.records if r.getMessage().startswith("Task exception was never retrieved")]
    assert [str(r.exc_info[1]) for r in unretrieved] == ["not a read"]


def test_progress_lines_come_every_tenth_of_a_run_or_30_seconds_whichever_is_first():
    """The rule both training loops print by (pretraining between its metric lines, fine-tuning as metric lines):
    log_every's steps and the last, and at least every tenth of the run and every every_s seconds."""
    from bertjax.runtime.console import LineSchedule

    short = LineSchedule(20, log_every=50)
    assert [step for step in range(1, 21) if short.due(step)] == list(range(2, 21, 2))
    long = LineSchedule(1000, log_every=50)
    assert [step for step in range(1, 1001) if long.due(step)] == list(range(50, 1001, 50))
    slow = LineSchedule(1000, log_every=50, every_s=1.0)
    due = []
    for step in range(1, 6):
        time.sleep(1.1 if step == 3 else 0)  # step 3 comes 1.1 s after the start: a line, then none till 50
        due.append(slow.due(step))
    assert due == [False, False, True, False, False]


def test_the_eta_extrapolates_from_steps_that_did_not_compile(monkeypatch):
    """A fine-tune's step 2 of a length not met before compiled again: the ETA at step 2 extrapolated that compile
    over the whole run (a 10-minute MiniLM run said 1h53m). Time set aside (a compiling step, the first
    evaluation) is not extrapolated from: "?" until a step that did not compile, then their mean."""
    now = [1000.0]
    monkeypatch.setattr(time, "time", lambda: now[0])
    lines = []
    console = Console()
    console.line = lines.append
    writer = MetricsWriter("", 600, enabled=False, console=console)
    writer.mark_start(1)            # after the first, compiling, step
    now[0] += 60.5                  # step 2: another length, compiled again and ran: 60.5 s
    writer.set_aside(60.5, steps=1)
    writer.console(2, {})
    assert lines[-1] == "step 2/600 eta ?"   # was 10h03m (60.5 s x 598)
    now[0] += 1.0                   # step 3 in 1 s
    writer.console(3, {})
    assert lines[-1] == "step 3/600 eta 9m57s"   # 1 s x 597
    now[0] += 30.0                  # the first evaluation: it compiles the predict step
    writer.set_aside(30.0)
    now[0] += 2.0                   # step 4 in 2 s
    writer.console(4, {})
    assert lines[-1] == "step 4/600 eta 14m54s"   # (3 s / 2 steps) x 596
