"""A quiet start: TensorFlow's native start-up lines kept off the console unless asked for (`--verbose`).

Importing TensorFlow writes C++ log lines straight to file descriptor 2 before its logging is initialised
("All log messages before absl::InitializeLog() ...", "cudart_stub.cc ... Could not find cuda drivers"), and
its first device query writes "failed call to cuInit: ... UNKNOWN ERROR (303)" on a machine without a GPU.
TF_CPP_MIN_LOG_LEVEL does not reach them, so fd 2 is pointed at a temporary file for exactly those two moments;
what was captured is discarded when they succeed and written back when they fail, so a real import or device
error is never hidden. Later native messages (a crash report) reach the terminal as they always do. Joining a
multi-process job on CPU, gloo prints "[Gloo] Rank 0 is connected to 1 peer ranks" per process: held the same way.
"""
from __future__ import annotations

import contextlib
import os
import sys
import tempfile


@contextlib.contextmanager
def native_output_held(verbose: bool = False, fds: tuple[int, ...] = (2,)):
    """Hold what native code writes to the file descriptors `fds` inside the block; write it back only if the
    block raises."""
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
    except BaseException:
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
