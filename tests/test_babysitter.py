"""The babysitter with the local backend: real multi-process pretraining jobs, killed like preempted hosts."""
import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from bertjax.cloud.babysitter import babysit, failure_signature
from bertjax.cloud.local import LocalProcesses, launch
from bertjax.data.demo_corpus import write_demo_corpus
from bertjax.runtime.preemption import STOPPED_EXIT
from tests.conftest import REPO_ROOT, SUITE_CACHE_ON
from tests.test_pretrain import _argv, _env, _final_params


@pytest.fixture(scope="module")
def two_file_corpus(tmp_path_factory, minilm_dir):
    """The demo corpus as two files, one for each of two processes."""
    folder = tmp_path_factory.mktemp("corpus2")
    train_path, _ = write_demo_corpus(str(folder))
    documents = open(train_path, encoding="utf-8").read().split("\n\n")
    for index in range(2):
        (folder / f"part{index}.txt").write_text("\n\n".join(documents[index::2]), encoding="utf-8")
    return str(folder / "part*.txt"), str(minilm_dir / "vocab.txt")


def _command(workdir, corpus, *extra):
    return _argv(workdir, corpus, *extra)[3:]  # without the "python -m bertjax.cli" prefix


# The killed job's own length (test_pretrain's runs are shorter than its kill points): saves every 10 steps.
LONG = ("--set", "train.steps=40", "--set", "checkpoint.every=10")


def test_a_refused_job_is_not_restarted(two_file_corpus, tmp_path):
    messages = []
    backend = LocalProcesses(2, 1, env=_env(1))
    command = _command(tmp_path / "run", ("/nonexistent/corpus-*.txt", two_file_corpus[1]))
    assert babysit(backend, command, str(tmp_path / "run"), max_restarts=5, log=messages.append) == 1
    assert len(messages) == 1, messages  # a configuration error: no restart, it would be refused again
    assert "refused for its input or configuration; not restarting" in messages[0]
    assert "matches no files" in messages[0]


def test_same_failure_twice_stops_with_the_log_tail(tmp_path):
    # Workers that fail (exit 1, not a refusal) the same way every run, with a pid that changes.
    messages = []
    program = [sys.executable, "-c", "import os, sys; print('pid', os.getpid()); "
               "sys.exit('RuntimeError: worker lost')"]
    backend = LocalProcesses(2, 1, env=_env(1), program=program)
    assert babysit(backend, ["pretrain"], str(tmp_path / "run"), max_restarts=5, log=messages.append) == 1
    assert len(messages) == 2 and "restart 1/5" in messages[0], messages  # one restart, then the stop
    assert "failed the same way twice" in messages[-1] and "RuntimeError: worker lost" in messages[-1]


def test_a_job_that_stopped_before_its_end_is_rerun_to_completion(tmp_path):
    """Workers that save and exit STOPPED_EXIT (a SIGTERM to them, --max-steps-this-run), twice with the same last
    lines: each time a rerun, never "failed the same way twice", until the job completes. Worker 1 ends later
    (still saving) each time: the run lasts until it has (the first to end kills no one)."""
    workdir = tmp_path / "run"
    program = [sys.executable, "-c", "import os, sys, time\n"
               "index, workdir = (sys.argv[sys.argv.index(flag) + 1] for flag in ('--process-id', '--workdir'))\n"
               "runs = len([name for name in os.listdir(workdir) if name.startswith(f'run.{index}.')])\n"
               "time.sleep(int(index))\n"
               "open(os.path.join(workdir, f'run.{index}.{runs}'), 'w').close()\n"
               "if runs < 2:\n"
               f"    print('stopped at step 4 of 12 (SIGTERM)'); sys.exit({STOPPED_EXIT})\n"
               "if index == '0': open(os.path.join(workdir, 'COMPLETED'), 'w').close()\n"]
    workdir.mkdir()
    messages = []
    backend = LocalProcesses(2, 1, env=_env(1), program=program)
    assert babysit(backend, ["pretrain", "--workdir", str(workdir)], str(workdir), max_restarts=5,
                   log=messages.append) == 0
    assert messages == ["babysitter: the job ended (resumable) before completing; restart 1/5",
                        "babysitter: the job ended (resumable) before completing; restart 2/5",
                        "babysitter: job completed after 2 restart(s)"]
    assert sorted(name for name in os.listdir(workdir) if name.startswith("run.")) == \
        [f"run.{index}.{run}" for index in (0, 1) for run in range(3)]  # every worker of every run to its end


def test_failure_signature_ignores_numbers_that_change_between_runs():
    first = "[p0] I1122 12:00:01 pid 4242 started\n[p0] bertjax pretrain: error: worker 3 lost at 0x7f00\n"
    second = "[p0] I1122 13:30:59 pid 5151 started\n[p0] bertjax pretrain: error: worker 3 lost at 0x7f99\n"
    assert failure_signature(first) == failure_signature(second)
    assert failure_signature(first) != failure_signature("[p0] ValueError: something else\n")


@pytest.mark.slow
def test_job_killed_twice_is_restarted_and_ends_bit_exact(two_file_corpus, tmp_path):
    reference = tmp_path / "reference"
    assert launch(_command(reference, two_file_corpus, *LONG), processes=2, devices_per_process=4,
                  env=_env(4)) == 0
    assert (reference / "COMPLETED").exists()

    workdir = tmp_path / "babysat"
    backend = LocalProcesses(2, 4, env=_env(4))
    kills = []

    def kill_at(steps):
        # SIGKILL worker 1 (a host gone, as in a preemption) once the job has logged each step in `steps`.
        for target in steps:
            while True:
                metrics = workdir / "metrics.jsonl"
                logged = [json.loads(line)["step"] for line in metrics.read_text().splitlines()] \
                    if metrics.exists() else []
                if logged and logged[-1] >= target and backend.children and backend.children[1].poll() is None:
                    backend.children[1].send_signal(signal.SIGKILL)
                    kills.append(logged[-1])
                    break
                time.sleep(0.1)

    killer = threading.Thread(target=kill_at, args=([15, 27],), daemon=True)
    killer.start()
    messages = []
    started = time.time()
    assert babysit(backend, _command(workdir, two_file_corpus, *LONG), str(workdir), max_restarts=3,
                   log=messages.append) == 0
    babysat_s = time.time() - started
    assert len(kills) == 2 and kills[0] >= 15 and kills[1] >= 27
    assert sum("restart" in m and "preempted" in m for m in messages) == 2
    for ours, theirs in zip(_final_params(workdir, 40), _final_params(reference, 40)):
        assert (ours == theirs).all()
    _check_goodput(workdir, kills, babysat_s)


def _check_goodput(workdir, kills, babysat_s):
    """Each restart's account names the steps computed past the checkpoint it resumed from (the kill points);
    each run's categories add up to its wall time, and `bertjax goodput` adds the three runs up to the job's."""
    from bertjax.pretraining.goodput import CATEGORIES, run_snapshots

    records = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in records if "loss" in r]
    # One curve: each restart dropped what its killed predecessor logged past the checkpoint it resumed from.
    assert steps == sorted(set(steps)), steps
    runs = run_snapshots(str(workdir))
    resumed = [run["first_step"] for run in runs[1:]]  # the checkpoints the restarts continued from
    assert resumed[0] in (0, 10) and resumed[1] in (10, 20), resumed  # the last complete save before each kill
    # A killed run had logged its kill step and computed at most two more: those past the resumed checkpoint are lost.
    lost = [run["lost_steps"] for run in runs]
    assert lost[0] == 0 and [kill - start <= steps <= kill + 2 - start
                             for kill, start, steps in zip(kills, resumed, lost[1:])] == [True, True], (kills, lost)
    # A killed run either has no end (process 0 killed too) or ends failing (process 0 saw its peer go first).
    assert [r["status"] for r in runs][-1] == "completed" and "completed" not in [r["status"] for r in runs[:2]]
    assert [r["first_step"] for r in runs] == [0, *resumed]
    for run in runs:
        assert sum(run[k] for k in CATEGORIES) == pytest.approx(run["wall_s"], rel=0.05), run
    if SUITE_CACHE_ON:
        assert all(run["compile_cache_hits"] >= 1 for run in runs[1:])  # each restart read its step back

    result = subprocess.run([sys.executable, "-m", "bertjax.cli", "goodput", str(workdir), "--json"],
                            env=_env(1), cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    job = json.loads(result.stdout)
    print("\nwhole-job goodput account:", json.dumps({k: v for k, v in job.items() if k != "runs"}))
    assert len(job["runs"]) == 3 and job["launcher_restarts"] == 2
    assert job["lost_steps"] == sum(r["lost_steps"] for r in runs)
    assert job["wall_s"] == pytest.approx(babysat_s, rel=0.05)  # the launcher's log against this test's clock
    parts = sum(job[k] for k in CATEGORIES) + job["unrecorded_s"] + job["between_runs_s"]
    assert parts == pytest.approx(job["wall_s"], rel=0.05)
    assert 0 < job["goodput"] < 1 and job["step_s"] > job["lost_s"] > 0
    text = subprocess.run([sys.executable, "-m", "bertjax.cli", "goodput", str(workdir)], env=_env(1),
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=120).stdout
    print(text)
    assert text.startswith(f"{workdir}: 3 run(s), ") and "launcher: 2 restart(s) recorded" in text
