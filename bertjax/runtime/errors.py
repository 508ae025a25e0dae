"""How a caught error is told in one line (the command line prints one line per failure, never a traceback).

And the rule for every boundary where a library (TensorFlow, TensorStore, a writer: TensorBoard's, W&B's) touches a
user's file: `at_file(path)` around it turns a failure of the file or its file system (permission, a full or
read-only disk, a process limit, a file gone) into one line naming the file and why (`cannot read PATH: ...`,
`cannot write PATH: ...`), exit 2. A disk that filled during a TensorBoard flush was `OSError: [Errno 28]` naming no
file, and an unreadable data.input TensorFlow's PermissionDeniedError, both tracebacks with exit 1. What escapes
every boundary is still told by the path its library named (`file_failure_line`, the command line's last resort).
"""
from __future__ import annotations

import contextlib
import errno
import getpass
import os
import re
from typing import Iterator


class OutputWriteError(ValueError):
    """An output could not be written (a full or read-only disk, ...): one line, exit 2 (the machine's state, not a
    bug, and not worth a retry); the writer has removed what it began."""


class FileReadError(ValueError):
    """A user's file could not be read (permission, a process limit, gone): one line naming it, exit 2."""


# The longest an error line may be (a line quoting a whole table row ran to thousands of characters).
LINE_LIMIT = 1000


def shown(value, limit: int = 60) -> str:
    """repr(value) for an error line, its middle cut where longer than `limit` (saying how long it was): a value
    quoted from a user's file (a row read as a header, a text in a label column) stays readable."""
    text = repr(value.tolist() if hasattr(value, "tolist") else value)
    if len(text) <= limit:
        return text
    keep = (limit - 3) // 2
    return f"{text[:keep]}...{text[-keep:]} ({len(text):,} characters)"


def shown_list(values, limit: int = 10) -> str:
    """The first `limit` of `values` as a list for an error line, each shown(), and how many there are."""
    values = list(values)
    head = ", ".join(shown(v) for v in values[:limit])
    return f"[{head}]" if len(values) <= limit else f"[{head}, ... ({len(values):,} in all)]"


def clipped(line: str, limit: int = LINE_LIMIT) -> str:
    """`line` cut in its middle to `limit` characters (the last resort of the one-line error)."""
    if len(line) <= limit:
        return line
    keep = (limit - 40) // 2
    return f"{line[:keep]} ... ({len(line) - 2 * keep:,} characters cut) ... {line[-keep:]}"


def first_line(error: BaseException, limit: int = 300) -> str:
    """`TypeName: first line of the message` (Orbax, TensorStore and TensorFlow messages run to many lines)."""
    text = getattr(error, "message", None) or str(error)
    line = (text.strip().splitlines() or [""])[0][:limit]
    return f"{type(error).__name__}: {line}" if line else type(error).__name__


def is_full_disk(error: BaseException) -> bool:
    """An OSError's ENOSPC, TensorFlow's and TensorStore's RESOURCE_EXHAUSTED, or one of those wrapped in another
    error's message (Beam's); not a process limit told as RESOURCE_EXHAUSTED too (too many open files: a run under
    `ulimit -n 40` was told "no space left on device" with 50 GB free)."""
    text = str(error)
    return ("No space left" in text or getattr(error, "errno", None) == errno.ENOSPC
            or "RESOURCE_EXHAUSTED" in text and limit_line(error) is None)


def cannot_write(what: str, error: BaseException) -> str:
    """`cannot write WHAT: no space left on device` for a full disk, the process limit it hit, else why (`cause`)."""
    return f"cannot write {what}: {cause(error, what)}"


def cannot_read(what: str, error: BaseException) -> str:
    """`cannot read WHAT: permission denied to USER; ...`: the file the error names where it names one inside
    WHAT (a file of a directory, of a glob), and why (`cause`)."""
    named = failed_path(error)
    where = f"{named} (of {what})" if named and named.rstrip("/") != str(what).rstrip("/") else what
    line = f"cannot read {where}: {cause(error, what)}"
    if is_permission_error(error):
        line += "; give this user read access to it (chmod u+r, a directory u+rx), or run as its owner"
    return line


def user() -> str:
    """This process's user name (its uid where it has none)."""
    try:
        return getpass.getuser()
    except (KeyError, OSError):
        return f"uid {os.getuid()}"


def is_permission_error(error: BaseException) -> bool:
    """An OSError's EACCES/EPERM, or TensorStore's or TensorFlow's PERMISSION_DENIED in an error's message."""
    text = str(error)
    return isinstance(error, PermissionError) or "PERMISSION_DENIED" in text or "Permission denied" in text


# TensorFlow's statuses of a file or its file system (their class names: TensorFlow is not imported here).
_TENSORFLOW_FILE_ERRORS = ("PermissionDeniedError", "NotFoundError", "ResourceExhaustedError",
                           "FailedPreconditionError")
# TensorFlow's file errors read "PATH; REASON" (inside a tf.data op: "{{function_node ...}} PATH; REASON [Op:...]").
_TENSORFLOW_NAMED = re.compile(r"^(?:\{\{[^}]*\}\}\s*)?(?P<path>[^\s;{}][^;{}]*?); (?P<reason>[A-Z][^;\[\n]*?)"
                               r"\s*(?:\[Op:|$)", re.M)


def _from_tensorflow(error: BaseException) -> bool:
    return type(error).__module__.startswith("tensorflow") and type(error).__name__ in _TENSORFLOW_FILE_ERRORS


# The system's errors of a file or its file system (not a network's: a refused connection may be worth a retry).
_FILE_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM, errno.EIO, errno.ENOENT,
                errno.EISDIR, errno.ENOTDIR, errno.ELOOP, errno.EFBIG, errno.EMFILE, errno.ENFILE, errno.ENAMETOOLONG,
                errno.EEXIST, errno.ENOTEMPTY, errno.EXDEV}


def is_file_failure(error: BaseException) -> bool:
    """A failure of a file or its file system, not a bug: an OSError the system raised for a file (full, read-only,
    permission, gone, a limit), TensorFlow's file statuses, TensorStore's permission and space statuses."""
    if isinstance(error, OSError):
        return error.errno in _FILE_ERRNOS
    return _from_tensorflow(error) or is_permission_error(error) or is_full_disk(error) \
        or limit_line(error) is not None


def failed_path(error: BaseException) -> str | None:
    """The path a file failure names: an OSError's filename, the PATH of TensorFlow's "PATH; REASON"."""
    if isinstance(error, OSError):
        return str(error.filename) if error.filename else None
    found = _TENSORFLOW_NAMED.search(getattr(error, "message", None) or str(error)) if _from_tensorflow(error) \
        else None
    return found.group("path") if found else None


def cause(error: BaseException, where=None) -> str:
    """Why a file could not be read or written, in a few words: the process limit hit (with its value), no space
    left, permission denied to this user, a symbolic link that leads back to itself on the way to the file (its path
    or `where`), the system's or TensorFlow's reason, else the error's first line."""
    if isinstance(error, OSError) and error.errno in (errno.EEXIST, errno.ELOOP, errno.ENOTDIR, errno.ENOENT):
        loop = link_loop(error.filename or where)  # told as "File exists" or "Not a directory" by the system
        if loop is not None:
            return f"{loop} is a symbolic link that leads back to itself (a loop); remove it, or point it at a folder"
    limit = limit_line(error)
    if limit is not None:
        return limit
    if is_full_disk(error):
        return "no space left on device"
    if is_permission_error(error):
        return f"permission denied to {user()}"
    reason = error.strerror if isinstance(error, OSError) else None
    if reason is None and _from_tensorflow(error):
        found = _TENSORFLOW_NAMED.search(getattr(error, "message", None) or str(error))
        reason = found.group("reason") if found else None
    return reason[0].lower() + reason[1:] if reason else first_line(error)


def link_loop(path) -> str | None:
    """The symbolic link on the way to local `path` (itself or a folder above it) that leads back to itself, or
    None."""
    if not isinstance(path, (str, os.PathLike)) or "://" in str(path):
        return None
    parts = os.path.abspath(path).split(os.sep)
    for end in range(2, len(parts) + 1):
        prefix = os.sep.join(parts[:end])
        if os.path.islink(prefix):
            try:
                os.path.realpath(prefix, strict=True)
            except OSError as error:
                if error.errno == errno.ELOOP:
                    return prefix
                return None  # a link to nothing: not a loop
    return None


def _told(error: BaseException) -> bool:
    """An error bertjax has already put in its one line (not a library's raw status: "RESOURCE_EXHAUSTED: ...")."""
    return isinstance(error, ValueError) and not re.match(r"[A-Z_]+: ", str(error))


@contextlib.contextmanager
def at_file(path, *, writing: bool = False) -> Iterator[None]:
    """Around a boundary where a library reads (or, `writing`, writes) the user's file or directory `path`: a file
    failure (`is_file_failure`) inside is raised as one line naming it, FileReadError (`cannot read PATH: why`)
    or OutputWriteError (`cannot write PATH: why`); every other error passes unchanged."""
    try:
        yield
    except Exception as error:
        if _told(error) or not is_file_failure(error):
            raise
        if writing:
            raise OutputWriteError(cannot_write(path, error)) from None
        raise FileReadError(cannot_read(path, error)) from None


def file_failure_line(error: BaseException) -> str:
    """The last resort's line for a file failure no boundary caught: the path its library named, and why."""
    named = failed_path(error)
    if not named:
        return f"a file could not be read or written ({cause(error)})"
    why = cause(error, named)
    return why if why.startswith(f"{named} is ") else f"{named}: {why}"


# Process limits, as resource.getrlimit names them, with the shell's spelling and what a failure says about each.
_OPEN_FILES = (errno.EMFILE, "Too many open files", "os_error_code=24", "os_error_code='24'")
_FILE_SIZE = (errno.EFBIG, "File too large", "os_error_code=27", "os_error_code='27'")
_MEMORY = (errno.ENOMEM, "Cannot allocate memory", "failed to map segment", "std::bad_alloc", "os_error_code=12",
           "os_error_code='12'")


def _says(error: BaseException, signs: tuple) -> bool:
    code, *texts = signs
    text = f"{type(error).__name__}: {error}"
    return getattr(error, "errno", None) == code or any(sign in text for sign in texts)


def _limit(name: str) -> int | None:
    """A soft process limit (None: unlimited)."""
    import resource

    soft = resource.getrlimit(getattr(resource, name))[0]
    return None if soft == resource.RLIM_INFINITY else soft


def limit_line(error: BaseException) -> str | None:
    """The process limit an error hit, named in a line with its value and how to raise it (None: no limit's)."""
    if _says(error, _OPEN_FILES):
        soft = _limit("RLIMIT_NOFILE")
        return (f"too many open files: this process may have {soft} open at once (ulimit -n {soft}); raise it "
                "(ulimit -n 65536)")
    if _says(error, _FILE_SIZE):
        soft = _limit("RLIMIT_FSIZE")
        where = f"{error.filename}: " if getattr(error, "filename", None) else ""
        said = f"the file-size limit (ulimit -f: {soft:,} bytes)" if soft is not None else "the file system's limit"
        return f"{where}a file grew past {said}; raise it (ulimit -f unlimited)"
    if isinstance(error, MemoryError) or _says(error, _MEMORY):
        soft = _limit("RLIMIT_AS")
        said = (f"the address-space limit (ulimit -v: {soft / 2**30:.1f} GiB) is reached; raise it (ulimit -v "
                "unlimited)" if soft is not None else "the machine's memory is exhausted")
        return f"out of memory: {said}"
    return None
