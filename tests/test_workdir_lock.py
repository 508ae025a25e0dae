"""One job per workdir: a second job is refused naming the holder and the first keeps its checkpoints and
metrics; a holder that died frees the workdir."""
import json
import os
import socket
import subprocess
import sys
import time

import pytest

from bertjax.runtime.preemption import STOPPED_EXIT
from bertjax.runtime.workdir_lock import LOCK_NAME, WorkdirBusy, WorkdirLock, is_stale
from tests.conftest import REPO_ROOT
from tests.test_pretrain import _argv, _env, _in_process, corpus  # noqa: F401 - the corpus fixture


def test_a_second_holder_is_refused_by_name_until_the_first_releases(tmp_path):
    first = WorkdirLock(str(tmp_path), command="bertjax pretrain first", log=lambda m: None)
    first.acquire()
    with pytest.raises(WorkdirBusy, match=rf"{tmp_path} is in use by another job \(pid {os.getpid()} on "
                                          rf"{socket.gethostname()}, started .*: bertjax pretrain first\)"):
        WorkdirLock(str(tmp_path), log=lambda m: None).acquire()
    first.release()
    assert not (tmp_path / LOCK_NAME).exists()
    second = WorkdirLock(str(tmp_path), log=lambda m: None)
    second.acquire()
    second.release()


def test_a_heartbeat_rewrites_the_lock_and_the_holder_still_releases_it(tmp_path):
    lock = WorkdirLock(str(tmp_path), log=lambda m: None)
    lock.acquire()
    before = json.loads((tmp_path / LOCK_NAME).read_text())
    time.sleep(0.01)
    lock.refresh()  # what the heartbeat thread does every HEARTBEAT_S
    after = json.loads((tmp_path / LOCK_NAME).read_text())
    assert after["token"] == before["token"] and after["heartbeat"] > before["heartbeat"]
    lock.refresh()
    lock.release()
    assert not (tmp_path / LOCK_NAME).exists()


def test_the_lock_of_a_dead_job_is_taken_over(tmp_path):
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()  # a pid that no longer runs, as a SIGKILLed job leaves it
    now = time.time()
    (tmp_path / LOCK_NAME).write_text(json.dumps({"host": socket.gethostname(), "pid": gone.pid, "token": "x",
                                                  "started": now, "heartbeat": now, "command": "killed"}))
    said = []
    lock = WorkdirLock(str(tmp_path), log=said.append)
    lock.acquire()
    assert "taking over the lock of a job that is gone (pid" in said[0]
    assert json.loads((tmp_path / LOCK_NAME).read_text())["pid"] == os.getpid()
    lock.release()
    # Another host's lock goes stale only with its heartbeat.
    other = {"host": "elsewhere", "pid": 1, "heartbeat": now}
    assert not is_stale(other, now + 60) and is_stale(other, now + 3600)


def test_a_lock_whose_heartbeat_lies_in_the_future_names_clock_skew(tmp_path):
    """Another host's lock whose heartbeat is an hour ahead of this host's clock: the refusal says the clocks
    disagree (it read "last heartbeat -3600s ago", and the lock stays live until this clock passes it)."""
    now = time.time()
    (tmp_path / LOCK_NAME).write_text(json.dumps({"host": "elsewhere", "pid": 1, "token": "x", "started": now,
                                                  "heartbeat": now + 3600, "command": "bertjax pretrain"}))
    with pytest.raises(WorkdirBusy) as refused:
        WorkdirLock(str(tmp_path)).acquire(wait_s=0)
    message = str(refused.value)
    assert "last heartbeat 3600s in the future by this host's clock: its host's clock and this one's disagree " \
        "(clock skew), and it counts as live until this clock passes it by 120s" in message, message
    assert "ago" not in message


def test_two_pretrain_jobs_on_one_workdir(corpus, tmp_path, monkeypatch, capsys):  # noqa: F811
    workdir = tmp_path / "run"
    # The second job is refused within a second of the lock appearing; the first has its start-up and compile
    # (tens of seconds) still ahead of its 6 steps.
    first = subprocess.Popen(_argv(workdir, corpus, "--set", "train.steps=6", "--set", "train.log_every=2",
                                   "--set", "checkpoint.every=3"),
                             env=_env(1), cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.time() + 120
        while not (workdir / LOCK_NAME).exists() and time.time() < deadline:
            time.sleep(0.2)
        # The second job in this process: it is refused at once, while the first compiles and trains.
        code, _, err = _in_process(_argv(workdir, corpus, "--set", "train.seed=7",
                                         "--set", "optimizer.learning_rate=1e-3"), monkeypatch, capsys)
        output, _ = first.communicate(timeout=600)
    finally:
        first.kill()
    assert code == 2, err
    assert f"{workdir} is in use by another job (pid {first.pid} on {socket.gethostname()}" in err
    assert first.returncode == 0, output[-3000:]
    # Nothing of the second job's: the first's config, one run's steps in order, its own newest checkpoint.
    assert json.loads((workdir / "config.json").read_text())["train"]["seed"] == 0
    steps = [json.loads(line)["step"] for line in (workdir / "metrics.jsonl").read_text().splitlines()
             if "loss" in json.loads(line)]
    assert steps == sorted(set(steps)) and steps[-1] == 6
    assert "newest: step 6" in output, output[-2000:]
    assert not (workdir / LOCK_NAME).exists(), (workdir / LOCK_NAME).read_text()


@pytest.mark.parametrize("content", ["null", "[1, 2]", '"a lock"', "",
                                     '{"host": "elsewhere", "pid": 1, "token": "t", "started": 0, "heartbeat": "soon"}',
                                     '{"host": "elsewhere", "pid": 1, "heartbeat": 1e12}'])
def test_a_lock_holding_no_holder_record_is_replaced_with_a_line(tmp_path, content):
    import threading

    (tmp_path / LOCK_NAME).write_text(content)
    said, errors = [], []
    lock = WorkdirLock(str(tmp_path), log=said.append)

    def take():
        try:
            lock.acquire()
        except Exception as error:  # noqa: BLE001 - told to the main thread
            errors.append(error)

    taker = threading.Thread(target=take, daemon=True)
    taker.start()
    taker.join(timeout=60)  # `null` once read as "released" and looped for ever
    assert not taker.is_alive(), f"acquire() still looping on a LOCK holding {content!r}"
    assert not errors, errors
    assert said == [f"{tmp_path / LOCK_NAME}: replacing an unreadable lock file"]
    assert json.loads((tmp_path / LOCK_NAME).read_text())["token"] == lock.holder["token"]
    lock.release()
    assert not (tmp_path / LOCK_NAME).exists()


def test_a_lock_that_is_a_directory_is_refused_naming_it(tmp_path):
    (tmp_path / LOCK_NAME).mkdir()
    with pytest.raises(ValueError) as caught:
        WorkdirLock(str(tmp_path), log=lambda m: None).acquire()
    assert str(caught.value) == (f"{tmp_path / LOCK_NAME} is a directory, not a lock file; remove it "
                                 f"(rm -r {tmp_path / LOCK_NAME}) and start the job again")


# Slow: two pretrain runs in this process, 170 s on the loaded test machine; the fine-tune's record of the resolved
# workdir is held in the default suite (test_finetune_resume.py).
@pytest.mark.slow
def test_two_spellings_of_one_workdir_are_one_run(corpus, tmp_path, minilm_dir, monkeypatch, capsys):  # noqa: F811
    """`x/../w` and `w/` are one directory: a pretrain started on one resumes on the other (its --init vocabulary,
    written into the workdir, was recorded in the first spelling and the resume refused as a changed data.vocab)."""
    from tests.conftest import save_tiny_checkpoint

    (tmp_path / "x").mkdir()
    init = save_tiny_checkpoint(tmp_path / "ckpt", minilm_dir / "vocab.txt", seed=0)
    spellings = [f"{tmp_path}/x/../w", f"{tmp_path}/w/"]
    for spelling in spellings:
        argv = _argv(spelling, corpus, "--init", init, "--max-steps-this-run", "1")
        argv[argv.index("bert-tiny")] = "init"  # the --init checkpoint's model and vocabulary
        at = argv.index(f"data.vocab={corpus[1]}")
        del argv[at - 1:at + 1]
        code, out, err = _in_process(argv, monkeypatch, capsys)
        assert code == STOPPED_EXIT, out[-2000:] + err[-2000:]  # a step of the run's 12 each time
    assert f"resumed from {tmp_path}/w/checkpoints/1" in out
    assert json.loads((tmp_path / "w" / "config.json").read_text())["data"]["vocab"] == \
        f"{tmp_path}/w/init_vocab.txt"
