"""SIGTERM/SIGINT as a request to stop at the next step boundary (after a save), shared by the training loops:
a preempted TPU VM or a cluster scheduler sends SIGTERM and waits a grace period before killing."""
from __future__ import annotations

import signal

import jax
import numpy as np
from jax.experimental import multihost_utils


class PreemptionFlag:
    """Set by SIGTERM/SIGINT; the loop saves at the next step boundary and exits cleanly."""

    def __init__(self):
        self.requested = False
        self._previous = {}
        for sig in (signal.SIGTERM, signal.SIGINT):
            self._previous[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum, frame):
        self.requested = True

    def agreed(self, step: int) -> bool:
        """True on every process once any process got the signal (all processes stop at the same step)."""
        flag = self.requested
        if jax.process_count() > 1:
            flag = bool(np.any(multihost_utils.process_allgather(np.asarray(flag))))
        return flag

    def restore(self):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
