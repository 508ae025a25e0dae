"""LayerNorm, and the post-LN encoder's `LayerNorm(dropout(x) + residual)` as one function with its own gradient.

Both are computed in float32 over the last axis, output in the compute dtype. XLA:TPU gets the composition as
written, its variance in one pass (`normalise_rows(one_pass=True)`). Off TPU, `LayerNorm(x, residual, dropout_rng)`
is a `jax.custom_vjp` whose backward keeps only the sum s = dropout(x) + residual (compute dtype) and each row's mean
and 1 / std (float32), and recomputes the dropout mask from its seeds (`dropout.keep_mask_fused`), hashed in place:
differentiated as written, XLA:GPU wrote the sum's gradient for the dropout's backward to read back, and scale's
gradient product dy * xhat in float32 before reducing it (BERT-base on an H200: docs/performance-history.md). The
values are those of the composition: the same mask bits, the same roundings (dropout and the sum in the compute
dtype, then float32), and the backward is LayerNorm's analytic gradient:
    xhat = (s - mean) * rstd,  g = dy * scale
    ds = rstd * (g - mean_row(g) - xhat * mean_row(g * xhat)),  dscale = sum_rows(dy * xhat),  dbias = sum_rows(dy)
    dresidual = ds,  dx = where(keep, ds / keep_probability, 0)
On a GPU (the target platform) both LayerNorms are `layer_norm_gpu`'s Pallas kernels instead, one forward and one
backward with these values, per device on a mesh (unless their check on the card failed: `gpu_kernels.py`); this
custom_vjp is what CPUs run.
"""
from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp

from bertjax.model import dropout as dropout_lib
from bertjax.model.kernels.gpu import gpu_kernels, layer_norm_gpu
from bertjax.model.bert.config import BertConfig
from bertjax.sharding import target_platform


def as_rows(x):
    return x.astype(jnp.float32).reshape(-1, x.shape[-1])


def normalise_rows(s, scale, bias, eps: float, one_pass: bool = False):
    """LayerNorm of float32 `s` over its last axis (rows [N, H] or any leading shape): (y, mean, rstd).

    `one_pass` (TPU): the variance as max(E[s^2] - E[s]^2, 0), as Flax's LayerNorm computes it by default. Both sums
    are taken in one read of s, which XLA:TPU fuses into the matmul that produces s; the centred variance needed a
    second pass over s (in the forward and again in the backward's recomputation): 4 passes a layer, ~8% of
    ModernBERT's priced budget step, ~7% of BERT's (docs/performance.md). The cost is float32 cancellation, a
    relative error of about 6e-8 x (1 + mean^2 / variance) in the variance: far below the bf16 rounding of the
    output at any offset a trained network's rows have (test_layer_norm.py)."""
    mean = s.mean(-1, keepdims=True)
    if one_pass:
        variance = jnp.maximum(jnp.square(s).mean(-1, keepdims=True) - jnp.square(mean), 0.0)
    else:
        variance = jnp.square(s - mean).mean(-1, keepdims=True)
    rstd = jax.lax.rsqrt(variance + eps)
    return (s - mean) * rstd * scale + bias, mean, rstd


def _gpu_kernels_run() -> bool:
    """Whether the program is for a GPU whose LayerNorm kernels passed their check (`gpu_kernels.py`)."""
    return target_platform() == "gpu" and gpu_kernels.runs_kernel("layer_norm")


def layer_norm(x, scale, bias, eps: float, dtype):
    """LayerNorm of `x` over its last axis in float32, output in `dtype`."""
    shape = x.shape
    platform = target_platform()
    if _gpu_kernels_run() and \
            (y := layer_norm_gpu.per_device_layer_norm(x, scale, bias, eps, dtype)) is not None:
        return y
    if platform == "tpu":
        y, _, _ = normalise_rows(x.astype(jnp.float32), scale, bias, eps, one_pass=True)
    else:
        # Over rows of a 2-D array XLA:GPU reduces scale's and bias's gradients over one axis, in the
        # normalisation's own fusions; over [B, L, H] it transposed them first (BERT-base on an H200, priced:
        # 47.9 -> 47.1 ms, 131 kernels fewer). XLA:TPU keeps [B, L, H] (see model/gelu.py; docs/performance-history.md).
        y, _, _ = normalise_rows(as_rows(x), scale, bias, eps)
    return y.astype(dtype).reshape(shape)


def sum_and_layer_norm(x, residual, scale, bias, eps: float, dtype):
    """(residual + x, LayerNorm(residual + x)): a pre-norm layer's residual stream and its next norm, the sum in
    their dtype. On a GPU one kernel reads x and the residual and writes both (XLA wrote the sum, then the LayerNorm
    kernel read it back; in the backward the stream's gradient is added in the LayerNorm's kernel, not in a pass of
    its own); elsewhere the composition."""
    if x.dtype != residual.dtype:
        raise ValueError(f"x ({x.dtype}) and residual ({residual.dtype}) must have one dtype")
    if _gpu_kernels_run() and \
            (both := layer_norm_gpu.per_device_layer_norm(x, scale, bias, eps, dtype, residual,
                                                          return_sum=True)) is not None:
        y, s = both
        return s, y
    s = residual + x
    return s, layer_norm(s, scale, bias, eps, dtype)


def _dropout_sum(x, residual, seeds, rate: float):
    """dropout(x) + residual in their own dtype, as the composition rounds it; the mask drawn where it is used."""
    if seeds is not None:
        x = dropout_lib.apply_keep_mask(x, dropout_lib.keep_mask_fused(seeds, rate, x.shape), rate)
    return x + residual


def residual_layer_norm(x, residual, scale, bias, eps: float, dtype, rate: float = 0.0, rng=None, x_bias=None):
    """LayerNorm(dropout(x + x_bias) + residual) over the last axis (dropout skipped when `rng` is None, x_bias
    when None: the bias of the Dense whose output x is, added in x's dtype); x and residual of one dtype (the
    sum's, whose gradient both get)."""
    if x.dtype != residual.dtype:
        raise ValueError(f"x ({x.dtype}) and residual ({residual.dtype}) must have one dtype")
    fusable = dropout_lib.fusable_shape(x.shape)
    if fusable and _gpu_kernels_run():
        seeds = None if rng is None else dropout_lib.word_seeds(rng)
        y = layer_norm_gpu.per_device_layer_norm(x, scale, bias, eps, dtype, residual, rate, seeds, x_bias)
        if y is not None:
            return y
    if x_bias is not None:
        x = x + x_bias.astype(x.dtype)
    if target_platform() == "tpu" or not fusable:
        if rng is not None:
            x = dropout_lib.dropout(x, rate, rng)
        return layer_norm(x + residual, scale, bias, eps, dtype)
    seeds = None if rng is None else dropout_lib.word_seeds(rng)
    return _fused(eps, jnp.dtype(dtype), rate, x, residual, scale, bias, seeds)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _fused(eps, dtype, rate, x, residual, scale, bias, seeds):
    return _fused_forward(eps, dtype, rate, x, residual, scale, bias, seeds)[0]


def _fused_forward(eps, dtype, rate, x, residual, scale, bias, seeds):
    s = _dropout_sum(x, residual, seeds, rate)
    y, mean, rstd = normalise_rows(as_rows(s), scale, bias, eps)
    return y.astype(dtype).reshape(s.shape), (s, mean, rstd, scale, seeds)


def normalise_backward(dy, s, mean, rstd, scale):
    """LayerNorm's analytic gradient over float32 rows [N, H] (dy, its input s, each row's mean and 1 / std):
    (ds, scale's gradient, bias's gradient)."""
    # Read as kept: XLA:GPU otherwise recomputes the mean from s inside the (dy * xhat) kernel, which then cannot
    # be fused into scale's gradient reduction and writes that product in float32.
    mean, rstd = jax.lax.optimization_barrier((mean, rstd))
    xhat = (s - mean) * rstd
    g = dy * scale
    ds = rstd * (g - g.mean(-1, keepdims=True) - xhat * (g * xhat).mean(-1, keepdims=True))
    return ds, (dy * xhat).sum(0), dy.sum(0)


def _fused_backward(eps, dtype, rate, saved, dy):
    s, mean, rstd, scale, seeds = saved
    ds, dscale, dbias = normalise_backward(as_rows(dy), as_rows(s), mean, rstd, scale)
    ds = ds.astype(s.dtype).reshape(s.shape)  # the sum's gradient, rounded to its dtype as autodiff does
    dx = ds
    if seeds is not None:
        # The seeds through a barrier: the mask is then no common subexpression of the forward's, which XLA would
        # store (a byte an element written and read back) rather than hash again here.
        dx = dropout_lib.apply_keep_mask(
            ds, dropout_lib.keep_mask_fused(jax.lax.optimization_barrier(seeds), rate, s.shape), rate)
    return dx, ds, dscale, dbias, None


_fused.defvjp(_fused_forward, _fused_backward)


class LayerNorm(nn.Module):
    """LayerNorm over the last axis (params `scale`, `bias`). Called as `LayerNorm(x)`, or as
    `LayerNorm(x, residual, dropout_rng, dropout_rate, x_bias)` for LayerNorm(dropout(x + x_bias) + residual)."""

    config: BertConfig

    @nn.compact
    def __call__(self, x, residual=None, dropout_rng=None, dropout_rate: float = 0.0, x_bias=None):
        features = x.shape[-1]
        scale = self.param("scale", nn.with_logical_partitioning(nn.initializers.ones_init(), ("embed",)),
                           (features,), jnp.float32)
        bias = self.param("bias", nn.with_logical_partitioning(nn.initializers.zeros_init(), ("embed",)),
                          (features,), jnp.float32)
        eps, dtype = self.config.layer_norm_eps, jnp.dtype(self.config.dtype)
        if residual is None:
            return layer_norm(x, scale, bias, eps, dtype)
        return residual_layer_norm(x, residual, scale, bias, eps, dtype, dropout_rate, dropout_rng, x_bias)
