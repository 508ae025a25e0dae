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
    error's message (Beam's)."""
    text = str(error)
    return "RESOURCE_EXHAUSTED" in text or "No space left" in text or getattr(error, "errno", None) == errno.ENOSPC


def cannot_write(what: str, error: BaseException) -> str:
    """`cannot write WHAT: no space left on device` for a full disk, else with the error's first line."""
    if is_full_disk(error):
        return f"cannot write {what}: no space left on device"
    return f"cannot write {what}: {first_line(error)}"
