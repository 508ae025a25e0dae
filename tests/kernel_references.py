"""The Pallas kernels' inputs and references, shared by their tests and by bench/gpu_kernels.py (which runs them on
a bare GPU machine: no pytest here). Each `*_kernel_and_reference` returns the kernel's value and gradients and
the XLA reference's on the same inputs with the same dropout mask, run on JAX's default device."""
import jax
import jax.numpy as jnp
import numpy as np

from bertjax.model import dropout_attention as da
from bertjax.model import dropout_attention_gpu as dg
from bertjax.model import layer_norm as ln
from bertjax.model import layer_norm_gpu as lg
from bertjax.model.attention import reference_attention

LAYER_NORM_EPS, LAYER_NORM_RATE = 1e-12, 0.1


def _inputs(batch, length, heads, head_dim, seed=0):
    rng = np.random.default_rng(seed)
    return tuple(jnp.asarray(rng.normal(size=(batch, length, heads, head_dim)), jnp.float32) for _ in range(3))


def _segments(batch, length, layout):
    """Segment ids: 0 = padding; equal nonzero ids attend to each other."""
    ids = np.ones((batch, length), np.int32)
    if layout == "padding":
        ids[0, length * 3 // 4:] = 0
        ids[-1, 5:] = 0                       # (in a batch of 1 this overrides the first: 5 real tokens)
    elif layout == "packing":
        ids[:, length // 3:] = 2
        ids[:, length * 2 // 3:] = 3
        ids[-1, length - 9:] = 0              # padding after the packed sequences
    return jnp.asarray(ids)


def _reference(q, k, v, segment_ids, keep_mask, rate, window=None):
    """reference_attention with an explicit keep mask (None: no dropout); segment ids as its masks (0 = padding).
    A padding query sees no key there (the kernel's sees the padding): those rows are left out of comparisons."""
    segment_ids = jnp.asarray(segment_ids)
    return reference_attention(q, k, v, (segment_ids != 0).astype(jnp.int32), segment_ids, dropout_rate=rate,
                               deterministic=keep_mask is None, keep_mask=keep_mask, window=window)


def _value_and_grads(attention, weights, *args):
    """attention(*args) and the gradients of sum(sin(out) * weights) with respect to each of args, from one
    forward run (jax.vjp: the interpreted kernels' forward runs once, not once more inside jax.grad)."""
    out, pullback = jax.vjp(attention, *args)
    return out, pullback(jnp.cos(out) * weights)


def _biases(heads, head_dim, seed=5):
    """(q, k, v) projection biases [heads, head_dim] float32 (the model's parameters' dtype)."""
    return tuple(jnp.asarray(np.random.default_rng(seed).normal(size=(3, heads, head_dim)), jnp.float32))


def attention_kernel_and_reference(q, k, v, biases, segment_ids, rate, seed, interpret=True, window=None, **blocks):
    """(out, grads of q, k, v and the biases) of the GPU attention kernel given the (q, k, v) `biases`, and of the
    float32 reference on q + bq, k + bk, v + bv with `dropout_keep_mask`'s mask, on the same inputs (the
    reference's in float32); padding rows are left out of the loss (ignorable outputs). `window`: both sliding."""
    batch, length, heads, _ = q.shape
    weights = (segment_ids != 0).astype(jnp.float32)[:, :, None, None]
    kernel = lambda q, k, v, b: dg.flash_attention_with_dropout(
        q, k, v, segment_ids, dropout_rate=rate, seed=seed, biases=b, interpret=interpret, window=window,
        **blocks).astype(jnp.float32)
    mask = da.dropout_keep_mask(seed, batch, heads, length, length, rate) if rate else None
    reference = lambda q, k, v, b: _reference(q + b[0], k + b[1], v + b[2], segment_ids, mask, rate, window)
    as32 = [x.astype(jnp.float32) for x in (q, k, v)]
    return (_value_and_grads(kernel, weights, q, k, v, biases),
            _value_and_grads(reference, weights, *as32, biases))


def layer_norm_inputs(dtype, shape=(3, 8, 64)):
    """(x, residual, scale, bias, cotangent): x in `dtype` off centre, scale near 1 and bias float32 [width]."""
    keys = jax.random.split(jax.random.PRNGKey(0), 5)
    x = (2.0 * jax.random.normal(keys[0], shape) + 0.5).astype(dtype)
    residual = jax.random.normal(keys[1], shape).astype(dtype)
    scale = 1.0 + 0.3 * jax.random.normal(keys[2], shape[-1:])
    bias = 0.1 * jax.random.normal(keys[3], shape[-1:])
    cotangent = jax.random.normal(keys[4], shape).astype(dtype)
    return x, residual, scale, bias, cotangent


def layer_norm_value_and_grads(fn, cotangent, *args):
    y, pullback = jax.vjp(fn, *args)
    return (y,) + pullback(cotangent)


def layer_norm_kernel_and_reference(x, residual, scale, bias, cotangent, dtype, seeds=None, x_bias=None,
                                    interpret=True):
    """(y, gradients of x, [x_bias], [residual], scale, bias) of the GPU LayerNorm kernels on
    LayerNorm(dropout(x + x_bias) + residual) in `dtype` (x_bias, residual: None for none; seeds: None, no
    dropout), and of the XLA custom_vjp they replace (`layer_norm._fused`, a residual of zeros where none),
    x_bias added in x's dtype before it."""
    args = [a for a in (x, x_bias, residual, scale, bias) if a is not None]

    def split(args):
        args = iter(args)
        return [next(args) if a is not None else None for a in (x, x_bias, residual, scale, bias)]

    def kernel(*args):
        x, x_bias, residual, scale, bias = split(args)
        return lg.layer_norm(x, scale, bias, LAYER_NORM_EPS, dtype, residual, LAYER_NORM_RATE, seeds,
                             interpret=interpret, x_bias=x_bias)

    def xla(*args):
        x, x_bias, residual, scale, bias = split(args)
        summand = jnp.zeros_like(x) if residual is None else residual
        x = x if x_bias is None else x + x_bias.astype(x.dtype)
        return ln._fused(LAYER_NORM_EPS, jnp.dtype(dtype), LAYER_NORM_RATE, x, summand, scale, bias, seeds)

    return tuple(layer_norm_value_and_grads(f, cotangent, *args) for f in (kernel, xla))
