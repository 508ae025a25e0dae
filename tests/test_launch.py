"""`bertjax launch tpu|gke --dry-run`: the queued-resource request, built from google-cloud-tpu's own message types,
the gcloud commands and the xpk command, against golden files written by hand from the documented gcloud and xpk
syntax. No network."""
import os
import pathlib
import re
import signal
import subprocess
import sys
import time

import pytest

from bertjax.cli import main as bertjax_main
from bertjax.runtime.preemption import STOPPED_EXIT
from tests import stall_watch
from tests.conftest import REPO_ROOT, process_running

GOLDEN = pathlib.Path(__file__).parent / "golden"
pytest.importorskip("google.cloud.tpu_v2alpha1", reason="launch tpu needs google-cloud-tpu (the test extras)")


@pytest.mark.parametrize("golden, args", [
    ("launch_tpu_spot_v5litepod16.txt",
     ["--name", "bert-p1", "--tpu-type", "v5litepod-16", "--zone", "us-west4-a", "--project", "my-project", "--spot",
      "--dry-run", "--", "pretrain", "--config", "bert-base-phase1", "--workdir", "gs://my-bucket/bert-base",
      "--set", "data.vocab=gs://my-bucket/vocab.txt"]),
    ("launch_tpu_reserved_v4_32.txt",
     ["--name", "bert-v4", "--tpu-type", "v4-32", "--zone", "us-central2-b", "--project", "team-tpus", "--reserved",
      "--wheel", "dist/bertjax-0.1.0-py3-none-any.whl", "--dry-run", "--", "pretrain", "--config", "bert-tiny",
      "--workdir", "gs://team-bucket/tiny"]),
])
def test_dry_run_matches_the_golden_file(golden, args, capsys):
    assert bertjax_main(["launch", "tpu", *args]) == 0
    assert capsys.readouterr().out == (GOLDEN / golden).read_text()


def test_gke_dry_run_matches_the_golden_xpk_command(capsys):
    assert bertjax_main(["launch", "gke", "--cluster", "tpu-cluster", "--name", "bert-ms", "--tpu-type",
                         "v5litepod-16", "--num-slices", "2", "--zone", "us-west4-a", "--project", "my-project",
                         "--dry-run", "--", "pretrain", "--config", "bert-base-phase1", "--workdir",
                         "gs://my-bucket/bert-ms"]) == 0
    assert capsys.readouterr().out == (GOLDEN / "launch_gke_v5litepod16_2slices.txt").read_text()


def test_the_request_is_a_real_queued_resource_message():
    from google.cloud import tpu_v2alpha1 as tpu

    from bertjax.cloud.tpu import SliceSpec, queued_resource_request

    request = queued_resource_request(SliceSpec("n", "v6e-16", "us-east5-b", "p", "spot"))
    assert isinstance(request, tpu.CreateQueuedResourceRequest)
    node_spec = request.queued_resource.tpu.node_spec[0]
    assert (node_spec.node_id, node_spec.node.accelerator_type, node_spec.node.runtime_version) == \
        ("n", "v6e-16", "v2-alpha-tpuv6e")
    assert "spot" in request.queued_resource and "guaranteed" not in request.queued_resource
    # Round trip through the wire format the API takes.
    assert tpu.CreateQueuedResourceRequest.deserialize(tpu.CreateQueuedResourceRequest.serialize(request)) == request


@pytest.mark.parametrize("args, message", [
    (["--tpu-type", "v5e:4x4"], "give the gcloud accelerator type ('v5litepod-16')"),
    (["--tpu-type", "v5litepod-16", "--", "pretrain", "--config", "bert-tiny"], "with its --workdir"),
])
def test_bad_requests_are_clear_errors(args, message, capsys):
    base = ["launch", "tpu", "--name", "n", "--zone", "z", "--project", "p", "--dry-run"]
    command = args if "--" in args else [*args, "--", "pretrain", "--workdir", "gs://b/w"]
    assert bertjax_main(base + command) == 2
    assert message in capsys.readouterr().err


def test_launch_local_needs_the_command_and_the_workdir_to_babysit(capsys):
    with pytest.raises(SystemExit) as exit_info:
        bertjax_main(["launch", "local", "--processes", "2"])
    assert exit_info.value.code == 2 and "give the bertjax command after --" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        bertjax_main(["launch", "local", "--max-restarts", "2", "--", "pretrain", "--config", "bert-tiny"])
    assert exit_info.value.code == 2 and "needs the command's --workdir" in capsys.readouterr().err


@pytest.mark.parametrize("flag, value", [("--processes", "0"), ("--processes", "-1"), ("--devices-per-process", "0"),
                                         ("--max-restarts", "-2")])
def test_launch_local_refuses_counts_that_run_nothing(flag, value, capsys):
    with pytest.raises(SystemExit) as exit_info:
        bertjax_main(["launch", "local", flag, value, "--", "pretrain", "--config", "bert-tiny"])
    assert exit_info.value.code == 2
    assert f"argument {flag}: must be >= {1 if flag != '--max-restarts' else 0}, got {value}" in \
        capsys.readouterr().err


def test_launch_local_names_the_worker_that_was_killed(tmp_path):
    """Worker 1 dies of SIGKILL (a host gone): the launcher says which and how, stops the other, exits 128 + 9."""
    script = tmp_path / "worker.py"
    script.write_text("import os, signal, sys, time\n"
                      "index = int(sys.argv[sys.argv.index('--process-id') + 1])\n"
                      "time.sleep(0.5)\n"
                      "os.kill(os.getpid(), signal.SIGKILL) if index == 1 else time.sleep(300)\n")
    done = subprocess.run([sys.executable, "-c", "import sys; from bertjax.cloud.local import launch; "
                           f"sys.exit(launch(['job'], 2, 1, program=[sys.executable, {str(script)!r}]))"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 137
    assert re.fullmatch(r"bertjax launch: worker p1 \(pid \d+\) was killed by SIGKILL; stopping the 1 other\(s\)",
                        done.stderr.strip().splitlines()[-1]), done.stderr


@pytest.mark.parametrize("argv, message", [
    (["pretrain", "--config", "bert-tiny", "--workdir", "w", "--max-steps-this-run", "0"],
     "argument --max-steps-this-run: must be >= 1, got 0"),
    (["pretrain", "--config", "bert-tiny", "--workdir", "w", "--max-steps-this-run", "-3"],
     "argument --max-steps-this-run: must be >= 1, got -3"),
    (["data", "create", "--input", "x", "--vocab", "v", "--out", "o", "--num-workers", "0"],
     "argument --num-workers: must be >= 1, got 0")])
def test_counts_that_would_do_nothing_are_refused(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        bertjax_main(argv)
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


def test_a_worker_index_outside_the_workers_is_named(tmp_path, capsys):
    (tmp_path / "c.txt").write_text("One. Two.\n\nThree.\n")
    assert bertjax_main(["data", "create", "--input", str(tmp_path / "c.txt"), "--vocab", "v", "--out",
                         str(tmp_path / "o"), "--num-workers", "2", "--worker-index", "5"]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "bertjax data: error: --worker-index 5 is not one of the 2 workers' indices (0..1)")


def test_launch_local_shares_the_cpu_peak_among_the_hosts_devices_and_shows_no_gloo_lines(tmp_path):
    """2 local processes x 4 CPU devices share one machine's cores: each device's peak (the MFU's denominator) is
    an eighth of the host's measured matmul peak, as one process's 8 forced devices get (a whole one each before:
    an MFU 8 times too low). Their collectives' gloo connection lines stay off the launcher's output."""
    import jax
    import jax.numpy as jnp

    from bertjax.pretraining.metrics import cached_matmul_peak

    peak, _ = cached_matmul_peak(jax.devices()[0], jnp.float32, cache_dir=str(tmp_path))  # what the workers read
    script = tmp_path / "peak.py"
    script.write_text(
        "import sys, jax\n"
        "a = sys.argv\n"
        "jax.distributed.initialize(a[a.index('--coordinator') + 1], int(a[a.index('--num-processes') + 1]),\n"
        "                           int(a[a.index('--process-id') + 1]))\n"
        "from bertjax.pretraining.metrics import device_peak_flops\n"
        f"peak, source = device_peak_flops(cache_dir={str(tmp_path)!r})\n"
        # One write: the workers' stdout is unbuffered, and gloo's native lines would land between print's pieces.
        "sys.stdout.write(f'PEAK {peak!r} {source}\\n'); sys.stdout.flush()\n")
    # Without the gs:// stand-in's proxy (set for the session when test_cloud_storage ran first in this worker).
    env = {name: value for name, value in os.environ.items() if "proxy" not in name.lower()}
    env.update(JAX_PLATFORMS="cpu", PYTHONPATH=str(REPO_ROOT))
    done = stall_watch.run([sys.executable, "-c", "import sys; from bertjax.cloud.local import launch; "
                           f"sys.exit(launch([], 2, 4, program=[sys.executable, {str(script)!r}]))"],
                          env=env, cwd=REPO_ROOT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    lines = sorted(line for line in done.stdout.splitlines() if "PEAK " in line)
    assert [line[:4] for line in lines] == ["[p0]", "[p1]"], done.stdout
    for line in lines:
        assert float(line.split()[2]) == pytest.approx(peak / 8, rel=1e-9), line
        assert line.endswith("shared by the 8 CPU devices of this host"), line
    assert "Gloo" not in done.stdout + done.stderr, done.stdout


# A worker stand-in: says it started (its pid in a file), then waits; a stop signal it handles is written down and
# ends it (exit STOPPED_EXIT, as a job that saved before its end), one it ignores leaves it running until killed.
STOPPABLE_WORKER = f"""import os, signal, sys, time
index = int(sys.argv[sys.argv.index('--process-id') + 1])
folder = sys.argv[1]
def stop(signum, frame):
    open(os.path.join(folder, f'signal.{{index}}'), 'w').write(signal.Signals(signum).name)
    sys.exit({STOPPED_EXIT})
for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
    signal.signal(sig, signal.SIG_IGN if 'ignore' in sys.argv else stop)
open(os.path.join(folder, f'pid.{{index}}'), 'w').write(str(os.getpid()))
time.sleep(60)  # bounded: an orphan (the bug) goes by itself
"""


def _launcher_of_stand_ins(tmp_path, *job, grace_s=30.0, babysat=False):
    """A `launch local` of 2 stand-in workers (`babysat`: as --max-restarts 3 runs them), once both run: (the
    launcher, the workers' pids)."""
    script = tmp_path / "worker.py"
    script.write_text(STOPPABLE_WORKER)
    command, program = [str(tmp_path), *job], [sys.executable, str(script)]
    code = (f"from bertjax.cloud.local import LocalProcesses\nfrom bertjax.cloud.babysitter import babysit\n"
            f"with LocalProcesses(2, 1, program={program!r}, grace_s={grace_s}).stopping_on_signals() as workers:\n"
            f"    sys.exit(babysit(workers, {command!r}, {str(tmp_path)!r}, 3))" if babysat else
            f"from bertjax.cloud.local import launch\n"
            f"sys.exit(launch({command!r}, 2, 1, program={program!r}, grace_s={grace_s}))")
    launcher = subprocess.Popen([sys.executable, "-c", "import sys\n" + code], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
    pid_files = [tmp_path / "pid.0", tmp_path / "pid.1"]
    deadline = time.monotonic() + 60
    while not all(p.exists() and p.read_text() for p in pid_files):
        assert launcher.poll() is None and time.monotonic() < deadline, launcher.communicate()
        time.sleep(0.1)
    return launcher, [int(p.read_text()) for p in pid_files]


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP])
def test_a_stop_signal_to_the_launcher_is_passed_on_and_the_workers_are_waited_for(tmp_path, sig):
    """The launcher ended alone used to leave its workers running, orphaned, holding memory and the workdir lock."""
    launcher, pids = _launcher_of_stand_ins(tmp_path)
    launcher.send_signal(sig)
    _, err = launcher.communicate(timeout=20)
    # The workers saved and stopped before the job's end (STOPPED_EXIT): so does the launcher (it was 0: `launch
    # local ... && export ...` went on).
    assert launcher.returncode == STOPPED_EXIT, err
    assert [(tmp_path / f"signal.{i}").read_text() for i in (0, 1)] == [sig.name] * 2
    assert not [pid for pid in pids if process_running(pid)]
    assert f"bertjax launch: {sig.name}: passing it on to the workers" in err


def test_a_babysat_job_stopped_by_a_signal_is_not_restarted(tmp_path):
    """Its workers exit STOPPED_EXIT after saving, which the babysitter reruns when they stop by themselves: not
    when the launcher was asked to stop. It exits STOPPED_EXIT too (it was 1: told from a failure by its text)."""
    launcher, pids = _launcher_of_stand_ins(tmp_path, babysat=True)
    launcher.send_signal(signal.SIGTERM)
    out, err = launcher.communicate(timeout=30)
    assert launcher.returncode == STOPPED_EXIT, out + err
    assert out.strip().splitlines()[-1] == ("babysitter: stopped by a signal before the job completed; not "
                                            "restarting (run the same command to resume)")
    assert "restart 1/" not in out and not [pid for pid in pids if process_running(pid)]


def test_a_worker_that_stopped_before_the_end_waits_for_the_others_and_the_launcher_exits_stopped(tmp_path):
    """A job stopped before its end (--max-steps-this-run, a SIGTERM to its processes) exits STOPPED_EXIT on every
    worker, each once its part of the save is done: the first to end must not kill the others (a non-zero exit
    does), and the launcher's status is theirs, so `launch local ... && next` does not go on."""
    script = tmp_path / "worker.py"
    script.write_text("import os, sys, time\n"
                      "index = int(sys.argv[sys.argv.index('--process-id') + 1])\n"
                      "time.sleep(1.5 * index)  # worker 1 still saving when worker 0 has ended\n"
                      f"open(os.path.join(sys.argv[1], f'saved.{{index}}'), 'w').close()\n"
                      f"sys.exit({STOPPED_EXIT})\n")
    done = subprocess.run([sys.executable, "-c", "import sys; from bertjax.cloud.local import launch; "
                           f"sys.exit(launch([{str(tmp_path)!r}], 2, 1, program=[sys.executable, {str(script)!r}]))"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == STOPPED_EXIT, done.stderr
    assert (tmp_path / "saved.0").exists() and (tmp_path / "saved.1").exists(), done.stderr
    assert "stopping the 1 other(s)" not in done.stderr


def test_workers_that_do_not_stop_are_killed_after_the_grace(tmp_path):
    launcher, pids = _launcher_of_stand_ins(tmp_path, "ignore", grace_s=2)
    started = time.monotonic()
    launcher.send_signal(signal.SIGTERM)
    _, err = launcher.communicate(timeout=30)
    assert launcher.returncode == 128 + signal.SIGKILL and time.monotonic() - started < 15, err
    assert not [pid for pid in pids if process_running(pid)]
    assert "bertjax launch: 2 worker(s) still running 2s after SIGTERM; killing them" in err


def test_workers_of_a_launcher_killed_outright_end_with_it(tmp_path):
    launcher, pids = _launcher_of_stand_ins(tmp_path, "ignore")  # not even a SIGTERM would stop them
    launcher.kill()
    launcher.wait(timeout=10)
    deadline = time.monotonic() + 5
    while [pid for pid in pids if process_running(pid)] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [pid for pid in pids if process_running(pid)]


def test_launch_local_says_what_it_starts_before_the_workers_first_lines(tmp_path, capfd):
    """The workers say nothing until each has imported JAX and TensorFlow and joined the others (34 s): the
    launcher says first what it started and what the wait is."""
    from bertjax.cloud.local import LocalProcesses

    script = tmp_path / "worker.py"
    script.write_text("print('worker up')\n")
    workers = LocalProcesses(2, 3, program=[sys.executable, str(script)])
    workers.start(["pretrain", "--config", "bert-tiny"])
    assert workers.wait() == (0, "exited")
    time.sleep(0.2)   # the relay threads' last lines
    out, err = capfd.readouterr()
    assert err.strip() == (
        f"bertjax launch: starting 2 process(es) of 3 CPU device(s) each, joined through 127.0.0.1:"
        f"{err.split('127.0.0.1:')[1].split(':')[0]}: {sys.executable} {script} pretrain --config bert-tiny; their "
        f"lines follow once each has imported JAX and TensorFlow and joined the others (~30 s on 2 cores)")
    assert err.split("127.0.0.1:")[1].split(":")[0].isdigit()
    assert sorted(out.splitlines()) == ["[p0] worker up", "[p1] worker up"]
