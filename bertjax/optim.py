"""Optimizer and learning-rate schedule factory (optax).

BERT's recipe: AdamW (decoupled weight decay 0.01, not applied to LayerNorm parameters and biases), global-norm
clipping at 1.0, linear warmup to the peak learning rate then linear decay to 0 at the last step. The original
TF optimizer omits Adam's bias correction; `bias_correction=True` (the default) matches torch.optim.AdamW / HF.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import optax


def linear_warmup_linear_decay(learning_rate: float, num_train_steps: int, warmup_steps: int) -> optax.Schedule:
    """lr * step / warmup for step < warmup, then lr * (total - step) / (total - warmup), floored at 0.

    The same values as transformers.get_linear_schedule_with_warmup (step = number of updates done so far).
    """
    if num_train_steps <= 0:
        raise ValueError(f"num_train_steps must be positive, got {num_train_steps}")
    if not 0 <= warmup_steps <= num_train_steps:
        raise ValueError(f"warmup_steps must be in [0, num_train_steps={num_train_steps}], got {warmup_steps}")

    def schedule(step):
        step = jnp.asarray(step, jnp.float32)
        warm = step / max(warmup_steps, 1)
        decay = (num_train_steps - step) / max(num_train_steps - warmup_steps, 1)
        factor = jnp.where(step < warmup_steps, warm, jnp.maximum(decay, 0.0))
        return learning_rate * factor

    return schedule


def linear_warmup_cosine_decay(learning_rate: float, num_train_steps: int, warmup_steps: int) -> optax.Schedule:
    """Linear warmup to `learning_rate`, then half a cosine down to 0 at `num_train_steps`."""
    if not 0 <= warmup_steps <= num_train_steps:
        raise ValueError(f"warmup_steps must be in [0, num_train_steps={num_train_steps}], got {warmup_steps}")

    def schedule(step):
        step = jnp.asarray(step, jnp.float32)
        warm = step / max(warmup_steps, 1)
        progress = jnp.clip((step - warmup_steps) / max(num_train_steps - warmup_steps, 1), 0.0, 1.0)
        return learning_rate * jnp.where(step < warmup_steps, warm, 0.5 * (1.0 + jnp.cos(jnp.pi * progress)))

    return schedule


SCHEDULES = {"linear": linear_warmup_linear_decay, "cosine": linear_warmup_cosine_decay}


def decay_mask(params):
    """True for parameters that get weight decay: matrices (kernels, embeddings). LayerNorm scales/biases and
    all biases are vectors, so rank >= 2 is exactly BERT's "exclude LayerNorm and bias" rule."""
    return jax.tree_util.tree_map(lambda p: jnp.ndim(p) >= 2, params)


def _scale_by_adam_no_bias_correction(b1: float, b2: float, eps: float) -> optax.GradientTransformation:
    """Adam moments without bias correction (google-research/bert AdamWeightDecayOptimizer)."""

    def init(params):
        zeros = jax.tree_util.tree_map(jnp.zeros_like, params)
        return optax.ScaleByAdamState(count=jnp.zeros([], jnp.int32), mu=zeros, nu=zeros)

    def update(updates, state, params=None):
        del params
        mu = jax.tree_util.tree_map(lambda m, g: b1 * m + (1 - b1) * g, state.mu, updates)
        nu = jax.tree_util.tree_map(lambda v, g: b2 * v + (1 - b2) * g * g, state.nu, updates)
        out = jax.tree_util.tree_map(lambda m, v: m / (jnp.sqrt(v) + eps), mu, nu)
        return out, optax.ScaleByAdamState(count=state.count + 1, mu=mu, nu=nu)

    return optax.GradientTransformation(init, update)


def make_optimizer(learning_rate: float, num_train_steps: int, warmup_steps: int, *, weight_decay: float = 0.01,
                   b1: float = 0.9, b2: float = 0.999, eps: float = 1e-6, clip_norm: float | None = 1.0,
                   bias_correction: bool = True, name: str = "adamw",
                   decay: str = "linear") -> tuple[optax.GradientTransformation, optax.Schedule]:
    """(optimizer, schedule).

    `name`: "adamw" (BERT) or "lamb" (You et al.: the same Adam direction and decoupled decay, scaled per
    tensor by the trust ratio ||w|| / ||update||, as in large-batch recipes). `decay`: "linear" or "cosine"
    after the linear warmup.
    """
    if name not in ("adamw", "lamb"):
        raise ValueError(f"unknown optimizer {name!r}; expected 'adamw' or 'lamb'")
    if decay not in SCHEDULES:
        raise ValueError(f"unknown decay {decay!r}; expected one of {sorted(SCHEDULES)}")
    schedule = SCHEDULES[decay](learning_rate, num_train_steps, warmup_steps)
    adam = (optax.scale_by_adam(b1=b1, b2=b2, eps=eps) if bias_correction
            else _scale_by_adam_no_bias_correction(b1, b2, eps))
    chain = [optax.clip_by_global_norm(clip_norm)] if clip_norm else []
    chain += [adam, optax.add_decayed_weights(weight_decay, mask=decay_mask)]
    if name == "lamb":
        chain.append(optax.scale_by_trust_ratio())
    chain.append(optax.scale_by_learning_rate(schedule))
    return optax.chain(*chain), schedule
