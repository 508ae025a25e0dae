"""A workdir a command creates and then fails in, before it saved anything to resume from, is removed again.

Otherwise a typo in `--set data.input=...` leaves `config.json` and an empty `checkpoints/` behind, and the next
command on that workdir meets a run that never ran (a resume refused for its "changed" config, `info` reading a
workdir with no model). A workdir that existed before the command is never removed, nor one holding a complete
checkpoint: a job that fails at step 5000 keeps its checkpoints to resume from. Only while no other job holds
the workdir's lock: of two jobs started at once on a new workdir, the one refused (or failing beside the holder)
must not remove what the other is writing.
"""
from __future__ import annotations

import contextlib
import time
from typing import Callable, Iterator

from etils import epath

from bertjax.runtime import workdir_paths
from bertjax.runtime.workdir_lock import WorkdirLock


@contextlib.contextmanager
def removed_if_failed_before_saving(workdir: str, has_saved: Callable[[], bool],
                                    lock: WorkdirLock | None) -> Iterator[None]:
    """Runs the body, which takes and releases `lock`; if it raises, `workdir` did not exist before,
    `has_saved()` is False and no job holds the lock, removes it. `lock` None (a process of the job that holds no
    lock): never removes."""
    path = epath.Path(workdir)
    created = lock is not None and not path.exists()
    try:
        yield
    except BaseException:  # a stop signal (preemption.Stopped) too
        if created and path.exists() and not has_saved() and lock.read() is None:
            _remove_after_failure(path)
        raise


def _remove_after_failure(path: epath.Path, tries: int = 3, pause_s: float = 0.5) -> None:
    """Removes `path`, retrying while writes of the failed job may still land in it (a failed save's Orbax threads:
    "Directory not empty"). A removal that still fails is left: the job's own error is the one to tell, never the
    cleanup's (under `ulimit -n 30` the save's "too many open files" was replaced by the rmtree's errno 39)."""
    for attempt in range(tries):
        try:
            workdir_paths.remove(path)
            return
        except OSError:
            if attempt + 1 < tries:
                time.sleep(pause_s)
