"""metrics.jsonl and TensorBoard after a kill and a resume: one run's steps, in order, strict JSONL."""
import json

from tensorboard.backend.event_processing.plugin_event_accumulator import EventAccumulator
from tensorboard.util import tensor_util

from bertjax.pretraining.metrics import MetricsWriter


def _losses(logdir):
    events = EventAccumulator(str(logdir), size_guidance={"tensors": 0}, purge_orphaned_data=True)  # as TensorBoard reads
    events.Reload()
    return [(e.step, round(float(tensor_util.make_ndarray(e.tensor_proto)), 3)) for e in events.Tensors("loss")]


def test_a_resume_drops_what_the_killed_run_logged_past_its_checkpoint(tmp_path):
    quiet = type("Quiet", (), {"line": lambda self, message: said.append(message)})()
    said = []
    killed = MetricsWriter(str(tmp_path), 20, console=quiet)
    for step in range(1, 15):  # checkpointed at 10, killed after logging 14 and while writing 15
        killed.write(step, {"loss": 100.0 + step})
    killed.close()
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 15, "loss": 11')

    resumed = MetricsWriter(str(tmp_path), 20, console=quiet, start_step=10)
    for step in range(11, 13):
        resumed.write(step, {"loss": float(step)})
    resumed.close()

    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]  # strict
    assert [(r["step"], r["loss"]) for r in records] == [(s, 100.0 + s) for s in range(1, 11)] + [(11, 11.0),
                                                                                                 (12, 12.0)]
    assert said == [f"{tmp_path}/metrics.jsonl: dropped 4 record(s) logged past step 10 (recomputed now) and a "
                    "line cut by the kill"]
    assert _losses(tmp_path / "tensorboard") == [(s, 100.0 + s) for s in range(1, 11)] + [(11, 11.0), (12, 12.0)]


def test_a_first_run_writes_without_dropping(tmp_path):
    writer = MetricsWriter(str(tmp_path), 5, start_step=0)
    writer.write(1, {"loss": 1.0})
    writer.close()
    assert [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [1]
