"""Run a command to its end, failing it only when it stalls: a hang is a process that neither uses CPU nor writes
output for a while; a slow start on a loaded machine (TensorFlow's import, a compile) keeps doing both. A wall-clock
timeout alone failed jobs that were merely slow at a load of ~17."""
from __future__ import annotations

import os
import subprocess
import tempfile
import time
from dataclasses import dataclass

# A process blocked for ever (a tf.data iterator's destructor, a lock) uses no CPU; 90 s without a tick of CPU or a
# byte of output is far longer than any pause a working job makes, even behind other processes on two cores.
STALL_S = 90.0
# A job that keeps working but never ends is also a failure; far past any test job's slowest run.
CEILING_S = 1200.0
_TICKS = os.sysconf("SC_CLK_TCK")


@dataclass
class Finished:
    returncode: int
    stdout: str
    stderr: str
    seconds: float


class Stalled(AssertionError):
    """The command made no progress for `STALL_S` seconds (or ran past `CEILING_S`)."""


def _stat_fields(pid: int) -> list[bytes]:
    """/proc/PID/stat's fields from the state on (the command name, which may hold spaces, cut off); [] if gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()
    except OSError:
        return []


def _cpu_seconds(root: int) -> float:
    """CPU seconds used so far by a process and every live descendant (a launcher's workers, a job's helpers)."""
    parents = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            fields = _stat_fields(int(entry))
            if fields:
                parents[int(entry)] = (int(fields[1]), fields)
    tree, total = {root}, 0.0
    for pid in sorted(parents):  # children have larger pids, except after a wrap: found on the next pass
        if pid in tree or parents[pid][0] in tree:
            tree.add(pid)
            # utime, stime, cutime, cstime: fields 14-17 of stat(5), counted here from the state (field 3).
            total += sum(int(v) for v in parents[pid][1][11:15]) / _TICKS
    return total


def run(argv: list[str], *, stall_s: float = STALL_S, ceiling_s: float = CEILING_S, **popen) -> Finished:
    """Run `argv` to its end (stdout and stderr captured as text); raise `Stalled`, with the stderr tail, if it goes
    `stall_s` seconds without CPU time or output, or runs `ceiling_s` in all. The process is killed first."""
    start = time.monotonic()
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        proc = subprocess.Popen(argv, stdout=out, stderr=err, **popen)
        progress = (0.0, 0)
        last_progress = start
        while proc.poll() is None:
            time.sleep(0.5)
            now = time.monotonic()
            seen = (_cpu_seconds(proc.pid), os.fstat(out.fileno()).st_size + os.fstat(err.fileno()).st_size)
            if seen != progress:
                progress, last_progress = seen, now
            if now - last_progress > stall_s or now - start > ceiling_s:
                proc.kill()
                proc.wait()
                err.seek(0)
                tail = err.read()[-2000:].decode(errors="replace")
                why = (f"no CPU time or output for {stall_s:.0f} s" if now - last_progress > stall_s
                       else f"still running after {ceiling_s:.0f} s")
                raise Stalled(f"{' '.join(argv[:4])}: {why}; stderr tail: {tail!r}")
        out.seek(0)
        err.seek(0)
        return Finished(proc.returncode, out.read().decode(errors="replace"), err.read().decode(errors="replace"),
                        time.monotonic() - start)


def run_at_once(argvs: list[list[str]], **popen) -> tuple[list[int], list[str], list[int]]:
    """Starts every command of `argvs` at once (stdout and stderr together) and waits for all: (exit statuses,
    outputs, pids), in `argvs`' order. For races (two jobs on one workdir or --out); each is killed on a failure."""
    jobs = [subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **popen)
            for argv in argvs]
    try:
        outputs = [job.communicate(timeout=600)[0] for job in jobs]
    finally:
        for job in jobs:
            job.kill()
    return [job.returncode for job in jobs], outputs, [job.pid for job in jobs]
