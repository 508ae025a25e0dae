"""32-bit integer hashing for dropout masks: MurmurHash3's finaliser on int32 bits.

int32 arithmetic that wraps (the same bits as uint32) with logical shifts lowers to XLA's and Mosaic's 32-bit
vector ops alike, so a mask drawn in a Pallas kernel and one drawn in plain jnp are the same bits.
"""
from __future__ import annotations

import jax.numpy as jnp
from jax import lax


def i32(c: int) -> int:
    """A uint32 constant as the int32 with the same bits."""
    c &= 0xFFFFFFFF
    return c - (1 << 32) if c >= 1 << 31 else c


GOLDEN, C_HEAD, C_ADD = i32(0x9E3779B9), i32(0x85EBCA77), i32(0x632BE5AB)
_FMIX_1, _FMIX_2 = i32(0x85EBCA6B), i32(0xC2B2AE35)


def srl(x, n: int):
    """Logical (unsigned) right shift of int32 `x`."""
    return lax.shift_right_logical(x, jnp.full(jnp.shape(x), n, jnp.int32))


def fmix32(x):
    """MurmurHash3's 32-bit finaliser on int32 bits (wrapping multiplies, logical shifts): a bijection."""
    x = x ^ srl(x, 16)
    x = x * jnp.int32(_FMIX_1)
    x = x ^ srl(x, 13)
    x = x * jnp.int32(_FMIX_2)
    return x ^ srl(x, 16)


def below(u, bound: int):
    """Unsigned `u < bound` for int32 bits `u` and 0 <= bound < 2^32, as a signed compare (both sign bits flipped)."""
    return (u ^ jnp.int32(i32(0x80000000))) < jnp.int32(i32(bound - 2**31))
