"""Keeps a pretraining job running through preemptions, whatever runs it (a TPU slice, local processes).

The job resumes by itself from its workdir's latest complete checkpoint, so bringing it back is: run the same
command again. The babysitter runs it, and after every end looks at the workdir: the job's completion marker
(`<workdir>/COMPLETED`, written by `bertjax pretrain` after its last save) means done; otherwise it runs it again,
until `max_restarts` is spent. A job that stopped itself before its end with its state saved (bertjax's
STOPPED_EXIT: a SIGTERM to its processes, --max-steps-this-run) is run again as a preempted one is. A job refused
for its input or configuration (bertjax exits 2: a missing corpus, a bad --set, a config its checkpoints cannot
resume with) would be refused again: it stops at once. A job that fails the same way twice in a row (not a
preemption) is not a preemption to wait out either: it stops with the log tail.
"""
from __future__ import annotations

import re
from typing import Callable, Protocol

from etils import epath

from bertjax.runtime.preemption import STOPPED_EXIT

# bertjax's exit code for bad input or configuration (bertjax/cli.py), which no restart can cure.
USAGE_ERROR_EXIT = 2


class Backend(Protocol):
    """Something that runs a `bertjax ...` command on all of a job's workers and reports how it ended:
    (kind, log tail), kind "exited" (every worker ended by itself), "resumable" (the workers saved and exited with
    STOPPED_EXIT before the job's end), "preempted" (workers killed or gone), "refused" (a worker exited with
    USAGE_ERROR_EXIT), "failed" (a worker exited with another error) or "stopped" (the launcher itself was asked to
    stop, by a signal: the run is not restarted)."""

    def run(self, command: list[str]) -> tuple[str, str]: ...


def failure_signature(log_tail: str) -> str:
    """The last error line of a log, without numbers that change between runs (pids, times, addresses)."""
    lines = [line for line in log_tail.splitlines() if re.search(r"error|Error|Exception|Traceback", line)]
    return re.sub(r"\d+", "N", lines[-1].strip()) if lines else log_tail.strip()[-200:]


def is_completed(workdir: str) -> bool:
    from bertjax.checkpoint import (
        COMPLETION_MARKER,  # here: the launcher's --help does not load JAX
    )

    return (epath.Path(workdir) / COMPLETION_MARKER).exists()


def babysit(backend: Backend, command: list[str], workdir: str, max_restarts: int,
            log: Callable[[str], None] = print) -> int:
    """Runs `command` until the job in `workdir` completes (0), or it fails the same way twice in a row or
    `max_restarts` restarts are spent (1), or the launcher is stopped by a signal first (STOPPED_EXIT, as the job
    itself: `launch ... && next` does not go on)."""
    from bertjax.pretraining.goodput import (
        launcher_event,  # the goodput account's time between runs
    )

    restarts, previous_failure = 0, None
    while True:
        launcher_event(workdir, "start", restart=restarts)
        kind, log_tail = backend.run(command)
        launcher_event(workdir, "end", restart=restarts, kind=kind)
        if is_completed(workdir):
            log(f"babysitter: job completed after {restarts} restart(s)")
            return 0
        if kind == "stopped":
            log("babysitter: stopped by a signal before the job completed; not restarting (run the same command "
                "to resume)")
            return STOPPED_EXIT
        if kind == "refused":
            log(f"babysitter: the job was refused for its input or configuration; not restarting. Last output:\n"
                f"{log_tail}")
            return 1
        if kind in ("preempted", "resumable"):  # no failure: the same command goes on from the saved state
            previous_failure = None
        else:
            signature = failure_signature(log_tail)
            if signature == previous_failure:
                log(f"babysitter: the job failed the same way twice in a row; not restarting. Last output:\n"
                    f"{log_tail}")
                return 1
            previous_failure = signature
        if restarts >= max_restarts:
            log(f"babysitter: {max_restarts} restart(s) spent and the job has not completed. Last output:\n"
                f"{log_tail}")
            return 1
        restarts += 1
        log(f"babysitter: the job ended ({kind}) before completing; restart {restarts}/{max_restarts}")
