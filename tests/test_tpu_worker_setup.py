"""The worker set-up `launch tpu` sends (tpu.worker_commands: the scripts given to `gcloud ... ssh --command`), run
for real in a sandbox whose only python3 is older than 3.11, as on the default runtime images (tpu-ubuntu2204-base:
Ubuntu 22.04's 3.10, which the wheel's requires-python >=3.11 refuses). The image's pip installs uv, uv installs a
managed CPython 3.11 and makes ~/bertjax-venv from it, the wheel built from this checkout goes there, and the job the
start command starts runs from it; a rerun re-uses what is there, a half-made environment is made again.

Offline, what the set-up downloads comes from local files, through the tools' own settings: the image's pip finds uv
in a folder (PIP_NO_INDEX, PIP_FIND_LINKS; the wheel packed again from this environment's uv, a test extra); uv's
Python download is this interpreter's installation packed as an archive and listed in a downloads file
(UV_PYTHON_DOWNLOADS_JSON_URL, file://); the wheel's dependencies (GBs from PyPI) are not installed (pip's and uv's
`no-deps`: PIP_NO_DEPS, UV_CONFIG_FILE) but found by the job in this environment's site-packages (a path entry, as
test_wheel.py does). The old python3 is a real one where the machine has one (~/.pyenv, python3.10 on PATH,
BERTJAX_TEST_OLD_PYTHON); else a stand-in that says 3.10 and refuses the wheel as pip does."""
import base64
import csv
import glob
import hashlib
import importlib.metadata
import io
import json
import os
import pathlib
import platform
import shutil
import stat
import subprocess
import sys
import sysconfig
import tarfile
import time
import zipfile

import pytest

from bertjax.cloud.tpu import JOB_DIR, UV_DIR, UV_VERSION, VENV, VENV_COMPLETE, WORKER_PYTHON, worker_commands

ROOT = pathlib.Path(__file__).resolve().parents[1]
# What `launch tpu` sent before it brought its own Python: the image's pip.
OLD_INSTALL = 'pip install --quiet --upgrade "./{wheel}[tpu]"'


def _version(python: str) -> tuple[int, ...] | None:
    """The interpreter's version if it runs and has pip, else None."""
    env = {key: value for key, value in os.environ.items() if not key.startswith(("PYTHON", "PIP_"))}
    found = subprocess.run([python, "-c", "import sys, pip; print(*sys.version_info[:3])"], capture_output=True,
                           text=True, env=env)
    return tuple(map(int, found.stdout.split())) if found.returncode == 0 else None


def _old_python() -> str | None:
    """A real Python older than 3.11 with pip, the newest such: $BERTJAX_TEST_OLD_PYTHON, pyenv's, python3.10 ..."""
    candidates = [os.environ.get("BERTJAX_TEST_OLD_PYTHON", "")]
    candidates += glob.glob(os.path.expanduser("~/.pyenv/versions/3.*/bin/python3"))
    candidates += [shutil.which(f"python3.{minor}") or "" for minor in (10, 9)]
    versions = {path: _version(path) for path in candidates if path and os.path.isfile(path)}
    old = [(version, path) for path, version in versions.items() if version and (3, 8) <= version < (3, 11)]
    return max(old)[1] if old else None


def _sandbox_bin(folder: pathlib.Path, old_python: str | None) -> str:
    """A PATH folder with the machine's tools but no Python of its own: python3 (and pip) are the old one, or a
    stand-in that says 3.10 and refuses the bertjax wheel as pip does."""
    folder.mkdir()
    for tool in pathlib.Path("/usr/bin").iterdir():
        if not tool.name.startswith(("python", "pip", "pydoc", "2to3", "idle", "uv", "bertjax")):
            (folder / tool.name).symlink_to(tool)
    if old_python is not None:
        (folder / "python3").symlink_to(old_python)
    else:
        (folder / "python3").write_text(
            '#!/bin/sh\ncase "$*" in -V|--version) echo "Python 3.10.12"; exit 0;; esac\n'
            'case "$*" in *bertjax-*.whl*) echo "ERROR: Package \'bertjax\' requires a different Python: 3.10.12 not '
            f"in '>=3.11,<3.13'\" >&2; exit 1;; esac\nexec {sys.executable} \"$@\"\n")
        (folder / "python3").chmod(0o755)
    (folder / "pip").write_text('#!/bin/sh\nexec python3 -m pip "$@"\n')
    (folder / "pip").chmod(0o755)
    return str(folder)


def _uv_wheel(folder: pathlib.Path) -> None:
    """uv UV_VERSION as a wheel in `folder`, packed again from this environment's installed uv, for the image's pip."""
    uv = pytest.importorskip("uv", reason="needs uv (the test extras)")
    dist = importlib.metadata.distribution("uv")
    assert dist.version == UV_VERSION, "pyproject.toml's test extra pins uv to bertjax.cloud.tpu.UV_VERSION"
    tags = [line.split(": ", 1)[1] for line in dist.read_text("WHEEL").splitlines() if line.startswith("Tag: ")]
    name = f"uv-{UV_VERSION}-py3-none-{'.'.join(tag.split('-')[2] for tag in tags)}.whl"
    package = pathlib.Path(uv.__file__).parent
    files = {f"uv/{path.name}": path.read_bytes() for path in package.iterdir() if path.is_file()}
    files[f"uv-{UV_VERSION}.data/scripts/uv"] = pathlib.Path(uv.find_uv_bin()).read_bytes()
    info = f"uv-{UV_VERSION}.dist-info"
    files[f"{info}/METADATA"] = dist.read_text("METADATA").encode()
    files[f"{info}/WHEEL"] = dist.read_text("WHEEL").encode()
    record = io.StringIO()
    for path, data in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        csv.writer(record).writerow([path, f"sha256={digest}", len(data)])
    csv.writer(record).writerow([f"{info}/RECORD", "", ""])
    files[f"{info}/RECORD"] = record.getvalue().encode()
    with zipfile.ZipFile(folder / name, "w", zipfile.ZIP_DEFLATED) as wheel:
        for path, data in files.items():
            entry = zipfile.ZipInfo(path, date_time=(2020, 1, 1, 0, 0, 0))
            entry.external_attr = (stat.S_IFREG | (0o755 if path.endswith("scripts/uv") else 0o644)) << 16
            wheel.writestr(entry, data, zipfile.ZIP_DEFLATED)


def _python_download(folder: pathlib.Path) -> pathlib.Path:
    """This interpreter's installation as uv's managed-Python archive (`python/` at its top, as python-build-standalone
    lays it out) and the downloads file that offers it; returns the file."""
    version = sys.version_info
    lib = f"lib/python{version.major}.{version.minor}"
    left_out = (f"{lib}/site-packages/", f"{lib}/test/", f"{lib}/idlelib/", f"{lib}/tkinter/", f"{lib}/config-")

    def keep(entry: tarfile.TarInfo):
        inside = entry.name.split("/", 1)[1] + ("/" if entry.isdir() else "")
        return None if "__pycache__" in inside or inside.startswith(left_out) else entry

    archive = folder / "cpython.tar.gz"
    with tarfile.open(archive, "w:gz", compresslevel=1) as tar:
        for part in (f"bin/python{version.major}.{version.minor}", "bin/python3", "lib", "include"):
            if os.path.lexists(os.path.join(sys.base_prefix, part)):
                tar.add(os.path.join(sys.base_prefix, part), arcname=f"python/{part}", filter=keep)
    key = f"cpython-{version.major}.{version.minor}.{version.micro}-linux-{platform.machine()}-gnu"
    downloads = folder / "downloads.json"
    downloads.write_text(json.dumps({key: {
        "name": "cpython", "arch": {"family": platform.machine(), "variant": None}, "os": "linux", "libc": "gnu",
        "major": version.major, "minor": version.minor, "patch": version.micro, "prerelease": "",
        "url": archive.as_uri(), "sha256": hashlib.sha256(archive.read_bytes()).hexdigest(), "variant": None,
        "build": "local"}}))
    return downloads


@pytest.fixture
def worker(tmp_path):
    """(home, run): a worker's home with the copied wheel, and a runner of a command there as sshd runs it (bash -c)
    with the environment the sandbox gives."""
    if f"{sys.version_info.major}.{sys.version_info.minor}" != WORKER_PYTHON or sys.platform != "linux":
        pytest.skip(f"packs this interpreter as the managed CPython {WORKER_PYTHON} (Linux)")
    sources = tmp_path / "sources"
    (sources / "pip").mkdir(parents=True)
    _uv_wheel(sources / "pip")
    downloads = _python_download(sources)
    (sources / "uv.toml").write_text("[pip]\nno-deps = true\n")
    home = tmp_path / "home"
    home.mkdir()
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w",
                            str(tmp_path / "dist"), str(ROOT)], capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stderr[-3000:]
    shutil.copy(next((tmp_path / "dist").glob("bertjax-*.whl")), home)  # what `gcloud ... scp` does
    env = {"HOME": str(home), "PATH": _sandbox_bin(tmp_path / "bin", _old_python()), "LANG": "C.UTF-8",
           "PIP_CONFIG_FILE": os.devnull, "PIP_ROOT_USER_ACTION": "ignore", "PIP_NO_INDEX": "1",
           "PIP_FIND_LINKS": str(sources / "pip"), "PIP_NO_DEPS": "1", "UV_CONFIG_FILE": str(sources / "uv.toml"),
           "UV_PYTHON_DOWNLOADS_JSON_URL": downloads.as_uri()}

    def run(command: str, **extra) -> subprocess.CompletedProcess:
        return subprocess.run(["bash", "-c", command], cwd=home, env={**env, **extra}, stdin=subprocess.DEVNULL,
                              capture_output=True, text=True, timeout=300)

    return home, run


def test_the_set_up_brings_python_3_11_where_the_images_python3_is_older(worker):
    home, run = worker
    wheel = next(home.glob("bertjax-*.whl")).name
    image_python = run("python3 -V")
    assert image_python.returncode == 0, image_python.stderr
    assert tuple(map(int, image_python.stdout.split()[1].split(".")[:2])) < (3, 11), image_python.stdout
    # The old set-up, in this sandbox: the image's pip refuses the wheel.
    old = run(OLD_INSTALL.format(wheel=wheel))
    assert old.returncode != 0 and "requires a different Python" in old.stdout + old.stderr, old.stdout + old.stderr

    install, start = worker_commands(wheel, ["--version"])
    done = run(install)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"Python {WORKER_PYTHON}." in done.stdout and f"in ~/{VENV}" in done.stdout, done.stdout
    venv = home / VENV
    # The environment's interpreter is uv's managed CPython, not the image's.
    base = subprocess.run([str(venv / "bin" / "python"), "-c", "import sys; print(sys.base_prefix, sys.version)"],
                          capture_output=True, text=True, env={"HOME": str(home)}).stdout
    assert base.startswith(str(home / ".local" / "share" / "uv" / "python" / f"cpython-{WORKER_PYTHON}")), base
    site = venv / "lib" / f"python{WORKER_PYTHON}" / "site-packages"
    assert (site / "bertjax" / "cloud" / "tpu.py").is_file()
    (site / "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")  # the dependencies, from here

    assert run(start).returncode == 0
    exit_file = home / JOB_DIR / "exit"
    deadline = time.monotonic() + 120
    while not exit_file.exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    log = (home / JOB_DIR / "job.log").read_text()
    assert exit_file.read_text().strip() == "0", log
    assert f"Python {WORKER_PYTHON}." in log and f"at {site / 'bertjax'}" in log, log

    # A rerun (a failed job restarted on the slice) re-uses uv and the environment: nothing left to download.
    installed = (venv / "bin" / "python").resolve()
    again = run(install, PIP_FIND_LINKS=str(home / "nowhere"), UV_PYTHON_DOWNLOADS_JSON_URL=(home / "x.json").as_uri())
    assert again.returncode == 0 and f"re-using ~/{VENV}" in again.stdout, again.stdout + again.stderr
    assert (venv / "bin" / "python").resolve() == installed and (site / "deps.pth").exists()

    # What a cut-short run left is not taken for good: uv's unfinished folder, an environment without its mark.
    shutil.rmtree(home / UV_DIR)
    (home / f"{UV_DIR}.tmp" / "bin").mkdir(parents=True)
    (home / f"{UV_DIR}.tmp" / "bin" / "uv").write_text("half-copied")
    (venv / VENV_COMPLETE).unlink()
    remade = run(install)
    assert remade.returncode == 0 and "re-using" not in remade.stdout, remade.stdout + remade.stderr
    assert (venv / VENV_COMPLETE).exists() and not (site / "deps.pth").exists()
    assert not (home / f"{UV_DIR}.tmp").exists() and (home / UV_DIR / "bin" / "uv").is_file()
