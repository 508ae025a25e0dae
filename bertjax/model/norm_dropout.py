"""dropout(LayerNorm(x)), the embeddings' tail, with its own gradients off TPU.

Its values are those of `layer_norm.layer_norm` then `dropout.dropout` (the same mask bits and roundings); XLA:TPU
gets that composition as written (its program is left as it was). On GPU the LayerNorm is `layer_norm_gpu`'s
kernels and the dropout `_rehashed_dropout`, whose backward hashes the mask again (2 layers on an H200, priced
against this module's VJP: 8.81 -> 8.75 ms, 0.15 GB less; ESTIMATES). On CPU one VJP whose backward keeps x
(float32), each row's mean and 1 / std and the dropout's seeds, and hashes the mask again where it is used
(`dropout.keep_mask_fused`): differentiated as written, XLA:GPU stored the mask (a byte an element, hashed and
concatenated in passes of their own) and wrote scale's gradient product dz * xhat in float32 before reducing it
(BERT-base on an H200: docs/performance-history.md). With z the LayerNorm's output (compute dtype):
    dz = where(keep, dy / keep_probability, 0),  xhat = (x - mean) * rstd,  g = dz * scale
    dx = rstd * (g - mean_row(g) - xhat * mean_row(g * xhat)),  dscale = sum_rows(dz * xhat),  dbias = sum_rows(dz)
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from bertjax.model import dropout as dropout_lib
from bertjax.model.kernels.gpu import gpu_kernels
from bertjax.model.layer_norm import as_rows, layer_norm, normalise_backward, normalise_rows
from bertjax.sharding import target_platform


def norm_then_dropout(x, scale, bias, eps: float, dtype, rate: float = 0.0, rng=None):
    """dropout(LayerNorm(x)) over the last axis, LayerNorm in float32, output in `dtype` (dropout skipped when
    `rng` is None)."""
    if target_platform() == "gpu" and dropout_lib.fusable_shape(x.shape) and gpu_kernels.runs_kernel("layer_norm"):
        y = layer_norm(x, scale, bias, eps, dtype)   # layer_norm_gpu's kernels
        return y if rng is None else _rehashed_dropout(rate, y, dropout_lib.word_seeds(rng))
    if target_platform() == "tpu" or not dropout_lib.fusable_shape(x.shape):
        y = layer_norm(x, scale, bias, eps, dtype)
        return y if rng is None else dropout_lib.dropout(y, rate, rng)
    seeds = None if rng is None else dropout_lib.word_seeds(rng)
    return _fused(eps, jnp.dtype(dtype), rate, x, scale, bias, seeds)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _fused(eps, dtype, rate, x, scale, bias, seeds):
    return _fused_forward(eps, dtype, rate, x, scale, bias, seeds)[0]


def _fused_forward(eps, dtype, rate, x, scale, bias, seeds):
    z, mean, rstd = normalise_rows(as_rows(x), scale, bias, eps)
    z = z.astype(dtype).reshape(x.shape)
    if seeds is not None:
        z = dropout_lib.apply_keep_mask(z, dropout_lib.keep_mask_fused(seeds, rate, x.shape), rate)
    return z, (x, mean, rstd, scale, seeds)


def _fused_backward(eps, dtype, rate, saved, dy):
    x, mean, rstd, scale, seeds = saved
    # As layer_norm.py's backward: the statistics read as kept (computed again here, a pass more over x, priced
    # worse); the seeds through a barrier (the mask hashed again here, not stored by the forward as a common
    # subexpression).
    if seeds is not None:
        dy = dropout_lib.apply_keep_mask(
            dy, dropout_lib.keep_mask_fused(jax.lax.optimization_barrier(seeds), rate, x.shape), rate)
    dx, dscale, dbias = normalise_backward(as_rows(dy), as_rows(x), mean, rstd, scale)
    return dx.astype(x.dtype).reshape(x.shape), dscale, dbias, None


_fused.defvjp(_fused_forward, _fused_backward)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _rehashed_dropout(rate, y, seeds):
    """`dropout.dropout`'s values from the seeds; the backward hashes the mask again rather than reading it stored."""
    return dropout_lib.apply_keep_mask(y, dropout_lib.keep_mask_fused(seeds, rate, y.shape), rate)


def _rehashed_dropout_forward(rate, y, seeds):
    return _rehashed_dropout(rate, y, seeds), seeds


def _rehashed_dropout_backward(rate, seeds, dy):
    # The seeds through a barrier: otherwise the forward's mask is a common subexpression XLA stores.
    keep = dropout_lib.keep_mask_fused(jax.lax.optimization_barrier(seeds), rate, dy.shape)
    return dropout_lib.apply_keep_mask(dy, keep, rate), None


_rehashed_dropout.defvjp(_rehashed_dropout_forward, _rehashed_dropout_backward)
