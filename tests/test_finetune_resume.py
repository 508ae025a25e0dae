"""A fine-tune workdir belongs to one run: SIGTERM saves and exits 0, a rerun resumes to the same bits, another
run's settings are refused unless --overwrite, and a finished run is not run again."""
import json
import os
import signal
import threading
import time

import jax
import numpy as np
import pytest

from bertjax.checkpoint import load_model
from bertjax.cli import main
from tests.test_glue_job import _synthetic_glue, tiny_init  # noqa: F401 - the fixture


def _argv(data, init, workdir, *extra):
    return ["finetune", "glue", "--task", "sst2", "--init", init, "--data", str(data), "--workdir", str(workdir),
            "--epochs", "3", "--batch-size", "16", "--max-seq-length", "32", "--learning-rate", "1e-3",
            "--log-every", "1", "--save-every", "0", "--save-checkpoint", *extra]


def _sigterm_once_training(workdir):
    """SIGTERM to this process as soon as the run has logged its first step (mid-epoch 1 of 10-step epochs)."""
    def watch():
        deadline = time.time() + 300
        while time.time() < deadline:
            path = workdir / "metrics.jsonl"
            if path.exists() and path.read_text().strip():
                os.kill(os.getpid(), signal.SIGTERM)
                return
            time.sleep(0.001)

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


def _steps(workdir):
    return [json.loads(line)["step"] for line in (workdir / "metrics.jsonl").read_text().splitlines()
            if "loss" in json.loads(line)]


def test_sigterm_then_rerun_ends_with_the_uninterrupted_weights(tiny_init, tmp_path, capsys):  # noqa: F811
    data = _synthetic_glue(tmp_path / "glue")  # SST-2: 160 training rows, 10 steps an epoch, 30 steps
    assert main(_argv(data, tiny_init, tmp_path / "whole")) == 0

    cut = tmp_path / "cut"
    watcher = _sigterm_once_training(cut)
    assert main(_argv(data, tiny_init, cut)) == 0  # stopped, saved, exit 0
    watcher.join()
    out = capsys.readouterr().out
    assert "stopped by a signal at step" in out and "rerun the same command to resume" in out
    assert not (cut / "metrics.json").exists() and (cut / "train_state").is_dir()
    stopped_at = max(_steps(cut))
    assert 1 <= stopped_at < 10  # mid-epoch 1

    assert main(_argv(data, tiny_init, cut)) == 0  # the same command resumes
    assert f"resumed from {cut}/train_state/{stopped_at} (step {stopped_at} of 30)" in capsys.readouterr().out
    whole, resumed = (load_model(str(w / "checkpoint")).params for w in (tmp_path / "whole", cut))
    assert jax.tree_util.tree_structure(whole) == jax.tree_util.tree_structure(resumed)
    for a, b in zip(jax.tree_util.tree_leaves(whole), jax.tree_util.tree_leaves(resumed)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))  # bit for bit
    assert _steps(cut) == list(range(1, 31))  # one curve, not two interleaved

    # Finished: not run again. Another learning rate: refused by name, unless --overwrite.
    assert main(_argv(data, tiny_init, cut)) == 0
    assert "already holds this run, completed" in capsys.readouterr().out
    assert main(_argv(data, tiny_init, cut, "--learning-rate", "2e-3")) == 2
    assert "belongs to another fine-tuning run (learning_rate: 0.001 -> 0.002)" in capsys.readouterr().err
    assert main(_argv(data, tiny_init, cut, "--learning-rate", "2e-3", "--overwrite", "--epochs", "1")) == 0
    assert _steps(cut) == list(range(1, 11))


def test_a_run_that_wrote_nothing_does_not_hold_its_workdir(tmp_path):
    from bertjax.finetune.run_record import claim

    said = []
    assert claim(str(tmp_path), {"learning_rate": 1e-3}, overwrite=False, log=said.append) == "new"
    # It stopped on bad input before writing anything: a corrected command is not refused.
    assert claim(str(tmp_path), {"learning_rate": 2e-3}, overwrite=False, log=said.append) == "new"
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 1.0}\n')
    assert claim(str(tmp_path), {"learning_rate": 2e-3}, overwrite=False, log=said.append) == "resume"
    with pytest.raises(ValueError, match=r"belongs to another fine-tuning run \(learning_rate: 0.002 -> 0.003\)"):
        claim(str(tmp_path), {"learning_rate": 3e-3}, overwrite=False, log=said.append)
    assert said == []
