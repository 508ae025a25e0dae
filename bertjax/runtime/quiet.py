"""A quiet start: TensorFlow's native start-up lines kept off the console unless asked for (`--verbose`).

Importing TensorFlow writes C++ log lines straight to file descriptor 2 before its logging is initialised
("All log messages before absl::InitializeLog() ...", "cudart_stub.cc ... Could not find cuda drivers"), and
its first device query writes "failed call to cuInit: ... UNKNOWN ERROR (303)" on a machine without a GPU.
TF_CPP_MIN_LOG_LEVEL does not reach them, so fd 2 is pointed at a temporary file for exactly those two moments;
what was captured is discarded when they succeed and written back when they fail, so a real import or device
error is never hidden (a stop signal that lands there is no failure: its one line is all that is said). Later
native messages (a crash report) reach the terminal as they always do. Joining a multi-process job on CPU, gloo
prints "[Gloo] Rank 0 is connected to 1 peer ranks" per process: held the same way.
Worker processes a job starts (Beam's DirectRunner in multi_processing mode) import TensorFlow themselves and
inherit fd 2: while they run, fd 2 is a pipe whose lines reach the terminal as they come, except the known
start-up lines (`native_lines_dropped`), so a worker's traceback is never held back.
"""
from __future__ import annotations

import contextlib
import os
import re
import sys
import tempfile
import threading

# The start-up lines of a process that imports TensorFlow (and oneDNN's notice when its first int64 op runs, where
# TF_ENABLE_ONEDNN_OPTS was not set to 0 for it), of Beam's local workers (which restate their options) and of gloo
# joining CPU processes at each new collective: nothing a user can act on.
START_UP_LINE = re.compile(
    rb"absl::InitializeLog\(\)|cudart_stub\.cc.*Could not find cuda drivers|failed call to cuInit"
    rb"|oneDNN custom operations are on|oneDNN supports DT_INT64 only"
    rb"|No semi_persistent_directory found|Discarding unparseable args"
    # gloo's line; two copies (its threads write it in pieces) can land in one another on a loaded machine, split
    # before or after the rank ("[Gloo] Rank 1[Gloo] Rank 1 is connected to ..." then " is connected to ...", or
    # "[Gloo] Rank [Gloo] Rank 1 is connected to ..." then "1 is connected to ...").
    rb"|^(?:\[Gloo\] Rank ?\d* ?)+(?:is connected to|$)|^ ?(?:\d+ )?is connected to \d+ peer ranks")


@contextlib.contextmanager
def native_output_held(verbose: bool = False, fds: tuple[int, ...] = (2,)):
    """Hold what native code writes to the file descriptors `fds` inside the block; write it back only if the
    block fails (an Exception: not a stop signal's preemption.Stopped or KeyboardInterrupt)."""
    if verbose:
        yield
        return
    sys.stdout.flush()
    sys.stderr.flush()
    saved = {fd: os.dup(fd) for fd in fds}
    held = {fd: tempfile.TemporaryFile() for fd in fds}
    for fd in fds:
        os.dup2(held[fd].fileno(), fd)
    try:
        yield
    except Exception:
        for fd in fds:
            os.dup2(saved[fd], fd)
            held[fd].seek(0)
            os.write(fd, held[fd].read())
        raise
    finally:
        for fd in fds:
            os.dup2(saved[fd], fd)
            os.close(saved[fd])
            held[fd].close()


@contextlib.contextmanager
def native_lines_dropped(verbose: bool = False, fd: int = 2):
    """Inside the block, lines written to `fd` (by this process or a child it starts) pass through as they come,
    except those START_UP_LINE matches. A child still running after the block keeps writing through the filter."""
    if verbose:
        yield
        return
    sys.stderr.flush()
    terminal = os.dup(fd)
    read, write = os.pipe()
    os.dup2(write, fd)
    os.close(write)

    def forward():
        with os.fdopen(read, "rb") as lines:
            for line in lines:
                if not START_UP_LINE.search(line):
                    os.write(terminal, line)

    forwarder = threading.Thread(target=forward, name="native-lines", daemon=True)
    forwarder.start()
    try:
        yield
    finally:
        sys.stderr.flush()
        os.dup2(terminal, fd)  # the pipe's last writer in this process closed: the forwarder ends at its end
        forwarder.join(timeout=5)
        if not forwarder.is_alive():  # else a child holds the pipe: the forwarder still needs `terminal`
            os.close(terminal)


def start_tensorflow(verbose: bool = False) -> None:
    """Import TensorFlow quietly and keep it off accelerators: it only runs tf.data and tokenizers on the host,
    and would otherwise reserve GPU memory that JAX needs."""
    os.environ["TF_CPP_MIN_LOG_LEVEL"] = "0" if verbose else os.environ.get("TF_CPP_MIN_LOG_LEVEL", "2")
    # TensorFlow here runs string and integer ops (tf.data, tokenizers), which oneDNN does not speed up; with it on,
    # a CPU without AVX-512 logs "oneDNN supports DT_INT64 only on platforms with AVX-512" at ERROR level (past
    # TF_CPP_MIN_LOG_LEVEL=2) while the data pipeline runs.
    os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")
    with native_output_held(verbose):
        import tensorflow as tf

        tf.config.set_visible_devices([], "GPU")
