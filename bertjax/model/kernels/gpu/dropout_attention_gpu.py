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
array, so that XLA adds them up into the biases' gradients in one reduction, over 1/block of dq/dk/dv's data;
written a row at a time).

ModernBERT's layout (`stacked_flash_attention_with_dropout`): q/k/v stacked [B, S, 3, H, D] as its one projection
writes them, read in place (the array passed three times, each BlockSpec at its index of the third axis) and the
gradient written as one such array (the whole array a ref, each program storing its rows of the three: a block of 3
is no power of two), which the projection's backward reads as it is; and rotary positions applied inside: q and k
loaded as two halves each (Triton's lowering neither slices nor concatenates arrays), rotated in float32 by the
tables' rows and rounded once (transformers' values), the products summed over the halves, and the gradients of
the halves rotated back before they are written. XLA had rotated q and k in a pass of its own, and in the backward
rotated their gradients back and stacked the three for the projection.

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

from bertjax.model.kernels.tpu.dropout_attention import (
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


class _Columns:
    """How a program holds q and k: whole rows, or, with rotary positions, each row's two halves (Triton's lowering
    neither slices nor concatenates arrays: each half is loaded from its ref, and the products are summed over the
    halves). The rotation is transformers' (`rope.rotate`): x * cos + rotate_half(x) * sin in float32 and rounded
    once, by the tables' refs [S, D] of this example (cos, sin; both halves of a row hold the same angles)."""

    def __init__(self, head_dim, cos_ref=None, sin_ref=None):
        half = head_dim // 2
        self.tables = None if cos_ref is None else (cos_ref, sin_ref)
        self.parts = (slice(None),) if cos_ref is None else (pl.ds(0, half), pl.ds(half, half))

    def bias_parts(self, bias_ref):
        """A bias row [D] in float32, in parts: loaded once per program, added to every block the loops load."""
        return tuple(bias_ref[part].astype(jnp.float32) for part in self.parts)

    def _angles(self, rows):
        return tuple(table[rows, self.parts[0]] for table in self.tables)

    def load(self, ref, rows, bias_parts):
        """q's or k's block of `rows` plus its bias, rotated: a tuple of parts in the ref's dtype."""
        parts = tuple(_biased(ref[rows, part], bias) for part, bias in zip(self.parts, bias_parts))
        if self.tables is None:
            return parts
        (cos, sin), (x1, x2) = self._angles(rows), (x.astype(jnp.float32) for x in parts)
        return tuple(x.astype(parts[0].dtype) for x in (x1 * cos - x2 * sin, x2 * cos + x1 * sin))

    def unrotated(self, grads, rows):
        """The gradient (float32 parts) of a block before its rotation, from the rotated block's."""
        if self.tables is None:
            return grads
        (cos, sin), (g1, g2) = self._angles(rows), grads
        return g1 * cos + g2 * sin, g2 * cos - g1 * sin


def _dot_parts(a_parts, b_parts, contract):
    """a . b over the parts' columns: the parts' products summed (float32)."""
    return functools.reduce(jnp.add, [dot(a, b, contract) for a, b in zip(a_parts, b_parts)])


def _masked_scores(q, k, q_seg, k_seg, scale, rows=None, cols=None, window=None):
    """Logits q k^T * scale [bq, bk] in float32 (q, k: `_Columns` parts), MASK_VALUE where the segments differ (the
    reference's mask) and, with a `window`, where the query positions `rows` [bq, 1] and key positions `cols`
    [1, bk] are further apart."""
    allowed = q_seg[:, None] == k_seg[None, :]
    if window is not None:
        allowed = allowed & (jnp.abs(rows - cols) <= window)
    return jnp.where(allowed, _dot_parts(q, k, NT) * scale, MASK_VALUE)


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


def _fwd_kernel(scalars_ref, q_ref, k_ref, v_ref, bq_ref, bk_ref, bv_ref, seg_ref, *refs, scale, block_q, block_k,
                threshold, inv_keep, window, rotary):
    cos_ref, sin_ref, o_ref, lse_ref = refs if rotary else (None, None, *refs)
    head_dim = q_ref.shape[1]
    columns = _Columns(head_dim, cos_ref, sin_ref)
    q_start = pl.program_id(2) * block_q
    stream = _Stream(scalars_ref, threshold)
    bk, bv = columns.bias_parts(bk_ref), bv_ref[...].astype(jnp.float32)
    q = columns.load(q_ref, pl.ds(q_start, block_q), columns.bias_parts(bq_ref))
    q_seg = seg_ref[pl.ds(q_start, block_q)]
    rows = _positions(q_start, block_q)[:, None]

    def body(kb, carry):
        acc, m_prev, l_prev = carry
        keys = pl.ds(kb * block_k, block_k)
        cols = _positions(kb * block_k, block_k)[None, :]
        s = _masked_scores(q, columns.load(k_ref, keys, bk), q_seg, seg_ref[keys], scale, rows, cols, window)
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


def _bwd_kernel(scalars_ref, q_ref, k_ref, v_ref, bq_ref, bk_ref, bv_ref, seg_ref, *refs, scale, block, threshold,
                keep_prob, window, rotary, stacked):
    """refs: the rotary tables' (cos, sin: with `rotary`); the forward's lse [S] of this head, o, dO; the outputs:
    dq, dk, dv (each [B, S, H, D] in blocks of rows), or with `stacked` one [B, S, 3, H, D] (the whole array: the
    program writes its rows of the three), and sums [4, D]: the held block's dq, dk, dv summed over its rows, in
    float32 (the biases' gradients, summed by XLA)."""
    cos_ref, sin_ref, *refs = refs if rotary else (None, None, *refs)
    lse_ref, o_ref, do_ref, *grad_refs, sums_ref = refs
    head_dim = q_ref.shape[1]
    columns = _Columns(head_dim, cos_ref, sin_ref)
    start = pl.program_id(2) * block
    held = pl.ds(start, block)
    stream = _Stream(scalars_ref, threshold)
    steps = q_ref.shape[0] // block
    bq, bk = columns.bias_parts(bq_ref), columns.bias_parts(bk_ref)
    bv = bv_ref[...].astype(jnp.float32)

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

    def write(index, grads, parts):
        """q's (index 0), k's or v's gradient of the held rows (float32 parts), and its sum over them."""
        for part, grad in zip(parts, grads):
            if stacked:
                grad_refs[0][pl.program_id(0), held, index, pl.program_id(1), part] = grad.astype(grad_refs[0].dtype)
            else:
                grad_refs[index][:, part] = grad.astype(grad_refs[index].dtype)
            sums_ref[index, part] = jnp.sum(grad, axis=0)

    # dk, dv of the held key block over every query block: dV = (P*Z)^T dO, dK = dS^T Q * scale.
    k, v = columns.load(k_ref, held, bk), _biased(v_ref[held, :], bv)

    def dkv_body(qb, carry):
        dk, dv = carry
        queries = pl.ds(qb * block, block)
        q, do = columns.load(q_ref, queries, bq), do_ref[queries, :]
        pz, ds = recompute(queries, held, q, k, v, do, statistics(queries, do))
        ds = ds.astype(q[0].dtype)
        return tuple(g + dot(ds, x, TN) for g, x in zip(dk, q)), dv + dot(pz.astype(do.dtype), do, TN)

    zeros = jnp.zeros((block, head_dim // len(columns.parts)), jnp.float32)
    dv_zeros = jnp.zeros((block, head_dim), jnp.float32)
    dk, dv = lax.fori_loop(*_window_blocks(start, block, block, steps, window), dkv_body,
                           ((zeros,) * len(columns.parts), dv_zeros))
    write(1, columns.unrotated(tuple(g * scale for g in dk), held), columns.parts)
    write(2, (dv,), (slice(None),))

    # dq of the held query block over every key block: dQ = dS K * scale.
    q, do = columns.load(q_ref, held, bq), do_ref[held, :]
    held_stats = statistics(held, do)

    def dq_body(kb, dq):
        keys = pl.ds(kb * block, block)
        k = columns.load(k_ref, keys, bk)
        _, ds = recompute(held, keys, q, k, _biased(v_ref[keys, :], bv), do, held_stats)
        ds = ds.astype(k[0].dtype)
        return tuple(g + dot(ds, x, NN) for g, x in zip(dq, k))

    dq = lax.fori_loop(*_window_blocks(start, block, block, steps, window), dq_body, (zeros,) * len(columns.parts))
    write(0, columns.unrotated(tuple(g * scale for g in dq), held), columns.parts)
    sums_ref[3, :] = jnp.zeros((head_dim,), jnp.float32)


def _specs(length, block, head_dim, stacked):
    """BlockSpecs over grid (example, head, block): q's, k's and v's whole [S, D] of the head (index 0, 1, 2 of
    [B, S, 3, H, D] when `stacked`, else of [B, S, H, D] each: the loops load their own blocks); a `block` of rows of
    one head of [B, S, H, D] (o, dO; the backward's dq/dk/dv when not stacked); the head's whole [S, D] of such an
    array; the head's bias [D] of [H, D]; the example's segment ids [S]; its rotary table [S, D] of [B, S, D]; a
    head's [S] statistics of [B, H, S]; the block's rows of them; the block's [D] of [B, H, S / block * 4, D] (the
    backward's per-block sums)."""
    if stacked:
        qkv = [pl.BlockSpec((None, length, None, None, head_dim), lambda b, h, i, j=j: (b, 0, j, h, 0))
               for j in range(3)]
    else:
        qkv = [pl.BlockSpec((None, length, None, head_dim), lambda b, h, i: (b, 0, h, 0))] * 3
    rows = pl.BlockSpec((None, block, None, head_dim), lambda b, h, i: (b, i, h, 0))
    whole = pl.BlockSpec((None, length, None, head_dim), lambda b, h, i: (b, 0, h, 0))
    bias = pl.BlockSpec((None, head_dim), lambda b, h, i: (h, 0))
    segments = pl.BlockSpec((None, length), lambda b, h, i: (b, 0))
    table = pl.BlockSpec((None, length, head_dim), lambda b, h, i: (b, 0, 0))
    stats = pl.BlockSpec((None, None, length), lambda b, h, i: (b, h, 0))
    stat_rows = pl.BlockSpec((None, None, block), lambda b, h, i: (b, h, i))
    block_sum = pl.BlockSpec((None, None, 4, head_dim), lambda b, h, i: (b, h, i, 0))
    return qkv, rows, whole, bias, segments, table, stats, stat_rows, block_sum


_SCALARS = pl.BlockSpec((4,), lambda b, h, i: (0,))   # (seed, batch offset, head offset, 0): 4, a power of two


def _shape(arrays):
    """(batch, length, heads, head_dim) of q/k/v: (q, k, v) [B, S, H, D] or (qkv,) [B, S, 3, H, D]."""
    return (*arrays[0].shape[:2], *arrays[0].shape[-2:])


def _forward(arrays, biases, segment_ids, scalars, rotary, rate, block_q, block_k, interpret, window=None):
    batch, length, heads, head_dim = _shape(arrays)
    qkv, rows, _, bias, segments, table, _, stat_rows, _ = _specs(length, block_q, head_dim, len(arrays) == 1)
    threshold, inv_keep = (None, 1.0) if rate == 0.0 else (keep_threshold(rate), 1.0 / (1.0 - rate))
    return pl.pallas_call(
        functools.partial(_fwd_kernel, scale=1.0 / math.sqrt(head_dim), block_q=block_q, block_k=block_k,
                          threshold=threshold, inv_keep=inv_keep, window=window, rotary=bool(rotary)),
        grid=(batch, heads, length // block_q),
        in_specs=[_SCALARS, *qkv, bias, bias, bias, segments, *(table for _ in rotary)],
        out_specs=[rows, stat_rows],
        out_shape=[jax.ShapeDtypeStruct((batch, length, heads, head_dim), arrays[0].dtype),
                   jax.ShapeDtypeStruct((batch, heads, length), jnp.float32)],
        compiler_params=plgpu.CompilerParams(num_warps=NUM_WARPS, num_stages=NUM_STAGES),
        interpret=interpret,
        name=f"flash_dropout_gpu_fwd_p{priced_pairs(batch, heads, length, block_q, block_k, window)}",
    )(scalars, *(arrays * 3 if len(arrays) == 1 else arrays), *biases, segment_ids, *rotary)


def _backward(arrays, biases, segment_ids, scalars, rotary, o, lse, do, rate, block, interpret, window=None):
    """(the gradients of `arrays`, their per-block sums [B, H, S / block, 3, D] float32)."""
    batch, length, heads, head_dim = _shape(arrays)
    stacked = len(arrays) == 1
    qkv, rows, whole, bias, segments, table, stats, _, block_sum = _specs(length, block, head_dim, stacked)
    sum_shape = jax.ShapeDtypeStruct((batch, heads, length // block * 4, head_dim), jnp.float32)
    *grads, sums = pl.pallas_call(
        functools.partial(_bwd_kernel, scale=1.0 / math.sqrt(head_dim), block=block,
                          threshold=None if rate == 0.0 else keep_threshold(rate), keep_prob=1.0 - rate,
                          window=window, rotary=bool(rotary), stacked=stacked),
        grid=(batch, heads, length // block),
        in_specs=[_SCALARS, *qkv, bias, bias, bias, segments, *(table for _ in rotary), stats, whole, whole],
        out_specs=[*([pl.no_block_spec] if stacked else [rows] * 3), block_sum],
        out_shape=[*(jax.ShapeDtypeStruct(x.shape, x.dtype) for x in arrays), sum_shape],
        compiler_params=plgpu.CompilerParams(num_warps=NUM_WARPS, num_stages=NUM_STAGES),
        interpret=interpret,
        name=f"flash_dropout_gpu_bwd_p{priced_pairs(batch, heads, length, block, block, window)}",
    )(scalars, *(arrays * 3 if stacked else arrays), *biases, segment_ids, *rotary, lse, o, do)
    return tuple(grads), sums.reshape(batch, heads, length // block, 4, head_dim)[:, :, :, :3]


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7, 8, 9, 10))
def _attention(arrays, biases, segment_ids, scalars, rotary, rate, block_q, block_k, block_bwd, interpret, window):
    return _attention_fwd(arrays, biases, segment_ids, scalars, rotary, rate, block_q, block_k, block_bwd,
                          interpret, window)[0]


def _attention_fwd(arrays, biases, segment_ids, scalars, rotary, rate, block_q, block_k, block_bwd, interpret,
                   window):
    rows = tuple(b.astype(arrays[0].dtype) for b in biases)   # the reference's x + b.astype(x.dtype)
    o, lse = _forward(arrays, rows, segment_ids, scalars, rotary, rate, block_q, block_k, interpret, window)
    return o, (arrays, biases, rows, segment_ids, scalars, rotary, o, lse)


def _attention_bwd(rate, block_q, block_k, block_bwd, interpret, window, residuals, do):
    arrays, biases, rows, segment_ids, scalars, rotary, o, lse = residuals
    grads, sums = _backward(arrays, rows, segment_ids, scalars, rotary, o, lse, do, rate, block_bwd, interpret,
                            window)
    sums = sums.sum(axis=(0, 2))
    bias_grads = tuple(sums[:, j].astype(b.dtype) for j, b in enumerate(biases))
    # The tables come from integer positions: no gradient reaches a parameter through them (None: zeros).
    return grads, bias_grads, None, None, None


_attention.defvjp(_attention_fwd, _attention_bwd)


def flash_attention_with_dropout(query, key, value, segment_ids, *, dropout_rate: float, seed, block_q: int = 64,
                                 block_k: int = 64, block_bwd: int = 64, batch_offset=0, head_offset=0,
                                 biases=None, interpret: bool = False, window: int | None = None, rotary=None):
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
    the loops skip the blocks outside it. rotary: optional (cos, sin) float32 [batch, length, head_dim] (`rope
    .cos_sin`'s): q and k (plus their biases) rotated as the kernels load them (`rope.apply_rotary`'s values), the
    gradients returned those of the unrotated q and k.
    """
    return _checked_call((query, key, value), segment_ids, dropout_rate, seed, block_q, block_k, block_bwd,
                         batch_offset, head_offset, biases, interpret, window, rotary)


def stacked_flash_attention_with_dropout(qkv, segment_ids, **options):
    """`flash_attention_with_dropout` on q, k and v stacked, [batch, length, 3, heads, head_dim] (a fused
    projection's output as it is: no copy apart), its gradient one such array (the projection's backward reads it
    as it is); the same keyword options."""
    return flash_attention_with_dropout(qkv, None, None, segment_ids, **options)


def _checked_call(arrays, segment_ids, dropout_rate, seed, block_q, block_k, block_bwd, batch_offset, head_offset,
                  biases, interpret, window, rotary):
    arrays = tuple(a for a in arrays if a is not None)
    dropout_rate = float(dropout_rate)
    if not 0.0 <= dropout_rate < 1.0:
        raise ValueError(f"dropout_rate must be in [0, 1), got {dropout_rate}")
    _, length, heads, head_dim = _shape(arrays)
    if length > MAX_LENGTH:
        raise ValueError(f"lengths up to {MAX_LENGTH} are supported, got {length}")
    for name, size in (("block_q", block_q), ("block_k", block_k), ("block_bwd", block_bwd), ("head_dim", head_dim)):
        if size & (size - 1) or (name != "head_dim" and length % size):
            raise ValueError(f"{name}={size} must be a power of two" + ("" if name == "head_dim" else
                                                                        f" dividing the length {length}"))
    rotary = () if rotary is None else tuple(t.astype(jnp.float32) for t in rotary)
    if biases is None:
        biases = (jnp.zeros((heads, head_dim), arrays[0].dtype),) * 3
    scalars = jnp.concatenate([seed_word(seed), jnp.asarray(batch_offset, jnp.int32).reshape(1),
                               jnp.asarray(head_offset, jnp.int32).reshape(1), jnp.zeros(1, jnp.int32)])
    return _attention(arrays, tuple(biases), segment_ids.astype(jnp.int32), scalars, rotary, dropout_rate,
                      block_q, block_k, block_bwd, interpret, window)
