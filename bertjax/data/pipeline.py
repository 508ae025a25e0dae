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

import tensorflow as tf

from bertjax.data import corpus, input_source, masking, tfrecord
from bertjax.data.data_config import PretrainingDataConfig
from bertjax.data.input_source import InputSource
from bertjax.data.stages import (
    InstanceMaker,
    finalize_batch,
    fold_seed,
    pack_block,
    tokenized_blocks,
)
from bertjax.data.tokenizers import load_tokenizer


def _host_files(source: InputSource, process_index: int, process_count: int) -> tuple[list[str], tuple[int, int]]:
    """The files this process reads and its share of their units (corpus.files_for_process)."""
    config, files, share = source.config, list(source.files), (0, 1)
    if config.input_kind == "tfrecord":
        if len(files) < process_count:  # every process reads every file, and keeps its share of the records
            return files, share
        files = corpus.shard_files(files, process_index, process_count)
    else:
        files, share = corpus.files_for_process(files, config, process_index, process_count)
    # An endless pipeline over empty input would spin forever without yielding: refuse it up front.
    if all(tf.io.gfile.stat(f).length == 0 for f in files):
        raise ValueError(f"all {len(files)} input file(s) of process {process_index} are empty: {files[:3]}")
    return files, share


def resolve_input(config: PretrainingDataConfig, key: str = "data.input") -> PretrainingDataConfig:
    """The config as a job reads its input (input_source.resolve): the kind decided, the shapes and vocabulary of
    `data create` shards taken."""
    return input_source.resolve(config, key).config


def _documents(config: PretrainingDataConfig, files: list[str], order_seed: tf.Tensor, process_index: int,
               process_count: int, share: tuple[int, int], formats: dict[str, str]) -> tf.data.Dataset:
    if config.is_tfds:
        return corpus.tfds_documents(config, process_index, process_count)
    return corpus.documents_from_files(files, config, cycle_length=config.file_cycle_length, order_seed=order_seed,
                                       share=share, formats=formats)


def _epochs(num_epochs: int | None) -> tf.data.Dataset:
    return tf.data.Dataset.counter() if num_epochs is None else tf.data.Dataset.range(num_epochs)


def make_pretraining_dataset(source: InputSource | PretrainingDataConfig, global_batch_size: int,
                             process_index: int = 0, process_count: int = 1, stats: collections.Counter | None = None,
                             drop_remainder: bool = True) -> tf.data.Dataset:
    """Per-host batches of global_batch_size / process_count examples for the trainer.

    Each element: int32 input_ids, input_mask, segment_ids [B, max_seq_length]; masked_lm_positions,
    masked_lm_ids [B, max_predictions_per_seq]; float32 masked_lm_weights [B, max_predictions_per_seq];
    int32 next_sentence_labels [B, 1]; with `config.packing`, the packed layout of data/schema.py. Process i
    reads only its files (files[i::n]; TFRecords in fewer files than processes: its records, [i::n]; JSON Lines or
    Parquet in fewer files than processes: its row groups / record chunks, corpus.files_for_process); the stream is a
    pure function of (config, process_index, process_count). `stats`, if given, collects counters. `source` is the
    input as the job resolved it (input_source.resolve); a config is resolved here.
    """
    if not isinstance(source, InputSource):
        source = input_source.resolve(source)
    config = source.config
    if global_batch_size % process_count:
        raise ValueError(f"global batch {global_batch_size} is not divisible by {process_count} processes")
    batch_size = global_batch_size // process_count
    seed = config.seed
    host_seed = fold_seed(tf.constant([seed, 0], tf.int64), process_index)
    files, share = (([], (0, 1)) if config.input_kind == "text" and config.is_tfds else
                    _host_files(source, process_index, process_count))

    if config.input_kind == "tfrecord":
        # Fewer shards than processes (`data create`'s one shard, read by 2 hosts): all processes read the same
        # files in the same order and each keeps every process_count-th record, from position process_index.
        split_records = process_count > 1 and len(files) < process_count
        order_seed = fold_seed(tf.constant([seed, 0], tf.int64), 0) if split_records else host_seed

        def epoch_examples(epoch):
            examples = tfrecord.tfrecord_examples(files, order_seed=fold_seed(order_seed, 1, epoch))
            return examples.shard(process_count, process_index) if split_records else examples

        ds = _epochs(config.num_epochs).flat_map(epoch_examples)
        ds = ds.shuffle(config.shuffle_buffer, seed=seed + process_index, reshuffle_each_iteration=False)
        ds = ds.batch(batch_size, drop_remainder=drop_remainder)
        ds = ds.map(lambda s: tfrecord.parse_batch(s, config.feature_shapes()),
                    num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
        return _with_options(ds, config.prefetch_batches)

    tokenizer = load_tokenizer(config.vocab, config.lower_case)
    maker = InstanceMaker(config, cls_id=tokenizer.cls_id, sep_id=tokenizer.sep_id,
                          pad_id=tokenizer.pad_id, seed=seed, process_index=process_index, stats=stats)
    masker = masking.masker_for_tokenizer(config, tokenizer)
    static = config.masking == "static"

    def epoch_instances(epoch):
        # Static: epoch e replays copy e % dupe_factor (same files order, instances and masks).
        stream = epoch % config.dupe_factor if static else epoch
        docs = _documents(config, files, fold_seed(host_seed, 1, stream), process_index, process_count, share,
                          dict(zip(source.files, source.formats)))
        blocks = tokenized_blocks(docs, tokenizer, config.doc_buffer_size).enumerate()

        parallel = {"num_parallel_calls": tf.data.AUTOTUNE, "deterministic": True}
        made = blocks.map(lambda index, block: (index, maker.tf_map(block, index, tf.reshape(stream, [1]))),
                          **parallel)
        if static or config.packing:
            # Packing masks each block before packing it (as static masking does); dynamic masking stays
            # dynamic because every epoch makes new instances from its own stream.
            masked = made.map(lambda index, out: masker(out, fold_seed(host_seed, 2, stream, index)), **parallel)
            if config.packing:
                masked = masked.map(lambda out: pack_block(out, config.max_instances_per_row, tokenizer.pad_id),
                                    **parallel)
            return masked.unbatch()
        return made.map(lambda index, out: out).unbatch()

    ds = _epochs(config.num_epochs).flat_map(epoch_instances)
    ds = ds.shuffle(config.shuffle_buffer, seed=seed + process_index, reshuffle_each_iteration=False)
    ds = ds.batch(batch_size, drop_remainder=drop_remainder)
    if not static and not config.packing:
        ds = ds.enumerate().map(lambda i, b: masker(b, fold_seed(host_seed, 3, i)),
                                num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
    return _with_options(ds.map(finalize_batch), config.prefetch_batches)


def _with_options(ds: tf.data.Dataset, prefetch: int) -> tf.data.Dataset:
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
