"""LayerNorm(dropout(x) + residual) and plain LayerNorm as Pallas GPU kernels (Triton lowering): one forward
kernel, one backward kernel, with the values of `layer_norm._fused_forward` / `_fused_backward`.

- forward, a program per ROWS rows: reads x (and the residual), writes the sum s = dropout(x) + residual (compute
  dtype; kept for the backward, not written without a residual: s is x), y, and each row's mean and 1 / std
  (float32);
- backward, a program per ROWS * BACKWARD_STEPS rows (a loop over blocks of ROWS): reads dy, s, mean and 1 / std,
  writes ds (the residual's gradient) and, with dropout, dx = where(keep, ds / keep_prob, 0) (without dropout dx is
  ds, not written twice); and per program the column sums of dy * xhat and dy in float32 (scale's and bias's
  gradients, added up by XLA over an array 1 / (ROWS * BACKWARD_STEPS) of dy's rows).

The keep mask is `dropout.keep_mask_fused`'s, bit for bit: element (row, c) of the rows [N, H] hashes the word
numbered global_row * H / 2 + (c mod H / 2) (`dropout.hash_words`), its low 16 bits for c < H / 2, its high ones
otherwise; global_row = this call's first row (a shard's, `manual_batch_offset`) + the row. Roundings as the
composition's: dropout and the sum in the compute dtype, statistics and the normalisation in float32.

Triton wants power-of-two shapes: a row is held as its width rounded up to a power of two (768 -> 1024), the
columns past the width masked in every load and store (not read, not written), as are the rows past the last.
Arrays are passed flat (1-D) and addressed by row * width + column. Off GPU (`interpret=True`) the same kernels run
in Pallas' interpreter: the tests on CPU.
"""
from __future__ import annotations

import functools
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
from jax.sharding import PartitionSpec

from bertjax.model import dropout as dropout_lib
from bertjax.model.hashing import below, fmix32
from bertjax.sharding import manual_batch_offset, target_platform

# Rows per forward program (4,096 programs for BERT-base's 32,768 rows); the backward loops over BACKWARD_STEPS
# such blocks per program (512 programs; its partial sums 1/64 of dy's rows); 8 warps: 32 float32 registers per
# thread for each [8, 1024] block held. Not tuned on a GPU.
ROWS, BACKWARD_STEPS, NUM_WARPS = 8, 8, 8


class _Block:
    """The positions of a block of ROWS rows starting at `first_row` of [n_rows, width], padded to `padded`
    columns: flat indices, masks, the keep mask."""

    def __init__(self, first_row, n_rows: int, width: int, padded: int):
        self.row = first_row + jnp.arange(ROWS, dtype=jnp.int32)
        self.column = jnp.arange(padded, dtype=jnp.int32)
        self.row_ok, self.column_ok = self.row < n_rows, self.column < width
        self.ok = self.row_ok[:, None] & self.column_ok[None, :]
        self.at = self.row[:, None] * width + self.column[None, :]
        self.width = width

    def load(self, ref, dtype=jnp.float32):
        return plgpu.load(ref.at[self.at], mask=self.ok, other=0).astype(dtype)

    def store(self, ref, value):
        plgpu.store(ref.at[self.at], value.astype(ref.dtype), mask=self.ok)

    def row_stat(self, ref):
        return plgpu.load(ref.at[self.row], mask=self.row_ok, other=0.0)[:, None]

    def keep(self, scalars_ref, threshold: int):
        """`keep_mask_fused`'s bits at the block's global positions; scalars: (mult, add, first global row, 0)."""
        half = self.width // 2
        high = self.column >= half
        number = (scalars_ref[2] + self.row)[:, None] * half + jnp.where(high, self.column - half, self.column)
        words = fmix32(fmix32(number * scalars_ref[0] + scalars_ref[1]))
        return jnp.where(high[None, :], below(words, threshold << 16), below(words << 16, threshold << 16))


def _dropped(x, keep, rate: float):
    """where(keep, x / keep_prob, 0) in x's dtype (the scaling in float32, rounded once: `dropout.dropout`'s)."""
    scaled = (x.astype(jnp.float32) * dropout_lib.keep_scale(rate)).astype(x.dtype)
    return jnp.where(keep, scaled, jnp.zeros((), x.dtype))


def _forward_kernel(scalars_ref, x_ref, residual_ref, scale_ref, bias_ref, *out_refs, n_rows, width, padded, eps,
                    rate, threshold):
    s_ref, y_ref, mean_ref, rstd_ref = out_refs if len(out_refs) == 4 else (None, *out_refs)
    block = _Block(pl.program_id(0) * ROWS, n_rows, width, padded)
    s = block.load(x_ref, x_ref.dtype)
    if threshold is not None:
        s = _dropped(s, block.keep(scalars_ref, threshold), rate)
    if residual_ref is not None:
        s = s + block.load(residual_ref, residual_ref.dtype)
    if s_ref is not None:
        block.store(s_ref, s)
    s = s.astype(jnp.float32)
    mean = jnp.sum(s, axis=1, keepdims=True) / width          # the padding columns load as 0
    centred = jnp.where(block.column_ok[None, :], s - mean, 0.0)
    rstd = lax.rsqrt(jnp.sum(centred * centred, axis=1, keepdims=True) / width + eps)
    scale = plgpu.load(scale_ref.at[block.column], mask=block.column_ok, other=0.0)
    bias = plgpu.load(bias_ref.at[block.column], mask=block.column_ok, other=0.0)
    block.store(y_ref, centred * rstd * scale[None, :] + bias[None, :])
    plgpu.store(mean_ref.at[block.row], mean[:, 0], mask=block.row_ok)
    plgpu.store(rstd_ref.at[block.row], rstd[:, 0], mask=block.row_ok)


def _backward_kernel(scalars_ref, dy_ref, s_ref, mean_ref, rstd_ref, scale_ref, ds_ref, *out_refs, n_rows, width,
                     padded, rate, threshold):
    dx_ref, sums_ref = out_refs if threshold is not None else (None, *out_refs)
    column = jnp.arange(padded, dtype=jnp.int32)
    scale = plgpu.load(scale_ref.at[column], mask=column < width, other=0.0)[None, :]
    first_row = pl.program_id(0) * BACKWARD_STEPS * ROWS   # read here: the interpreter has no program id in a loop

    def body(step, sums):
        block = _Block(first_row + step * ROWS, n_rows, width, padded)
        dy = block.load(dy_ref)   # the rows past the last load as 0: they add nothing to the sums
        rstd = block.row_stat(rstd_ref)
        xhat = jnp.where(block.column_ok[None, :], (block.load(s_ref) - block.row_stat(mean_ref)) * rstd, 0.0)
        g = dy * scale
        ds = rstd * (g - jnp.sum(g, axis=1, keepdims=True) / width
                     - xhat * (jnp.sum(g * xhat, axis=1, keepdims=True) / width))
        ds = ds.astype(ds_ref.dtype)   # the sum's gradient, rounded to its dtype as autodiff does
        block.store(ds_ref, ds)
        if threshold is not None:
            block.store(dx_ref, _dropped(ds, block.keep(scalars_ref, threshold), rate))
        return sums[0] + jnp.sum(dy * xhat, axis=0), sums[1] + jnp.sum(dy, axis=0)

    zeros = jnp.zeros((padded,), jnp.float32)
    dscale, dbias = lax.fori_loop(0, BACKWARD_STEPS, body, (zeros, zeros))
    at = pl.program_id(0) * 2 * width + column
    plgpu.store(sums_ref.at[at], dscale, mask=column < width)
    plgpu.store(sums_ref.at[at + width], dbias, mask=column < width)


def _threshold(rate: float, dropout: bool):
    """The keep threshold, None where nothing is dropped (no key, or rate 0)."""
    threshold = dropout_lib.keep_threshold(rate)
    return threshold if dropout and threshold < 1 << 16 else None


def _call(kernel, grid, out_shapes, interpret, name, *args):
    return pl.pallas_call(kernel, grid=(grid,), out_shape=out_shapes, interpret=interpret, name=name,
                          compiler_params=plgpu.CompilerParams(num_warps=NUM_WARPS, num_stages=1))(*args)


def _geometry(x):
    n_rows, width = x.size // x.shape[-1], x.shape[-1]
    if x.size >= 2**31:
        raise ValueError(f"the GPU LayerNorm addresses elements with int32: {x.shape} has too many")
    return dict(n_rows=n_rows, width=width, padded=pl.next_power_of_2(width))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3, 4, 5))
def _layer_norm(eps, dtype, rate, dropout, has_residual, interpret, x, residual, scale, bias, scalars):
    return _layer_norm_forward(eps, dtype, rate, dropout, has_residual, interpret, x, residual, scale, bias, scalars)[0]


def _layer_norm_forward(eps, dtype, rate, dropout, has_residual, interpret, x, residual, scale, bias, scalars):
    geometry = _geometry(x)
    flat = jax.ShapeDtypeStruct((x.size,), x.dtype)
    stats = jax.ShapeDtypeStruct((geometry["n_rows"],), jnp.float32)
    threshold = _threshold(rate, dropout)
    keeps_sum = residual is not None or threshold is not None   # else the backward reads x as the sum
    out_shapes = ([flat] if keeps_sum else []) + [jax.ShapeDtypeStruct((x.size,), dtype), stats, stats]
    kernel = functools.partial(_forward_kernel, eps=eps, rate=rate, threshold=threshold, **geometry)
    if residual is None:   # a None ref in the residual's place
        kernel = functools.partial(lambda k, scalars, x, *rest: k(scalars, x, None, *rest), kernel)
    operands = [a.reshape(-1) for a in (x, residual) if a is not None]
    outs = _call(kernel, pl.cdiv(geometry["n_rows"], ROWS), out_shapes, interpret, "layer_norm_gpu_fwd", scalars,
                 *operands, scale, bias)
    s = outs[0].reshape(x.shape) if keeps_sum else x
    y, mean, rstd = outs[-3:]
    return y.reshape(x.shape), (s, mean, rstd, scale, scalars)


def _layer_norm_backward(eps, dtype, rate, dropout, has_residual, interpret, saved, dy):
    s, mean, rstd, scale, scalars = saved
    geometry = _geometry(s)
    threshold = _threshold(rate, dropout)
    flat = jax.ShapeDtypeStruct((s.size,), s.dtype)
    programs = pl.cdiv(geometry["n_rows"], ROWS * BACKWARD_STEPS)
    sums = jax.ShapeDtypeStruct((programs * 2 * geometry["width"],), jnp.float32)
    out_shapes = [flat] + ([flat] if threshold is not None else []) + [sums]
    kernel = functools.partial(_backward_kernel, rate=rate, threshold=threshold, **geometry)
    outs = _call(kernel, programs, out_shapes, interpret, "layer_norm_gpu_bwd", scalars, dy.reshape(-1),
                 s.reshape(-1), mean, rstd, scale)
    ds = outs[0].reshape(s.shape)
    dx = outs[1].reshape(s.shape) if threshold is not None else ds
    sums = outs[-1].reshape(programs, 2, geometry["width"]).sum(0)
    return dx, ds if has_residual else None, sums[0], sums[1], None


_layer_norm.defvjp(_layer_norm_forward, _layer_norm_backward)


def layer_norm(x, scale, bias, eps: float, dtype, residual=None, rate: float = 0.0, seeds=None, row_offset=0,
               interpret: bool = False):
    """LayerNorm(dropout(x) + residual) over the last axis, float32 statistics, output in `dtype`; without a
    residual LayerNorm(x); dropout with `seeds` (`dropout.word_seeds(rng)`; None: none) at `rate`, the mask of
    `keep_mask_fused(seeds, rate, x.shape)` for rows numbered from `row_offset` (a shard's first global row).
    x and residual of one dtype (the sum's; both get its gradient); dropout needs an even width."""
    if residual is not None and residual.dtype != x.dtype:
        raise ValueError(f"x ({x.dtype}) and residual ({residual.dtype}) must have one dtype")
    dropout = seeds is not None
    if dropout and not dropout_lib.fusable_shape(x.shape):
        raise ValueError(f"dropout in the GPU LayerNorm needs two axes or more, the last even; got {x.shape}")
    scalars = jnp.concatenate([jnp.zeros(2, jnp.int32) if seeds is None else seeds.astype(jnp.int32),
                               jnp.asarray(row_offset, jnp.int32).reshape(1), jnp.zeros(1, jnp.int32)])
    return _layer_norm(float(eps), jnp.dtype(dtype), float(rate), dropout, residual is not None, interpret, x,
                       residual, scale.astype(jnp.float32), bias.astype(jnp.float32), scalars)


def per_device_layer_norm(x, scale, bias, eps: float, dtype, residual=None, rate: float = 0.0, seeds=None):
    """`layer_norm` run on each device's rows of a multi-device mesh, as `attention.per_device_shard` runs the
    attention kernel (XLA cannot partition a Pallas call): the leading axis split over the activation_batch axes,
    the others whole; each shard's mask rows numbered from its first global row. None where the leading axis does
    not split evenly over those axes (the caller keeps XLA's LayerNorm)."""
    rows_per_example = x.size // (x.shape[0] * x.shape[-1])

    def call(x, residual, scale, bias, seeds):
        return layer_norm(x, scale, bias, eps, dtype, residual, rate, seeds,
                          row_offset=manual_batch_offset(x.shape[0]) * rows_per_example,
                          interpret=target_platform() != "gpu")

    mesh = jax.sharding.get_abstract_mesh()
    free = () if mesh.empty else tuple(name for name in mesh.axis_names if name not in mesh.manual_axes)
    if mesh.empty or mesh.size == 1 or not free:
        return call(x, residual, scale, bias, seeds)
    batch_axes = nn.logical_to_mesh_axes(("activation_batch",))[0]
    names = (batch_axes,) if isinstance(batch_axes, str) else tuple(batch_axes or ())
    if x.shape[0] % math.prod(mesh.shape[name] for name in names):
        return None
    rows = PartitionSpec(batch_axes, *(None,) * (x.ndim - 1))
    arrays = (x, residual, scale, bias, seeds)
    present = [a is not None for a in arrays]
    specs = (rows, rows, PartitionSpec(), PartitionSpec(), PartitionSpec())

    def local(*given):   # shard_map takes arrays only: the absent residual or seeds put back as None
        given = iter(given)
        return call(*(next(given) if p else None for p in present))

    return jax.shard_map(local, in_specs=tuple(s for s, p in zip(specs, present) if p), out_specs=rows,
                         axis_names=set(free), check_vma=False)(*(a for a in arrays if a is not None))
