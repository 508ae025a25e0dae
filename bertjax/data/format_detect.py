"""Which corpus format input files are, where their extension or bytes say so without doubt: `data create` and
`vocab train` use it when --format is left out, and refuse a --format the files contradict.

Parquet and Arrow files are told by their magic bytes (or .parquet / .arrow), JSON Lines by a first line that is a
JSON object (or .jsonl / .ndjson / .json), both after decompression; any other UTF-8 text is the `sentences`
layout, the original format (the text layouts cannot be told apart by their bytes: --format names the others).
"""
from __future__ import annotations

import json
import os
from typing import Callable, Sequence

from bertjax.data import file_readers

TEXT_LAYOUTS = ("sentences", "paragraphs", "wikitext", "wrapped")
_BY_EXTENSION = {".jsonl": "jsonl", ".ndjson": "jsonl", ".json": "jsonl", ".parquet": "parquet", ".arrow": "parquet"}
_COMPRESSED = tuple(end for _, ends in file_readers.COMPRESSIONS.values() for end in ends)
# Bytes are read from this many files (a glob on gs:// may match thousands); the names of all are checked.
SNIFFED_FILES = 8


def _family(corpus_format: str) -> str:
    return "text" if corpus_format in TEXT_LAYOUTS else corpus_format


def by_name(path: str) -> str | None:
    """"jsonl" | "parquet" from the extension (under a compression's), or None."""
    name = path.lower()
    for end in _COMPRESSED:
        if name.endswith(end):
            name = name[:-len(end)]
            break
    return _BY_EXTENSION.get(os.path.splitext(name)[1])


def by_bytes(path: str) -> str:
    """"parquet" | "jsonl" | "text" from a file's first 64 KiB (decompressed)."""
    _, head = file_readers._head(path)
    # Parquet, the Arrow IPC file format, and the Arrow IPC stream format (`datasets.save_to_disk`'s .arrow files:
    # a 0xFFFFFFFF continuation marker first, no magic).
    if head.startswith((b"PAR1", b"ARROW1", b"\xff\xff\xff\xff")):
        return "parquet"
    first = next((line.strip() for line in head.split(b"\n")[:-1] if line.strip()), b"")
    if first.startswith(b"{"):
        try:
            if isinstance(json.loads(first), dict):
                return "jsonl"
        except ValueError:
            pass
    return "text"


def detect(files: Sequence[str]) -> tuple[str, str]:
    """(family, why) of input files: "parquet", "jsonl" or "text". Files that disagree, or a file whose bytes
    contradict its name, are an error naming them."""
    kinds = []
    for index, path in enumerate(files):
        named = by_name(path)
        if index >= SNIFFED_FILES:
            kinds.append((path, named or "text", "its name"))
            continue
        seen = by_bytes(path)
        if named and named != seen:
            raise ValueError(f"{path}: named as {named} but its bytes are {_what(seen)}: rename it, or give "
                             f"--format")
        kinds.append((path, seen, "its extension and bytes" if named else "its bytes"))
    first = kinds[0]
    other = next((k for k in kinds if k[1] != first[1]), None)
    if other:
        raise ValueError(f"the input mixes formats: {first[0]} is {_what(first[1])}, {other[0]} is "
                         f"{_what(other[1])}; give one format per command")
    return first[1], f"{first[0]}: {_what(first[1])}, by {first[2]}" + (
        f" (and {len(files) - 1} more file(s) alike)" if len(files) > 1 else "")


def _what(family: str) -> str:
    return {"parquet": "Parquet/Arrow", "jsonl": "JSON Lines (each line a JSON object)", "text": "plain text"}[family]


def resolve(inputs: Sequence[str], given: str | None, log: Callable[[str], None]) -> str:
    """The corpus format for `inputs`: `given` (checked against the files) or, without it, the detected one
    (said in one line). hf: and tfds: inputs are left to their own rules."""
    if any(i.startswith(("hf:", "tfds:")) for pattern in inputs for i in pattern.split(",")):
        return given or "sentences"
    from bertjax.data.corpus import expand_inputs  # imports TensorFlow

    files = expand_inputs(inputs)
    family, why = detect(files)
    if given is None:
        chosen = "sentences" if family == "text" else family
        log(f"--format {chosen}, detected: {why}" + (
            " (paragraphs, wikitext and wrapped text need --format)" if family == "text" else ""))
        return chosen
    if _family(given) != family:
        raise ValueError(f"--format {given} does not match the input: {why}; pass --format "
                         f"{'sentences (or another text layout)' if family == 'text' else family}, or leave "
                         f"--format out")
    return given
