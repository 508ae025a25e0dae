"""metrics.jsonl and TensorBoard after a kill and a resume: one run's steps, in order, strict JSONL."""
import json

import numpy as np
import pytest
from tensorboard.backend.event_processing.plugin_event_accumulator import (
    EventAccumulator,
)
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


def _wandb_history(run_file):
    """The history records of an offline W&B run file (a LevelDB-style log of W&B's protobuf Records)."""
    import struct

    from wandb.proto import wandb_internal_pb2

    data, block, rows, pending = run_file.read_bytes(), 32768, [], b""
    pos = 7  # the file header (":W&B", a magic, the version)
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if length == 0 and kind == 0:
            break
        pending += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a whole record, or its last chunk
            record = wandb_internal_pb2.Record.FromString(pending)
            pending = b""
            if record.WhichOneof("record_type") == "history":
                rows.append({i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item})
    return rows


def test_metrics_also_go_to_weights_and_biases(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    writer = MetricsWriter(str(tmp_path / "run"), 3, start_step=0, wandb_project="bertjax-test",
                           run_config={"train": {"steps": 3}})
    writer.write(1, {"loss": 2.5})
    writer.write(2, {"loss": 2.0}, prefix="eval_")
    writer.write_event(2, "goodput", {"wall_s": 10.0, "label": "x"})
    writer.close()
    [run_file] = (tmp_path / "run" / "wandb").glob("offline-run-*/run-*.wandb")
    rows = _wandb_history(run_file)
    assert [(r["_step"], {k: v for k, v in r.items() if not k.startswith("_")}) for r in rows] == [
        (1, {"loss": 2.5}), (2, {"eval_loss": 2.0, "goodput/wall_s": 10.0})]


def test_scalars_read_back_as_tensorflows_summary_writer_writes_them(tmp_path):
    """bertjax's TensorFlow-free event file against tf.summary's (through flax's writer): TensorBoard reads the same
    tags, steps, values and plugin from both."""
    from flax.metrics import tensorboard

    from bertjax.runtime.tensorboard_events import ScalarWriter

    def read(logdir):
        events = EventAccumulator(str(logdir), size_guidance={"tensors": 0})
        events.Reload()
        tags = sorted(events.Tags()["tensors"])
        return {tag: [(e.step, float(tensor_util.make_ndarray(e.tensor_proto)), e.tensor_proto.dtype)
                      for e in events.Tensors(tag)] for tag in tags}, \
            {tag: events.SummaryMetadata(tag).plugin_data.plugin_name for tag in tags}

    for name, writer in (("ours", ScalarWriter(str(tmp_path / "ours"))),
                         ("tf", tensorboard.SummaryWriter(str(tmp_path / "tf")))):
        for step in range(1, 4):
            writer.scalar("loss", 1.0 / step, step)
            writer.scalar("eval/accuracy", 0.25 * step, step)
        writer.close()
    ours, tf = read(tmp_path / "ours"), read(tmp_path / "tf")
    assert ours == tf and ours[0]["loss"][2][:2] == (3, float(np.float32(1 / 3)))
