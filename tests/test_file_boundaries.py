"""Every boundary where TensorFlow, TensorStore or a writer library (TensorBoard's events, W&B, TFRecords) touches a
user's file tells a failure there in one line naming the file and why, exit 2 (bertjax/runtime/errors.at_file): a
disk that filled during a TensorBoard flush was `OSError: [Errno 28]` naming no file (exit 1), an unreadable
data.input or tokenizer file TensorFlow's PermissionDeniedError (a traceback). Each failure is real: a full tmpfs
for the writers, file modes that a root process without its capability to read around them must obey for the
readers."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from bertjax.cli import job_error_line, main
from bertjax.runtime import errors
from tests.conftest import REPO_ROOT, fill_disk, limited, save_tiny_checkpoint, save_tiny_classifier_hf, \
    save_tiny_hf, xla_flags

FULL = "no space left on device"


def _denied(user: str) -> str:
    return (f"permission denied to {user}; give this user read access to it (chmod u+r, a directory u+rx), or run as "
            "its owner")


def _told(error: BaseException) -> str:
    """The error's line as the command line prints it (None: a bug's traceback, exit 1)."""
    line = job_error_line(error)
    assert line == str(error), (line, str(error))  # exit 2, the line as raised
    return line


# ------------------------------------------------------------------------------------------------ writers

def _tensorboard(full):
    from bertjax.runtime.tensorboard_events import ScalarWriter

    writer = ScalarWriter(str(full / "tensorboard"))
    writer.scalar("loss", 1.0, 1)
    writer.flush()


def _metrics_jsonl(full):
    from bertjax.pretraining.metrics import MetricsWriter

    MetricsWriter(str(full / "run"), total_steps=10).write(1, {"loss": 1.0})


def _tensorboard_restart(full):
    from bertjax.pretraining.metrics import _tensorboard_restart

    (full / "tensorboard").mkdir()
    _tensorboard_restart(str(full / "tensorboard"), 3)


def _goodput(full):
    from bertjax.pretraining.goodput import launcher_event

    launcher_event(str(full / "run"), "start", attempt=1)


def _shards(full):
    from bertjax.data.tfrecord import ShardWriter

    writer = ShardWriter(str(full / "shards"), 1)
    writer.write([b"x" * 200_000])
    writer.close()


def _output_file(full):
    from bertjax.runtime.outputs import write_whole

    write_whole(full / "predictions.jsonl", "x" * 200_000)


# boundary -> (what writes there, what its line names: a glob, FULL the full disk)
WRITERS = {
    "tensorboard events (a flush)": (_tensorboard, "FULL/tensorboard/events.out.tfevents.*.v2"),
    "metrics.jsonl": (_metrics_jsonl, "FULL/run/metrics.jsonl"),
    "tensorboard restart marker (tensorboard's EventFileWriter)": (_tensorboard_restart, "FULL/tensorboard"),
    "goodput launcher log": (_goodput, "FULL/run/goodput/launcher.jsonl"),
    "TFRecord shards (tf.io.TFRecordWriter)": (_shards, "shards to FULL/shards"),
    "an output file (outputs.write_whole)": (_output_file, "FULL/predictions.jsonl"),
}


@pytest.mark.parametrize("boundary", list(WRITERS))
def test_a_full_disk_at_each_writer_is_one_line_naming_the_file(boundary, small_disk):
    import fnmatch

    write, named = WRITERS[boundary]
    fill_disk(small_disk / "filler")
    with pytest.raises(errors.OutputWriteError) as caught:
        write(small_disk)
    line = _told(caught.value)
    assert fnmatch.fnmatchcase(line, f"cannot write {named.replace('FULL', str(small_disk))}: {FULL}"), line


WANDB = r"""
import sys
from bertjax.cli import job_error_line
from bertjax.pretraining.metrics import MetricsWriter
try:
    writer = MetricsWriter(sys.argv[1], total_steps=10, wandb_project="boundaries")
    writer.write(1, {"loss": 1.0})
    writer.close()
except Exception as error:
    print(type(error).__name__, job_error_line(error), sep="|")
"""


def test_a_full_disk_under_weights_and_biases_is_one_line_naming_its_directory(tmp_path, small_disk):
    """W&B (offline: its run files in WORKDIR/wandb) on a disk that fills, the run's other files on another: W&B's
    own OSError, named by its directory (in a process of its own: W&B's threads outlive the failure)."""
    pytest.importorskip("wandb")
    run = tmp_path / "run"
    run.mkdir()
    (run / "wandb").symlink_to(small_disk)
    fill_disk(small_disk / "filler")
    env = dict(os.environ, WANDB_MODE="offline", WANDB_SILENT="true", JAX_PLATFORMS="cpu", PYTHONPATH=str(REPO_ROOT))
    done = subprocess.run([sys.executable, "-c", WANDB, str(run)], env=env, cwd=REPO_ROOT, capture_output=True,
                          text=True, timeout=300)
    assert done.stdout.strip().splitlines()[-1] == f"OutputWriteError|cannot write {run / 'wandb'}: {FULL}", \
        done.stdout[-2000:] + done.stderr[-2000:]


def test_a_disk_that_fills_during_a_tensorboard_flush_ends_pretrain_in_one_line(tmp_path, small_disk, minilm_dir,
                                                                              capsys):
    """The probe's case end to end: the run's TensorBoard directory on a disk that fills (here, full from the
    start: the event file opens, its first flush fails), the checkpoints on another: one line naming the event
    file, exit 2, no traceback."""
    from bertjax.data.demo_corpus import write_demo_corpus

    train, _ = write_demo_corpus(str(tmp_path / "corpus"))
    workdir = tmp_path / "run"
    workdir.mkdir()
    (workdir / "tensorboard").symlink_to(small_disk)
    fill_disk(small_disk / "filler")
    code = main(["pretrain", "--config", "bert-tiny", "--workdir", str(workdir), "--set", f"data.input={train}",
                 "--set", f"data.vocab={minilm_dir / 'vocab.txt'}", "--set", "data.max_seq_length=32",
                 "--set", "data.max_predictions_per_seq=5", "--set", "train.batch_size=8", "--set", "train.steps=2",
                 "--set", "train.log_every=1", "--set", "checkpoint.every=2"])
    err = capsys.readouterr().err
    last = err.strip().splitlines()[-1]
    assert code == 2 and "Traceback" not in err, err[-3000:]
    assert last.startswith(f"bertjax pretrain: error: cannot write {workdir}/tensorboard/events.out.tfevents.") and \
        last.endswith(f": {FULL}"), last


# ------------------------------------------------------------------------------------------------ readers

# Runs each case's `bertjax` argv in this one process (a process with its file access dropped: see conftest.limited)
# and prints {"case", "code", "last", "traceback"} per case.
READS = r"""
import contextlib, io, json, sys, traceback
from bertjax.cli import main
for name, argv in json.loads(sys.argv[1]):
    err, tb = io.StringIO(), ""
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            code = main(argv)
    except BaseException:
        code, tb = 1, traceback.format_exc()
    lines = err.getvalue().strip().splitlines()
    print(json.dumps({"case": name, "code": code, "last": lines[-1] if lines else "", "traceback": tb}), flush=True)
"""


@pytest.fixture(scope="module")
def inputs(tmp_path_factory, minilm_dir):
    """A copy of each kind of file the commands read (each case denies its own), and the models they read."""
    from bertjax.data.demo_corpus import write_demo_corpus
    from tests import modernbert_fixture

    root = tmp_path_factory.mktemp("inputs")
    train, _ = write_demo_corpus(str(root / "corpus"))
    shutil.copy(minilm_dir / "vocab.txt", root / "vocab.txt")
    modernbert_fixture.bpe_tokenizer().save_pretrained(str(root / "bpe"))
    (root / "folder").mkdir()
    shutil.copy(train, root / "folder" / "a.txt")
    (root / "rows.csv").write_text("text,label\n" + "".join(f"row {i} of a table,{'ab'[i % 2]}\n" for i in range(16)))
    (root / "lines.txt").write_text("".join(f"line {i} to embed\n" for i in range(8)))
    assert main(["data", "create", "--input", train, "--vocab", str(root / "vocab.txt"), "--out",
                 str(root / "shards"), "--max-seq-length", "32", "--max-predictions", "5"]) == 0
    save_tiny_hf(root / "hf", minilm_dir / "vocab.txt", seed=0)
    save_tiny_classifier_hf(root / "classifier", minilm_dir / "vocab.txt")
    save_tiny_checkpoint(root / "checkpoint", minilm_dir / "vocab.txt", seed=0)
    return root


def test_an_unreadable_file_at_each_reader_is_one_line_naming_it(inputs, tmp_path):
    """Each reader in turn meets a file (or folder) it may not read: `cannot read PATH: permission denied to USER;
    ...`, exit 2. Before: TensorFlow's PermissionDeniedError (input kind and format detection, a corpus folder,
    vocab.txt, a shard read by tf.data), safetensors' "No such file or directory", a bare `[Errno 13]`."""
    import getpass

    root = tmp_path / "inputs"
    shutil.copytree(inputs, root, symlinks=True)
    corpus, vocab, shards = root / "corpus" / "train.txt", root / "vocab.txt", root / "shards"
    readable = root / "corpus" / "readable.txt"  # the corpus of the cases that deny another file
    shard = next(shards.glob("*.tfrecord"))
    pretrain = ["pretrain", "--config", "bert-tiny", "--set", "train.steps=2", "--set", "data.max_seq_length=32",
                "--set", "data.max_predictions_per_seq=5", "--set", "train.batch_size=8"]

    def run(workdir, data, vocab_file):
        return pretrain + ["--workdir", str(tmp_path / workdir), "--set", f"data.input={data}"] + (
            ["--set", f"data.vocab={vocab_file}"] if vocab_file else [])

    # case -> (argv, the path denied, the path the line names, and what it names it of)
    cases = {
        "pretrain data.input (the input kind detected)": (run("w1", corpus, vocab), corpus, corpus),
        "pretrain data.input a folder": (run("w2", root / "folder", vocab), root / "folder", root / "folder"),
        "pretrain data.vocab (vocab.txt)": (run("w3", readable, root / "vocab2.txt"), root / "vocab2.txt",
                                            root / "vocab2.txt"),
        "pretrain data.vocab (tokenizer.json)": (run("w4", readable, root / "bpe" / "tokenizer.json"),
                                                 root / "bpe" / "tokenizer.json", root / "bpe" / "tokenizer.json"),
        "pretrain on shards (tf.data reads a shard)": (run("w5", shards, None), shard, f"{shard} (of data.input)"),
        "data create --input": (["data", "create", "--input", str(root / "corpus2.txt"), "--vocab", str(vocab),
                                 "--out", str(tmp_path / "o1")], root / "corpus2.txt", root / "corpus2.txt"),
        "data create --vocab": (["data", "create", "--input", str(readable), "--vocab", str(root / "vocab3.txt"),
                                 "--out", str(tmp_path / "o2")], root / "vocab3.txt", root / "vocab3.txt"),
        "vocab train --input": (["vocab", "train", "--input", str(root / "corpus3.txt"), "--out",
                                 str(tmp_path / "o3"), "--vocab-size", "100", "--type", "wordpiece"],
                                root / "corpus3.txt", root / "corpus3.txt"),
        "finetune classify --train": (["finetune", "classify", "--train", str(root / "rows.csv"), "--init",
                                       str(root / "checkpoint"), "--workdir", str(tmp_path / "w6")],
                                      root / "rows.csv", root / "rows.csv"),
        "predict --input": (["predict", "--model", str(root / "classifier"), "--input", str(root / "rows2.csv")],
                            root / "rows2.csv", root / "rows2.csv"),
        "embed --input": (["embed", "--checkpoint", str(root / "hf"), "--input", str(root / "lines.txt"),
                           "--output", str(tmp_path / "e.npy")], root / "lines.txt", root / "lines.txt"),
        "an HF model's safetensors": (["info", str(root / "hf2")], root / "hf2" / "model.safetensors",
                                      root / "hf2" / "model.safetensors"),
        "an HF model's config.json": (["info", str(root / "hf3")], root / "hf3" / "config.json",
                                      root / "hf3" / "config.json"),
    }
    for copy, source in (("corpus/readable.txt", corpus), ("vocab2.txt", vocab), ("vocab3.txt", vocab),
                         ("corpus2.txt", corpus), ("corpus3.txt", corpus), ("rows2.csv", root / "rows.csv"),
                         ("hf2", root / "hf"), ("hf3", root / "hf")):
        (shutil.copytree if source.is_dir() else shutil.copy)(source, root / copy)
    for _, denied, _ in cases.values():
        denied.chmod(0)
    try:
        probe = subprocess.run(limited(["/bin/cat", str(corpus)], drop_file_access=True), capture_output=True)
        if probe.returncode == 0:
            pytest.skip("this machine reads files whatever their mode (root without a capability bounding set)")
        argvs = [(name, argv) for name, (argv, _, _) in cases.items()]
        env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=xla_flags(1), PYTHONPATH=str(REPO_ROOT))
        done = subprocess.run(limited([sys.executable, "-c", READS, json.dumps(argvs, default=str)],
                                      drop_file_access=True), env=env, cwd=REPO_ROOT, capture_output=True, text=True,
                              timeout=600)
    finally:
        for _, denied, _ in cases.values():
            denied.chmod(0o755)
    results = {r["case"]: r for r in map(json.loads, done.stdout.strip().splitlines())}
    assert sorted(results) == sorted(cases), done.stderr[-3000:]
    for name, (argv, _, named) in cases.items():
        result, command = results[name], argv[0]
        assert (result["code"], result["traceback"]) == (2, ""), (name, result)
        assert result["last"] == f"bertjax {command}: error: cannot read {named}: {_denied(getpass.getuser())}", \
            (name, result["last"])
