"""The fused Pallas TPU attention with attention dropout (bertjax.dropout_attention): forward and gradients against
the reference attention with the kernel's own keep mask (interpret mode on CPU), the mask's statistics, and a
Mosaic compile for two TPU generations (compile-only devices)."""
import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from bertjax.model import dropout_attention as da
from bertjax.model.attention import dot_product_attention, reference_attention
from tests.kernel_references import _inputs, _reference, _segments, _value_and_grads


def _loss(attention, weights):
    return lambda q, k, v: jnp.sum(jnp.sin(attention(q, k, v)) * weights)


def _kernel_and_reference(q, k, v, segment_ids, rate, seed, window=None, **blocks):
    """(out, grads) of the kernel and of the reference with the kernel's mask; rows of padding are left out of the
    loss (their outputs are ignorable: the kernel's padding rows also see the block padding)."""
    batch, length, heads, _ = q.shape
    weights = (segment_ids != 0).astype(jnp.float32)[:, :, None, None]
    kernel = lambda q, k, v: da.flash_attention_with_dropout(q, k, v, segment_ids, dropout_rate=rate, seed=seed,
                                                             window=window, **blocks)
    mask = da.dropout_keep_mask(seed, batch, heads, length, length, rate) if rate else None
    reference = lambda q, k, v: _reference(q, k, v, segment_ids, mask, rate, window)
    with pltpu.force_tpu_interpret_mode():
        kernel_result = _value_and_grads(kernel, weights, q, k, v)
    return kernel_result, _value_and_grads(reference, weights, q, k, v)


def _assert_close(kernel, reference, segment_ids, tol=1e-5):
    (out, grads), (expected, expected_grads) = kernel, reference
    valid = np.asarray(segment_ids) != 0
    assert np.isfinite(np.asarray(out)).all()
    np.testing.assert_allclose(np.asarray(out)[valid], np.asarray(expected)[valid], rtol=tol, atol=tol)
    for grad, expected_grad in zip(grads, expected_grads):
        assert np.isfinite(np.asarray(grad)).all()
        np.testing.assert_allclose(np.asarray(grad), np.asarray(expected_grad), rtol=tol, atol=tol)


# Each case a branch of its own (interpret mode costs ~10 CPU-s a case): packed segments with dropout in one head's
# lanes and in pairs, one block and rate 0 are test_biases_..., test_rate_zero_... and the entry point's cases.
@pytest.mark.parametrize("length, batch, heads, head_dim, layout, blocks", [
    # 120 tokens padded to 128, in 2 x 4 blocks (interpret mode takes any block; Mosaic wants multiples of 128)
    (120, 2, 2, 16, "padding", dict(block_q=64, block_k=32)),
    (500, 1, 2, 8, "padding", {}),           # padded to 512: 4 x 4 default blocks of 128; 1/sqrt(8) in the kernels
    # heads of 64 in pairs: q/k/v/o in the projections' [B, S, H * 64] layout, two heads per 128-lane block
    (250, 1, 4, 64, "padding", {}),          # 2 blocks of 2 heads, padded to 256
    (128, 1, 3, 64, "packing", {"block_q": 64, "block_k": 64}),   # an odd head count: one head per block
])
def test_forward_and_gradients_equal_the_reference_with_the_kernels_mask(length, batch, heads, head_dim, layout,
                                                                        blocks):
    q, k, v = _inputs(batch, length, heads, head_dim)
    segment_ids = _segments(batch, length, layout)
    kernel, reference = _kernel_and_reference(q, k, v, segment_ids, 0.1, 2024, **blocks)
    _assert_close(kernel, reference, segment_ids)
    # The mask mattered: without dropout the output is another.
    out = kernel[0]
    no_dropout = _reference(q, k, v, segment_ids, None, 0.0)
    assert np.abs(np.asarray(out - no_dropout)).max() > 1e-2


def _pallas_grids(function, *args) -> dict:
    """{kernel name: grid} of the pallas_calls in the jaxpr of `function(*args)` (interpret mode)."""
    with pltpu.force_tpu_interpret_mode():
        jaxpr = jax.make_jaxpr(function)(*args).jaxpr
    return {str(eqn.params["name"]): tuple(eqn.params["grid_mapping"].grid) for eqn in _all_eqns(jaxpr)
            if eqn.primitive.name == "pallas_call"}


@pytest.mark.parametrize("length, heads, head_dim, layout, window, rate, blocks, width", [
    # ModernBERT's heads of 64 in pairs; 8 blocks of 32 with a window of 20: a held block meets 3 streamed ones
    # (2 at either end), the others are skipped, and the blocks met at their edge are cut
    (256, 2, 64, "packing", 20, 0.1, {"block_q": 32, "block_k": 32}, 3),
    # held and streamed blocks of other sizes: 4 held of 32 over 8 streamed of 16 (padded 120 -> 128)
    (120, 2, 16, "padding", 8, 0.0, {"block_q": 32, "block_k": 16}, 4),
])
def test_a_window_skips_the_blocks_outside_it_and_masks_the_rest(length, heads, head_dim, layout, window, rate,
                                                                 blocks, width):
    """A sliding window (ModernBERT's local layers): the kernel equals the windowed reference with its own mask,
    forward and gradients, packed or padded, and its grids step only through the blocks that meet the window
    (`width` streamed blocks a held block, not all of them: nothing fetched, computed or stepped over beyond)."""
    q, k, v = _inputs(1, length, heads, head_dim)
    segment_ids = _segments(1, length, layout)
    kernel, reference = _kernel_and_reference(q, k, v, segment_ids, rate, 7, window=window, **blocks)
    _assert_close(kernel, reference, segment_ids)
    full = _reference(q, k, v, segment_ids, None, 0.0)
    assert np.abs(np.asarray(kernel[0] - full)).max() > 1e-2   # the window mattered
    attend = lambda q, k, v: jnp.sum(da.flash_attention_with_dropout(q, k, v, segment_ids, dropout_rate=rate, seed=7,
                                                                     window=window, **blocks))
    padded = length + -length % max(blocks.values())
    held = padded // blocks["block_q"]
    pack = 2 if head_dim == 64 else 1
    assert _pallas_grids(jax.grad(attend, argnums=(0, 1, 2)), q, k, v) == {
        name: (1, heads // pack, held, width) for name in ("flash_dropout_fwd", "flash_dropout_dq", "flash_dropout_dkv")}
    assert width < padded // blocks["block_k"]
    # Held block 1 of 32 (queries 32..63) meets the keys 12..83 within 20: streamed blocks 0..2 of 3 (block_k 32);
    # with 4 blocks of 32 keys and held blocks of 32, the first meets 0..1 only.
    assert da.window_span(1, 32, 32, 3, 20) == (0, 2) and da.window_span(0, 32, 32, 4, 20) == (0, 1)
    assert da._pairs(1, 2, 128, 32, 32, 20) == 2 * (2 + 3 + 3 + 2) * 32 * 32
    # ModernBERT-base's local layers at 8,192 tokens (64 each side, blocks of 128): 3 grid steps a held block, not 64.
    assert da.window_width(128, 128, 8192, 64) == 3 and da.window_width(128, 128, 8192, None) == 64


@pytest.mark.parametrize("length, head_dim, layout, blocks", [
    (128, 16, "packing", {}),                               # 1/sqrt(16) a power of two: q and its bias pre-scaled
    (500, 8, "padding", {"block_q": 256, "block_k": 128}),    # 1/sqrt(8) scaled in the kernels; 2 held blocks
    (256, 64, "packing", {"block_q": 128, "block_k": 64}),    # two heads of 64 in one 128-lane block
])
def test_biases_added_in_the_kernel_get_the_gradients_of_biases_added_before_it(length, head_dim, layout, blocks):
    """`biases`: the q/k/v biases' gradients, summed inside the kernels, equal the reference's (jax's reduction of
    the gradient of q + bias etc.); q/k/v's gradients and the output too. The key bias's is ~0 in both (softmax
    ignores a shift of every logit of a row): an absolute tolerance besides the relative one (float32 sums)."""
    batch, heads, rate, seed = 2, 2, 0.1, 7
    q, k, v = _inputs(batch, length, heads, head_dim, seed=5)
    rng = np.random.default_rng(6)
    biases = tuple(jnp.asarray(rng.normal(size=(heads, head_dim)), jnp.float32) for _ in range(3))
    segment_ids = _segments(batch, length, layout)
    weights = (segment_ids != 0).astype(jnp.float32)[:, :, None, None]
    mask = da.dropout_keep_mask(seed, batch, heads, length, length, rate)
    kernel = lambda q, k, v, b: da.flash_attention_with_dropout(q, k, v, segment_ids, dropout_rate=rate, seed=seed,
                                                                biases=b, **blocks)
    reference = lambda q, k, v, b: _reference(*(x + bias for x, bias in zip((q, k, v), b)), segment_ids, mask, rate)
    with pltpu.force_tpu_interpret_mode():
        out, grads = _value_and_grads(kernel, weights, q, k, v, biases)
    expected, expected_grads = _value_and_grads(reference, weights, q, k, v, biases)
    _assert_close((out, grads[:3]), (expected, expected_grads[:3]), segment_ids)
    for grad, expected in zip(grads[3], expected_grads[3]):
        assert grad.shape == (heads, head_dim) and grad.dtype == jnp.float32
        np.testing.assert_allclose(np.asarray(grad), np.asarray(expected), rtol=1e-5, atol=5e-5)
    assert np.abs(np.asarray(grads[3][2])).max() > 1.0   # the value bias's gradient is not trivially small


def test_rate_zero_is_attention_without_dropout():
    q, k, v = _inputs(2, 128, 2, 16)
    segment_ids = _segments(2, 128, "packing")
    kernel, reference = _kernel_and_reference(q, k, v, segment_ids, 0.0, 7, block_q=64, block_k=64)
    _assert_close(kernel, reference, segment_ids)


def test_the_kernel_applies_exactly_the_jnp_mask():
    """With q = k = 0 the probabilities of a row are uniform, and with v the identity each output row is the row of
    the keep mask, scaled: out[b, i, h, j] = keep[b, h, i, j] / ((1 - rate) * length)."""
    batch, length, heads, rate = 2, 128, 3, 0.25
    q = k = jnp.zeros((batch, length, heads, length), jnp.float32)
    v = jnp.broadcast_to(jnp.eye(length, dtype=jnp.float32)[None, :, None, :], (batch, length, heads, length))
    segment_ids = jnp.ones((batch, length), jnp.int32)
    with pltpu.force_tpu_interpret_mode():
        out = da.flash_attention_with_dropout(q, k, v, segment_ids, dropout_rate=rate, seed=99, block_q=64,
                                              block_k=64)
    recovered = np.asarray(out).transpose(0, 2, 1, 3) * (1 - rate) * length
    mask = np.asarray(da.dropout_keep_mask(99, batch, heads, length, length, rate))
    np.testing.assert_allclose(recovered, mask.astype(np.float32), rtol=1e-5, atol=1e-5)


def test_keep_fraction_and_independence():
    rate, batch, heads, length = 0.1, 4, 12, 512
    mask = np.asarray(da.dropout_keep_mask(12345, batch, heads, length, length, rate))
    n = mask.size                                   # 12.6M pairs
    sigma = np.sqrt(rate * (1 - rate) / n)          # 8.4e-5
    assert abs(mask.mean() - (1 - rate)) < 5 * sigma
    # Every (batch, head) stream and every row keeps about 1 - rate.
    per_stream = mask.mean(axis=(2, 3))
    assert np.abs(per_stream - (1 - rate)).max() < 5 * np.sqrt(rate * (1 - rate) / length**2)
    per_row = mask.mean(axis=3).ravel()
    assert abs(per_row.std() - np.sqrt(rate * (1 - rate) / length)) < 0.05 * np.sqrt(rate * (1 - rate) / length)
    # Neighbours (along keys, queries), heads, examples and seeds are independent: both kept ~ (1 - rate)^2.
    other_seed = np.asarray(da.dropout_keep_mask(12346, batch, heads, length, length, rate))
    pairs = {"next key": (mask[..., 1:], mask[..., :-1]), "next query": (mask[:, :, 1:], mask[:, :, :-1]),
             "next head": (mask[:, 1:], mask[:, :-1]), "next example": (mask[1:], mask[:-1]),
             "next seed": (mask, other_seed)}
    for name, (a, b) in pairs.items():
        both = (a & b).mean()
        assert abs(both - (1 - rate) ** 2) < 6 * np.sqrt((1 - rate) ** 2 * (1 - (1 - rate) ** 2) / a.size), name
    for rate in (0.5, 0.02):
        small = np.asarray(da.dropout_keep_mask(1, 2, 4, 256, 256, rate))
        assert abs(small.mean() - (1 - rate)) < 5 * np.sqrt(rate * (1 - rate) / small.size)


def test_seeds_select_masks_and_outputs():
    q, k, v = _inputs(1, 128, 2, 16)
    segment_ids = _segments(1, 128, "none")
    run = lambda seed: da.flash_attention_with_dropout(q, k, v, segment_ids, dropout_rate=0.1, seed=seed,
                                                       block_q=64, block_k=64)
    with pltpu.force_tpu_interpret_mode():
        first, again, other = run(5), run(5), run(6)
    np.testing.assert_array_equal(np.asarray(first), np.asarray(again))
    assert np.abs(np.asarray(first - other)).max() > 1e-2
    mask5, mask6 = (np.asarray(da.dropout_keep_mask(s, 1, 2, 128, 128, 0.1)) for s in (5, 6))
    assert 0.15 < (mask5 != mask6).mean() < 0.21      # independent masks disagree on 2 * 0.9 * 0.1 = 18%
    # A seed may be a uint32 (any of its 2^32 values), an int32 with the same bits, or a jax key.
    np.testing.assert_array_equal(da.dropout_keep_mask(np.uint32(2**32 - 1), 1, 1, 16, 16, 0.1),
                                  da.dropout_keep_mask(np.int32(-1), 1, 1, 16, 16, 0.1))
    key = jax.random.key(3)
    np.testing.assert_array_equal(da.dropout_keep_mask(key, 1, 2, 64, 64, 0.1),
                                  da.dropout_keep_mask(jax.random.bits(key, (), jnp.uint32), 1, 2, 64, 64, 0.1))


def _entry_point_case(length):
    """(q, k, v, input_mask, packing_ids, rng, loss weights) for `dot_product_attention` at `length`."""
    batch, heads, head_dim = 2, 2, 16
    q, k, v = _inputs(batch, length, heads, head_dim, seed=3)
    input_mask = np.ones((batch, length), np.int32)
    input_mask[1, length * 3 // 5:] = 0
    packing_ids = np.zeros((batch, length), np.int32)
    packing_ids[0, length * 2 // 5:] = 1
    weights = jnp.asarray(input_mask, jnp.float32)[:, :, None, None]
    return q, k, v, input_mask, packing_ids, jax.random.key(11), weights


def _entry_point(input_mask, packing_ids, rng, rate=0.1):
    return lambda q, k, v: dot_product_attention(q, k, v, input_mask, packing_ids, backend="flash_dropout_tpu",
                                                 dropout_rate=rate, dropout_rng=rng, deterministic=False)


@pytest.mark.parametrize("length, grid", [(100, (1, 1)), (250, (1, 2)), (500, (1, 4))])
def test_the_entry_points_held_block_is_the_longest_of_512_256_128_dividing_the_padded_length(length, grid):
    """`dot_product_attention`'s blocks for the kernel (traced, not run): 100 -> 128, one block; 250 -> 256, one
    held block of 256 over 2 streamed blocks of 128 in every kernel; 500 -> 512: 512 over 4 of 128."""
    q, k, v, input_mask, packing_ids, rng, weights = _entry_point_case(length)
    eqns = jax.make_jaxpr(jax.grad(_loss(_entry_point(input_mask, packing_ids, rng), weights)))(q, k, v).jaxpr
    grids = [eqn.params["grid_mapping"].grid for eqn in _all_eqns(eqns) if eqn.primitive.name == "pallas_call"]
    assert grids == [(2, 2, *grid)] * 3


def test_attention_entry_point_with_the_dropout_backend_equals_the_reference_with_its_mask():
    """Through `dot_product_attention` at 250 tokens (padded to 256: a held block over 2 streamed ones); and
    deterministic (eval), the plain attention."""
    length, batch, heads, rate = 250, 2, 2, 0.1
    q, k, v, input_mask, packing_ids, rng, weights = _entry_point_case(length)
    mask = da.dropout_keep_mask(da.seed_from_rng(rng), batch, heads, length, length, rate)
    reference = lambda q, k, v: reference_attention(q, k, v, input_mask, packing_ids, dropout_rate=rate,
                                                    dropout_rng=rng, deterministic=False, keep_mask=mask)
    with pltpu.force_tpu_interpret_mode():
        out, grads = _value_and_grads(_entry_point(input_mask, packing_ids, rng, rate), weights, q, k, v)
        # Deterministic (eval): no dropout, the plain attention.
        eval_out = dot_product_attention(q, k, v, input_mask, packing_ids, backend="flash_dropout_tpu",
                                         dropout_rate=rate, dropout_rng=None, deterministic=True)
    expected, expected_grads = _value_and_grads(reference, weights, q, k, v)
    valid = input_mask.astype(bool)
    np.testing.assert_allclose(np.asarray(out)[valid], np.asarray(expected)[valid], rtol=1e-5, atol=1e-5)
    for grad, expected_grad in zip(grads, expected_grads):
        np.testing.assert_allclose(np.asarray(grad), np.asarray(expected_grad), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(eval_out)[valid],
                               np.asarray(reference_attention(q, k, v, input_mask, packing_ids))[valid],
                               rtol=1e-5, atol=1e-5)


def _kernel_eqns(q, k, v, segment_ids, **blocks):
    """The pallas_call equations of the kernel's forward + backward, traced (not run)."""
    def step(q, k, v, segment_ids):
        loss = lambda q, k, v: jnp.sum(da.flash_attention_with_dropout(
            q, k, v, segment_ids, dropout_rate=0.1, seed=0, **blocks).astype(jnp.float32))
        return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)
    jaxpr = jax.make_jaxpr(step)(q, k, v, segment_ids)
    return [eqn for eqn in _all_eqns(jaxpr.jaxpr) if eqn.primitive.name == "pallas_call"]


def test_cost_estimates_count_tile_padded_bytes_per_copy_and_the_work_of_the_slower_unit():
    """Declared costs, hand-counted for batch 2, 4 heads of 64 (bf16), length 256 in 128 blocks: q/k/v/o as
    [2, 256, 4 * 64], two heads per 128-lane block (no padding): A = 2*256*256*2 bytes per pass; grid (2 examples,
    2 head pairs, 2, 2). A (1, 128) block of a [.., 1, 256] int32/f32 array is one (1, 128) tile, 512 bytes; a
    statistics block holds the pair's two heads, 1024."""
    q, k, v = (jax.ShapeDtypeStruct((2, 256, 4, 64), jnp.bfloat16) for _ in range(3))
    costs = [eqn.params["cost_estimate"] for eqn in _kernel_eqns(q, k, v, jax.ShapeDtypeStruct((2, 256), jnp.int32))]
    assert len(costs) == 3
    a, tile, stat_tile = 2 * 256 * 256 * 2, 512, 1024
    steps, per_outer_block = 2 * 2 * 2 * 2, 2 * 2 * 2     # grid cells; (batch, head pair, outer block) cells
    stats = 2 * 4 * 256 * 4                               # lse or D [2, 4, 1, 256] float32, moved once
    biases = 3 * 2 * 256 * 2                              # the q/k/v bias rows [2, 1, 256] bf16, read once each
    sums = per_outer_block * 8 * 128 * 4                  # a bias gradient's (8, 128) float32 tile per held block
    expected_bytes = [
        # forward: q once, k and v once per query block, o once; q segment ids per outer block, k's every step
        a + 2 * 2 * a + a + per_outer_block * tile + steps * tile + stats + biases,
        # dq: q, o, do, dq once; k, v per query block; segment ids as the forward; lse read and D written once
        4 * a + 2 * 2 * a + per_outer_block * tile + steps * tile + 2 * stats + sums + biases,
        # dk/dv: k, v, dk, dv once; q and do per key block; k segment ids per key block; q's, lse and D every
        # step; dk's and dv's sums
        4 * a + 2 * 2 * a + per_outer_block * tile + steps * (tile + 2 * stat_tile) + 2 * sums + biases,
    ]
    pairs = 2 * 4 * 256 * 256
    # Per head and query/key pair. VPU: the hash's 11, its per-sweep precomputation 6 / 2 streamed blocks, and
    # forward 7, dq 7, dk/dv 9 (1/sqrt(64) = 1/8 is a power of two: q comes pre-scaled), at 32 MXU flops each. MXU:
    # 2, 3, 4 products contracting (or producing) 128 lanes (the pair's other head zeroed), 2 * 128 flops each.
    hash_ops = 11 + 6 / 2
    expected_flops = [pairs * max(32 * (hash_ops + 7), 2 * 128 * 2), pairs * max(32 * (hash_ops + 7), 2 * 128 * 3),
                      pairs * max(32 * (hash_ops + 9), 2 * 128 * 4)]
    assert expected_flops == [pairs * 32 * (hash_ops + 7), pairs * 768, pairs * 1024]   # VPU, MXU, MXU
    assert [c.bytes_accessed for c in costs] == expected_bytes
    assert [c.flops for c in costs] == expected_flops
    assert [c.transcendentals for c in costs] == [pairs] * 3


def test_the_logits_are_scaled_in_the_kernels_only_where_the_scale_is_not_a_power_of_two():
    """head_dim 32 (one head per block, [B, H, S, 32]): 1/sqrt(32) is inexact in bf16, so q is not pre-scaled and
    each kernel pays the op per pair (forward 8, dq 8, dk/dv 10 besides the hash's 11 + 6 / 2); the matmuls of 32
    lanes take whole 128-lane MXU passes (2 * 128 flops per pair each): the forward is the VPU's, dq and dk/dv the
    MXU's."""
    q, k, v = (jax.ShapeDtypeStruct((2, 256, 4, 32), jnp.bfloat16) for _ in range(3))
    costs = [eqn.params["cost_estimate"] for eqn in _kernel_eqns(q, k, v, jax.ShapeDtypeStruct((2, 256), jnp.int32))]
    pairs, hash_ops = 2 * 4 * 256 * 256, 11 + 6 / 2
    assert [c.flops for c in costs] == [pairs * 32 * (hash_ops + 8), pairs * 2 * 128 * 3, pairs * 2 * 128 * 4]


def test_statistics_and_segment_ids_reach_the_kernels_lane_dense():
    """Heads of 64 in pairs: q/k/v/o and their gradients as [B, S, H * 64] (the projections' layout, reshaped, no
    transpose); lse and D as [B, H, 1, S] float32, segment ids as [B, 1, S] int32, the biases as [B, 1, H * 64] rows:
    no copy replicated over lanes or sublanes goes in or out of any kernel."""
    batch, length, heads = 2, 256, 2
    q, k, v = (jax.ShapeDtypeStruct((batch, length, heads, 64), jnp.bfloat16) for _ in range(3))
    eqns = _kernel_eqns(q, k, v, jax.ShapeDtypeStruct((batch, length), jnp.int32))
    shapes = [var.aval.shape for eqn in eqns for var in (*eqn.invars, *eqn.outvars)]
    qkv_shape = (batch, length, heads * 64)
    sums_shape = (batch, length // 128 * 8, heads * 64)   # the backward's bias-gradient tiles, one per held block
    # forward q, k, v -> o; dq q, k, v, o, dO -> dq; dk/dv q, k, v, dO -> dk, dv. Each kernel reads the 3 bias rows.
    assert shapes.count(qkv_shape) == 4 + 6 + 6
    assert shapes.count((batch, 1, heads * 64)) == 3 * 3
    others = [var.aval for eqn in eqns for var in (*eqn.invars, *eqn.outvars)
              if var.aval.shape not in (qkv_shape, (3,), sums_shape, (batch, 1, heads * 64))]   # (3,): the seed
    assert others and all(a.shape in ((batch, 1, length), (batch, heads, 1, length)) for a in others), others
    assert {a.dtype for a in others if a.shape == (batch, 1, length)} == {jnp.dtype(jnp.int32)}
    assert {a.dtype for a in others if a.shape == (batch, heads, 1, length)} == {jnp.dtype(jnp.float32)}


def test_the_forwards_lane_dense_log_sum_exp_is_the_softmax_normaliser():
    """The forward's lse output [B, H, 1, S] (two heads of 64 in one block): logsumexp over the keys of the query's
    segment, from plain jnp."""
    batch, length, heads, head_dim = 2, 256, 2, 64
    q, k, v = _inputs(batch, length, heads, head_dim, seed=8)
    segment_ids = _segments(batch, length, "packing")
    layout = da._layout(heads, head_dim)
    packed = lambda x: x.reshape(batch, length, heads * head_dim)
    seed = jnp.zeros(3, jnp.int32)
    with pltpu.force_tpu_interpret_mode():
        _, lse = da._forward(packed(q), packed(k), packed(v), da._bias_rows(layout, None, batch, q.dtype),
                             segment_ids, seed, 0.1, 128, 128, layout, prescale=False)
    assert lse.shape == (batch, heads, 1, length) and lse.dtype == jnp.float32
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k, precision="highest") / np.sqrt(head_dim)
    same = segment_ids[:, None, :, None] == segment_ids[:, None, None, :]
    expected = jax.nn.logsumexp(jnp.where(same, scores, -jnp.inf), axis=-1)
    np.testing.assert_allclose(np.asarray(lse[:, :, 0]), np.asarray(expected), rtol=1e-5, atol=1e-5)


def _all_eqns(jaxpr):
    for eqn in jaxpr.eqns:
        yield eqn
        for param in eqn.params.values():
            inner = getattr(param, "jaxpr", None)
            if inner is not None and hasattr(inner, "eqns"):
                yield from _all_eqns(inner)
            elif hasattr(param, "eqns"):
                yield from _all_eqns(param)


@pytest.mark.usefixtures("no_cache_writes")
@pytest.mark.parametrize("topology, batch, length, window", [
    ("v5e:2x2", 8, 128, None), ("v5e:2x2", 4, 512, None), ("v4-8", 8, 128, None), ("v4-8", 4, 512, None),
    ("v5e:2x2", 1, 2048, 64),   # ModernBERT's local layers: the window's grid, its block indices in the kernels
])
def test_forward_and_backward_compile_through_mosaic_for_tpu(topology, batch, length, window):
    """BERT-base attention (12 heads of 64, bf16) forward + backward, compiled by XLA:TPU and Mosaic for
    compile-only devices of two TPU generations (libtpu; no TPU needed); a window's kernels too."""
    pytest.importorskip("libtpu", reason="compiling for TPU needs libtpu")
    from bertjax.cloud import topologies

    device = topologies.compile_only_devices(topologies.parse_topology(topology))[0]
    sharding = jax.sharding.SingleDeviceSharding(device)
    qkv = jax.ShapeDtypeStruct((batch, length, 12, 64), jnp.bfloat16, sharding=sharding)
    segment_ids = jax.ShapeDtypeStruct((batch, length), jnp.int32, sharding=sharding)
    seed = jax.ShapeDtypeStruct((), jnp.uint32, sharding=sharding)

    def step(q, k, v, segment_ids, seed):
        loss = lambda q, k, v: jnp.sum(da.flash_attention_with_dropout(
            q, k, v, segment_ids, dropout_rate=0.1, seed=seed, window=window).astype(jnp.float32))
        return jax.value_and_grad(loss, argnums=(0, 1, 2))(q, k, v)
    compiled = jax.jit(step).lower(qkv, qkv, qkv, segment_ids, seed).compile()
    hlo = compiled.as_text()
    assert hlo.count('custom_call_target="tpu_custom_call"') == 3   # forward, dq, dk/dv: all Mosaic
    for name in ("flash_dropout_fwd", "flash_dropout_dq", "flash_dropout_dkv"):
        assert name in hlo
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    # XLA takes the kernels' declared costs: at least the 9 [S, S, 64] matmuls of forward + backward (with a
    # window, of the pairs in the blocks that meet it: 3 blocks of 128 keys a query, 2 at either end).
    pairs = length * length if window is None else 128 * 128 * (3 * (length // 128) - 2)
    assert cost["flops"] >= 9 * 2 * 64 * batch * 12 * pairs


@pytest.mark.parametrize("backend, heads, head_dim", [
    ("flash_dropout_tpu", 2, 16), ("flash_dropout_tpu", 4, 64),   # one head per shard; a pair of 64 per shard
    ("flash_dropout_gpu", 2, 16),                                 # the GPU kernel, interpreted ([H, D] biases)
])
def test_sharded_batch_and_heads_give_the_mask_of_the_global_arrays(backend, heads, head_dim):
    """On a mesh the backend runs the kernel per shard (shard_map: batch over data, heads over tensor); each shard
    hashes its global batch and head indices, so the output is the unsharded one; the q/k/v biases' gradients,
    summed per shard in the kernels (the GPU kernel's [heads, head_dim] ones replicated over the batch's shards),
    are the unsharded ones too."""
    from bertjax import sharding

    batch, length, rate = 2, 128, 0.1
    q, k, v = _inputs(batch, length, heads, head_dim, seed=4)
    biases = tuple(jnp.asarray(np.random.default_rng(9).normal(size=(3, heads, head_dim)), jnp.float32))
    input_mask = np.ones((batch, length), np.int32)
    input_mask[1, 70:] = 0
    rng = jax.random.key(5)
    mask = da.dropout_keep_mask(da.seed_from_rng(rng), batch, heads, length, length, rate)
    weights = jnp.asarray(input_mask, jnp.float32)[:, :, None, None]
    attend = lambda q, k, v, b: dot_product_attention(q, k, v, input_mask, None, backend=backend,
                                                      dropout_rate=rate, dropout_rng=rng, deterministic=False,
                                                      biases=b)
    reference = lambda q, k, v, b: reference_attention(q + b[0], k + b[1], v + b[2], input_mask, None,
                                                       dropout_rate=rate, dropout_rng=rng, deterministic=False,
                                                       keep_mask=mask)
    loss = lambda f: lambda q, k, v, b: jnp.sum(jnp.sin(f(q, k, v, b)) * weights)
    mesh = sharding.make_mesh(data=2, fsdp=1, tensor=2, devices=jax.devices()[:4])
    # (The TPU interpreter would take the GPU kernel's pallas_call too, and refuse its Triton parameters.)
    interpret = pltpu.force_tpu_interpret_mode() if backend.endswith("_tpu") else contextlib.nullcontext()
    with interpret, sharding.activate(mesh):
        out, grads = jax.jit(lambda *a: (attend(*a), jax.grad(loss(attend), argnums=(0, 1, 2, 3))(*a)))(
            q, k, v, biases)
    valid = input_mask.astype(bool)
    np.testing.assert_allclose(np.asarray(out)[valid], np.asarray(reference(q, k, v, biases))[valid],
                               rtol=1e-5, atol=1e-5)
    expected_grads = jax.grad(loss(reference), argnums=(0, 1, 2, 3))(q, k, v, biases)
    for grad, expected in zip(jax.tree.leaves(grads), jax.tree.leaves(expected_grads)):
        np.testing.assert_allclose(np.asarray(grad), np.asarray(expected), rtol=1e-5, atol=5e-5)


def test_the_gpu_kernel_on_stacked_qkv_with_rotary_positions_sharded_is_the_unsharded():
    """ModernBERT's GPU path on a mesh (batch over data, heads over tensor): the stacked q/k/v, the rotary tables
    (split with the batch) and the biases per shard; output and gradients those of one device."""
    from bertjax import sharding
    from bertjax.model import rope
    from bertjax.model.attention import stacked_gpu_attention

    batch, length, heads, head_dim, rate = 2, 128, 2, 16, 0.1
    qkv = jnp.stack(_inputs(batch, length, heads, head_dim, seed=6), axis=2)
    biases = tuple(jnp.asarray(np.random.default_rng(3).normal(size=(3, heads, head_dim)), jnp.float32))
    input_mask = np.ones((batch, length), np.int32)
    input_mask[1, 90:] = 0
    positions = jnp.asarray(np.stack([np.arange(length), np.arange(length) % 50]), jnp.int32)
    rotary = rope.cos_sin(positions, head_dim, 160.0)
    weights = jnp.asarray(input_mask, jnp.float32)[:, :, None, None]
    attend = lambda qkv, b: stacked_gpu_attention(qkv, input_mask, rotary=rotary, dropout_rate=rate,
                                                  dropout_rng=jax.random.key(2), deterministic=False, biases=b,
                                                  window=30)
    loss = lambda qkv, b: jnp.sum(jnp.sin(attend(qkv, b)) * weights)
    run = jax.jit(lambda *a: (attend(*a), jax.grad(loss, argnums=(0, 1))(*a)))
    alone = run(qkv, biases)
    mesh = sharding.make_mesh(data=2, fsdp=1, tensor=2, devices=jax.devices()[:4])
    with sharding.activate(mesh):
        sharded = run(qkv, biases)
    valid = input_mask.astype(bool)
    np.testing.assert_allclose(np.asarray(sharded[0])[valid], np.asarray(alone[0])[valid], rtol=1e-5, atol=1e-5)
    for got, want in zip(jax.tree.leaves(sharded[1]), jax.tree.leaves(alone[1])):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=5e-5)


@pytest.mark.slow
@pytest.mark.parametrize("topology", ["v5e:2x2", "v4-8"])
def test_bert_tiny_train_step_with_the_dropout_kernel_compiles_for_tpu(topology):
    """The job's whole train step (data parallel over 4 chips) with attention dropout in the fused kernel."""
    pytest.importorskip("libtpu", reason="compiling for TPU needs libtpu")
    from bertjax.cloud import topologies
    from bertjax.cloud import compile as tpu_compile
    from bertjax.pretraining.config import load_config

    config = load_config("bert-tiny", ["model.attention_backend=flash_dropout_tpu"], require_data=False)
    assert config.model.attention_probs_dropout_prob > 0
    result = tpu_compile.compile_for_topology(config, topologies.parse_topology(topology))
    assert result["fits"]
