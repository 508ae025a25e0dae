"""A local stand-in for Cloud TPU (tests only): the TPU API (api.py, a gRPC server the real google-cloud-tpu
client talks to) and `gcloud compute tpus tpu-vm scp/ssh` (gcloud.py) acting on N local worker directories."""

import contextlib
import json
import os
import pathlib
import stat
import sys

REPO = pathlib.Path(__file__).resolve().parents[2]


def _script(path: pathlib.Path, text: str) -> None:
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)


@contextlib.contextmanager
def standin(root: pathlib.Path, workers: int = 2, plans=(), devices_per_worker: int = 1, operation_polls: int = 1,
            toy_job: bool = False):
    """Starts the API stand-in; yields (server, env): env points a launcher at it (gcloud on PATH, the API
    endpoint, the workers' root). The workers' `bertjax` is this checkout's, or toy_job.py with toy_job=True.
    Stops it, killing whatever jobs its workers still run."""
    from tests.conftest import xla_flags
    from tests.tpu_standin.api import TpuStandIn

    root.mkdir(parents=True, exist_ok=True)
    bin_dir, worker_bin = root / "bin", root / "worker-bin"
    bin_dir.mkdir(exist_ok=True)
    worker_bin.mkdir(exist_ok=True)
    _script(bin_dir / "gcloud", f'#!/bin/sh\nexec {sys.executable} {REPO}/tests/tpu_standin/gcloud.py "$@"\n')
    # pip: checks the copied wheel is there and records it (the job runs this checkout, not the wheel's copy).
    _script(worker_bin / "pip", '#!/bin/sh\nfor a in "$@"; do case "$a" in ./*) w="${a%%\\[*}";; esac; done\n'
            '[ -f "$w" ] || { echo "pip: $w: no such file" >&2; exit 1; }\necho "$w" > installed-wheel\n')
    program = f"{REPO}/tests/tpu_standin/toy_job.py" if toy_job else "-m bertjax.cli"
    _script(worker_bin / "bertjax", f'#!/bin/sh\nexec {sys.executable} {program} "$@"\n')
    cache = os.environ.get("XDG_CACHE_HOME") or str(pathlib.Path.home() / ".cache")
    (root / "config.json").write_text(json.dumps({"worker_bin": str(worker_bin), "repo": str(REPO),
                                                  "xla_flags": xla_flags(devices_per_worker), "cache": cache}))
    server = TpuStandIn(root, workers, plans, operation_polls)
    host = server.start()
    env = {"TPU_STANDIN_ROOT": str(root), "BERTJAX_TPU_EMULATOR_HOST": host,
           "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    try:
        yield server, env
    finally:
        server.stop()
