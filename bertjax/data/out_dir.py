"""One writer per `--out` of `data create` (either runner) and `vocab train`, and no --out left by a failed run.

Two runs into one --out at once each wrote their files under the same names and both reported success, and only
one run's files remained. So a run takes OUT/LOCK before it writes anything: the pretraining workdir's lock
(workdir_lock.py: holder, heartbeat, a dead holder's lock taken over), and a second run is refused naming the
holder. The workers of one multi-worker `data create` write their own files into one --out at once, so each takes
a lock of its own (LOCK-w00003). An --out the run created is removed again when the run fails (new_workdir.py),
once the run has removed its own partial files, unless something else was written there (another worker's files).
"""
from __future__ import annotations

import contextlib
from typing import Iterator

from etils import epath

from bertjax.runtime.new_workdir import removed_if_failed_before_saving
from bertjax.runtime.workdir_lock import LOCK_NAME, WorkdirLock


def lock_name(worker_index: int = 0, num_workers: int = 1) -> str:
    """The lock file of one `data create` worker (of a run of one worker, or of Beam's: LOCK)."""
    return LOCK_NAME if num_workers == 1 else f"{LOCK_NAME}-w{worker_index:05d}"


@contextlib.contextmanager
def owned(out_dir: str, log=print, name: str = LOCK_NAME) -> Iterator[None]:
    """Runs the body holding `out_dir`'s lock `name` (WorkdirBusy, naming the holder, if another live run holds
    it); if the body raises and `out_dir` did not exist before, removes it when nothing is left in it."""
    lock = WorkdirLock(out_dir, log=log, name=name, flag="--out")
    with removed_if_failed_before_saving(out_dir, lambda: any(epath.Path(out_dir).iterdir()), lock):
        lock.acquire()
        try:
            yield
        finally:
            lock.release()


def remove_quietly(*paths: str) -> None:
    """Removes what a failed run began (on a full disk, or one gone read-only, a removal may fail too)."""
    import tensorflow as tf  # here: `demo-corpus` takes its --out's lock without starting TensorFlow

    for path in paths:
        try:
            if tf.io.gfile.exists(path):
                tf.io.gfile.remove(path)
        except (tf.errors.OpError, OSError):
            pass
