"""bench/gpu_kernels.py, the check of the Pallas GPU kernels that bench/gpu_check.sh runs on the card before any
timing: here in Pallas' interpreter (its --interpret mode, a subprocess), and its verdict on deliberately wrong
arrays (in process)."""
import importlib.util
import subprocess
import sys

import numpy as np

from tests.conftest import REPO_ROOT

SCRIPT = REPO_ROOT / "bench" / "gpu_kernels.py"


def _bench():
    spec = importlib.util.spec_from_file_location("gpu_kernels", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_interpreted_every_case_passes_and_is_reported():
    """The script as gpu_check.sh runs it, interpreted on this CPU (from another directory): each kernel family in
    bf16 and float32 with dropout (and the pre-norm sum, ModernBERT's stacked and rotated attention) against its XLA
    reference, a line per case, exit 0."""
    done = subprocess.run([sys.executable, str(SCRIPT), "--interpret"], cwd="/", capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    lines = [line for line in done.stdout.splitlines() if ": max rel error " in line]
    assert len(lines) == 12 and all(": ok [" in line for line in lines), done.stdout
    for family in ("attention bfloat16", "attention float32", "attention float32 [2,64,3,2,16] packing, stacked",
                   "layer_norm bfloat16", "layer_norm float32 ",
                   "layer_norm float32->bfloat16 [3, 7, 48] plain, dropout",
                   "layer_norm bfloat16 [3, 7, 48] pre-norm sum"):
        assert any(line.startswith(family) for line in lines), family
    assert done.stdout.splitlines()[-1].startswith("gpu_kernels: all ok")


def test_without_a_gpu_it_refuses_to_run_uninterpreted():
    done = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=300,
                          env={"JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin"})
    assert done.returncode == 2 and "no GPU (JAX's backend is cpu); --interpret" in done.stderr
    assert ": max rel error" not in done.stdout


def test_a_wrong_array_fails_its_case_and_the_run(capsys):
    """One element of one gradient off by 10% of that gradient's largest magnitude (a wrong block, say): the case's
    line says FAIL and names the tensor, the run returns 1; a NaN fails too; the right arrays pass; a case that
    raises (a kernel that does not lower) is a FAIL line and the other cases still run."""
    bench = _bench()
    want = np.random.default_rng(0).normal(size=(4, 64, 2, 16)).astype(np.float32)
    wrong = want.copy()
    wrong[3, 63, 1, 15] += 0.1 * np.abs(want).max()
    with_nan = want.copy()
    with_nan[0, 0, 0, 0] = np.nan

    def failing_lowering():
        raise ValueError("Triton lowering failed\nsecond line")

    status = bench.run([
        ("right case", 1e-3, lambda: [("out", want, want, None), ("dq", want, want, None)]),
        ("wrong case", 1e-3, lambda: [("out", want, want, None), ("dq", wrong, want, None)]),
        ("nan case", 1e-3, lambda: [("dv", with_nan, want, None)]),
        ("raising case", 1e-3, failing_lowering),
        ("after it", 1e-3, lambda: [("y", want, want, None)]),
    ])
    lines = capsys.readouterr().out.splitlines()
    assert status == 1
    assert lines[0].startswith("right case: max rel error 0.0e+00 (") and ": ok [" in lines[0]
    assert lines[1].startswith("wrong case: max rel error 1.0e-01 (dq), tolerance 1e-03: FAIL")
    assert lines[2].startswith("nan case: max rel error inf (dv), tolerance 1e-03: FAIL")
    assert lines[3].startswith("raising case: FAIL (ValueError: Triton lowering failed)")
    assert lines[4].startswith("after it: ") and ": ok [" in lines[4]
    # Within tolerance passes: the error is relative to the tensor's largest magnitude (or the scale given).
    assert bench.compare("near", [("dq", wrong, want, None)], 0.2)[0]
    assert not bench.compare("near", [("dbk", wrong, want, 0.5 * np.abs(want).max())], 0.15)[0]
    assert bench.run([("right case", 1e-3, lambda: [("out", want, want, None)])]) == 0
