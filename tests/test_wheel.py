"""A wheel built from the checkout carries everything a TPU worker runs: installed outside the repository, it finds
its presets, pretrains (as 2 local processes, `bertjax launch local`) and compiles for a TPU topology."""
import os
import pathlib
import subprocess
import sys
import sysconfig

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_wheel_installed_outside_the_repo_pretrains_and_compiles(tmp_path, minilm_dir):
    pytest.importorskip("libtpu")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(tmp_path / "dist"), str(ROOT)],
                   check=True)
    wheel = next((tmp_path / "dist").glob("bertjax-*.whl"))
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    python = venv / "bin" / "python"
    subprocess.run([str(python), "-m", "pip", "install", "-q", "--no-deps", str(wheel)], check=True)
    # The dependencies come from this environment (a path entry: its editable bertjax hook is not loaded).
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          check=True, capture_output=True, text=True).stdout.strip()
    pathlib.Path(site, "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")

    work = tmp_path / "elsewhere"
    work.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    run = lambda *args: subprocess.run([str(python), "-m", "bertjax.cli", *args], cwd=work, env=env,
                                       capture_output=True, text=True, timeout=900)
    where = subprocess.run([str(python), "-c", "import bertjax.configs; print(bertjax.configs.__file__)"], cwd=work,
                           env=env, check=True, capture_output=True, text=True).stdout
    assert where.startswith(str(venv))
    assert run("demo-corpus", "--out", "corpus").returncode == 0
    # As 2 jax.distributed processes through `bertjax launch local` (no checkout needed); a file each.
    trained = run("launch", "local", "--processes", "2", "--devices-per-process", "1", "--",
                  "pretrain", "--config", "bert-tiny", "--workdir", "run", "--set", "data.input=corpus/*.txt",
                  "--set", f"data.vocab={minilm_dir / 'vocab.txt'}", "--set", "train.steps=2",
                  "--set", "train.log_every=1", "--set", "train.batch_size=8", "--set", "data.shuffle_buffer=10",
                  "--set", "optimizer.warmup_steps=1")
    assert trained.returncode == 0, trained.stderr[-2000:]
    assert "completed at step 2" in trained.stdout
    compiled = run("compile", "--config", "bert-tiny", "--topology", "v5e:2x2")
    assert compiled.returncode == 0, compiled.stderr[-2000:]
    assert "fits" in compiled.stdout


def test_the_build_writes_no_license_warning_and_help_names_each_flag_once(tmp_path):
    """pyproject's license is a PEP 639 SPDX string: setuptools builds without its deprecation warnings (three per
    install with the old table); and --help shows `--text-field TEXT_FIELD` once."""
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w",
                            str(tmp_path), str(ROOT)], capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stderr[-3000:]
    assert "license" not in (built.stdout + built.stderr).lower(), built.stdout + built.stderr
    import zipfile

    with zipfile.ZipFile(next(tmp_path.glob("bertjax-*.whl"))) as wheel:
        metadata = wheel.read(next(n for n in wheel.namelist() if n.endswith("METADATA"))).decode()
    assert "License-Expression: Apache-2.0" in metadata
    shown = subprocess.run([sys.executable, "-m", "bertjax.cli", "vocab", "train", "--help"], capture_output=True,
                           text=True, timeout=120).stdout
    assert "--text-field TEXT_FIELD" in shown and "--text-field TEXT_FIELD, --text-field" not in shown, shown
