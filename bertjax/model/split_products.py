"""A fused projection's products taken apart, x W[:, i] for each i, with one matmul for each gradient.

Differentiated as written, the input gradient of n products is n matmuls summed, and XLA:TPU fuses each partial sum
into the next matmul, a fusion it prices at ~1.8x the matmul's FLOPs at peak (q/k/v in the budget step on v5e:
1.07 ms a layer where one matmul over all three takes 0.63). Here the backward stacks the n cotangents and
contracts them with the whole kernel [in, n, width], once for the input and once for the kernel; the stacking is
fused into the matmuls' operands when the cotangents come from kernels of their own (attention's and RoPE's on TPU:
an elementwise producer would write the stack out). XLA:GPU writes the stack in the fusion that rotates q's and k's
gradients back, where it wrote those two and then read three products to sum them."""
from __future__ import annotations

import jax
import jax.numpy as jnp


@jax.custom_vjp
def split_products(x, kernel):
    """(x @ kernel[:, 0], ..., x @ kernel[:, n - 1]) for x [..., in] and kernel [in, n, width], in their dtype."""
    return tuple(x @ kernel[:, i] for i in range(kernel.shape[1]))


def _forward(x, kernel):
    return split_products(x, kernel), (x, kernel)


def _backward(residuals, cotangents):
    x, kernel = residuals
    stacked = jnp.stack([c.astype(x.dtype) for c in cotangents], axis=-2)
    dx = jnp.einsum("...nw,hnw->...h", stacked, kernel)
    dkernel = jnp.einsum("...h,...nw->hnw", x, stacked)
    return dx.astype(x.dtype), dkernel.astype(kernel.dtype)


split_products.defvjp(_forward, _backward)
