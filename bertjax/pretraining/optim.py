"""Optimizer and learning-rate schedule factory (optax).

BERT's recipe: AdamW (decoupled weight decay 0.01, not applied to LayerNorm parameters and biases), global-norm
clipping at 1.0, linear warmup to the peak learning rate then linear decay to 0 at the last step. The original
TF optimizer omits Adam's bias correction; `bias_correction=True` (the default) matches torch.optim.AdamW / HF.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import optax

from bertjax.model import bert as model_lib
from bertjax.options import floats, ints, option, range_problems


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


def linear_warmup_constant(learning_rate: float, num_train_steps: int, warmup_steps: int) -> optax.Schedule:
    """Linear warmup to `learning_rate`, then held there: the stable phase of a warmup-stable-decay ("trapezoidal")
    schedule, as ModernBERT's pretraining ran (its decay came with the context extension that followed)."""
    if not 0 <= warmup_steps <= num_train_steps:
        raise ValueError(f"warmup_steps must be in [0, num_train_steps={num_train_steps}], got {warmup_steps}")

    def schedule(step):
        step = jnp.asarray(step, jnp.float32)  # no warmup: the peak from the first step, as the linear decay's
        return learning_rate * jnp.where(step < warmup_steps, step / max(warmup_steps, 1), 1.0)

    return schedule


SCHEDULES = {"linear": linear_warmup_linear_decay, "cosine": linear_warmup_cosine_decay,
             "constant": linear_warmup_constant}


def decay_mask(params):
    """True for parameters that get weight decay: matrices (kernels, embeddings). LayerNorm scales/biases and
    all biases are vectors, so rank >= 2 is exactly BERT's "exclude LayerNorm and bias" rule (the layer axis of
    stacked layers, `model.scan_layers`, not counted)."""
    return jax.tree_util.tree_map_with_path(
        lambda path, p: jnp.ndim(p) - model_lib.is_stacked_path(path) >= 2, params)


def scale_by_trust_ratio() -> optax.GradientTransformation:
    """LAMB's trust ratio (optax's), per tensor: per layer for stacked layers (vmapped over the layer axis), so
    scanned and unrolled models take the same steps."""
    inner = optax.scale_by_trust_ratio()

    def one(update, param):
        return inner.update(update, optax.EmptyState(), param)[0]

    def update(updates, state, params=None):
        scaled = jax.tree_util.tree_map_with_path(
            lambda path, u, p: (jax.vmap(one) if model_lib.is_stacked_path(path) else one)(u, p), updates, params)
        return scaled, state

    return optax.GradientTransformation(lambda params: optax.EmptyState(), update)


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


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
    """The optimizer and its schedule (a pretraining job's `optimizer.*` keys; BERT's recipe by default)."""

    name: str = option("adamw", "adamw (BERT) | lamb (You et al.: Adam direction and decoupled decay, scaled per "
                       "tensor by the trust ratio ||w|| / ||update||, as in large-batch recipes)")
    learning_rate: float = option(1e-4, "peak learning rate (0: every update is zero, the weights stay as they are)",
                                  valid=floats(0))
    warmup_steps: int = option(10_000, "linear warmup from 0", valid=ints(0))
    warmup_ratio: float = option(0.0, "the warmup as a share of the run's steps; > 0 replaces warmup_steps (so a "
                                 "changed train.steps needs no new warmup)", valid=floats(0, 1))
    decay: str = option("linear", "after warmup: linear | cosine (to 0 at the last step) | constant (held)")
    weight_decay: float = option(0.01, "decoupled, not applied to LayerNorm parameters and biases",
                                 valid=floats(0))
    b1: float = option(0.9, "Adam's beta1: decay of the first-moment (mean) estimate",
                       valid=floats(0, 1, high_open=True))
    b2: float = option(0.999, "Adam's beta2: decay of the second-moment (variance) estimate",
                       valid=floats(0, 1, high_open=True))
    eps: float = option(1e-6, "Adam's epsilon, added to the second moment's root (BERT's 1e-6)",
                        valid=floats(0, low_open=True))
    clip_norm: float = option(1.0, "global gradient-norm clip (0: none)", valid=floats(0))
    bias_correction: bool = option(True, "false: the original TF AdamWeightDecayOptimizer (no bias correction)")

    def __post_init__(self):
        if self.name not in ("adamw", "lamb"):
            raise ValueError(f"unknown optimizer {self.name!r}; expected 'adamw' or 'lamb'")
        if self.decay not in SCHEDULES:
            raise ValueError(f"unknown decay {self.decay!r}; expected one of {sorted(SCHEDULES)}")
        problems = range_problems(self)
        if problems:
            raise ValueError("optimizer: " + "; ".join(problems))

    def warmup_for(self, num_train_steps: int) -> int:
        """The warmup steps of a run of `num_train_steps`: warmup_ratio of them where set, else warmup_steps."""
        return int(round(self.warmup_ratio * num_train_steps)) if self.warmup_ratio else self.warmup_steps

    def warmup_note(self, num_train_steps: int) -> str:
        """Which of the two warmup keys sets the warmup of a run of `num_train_steps` (a config holds both)."""
        if self.warmup_ratio:
            return (f"optimizer.warmup_ratio={self.warmup_ratio:g} applies: {self.warmup_for(num_train_steps):,} "
                    f"warmup steps of train.steps={num_train_steps:,}; optimizer.warmup_steps="
                    f"{self.warmup_steps} is not used")
        return f"optimizer.warmup_steps={self.warmup_steps} applies (optimizer.warmup_ratio is 0)"


def make_optimizer(config: OptimizerConfig, num_train_steps: int) -> tuple[optax.GradientTransformation,
                                                                           optax.Schedule]:
    """(optimizer, schedule) for `num_train_steps` updates."""
    schedule = SCHEDULES[config.decay](config.learning_rate, num_train_steps, config.warmup_for(num_train_steps))
    adam = (optax.scale_by_adam(b1=config.b1, b2=config.b2, eps=config.eps) if config.bias_correction
            else _scale_by_adam_no_bias_correction(config.b1, config.b2, config.eps))
    chain = [optax.clip_by_global_norm(config.clip_norm)] if config.clip_norm else []
    chain += [adam, optax.add_decayed_weights(config.weight_decay, mask=decay_mask)]
    if config.name == "lamb":
        chain.append(scale_by_trust_ratio())
    chain.append(optax.scale_by_learning_rate(schedule))
    return optax.chain(*chain), schedule
