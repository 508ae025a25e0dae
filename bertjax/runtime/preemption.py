"""SIGTERM/SIGINT/SIGHUP as a request to stop at the next step boundary (after a save), shared by the training
loops: a preempted TPU VM or a cluster scheduler sends SIGTERM and waits a grace period before killing; a dropped
SSH session sends SIGHUP, whose default (die at once, no save, the workdir lock left) would lose the run's work.

Every other command (and a training job before and after its loop) takes them as `Stopped`, raised where the main
thread is: its cleanup runs on the way out (a partial output removed, its lock released; outputs.py) and `bertjax`
ends it in one line, status 128 + the signal's number. A signal that comes during that cleanup is not raised again
(a second Ctrl-C would cut it short and leave what it was removing).

A training job stopped before its last step (a stop signal, or pretraining's --max-steps-this-run) saves and exits
STOPPED_EXIT: not 0, so that `pretrain ... && export ...` does not go on with a half-trained model; not a failure's
1 or 2, so that a launcher reruns it (the same command resumes)."""
from __future__ import annotations

import contextlib
import gc
import os
import signal
import threading
from typing import Iterator

# The signals that ask a job to stop (also what `launch local` forwards to its workers).
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)

# The exit status of a training job that stopped before its last step with its state saved: sysexits.h's
# EX_TEMPFAIL ("temporary failure, retry"), apart from a bug's 1, bad input's 2 and a signal's 128 + N. A launcher's
# babysitter reruns it; the same command run again resumes.
STOPPED_EXIT = 75


def stopped_line(step: int, total: int, why: str, saved: str) -> str:
    """A stopped training job's last line: where it stopped, why, where its state is, how to go on."""
    return (f"stopped at step {step} of {total} ({why}), its state saved in {saved}: not finished (exit status "
            f"{STOPPED_EXIT}); run the same command again to resume from step {step}")


class Stopped(BaseException):
    """A stop signal (a BaseException, as KeyboardInterrupt: no `except Exception` takes it for a failure)."""

    def __init__(self, signum: int):
        self.signum = signum
        super().__init__(f"stopped by {signal.Signals(signum).name}")


def raise_stopped(signum, frame):
    """The handler of STOP_SIGNALS outside a training loop: the first raises Stopped, the ones after it are
    dropped, so that the cleanup the first set off runs to its end. Where an exception would be printed as
    "Exception ignored" and dropped (the signal came during a `__del__` or a garbage-collection callback, JAX's
    among them), the signal is sent again 10 ms later instead."""
    if _swallowed_there(frame):
        threading.Timer(0.01, os.kill, (os.getpid(), signum)).start()
        return
    for sig in STOP_SIGNALS:
        signal.signal(sig, _ignore_during_cleanup)
    raise Stopped(signum)


def _swallowed_there(frame) -> bool:
    """Whether an exception raised at `frame` ends as "Exception ignored": inside a __del__ or a gc callback."""
    callbacks = {getattr(callback, "__code__", None) for callback in gc.callbacks}
    while frame is not None:
        if frame.f_code.co_name == "__del__" or frame.f_code in callbacks:
            return True
        frame = frame.f_back
    return False


def _ignore_during_cleanup(signum, frame):
    pass


@contextlib.contextmanager
def stopped_by_raising(enabled: bool = True) -> Iterator[None]:
    """STOP_SIGNALS raise Stopped in the body (only in the main thread, where handlers can be set); the handlers
    before it are back after it (a test calling `bertjax` in-process keeps its own). A Python handler runs only
    when the main thread is back in Python: a command held in native code (a compile, a library stuck under a
    process limit) would outlive a SIGTERM, which used to end it at once; so `_NativeWatch` ends it GRACE_S after
    the signal, in a line, when it has not ended by then."""
    if not enabled or threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {sig: signal.signal(sig, raise_stopped) for sig in STOP_SIGNALS}
    watch = _NativeWatch()
    try:
        yield
    finally:
        watch.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)


# Seconds a stopped command has to end (its cleanup included) before it is ended without it.
GRACE_S = 30.0


class _NativeWatch:
    """Python's C signal handler writes each signal's number to the wakeup fd whatever the main thread is doing; a
    thread reading it ends the process GRACE_S after a stop signal taken by `raise_stopped` (not one a training
    loop's PreemptionFlag takes: it stops at a step boundary), if the process is still there. A thread needs the
    GIL: a native call that lets it go (XLA's compiles, TensorFlow's ops, I/O) is watched, one that holds it is not
    (and, as before, SIGKILL ends anything)."""

    def __init__(self):
        self._read, self._write = os.pipe()
        os.set_blocking(self._write, False)
        self._previous_fd = signal.set_wakeup_fd(self._write, warn_on_full_buffer=False)
        self._timer: threading.Timer | None = None
        self._thread = threading.Thread(target=self._run, name="bertjax-stop-watch", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            try:
                data = os.read(self._read, 16)
            except OSError:
                return
            if not data:
                return
            for signum in data:
                if signum in STOP_SIGNALS and signal.getsignal(signum) in (raise_stopped, _ignore_during_cleanup):
                    self._timer = threading.Timer(GRACE_S, _end_stuck, (signum,))
                    self._timer.daemon = True
                    self._timer.start()
                    return

    def stop(self) -> None:
        """The command ended (in-process: returned to its caller): nothing to end any more."""
        signal.set_wakeup_fd(self._previous_fd)
        os.close(self._write)  # the thread's read returns b"": it ends
        self._thread.join(timeout=1)
        os.close(self._read)
        if self._timer is not None:
            self._timer.cancel()


def _end_stuck(signum: int) -> None:
    name = signal.Signals(signum).name
    os.write(2, f"\nbertjax: stopped by {name}: still in native code {GRACE_S:.0f}s later; ended without its "
                f"cleanup\n".encode())
    os._exit(128 + signum)


class PreemptionFlag:
    """Set by SIGTERM/SIGINT/SIGHUP; the loop saves at the next step boundary and stops (the job: STOPPED_EXIT)."""

    def __init__(self):
        self.requested = False
        self.signum: int | None = None  # the first stop signal, for the job's last line
        self._previous = {}
        for sig in STOP_SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum, frame):
        self.requested = True
        self.signum = self.signum or signum

    def reason(self) -> str:
        """The signal that stopped the job, for its last line ("SIGTERM")."""
        return signal.Signals(self.signum).name if self.signum else "a stop signal to another of its processes"

    def agreed(self, step: int) -> bool:
        """True on every process once any process got the signal (all processes stop at the same step)."""
        import jax  # here: the launcher (cloud/local.py) takes STOP_SIGNALS without starting JAX
        import numpy as np
        from jax.experimental import multihost_utils

        flag = self.requested
        if jax.process_count() > 1:
            flag = bool(np.any(multihost_utils.process_allgather(np.asarray(flag))))
        return flag

    def restore(self):
        """The handlers before the loop back; in a command (whose handler is `raise_stopped`) after a stop was
        asked, later signals dropped instead: a second Ctrl-C while the stopped job saves and cleans up would cut
        that short (it was a KeyboardInterrupt traceback)."""
        for sig, handler in self._previous.items():
            signal.signal(sig, _ignore_during_cleanup if self.requested and handler is raise_stopped else handler)
