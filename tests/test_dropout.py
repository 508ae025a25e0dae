"""The 16-bit dropout mask (bertjax.model.dropout) against its definition: keep rate, independence, unbiasedness."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bertjax.model import dropout as dropout_lib


def test_threshold_rounds_the_keep_probability_to_sixteen_bits():
    assert dropout_lib.keep_threshold(0.1) == 58982            # round(0.9 * 65536)
    assert dropout_lib.keep_threshold(0.5) == 32768
    assert dropout_lib.keep_threshold(0.0) == 65536
    with pytest.raises(ValueError, match=r"dropout rate must be in \[0, 1\), got 1.0"):
        dropout_lib.keep_threshold(1.0)


def test_keep_rate_matches_the_threshold_within_binomial_noise():
    shape = (64, 128, 129)  # odd element count: the last word's upper half is dropped
    keep = np.asarray(dropout_lib.keep_mask(jax.random.key(3), 0.1, shape))
    assert keep.shape == shape and keep.dtype == bool
    p = 58982 / 65536
    n = keep.size
    assert abs(keep.mean() - p) < 5 * np.sqrt(p * (1 - p) / n)


def test_the_two_halves_of_a_word_are_independent_draws():
    # Elements c and c + C/2 of a row come from the low and high 16 bits of one word: their agreement must be that
    # of independent coin flips (a shared or shifted half would make them agree far more often); so must
    # neighbours', which come from consecutive counters.
    for shape in [(1 << 20,), (1 << 10, 1 << 10)]:
        keep = np.asarray(dropout_lib.keep_mask(jax.random.key(0), 0.5, shape)).reshape(-1, shape[-1])
        half = shape[-1] // 2
        low, high = keep[:, :half], keep[:, half:]
        n = low.size
        assert abs((low == high).mean() - 0.5) < 5 * np.sqrt(0.25 / n)
        assert abs((keep[:, :-1] == keep[:, 1:]).mean() - 0.5) < 5 * np.sqrt(0.25 / n)


def test_dropout_is_unbiased_and_zeroes_the_dropped():
    x = jnp.full((256, 1024), 2.0)
    out = np.asarray(dropout_lib.dropout(x, 0.1, jax.random.key(7)))
    kept = out != 0
    np.testing.assert_allclose(out[kept], 2.0 * 65536 / 58982, rtol=1e-6)
    assert abs(out.mean() - 2.0) < 5 * 2.0 * np.sqrt((1 / 0.9 - 1) / out.size)


def test_same_key_same_mask_other_key_other_mask():
    a = dropout_lib.keep_mask(jax.random.key(1), 0.1, (32, 32))
    b = dropout_lib.keep_mask(jax.random.key(1), 0.1, (32, 32))
    c = dropout_lib.keep_mask(jax.random.key(2), 0.1, (32, 32))
    assert np.array_equal(a, b) and not np.array_equal(a, c)


def test_gradient_flows_through_kept_elements_only():
    x = jnp.ones((16, 64))
    key = jax.random.key(5)
    grad = np.asarray(jax.grad(lambda v: dropout_lib.dropout(v, 0.25, key).sum())(x))
    keep = np.asarray(dropout_lib.keep_mask(key, 0.25, x.shape))
    np.testing.assert_allclose(grad, np.where(keep, 65536 / 49152, 0.0), rtol=1e-6)


def test_bfloat16_values_are_scaled_in_float32_and_rounded_once():
    x = jax.random.normal(jax.random.key(2), (64, 256), jnp.float32).astype(jnp.bfloat16)
    out = dropout_lib.dropout(x, 0.1, jax.random.key(4))
    assert out.dtype == jnp.bfloat16
    keep = np.asarray(dropout_lib.keep_mask(jax.random.key(4), 0.1, x.shape))
    expected = (np.asarray(x, np.float32) * (65536 / 58982)).astype(jnp.bfloat16)
    np.testing.assert_array_equal(np.asarray(out)[keep], expected[keep])
    assert (np.asarray(out)[~keep] == 0).all()


def _fmix32(x):
    """MurmurHash3's fmix32 in numpy uint32 (the published finaliser), independent of bertjax.model.hashing."""
    x = x.astype(np.uint32)
    x ^= x >> np.uint32(16)
    x = (x * np.uint32(0x85EBCA6B)).astype(np.uint32)
    x ^= x >> np.uint32(13)
    x = (x * np.uint32(0xC2B2AE35)).astype(np.uint32)
    return x ^ (x >> np.uint32(16))


def test_mask_is_the_documented_counter_hash():
    """The module docstring's definition, recomputed in numpy uint32 arithmetic: a mask [3, 5, 8] and a flat one."""
    key, rate = jax.random.key(11), 0.3
    threshold = dropout_lib.keep_threshold(rate)
    w0, w1 = np.asarray(jax.random.bits(key, (2,), jnp.uint32))
    with np.errstate(over="ignore"):
        mult = _fmix32(w0 ^ np.uint32(0x9E3779B9)) | np.uint32(1)
        add = _fmix32(w1 ^ np.uint32(0x85EBCA77))
        words = lambda count: _fmix32(_fmix32(np.arange(count, dtype=np.uint32) * mult + add))
    draws = lambda u: np.concatenate([u & np.uint32(0xFFFF), u >> np.uint32(16)], axis=-1)
    np.testing.assert_array_equal(np.asarray(dropout_lib.keep_mask(key, rate, (3, 5, 8))),
                                  draws(words(60).reshape(3, 5, 4)) < threshold)
    np.testing.assert_array_equal(np.asarray(dropout_lib.keep_mask(key, rate, (7,))),
                                  (draws(words(4)) < threshold)[:7])
    np.testing.assert_array_equal(np.asarray(dropout_lib.keep_mask(key, rate, (3, 5))),
                                  (draws(words(8)) < threshold)[:15].reshape(3, 5))


def test_rows_columns_and_keys_are_independent_draws():
    keep = np.asarray(dropout_lib.keep_mask(jax.random.key(5), 0.5, (1024, 1024)))
    other = np.asarray(dropout_lib.keep_mask(jax.random.key(6), 0.5, (1024, 1024)))
    bound = 5 * np.sqrt(0.25 / keep[1:].size)
    for a, b in [(keep[1:], keep[:-1]), (keep[:, 2:], keep[:, :-2]), (keep, other)]:
        assert abs((a == b).mean() - 0.5) < bound
    per_row = keep.mean(axis=1)  # every row keeps at the rate
    assert np.abs(per_row - 0.5).max() < 5 * np.sqrt(0.25 / 1024)


def test_mask_is_the_same_when_sharded_over_devices():
    mesh = jax.make_mesh((len(jax.devices()),), ("data",))
    shape = (8 * len(jax.devices()), 16, 32)
    sharded = jax.jit(lambda k: dropout_lib.keep_mask(k, 0.1, shape),
                      out_shardings=jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data")))
    whole = np.asarray(dropout_lib.keep_mask(jax.random.key(9), 0.1, shape))
    np.testing.assert_array_equal(np.asarray(sharded(jax.random.key(9))), whole)
