"""RoPE on q and k in one Pallas TPU kernel, in the projections' [B, S, heads * head_dim] layout.

XLA:TPU moved each head's halves (rotate_half) through copies in layouts of 64 lanes padded to 128, and the
rotation taken from the weights (x rotate_half(W): `modernbert.RotaryQKV`) doubles q's and k's projections (16% of
modernbert-base's budget step on v5e by XLA's estimate). Here each [rows, 128] block of q and k (two heads of 64,
or one of 128) is rotated in vector registers: the partner lanes come from two lane rotations (`pltpu.roll`) and
a select, then x cos + partner sin in float32, rounded once to q's dtype (as transformers computes it). One pass
over q and k each way; the backward is the same kernel with -sin (a rotation's transpose is its inverse).

Which rotation brings each lane its partner is read off the rotated lane indices themselves, so the kernel does
not depend on the direction `pltpu.roll` rotates in (interpret mode and Mosaic have disagreed on it before).
Off TPU it runs in interpret mode (`pltpu.force_tpu_interpret_mode()`, tests on CPU).
"""
from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.sharding import PartitionSpec

from bertjax.model import rope

LANES = 128
MAX_BLOCK_ROWS = 512


def supported(width: int, head_dim: int, length: int) -> bool:
    """Whether q/k of `width` lanes with heads of `head_dim` fit the kernel's [rows, 128] blocks of whole heads."""
    return width % LANES == 0 and LANES % head_dim == 0 and head_dim % 2 == 0 and _block_rows(length) is not None


def _block_rows(length: int) -> int | None:
    for rows in (MAX_BLOCK_ROWS, 256, 128, 64, 32, 16, 8):
        if length % rows == 0:
            return rows
    return None


def lane_tables(cos, sin, head_dim: int):
    """(cos, signed sin), float32 [B or 1, S, 128], from rope.cos_sin's [B or 1, S, head_dim]: tiled over the
    heads of a 128-lane block, sin negated in each head's first half (there the partner enters as -x[l + d/2])."""
    heads = LANES // head_dim
    signed = jnp.where(jnp.arange(head_dim) < head_dim // 2, -sin, sin)
    return jnp.tile(cos.astype(jnp.float32), heads), jnp.tile(signed.astype(jnp.float32), heads)


def _kernel(q_ref, k_ref, cos_ref, sin_ref, q_out, k_out, *, head_dim: int):
    half = head_dim // 2
    cos, sin = cos_ref[0], sin_ref[0]                                   # [rows, 128] float32
    lane = lax.broadcasted_iota(jnp.int32, cos.shape, 1)
    wanted = jnp.where(lane % head_dim < half, lane + half, lane - half)  # the partner lane, inside the head
    from_first = pltpu.roll(lane, half, 1) == wanted                     # which rotation brings it
    for x_ref, out_ref in ((q_ref, q_out), (k_ref, k_out)):
        for block in range(x_ref.shape[-1] // LANES):
            lanes = slice(block * LANES, (block + 1) * LANES)
            x = x_ref[0, :, lanes].astype(jnp.float32)
            partner = jnp.where(from_first, pltpu.roll(x, half, 1), pltpu.roll(x, LANES - half, 1))
            out_ref[0, :, lanes] = (x * cos + partner * sin).astype(out_ref.dtype)


def _rotate(q, k, cos, sin, head_dim: int):
    batch, length, width = q.shape
    rows = _block_rows(length)
    grid = (batch, length // rows)
    x_spec = pl.BlockSpec((1, rows, width), lambda b, r: (b, r, 0))
    table_batch = cos.shape[0]
    table_spec = pl.BlockSpec((1, rows, LANES), lambda b, r: (b if table_batch > 1 else 0, r, 0))
    elements = 2 * q.size
    # Per element: 2 rolls, a select, 2 multiplies, an add and the casts; bytes: q and k in and out, the tables.
    cost = pl.CostEstimate(flops=8 * elements, transcendentals=0,
                           bytes_accessed=2 * (q.nbytes + k.nbytes) + batch * length * LANES * 4 * 2)
    return pl.pallas_call(
        functools.partial(_kernel, head_dim=head_dim), grid=grid,
        in_specs=[x_spec, x_spec, table_spec, table_spec], out_specs=[x_spec, x_spec],
        out_shape=[jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct(k.shape, k.dtype)],
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel")),
        cost_estimate=cost, name="rope_qk",
    )(q, k, cos, sin)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def rotate_qk(q, k, cos, sin, head_dim: int):
    """(q, k) [B, S, heads * head_dim] rotated by `lane_tables`' (cos, signed sin) [B or 1, S, 128]: rope.rotate's
    values to rounding (float32 arithmetic, one rounding)."""
    return tuple(_rotate(q, k, cos, sin, head_dim))


def _rotate_fwd(q, k, cos, sin, head_dim):
    return rotate_qk(q, k, cos, sin, head_dim), (cos, sin)


def _rotate_bwd(head_dim, saved, grads):
    cos, sin = saved
    dq, dk = _rotate(*grads, cos, -sin, head_dim)
    return dq, dk, jnp.zeros_like(cos), jnp.zeros_like(sin)


rotate_qk.defvjp(_rotate_fwd, _rotate_bwd)


def rotate_qk_on_devices(q, k, cos, sin, head_dim: int):
    """q and k [B, S, heads * head_dim] rotated by rope.cos_sin's (cos, sin) [B or 1, S, head_dim]: `rotate_qk` on
    each device's shard of a multi-device mesh (XLA cannot partition a Mosaic kernel), q and k split as the
    logical-axis rules split activations' batch, length and heads, the tables like the batch and length. A shard the
    kernel does not take (`supported`) is rotated by `rope.apply_rotary` instead."""
    def local(q, k, cos, sin):
        if supported(q.shape[-1], head_dim, q.shape[1]):
            return rotate_qk(q, k, *lane_tables(cos, sin, head_dim), head_dim)
        return tuple(rope.apply_rotary(x, cos, sin, head_dim) for x in (q, k))

    mesh = jax.sharding.get_abstract_mesh()
    free = () if mesh.empty else tuple(name for name in mesh.axis_names if name not in mesh.manual_axes)
    if mesh.empty or mesh.size == 1 or not free:
        return local(q, k, cos, sin)
    x_spec = PartitionSpec(*nn.logical_to_mesh_axes(("activation_batch", "activation_length", "activation_heads")))
    table_spec = PartitionSpec(x_spec[0] if cos.shape[0] > 1 else None, x_spec[1], None)
    return jax.shard_map(local, in_specs=(x_spec, x_spec, table_spec, table_spec), out_specs=(x_spec, x_spec),
                         axis_names=set(free), check_vma=False)(q, k, cos, sin)
