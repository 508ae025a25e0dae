"""The pretraining input pipeline in tf.data: text (or TFRecords) -> per-host masked batches.

    files of this host -> documents -> blocks of `doc_buffer_size` documents -> in-graph tokenization
    -> instances (numpy, the original algorithm) -> [static masks per block] -> shuffle -> batch
    -> [dynamic masks per batch] -> prefetch

Determinism: every random choice is a function of (seed, process_index, epoch/dupe, block or batch
index): file order and shuffles use seeded tf.data ops, instance creation a Python RNG seeded per
block, masking stateless TF RNG. Hence the stream is reproducible and, because every stage is a
checkpointable tf.data op, its position can be saved with tf.train.Checkpoint (`save_iterator`) and
restored in a fresh process (`restore_iterator`) to continue bit-identically.
"""
from __future__ import annotations

import collections
import dataclasses
import random
import threading

import numpy as np
import tensorflow as tf

from bertjax.data import corpus, masking, tfrecord
from bertjax.data.instances import Block, InstanceConfig, assemble, create_instances
from bertjax.data.tokenizers import load_tokenizer

MASKING_MODES = ("dynamic", "static")
INPUT_KINDS = ("text", "tfrecord")


@dataclasses.dataclass(frozen=True)
class PretrainingDataConfig:
    """Everything that defines the pretraining example stream (defaults = the original BERT flags)."""

    inputs: tuple[str, ...]
    input_kind: str = "text"  # "text" (globs or tfds:NAME) or "tfrecord" (shards written by `data create`)
    vocab_path: str | None = None  # vocab.txt (WordPiece) or .model (SentencePiece); text input only
    lower_case: bool | None = None  # default: True for WordPiece, False for SentencePiece
    corpus_format: str = "sentences"
    max_seq_length: int = 128
    max_predictions_per_seq: int = 20
    masked_lm_prob: float = 0.15
    short_seq_prob: float = 0.1
    next_sentence_prediction: bool = True
    whole_word_masking: bool = False
    masking: str = "dynamic"
    dupe_factor: int = 10  # static masking: distinct (instances, masks) copies before repeating
    doc_buffer_size: int = 1000  # documents per instance-creation block: bounds memory
    shuffle_buffer: int = 10_000  # instances
    seed: int = 12345
    num_epochs: int | None = None  # None: repeat forever
    file_cycle_length: int = 4
    tfds_text_field: str = "text"
    tfds_data_dir: str | None = None
    max_line_chars: int = 100_000

    def __post_init__(self):
        # A single path, or a list (e.g. from a JSON/YAML config), becomes a tuple.
        object.__setattr__(self, "inputs", (self.inputs,) if isinstance(self.inputs, str) else tuple(self.inputs))
        if self.input_kind not in INPUT_KINDS:
            raise ValueError(f"input_kind={self.input_kind!r}; expected one of {INPUT_KINDS}")
        if self.masking not in MASKING_MODES:
            raise ValueError(f"masking={self.masking!r}; expected one of {MASKING_MODES}")
        if self.input_kind == "text" and not self.vocab_path:
            raise ValueError("text input needs a vocab (vocab.txt or SentencePiece .model)")
        for name in ("dupe_factor", "doc_buffer_size", "shuffle_buffer"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        self.instance_config()  # validates max_seq_length / short_seq_prob
        self.masking_config().validate(self.max_seq_length)

    def instance_config(self) -> InstanceConfig:
        return InstanceConfig(self.max_seq_length, self.short_seq_prob, self.next_sentence_prediction)

    def masking_config(self) -> masking.MaskingConfig:
        return masking.MaskingConfig(self.masked_lm_prob, self.max_predictions_per_seq, self.whole_word_masking)

    def corpus_config(self) -> corpus.CorpusConfig:
        return corpus.CorpusConfig(inputs=self.inputs, format=self.corpus_format, text_field=self.tfds_text_field,
                                   tfds_data_dir=self.tfds_data_dir, max_line_chars=self.max_line_chars)


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


def _host_files(config: PretrainingDataConfig, process_index: int, process_count: int) -> list[str]:
    if config.input_kind == "tfrecord":
        _check_tfrecord_metadata(config)
        files = tfrecord.find_shards(config.inputs)
    else:
        files = corpus.expand_inputs(config.inputs)
    files = corpus.shard_files(files, process_index, process_count)
    # An endless pipeline over empty input would spin forever without yielding: refuse it up front.
    if all(tf.io.gfile.stat(f).length == 0 for f in files):
        raise ValueError(f"all {len(files)} input file(s) of process {process_index} are empty: {files[:3]}")
    return files


def _check_tfrecord_metadata(config: PretrainingDataConfig):
    """Shapes must match what `data create` wrote (its metadata JSON, when present beside the shards)."""
    import json
    import os

    for path in config.inputs:
        meta_path = os.path.join(path, "pretrain-metadata.json")
        if tf.io.gfile.isdir(path) and tf.io.gfile.exists(meta_path):
            with tf.io.gfile.GFile(meta_path) as f:
                written = json.load(f).get("feature_spec", {})
            wanted = {"max_seq_length": config.max_seq_length,
                      "max_predictions_per_seq": config.max_predictions_per_seq}
            for key, value in wanted.items():
                if key in written and written[key] != value:
                    raise ValueError(f"{path} holds examples with {key}={written[key]}, the pipeline asks for {value}")


def _documents(config: PretrainingDataConfig, files: list[str], order_seed: tf.Tensor, process_index: int,
               process_count: int) -> tf.data.Dataset:
    corpus_config = config.corpus_config()
    if corpus_config.is_tfds:
        return corpus.tfds_documents(corpus_config, process_index, process_count)
    return corpus.documents_from_files(files, corpus_config, cycle_length=config.file_cycle_length,
                                       order_seed=order_seed)


def _epochs(num_epochs: int | None) -> tf.data.Dataset:
    return tf.data.Dataset.counter() if num_epochs is None else tf.data.Dataset.range(num_epochs)


def finalize_batch(batch: dict) -> dict:
    """next_sentence_labels as [B, 1], as in the original TFRecord format."""
    batch = dict(batch)
    batch["next_sentence_labels"] = tf.reshape(batch["next_sentence_labels"], [-1, 1])
    return batch


def make_pretraining_dataset(config: PretrainingDataConfig, global_batch_size: int, process_index: int = 0,
                             process_count: int = 1, stats: collections.Counter | None = None,
                             drop_remainder: bool = True, prefetch: int | None = 2) -> tf.data.Dataset:
    """Per-host batches of global_batch_size / process_count examples for the trainer.

    Each element: int32 input_ids, input_mask, segment_ids [B, max_seq_length]; masked_lm_positions,
    masked_lm_ids [B, max_predictions_per_seq]; float32 masked_lm_weights [B, max_predictions_per_seq];
    int32 next_sentence_labels [B, 1]. Process i reads only its files (files[i::n]); the stream is a
    pure function of (config, process_index, process_count). `stats`, if given, collects counters.
    """
    if global_batch_size % process_count:
        raise ValueError(f"global batch {global_batch_size} is not divisible by {process_count} processes")
    batch_size = global_batch_size // process_count
    seed = config.seed
    host_seed = fold_seed(tf.constant([seed, 0], tf.int64), process_index)
    corpus_config = config.corpus_config() if config.input_kind == "text" else None
    files = [] if corpus_config and corpus_config.is_tfds else _host_files(config, process_index, process_count)

    if config.input_kind == "tfrecord":
        def epoch_examples(epoch):
            return tfrecord.tfrecord_examples(files, order_seed=fold_seed(host_seed, 1, epoch))

        ds = _epochs(config.num_epochs).flat_map(epoch_examples)
        ds = ds.shuffle(config.shuffle_buffer, seed=seed + process_index, reshuffle_each_iteration=False)
        ds = ds.batch(batch_size, drop_remainder=drop_remainder)
        ds = ds.map(lambda s: tfrecord.parse_batch(s, config.max_seq_length, config.max_predictions_per_seq),
                    num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
        return _with_options(ds, prefetch)

    tokenizer = load_tokenizer(config.vocab_path, config.lower_case)
    maker = InstanceMaker(config.instance_config(), cls_id=tokenizer.cls_id, sep_id=tokenizer.sep_id,
                          pad_id=tokenizer.pad_id, seed=seed, process_index=process_index, stats=stats)
    masker = masking.masker_for_tokenizer(config.masking_config(), tokenizer)
    static = config.masking == "static"

    def epoch_instances(epoch):
        # Static: epoch e replays copy e % dupe_factor (same files order, instances and masks).
        stream = epoch % config.dupe_factor if static else epoch
        docs = _documents(config, files, fold_seed(host_seed, 1, stream), process_index, process_count)
        blocks = tokenized_blocks(docs, tokenizer, config.doc_buffer_size).enumerate()

        parallel = {"num_parallel_calls": tf.data.AUTOTUNE, "deterministic": True}
        made = blocks.map(lambda index, block: (index, maker.tf_map(block, index, tf.reshape(stream, [1]))),
                          **parallel)
        if static:
            masked = made.map(lambda index, out: masker(out, fold_seed(host_seed, 2, stream, index)), **parallel)
            return masked.unbatch()
        return made.map(lambda index, out: out).unbatch()

    ds = _epochs(config.num_epochs).flat_map(epoch_instances)
    ds = ds.shuffle(config.shuffle_buffer, seed=seed + process_index, reshuffle_each_iteration=False)
    ds = ds.batch(batch_size, drop_remainder=drop_remainder)
    if not static:
        ds = ds.enumerate().map(lambda i, b: masker(b, fold_seed(host_seed, 3, i)),
                                num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
    return _with_options(ds.map(finalize_batch), prefetch)


def _with_options(ds: tf.data.Dataset, prefetch: int | None) -> tf.data.Dataset:
    if prefetch:
        ds = ds.prefetch(prefetch)
    options = tf.data.Options()
    options.deterministic = True
    # numpy_function is declared stateless (it is a pure function of its inputs), so nothing is lost.
    options.experimental_external_state_policy = tf.data.experimental.ExternalStatePolicy.FAIL
    return ds.with_options(options)


def save_iterator(iterator, path: str) -> str:
    """Write the iterator's position (tf.data checkpoint) to `path` (a file prefix); returns the prefix."""
    return tf.train.Checkpoint(iterator=iterator).write(path)


def restore_iterator(iterator, path: str):
    """Restore a position written by `save_iterator` into a fresh iterator of the *same* pipeline
    (same config, process index and process count)."""
    if not tf.io.gfile.exists(path + ".index"):
        raise FileNotFoundError(f"no input pipeline checkpoint at {path}")
    try:
        tf.train.Checkpoint(iterator=iterator).read(path).assert_consumed()
    except tf.errors.OpError as error:
        raise ValueError(f"cannot restore the input pipeline position from {path}: this pipeline differs from "
                         f"the one that saved it ({error.message.splitlines()[0][:300]})") from error


def iterator_checkpoint_path(directory: str, process_index: int) -> str:
    """Per-process prefix inside a checkpoint directory (each host saves its own pipeline position)."""
    return f"{directory.rstrip('/')}/input_pipeline/process_{process_index:05d}"
