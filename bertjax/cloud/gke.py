"""A job on TPU slices in a GKE cluster, through xpk (Google's tool for TPU workloads on GKE).

xpk turns one command into a JobSet with the TPU node selectors (accelerator, topology), one pod per TPU VM host
and the host's chips requested as google.com/tpu, queued by Kueue, and restarts the JobSet after a failure or
preemption (`--max-restarts`); the job resumes from its workdir's (gs://) checkpoints. The pods' image is a base
Python image plus a script directory holding this checkout's wheel, installed before the job starts.
"""
from __future__ import annotations

import dataclasses
import os
import shlex

from bertjax.cloud.topologies import parse_topology


@dataclasses.dataclass(frozen=True)
class GkeSpec:
    cluster: str
    workload: str
    tpu_type: str
    zone: str
    project: str
    num_slices: int = 1
    base_docker_image: str = "python:3.11-slim"
    max_restarts: int = 10

    def __post_init__(self):
        topology = parse_topology(self.tpu_type, self.num_slices)
        if self.tpu_type != topology.accelerator_type:
            raise ValueError(f"--tpu-type {self.tpu_type!r}: give the gcloud accelerator type "
                             f"({topology.accelerator_type!r})")


def job_command(spec: GkeSpec, command: list[str]) -> list[str]:
    """The bertjax command every pod runs: multi-controller (`--distributed`); across slices, mesh.dcn_data."""
    command = [*command, "--distributed"]
    if spec.num_slices > 1 and not any(arg.startswith("mesh.dcn_data=") for arg in command):
        command += ["--set", f"mesh.dcn_data={spec.num_slices}"]
    return command


def xpk_command(spec: GkeSpec, script_dir: str, wheel_path: str, command: list[str]) -> list[str]:
    """`xpk workload create` for the job: the image is the base image plus `script_dir` (holding the wheel)."""
    install = f'pip install --quiet "./{os.path.basename(wheel_path)}[tpu]"'
    return ["xpk", "workload", "create", f"--cluster={spec.cluster}", f"--workload={spec.workload}",
            f"--tpu-type={spec.tpu_type}", f"--num-slices={spec.num_slices}", f"--zone={spec.zone}",
            f"--project={spec.project}", f"--base-docker-image={spec.base_docker_image}",
            f"--script-dir={script_dir}", f"--max-restarts={spec.max_restarts}",
            "--command", f"{install} && {shlex.join(['bertjax', *job_command(spec, command)])}"]
