"""The Pallas GPU kernels compiled for the real card, checked against XLA on the same device before anything is
timed (bench/gpu_check.sh runs this first and stops if it fails).

    python3 bench/gpu_kernels.py                         # on a GPU: BERT-base shapes, the kernels through Triton
    .venv/bin/python bench/gpu_kernels.py --interpret    # anywhere: tiny shapes in Pallas' interpreter

The cases are `bertjax.model.kernels.gpu.gpu_kernel_check`'s (a job runs them at small shapes before its first step on a
card without a verdict): each kernel family forward and backward against its XLA reference on the same inputs with the
same dropout mask, one line per case (the largest relative error of its output and gradients, the tensor, the tolerance,
ok or FAIL; a case that raises, such as a Triton lowering error, is a FAIL with the error's first line). Exit 1 on any
FAIL, 2 without a GPU unless --interpret. On a GPU the verdict is also cached for this card, jax version and kernel
source (so jobs here skip their own check), and its key printed: the line to record in `gpu_kernel_check.PASSED_ON` once
all pass.

On a GPU: the attention with 12 heads of 64 at batch 4 x seq 128 (padding) and batch 2 x seq 512 (packing), the
model's blocks (`attention.gpu_query_block`), and ModernBERT's (q/k/v stacked, rotary positions and a window of 128
in the kernels) at the second; the residual LayerNorm over [4, 128, 768] and [2, 512, 768] (768 held as 1,024
columns), the plain one and the pre-norm sum (ModernBERT's) over the first; dropout 0.1; bf16 and float32: 14
cases. The largest array is the reference's [2, 12, 512, 512] float32 scores (25 MB): each case is a few small
compiles. Interpreted: 12 cases at [2, 64, 2, 16] and [3, 7, 48], ~30 s on a loaded 2-core CPU. float32 matmuls at full
precision on both sides (the kernels ask for it; XLA would use TF32). Tolerances: bf16 within its rounding, float32
within reduction order and the GPU's approximate exp/rsqrt; a wrong block, mask or load is off by more.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import jax

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # this checkout's bertjax, run as a script

from bertjax.model.kernels.gpu import gpu_kernel_check as check  # noqa: E402
from bertjax.model.kernels.gpu.gpu_kernel_check import compare  # noqa: E402, F401 (the tests call it here)


def run(found) -> int:
    """Each case (name, tolerance, compute: () -> tensors for `compare`) run and printed; 1 if any failed."""
    return 1 if any(not ok for _, ok, _ in check.run_cases(found, out=lambda line: print(line, flush=True))) else 0


def cases(interpret: bool):
    return check.cases("interpret" if interpret else "bert-base")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--interpret", action="store_true",
                        help="tiny shapes in Pallas' interpreter (no GPU needed; what the tests run)")
    args = parser.parse_args(argv)
    if not args.interpret and jax.default_backend() != "gpu":
        print(f"gpu_kernels: no GPU (JAX's backend is {jax.default_backend()}); --interpret runs the cases in "
              "Pallas' interpreter", file=sys.stderr)
        return 2
    jax.config.update("jax_default_matmul_precision", "highest")   # the references' float32 matmuls, not TF32
    device = jax.devices()[0]
    print(f"gpu_kernels on {device.platform} ({device.device_kind}){', interpreted' if args.interpret else ''}",
          flush=True)
    start = time.perf_counter()
    results = check.run_cases(cases(args.interpret), out=lambda line: print(line, flush=True))
    status = 1 if any(not ok for _, ok, _ in results) else 0
    print(f"gpu_kernels: {'all ok' if status == 0 else 'FAILED'} in {time.perf_counter() - start:.0f} s")
    if not args.interpret:   # a job on this machine then takes the verdict instead of checking again
        key = check.verdict_key(device.device_kind)
        where = check.store_verdict(key, dict(check.verdict_of(results), checked=time.strftime("%Y-%m-%d %H:%M:%S"),
                                              by="bench/gpu_kernels.py"))
        print(f"gpu_kernels: verdict for {key!r} {where}"
              + (f"; to record it in the project: PASSED_ON += (({device.device_kind!r}, {jax.__version__!r}, "
                 f"{check.fingerprint()!r}),)" if status == 0 else ""))
    return status


if __name__ == "__main__":
    sys.exit(main())
