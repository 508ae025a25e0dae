"""Fused TPU attention (Pallas/Mosaic) with BERT's attention-probability dropout, forward and backward.

    out = dropout(softmax(q k^T / sqrt(d) + mask)) v

computed blockwise (flash attention: running max and sum over key blocks), so the [batch, heads, S, S]
probabilities and the dropout bits never reach HBM. The backward (jax.custom_vjp) recomputes the probabilities
from the saved log-sum-exp and the keep mask from the same hash, in two kernels: one accumulating dq over key
blocks, one accumulating dk and dv over query blocks.

Dropout semantics (those of `bertjax.model.attention.reference_attention`): the mask applies to the normalised
probabilities. The running max/sum use the undropped probabilities; only the P.V product uses the dropped ones,
and the 1/keep_prob scale is applied once per row at the end. Backward, with Z = keep / keep_prob:
    dV = (P*Z)^T dO,   dP = (dO V^T) * Z,   dS = P * (dP - D),   D_i = sum_j dP_ij P_ij = rowsum(dO * O)_i
(the last because sum_j (dO_i . v_j) P_ij Z_ij = dO_i . o_i), dQ = dS K / sqrt(d), dK = dS^T Q / sqrt(d).

The keep mask is a counter-based hash, reproducible outside the kernel (`dropout_keep_mask`), of
(seed, batch index, head index, query position, key position), in int32 arithmetic that wraps (the same bits as
uint32) with logical shifts, so it lowers to Mosaic's 32-bit vector ops and runs identically in interpret mode and
plain jnp:
    stream key (per batch index b, head h; scalar work, once per grid cell):
        k0 = fmix32(seed ^ 0x9E3779B9); k1 = fmix32(k0 + (b + 1) * 0x9E3779B9); k2 = fmix32(k1 ^ (h + 1) * 0x85EBCA77)
        mult = k2 | 1;  add = fmix32(k2 + 0x632BE5AB)
    element (query i, key j):  x = (i << 16) | j;  u = fmix32(x * mult + add);  keep = u <u threshold
with fmix32 MurmurHash3's 32-bit finaliser (xor-shift 16, * 0x85EBCA6B, xor-shift 13, * 0xC2B2AE35, xor-shift 16)
and threshold = round((1 - rate) * 2^32). Per key/query pair that is 13 32-bit integer ops (shift, or, mul, add,
3 shifts, 3 xors, 2 muls, the sign flip of the unsigned compare, the compare) plus the select applying it; x is
unique for lengths up to 65536. Multiplying by a per-stream odd number (not xoring a key in) keeps two streams'
masks from being shifted copies of each other. pltpu.prng_* is not used: its bits cannot be reproduced off-TPU.

Off TPU the kernels run in interpret mode: call inside `jax.experimental.pallas.tpu.force_tpu_interpret_mode()`
(covering the backward trace too), as `bertjax.model.attention` does for its other Pallas backends.
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from bertjax.model.hashing import C_ADD, C_HEAD, GOLDEN, fmix32, i32

LANES = 128        # the TPU vector lane width: per-row statistics are stored replicated over 128 lanes
SUBLANES = 8       # key segment ids are stored replicated over 8 sublanes (one (8, 128) tile row)
MAX_LENGTH = 1 << 16   # x = (i << 16) | j needs i, j < 2^16
MASK_VALUE = float(jnp.finfo(jnp.float32).min)   # the reference's mask logit; exp(MASK_VALUE - m) == 0
HASH_OPS_PER_ELEMENT = 13   # integer ops of the keep-mask hash per query/key pair (see the module docstring)
# Per query/key pair besides the matmuls and the hash: scale, segment compare, mask select, max, subtract, sum,
# keep select (forward ~7); the backward kernels a few more each.
_FWD_VPU_OPS, _DQ_VPU_OPS, _DKV_VPU_OPS = 7, 8, 10


_SIGN = i32(0x80000000)


def _stream_key(seed, batch_index, head_index):
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


def _keep(rows, cols, mult, add, threshold: int):
    """Boolean keep mask for int32 global positions `rows`, `cols` (broadcasting) of one stream."""
    u = fmix32(((rows << 16) | cols) * mult + add)
    # Unsigned u < threshold as a signed compare: flip the sign bit of both sides.
    return (u ^ jnp.int32(_SIGN)) < jnp.int32(i32(threshold - 2**31))


def seed_from_rng(rng) -> jax.Array:
    """A uint32 seed drawn from a jax PRNG key (typed or raw uint32[2]): flax's make_rng('dropout') key."""
    return jax.random.bits(rng, (), jnp.uint32)


def _seed_word(seed) -> jax.Array:
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
    seed = _seed_word(seed)[0]
    b = jnp.arange(batch, dtype=jnp.int32)[:, None, None, None]
    h = jnp.arange(heads, dtype=jnp.int32)[None, :, None, None]
    mult, add = _stream_key(seed, b, h)
    rows = jnp.arange(q_len, dtype=jnp.int32)[:, None]
    cols = jnp.arange(kv_len, dtype=jnp.int32)[None, :]
    return _keep(rows, cols, mult, add, keep_threshold(rate))


# ----------------------------------------------------------------------------------------------------------------
# Kernels. Block refs arrive squeezed: q/k/v/o [block, head_dim], q segment ids [block_q, LANES], key segment ids
# [SUBLANES, block_k], per-row statistics [block_q, LANES] (replicated over lanes).

def _dot(a, b, contract):
    """a . b contracting dims `contract` ((lhs,), (rhs,)), float32 result (exact float32 for float32 inputs).

    The precision is explicit: Mosaic rejects fp32 contract precision on bf16 operands, which
    JAX_DEFAULT_MATMUL_PRECISION=highest (the tests' setting) would otherwise ask for."""
    precision = lax.Precision.HIGHEST if a.dtype == jnp.float32 else lax.Precision.DEFAULT
    return lax.dot_general(a, b, (contract, ((), ())), preferred_element_type=jnp.float32, precision=precision)


_NT = ((1,), (1,))   # a [m, d] . b [n, d] -> [m, n]
_NN = ((1,), (0,))   # a [m, k] . b [k, n] -> [m, n]
_TN = ((0,), (0,))   # a [k, m] . b [k, n] -> [m, n]


def _scores(q_ref, k_ref, qseg_ref, kseg_ref, scale):
    """Masked logits [block_q, block_k] in float32 and the mask."""
    s = _dot(q_ref[...], k_ref[...], _NT) * scale
    mask = qseg_ref[...][:, :1] == kseg_ref[...][:1, :]
    return jnp.where(mask, s, MASK_VALUE)


def _block_keep(seed_ref, batch_index, head_index, q_block, k_block, shape, threshold):
    """The keep mask of one [block_q, block_k] block; seed_ref holds (seed, batch offset, head offset): the
    offsets of this call's batch and heads in the global arrays (non-zero inside a shard_map)."""
    mult, add = _stream_key(seed_ref[0], batch_index + seed_ref[1], head_index + seed_ref[2])
    rows = lax.broadcasted_iota(jnp.int32, shape, 0) + q_block * shape[0]
    cols = lax.broadcasted_iota(jnp.int32, shape, 1) + k_block * shape[1]
    return _keep(rows, cols, mult, add, threshold)


def _fwd_kernel(seed_ref, q_ref, k_ref, v_ref, qseg_ref, kseg_ref, o_ref, lse_ref, m_sc, l_sc, acc_sc, *,
                scale, threshold, inv_keep):
    b, h, qi, ki = (pl.program_id(i) for i in range(4))

    @pl.when(ki == 0)
    def _init():
        m_sc[...] = jnp.full(m_sc.shape, -jnp.inf, jnp.float32)
        l_sc[...] = jnp.zeros(l_sc.shape, jnp.float32)
        acc_sc[...] = jnp.zeros(acc_sc.shape, jnp.float32)

    s = _scores(q_ref, k_ref, qseg_ref, kseg_ref, scale)
    m_prev, l_prev = m_sc[...][:, :1], l_sc[...][:, :1]
    m_new = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
    p = jnp.exp(s - m_new)                       # undropped: the softmax statistics see every key
    alpha = jnp.exp(m_prev - m_new)
    l_new = alpha * l_prev + jnp.sum(p, axis=1, keepdims=True)
    if threshold is not None:
        p = jnp.where(_block_keep(seed_ref, b, h, qi, ki, s.shape, threshold), p, 0.0)
    v = v_ref[...]
    acc_sc[...] = alpha * acc_sc[...] + _dot(p.astype(v.dtype), v, _NN)
    m_sc[...] = jnp.broadcast_to(m_new, m_sc.shape)
    l_sc[...] = jnp.broadcast_to(l_new, l_sc.shape)

    @pl.when(ki == pl.num_programs(3) - 1)
    def _finish():
        m, l = m_sc[...][:, :1], l_sc[...][:, :1]
        o_ref[...] = (acc_sc[...] * (inv_keep / l)).astype(o_ref.dtype)
        lse_ref[...] = jnp.broadcast_to(m + jnp.log(l), lse_ref.shape)


def _probs_and_dscores(seed_ref, b, h, qi, ki, q_ref, k_ref, v_ref, qseg_ref, kseg_ref, lse_ref, di_ref, do_ref, *,
                       scale, threshold, inv_keep):
    """The backward's recomputation for one block: dropped, scaled probabilities P*Z and dS (both [bq, bk])."""
    s = _scores(q_ref, k_ref, qseg_ref, kseg_ref, scale)
    p = jnp.exp(s - lse_ref[...][:, :1])
    dp = _dot(do_ref[...], v_ref[...], _NT)      # d(P*Z) = dO V^T
    if threshold is None:
        pz = p
    else:
        keep = _block_keep(seed_ref, b, h, qi, ki, s.shape, threshold)
        pz = jnp.where(keep, p * inv_keep, 0.0)
        dp = jnp.where(keep, dp * inv_keep, 0.0)
    ds = p * (dp - di_ref[...][:, :1])
    return pz, ds


def _dq_kernel(seed_ref, q_ref, k_ref, v_ref, qseg_ref, kseg_ref, lse_ref, di_ref, do_ref, dq_ref, dq_sc, *,
               scale, threshold, inv_keep):
    b, h, qi, ki = (pl.program_id(i) for i in range(4))

    @pl.when(ki == 0)
    def _init():
        dq_sc[...] = jnp.zeros(dq_sc.shape, jnp.float32)

    _, ds = _probs_and_dscores(seed_ref, b, h, qi, ki, q_ref, k_ref, v_ref, qseg_ref, kseg_ref, lse_ref, di_ref,
                               do_ref, scale=scale, threshold=threshold, inv_keep=inv_keep)
    k = k_ref[...]
    dq_sc[...] += _dot(ds.astype(k.dtype), k, _NN)

    @pl.when(ki == pl.num_programs(3) - 1)
    def _finish():
        dq_ref[...] = (dq_sc[...] * scale).astype(dq_ref.dtype)


def _dkv_kernel(seed_ref, q_ref, k_ref, v_ref, qseg_ref, kseg_ref, lse_ref, di_ref, do_ref, dk_ref, dv_ref,
                dk_sc, dv_sc, *, scale, threshold, inv_keep):
    b, h, ki, qi = (pl.program_id(i) for i in range(4))   # key blocks outer, query blocks inner (reduced)

    @pl.when(qi == 0)
    def _init():
        dk_sc[...] = jnp.zeros(dk_sc.shape, jnp.float32)
        dv_sc[...] = jnp.zeros(dv_sc.shape, jnp.float32)

    pz, ds = _probs_and_dscores(seed_ref, b, h, qi, ki, q_ref, k_ref, v_ref, qseg_ref, kseg_ref, lse_ref, di_ref,
                                do_ref, scale=scale, threshold=threshold, inv_keep=inv_keep)
    do, q = do_ref[...], q_ref[...]
    dv_sc[...] += _dot(pz.astype(do.dtype), do, _TN)
    dk_sc[...] += _dot(ds.astype(q.dtype), q, _TN)

    @pl.when(qi == pl.num_programs(3) - 1)
    def _finish():
        dk_ref[...] = (dk_sc[...] * scale).astype(dk_ref.dtype)
        dv_ref[...] = dv_sc[...].astype(dv_ref.dtype)


# ----------------------------------------------------------------------------------------------------------------
# pallas_calls. Arrays: q/k/v/o [B, H, S, D]; qseg [B, S, LANES]; kseg [B, SUBLANES, S]; lse/di [B, H, S, LANES].

def _nbytes(*arrays) -> int:
    return sum(math.prod(a.shape) * jnp.dtype(a.dtype).itemsize for a in arrays)


def _cost(*, pairs, matmuls, head_dim, vpu_ops, threshold, exps, streamed_once, streamed_per_q_block,
          streamed_per_k_block, n_q_blocks, n_k_blocks) -> pl.CostEstimate:
    """Roofline figures of one kernel: `matmuls` [bq,bk,D] products (2*D flops per pair each), `vpu_ops` float ops
    per pair, the hash's integer ops when dropout is on (counted as flops: they occupy the same VPU slots), `exps`
    exponentials per pair; bytes: blocks read once, re-read for every query block (e.g. K, V in the forward), or
    re-read for every key block."""
    hash_ops = HASH_OPS_PER_ELEMENT if threshold is not None else 0
    flops = pairs * (2 * head_dim * matmuls + vpu_ops + hash_ops)
    bytes_accessed = (_nbytes(*streamed_once) + n_q_blocks * _nbytes(*streamed_per_q_block)
                      + n_k_blocks * _nbytes(*streamed_per_k_block))
    return pl.CostEstimate(flops=int(flops), transcendentals=int(exps * pairs), bytes_accessed=int(bytes_accessed))


def _specs(block_q, block_k, head_dim, q_axis: int, k_axis: int):
    """BlockSpecs indexed by grid (b, h, *) with the query block index at grid axis `q_axis`, key at `k_axis`."""
    def q_rows(*g):
        return g[0], g[1], g[q_axis], 0

    def k_rows(*g):
        return g[0], g[1], g[k_axis], 0

    q_spec = pl.BlockSpec((None, None, block_q, head_dim), q_rows)
    k_spec = pl.BlockSpec((None, None, block_k, head_dim), k_rows)
    row_stat = pl.BlockSpec((None, None, block_q, LANES), q_rows)
    qseg = pl.BlockSpec((None, block_q, LANES), lambda *g: (g[0], g[q_axis], 0))
    kseg = pl.BlockSpec((None, SUBLANES, block_k), lambda *g: (g[0], 0, g[k_axis]))
    return q_spec, k_spec, row_stat, qseg, kseg


def _grid_spec(grid, in_specs, out_specs, scratch):
    # The seed is prefetched to SMEM; index maps and kernels receive its ref after the grid indices.
    wrap = lambda spec: pl.BlockSpec(spec.block_shape, lambda *g: spec.index_map(*g[:4]))
    return pltpu.PrefetchScalarGridSpec(num_scalar_prefetch=1, grid=grid, in_specs=[wrap(s) for s in in_specs],
                                        out_specs=[wrap(s) for s in out_specs], scratch_shapes=scratch)


def _segment_layouts(segment_ids, length):
    batch = segment_ids.shape[0]
    qseg = lax.broadcast_in_dim(segment_ids, (batch, length, LANES), (0, 1))
    kseg = lax.broadcast_in_dim(segment_ids, (batch, SUBLANES, length), (0, 2))
    return qseg, kseg


def _kernel_args(rate):
    if rate == 0.0:
        return dict(threshold=None, inv_keep=1.0)
    return dict(threshold=keep_threshold(rate), inv_keep=1.0 / (1.0 - rate))


def _forward(q, k, v, segment_ids, seed, rate, block_q, block_k):
    batch, heads, length, head_dim = q.shape
    nq, nk = length // block_q, length // block_k
    qseg, kseg = _segment_layouts(segment_ids, length)
    q_spec, k_spec, row_stat, qseg_spec, kseg_spec = _specs(block_q, block_k, head_dim, q_axis=2, k_axis=3)
    kwargs = _kernel_args(rate)
    out_shape = (jax.ShapeDtypeStruct(q.shape, q.dtype),
                 jax.ShapeDtypeStruct((batch, heads, length, LANES), jnp.float32))
    cost = _cost(pairs=batch * heads * length * length, matmuls=2, head_dim=head_dim, vpu_ops=_FWD_VPU_OPS,
                 threshold=kwargs["threshold"], exps=1, streamed_once=(q, *out_shape), streamed_per_q_block=(k, v),
                 streamed_per_k_block=(), n_q_blocks=nq, n_k_blocks=nk)
    cost = pl.CostEstimate(flops=cost.flops, transcendentals=cost.transcendentals,
                           bytes_accessed=cost.bytes_accessed + heads * (_nbytes(qseg) + nq * _nbytes(kseg)))
    o, lse = pl.pallas_call(
        functools.partial(_fwd_kernel, scale=1.0 / math.sqrt(head_dim), **kwargs),
        grid_spec=_grid_spec(
            (batch, heads, nq, nk), [q_spec, k_spec, k_spec, qseg_spec, kseg_spec], [q_spec, row_stat],
            [pltpu.VMEM((block_q, LANES), jnp.float32), pltpu.VMEM((block_q, LANES), jnp.float32),
             pltpu.VMEM((block_q, head_dim), jnp.float32)]),
        out_shape=out_shape,
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "parallel", "arbitrary")),
        cost_estimate=cost,
        name="flash_dropout_fwd",
    )(seed, q, k, v, qseg, kseg)
    return o, lse[..., 0]


def _backward(q, k, v, segment_ids, seed, o, lse, do, rate, block_q, block_k):
    batch, heads, length, head_dim = q.shape
    nq, nk = length // block_q, length // block_k
    qseg, kseg = _segment_layouts(segment_ids, length)
    di = jnp.sum(do.astype(jnp.float32) * o.astype(jnp.float32), axis=-1)
    lse = jnp.broadcast_to(lse[..., None], (*lse.shape, LANES))
    di = jnp.broadcast_to(di[..., None], (*di.shape, LANES))
    kwargs = _kernel_args(rate)
    scale = 1.0 / math.sqrt(head_dim)
    pairs = batch * heads * length * length
    seg_bytes = heads * (_nbytes(qseg) + _nbytes(kseg))

    q_spec, k_spec, row_stat, qseg_spec, kseg_spec = _specs(block_q, block_k, head_dim, q_axis=2, k_axis=3)
    cost = _cost(pairs=pairs, matmuls=3, head_dim=head_dim, vpu_ops=_DQ_VPU_OPS, threshold=kwargs["threshold"],
                 exps=1, streamed_once=(q, lse, di, do, q), streamed_per_q_block=(k, v), streamed_per_k_block=(),
                 n_q_blocks=nq, n_k_blocks=nk)
    dq = pl.pallas_call(
        functools.partial(_dq_kernel, scale=scale, **kwargs),
        grid_spec=_grid_spec(
            (batch, heads, nq, nk),
            [q_spec, k_spec, k_spec, qseg_spec, kseg_spec, row_stat, row_stat, q_spec], [q_spec],
            [pltpu.VMEM((block_q, head_dim), jnp.float32)]),
        out_shape=[jax.ShapeDtypeStruct(q.shape, q.dtype)],
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "parallel", "arbitrary")),
        cost_estimate=pl.CostEstimate(flops=cost.flops, transcendentals=cost.transcendentals,
                                      bytes_accessed=cost.bytes_accessed + nq * seg_bytes),
        name="flash_dropout_dq",
    )(seed, q, k, v, qseg, kseg, lse, di, do)[0]

    q_spec, k_spec, row_stat, qseg_spec, kseg_spec = _specs(block_q, block_k, head_dim, q_axis=3, k_axis=2)
    cost = _cost(pairs=pairs, matmuls=4, head_dim=head_dim, vpu_ops=_DKV_VPU_OPS, threshold=kwargs["threshold"],
                 exps=1, streamed_once=(k, v, k, v), streamed_per_q_block=(),
                 streamed_per_k_block=(q, lse, di, do), n_q_blocks=nq, n_k_blocks=nk)
    dk, dv = pl.pallas_call(
        functools.partial(_dkv_kernel, scale=scale, **kwargs),
        grid_spec=_grid_spec(
            (batch, heads, nk, nq),
            [q_spec, k_spec, k_spec, qseg_spec, kseg_spec, row_stat, row_stat, q_spec], [k_spec, k_spec],
            [pltpu.VMEM((block_k, head_dim), jnp.float32), pltpu.VMEM((block_k, head_dim), jnp.float32)]),
        out_shape=[jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)],
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "parallel", "arbitrary")),
        cost_estimate=pl.CostEstimate(flops=cost.flops, transcendentals=cost.transcendentals,
                                      bytes_accessed=cost.bytes_accessed + nk * seg_bytes),
        name="flash_dropout_dkv",
    )(seed, q, k, v, qseg, kseg, lse, di, do)
    return dq, dk, dv


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7))
def _attention(q, k, v, segment_ids, seed, rate, block_q, block_k):
    return _forward(q, k, v, segment_ids, seed, rate, block_q, block_k)[0]


def _attention_fwd(q, k, v, segment_ids, seed, rate, block_q, block_k):
    o, lse = _forward(q, k, v, segment_ids, seed, rate, block_q, block_k)
    return o, (q, k, v, segment_ids, seed, o, lse)


def _attention_bwd(rate, block_q, block_k, residuals, do):
    q, k, v, segment_ids, seed, o, lse = residuals
    dq, dk, dv = _backward(q, k, v, segment_ids, seed, o, lse, do, rate, block_q, block_k)
    return dq, dk, dv, None, None


_attention.defvjp(_attention_fwd, _attention_bwd)


def flash_attention_with_dropout(query, key, value, segment_ids, *, dropout_rate: float, seed, block_q: int = 128,
                                 block_k: int = 128, batch_offset=0, head_offset=0):
    """dropout(softmax(q k^T / sqrt(d) + mask)) v, fused; q/k/v [batch, length, heads, head_dim].

    segment_ids [batch, length] int32: 0 = padding; a query attends to the keys with its id (so padding attends to
    padding and every row has a key). dropout_rate: static, in [0, 1); 0 = no dropout (the hash is not even
    computed). seed: uint32/int32 scalar, or a jax PRNG key (turned into a uint32 by `seed_from_rng`). The keep
    mask is `dropout_keep_mask(seed, batch, heads, length, length, dropout_rate)`. The length is padded (with
    segment id 0) to a multiple of the blocks. Output in query's dtype; softmax statistics in float32.
    batch_offset/head_offset (int or traced int32): the global index of this call's first example and head, for a
    call on one shard inside a shard_map, so that the mask is that of the global arrays whatever the sharding.
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
    to_bhsd = lambda x: jnp.swapaxes(x, 1, 2)
    # Scalar-prefetched to SMEM: the seed's bits and the global index of this call's first example and head.
    scalars = jnp.concatenate([_seed_word(seed), jnp.asarray(batch_offset, jnp.int32).reshape(1),
                               jnp.asarray(head_offset, jnp.int32).reshape(1)])
    out = _attention(to_bhsd(query), to_bhsd(key), to_bhsd(value), segment_ids, scalars, dropout_rate,
                     block_q, block_k)
    return to_bhsd(out)[:, :length]
