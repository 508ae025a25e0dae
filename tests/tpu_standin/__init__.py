"""A local stand-in for Cloud TPU (tests only): the TPU API (api.py, a gRPC server the real google-cloud-tpu
client talks to) and `gcloud compute tpus tpu-vm scp/ssh` (gcloud.py) acting on N local worker directories."""

import contextlib
import json
import os
import pathlib
import stat
import sys

REPO = pathlib.Path(__file__).resolve().parents[2]
UV_STANDIN = """#!{python}
import os, pathlib, shutil, sys
args = sys.argv[1:]
if args == ["--version"]:
    print("uv {version} (stand-in)")
elif args[0] == "venv":
    venv = pathlib.Path(args[-1])
    (venv / "bin").mkdir(parents=True)
    os.symlink(sys.executable, venv / "bin" / "python")
elif args[:2] == ["pip", "install"]:
    wheel = next(arg for arg in args if arg.startswith("./")).split("[")[0]
    if not os.path.isfile(wheel):
        sys.exit(f"uv: {{wheel}}: no such file")
    pathlib.Path("installed-wheel").write_text(wheel + "\\n")
    shutil.copy("{bertjax}", pathlib.Path(args[args.index("--python") + 1]).parent / "bertjax")
else:
    sys.exit(f"stand-in uv: unsupported {{args}}")
"""


def _script(path: pathlib.Path, text: str) -> None:
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)


@contextlib.contextmanager
def standin(root: pathlib.Path, workers: int = 2, plans=(), devices_per_worker: int = 1, operation_polls: int = 1,
            toy_job: bool = False):
    """Starts the API stand-in; yields (server, env): env points a launcher at it (gcloud on PATH, the API
    endpoint, the workers' root). The workers' `bertjax` is this checkout's, or toy_job.py with toy_job=True.
    Stops it, killing whatever jobs its workers still run."""
    from bertjax.cloud.tpu import UV_VERSION
    from tests.conftest import xla_flags
    from tests.tpu_standin.api import TpuStandIn

    root.mkdir(parents=True, exist_ok=True)
    bin_dir, worker_bin = root / "bin", root / "worker-bin"
    bin_dir.mkdir(exist_ok=True)
    worker_bin.mkdir(exist_ok=True)
    _script(bin_dir / "gcloud", f'#!/bin/sh\nexec {sys.executable} {REPO}/tests/tpu_standin/gcloud.py "$@"\n')
    # The worker set-up's tools (tpu.worker_setup; its real run: tests/test_tpu_worker_setup.py): the image's python3
    # installs a stand-in uv with `-m pip install --target DIR uv==V` (anything else runs this interpreter); that uv
    # makes a venv whose python is this interpreter, and its `pip install ./WHEEL[tpu]` checks the copied wheel is
    # there, records it and puts the stand-in `bertjax` in the venv (the job runs this checkout, not the wheel's copy).
    program = f"{REPO}/tests/tpu_standin/toy_job.py" if toy_job else "-m bertjax.cli"
    _script(worker_bin / "bertjax", f'#!/bin/sh\nexec {sys.executable} {program} "$@"\n')
    _script(worker_bin / "uv-standin", UV_STANDIN.format(python=sys.executable, version=UV_VERSION,
                                                          bertjax=worker_bin / "bertjax"))
    _script(worker_bin / "python3", f'#!/bin/sh\ncase "$*" in *"-m pip install "*" --target "*) ;; *) exec '
            f'{sys.executable} "$@";; esac\nt=; p=; for a in "$@"; do [ "$p" = --target ] && t="$a"; p="$a"; done\n'
            f'mkdir -p "$t/bin" && cp {worker_bin / "uv-standin"} "$t/bin/uv"\n')
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
