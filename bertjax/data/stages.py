"""The stages that `bertjax data create` and the tf.data pretraining pipeline share: tokenized blocks of
documents, instance making (numpy, the original algorithm), the seeds each random choice is drawn from, and the
batch layout of the original TFRecord format. One implementation, so both paths give the same instances.
"""
from __future__ import annotations

import collections
import random
import threading

import numpy as np
import tensorflow as tf

from bertjax.data import packing, schema
from bertjax.data.data_config import InstanceConfig
from bertjax.data.instances import Block, assemble, create_instances


def block_rng(seed: int, stream: int, process_index: int, block_index: int) -> random.Random:
    """The Python RNG of one instance-creation block (string seeding is stable across processes)."""
    return random.Random(f"bertjax/{seed}/{stream}/{process_index}/{block_index}")


def fold_seed(seed: tf.Tensor, *values) -> tf.Tensor:
    """A stateless-RNG seed (int64 [2]) derived from `seed` and the given integers, in order."""
    for value in values:
        seed = tf.random.experimental.stateless_fold_in(seed, tf.cast(value, tf.int64))
    return seed


class InstanceMaker:
    """numpy side of the pipeline: a tokenized block -> padded, unmasked instance arrays.

    `stats` counts documents, empty documents, instances... (monitoring only: blocks prefetched
    ahead of the consumer are counted too; exact after a full pass).
    """

    def __init__(self, config: InstanceConfig, *, cls_id: int, sep_id: int, pad_id: int, seed: int,
                 process_index: int = 0, stats: collections.Counter | None = None):
        self.config, self.seed, self.process_index = config, seed, process_index
        self.cls_id, self.sep_id, self.pad_id = cls_id, sep_id, pad_id
        self.stats = stats if stats is not None else collections.Counter()
        self._lock = threading.Lock()

    def __call__(self, ids, sentence_splits, doc_splits, invalid_utf8, truncated, block_index, streams,
                 count_input=True):
        """streams: the RNG streams (epochs or dupes) to create, concatenated in this order;
        count_input: whether this call counts the block's input statistics (once per block pass)."""
        local = collections.Counter()
        if count_input:
            local.update(invalid_utf8_lines=int(np.sum(invalid_utf8)), truncated_lines=int(np.sum(truncated)))
        block = Block.from_ragged(ids, sentence_splits, doc_splits, local if count_input else None)
        arrays = []
        for stream in np.asarray(streams).reshape(-1).tolist():
            rng = block_rng(self.seed, stream, self.process_index, int(block_index))
            instances = create_instances(block, self.config, rng, local)
            arrays.append(assemble(block, instances, self.config.max_seq_length, self.cls_id, self.sep_id,
                                   self.pad_id))
        with self._lock:
            self.stats.update(local)
        keys = ("input_ids", "input_mask", "segment_ids", "next_sentence_labels")
        return tuple(np.concatenate([a[k] for a in arrays]) if arrays else
                     np.zeros((0,) + ((self.config.max_seq_length,) if k != "next_sentence_labels" else ()),
                              np.int32) for k in keys)

    def tf_map(self, block: dict, block_index: tf.Tensor, streams: tf.Tensor,
               count_input: tf.Tensor | bool = True) -> dict[str, tf.Tensor]:
        """The graph-side wrapper (tf.numpy_function); output shapes restored for batching."""
        outputs = tf.numpy_function(
            self, [block["ids"], block["sentence_splits"], block["doc_splits"], block["invalid_utf8"],
                   block["truncated"], block_index, streams, count_input],
            [tf.int32] * 4, stateful=False)  # a pure function of its inputs: safe to checkpoint around
        length = self.config.max_seq_length
        names = ("input_ids", "input_mask", "segment_ids", "next_sentence_labels")
        shapes = ([None, length], [None, length], [None, length], [None])
        return {n: tf.ensure_shape(o, s) for n, o, s in zip(names, outputs, shapes)}


def tokenized_blocks(documents: tf.data.Dataset, tokenizer, doc_buffer_size: int) -> tf.data.Dataset:
    """Documents -> blocks {ids, sentence_splits, doc_splits, invalid_utf8, truncated}, tokenized in-graph."""
    def tokenize(block):
        sentences = block["sentences"]
        ids = tokenizer.tokenize(sentences.flat_values)
        return {"ids": ids.flat_values, "sentence_splits": ids.row_splits, "doc_splits": sentences.row_splits,
                "invalid_utf8": block["invalid_utf8"], "truncated": block["truncated"]}

    return documents.ragged_batch(doc_buffer_size).map(tokenize, num_parallel_calls=tf.data.AUTOTUNE,
                                                        deterministic=True)


def pack_block(features: dict[str, tf.Tensor], max_instances: int, pad_id: int) -> dict[str, tf.Tensor]:
    """A block's masked instances -> packed rows (data/packing.py; a pure function of the block)."""
    names = tuple(schema.PACKED_FEATURES)
    dtypes = [tf.as_dtype(schema.PACKED_FEATURES[name][0]) for name in names]
    inputs = [features[k] for k in ("input_ids", "input_mask", "segment_ids", "masked_lm_positions",
                                    "masked_lm_ids", "masked_lm_weights", "next_sentence_labels")]

    def pack(*arrays):
        packed = packing.pack_instances(dict(zip(schema.FEATURE_NAMES, arrays)), max_instances, pad_id)
        return tuple(packed[name] for name in names)

    outputs = tf.numpy_function(pack, inputs, dtypes, stateful=False)
    seq_len = features["input_ids"].shape[1]
    shapes = schema.feature_shapes(seq_len, features["masked_lm_positions"].shape[1], max_instances)
    return {name: tf.ensure_shape(out, [None, shapes[name][0]]) for name, out in zip(names, outputs)}


def finalize_batch(batch: dict) -> dict:
    """next_sentence_labels as [B, 1], as in the original TFRecord format (packed rows already have [B, k])."""
    batch = dict(batch)
    if not schema.is_packed(batch):
        batch["next_sentence_labels"] = tf.reshape(batch["next_sentence_labels"], [-1, 1])
    return batch
