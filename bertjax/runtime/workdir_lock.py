"""One job per workdir: a lock file naming its holder (host, pid, start, command), refreshed while the job runs.

Two jobs in one workdir replace each other's checkpoints and interleave their metrics, and one may take a step the
other is still writing for a damaged one. So a job takes WORKDIR/LOCK before it writes anything and gives it back
when it ends. A holder that died without giving it back (SIGKILL, a preempted VM) must not hold the workdir for
ever: on the holder's own host the lock is stale once its pid is gone; from another host (a slice re-created
elsewhere, a shared gs:// workdir) once its heartbeat, rewritten every HEARTBEAT_S seconds by a daemon thread, is
older than STALE_AFTER_S. A job that finds another host's fresh lock waits up to STALE_AFTER_S for it to go stale
(a restarted slice meeting its dead predecessor's lock) before refusing.

Taking the lock is atomic: O_CREAT | O_EXCL on a local or network filesystem; on gs:// an object created only if
absent (Cloud Storage's ifGenerationMatch=0, cloud_storage.py). On gs:// every later write names the generation
read: a heartbeat only over our own lock, a takeover only over the stale lock that was read (of two jobs taking
over one dead holder, one wins), a release only of our own.

Whatever a LOCK holds that is not a holder's record (empty, cut, `null`, a list, a heartbeat that is no number)
is unreadable and replaced, said in a line; a LOCK that is a directory is refused, naming it.
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

from bertjax.runtime import jsonio, workdir_paths
from bertjax.runtime.cloud_storage import ABSENT, GcsObject

LOCK_NAME = "LOCK"
HEARTBEAT_S = 30.0
STALE_AFTER_S = 120.0
LOCAL_GENERATION = 1  # what a local LOCK's "generation" always is (any number but ABSENT)


class WorkdirBusy(ValueError):
    """Another live job holds the workdir (a ValueError: bertjax exits 2, and the babysitter does not restart)."""


# A heartbeat further ahead of this host's clock than this is told as clock skew (writes take well under it).
SKEW_TOLERANCE_S = 5.0


def describe(holder: dict) -> str:
    started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(holder.get("started", 0)))
    age = time.time() - holder.get("heartbeat", 0)
    beat = (f"last heartbeat {age:.0f}s ago" if age > -SKEW_TOLERANCE_S else
            f"last heartbeat {-age:.0f}s in the future by this host's clock: its host's clock and this one's "
            f"disagree (clock skew), and it counts as live until this clock passes it by {STALE_AFTER_S:.0f}s")
    return f"pid {holder.get('pid')} on {holder.get('host')}, started {started}, {beat}: {holder.get('command', '?')}"


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


def parse(text: bytes) -> dict:
    """The holder's record in a LOCK's bytes; {} when they are not one (cut, empty, null, a list, a bad field)."""
    try:
        holder = jsonio.loads(text, "LOCK", "a lock's holder record")
        if isinstance(holder, dict) and isinstance(holder.get("token"), str) and isinstance(holder.get("host"), str):
            return {**holder, "pid": int(holder["pid"]), "heartbeat": float(holder["heartbeat"]),
                    "started": float(holder["started"])}
    except (ValueError, TypeError, KeyError, UnicodeDecodeError):  # JSONDecodeError is a ValueError
        pass
    return {}


class LocalLockFile:
    """WORKDIR/LOCK on a file system: created by a hard link (atomic, fails if it exists), rewritten by rename
    (readers never see it half-written).
    The generation it hands out is always LOCAL_GENERATION: a rename cannot be made conditional, so the read-back
    check of the token just before a rewrite has to do. (Not ABSENT, 0: a heartbeat naming it would be taken for a
    create, refused since LOCK exists, and leave the job thinking it lost its lock: no heartbeats, no release.)"""

    def __init__(self, path: epath.Path):
        self.path = path

    def read(self) -> tuple[bytes, int] | None:
        try:
            return self.path.read_bytes(), LOCAL_GENERATION
        except FileNotFoundError:
            return None
        except IsADirectoryError:
            raise ValueError(f"{self.path} is a directory, not a lock file; remove it (rm -r {self.path}) and "
                             "start the job again") from None

    def _written_aside(self, data: bytes) -> epath.Path:
        """`data` in a file of its own beside LOCK; none left where the write fails (a full disk)."""
        temporary = self.path.parent / f".{LOCK_NAME}.{uuid.uuid4().hex}"
        try:
            temporary.write_bytes(data)
        except OSError:
            temporary.unlink(missing_ok=True)
            raise
        return temporary

    def write(self, data: bytes, generation: int) -> int | None:
        if generation == ABSENT:
            # Written whole under another name, then hard-linked as LOCK (which fails if LOCK exists): another
            # job never reads a just-created, still empty LOCK (taken for an unreadable one and replaced).
            temporary = self._written_aside(data)
            try:
                os.link(temporary, self.path)
            except FileExistsError:
                return None
            except OSError:  # a file system without hard links: create with O_EXCL, then write
                try:
                    fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
                except FileExistsError:
                    return None
                with os.fdopen(fd, "wb") as f:
                    f.write(data)
            finally:
                temporary.unlink(missing_ok=True)
            return LOCAL_GENERATION
        os.replace(self._written_aside(data), self.path)
        return LOCAL_GENERATION

    def delete(self, generation: int) -> bool:
        try:
            self.path.unlink()
        except FileNotFoundError:
            return False
        return True


class WorkdirLock:
    """The lock of one workdir, held by this process from `acquire()` to `release()`."""

    def __init__(self, workdir: str, command: str | None = None, log=print, name: str = LOCK_NAME,
                 flag: str = "--workdir", guards: str | None = None):
        """name: the lock file's (one per writer of a shared directory); flag: the option that named `workdir`;
        guards: what the lock is named for in a refusal (default: `workdir`; an output's lock beside it: the
        output)."""
        self.path = epath.Path(workdir_paths.canonical(workdir)) / name
        self.flag = flag
        self.guards = guards or str(self.path.parent)
        self.store = GcsObject(str(self.path)) if str(self.path).startswith("gs://") else LocalLockFile(self.path)
        self.log = log
        now = time.time()
        self.holder = {"host": socket.gethostname(), "pid": os.getpid(), "token": uuid.uuid4().hex,
                       "started": now, "heartbeat": now,
                       "command": command or " ".join(["bertjax", *sys.argv[1:]])[:300]}
        self.generation: int | None = None  # of our lock object, while we hold it
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def read(self) -> dict | None:
        """The current holder's record (None: no lock; {}: a LOCK that holds no holder's record)."""
        found = self.store.read()
        return None if found is None else parse(found[0])

    def acquire(self, wait_s: float = STALE_AFTER_S) -> None:
        """Takes the lock, taking over a stale one (said in a line); raises WorkdirBusy naming a live holder."""
        if not str(self.path).startswith("gs://"):  # Cloud Storage has no directories to make
            self.path.parent.mkdir(parents=True, exist_ok=True)
        deadline = time.time() + wait_s
        while True:
            try:
                self.generation = self.store.write(self._text(), ABSENT)
            except OSError as error:  # a read-only disk or mount, someone else's directory: named, not a temp file
                raise ValueError(f"{self.path.parent}: cannot write there ({error.strerror or error}); give a "
                                 f"writable {self.flag}") from None
            if self.generation is not None:
                break
            found = self.store.read()
            if found is None:  # released meanwhile
                continue
            holder, generation = parse(found[0]), found[1]
            if holder.get("token") == self.holder["token"]:  # our create went through, its reply was lost
                self.generation = generation
                break
            if holder == {} or is_stale(holder):
                self.log(f"{self.path}: taking over the lock of a job that is gone ({describe(holder)})"
                         if holder else f"{self.path}: replacing an unreadable lock file")
                # Only over the lock just read: of two jobs taking over one dead holder, one wins.
                self.generation = self._take_over(generation)
                if self.generation is not None:
                    break
                continue
            same_host = holder.get("host") == socket.gethostname()
            if same_host or time.time() >= deadline:
                raise WorkdirBusy(f"{self.guards} is in use by another job ({describe(holder)}); wait for it "
                                  f"to end, stop it, or use another {self.flag} (a holder that died frees it: on "
                                  f"its host at once, elsewhere {STALE_AFTER_S:.0f}s after its last heartbeat)")
            self.log(f"{self.path}: held by {describe(holder)}; waiting up to {deadline - time.time():.0f}s for "
                     "it to go stale")
            time.sleep(min(HEARTBEAT_S, max(deadline - time.time(), 0.1)))
        self._thread = threading.Thread(target=self._heartbeat, name="bertjax-workdir-lock", daemon=True)
        self._thread.start()

    def _text(self) -> bytes:
        return json.dumps(self.holder).encode()

    def _take_over(self, generation: int) -> int | None:
        if isinstance(self.store, LocalLockFile):  # remove, then create with O_EXCL like any other taker
            self.store.delete(generation)
            return self.store.write(self._text(), ABSENT)
        return self.store.write(self._text(), generation)

    def _heartbeat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            self.refresh()

    def refresh(self) -> None:
        """Rewrites the heartbeat (while the lock is still ours: a taken-over lock is left to its new holder)."""
        if self.generation is None or (self.read() or {}).get("token") != self.holder["token"]:
            return
        self.holder["heartbeat"] = time.time()
        # On gs:// only over our own generation: a takeover since the read above wins.
        self.generation = self.store.write(self._text(), self.generation)

    def release(self) -> None:
        """Gives the lock back, if this process still holds it."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        if self.generation is not None and (self.read() or {}).get("token") == self.holder["token"]:
            self.store.delete(self.generation)
        self.generation = None

    def __enter__(self) -> "WorkdirLock":
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()
