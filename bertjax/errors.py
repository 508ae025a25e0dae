"""How a caught error is told in one line (the command line prints one line per failure, never a traceback)."""
from __future__ import annotations


def first_line(error: BaseException, limit: int = 300) -> str:
    """`TypeName: first line of the message` (Orbax, TensorStore and TensorFlow messages run to many lines)."""
    text = getattr(error, "message", None) or str(error)
    line = (text.strip().splitlines() or [""])[0][:limit]
    return f"{type(error).__name__}: {line}" if line else type(error).__name__
