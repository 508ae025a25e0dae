"""The Python side of reading corpus files: compression (by magic bytes and extension), the input check that
refuses what a format cannot read, and the read units of record files and compressed text (a Parquet row group, or
chunk k of lines or records) that corpus.py maps through stateless numpy_functions. Also the one reader of the
text inputs other commands read whole (`read_text`, `read_text_bytes`: embed's sentences, predict's and the
fine-tunes' files, stdin), by the same detection and checks, so that no command reads a compressed, Parquet or
binary file as lines of text.

A unit is a pure function of (file, k). Sequential readers (a zstd stream positioned at chunk k) are kept open per
process (`_READERS`), so reading a file chunk after chunk costs O(file); a restored position reopens the file and
skips to its chunk once. Bad input is an error naming the file, the line or row group, and what was expected.
"""
from __future__ import annotations

import bz2
import codecs
import collections
import io
import itertools
import threading
import zlib
from typing import Callable, Iterator, Mapping, Sequence

import numpy as np

from bertjax.runtime import errors, jsonio
from bertjax.data.data_config import AUTO_FORMAT, CorpusConfig

_SNIFF_BYTES = 1 << 16
# Compressions read as such: magic bytes and the extensions that name them.
COMPRESSIONS = {"gzip": (b"\x1f\x8b", (".gz", ".gzip")), "zstd": (b"\x28\xb5\x2f\xfd", (".zst", ".zstd")),
                "bzip2": (b"BZh", (".bz2",))}
# What other files are recognised as, to name them when they are refused.
_OTHER_MAGIC = {b"PK\x03\x04": "a zip archive", b"\xfd7zXZ\x00": "an xz archive", b"7z\xbc\xaf\x27\x1c": "a 7z archive",
                b"PAR1": "a Parquet file", b"ARROW1": "an Arrow file", b"\x28\xb5\x2f\xfd": "zstd-compressed"}


def compression_of(path: str, head: bytes) -> str:
    """"gzip" | "zstd" | "bzip2" | "" for a file whose first bytes are `head`; an extension naming another
    compression than the bytes show is an error (a file renamed by mistake)."""
    by_magic = next((name for name, (magic, _) in COMPRESSIONS.items() if head.startswith(magic)), "")
    by_name = next((name for name, (_, ends) in COMPRESSIONS.items() if path.lower().endswith(ends)), "")
    if by_name and by_magic != by_name:
        raise ValueError(f"{path}: named as {by_name}-compressed, but its bytes are "
                         f"{by_magic + '-compressed' if by_magic else 'not'} ({head[:4]!r}...)")
    return by_magic


def _open_raw(path: str):
    """A buffered binary file of `path`: a local file, or (gs://, any other scheme) TensorFlow's file system."""
    return open(path, "rb") if "://" not in path else io.BufferedReader(_GFileRaw(path), 1 << 20)


class _GFileRaw(io.RawIOBase):
    """A tf.io.gfile.GFile as a standard raw binary file. GFile has no `closed`: pyarrow asks a Python file for it
    and takes its absence for a closed file ("I/O operation on closed file"), so Parquet and Arrow files on gs://
    are read through this."""

    def __init__(self, path: str):
        import tensorflow as tf  # only for gs:// and other schemes: predict and classify start without TensorFlow

        self._file = tf.io.gfile.GFile(path, "rb")

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        data = self._file.read(len(buffer))
        buffer[:len(data)] = data
        return len(data)

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        self._file.seek(offset, whence)
        return self._file.tell()

    def tell(self) -> int:
        return self._file.tell()

    def close(self) -> None:
        if not self.closed:
            self._file.close()
        super().close()


def open_decompressed(path: str):
    """A binary file object of `path`'s content, decompressed (gzip, zstd or bzip2, by magic bytes). A stream that
    ends before its end marker (a cut or still-growing file) raises EOFError at its end, for every codec: zstandard's
    own stream reader and TensorFlow's gzip reader take it for the end of the data."""
    raw = _open_raw(path)
    kind = compression_of(path, raw.read(4))
    raw.seek(0)
    return io.BufferedReader(_Decompressed(raw, kind), 1 << 16) if kind else raw


def _decompressor(kind: str):
    if kind == "gzip":
        return zlib.decompressobj(wbits=31)
    if kind == "bzip2":
        return bz2.BZ2Decompressor()
    import zstandard

    return zstandard.ZstdDecompressor().decompressobj()


class _Decompressed(io.RawIOBase):
    """The decompressed bytes of a raw stream of one or more gzip members / bzip2 streams / zstd frames (each
    codec's decompressor object tells whether its member ended: `eof`)."""

    def __init__(self, raw, kind: str):
        self._raw, self._kind = raw, kind
        self._decoder = _decompressor(kind)
        self._pending, self._offset = b"", 0  # decompressed bytes, and how many of them were returned

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        while self._offset == len(self._pending):
            data = self._decoder.unused_data if self._decoder.eof else self._raw.read(1 << 16)
            if self._decoder.eof:  # the next member, if any bytes follow
                if not data:
                    data = self._raw.read(1 << 16)
                    if not data:
                        return 0
                self._decoder = _decompressor(self._kind)
            elif not data:
                raise EOFError(f"the {self._kind} stream ends before its end marker (the file is cut)")
            try:
                self._pending, self._offset = self._decoder.decompress(data), 0
            except Exception as error:  # zlib.error, bz2's OSError, zstandard's ZstdError: no common base
                raise OSError(f"the {self._kind} data is damaged ({errors.first_line(error)})") from None
        n = min(len(buffer), len(self._pending) - self._offset)
        buffer[:n] = self._pending[self._offset:self._offset + n]
        self._offset += n
        return n

    def close(self) -> None:
        self._raw.close()
        super().close()


def _head(path: str) -> tuple[str, bytes]:
    """(compression, first decompressed bytes) of a file."""
    with errors.at_file(path), _open_raw(path) as f:
        raw = f.read(_SNIFF_BYTES)
    kind = compression_of(path, raw)
    if not kind:
        return kind, raw
    try:
        with open_decompressed(path) as f:
            return kind, f.read(_SNIFF_BYTES)
    except (OSError, EOFError) as error:
        raise ValueError(f"{path}: {kind}-compressed but cannot be decompressed ({error})") from None


def _text_problem(head: bytes) -> str | None:
    """Why bytes are not UTF-8 text (a known format named), or None."""
    other = next((what for magic, what in _OTHER_MAGIC.items() if head.startswith(magic)), None)
    if other:
        return f"{other}, not text"
    nul = nul_problem(head)
    if nul:
        return nul
    # A multi-byte character cut at the end of the sample is not an error.
    text = head.decode("utf-8", errors="replace")[:-1]
    invalid = text.count("\ufffd")
    if text and invalid > 0.05 * len(text):
        return f"not UTF-8 text ({invalid} of the first {len(text)} characters are invalid)"
    return None


def nul_problem(data: bytes, first_line: int = 1) -> str | None:
    """"a NUL byte in line N (...)" for text bytes holding one (line numbers from `first_line`), or None. A NUL is
    refused wherever it is: in a file's first 64 KiB (the sniff), further on (read whole, or a corpus line as read)."""
    at = data.find(b"\x00")
    if at < 0:
        return None
    line = first_line + data.count(b"\n", 0, at)
    return f"a NUL byte in line {line} (binary data, not text)"


def read_text_bytes(path: str, data: bytes | None = None, expected: str = "UTF-8 text") -> bytes:
    """The content of a text input a command reads whole (`data`: stdin's bytes, `path` naming it), decompressed by
    its magic bytes as corpus files are (gzip, zstd, bzip2; an extension naming another compression is refused),
    and refused, in one line naming it and `expected`, where a corpus file is: another format's bytes (Parquet,
    Arrow, an archive), a NUL byte anywhere (named by its line), mostly invalid UTF-8 in the first 64 KiB."""
    if data is None:
        with errors.at_file(path), _open_raw(path) as f:
            data = f.read()
    compression = compression_of(path, data[:4])
    if compression:
        try:
            with io.BufferedReader(_Decompressed(io.BytesIO(data), compression)) as f:
                data = f.read()
        except (OSError, EOFError) as error:
            raise ValueError(f"{path}: {compression}-compressed but cannot be decompressed ({error})") from None
    problem = _text_problem(data[:_SNIFF_BYTES]) or nul_problem(data)
    if problem:
        where = f" (decompressed from {compression})" if compression else ""
        raise ValueError(f"{path}: {problem}{where}; expected {expected}"
                         + (" (.gz, .zst and .bz2 are decompressed)" if not compression else ""))
    return data


def read_text(path: str, expected: str = "UTF-8 text") -> str:
    """`read_text_bytes(path)` decoded strictly: Excel's byte-order mark dropped, a byte that is not UTF-8 an error
    naming its line."""
    data = read_text_bytes(path, expected=expected).removeprefix(codecs.BOM_UTF8)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as error:
        line = data[:error.start].count(b"\n") + 1
        raise ValueError(f"{path}:{line}: byte 0x{data[error.start]:02x} is not UTF-8; save the file as UTF-8") \
            from None


def compressed_table(path: str, compression: str) -> str:
    """The line for Parquet or Arrow bytes inside a compression (`x.parquet.gz`): refused by every reader."""
    return (f"{path}: a Parquet/Arrow file inside {compression} compression: these are read as they are (Parquet "
            f"compresses its own pages); decompress it")


def parquet_table(path: str):
    """A Parquet file a command reads as a table (`finetune classify`, `predict`), as a pyarrow ParquetFile (a
    context manager): its bytes checked first, so a CSV or a compressed file named .parquet is told as what it is."""
    import pyarrow.parquet as pq

    with errors.at_file(path), _open_raw(path) as f:
        head = f.read(_SNIFF_BYTES)
    if not head.startswith(b"PAR1"):
        compression = next((name for name, (magic, _) in COMPRESSIONS.items() if head.startswith(magic)), "")
        if compression and _head(path)[1].startswith((b"PAR1", b"ARROW1", b"\xff\xff\xff\xff")):
            raise ValueError(compressed_table(path, compression))
        seen = f"{compression}-compressed" if compression else (_text_problem(head) or "text")
        raise ValueError(f"{path}: named as Parquet but its bytes are {seen} (no PAR1 magic); rename it to what it is")
    # A local path: pyarrow opens and closes the file itself (closing a ParquetFile leaves a file given to it open).
    return pq.ParquetFile(path if "://" not in path else _open_raw(path))


def without_compression(path: str) -> str:
    """`path` less a compression's extension (`train.csv.gz` -> `train.csv`): what the name says the content is."""
    lower = path.lower()
    end = next((end for _, ends in COMPRESSIONS.values() for end in ends if lower.endswith(end)), "")
    return path[:len(path) - len(end)]


def require_format(config: CorpusConfig) -> None:
    """Readers take a resolved corpus format: reading `auto` as some layout is the silent guess this refuses."""
    if config.corpus_format == AUTO_FORMAT:
        raise ValueError("corpus_format=auto reached a reader unresolved: resolve it first (format_detect.resolve)")


def check_input_files(files: Sequence[str], config: CorpusConfig | None = None,
                      formats: Mapping[str, str] | None = None) -> list[str]:
    """Refuses files that the format cannot read, naming what they are (judged by their first 64 KiB, after
    decompression): a binary file or an archive would otherwise be read as a few lines of replacement characters,
    and a job would train on nothing. Parquet/Arrow files must be such and hold `text_field`. Returns each file's
    format as recorded in metadata (e.g. "jsonl+zstd", "parquet"). `formats`: each file's format (a mixed corpus's,
    corpus.file_formats); default: the config's."""
    config = config or CorpusConfig(corpus_format="sentences")
    if config.is_mixed and formats is None:
        raise ValueError("a corpus of several formats is checked file by file: pass each file's (corpus.file_formats)")
    require_format(config)
    kinds = []
    for path in files:
        corpus_format = formats[path] if config.is_mixed else config.corpus_format
        if corpus_format == "parquet":
            kinds.append(_check_table_file(path, config.text_field))
            continue
        compression, head = _head(path)
        problem = _text_problem(head)
        if problem:
            where = f" (decompressed from {compression})" if compression else ""
            raise ValueError(f"{path}: {problem}{where}; {corpus_format} corpora are read as UTF-8 lines"
                             + (" (.gz, .zst and .bz2 are decompressed)" if not compression else ""))
        first = head.split(b"\n", 1)[0] if b"\n" in head else b""
        if corpus_format == "jsonl" and first.strip():  # the first record, up front (the rest as read)
            _json_text(path, 1, first, config.text_field)
        kinds.append(corpus_format + (f"+{compression}" if compression else ""))
    return kinds


# Records whose text is null (JSON null, a Parquet/Arrow null), per file: read as empty texts (no document), counted
# here, in this process (`data create` reports the number its run added).
NULL_TEXTS: collections.Counter = collections.Counter()
_NULL_LOCK = threading.Lock()


def _count_nulls(path: str, count: int) -> None:
    if count:
        with _NULL_LOCK:
            NULL_TEXTS[path] += count


class CorpusError(ValueError):
    """Bad input found while a file is read inside tf.data (a numpy_function): TensorFlow wraps it in its own error,
    in which the command line finds it by this name and tells it in one line."""


def compression_name(path: bytes) -> bytes:
    path = path.decode()
    with _open_raw(path) as f:
        return compression_of(path, f.read(4)).encode()


class _ReaderCache:
    """Open sequential readers of files, each positioned at its next chunk, so reading chunk after chunk costs
    O(file) while a chunk stays a pure function of (file, k): a request that no open reader can reach forwards
    (a restored position, another epoch) opens the file again and skips to it. Per process, at most `size` open
    readers (the least recently used is closed); a reader in use is taken out, so threads never share one."""

    def __init__(self, size: int = 64):
        self.size = size
        self._lock = threading.Lock()
        self._open: collections.OrderedDict = collections.OrderedDict()  # (key, serial) -> (next chunk, iterator)
        self._serial = itertools.count()

    def chunk(self, key, k: int, chunk_size: int, open_items: Callable[[], Iterator]) -> list:
        """Items [k * chunk_size, (k + 1) * chunk_size) of `open_items()`."""
        with self._lock:
            usable = [(entry[0], name) for name, entry in self._open.items() if name[0] == key and entry[0] <= k]
            position, items = (self._open.pop(max(usable)[1]) if usable else (0, None))
        if items is None:
            items = open_items()
        for _ in itertools.islice(items, (k - position) * chunk_size):  # skip to chunk k
            pass
        chunk = list(itertools.islice(items, chunk_size))
        if len(chunk) < chunk_size:
            _close(items)
            return chunk
        with self._lock:
            self._open[(key, next(self._serial))] = (k + 1, items)
            while len(self._open) > self.size:
                _close(self._open.popitem(last=False)[1][1])
        return chunk


def _close(items) -> None:
    if hasattr(items, "close"):
        items.close()


_READERS = _ReaderCache()


def _lines_of(path: str) -> Iterator[bytes]:
    """The lines of a (compressed) text file; a read error is a CorpusError naming the file and the last whole line."""
    number = 0
    try:
        with open_decompressed(path) as f:
            for number, line in enumerate(f, 1):
                if b"\x00" in line:
                    raise CorpusError(f"{path}: {nul_problem(line, number)}; text corpora are read as UTF-8 lines")
                yield line.rstrip(b"\n").rstrip(b"\r")
    except (EOFError, OSError) as error:  # a cut stream, damaged data (see _Decompressed), a failing disk
        raise CorpusError(f"{path}: {error}, after line {number}") from None


def refuse_nul(path: bytes) -> bool:
    """Called when a text file's lines, as tf.data read them, hold a NUL byte: a CorpusError naming the file and
    the line (found by reading the file again, once; only this error path pays for it)."""
    for _ in _lines_of(path.decode()):  # raises at the line
        pass
    raise CorpusError(f"{path.decode()}: a NUL byte (binary data, not text); text corpora are read as UTF-8 lines")


def line_chunk(path: bytes, k, chunk_size) -> np.ndarray:
    """Lines [k * chunk_size, (k + 1) * chunk_size) of a compressed text file."""
    path = path.decode()
    lines = _READERS.chunk(("lines", path), int(k), int(chunk_size), lambda: _lines_of(path))
    return np.array(lines, dtype=object).reshape(-1)


def record_unit(path: bytes, k, mine, corpus_format: bytes, field: bytes, chunk_size) -> tuple[np.ndarray, bool]:
    """Unit k of a record file: (its texts as UTF-8 bytes, or none when not `mine`; whether unit k exists)."""
    path, field, k = path.decode(), field.decode(), int(k)
    if corpus_format == b"parquet" and _is_parquet(path):
        parquet = _parquet_file(path)
        if k >= parquet.num_row_groups:
            return np.zeros([0], object), False
        return (_parquet_texts(path, parquet, k, field) if mine else np.zeros([0], object)), True
    if corpus_format == b"parquet":
        chunk = _READERS.chunk(("arrow", path, field), k, int(chunk_size), lambda: _arrow_texts(path, field))
        texts = chunk
    else:
        chunk = _READERS.chunk(("jsonl", path), k, int(chunk_size), lambda: _numbered_lines(path))
        texts = [_json_text(path, number, line, field) for number, line in chunk if line.strip()] if mine else []
    return np.array(texts if mine else [], dtype=object).reshape(-1), bool(chunk)


def _numbered_lines(path: str) -> Iterator[tuple[int, bytes]]:
    return enumerate(_lines_of(path), 1)


def _utf8(text: str) -> bytes:
    """A decoded text back to bytes; bytes that were not UTF-8 come back as they were, so that `_clean_lines`
    replaces and counts them as it does for text files."""
    try:
        return text.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:  # a lone surrogate written as a JSON escape: invalid UTF-8, counted
        return text.encode("utf-8", "surrogatepass")


def _json_text(path: str, number: int, line: bytes, field: str) -> bytes:
    """The text field of JSON line `number` of `path`, or an error naming the file, the line and what was expected."""
    try:
        record = jsonio.loads(line.decode("utf-8", "surrogateescape"), f"{path}: line {number}",
                              f"a JSON object with a {field!r} field", row=True)
    except ValueError as error:  # as CorpusError: told by its line through TensorFlow's error
        raise CorpusError(str(error)) from None
    if not isinstance(record, dict) or field not in record:
        fields = f"fields: {', '.join(list(record)[:10])}" if isinstance(record, dict) else type(record).__name__
        raise CorpusError(f"{path}: line {number}: expected a JSON object with a {field!r} field ({fields}; set "
                         f"data.text_field / --text-field)")
    text = record[field]
    if text is None:
        _count_nulls(path, 1)
        return b""
    if not isinstance(text, str):
        raise CorpusError(f"{path}: line {number}: field {field!r} is {type(text).__name__}, expected a string")
    return _utf8(text)


def _is_parquet(path: str) -> bool:
    return not path.lower().endswith(".arrow")


# path -> open ParquetFile (footer read once), most recently used last. The ParquetFile owns its file (a gs://
# file is closed when the last ParquetFile on it is collected, never while a reader holds it); one whose file was
# closed anyway is opened again rather than read.
_PARQUET_FILES: collections.OrderedDict = collections.OrderedDict()
_PARQUET_LOCK = threading.Lock()


def _parquet_file(path: str):
    import pyarrow.parquet as pq

    with _PARQUET_LOCK:
        found = _PARQUET_FILES.pop(path, None)
    if found is None or found.closed:
        try:  # a local path: Arrow's own file, read with pread (threads may read row groups at once)
            found = pq.ParquetFile(path if "://" not in path else _open_raw(path))
        except (OSError, ValueError) as error:  # pyarrow's ArrowInvalid: a cut footer, not Parquet at all
            raise CorpusError(f"{path}: not a readable Parquet file ({errors.first_line(error)}); cut, or still "
                              "being written?") from None
    with _PARQUET_LOCK:
        _PARQUET_FILES[path] = found
        while len(_PARQUET_FILES) > 64:
            _PARQUET_FILES.popitem(last=False)
    return found


def _column_bytes(table, path: str, field: str, where: str) -> np.ndarray:
    """A string column -> object array of UTF-8 bytes (nulls as empty texts)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    if field not in table.column_names:
        raise CorpusError(f"{path}: {where}: expected a {field!r} column (columns: {', '.join(table.column_names)};"
                         f" set data.text_field / --text-field)")
    column = table.column(field)
    if not (pa.types.is_string(column.type) or pa.types.is_large_string(column.type)):
        raise CorpusError(f"{path}: {where}: column {field!r} is {column.type}, expected strings")
    _count_nulls(path, column.null_count)
    return pc.fill_null(column, "").cast(pa.large_binary()).to_numpy(zero_copy_only=False)


def _parquet_texts(path: str, parquet, k: int, field: str) -> np.ndarray:
    if field not in parquet.schema_arrow.names:
        raise CorpusError(f"{path}: expected a {field!r} column (columns: {', '.join(parquet.schema_arrow.names)}; "
                         f"set data.text_field / --text-field)")
    try:
        table = parquet.read_row_group(k, columns=[field])
    except (OSError, ValueError) as error:  # pyarrow's ArrowInvalid/ArrowIOError: a damaged row group
        raise CorpusError(f"{path}: row group {k} of {parquet.num_row_groups} cannot be read "
                          f"({errors.first_line(error)})") from None
    return _column_bytes(table, path, field, f"row group {k}")


def _arrow_texts(path: str, field: str) -> Iterator[bytes]:
    """The texts of an Arrow IPC stream file (what `datasets.save_to_disk` writes), record batch by record batch."""
    import pyarrow as pa

    first_row = 0
    with _open_raw(path) as f:
        batches = iter(pa.ipc.open_stream(f))
        while True:
            try:
                batch = next(batches, None)
            except (pa.ArrowInvalid, OSError) as error:  # a cut or damaged stream
                raise CorpusError(f"{path}: the Arrow stream cannot be read after row {first_row} "
                                  f"({errors.first_line(error)})") from None
            if batch is None:
                return
            table = pa.Table.from_batches([batch])
            yield from _column_bytes(table, path, field, f"rows from {first_row}")
            first_row += batch.num_rows


def _check_table_file(path: str, field: str) -> str:
    """A Parquet or Arrow stream file holding a string column `field`: its kind ("parquet" | "arrow")."""
    import pyarrow as pa

    with _open_raw(path) as f:
        head = f.read(8)
    if _is_parquet(path):
        if not head.startswith(b"PAR1"):
            seen = next((what for magic, what in _OTHER_MAGIC.items() if head.startswith(magic)),
                        "text" if not _text_problem(head) else f"bytes {head[:4]!r}")
            raise ValueError(f"{path}: expected a Parquet file (PAR1), found {seen}; corpus_format=parquet reads "
                             "Parquet files and `datasets.save_to_disk` directories")
        names = _parquet_file(path).schema_arrow.names
        kind = "parquet"
    else:
        with _open_raw(path) as f:
            try:
                names = pa.ipc.open_stream(f).schema.names
            except pa.ArrowInvalid as error:
                raise ValueError(f"{path}: expected an Arrow IPC stream (datasets.save_to_disk), {error}") from None
        kind = "arrow"
    if field not in names:
        raise ValueError(f"{path}: expected a {field!r} column (columns: {', '.join(names)}; set data.text_field / "
                         "--text-field)")
    return kind
