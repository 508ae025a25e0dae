"""The batch-size warmup (`train.batch_size_warmup_tokens`): how many microbatches each step trains on, and how many
came before it, as pure functions of the step.

ModernBERT's schedule (AnswerDotAI/ModernBERT: src/sequence_packer.py, `BatchSizeWarmupScheduler`, which
yamls/modernbert/modernbert-base-pretrain.yaml drives with batch_size_warmup_min_size = its device microbatch, 96,
and batch_size_warmup_tokens = 50B): the batch grows a microbatch at a time from the start size to one microbatch
below the full batch, then is full; size b (in microbatches, from the start s to the full K - 1) is used while the
tokens trained so far are below ceil(W (s + ... + b) / (s + ... + (K - 1))), W the warmup's tokens. Each size so
takes a share of W proportional to itself: about the same number of steps each. Here the thresholds are exact
integers (theirs round a float product), and tokens are the positions of the global batch (rows x
data.max_seq_length), where ModernBERT counted per device the real tokens its packer emitted: the size of every step
is then a function of the step alone (XLA's shapes are fixed before any data is read, and a resume needs no token
count saved); with packed rows the two differ by the padding fraction.

A step of k microbatches counts k / K of a full step: `full_steps_before` is the learning-rate schedule's clock, so
the schedule is counted in tokens (optimizer.warmup_steps: that many full steps' worth), and a resume needs nothing
but the step.
"""
from __future__ import annotations

import dataclasses


def warmup_sizes(start: int, full: int, tokens: int, microbatch_tokens: int) -> tuple[tuple[int, int], ...]:
    """(microbatches, steps) of each size of the warmup, in order: from `start` microbatches to `full` - 1, over
    `tokens` tokens, `microbatch_tokens` a microbatch. A size whose share the sizes before it already covered takes
    no step and is left out (as ModernBERT's schedule skips it); start = full: none."""
    sizes = range(start, full)
    total = sum(sizes)
    segments, done, cumulative = [], 0, 0
    for size in sizes:
        cumulative += size
        threshold = -(-tokens * cumulative // total)     # ceil(tokens * cumulative / total), in integers
        step_tokens = size * microbatch_tokens
        steps = max(0, -(-(threshold - done) // step_tokens))
        if steps:
            segments.append((size, steps))
            done += steps * step_tokens
    return tuple(segments)


@dataclasses.dataclass(frozen=True)
class BatchSchedule:
    """The global batch of each step: `microbatches` microbatches of `microbatch_rows` rows (the full batch), after
    the warmup's `warmup` ((microbatches, steps) per size). While there is one (`warming`), the input pipeline
    yields microbatches and the loop takes as many as the step's size; without, one full batch a step, as before
    the warmup existed."""

    microbatch_rows: int
    microbatches: int
    seq_len: int
    warmup: tuple[tuple[int, int], ...] = ()

    @property
    def warming(self) -> bool:
        return bool(self.warmup)

    @property
    def warmup_steps(self) -> int:
        return sum(steps for _, steps in self.warmup)

    @property
    def pipeline_rows(self) -> int:
        """The global rows of one element of the input pipeline: a microbatch while warming, else the full batch."""
        return self.microbatch_rows * (1 if self.warming else self.microbatches)

    def microbatches_at(self, step: int) -> int:
        """The microbatches of the step from `step` to step + 1."""
        for size, steps in self.warmup:
            if step < steps:
                return size
            step -= steps
        return self.microbatches

    def rows_at(self, step: int) -> int:
        return self.microbatches_at(step) * self.microbatch_rows

    def elements_at(self, step: int) -> int:
        """The input pipeline's elements the step from `step` takes."""
        return self.microbatches_at(step) if self.warming else 1

    def microbatches_before(self, step: int) -> int:
        """The microbatches the steps before `step` trained on."""
        done = 0
        for size, steps in self.warmup:
            taken = min(step, steps)
            done, step = done + taken * size, step - taken
        return done + step * self.microbatches

    def tokens_before(self, step: int) -> int:
        """The positions (rows x seq_len) the steps before `step` trained on."""
        return self.microbatches_before(step) * self.microbatch_rows * self.seq_len

    def full_steps_before(self, step: int) -> float:
        """The full-size steps' worth of tokens before `step` (= step without a warmup)."""
        return self.microbatches_before(step) / self.microbatches

    def traced_full_steps_before(self, step):
        """`full_steps_before` of a traced step count (the optimizer's schedule count), in float32: exact to 2^24
        microbatches, then to float32's rounding."""
        import jax.numpy as jnp
        import numpy as np

        sizes = [size for size, _ in self.warmup] + [self.microbatches]
        starts = np.cumsum([0] + [steps for _, steps in self.warmup])
        before = [self.microbatches_before(int(start)) for start in starts]
        step = jnp.asarray(step, jnp.int32)
        segment = jnp.sum(step >= jnp.asarray(starts, jnp.int32)) - 1
        done = (jnp.asarray(before, jnp.float32)[segment]
                + (step - jnp.asarray(starts, jnp.int32)[segment]).astype(jnp.float32)
                * jnp.asarray(sizes, jnp.float32)[segment])
        return done / self.microbatches

    def describe(self, steps: int) -> str:
        """The warmup of a run of `steps` steps for a person: its sizes and steps, its tokens; '' without one."""
        if not self.warming:
            return ""
        full_rows = self.microbatches * self.microbatch_rows
        counts = sorted({n for _, n in self.warmup})
        each = (f"{counts[0]:,} steps each" if len(counts) == 1 else
                f"{counts[0]:,} to {counts[-1]:,} steps each")
        text = (f"batch-size warmup: {self.warmup_steps:,} steps at {len(self.warmup)} size(s) from "
                f"{self.warmup[0][0] * self.microbatch_rows:,} to {self.warmup[-1][0] * self.microbatch_rows:,} rows "
                f"(a microbatch of {self.microbatch_rows:,} at a time, {each}), "
                f"{_tokens(self.tokens_before(self.warmup_steps))} tokens; then {full_rows:,} rows a step")
        if steps < self.warmup_steps:
            text += f" (train.steps={steps:,} ends inside it)"
        return text


def _tokens(count: int) -> str:
    """1.72T, 50.0B, 3.1M or 512."""
    for scale, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M")):
        if count >= scale:
            return f"{count / scale:.3g}{suffix}"
    return f"{count:,}"


def of(train, seq_len: int) -> BatchSchedule:
    """The batch schedule of a job's `train` config (TrainConfig) at `seq_len` tokens a row."""
    rows = train.batch_size // train.grad_accum_steps
    if not train.batch_size_warmup_tokens:
        return BatchSchedule(rows, train.grad_accum_steps, seq_len)
    start = (train.batch_size_warmup_min or rows) // rows
    return BatchSchedule(rows, train.grad_accum_steps, seq_len,
                         warmup_sizes(start, train.grad_accum_steps, train.batch_size_warmup_tokens, rows * seq_len))
