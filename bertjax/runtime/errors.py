"""How a caught error is told in one line (the command line prints one line per failure, never a traceback)."""
from __future__ import annotations

import errno


class OutputWriteError(ValueError):
    """An output could not be written (a full or read-only disk, ...): one line, exit 2 (the machine's state, not a
    bug, and not worth a retry); the writer has removed what it began."""


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
    """`cannot write WHAT: no space left on device` for a full disk, the process limit it hit, else the error's
    first line."""
    limit = limit_line(error)
    if limit is not None:
        return f"cannot write {what}: {limit}"
    if is_full_disk(error):
        return f"cannot write {what}: no space left on device"
    return f"cannot write {what}: {first_line(error)}"


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
