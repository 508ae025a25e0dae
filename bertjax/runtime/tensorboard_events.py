"""TensorBoard scalars written without TensorFlow: one event file of the format `tf.summary.scalar` writes (TFRecord
framing, an Event per value with the "scalars" plugin's float32 tensor), so TensorBoard reads it the same.

flax.metrics.tensorboard would import TensorFlow for this (~5 CPU-s and ~0.7 GB resident at start), which a
fine-tune on a table file otherwise never needs.
"""
from __future__ import annotations

import contextlib
import os
import socket
import struct
import time

import google_crc32c
import numpy as np
from etils import epath
from tensorboard.compat.proto import event_pb2, summary_pb2
from tensorboard.plugins.scalar import metadata as scalar_metadata
from tensorboard.util import tensor_util

from bertjax.runtime.errors import at_file


def _masked_crc(data: bytes) -> int:
    """TFRecord's masked CRC-32C of `data`."""
    crc = google_crc32c.value(data)
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def record(data: bytes) -> bytes:
    """`data` framed as one TFRecord: length, its CRC, the data, its CRC."""
    length = struct.pack("<Q", len(data))
    return length + struct.pack("<I", _masked_crc(length)) + data + struct.pack("<I", _masked_crc(data))


class ScalarWriter:
    """Scalars into a new event file in `logdir` (local or gs://): events.out.tfevents.<second>.<host>.<pid>.v2.
    A write that fails (a full disk at a flush) is one line naming the file (errors.at_file)."""

    def __init__(self, logdir: str):
        directory = epath.Path(logdir)
        name = f"events.out.tfevents.{int(time.time())}.{socket.gethostname()}.{os.getpid()}.v2"
        self.path = str(directory / name)
        # A local path's open() is the file; a gs:// one's (etils) a context manager giving it: entered alike.
        self._open = contextlib.ExitStack()
        with at_file(self.path, writing=True):
            directory.mkdir(parents=True, exist_ok=True)
            self._file = self._open.enter_context((directory / name).open("wb"))
        self._add(event_pb2.Event(wall_time=time.time(), file_version="brain.Event:2"))
        self._metadata = scalar_metadata.create_summary_metadata(display_name=None, description=None)

    def _add(self, event: event_pb2.Event) -> None:
        with at_file(self.path, writing=True):
            self._file.write(record(event.SerializeToString()))

    def scalar(self, tag: str, value: float, step: int) -> None:
        tensor = tensor_util.make_tensor_proto(np.float32(value))
        summary = summary_pb2.Summary(value=[summary_pb2.Summary.Value(tag=tag, tensor=tensor, metadata=self._metadata)])
        self._add(event_pb2.Event(wall_time=time.time(), step=int(step), summary=summary))

    def flush(self) -> None:
        with at_file(self.path, writing=True):
            self._file.flush()

    def close(self) -> None:
        with at_file(self.path, writing=True):
            self._open.close()
