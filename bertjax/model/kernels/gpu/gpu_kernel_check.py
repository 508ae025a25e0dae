"""bertjax's Pallas GPU kernels checked against XLA on the card itself, before a job trusts them.

A user's first job on a GPU must not be the kernels' first test: `prepare`, before a job's first step on a GPU
(the pretraining loop, a fine-tune's or predict's Trainer), looks up this card's verdict, cached per card, jax
version and kernel source (`verdict_key`: a kernel edited since is checked again) in
$XDG_CACHE_HOME/bertjax/gpu_kernels.json (else ~/.cache/bertjax); without one it runs the quick check (`cases`
"quick": small shapes, a few compiles each, seconds) and caches the verdict. A family whose kernels disagree
with XLA (or do not compile) runs XLA's path for the rest of the process (`gpu_kernels.run_xla_for`), said in one
line; processes of a multi-process job agree first (one failed anywhere: XLA's path everywhere, one program).

Each case runs a kernel family forward and backward, and its XLA reference on the same inputs with the same dropout
mask: the attention with dropout and the q/k/v biases (`dropout_attention_gpu`) against `reference_attention` with
`dropout_keep_mask`; the LayerNorm kernels (`layer_norm_gpu`: residual + dropout + the Dense's bias, and plain)
against the XLA custom_vjp `layer_norm._fused`. Its line: the largest error of its output and gradients, each
relative to that tensor's largest magnitude (the q/k/v biases' gradients to the value bias's: the key bias's is
~0), the tensor, the tolerance, ok or FAIL; a case that raises (a Triton lowering error) is a FAIL. The same cases
at BERT-base shapes are `bench/gpu_kernels.py` (what `bench/gpu_check.sh` runs first), tiny and interpreted the
tests' (tests/kernel_references.py names these references for the kernels' own tests).

`bertjax compile` for a GPU host says when the priced program holds kernels with no passing verdict for that card
(`compile_note`): in this machine's cache or in `PASSED_ON`, the checks recorded in the project.
"""
from __future__ import annotations

import hashlib
import json
import os
import pathlib
import time

import jax
import jax.numpy as jnp
import numpy as np

from bertjax.model import dropout as dropout_lib
from bertjax.model.kernels.tpu import dropout_attention as da
from bertjax.model.kernels.gpu import dropout_attention_gpu as dg
from bertjax.model.kernels.gpu import gpu_kernels
from bertjax.model import layer_norm as ln
from bertjax.model.kernels.gpu import layer_norm_gpu as lg
from bertjax.model.attention import gpu_query_block, reference_attention
from bertjax.runtime.errors import OutputWriteError
from bertjax.runtime.input_files import read_json
from bertjax.runtime.outputs import write_whole

# (device_kind, jax version, kernels' fingerprint) of checks that passed on a real card (bench/gpu_check.sh's
# kernels.txt gives the line), recorded here by hand. None yet: these kernels have run only in Pallas' interpreter.
PASSED_ON: tuple[tuple[str, str, str], ...] = ()

# The sources whose edit calls for a new check: the kernels and what they compute with (the TPU kernel's hash).
# Paths under bertjax/model/.
KERNEL_SOURCES = ("kernels/gpu/dropout_attention_gpu.py", "kernels/gpu/layer_norm_gpu.py",
                  "kernels/tpu/dropout_attention.py", "hashing.py")
CACHE_FILE = "gpu_kernels.json"
CHECK_COMMAND = "bash bench/gpu_check.sh"

# The largest relative error allowed, by dtype. bf16: the attention rounds P and dS to bf16 for its dots, the
# reference sums the Dense bias's gradient in bf16 (1.1e-2 and 1.4e-2 at seq 512, interpreted on a CPU). float32:
# reduction order and the GPU's approximate exp/rsqrt; a wrong block, mask or load is off by more.
TOLERANCE = {"bfloat16": 5e-2, "float32": 1e-3}
ATTENTION_RATE, ATTENTION_SEED = 0.1, 2024
LAYER_NORM_EPS, LAYER_NORM_RATE = 1e-12, 0.1


# ------------------------------------------------------------------------------------- the verdict, cached

def fingerprint() -> str:
    """12 hex digits of the kernels' sources (`KERNEL_SOURCES`): a verdict holds for the code it checked."""
    digest = hashlib.sha256()
    for name in KERNEL_SOURCES:
        digest.update((pathlib.Path(__file__).parents[2] / name).read_bytes())
    return digest.hexdigest()[:12]


def verdict_key(device_kind: str, jax_version: str | None = None) -> str:
    return f"{device_kind} | jax {jax_version or jax.__version__} | kernels {fingerprint()}"


def cache_path(cache_dir: str | None = None) -> pathlib.Path:
    directory = pathlib.Path(cache_dir or os.environ.get("XDG_CACHE_HOME") or pathlib.Path.home() / ".cache")
    return directory / "bertjax" / CACHE_FILE


def cached_verdicts(cache_dir: str | None = None) -> dict:
    try:
        found = read_json(cache_path(cache_dir), "the kernels' cached verdicts (JSON)")
    except (OSError, ValueError):  # none yet, or unreadable: checked again (and rewritten)
        return {}
    return found if isinstance(found, dict) else {}


def store_verdict(key: str, verdict: dict, cache_dir: str | None = None) -> str:
    """The verdict written under `key` (the file replaced whole); where, or why not (a read-only home costs only
    the caching: the next job checks again)."""
    path = cache_path(cache_dir)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_whole(path, json.dumps({**cached_verdicts(cache_dir), key: verdict}, indent=1, sort_keys=True))
        return f"cached in {path}"
    except (OSError, OutputWriteError) as error:
        return f"not cached: {error}"


def failed_families(verdict: dict) -> set[str]:
    return {family for family in gpu_kernels.FAMILIES if verdict.get("families", {}).get(family) != "ok"}


def passed(device_kind: str, jax_version: str | None = None, cache_dir: str | None = None) -> bool:
    """Whether every kernel family passed the check on this card with this jax and these kernels: recorded in the
    project (`PASSED_ON`) or in this machine's cache."""
    if (device_kind, jax_version or jax.__version__, fingerprint()) in PASSED_ON:
        return True
    verdict = cached_verdicts(cache_dir).get(verdict_key(device_kind, jax_version))
    return isinstance(verdict, dict) and not failed_families(verdict)


def kernels_in_program(hlo_text: str) -> list[str]:
    """The kernel families (`gpu_kernels.FAMILIES`) whose Triton kernels a compiled GPU program calls."""
    calls = [line for line in hlo_text.splitlines() if "__gpu$xla.gpu.triton" in line]
    return [family for family, (name, _) in gpu_kernels.FAMILIES.items() if any(name in line for line in calls)]


def compile_note(device_kind: str, hlo_text: str, cache_dir: str | None = None) -> str:
    """`bertjax compile`'s line when the priced program holds kernels that have not passed their check on this card
    ('' otherwise)."""
    found = kernels_in_program(hlo_text)
    if not found or passed(device_kind, cache_dir=cache_dir):
        return ""
    names = ", ".join(f"{gpu_kernels.FAMILIES[f][0]} ({gpu_kernels.FAMILIES[f][1]})" for f in found)
    return (f"GPU kernels: the priced program runs bertjax's Pallas kernels {names}, which have not passed their "
            f"check on an {device_kind} with jax {jax.__version__} (kernels {fingerprint()}): check them on the card "
            f"with `{CHECK_COMMAND}` (its first minute, before it times anything). A job checks them itself before "
            f"its first step and runs XLA's path for one that disagrees, which this price does not cover")


# ------------------------------------------------------------------------------------- before a job's first step

def prepare(platform: str, log, *, device=None, check=None, cache_dir: str | None = None) -> frozenset[str]:
    """Before a job's first step on `platform` (its mesh's): on a GPU, the card's verdict (cached, else checked now
    by `check`, default `run_check`, and cached); the families that failed run XLA's path from now on, said in one
    line through `log`. Returns them (empty off GPU: nothing is checked or changed)."""
    if platform != "gpu":
        return frozenset()
    device = device or jax.local_devices()[0]
    key = verdict_key(device.device_kind)
    verdict = cached_verdicts(cache_dir).get(key)
    if not isinstance(verdict, dict) or "families" not in verdict:
        log(f"checking bertjax's Pallas GPU kernels against XLA on this {device.device_kind} (the first job with "
            f"jax {jax.__version__} and these kernels on this card; seconds) ...")
        started = time.perf_counter()
        verdict = dict((check or run_check)(), checked=time.strftime("%Y-%m-%d %H:%M:%S"))
        seconds = time.perf_counter() - started
        where = store_verdict(key, verdict, cache_dir)
        failed = failed_families(verdict)
        log(f"GPU kernel check: {'all ok' if not failed else 'FAILED: ' + ', '.join(sorted(failed))} in "
            f"{seconds:.0f} s, {where}")
    failed = _agreed(failed_families(verdict))
    gpu_kernels.run_xla_for(failed)
    if failed:
        kernels = ", ".join(f"{gpu_kernels.FAMILIES[f][0]} ({gpu_kernels.FAMILIES[f][1]})" for f in sorted(failed))
        first = next((line for line in verdict.get("lines", []) if "FAIL" in line), "")
        log(f"warning: {kernels} disagreed with XLA on this {device.device_kind} ({first or 'on another process'}): "
            f"this job runs XLA's path instead (correct, slower; {cache_path(cache_dir)}, `{CHECK_COMMAND}`)")
    return frozenset(failed)


def _agreed(failed: set[str]) -> set[str]:
    """The families that failed on any process of the job (every process compiles one program)."""
    if jax.process_count() == 1:
        return failed
    from jax.experimental import multihost_utils

    families = sorted(gpu_kernels.FAMILIES)
    bits = np.asarray(multihost_utils.process_allgather(np.array([f in failed for f in families], np.int32)))
    return {f for f, bit in zip(families, bits.reshape(-1, len(families)).max(axis=0)) if bit}


def run_check(size: str = "quick") -> dict:
    """The cases run on JAX's default device (a GPU), as a verdict (`verdict_of`)."""
    with jax.default_matmul_precision("highest"):   # the references' float32 matmuls, not TF32
        return verdict_of(run_cases(cases(size)))


def verdict_of(results) -> dict:
    """{"families": {family: "ok" | "FAIL"}, "lines": [...]} of `run_cases`' results (a family fails with a case)."""
    families = {family: "ok" for family in gpu_kernels.FAMILIES}
    for name, ok, _ in results:
        if not ok:
            families[name.split()[0]] = "FAIL"
    return {"families": families, "lines": [line for _, _, line in results]}


# ------------------------------------------------------------------------------------- the cases

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


def run_cases(found, out=None) -> list[tuple[str, bool, str]]:
    """Each case (name, tolerance, compute: () -> tensors for `compare`) run: (name, ok, its line, with its seconds),
    the line also to `out` (a callable) as it ends. A case that raises is a FAIL line; the others still run."""
    results = []
    for case, tolerance, compute in found:
        start = time.perf_counter()
        try:
            ok, line = compare(case, compute(), tolerance)
        except Exception as error:   # a kernel that does not compile or run on this card: report it, go on
            message = (str(error).strip().splitlines() or [""])[0][:200]
            ok, line = False, f"{case}: FAIL ({type(error).__name__}: {message})"
        line = f"{line} [{time.perf_counter() - start:.1f} s]"
        results.append((case, ok, line))
        if out is not None:
            out(line)
    return results


def cases(size: str):
    """(name, tolerance, compute) of every case, each name starting with its family. `size`: "interpret" (tiny,
    in Pallas' interpreter: the tests), "quick" (small, on the card: a job's check), "bert-base" (BERT-base's
    shapes: bench/gpu_kernels.py). Dropout 0.1, bf16 and float32."""
    interpret = size == "interpret"
    if interpret:   # 2 x 2 blocks of 32 (uneven in the forward's keys); 21 rows of 48 columns held as 64
        attention = [(2, 64, 2, 16, "padding", dict(block_q=32, block_k=16, block_bwd=32)),
                     (2, 64, 2, 16, "packing", dict(block_q=32, block_k=32, block_bwd=32))]
        layer_norm_shapes = [(3, 7, 48)]
    else:   # the model's blocks (`attention.gpu_query_block`); 768 columns held as 1,024
        heads, shapes = (2, ((2, 128, "padding"), (1, 256, "packing"))) if size == "quick" else \
            (12, ((4, 128, "padding"), (2, 512, "packing")))
        attention = [(batch, length, heads, 64, layout, dict(block_q=gpu_query_block(length), block_k=64,
                                                             block_bwd=64)) for batch, length, layout in shapes]
        layer_norm_shapes = [(2, 64, 768)] if size == "quick" else [(4, 128, 768), (2, 512, 768)]
    found = []
    for dtype in (jnp.bfloat16, jnp.float32):
        name = jnp.dtype(dtype).name
        for batch, length, heads, head_dim, layout, blocks in attention:
            found.append((f"attention {name} [{batch},{length},{heads},{head_dim}] {layout}, dropout "
                          f"{ATTENTION_RATE}, biases", TOLERANCE[name],
                          lambda a=(batch, length, heads, head_dim, layout, dtype, interpret, blocks):
                          _attention_tensors(*a)))
        batch, length, heads, head_dim, layout, blocks = attention[-1]
        found.append((f"attention {name} [{batch},{length},3,{heads},{head_dim}] {layout}, stacked q/k/v, rotary, "
                      f"window, dropout {ATTENTION_RATE}, biases", TOLERANCE[name],
                      lambda a=(batch, length, heads, head_dim, layout, dtype, interpret, blocks):
                      _stacked_attention_tensors(*a)))
        for shape in layer_norm_shapes:
            found.append((f"layer_norm {name} {list(shape)} dropout(x + b) + residual", TOLERANCE[name],
                          lambda shape=shape, dtype=dtype: _layer_norm_tensors(shape, dtype, interpret, True, True)))
        found.append((f"layer_norm {name} {list(layer_norm_shapes[0])} pre-norm sum", TOLERANCE[name],
                      lambda dtype=dtype: _pre_norm_sum_tensors(layer_norm_shapes[0], dtype, interpret)))
    shape = layer_norm_shapes[0]   # plain: the embeddings' (float32 in, bf16 out), with and without dropout
    for dropout in (False, True):
        found.append((f"layer_norm float32->bfloat16 {list(shape)} plain{', dropout' if dropout else ''}",
                      TOLERANCE["bfloat16"], lambda dropout=dropout: _layer_norm_tensors(
                          shape, jnp.float32, interpret, False, dropout, out_dtype=jnp.bfloat16)))
    return found


def _attention_tensors(batch, length, heads, head_dim, layout, dtype, interpret, blocks):
    q, k, v = (x.astype(dtype) for x in attention_inputs(batch, length, heads, head_dim, seed=1))
    biases, segment_ids = projection_biases(heads, head_dim, seed=6), segment_ids_for(batch, length, layout)
    (out, grads), (expected, expected_grads) = attention_kernel_and_reference(
        q, k, v, biases, segment_ids, ATTENTION_RATE, ATTENTION_SEED, interpret=interpret, **blocks)
    valid = np.asarray(segment_ids) != 0   # padding queries: ignorable outputs (the kernel's see the padding)
    bias_scale = np.abs(np.asarray(expected_grads[3][2])).max()
    return ([("out", np.asarray(out)[valid], np.asarray(expected)[valid], None)]
            + [(name, g, e, None) for name, g, e in zip(("dq", "dk", "dv"), grads[:3], expected_grads[:3])]
            + [(name, g, e, bias_scale) for name, g, e in zip(("dbq", "dbk", "dbv"), grads[3], expected_grads[3])])


def _stacked_attention_tensors(batch, length, heads, head_dim, layout, dtype, interpret, blocks):
    """ModernBERT's attention: q/k/v stacked, rotated in the kernels, in a window of a quarter of the length."""
    qkv = jnp.stack(attention_inputs(batch, length, heads, head_dim, seed=2), axis=2).astype(dtype)
    biases, segment_ids = projection_biases(heads, head_dim, seed=7), segment_ids_for(batch, length, layout)
    (out, grads), (expected, expected_grads) = stacked_attention_kernel_and_reference(
        qkv, biases, segment_ids, ATTENTION_RATE, ATTENTION_SEED, interpret=interpret, window=length // 4, **blocks)
    valid = np.asarray(segment_ids) != 0
    bias_scale = np.abs(np.asarray(expected_grads[1][2])).max()
    return ([("out", np.asarray(out)[valid], np.asarray(expected)[valid], None)]
            + [(name, grads[0][:, :, i], expected_grads[0][:, :, i], None) for i, name in enumerate(("dq", "dk", "dv"))]
            + [(name, g, e, bias_scale) for name, g, e in zip(("dbq", "dbk", "dbv"), grads[1], expected_grads[1])])


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


def _pre_norm_sum_tensors(shape, dtype, interpret):
    x, residual, scale, bias, cotangent = layer_norm_inputs(dtype, shape)
    got, want = pre_norm_sum_kernel_and_reference(x, residual, scale, bias, cotangent, dtype, interpret=interpret)
    names = ("sum", "y", "dx", "dresidual", "dscale", "dbias")
    return [(name, g, w, None) for name, g, w in zip(names, got, want)]


# ------------------------------------------------------------------------------------- inputs and references

def attention_inputs(batch, length, heads, head_dim, seed=0):
    rng = np.random.default_rng(seed)
    return tuple(jnp.asarray(rng.normal(size=(batch, length, heads, head_dim)), jnp.float32) for _ in range(3))


def segment_ids_for(batch, length, layout):
    """Segment ids: 0 = padding; equal nonzero ids attend to each other."""
    ids = np.ones((batch, length), np.int32)
    if layout == "padding":
        ids[0, length * 3 // 4:] = 0
        ids[-1, 5:] = 0                       # (in a batch of 1 this overrides the first: 5 real tokens)
    elif layout == "packing":
        ids[:, length // 3:] = 2
        ids[:, length * 2 // 3:] = 3
        ids[-1, length - 9:] = 0              # padding after the packed sequences
    return jnp.asarray(ids)


def reference_with_mask(q, k, v, segment_ids, keep_mask, rate, window=None):
    """reference_attention with an explicit keep mask (None: no dropout); segment ids as its masks (0 = padding).
    A padding query sees no key there (the kernel's sees the padding): those rows are left out of comparisons."""
    segment_ids = jnp.asarray(segment_ids)
    return reference_attention(q, k, v, (segment_ids != 0).astype(jnp.int32), segment_ids, dropout_rate=rate,
                               deterministic=keep_mask is None, keep_mask=keep_mask, window=window)


def value_and_grads(attention, weights, *args):
    """attention(*args) and the gradients of sum(sin(out) * weights) with respect to each of args, from one
    forward run (jax.vjp: the interpreted kernels' forward runs once, not once more inside jax.grad)."""
    out, pullback = jax.vjp(attention, *args)
    return out, pullback(jnp.cos(out) * weights)


def projection_biases(heads, head_dim, seed=5):
    """(q, k, v) projection biases [heads, head_dim] float32 (the model's parameters' dtype)."""
    return tuple(jnp.asarray(np.random.default_rng(seed).normal(size=(3, heads, head_dim)), jnp.float32))


def attention_kernel_and_reference(q, k, v, biases, segment_ids, rate, seed, interpret=True, window=None,
                                   **blocks):
    """(out, grads of q, k, v and the biases) of the GPU attention kernel given the (q, k, v) `biases`, and of the
    float32 reference on q + bq, k + bk, v + bv with `dropout_keep_mask`'s mask, on the same inputs (the
    reference's in float32); padding rows are left out of the loss (ignorable outputs). `window`: both sliding."""
    batch, length, heads, _ = q.shape
    weights = (segment_ids != 0).astype(jnp.float32)[:, :, None, None]
    kernel = lambda q, k, v, b: dg.flash_attention_with_dropout(  # noqa: E731
        q, k, v, segment_ids, dropout_rate=rate, seed=seed, biases=b, interpret=interpret, window=window,
        **blocks).astype(jnp.float32)
    mask = da.dropout_keep_mask(seed, batch, heads, length, length, rate) if rate else None
    reference = lambda q, k, v, b: reference_with_mask(q + b[0], k + b[1], v + b[2], segment_ids, mask,  # noqa: E731
                                                       rate, window)
    as32 = [x.astype(jnp.float32) for x in (q, k, v)]
    return (value_and_grads(kernel, weights, q, k, v, biases),
            value_and_grads(reference, weights, *as32, biases))


def packed_positions(segment_ids):
    """int32 [B, S]: each token's position in its packed sequence (0 at each change of segment id)."""
    ids = np.asarray(segment_ids)
    starts = np.concatenate([np.ones_like(ids[:, :1], bool), ids[:, 1:] != ids[:, :-1]], axis=1)
    index = np.broadcast_to(np.arange(ids.shape[1]), ids.shape)
    return jnp.asarray(index - np.maximum.accumulate(np.where(starts, index, 0), axis=1), jnp.int32)


def stacked_attention_kernel_and_reference(qkv, biases, segment_ids, rate, seed, interpret=True, window=None,
                                           theta=10000.0, **blocks):
    """As `attention_kernel_and_reference`, for ModernBERT's layout: q/k/v stacked [B, S, 3, H, D] (one
    projection's output) with the rotary positions of the packed sequences applied in the kernels; the reference
    adds the biases and rotates q and k with `rope.apply_rotary` first. Gradients of qkv and the biases."""
    from bertjax.model import rope

    batch, length, _, heads, head_dim = qkv.shape
    weights = (segment_ids != 0).astype(jnp.float32)[:, :, None, None]
    cos, sin = rope.cos_sin(packed_positions(segment_ids), head_dim, theta)
    kernel = lambda qkv, b: dg.stacked_flash_attention_with_dropout(  # noqa: E731
        qkv, segment_ids, dropout_rate=rate, seed=seed, biases=b, interpret=interpret, window=window,
        rotary=(cos, sin), **blocks).astype(jnp.float32)
    mask = da.dropout_keep_mask(seed, batch, heads, length, length, rate) if rate else None

    def reference(qkv, b):
        q, k, v = (qkv[:, :, i] + b[i] for i in range(3))
        q, k = (rope.apply_rotary(x.reshape(batch, length, -1), cos, sin, head_dim).reshape(x.shape) for x in (q, k))
        return reference_with_mask(q, k, v, segment_ids, mask, rate, window)

    return (value_and_grads(kernel, weights, qkv, biases),
            value_and_grads(reference, weights, qkv.astype(jnp.float32), biases))


def layer_norm_inputs(dtype, shape=(3, 8, 64)):
    """(x, residual, scale, bias, cotangent): x in `dtype` off centre, scale near 1 and bias float32 [width]."""
    keys = jax.random.split(jax.random.PRNGKey(0), 5)
    x = (2.0 * jax.random.normal(keys[0], shape) + 0.5).astype(dtype)
    residual = jax.random.normal(keys[1], shape).astype(dtype)
    scale = 1.0 + 0.3 * jax.random.normal(keys[2], shape[-1:])
    bias = 0.1 * jax.random.normal(keys[3], shape[-1:])
    cotangent = jax.random.normal(keys[4], shape).astype(dtype)
    return x, residual, scale, bias, cotangent


def layer_norm_value_and_grads(fn, cotangent, *args):
    y, pullback = jax.vjp(fn, *args)
    return (y,) + pullback(cotangent)


def layer_norm_kernel_and_reference(x, residual, scale, bias, cotangent, dtype, seeds=None, x_bias=None,
                                    interpret=True):
    """(y, gradients of x, [x_bias], [residual], scale, bias) of the GPU LayerNorm kernels on
    LayerNorm(dropout(x + x_bias) + residual) in `dtype` (x_bias, residual: None for none; seeds: None, no
    dropout), and of the XLA custom_vjp they replace (`layer_norm._fused`, a residual of zeros where none),
    x_bias added in x's dtype before it."""
    args = [a for a in (x, x_bias, residual, scale, bias) if a is not None]

    def split(args):
        args = iter(args)
        return [next(args) if a is not None else None for a in (x, x_bias, residual, scale, bias)]

    def kernel(*args):
        x, x_bias, residual, scale, bias = split(args)
        return lg.layer_norm(x, scale, bias, LAYER_NORM_EPS, dtype, residual, LAYER_NORM_RATE, seeds,
                             interpret=interpret, x_bias=x_bias)

    def xla(*args):
        x, x_bias, residual, scale, bias = split(args)
        summand = jnp.zeros_like(x) if residual is None else residual
        x = x if x_bias is None else x + x_bias.astype(x.dtype)
        return ln._fused(LAYER_NORM_EPS, jnp.dtype(dtype), LAYER_NORM_RATE, x, summand, scale, bias, seeds)

    return tuple(layer_norm_value_and_grads(f, cotangent, *args) for f in (kernel, xla))


def pre_norm_sum_kernel_and_reference(x, residual, scale, bias, cotangent, dtype, interpret=True):
    """(sum, y, gradients of x, residual, scale, bias) of the GPU kernels returning residual + x and its LayerNorm
    (ModernBERT's residual stream: `layer_norm.sum_and_layer_norm`), both outputs given a cotangent (the sum's:
    `cotangent` reversed along its rows), and of the XLA composition (the sum, then `layer_norm._fused`)."""
    sum_cotangent = cotangent[..., ::-1, :]

    def kernel(x, residual, scale, bias):
        y, total = lg.layer_norm(x, scale, bias, LAYER_NORM_EPS, dtype, residual, interpret=interpret,
                                 return_sum=True)
        return total, y

    def xla(x, residual, scale, bias):
        total = residual + x
        return total, ln._fused(LAYER_NORM_EPS, jnp.dtype(dtype), 0.0, total, jnp.zeros_like(total), scale, bias,
                                None)

    def value_and_grads(f):
        (total, y), pullback = jax.vjp(f, x, residual, scale, bias)
        return (total, y, *pullback((sum_cotangent, cotangent)))

    return value_and_grads(kernel), value_and_grads(xla)
