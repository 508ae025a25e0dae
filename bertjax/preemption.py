"""SIGTERM/SIGINT/SIGHUP as a request to stop at the next step boundary (after a save), shared by the training
loops: a preempted TPU VM or a cluster scheduler sends SIGTERM and waits a grace period before killing; a dropped
SSH session sends SIGHUP, whose default (die at once, no save, the workdir lock left) would lose the run's work."""
from __future__ import annotations

import signal

# The signals that ask a job to stop (also what `launch local` forwards to its workers).
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


class PreemptionFlag:
    """Set by SIGTERM/SIGINT/SIGHUP; the loop saves at the next step boundary and exits cleanly."""

    def __init__(self):
        self.requested = False
        self._previous = {}
        for sig in STOP_SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum, frame):
        self.requested = True

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
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
