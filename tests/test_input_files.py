"""Files bertjax reads whole are checked by type and size first (bertjax/runtime/input_files.py), and a permission problem
is named as one: never read as damage (a tensor "missing", a checkpoint set aside as corrupt)."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from tests.conftest import REPO_ROOT, limited, save_tiny_checkpoint, save_tiny_hf, xla_flags

# What a command may map: a regression that reads /dev/zero whole fails in seconds on a MemoryError, not after
# taking the machine's memory.
ADDRESS_SPACE = 8 << 30


def _run(argv: list[str], drop_file_access: bool = False) -> subprocess.CompletedProcess:
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=xla_flags(1), PYTHONPATH=str(REPO_ROOT))
    return subprocess.run(limited(argv, drop_file_access=drop_file_access, RLIMIT_AS=ADDRESS_SPACE), env=env,
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=600)


def _bertjax(*args, drop_file_access: bool = False) -> subprocess.CompletedProcess:
    return _run([sys.executable, "-m", "bertjax.cli", *args], drop_file_access)


def _last(result) -> str:
    return result.stderr.strip().splitlines()[-1]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, minilm_dir):
    """A pretraining run directory: a complete step 3 (a tiny model checkpoint) and its records."""
    run = tmp_path_factory.mktemp("run")
    save_tiny_checkpoint(run / "checkpoints" / "3", minilm_dir / "vocab.txt", seed=0)
    (run / "metrics.jsonl").write_text(json.dumps({"step": 3, "loss": 7.0}) + "\n")
    return run


def test_files_that_are_not_regular_files_are_refused_by_type_naming_them(run_dir, minilm_dir, tmp_path):
    """A config, metrics or goodput file linked to /dev/zero was read until MemoryError; a safetensors file linked
    to /dev/urandom ended in a traceback naming nothing. Each is one line naming the file, what it is and what was
    expected, before a byte of it is read."""
    import shutil

    config = tmp_path / "config.json"
    config.symlink_to("/dev/zero")
    result = _bertjax("config", "show", str(config))
    assert result.returncode == 2 and _last(result) == (
        f"bertjax config: error: {config} (a link to /dev/zero) is a character device, not a file; expected a "
        "pretraining config (JSON)"), result.stderr[-2000:]

    run = tmp_path / "run"
    shutil.copytree(run_dir, run)
    (run / "metrics.jsonl").unlink()
    (run / "metrics.jsonl").symlink_to("/dev/zero")
    result = _bertjax("info", str(run))
    assert result.returncode == 2 and _last(result) == (
        f"bertjax info: error: {run / 'metrics.jsonl'} (a link to /dev/zero) is a character device, not a file; "
        "expected the run's metrics (JSON Lines)"), result.stderr[-2000:]

    (run / "goodput").mkdir()
    (run / "goodput" / "run-1.json").symlink_to("/dev/zero")
    result = _bertjax("goodput", str(run))
    assert result.returncode == 2 and "goodput/run-1.json (a link to /dev/zero) is a character device, not a " \
        "file; expected a run's goodput account (JSON)" in _last(result), result.stderr[-2000:]

    hf = tmp_path / "hf"
    save_tiny_hf(hf, minilm_dir / "vocab.txt", seed=0)
    (hf / "model.safetensors").unlink()
    (hf / "model.safetensors").symlink_to("/dev/urandom")
    for command in (["info", str(hf)], ["convert", str(hf), "--from", "hf", "--out", str(tmp_path / "converted")]):
        result = _bertjax(*command)
        assert result.returncode == 2 and _last(result) == (
            f"bertjax {command[0]}: error: {hf / 'model.safetensors'} (a link to /dev/urandom) is a character "
            "device, not a file; expected a safetensors file"), result.stderr[-2000:]
        assert "Traceback" not in result.stderr
    assert not (tmp_path / "converted").exists()


def test_json_that_is_cut_or_too_large_is_named_with_its_path(tmp_path, monkeypatch):
    from bertjax.runtime import input_files

    cut = tmp_path / "run.json"
    cut.write_text('{"job": "classify", "train": "a.cs')
    with pytest.raises(ValueError, match=rf"^{cut}: not valid JSON \(cut short\?\): Unterminated string starting at "
                                         r"\(line 1, column 30\); expected a fine-tune's run record$"):
        input_files.read_json(cut, "a fine-tune's run record")
    big = tmp_path / "big.json"
    big.write_text("[" + "0, " * 100 + "0]")
    with pytest.raises(ValueError, match=rf"^{big}: 303 bytes, more than a config can be \(100 bytes at most\)"):
        input_files.read_json(big, "a config", limit=100)
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(ValueError, match=r"is a FIFO \(named pipe\), not a file"):
        input_files.read_text(fifo, "text")  # refused without opening it (an open would wait for a writer)


# ------------------------------------------------------------------------------------------- permissions

@pytest.fixture
def unreadable():
    """chmod 000 on the paths given (put back after), and whether this machine lets a test read around it."""
    changed = []

    def make(*paths):
        for path in paths:
            changed.append((path, path.stat().st_mode))
            path.chmod(0)
        probe = _run(["/bin/cat" if paths[0].is_file() else "/bin/ls", str(paths[0])], drop_file_access=True)
        if probe.returncode == 0:
            pytest.skip("this machine reads files whatever their mode (root without a capability bounding set)")

    yield make
    for path, mode in reversed(changed):
        if path.exists():  # (set aside elsewhere by a resume that took it for damage)
            path.chmod(mode)


def test_an_unreadable_checkpoint_is_named_a_permission_problem_not_a_missing_tensor(run_dir, tmp_path, unreadable):
    import shutil

    checkpoint = tmp_path / "ckpt"
    shutil.copytree(run_dir / "checkpoints" / "3", checkpoint)
    unreadable(checkpoint / "params")
    result = _bertjax("info", str(checkpoint), drop_file_access=True)
    assert result.returncode == 2, result.stderr[-2000:]
    assert _last(result).startswith(f"bertjax info: error: {checkpoint / 'params'}: permission denied to "), \
        _last(result)
    assert "missing" not in result.stderr and "Traceback" not in result.stderr


RESUME = r"""
import sys
import jax
import numpy as np
from bertjax.checkpoint import PARAMS, StepCheckpointer
checkpointer = StepCheckpointer(sys.argv[1], keep=3)
abstract = {PARAMS: {"w": jax.ShapeDtypeStruct((4096,), np.float32)}}
try:
    checkpointer.restore_newest(lambda step: checkpointer.restore_items(step, abstract), print)
except ValueError as error:
    print(f"{type(error).__name__}: {error}")
"""


def test_a_resume_from_an_unreadable_newest_step_names_it_and_sets_nothing_aside(tmp_path, unreadable):
    """A valid newest step this user may not read was renamed `.corrupt` and its steps computed again: now the
    resume (StepCheckpointer.restore_newest, what pretraining and fine-tunes resume through) stops on one line
    naming the permission problem, and every step stays as it was."""
    from bertjax.checkpoint import PARAMS, StepCheckpointer

    steps = tmp_path / "steps"
    checkpointer = StepCheckpointer(steps, keep=3)
    for step in (1, 2):
        checkpointer.save_items(step, {PARAMS: {"w": np.full(4096, step, np.float32)}})
    checkpointer.close()
    unreadable(steps / "2" / PARAMS)
    result = _run([sys.executable, "-c", RESUME, str(steps)], drop_file_access=True)
    assert result.returncode == 0, result.stderr[-3000:]
    [line] = result.stdout.strip().splitlines()
    assert line.startswith(f"Unreadable: {steps / '2' / PARAMS}: permission denied to "), line
    assert sorted(p.name for p in steps.iterdir()) == ["1", "2"]
