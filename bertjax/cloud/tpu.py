"""A job on a Cloud TPU slice: the queued-resource request (google-cloud-tpu's v2alpha1 types), the equivalent
gcloud commands, and the backend the babysitter drives.

One slice per job: a queued resource with one node (`--node-id`) of the accelerator type. On every worker the
backend installs the wheel built from this checkout (configs included) and runs the same `bertjax ...` command
with `--distributed` (multi-controller JAX; jax.distributed finds the slice's workers itself), streaming worker 0's
output. A run that ends with the slice preempted, suspended or gone counts as a preemption: the backend deletes the
queued resource and the babysitter starts over, the job resuming from its workdir (gs://) checkpoints.
"""
from __future__ import annotations

import dataclasses
import os
import shlex
import subprocess
import time

from bertjax.cloud.topologies import parse_topology

# The TPU VM software each generation boots (Google Cloud's runtime versions for JAX).
RUNTIME_VERSIONS = {"v4": "tpu-ubuntu2204-base", "v5e": "v2-alpha-tpuv5-lite", "v5p": "v2-alpha-tpuv5",
                    "v6e": "v2-alpha-tpuv6e"}
PROVISIONING = ("on-demand", "spot", "reserved")


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


def queued_resource_request(spec: SliceSpec):
    """The CreateQueuedResourceRequest for the slice (google.cloud.tpu_v2alpha1 message types)."""
    from google.cloud import (
        tpu_v2alpha1 as tpu,  # the client library is needed only by `launch tpu`
    )

    node = tpu.Node(accelerator_type=spec.tpu_type, runtime_version=spec.runtime_version)
    resource = tpu.QueuedResource(tpu=tpu.QueuedResource.Tpu(node_spec=[tpu.QueuedResource.Tpu.NodeSpec(
        parent=spec.parent, node_id=spec.name, node=node)]))
    if spec.provisioning == "spot":
        resource.spot = tpu.QueuedResource.Spot()
    elif spec.provisioning == "reserved":
        resource.guaranteed = tpu.QueuedResource.Guaranteed(reserved=True)
    return tpu.CreateQueuedResourceRequest(parent=spec.parent, queued_resource_id=spec.name,
                                           queued_resource=resource)


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


def gcloud_ssh(spec: SliceSpec, remote_command: str) -> list[str]:
    return ["gcloud", "compute", "tpus", "tpu-vm", "ssh", spec.name, "--worker=all", *_where(spec),
            "--command", remote_command]


def worker_commands(wheel_name: str, command: list[str]) -> tuple[str, str]:
    """(install, run) shell commands for every worker: this checkout's wheel with libtpu, then the job."""
    install = f'pip install --quiet --upgrade "./{wheel_name}[tpu]"'
    run = shlex.join(["bertjax", *command, "--distributed"])
    return install, run


def dry_run(spec: SliceSpec, wheel_path: str, command: list[str]) -> str:
    """What `launch tpu` would do, without calling anything: the request message and the gcloud equivalents."""
    install, run = worker_commands(os.path.basename(wheel_path), command)
    steps = [gcloud_create(spec), gcloud_copy(spec, wheel_path), gcloud_ssh(spec, install), gcloud_ssh(spec, run),
             gcloud_delete(spec)]
    message = queued_resource_request(spec)
    request = type(message).to_json(message, indent=2, sort_keys=True, always_print_fields_with_no_presence=False)
    return ("# CreateQueuedResourceRequest (google.cloud.tpu_v2alpha1)\n" + request + "\n"
            "# gcloud equivalent: create, copy the wheel, install, run on all workers, delete\n"
            + "\n".join(shlex.join(step) for step in steps) + "\n")


class CloudTpuBackend:
    """The babysitter's backend on Cloud TPU: one queued resource per run, deleted when the run ends."""

    def __init__(self, spec: SliceSpec, wheel_path: str, client=None, poll_seconds: float = 30.0,
                 log=print):
        from google.cloud import tpu_v2alpha1 as tpu

        self.spec, self.wheel_path, self.poll_seconds, self.log = spec, wheel_path, poll_seconds, log
        self.client = client or tpu.TpuClient()
        self._states = tpu.QueuedResourceState.State

    def _state(self):
        name = f"{self.spec.parent}/queuedResources/{self.spec.name}"
        return self.client.get_queued_resource(name=name).state.state

    def _create_and_wait(self) -> None:
        self.client.create_queued_resource(request=queued_resource_request(self.spec)).result()
        while (state := self._state()) != self._states.ACTIVE:
            if state in (self._states.FAILED, self._states.SUSPENDED):
                raise RuntimeError(f"queued resource {self.spec.name} is {state.name}")
            self.log(f"launch tpu: {self.spec.name} is {state.name}; waiting")
            time.sleep(self.poll_seconds)

    def _delete(self) -> None:
        name = f"{self.spec.parent}/queuedResources/{self.spec.name}"
        try:
            self.client.delete_queued_resource(name=name, force=True).result()
        except Exception as error:  # already gone: nothing to delete  # noqa: BLE001
            self.log(f"launch tpu: delete {self.spec.name}: {error}")

    def run(self, command: list[str]) -> tuple[str, str]:
        self._create_and_wait()
        wheel_name = os.path.basename(self.wheel_path)
        install, run = worker_commands(wheel_name, command)
        try:
            for step in (gcloud_copy(self.spec, self.wheel_path), gcloud_ssh(self.spec, install)):
                subprocess.run(step, check=True)
            job = subprocess.run(gcloud_ssh(self.spec, run), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                 text=True)
            tail = "\n".join(job.stdout.splitlines()[-40:])
            print(job.stdout, end="")
            try:
                active = self._state() == self._states.ACTIVE
            except Exception:  # the queued resource is gone: preempted  # noqa: BLE001
                active = False
            kind = "exited" if job.returncode == 0 else ("failed" if active else "preempted")
            return kind, tail
        finally:
            self._delete()
