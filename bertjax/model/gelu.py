"""GELU whose backward keeps only its input: the derivative is recomputed from x, not read back from memory.

Differentiated as written, `jax.nn.gelu` leaves its intermediates (erfc's or tanh's value, x's square...) for the
backward pass: on XLA:GPU the BERT-base feed-forward's GELU wrote three [B, L, 3072] tensors per layer (the H200
profile, ../shared/gpu beside the project). Here (off TPU) the forward is `jax.nn.gelu` itself (the same bits), the residual is x
alone, and the backward evaluates the derivative in float32 and rounds once:
    exact: d/dx = Phi(x) + x phi(x) = 0.5 erfc(-x / sqrt 2) + x exp(-x^2 / 2) / sqrt(2 pi)
    tanh:  t = tanh(c (x + a x^3)); d/dx = 0.5 (1 + t) + 0.5 x (1 - t^2) c (1 + 3 a x^2), c = sqrt(2 / pi), a = 0.044715
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from bertjax.sharding import target_platform

_TANH_C = math.sqrt(2.0 / math.pi)
_TANH_A = 0.044715


def gelu(x, approximate: bool):
    """`jax.nn.gelu(x, approximate)`; off TPU its gradient recomputed from x alone. XLA:TPU is left its own
    differentiation: with this GELU (and LayerNorm over 2-D rows) its estimate of the bert-base-phase1 step on
    v5litepod-16 grew from 13.77 to 15.77 ms (docs/performance-history.md)."""
    if target_platform() == "tpu":
        return jax.nn.gelu(x, approximate=approximate)
    return _gelu_saving_input(x, approximate)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _gelu_saving_input(x, approximate: bool):
    return jax.nn.gelu(x, approximate=approximate)


def _forward(x, approximate):
    return _gelu_saving_input(x, approximate), x


def gelu_derivative(x, approximate: bool):
    """d gelu / dx at x, in float32."""
    x = x.astype(jnp.float32)
    if approximate:
        t = jnp.tanh(_TANH_C * (x + _TANH_A * x ** 3))
        return 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * _TANH_C * (1.0 + 3.0 * _TANH_A * x * x)
    return 0.5 * jax.lax.erfc(-x * math.sqrt(0.5)) + x * jnp.exp(-0.5 * x * x) * (1.0 / math.sqrt(2.0 * math.pi))


def _backward(approximate, x, g):
    return ((g.astype(jnp.float32) * gelu_derivative(x, approximate)).astype(x.dtype),)


_gelu_saving_input.defvjp(_forward, _backward)


def gelu_with_bias(h, bias, approximate: bool):
    """`gelu(h + bias)` for a matmul's output h and its bias (broadcast over the last axis): `jax.nn.gelu`'s bits.

    Off TPU the backward keeps h (in memory anyway, the matmul wrote it) and the bias, not their sum: the forward
    fusion then writes gelu(h + b) alone where it wrote h + b as well (BERT-base's feed-forward on an H200: one
    [B, L, 3072] tensor a layer). The backward recomputes h + b (the same bits) and returns the bias's gradient,
    summed in its dtype as autodiff's transposed broadcast sums it."""
    if target_platform() == "tpu":
        return jax.nn.gelu(h + bias, approximate=approximate)
    return _gelu_with_bias(h, bias, approximate)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _gelu_with_bias(h, bias, approximate: bool):
    return jax.nn.gelu(h + bias, approximate=approximate)


def _forward_with_bias(h, bias, approximate):
    return _gelu_with_bias(h, bias, approximate), (h, bias)


def _backward_with_bias(approximate, residuals, g):
    # The barrier keeps XLA from merging this h + bias with the forward's (CSE), which would make the forward
    # write the sum for the backward again.
    h, bias = jax.lax.optimization_barrier(residuals)
    x = h + bias
    dx = (g.astype(jnp.float32) * gelu_derivative(x, approximate)).astype(x.dtype)
    # Summed in dx's dtype as autodiff transposes the broadcast (jnp.sum would round through float32), so XLA
    # fuses the sum into the kernel that writes dx.
    summed = tuple(range(dx.ndim - bias.ndim))
    dbias = jax.lax.reduce(dx, jnp.zeros((), dx.dtype), jax.lax.add, summed)
    return dx.astype(h.dtype), dbias.astype(bias.dtype)


_gelu_with_bias.defvjp(_forward_with_bias, _backward_with_bias)


def gated_gelu(x, gate, approximate: bool):
    """GeGLU's product `jax.nn.gelu(x, approximate) * gate` (TPU's: x and gate the halves of Wi's [..., 2I] product,
    `modernbert.GatedMLP`): its bits. The backward keeps x and gate, not gelu(x) as autodiff did; XLA:TPU computes
    both gradients in the matmul that writes the product's cotangent (docs/performance.md)."""
    return _gated_gelu(x, gate, approximate)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _gated_gelu(x, gate, approximate: bool):
    return jax.nn.gelu(x, approximate=approximate) * gate


def _forward_gated(x, gate, approximate):
    return _gated_gelu(x, gate, approximate), (x, gate)


def _gated_gradients(x, gate, g, approximate):
    """(dx, dgate) of gelu(x) * gate for its cotangent g, in float32."""
    x, gate, g = (t.astype(jnp.float32) for t in (x, gate, g))
    return g * gate * gelu_derivative(x, approximate), g * jax.nn.gelu(x, approximate=approximate)


def _backward_gated(approximate, residuals, g):
    x, gate = residuals
    dx, dgate = _gated_gradients(x, gate, g, approximate)
    return dx.astype(x.dtype), dgate.astype(gate.dtype)


_gated_gelu.defvjp(_forward_gated, _backward_gated)


def gated_gelu_of_pair(y, approximate: bool):
    """`gated_gelu` of y [..., 2, width] = (x, gate), one projection's two outputs (off TPU: one Wi product): its
    bits. The backward keeps y and writes y's gradient, (dx, dgate), in one pass. Differentiated as written, the
    forward wrote gelu(x) as well (for gate's gradient), the backward read it in a pass of its own, and the two
    halves' gradients were joined in another (modernbert-base on an H200: docs/performance.md)."""
    return _gated_gelu_of_pair(y, approximate)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _gated_gelu_of_pair(y, approximate: bool):
    return jax.nn.gelu(y[..., 0, :], approximate=approximate) * y[..., 1, :]


def _forward_of_pair(y, approximate):
    return _gated_gelu_of_pair(y, approximate), y


def _after(x, g):
    """x, as a value XLA cannot compute on before g exists (x + 0 * one element of g: the same values, NaN where that
    element is not finite, when the gradient is not finite either). XLA:CPU computed the GELU's float32 parts of
    every layer's backward, which depend on the forward's y alone, right after the forward and held them to the
    backward: 4 of [tokens, 2 * intermediate] a layer, 0.63 of 2.93 GB of temporaries in a 3-layer
    ModernBERT-base step at 8192 tokens (bench/long_context.py). An optimization barrier does not order them:
    XLA:CPU removes barriers before it schedules."""
    return x + (0 * g.reshape(-1)[0]).astype(x.dtype)


def _backward_of_pair(approximate, y, g):
    # One elementwise kernel over y's elements, each operand repeated along the pair (x | x, gate | gate, g | g)
    # and the pair merged into the last axis: computed as two halves, XLA:GPU joined dx and dgate in passes of
    # their own; repeated along the pair's own axis, it wrote the GELU's float32 parts to memory.
    y = _after(y, g)
    pair_shape = y.shape
    both = lambda t: jnp.broadcast_to(t[..., None, :], pair_shape).reshape(*pair_shape[:-2], -1)
    dx, dgate = _gated_gradients(both(y[..., 0, :]), both(y[..., 1, :]), both(g), approximate)
    is_gate = jax.lax.broadcasted_iota(jnp.int32, dx.shape, dx.ndim - 1) >= pair_shape[-1]
    return (jnp.where(is_gate, dgate, dx).astype(y.dtype).reshape(pair_shape),)


_gated_gelu_of_pair.defvjp(_forward_of_pair, _backward_of_pair)
