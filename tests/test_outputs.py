"""Every output a command produces is whole or absent and has one writer (bertjax/runtime/outputs.py), and a stop signal
ends a command in one line with nothing of it left behind (preemption.Stopped): across the commands that write an
output file or directory."""
import os
import signal
import subprocess
import sys

import numpy as np
import pytest

from bertjax.cli import main
from tests import stall_watch
from tests.conftest import REPO_ROOT, fill_disk, save_tiny_classifier_hf, save_tiny_hf, xla_flags

WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa".split()


def _sentences(count: int) -> list[str]:
    return [" ".join(WORDS[(i * 7 + j * 3) % len(WORDS)] for j in range(6 + i % 5)) for i in range(count)]


@pytest.fixture(scope="module")
def models(tmp_path_factory, minilm_dir):
    """A tiny HF encoder and a tiny HF sequence classifier (untrained), and the vocabulary they share."""
    root = tmp_path_factory.mktemp("models")
    vocab = minilm_dir / "vocab.txt"
    return {"hf": save_tiny_hf(root / "hf", vocab, seed=0), "classifier": save_tiny_classifier_hf(root / "cls", vocab),
            "vocab": str(vocab)}


def _inputs(folder, rows: int) -> dict:
    """predict's CSV and embed's lines of `rows` texts in `folder`."""
    folder.mkdir(parents=True, exist_ok=True)
    texts = _sentences(rows)
    (folder / "in.csv").write_text("text\n" + "".join(t + "\n" for t in texts))
    (folder / "in.txt").write_text("".join(t + "\n" for t in texts))
    return {"csv": str(folder / "in.csv"), "txt": str(folder / "in.txt")}


# command -> (the flag naming its output, its argv for an output and inputs, whether the output is a directory)
COMMANDS = {
    "predict": ("--output", lambda m, i, out: ["predict", "--model", m["classifier"], "--input", i["csv"],
                                               "--output", out, "--max-seq-length", "32"], False),
    "embed": ("--output", lambda m, i, out: ["embed", "--checkpoint", m["hf"], "--input", i["txt"], "--output", out,
                                             "--max-len", "32"], False),
    "export": ("--out", lambda m, i, out: ["export", m["hf"], "--out", out], True),
    "convert": ("--out", lambda m, i, out: ["convert", m["hf"], "--from", "hf", "--out", out], True),
}


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_a_full_disk_keeps_the_earlier_output_and_leaves_no_part_of_the_new_one(command, models, small_disk, tmp_path,
                                                                               capsys):
    """A disk that fills while the output is written: one line naming the output and the full disk; an earlier
    output (predict's, embed's) is as it was, not cut to what fitted; nothing else is left on the disk (no partial
    file or directory, no lock). The model directories do not fit the 3 MB disk at all."""
    flag, argv, directory = COMMANDS[command]
    out = small_disk / ("out" if directory else "out.data")
    if not directory:  # a good output of a few rows first, then one of many that cannot fit beside it
        assert main(argv(models, _inputs(tmp_path / "few", 3), str(out))) == 0
        earlier = out.read_bytes()
        fill_disk(small_disk / "filler", leave=12288)  # the lock file's page, and little more
    capsys.readouterr()
    assert main(argv(models, _inputs(tmp_path / "many", 400), str(out))) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == \
        f"bertjax {command}: error: cannot write {out}: no space left on device"
    if directory:
        assert os.listdir(small_disk) == []
    else:
        assert out.read_bytes() == earlier
        assert sorted(os.listdir(small_disk)) == ["filler", out.name]


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_a_second_writer_of_one_output_is_refused_naming_the_holder(command, models, tmp_path, capsys):
    """While a run holds an output (here this test process, through the commands' own lock), a second run writing
    it is refused in one line naming the holder, before any work, and writes nothing; another spelling of the path
    is the same output."""
    from bertjax.runtime.outputs import one_writer

    flag, argv, directory = COMMANDS[command]
    inputs = _inputs(tmp_path / "in", 3)
    out = tmp_path / "out"
    (tmp_path / "sub").mkdir()
    with one_writer(str(out), flag):
        capsys.readouterr()
        assert main(argv(models, inputs, str(tmp_path / "sub" / ".." / "out"))) == 2
        line = capsys.readouterr().err.strip().splitlines()[-1]
    assert f"{flag} {tmp_path / 'sub' / '..' / 'out'} is in use by another job (pid {os.getpid()} on " in line, line
    assert f"or use another {flag}" in line
    assert sorted(os.listdir(tmp_path)) == ["in", "sub"]
    assert main(argv(models, inputs, str(out))) == 0  # released: the next run writes it


def _env() -> dict:
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=xla_flags(1), PYTHONPATH=str(REPO_ROOT))
    return env


@pytest.mark.parametrize("command", ["export", "convert"])
def test_two_runs_into_one_out_at_once_one_writes_it_and_the_other_is_refused(command, models, tmp_path):
    """Two exports to one --out at once both said "wrote" (one export lost); two converts: the loser's raw
    [Errno 17]. Now one writes it whole and the other is refused in one line: the out is in use, or, when the
    first had finished, it exists."""
    flag, argv, _ = COMMANDS[command]
    out = tmp_path / "out"
    typed = [sys.executable, "-m", "bertjax.cli", *argv(models, {}, str(out))]
    codes, outputs, _ = stall_watch.run_at_once([typed, typed], env=_env(), cwd=REPO_ROOT)
    assert sorted(codes) == [0, 2], list(zip(codes, [o[-2000:] for o in outputs]))
    refused = outputs[codes.index(2)].strip().splitlines()[-1]
    assert refused.startswith(f"bertjax {command}: error: {flag} {out}"), refused
    assert "is in use by another job" in refused or "already exists" in refused, refused
    assert f"wrote {out}" in outputs[codes.index(0)] and "Traceback" not in "".join(outputs)
    assert sorted(os.listdir(tmp_path)) == ["out"]


# A command stopped by a signal while it writes: the function its run calls (patched in the child to send the
# signal to its own process just before or after it runs), the signal, its argv.
DRIVER = r"""
import importlib, os, signal, sys
target, when, signame, *argv = sys.argv[1:]
module_name, path = target.split(":")
owner = importlib.import_module(module_name)
*parents, name = path.split(".")
for part in parents:
    owner = getattr(owner, part)
original = getattr(owner, name)
def wrapped(*args, **kwargs):
    if when == "before":
        os.kill(os.getpid(), getattr(signal, signame))
    result = original(*args, **kwargs)
    if when == "after":
        os.kill(os.getpid(), getattr(signal, signame))
    return result
setattr(owner, name, wrapped)
from bertjax import cli
sys.argv = ["bertjax", *argv]
sys.exit(cli.main())
"""

STOPPED = {
    # a shard's records written to its temporary file, --out made and locked
    "data create": ("bertjax.data.tfrecord:ShardWriter.write", "after", "SIGTERM"),
    # --out made and locked, before the vocabulary is trained
    "vocab train": ("bertjax.data.vocab:train_wordpiece", "before", "SIGINT"),
    # the vectors written to the output's temporary file
    "embed": ("numpy:save", "after", "SIGHUP"),
    # the checkpoint written whole beside --out, not yet renamed
    "convert": ("bertjax.checkpoint:save_model", "after", "SIGTERM"),
    "export": ("bertjax.interop.hf:_write_files", "after", "SIGINT"),
}


def _stopped_argv(command: str, models, tmp_path) -> list[str]:
    text = tmp_path / "corpus.txt"
    text.write_text("\n\n".join("\n".join(s.capitalize() + "." for s in _sentences(40)[i::5]) for i in range(5))
                    + "\n")
    out = str(tmp_path / "out")
    return {"data create": ["data", "create", "--input", str(text), "--vocab", models["vocab"], "--out", out,
                            "--max-seq-length", "32", "--max-predictions", "5"],
            "vocab train": ["vocab", "train", "--input", str(text), "--vocab-size", "100", "--type", "wordpiece",
                            "--min-count", "1", "--out", out],
            "embed": ["embed", "--checkpoint", models["hf"], "--input", str(text), "--output", out, "--max-len", "32"],
            "convert": ["convert", models["hf"], "--from", "hf", "--out", out],
            "export": ["export", models["hf"], "--out", out]}[command]


@pytest.mark.parametrize("command", sorted(STOPPED))
def test_a_stop_signal_ends_a_command_in_one_line_and_leaves_nothing_behind(command, models, tmp_path, capsys):
    """SIGTERM, SIGINT or SIGHUP while a command writes its output: one line and the shell's 128 + N, no traceback;
    no lock, temporary shard or file, partial directory or empty --out is left, so the same command again needs no
    --overwrite and runs to its end."""
    target, when, name = STOPPED[command]
    argv = _stopped_argv(command, models, tmp_path)
    before = sorted(os.listdir(tmp_path))
    result = subprocess.run([sys.executable, "-c", DRIVER, target, when, name, *argv], env=_env(), cwd=REPO_ROOT,
                            capture_output=True, text=True, timeout=600)
    signum = getattr(signal, name)
    assert result.returncode == 128 + signum, result.stdout[-2000:] + result.stderr[-3000:]
    assert result.stderr.strip().splitlines()[-1] == f"bertjax {command.split()[0]}: stopped by {name}"
    assert "Traceback" not in result.stderr and "Traceback" not in result.stdout, result.stderr[-3000:]
    assert sorted(os.listdir(tmp_path)) == before  # nothing: no --out, no partial, no lock beside it
    capsys.readouterr()
    assert main(argv) == 0, capsys.readouterr().err[-2000:]
    assert "out" in os.listdir(tmp_path)


# A stop signal to this process the moment TensorFlow's import returns: inside the quiet start
# (quiet.native_output_held), where its native start-up lines are held.
STOPPED_AT_START = r"""
import builtins, os, signal, sys
signum, real_import = getattr(signal, sys.argv[1]), builtins.__import__
def importing(name, *args, **kwargs):
    module = real_import(name, *args, **kwargs)
    if name == "tensorflow" and not getattr(importing, "sent", False):
        importing.sent = True
        os.kill(os.getpid(), signum)
    return module
builtins.__import__ = importing
from bertjax import cli
sys.argv = ["bertjax", *sys.argv[2:]]
sys.exit(cli.main())
"""


@pytest.mark.parametrize("command, name", [("data create", "SIGTERM"), ("export", "SIGINT")])
def test_a_stop_during_tensorflows_start_says_its_line_alone(command, name, models, tmp_path):
    """A stop signal that lands while TensorFlow starts (held quiet) wrote TensorFlow's native start-up lines
    ("All log messages before absl::InitializeLog()", "Could not find cuda drivers") back as if the start had failed:
    now the command's one line is all it says (in a user's shell: TF_CPP_MIN_LOG_LEVEL unset)."""
    env = _env()
    env.pop("TF_CPP_MIN_LOG_LEVEL", None)
    result = subprocess.run([sys.executable, "-c", STOPPED_AT_START, name, *_stopped_argv(command, models, tmp_path)],
                            env=env, cwd=REPO_ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 128 + getattr(signal, name), result.stderr[-3000:]
    assert result.stderr.strip().splitlines() == [f"bertjax {command.split()[0]}: stopped by {name}"], \
        result.stderr[-3000:]


def test_demo_corpus_starts_no_tensorflow(tmp_path):
    """`demo-corpus` (a command without TensorFlow) imported it through its --out's lock, and printed TensorFlow's
    native start-up lines on every run."""
    env = _env()
    env.pop("TF_CPP_MIN_LOG_LEVEL", None)
    program = ("import sys; from bertjax import cli; code = cli.main(['demo-corpus', '--out', sys.argv[1]]); "
               "print('tensorflow' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", program, str(tmp_path / "corpus")], env=env, cwd=REPO_ROOT,
                            capture_output=True, text=True, timeout=300)
    assert result.stdout.strip().splitlines()[-1] == "False" and result.stderr == "", result.stderr[-3000:]
    assert sorted(os.listdir(tmp_path / "corpus")) == ["eval.txt", "train.txt"]


def test_an_output_file_keeps_its_permissions_and_a_link_stays_a_link(models, tmp_path):
    """Written beside and renamed: an earlier output's mode is kept, and an --output that is a symlink writes the
    file it points to (the link stays, as writing through it did)."""
    inputs = _inputs(tmp_path / "in", 3)
    target = tmp_path / "vectors.npy"
    target.write_bytes(b"old")
    target.chmod(0o640)
    link = tmp_path / "link.npy"
    link.symlink_to(target)
    assert main(COMMANDS["embed"][1](models, inputs, str(link))) == 0
    assert link.is_symlink() and np.load(target).shape == (3, 32)
    assert target.stat().st_mode & 0o777 == 0o640
    assert sorted(os.listdir(tmp_path)) == ["in", "link.npy", "vectors.npy"]


NATIVE = r"""
import hashlib, sys, threading, time
from bertjax.runtime import preemption
preemption.GRACE_S = 1.0


def native():
    # One native call that lets other threads run (as XLA's compiles and TensorFlow's ops do) and returns in
    # minutes: no Python handler runs in the main thread until it returns.
    hashlib.pbkdf2_hmac("sha256", b"password", b"salt", 10**9)


def ready():  # once the main thread is in the native call
    main = threading.main_thread().ident
    while sys._current_frames()[main].f_code.co_name != "native":
        time.sleep(0.01)
    time.sleep(0.2)
    print("ready", flush=True)


with preemption.stopped_by_raising():
    threading.Thread(target=ready, daemon=True).start()
    native()
"""


def test_a_command_held_in_native_code_is_still_ended_by_a_stop_signal():
    """A Python signal handler runs only between bytecodes: a command inside a long native call (a compile, a
    library spinning under a process limit) would outlive the SIGTERM that used to end it at once. The signal's
    watch (preemption._NativeWatch) ends it GRACE_S later (here 1 s), in a line."""
    process = subprocess.Popen([sys.executable, "-c", NATIVE], env=_env(), cwd=REPO_ROOT, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    try:
        assert process.stdout.readline() == "ready\n"
        process.send_signal(signal.SIGTERM)
        _, err = process.communicate(timeout=120)
    finally:
        process.kill()
    assert process.returncode == 128 + signal.SIGTERM
    assert err.strip().splitlines()[-1] == "bertjax: stopped by SIGTERM: still in native code 1s later; ended without " \
                                           "its cleanup"


def test_a_file_a_job_writes_is_whole_or_not_there(tmp_path):
    """The files a job writes into its workdir go through outputs.open_whole: a metrics.json cut by a full disk was
    read by the next run as a finished one ("already holds this run, completed"). A write that fails leaves the
    earlier file as it was and no partial one, and names the file."""
    import errno

    from bertjax.runtime.errors import OutputWriteError
    from bertjax.runtime.outputs import open_whole

    target = tmp_path / "metrics.json"
    target.write_text("earlier")
    with pytest.raises(OutputWriteError, match=rf"^cannot write {target}: no space left on device$"):
        with open_whole(target) as f:
            f.write('{"half": ')
            raise OSError(errno.ENOSPC, "No space left on device")
    assert target.read_text() == "earlier" and os.listdir(tmp_path) == ["metrics.json"]
    with open_whole(tmp_path / "new.json") as f:
        f.write("{}")
    assert (tmp_path / "new.json").read_text() == "{}"
