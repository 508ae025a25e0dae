"""A quiet start: TensorFlow's native start-up lines kept off the console unless asked for (`--verbose`).

Importing TensorFlow writes C++ log lines straight to file descriptor 2 before its logging is initialised
("All log messages before absl::InitializeLog() ...", "cudart_stub.cc ... Could not find cuda drivers"), and
its first device query writes "failed call to cuInit: ... UNKNOWN ERROR (303)" on a machine without a GPU.
TF_CPP_MIN_LOG_LEVEL does not reach them, so fd 2 is pointed at a temporary file for exactly those two moments;
what was captured is discarded when they succeed and written back when they fail, so a real import or device
error is never hidden. Later native messages (a crash report) reach the terminal as they always do.
"""
from __future__ import annotations

import contextlib
import os
import sys
import tempfile


@contextlib.contextmanager
def native_stderr_held(verbose: bool = False):
    """Hold what native code writes to fd 2 inside the block; write it back only if the block raises."""
    if verbose:
        yield
        return
    sys.stderr.flush()
    saved_fd = os.dup(2)
    with tempfile.TemporaryFile() as held:
        os.dup2(held.fileno(), 2)
        try:
            yield
        except BaseException:
            os.dup2(saved_fd, 2)
            held.seek(0)
            os.write(2, held.read())
            raise
        finally:
            os.dup2(saved_fd, 2)
            os.close(saved_fd)


def start_tensorflow(verbose: bool = False) -> None:
    """Import TensorFlow quietly and keep it off accelerators: it only runs tf.data and tokenizers on the host,
    and would otherwise reserve GPU memory that JAX needs."""
    os.environ["TF_CPP_MIN_LOG_LEVEL"] = "0" if verbose else os.environ.get("TF_CPP_MIN_LOG_LEVEL", "2")
    with native_stderr_held(verbose):
        import tensorflow as tf

        tf.config.set_visible_devices([], "GPU")
