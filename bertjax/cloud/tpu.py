"""A job on a Cloud TPU slice: the queued-resource request (google-cloud-tpu's v2alpha1 types), the equivalent
gcloud commands, the scripts run on the workers, and the backend the babysitter drives.

One slice per job: a queued resource with one node (`--node-id`) of the accelerator type. On every worker the
backend installs the wheel built from this checkout (configs included) into ~/bertjax-venv, a CPython 3.11 that uv
brings whatever the image's python3 is, and starts the same `bertjax ...` command with `--distributed` *detached*
(setsid + nohup, output to ~/bertjax-job/job.log, exit code to ~/bertjax-job/exit), so no SSH session carries the
job: the launcher can drop, be killed or be re-attached with `bertjax launch watch`. It follows worker 0's log live
and polls the slice's state and the workers' exit codes; a slice that is no longer ACTIVE (or a worker whose job
vanished without an exit code) is a preemption: the queued resource is deleted and re-created, and the job resumes
from its workdir (gs://) checkpoints. Workers that all exit 0 or STOPPED_EXIT (some saved and stopped before the
job's end, as a TPU maintenance's SIGTERM makes them) leave the slice ACTIVE: the job is started on it again.
"""
from __future__ import annotations

import collections
import dataclasses
import os
import shlex
import subprocess
import sys
import threading
import time

from bertjax.cloud.topologies import parse_topology
from bertjax.cloud.tpu_slice import NODE_GONE_STATES, Slice
from bertjax.runtime.preemption import STOPPED_EXIT

# A worker's job states that end no run by themselves: done, or saved and stopped (its peers stop at the same step).
ENDED_WELL = ("exit 0", f"exit {STOPPED_EXIT}")

# The TPU VM software each generation boots (Google Cloud's runtime versions for JAX).
RUNTIME_VERSIONS = {"v4": "tpu-ubuntu2204-base", "v5e": "v2-alpha-tpuv5-lite", "v5p": "v2-alpha-tpuv5",
                    "v6e": "v2-alpha-tpuv6e"}
PROVISIONING = ("on-demand", "spot", "reserved")
# Node metadata that records the job in its slice, so `launch watch` can re-create and restart it.
COMMAND_KEY, WHEEL_KEY = "bertjax-command", "bertjax-wheel"
JOB_DIR = "bertjax-job"  # on every worker, relative to the SSH user's home
# The workers' Python. Google's "TPU software versions" page (cloud.google.com/tpu/docs/runtimes) says a runtime
# version is the software pre-installed on the TPU VM, "the Ubuntu operating system, Docker, and other software",
# and names the JAX ones above; it names no Python. tpu-ubuntu2204-base is Ubuntu 22.04, whose python3 is 3.10; the
# page does not say which Ubuntu the v2-alpha-* images are. The wheel (requires-python >=3.11) and jax 0.7+ refuse
# 3.10, so the set-up does not depend on the image's interpreter: uv (pinned) installs a managed CPython (a
# python-build-standalone build) and makes ~/VENV from it, the wheel goes there, and the job runs that environment's
# bertjax. The image's python3 only fetches uv from PyPI with its pip (else uv's standalone installer from GitHub).
WORKER_PYTHON = "3.11"  # the minor version the pinned dependencies are verified on (pyproject.toml)
UV_VERSION = "0.13.9"
VENV = "bertjax-venv"  # on every worker, relative to the SSH user's home
UV_DIR = ".bertjax-uv"  # uv itself, the same
VENV_COMPLETE = ".bertjax-complete"  # in VENV once `uv venv` completed: an environment without it is made again


@dataclasses.dataclass(frozen=True)
class SliceSpec:
    """Where and how to get the slice."""

    name: str
    tpu_type: str                 # gcloud accelerator type, e.g. v5litepod-16
    zone: str
    project: str
    provisioning: str = "on-demand"
    runtime_version: str = ""     # default: the generation's JAX runtime (RUNTIME_VERSIONS)

    def __post_init__(self):
        topology = parse_topology(self.tpu_type)  # validates the name
        if self.tpu_type != topology.accelerator_type:
            raise ValueError(f"--tpu-type {self.tpu_type!r}: give the gcloud accelerator type "
                             f"({topology.accelerator_type!r})")
        if self.provisioning not in PROVISIONING:
            raise ValueError(f"provisioning {self.provisioning!r}; expected one of {PROVISIONING}")
        if not self.runtime_version:
            object.__setattr__(self, "runtime_version", RUNTIME_VERSIONS[topology.generation])

    @property
    def parent(self) -> str:
        return f"projects/{self.project}/locations/{self.zone}"


def queued_resource_request(spec: SliceSpec, command: list[str] | None = None, wheel_name: str = ""):
    """The CreateQueuedResourceRequest for the slice (google.cloud.tpu_v2alpha1 message types); the job's
    command and wheel go into the node's metadata."""
    from google.cloud import (
        tpu_v2alpha1 as tpu,  # the client library is needed only by `launch tpu`
    )

    metadata = {COMMAND_KEY: shlex.join(command), WHEEL_KEY: wheel_name} if command else {}
    node = tpu.Node(accelerator_type=spec.tpu_type, runtime_version=spec.runtime_version, metadata=metadata)
    resource = tpu.QueuedResource(tpu=tpu.QueuedResource.Tpu(node_spec=[tpu.QueuedResource.Tpu.NodeSpec(
        parent=spec.parent, node_id=spec.name, node=node)]))
    if spec.provisioning == "spot":
        resource.spot = tpu.QueuedResource.Spot()
    elif spec.provisioning == "reserved":
        resource.guaranteed = tpu.QueuedResource.Guaranteed(reserved=True)
    return tpu.CreateQueuedResourceRequest(parent=spec.parent, queued_resource_id=spec.name,
                                           queued_resource=resource)


def job_from_resource(resource, zone: str, project: str) -> tuple[SliceSpec, list[str], str]:
    """(spec, command, wheel name) recorded in a queued resource by `launch tpu`, for `launch watch`."""
    node_spec = resource.tpu.node_spec[0]
    node = node_spec.node
    if COMMAND_KEY not in node.metadata:
        raise ValueError(f"queued resource {node_spec.node_id} was not created by `bertjax launch tpu` (its node "
                         f"has no {COMMAND_KEY} metadata)")
    provisioning = "spot" if "spot" in resource else "reserved" if "guaranteed" in resource else "on-demand"
    spec = SliceSpec(node_spec.node_id, node.accelerator_type, zone, project, provisioning, node.runtime_version)
    return spec, shlex.split(node.metadata[COMMAND_KEY]), node.metadata.get(WHEEL_KEY, "")


def _where(spec: SliceSpec) -> list[str]:
    return [f"--zone={spec.zone}", f"--project={spec.project}"]


def gcloud_create(spec: SliceSpec) -> list[str]:
    provisioning = {"spot": ["--spot"], "reserved": ["--reserved"]}.get(spec.provisioning, [])
    return ["gcloud", "compute", "tpus", "queued-resources", "create", spec.name, f"--node-id={spec.name}",
            f"--accelerator-type={spec.tpu_type}", f"--runtime-version={spec.runtime_version}", *_where(spec),
            *provisioning]


def gcloud_delete(spec: SliceSpec) -> list[str]:
    return ["gcloud", "compute", "tpus", "queued-resources", "delete", spec.name, *_where(spec), "--force",
            "--quiet"]


def gcloud_copy(spec: SliceSpec, local_path: str) -> list[str]:
    return ["gcloud", "compute", "tpus", "tpu-vm", "scp", local_path, f"{spec.name}:", "--worker=all",
            *_where(spec)]


def gcloud_ssh(spec: SliceSpec, remote_command: str, worker: str = "all") -> list[str]:
    return ["gcloud", "compute", "tpus", "tpu-vm", "ssh", spec.name, f"--worker={worker}", *_where(spec),
            "--command", remote_command]


def worker_setup(wheel_name: str) -> str:
    """The script that readies a worker for the job: uv UV_VERSION (in ~/UV_DIR), a uv-managed CPython WORKER_PYTHON
    and ~/VENV made from it, the wheel with libtpu installed there. Idempotent: a rerun (a failed job restarted on
    the same slice, `launch watch`) re-uses uv and the environment and installs the wheel again; what a cut-short run
    left half-made (uv's folder before its move, an environment without VENV_COMPLETE) is removed and made again."""
    major, minor = WORKER_PYTHON.split(".")
    return f"""set -eu
uv="$HOME/{UV_DIR}/bin/uv" venv="$HOME/{VENV}"
case "$("$uv" --version 2>/dev/null)" in
"uv {UV_VERSION}" | "uv {UV_VERSION} "*) ;;
*) rm -rf "$HOME/{UV_DIR}" "$HOME/{UV_DIR}.tmp"
   if ! python3 -m pip install --quiet --disable-pip-version-check --no-warn-script-location \\
       --target "$HOME/{UV_DIR}.tmp" uv=={UV_VERSION}; then
     echo "bertjax worker set-up: pip did not install uv; trying the uv installer from GitHub" >&2
     rm -rf "$HOME/{UV_DIR}.tmp"
     curl -LsSf https://astral.sh/uv/{UV_VERSION}/install.sh | env UV_UNMANAGED_INSTALL="$HOME/{UV_DIR}.tmp/bin" sh
   fi
   "$HOME/{UV_DIR}.tmp/bin/uv" --version > /dev/null
   mv "$HOME/{UV_DIR}.tmp" "$HOME/{UV_DIR}";;
esac
if [ -f "$venv/{VENV_COMPLETE}" ] && \\
    "$venv/bin/python" -c "import sys; sys.exit(sys.version_info[:2] != ({major}, {minor}))" 2>/dev/null; then
  echo "bertjax worker set-up: re-using ~/{VENV}"
else
  rm -rf "$venv"
  "$uv" venv --quiet --python {WORKER_PYTHON} --managed-python "$venv"
  touch "$venv/{VENV_COMPLETE}"
fi
"$uv" pip install --quiet --python "$venv/bin/python" --reinstall-package bertjax "./{wheel_name}[tpu]"
echo "bertjax worker set-up: $("$venv/bin/python" -V) (uv-managed) in ~/{VENV}, bertjax installed"
""".rstrip("\n")


def worker_python(runtime_version: str) -> str:
    """Which Python the workers run, and where it comes from (`launch tpu --dry-run`, the launcher's log)."""
    return (f"CPython {WORKER_PYTHON} installed by uv {UV_VERSION} (a python-build-standalone build) in ~/{VENV} on "
            f"every worker, whatever python3 the {runtime_version} image has (tpu-ubuntu2204-base, Ubuntu 22.04: 3.10; "
            f"the wheel needs >=3.11); the job runs ~/{VENV}/bin/bertjax")


def worker_commands(wheel_name: str, command: list[str]) -> tuple[str, str]:
    """(install, start) shell commands for every worker: worker_setup's script, then the job started detached from
    ~/VENV. setsid gives the job a session of its own (no controlling terminal, its own process group): the SSH
    session's hangup never reaches it, and a restart kills the previous job's whole group; nohup also ignores
    SIGHUP. The job's output goes to JOB_DIR/job.log, its exit code to JOB_DIR/exit when it ends by itself."""
    job = (f'echo $$ > {JOB_DIR}/pid; "$HOME/{VENV}/bin/bertjax" {shlex.join([*command, "--distributed"])}; '
           f"echo $? > {JOB_DIR}/exit.tmp; mv {JOB_DIR}/exit.tmp {JOB_DIR}/exit")
    start = (f'mkdir -p {JOB_DIR} && if [ -f {JOB_DIR}/pid ]; then kill -9 -- -"$(cat {JOB_DIR}/pid)" '
             f"2>/dev/null; fi; rm -f {JOB_DIR}/pid {JOB_DIR}/exit; "
             f"if [ -f {JOB_DIR}/job.log ]; then mv {JOB_DIR}/job.log {JOB_DIR}/job.log.previous; fi; "
             f'PATH="$HOME/{VENV}/bin:$PATH" setsid nohup bash -c {shlex.quote(job)} > {JOB_DIR}/job.log 2>&1 '
             f"< /dev/null & for i in $(seq 100); do [ -f {JOB_DIR}/pid ] && break; sleep 0.1; done")
    return worker_setup(wheel_name), start


# One line per worker: "bertjax-job exit N" (ended by itself), "running", "lost" (its processes are gone without
# an exit code: the host was restarted or the job killed) or "none" (never started here).
STATUS = (f'if [ -f {JOB_DIR}/exit ]; then s="exit $(cat {JOB_DIR}/exit)"; elif [ -f {JOB_DIR}/pid ] && '
          f'kill -0 -- -"$(cat {JOB_DIR}/pid)" 2>/dev/null; then s=running; elif [ -f {JOB_DIR}/pid ]; then s=lost; '
          f'else s=none; fi; echo "bertjax-job $s"')


def follow_command(from_line: int = 1) -> str:
    """Worker 0's log from line `from_line` on, then as it grows (and across a restart's new file)."""
    return f"tail -n +{from_line} -F {JOB_DIR}/job.log 2>/dev/null"


def dry_run(spec: SliceSpec, wheel_path: str, command: list[str]) -> str:
    """What `launch tpu` would do, without calling anything: the request message and the gcloud equivalents."""
    wheel_name = os.path.basename(wheel_path)
    install, start = worker_commands(wheel_name, command)
    steps = [gcloud_create(spec), gcloud_copy(spec, wheel_path), gcloud_ssh(spec, install), gcloud_ssh(spec, start),
             gcloud_ssh(spec, follow_command(), worker="0"), gcloud_ssh(spec, STATUS), gcloud_delete(spec)]
    message = queued_resource_request(spec, command, wheel_name)
    request = type(message).to_json(message, indent=2, sort_keys=True, always_print_fields_with_no_presence=False)
    return ("# CreateQueuedResourceRequest (google.cloud.tpu_v2alpha1)\n" + request + "\n"
            "# gcloud equivalent: create (the request also records the job in the node's metadata, for `launch "
            "watch`), copy the wheel, install, start the job detached on all workers, follow worker 0's log, poll "
            "the workers' exit codes (and the slice's state), delete once done\n"
            f"# the workers' Python: {worker_python(spec.runtime_version)}\n"
            + "\n".join(shlex.join(step) for step in steps) + "\n")


def parse_status(output: str) -> list[str]:
    """The workers' job states from STATUS's output ("exit 0", "exit 75", "running", "lost", "none"), in output
    order."""
    return [line.split(" ", 1)[1].strip() for line in output.splitlines() if line.startswith("bertjax-job ")]


class LogFollower:
    """Relays worker 0's job log to this process's output as it is written, keeping the last lines. The SSH
    session that tails it may drop at any time (it carries nothing but the view): it is reopened from the next
    line not yet seen."""

    def __init__(self, spec: SliceSpec, tail_lines: int = 40, out=None, reconnect_seconds: float = 5.0):
        self.spec, self.out, self.reconnect_seconds = spec, out or sys.stdout, reconnect_seconds
        self.tail = collections.deque(maxlen=tail_lines)
        self.lines = 0
        self._stop = threading.Event()
        self._process = None
        self._thread = threading.Thread(target=self._follow, daemon=True)

    def start(self) -> LogFollower:
        self._thread.start()
        return self

    def _follow(self) -> None:
        while not self._stop.is_set():
            self._process = subprocess.Popen(gcloud_ssh(self.spec, follow_command(self.lines + 1), worker="0"),
                                             stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                             stdin=subprocess.DEVNULL, start_new_session=True)
            for raw in iter(self._process.stdout.readline, b""):
                line = raw.decode(errors="replace").rstrip("\n")
                self.lines += 1
                self.tail.append(line)
                self.out.write(f"[worker 0] {line}\n")
                self.out.flush()
            self._process.wait()
            self._stop.wait(self.reconnect_seconds)

    def stop(self) -> None:
        self._stop.set()
        if self._process is not None and self._process.poll() is None:
            self._process.kill()
        self._thread.join(timeout=10)


class CloudTpuBackend:
    """The babysitter's backend on Cloud TPU. A run: make sure the slice is ACTIVE (create it, or replace a
    preempted one), install and start the job detached on every worker (or, for `launch watch`, attach to the one
    already there), follow worker 0's log and poll until the job ends or the slice goes. The slice is kept
    between runs while it is ACTIVE (a failed job restarts on it); `release` deletes it."""

    def __init__(self, spec: SliceSpec, wheel_path: str, client=None, poll_seconds: float = 30.0,
                 log=print, attach: bool = False, **slice_options):
        self.spec, self.wheel_path, self.poll_seconds, self.log = spec, wheel_path, poll_seconds, log
        self.slice = Slice(spec, self._request, client=client, poll_seconds=poll_seconds, log=log,
                           **slice_options)
        self._attach, self._installed, self._command = attach, False, None

    def _request(self):
        return queued_resource_request(self.spec, self._command, os.path.basename(self.wheel_path))

    def _gcloud(self, step: list[str], check: bool = True) -> subprocess.CompletedProcess:
        return subprocess.run(step, check=check, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              stdin=subprocess.DEVNULL)

    def worker_states(self) -> list[str] | None:
        """Every worker's job state (parse_status), or None if they cannot be reached right now."""
        result = self._gcloud(gcloud_ssh(self.spec, STATUS), check=False)
        states = parse_status(result.stdout)
        return states if result.returncode == 0 and states else None

    def run(self, command: list[str]) -> tuple[str, str]:
        self._command = command
        if self.slice.acquire():
            self._installed = False
        attach, self._attach = self._attach, False
        states = self.worker_states() if attach else None
        if states and any(state != "none" for state in states):
            self.log(f"launch tpu: attached to the job on {self.spec.name} (workers: {', '.join(states)})")
        else:
            install, start = worker_commands(os.path.basename(self.wheel_path), command)
            if not self._installed:
                self.log(f"launch tpu: installing {os.path.basename(self.wheel_path)} on every worker, into "
                         f"~/{VENV}: CPython {WORKER_PYTHON} by uv {UV_VERSION}, whatever the image's python3")
                for step in (gcloud_copy(self.spec, self.wheel_path), gcloud_ssh(self.spec, install)):
                    result = self._gcloud(step, check=False)
                    if result.returncode:
                        return self._ended_early(f"{shlex.join(step)} failed ({result.returncode}):\n"
                                                 f"{result.stdout[-3000:]}")
                self._installed = True
            result = self._gcloud(gcloud_ssh(self.spec, start), check=False)
            if result.returncode:
                return self._ended_early(f"starting the job failed ({result.returncode}):\n{result.stdout[-3000:]}")
            self.log(f"launch tpu: job started on every worker of {self.spec.name}; following worker 0's log "
                     f"(~/{JOB_DIR}/job.log); re-attach from anywhere with: bertjax launch watch {self.spec.name} "
                     f"--zone {self.spec.zone} --project {self.spec.project}")
        return self._watch()

    def _ended_early(self, message: str) -> tuple[str, str]:
        """A step before the job failed: a preemption if the slice went meanwhile, else a failure."""
        return ("failed" if self.slice.state() == "ACTIVE" else "preempted"), message

    def _watch(self) -> tuple[str, str]:
        follower = LogFollower(self.spec).start()
        try:
            while True:
                time.sleep(self.poll_seconds)
                gone = self._slice_gone()
                if gone:
                    self.log(f"launch tpu: {self.spec.name} {gone}: the job was preempted")
                    return "preempted", "\n".join(follower.tail)
                states = self.worker_states()
                if states is None:
                    continue  # unreachable for now: the slice's state decides at the next poll
                ended = [state for state in states if state.startswith("exit") or state == "lost"]
                if len(ended) == len(states) or any(state not in ENDED_WELL for state in ended):
                    break
        finally:
            follower.stop()
        tail = self._gcloud(gcloud_ssh(self.spec, f"tail -n 40 {JOB_DIR}/job.log", worker="0"), check=False)
        log_tail = tail.stdout if tail.returncode == 0 else "\n".join(follower.tail)
        if all(state == "exit 0" for state in states):
            self.log("launch tpu: the job exited on every worker")
            return "exited", log_tail
        gone = self._slice_gone()
        if not gone and all(state in ENDED_WELL for state in states):
            self.log(f"launch tpu: the job saved and stopped before its end (exit status {STOPPED_EXIT}) on "
                     f"{self.spec.name}")
            return "resumable", log_tail
        kind = "preempted" if gone or "lost" in states else "failed"
        self.log(f"launch tpu: the job ended on {self.spec.name} (workers: {', '.join(states)}"
                 f"{'; slice ' + gone if gone else ''})")
        return kind, log_tail

    def _slice_gone(self) -> str:
        """Why the slice no longer runs the job ("is SUSPENDED", "node is PREEMPTED"), or "" while it does."""
        state = self.slice.state()
        if state != "ACTIVE":
            return f"is {state}"
        node = self.slice.node_state()
        return f"node is {node}" if node in (*NODE_GONE_STATES, "GONE") else ""

    def release(self) -> None:
        """Deletes the slice (the job completed or was given up)."""
        self.slice.delete()
