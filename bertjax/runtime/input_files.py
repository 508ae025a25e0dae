"""Files bertjax reads whole (configs, a run's records, a checkpoint's JSON, vocabularies, safetensors): checked by
type and size before a byte is read, JSON parsed naming the file.

A config, metrics or goodput file linked to /dev/zero was read until MemoryError, a safetensors file linked to
/dev/urandom ended in a traceback naming nothing, a cut run.json was a JSONDecodeError without its path. So such
reads go through here: what is not a regular file (a device, a FIFO, a socket, a directory) is refused naming what
it is; a file larger than what it can be (`limit`) is refused naming its size; JSON nested too deep, or that does
not parse, is named with its path and where it stops (jsonio.loads). An object on gs:// is always a regular file
(its size is checked).

And what a run read, as its record keeps it (`input:<path>`: size and SHA-256), which the model card shows: kept here,
below both the fine-tune's record and interop's card.
"""
from __future__ import annotations

import hashlib
import os
import stat
from typing import Any

from etils import epath

from bertjax.runtime import jsonio
from bertjax.runtime.errors import FileReadError, at_file, user

# What a JSON document bertjax reads can be at most (a tokenizer.json is ~10 MB; configs and records far less).
JSON_LIMIT = 256 << 20
_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
          (stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISSOCK, "a socket"))


class Unreadable(FileReadError):
    """A file or directory this user may not read: told as a permission problem, never taken for a damaged or
    missing one (a checkpoint set aside as corrupt, a tensor called missing)."""


def check_readable_tree(root, what: str) -> None:
    """Raises Unreadable naming the first directory or file under `root` (local; `what` it is) that this user may
    not read: a checkpoint with an unreadable part was read as one with a tensor missing, or set aside as corrupt."""
    root = str(root)
    if "://" in root or not os.path.isdir(root):
        return

    def refused(error: OSError) -> None:
        if isinstance(error, PermissionError):
            raise Unreadable(f"{error.filename or root}: permission denied to {user()} ({what} {root}); give "
                             "this user read access to it (chmod -R u+rX), or run as its owner") from None
        raise error

    for directory, _, files in os.walk(root, onerror=refused):
        for name in files:
            try:
                with open(os.path.join(directory, name), "rb"):
                    pass
            except PermissionError as error:
                refused(error)
            except OSError:  # a dangling link, a device: for the reader to tell
                pass


def check_regular(path, what: str, limit: int | None = None) -> int:
    """The size of `path`, a regular file of at most `limit` bytes; else ValueError naming it and what it is
    (`what`: what the file was expected to be). A missing file: FileNotFoundError."""
    name = str(path)
    if "://" in name:
        size = epath.Path(name).stat().length
    else:
        info = os.stat(name)  # through a link: what is read
        if not stat.S_ISREG(info.st_mode):
            kind = next((kind for test, kind in _KINDS if test(info.st_mode)), "not a regular file")
            link = f" (a link to {os.path.realpath(name)})" if os.path.islink(name) else ""
            raise ValueError(f"{name}{link} is {kind}, not a file; expected {what}")
        size = info.st_size
    if limit is not None and size > limit:
        raise ValueError(f"{name}: {size:,} bytes, more than {what} can be ({limit:,} bytes at most)")
    return size


def read_bytes(path, what: str, limit: int | None = None) -> bytes:
    check_regular(path, what, limit)
    with at_file(path):
        return epath.Path(path).read_bytes()


def read_text(path, what: str, limit: int | None = None) -> str:
    """The file's text (UTF-8; a bad byte named by its offset)."""
    data = read_bytes(path, what, limit)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise ValueError(f"{path}: not UTF-8 text (byte {error.start}); expected {what}") from None


def read_json(path, what: str = "a JSON file", limit: int = JSON_LIMIT) -> Any:
    """The file's JSON (jsonio.loads: nesting checked before it is parsed); a cut, damaged or too deeply nested file
    is a ValueError naming it and where it stops."""
    return jsonio.loads(read_text(path, what, limit), str(path), what)


# The record's keys for the content of the files a run reads (`input:<path>`): a rerun on changed data is another run.
INPUT_KEY = "input:"


def input_fingerprints(paths) -> dict:
    """{`input:<file>`: fingerprint} for every file of the local `paths` (files, or directories walked whole);
    other values (tfds:, hub ids, gs://) are left to the record's plain settings."""
    files = []
    for path in paths:
        if not isinstance(path, str) or not path or "://" in path or not os.path.exists(path):
            continue
        if os.path.isdir(path):
            files += [os.path.join(d, name) for d, _, names in os.walk(path) for name in names
                      if not name.startswith(".")]
        else:
            files.append(path)
    return {INPUT_KEY + file: fingerprint(file) for file in sorted(os.path.realpath(f) for f in files)}


def fingerprint(path: str) -> str:
    """"<size> bytes, sha256 <first 16 hex digits>" of a file, local or gs://: what a fine-tune's run record keeps
    of each input file, `data create` of each corpus file, and a model card shows."""
    digest, size = hashlib.sha256(), 0
    with at_file(path), open(path, "rb") if "://" not in path else epath.Path(path).open("rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            digest.update(block)
            size += len(block)
    return f"{size} bytes, sha256 {digest.hexdigest()[:16]}"
