"""The fine-tuning loop shared by the GLUE and SQuAD jobs: params from a pretrained encoder, jitted train and
predict steps on a data-parallel mesh, batches padded to a few length buckets.

Batches always have `batch_size` rows (a short last batch is padded with rows of weight 0, and the loss is the
weighted mean), so every step has one of at most max_len / bucket shapes and nothing recompiles per batch.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import sys
import time
from typing import Callable

import flax.linen as nn
from flax import traverse_util
import jax
import jax.numpy as jnp
import numpy as np
import optax
from etils import epath

from bertjax import options, sharding
from bertjax.runtime import compile_cache, host_memory, workdir_paths
from bertjax.checkpoint import (
    BEST,
    BEST_PARAMS,
    OPT_STATE,
    PARAMS,
    ModelCheckpoint,
    StepCheckpointer,
    merge_params,
    orbax_path,
    save_model,
)
from bertjax.runtime.console import Console, LineSchedule, Progress, duration, metric_text
from bertjax.runtime.errors import OutputWriteError
from bertjax.finetune.run_record import TRAIN_STATE
from bertjax.finetune.settings import TrainSettings, greater_is_better
from bertjax.interop.hf import export_hf
from bertjax.model import layer_layout
from bertjax.model import family, shapes
from bertjax.model.family import init_params
from bertjax.runtime.preemption import PreemptionFlag, stopped_line
from bertjax.pretraining.metrics import MetricsWriter
from bertjax.pretraining.optim import OptimizerConfig, make_optimizer
from bertjax.pretraining.step import TooManyNonFiniteSteps

INPUT_KEYS = ("input_ids", "input_mask", "segment_ids")


class Preempted(Exception):
    """A fine-tune stopped by a signal after saving its training state; its message is the job's last line (the
    command exits preemption.STOPPED_EXIT; the same command run again resumes)."""


class TrainStateSaver:
    """The fine-tune's params and optimizer state (and the best evaluation's, with --metric-for-best) at
    WORKDIR/train_state/<step>, through checkpoint.StepCheckpointer. The newest two are kept, so that a newest one
    that cannot be read is set aside and the one before it resumed."""

    def __init__(self, workdir: str):
        self.checkpointer = StepCheckpointer(orbax_path(workdir) / TRAIN_STATE, keep=2)
        self.directory = self.checkpointer.directory

    def remove(self) -> None:
        self.checkpointer.remove()

    def save(self, step: int, params, opt_state, best: "BestTracker | None" = None) -> None:
        items = {PARAMS: params, OPT_STATE: opt_state}
        if best is not None:  # the best evaluation so far: its params (none yet: the current ones) and count
            items.update({BEST_PARAMS: params if best.params is None else best.params, BEST: best.state()})
        self.checkpointer.save_items(step, items)

    def restore(self, params, opt_state, best: "BestTracker | None", log, *, config):
        """(params, opt_state, step) of the newest save that reads, laid out as the given (freshly initialised)
        ones (`config`'s layers: a save per layer continues scanned), or None without one; `best` gets the best
        evaluation's params and count back."""
        abstract = lambda tree: jax.tree_util.tree_map(  # noqa: E731
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)
        items = {PARAMS: abstract(params), OPT_STATE: abstract(opt_state)}
        if best is not None:
            items.update({BEST_PARAMS: abstract(params), BEST: None})

        def read(step: int) -> dict:  # a run resumed with --metric-for-best added finds no best saved
            saved_best = (epath.Path(self.checkpointer.step_dir(step)) / BEST).exists()
            return self.checkpointer.restore_items_any_layout(
                step, items if saved_best else {k: v for k, v in items.items() if k not in (BEST, BEST_PARAMS)},
                config)

        found = self.checkpointer.restore_newest(read, log)
        if found is None:
            return None
        step, restored = found
        if best is not None and not best.load(restored.get(BEST), restored.get(BEST_PARAMS)):
            log(f"--metric-for-best {best.metric}: no best evaluation by it saved; tracked from step {step} on")
        return restored[PARAMS], restored[OPT_STATE], step


class BestTracker:
    """The params of the best evaluation by `metric` (a copy on the devices), and the evaluations since it, for
    --metric-for-best and --early-stopping-patience."""

    def __init__(self, metric: str, patience: int):
        self.metric, self.patience, self.higher = metric, patience, greater_is_better(metric)
        self.value, self.step, self.stale, self.params = None, None, 0, None

    def update(self, step: int, metrics: dict, params) -> bool:
        """Records an evaluation; True when it is the best so far (its params are then kept)."""
        if self.metric not in metrics:
            raise ValueError(f"--metric-for-best {self.metric!r} is not among the evaluation's metrics "
                             f"{sorted(metrics)}")
        value = float(metrics[self.metric])
        better = self.value is None or (value > self.value if self.higher else value < self.value)
        if better:
            self.value, self.step, self.stale = value, step, 0
            self.params = jax.tree_util.tree_map(jnp.copy, params)  # the training step donates its params
        else:
            self.stale += 1
        return better

    @property
    def should_stop(self) -> bool:
        return bool(self.patience) and self.stale >= self.patience

    def state(self) -> dict:
        return {"value": self.value, "step": self.step, "stale": self.stale, "metric": self.metric}

    def load(self, state: dict | None, params) -> bool:
        """Takes a saved best back; False (nothing taken) when none was saved or it was by another metric (a
        resume may change --metric-for-best). A save from before the metric was recorded is taken as by this one."""
        if state is None or state.get("metric", self.metric) != self.metric:
            return False
        self.value, self.step, self.stale = state["value"], state["step"], state["stale"]
        self.params = params if self.step is not None else None
        return True


def fresh_params(params: dict, module: nn.Module, config, key) -> dict:
    """`params` with each leaf still abstract (a jax.ShapeDtypeStruct: what merge_params left initialised) given the
    value of the module's init with `key`, bit for bit: one jitted init whose other tensors XLA drops."""
    flat = traverse_util.flatten_dict(params)
    missing = [path for path, leaf in flat.items() if isinstance(leaf, jax.ShapeDtypeStruct)]
    if not missing:
        return params

    def initialised(init_key):
        values = traverse_util.flatten_dict(nn.meta.unbox(init_params(module, config, init_key)))
        return {"/".join(path): values[path] for path in missing}

    values = jax.jit(initialised)(key)
    return traverse_util.unflatten_dict({**flat, **{path: values["/".join(path)] for path in missing}})


def scans_layers(platform: str) -> bool:
    """Whether a fine-tune runs the encoder as one scan over its stacked layers: on a CPU, either family's
    (ModernBERT's layers told by scanned flags which is global). XLA:CPU then compiles one layer, not N: MiniLM's
    train step compiled in ~9 s unrolled and ~3 s scanned, its steps as fast; a first small fine-tune's wall time
    halved. On TPUs and GPUs, where compiles are fast against the run and the scan's stacked residuals cost step
    time (+35-86% priced for BERT's pretraining step on v5e), the layers stay unrolled. Dropout draws other bits
    scanned than unrolled (the same distribution); checkpoints and exports are written per layer either way, and a
    saved train state resumes in either layout."""
    return platform == "cpu"


def train_step_fn(loss_and_grads: Callable, optimizer):
    """The fine-tune's step (params, opt_state, batch, rng) -> (params, opt_state, loss, finite): `loss_and_grads`'
    gradient, the optax update, skipped where the gradient is not finite. What `Trainer.train` jits, and what
    `bertjax compile --embedding` compiles for a slice."""
    def step(params, opt_state, batch, rng):
        loss, grads = loss_and_grads(params, batch, rng)
        finite = jnp.isfinite(optax.tree.norm(grads))

        def update(params, opt_state):
            updates, new_opt_state = optimizer.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), new_opt_state

        # As in pretraining: a non-finite gradient skips the update (params and moments unchanged).
        params, opt_state = jax.lax.cond(finite, update, lambda p, o: (p, o), params, opt_state)
        return params, opt_state, loss, finite

    return step


class Trainer:
    """Holds a model, its params on a mesh, and jitted train / predict steps for one loss."""

    def __init__(self, module: nn.Module, config, pretrained_params: dict, loss_fn: Callable, settings: TrainSettings,
                 source: str = "checkpoint", mesh=None):
        if settings.dtype != config.dtype:  # mixed precision: bfloat16 matmuls, the params stay float32
            config = config.replace(dtype=settings.dtype)
            module = module.clone(config=config)
        # Before the steps compile: a rerun (another seed, a restarted job) reads them back.
        compile_cache.enable(settings.compilation_cache_dir, key="compilation_cache_dir")
        host_memory.release_freed_memory_after_compiles(os.environ)
        self.mesh = mesh or sharding.make_mesh()
        if scans_layers(self.mesh.devices.flat[0].platform) and not config.scan_layers:
            config = config.replace(scan_layers=True)  # merge_params stacks the checkpoint's layers to match
            module = module.clone(config=config)
        if self.mesh.devices.flat[0].platform == "gpu":   # before any step is traced: kernels that disagree left out
            from bertjax.model.kernels.gpu import gpu_kernel_check

            gpu_kernel_check.prepare("gpu", Console().line)
        self.module, self.config, self.settings, self.loss_fn = module, config, settings, loss_fn
        n_data = self.mesh.shape["data"] * self.mesh.shape["fsdp"]
        # Prediction holds no gradients or optimizer state: a batch that trains fits, so it never predicts smaller.
        self.eval_batch_size = max(settings.eval_batch_size, settings.batch_size)
        self.predicted_rows = 0  # counted for the evaluation lines
        self._last_prediction = None  # (arrays, params, per_token, outputs): the dev set once per params
        self.predict_flag = "--eval-batch-size"  # the option a refused prediction batch names
        for name, rows in (("batch_size", settings.batch_size // settings.grad_accum_steps),
                           ("eval_batch_size", settings.eval_batch_size)):
            if rows % n_data:
                raise ValueError(f"{name}={getattr(settings, name)} is not divisible by the {n_data} data-parallel "
                                 "devices" + (f" times grad_accum_steps={settings.grad_accum_steps}"
                                              if name == "batch_size" and settings.grad_accum_steps > 1 else ""))
        key = jax.random.PRNGKey(settings.seed)
        self.init_key, self.dropout_key = jax.random.split(key)
        # Outside the mesh: the dummy init batch of 1 row cannot be split over the data axis.
        # Shapes only: the checkpoint's tensors replace the encoder's, and a whole init run op by op took ~6 CPU-s
        # (a compile per op) to be thrown away. What stays initialised (a new head) is computed by fresh_params.
        boxed = jax.eval_shape(lambda key: init_params(module, config, key), self.init_key)
        self.param_shardings = sharding.param_shardings(boxed, self.mesh)
        # Told when training starts, and only if it does not resume: a resumed run's head is its saved step's.
        self.init_notes = []
        params = merge_params(nn.meta.unbox(boxed), pretrained_params, source=source, encoder_only=True,
                              note=self.init_notes.append)
        params = fresh_params(params, module, config, self.init_key)
        self.params = jax.device_put(params, self.param_shardings)
        self.batch_sharding = sharding.batch_sharding(self.mesh)
        self._predict = jax.jit(self._predict_fn)

    # ------------------------------------------------------------------------------------------- batching

    def _rows_at_most(self, batch_size: int, rows: int, accum: int = 1) -> int:
        """`batch_size`, or fewer where it exceeds `rows`: the rows rounded up to what splits over the devices
        (and `accum` micro-batches)."""
        unit = self.mesh.shape["data"] * self.mesh.shape["fsdp"] * accum
        return min(batch_size, max(unit, math.ceil(rows / unit) * unit))

    def check_memory(self, batch_size: int, row_shape: tuple[int, ...], training: bool) -> None:
        """Refuses a batch whose step would not fit the memory of the devices (on the CPU, the machine's), before
        the step allocates anything: a fine-tune with an absurd --batch-size was killed by the kernel with no word.
        The estimate counts only what the step must hold (a floor: XLA needs more), so it refuses no step that fits:
        see `step_memory`."""
        flag = "--batch-size" if training else self.predict_flag
        rows = batch_size // (self.settings.grad_accum_steps if training else 1)
        tokens = int(np.prod(row_shape))
        need, state, activations, where, memory = step_memory(self.config, _count(self.params), rows, tokens,
                                                              self.mesh, training, self.settings.dtype)
        if need > memory:
            kind, held = ("training", "params, gradients and optimizer state") if training else \
                ("prediction", "params")
            raise ValueError(f"{flag} {batch_size} of {tokens} tokens a row: a {kind} step needs at least "
                             f"{need / 2**30:,.1f} GiB ({state / 2**30:,.1f} GiB of {held}, {activations / 2**30:,.1f} "
                             f"GiB of activations), more than {where}'s {memory / 2**30:,.1f} GiB of memory; give a "
                             f"smaller {flag}" + (" or a --grad-accum-steps (the same batch in parts)" if training
                                                  else ""))

    def _batches(self, arrays: dict[str, np.ndarray], order: np.ndarray, batch_size: int):
        """Fixed-size batches over `order`; length cut to the bucket that holds the longest row. Inputs are
        [N, L], or [N, choices, L] (multiple choice: the longest choice decides)."""
        max_len = arrays["input_ids"].shape[-1]
        lengths = arrays["input_mask"].sum(axis=-1)
        for start in range(0, len(order), batch_size):
            idx = order[start:start + batch_size]
            weights = np.ones(batch_size, np.float32)
            if len(idx) < batch_size:
                weights[len(idx):] = 0.0
                idx = np.concatenate([idx, np.repeat(idx[:1], batch_size - len(idx))])
            bucket = self.settings.length_bucket
            length = min(max_len, max(bucket, int(math.ceil(lengths[idx].max() / bucket)) * bucket))
            batch = {k: (v[idx][..., :length] if k in INPUT_KEYS else v[idx]) for k, v in arrays.items()}
            batch["weights"] = weights
            yield jax.device_put(batch, self.batch_sharding), int((weights > 0).sum())

    # ------------------------------------------------------------------------------------------- training

    def _loss(self, params, batch, rng, total_weight=None):
        """The weighted mean loss of `batch`, or (a micro-batch's) weighted sum over `total_weight`."""
        outputs = self.module.apply({"params": params}, batch["input_ids"], batch["input_mask"],
                                    batch["segment_ids"], deterministic=False, rngs={"dropout": rng})
        per_example = self.loss_fn(outputs, batch)
        if total_weight is None:
            total_weight = jnp.maximum(jnp.sum(batch["weights"]), 1.0)
        return jnp.sum(per_example * batch["weights"]) / total_weight

    def _loss_and_grads(self, params, batch, rng):
        """The batch's loss and gradient, over settings.grad_accum_steps micro-batches (summed in a scan)."""
        accum = self.settings.grad_accum_steps
        if accum == 1:
            return jax.value_and_grad(self._loss)(params, batch, rng)
        total = jnp.maximum(jnp.sum(batch["weights"]), 1.0)
        # Rows j*accum + i form micro-batch i, so every device holds an equal share of each (as in pretraining).
        micro_batches = jax.tree_util.tree_map(
            lambda x: jnp.swapaxes(x.reshape((x.shape[0] // accum, accum) + x.shape[1:]), 0, 1), batch)

        def body(carry, inputs):
            index, micro = inputs
            loss, grads = jax.value_and_grad(self._loss)(params, micro, jax.random.fold_in(rng, index), total)
            return jax.tree_util.tree_map(jnp.add, carry, (loss, grads)), None

        zeros = (jnp.zeros((), jnp.float32), jax.tree_util.tree_map(jnp.zeros_like, params))
        (loss, grads), _ = jax.lax.scan(body, zeros, (jnp.arange(accum), micro_batches))
        return loss, grads

    def train(self, arrays: dict[str, np.ndarray], epoch_end: Callable[[int, float], dict | None] | None = None,
              workdir: str | None = None, evaluate: Callable[[], dict] | None = None) -> dict:
        """Trains on `arrays` for settings.epochs (fractions allowed); calls epoch_end(epoch, seconds) after each
        (a dict it returns is logged as eval metrics). Progress goes to the console every settings.log_every steps
        and, with `workdir`, to WORKDIR/metrics.jsonl and WORKDIR/tensorboard as in pretraining; the training
        state is saved every settings.save_every steps and on SIGTERM (then Preempted is raised), and a run that
        finds one resumes from it: the same example order and dropout masks, so the same bits. `evaluate`: dev
        metrics (a flat dict), recorded as eval_* every settings.eval_every steps. Returns the steps, the epochs they
        cover (fractional), the rows trained on (num_train_rows: after --max-train-examples) and the per-epoch history."""
        s = self.settings
        n = available = len(arrays["input_ids"])
        if n == 0:
            raise ValueError("no training examples")
        if s.max_train_examples and s.max_train_examples < n:  # its own generator: the example order is unchanged
            keep = np.sort(np.random.default_rng([s.seed, 1]).choice(n, s.max_train_examples, replace=False))
            arrays, n = {k: v[keep] for k, v in arrays.items()}, s.max_train_examples
        console = Console()
        batch_size = self._rows_at_most(s.batch_size, n, s.grad_accum_steps)
        if batch_size < s.batch_size:  # rows of padding (weight 0) would cost memory and time for nothing
            console.line(f"--batch-size {s.batch_size} is more than the {n:,} training examples: batches of "
                         f"{batch_size} (all of them, one step an epoch)")
            s = dataclasses.replace(s, batch_size=batch_size)
        self.check_memory(s.batch_size, arrays["input_ids"].shape[1:], training=True)
        steps_per_epoch = math.ceil(n / s.batch_size)
        total_steps = max(1, int(math.ceil(steps_per_epoch * s.epochs)))
        if s.max_steps:
            total_steps = min(total_steps, s.max_steps)
        if total_steps > options.INT_LIMIT:  # a derived count told by the flags that make it, not by its own name
            raise ValueError(f"--epochs {s.epochs:g} of {steps_per_epoch:,} step(s) each (--batch-size "
                             f"{s.batch_size}) is {total_steps:,} steps, more than {options.INT_LIMIT:,}: lower "
                             "--epochs (or set --max-steps)")
        warmup = int(s.warmup_proportion * total_steps)
        optimizer, schedule = make_optimizer(OptimizerConfig(
            learning_rate=s.learning_rate, warmup_steps=warmup, weight_decay=s.weight_decay,
            clip_norm=s.max_grad_norm), total_steps)
        schedule = jax.jit(schedule)  # for the logged rate: one small program, where op by op compiled six
        best = BestTracker(s.metric_for_best, s.early_stopping_patience) if s.metric_for_best else None
        if best is not None and evaluate is None:
            raise ValueError(f"--metric-for-best {s.metric_for_best}: this run has no dev set to evaluate")

        step = train_step_fn(self._loss_and_grads, optimizer)
        epochs = total_steps / steps_per_epoch  # what the steps cover: --max-steps may end before s.epochs
        console.line(f"training: {n:,} examples" + (f" (a seeded subset of {available:,})" if n < available else "")
                     + f", {total_steps:,} steps of {s.batch_size} = {epochs:.3g} epochs"
                     + (f" (--max-steps {s.max_steps}; {s.epochs:g} asked)" if epochs < s.epochs else "")
                     + f", {warmup} warmup, peak learning rate {s.learning_rate:g}")
        with sharding.activate(self.mesh):
            opt_state = jax.jit(optimizer.init)(self.params)
            train_step = jax.jit(step, donate_argnums=(0, 1))
            rng = np.random.default_rng(s.seed)
            states = TrainStateSaver(workdir) if workdir is not None else None
            params, step_index = self.params, 0
            resumed = (states.restore(params, opt_state, best, console.line, config=self.config)
                       if states is not None else None)
            if resumed is not None:
                params, opt_state, step_index = resumed
                console.line(f"resumed from {states.directory}/{step_index} (step {step_index} of {total_steps})")
            else:
                for line in self.init_notes:
                    console.line(line)
            writer = MetricsWriter(workdir or "", total_steps, enabled=workdir is not None, console=console,
                                   start_step=step_index)
            history, resumed_at, stopped_early = [], step_index, False
            nonfinite_total, nonfinite_run = 0, 0
            # The steps since the last metrics record: their mean loss is the record's, and the console's lines
            # between records say which steps they average.
            interval_losses, interval_start, interval_steps = [], time.perf_counter(), 0
            interval_first = step_index + 1
            console.start_progress(total_steps, initial=step_index)
            lines = LineSchedule(total_steps, s.log_every)
            preemption = PreemptionFlag()
            # The ETA extrapolates from the steps that did not compile: a batch of a length bucket not met before
            # compiles the step again (a 10-minute MiniLM run's ETA at step 2 said 1h53m), and the first
            # evaluation compiles the predict step; their time is set aside.
            lengths_met, evaluations = set(), [0]

            def timed_evaluation(evaluate):
                started_at = time.perf_counter()
                evaluated, cost = self._timed(evaluate)
                if not evaluations[0]:
                    writer.set_aside(time.perf_counter() - started_at)
                evaluations[0] += 1
                return evaluated, cost
            try:
                for epoch in range(math.ceil(epochs)):
                    started, losses, first_step = time.perf_counter(), [], step_index
                    order = rng.permutation(n)  # drawn for every epoch, so a resumed run has the same orders
                    done_in_epoch = step_index - epoch * steps_per_epoch
                    if done_in_epoch >= steps_per_epoch:  # finished before the restored step
                        continue
                    order = order[max(done_in_epoch, 0) * s.batch_size:]
                    for batch, _ in self._batches(arrays, order, s.batch_size):
                        if step_index >= total_steps:
                            break
                        if step_index == resumed_at:
                            console.line(f"compiling the train step (step {step_index + 1} includes it) ...")
                        step_started = time.perf_counter()
                        params, opt_state, loss, finite = train_step(
                            params, opt_state, batch, jax.random.fold_in(self.dropout_key, step_index))
                        step_index += 1
                        console.advance()
                        new_length = batch["input_ids"].shape not in lengths_met
                        lengths_met.add(batch["input_ids"].shape)
                        if step_index == resumed_at + 1:
                            jax.block_until_ready(loss)
                            console.line(f"step {step_index} compiled and ran in "
                                         f"{duration(time.perf_counter() - started)}")
                            writer.mark_start(step_index)
                            interval_start = time.perf_counter()
                        else:
                            interval_steps += 1
                        if bool(finite):
                            losses.append(loss)
                            interval_losses.append(loss)
                            nonfinite_run = 0
                        else:
                            nonfinite_total, nonfinite_run = nonfinite_total + 1, nonfinite_run + 1
                            console.line(f"warning: step {step_index}: non-finite gradient, update skipped "
                                         f"({nonfinite_total} so far)")
                            if nonfinite_run >= s.max_consecutive_nonfinite:
                                raise TooManyNonFiniteSteps(
                                    f"{nonfinite_run} consecutive steps had a non-finite gradient (up to step "
                                    f"{step_index}); stopping without saving. Lower the learning rate, or check the "
                                    f"training data for non-finite values.")
                        if new_length and step_index > resumed_at + 1:   # done: `finite` was read above
                            writer.set_aside(time.perf_counter() - step_started, steps=1)
                        logged = step_index % s.log_every == 0 or step_index == total_steps
                        if lines.due(step_index):  # metrics.jsonl every log_every; the console more often
                            seconds = max(time.perf_counter() - interval_start, 1e-9)
                            values = {"loss": float(np.mean(jax.device_get(interval_losses))) if interval_losses
                                      else float("nan"),
                                      "learning_rate": float(schedule(step_index - 1)),
                                      "epoch": step_index / steps_per_epoch,  # fractional: where in the data
                                      "examples_per_s": interval_steps * s.batch_size / seconds}
                            averaged = f"step {step_index}" if interval_first == step_index else \
                                f"steps {interval_first}-{step_index}"
                            writer.console(step_index, values,
                                           keys=("epoch", "loss", "learning_rate", "examples_per_s"),
                                           labels={"loss": "mean_loss"}, notes={"loss": averaged})
                        if logged:
                            writer.write(step_index, values)
                            interval_losses, interval_start, interval_steps = [], time.perf_counter(), 0
                            interval_first = step_index + 1
                        # --metric-for-best without --eval-every: an evaluation at each epoch's last step (before
                        # a save of that step, so that a resumed run has it too).
                        if evaluate and (s.eval_every and step_index % s.eval_every == 0 or best is not None and
                                         not s.eval_every and (step_index % steps_per_epoch == 0
                                                               or step_index == total_steps)):
                            self.params = params
                            evaluated, cost = timed_evaluation(evaluate)
                            writer.write(step_index, evaluated, prefix="eval_")
                            console.line(f"eval at step {step_index}: {metric_text(evaluated)} {cost}")
                            if best is not None and best.update(step_index, evaluated, params):
                                console.line(f"best {best.metric} so far: {best.value:.4f} (step {step_index})")
                            stopped_early = best is not None and best.should_stop and step_index < total_steps
                        if states is not None and (preemption.requested or (
                                s.save_every and step_index % s.save_every == 0 and step_index < total_steps)):
                            states.save(step_index, params, opt_state, best)
                            if preemption.requested:
                                raise Preempted(stopped_line(step_index, total_steps, preemption.reason(),
                                                             f"{states.directory}/{step_index}"))
                        if stopped_early:
                            console.line(f"early stopping at step {step_index}: {best.stale} evaluations without a "
                                         f"better {best.metric} (best {best.value:.4f} at step {best.step})")
                            break
                    self.params = params
                    if step_index == first_step:  # resumed at this epoch's end: it trained nothing in this run
                        continue
                    # None when every step of the epoch was skipped as non-finite (there is no mean to give).
                    mean_loss = float(np.mean(jax.device_get(losses))) if losses else None
                    seconds = time.perf_counter() - started
                    covered = (step_index - epoch * steps_per_epoch) / steps_per_epoch
                    history.append({"epoch": epoch + 1, "epoch_fraction": covered, "steps": step_index,
                                    "steps_this_run": step_index - first_step, "train_loss": mean_loss,
                                    "seconds": seconds})
                    console.line(f"epoch {epoch + 1}" + (f" ({covered:.2g} of it)" if covered < 1 else "")
                                 + f": {step_index} steps, mean loss "
                                 + (f"{mean_loss:.4f}" if mean_loss is not None else "n/a (no finite step)")
                                 + f", {duration(seconds)}")
                    if epoch_end is not None:
                        evaluated, cost = timed_evaluation(lambda: epoch_end(epoch + 1, seconds))
                        if evaluated:
                            writer.write(step_index, evaluated, prefix="eval_")
                            console.line(f"eval after epoch {epoch + 1}: {metric_text(evaluated)} {cost}")
                    if stopped_early:
                        break
            finally:
                preemption.restore()
                console.close_progress()
                # The disk that failed a write fails this one too: the error on its way out is the one to name.
                failing = sys.exc_info()[1] is not None
                with contextlib.suppress(OSError, OutputWriteError) if failing else contextlib.nullcontext():
                    writer.close()
        if states is not None:  # trained: the state only a resume needed goes (a BERT-large one is 4 GB)
            states.remove()
        if best is not None and best.params is not None:  # what the job evaluates and exports from here on
            self.params = best.params
            console.line(f"kept the params of the best evaluation: {best.metric} {best.value:.4f} at step "
                         f"{best.step} of {step_index}")
        ran = step_index - resumed_at
        if ran and nonfinite_total == ran:  # nothing learned: a score now would be the untrained head's
            raise TooManyNonFiniteSteps(
                f"every one of the {ran} steps had a non-finite gradient and skipped its update; no metrics "
                f"written. Check the checkpoint and vocabulary (NaN embeddings?), or lower the learning rate.")
        seconds = max(sum(h["seconds"] for h in history), 1e-9)
        final_loss = history[-1]["train_loss"] if history else None
        if ran:
            console.line(f"trained {ran} steps in {duration(seconds)} ({ran * s.batch_size / seconds:.1f} "
                         f"examples/s)" + (f", final epoch loss {final_loss:.4f}" if final_loss is not None else "")
                         + (f"; curve in {writer.jsonl_path} and {writer.tensorboard_dir}" if workdir else ""))
        else:
            console.line(f"nothing left to train: resumed at step {step_index} of {total_steps}")
        return {"total_steps": total_steps, "warmup_steps": warmup, "epochs": epochs, "num_train_rows": n,
                "history": history, "nonfinite_steps": nonfinite_total, "steps_run": step_index,
                "stopped_early": stopped_early,
                **({"best": {"metric": best.metric, **best.state()}} if best is not None else {})}

    def _timed(self, evaluate: Callable[[], dict | None]) -> tuple[dict | None, str]:
        """evaluate()'s metrics and what they cost, "(400 rows, 3.2 s)": the rows it predicted, its wall time."""
        rows, started = self.predicted_rows, time.perf_counter()
        evaluated = evaluate()
        return evaluated, f"({self.predicted_rows - rows:,} rows, {time.perf_counter() - started:.1f} s)"

    # ------------------------------------------------------------------------------------------- inference

    def _predict_fn(self, params, batch):
        return self.module.apply({"params": params}, batch["input_ids"], batch["input_mask"], batch["segment_ids"],
                                 deterministic=True)

    def predict(self, arrays: dict[str, np.ndarray], per_token: bool = False):
        """Model outputs for every row of `arrays`; per_token outputs ([B, L] or [B, L, labels] logits) are padded
        back to the full length with a very negative logit. The same `arrays` object asked again with the same
        params (the dev set evaluated after the last epoch, then predicted for the job's metrics and predictions
        file) gets the outputs computed the first time (idle, a ModernBERT fine-tune's two passes: 12.0 s of 84.5)."""
        last = self._last_prediction
        if last is not None and last[0] is arrays and last[1] is self.params and last[2] == per_token:
            return last[3]
        n = len(arrays["input_ids"])
        max_len = arrays["input_ids"].shape[1]
        inputs = {k: arrays[k] for k in INPUT_KEYS}
        outputs = []
        batch_size = self._rows_at_most(self.eval_batch_size, n)
        self.check_memory(batch_size, arrays["input_ids"].shape[1:], training=False)
        self.predicted_rows += n
        progress = Progress(f"predicting {n:,} rows", math.ceil(n / batch_size), detail=f" of {batch_size}")
        with sharding.activate(self.mesh):
            for batch, real in self._batches(inputs, np.arange(n), batch_size):
                out = jax.device_get(self._predict(self.params, batch))
                progress.advance()
                out = jax.tree_util.tree_map(lambda x, r=real: np.asarray(x[:r]), out)
                if per_token:
                    out = jax.tree_util.tree_map(
                        lambda x: np.pad(x, ((0, 0), (0, max_len - x.shape[1])) + ((0, 0),) * (x.ndim - 2),
                                     constant_values=-1e4), out)
                outputs.append(out)
        progress.close(f"predicted {n:,} rows")
        if not outputs:
            raise ValueError("nothing to predict")
        outputs = jax.tree_util.tree_map(lambda *xs: np.concatenate(xs), *outputs)
        self._last_prediction = (arrays, self.params, per_token, outputs)
        return outputs


def _count(params) -> int:
    return int(sum(np.prod(np.shape(leaf)) for leaf in jax.tree_util.tree_leaves(params)))


def step_memory(config, num_params: int, rows: int, tokens_per_row: int, mesh, training: bool, dtype: str):
    """(need, of it the params' state, of it the activations, whose memory, that memory) in bytes of a step of
    `rows` rows (all devices together) of `tokens_per_row` tokens: params (to train, also gradients and AdamW's
    two moments: 16 bytes a parameter) on every device, and the activations' floor (shapes.activation_floor_bytes).
    On an accelerator per device against its memory; on the CPU the devices together against the machine's."""
    from bertjax.model.config_base import host_memory_bytes

    devices = list(mesh.devices.flat)
    per_param = 16 if training else 4
    stats = devices[0].memory_stats() if devices[0].platform != "cpu" else None
    if stats and stats.get("bytes_limit"):
        share = math.ceil(rows / (mesh.shape["data"] * mesh.shape["fsdp"]))
        state = per_param * num_params
        activations = shapes.activation_floor_bytes(config, share, tokens_per_row, dtype, training,
                                                    devices[0].platform)
        where, memory = f"a {devices[0].device_kind} device", int(stats["bytes_limit"])
    else:
        state = per_param * num_params * len(devices)
        activations = shapes.activation_floor_bytes(config, rows, tokens_per_row, dtype, training,
                                                    devices[0].platform)
        where, memory = "this machine", host_memory_bytes()
    return state + activations, state, activations, where, memory


def write_fine_tuned(params, init: ModelCheckpoint, out_dir: str, *, bertjax_checkpoint: bool, hf: bool,
                     architecture: str, **hf_config) -> None:
    """The fine-tuned `params` (config and vocabulary of the `init` checkpoint) as a bertjax checkpoint in
    <out_dir>/checkpoint and/or an HF `architecture` directory in <out_dir>/hf (extra config.json keys: hf_config)."""
    # Per layer, as every checkpoint and export was written before fine-tunes scanned their layers.
    params = layer_layout.with_layout(jax.device_get(params), init.config, stacked=False)
    if bertjax_checkpoint:
        target = epath.Path(out_dir) / "checkpoint"
        workdir_paths.remove(target)
        head = {"architecture": architecture}
        if hf_config.get("id2label"):  # regression (STS-B) has none
            head["id2label"] = {str(i): label for i, label in hf_config["id2label"].items()}
        if hf_config.get("problem_type"):
            head["problem_type"] = hf_config["problem_type"]
        if hf_config.get("squad"):  # a span model's SQuAD settings: how `bertjax predict` decodes it
            head["squad"] = hf_config["squad"]
        if hf_config.get("max_seq_length"):  # the length it was trained at: what `bertjax predict` takes
            head["max_seq_length"] = hf_config["max_seq_length"]
        save_model(str(target), params, init.config, init.vocab, init.lower_case, head=head, tokenizer=init.tokenizer)
    if hf:
        export_hf(params, init.config, init.vocab, str(epath.Path(out_dir) / "hf"), lower_case=init.lower_case,
                  architecture=architecture, tokenizer=init.tokenizer, **hf_config)


# ------------------------------------------------------------------------------------------------- losses

def classification_loss(logits, batch):
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["labels"])


def regression_loss(logits, batch):
    return jnp.square(logits[:, 0] - batch["labels"])


def token_classification_loss(logits, batch):
    """Cross-entropy over the labelled tokens (label_ids >= 0), averaged over all labelled tokens of the batch
    (as HF's BertForTokenClassification), returned per example so that the Trainer's weighted mean over rows
    gives exactly that token-level mean: row i carries sum_i(token losses) * sum(w) / sum_j(w_j * tokens_j)."""
    labels = batch["label_ids"][:, :logits.shape[1]]  # the batch was cut to its length bucket, the labels not
    mask = labels >= 0
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, jnp.where(mask, labels, 0))
    per_row = jnp.sum(jnp.where(mask, losses, 0.0), axis=1)
    weights = batch["weights"]
    tokens = jnp.sum(mask.sum(axis=1) * weights)
    return per_row * jnp.sum(weights) / jnp.maximum(tokens, 1.0)


def span_loss(outputs, batch):
    start_logits, end_logits = outputs
    start = optax.softmax_cross_entropy_with_integer_labels(start_logits, batch["start_positions"])
    end = optax.softmax_cross_entropy_with_integer_labels(end_logits, batch["end_positions"])
    return (start + end) / 2.0
