"""The suite's hang detector tells a hang from a slow start by progress (CPU time or output), not by wall time."""
import sys

import pytest

from tests import stall_watch


def test_a_slow_but_working_process_runs_to_its_end():
    """Busy for 4 s with no output, past a 2 s stall limit: CPU time is progress."""
    busy = "import time\nend = time.monotonic() + 4\nwhile time.monotonic() < end: pass\nprint('done')"
    done = stall_watch.run([sys.executable, "-c", busy], stall_s=2)
    assert (done.returncode, done.stdout, done.seconds >= 4) == (0, "done\n", True)


def test_a_quiet_worker_process_counts_for_its_parent():
    """A parent waiting on a busy child (a launcher and its workers) is not stalled."""
    child = "import time\\nend = time.monotonic() + 4\\nwhile time.monotonic() < end: pass"
    parent = f"import subprocess, sys\nsubprocess.run([sys.executable, '-c', '{child}'], check=True)"
    assert stall_watch.run([sys.executable, "-c", parent], stall_s=2).returncode == 0


def test_a_blocked_process_is_killed_and_reported_with_its_stderr():
    blocked = "import sys, time\nprint('started', file=sys.stderr, flush=True)\ntime.sleep(600)"
    with pytest.raises(stall_watch.Stalled, match=r"no CPU time or output for 2 s; stderr tail: 'started\\n'"):
        stall_watch.run([sys.executable, "-c", blocked], stall_s=2)
