"""Every output a command produces is whole or absent, and has one writer at a time.

`replaced_when_whole(target)`: the body writes a temporary path beside `target` (`.NAME.partial-<id>`: the same
directory, so the same file system) that is renamed into place when the body returns: a file over an earlier one
(`os.replace`: a reader finds the old file or the new, never a part of one), a directory only where there is none.
When the body raises (a full disk, a stop signal, a bug), what it began is removed (with whatever Orbax made beside
it under that name), an earlier output is as it was, and a failed write is told in one line naming the target and
why (`cannot write OUT: no space left on device`). On gs:// an object appears whole when its upload ends and there is
no rename: the body writes `target` itself (Orbax marks a checkpoint complete there by its own commit file).

`one_writer(target, flag)`: one run per output. Two runs writing one --out each said "wrote" and one's output was
lost; so a run holds the workdir lock (workdir_lock.py) of its output, `.NAME.LOCK` beside it, from before its work
until the output is in place, and a second run is refused naming the holder. (`data create` and `vocab train`, whose
--out is a directory they fill, hold OUT/LOCK: data/out_dir.py.)
"""
from __future__ import annotations

import contextlib
import errno
import glob
import os
import shutil
import uuid
from typing import Iterator

from etils import epath

from bertjax.runtime.errors import OutputWriteError, cannot_write, is_full_disk
from bertjax.runtime.workdir_lock import WorkdirLock


def check_file_target(output: str, flag: str, inputs: tuple[str, ...] | list[str] = ()) -> None:
    """An output file checked before any work: it is no directory, its directory exists, and it is none of the
    command's `inputs` (writing it would replace the user's file)."""
    if "://" in output:  # a bucket has no directories to check
        if output in inputs:
            raise ValueError(f"{flag} {output} is also an input; give another file")
        return
    if os.path.isdir(output):
        raise ValueError(f"{flag} {output} is a directory; expected a file name")
    folder = os.path.dirname(os.path.abspath(output))
    if not os.path.isdir(folder):
        raise ValueError(f"{flag} {output}: no directory {folder}; create it first")
    for source in (s for s in inputs if s != "-" and os.path.exists(s)):
        if os.path.exists(output) and os.path.samefile(output, source):  # a link or another spelling of it too
            raise ValueError(f"{flag} {output} is the input {source}; writing it would replace the input, give "
                             "another file")


def _local_target(target: str) -> str:
    """The path a local output is written at: a symlink's target (the link stays a link), absolute."""
    return os.path.realpath(target)


@contextlib.contextmanager
def one_writer(target: str, flag: str, log=print) -> Iterator[None]:
    """Runs the body holding the lock of the output `target` (named by `flag`); WorkdirBusy, naming the holder, if
    another live run holds it. Two spellings of one path (a link, `x/../out`) are one output."""
    final = target if "://" in target else _local_target(target)
    parent, name = final.rsplit("/", 1) if "://" in final else os.path.split(final)
    lock = WorkdirLock(parent, log=log, name=f".{name}.LOCK", flag=flag, guards=f"{flag} {target}")
    lock.acquire()
    try:
        yield
    finally:
        lock.release()


def is_write_failure(error: BaseException) -> bool:
    """An error of the machine's state while writing (OSError: full, read-only, a file-size limit; TensorStore's
    and TensorFlow's RESOURCE_EXHAUSTED), not a bug of the writer."""
    return isinstance(error, OSError) or is_full_disk(error)


@contextlib.contextmanager
def replaced_when_whole(target: str, *, directory: bool = False) -> Iterator[str]:
    """Yields the path the body writes `target` at (a file, or a directory when `directory`), renamed into place
    when the body returns; see the module's docstring. A directory target must not exist."""
    if "://" in target:
        try:
            yield target
        except Exception as error:
            if is_write_failure(error):
                raise OutputWriteError(cannot_write(target, error)) from None
            raise
        return
    final = _local_target(target)
    partial = os.path.join(os.path.dirname(final), f".{os.path.basename(final)}.partial-{uuid.uuid4().hex[:8]}")
    try:
        yield partial
        if directory:
            if os.path.lexists(final):  # a rename would replace an empty directory without a word
                raise ValueError(f"{target} appeared while this run wrote it; choose a new directory")
            os.rename(partial, final)
        else:
            if os.path.exists(final):  # the earlier file's permissions, not a new file's
                shutil.copymode(final, partial)
            os.replace(partial, final)
    except BaseException as error:
        # Some writers do not say why a write fell short (numpy: "12800 requested and 2016 written"): a disk
        # found full before the partial output is removed is why.
        full = isinstance(error, OSError) and not is_full_disk(error) and _no_space_left(os.path.dirname(final))
        remove_partial(partial)
        if isinstance(error, Exception) and is_write_failure(error):
            raise OutputWriteError(cannot_write(target, OSError(errno.ENOSPC, "full") if full else error)) from None
        raise


def _no_space_left(directory: str) -> bool:
    try:
        stats = os.statvfs(directory)
    except OSError:
        return False
    return stats.f_bavail * stats.f_frsize < 64 << 10


@contextlib.contextmanager
def open_whole(target, mode: str = "w", **kwargs) -> Iterator:
    """`open(target, mode)` for a file written whole: beside it, renamed into place when closed
    (replaced_when_whole): a job's metrics.json cut by a full disk read as a finished run's."""
    with replaced_when_whole(str(target)) as partial:
        opened = open(partial, mode, **kwargs) if "://" not in partial else epath.Path(partial).open(mode, **kwargs)
        with opened as f:
            yield f


def write_whole(target, text: str) -> None:
    """`text` as the file `target` (UTF-8), written whole (open_whole)."""
    with open_whole(target, "w", encoding="utf-8") as f:
        f.write(text)


def remove_partial(partial: str) -> None:
    """Removes `partial` and what was made beside it under its name (Orbax's `<partial>.orbax-checkpoint-tmp*`);
    quietly: on a full disk or one gone read-only a removal may fail too."""
    for path in [partial, *glob.glob(glob.escape(partial) + ".*")]:
        try:
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path, ignore_errors=True)
            elif os.path.lexists(path):
                os.unlink(path)
        except OSError:
            pass
