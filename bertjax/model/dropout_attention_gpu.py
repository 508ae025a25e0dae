"""Fused GPU attention (Pallas, Triton lowering) with BERT's attention-probability dropout, forward and backward.

    out = dropout(softmax(q k^T / sqrt(d) + mask)) v

The GPU counterpart of `dropout_attention` (the TPU kernel), with the same semantics and the same keep mask, bit
for bit: the element (b, h, i, j) is kept where `keep_at(*hash_terms(i, j, *stream_key(seed, b, h)))` says (those
functions `dropout_attention`'s), the mask `dropout_keep_mask` draws in plain jnp and the TPU kernel's tests hold it
to, so a run moved between TPU and GPU drops the same probabilities. Per query/key pair the hash is an add, fmix32
and an unsigned compare (11 integer ops); the rest of x * mult + add is per row and per column of a block. Flash
attention in the style of jax.experimental.pallas.ops.gpu.attention:

- forward, a program per (example, head, query block): the query block held, a loop over key blocks with the
  running max and sum of the undropped probabilities (the softmax sees every key); the dropped ones go into P.V
  and 1/keep_prob is applied once per row at the end; writes o and lse = m + log(l) [B, H, S] float32;
- backward (jax.custom_vjp), a program per (example, head, block): dk/dv of its key block over every query block,
  then dq of its query block over every key block (`dropout_attention.probs_and_dscores`: the probabilities and
  the mask recomputed from lse and the hash, nothing [S, S] stored), D = rowsum(dO * O) per query block from
  O's and dO's rows as the loops load them (O re-read once per held block: priced below XLA's own pass over both).

q/k/v are read, and o, dq, dk, dv written, in the model's [B, S, heads, head_dim] (the projections' [B, S, H * D]
reshaped, no transpose): a block is `block` rows of one head, 2 * head_dim bytes each (bf16) at a stride of
2 * H * D. Padding and packing arrive as segment ids [B, S] (0 = padding: padding attends to padding, so every row
has a key). The projections' biases [H, D] are added to q/k/v blocks as the kernels load them (in XLA the add is a
pass of its own over q/k/v: the projections' matmuls do not take it as an epilogue), and the backward writes each
held block's dq/dk/dv summed over its rows in float32, rows 0-2 of a [4, D] tile of [B, H, S / block * 4, D] (one
array, so that XLA adds them up into the biases' gradients in one reduction, over 1/block of dq/dk/dv's data).

Triton wants power-of-two block shapes; the length must be a multiple of the blocks (`dot_product_attention` pads
it to 128). Off GPU (`interpret=True`) the same kernels run in Pallas' interpreter: the tests on CPU.
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from bertjax.model.dropout_attention import (
    MASK_VALUE,
    MAX_LENGTH,
    NN,
    NT,
    dot,
    hash_terms,
    keep_at,
    keep_threshold,
    probs_and_dscores,
    seed_word,
    stream_key,
)

TN = ((0,), (0,))   # a [k, m] . b [k, n] -> [m, n]
# Launch parameters for every kernel here: 4 warps for blocks of up to 128 x 64 (jax's GPU attention's choice for
# head_dim <= 64), two stages of software pipelining of the loops' loads. Not tuned on a GPU.
NUM_WARPS, NUM_STAGES = 4, 2


def _positions(start, size):
    """int32 global positions start .. start + size - 1."""
    return start + jnp.arange(size, dtype=jnp.int32)


class _Stream:
    """A program's dropout stream: (mult, add) of its (example, head) and the threshold; None for rate 0."""

    def __init__(self, scalars_ref, threshold):
        self.threshold = threshold
        if threshold is not None:
            # scalars: the seed's bits, the global index of this call's first example and head (a shard's offset).
            b, h = pl.program_id(0) + scalars_ref[1], pl.program_id(1) + scalars_ref[2]
            self.mult, self.add = stream_key(scalars_ref[0], b, h)

    def keep(self, rows, cols):
        """The keep mask of the block of query positions `rows` [bq, 1] and key positions `cols` [1, bk]."""
        if self.threshold is None:
            return None
        return keep_at(*hash_terms(rows, cols, self.mult, self.add), self.threshold)


def _biased(x, bias):
    """A q/k/v block [rows, D] plus its bias row `bias` [D] (float32), in the block's dtype: the bits of XLA's
    x + bias.astype(x.dtype) (computed in float32 and rounded)."""
    return (x.astype(jnp.float32) + bias[None, :]).astype(x.dtype)


def _bias_rows(*bias_refs):
    """The biases' [D] blocks in float32: loaded once per program, added to every block the loops load."""
    return tuple(ref[...].astype(jnp.float32) for ref in bias_refs)


def _masked_scores(q, k, q_seg, k_seg, scale, rows=None, cols=None, window=None):
    """Logits q k^T * scale [bq, bk] in float32, MASK_VALUE where the segments differ (the reference's mask) and,
    with a `window`, where the query positions `rows` [bq, 1] and key positions `cols` [1, bk] are further apart."""
    allowed = q_seg[:, None] == k_seg[None, :]
    if window is not None:
        allowed = allowed & (jnp.abs(rows - cols) <= window)
    return jnp.where(allowed, dot(q, k, NT) * scale, MASK_VALUE)


def priced_pairs(batch: int, heads: int, length: int, held: int, block: int, window) -> int:
    """The query-key pairs the loops compute (whole blocks: those that meet each held block's window), carried in
    the kernels' names (`_p<pairs>`) for `cloud/gpu_estimate.py`, which prices their matmuls from it: Triton's custom
    call keeps no cost estimate, and a deviceless program shows no window."""
    total = 0
    for start in range(0, length, held):
        first, end = _window_blocks(start, held, block, length // block, window)
        total += int(end) - int(first)
    return batch * heads * total * held * block


def _window_blocks(start, held, block, blocks, window):
    """(first, end) of the loop over blocks of `block` rows that meet a held block [start, start + held) within
    `window` (all `blocks` without one): the loops skip the others, neither loading nor computing them."""
    if window is None:
        return 0, blocks
    if isinstance(start, int):   # counted on the host (`priced_pairs`)
        return max(start - window, 0) // block, min((start + held - 1 + window) // block + 1, blocks)
    first = jnp.maximum(start - window, 0) // block
    return first, jnp.minimum((start + held - 1 + window) // block + 1, blocks)


def _fwd_kernel(scalars_ref, q_ref, k_ref, v_ref, bq_ref, bk_ref, bv_ref, seg_ref, o_ref, lse_ref, *, scale, block_k,
                threshold, inv_keep, window):
    block_q, head_dim = q_ref.shape
    q_start = pl.program_id(2) * block_q
    stream = _Stream(scalars_ref, threshold)
    bq, bk, bv = _bias_rows(bq_ref, bk_ref, bv_ref)
    q = _biased(q_ref[...], bq)
    q_seg = seg_ref[pl.ds(q_start, block_q)]
    rows = _positions(q_start, block_q)[:, None]

    def body(kb, carry):
        acc, m_prev, l_prev = carry
        keys = pl.ds(kb * block_k, block_k)
        cols = _positions(kb * block_k, block_k)[None, :]
        s = _masked_scores(q, _biased(k_ref[keys, :], bk), q_seg, seg_ref[keys], scale, rows, cols, window)
        m_new = jnp.maximum(m_prev, jnp.max(s, axis=1))
        p = jnp.exp(s - m_new[:, None])          # undropped: the softmax statistics see every key
        alpha = jnp.exp(m_prev - m_new)
        l_new = alpha * l_prev + jnp.sum(p, axis=1)
        keep = stream.keep(rows, cols)
        if keep is not None:
            p = jnp.where(keep, p, 0.0)
        v = _biased(v_ref[keys, :], bv)
        return acc * alpha[:, None] + dot(p.astype(v.dtype), v, NN), m_new, l_new

    init = (jnp.zeros((block_q, head_dim), jnp.float32), jnp.full((block_q,), -jnp.inf, jnp.float32),
            jnp.zeros((block_q,), jnp.float32))
    acc, m, l = lax.fori_loop(*_window_blocks(q_start, block_q, block_k, k_ref.shape[0] // block_k, window), body,
                              init)
    o_ref[...] = (acc * (inv_keep / l)[:, None]).astype(o_ref.dtype)
    lse_ref[...] = m + jnp.log(l)


def _bwd_kernel(scalars_ref, q_ref, k_ref, v_ref, bq_ref, bk_ref, bv_ref, seg_ref, lse_ref, o_ref, do_ref, dq_ref,
                dk_ref, dv_ref, sums_ref, *, scale, block, threshold, keep_prob, window):
    """lse_ref: the forward's lse [S] of this head; sums_ref [4, D]: the held block's dq, dk, dv summed over its
    rows, and zeros (float32; the biases' gradients, summed by XLA)."""
    head_dim = q_ref.shape[1]
    start = pl.program_id(2) * block
    held = pl.ds(start, block)
    stream = _Stream(scalars_ref, threshold)
    steps = q_ref.shape[0] // block
    bq, bk, bv = _bias_rows(bq_ref, bk_ref, bv_ref)

    def statistics(queries, do):
        """lse - log(1/keep_prob) and D * keep_prob of the query block [block, 1] (`probs_and_dscores`'), with
        D = rowsum(dO * O) from the block's rows of O (the sum of dP * P with the mask: O holds the dropped
        probabilities): a row's work, not an XLA pass over dO and O."""
        di = jnp.sum(do.astype(jnp.float32) * o_ref[queries, :].astype(jnp.float32), axis=1) * keep_prob
        return (lse_ref[queries] + math.log(keep_prob))[:, None], di[:, None]

    def recompute(queries, keys, q, k, v, do, stats):
        """P*Z and dS of the block (queries, keys) [block, block]; `stats`: the queries' `statistics`."""
        rows, cols = _positions(queries.start, block)[:, None], _positions(keys.start, block)[None, :]
        s = _masked_scores(q, k, seg_ref[queries], seg_ref[keys], scale, rows, cols, window)
        keep = stream.keep(rows, cols)
        return probs_and_dscores(s, *stats, dot(do, v, NT), keep)

    # dk, dv of the held key block over every query block: dV = (P*Z)^T dO, dK = dS^T Q * scale.
    k, v = _biased(k_ref[held, :], bk), _biased(v_ref[held, :], bv)

    def dkv_body(qb, carry):
        dk, dv = carry
        queries = pl.ds(qb * block, block)
        q, do = _biased(q_ref[queries, :], bq), do_ref[queries, :]
        pz, ds = recompute(queries, held, q, k, v, do, statistics(queries, do))
        return dk + dot(ds.astype(q.dtype), q, TN), dv + dot(pz.astype(do.dtype), do, TN)

    zeros = jnp.zeros((block, head_dim), jnp.float32)
    dk, dv = lax.fori_loop(*_window_blocks(start, block, block, steps, window), dkv_body, (zeros, zeros))
    dk = dk * scale
    dk_ref[...] = dk.astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)
    key_sums = jnp.sum(dk, axis=0), jnp.sum(dv, axis=0)   # [D] each: what stays live through the dq loop

    # dq of the held query block over every key block: dQ = dS K * scale.
    q, do = _biased(q_ref[held, :], bq), do_ref[held, :]
    held_stats = statistics(held, do)

    def dq_body(kb, dq):
        keys = pl.ds(kb * block, block)
        k = _biased(k_ref[keys, :], bk)
        _, ds = recompute(held, keys, q, k, _biased(v_ref[keys, :], bv), do, held_stats)
        return dq + dot(ds.astype(k.dtype), k, NN)

    dq = lax.fori_loop(*_window_blocks(start, block, block, steps, window), dq_body, zeros) * scale
    dq_ref[...] = dq.astype(dq_ref.dtype)
    # Rows selected by an iota (Triton has no concatenate); 4 rows: its blocks' sizes are powers of two.
    row = lax.broadcasted_iota(jnp.int32, sums_ref.shape, 0)
    sums = [jnp.broadcast_to(x[None, :], sums_ref.shape) for x in (jnp.sum(dq, axis=0), *key_sums)]
    sums_ref[...] = jnp.where(row == 0, sums[0], jnp.where(row == 1, sums[1], jnp.where(row == 2, sums[2], 0.0)))


def _specs(length, block, head_dim):
    """BlockSpecs over grid (example, head, block): a `block` of rows of one head of [B, S, H, D]; the head's whole
    [S, D] (the loops' operands: each loop loads its own blocks); the head's bias [D] of [H, D]; the example's
    segment ids [S]; a head's [S] statistics of [B, H, S]; the block's rows of them; the block's [D] of
    [B, H, S / block * 4, D] (the backward's per-block sums)."""
    rows = pl.BlockSpec((None, block, None, head_dim), lambda b, h, i: (b, i, h, 0))
    whole = pl.BlockSpec((None, length, None, head_dim), lambda b, h, i: (b, 0, h, 0))
    bias = pl.BlockSpec((None, head_dim), lambda b, h, i: (h, 0))
    segments = pl.BlockSpec((None, length), lambda b, h, i: (b, 0))
    stats = pl.BlockSpec((None, None, length), lambda b, h, i: (b, h, 0))
    stat_rows = pl.BlockSpec((None, None, block), lambda b, h, i: (b, h, i))
    block_sum = pl.BlockSpec((None, None, 4, head_dim), lambda b, h, i: (b, h, i, 0))
    return rows, whole, bias, segments, stats, stat_rows, block_sum


_SCALARS = pl.BlockSpec((4,), lambda b, h, i: (0,))   # (seed, batch offset, head offset, 0): 4, a power of two


def _forward(q, k, v, biases, segment_ids, scalars, rate, block_q, block_k, interpret, window=None):
    batch, length, heads, head_dim = q.shape
    rows, whole, bias, segments, _, stat_rows, _ = _specs(length, block_q, head_dim)
    threshold, inv_keep = (None, 1.0) if rate == 0.0 else (keep_threshold(rate), 1.0 / (1.0 - rate))
    return pl.pallas_call(
        functools.partial(_fwd_kernel, scale=1.0 / math.sqrt(head_dim), block_k=block_k, threshold=threshold,
                          inv_keep=inv_keep, window=window),
        grid=(batch, heads, length // block_q),
        in_specs=[_SCALARS, rows, whole, whole, bias, bias, bias, segments], out_specs=[rows, stat_rows],
        out_shape=[jax.ShapeDtypeStruct(q.shape, q.dtype),
                   jax.ShapeDtypeStruct((batch, heads, length), jnp.float32)],
        compiler_params=plgpu.CompilerParams(num_warps=NUM_WARPS, num_stages=NUM_STAGES),
        interpret=interpret,
        name=f"flash_dropout_gpu_fwd_p{priced_pairs(batch, heads, length, block_q, block_k, window)}",
    )(scalars, q, k, v, *biases, segment_ids)


def _backward(q, k, v, biases, segment_ids, scalars, o, lse, do, rate, block, interpret, window=None):
    """(dq, dk, dv, their per-block sums [B, H, S / block, 3, D] float32)."""
    batch, length, heads, head_dim = q.shape
    rows, whole, bias, segments, stats, _, block_sum = _specs(length, block, head_dim)
    sum_shape = jax.ShapeDtypeStruct((batch, heads, length // block * 4, head_dim), jnp.float32)
    dq, dk, dv, sums = pl.pallas_call(
        functools.partial(_bwd_kernel, scale=1.0 / math.sqrt(head_dim), block=block,
                          threshold=None if rate == 0.0 else keep_threshold(rate), keep_prob=1.0 - rate,
                          window=window),
        grid=(batch, heads, length // block),
        in_specs=[_SCALARS, whole, whole, whole, bias, bias, bias, segments, stats, whole, whole],
        out_specs=[rows, rows, rows, block_sum],
        out_shape=[*(jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (q, k, v)), sum_shape],
        compiler_params=plgpu.CompilerParams(num_warps=NUM_WARPS, num_stages=NUM_STAGES),
        interpret=interpret,
        name=f"flash_dropout_gpu_bwd_p{priced_pairs(batch, heads, length, block, block, window)}",
    )(scalars, q, k, v, *biases, segment_ids, lse, o, do)
    return dq, dk, dv, sums.reshape(batch, heads, length // block, 4, head_dim)[:, :, :, :3]


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8, 9, 10, 11))
def _attention(q, k, v, biases, segment_ids, scalars, rate, block_q, block_k, block_bwd, interpret, window):
    return _attention_fwd(q, k, v, biases, segment_ids, scalars, rate, block_q, block_k, block_bwd, interpret,
                          window)[0]


def _attention_fwd(q, k, v, biases, segment_ids, scalars, rate, block_q, block_k, block_bwd, interpret, window):
    rows = tuple(b.astype(q.dtype) for b in biases)   # the reference's x + b.astype(x.dtype)
    o, lse = _forward(q, k, v, rows, segment_ids, scalars, rate, block_q, block_k, interpret, window)
    return o, (q, k, v, biases, rows, segment_ids, scalars, o, lse)


def _attention_bwd(rate, block_q, block_k, block_bwd, interpret, window, residuals, do):
    q, k, v, biases, rows, segment_ids, scalars, o, lse = residuals
    dq, dk, dv, sums = _backward(q, k, v, rows, segment_ids, scalars, o, lse, do, rate, block_bwd, interpret,
                                 window)
    sums = sums.sum(axis=(0, 2))
    bias_grads = tuple(sums[:, j].astype(b.dtype) for j, b in enumerate(biases))
    return dq, dk, dv, bias_grads, None, None


_attention.defvjp(_attention_fwd, _attention_bwd)


def flash_attention_with_dropout(query, key, value, segment_ids, *, dropout_rate: float, seed, block_q: int = 64,
                                 block_k: int = 64, block_bwd: int = 64, batch_offset=0, head_offset=0,
                                 biases=None, interpret: bool = False, window: int | None = None):
    """dropout(softmax(q k^T / sqrt(d) + mask)) v, fused for GPU; q/k/v [batch, length, heads, head_dim].

    segment_ids [batch, length] int: 0 = padding; a query attends to the keys with its id. dropout_rate: static,
    in [0, 1); 0 = no dropout (no hash computed). seed: uint32/int32 scalar or a jax PRNG key; the keep mask is
    `dropout_attention.dropout_keep_mask(seed, batch, heads, length, length, dropout_rate)`, the TPU kernel's.
    block_q/block_k: the forward's held query block and streamed key block; block_bwd: the backward's (held and
    streamed alike); powers of two dividing the length. batch_offset/head_offset (int or traced int32): the global
    index of this call's first example and head (a shard inside a shard_map), so the mask is the global arrays'.
    biases: optional (q, k, v) biases [heads, head_dim] (the projections'), added to query, key and value in their
    dtype inside the kernels; their gradients are the backward kernel's per-block sums of dq/dk/dv added up.
    interpret: run in Pallas' interpreter (off GPU). Output in query's dtype; softmax statistics in float32.
    window: a query attends only to keys at most this many positions away (ModernBERT's sliding-window layers);
    the loops skip the blocks outside it.
    """
    dropout_rate = float(dropout_rate)
    if not 0.0 <= dropout_rate < 1.0:
        raise ValueError(f"dropout_rate must be in [0, 1), got {dropout_rate}")
    length, heads, head_dim = query.shape[1:]
    if length > MAX_LENGTH:
        raise ValueError(f"lengths up to {MAX_LENGTH} are supported, got {length}")
    for name, size in (("block_q", block_q), ("block_k", block_k), ("block_bwd", block_bwd), ("head_dim", head_dim)):
        if size & (size - 1) or (name != "head_dim" and length % size):
            raise ValueError(f"{name}={size} must be a power of two" + ("" if name == "head_dim" else
                                                                        f" dividing the length {length}"))
    if biases is None:
        biases = (jnp.zeros((heads, head_dim), query.dtype),) * 3
    scalars = jnp.concatenate([seed_word(seed), jnp.asarray(batch_offset, jnp.int32).reshape(1),
                               jnp.asarray(head_offset, jnp.int32).reshape(1), jnp.zeros(1, jnp.int32)])
    return _attention(query, key, value, tuple(biases), segment_ids.astype(jnp.int32), scalars, dropout_rate,
                      block_q, block_k, block_bwd, interpret, window)
