"""Dropout with a cheap keep mask: 16 bits per element from a counter-based hash, two elements per 32-bit word.

The mask, not the masking, is what dropout costs: `jax.random.bernoulli` spends a threefry word (20 rounds) per
element, which was ~7-9% of XLA:TPU's estimate of the BERT-base step at seq 128 and most of dropout's time on
the CPU. Here each 32-bit word is two rounds of MurmurHash3's finaliser (`hashing.fmix32`) on a counter:

    seed words s0, s1 = jax.random.bits(rng, (2,))            (the layer's "dropout" key; scalar work)
    mult = fmix32(s0 ^ 0x9E3779B9) | 1,  add = fmix32(s1 ^ 0x85EBCA77)
    a mask of shape [..., C] (two axes or more, C even) has words [..., C / 2]; the word numbered n (row-major) is
        u = fmix32(fmix32(n * mult + add))
    element (..., c) draws the low 16 bits of word (..., c) for c < C / 2, the high 16 bits of word (..., c - C / 2)
    otherwise, and is kept if its draw is below the threshold. Any other mask is drawn flat: words [ceil(size / 2)],
    the low halves then the high halves, cut to its size.

The two halves of a word go to elements C / 2 apart, not to neighbours: both are compared in place (low: u << 16
against threshold << 16; high: u against threshold << 16, unsigned) and the two blocks concatenated, which XLA:TPU
does without moving lanes (BERT-base's hidden width 768 splits at a 128-lane boundary; the attention
probabilities' masks are laid out with the query axis minor). Interleaved halves (elements 2c and 2c + 1 from
word c) make it shuffle lanes: the masks take 11.1% of the estimated BERT-base phase-1 step on v5litepod-16 that
way, 5.3% this way (17.61 -> 16.54 ms).

The bits depend only on the key and each element's global position: the same on any mesh, sharding, backend or
JAX version, so bitwise resume holds anywhere the same key sequence is replayed. Multiplying the counter by a
per-key odd number (not adding a key to it) keeps two dropout sites' masks from being shifted copies of each
other. The keep probability is rounded to a multiple of 2^-16 (0.9 -> 0.8999939) and the kept values are scaled
by the inverse of that rounded probability, so the output stays an unbiased estimate of the input, as in standard
(inverted) dropout.
"""
from __future__ import annotations

import math

import flax.linen as nn
import jax
import jax.numpy as jnp

from bertjax.model.hashing import C_HEAD, GOLDEN, below, fmix32
from bertjax.sharding import manual_batch_offset

_LEVELS = 1 << 16


def keep_threshold(rate: float) -> int:
    """Draws (uniform on [0, 2^16)) below this are kept: round((1 - rate) * 2^16)."""
    if not 0.0 <= rate < 1.0:
        raise ValueError(f"dropout rate must be in [0, 1), got {rate}")
    return round((1.0 - rate) * _LEVELS)


def hash_words(rng, shape, batch_leading: bool = True) -> jax.Array:
    """int32 words of `shape`, word n (row-major) = fmix32(fmix32(n * mult + add)) as defined above.

    `batch_leading`: the leading axis is the batch (inside a shard_map over the batch, its global rows are numbered).
    """
    indices = [jax.lax.broadcasted_iota(jnp.int32, shape, axis) for axis in range(len(shape))]
    return _words_at(_mult_add(rng), shape, indices, batch_leading)


def _mult_add(rng):
    """The hash's (mult, add) from the key, two int32 scalars."""
    seeds = jax.lax.bitcast_convert_type(jax.random.bits(rng, (2,), jnp.uint32), jnp.int32)
    return fmix32(seeds[0] ^ jnp.int32(GOLDEN)) | 1, fmix32(seeds[1] ^ jnp.int32(C_HEAD))


def word_seeds(rng) -> jax.Array:
    """int32 [2]: the hash's (mult, add) from the key, what `keep_mask_fused` draws from."""
    return jnp.stack(_mult_add(rng))


def _words_at(seeds, shape, indices, batch_leading: bool) -> jax.Array:
    """The words of a grid of `shape` at the per-axis `indices` (int32 arrays of one shape, one per axis);
    `seeds`: (mult, add)."""
    mult, add = seeds[0], seeds[1]
    number = jnp.zeros(indices[0].shape, jnp.int32)
    for axis, (size, index) in enumerate(zip(shape, indices)):  # the flat word number, wrapping past 2^32 words
        number = number * jnp.int32(size) + index
        if axis == 0 and batch_leading:
            number = number + manual_batch_offset(size)
    return fmix32(fmix32(number * mult + add))


def _kept_halves(words, rate: float) -> jax.Array:
    """The keep bits of the words' low halves, then their high halves, concatenated along the last axis."""
    threshold = keep_threshold(rate)
    if threshold == _LEVELS:  # rate 0: every element kept (threshold << 16 would not fit 32 bits)
        return jnp.ones(words.shape[:-1] + (2 * words.shape[-1],), bool)
    # draw < threshold for a 16-bit draw d in the top half of a word w: w <u threshold << 16 (the bits below d
    # cannot lift it past a multiple of 2^16).
    both_bits = (below(words << 16, threshold << 16).astype(jnp.uint8)
                 | (below(words, threshold << 16).astype(jnp.uint8) << 1))
    # Both halves' bits held in one byte per word, materialised: without the barrier XLA:TPU fuses the hash into
    # each half's consumer and hashes every word twice (the masks were 3.3% of BERT-base's estimated step).
    both_bits = jax.lax.optimization_barrier(both_bits)
    # Each consumer picks its bit from the byte (a shift by 0 or 1); two masks unpacked from it first were stored
    # as such, a pass more (docs/performance-history.md, tried and dropped).
    tiled = jnp.concatenate([both_bits, both_bits], axis=-1)
    high = jax.lax.broadcasted_iota(jnp.int32, tiled.shape, tiled.ndim - 1) >= words.shape[-1]
    return ((tiled >> high.astype(jnp.uint8)) & 1) != 0


def keep_mask(rng, rate: float, shape) -> jax.Array:
    """Boolean keep mask of `shape`, each element kept with probability keep_threshold(rate) / 2^16.

    Words follow the mask's leading shape, so a mask split over devices (batch-sharded) hashes its own words
    without moving any (a flat draw split into halves and concatenated made XLA's SPMD partitioner all-to-all
    the words between chips).
    """
    shape = tuple(shape)
    if len(shape) >= 2 and shape[-1] % 2 == 0:
        return _kept_halves(hash_words(rng, shape[:-1] + (shape[-1] // 2,)), rate)
    size = math.prod(shape)
    words = hash_words(rng, ((size + 1) // 2,), batch_leading=False)
    return _kept_halves(words, rate)[:size].reshape(shape)


def fusable_shape(shape) -> bool:
    """Whether `keep_mask_fused` draws masks of `shape`: two axes or more, the last even."""
    return len(shape) >= 2 and shape[-1] % 2 == 0


def keep_mask_fused(seeds, rate: float, shape) -> jax.Array:
    """`keep_mask(rng, rate, shape)`'s bits from `word_seeds(rng)`, each element hashing its own word (a word is
    hashed twice) and nothing concatenated or materialised: an elementwise function of the position that XLA:GPU
    fuses into the consumer (a concatenation of the two halves it wrote to memory, a byte an element)."""
    shape = tuple(shape)
    if not fusable_shape(shape):
        raise ValueError(f"keep_mask_fused draws masks of two axes or more, the last even; got {shape}")
    threshold = keep_threshold(rate)
    if threshold == _LEVELS:
        return jnp.ones(shape, bool)
    half = shape[-1] // 2
    column = jax.lax.broadcasted_iota(jnp.int32, shape, len(shape) - 1)
    high = column >= half
    indices = [jax.lax.broadcasted_iota(jnp.int32, shape, axis) for axis in range(len(shape) - 1)]
    words = _words_at(seeds, shape[:-1] + (half,), indices + [jnp.where(high, column - half, column)], True)
    return jnp.where(high, below(words, threshold << 16), below(words << 16, threshold << 16))


def keep_scale(rate: float) -> float:
    """What kept values are multiplied by: 2^16 / keep_threshold(rate), the inverse of the keep probability."""
    return _LEVELS / keep_threshold(rate)


def dropout(x, rate: float, rng) -> jax.Array:
    """Inverted dropout of `x` (kept values scaled by 2^16 / threshold), in the dtype of `x`.

    The scaling is done in float32 and rounded once: a bfloat16 scale factor would itself be off by ~0.2%, a bias
    on every kept activation.
    """
    return apply_keep_mask(x, keep_mask(rng, rate, x.shape), rate)


def apply_keep_mask(x, keep, rate: float) -> jax.Array:
    """where(keep, x / keep probability, 0) in x's dtype, the scaling in float32 rounded once (dropout's values,
    and its gradient's)."""
    scaled = (x.astype(jnp.float32) * keep_scale(rate)).astype(x.dtype)
    return jnp.where(keep, scaled, jnp.zeros((), x.dtype))


class Dropout(nn.Module):
    """`flax.linen.Dropout` with the mask of `keep_mask`; draws from the "dropout" RNG stream."""

    rate: float

    @nn.compact
    def __call__(self, x, deterministic: bool):
        if deterministic or self.rate == 0.0:
            return x
        return dropout(x, self.rate, self.make_rng("dropout"))

    def key(self, deterministic: bool):
        """The key `__call__` would draw its mask from (None where it would not drop), for a caller that applies
        the mask itself (`layer_norm.residual_layer_norm`): the same bits as calling this module."""
        if deterministic or self.rate == 0.0:
            return None
        return self.make_rng("dropout")
