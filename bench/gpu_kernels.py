"""The Pallas GPU kernels compiled for the real card, checked against XLA on the same device before anything is
timed (bench/gpu_check.sh runs this first and stops if it fails).

    python3 bench/gpu_kernels.py                         # on a GPU: BERT-base shapes, the kernels through Triton
    .venv/bin/python bench/gpu_kernels.py --interpret    # anywhere: tiny shapes in Pallas' interpreter

Each case runs a kernel family forward and backward, and its XLA reference on the same inputs with the same
dropout mask (tests/kernel_references.py, the tests' own references): the attention with dropout and the q/k/v
biases (`dropout_attention_gpu`) against `reference_attention` with `dropout_keep_mask`; the LayerNorm kernels
(`layer_norm_gpu`: residual + dropout + the Dense's bias, and plain) against the XLA custom_vjp `layer_norm._fused`.
One line per case: the largest error of its output and gradients, each relative to that tensor's largest
magnitude (the q/k/v biases' gradients to the value bias's: the key bias's is ~0), the tensor it is in, the
tolerance, ok or FAIL; a case that raises (a Triton lowering error) is a FAIL with the error's first line. Exit 1 on
any FAIL, 2 without a GPU unless --interpret.

On a GPU: the attention with 12 heads of 64 at batch 4 x seq 128 (padding) and batch 2 x seq 512 (packing), the
model's blocks (`attention.gpu_query_block`); the residual LayerNorm over [4, 128, 768] and [2, 512, 768] (768
held as 1,024 columns), the plain one over the first; dropout 0.1; bf16 and float32: 10 cases. The largest array
is the reference's [2, 12, 512, 512] float32 scores (25 MB): each case is a few small compiles. Interpreted: 8
cases at [2, 64, 2, 16] and [3, 7, 48], 16-36 s (~22 CPU-s) on a loaded 2-core CPU. float32 matmuls at full
precision on both sides (the kernels ask for it; XLA would use TF32). Tolerances: bf16 within its rounding, float32
within reduction order and the GPU's approximate exp/rsqrt (interpreted: 1e-2 and 1e-6); a wrong block, mask or load
is off by more.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # tests/kernel_references.py, run as a script

from bertjax.model import dropout as dropout_lib  # noqa: E402
from bertjax.model.attention import gpu_query_block  # noqa: E402
from tests.kernel_references import (_biases, _inputs, _segments, attention_kernel_and_reference,  # noqa: E402
                                     layer_norm_inputs, layer_norm_kernel_and_reference)

# The largest relative error allowed, by dtype. bf16: the attention rounds P and dS to bf16 for its dots, the
# reference sums the Dense bias's gradient in bf16 (1.1e-2 and 1.4e-2 at seq 512, interpreted on a CPU).
TOLERANCE = {"bfloat16": 5e-2, "float32": 1e-3}
ATTENTION_RATE, ATTENTION_SEED = 0.1, 2024


def compare(case: str, tensors, tolerance: float) -> tuple[bool, str]:
    """(ok, the case's line) for `tensors`: (name, got, want, scale or None) each, the error max|got - want| over
    `scale` (None: max|want|); non-finite values are an infinite error."""
    worst, worst_name = -1.0, ""
    for name, got, want, scale in tensors:
        got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
        scale = np.abs(want).max() if scale is None else scale
        error = float(np.abs(got - want).max() / scale) if np.isfinite(got).all() and got.shape == want.shape \
            else float("inf")
        if not error <= worst:
            worst, worst_name = error, name
    ok = worst <= tolerance
    return ok, f"{case}: max rel error {worst:.1e} ({worst_name}), tolerance {tolerance:.0e}: {'ok' if ok else 'FAIL'}"


def run(cases) -> int:
    """Each case (name, tolerance, compute: () -> tensors for `compare`) run and printed; 1 if any failed."""
    failed = 0
    for case, tolerance, compute in cases:
        start = time.perf_counter()
        try:
            ok, line = compare(case, compute(), tolerance)
        except Exception as error:   # a kernel that does not compile or run on this card: report it, go on
            message = (str(error).strip().splitlines() or [""])[0][:200]
            ok, line = False, f"{case}: FAIL ({type(error).__name__}: {message})"
        failed += not ok
        print(f"{line} [{time.perf_counter() - start:.1f} s]", flush=True)
    return 1 if failed else 0


def _attention_tensors(batch, length, heads, head_dim, layout, dtype, interpret, blocks):
    q, k, v = (x.astype(dtype) for x in _inputs(batch, length, heads, head_dim, seed=1))
    biases, segment_ids = _biases(heads, head_dim, seed=6), _segments(batch, length, layout)
    (out, grads), (expected, expected_grads) = attention_kernel_and_reference(
        q, k, v, biases, segment_ids, ATTENTION_RATE, ATTENTION_SEED, interpret=interpret, **blocks)
    valid = np.asarray(segment_ids) != 0   # padding queries: ignorable outputs (the kernel's see the padding)
    bias_scale = np.abs(np.asarray(expected_grads[3][2])).max()
    return ([("out", np.asarray(out)[valid], np.asarray(expected)[valid], None)]
            + [(name, g, e, None) for name, g, e in zip(("dq", "dk", "dv"), grads[:3], expected_grads[:3])]
            + [(name, g, e, bias_scale) for name, g, e in zip(("dbq", "dbk", "dbv"), grads[3], expected_grads[3])])


def _layer_norm_tensors(shape, dtype, interpret, residual: bool, dropout: bool, out_dtype=None):
    x, residual_x, scale, bias, cotangent = layer_norm_inputs(dtype, shape)
    out_dtype = out_dtype or dtype
    x_bias = 0.5 * jax.random.normal(jax.random.PRNGKey(9), shape[-1:]) if residual else None
    seeds = dropout_lib.word_seeds(jax.random.PRNGKey(7)) if dropout else None
    got, want = layer_norm_kernel_and_reference(x, residual_x if residual else None, scale, bias,
                                                cotangent.astype(out_dtype), out_dtype, seeds, x_bias,
                                                interpret=interpret)
    names = ("y", "dx") + (("dx_bias", "dresidual") if residual else ()) + ("dscale", "dbias")
    return [(name, g, w, None) for name, g, w in zip(names, got, want)]


def cases(interpret: bool):
    """(name, tolerance, compute) of every case: BERT-base shapes on a GPU, tiny ones in the interpreter."""
    if interpret:   # 2 x 2 blocks of 32 (uneven in the forward's keys); 21 rows of 48 columns held as 64
        attention = [(2, 64, 2, 16, "padding", dict(block_q=32, block_k=16, block_bwd=32)),
                     (2, 64, 2, 16, "packing", dict(block_q=32, block_k=32, block_bwd=32))]
        layer_norm_shapes = [(3, 7, 48)]
    else:
        attention = [(batch, length, 12, 64, layout, dict(block_q=gpu_query_block(length), block_k=64, block_bwd=64))
                     for batch, length, layout in ((4, 128, "padding"), (2, 512, "packing"))]
        layer_norm_shapes = [(4, 128, 768), (2, 512, 768)]
    found = []
    for dtype in (jnp.bfloat16, jnp.float32):
        name = jnp.dtype(dtype).name
        for batch, length, heads, head_dim, layout, blocks in attention:
            found.append((f"attention {name} [{batch},{length},{heads},{head_dim}] {layout}, dropout "
                          f"{ATTENTION_RATE}, biases", TOLERANCE[name],
                          lambda a=(batch, length, heads, head_dim, layout, dtype, interpret, blocks):
                          _attention_tensors(*a)))
        for shape in layer_norm_shapes:
            found.append((f"layer_norm {name} {list(shape)} dropout(x + b) + residual", TOLERANCE[name],
                          lambda shape=shape, dtype=dtype: _layer_norm_tensors(shape, dtype, interpret, True, True)))
    shape = layer_norm_shapes[0]   # plain: the embeddings' (float32 in, bf16 out), with and without dropout
    for dropout in (False, True):
        found.append((f"layer_norm float32->bfloat16 {list(shape)} plain{', dropout' if dropout else ''}",
                      TOLERANCE["bfloat16"], lambda dropout=dropout: _layer_norm_tensors(
                          shape, jnp.float32, interpret, False, dropout, out_dtype=jnp.bfloat16)))
    return found


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
    status = run(cases(args.interpret))
    print(f"gpu_kernels: {'all ok' if status == 0 else 'FAILED'} in {time.perf_counter() - start:.0f} s")
    return status


if __name__ == "__main__":
    sys.exit(main())
