"""Fused TPU attention (Pallas/Mosaic) with BERT's attention-probability dropout, forward and backward.

    out = dropout(softmax(q k^T / sqrt(d) + mask)) v

computed blockwise (flash attention: running max and sum over key blocks), so the [batch, heads, S, S]
probabilities and the dropout bits never reach HBM. The backward (jax.custom_vjp) recomputes the probabilities
from the saved log-sum-exp and the keep mask from the same hash, in two kernels: one accumulating dq over key
blocks, one accumulating dk and dv over query blocks (on the transposed scores). Per-query statistics (lse, D) and
segment ids live in HBM lane-dense, [B, H, 1, S] and [B, 1, S].

Heads of 64 in pairs (BERT's head size, an even head count): the kernels read q/k/v and write o (and dq/dk/dv) in
the projections' own [B, S, H * 64] layout, two heads per 128-lane block, so neither the kernels' blocks nor the
projections around them move a [B, H, S, 64] layout padded to 128 lanes in HBM (nor transpose into it). The
projections' biases and the query's 1/sqrt(d) are applied to each block inside the kernels (in XLA they would be a
pass of their own over q/k/v: no transpose copy to fuse into), and D = rowsum(dO * O) is computed in the dq kernel
(XLA's sum over 64-lane groups would be another pass) and handed to dk/dv. Other head sizes or odd head counts:
one head per block, [B, H, S, D].

Dropout semantics (those of `bertjax.model.attention.reference_attention`): the mask applies to the normalised
probabilities. The running max/sum use the undropped probabilities; only the P.V product uses the dropped ones,
and the 1/keep_prob scale is applied once per row at the end. Backward, with Z = keep / keep_prob:
    dV = (P*Z)^T dO,   dP = (dO V^T) * Z,   dS = P * (dP - D),   D_i = sum_j dP_ij P_ij = rowsum(dO * O)_i
(the last because sum_j (dO_i . v_j) P_ij Z_ij = dO_i . o_i), dQ = dS K / sqrt(d), dK = dS^T Q / sqrt(d).

The keep mask is a counter-based hash, reproducible outside the kernel (`dropout_keep_mask`; `stream_key`,
`hash_terms` and `keep_at` also draw the GPU kernel's, `dropout_attention_gpu`), of
(seed, batch index, head index, query position, key position), in int32 arithmetic that wraps (the same bits as
uint32) with logical shifts, so it lowers to Mosaic's 32-bit vector ops and runs identically in interpret mode and
plain jnp:
    stream key (per batch index b, head h; scalar work, once per grid cell):
        k0 = fmix32(seed ^ 0x9E3779B9); k1 = fmix32(k0 + (b + 1) * 0x9E3779B9); k2 = fmix32(k1 ^ (h + 1) * 0x85EBCA77)
        mult = k2 | 1;  add = fmix32(k2 + 0x632BE5AB)
    element (query i, key j):  x = (i << 16) | j;  u = fmix32(x * mult + add);  keep = u <u threshold
with fmix32 MurmurHash3's 32-bit finaliser (xor-shift 16, * 0x85EBCA6B, xor-shift 13, * 0xC2B2AE35, xor-shift 16)
and threshold = round((1 - rate) * 2^32). Per key/query pair the kernels spend 11 32-bit integer ops on it
(HASH_OPS_PER_ELEMENT: x * mult + add is precomputed per block sweep) plus the select applying it; x is unique
for lengths up to 65536. Multiplying by a per-stream odd number (not xoring a key in) keeps two streams'
masks from being shifted copies of each other. pltpu.prng_* is not used: its bits cannot be reproduced off-TPU.

Off TPU the kernels run in interpret mode: call inside `jax.experimental.pallas.tpu.force_tpu_interpret_mode()`
(covering the backward trace too), as `bertjax.model.attention` does for its other Pallas backends.
"""
from __future__ import annotations

import functools
import itertools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from bertjax.model.hashing import C_ADD, C_HEAD, GOLDEN, below, fmix32

LANES = 128        # the TPU vector lane width
SUBLANES = 8       # rows of 32 bits in one memory tile / vreg
MAX_LENGTH = 1 << 16   # x = (i << 16) | j needs i, j < 2^16
MASK_VALUE = float(jnp.finfo(jnp.float32).min)   # the reference's mask logit; exp(MASK_VALUE - m) == 0
# Vector-unit (VPU) ops per query/key pair, as the kernels write them. The keep-mask hash: the block's offset added
# to its precomputed x_local * mult + add (`_init_block_hash`), fmix32 (3 shifts, 3 xors, 2 multiplies), the sign
# flip of the unsigned compare and the compare = 11; the precomputation, once per held block's sweep over the
# streamed blocks, 6 per element of one block (2 iotas, shift, add, multiply, add): 6 / (streamed blocks) per pair.
# Besides the matmuls and the hash (exp runs on the separate EUP and is declared as a transcendental): forward
# scale, segment compare, mask select, max, subtract, sum, keep select, cast to the matmul dtype = 8; dq scale,
# compare, select, subtract lse, dP's keep select, subtract D, multiply by P, cast = 8 (1/keep_prob is folded into
# the per-query statistics: `probs_and_dscores`); dk/dv those and P*Z's select and cast = 10. One fewer in each
# where q comes pre-scaled (`flash_attention_with_dropout`). Not per pair, so not counted: the bias adds, lane masks
# and per-head lane selects on [block, 128] q/k/v/o blocks (for a pair of heads as many [block, 128] ops as the
# one-head layout spends on its two heads' blocks of 64 lanes padded to 128).
HASH_OPS_PER_ELEMENT, HASH_INIT_OPS_PER_ELEMENT = 11, 6
# A window's mask per pair: two iotas, their offsets, the difference, its absolute value, the compare and the and.
WINDOW_VPU_OPS = 7
_FWD_VPU_OPS, _DQ_VPU_OPS, _DKV_VPU_OPS = 8, 8, 10




def stream_key(seed, batch_index, head_index):
    """(mult, add) of the (batch, head) stream: int32 scalars in the kernel, broadcasting arrays in jnp."""
    k = fmix32(seed ^ jnp.int32(GOLDEN))
    k = fmix32(k + (batch_index + 1) * jnp.int32(GOLDEN))
    k = fmix32(k ^ (head_index + 1) * jnp.int32(C_HEAD))
    return k | 1, fmix32(k + jnp.int32(C_ADD))


def keep_threshold(rate: float) -> int:
    """Hashes (as uint32) below this are kept: round((1 - rate) * 2^32), at most 2^32 - 1."""
    if not 0.0 < rate < 1.0:
        raise ValueError(f"attention dropout rate must be in (0, 1) for a mask, got {rate}")
    return min(round((1.0 - rate) * 2.0**32), 2**32 - 1)


def hash_terms(rows, cols, mult, add):
    """x * mult + add for x = (rows << 16) | cols in two terms, (rows << 16) * mult + add and cols * mult, for int32
    global positions `rows`, `cols` of one stream: their sum is the same bits (cols < 2^16 sets no bit of
    rows << 16, and products wrap mod 2^32), so a block's [rows, 1] and [1, cols] terms cost no op per pair."""
    return (rows << 16) * mult + add, cols * mult


def keep_at(row_term, col_term, threshold: int):
    """Boolean keep mask from `hash_terms` (broadcasting): fmix32 of their sum, below the threshold (unsigned)."""
    return below(fmix32(row_term + col_term), threshold)


def seed_from_rng(rng) -> jax.Array:
    """A uint32 seed drawn from a jax PRNG key (typed or raw uint32[2]): flax's make_rng('dropout') key."""
    return jax.random.bits(rng, (), jnp.uint32)


def seed_word(seed) -> jax.Array:
    """The seed as int32[1] (its uint32 bits)."""
    if isinstance(seed, jax.Array) and jax.dtypes.issubdtype(seed.dtype, jax.dtypes.prng_key):
        seed = seed_from_rng(seed)
    seed = jnp.asarray(seed)
    if seed.dtype == jnp.int32:
        return seed.reshape(1)
    return lax.bitcast_convert_type(seed.astype(jnp.uint32), jnp.int32).reshape(1)


def dropout_keep_mask(seed, batch: int, heads: int, q_len: int, kv_len: int, rate: float) -> jax.Array:
    """The kernel's keep mask, bool [batch, heads, q_len, kv_len], in plain jnp (the same hash, the same bits)."""
    if max(q_len, kv_len) > MAX_LENGTH:
        raise ValueError(f"lengths up to {MAX_LENGTH} are supported, got {q_len}, {kv_len}")
    seed = seed_word(seed)[0]
    b = jnp.arange(batch, dtype=jnp.int32)[:, None, None, None]
    h = jnp.arange(heads, dtype=jnp.int32)[None, :, None, None]
    mult, add = stream_key(seed, b, h)
    rows = jnp.arange(q_len, dtype=jnp.int32)[:, None]
    cols = jnp.arange(kv_len, dtype=jnp.int32)[None, :]
    return keep_at(*hash_terms(rows, cols, mult, add), keep_threshold(rate))


# ----------------------------------------------------------------------------------------------------------------
# Kernels. Block refs arrive squeezed: q/k/v/o [block, width] (`_Layout`), their biases a (1, width) row; segment
# ids one (1, block) row of [B, 1, S], the per-query statistics (lse, di) the block's heads' (pack, 1, block) rows
# of [B, H, 1, S]. The forward and dq kernels hold per-query
# values as sublane columns (block_q, LANES) in VMEM scratch, transposed once per query block; the dk/dv kernel
# computes the scores transposed ([block_k, block_q]), so per-query values are lane rows there and broadcast over
# sublanes as they are.

def dot(a, b, contract):
    """a . b contracting dims `contract` ((lhs,), (rhs,)), float32 result (exact float32 for float32 inputs).

    The precision is explicit: Mosaic rejects fp32 contract precision on bf16 operands, which
    JAX_DEFAULT_MATMUL_PRECISION=highest (the tests' setting) would otherwise ask for. (Also the GPU kernel's:
    Triton takes HIGHEST on float32 as IEEE, not TF32.)"""
    precision = lax.Precision.HIGHEST if a.dtype == jnp.float32 else lax.Precision.DEFAULT
    return lax.dot_general(a, b, (contract, ((), ())), preferred_element_type=jnp.float32, precision=precision)


NT = ((1,), (1,))   # a [m, d] . b [n, d] -> [m, n]
NN = ((1,), (0,))   # a [m, k] . b [k, n] -> [m, n]


def _column(row):
    """A (1, n) lane row as an (n, LANES) sublane column (each row i holds row[0, i] in every lane)."""
    return jnp.broadcast_to(row, (LANES, row.shape[1])).T


def _row(column):
    """An (n, LANES) sublane column (every lane equal) as a (1, n) lane row."""
    return column.T[:1, :]


def _row_sum_tile(x, shape):
    """The float32 sum of x's rows in the first row of a `shape` (SUBLANES, D) tile, zeros below: one held block's
    share of a projection bias's gradient (`_backward`), written as a whole tile."""
    total = jnp.broadcast_to(jnp.sum(x, axis=0, keepdims=True), shape)
    return jnp.where(lax.broadcasted_iota(jnp.int32, shape, 0) == 0, total, 0.0)


def _scores(a, b, a_seg, b_seg, scale, window=None, a_start=0, b_start=0):
    """Masked logits a b^T * scale [rows of a, rows of b] in float32; a_seg (rows, 1), b_seg (1, cols). With a
    `window`, also masked where the rows' and columns' positions (from a_start, b_start) are further apart."""
    s = dot(a, b, NT)
    if scale != 1.0:
        s = s * scale
    allowed = a_seg == b_seg
    if window is not None:
        shape = s.shape
        distance = ((a_start + lax.broadcasted_iota(jnp.int32, shape, 0))
                    - (b_start + lax.broadcasted_iota(jnp.int32, shape, 1)))
        allowed = allowed & (jnp.abs(distance) <= window)
    return jnp.where(allowed, s, MASK_VALUE)


def window_block(held, step, held_block: int, streamed_block: int, streamed_blocks: int, window: int):
    """(the streamed block that grid step `step` of held block `held` covers, whether it computes it). With a window
    the kernels' streamed grid axis is only as long as the most blocks a held block meets (`window_width`): step s
    is the held block's first streamed block in its window plus s; a step past its last (at the sequence's ends)
    computes nothing and names the last block again, which Pallas does not copy again. Plain ints in, plain ints
    out (the index maps counted on the host, `_block_fetches`); traced int32 scalars in the kernels."""
    if isinstance(held, int) and isinstance(step, int):
        first, last = window_span(held, held_block, streamed_block, streamed_blocks, window)
        return min(first + step, last), first + step <= last
    # lax.div (truncating) of non-negative ints: jnp's floor division lowers to a sign op Mosaic asks a chip about.
    first = lax.div(jnp.maximum(held * held_block - window, 0), streamed_block)
    last = jnp.minimum(lax.div(held * held_block + held_block - 1 + window, streamed_block), streamed_blocks - 1)
    return jnp.minimum(first + step, last), first + step <= last


def _kernel_stream(seed_ref, batch_index, head_index):
    """(mult, add) of a grid cell's stream; seed_ref holds (seed, batch offset, head offset): the offsets of this
    call's batch and heads in the global arrays (non-zero inside a shard_map). Scalar work."""
    return stream_key(seed_ref[0], batch_index + seed_ref[1], head_index + seed_ref[2])


def _init_block_hash(hash_sc, j, seed_ref, batch_index, head_index, transposed=False):
    """At the start of a held block's sweep: hash_sc[j] = x_local * mult + add for this stream, x_local = (query
    offset << 16) + key offset within a block of hash_sc[j]'s shape ([block_q, block_k], or [block_k, block_q] when
    `transposed`). A block starting at (q_start, k_start) has x = x_local + (q_start << 16) + k_start (positions
    < 2^16: no carries), so its x * mult + add is hash_sc[j] + ((q_start << 16) + k_start) * mult: one vector add."""
    mult, add = _kernel_stream(seed_ref, batch_index, head_index)
    q_axis, k_axis = (1, 0) if transposed else (0, 1)
    shape = hash_sc.shape[1:]
    local = (lax.broadcasted_iota(jnp.int32, shape, q_axis) << 16) + lax.broadcasted_iota(jnp.int32, shape, k_axis)
    hash_sc[j] = local * mult + add


def _block_keep(hash_sc, j, seed_ref, batch_index, head_index, q_start, k_start, threshold):
    """The keep mask of the block at (q_start, k_start), in hash_sc[j]'s orientation: the bits of `keep_at`."""
    mult, _ = _kernel_stream(seed_ref, batch_index, head_index)
    return below(fmix32(hash_sc[j] + ((q_start << 16) + k_start) * mult), threshold)


# A block of q/k/v/o is [rows, width]: one head's head_dim lanes (the [B, H, S, D] layout, pack = 1), or `pack` heads
# side by side in 128 lanes (the projections' [B, S, H * D] layout, pack = 128 / D). Head j of a packed block is
# the lanes [j * D, (j + 1) * D): its logits contract the held block with the other heads' lanes zeroed against all
# lanes of the streamed one (on the MXU a 64-deep contraction takes as long as a 128-deep one), and of each
# [rows, 128] product (P_j V, dS_j K, ...) only head j's lanes are kept.

def _head_lanes(x, j, head_dim):
    """x [rows, width] with the lanes outside head j's zeroed (x itself where one head fills the block)."""
    if x.shape[-1] == head_dim:
        return x
    lane = lax.broadcasted_iota(jnp.int32, x.shape, 1)
    return jnp.where((lane >= j * head_dim) & (lane < (j + 1) * head_dim), x, jnp.zeros((), x.dtype))


def _by_head(parts, shape, head_dim):
    """[rows, width]: head j's lanes from parts[j] (each [rows, width] or a [rows, 1] column, broadcast)."""
    parts = [jnp.broadcast_to(x, shape) for x in parts]
    out = parts[-1]
    if len(parts) > 1:
        lane = lax.broadcasted_iota(jnp.int32, shape, 1)
        for j in reversed(range(len(parts) - 1)):
            out = jnp.where(lane < (j + 1) * head_dim, parts[j], out)
    return out


def _head_sum(x, j, head_dim):
    """The sum over head j's lanes of each row of x [rows, width]: a [rows, 1] column."""
    return jnp.sum(_head_lanes(x, j, head_dim), axis=1, keepdims=True)


def _biased(x_ref, bias_ref, factor=1.0):
    """A q/k/v block plus its projection bias (a (1, width) row), times `factor` (1/sqrt(D) for a pre-scaled query:
    a power of two, so scaling before or after rounding is the same), in the block's dtype: the bits of XLA's
    x + bias (computed in float32 and rounded)."""
    x = x_ref[...]
    y = x.astype(jnp.float32) + bias_ref[...].astype(jnp.float32)
    return (y * factor if factor != 1.0 else y).astype(x.dtype)


def _fwd_kernel(seed_ref, q_ref, k_ref, v_ref, qb_ref, kb_ref, vb_ref, qseg_ref, kseg_ref, o_ref, lse_ref, m_sc,
                l_sc, acc_sc, qseg_sc, q_sc, hash_sc, *, scale, prescale, threshold, inv_keep, head_dim, window,
                streamed_blocks):
    b, hb, qi, ki = (pl.program_id(i) for i in range(4))
    block_q, block_k = q_ref.shape[0], k_ref.shape[0]
    pack = lse_ref.shape[0]

    @pl.when(ki == 0)
    def _init():
        m_sc[...] = jnp.full(m_sc.shape, -jnp.inf, jnp.float32)
        l_sc[...] = jnp.zeros(l_sc.shape, jnp.float32)
        acc_sc[...] = jnp.zeros(acc_sc.shape, jnp.float32)
        qseg_sc[...] = _column(qseg_ref[...])
        q = _biased(q_ref, qb_ref, prescale)
        for j in range(pack):
            q_sc[j] = _head_lanes(q, j, head_dim)
            if threshold is not None:
                _init_block_hash(hash_sc, j, seed_ref, b, hb * pack + j)

    streamed, runs = (ki, True) if window is None else window_block(qi, ki, block_q, block_k, streamed_blocks, window)

    @pl.when(runs)
    def _block():
        _fwd_block(seed_ref, k_ref, v_ref, kb_ref, vb_ref, kseg_ref, m_sc, l_sc, acc_sc, qseg_sc, q_sc, hash_sc, b, hb,
                   qi * block_q, streamed * block_k, scale=scale, threshold=threshold, head_dim=head_dim, window=window)

    @pl.when(ki == pl.num_programs(3) - 1)
    def _finish():
        scales = [inv_keep / l_sc[j][:, :1] for j in range(pack)]
        o_ref[...] = (acc_sc[...] * _by_head(scales, acc_sc.shape, head_dim)).astype(o_ref.dtype)
        for j in range(pack):
            lse_ref[j] = _row(m_sc[j] + jnp.log(l_sc[j]))


def _fwd_block(seed_ref, k_ref, v_ref, kb_ref, vb_ref, kseg_ref, m_sc, l_sc, acc_sc, qseg_sc, q_sc, hash_sc, b, hb,
               q_start, k_start, *, scale, threshold, head_dim, window):
    """One streamed key block of the forward: the running max, sum and output of the held queries updated."""
    pack = m_sc.shape[0]
    k, v = _biased(k_ref, kb_ref), _biased(v_ref, vb_ref)
    alphas, products = [], []
    for j in range(pack):
        s = _scores(q_sc[j], k, qseg_sc[...][:, :1], kseg_ref[...], scale, window, q_start, k_start)
        m_prev, l_prev = m_sc[j][:, :1], l_sc[j][:, :1]
        m_new = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
        p = jnp.exp(s - m_new)                       # undropped: the softmax statistics see every key
        alpha = jnp.exp(m_prev - m_new)
        l_new = alpha * l_prev + jnp.sum(p, axis=1, keepdims=True)
        if threshold is not None:
            keep = _block_keep(hash_sc, j, seed_ref, b, hb * pack + j, q_start, k_start, threshold)
            p = jnp.where(keep, p, 0.0)
        alphas.append(alpha)
        products.append(dot(p.astype(v.dtype), v, NN))
        m_sc[j] = jnp.broadcast_to(m_new, m_sc.shape[1:])
        l_sc[j] = jnp.broadcast_to(l_new, l_sc.shape[1:])
    acc_sc[...] = (_by_head(alphas, acc_sc.shape, head_dim) * acc_sc[...]
                   + _by_head(products, acc_sc.shape, head_dim))


def probs_and_dscores(s, lse_kept, di_kept, dp, keep):
    """The backward's recomputation for one block, from the masked logits s, lse - log(1/keep_prob), D * keep_prob
    and dP = dO V^T (all broadcasting, in either orientation): dropped, scaled probabilities P*Z and dS.
    p = exp(s - lse_kept) = P / keep_prob, so P*Z = keep ? p : 0 and dS = P (dP Z - D) = p ((keep ? dP : 0) - D
    keep_prob): with the statistics so adjusted once per row, no 1/keep_prob scaling per pair."""
    p = jnp.exp(s - lse_kept)
    if keep is None:
        return p, p * (dp - di_kept)
    return jnp.where(keep, p, 0.0), p * (jnp.where(keep, dp, 0.0) - di_kept)


def _dq_kernel(seed_ref, q_ref, k_ref, v_ref, qb_ref, kb_ref, vb_ref, qseg_ref, kseg_ref, lse_ref, o_ref, do_ref,
               dq_ref, dqsum_ref, di_ref, dq_sc, qseg_sc, lse_sc, di_sc, q_sc, do_sc, hash_sc, *, scale, prescale,
               dq_scale, threshold, inv_keep, head_dim, window, streamed_blocks):
    """Also computes D = rowsum(dO * O) per head from the held blocks, and writes it (lane-dense) for dk/dv."""
    b, hb, qi, ki = (pl.program_id(i) for i in range(4))
    block_q, block_k = q_ref.shape[0], k_ref.shape[0]
    pack = lse_ref.shape[0]

    @pl.when(ki == 0)
    def _init():
        dq_sc[...] = jnp.zeros(dq_sc.shape, jnp.float32)
        qseg_sc[...] = _column(qseg_ref[...])
        q, do = _biased(q_ref, qb_ref, prescale), do_ref[...]
        do_o = do.astype(jnp.float32) * o_ref[...].astype(jnp.float32)
        for j in range(pack):
            di = jnp.broadcast_to(_head_sum(do_o, j, head_dim), (block_q, LANES))
            di_ref[j] = _row(di)
            lse_sc[j] = _column(lse_ref[j] - math.log(inv_keep))   # see `probs_and_dscores`
            di_sc[j] = di * (1.0 / inv_keep)
            q_sc[j] = _head_lanes(q, j, head_dim)
            do_sc[j] = _head_lanes(do, j, head_dim)
            if threshold is not None:
                _init_block_hash(hash_sc, j, seed_ref, b, hb * pack + j)

    streamed, runs = (ki, True) if window is None else window_block(qi, ki, block_q, block_k, streamed_blocks, window)

    @pl.when(runs)
    def _block():
        k, v = _biased(k_ref, kb_ref), _biased(v_ref, vb_ref)
        products = []
        for j in range(pack):
            s = _scores(q_sc[j], k, qseg_sc[...][:, :1], kseg_ref[...], scale, window, qi * block_q, streamed * block_k)
            keep = None if threshold is None else _block_keep(hash_sc, j, seed_ref, b, hb * pack + j, qi * block_q,
                                                              streamed * block_k, threshold)
            dp = dot(do_sc[j], v, NT)       # d(P*Z) = dO V^T
            _, ds = probs_and_dscores(s, lse_sc[j][:, :1], di_sc[j][:, :1], dp, keep)
            products.append(dot(ds.astype(k.dtype), k, NN))
        dq_sc[...] += _by_head(products, dq_sc.shape, head_dim)

    @pl.when(ki == pl.num_programs(3) - 1)
    def _finish():
        dq = dq_sc[...] * dq_scale if dq_scale != 1.0 else dq_sc[...]
        dq_ref[...] = dq.astype(dq_ref.dtype)
        dqsum_ref[...] = _row_sum_tile(dq, dqsum_ref.shape)


def _dkv_kernel(seed_ref, q_ref, k_ref, v_ref, qb_ref, kb_ref, vb_ref, qseg_ref, kseg_ref, lse_ref, di_ref, do_ref,
                dk_ref, dv_ref, dksum_ref, dvsum_ref, dk_sc, dv_sc, kseg_sc, k_sc, v_sc, hash_sc, *, scale, prescale,
                threshold, inv_keep, head_dim, window, streamed_blocks):
    """Scores transposed: s^T = K Q^T [block_k, block_q], so dV = (P*Z)^T dO and dK = dS^T Q are plain matmuls and
    the per-query statistics and segment ids are lane rows."""
    b, hb, ki, qi = (pl.program_id(i) for i in range(4))   # key blocks outer, query blocks inner (reduced)
    block_q, block_k = q_ref.shape[0], k_ref.shape[0]
    pack = lse_ref.shape[0]

    @pl.when(qi == 0)
    def _init():
        dk_sc[...] = jnp.zeros(dk_sc.shape, jnp.float32)
        dv_sc[...] = jnp.zeros(dv_sc.shape, jnp.float32)
        kseg_sc[...] = _column(kseg_ref[...])
        k, v = _biased(k_ref, kb_ref), _biased(v_ref, vb_ref)
        for j in range(pack):
            k_sc[j] = _head_lanes(k, j, head_dim)
            v_sc[j] = _head_lanes(v, j, head_dim)
            if threshold is not None:
                _init_block_hash(hash_sc, j, seed_ref, b, hb * pack + j, transposed=True)

    streamed, runs = (qi, True) if window is None else window_block(ki, qi, block_k, block_q, streamed_blocks, window)

    @pl.when(runs)
    def _block():
        q, do = _biased(q_ref, qb_ref, prescale), do_ref[...]
        dk_parts, dv_parts = [], []
        for j in range(pack):
            q_start = streamed * block_q
            s_t = _scores(k_sc[j], q, kseg_sc[...][:, :1], qseg_ref[...], scale, window, ki * block_k, q_start)
            keep = None if threshold is None else _block_keep(hash_sc, j, seed_ref, b, hb * pack + j, q_start,
                                                              ki * block_k, threshold)
            dp_t = dot(v_sc[j], do, NT)             # (dO V^T)^T = V dO^T
            pz_t, ds_t = probs_and_dscores(s_t, lse_ref[j] - math.log(inv_keep), di_ref[j] * (1.0 / inv_keep),
                                           dp_t, keep)
            dv_parts.append(dot(pz_t.astype(do.dtype), do, NN))
            dk_parts.append(dot(ds_t.astype(q.dtype), q, NN))
        dv_sc[...] += _by_head(dv_parts, dv_sc.shape, head_dim)
        dk_sc[...] += _by_head(dk_parts, dk_sc.shape, head_dim)

    @pl.when(qi == pl.num_programs(3) - 1)
    def _finish():
        dk = dk_sc[...] * scale if scale != 1.0 else dk_sc[...]
        dk_ref[...] = dk.astype(dk_ref.dtype)
        dv_ref[...] = dv_sc[...].astype(dv_ref.dtype)
        dksum_ref[...] = _row_sum_tile(dk, dksum_ref.shape)
        dvsum_ref[...] = _row_sum_tile(dv_sc[...], dvsum_ref.shape)


# ----------------------------------------------------------------------------------------------------------------
# pallas_calls. Arrays: q/k/v/o as `_Layout` says; segment ids [B, 1, S]; lse/di [B, H, 1, S].

def _tile_padded_bytes(block_shape, array) -> int:
    """Bytes a DMA moves for one block of `array` in HBM: whole (rows, 128) tiles of XLA:TPU's layout, rows = 8
    (bf16 packs row pairs into 32-bit words of the same (8, 128) tile), or the array's second-last dim rounded up to
    a power of two where it is under 8 (a [.., 1, S] array is tiled (1, 128))."""
    itemsize = jnp.dtype(array.dtype).itemsize
    *outer, rows, cols = [1 if d is None else d for d in block_shape]
    tile_rows = min(SUBLANES, 1 << max(0, array.shape[-2] - 1).bit_length())
    return math.prod(outer) * -(-rows // tile_rows) * tile_rows * -(-cols // LANES) * LANES * itemsize


def _block_fetches(index_map, grid) -> int:
    """How many times a block is copied: Pallas copies when the block index differs from the previous grid step's
    (the grid iterated row-major); counted over the grid."""
    count, last = 0, None
    for g in itertools.product(*(range(n) for n in grid)):
        index = index_map(*g)
        count += index != last
        last = index
    return count


# pl.CostEstimate has one flop count, which XLA (and `bertjax compile`) prices at the MXU's peak; the kernels'
# elementwise work runs on the VPU at a lower rate, so it is declared as the MXU flops that take as long. v5e, per
# TensorCore and cycle: 4 MXUs x 128 x 128 multiply-adds = 131072 flops (197 TFLOP/s bf16 at 1.5 GHz, the Cloud
# TPU v5e docs); the VPU one op on an (8, 128) vreg (the scaling book's "How to think about TPUs") in each of 4
# vector-ALU slots (the slot count is our assumption) = 4096 32-bit ops. One VPU op = 131072 / 4096 = 32 MXU
# flops. v4 and v5p have the same four 128 x 128 MXUs and vreg shape per TensorCore; v6e's 256 x 256 MXUs would
# make it 128 (not modelled: one figure for every generation).
VPU_OP_MXU_FLOPS = 32


def _mxu_width(width: int) -> int:
    """The lanes an MXU pass spends on a product contracting, or producing, `width` lanes: whole 128-lane passes
    (a 128 x 128 systolic array: a 64-deep contraction, or 64 output columns, takes as long as 128). A packed
    block's head contracts all 128 lanes with the other head's zeroed: the same passes as one head of 64 alone."""
    return -(-width // LANES) * LANES


def _cost(*, pairs, matmuls, width, vpu_ops, threshold, exps, grid, specs, operands) -> pl.CostEstimate:
    """Roofline figures of one kernel. Flops: the larger of the MXU's (`matmuls` products per head of a [bq, bk]
    block with a q/k/v block `width` lanes wide, at `_mxu_width` as the MXU runs them) and the VPU's (`vpu_ops` per
    pair and the hash's when dropout is on, at VPU_OP_MXU_FLOPS each): the two units run side by side in the kernel's VLIW bundles, so the slower sets the time. `exps` exponentials
    per pair. Bytes: each operand's (inputs and outputs, `specs` matching `operands`) tile-padded block times the
    times it is copied over the grid."""
    elementwise = vpu_ops
    if threshold is not None:   # grid[3]: the streamed blocks of one sweep
        elementwise += HASH_OPS_PER_ELEMENT + HASH_INIT_OPS_PER_ELEMENT / grid[3]
    flops = pairs * max(2 * _mxu_width(width) * matmuls, round(elementwise * VPU_OP_MXU_FLOPS))
    bytes_accessed = sum(_tile_padded_bytes(spec.block_shape, x) * _block_fetches(spec.index_map, grid)
                         for spec, x in zip(specs, operands))
    return pl.CostEstimate(flops=int(flops), transcendentals=int(exps * pairs), bytes_accessed=int(bytes_accessed))


class _Layout(NamedTuple):
    """How q/k/v/o (and their gradients) lie in HBM for the kernels: `packed`, the projections' own [B, S, H * D]
    (a free reshape of [B, S, H, D]) in blocks of 128 lanes holding LANES / D heads each; otherwise [B, H, S, D],
    one head per block (its D lanes padded to 128 in XLA:TPU's HBM tiles)."""
    heads: int
    head_dim: int
    packed: bool

    @property
    def pack(self) -> int:
        """Heads per block."""
        return LANES // self.head_dim if self.packed else 1

    @property
    def width(self) -> int:
        """Lanes of one q/k/v/o block."""
        return self.pack * self.head_dim

    def length(self, x) -> int:
        return x.shape[1] if self.packed else x.shape[2]


def _layout(heads: int, head_dim: int) -> _Layout:
    """Packed where two heads of 64 fill a block (BERT's head size, an even head count); elsewhere one head per
    block in [B, H, S, D]. (Heads of 16 or 32 could pack 8 or 4 to a block the same way: not compiled or priced.)"""
    return _Layout(heads, head_dim, packed=2 * head_dim == LANES and heads % 2 == 0)


def window_span(held: int, held_block: int, streamed_block: int, streamed_blocks: int, window: int):
    """(first, last) streamed block a held block meets within `window`: every block between them meets it."""
    first = max(0, held * held_block - window) // streamed_block
    last = (held * held_block + held_block - 1 + window) // streamed_block
    return first, min(streamed_blocks - 1, last)


def window_width(held_block: int, streamed_block: int, length: int, window: int | None) -> int:
    """The kernels' streamed grid axis: every streamed block, or with a `window` the most that one held block meets
    (3 for ModernBERT's 64 tokens each side in blocks of 128, at any length: the grid grows with the sequence, not
    with its square)."""
    streamed_blocks = length // streamed_block
    if window is None:
        return streamed_blocks
    return max(last - first + 1 for first, last in (window_span(i, held_block, streamed_block, streamed_blocks, window)
                                                    for i in range(length // held_block)))


def _streamed_index(window, held_block, streamed_block, streamed_blocks):
    """grid -> the streamed block to fetch: grid axis 3, or with a `window` the one that step covers in the held
    block's (grid axis 2) window (`window_block`)."""
    if window is None:
        return lambda g: g[3]
    return lambda g: window_block(g[2], g[3], held_block, streamed_block, streamed_blocks, window)[0]


def _specs(layout, block_q, block_k, q_axis: int, k_axis: int, window=None, length=None):
    """BlockSpecs indexed by grid (b, head block, *) with the query block index at grid axis `q_axis`, key at
    `k_axis` (the held block's at 2, the streamed one's at 3); the per-query statistics hold the block's `pack`
    heads. With a `window` grid axis 3 steps through the held block's window alone (`window_block`)."""
    held_block, streamed_block = (block_q, block_k) if q_axis == 2 else (block_k, block_q)
    streamed = _streamed_index(window, held_block, streamed_block, (length or 0) // streamed_block)
    q_index = (lambda g: g[2]) if q_axis == 2 else streamed
    k_index = (lambda g: g[2]) if k_axis == 2 else streamed
    if layout.packed:
        q_spec = pl.BlockSpec((None, block_q, LANES), lambda *g: (g[0], q_index(g), g[1]))
        k_spec = pl.BlockSpec((None, block_k, LANES), lambda *g: (g[0], k_index(g), g[1]))
    else:
        q_spec = pl.BlockSpec((None, None, block_q, layout.head_dim), lambda *g: (g[0], g[1], q_index(g), 0))
        k_spec = pl.BlockSpec((None, None, block_k, layout.head_dim), lambda *g: (g[0], g[1], k_index(g), 0))
    q_stat = pl.BlockSpec((None, layout.pack, 1, block_q), lambda *g: (g[0], g[1], 0, q_index(g)))
    qseg = pl.BlockSpec((None, 1, block_q), lambda *g: (g[0], 0, q_index(g)))
    kseg = pl.BlockSpec((None, 1, block_k), lambda *g: (g[0], 0, k_index(g)))
    return q_spec, k_spec, q_stat, qseg, kseg


def _pairs(batch, heads, length, block_q, block_k, window) -> int:
    """The query-key pairs the kernels compute: all of them, or those of the blocks that meet within a window."""
    if window is None:
        return batch * heads * length * length
    blocks = sum(last - first + 1 for first, last in
                 (window_span(i, block_q, block_k, length // block_k, window) for i in range(length // block_q)))
    return batch * heads * blocks * block_q * block_k


def _sums(layout, batch, held_blocks):
    """(spec, shape) of the backward's per-held-block bias-gradient tiles: row 0 of an (8, width) float32 tile holds
    the held block's rows summed (grid axis 2 is the held block in both backward kernels)."""
    if layout.packed:
        spec = pl.BlockSpec((None, SUBLANES, LANES), lambda *g: (g[0], g[2], g[1]))
        shape = (batch, held_blocks * SUBLANES, layout.heads * layout.head_dim)
    else:
        spec = pl.BlockSpec((None, None, SUBLANES, layout.head_dim), lambda *g: (g[0], g[1], g[2], 0))
        shape = (batch, layout.heads, held_blocks * SUBLANES, layout.head_dim)
    return spec, jax.ShapeDtypeStruct(shape, jnp.float32)


def _summed(layout, sums):
    """The tiles of `_sums` added up: [B, H, D]."""
    if layout.packed:
        return sums.sum(axis=1).reshape(sums.shape[0], layout.heads, layout.head_dim)
    return sums.sum(axis=2)


def _pallas_call(kernel, name, grid, in_specs, out_specs, scratch, out_shape, cost, *args):
    # The seed is prefetched to SMEM; index maps and kernels receive its ref after the grid indices.
    wrap = lambda spec: pl.BlockSpec(spec.block_shape, lambda *g: spec.index_map(*g[:4]))
    grid_spec = pltpu.PrefetchScalarGridSpec(num_scalar_prefetch=1, grid=grid, in_specs=[wrap(s) for s in in_specs],
                                             out_specs=[wrap(s) for s in out_specs], scratch_shapes=scratch)
    return pl.pallas_call(
        kernel, grid_spec=grid_spec, out_shape=out_shape,
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "parallel", "arbitrary")),
        cost_estimate=_cost(grid=grid, specs=(*in_specs, *out_specs), operands=(*args[1:], *out_shape), **cost),
        name=name,
    )(*args)


def _kernel_args(rate):
    if rate == 0.0:
        return dict(threshold=None, inv_keep=1.0)
    return dict(threshold=keep_threshold(rate), inv_keep=1.0 / (1.0 - rate))


def _column_scratch(block, dtype=jnp.float32):
    return pltpu.VMEM((block, LANES), dtype)


def _forward(q, k, v, biases, segment_ids, seed, rate, block_q, block_k, layout, prescale, window=None):
    """(o in q's layout, lse [B, H, 1, S] float32). q/k/v in `layout`, `biases` (q, k, v) its `_bias_rows`; the
    logits are (q + bias) (k + bias)^T / sqrt(D), the 1/sqrt(D) applied to the query if `prescale`, else to them."""
    batch, length, pack, width = q.shape[0], layout.length(q), layout.pack, layout.width
    scale, q_factor = _scales(layout, prescale)
    seg = segment_ids.reshape(batch, 1, length)
    q_spec, k_spec, q_stat, qseg_spec, kseg_spec = _specs(layout, block_q, block_k, q_axis=2, k_axis=3,
                                                          window=window, length=length)
    bias_spec = _bias_spec(layout)
    kwargs = _kernel_args(rate)
    cost = {"pairs": _pairs(batch, layout.heads, length, block_q, block_k, window), "matmuls": 2, "width": width,
            "vpu_ops": _FWD_VPU_OPS - (scale == 1.0) + (0 if window is None else WINDOW_VPU_OPS),
            "threshold": kwargs["threshold"], "exps": 1}
    return _pallas_call(
        functools.partial(_fwd_kernel, scale=scale, prescale=q_factor, head_dim=layout.head_dim, window=window,
                          streamed_blocks=length // block_k, **kwargs),
        "flash_dropout_fwd", (batch, layout.heads // pack, length // block_q,
                              window_width(block_q, block_k, length, window)),
        [q_spec, k_spec, k_spec, bias_spec, bias_spec, bias_spec, qseg_spec, kseg_spec], [q_spec, q_stat],
        [pltpu.VMEM((pack, block_q, LANES), jnp.float32), pltpu.VMEM((pack, block_q, LANES), jnp.float32),
         pltpu.VMEM((block_q, width), jnp.float32), _column_scratch(block_q, jnp.int32),
         pltpu.VMEM((pack, block_q, width), q.dtype), pltpu.VMEM((pack, block_q, block_k), jnp.int32)],
        (jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct((batch, layout.heads, 1, length), jnp.float32)),
        cost, seed, q, k, v, *biases, seg, seg)


def _backward(q, k, v, biases, segment_ids, seed, o, lse, do, rate, block_q, block_k, layout, prescale, window=None):
    """(dq, dk, dv, (dq, dk, dv summed over the sequence [B, H, D] float32: the gradients of the biases, from the
    kernels' own accumulators instead of an XLA reduction over the gradients)); arguments as `_forward`'s."""
    batch, length, pack, width = q.shape[0], layout.length(q), layout.pack, layout.width
    scale, q_factor = _scales(layout, prescale)
    unscaled = scale == 1.0   # one VPU op per pair fewer
    nq, nk = length // block_q, length // block_k
    # Both kernels hold blocks of block_q (queries in dq, keys in dk/dv) over streamed blocks of block_k.
    grid = (batch, layout.heads // pack, nq, window_width(block_q, block_k, length, window))
    seg = segment_ids.reshape(batch, 1, length)
    kwargs = dict(_kernel_args(rate), head_dim=layout.head_dim, scale=scale, prescale=q_factor, window=window,
                  streamed_blocks=nk)
    cost = {"pairs": _pairs(batch, layout.heads, length, block_q, block_k, window), "width": width,
            "threshold": kwargs["threshold"], "exps": 1}
    windowed = 0 if window is None else WINDOW_VPU_OPS
    sum_spec, sum_shape = _sums(layout, batch, nq)
    bias_spec = _bias_spec(layout)
    stats_shape = jax.ShapeDtypeStruct((batch, layout.heads, 1, length), jnp.float32)

    q_spec, k_spec, q_stat, qseg_spec, kseg_spec = _specs(layout, block_q, block_k, q_axis=2, k_axis=3,
                                                          window=window, length=length)
    # dq: the chain rule of the logits' scale and of the query's prescale once per row, at the end.
    dq, dq_sum, di = _pallas_call(
        functools.partial(_dq_kernel, dq_scale=scale * q_factor, **kwargs), "flash_dropout_dq", grid,
        [q_spec, k_spec, k_spec, bias_spec, bias_spec, bias_spec, qseg_spec, kseg_spec, q_stat, q_spec, q_spec],
        [q_spec, sum_spec, q_stat],
        [pltpu.VMEM((block_q, width), jnp.float32), _column_scratch(block_q, jnp.int32),
         pltpu.VMEM((pack, block_q, LANES), jnp.float32), pltpu.VMEM((pack, block_q, LANES), jnp.float32),
         pltpu.VMEM((pack, block_q, width), q.dtype), pltpu.VMEM((pack, block_q, width), do.dtype),
         pltpu.VMEM((pack, block_q, block_k), jnp.int32)],
        [jax.ShapeDtypeStruct(q.shape, q.dtype), sum_shape, stats_shape],
        {**cost, "matmuls": 3, "vpu_ops": _DQ_VPU_OPS - unscaled + windowed},
        seed, q, k, v, *biases, seg, seg, lse, o, do)

    # dk/dv holds a key block over streamed query blocks: the held block is block_q long here too (the streamed
    # operands are re-read once per held block), so the blocks swap roles.
    q_spec, k_spec, q_stat, qseg_spec, kseg_spec = _specs(layout, block_k, block_q, q_axis=3, k_axis=2,
                                                          window=window, length=length)
    dk, dv, dk_sum, dv_sum = _pallas_call(
        functools.partial(_dkv_kernel, **kwargs), "flash_dropout_dkv", grid,
        [q_spec, k_spec, k_spec, bias_spec, bias_spec, bias_spec, qseg_spec, kseg_spec, q_stat, q_stat, q_spec],
        [k_spec, k_spec, sum_spec, sum_spec],
        [pltpu.VMEM((block_q, width), jnp.float32), pltpu.VMEM((block_q, width), jnp.float32),
         _column_scratch(block_q, jnp.int32), pltpu.VMEM((pack, block_q, width), k.dtype),
         pltpu.VMEM((pack, block_q, width), v.dtype), pltpu.VMEM((pack, block_q, block_k), jnp.int32)],
        [jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype), sum_shape, sum_shape],
        {**cost, "matmuls": 4, "vpu_ops": _DKV_VPU_OPS - unscaled + windowed},
        seed, q, k, v, *biases, seg, seg, lse, di, do)
    return dq, dk, dv, tuple(_summed(layout, x) for x in (dq_sum, dk_sum, dv_sum))


def _scales(layout, prescale):
    """(the logits' scale, the query's factor): 1/sqrt(D) on one of them."""
    factor = 1.0 / math.sqrt(layout.head_dim)
    return (1.0, factor) if prescale else (factor, 1.0)


def _bias_spec(layout):
    """The BlockSpec of `_bias_rows`: the block's heads' biases, one (1, width) row per grid cell's head block."""
    if layout.packed:
        return pl.BlockSpec((None, 1, LANES), lambda *g: (g[0], 0, g[1]))
    return pl.BlockSpec((None, None, 1, layout.head_dim), lambda *g: (g[0], g[1], 0, 0))


def _bias_rows(layout, biases, batch, dtype):
    """The q/k/v biases [B, H, D] (None: zeros) as the kernels read them, in q/k/v's dtype: [B, 1, H * D] rows where
    packed, [B, H, 1, D] otherwise."""
    shape = (batch, 1, layout.heads * layout.head_dim) if layout.packed else (batch, layout.heads, 1, layout.head_dim)
    if biases is None:
        return (jnp.zeros(shape, dtype),) * 3
    return tuple(b.astype(dtype).reshape(shape) for b in biases)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8, 9, 10, 11))
def _attention(q, k, v, biases, segment_ids, seed, rate, block_q, block_k, layout, prescale, window):
    return _attention_fwd(q, k, v, biases, segment_ids, seed, rate, block_q, block_k, layout, prescale, window)[0]


def _attention_fwd(q, k, v, biases, segment_ids, seed, rate, block_q, block_k, layout, prescale, window):
    rows = _bias_rows(layout, biases, q.shape[0], q.dtype)
    o, lse = _forward(q, k, v, rows, segment_ids, seed, rate, block_q, block_k, layout, prescale, window)
    return o, (q, k, v, biases, rows, segment_ids, seed, o, lse)


def _attention_bwd(rate, block_q, block_k, layout, prescale, window, residuals, do):
    q, k, v, biases, rows, segment_ids, seed, o, lse = residuals
    dq, dk, dv, sums = _backward(q, k, v, rows, segment_ids, seed, o, lse, do, rate, block_q, block_k, layout,
                                 prescale, window)
    bias_grads = None if biases is None else tuple(s.astype(b.dtype) for s, b in zip(sums, biases))
    return dq, dk, dv, bias_grads, None, None


_attention.defvjp(_attention_fwd, _attention_bwd)


def flash_attention_with_dropout(query, key, value, segment_ids, *, dropout_rate: float, seed, block_q: int = 128,
                                 block_k: int = 128, batch_offset=0, head_offset=0, biases=None,
                                 window: int | None = None):
    """dropout(softmax(q k^T / sqrt(d) + mask)) v, fused; q/k/v [batch, length, heads, head_dim].

    segment_ids [batch, length] int32: 0 = padding; a query attends to the keys with its id (so padding attends to
    padding and every row has a key). dropout_rate: static, in [0, 1); 0 = no dropout (the hash is not even
    computed). seed: uint32/int32 scalar, or a jax PRNG key (turned into a uint32 by `seed_from_rng`). The keep
    mask is `dropout_keep_mask(seed, batch, heads, length, length, dropout_rate)`. block_q: the held block (queries
    in the forward and dq kernels, keys in dk/dv), block_k: the streamed one. The length is padded (with
    segment id 0) to a multiple of the blocks. Output in query's dtype; softmax statistics in float32.
    batch_offset/head_offset (int or traced int32): the global index of this call's first example and head, for a
    call on one shard inside a shard_map, so that the mask is that of the global arrays whatever the sharding.
    biases: optional (q, k, v) biases, each [heads, head_dim] or [batch, heads, head_dim], added to query, key and
    value in their dtype (the projections' biases) inside the kernels: their gradients are the kernels' dq/dk/dv
    summed over the sequence inside the kernels, where XLA's reduction of each [batch, length, heads, 64] gradient
    (64 lanes padded to 128) is priced at ~0.12 ms a layer on v5e at seq 512, batch 16.
    window: a query attends only to keys at most this many positions away (ModernBERT's sliding-window layers); the
    kernels' grids step only through the blocks that meet it (`window_width`): the others are neither fetched, nor
    computed, nor stepped over.
    """
    dropout_rate = float(dropout_rate)
    if not 0.0 <= dropout_rate < 1.0:
        raise ValueError(f"dropout_rate must be in [0, 1), got {dropout_rate}")
    batch, length, heads, head_dim = query.shape
    block = max(block_q, block_k)
    if block % block_q or block % block_k:
        raise ValueError(f"block_q={block_q} and block_k={block_k} must divide one another")
    extra = -length % block
    if length + extra > MAX_LENGTH:
        raise ValueError(f"lengths up to {MAX_LENGTH} are supported, got {length}")
    segment_ids = segment_ids.astype(jnp.int32)
    if extra:
        pad = lambda x: jnp.pad(x, [(0, 0), (0, extra)] + [(0, 0)] * (x.ndim - 2))
        query, key, value, segment_ids = pad(query), pad(key), pad(value), pad(segment_ids)
    layout = _layout(heads, head_dim)
    padded = length + extra
    if layout.packed:   # [B, S, H, D] <-> [B, S, H * D]: reshapes that move no data
        to_kernel = lambda x: x.reshape(batch, padded, heads * head_dim)
        from_kernel = lambda x: x.reshape(batch, padded, heads, head_dim)
    else:               # [B, S, H, D] <-> [B, H, S, D]
        to_kernel = from_kernel = lambda x: jnp.swapaxes(x, 1, 2)
    if biases is not None:
        biases = tuple(jnp.broadcast_to(b, (batch, heads, head_dim)) for b in biases)
    # Where 1/sqrt(D) is a power of two (D a power of 4: 16, 64 (BERT), 256), q * 1/sqrt(D) is exact: q is scaled
    # once on its way into the kernels and no kernel scales its [S, S] logits (one VPU op per query-key pair fewer).
    prescale = math.frexp(1.0 / math.sqrt(head_dim))[0] == 0.5
    # Scalar-prefetched to SMEM: the seed's bits and the global index of this call's first example and head.
    scalars = jnp.concatenate([seed_word(seed), jnp.asarray(batch_offset, jnp.int32).reshape(1),
                               jnp.asarray(head_offset, jnp.int32).reshape(1)])
    out = _attention(to_kernel(query), to_kernel(key), to_kernel(value), biases, segment_ids, scalars, dropout_rate,
                     block_q, block_k, layout, prescale, window)
    return from_kernel(out)[:, :length]
