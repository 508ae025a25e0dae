"""Dropout with a cheap keep mask: 16 bits per element from a counter-based hash, two elements per 32-bit word.

The mask, not the masking, is what dropout costs: `jax.random.bernoulli` spends a threefry word (20 rounds) per
element, which was ~7-9% of XLA:TPU's estimate of the BERT-base step at seq 128 and most of dropout's time on
the CPU. Here each 32-bit word is MurmurHash3's finaliser (`hashing.fmix32`) of a counter, ~8 integer ops:

    seed words w0, w1 = jax.random.bits(rng, (2,))            (the layer's "dropout" key; scalar work)
    per row r (the flattened index over all but the last axis):
        mult = fmix32(fmix32(w0 ^ 0x9E3779B9) + (r + 1) * 0x9E3779B9) | 1
        add  = fmix32(fmix32(w1 ^ 0x85EBCA77) + (r + 1) * 0x85EBCA77)
    word c of row r:  u = fmix32(c * mult + add);  elements 2c and 2c + 1 take its low and high 16 bits

The bits depend only on the key and each element's global position: the same on any mesh, sharding, backend or
JAX version, so bitwise resume holds anywhere the same key sequence is replayed. A row's stream has ~63 bits of
key (two independent words), so distinct dropout sites do not share masks. The keep probability is rounded to a
multiple of 2^-16 (0.9 -> 0.8999939) and the kept values are scaled by the inverse of that rounded probability,
so the output stays an unbiased estimate of the input, as in standard (inverted) dropout.
"""
from __future__ import annotations

import math

import flax.linen as nn
import jax
import jax.numpy as jnp

from bertjax.model.hashing import C_HEAD, GOLDEN, fmix32, srl
from bertjax.sharding import manual_batch_offset

_LEVELS = 1 << 16


def keep_threshold(rate: float) -> int:
    """Draws (uniform on [0, 2^16)) below this are kept: round((1 - rate) * 2^16)."""
    if not 0.0 <= rate < 1.0:
        raise ValueError(f"dropout rate must be in [0, 1), got {rate}")
    return round((1.0 - rate) * _LEVELS)


def hash_words(rng, rows_shape, words: int) -> jax.Array:
    """int32 [*rows_shape, words]: word c of each row (rows numbered in row-major order), as defined above."""
    seeds = jax.lax.bitcast_convert_type(jax.random.bits(rng, (2,), jnp.uint32), jnp.int32)
    row = jnp.zeros(rows_shape, jnp.int32)
    for axis, size in enumerate(rows_shape):  # the flat row index, wrapping past 2^32 rows
        row = row * jnp.int32(size) + jax.lax.broadcasted_iota(jnp.int32, rows_shape, axis)
        if axis == 0:  # the global batch row inside a shard_map over the batch (the leading axis is the batch)
            row = row + manual_batch_offset(size)
    row = (row + 1)[..., None]
    mult = fmix32(fmix32(seeds[0] ^ jnp.int32(GOLDEN)) + row * jnp.int32(GOLDEN)) | 1
    add = fmix32(fmix32(seeds[1] ^ jnp.int32(C_HEAD)) + row * jnp.int32(C_HEAD))
    col = jax.lax.broadcasted_iota(jnp.int32, (1,) * len(rows_shape) + (words,), len(rows_shape))
    return fmix32(col * mult + add)


def _draws(words: jax.Array) -> jax.Array:
    """The 16-bit draws of int32 words: element 2c the low half of word c, 2c + 1 its high half."""
    return jnp.stack([words & jnp.int32(_LEVELS - 1), srl(words, 16)], axis=-1).reshape(
        words.shape[:-1] + (2 * words.shape[-1],))


def keep_mask(rng, rate: float, shape) -> jax.Array:
    """Boolean keep mask of `shape`, each element kept with probability keep_threshold(rate) / 2^16.

    Words follow the mask's leading shape, so a mask split over devices (batch-sharded) hashes its own words
    without moving any (a flat draw split into halves and concatenated made XLA's SPMD partitioner all-to-all
    the words between chips). An odd last axis is drawn as one flat row.
    """
    shape = tuple(shape)
    threshold = jnp.int32(keep_threshold(rate))
    if not shape or shape[-1] % 2:
        size = math.prod(shape)
        draws = _draws(hash_words(rng, (), (size + 1) // 2))[:size]
        return (draws < threshold).reshape(shape)
    return _draws(hash_words(rng, shape[:-1], shape[-1] // 2)) < threshold


def dropout(x, rate: float, rng) -> jax.Array:
    """Inverted dropout of `x` (kept values scaled by 2^16 / threshold), in the dtype of `x`.

    The scaling is done in float32 and rounded once: a bfloat16 scale factor would itself be off by ~0.2%, a bias
    on every kept activation.
    """
    keep = keep_mask(rng, rate, x.shape)
    scale = _LEVELS / keep_threshold(rate)
    scaled = (x.astype(jnp.float32) * scale).astype(x.dtype)
    return jnp.where(keep, scaled, jnp.zeros((), x.dtype))


class Dropout(nn.Module):
    """`flax.linen.Dropout` with the mask of `keep_mask`; draws from the "dropout" RNG stream."""

    rate: float

    @nn.compact
    def __call__(self, x, deterministic: bool):
        if deterministic or self.rate == 0.0:
            return x
        return dropout(x, self.rate, self.make_rng("dropout"))
