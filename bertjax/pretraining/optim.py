"""Optimizer and learning-rate schedule factory (optax).

BERT's recipe: AdamW (decoupled weight decay 0.01, not applied to LayerNorm parameters and biases), global-norm
clipping at 1.0, linear warmup to the peak learning rate then linear decay to 0 at the last step. The original
TF optimizer omits Adam's bias correction; `bias_correction=True` (the default) matches torch.optim.AdamW / HF.
ModernBERT's: StableAdamW (`scale_by_stable_adam`) with fully decoupled weight decay (`decouple_lr`), the learning
rate warmed up, held (`decay=constant`), then taken to 0 by 1-sqrt in a decay phase of its own (a run started from
the stable phase's checkpoint with its optimizer state: `restart_schedule`).
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import optax

from bertjax.model import layer_layout
from bertjax.options import floats, ints, option, range_problems


# The decay after the warmup, as a factor of the peak at `progress` = (step - warmup) / (steps - warmup) in [0, 1].
DECAY_SHAPES = {
    "linear": lambda progress: 1.0 - progress,
    "cosine": lambda progress: 0.5 * (1.0 + jnp.cos(jnp.pi * progress)),
    # Hägele et al. 2024's cooldown, ModernBERT's decay phase (its one_minus_sqrt scheduler).
    "1-sqrt": lambda progress: 1.0 - jnp.sqrt(progress),
    # Held: the stable phase of warmup-stable-decay, the decay being a run of its own (`init_optimizer_state`).
    "constant": lambda progress: jnp.ones_like(progress),
}


def warmup_then_decay(decay: str, learning_rate: float, num_train_steps: int, warmup_steps: int) -> optax.Schedule:
    """lr * step / warmup for step < warmup, then lr * DECAY_SHAPES[decay](progress), progress = (step - warmup) /
    (num_train_steps - warmup) clipped to [0, 1]: 0 at the last step's end for every decay but constant.

    `step` = updates done so far. linear is transformers.get_linear_schedule_with_warmup; with warmup 0 a run is a
    decay phase of its own, from lr at its first update (lr * (1 - sqrt(t / steps)) for 1-sqrt).
    """
    if num_train_steps <= 0:
        raise ValueError(f"num_train_steps must be positive, got {num_train_steps}")
    if not 0 <= warmup_steps <= num_train_steps:
        raise ValueError(f"warmup_steps must be in [0, num_train_steps={num_train_steps}], got {warmup_steps}")
    shape = DECAY_SHAPES[decay]

    def schedule(step):
        step = jnp.asarray(step, jnp.float32)
        progress = jnp.clip((step - warmup_steps) / max(num_train_steps - warmup_steps, 1), 0.0, 1.0)
        return learning_rate * jnp.where(step < warmup_steps, step / max(warmup_steps, 1), shape(progress))

    return schedule


def decay_mask(params):
    """True for parameters that get weight decay: matrices (kernels, embeddings). LayerNorm scales/biases and
    all biases are vectors, so rank >= 2 is exactly BERT's "exclude LayerNorm and bias" rule (the layer axis of
    stacked layers, `model.scan_layers`, not counted)."""
    return jax.tree_util.tree_map_with_path(
        lambda path, p: jnp.ndim(p) - layer_layout.is_stacked_path(path) >= 2, params)


def clip_by_global_norm(max_norm: float) -> optax.GradientTransformation:
    """Gradients scaled by max_norm / max(global norm, max_norm): one scalar factor, as torch's clip_grad_norm_
    applies it (optax's, select(norm < max, g, g / norm * max), agrees to an ulp). A multiply by a scalar is fused
    into each of its uses (Adam's two moments), where optax's divide was materialised per tensor: a ModernBERT
    fine-tune's train step held a 148 MiB copy of its clipped embedding gradient (XLA:CPU's memory analysis,
    1,057 -> 909 MiB of temporaries). Below the threshold the factor is 1.0: the gradients unchanged, bit for bit."""

    def update(updates, state, params=None):
        del params
        norm = optax.tree.norm(updates)
        factor = max_norm / jnp.maximum(norm, max_norm)
        return jax.tree_util.tree_map(lambda g: g * factor.astype(g.dtype), updates), state

    return optax.GradientTransformation(optax.init_empty_state, update)


def scale_by_trust_ratio() -> optax.GradientTransformation:
    """LAMB's trust ratio (optax's), per tensor: per layer for stacked layers (vmapped over the layer axis), so
    scanned and unrolled models take the same steps."""
    inner = optax.scale_by_trust_ratio()

    def one(update, param):
        return inner.update(update, optax.EmptyState(), param)[0]

    def update(updates, state, params=None):
        scaled = jax.tree_util.tree_map_with_path(
            lambda path, u, p: (jax.vmap(one) if layer_layout.is_stacked_path(path) else one)(u, p), updates, params)
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


def scale_by_stable_adam(b1: float, b2: float, eps: float, weight_decay: float, mask) -> optax.GradientTransformation:
    """StableAdamW's update before the learning rate: Adam's bias-corrected direction plus decoupled weight decay,
    the sum divided per tensor by max(1, RMS_t), RMS_t = sqrt(mean(g_t^2 / max(v_t, eps^2))) with v_t the
    bias-corrected second moment after this step's gradient (so the step's learning rate, decay included, is
    lr_t / max(1, RMS_t): Adafactor's update clipping as Wortsman et al. 2023 put it into AdamW).

    optimi's StableAdamW (warner-benjamin/optimi, optimi/stableadamw.py, `_single_param_stableadamw` and
    `_foreach_stableadamw`; the optimizer ModernBERT trained with, its src/optimizer.py a copy that also logs grad
    norms): its moments are kept bias-corrected by debiased betas (beta_hat = beta (1 - beta^(t-1)) / (1 - beta^t)),
    which equal Adam's m_t / (1 - b1^t) and v_t / (1 - b2^t) held here by optax.scale_by_adam; eps is added to
    sqrt(v_t) in the step and its square floors v_t in the RMS; the RMS uses the bias-corrected v_t (at step 1,
    g^2 / v_1 = 1: no clipping), not the raw v_t its documentation's formula shows. The weight decay (`mask`: the
    tensors that get it) is multiplied by the clipped learning rate, as optimi scales it. Per tensor: per layer for
    stacked layers (`model.scan_layers` or not), as the torch model's tensors are. The state is
    optax.scale_by_adam's (AdamW's): the clipping keeps nothing of its own. Kahan summation (optimi's, for bf16
    params) is not needed: params are float32 here.
    """
    inner = optax.chain(optax.scale_by_adam(b1=b1, b2=b2, eps=eps), optax.add_decayed_weights(weight_decay, mask))

    def update(grads, state, params=None):
        updates, state = inner.update(grads, state, params)
        adam = state[0]
        nu_hat = optax.tree.bias_correction(adam.nu, b2, adam.count)

        def clipped(path, update, grad, nu):
            ratio = jnp.square(grad) / jnp.maximum(nu, eps ** 2)
            per_tensor = tuple(range(int(layer_layout.is_stacked_path(path)), ratio.ndim))
            rms = jnp.sqrt(jnp.mean(ratio, axis=per_tensor, keepdims=True))
            return update / jnp.maximum(1.0, rms)

        return jax.tree_util.tree_map_with_path(clipped, updates, grads, nu_hat), state

    return optax.GradientTransformation(inner.init, update)


def restart_schedule(opt_state, fresh_opt_state):
    """`opt_state` (a run's, restored) with the learning-rate schedule's position of `fresh_opt_state` (a new run's:
    0): its moments and Adam's own step count (its bias correction) kept. A phase that continues another's optimizer
    on a schedule of its own, as ModernBERT's context extension and decay did (their Composer runs loaded the
    optimizer state with `reset_time`)."""
    is_schedule = lambda node: isinstance(node, optax.ScaleByScheduleState)  # noqa: E731
    return jax.tree_util.tree_map(lambda old, new: new if is_schedule(old) else old, opt_state, fresh_opt_state,
                                  is_leaf=is_schedule)


OPTIMIZERS = ("adamw", "lamb", "stableadamw")


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
    """The optimizer and its schedule (a pretraining job's `optimizer.*` keys; BERT's recipe by default)."""

    name: str = option("adamw", "adamw (BERT) | lamb (You et al.: Adam direction and decoupled decay, scaled per "
                       "tensor by the trust ratio ||w|| / ||update||, as in large-batch recipes) | stableadamw "
                       "(ModernBERT's, optimi's: AdamW whose step is divided per tensor by max(1, RMS(g^2 / v)), "
                       "Adafactor's update clipping; it replaces gradient clipping: set clip_norm=0)")
    learning_rate: float = option(1e-4, "peak learning rate (0: every update is zero, the weights stay as they are)",
                                  valid=floats(0))
    warmup_steps: int = option(10_000, "linear warmup from 0", valid=ints(0))
    warmup_ratio: float = option(0.0, "the warmup as a share of the run's steps; > 0 replaces warmup_steps (so a "
                                 "changed train.steps needs no new warmup)", valid=floats(0, 1))
    decay: str = option("linear", "after warmup: linear | cosine | 1-sqrt (lr * (1 - sqrt(progress)); to 0 at the "
                        "last step) | constant (held: a stable phase, whose decay is a run of its own)")
    weight_decay: float = option(0.01, "decoupled, not applied to LayerNorm parameters and biases",
                                 valid=floats(0))
    decouple_lr: bool = option(False, "weight decay scaled by lr_t / learning_rate instead of by lr_t (fully "
                               "decoupled: optimi's decouple_lr, Composer's Decoupled* optimizers, whose "
                               "weight_decay 1e-5 ModernBERT and MosaicBERT mean)")
    b1: float = option(0.9, "Adam's beta1: decay of the first-moment (mean) estimate",
                       valid=floats(0, 1, high_open=True))
    b2: float = option(0.999, "Adam's beta2: decay of the second-moment (variance) estimate",
                       valid=floats(0, 1, high_open=True))
    eps: float = option(1e-6, "Adam's epsilon, added to the second moment's root (BERT's 1e-6)",
                        valid=floats(0, low_open=True))
    clip_norm: float = option(1.0, "global gradient-norm clip (0: none)", valid=floats(0))
    bias_correction: bool = option(True, "false: the original TF AdamWeightDecayOptimizer (no bias correction)")

    def __post_init__(self):
        if self.name not in OPTIMIZERS:
            raise ValueError(f"unknown optimizer {self.name!r}; expected one of {', '.join(OPTIMIZERS)}")
        if self.decay not in DECAY_SHAPES:
            raise ValueError(f"unknown decay {self.decay!r}; expected one of {', '.join(DECAY_SHAPES)}")
        if self.name == "stableadamw" and not self.bias_correction:
            raise ValueError("optimizer.name=stableadamw has Adam's bias correction (optimi's): "
                             "optimizer.bias_correction=false is AdamW's (the original TF optimizer's) alone")
        problems = range_problems(self)
        if problems:
            raise ValueError("optimizer: " + "; ".join(problems))

    def warmup_for(self, num_train_steps: int) -> int:
        """The warmup steps of a run of `num_train_steps`: warmup_ratio of them where set, else warmup_steps."""
        return int(round(self.warmup_ratio * num_train_steps)) if self.warmup_ratio else self.warmup_steps

    def sets_both_warmups(self) -> bool:
        """Whether the config gives both a warmup ratio and warmup steps other than the default (a config file or
        a run's config.json can hold both: the ratio applies, which a run says in a line)."""
        return bool(self.warmup_ratio) and self.warmup_steps != OptimizerConfig.warmup_steps

    def warmup_note(self, num_train_steps: int) -> str:
        """Which of the two warmup keys sets the warmup of a run of `num_train_steps` (a config holds both)."""
        if self.warmup_ratio:
            return (f"optimizer.warmup_ratio={self.warmup_ratio:g} applies: {self.warmup_for(num_train_steps):,} "
                    f"warmup steps of train.steps={num_train_steps:,}; optimizer.warmup_steps="
                    f"{self.warmup_steps} is not used")
        return f"optimizer.warmup_steps={self.warmup_steps} applies (optimizer.warmup_ratio is 0)"


def make_optimizer(config: OptimizerConfig, num_train_steps: float, steps_done=None) -> tuple[
        optax.GradientTransformation, optax.Schedule]:
    """(optimizer, schedule) for `num_train_steps` updates. `steps_done`: the schedule's clock, the update count ->
    the updates' worth done, `num_train_steps` then in its units (a batch-size warmup's: full steps' worth of
    tokens, batch_schedule.py); None: the count itself."""
    schedule = warmup_then_decay(config.decay, config.learning_rate, num_train_steps,
                                 config.warmup_for(num_train_steps))
    if steps_done is not None:
        schedule = (lambda count, by_steps=schedule: by_steps(steps_done(count)))  # noqa: E731
    # Fully decoupled: lr_t * (weight_decay / peak) = (lr_t / peak) * weight_decay, optimi's and Composer's decay.
    # At a peak of 0 (continued pretraining that only exports) no update is made, decay included.
    weight_decay = ((config.weight_decay / config.learning_rate if config.learning_rate else 0.0)
                    if config.decouple_lr else config.weight_decay)
    chain = [clip_by_global_norm(config.clip_norm)] if config.clip_norm else []
    if config.name == "stableadamw":
        chain.append(scale_by_stable_adam(config.b1, config.b2, config.eps, weight_decay, decay_mask))
    else:
        adam = (optax.scale_by_adam(b1=config.b1, b2=config.b2, eps=config.eps) if config.bias_correction
                else _scale_by_adam_no_bias_correction(config.b1, config.b2, config.eps))
        chain += [adam, optax.add_decayed_weights(weight_decay, mask=decay_mask)]
    if config.name == "lamb":
        chain.append(scale_by_trust_ratio())
    chain.append(optax.scale_by_learning_rate(schedule))
    return optax.chain(*chain), schedule
