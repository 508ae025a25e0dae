"""One job per workdir: a lock file naming its holder (host, pid, start, command), refreshed while the job runs.

Two jobs in one workdir replace each other's checkpoints and interleave their metrics, and one may take a step the
other is still writing for a damaged one. So a job takes WORKDIR/LOCK before it writes anything and gives it back
when it ends. A holder that died without giving it back (SIGKILL, a preempted VM) must not hold the workdir for
ever: on the holder's own host the lock is stale once its pid is gone; from another host (a slice re-created
elsewhere, a shared gs:// workdir) once its heartbeat, rewritten every HEARTBEAT_S seconds by a daemon thread, is
older than STALE_AFTER_S. A job that finds another host's fresh lock waits up to STALE_AFTER_S for it to go stale
(a restarted slice meeting its dead predecessor's lock) before refusing.

Taking the lock is atomic on a local or network filesystem (O_CREAT | O_EXCL). On gs://, which etils/tf.io.gfile
give no create-if-absent for, it is write-then-read-back: two jobs starting within the same second on different
hosts can both believe they hold it; the heartbeat check then makes the later writer's lock win and the other job
stops at its next heartbeat with the holder named.
"""
from __future__ import annotations

import json
import os
import socket
import sys
import threading
import time
import uuid

from etils import epath

LOCK_NAME = "LOCK"
HEARTBEAT_S = 30.0
STALE_AFTER_S = 120.0


class WorkdirBusy(ValueError):
    """Another live job holds the workdir (a ValueError: bertjax exits 2, and the babysitter does not restart)."""


def describe(holder: dict) -> str:
    started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(holder.get("started", 0)))
    return (f"pid {holder.get('pid')} on {holder.get('host')}, started {started}, last heartbeat "
            f"{time.time() - holder.get('heartbeat', 0):.0f}s ago: {holder.get('command', '?')}")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's live process
        return True
    return True


def is_stale(holder: dict, now: float | None = None) -> bool:
    """Whether the job that wrote `holder` is gone: its pid is dead on this host, or its heartbeat is old."""
    now = time.time() if now is None else now
    if holder.get("host") == socket.gethostname() and not _pid_alive(int(holder.get("pid", -1))):
        return True
    return now - float(holder.get("heartbeat", 0)) > STALE_AFTER_S


class WorkdirLock:
    """The lock of one workdir, held by this process from `acquire()` to `release()`."""

    def __init__(self, workdir: str, command: str | None = None, log=print):
        self.path = epath.Path(workdir) / LOCK_NAME
        self.log = log
        now = time.time()
        self.holder = {"host": socket.gethostname(), "pid": os.getpid(), "token": uuid.uuid4().hex,
                       "started": now, "heartbeat": now,
                       "command": command or " ".join(["bertjax", *sys.argv[1:]])[:300]}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def read(self) -> dict | None:
        """The current holder's record (None: no lock, or one cut while being written)."""
        try:
            return json.loads(self.path.read_text())
        except FileNotFoundError:
            return None
        except (json.JSONDecodeError, UnicodeDecodeError):
            return {}

    def acquire(self, wait_s: float = STALE_AFTER_S) -> None:
        """Takes the lock, taking over a stale one (said in a line); raises WorkdirBusy naming a live holder."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        deadline = time.time() + wait_s
        while True:
            if self._create():
                break
            holder = self.read()
            if holder is None:  # released meanwhile
                continue
            if holder == {} or is_stale(holder):
                self.log(f"{self.path}: taking over the lock of a job that is gone ({describe(holder)})"
                         if holder else f"{self.path}: replacing an unreadable lock file")
                self._remove()
                continue
            same_host = holder.get("host") == socket.gethostname()
            if same_host or time.time() >= deadline:
                raise WorkdirBusy(f"{self.path.parent} is in use by another job ({describe(holder)}); wait for it "
                                  f"to end, stop it, or use another --workdir (a holder that died frees it: on "
                                  f"its host at once, elsewhere {STALE_AFTER_S:.0f}s after its last heartbeat)")
            self.log(f"{self.path}: held by {describe(holder)}; waiting up to {deadline - time.time():.0f}s for "
                     "it to go stale")
            time.sleep(min(HEARTBEAT_S, max(deadline - time.time(), 0.1)))
        self._thread = threading.Thread(target=self._heartbeat, name="bertjax-workdir-lock", daemon=True)
        self._thread.start()

    def _create(self) -> bool:
        text = json.dumps(self.holder)
        if str(self.path).startswith("gs://"):  # no create-if-absent: write, then read back (module docstring)
            if self.path.exists():
                return False
            self.path.write_text(text)
            return (self.read() or {}).get("token") == self.holder["token"]
        try:
            fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "w") as f:
            f.write(text)
        return True

    def _remove(self) -> None:
        try:
            self.path.unlink()
        except FileNotFoundError:
            pass

    def _heartbeat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            self.refresh()

    def refresh(self) -> None:
        """Rewrites the heartbeat (while the lock is still ours: a taken-over lock is left to its new holder)."""
        if (self.read() or {}).get("token") != self.holder["token"]:
            return
        self.holder["heartbeat"] = time.time()
        if str(self.path).startswith("gs://"):  # an object write is atomic
            self.path.write_text(json.dumps(self.holder))
            return
        temporary = self.path.parent / f".{LOCK_NAME}.{self.holder['token']}"
        temporary.write_text(json.dumps(self.holder))
        os.replace(temporary, self.path)  # readers never see a half-written lock

    def release(self) -> None:
        """Gives the lock back, if this process still holds it."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        if (self.read() or {}).get("token") == self.holder["token"]:
            self._remove()

    def __enter__(self) -> "WorkdirLock":
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()
