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
