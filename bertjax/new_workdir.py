"""A workdir a command creates and then fails in, before it saved anything to resume from, is removed again.

Otherwise a typo in `--set data.input=...` leaves `config.json` and an empty `checkpoints/` behind, and the next
command on that workdir meets a run that never ran (a resume refused for its "changed" config, `info` reading a
workdir with no model). A workdir that existed before the command is never removed, nor one holding a complete
checkpoint: a job that fails at step 5000 keeps its checkpoints to resume from.
"""
from __future__ import annotations

import contextlib
from typing import Callable, Iterator

from etils import epath


@contextlib.contextmanager
def removed_if_failed_before_saving(workdir: str, has_saved: Callable[[], bool], *,
                                    enabled: bool = True) -> Iterator[None]:
    """Runs the body; if it raises, `workdir` did not exist before and `has_saved()` is False, removes it."""
    path = epath.Path(workdir)
    created = enabled and not path.exists()
    try:
        yield
    except Exception:
        if created and path.exists() and not has_saved():
            path.rmtree()
        raise
