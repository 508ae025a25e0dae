"""One console style for every job: timestamped lines, durations, and a progress bar where a terminal is attached.

Lines go to stdout with the wall-clock time in front, so a log file read later says when each thing happened.
A job's progress is a tqdm bar on a terminal (lines are written above it) and nothing but the lines in a log.
"""
from __future__ import annotations

import logging
import os
import sys
import time


def duration(seconds: float) -> str:
    """7s, 3m05s, 2h04m09s."""
    seconds = int(round(max(seconds, 0)))
    hours, minutes, secs = seconds // 3600, seconds % 3600 // 60, seconds % 60
    if hours:
        return f"{hours}h{minutes:02d}m{secs:02d}s"
    return f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"


def metric_text(values: dict, keys=None, labels: dict | None = None, notes: dict | None = None) -> str:
    """`loss=2.301 mlm_accuracy=0.4112` for the given keys (all of them by default), in that order; a key in
    `labels` shown by its label, one in `notes` followed by its note: `mean_loss=2.301 (steps 41-50)`."""
    keys = values.keys() if keys is None else [k for k in keys if k in values]
    labels, notes = labels or {}, notes or {}
    return " ".join(f"{labels.get(k, k)}={values[k]:.4g}" + (f" ({notes[k]})" if k in notes else "") for k in keys)


def _columns(stream) -> int:
    """The width of the terminal `stream` writes to (0 when it reports none)."""
    try:
        return os.get_terminal_size(stream.fileno()).columns
    except (OSError, ValueError, AttributeError):
        return 0


class Console:
    """Timestamped lines (only where `enabled`: process 0 of a multi-process job) and an optional progress bar."""

    def __init__(self, enabled: bool = True, stream=None):
        self.enabled = enabled
        self.stream = stream or sys.stdout
        self._bar = None

    def line(self, message: str) -> None:
        if not self.enabled:
            return
        text = f"{time.strftime('%H:%M:%S')} {message}"
        if self._bar is not None:
            self._bar.write(text, file=self.stream)
        else:
            print(text, file=self.stream, flush=True)

    def start_progress(self, total: int, initial: int = 0, unit: str = "step") -> None:
        """A tqdm bar over `total` steps when the stream is a terminal; without one, progress is the lines."""
        if self.enabled and self.stream.isatty():
            from tqdm import tqdm

            # A terminal nobody sized (`script`, `docker exec -t` from a pipe) reports 0 columns, where tqdm draws
            # nothing: such a one gets 80.
            width = dict(dynamic_ncols=True) if _columns(self.stream) else dict(ncols=80)
            self._bar = tqdm(total=total, initial=initial, unit=unit, file=self.stream, leave=False, **width)

    @property
    def shows_bar(self) -> bool:
        """Whether progress is a bar now (a terminal), rather than only the lines."""
        return self._bar is not None

    def advance(self, steps: int = 1) -> None:
        if self._bar is not None:
            self._bar.update(steps)

    def close_progress(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def timed(self, what: str):
        """`with console.timed("compiling the train step"):` -> "compiling the train step ..." then "... done in 14s"."""
        return _Timed(self, what)


class LineSchedule:
    """When a run's progress line is due: every `log_every` steps and the last, and besides at least every tenth of
    the run and every `every_s` seconds, whichever comes first, so that a short or a slow run written to a log (no
    terminal, no bar) says where it is before its end."""

    EVERY_S = 30.0

    def __init__(self, total_steps: int, log_every: int, every_s: float | None = None):
        self.total_steps, self.log_every = total_steps, log_every
        self.tenth = max(1, total_steps // 10)
        self.every_s = self.EVERY_S if every_s is None else every_s
        self.last_line = time.perf_counter()

    def due(self, step: int) -> bool:
        """Whether step `step` gets a line (call once per step: the clock restarts at each line)."""
        now = time.perf_counter()
        if (step % self.log_every == 0 or step % self.tenth == 0 or step == self.total_steps
                or now - self.last_line >= self.every_s):
            self.last_line = now
            return True
        return False


class Progress:
    """A long piece of work counted in units (batches, folds): a line before, a bar on a terminal or else a line
    with the count and the ETA every `every_s` seconds, and a timed line after (`close`).

    `what` names the work in the lines: "extracting features of 1,200 rows" gives "extracting features of 1,200
    rows (19 batches) ...", "extracting features of 1,200 rows: batch 7/19, eta 41s" and "extracting features of
    1,200 rows: done in 1m05s". `detail` is added inside the brackets of the first line."""

    EVERY_S = 15.0

    def __init__(self, what: str, total: int, unit: str = "batch", console: Console | None = None,
                 every_s: float | None = None, detail: str = ""):
        self.console, self.what, self.total, self.unit = console or Console(), what, total, unit
        self.every_s = self.EVERY_S if every_s is None else every_s
        self.done = 0
        self.start = self.last_line = time.perf_counter()
        units = unit if total == 1 else (unit + "es" if unit.endswith(("s", "ch")) else unit + "s")
        self.console.line(f"{what} ({total} {units}{detail}) ...")
        self.console.start_progress(total, unit=unit)

    def advance(self, units: int = 1) -> None:
        """`units` more of the work are done."""
        self.done += units
        self.console.advance(units)
        now = time.perf_counter()
        if not self.console.shows_bar and now - self.last_line >= self.every_s and self.done < self.total:
            eta = (now - self.start) / self.done * (self.total - self.done)
            self.console.line(f"{self.what}: {self.unit} {self.done}/{self.total}, eta {duration(eta)}")
            self.last_line = now

    def close(self, said: str | None = None) -> float:
        """The closing line, `SAID in 12s` (SAID by default: "WHAT: done"); returns the seconds since the start."""
        self.console.close_progress()
        seconds = time.perf_counter() - self.start
        self.console.line(f"{said or self.what + ': done'} in {duration(seconds)}")
        return seconds


class _Timed:
    def __init__(self, console: Console, what: str):
        self.console, self.what = console, what

    def __enter__(self):
        self.console.line(f"{self.what} ...")
        self.start = time.perf_counter()
        return self

    def __exit__(self, kind, value, traceback):
        if kind is None:
            self.seconds = time.perf_counter() - self.start
            self.console.line(f"{self.what}: done in {duration(self.seconds)}")
        return False


def route_logging_to_console(stream=None) -> None:
    """The jobs' `logging` messages (the "bertjax" loggers: readers' skipped-row counts, job steps) as console
    lines: timestamped on stdout, warnings marked. The level is set on the "bertjax" logger, not the root:
    importing absl (TF, Orbax) resets the root level to WARNING."""
    logger = logging.getLogger("bertjax")
    if any(getattr(h, "bertjax_console", False) for h in logger.handlers):
        return
    handler = logging.StreamHandler(stream or sys.stdout)
    handler.setFormatter(_ConsoleFormat())
    handler.bertjax_console = True
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False


class _ConsoleFormat(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        prefix = "warning: " if record.levelno >= logging.WARNING else ""
        return f"{time.strftime('%H:%M:%S', time.localtime(record.created))} {prefix}{record.getMessage()}"
