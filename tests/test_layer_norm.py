"""The fused LayerNorm(dropout(x) + residual) against autodiff of the composition it replaces off TPU."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bertjax.model import dropout as dropout_lib
from bertjax.model import layer_norm as ln
from tests.kernel_references import layer_norm_inputs

EPS = 1e-12
RATE = 0.1


def _composition(x, residual, scale, bias, rng, dtype):
    """How bert.py computed it before: Dropout module, the sum in the compute dtype, float32 LayerNorm."""
    if rng is not None:
        x = dropout_lib.dropout(x, RATE, rng)
    s = (x + residual).astype(jnp.float32)
    mean = s.mean(-1, keepdims=True)
    variance = jnp.square(s - mean).mean(-1, keepdims=True)
    return ((s - mean) * jax.lax.rsqrt(variance + EPS) * scale + bias).astype(dtype)


def _value_and_grads(fn, x, residual, scale, bias, cotangent):
    y, pullback = jax.vjp(fn, x, residual, scale, bias)
    return (y,) + pullback(cotangent)


@pytest.mark.parametrize("with_dropout", [True, False])
@pytest.mark.parametrize("dtype, rtol, atol", [(jnp.float32, 1e-5, 1e-5), (jnp.bfloat16, 2e-2, 2e-2)])
def test_values_and_gradients_match_autodiff_of_the_composition(with_dropout, dtype, rtol, atol):
    x, residual, scale, bias, cotangent = layer_norm_inputs(dtype)
    rng = jax.random.PRNGKey(7) if with_dropout else None
    fused = jax.jit(lambda *a: ln.residual_layer_norm(*a, EPS, dtype, RATE, rng))
    plain = jax.jit(lambda *a: _composition(*a, rng, dtype))
    got = _value_and_grads(fused, x, residual, scale, bias, cotangent)
    want = _value_and_grads(plain, x, residual, scale, bias, cotangent)
    # The forward is the same arithmetic: the same bits.
    np.testing.assert_array_equal(np.asarray(got[0], np.float32), np.asarray(want[0], np.float32))
    for name, g, w in zip(("dx", "dresidual", "dscale", "dbias"), got[1:], want[1:]):
        assert g.dtype == w.dtype, name
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32), rtol=rtol, atol=atol,
                                   err_msg=name)


def test_dropped_elements_get_no_gradient_and_kept_ones_are_scaled():
    x, residual, scale, bias, cotangent = layer_norm_inputs(jnp.float32)
    rng = jax.random.PRNGKey(3)
    _, dx, dresidual, _, _ = _value_and_grads(lambda *a: ln.residual_layer_norm(*a, EPS, jnp.float32, RATE, rng),
                                              x, residual, scale, bias, cotangent)
    keep = np.asarray(dropout_lib.keep_mask(rng, RATE, x.shape))
    assert 0.8 < keep.mean() < 0.97
    assert np.all(np.asarray(dx)[~keep] == 0.0)
    np.testing.assert_allclose(np.asarray(dx)[keep], np.asarray(dresidual)[keep] * 65536 / 58982, rtol=1e-6)


@pytest.mark.parametrize("rate", [RATE, 0.5, 0.0])
def test_fused_mask_is_keep_mask(rate):
    for shape in [(2, 5, 64), (4, 6)]:
        rng = jax.random.PRNGKey(11)
        np.testing.assert_array_equal(
            np.asarray(dropout_lib.keep_mask_fused(dropout_lib.word_seeds(rng), rate, shape)),
            np.asarray(dropout_lib.keep_mask(rng, rate, shape)))


def test_shapes_the_fused_mask_cannot_draw_take_the_composition():
    x, residual, scale, bias, cotangent = layer_norm_inputs(jnp.float32, shape=(4, 7))
    rng = jax.random.PRNGKey(2)
    got = _value_and_grads(lambda *a: ln.residual_layer_norm(*a, EPS, jnp.float32, RATE, rng),
                           x, residual, scale, bias, cotangent)
    want = _value_and_grads(lambda *a: _composition(*a, rng, jnp.float32), x, residual, scale, bias, cotangent)
    for g, w in zip(got, want):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-6, atol=1e-6)


def test_gradient_of_an_affine_layer_norm_is_the_hand_derivation():
    """One row, no dropout: d/dx of sum(c * LayerNorm(x + r)) by the textbook formula, in float64 numpy."""
    x = np.array([[1.0, -2.0, 0.5, 3.0]])
    r = np.array([[0.5, 0.25, -1.0, 0.0]])
    scale, bias, c = np.array([1.5, 0.5, -1.0, 2.0]), np.array([0.1, 0.0, 0.2, -0.3]), np.array([[1.0, -1.0, 2.0, 0.5]])
    s = x + r
    mu, sigma = s.mean(), np.sqrt(s.var() + EPS)
    xhat = (s - mu) / sigma
    g = c * scale
    ds = (g - g.mean() - xhat * (g * xhat).mean()) / sigma
    args = [jnp.asarray(a, jnp.float32) for a in (x, r, scale, bias)]
    _, dx, dr, dscale, dbias = _value_and_grads(lambda *a: ln.residual_layer_norm(*a, EPS, jnp.float32),
                                                *args, jnp.asarray(c, jnp.float32))
    for got, want in ((dx, ds), (dr, ds), (dscale, (c * xhat)[0]), (dbias, c[0])):
        np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-6)


def test_mixed_dtypes_are_refused():
    x, residual, scale, bias, _ = layer_norm_inputs(jnp.float32)
    with pytest.raises(ValueError, match="one dtype"):
        ln.residual_layer_norm(x.astype(jnp.bfloat16), residual, scale, bias, EPS, jnp.float32)


@pytest.mark.parametrize("offset", [0.0, 3.0, 30.0])
def test_the_tpus_one_pass_variance_is_layer_norm_within_its_cancellation_bound(monkeypatch, offset):
    """On TPU the variance is E[s^2] - E[s]^2 (one read of s): against float64 LayerNorm of rows whose mean is
    `offset` standard deviations from 0, its float32 error stays within float32's cancellation bound
    (~6e-8 x (1 + offset^2), here x8), its bf16 output is the two-pass one's but for a last-bit rounding, and its
    gradients are autodiff's of the two-pass LayerNorm."""
    rows = np.random.default_rng(3).normal(size=(64, 768)) * np.linspace(0.5, 2.0, 64)[:, None]
    rows += offset * rows.std(-1, keepdims=True)
    scale = np.random.default_rng(4).uniform(0.5, 1.5, 768)
    bias = np.random.default_rng(5).normal(size=768) * 0.1
    mean, var = rows.mean(-1, keepdims=True), rows.var(-1, keepdims=True)
    exact = (rows - mean) / np.sqrt(var + 1e-5) * scale + bias
    args = [jnp.asarray(a, jnp.float32) for a in (rows, scale, bias)]
    monkeypatch.setattr(ln, "target_platform", lambda: "tpu")
    on_tpu = jax.jit(lambda x, s, b: ln.layer_norm(x, s, b, 1e-5, jnp.float32))
    bound = 8 * 6e-8 * (1 + offset ** 2) * np.abs(exact).max()
    np.testing.assert_allclose(np.asarray(on_tpu(*args)), exact, rtol=0, atol=bound + 1e-6)

    in_bf16 = np.asarray(jax.jit(lambda x, s, b: ln.layer_norm(x, s, b, 1e-5, jnp.bfloat16))(*args), np.float32)
    two_pass = np.asarray(jax.jit(lambda x, s, b: ln.normalise_rows(x, s, b, 1e-5)[0].astype(jnp.bfloat16))(*args),
                          np.float32)
    np.testing.assert_allclose(in_bf16, two_pass, rtol=2 ** -7, atol=bound)  # one bf16 ulp, or the bound
    assert np.mean(in_bf16 == two_pass) > (0.999 if offset <= 3 else 0.98)

    cotangent = jnp.asarray(np.random.default_rng(6).normal(size=rows.shape), jnp.float32)
    got = jax.vjp(on_tpu, *args)[1](cotangent)
    want = jax.vjp(lambda x, s, b: ln.normalise_rows(x, s, b, 1e-5)[0], *args)[1](cotangent)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-4 * (1 + offset ** 2),
                                   atol=1e-4 * (1 + offset ** 2) * np.abs(np.asarray(w)).max())
