"""A fine-tune workdir belongs to one run: SIGTERM saves and exits STOPPED_EXIT, a rerun resumes to the same bits,
another run's settings are refused unless --overwrite, and a finished run is not run again."""
import json
import os
import re
import signal
import threading
import time

import jax
import numpy as np
import pytest

from bertjax.checkpoint import load_model
from bertjax.cli import main
from bertjax.runtime.preemption import STOPPED_EXIT
from tests.test_glue_job import _synthetic_glue, tiny_init  # noqa: F401 - the fixture


def _argv(data, init, workdir, *extra):
    return ["finetune", "glue", "--task", "sst2", "--init", init, "--data", str(data), "--workdir", str(workdir),
            "--epochs", "3", "--batch-size", "16", "--max-seq-length", "32", "--learning-rate", "1e-3",
            "--log-every", "1", "--save-every", "0", "--save-checkpoint", *extra]


def _sigterm_once_training(workdir, after_step: int = 1, sig=signal.SIGTERM):
    """SIGTERM (or `sig`) to this process as soon as the run has logged `after_step` (by default its first step:
    mid-epoch 1 of 10-step epochs)."""
    def watch():
        deadline = time.time() + 300
        while time.time() < deadline:
            path = workdir / "metrics.jsonl"
            if path.exists() and path.read_text().strip() and max(_steps(workdir), default=0) >= after_step:
                os.kill(os.getpid(), sig)
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
    assert main(_argv(data, tiny_init, cut)) == STOPPED_EXIT  # stopped, saved: not 0, the job is not done
    watcher.join()
    out = capsys.readouterr().out
    assert not (cut / "metrics.json").exists() and (cut / "train_state").is_dir()
    stopped_at = max(_steps(cut))
    assert 1 <= stopped_at < 10  # mid-epoch 1
    assert out.strip().splitlines()[-1][9:] == (  # after its time
        f"stopped at step {stopped_at} of 30 (SIGTERM), its state saved in {cut}/train_state/{stopped_at}: not "
        f"finished (exit status {STOPPED_EXIT}); run the same command again to resume from step {stopped_at}")

    # The same command resumes; evaluating every 10 steps now leaves the weights trained so far as they are.
    assert main(_argv(data, tiny_init, cut, "--eval-every", "10")) == 0
    out = capsys.readouterr().out
    assert f"{cut}: resuming; changed since: --eval-every 0 -> 10 (the weights trained so far stay valid)" in out
    assert f"resumed from {cut}/train_state/{stopped_at} (step {stopped_at} of 30)" in out
    assert re.findall(r"eval at step (\d+): accuracy=\S+ \(48 rows, \d+\.\d s\)", out) == ["10", "20", "30"], out
    whole, resumed = (load_model(str(w / "checkpoint")).params for w in (tmp_path / "whole", cut))
    assert jax.tree_util.tree_structure(whole) == jax.tree_util.tree_structure(resumed)
    for a, b in zip(jax.tree_util.tree_leaves(whole), jax.tree_util.tree_leaves(resumed)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))  # bit for bit
    assert _steps(cut) == list(range(1, 31))  # one curve, not two interleaved

    # Finished: not run again. Another learning rate: refused by name, unless --overwrite.
    assert main(_argv(data, tiny_init, cut)) == 0
    assert "already holds this run, completed" in capsys.readouterr().out
    # Its training data changed since (labels flipped): not taken for the same run, the file named.
    train = data / "SST-2" / "train.tsv"
    original = train.read_text()
    rows = original.splitlines()
    train.write_text("\n".join(rows[:1] + [r[:-1] + str(1 - int(r[-1])) for r in rows[1:]]) + "\n")
    assert main(_argv(data, tiny_init, cut)) == 2
    assert f"{cut}: the files its run read changed since (input:{train}: '" in capsys.readouterr().err
    train.write_text(original)
    assert main(_argv(data, tiny_init, cut, "--learning-rate", "2e-3")) == 2
    assert "belongs to another fine-tuning run (learning_rate: 0.001 -> 0.002)" in capsys.readouterr().err
    assert main(_argv(data, tiny_init, cut, "--learning-rate", "2e-3", "--overwrite", "--epochs", "1")) == 0
    assert _steps(cut) == list(range(1, 11))


def test_sighup_saves_like_sigterm_and_the_rerun_resumes(tiny_init, tmp_path, capsys):  # noqa: F811
    """A dropped SSH session (SIGHUP) used to kill a fine-tune at once: no save, its lock left behind."""
    data, cut = _synthetic_glue(tmp_path / "glue"), tmp_path / "cut"
    watcher = _sigterm_once_training(cut, sig=signal.SIGHUP)
    assert main(_argv(data, tiny_init, cut, "--epochs", "1")) == STOPPED_EXIT
    watcher.join()
    assert "of 10 (SIGHUP), its state saved in" in capsys.readouterr().out and not (cut / "LOCK").exists()
    stopped_at = max(_steps(cut))
    assert main(_argv(data, tiny_init, cut, "--epochs", "1")) == 0
    assert f"resumed from {cut}/train_state/{stopped_at} (step {stopped_at} of 10)" in capsys.readouterr().out
    assert _steps(cut) == list(range(1, 11))


def test_a_damaged_newest_train_state_is_set_aside_and_the_previous_one_resumes(tiny_init, tmp_path,  # noqa: F811
                                                                                   capsys):
    """Saves every 3 steps and on SIGTERM keep the newest two; the newest one cut (its params files truncated) is
    moved aside with one warning line, and the run resumes from the one before to the uninterrupted weights."""
    data = _synthetic_glue(tmp_path / "glue")
    every = ("--save-every", "3")
    assert main(_argv(data, tiny_init, tmp_path / "whole", *every)) == 0
    assert not (tmp_path / "whole" / "train_state").exists()  # a finished run keeps no train state

    cut = tmp_path / "cut"
    watcher = _sigterm_once_training(cut, after_step=4)
    assert main(_argv(data, tiny_init, cut, *every)) == STOPPED_EXIT
    watcher.join()
    assert "of 30 (SIGTERM), its state saved in" in capsys.readouterr().out
    newest = max(_steps(cut))
    previous = (newest - 1) // 3 * 3  # the last save every 3 steps before the one on SIGTERM
    assert 4 <= newest < 30
    states = cut / "train_state"
    assert sorted(p.name for p in states.iterdir()) == sorted([str(previous), str(newest)])
    for path in (states / str(newest) / "params").rglob("*"):
        if path.is_file() and path.stat().st_size > 64:
            path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])

    assert main(_argv(data, tiny_init, cut, *every)) == 0
    out = capsys.readouterr().out
    [warning] = [line for line in out.splitlines() if "warning: cannot restore" in line]
    assert f"cannot restore {states}/{newest} (" in warning and f"moved it to {states}/{newest}.corrupt" in warning
    assert f"resumed from {states}/{previous} (step {previous} of 30)" in out
    whole, resumed = (load_model(str(w / "checkpoint")).params for w in (tmp_path / "whole", cut))
    for a, b in zip(jax.tree_util.tree_leaves(whole), jax.tree_util.tree_leaves(resumed)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))  # bit for bit
    assert _steps(cut) == list(range(1, 31))
    assert [p.name for p in states.iterdir()] == [f"{newest}.corrupt"]  # kept for inspection; the rest removed


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


def test_a_resume_on_changed_input_files_is_refused_naming_them(tmp_path):
    """The record holds each input file's size and SHA-256 (hashlib over the bytes, the reference): a resume
    after a file's content changed, even at the same size, is refused; the same bytes resume."""
    import hashlib

    from bertjax.finetune.run_record import claim
    from bertjax.runtime.input_files import input_fingerprints

    data = tmp_path / "data"
    data.mkdir()
    (data / "train.tsv").write_text("sentence\tlabel\ngood\t1\nbad\t0\n")
    (data / ".hidden").write_text("editor state")
    prints = input_fingerprints([str(data), "tfds:glue", str(tmp_path / "missing")])
    body = (data / "train.tsv").read_bytes()
    digest = hashlib.sha256(body).hexdigest()[:16]
    assert prints == {f"input:{data / 'train.tsv'}": f"{len(body)} bytes, sha256 {digest}"}
    workdir = str(tmp_path / "run")
    assert claim(workdir, {"lr": 1, **prints}, overwrite=False, log=print) == "new"
    (tmp_path / "run" / "metrics.jsonl").write_text('{"step": 5, "loss": 1.0}\n')  # stopped at step 5
    assert claim(workdir, {"lr": 1, **input_fingerprints([str(data)])}, overwrite=False, log=print) == "resume"
    (data / "train.tsv").write_text("sentence\tlabel\ngood\t0\nbad\t1\n")  # labels flipped, same size
    with pytest.raises(ValueError, match=rf"{workdir}: the files its run read changed since \(input:{data}/train.tsv: "
                                         r"'\d+ bytes, sha256 \w+' -> '\d+ bytes, sha256 \w+'\): pass --overwrite"):
        claim(workdir, {"lr": 1, **input_fingerprints([str(data)])}, overwrite=False, log=print)


def test_overwrite_removes_only_what_a_run_wrote(tmp_path):
    """A user's own TensorBoard run and notes in the workdir stay; a run's event files, metrics, state and model
    go."""
    from bertjax.finetune.run_record import claim

    root = tmp_path / "run"
    (root / "tensorboard" / "mine").mkdir(parents=True)
    (root / "tensorboard" / "mine" / "events.out.tfevents.1.host").write_text("the user's")
    (root / "notes.txt").write_text("mine")
    said = []
    assert claim(str(root), {"lr": 1}, overwrite=True, log=said.append) == "new"  # never held a run: nothing removed
    assert said == [] and (root / "tensorboard" / "mine" / "events.out.tfevents.1.host").exists()
    (root / "tensorboard" / "events.out.tfevents.2.host").write_text("the run's")
    (root / "metrics.jsonl").write_text('{"step": 1}\n')
    (root / "train_state" / "1").mkdir(parents=True)
    for model in ("checkpoint", "hf"):  # the earlier run's model: `predict --model` would take it for the new run's
        (root / model).mkdir()
        (root / model / "config.json").write_text("{}")
    assert claim(str(root), {"lr": 2}, overwrite=True, log=said.append) == "new"
    assert said == [f"{root}: removed the earlier run's outputs (--overwrite)"]
    assert sorted(str(p.relative_to(root)) for p in root.rglob("*")) == [
        "notes.txt", "run.json", "tensorboard", "tensorboard/mine", "tensorboard/mine/events.out.tfevents.1.host"]


def test_overwrite_removes_a_linked_output_not_what_it_points_to(tmp_path):
    """A `tensorboard/` linked elsewhere lost the user's event file outside the workdir to --overwrite; a linked
    `train_state/` crashed it with a traceback. The links go, what they point to stays; so at a run's end."""
    from bertjax.checkpoint import StepCheckpointer
    from bertjax.finetune.run_record import claim

    root, outside = tmp_path / "run", tmp_path / "outside"
    (outside / "board").mkdir(parents=True)
    (outside / "board" / "events.out.tfevents.1.host").write_text("the user's events")
    (outside / "state" / "1").mkdir(parents=True)
    (outside / "state" / "1" / "weights").write_text("the user's state")
    assert claim(str(root), {"lr": 1}, overwrite=False, log=print) == "new"
    (root / "tensorboard").symlink_to(outside / "board")
    (root / "train_state").symlink_to(outside / "state")
    (root / "metrics.jsonl").write_text('{"step": 1}\n')
    assert claim(str(root), {"lr": 2}, overwrite=True, log=print) == "new"
    assert sorted(p.name for p in root.iterdir()) == ["run.json"]  # the links themselves gone
    assert (outside / "board" / "events.out.tfevents.1.host").read_text() == "the user's events"
    assert (outside / "state" / "1" / "weights").read_text() == "the user's state"
    # A finished fine-tune deletes its train_state: through a link, only the link.
    (root / "train_state").symlink_to(outside / "state")
    StepCheckpointer(str(root / "train_state"), keep=1).remove()
    assert not os.path.lexists(root / "train_state")
    assert (outside / "state" / "1" / "weights").read_text() == "the user's state"


def test_a_rerun_on_another_spelling_of_the_workdir_is_the_same_run(tmp_path, capsys):
    """`x/../w` and `w/` are one workdir: run.json records it resolved, so the rerun is not refused as another run
    (it was: `workdir: '.../x/../w' -> '.../w/'`). The runs stop at their missing data, after the claim."""
    (tmp_path / "x").mkdir()
    (tmp_path / "w").mkdir()  # existed before: kept when the run fails
    data = tmp_path / "no-glue"
    for spelling in (f"{tmp_path}/x/../w", f"{tmp_path}/w/"):
        assert main(_argv(data, "no-init", spelling)) == 2
        assert "belongs to another" not in capsys.readouterr().err
        (tmp_path / "w" / "metrics.jsonl").write_text('{"step": 1, "loss": 1.0}\n')  # it ran a step: a run to keep
    assert json.loads((tmp_path / "w" / "run.json").read_text())["workdir"] == str(tmp_path / "w")


def test_inputs_spelled_otherwise_or_named_from_another_directory_are_the_same_run(tmp_path, capsys, monkeypatch):
    """`glue`, `./glue`, its absolute path, and `../glue` from a folder beside it name one input: run.json records
    it resolved (and its files' content by resolved path), so a rerun or a resume from another directory is the
    same run, not "another fine-tuning run ... pass --overwrite". Another file is still another run. The runs stop
    at their missing task files, after the claim."""
    data = tmp_path / "glue"
    data.mkdir()
    (data / "README").write_text("a file of the data folder: its fingerprint is part of the record\n")
    (tmp_path / "elsewhere").mkdir()
    workdir = tmp_path / "w"
    workdir.mkdir()  # existed before: kept when the run fails
    for cwd, spelling in ((tmp_path, "glue"), (tmp_path, "./glue"), (tmp_path, str(data)),
                          (tmp_path / "elsewhere", "../glue")):
        monkeypatch.chdir(cwd)
        assert main(_argv(spelling, "no-init", workdir)) == 2
        err = capsys.readouterr().err
        assert "belongs to another" not in err and "changed since" not in err, err
        (workdir / "metrics.jsonl").write_text('{"step": 1, "loss": 1.0}\n')  # it ran a step: a run to resume
    record = json.loads((workdir / "run.json").read_text())
    assert record["data"] == str(data) and f"input:{data / 'README'}" in record

    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "README").write_text("another folder\n")
    assert main(_argv(tmp_path / "other", "no-init", workdir)) == 2
    assert f"{workdir} belongs to another fine-tuning run (data: " in capsys.readouterr().err


def test_a_full_disk_ends_a_fine_tune_in_one_line(tiny_init, tmp_path, small_disk):  # noqa: F811
    """A disk that fills at the first save: the save's line last, no traceback before it (Orbax's threads and
    TensorStore's writes still in flight printed theirs), nothing taken for a finished run."""
    import sys

    from tests import stall_watch
    from tests.conftest import REPO_ROOT, fill_disk

    data, workdir = _synthetic_glue(tmp_path / "glue"), small_disk / "run"
    fill_disk(small_disk / "filler", leave=400_000)  # room for the run's own small files, not for a save
    argv = [sys.executable, "-m", "bertjax.cli",
            *_argv(data, tiny_init, workdir, "--epochs", "1", "--save-every", "2")]
    done = stall_watch.run(argv, cwd=REPO_ROOT, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-3000:]
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("bertjax finetune: error: cannot write ") and last.endswith("no space left on device"), last
    assert not (workdir / "metrics.json").exists()


def test_a_resume_takes_new_evaluation_and_logging_settings_with_a_line_and_refuses_a_new_learning_rate(tmp_path):
    """--eval-every, --metric-for-best, patience, --log-every and --save-every leave the weights trained so far as
    they are: a resume takes them, says what changed, and records them; a changed learning rate is still refused."""
    from bertjax.finetune.run_record import RUN_RECORD, claim

    first = {"learning_rate": 1e-3, "eval_every": 25, "metric_for_best": "", "log_every": 50}
    assert claim(str(tmp_path), first, overwrite=False, log=print) == "new"
    (tmp_path / "metrics.jsonl").write_text('{"step": 40, "loss": 1.0}\n')
    said = []
    second = {**first, "eval_every": 50, "metric_for_best": "f1"}
    assert claim(str(tmp_path), second, overwrite=False, log=said.append) == "resume"
    assert said == [f"{tmp_path}: resuming; changed since: --eval-every 25 -> 50, --metric-for-best '' -> f1 (the "
                    "weights trained so far stay valid)"]
    assert json.loads((tmp_path / RUN_RECORD).read_text()) == second  # the next resume compares with these
    said.clear()
    assert claim(str(tmp_path), second, overwrite=False, log=said.append) == "resume" and said == []
    with pytest.raises(ValueError, match=r"belongs to another fine-tuning run \(learning_rate: 0.001 -> 0.002\)"):
        claim(str(tmp_path), {**second, "learning_rate": 2e-3, "log_every": 5}, overwrite=False, log=said.append)


def test_a_second_sigint_while_a_fine_tune_stops_ends_it_cleanly(tiny_init, tmp_path, capsys):  # noqa: F811
    """Ctrl-C in a shell running `bertjax finetune ... && echo NEXT` (SIGINT to its process group, the shell's too),
    then Ctrl-C again while the job saves and stops (here: just as its loop gives back the signal handlers, where
    the default one used to raise KeyboardInterrupt): the state saved, no traceback, the lock released, exit
    STOPPED_EXIT, so the shell does not go on (bash goes on after a Ctrl-C its job handled: with exit 0, NEXT ran);
    the same command resumes."""
    import subprocess
    import sys

    from tests.conftest import REPO_ROOT, xla_flags
    from tests.test_outputs import DRIVER

    data, cut = _synthetic_glue(tmp_path / "glue"), tmp_path / "cut"
    argv = _argv(data, tiny_init, cut, "--epochs", "1")
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=xla_flags(1), PYTHONPATH=str(REPO_ROOT))
    job = [sys.executable, "-c", DRIVER, "bertjax.runtime.preemption:PreemptionFlag.restore", "after", "SIGINT", *argv]
    process = subprocess.Popen(["bash", "-c", '"$@" && echo NEXT', "bash", *job], env=env, cwd=REPO_ROOT,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    deadline = time.time() + 300
    while time.time() < deadline and process.poll() is None:
        path = cut / "metrics.jsonl"
        if path.exists() and path.read_text().strip() and _steps(cut):
            os.killpg(process.pid, signal.SIGINT)  # as a terminal's Ctrl-C
            break
        time.sleep(0.01)
    out, err = process.communicate(timeout=600)
    assert process.returncode == STOPPED_EXIT and "NEXT" not in out, out[-2000:] + err[-3000:]
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err[-3000:]
    assert "of 10 (SIGINT), its state saved in" in out.strip().splitlines()[-1] and not (cut / "LOCK").exists()
    stopped_at = max(_steps(cut))
    assert main(argv) == 0
    assert f"resumed from {cut}/train_state/{stopped_at} (step {stopped_at} of 10)" in capsys.readouterr().out
