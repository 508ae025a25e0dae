"""The original BERT pretraining TFRecord format: serialize (in-graph), write shards atomically, read back.

Features (google-research/bert create_pretraining_data.py): input_ids, input_mask, segment_ids
[max_seq_length]; masked_lm_positions, masked_lm_ids, masked_lm_weights [max_predictions_per_seq];
next_sentence_labels [1]; all int64 except masked_lm_weights float32. Readers cast int64 -> int32.
Packed rows (`--pack`) add packing_ids, position_ids, instance_cls_positions and next_sentence_weights, with
wider masked_lm_* and next_sentence_labels (data/schema.py); the metadata JSON records `instances_per_row`.
Span masking adds span_left_positions / span_right_positions [max_predictions_per_seq]; the metadata records
`masking_scheme`.
"""
from __future__ import annotations

import contextlib
import os
import re
import struct
import uuid
from typing import Iterable, Iterator, Sequence

import numpy as np
import tensorflow as tf

from bertjax.runtime import jsonio
from bertjax.runtime.errors import OutputWriteError, at_file, cannot_write
from bertjax.runtime.input_files import read_json
from bertjax.data import schema
from bertjax.data.corpus import expand_inputs, file_order
from bertjax.data.out_dir import remove_quietly

SHARD_SUFFIX = ".tfrecord"
METADATA_SUFFIX = schema.METADATA_SUFFIX


def feature_spec(shapes: dict[str, tuple[int]]) -> dict[str, tf.io.FixedLenFeature]:
    """tf.io parsing spec of one example with these feature shapes (integers are int64 on disk)."""
    dtypes = schema.feature_dtypes(shapes)
    return {name: tf.io.FixedLenFeature(shape, tf.float32 if dtypes[name] == "float32" else tf.int64)
            for name, shape in shapes.items()}


def feature_spec_metadata(config) -> dict:
    """The shapes a stream's records have, as written to (and checked against) the metadata JSON."""
    return {"max_seq_length": config.max_seq_length, "max_predictions_per_seq": config.max_predictions_per_seq,
            "instances_per_row": config.instances_per_row, "masking_scheme": config.masking_scheme}


def _encode(message: str, fields: list[str], values: list[tf.Tensor]) -> tf.Tensor:
    count = tf.shape(values[0])[0]
    sizes = tf.stack([tf.fill([count], tf.shape(v)[1]) for v in values], axis=1)
    return tf.io.encode_proto(sizes, values, fields, message)


def serialize_batch(batch: dict[str, tf.Tensor]) -> tf.Tensor:
    """Serialized tf.train.Example strings [B] of a batch of features (each [B, width]), built in-graph.

    tf.io.encode_proto composes the Example bottom-up (value list -> Feature -> map entry -> Example);
    it is several times faster than building protos in Python and runs inside tf.data.
    """
    entries = []
    dtypes = schema.feature_dtypes(batch)
    for name in dtypes:
        value = tf.convert_to_tensor(batch[name])
        if value.shape.rank == 1:
            value = value[:, None]
        if dtypes[name] == "float32":
            values = _encode("tensorflow.FloatList", ["value"], [tf.cast(value, tf.float32)])
            feature = _encode("tensorflow.Feature", ["float_list"], [values[:, None]])
        else:
            values = _encode("tensorflow.Int64List", ["value"], [tf.cast(value, tf.int64)])
            feature = _encode("tensorflow.Feature", ["int64_list"], [values[:, None]])
        key = tf.fill([tf.shape(value)[0], 1], name)
        entries.append(_encode("tensorflow.Features.FeatureEntry", ["key", "value"], [key, feature[:, None]]))
    features = _encode("tensorflow.Features", ["feature"], [tf.stack(entries, axis=1)])
    return _encode("tensorflow.Example", ["features"], [features[:, None]])


def parse_batch(serialized: tf.Tensor, shapes: dict[str, tuple[int]]) -> dict[str, tf.Tensor]:
    """Parse a batch of serialized examples with these feature shapes; int64 features become int32."""
    parsed = tf.io.parse_example(serialized, feature_spec(shapes))
    return {k: tf.cast(v, tf.int32) if v.dtype == tf.int64 else v for k, v in parsed.items()}


def shard_prefix(worker_index: int = 0, num_workers: int = 1) -> str:
    """File-name prefix of one `data create` worker's shards (and of its metadata file)."""
    return "pretrain" if num_workers == 1 else f"pretrain-w{worker_index:05d}"


def write_metadata(out_dir: str, prefix: str, summary: dict) -> str:
    """Writes `<prefix>-metadata.json` beside the shards (atomically: a temporary name, then a rename)."""
    path = os.path.join(out_dir, prefix + METADATA_SUFFIX)
    try:
        with tf.io.gfile.GFile(path + ".tmp", "w") as f:
            jsonio.dump(summary, f, indent=1, default=list)
        tf.io.gfile.rename(path + ".tmp", path, overwrite=True)
    except (tf.errors.OpError, OSError) as error:
        remove_quietly(path + ".tmp")
        raise OutputWriteError(cannot_write(path, error)) from None
    return path



def read_metadata(directory: str) -> list[tuple[str, dict]]:
    """(path, content) of every `data create` metadata file in `directory` (none for a file or glob)."""
    with at_file(directory):
        if not tf.io.gfile.isdir(directory):
            return []
        paths = sorted(tf.io.gfile.glob(os.path.join(directory, "*" + METADATA_SUFFIX)))
    return [(path, read_json(path, "data create's metadata (JSON)")) for path in paths]


def shard_paths(out_dir: str, num_shards: int, prefix: str = "pretrain") -> list[str]:
    return [os.path.join(out_dir, f"{prefix}-{i:05d}-of-{num_shards:05d}{SHARD_SUFFIX}") for i in range(num_shards)]


class ShardWriter:
    """Round-robin writer of K TFRecord shards; each is written under a temporary name and renamed
    to its final name only after it was closed successfully, so a crash never leaves a truncated
    file under a final name. A failed write (a full disk) is an OutputWriteError naming the shards' directory; its
    temporaries are removed. Use as a context manager."""

    def __init__(self, out_dir: str, num_shards: int, prefix: str = "pretrain", compression: str | None = None):
        if num_shards < 1:
            raise ValueError(f"--shards must be >= 1, got {num_shards}")
        self.out_dir = out_dir
        self.paths = shard_paths(out_dir, num_shards, prefix)
        token = uuid.uuid4().hex[:8]
        self._tmp = [f"{p}.tmp-{token}" for p in self.paths]
        options = tf.io.TFRecordOptions(compression_type=compression or "")
        self._writers = []
        with self._told():
            tf.io.gfile.makedirs(out_dir)
            for path in self._tmp:
                self._writers.append(tf.io.TFRecordWriter(path, options))
        self.counts = np.zeros(num_shards, np.int64)
        self._next = 0

    @contextlib.contextmanager
    def _told(self):
        """A write that fails: its temporaries removed, one OutputWriteError (TensorFlow's own is a traceback)."""
        try:
            yield
        except (tf.errors.OpError, OSError) as error:
            self.close(commit=False)
            raise OutputWriteError(cannot_write(f"shards to {self.out_dir}", error)) from None

    def write(self, records: Iterable[bytes]):
        writers = self._writers
        with self._told():
            for record in records:
                writers[self._next].write(record)
                self.counts[self._next] += 1
                self._next = (self._next + 1) % len(writers)

    def close(self, commit: bool = True):
        if commit:
            with self._told():
                for writer in self._writers:
                    writer.close()  # flushes: where a full disk shows
                for tmp, final in zip(self._tmp, self.paths):
                    tf.io.gfile.rename(tmp, final, overwrite=True)
            return
        for writer in self._writers:
            try:
                writer.close()
            except tf.errors.OpError:  # what it could not flush is removed next
                pass
        remove_quietly(*self._tmp)

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        self.close(commit=exc_type is None)
        return False


def earlier_run_files(out_dir: str, worker_index: int = 0, num_workers: int = 1) -> list[str]:
    """Shards, unfinished shards and metadata in `out_dir` that a new `data create` run of this worker would be
    mixed with: all of them, except the files of the other workers of a multi-worker run."""
    if not tf.io.gfile.isdir(out_dir):
        return []
    ours = []
    for name in sorted(tf.io.gfile.listdir(out_dir)):
        if not (name.endswith(SHARD_SUFFIX) or f"{SHARD_SUFFIX}.tmp-" in name or name.endswith(METADATA_SUFFIX)):
            continue
        other_worker = re.match(r"pretrain-w(\d+)-", name)
        if num_workers > 1 and other_worker and int(other_worker[1]) != worker_index:
            continue
        ours.append(os.path.join(out_dir, name))
    return ours


def find_shards(patterns: Sequence[str]) -> list[str]:
    """TFRecord shard files for globs or directories (temporary files of unfinished writes are ignored).

    A directory written by `data create` is read as its metadata lists it (every worker's metadata file), so
    files that are not part of a finished run are never read; a listed shard that is missing is an error.
    """
    found = []
    for pattern in patterns:
        with at_file(pattern):
            found += _shards_of(pattern)
    return sorted(dict.fromkeys(found))


def _shards_of(pattern: str) -> list[str]:
    """find_shards of one pattern."""
    listed = [(meta_path, name, size) for meta_path, meta in read_metadata(pattern)
              for name, size in zip(meta.get("shards", []),
                                    meta.get("bytes_per_shard", [None] * len(meta.get("shards", []))))]
    if not listed:
        if tf.io.gfile.isdir(pattern):
            _refuse_unfinished(pattern, named_as_directory=True)
            pattern = os.path.join(pattern, f"*{SHARD_SUFFIX}")
        files = [f for f in expand_inputs([pattern]) if ".tmp-" not in os.path.basename(f)]
        for directory in sorted({os.path.dirname(f) for f in files}):
            _refuse_unfinished(directory, named_as_directory=False)
        return files
    found = []
    for meta_path, name, size in listed:
        path = os.path.join(pattern, name)
        if not tf.io.gfile.exists(path):
            raise FileNotFoundError(f"{path}: listed in {meta_path} but missing")
        actual = tf.io.gfile.stat(path).length
        if size is not None and actual != size:
            raise ValueError(f"{path}: {actual} bytes, but {meta_path} recorded {size}: the shard is truncated "
                             f"or was replaced; write it again (bertjax data create --overwrite)")
        found.append(path)
    return found


def _refuse_unfinished(directory: str, named_as_directory: bool) -> None:
    """`data create` writes its metadata last: shards without it are an unfinished run (killed mid-way), never
    trained on. A directory is read only with its metadata; shards named by a glob (TFRecords made elsewhere, e.g.
    by google-research/bert's script) are read without, unless unfinished temporaries lie beside them."""
    if read_metadata(directory):
        return
    names = tf.io.gfile.listdir(directory)
    shards = [n for n in names if n.endswith(SHARD_SUFFIX)]
    unfinished = [n for n in names if f"{SHARD_SUFFIX}.tmp-" in n]
    if unfinished or (named_as_directory and shards):
        raise ValueError(
            f"{directory}: {len(shards)} shard(s)" + (f" and {len(unfinished)} unfinished temporary file(s)"
                                                      if unfinished else "") +
            f" but no `data create` metadata (*{METADATA_SUFFIX}, written last): an interrupted `data create`. "
            f"Run it again with --overwrite" + ("" if unfinished else
                                                f"; for TFRecords made by another tool, name them by a glob "
                                                f"(data.input='{directory.rstrip('/')}/*{SHARD_SUFFIX}')"))


def is_tfrecord_file(path: str) -> bool:
    """True if the file's first record reads as a TFRecord (its length and CRC check out); an empty file or text
    is not."""
    # A record starts with its length as a little-endian uint64, whose top bytes are zero for any real record; text
    # has no NUL there. Deciding that here keeps TensorFlow's native "corrupted record" warning off a text corpus.
    with tf.io.gfile.GFile(path, "rb") as file:
        if b"\0" not in file.read(8):
            return False
    try:
        for _ in tf.data.TFRecordDataset(path).take(1):
            return True
    except (tf.errors.DataLossError, tf.errors.OutOfRangeError, tf.errors.InvalidArgumentError):
        pass
    return False


def detect_kind(patterns: Sequence[str]) -> str:
    """"tfrecord" for `data create` output (a directory with its metadata, or TFRecord files), else "text"."""
    for pattern in patterns:
        if pattern.startswith(("tfds:", "hf:")):
            return "text"
        with at_file(pattern):
            if tf.io.gfile.isdir(pattern):
                if read_metadata(pattern):
                    return "tfrecord"
                files = sorted(os.path.join(pattern, f) for f in tf.io.gfile.listdir(pattern))
            else:
                files = sorted(tf.io.gfile.glob(pattern))
            files = [f for f in files if not tf.io.gfile.isdir(f) and tf.io.gfile.stat(f).length > 0]
            if files:
                return "tfrecord" if is_tfrecord_file(files[0]) else "text"
    return "text"


def tfrecord_examples(files: Sequence[str], *, cycle_length: int = 8, order_seed=None,
                      compression: str | None = None) -> tf.data.Dataset:
    """Serialized examples interleaved from `files` (deterministic; file order permuted if a seed [2] is given)."""
    return file_order(files, order_seed).interleave(
        lambda f: tf.data.TFRecordDataset(f, compression_type=compression or "", buffer_size=1 << 20),
        cycle_length=min(cycle_length, len(files)), block_length=16, num_parallel_calls=tf.data.AUTOTUNE,
        deterministic=True)


# TensorFlow's record reader names the byte offset of a length (the record's start) or data (12 bytes on) that
# fails its CRC, not the file.
_CORRUPTED_AT = re.compile(r"corrupted record at (\d+)")
_HEADER = struct.Struct("<QI")  # a record: length, masked CRC-32C of the length, data, masked CRC-32C of the data


def _masked_crc(data: bytes) -> int:
    import google_crc32c  # google-cloud-storage's dependency

    crc = google_crc32c.value(data)
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def damaged_record_index(path: str, offset: int) -> int | None:
    """The index of the record of `path` whose length (at byte `offset`) or data (at `offset`) fail their CRC; None
    if no record's length or data start there (the headers before it are walked, not the data) or it is intact."""
    if tf.io.gfile.stat(path).length <= offset:
        return None
    with tf.io.gfile.GFile(path, "rb") as f:
        position = index = 0
        while position < offset - _HEADER.size:
            f.seek(position)
            header = f.read(_HEADER.size)
            if len(header) < _HEADER.size:
                return None
            position += _HEADER.size + _HEADER.unpack(header)[0] + 4
            index += 1
        if position not in (offset - _HEADER.size, offset):
            return None
        f.seek(position)
        header = f.read(_HEADER.size)
        if len(header) < _HEADER.size:  # a cut header
            return index
        length, length_crc = _HEADER.unpack(header)
        if _masked_crc(header[:8]) != length_crc:
            return index
        data = f.read(length + 4)
        intact = len(data) == length + 4 and _masked_crc(data[:length]) == struct.unpack("<I", data[length:])[0]
        return None if intact else index


@contextlib.contextmanager
def damaged_records_named(files: Sequence[str], key: str = "data.input") -> Iterator[None]:
    """TensorFlow's DataLossError for a record of `files` that fails its CRC, raised as one line naming the file, the
    record and its byte offset (ValueError); a file of the input `key` that tf.data cannot read (permission, gone)
    as `cannot read FILE (of KEY): why` (errors.at_file)."""
    try:
        with at_file(key):
            yield
    except tf.errors.DataLossError as error:
        found = _CORRUPTED_AT.search(str(error))
        if not found:
            raise
        offset = int(found.group(1))
        for path in files:
            index = damaged_record_index(path, offset)
            if index is not None:
                raise ValueError(f"{path}: record {index} (at byte {offset}) fails its CRC check: the file is "
                                 f"damaged; expected intact TFRecords (make them again: `data create --overwrite`)"
                                 ) from None
        shown = ", ".join(files[:3]) + (", ..." if len(files) > 3 else "")
        raise ValueError(f"a record at byte {offset} of one of {len(files)} TFRecord file(s) ({shown}) fails its "
                         f"CRC check: a file is damaged; expected intact TFRecords") from None
