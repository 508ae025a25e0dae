"""JSON written as every strict parser reads it, and read with its nesting checked first, naming where it came from.

Writing: Python's json module writes `NaN` and `Infinity` by default, which is not JSON (JavaScript's JSON.parse, jq
and most other parsers reject the whole file), so a non-finite number is written as null. Every JSON file or line
the project writes goes through here.

Reading: Python's parser recurses once per level of arrays and objects, so a file nested a few thousand levels deep
(a few kilobytes of brackets) ended in a RecursionError traceback naming no file. Every JSON document or line the
package reads from a user's or a run's file goes through `loads` (a file through input_files.read_json, which
checks its type and size first): its depth is counted by a scan that does not recurse before the parser sees it,
and an error names the source (the file; the file and line of a JSON Lines row) and what was expected there.
"""
from __future__ import annotations

import json
import math
import re

import numpy as np

# How deep a JSON value bertjax reads may nest. Real files nest a few levels (a tokenizer.json 5, an HF config.json
# 2); Python's parser fails near its recursion limit (1000, less the caller's own stack) and HF tokenizers' serde_json
# at 128. So 100: far above any real file, below both, so neither parser ever meets a value it cannot read for depth.
MAX_DEPTH = 100

# What is not a bracket: a string (an unterminated one runs to the end), or a run of other characters.
_NOT_A_BRACKET = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"?|[^\[\]{}"]+', re.S)
_OPENING = np.frombuffer(b"[{", np.uint8)


class TooDeep(ValueError):
    """JSON nested deeper than MAX_DEPTH levels."""


def nesting_depth(text: str | bytes) -> int:
    """How many levels of arrays and objects `text` nests (brackets inside strings not counted), found without
    parsing it (nothing recurses). A closing bracket with nothing open (JSON no parser gets past) restarts the count."""
    if isinstance(text, bytes):
        text = text.decode("utf-8", "surrogateescape")
    brackets = np.frombuffer(_NOT_A_BRACKET.sub("", text).encode("ascii"), np.uint8)
    if not brackets.size:
        return 0
    levels = np.cumsum(np.where(np.isin(brackets, _OPENING), 1, -1))
    return int((levels - np.minimum.accumulate(np.minimum(levels, 0))).max())


def check_depth(text: str | bytes, source: str, what: str, limit: int = MAX_DEPTH) -> None:
    """Raises TooDeep naming `source` (a file, `file: line N`) and `what` was expected there when `text` nests more
    than `limit` levels."""
    if text.count("[" if isinstance(text, str) else b"[") + text.count("{" if isinstance(text, str) else b"{") \
            <= limit:  # too few brackets to nest that deep: the scan is skipped (most lines, small files)
        return
    depth = nesting_depth(text)
    if depth > limit:
        raise TooDeep(f"{source}: JSON nested {depth:,} levels deep (arrays or objects within each other; {limit} at "
                      f"most); expected {what}")


def loads(text: str | bytes, source: str, what: str, *, row: bool = False, **kwargs):
    """The JSON value of `text`, read from `source` (a file; for a JSON Lines `row`, its file and line, and then the
    place it stops is a column), where `what` was expected: ValueError naming both when it nests too deep (checked
    before the parser recurses) or is not JSON (where it stops, and whether it looks cut short). `kwargs` go to
    json.loads (an object_pairs_hook)."""
    check_depth(text, source, what)
    try:
        return json.loads(text, **kwargs)
    except json.JSONDecodeError as error:
        cut = error.pos >= len(error.doc.rstrip()) or error.msg.startswith("Unterminated string")
        where = f"column {error.colno}" if row else f"line {error.lineno}, column {error.colno}"
        raise ValueError(f"{source}: not valid JSON{' (cut short?)' if cut else ''}: {error.msg} ({where}); "
                         f"expected {what}") from None


def finite(value):
    """`value` with every non-finite float (Python or numpy, at any depth of dicts, lists and tuples) replaced by
    None, and numpy scalars made Python numbers."""
    if isinstance(value, dict):
        return {key: finite(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite(item) for item in value]
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def dumps(value, **kwargs) -> str:
    """json.dumps of finite(value); refuses (ValueError) what would still not be JSON."""
    return json.dumps(finite(value), allow_nan=False, **kwargs)


def dump(value, f, **kwargs) -> None:
    """json.dump of finite(value) into the open text file `f`."""
    f.write(dumps(value, **kwargs))
