"""LayerNorm(dropout(x + b) + residual) and plain LayerNorm as Pallas GPU kernels (Triton lowering): one forward
kernel, one backward kernel, with the values of `layer_norm._fused_forward` / `_fused_backward`. b, optional, is the
bias of the Dense whose output x is (`bert.DenseBeforeLayerNorm`): added here, it is no XLA pass of its own.

- forward, a program per ROWS rows: reads x (and the residual), writes the sum s = dropout(x + b) + residual
  (compute dtype; kept for the backward, not written without a residual, bias or dropout: s is x), y, and each
  row's mean and 1 / std (float32); with `return_sum` s is an output too (a pre-norm layer's residual stream);
- backward, a program per ROWS * BACKWARD_STEPS rows (a loop over blocks of ROWS): reads dy, s, mean and 1 / std
  (and s's own cotangent, added to ds, with `return_sum`), writes ds (the residual's gradient) and, with dropout,
  dx = where(keep, ds / keep_prob, 0) (without dropout dx is ds, not written twice); and per program the column
  sums of dy * xhat and dy in float32 (scale's and bias's gradients), with b those of dx too (b's), added up by
  XLA over an array 1 / (ROWS * BACKWARD_STEPS) of dy's rows.

The keep mask is `dropout.keep_mask_fused`'s, bit for bit: element (row, c) of the rows [N, H] hashes the word
numbered global_row * H / 2 + (c mod H / 2) (`dropout.hash_words`), its low 16 bits for c < H / 2, its high ones
otherwise; global_row = this call's first row (a shard's, `manual_batch_offset`) + the row, an operand of its own
beside the seeds (mult, add). Roundings as the composition's: x + b (b rounded to x's dtype), dropout and the sum
in the compute dtype, statistics and the normalisation in float32.

Triton wants power-of-two shapes: a row is held as its width rounded up to a power of two (768 -> 1024), the
columns past the width masked in every load and store (not read, not written), as are the rows past the last.
Arrays are passed flat (1-D) and addressed by row * width + column. Off GPU (`interpret=True`) the same kernels run
in Pallas' interpreter: the tests on CPU.
"""
from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
from jax.sharding import PartitionSpec

from bertjax.model import dropout as dropout_lib
from bertjax.model.hashing import below, fmix32
from bertjax.sharding import logical_axis_size, manual_batch_offset, target_platform

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

    def load_row(self, ref):
        """A [width] operand (scale, a bias) as a [1, padded] row of float32, 0 past the width."""
        return plgpu.load(ref.at[self.column], mask=self.column_ok, other=0.0).astype(jnp.float32)[None, :]

    def keep(self, seeds_ref, offset_ref, threshold: int):
        """`keep_mask_fused`'s bits at the block's global positions; seeds (mult, add); offset: the first global
        row of this call's rows."""
        half = self.width // 2
        high = self.column >= half
        number = (offset_ref[0] + self.row)[:, None] * half + jnp.where(high, self.column - half, self.column)
        words = fmix32(fmix32(number * seeds_ref[0] + seeds_ref[1]))
        return jnp.where(high[None, :], below(words, threshold << 16), below(words << 16, threshold << 16))


def _forward_kernel(seeds_ref, offset_ref, x_ref, x_bias_ref, residual_ref, scale_ref, bias_ref, *out_refs, n_rows,
                    width, padded, eps, rate, threshold):
    s_ref, y_ref, mean_ref, rstd_ref = out_refs if len(out_refs) == 4 else (None, *out_refs)
    block = _Block(pl.program_id(0) * ROWS, n_rows, width, padded)
    s = block.load(x_ref, x_ref.dtype)
    if x_bias_ref is not None:   # the Dense's output x + b, rounded to x's dtype as the Dense rounds it
        s = s + block.load_row(x_bias_ref).astype(s.dtype)
    if threshold is not None:
        s = dropout_lib.apply_keep_mask(s, block.keep(seeds_ref, offset_ref, threshold), rate)
    if residual_ref is not None:
        s = s + block.load(residual_ref, residual_ref.dtype)
    if s_ref is not None:
        block.store(s_ref, s)
    s = s.astype(jnp.float32)
    mean = jnp.sum(s, axis=1, keepdims=True) / width          # the padding columns load as 0
    centred = jnp.where(block.column_ok[None, :], s - mean, 0.0)
    rstd = lax.rsqrt(jnp.sum(centred * centred, axis=1, keepdims=True) / width + eps)
    block.store(y_ref, centred * rstd * block.load_row(scale_ref) + block.load_row(bias_ref))
    plgpu.store(mean_ref.at[block.row], mean[:, 0], mask=block.row_ok)
    plgpu.store(rstd_ref.at[block.row], rstd[:, 0], mask=block.row_ok)


def _backward_kernel(seeds_ref, offset_ref, dy_ref, s_ref, mean_ref, rstd_ref, scale_ref, ds_in_ref, ds_ref, *out_refs,
                     n_rows, width, padded, rate, threshold, n_sums):
    dx_ref, sums_ref = out_refs if threshold is not None else (None, *out_refs)
    column = jnp.arange(padded, dtype=jnp.int32)
    scale = _Block(0, n_rows, width, padded).load_row(scale_ref)
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
        if ds_in_ref is not None:     # the sum's own cotangent (a pre-norm residual stream's), added as XLA adds
            ds = (ds.astype(jnp.float32) + block.load(ds_in_ref)).astype(ds_ref.dtype)
        block.store(ds_ref, ds)
        dx = ds
        if threshold is not None:
            dx = dropout_lib.apply_keep_mask(ds, block.keep(seeds_ref, offset_ref, threshold), rate)
            block.store(dx_ref, dx)
        column_sums = (dy * xhat, dy, dx.astype(jnp.float32))[:n_sums]   # the third: the x bias's gradient
        return tuple(total + jnp.sum(part, axis=0) for total, part in zip(sums, column_sums))

    totals = lax.fori_loop(0, BACKWARD_STEPS, body, (jnp.zeros((padded,), jnp.float32),) * n_sums)
    for i, total in enumerate(totals):
        plgpu.store(sums_ref.at[(pl.program_id(0) * n_sums + i) * width + column], total, mask=column < width)


def _threshold(rate: float, dropout: bool):
    """The keep threshold, None where nothing is dropped (no key, or rate 0)."""
    threshold = dropout_lib.keep_threshold(rate)
    return threshold if dropout and threshold < 1 << 16 else None


def _call(kernel, grid, out_shapes, interpret, name, *args):
    return pl.pallas_call(kernel, grid=(grid,), out_shape=out_shapes, interpret=interpret, name=name,
                          compiler_params=plgpu.CompilerParams(num_warps=NUM_WARPS, num_stages=1))(*args)


def _without(kernel, present):
    """`kernel` called with None in the places of the absent inputs (`present`: a flag per input); a Pallas call
    takes arrays only."""
    def call(*refs):
        refs = iter(refs)
        return kernel(*(next(refs) if given else None for given in present), *refs)
    return call


def _geometry(x):
    n_rows, width = x.size // x.shape[-1], x.shape[-1]
    if x.size >= 2**31:
        raise ValueError(f"the GPU LayerNorm addresses elements with int32: {x.shape} has too many")
    return dict(n_rows=n_rows, width=width, padded=pl.next_power_of_2(width))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3, 4, 5, 6))
def _layer_norm(eps, dtype, rate, dropout, present, interpret, returns_sum, x, x_bias, residual, scale, bias, seeds,
                offset):
    return _layer_norm_forward(eps, dtype, rate, dropout, present, interpret, returns_sum, x, x_bias, residual, scale,
                               bias, seeds, offset)[0]


def _layer_norm_forward(eps, dtype, rate, dropout, present, interpret, returns_sum, x, x_bias, residual, scale, bias,
                        seeds, offset):
    """`present`: whether (x_bias, residual) are given (static: the backward returns None for the absent);
    `returns_sum`: y and the sum s, not y alone."""
    geometry = _geometry(x)
    flat = jax.ShapeDtypeStruct((x.size,), x.dtype)
    stats = jax.ShapeDtypeStruct((geometry["n_rows"],), jnp.float32)
    threshold = _threshold(rate, dropout)
    keeps_sum = any(present) or threshold is not None   # else the backward reads x as the sum
    out_shapes = ([flat] if keeps_sum else []) + [jax.ShapeDtypeStruct((x.size,), dtype), stats, stats]
    kernel = functools.partial(_forward_kernel, eps=eps, rate=rate, threshold=threshold, **geometry)
    inputs = (seeds, offset, x.reshape(-1), x_bias, None if residual is None else residual.reshape(-1), scale, bias)
    outs = _call(_without(kernel, [a is not None for a in inputs]), pl.cdiv(geometry["n_rows"], ROWS), out_shapes,
                 interpret, "layer_norm_gpu_fwd", *(a for a in inputs if a is not None))
    s = outs[0].reshape(x.shape) if keeps_sum else x
    y, mean, rstd = outs[-3:]
    y = y.reshape(x.shape)
    return (y, s) if returns_sum else y, (s, mean, rstd, scale, seeds, offset)


def _layer_norm_backward(eps, dtype, rate, dropout, present, interpret, returns_sum, saved, cotangent):
    s, mean, rstd, scale, seeds, offset = saved
    dy, ds_in = cotangent if returns_sum else (cotangent, None)
    has_x_bias, has_residual = present
    geometry = _geometry(s)
    threshold = _threshold(rate, dropout)
    flat = jax.ShapeDtypeStruct((s.size,), s.dtype)
    programs = pl.cdiv(geometry["n_rows"], ROWS * BACKWARD_STEPS)
    n_sums = 3 if has_x_bias else 2
    sums = jax.ShapeDtypeStruct((programs * n_sums * geometry["width"],), jnp.float32)
    out_shapes = [flat] + ([flat] if threshold is not None else []) + [sums]
    kernel = functools.partial(_backward_kernel, rate=rate, threshold=threshold, n_sums=n_sums, **geometry)
    inputs = (seeds, offset, dy.reshape(-1), s.reshape(-1), mean, rstd, scale,
              None if ds_in is None else ds_in.reshape(-1))
    outs = _call(_without(kernel, [a is not None for a in inputs]), programs, out_shapes, interpret,
                 "layer_norm_gpu_bwd", *(a for a in inputs if a is not None))
    ds = outs[0].reshape(s.shape)
    dx = outs[1].reshape(s.shape) if threshold is not None else ds
    sums = outs[-1].reshape(programs, n_sums, geometry["width"]).sum(0)
    return (dx, sums[2] if has_x_bias else None, ds if has_residual else None, sums[0], sums[1], None, None)


_layer_norm.defvjp(_layer_norm_forward, _layer_norm_backward)


def layer_norm(x, scale, bias, eps: float, dtype, residual=None, rate: float = 0.0, seeds=None, row_offset=0,
               interpret: bool = False, x_bias=None, return_sum: bool = False):
    """LayerNorm(dropout(x + x_bias) + residual) over the last axis, float32 statistics, output in `dtype`; without
    a residual LayerNorm(dropout(x + x_bias)); x_bias (float32 [width], the Dense's bias before it; None: none)
    added in x's dtype; dropout with `seeds` (`dropout.word_seeds(rng)`; None: none) at `rate`, the mask of
    `keep_mask_fused(seeds, rate, x.shape)` for rows numbered from `row_offset` (a shard's first global row).
    x and residual of one dtype (the sum's; both get its gradient); dropout needs an even width. `return_sum`
    (with a residual): (y, the sum) — a pre-norm layer's residual stream, whose own gradient the backward adds in."""
    if residual is not None and residual.dtype != x.dtype:
        raise ValueError(f"x ({x.dtype}) and residual ({residual.dtype}) must have one dtype")
    if return_sum and residual is None:
        raise ValueError("return_sum needs a residual: without one the sum is x")
    dropout = seeds is not None
    if dropout and not dropout_lib.fusable_shape(x.shape):
        raise ValueError(f"dropout in the GPU LayerNorm needs two axes or more, the last even; got {x.shape}")
    seeds = jnp.zeros(2, jnp.int32) if seeds is None else seeds.astype(jnp.int32)
    offset = jnp.asarray(row_offset, jnp.int32).reshape(1)
    x_bias = None if x_bias is None else x_bias.astype(jnp.float32)
    return _layer_norm(float(eps), jnp.dtype(dtype), float(rate), dropout, (x_bias is not None, residual is not None),
                       interpret, return_sum, x, x_bias, residual, scale.astype(jnp.float32),
                       bias.astype(jnp.float32), seeds, offset)


def per_device_layer_norm(x, scale, bias, eps: float, dtype, residual=None, rate: float = 0.0, seeds=None,
                          x_bias=None, return_sum: bool = False):
    """`layer_norm` run on each device's rows of a multi-device mesh, as `attention.per_device_shard` runs the
    attention kernel (XLA cannot partition a Pallas call): the leading axis split over the activation_batch axes,
    the others whole; each shard's mask rows numbered from its first global row. None where the leading axis does
    not split evenly over those axes (the caller keeps XLA's LayerNorm)."""
    rows_per_example = x.size // (x.shape[0] * x.shape[-1])

    def call(x, residual, scale, bias, seeds, x_bias):
        return layer_norm(x, scale, bias, eps, dtype, residual, rate, seeds,
                          row_offset=manual_batch_offset(x.shape[0]) * rows_per_example,
                          interpret=target_platform() != "gpu", x_bias=x_bias, return_sum=return_sum)

    arrays = (x, residual, scale, bias, seeds, x_bias)
    mesh = jax.sharding.get_abstract_mesh()
    free = () if mesh.empty else tuple(name for name in mesh.axis_names if name not in mesh.manual_axes)
    if mesh.empty or mesh.size == 1 or not free:
        return call(*arrays)
    if x.shape[0] % logical_axis_size("activation_batch"):
        return None
    batch_axes = nn.logical_to_mesh_axes(("activation_batch",))[0]
    rows = PartitionSpec(batch_axes, *(None,) * (x.ndim - 1))
    present = [a is not None for a in arrays]
    specs = (rows, rows) + (PartitionSpec(),) * 4
    return jax.shard_map(_without(call, present), in_specs=tuple(s for s, p in zip(specs, present) if p),
                         out_specs=(rows, rows) if return_sum else rows, axis_names=set(free),
                         check_vma=False)(*(a for a in arrays if a is not None))
