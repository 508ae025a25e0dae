"""Scaled dot-product attention behind one function, with interchangeable backends.

All backends take query/key/value as [batch, length, heads, head_dim] and the same masks:
- `input_mask` [batch, length]: 1 for real tokens, 0 for padding (keys that are padding are never attended);
- `packing_ids` [batch, length] (optional): ids of the sequences packed into one row; a token attends only to
  tokens with the same id. (Not BERT's token-type "segment_ids", which only select an embedding.)
- `window` (optional, an int): a sliding window, a query attends only to keys at most `window` positions away
  (ModernBERT's local layers, HF's inclusive `sliding_window`); with packing, positions inside a row.
A query row whose keys are all masked (a padding position) gives a finite, ignorable output, never NaN.

Backends:
- "reference": einsum + float32 softmax in plain JAX; supports attention dropout. The definition the others are
  tested against.
- "chunked": the reference's values (no dropout) a block of queries at a time against only the keys they may see,
  with flash attention's backward (`chunked_attention.py`): memory linear in the length with a window (and the
  band's FLOPs only), a block x length of scores without. What a CPU runs from CHUNKED_MIN_LENGTH tokens.
- "dot_product": `jax.nn.dot_product_attention`, which dispatches to cuDNN's fused flash attention on GPU when
  the shapes/dtypes allow and to XLA otherwise.
- "cudnn": the same call forcing the cuDNN implementation (GPU, bf16/fp16 only).
- "pallas_tpu": the Pallas TPU flash-attention kernel (jax.experimental.pallas.ops.tpu.flash_attention).
- "splash_tpu": the Pallas TPU splash-attention kernel (block-sparse; what MaxText uses on TPU); a window as its local
  mask.
- "flash_dropout_tpu": bertjax's own Pallas TPU flash attention with attention-probability dropout
  (`dropout_attention.py`): the keep mask is a hash of (seed, batch, head, query, key) recomputed in the
  backward, never stored. Its seed is a uint32 drawn from `dropout_rng`, so the same key gives the same mask.
- "flash_dropout_gpu": the same on GPU, a Pallas kernel lowered through Triton (`dropout_attention_gpu.py`), with
  the TPU kernel's mask bit for bit; interpreted off GPU.
- "auto": without attention dropout splash on TPU, dot_product on GPU, reference on CPU (chunked from
  CHUNKED_MIN_LENGTH tokens); with it the platform's flash_dropout_* from FUSED_DROPOUT_MIN_LENGTH tokens and the
  reference otherwise (with a window, whose masks the dropout kernels do not take: the reference). The platform is
  the one the program is compiled for (the active mesh's), not the machine tracing it, so `bertjax compile` on a
  CPU compiles what the TPU would run.
The other fused backends and chunked have no attention-probability dropout; asking for one of them explicitly while
attention dropout is active is an error (dropout is part of BERT's definition).
Pallas kernels (Mosaic, Triton) cannot be partitioned by XLA: on a mesh they run per device (`per_device_shard`).
"""
from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec

from bertjax import sharding
from bertjax.model import gpu_kernels
from bertjax.model.chunked_attention import chunked_attention
from bertjax.model.dropout import dropout
from bertjax.sharding import target_platform

# The backends without attention-probability dropout.
NO_DROPOUT_BACKENDS = ("dot_product", "cudnn", "pallas_tpu", "splash_tpu", "chunked")

# From this length up, `auto` on a CPU (without attention dropout) runs the chunked backend: the reference's
# [batch, heads, S, S] scores, kept for the backward, grow with the square of the length (at 1024 tokens a layer of
# 12 heads holds 50 MB an example; ModernBERT-base's 22 layers at 8192 tokens ~70 GB). One attention's forward and
# backward (12 heads of 64, batch 16; a busy machine, load 16) at 512 tokens: 2.1 vs 4.3 s and 0.81 vs 1.57 GB peak
# with a window of 64 each side, 3.9 vs 5.2 s and 1.05 vs 1.71 GB without; at 1024, 4.1 vs 18.6 s and 20.9 vs 24.5 s.
CHUNKED_MIN_LENGTH = 512


# From this length up, `auto` runs attention dropout in the fused TPU kernel. XLA:TPU's estimates (BERT-base on v5e,
# bf16, 16 sequences per chip, 2 layers): at seq 128 the kernel wins (4.78 vs 4.89 ms) since it reads and writes
# q/k/v and the output in the projections' own [batch, S, heads * 64] layout; in the [batch, heads, S, 64] layout it
# had lost there (5.00 ms: the projections' dots writing and reading the transposed layout cost more than the
# kernel saved). Shorter lengths are unmeasured (padded to the kernel's 128-token blocks). On GPU the same bound:
# the reference writes and reads its [B, H, S, S] scores and mask in HBM (BERT-base at seq 128 on one H200: 28.7%
# MFU with attention dropout on); the GPU kernel is not yet timed against it.
FUSED_DROPOUT_MIN_LENGTH = 128
FUSED_DROPOUT_BACKENDS = {"tpu": "flash_dropout_tpu", "gpu": "flash_dropout_gpu"}


# The backends that take a sliding window: the reference and dot_product in the mask they build, chunked in its
# blocks' bands, splash as its
# block-sparse local mask, our TPU kernel in its index maps and block mask (blocks outside every window are skipped,
# not computed and masked).
WINDOW_BACKENDS = ("reference", "chunked", "dot_product", "splash_tpu", "flash_dropout_tpu", "flash_dropout_gpu")


def resolve_backend(backend: str, dropout_active: bool, platform: str | None = None, length: int = 0,
                    windowed: bool = False) -> str:
    """The concrete backend for `backend` on the target platform (`auto` picks by platform and, with attention
    dropout, by the sequence length; with a sliding window, among the backends that take one)."""
    platform = platform or target_platform()
    if platform == "gpu" and not gpu_kernels.runs_kernel("attention"):
        # Our kernel disagreed with XLA on this card (gpu_kernel_check.py): XLA's reference, asked for or not.
        if backend == "flash_dropout_gpu" or backend == "auto" and dropout_active and not windowed:
            return "reference"
    if windowed:
        if backend == "auto":
            if platform in FUSED_DROPOUT_BACKENDS and length >= FUSED_DROPOUT_MIN_LENGTH:
                return FUSED_DROPOUT_BACKENDS[platform]
            if platform == "cpu" and not dropout_active and length >= CHUNKED_MIN_LENGTH:
                return "chunked"
            if dropout_active or platform == "cpu":
                return "reference"
            return {"tpu": "splash_tpu", "gpu": "dot_product"}.get(platform, "reference")
        if backend not in WINDOW_BACKENDS:
            raise ValueError(f"attention backend {backend!r} has no sliding window; use attention_backend 'auto', "
                             f"{' or '.join(repr(b) for b in WINDOW_BACKENDS)}")
        if backend in NO_DROPOUT_BACKENDS and dropout_active:
            raise ValueError(f"attention backend {backend!r} has no attention dropout; set attention_dropout=0 "
                             "or use attention_backend 'auto' or 'reference'")
        return backend
    if backend == "auto":
        if dropout_active:
            fused = FUSED_DROPOUT_BACKENDS.get(platform)
            return fused if fused and length >= FUSED_DROPOUT_MIN_LENGTH else "reference"
        if platform == "cpu" and length >= CHUNKED_MIN_LENGTH:
            return "chunked"
        return {"tpu": "splash_tpu", "gpu": "dot_product"}.get(platform, "reference")
    if backend in NO_DROPOUT_BACKENDS and dropout_active:
        raise ValueError(f"attention backend {backend!r} has no attention dropout; set "
                         "attention_probs_dropout_prob=0 or use attention_backend 'auto' or 'reference'")
    return backend


def dot_product_attention(query, key, value, input_mask, packing_ids=None, *, backend: str = "auto",
                          dropout_rate: float = 0.0, dropout_rng=None, deterministic: bool = True, biases=None,
                          window: int | None = None):
    """Attention output [batch, length, heads, head_dim] in the dtype of `query`.

    `biases`: optional (query, key, value) biases [heads, head_dim] (the projections'), added to query/key/value in
    their dtype first; the fused dropout kernels add them themselves and sum their gradients in their own kernels.

    The Pallas TPU backends run off-TPU (tests on CPU) inside `jax.experimental.pallas.tpu
    .force_tpu_interpret_mode()`, which must enclose the tracing of the backward pass too; the GPU kernel runs
    interpreted wherever the target platform is not a GPU.
    """
    dropout_active = not deterministic and dropout_rate > 0.0
    backend = resolve_backend(backend, dropout_active, length=query.shape[1], windowed=window is not None)
    if biases is not None and backend not in FUSED_DROPOUT_BACKENDS.values():
        query, key, value = (x + b.astype(x.dtype) for x, b in zip((query, key, value), biases))
    if backend == "chunked":
        return chunked_attention(query, key, value, input_mask, packing_ids, window=window)
    if backend == "reference":
        return reference_attention(query, key, value, input_mask, packing_ids, dropout_rate=dropout_rate,
                                   dropout_rng=dropout_rng, deterministic=deterministic, window=window)
    if backend in ("dot_product", "cudnn"):
        mask = attention_mask(input_mask, packing_ids, window)[:, None, :, :]
        return jax.nn.dot_product_attention(
            query, key, value, mask=mask, implementation="cudnn" if backend == "cudnn" else None)
    segment_ids = _kernel_segment_ids(input_mask, packing_ids)
    if backend in FUSED_DROPOUT_BACKENDS.values():
        from bertjax.model.dropout_attention import seed_from_rng

        rate = dropout_rate if dropout_active else 0.0
        seed = seed_from_rng(dropout_rng) if rate > 0.0 else jnp.uint32(0)
        if backend == "flash_dropout_gpu":
            return per_device_shard(functools.partial(_flash_dropout_gpu_attention, dropout_rate=rate, window=window),
                                    query, key, value, segment_ids, seed, biases=biases)
        if biases is not None:   # per example, split with the batch and heads
            biases = tuple(jnp.broadcast_to(b, (query.shape[0], *b.shape)) for b in biases)
        return per_device_shard(functools.partial(_flash_dropout_attention, dropout_rate=rate, window=window), query,
                                key, value, segment_ids, seed, biases=biases)
    if backend in ("pallas_tpu", "splash_tpu"):
        kernel = _pallas_flash_attention if backend == "pallas_tpu" else functools.partial(_splash_attention,
                                                                                           window=window)
        return per_device_shard(kernel, query, key, value, segment_ids)
    raise ValueError(f"unknown attention backend {backend!r}")


def per_device_shard(kernel, query, key, value, segment_ids, *replicated, biases=None, rotary=None):
    """`kernel(query, key, value, segment_ids, *replicated, batch_offset=, head_offset=)` run on each device's
    shard of a multi-device mesh: XLA cannot partition a Mosaic (Pallas TPU) kernel, so the batch is split over
    the activation_batch axes and the heads over activation_heads by the logical-axis rules in force, and each
    device runs the kernel on its part; the offsets say where that part starts in the whole batch and heads.
    `key` and `value` None: `query` is q/k/v stacked, [batch, length, 3, heads, head_dim] (split alike).
    `biases` (optional, [batch, heads, head_dim] or [heads, head_dim] each) are split like the batch and heads
    and passed on as `biases=` (only where given); [heads, head_dim] ones are replicated over the batch's devices
    (their gradients summed over them by shard_map's transpose). `rotary` (optional, (cos, sin) [batch, length,
    head_dim]) is split like the batch and passed on as `rotary=`."""
    arrays = tuple(x for x in (query, key, value) if x is not None)
    extras = {name: tuple(values) for name, values in (("biases", biases), ("rotary", rotary)) if values is not None}

    def call(arrays, segment_ids, replicated, extras, **offsets):
        return kernel(*arrays, *(None,) * (3 - len(arrays)), segment_ids, *replicated, **extras, **offsets)

    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or mesh.size == 1:
        return call(arrays, segment_ids, replicated, extras, batch_offset=0, head_offset=0)
    qkv = nn.logical_to_mesh_axes(("activation_batch", "activation_length", "activation_heads", "activation_kv"))
    ids = nn.logical_to_mesh_axes(("activation_batch", "activation_length"))
    array_spec = qkv if len(arrays) == 3 else PartitionSpec(qkv[0], qkv[1], None, qkv[2], qkv[3])
    extra_specs = {"biases": lambda b: PartitionSpec(*(qkv[0],)[:b.ndim - 2], qkv[2], qkv[3]),
                   "rotary": lambda _: PartitionSpec(ids[0], ids[1], None)}
    specs = ((array_spec,) * len(arrays), ids, (PartitionSpec(),) * len(replicated),
             {name: tuple(extra_specs[name](x) for x in values) for name, values in extras.items()})
    heads_axes = qkv[2]
    # Over the axes not already manual (inside the train step's shard_map over data: fsdp and tensor, even of
    # size 1: a Mosaic call anywhere an axis is automatic is refused).
    free = {name for name in mesh.axis_names if name not in mesh.manual_axes}
    if not free:
        return call(arrays, segment_ids, replicated, extras,
                    batch_offset=sharding.manual_batch_offset(query.shape[0]), head_offset=0)

    def local(arrays, *rest):
        heads = arrays[0].shape[-2]
        return call(arrays, *rest, batch_offset=sharding.manual_batch_offset(arrays[0].shape[0]),
                    head_offset=0 if heads_axes is None else lax.axis_index(heads_axes) * heads)

    return jax.shard_map(local, in_specs=specs, out_specs=qkv, axis_names=free, check_vma=False)(
        arrays, segment_ids, replicated, extras)


def attention_mask(input_mask, packing_ids=None, window: int | None = None):
    """Boolean [batch, q_len, kv_len]: True where a query may attend to a key (a real key, of the query's packed
    sequence, within `window` positions of it)."""
    mask = jnp.broadcast_to(input_mask[:, None, :].astype(bool),
                            (input_mask.shape[0], input_mask.shape[1], input_mask.shape[1]))
    if packing_ids is not None:
        mask = mask & (packing_ids[:, :, None] == packing_ids[:, None, :])
    if window is not None:
        positions = np.arange(input_mask.shape[1])
        mask = mask & jnp.asarray(np.abs(positions[:, None] - positions[None, :]) <= window)[None]
    return mask


def reference_attention(query, key, value, input_mask, packing_ids=None, *, dropout_rate: float = 0.0,
                        dropout_rng=None, deterministic: bool = True, keep_mask=None, window: int | None = None):
    """softmax(q k^T / sqrt(d) + mask) v with float32 logits/softmax, as BERT defines it.

    `keep_mask` (bool [batch, heads, q_len, kv_len], with dropout active): use this dropout mask (kept
    probabilities scaled by 1 / (1 - dropout_rate)) instead of drawing one from `dropout_rng`; tests compare the
    fused dropout kernel against it with the kernel's own mask.
    """
    head_dim = query.shape[-1]
    logits = jnp.einsum("bqhd,bkhd->bhqk", query, key, preferred_element_type=jnp.float32)
    logits = logits / np.sqrt(head_dim).astype(np.float32)
    mask = attention_mask(input_mask, packing_ids, window)[:, None, :, :]
    # A large finite negative (not -inf), so that a fully masked row softmaxes to uniform instead of NaN.
    logits = jnp.where(mask, logits, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(logits, axis=-1)
    if not deterministic and dropout_rate > 0.0:
        if keep_mask is None:
            probs = dropout(probs, dropout_rate, dropout_rng)
        else:
            probs = jnp.where(keep_mask, probs / (1.0 - dropout_rate), 0.0)
    return jnp.einsum("bhqk,bkhd->bqhd", probs.astype(value.dtype), value)


def _kernel_segment_ids(input_mask, packing_ids):
    """Segment ids for the Pallas kernels: padding gets id 0, real tokens their packing id + 1.

    Folding padding into segment ids keeps every query row non-empty (padding attends to padding), which the
    kernels require, and real tokens never see padding.
    """
    ids = jnp.ones_like(input_mask, dtype=jnp.int32) if packing_ids is None else packing_ids.astype(jnp.int32) + 1
    return jnp.where(input_mask.astype(bool), ids, 0)


KERNEL_BLOCK = 128  # the TPU kernels tile the sequence in blocks of 128 (the lane width)


def _pad_to_block(query, key, value, segment_ids, *more):
    """Pads the length axis (1) to a multiple of KERNEL_BLOCK (of each array given, None kept); padding gets
    segment id 0, like other padding. (query, key, value, segment_ids, *more, length)."""
    length = query.shape[1]
    extra = -length % KERNEL_BLOCK
    pad = lambda x: x if x is None or not extra else jnp.pad(x, [(0, 0), (0, extra)] + [(0, 0)] * (x.ndim - 2))
    return (*(pad(x) for x in (query, key, value, segment_ids, *more)), length)


def _pallas_flash_attention(query, key, value, segment_ids, batch_offset, head_offset):
    from jax.experimental.pallas.ops.tpu import flash_attention as flash

    head_dim = query.shape[-1]
    query, key, value, segment_ids, length = _pad_to_block(query, key, value, segment_ids)
    block = KERNEL_BLOCK
    block_sizes = flash.BlockSizes(
        block_q=block, block_k_major=block, block_k=block, block_b=1,
        block_q_major_dkv=block, block_k_major_dkv=block, block_k_dkv=block, block_q_dkv=block,
        block_k_major_dq=block, block_k_dq=block, block_q_dq=block)
    to_bhld = lambda x: jnp.swapaxes(x, 1, 2)
    out = flash.flash_attention(
        to_bhld(query), to_bhld(key), to_bhld(value),
        segment_ids=flash.SegmentIds(q=segment_ids, kv=segment_ids), causal=False,
        sm_scale=float(1.0 / np.sqrt(head_dim)), block_sizes=block_sizes)
    return to_bhld(out)[:, :length]


def _splash_attention(query, key, value, segment_ids, batch_offset, head_offset, window: int | None = None):
    from jax.experimental.pallas.ops.tpu.splash_attention import (
        splash_attention_kernel as splash,
    )
    from jax.experimental.pallas.ops.tpu.splash_attention import (
        splash_attention_mask as splash_mask,
    )

    heads, head_dim = query.shape[2], query.shape[3]
    query, key, value, segment_ids, length = _pad_to_block(query, key, value, segment_ids)
    padded_length, block = query.shape[1], KERNEL_BLOCK
    block_sizes = splash.BlockSizes(block_q=block, block_kv=block, block_kv_compute=block, block_q_dkv=block,
                                    block_kv_dkv=block, block_kv_dkv_compute=block, block_q_dq=block,
                                    block_kv_dq=block)
    shape = (padded_length, padded_length)
    # A window: keys at most `window` positions from the query, both sides (ModernBERT's local layers); the kernel
    # skips the blocks outside it.
    head_mask = (splash_mask.FullMask(shape) if window is None else
                 splash_mask.LocalMask(shape, window_size=(window, window), offset=0))
    mask = splash_mask.MultiHeadMask([head_mask for _ in range(heads)])
    kernel = splash.make_splash_mha(mask, block_sizes=block_sizes, head_shards=1, q_seq_shards=1)
    # Splash does not scale the logits; BERT divides them by sqrt(head_dim).
    query = query / jnp.asarray(np.sqrt(head_dim), query.dtype)
    to_hld = lambda x: jnp.swapaxes(x, 0, 1)  # per example: [length, heads, d] -> [heads, length, d]

    def one_example(q, k, v, ids):
        out = kernel(to_hld(q), to_hld(k), to_hld(v), segment_ids=splash.SegmentIds(q=ids, kv=ids))
        return to_hld(out)

    if target_platform() == "tpu":
        out = jax.vmap(one_example)(query, key, value, segment_ids)
    else:
        # Interpret mode (tests off TPU) cannot batch the kernel's grid under vmap: loop over examples.
        out = jax.lax.map(lambda args: one_example(*args), (query, key, value, segment_ids))
    return out[:, :length]


def _flash_dropout_attention(query, key, value, segment_ids, seed, *, dropout_rate, batch_offset, head_offset,
                             biases=None, window=None):
    from bertjax.model.dropout_attention import flash_attention_with_dropout

    # The kernel pads the length to its blocks itself (padding with segment id 0) and slices the output back. Its
    # held block (queries in the forward and dq kernels, keys in dk/dv) is the longest of 512, 256, 128 tokens that
    # divides the length padded to 128: the streamed blocks are re-read once per held block, so at seq 512 every
    # operand moves once. With a window the held block is 128: a longer one meets more streamed blocks.
    padded = query.shape[1] + -query.shape[1] % KERNEL_BLOCK
    held = KERNEL_BLOCK if window is not None else next(
        block for block in (4 * KERNEL_BLOCK, 2 * KERNEL_BLOCK, KERNEL_BLOCK) if padded % block == 0)
    return flash_attention_with_dropout(query, key, value, segment_ids, dropout_rate=dropout_rate, seed=seed,
                                        block_q=held, block_k=KERNEL_BLOCK, batch_offset=batch_offset,
                                        head_offset=head_offset, biases=biases, window=window)


def gpu_query_block(padded_length: int) -> int:
    """The GPU kernel's held query block at a padded length: 64 at 128 tokens (twice the programs: 6,144 for
    BERT-base's batch of 256 on an H100's 132 SMs), 128 from 256 tokens (the keys and values are re-read once per
    query block); keys are streamed in 64s and the backward runs in 64 x 64 blocks (its loops hold q, k, v, dO and
    two accumulators). Not yet timed on a GPU."""
    return 64 if padded_length == KERNEL_BLOCK else 128


def _flash_dropout_gpu_attention(query, key, value, segment_ids, seed, *, dropout_rate, batch_offset, head_offset,
                                 biases=None, window=None, rotary=None):
    """The GPU kernel on (query, key, value), or on q/k/v stacked in `query` (key and value None)."""
    from bertjax.model.dropout_attention_gpu import flash_attention_with_dropout

    query, key, value, segment_ids, *rotary, length = _pad_to_block(query, key, value, segment_ids, *(rotary or ()))
    block_q = gpu_query_block(query.shape[1])
    # The kernels add the biases to the pad rows too: those are keys of padding queries only (segment id 0), whose
    # outputs are ignorable; their cotangents (0 in the model) are what reach the biases' gradients from there.
    out = flash_attention_with_dropout(query, key, value, segment_ids, dropout_rate=dropout_rate, seed=seed,
                                       block_q=block_q, block_k=64, block_bwd=64, batch_offset=batch_offset,
                                       head_offset=head_offset, biases=biases,
                                       interpret=target_platform() != "gpu", window=window, rotary=rotary or None)
    return out[:, :length]


def stacked_gpu_attention(qkv, input_mask, packing_ids=None, *, rotary, dropout_rate: float = 0.0, dropout_rng=None,
                          deterministic: bool = True, biases=None, window: int | None = None):
    """Attention [batch, length, heads, head_dim] by the GPU kernel (backend "flash_dropout_gpu") on q/k/v stacked,
    qkv [batch, length, 3, heads, head_dim] (a fused projection's output, read where it lies; its gradient is one
    such array, which the projection's backward reads as it is), q and k rotated as the kernels load them:
    `rotary` (cos, sin) float32 [batch or 1, length, head_dim], `rope.apply_rotary`'s values. XLA had rotated q and
    k in a pass of its own and, in the backward, rotated their gradients back and stacked the three for the
    projection (on an H200 ~0.2 ms a ModernBERT-base layer and microbatch, priced)."""
    from bertjax.model.dropout_attention import seed_from_rng

    rate = dropout_rate if not deterministic and dropout_rate > 0.0 else 0.0
    seed = seed_from_rng(dropout_rng) if rate > 0.0 else jnp.uint32(0)
    batch, length, _, _, head_dim = qkv.shape
    rotary = tuple(jnp.broadcast_to(t.astype(jnp.float32), (batch, length, head_dim)) for t in rotary)
    return per_device_shard(functools.partial(_flash_dropout_gpu_attention, dropout_rate=rate, window=window), qkv,
                            None, None, _kernel_segment_ids(input_mask, packing_ids), seed, biases=biases,
                            rotary=rotary)
