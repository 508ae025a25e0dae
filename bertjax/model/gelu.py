"""GELU whose backward keeps only its input: the derivative is recomputed from x, not read back from memory.

Differentiated as written, `jax.nn.gelu` leaves its intermediates (erfc's or tanh's value, x's square...) for the
backward pass: on XLA:GPU the BERT-base feed-forward's GELU wrote three [B, L, 3072] tensors per layer (the H200
profile, /work/shared/gpu). Here (off TPU) the forward is `jax.nn.gelu` itself (the same bits), the residual is x
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
    v5litepod-16 grew from 13.77 to 15.77 ms (docs/performance.md)."""
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
