"""Rotary position embeddings (Su et al. 2021) as transformers' ModernBERT (and Llama) compute them.

Frequencies inv_freq[j] = 1 / theta^(2j / d) for j < d / 2, angles position * inv_freq repeated over both halves
of the head (not interleaved), and x rotated as x * cos + rotate_half(x) * sin with rotate_half([a, b]) = [-b, a],
all in float32 and the result cast back to x's dtype (HF's `apply_rotary_pos_emb`). Positions are per token: packed
rows restart them at each sequence, so a packed sequence sees the rotations it would see alone.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def inverse_frequencies(head_dim: int, theta: float) -> np.ndarray:
    """float32 [head_dim / 2]: 1 / theta^(2j / head_dim), computed in float32 as torch does."""
    exponents = np.arange(0, head_dim, 2, dtype=np.float32) / np.float32(head_dim)
    return (np.float32(1.0) / np.power(np.float32(theta), exponents)).astype(np.float32)


def cos_sin(positions, head_dim: int, theta: float):
    """(cos, sin), float32 [..., head_dim] for int positions [...]."""
    angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(inverse_frequencies(head_dim, theta))
    angles = jnp.concatenate([angles, angles], axis=-1)
    return jnp.cos(angles), jnp.sin(angles)


def rotate_half(x, head_dim: int):
    """Each head's [a, b] as [-b, a] along the last axis, x [..., heads * head_dim] (the heads side by side)."""
    halves = x.reshape(x.shape[:-1] + (x.shape[-1] // head_dim, 2, head_dim // 2))
    return jnp.stack([-halves[..., 1, :], halves[..., 0, :]], axis=-2).reshape(x.shape)


def rotate(x, x_rotated, cos, sin, head_dim: int):
    """RoPE from x [batch, length, heads * head_dim] and its half rotation (`rotate_half(x)`, however computed):
    x * cos + x_rotated * sin with (cos, sin) [batch or 1, length, head_dim] tiled over the heads, in float32 and
    rounded once to x's dtype, as transformers computes it (q.float() * cos + ...; under autocast its tables are
    float32). In x's dtype, a bfloat16 model rounded each product and the sum."""
    heads = x.shape[-1] // head_dim
    cos, sin = (jnp.tile(t, heads).astype(jnp.float32) for t in (cos, sin))
    return (x.astype(jnp.float32) * cos + x_rotated.astype(jnp.float32) * sin).astype(x.dtype)


def apply_rotary(x, cos, sin, head_dim: int):
    """x [batch, length, heads * head_dim] rotated by (cos, sin) [batch or 1, length, head_dim]."""
    return rotate(x, rotate_half(x, head_dim), cos, sin, head_dim)
