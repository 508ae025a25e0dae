"""The "chunked" attention backend: the reference's attention (no dropout) a block of queries at a time, each block
against only the keys it may see, in plain JAX (what a CPU runs for long rows).

A global layer's block meets every key; a windowed layer's block (ModernBERT's local layers) meets its band only,
block + 2 * window keys, so such a layer computes and holds memory linear in the length, not its square. The
backward is flash attention's: the forward keeps each query's log-sum-exp of its scores, and the backward recomputes
a block's probabilities from it, so no [S, S] scores are ever held (one block's at a time). Its products are laid
out as XLA:CPU multiplies them fastest: as A B^T or A^T B, the key and value gradients accumulated as [head_dim,
keys] (12 heads, 512 queries x 4096 keys: dK^T = Q^T dS 0.15 s where dK = dS^T Q, autodiff's, took 0.33 s; out^T =
V^T P^T 0.12 s where P V took 0.18 s; a busy machine). Values equal the reference's to float32 rounding. A padding query (no key it may see) gets the mean of its band's values, finite and ignorable, and passes no
gradient back.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

# Without a window, a block's scores take at most this ([batch, heads, block, length] float32): what sets the block.
CHUNK_SCORE_BYTES = 64 * 2**20
_MASKED = float(np.finfo(np.float32).min)   # the reference's logit for a key a query may not see


def chunk_block(batch: int, length: int, heads: int, window: int | None) -> int:
    """The query block: with a window, the power of two from 32 that covers it (a band of 3x the window's keys for
    ModernBERT's 64 each side); without, the most queries up to 512 whose scores take at most CHUNK_SCORE_BYTES."""
    if window is not None:
        return max(32, 1 << (window - 1).bit_length())
    block = 512
    while block > 16 and batch * heads * block * length * 4 > CHUNK_SCORE_BYTES:
        block //= 2
    return block


def chunked_attention(query, key, value, input_mask, packing_ids=None, *, window: int | None = None,
                      block: int | None = None):
    """Attention [batch, length, heads, head_dim] of query/key/value [batch, length, heads, head_dim] with the
    masks of `attention.reference_attention` (padding, packed sequences, a window); `block`: queries a block
    (default chunk_block's)."""
    batch, length, heads, head_dim = query.shape
    block = min(block or chunk_block(batch, length, heads, window), length)
    blocks = -(-length // block)
    padded = blocks * block
    band = window is not None and block + 2 * window < padded   # else every block's keys are all the keys
    span, left = (block + 2 * window, window) if band else (padded, 0)
    keys_length = (blocks - 1) * block + span if band else padded
    ids = jnp.zeros((batch, length), jnp.int32) if packing_ids is None else packing_ids.astype(jnp.int32)

    def pad_keys(x, value=0):   # [batch, length, ...] -> [batch, keys_length, ...]: `left` before, the rest after
        widths = [(0, 0), (left, keys_length - left - length)] + [(0, 0)] * (x.ndim - 2)
        return jnp.pad(x, widths, constant_values=value)

    def query_blocks(x):   # [batch, length, ...] -> [blocks, batch, block, ...]
        x = jnp.pad(x, [(0, 0), (0, padded - length)] + [(0, 0)] * (x.ndim - 2))
        return jnp.moveaxis(x.reshape(batch, blocks, block, *x.shape[2:]), 1, 0)

    masks = (pad_keys(input_mask.astype(bool), False), pad_keys(ids), query_blocks(ids))
    layout = _Layout(block=block, span=span, left=left, band=band, window=window, head_dim=head_dim)
    # [blocks, batch, heads, block, head_dim]; keys and values [batch, heads, keys_length, head_dim]
    q = jnp.swapaxes(query_blocks(query), 2, 3)
    k, v = (jnp.swapaxes(pad_keys(x), 1, 2) for x in (key, value))
    out = _attention(layout, q, k, v, *masks)
    out = jnp.moveaxis(jnp.swapaxes(out, 2, 3), 0, 1).reshape(batch, padded, heads, head_dim)
    return out[:, :length]


@dataclasses.dataclass(frozen=True)
class _Layout:
    """The static facts of one call: query block, keys a block meets (`span`, starting `left` before the block in a
    band, else all from 0), the window, the head size."""

    block: int
    span: int
    left: int
    band: bool
    window: int | None
    head_dim: int

    @property
    def scale(self):
        return np.float32(np.sqrt(self.head_dim))

    def start(self, index):
        """Where block `index`'s keys start in the padded keys."""
        return index * self.block if self.band else 0

    def keys(self, x, index, axis):
        return lax.dynamic_slice_in_dim(x, self.start(index), self.span, axis=axis)

    def mask(self, index, key_real, key_ids, query_ids):
        """[batch, 1, block, span]: which of the block's keys each query may see."""
        real, k_ids = self.keys(key_real, index, 1), self.keys(key_ids, index, 1)
        mask = real[:, None, :] & (query_ids[:, :, None] == k_ids[:, None, :])
        if self.window is not None:
            queries = index * self.block + jnp.arange(self.block)
            keys = self.start(index) - self.left + jnp.arange(self.span)
            mask = mask & (jnp.abs(queries[:, None] - keys[None, :]) <= self.window)[None]
        return mask[:, None]

    def scores(self, q, k, mask):
        """Scaled logits [batch, heads, block, span] float32, masked keys at the reference's large negative."""
        logits = jnp.einsum("bhqd,bhkd->bhqk", q, k, preferred_element_type=jnp.float32) / self.scale
        return jnp.where(mask, logits, _MASKED)


def _forward(layout: _Layout, q, k, v, key_real, key_ids, query_ids):
    """(out [blocks, batch, heads, block, head_dim], log-sum-exp [blocks, batch, heads, block])."""
    v_t = jnp.swapaxes(v, 2, 3)   # [batch, heads, head_dim, keys]: out^T = V^T P^T

    def one_block(args):
        index, q_block, ids = args
        scores = layout.scores(q_block, layout.keys(k, index, 2), layout.mask(index, key_real, key_ids, ids))
        top = jnp.max(scores, axis=-1, keepdims=True)
        weights = jnp.exp(scores - top)
        total = jnp.sum(weights, axis=-1)
        out_t = jnp.einsum("bhdk,bhqk->bhdq", layout.keys(v_t, index, 3), weights.astype(v.dtype),
                           preferred_element_type=jnp.float32)
        out = (jnp.swapaxes(out_t, 2, 3) / total[..., None]).astype(q.dtype)
        return out, top[..., 0] + jnp.log(total)

    return lax.map(one_block, (jnp.arange(q.shape[0]), q, query_ids))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attention(layout: _Layout, q, k, v, key_real, key_ids, query_ids):
    return _forward(layout, q, k, v, key_real, key_ids, query_ids)[0]


def _attention_fwd(layout, q, k, v, key_real, key_ids, query_ids):
    out, lse = _forward(layout, q, k, v, key_real, key_ids, query_ids)
    return out, (q, k, v, key_real, key_ids, query_ids, out, lse)


def _attention_bwd(layout, residuals, d_out):
    q, k, v, key_real, key_ids, query_ids, out, lse = residuals
    # Flash attention's backward: dS = P * (dP - rowsum(dO * O)), P recomputed from the log-sum-exp.
    d_rows = jnp.sum(d_out.astype(jnp.float32) * out.astype(jnp.float32), axis=-1)
    zeros_t = jnp.zeros(k.shape[:2] + (k.shape[3], k.shape[2]), jnp.float32)   # [batch, heads, head_dim, keys]

    def one_block(carry, args):
        d_k_t, d_v_t = carry
        index, q_block, ids, d_o, block_lse, block_d_rows = args
        mask = layout.mask(index, key_real, key_ids, ids)
        k_block, v_block = layout.keys(k, index, 2), layout.keys(v, index, 2)
        probs = jnp.where(mask, jnp.exp(layout.scores(q_block, k_block, mask) - block_lse[..., None]), 0.0)
        d_probs = jnp.einsum("bhqd,bhkd->bhqk", d_o, v_block, preferred_element_type=jnp.float32)
        d_scores = probs * (d_probs - block_d_rows[..., None]) / layout.scale
        d_q = jnp.einsum("bhqk,bhkd->bhqd", d_scores.astype(k.dtype), k_block, preferred_element_type=jnp.float32)
        add = lambda total, part: lax.dynamic_update_slice_in_dim(  # noqa: E731
            total, layout.keys(total, index, 3) + part, layout.start(index), axis=3)
        d_k_t = add(d_k_t, jnp.einsum("bhqd,bhqk->bhdk", q_block, d_scores.astype(q.dtype),
                                      preferred_element_type=jnp.float32))
        d_v_t = add(d_v_t, jnp.einsum("bhqd,bhqk->bhdk", d_o, probs.astype(d_o.dtype),
                                      preferred_element_type=jnp.float32))
        return (d_k_t, d_v_t), d_q.astype(q.dtype)

    (d_k_t, d_v_t), d_q = lax.scan(one_block, (zeros_t, zeros_t),
                                   (jnp.arange(q.shape[0]), q, query_ids, d_out, lse, d_rows))
    d_k, d_v = (jnp.swapaxes(x, 2, 3).astype(dtype) for x, dtype in ((d_k_t, k.dtype), (d_v_t, v.dtype)))
    return d_q, d_k, d_v, None, None, None


_attention.defvjp(_attention_fwd, _attention_bwd)
