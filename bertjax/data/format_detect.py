"""Which corpus format input files are, where their extension or bytes say so without doubt. Every command that
reads a corpus (`data create` local and Beam, `vocab train`, pretrain's data.input and data.eval_input) resolves its
format through `resolve` before reading: a format left at `auto` is detected and said in one line, a format given
is checked against the files, and the files are checked for what the format cannot read
(`file_readers.check_input_files`).

Parquet and Arrow files are told by their magic bytes (or .parquet / .arrow), JSON Lines by a first line that is a
JSON object (or .jsonl / .ndjson / .json), both after decompression; any other UTF-8 text is the `sentences`
layout, the original format (the text layouts cannot be told apart by their bytes: --format names the others).

One policy for a file whose name contradicts its bytes, in every reader (corpora here; users' tables in
finetune/table_data.py; every command's text input in file_readers): a name that says what a file is (a
compression's extension, .jsonl, .parquet; a table's .csv) must agree with the bytes, else the file is refused
naming both (`named_otherwise`); a name that says nothing (.txt, none) leaves it to the bytes, and the detection line
says so. Parquet or Arrow inside a compression is refused the same way: those formats are read as they are.

Each input entry is one format: its own `FORMAT:` (`wrapped:books/*.txt`), else --format's, else what its files are
detected as. Entries of different formats make a mixed corpus (corpus_format `mixed`, every entry then naming its
format), read file by file in its own format (corpus.file_formats); one entry whose files differ is refused.
"""
from __future__ import annotations

import codecs
import dataclasses
import os
from typing import Callable, Sequence, TypeVar

from bertjax.data import file_readers
from bertjax.runtime import jsonio
from bertjax.data.data_config import AUTO_FORMAT, MIXED_FORMAT, CorpusConfig

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
    """"parquet" | "jsonl" | "text" from a file's first 64 KiB (decompressed); Parquet or Arrow inside a compression
    is an error naming both (file_readers.compressed_table)."""
    compression, head = file_readers._head(path)
    head = head.removeprefix(codecs.BOM_UTF8)  # Excel's "UTF-8" files start with the byte-order mark
    # Parquet, the Arrow IPC file format, and the Arrow IPC stream format (`datasets.save_to_disk`'s .arrow files:
    # a 0xFFFFFFFF continuation marker first, no magic).
    if head.startswith((b"PAR1", b"ARROW1", b"\xff\xff\xff\xff")):
        if compression:
            raise ValueError(file_readers.compressed_table(path, compression))
        return "parquet"
    first = next((line.strip() for line in head.split(b"\n")[:-1] if line.strip()), b"")
    if first.startswith(b"{"):
        try:
            if isinstance(jsonio.loads(first, f"{path}: line 1", "a JSON object", row=True), dict):
                return "jsonl"
        except jsonio.TooDeep:
            return "jsonl"  # an object's line, too deep to parse: its reader names the file and the line
        except ValueError:
            pass
    return "text"


class MixedFormats(ValueError):
    """Files of one input (a glob, a directory) that are of different formats."""


def detect(files: Sequence[str], key: str = "--format") -> tuple[str, str]:
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
            raise ValueError(named_otherwise(path, named, seen, f"rename it, or set {key}"))
        kinds.append((path, seen, "its extension and bytes" if named else "its bytes"))
    first = kinds[0]
    other = next((k for k in kinds if k[1] != first[1]), None)
    if other:
        raise MixedFormats(f"the input mixes formats: {first[0]} is {_what(first[1])}, {other[0]} is "
                           f"{_what(other[1])}; give each format its own --input (FORMAT:PATTERN names it)")
    return first[1], f"{first[0]}: {_what(first[1])}, by {first[2]}" + (
        f" (and {len(files) - 1} more file(s) alike)" if len(files) > 1 else "")


def named_otherwise(path: str, named: str, seen: str, fix: str = "rename it to what it is") -> str:
    """The line for a file named as one format (`named`: jsonl, parquet, CSV, ...) whose bytes are another (`seen`:
    a family by_bytes gives), and how to put it right (`fix`)."""
    return f"{path}: named as {named} but its bytes are {_what(seen)}: {fix}"


def _what(family: str) -> str:
    return {"parquet": "Parquet/Arrow", "jsonl": "JSON Lines (each line a JSON object)", "text": "plain text"}[family]


Config = TypeVar("Config", bound=CorpusConfig)


def _setting(key: str, value: str) -> str:
    return f"{key} {value}" if key.startswith("--") else f"{key}={value}"


def resolve(config: Config, log: Callable[[str], None], key: str = "--format") -> Config:
    """`config` with its corpus format resolved: `auto` becomes the detected format (said in one line naming the
    file(s) and the format), a given one is checked against the files. `key` names the setting in what is said
    (--format, data.corpus_format). Inputs of different formats (named by their FORMAT:, or detected per input)
    give corpus_format `mixed` with every input naming its own. hf: and tfds: inputs are left to their own rules."""
    given, inputs = config.corpus_format, config.inputs
    if any(i.startswith(("hf:", "tfds:")) for i in inputs):
        return dataclasses.replace(config, corpus_format="sentences" if given == AUTO_FORMAT else given)
    from bertjax.data.corpus import expand_inputs  # imports TensorFlow

    entries = config.input_entries
    if given != MIXED_FORMAT and not any(fmt for fmt, _ in entries):
        files = expand_inputs(inputs)
        try:  # one format for every file, said as one detection
            family, why = detect(files, key)
        except MixedFormats:
            if len(entries) == 1:
                raise
        else:
            return _checked(dataclasses.replace(config, corpus_format=_chosen(given, family, why, key, log)))
    chosen, said = [], []
    for fmt, pattern in entries:
        family, why = detect(expand_inputs([pattern]), key)
        wanted = fmt or given
        if wanted == AUTO_FORMAT:
            chosen.append("sentences" if family == "text" else family)
            said.append(f"{chosen[-1]}:{pattern} (detected: {why})")
        else:
            _check(wanted, family, why, key, entry=f"{fmt}:{pattern}" if fmt else None)
            chosen.append(wanted)
            said.append(f"{wanted}:{pattern}")
    if len(set(chosen)) == 1:
        return _checked(dataclasses.replace(config, corpus_format=chosen[0]))
    log(f"{_setting(key, MIXED_FORMAT)}, a format per input: {'; '.join(said)}")
    return _checked(dataclasses.replace(config, corpus_format=MIXED_FORMAT,
                                        input=",".join(f"{fmt}:{pattern}" for fmt, (_, pattern) in zip(chosen,
                                                                                                      entries))))


def _checked(config: Config) -> Config:
    """`config` once its files are readable in its format(s): what a format cannot read (a binary file, an archive,
    a NUL byte) is refused here, for every command alike (`vocab train` trained on a zip archive that `data create`
    refused)."""
    from bertjax.data.corpus import file_formats

    formats = file_formats(config)
    file_readers.check_input_files(sorted(formats), config, formats if config.is_mixed else None)
    return config


def _chosen(given: str, family: str, why: str, key: str, log: Callable[[str], None]) -> str:
    """The format of files of `family` for the setting `given`: detected and said for auto, else checked."""
    if given == AUTO_FORMAT:
        chosen = "sentences" if family == "text" else family
        log(f"{_setting(key, chosen)}, detected: {why}" + (
            f" (paragraphs, wikitext and wrapped text need {key})" if family == "text" else ""))
        return chosen
    _check(given, family, why, key)
    return given


def _check(given: str, family: str, why: str, key: str, entry: str | None = None) -> None:
    """A format `given` (by the setting `key`, or by the input `entry`'s own FORMAT:) for files of `family` (`why`:
    how they were told)."""
    if _family(given) == family:
        return
    wanted = "sentences (or another text layout)" if family == "text" else family
    if entry:
        raise ValueError(f"{entry} does not match its files: {why}; write {wanted}:..., or leave its FORMAT: out")
    raise ValueError(f"{_setting(key, given)} does not match the input: {why}; "
                     + (f"pass --format {wanted}, or leave --format out" if key.startswith("--") else
                        f"set {key}={wanted}, or {AUTO_FORMAT}"))
