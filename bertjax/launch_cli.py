"""`bertjax launch tpu` (a Cloud TPU queued resource, babysat through preemptions) and `bertjax launch gke` (xpk).

google-cloud-tpu (extra `cloud`) is imported only when the command runs, so `bertjax --help` stays fast.
"""
from __future__ import annotations

import argparse
import importlib.metadata
import os
import pathlib
import shlex
import shutil
import subprocess
import sys
import tempfile


def register(subparsers) -> None:
    launch = subparsers.add_parser("launch", help="run a job on TPU pod slices").add_subparsers(
        dest="launch_command", required=True)
    tpu = launch.add_parser("tpu", help="create a TPU queued resource, install this bertjax on every worker, run "
                            "the command on all of them, and re-create the slice after preemptions")
    tpu.add_argument("--name", required=True, help="queued resource and node id")
    tpu.add_argument("--tpu-type", required=True, help="gcloud accelerator type, e.g. v5litepod-16, v4-32, v5p-16")
    tpu.add_argument("--zone", required=True)
    tpu.add_argument("--project", required=True)
    provisioning = tpu.add_mutually_exclusive_group()
    provisioning.add_argument("--spot", dest="provisioning", action="store_const", const="spot",
                              default="on-demand", help="Spot capacity (may be preempted at any time)")
    provisioning.add_argument("--reserved", dest="provisioning", action="store_const", const="reserved",
                              help="the project's reservation")
    tpu.add_argument("--runtime-version", default="", help="TPU VM runtime (default: the generation's JAX one)")
    tpu.add_argument("--max-restarts", type=int, default=10, help="slice re-creations after preemptions")
    tpu.add_argument("--wheel", help="the bertjax wheel to install (default: built from this checkout)")
    tpu.add_argument("--dry-run", action="store_true", help="print the request and the gcloud equivalents")
    tpu.add_argument("command", nargs=argparse.REMAINDER, help="-- pretrain --config ... --workdir gs://...")
    tpu.set_defaults(func=_launch_tpu)

    gke = launch.add_parser("gke", help="run the command on TPU slices of a GKE cluster with xpk (a JobSet, "
                            "restarted after preemptions)")
    gke.add_argument("--cluster", required=True, help="the GKE cluster (with its TPU node pools, e.g. by xpk)")
    gke.add_argument("--name", required=True, help="the xpk workload name")
    gke.add_argument("--tpu-type", required=True, help="gcloud accelerator type of one slice, e.g. v5litepod-16")
    gke.add_argument("--num-slices", type=int, default=1)
    gke.add_argument("--zone", required=True)
    gke.add_argument("--project", required=True)
    gke.add_argument("--base-docker-image", default="python:3.11-slim")
    gke.add_argument("--max-restarts", type=int, default=10, help="JobSet restarts after failures/preemptions")
    gke.add_argument("--wheel", help="the bertjax wheel to install (default: built from this checkout)")
    gke.add_argument("--dry-run", action="store_true", help="print the xpk command instead of running it")
    gke.add_argument("command", nargs=argparse.REMAINDER, help="-- pretrain --config ... --workdir gs://...")
    gke.set_defaults(func=_launch_gke)


def _wheel_name() -> str:
    return f"bertjax-{importlib.metadata.version('bertjax')}-py3-none-any.whl"


def build_wheel(out_dir: str) -> str:
    """This checkout as a wheel (presets and everything a worker runs are inside it)."""
    root = pathlib.Path(__file__).resolve().parents[1]
    if not (root / "pyproject.toml").exists():
        raise ValueError("bertjax is not installed from a checkout: give --wheel PATH")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--wheel-dir", out_dir, str(root)],
                   check=True)
    return str(next(pathlib.Path(out_dir).glob("bertjax-*.whl")))


def _job_command(args: argparse.Namespace) -> list[str]:
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command or "--workdir" not in command[:-1]:
        raise ValueError("give the job after --, with its --workdir (gs://...), e.g. -- pretrain --config "
                         "bert-base-phase1 --workdir gs://BUCKET/run ...")
    return command


def _launch_gke(args: argparse.Namespace) -> int:
    from bertjax import gke

    command = _job_command(args)
    spec = gke.GkeSpec(args.cluster, args.name, args.tpu_type, args.zone, args.project, args.num_slices,
                       args.base_docker_image, args.max_restarts)
    if args.dry_run:
        print(shlex.join(gke.xpk_command(spec, "SCRIPT_DIR", args.wheel or _wheel_name(), command)))
        return 0
    with tempfile.TemporaryDirectory() as script_dir:
        wheel = args.wheel or build_wheel(script_dir)
        if os.path.dirname(os.path.abspath(wheel)) != script_dir:
            shutil.copy(wheel, script_dir)
        return subprocess.run(gke.xpk_command(spec, script_dir, wheel, command)).returncode


def _launch_tpu(args: argparse.Namespace) -> int:
    from bertjax import babysitter, cloud_tpu

    command = _job_command(args)
    spec = cloud_tpu.SliceSpec(args.name, args.tpu_type, args.zone, args.project, args.provisioning,
                               args.runtime_version)
    if args.dry_run:
        print(cloud_tpu.dry_run(spec, args.wheel or _wheel_name(), command), end="")
        return 0
    with tempfile.TemporaryDirectory() as folder:
        wheel = args.wheel or build_wheel(folder)
        backend = cloud_tpu.CloudTpuBackend(spec, wheel)
        return babysitter.babysit(backend, command, command[command.index("--workdir") + 1], args.max_restarts)
