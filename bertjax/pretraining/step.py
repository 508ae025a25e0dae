"""The pretraining objective and the sharded, jitted train and eval steps.

The MLM, NSP and (SpanBERT) SBO losses are computed as sums and normalised by the whole step's totals (masked tokens,
instances), so gradient accumulation over microbatches equals one big batch exactly, and packed rows equal the same
instances unpacked; a non-finite gradient skips the update and is counted.
"""
from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from bertjax import sharding
from bertjax.model import bert as model_lib
from bertjax.model import family
from bertjax.pretraining import update_sharding as update_sharding_lib
from bertjax.pretraining import xla_options
from bertjax.pretraining.state import TrainState
from bertjax.sharding import target_platform


class TooManyNonFiniteSteps(RuntimeError):
    """Raised by a training loop after too many non-finite gradients in a row (each one skipped its update)."""


def _token_nll(logits, labels):
    """(negative log-likelihood of `labels`, whether the argmax is the label), float32.

    Through `_nll_and_hit`, whose backward writes the logits' gradient in one pass: differentiated as written, the
    label's pick became a scatter-add into a zeroed float32 [tokens, vocab] array and log_softmax's backward read
    it again (BERT-base's MLM head on an H200: ~3.8 GB a step; on v5e the phase-1 step 13.8 -> 13.6 ms, and
    ModernBERT's 30% of 1024 tokens against a 50k vocabulary a sixth of a 3-layer step, docs/performance.md)."""
    return _nll_and_hit(target_platform() == "gpu", logits, labels)


def _online_softmax_combine(a, b):
    """Two partial reductions of a row, each (max, first index of the max, sum of exp(x - max), label's logit),
    as one: the smaller max's sum rescaled by exp(its max - the max) (online softmax). Associative and
    commutative, as lax.reduce needs; an empty part (-inf, ...) adds nothing."""
    (max_a, index_a, sum_a, label_a), (max_b, index_b, sum_b, label_b) = a, b
    a_first = (max_a > max_b) | ((max_a == max_b) & (index_a < index_b))
    a_larger = max_a >= max_b
    top = jnp.maximum(max_a, max_b)
    low_max, low_sum = jnp.where(a_larger, max_b, max_a), jnp.where(a_larger, sum_b, sum_a)
    rescaled = jnp.where(low_max == -jnp.inf, 0.0, low_sum * jnp.exp(low_max - top))
    return (top, jnp.where(a_first, index_a, index_b), jnp.where(a_larger, sum_a, sum_b) + rescaled,
            label_a + label_b)


def _log_softmax_parts(logits, labels, one_pass: bool):
    """(max, log of the sum of exp(logits - max), the label's logit, whether the label is the argmax) of each row,
    in float32: log_softmax = (logits - max) - log_sum, as jax.nn.log_softmax computes it.

    `one_pass` (GPU): one variadic reduction (online softmax), its sum rounded in another order (float32 ulps).
    Reduced as written (max, exp(x - max) summed, argmax, the label picked), XLA:GPU read BERT-base's [5120,
    30522] MLM logits four times (1.26 GB a step on an H200). XLA:CPU runs a variadic reduction as one serial
    loop (slower, and its sum rounds worse), so the CPU keeps the separate reductions."""
    x = logits.astype(jnp.float32)
    if not one_pass:
        top = x.max(-1)
        log_sum = jnp.log(jnp.sum(jnp.exp(x - top[..., None]), axis=-1))
        label_logit = jnp.take_along_axis(x, labels[..., None], axis=-1)[..., 0]
        # The label's logit is the max: argmax's hit (but for an exact tie, which counts here), without argmax's
        # (max, index) reduction, which XLA:TPU ran as a pass of its own over the logits (~2% of ModernBERT's
        # priced budget step).
        return top, log_sum, label_logit, label_logit == top
    column = jax.lax.broadcasted_iota(jnp.int32, x.shape, x.ndim - 1)
    label_logit = jnp.where(column == labels[..., None], x, 0.0)  # its row's one nonzero term: the sum is exact
    init = (jnp.float32(-jnp.inf), jnp.int32(x.shape[-1]), jnp.float32(0.0), jnp.float32(0.0))
    top, first_max, total, label_logit = jax.lax.reduce((x, column, jnp.ones_like(x), label_logit), init,
                                                        _online_softmax_combine, (x.ndim - 1,))
    return top, jnp.log(total), label_logit, first_max == labels


def _nll_and_hit_forward(one_pass, logits, labels):
    # The residuals are the logits themselves (the matmul's output, in memory anyway; XLA adds the bias again
    # where they are read) and two floats a token: no [tokens, vocab] array is written for the backward.
    top, log_sum, label_logit, hit = _log_softmax_parts(logits, labels, one_pass)
    nll = -((label_logit - top) - log_sum)
    return (nll, hit), (logits, labels, top[..., None], log_sum[..., None])


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _nll_and_hit(one_pass, logits, labels):
    """`_token_nll`'s values: the nll as jax.nn.log_softmax's (`_log_softmax_parts`), the hit argmax(logits) ==
    label (an exact tie for the max: a hit, or on a GPU only at its first index); its backward is
    `_nll_and_hit_backward`."""
    return _nll_and_hit_forward(one_pass, logits, labels)[0]


def _nll_and_hit_backward(one_pass, residuals, cotangents):
    """d nll / d logits = softmax - onehot(label), times the nll's cotangent: one elementwise pass over the logits
    (the one-hot an iota compare, not a scatter)."""
    logits, labels, top, log_sum = residuals
    g = cotangents[0]
    softmax = jnp.exp((logits.astype(jnp.float32) - top) - log_sum)
    onehot = jnp.arange(logits.shape[-1]) == labels[..., None]
    return (g[..., None] * (softmax - onehot)).astype(logits.dtype), None


_nll_and_hit.defvjp(_nll_and_hit_forward, _nll_and_hit_backward)


def pretraining_sums(outputs: dict, batch: dict) -> dict:
    """Sums (not means) of the MLM, NSP (and SBO) losses and hits over a batch, so microbatches add up exactly.

    The SBO predicts the same masked tokens as the MLM, so it shares the MLM weights and normaliser."""
    labels = batch["masked_lm_ids"].astype(jnp.int32)
    weights = batch["masked_lm_weights"].astype(jnp.float32)
    mlm_nll, mlm_hit = _token_nll(outputs["mlm_logits"], labels)
    nsp_weights = _nsp_weights(batch)
    sums = {
        "mlm_loss_sum": jnp.sum(mlm_nll * weights),
        "mlm_correct": jnp.sum(mlm_hit * weights),
        "mlm_weight": jnp.sum(weights),
        "nsp_count": jnp.sum(nsp_weights),  # the instances, NSP head or not (throughput, FLOPs)
        "real_tokens": jnp.sum(batch["input_mask"].astype(jnp.float32)),
        "positions": jnp.asarray(batch["input_mask"].size, jnp.float32),
    }
    if "nsp_logits" in outputs:  # BERT's; ModernBERT's objective is MLM alone
        # One NSP prediction per instance: per row unpacked, per filled slot of a packed row.
        nsp_logp = jax.nn.log_softmax(outputs["nsp_logits"].astype(jnp.float32).reshape(-1, 2), axis=-1)
        nsp_labels = batch["next_sentence_labels"].reshape(-1).astype(jnp.int32)
        nsp_nll = -jnp.take_along_axis(nsp_logp, nsp_labels[:, None], axis=-1)[:, 0]
        sums.update(nsp_loss_sum=jnp.sum(nsp_nll * nsp_weights),
                    nsp_correct=jnp.sum((nsp_logp.argmax(-1) == nsp_labels) * nsp_weights))
    if "sbo_logits" in outputs:
        sbo_nll, sbo_hit = _token_nll(outputs["sbo_logits"], labels)
        sums.update(sbo_loss_sum=jnp.sum(sbo_nll * weights), sbo_correct=jnp.sum(sbo_hit * weights))
    return sums


def _nsp_weights(batch: dict):
    """1 per real instance: every row unpacked, the filled slots of packed rows."""
    if "next_sentence_weights" in batch:
        return batch["next_sentence_weights"].reshape(-1).astype(jnp.float32)
    return jnp.ones(batch["next_sentence_labels"].size, jnp.float32)


def _objective(sums: dict, total_weight, total_count, nsp_loss: bool):
    """Weighted mean MLM cross-entropy (+ SBO's, over the same tokens) (+ mean NSP cross-entropy), normalised by
    the whole step's totals."""
    loss = sums["mlm_loss_sum"] / total_weight
    if "sbo_loss_sum" in sums:
        loss = loss + sums["sbo_loss_sum"] / total_weight
    if nsp_loss:
        loss = loss + sums["nsp_loss_sum"] / total_count
    return loss


def summarize(sums: dict, nsp_loss: bool) -> dict:
    weight = jnp.maximum(sums["mlm_weight"], 1e-5)
    count = jnp.maximum(sums["nsp_count"], 1.0)
    out = {"mlm_loss": sums["mlm_loss_sum"] / weight, "mlm_accuracy": sums["mlm_correct"] / weight}
    out["loss"] = out["mlm_loss"]
    if nsp_loss:  # without it the NSP head is untrained: its accuracy would only be a coin's, shown as a metric
        out.update(nsp_loss=sums["nsp_loss_sum"] / count, nsp_accuracy=sums["nsp_correct"] / count)
        out["loss"] = out["loss"] + out["nsp_loss"]
    if "sbo_loss_sum" in sums:
        out.update(sbo_loss=sums["sbo_loss_sum"] / weight, sbo_accuracy=sums["sbo_correct"] / weight)
        out["loss"] = out["loss"] + out["sbo_loss"]
    return out


def compute_layout(model, params):
    """The params as `model` computes with them: the state holds the layers stacked; an unrolled model takes them
    per layer (slices of the stacked tensors)."""
    return model_lib.with_layout(params, model.config, stacked=model.config.scan_layers)


def forward(model, params, batch: dict, *, deterministic: bool, rng=None):
    """The pretraining outputs for a batch dict, packed or not (its optional packing and span features passed on);
    `params` in either layer layout."""
    return model.apply({"params": compute_layout(model, params)}, batch["input_ids"], batch["input_mask"],
                       batch["segment_ids"], batch["masked_lm_positions"], packing_ids=batch.get("packing_ids"),
                       position_ids=batch.get("position_ids"), nsp_positions=batch.get("instance_cls_positions"),
                       span_left_positions=batch.get("span_left_positions"),
                       span_right_positions=batch.get("span_right_positions"), deterministic=deterministic,
                       rngs=None if deterministic else {"dropout": rng})


def skip_by_select(platform: str) -> bool:
    """Whether the non-finite skip is a select fused into the update (TPU, GPU) rather than a branch (CPU).

    XLA:TPU's estimate (2-layer BERT-base, 16 sequences per v5e chip): the branch's update 3.66 M cycles, 32% of
    the step, the select version 2.14 M (-16% of the step): inside a conditional the update is not fused with
    its neighbours and every tensor makes extra HBM passes. On the CPU the select is the slower (3.80 -> 3.97 s
    per BERT-base step): it keeps old and new params and moments alive together, and XLA:CPU copies them.
    """
    return platform != "cpu"


def train_step(state: TrainState, batch: dict, *, model: nn.Module, optimizer: optax.GradientTransformation,
               schedule, grad_accum_steps: int = 1, nsp_loss: bool, skip_nonfinite: str | None = None,
               update_sharding: update_sharding_lib.UpdateSharding | None = None, microbatch_rows: int | None = None):
    """One optimizer update over the global batch (split into `grad_accum_steps` microbatches, or where
    `microbatch_rows` is given, into as many microbatches of that many rows as the batch holds: a batch-size
    warmup's smaller steps are programs of fewer microbatches of the same shape).

    A non-finite gradient skips the update (params and optimizer state unchanged) and is counted, by a branch
    (`skip_nonfinite="cond"`) or a select per leaf ("select"); None: the faster of the two on the platform the
    step is compiled for (`skip_by_select`). `update_sharding`: the params and moments live split over the data
    axis; each replica's gradients are computed from the gathered params and reduce-scattered, and the update runs
    on the slices (`update_sharding.py`).
    """
    accum = grad_accum_steps
    if microbatch_rows:
        rows = batch["input_ids"].shape[0]
        if rows % microbatch_rows:
            raise ValueError(f"a batch of {rows} rows is not a whole number of {microbatch_rows}-row microbatches")
        accum = rows // microbatch_rows
    total_weight = jnp.maximum(jnp.sum(batch["masked_lm_weights"].astype(jnp.float32)), 1e-5)
    total_count = jnp.maximum(jnp.sum(_nsp_weights(batch)), 1.0)

    def grads_and_sums(params, rows, rng_data, step, total_weight, total_count):
        """Gradients (microbatches summed in float32) and loss sums of these rows, normalised by the totals."""
        step_rng = jax.random.fold_in(jax.random.wrap_key_data(rng_data), step)

        def micro_step(micro, index):
            def loss_fn(params):
                outputs = forward(model, params, micro, deterministic=False,
                                  rng=jax.random.fold_in(step_rng, index))
                sums = pretraining_sums(outputs, micro)
                return _objective(sums, total_weight, total_count, nsp_loss), sums
            (_, sums), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
            return grads, sums

        if accum == 1:
            return micro_step(rows, 0)
        params = family.loop_invariant_params(params, model.config)   # casts once a step, not per microbatch
        # Rows j*accum + i form microbatch i, so every device holds an equal share of each microbatch.
        micro_batches = jax.tree_util.tree_map(
            lambda x: jnp.swapaxes(x.reshape((x.shape[0] // accum, accum) + x.shape[1:]), 0, 1), rows)

        def body(carry, inputs):
            index, micro = inputs
            grads, sums = micro_step(micro, index)
            grads = jax.tree_util.tree_map(lambda g: g.astype(jnp.float32), grads)
            return jax.tree_util.tree_map(jnp.add, carry, (grads, sums)), None

        shapes = jax.eval_shape(lambda: micro_step(jax.tree_util.tree_map(lambda x: x[0], micro_batches), 0))
        zeros = jax.tree_util.tree_map(lambda x: jnp.zeros(x.shape, jnp.float32 if jnp.issubdtype(
            x.dtype, jnp.floating) else x.dtype), shapes)
        (grads, sums), _ = jax.lax.scan(body, zeros, (jnp.arange(accum), micro_batches))
        return grads, sums

    scalars = (state.rng, state.step, total_weight, total_count)
    compute_params = compute_layout(model, state.params)
    if update_sharding is None:
        grads, sums = grads_and_sums(compute_params, batch, *scalars)
    else:
        grads, sums = update_sharding_lib.local_gradients(
            update_sharding, grads_and_sums, update_sharding_lib.gather(update_sharding, compute_params), batch,
            *scalars)
    params = state.params
    grads = model_lib.with_layout(grads, model.config, stacked=model_lib.is_stacked(params))
    grad_norm = optax.tree.norm(grads)
    finite = jnp.isfinite(grad_norm)

    def update(params, opt_state, grads):
        updates, new_opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), new_opt_state

    # The clipping inside the optimizer recomputes the norm (~1% of the step); left, as the optimizer is shared
    # with fine-tuning.
    if skip_nonfinite is None:
        skip_nonfinite = "select" if skip_by_select(target_platform()) else "cond"
    if skip_nonfinite == "select":
        new_params, new_opt_state = update(params, state.opt_state, grads)
        keep = lambda new, old: jnp.where(finite, new, old)
        new_params = jax.tree_util.tree_map(keep, new_params, params)
        new_opt_state = jax.tree_util.tree_map(keep, new_opt_state, state.opt_state)
    else:
        new_params, new_opt_state = jax.lax.cond(finite, update,
                                                 lambda params, opt_state, grads: (params, opt_state),
                                                 params, state.opt_state, grads)
    nonfinite = (~finite).astype(jnp.int32)
    new_state = state.replace(
        step=state.step + 1,
        params=new_params,
        opt_state=new_opt_state,
        nonfinite_total=state.nonfinite_total + nonfinite,
        nonfinite_consecutive=jnp.where(finite, 0, state.nonfinite_consecutive + 1))
    step_metrics = summarize(sums, nsp_loss)
    step_metrics["padding_fraction"] = 1.0 - sums["real_tokens"] / sums["positions"]
    # Counts the loop sums over a logging interval for throughput and MFU (real tokens only).
    step_metrics.update(real_tokens=sums["real_tokens"], masked_tokens=sums["mlm_weight"],
                        instances=sums["nsp_count"])
    step_metrics.update(grad_norm=grad_norm, learning_rate=schedule(state.step),
                        nonfinite_total=new_state.nonfinite_total.astype(jnp.float32),
                        nonfinite_consecutive=new_state.nonfinite_consecutive.astype(jnp.float32))
    return new_state, step_metrics


def eval_sums(params, batch: dict, *, model: nn.Module) -> dict:
    """MLM/NSP loss and hit sums on a batch, without dropout."""
    return pretraining_sums(forward(model, params, batch, deterministic=True), batch)


def compile_steps(*, model, optimizer, schedule, grad_accum_steps: int = 1, nsp_loss: bool, state_shardings_tree,
                  mesh, update_sharding=None, microbatch_rows: int | None = None):
    """The jitted train step (state donated) and eval step, with batches split over data x fsdp; with
    `microbatch_rows`, one compiled program per batch size (train_step)."""
    batch_sharding = sharding.batch_sharding(mesh)
    train = jax.jit(
        functools.partial(train_step, model=model, optimizer=optimizer, schedule=schedule,
                          grad_accum_steps=grad_accum_steps, nsp_loss=nsp_loss, update_sharding=update_sharding,
                          microbatch_rows=microbatch_rows),
        in_shardings=(state_shardings_tree, batch_sharding),
        out_shardings=(state_shardings_tree, sharding.replicated(mesh)),
        donate_argnums=(0,), compiler_options=xla_options.compiler_options(mesh))
    evaluate = jax.jit(functools.partial(eval_sums, model=model),
                       in_shardings=(state_shardings_tree.params, batch_sharding),
                       out_shardings=sharding.replicated(mesh))
    return train, evaluate
