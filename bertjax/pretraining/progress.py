"""The pretraining loop's clock: the first (compiling) step timed apart, the throughput of the steps after it per
logging interval and over the run, the console's progress bar, and the run's closing summary."""
from __future__ import annotations

import collections
import time

import jax

from bertjax.runtime.console import duration, metric_text
from bertjax.pretraining import metrics as metrics_lib

# Per-step counts the train step reports, summed over a logging interval for throughput (not logged per step).
COUNTED = ("real_tokens", "masked_tokens", "instances")


class StepClock:
    """Times a run's steps. The first includes compilation: logged, charged to the goodput account's compile_s and
    not timed; so does the first step at each other batch size of a batch-size warmup (its program compiles then),
    its time taken out of its interval's. The rest are timed steps: counted in the account, advanced on the
    progress bar, and measured per logging interval (`interval`) and over the run (`mean`). `batches`: the rows of
    each step (batch_schedule.BatchSchedule)."""

    def __init__(self, start_step: int, total_steps: int, *, batches, seq_len: int, bert_config,
                 peak_flops: float, sbo: bool, run_start: float, account, writer, console):
        self.start_step, self.total_steps, self.run_start = start_step, total_steps, run_start
        self.batches = batches
        self._shape = dict(seq_len=seq_len, config=bert_config, peak_flops=peak_flops, sbo=sbo)
        self.account, self.writer, self.console = account, writer, console
        self.totals = collections.Counter()  # the timed steps' real tokens, rows and seconds, for the run's mean
        self._compile_start, self._compiled_rows, self._last = None, set(), None
        self._restart()

    def _restart(self) -> None:
        self._start, self._steps, self._rows, self._counts = time.perf_counter(), 0, 0, None

    def before_step(self, step: int) -> None:
        """Call before the train step that leads to step + 1."""
        rows = self.batches.rows_at(step)
        if step == self.start_step:
            self.console.line(f"compiling the train step (step {step + 1} includes it) ...")
            self._compile_start = time.perf_counter()
        elif rows not in self._compiled_rows:  # a batch-size warmup's next size: a program of its own
            jax.block_until_ready(self._last)  # the steps before it end first: their time is theirs
            self.account.mark("step_s")
            self.console.line(f"compiling the train step for {rows:,} rows (step {step + 1} includes it) ...")
            self._compile_start = time.perf_counter()
        self._compiled_rows.add(rows)

    def after_step(self, step: int, step_metrics: dict) -> None:
        """Call once the train step that led to `step` is dispatched."""
        self._last = step_metrics
        if step == self.start_step + 1:
            jax.block_until_ready(step_metrics)  # the first step includes compilation: not timed
            self.console.line(f"step {step} compiled and ran in "
                              f"{duration(time.perf_counter() - self._compile_start)}")
            self.account.mark("compile_s")
            self._compile_start = None
            self._restart()
            self.writer.mark_start(step)
            self.console.start_progress(self.total_steps, initial=step)
            return
        if self._compile_start is not None:  # not timed: its time leaves the interval's and the ETA's
            jax.block_until_ready(step_metrics)
            seconds, self._compile_start = time.perf_counter() - self._compile_start, None
            self.account.mark("compile_s")
            self._start += seconds
            self.writer.set_aside(seconds, self.batches.full_steps_before(step)
                                  - self.batches.full_steps_before(step - 1))
            self.console.line(f"step {step} compiled and ran in {duration(seconds)}")
            self.console.advance()
            return
        self._steps += 1
        self._rows += self.batches.rows_at(step - 1)
        self.account.timed_steps += 1
        self.console.advance()
        # Summed on the device (asynchronous adds), read only when logging.
        counts = {k: step_metrics[k] for k in COUNTED}
        self._counts = counts if self._counts is None else jax.tree_util.tree_map(jax.numpy.add, self._counts,
                                                                                  counts)

    def interval(self) -> dict:
        """The throughput of the timed steps since the previous call ({} without any); the next interval starts."""
        values = {}
        if self._steps:
            seconds = time.perf_counter() - self._start
            counted = metrics_lib.to_python(self._counts)
            values = metrics_lib.interval_metrics(seconds, self._steps, rows=self._rows, counts=counted,
                                                  **self._shape)
            self.totals.update(seconds=seconds, steps=self._steps, rows=self._rows, **counted)
        self._restart()
        return values

    def mean(self) -> dict | None:
        """The throughput over the run's timed steps that were logged (None without any)."""
        if not self.totals["seconds"]:
            return None
        return metrics_lib.interval_metrics(self.totals["seconds"], self.totals["steps"], rows=self.totals["rows"],
                                            counts=self.totals, **self._shape)


def summary(status: str, step: int, clock: StepClock, last_metrics: dict, evals: list, saved_step, workdir: str,
            writer) -> list[str]:
    """The closing lines: how far, how long, how fast, the final and best metrics, and where everything is."""
    lines = [f"{status} at step {step}/{clock.total_steps}: {step - clock.start_step} steps in "
             f"{duration(time.perf_counter() - clock.run_start)}"]
    mean = clock.mean()
    if mean:
        lines[0] += (f" (timed steps: {mean['steps_per_s']:.3g} steps/s, {mean['real_tokens_per_s']:,.0f} real "
                     f"tokens/s, mean MFU {mean['mfu']:.3g})")
    if last_metrics:
        lines.append(f"  last step: {metric_text(last_metrics, ('loss', 'mlm_accuracy', 'nsp_accuracy'))}")
    if evals:
        first, last = evals[0], evals[-1]
        best = max(evals, key=lambda e: e[1]["mlm_accuracy"])
        lines.append(f"  eval mlm_accuracy: {first[1]['mlm_accuracy']:.4g} at step {first[0]} -> "
                     f"{last[1]['mlm_accuracy']:.4g} at step {last[0]} (best {best[1]['mlm_accuracy']:.4g} at step "
                     f"{best[0]}; most frequent token {last[1]['most_frequent_token_accuracy']:.4g})")
        if "majority_nsp_accuracy" in last[1]:
            lines.append(f"  eval nsp_accuracy: {last[1]['nsp_accuracy']:.4g} at step {last[0]} (most frequent "
                         f"label {last[1]['majority_nsp_accuracy']:.4g})")
    lines.append(f"  checkpoints: {workdir}/checkpoints (newest: step {saved_step})")
    lines.append(f"  metrics: {writer.jsonl_path}; TensorBoard: tensorboard --logdir {writer.tensorboard_dir}")
    return lines  # a run stopped before its end says so, and how to go on, in its last line (loop.py)
