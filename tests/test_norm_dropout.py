"""dropout(LayerNorm(x)), the embeddings' tail, against autodiff of the composition it replaces off TPU."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bertjax.model import dropout as dropout_lib
from bertjax.model import layer_norm as ln
from bertjax.model import norm_dropout

EPS = 1e-12
RATE = 0.1


def _composition(x, scale, bias, rng, dtype):
    """How bert.py's Embeddings computed it before: the LayerNorm module, then the Dropout module."""
    y = ln.layer_norm(x, scale, bias, EPS, dtype)
    return y if rng is None else dropout_lib.dropout(y, RATE, rng)


def _inputs(shape=(3, 8, 64)):
    keys = jax.random.split(jax.random.PRNGKey(0), 4)
    x = 2.0 * jax.random.normal(keys[0], shape) + 0.5     # the embeddings' float32 sum
    scale = 1.0 + 0.3 * jax.random.normal(keys[1], shape[-1:])
    bias = 0.1 * jax.random.normal(keys[2], shape[-1:])
    return x, scale, bias, keys[3]


@pytest.mark.parametrize("with_dropout", [True, False])
@pytest.mark.parametrize("dtype, rtol", [(jnp.float32, 1e-5), (jnp.bfloat16, 2e-2)])
def test_values_and_gradients_match_autodiff_of_the_composition(with_dropout, dtype, rtol):
    x, scale, bias, cotangent_key = _inputs()
    cotangent = jax.random.normal(cotangent_key, x.shape).astype(dtype)
    rng = jax.random.PRNGKey(7) if with_dropout else None
    fused = jax.jit(lambda *a: norm_dropout.norm_then_dropout(*a, EPS, dtype, RATE, rng))
    plain = jax.jit(lambda *a: _composition(*a, rng, dtype))
    (got, got_pullback), (want, want_pullback) = jax.vjp(fused, x, scale, bias), jax.vjp(plain, x, scale, bias)
    # The forward is the same arithmetic and the same mask bits: the same bits.
    assert got.dtype == want.dtype
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
    for name, g, w in zip(("dx", "dscale", "dbias"), got_pullback(cotangent), want_pullback(cotangent)):
        assert g.dtype == w.dtype, name
        w = np.asarray(w, np.float32)
        np.testing.assert_allclose(np.asarray(g, np.float32), w, rtol=rtol, atol=rtol * np.abs(w).max(),
                                   err_msg=name)


def test_dropped_elements_pass_no_gradient_back():
    """Where the mask dropped an output, that element's cotangent reaches nothing: a cotangent only there gives
    x, scale and bias zero gradients."""
    x, scale, bias, _ = _inputs()
    rng = jax.random.PRNGKey(3)
    keep = np.asarray(dropout_lib.keep_mask(rng, RATE, x.shape))
    assert 0.8 < keep.mean() < 0.97
    _, pullback = jax.vjp(lambda *a: norm_dropout.norm_then_dropout(*a, EPS, jnp.float32, RATE, rng),
                          x, scale, bias)
    for g in pullback(jnp.asarray(~keep, jnp.float32)):
        assert not np.asarray(g).any()
    dx, _, _ = pullback(jnp.asarray(keep, jnp.float32))
    assert np.asarray(dx).any()


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_the_gpu_paths_dropout_is_dropouts_bits_and_gradient(dtype):
    """On GPU the embeddings' dropout follows the LayerNorm kernels as `_rehashed_dropout`: the values of
    `dropout.dropout` with the same key, bit for bit, and its gradient the same mask and scale."""
    x, _, _, cotangent_key = _inputs()
    y, rng = x.astype(dtype), jax.random.PRNGKey(5)
    cotangent = jax.random.normal(cotangent_key, x.shape).astype(dtype)
    got, got_pullback = jax.vjp(
        jax.jit(lambda y: norm_dropout._rehashed_dropout(RATE, y, dropout_lib.word_seeds(rng))), y)
    want, want_pullback = jax.vjp(jax.jit(lambda y: dropout_lib.dropout(y, RATE, rng)), y)
    assert got.dtype == want.dtype == dtype
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
    assert np.asarray(want == 0).mean() > 0.05   # a visible mask
    np.testing.assert_array_equal(np.asarray(got_pullback(cotangent)[0], np.float32),
                                  np.asarray(want_pullback(cotangent)[0], np.float32))


def test_summed_embeddings_and_their_gradients_equal_autodiff_of_the_sum():
    """The embeddings' sum off TPU (one pass over the batch for the positions' and token types' gradients)
    against autodiff of word[ids] + positions + types[segment ids]: the same values, the same gradients (the
    word table's by the same scatter-add, the others summed in another order)."""
    from bertjax.model.bert import model as bert  # noqa: PLC0415

    rng = np.random.default_rng(0)
    word, types = (jnp.asarray(rng.normal(0, 1, shape), jnp.float32) for shape in ((50, 16), (3, 16)))
    positions = jnp.asarray(rng.normal(0, 1, (1, 12, 16)), jnp.float32)
    input_ids = jnp.asarray(rng.integers(0, 50, (4, 12)), jnp.int32)
    segment_ids = jnp.asarray(rng.integers(0, 3, (4, 12)), jnp.int32)
    cotangent = jnp.asarray(rng.normal(0, 1, (4, 12, 16)), jnp.float32)
    ours = lambda w, p, t: bert.summed_embeddings(w, p, t, input_ids, segment_ids)
    plain = lambda w, p, t: bert._summed(w, p, t, input_ids, segment_ids)
    (got, got_pullback), (want, want_pullback) = jax.vjp(ours, word, positions, types), jax.vjp(
        plain, word, positions, types)
    np.testing.assert_array_equal(got, want)
    for name, g, w in zip(("word", "positions", "types"), got_pullback(cotangent), want_pullback(cotangent)):
        assert g.shape == w.shape and g.dtype == w.dtype, name
        w = np.asarray(w)
        np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-6 * np.abs(w).max(), err_msg=name)


def test_take_rows_is_take_and_its_gradient_autodiff_s_bit_for_bit():
    """ModernBERT's token lookup (`take_rows`) against autodiff of jnp.take: the same rows, the same table
    gradient bit for bit (the scatter-add into a zeroed table, rows no id hits +0.0), with a NaN and an infinity
    in the cotangent too (the zero is derived from its first value)."""
    from bertjax.model.bert import model as bert  # noqa: PLC0415

    rng = np.random.default_rng(1)
    table = jnp.asarray(rng.normal(0, 1, (40, 8)), jnp.float32)
    ids = jnp.asarray(rng.integers(0, 30, (3, 5)), jnp.int32)  # rows 30-39 never hit
    got, got_pullback = jax.vjp(lambda t: bert.take_rows(t, ids), table)
    want, want_pullback = jax.vjp(lambda t: jnp.take(t, ids, axis=0), table)
    np.testing.assert_array_equal(got, want)
    cotangent = rng.normal(0, 1, (3, 5, 8)).astype(np.float32)
    for special in (None, np.nan, np.inf):
        if special is not None:
            cotangent[0, 0, 0] = special
        g, w = np.asarray(got_pullback(jnp.asarray(cotangent))[0]), np.asarray(want_pullback(jnp.asarray(cotangent))[0])
        np.testing.assert_array_equal(g, w)
        np.testing.assert_array_equal(np.signbit(g), np.signbit(w))   # +0.0, not -0.0, where no id hits


def test_take_rows_gradient_holds_no_zeroed_table_through_the_backward_pass():
    """A train step (gradient, then an update of the donated params) over a 16 MiB table and six layers:
    differentiated as written, XLA:CPU makes the gradient's zeroed table in the forward pass and holds it through
    the backward's peak; `take_rows` makes it at the end. XLA's own memory analysis of the two compiled steps: the
    temporaries differ by the table (ModernBERT's 50,368 x 768: 148 MiB of a fine-tune step's peak)."""
    from bertjax.model.bert import model as bert  # noqa: PLC0415

    def step_with(take):
        def loss(params, ids):
            table, layers = params
            x = take(table, ids)
            for w in layers:
                x = jnp.tanh(x @ w)
            return jnp.sum(x ** 2)

        def step(params, ids):
            grads = jax.grad(loss)(params, ids)
            return jax.tree_util.tree_map(lambda p, g: p - 0.1 * g, params, grads)
        return step

    rng = np.random.default_rng(0)
    table = jnp.asarray(rng.normal(0, 1, (16384, 256)), jnp.float32)
    layers = [jnp.asarray(rng.normal(0, 0.05, (256, 256)), jnp.float32) for _ in range(6)]
    ids = jnp.asarray(rng.integers(0, 16384, (64, 64)), jnp.int32)
    temp = {name: jax.jit(step_with(take), donate_argnums=0).lower((table, layers), ids).compile()
            .memory_analysis().temp_size_in_bytes
            for name, take in (("autodiff", lambda t, i: jnp.take(t, i, axis=0)), ("take_rows", bert.take_rows))}
    assert temp["autodiff"] - temp["take_rows"] >= 0.9 * table.nbytes, temp
