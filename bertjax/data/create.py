"""`bertjax data create`: text corpus -> statically masked TFRecord shards in the original BERT format.

Streaming: documents flow through blocks of `doc_buffer_size` documents, each tokenized once and
turned into `dupe_factor` differently-drawn copies of instances and masks (the original's dupe loop),
then mixed by a bounded shuffle buffer and written round-robin to the shards. Peak memory is set by
the block and shuffle sizes, not by the corpus size (the original holds the whole corpus in RAM, and
shuffles globally; the bounded shuffle is the one deliberate difference).
"""
from __future__ import annotations

import collections
import dataclasses
import os
import time

import tensorflow as tf

from bertjax.data import corpus, file_readers, format_detect, masking, tfrecord
from bertjax.runtime import input_files
from bertjax.data import out_dir as out_dir_lib
from bertjax.data.data_config import RECORD_FORMATS, PretrainingDataConfig
from bertjax.data.instances import nsp_warning
from bertjax.data.stages import (
    InstanceMaker,
    finalize_batch,
    fold_seed,
    pack_block,
    tokenized_blocks,
)
from bertjax.data.tokenizers import load_tokenizer


def count_empty_files(files: list[str]) -> int:
    return sum(1 for f in files if tf.io.gfile.stat(f).length == 0)


class BlockPasses:
    """One (block, dupe) pass of `data create`: a tokenized block -> unmasked instances (numpy, the original
    algorithm) -> static masks -> packed rows (`--pack`) -> serialized tf.train.Example strings.

    The one implementation of those steps for both runners: the local path runs each step as its own parallel
    tf.data map (so the GIL-bound instance step overlaps with the TF ops); the Beam path (data/beam_create.py)
    calls `records` on each bucket of documents. Instances and masks are pure functions of (seed, worker_index,
    block index, dupe) and the block's documents.
    """

    def __init__(self, config: PretrainingDataConfig, tokenizer, stats: collections.Counter, worker_index: int = 0):
        self.config, self.pad_id = config, tokenizer.pad_id
        self.maker = InstanceMaker(config, cls_id=tokenizer.cls_id, sep_id=tokenizer.sep_id, pad_id=tokenizer.pad_id,
                                   seed=config.seed, process_index=worker_index, stats=stats)
        self.masker = masking.masker_for_tokenizer(config, tokenizer)
        self.base_seed = fold_seed(tf.constant([config.seed, 0], tf.int64), worker_index)

    def instances(self, index, dupe, block: dict, count_input=None) -> dict:
        """count_input: whether the block's input counters are counted (default: on the block's first dupe)."""
        return self.maker.tf_map(block, index, tf.reshape(dupe, [1]),
                                 count_input=tf.equal(dupe, 0) if count_input is None else count_input)

    def mask(self, index, dupe, instances: dict) -> dict:
        return self.masker(instances, fold_seed(self.base_seed, 2, dupe, index))

    def pack(self, masked: dict) -> dict:
        return pack_block(masked, self.config.max_instances_per_row, self.pad_id) if self.config.packing else masked

    @staticmethod
    def serialize(rows: dict) -> tf.Tensor:
        return tfrecord.serialize_batch(finalize_batch(rows))

    def records(self, index, dupe, block: dict, count_input=None) -> tf.Tensor:
        """All steps in one call: the serialized records [N] of one (block, dupe) pass."""
        return self.serialize(self.pack(self.mask(index, dupe, self.instances(index, dupe, block, count_input))))


def serialized_instances(config: PretrainingDataConfig, files: list[str], tokenizer,
                         stats: collections.Counter, worker_index: int = 0,
                         share: tuple[int, int] = (0, 1), formats: dict[str, str] | None = None) -> tf.data.Dataset:
    """Serialized tf.train.Example strings of one pass over `files` (`formats`: each one's, corpus.file_formats)
    with `dupe_factor` copies (unshuffled)."""
    passes = BlockPasses(config, tokenizer, stats, worker_index)
    if config.is_tfds:
        docs = corpus.tfds_documents(config)
    else:
        docs = corpus.documents_from_files(files, config, cycle_length=config.file_cycle_length, share=share,
                                           formats=formats)
    blocks = tokenized_blocks(docs, tokenizer, config.doc_buffer_size).enumerate()
    # The block is tokenized once and paired with each dupe index (the original's dupe loop).
    copies = blocks.flat_map(lambda index, block: tf.data.Dataset.range(config.dupe_factor).map(
        lambda dupe: (index, dupe, block)))
    parallel = {"num_parallel_calls": tf.data.AUTOTUNE, "deterministic": True}
    made = copies.map(lambda index, dupe, block: (index, dupe, passes.instances(index, dupe, block)), **parallel)
    masked = made.map(passes.mask, **parallel)
    if config.packing:
        masked = masked.map(passes.pack, **parallel)
    return masked.map(passes.serialize, **parallel).unbatch()


def earlier_run_check(out_dir: str, overwrite: bool, worker_index: int = 0, num_workers: int = 1) -> list[str]:
    """An earlier run's files in `out_dir` (they would be read together with this run's, a directory input):
    refused, or with `overwrite` returned, to be removed only after this run's shards are complete (a failed run
    loses nothing)."""
    earlier = tfrecord.earlier_run_files(out_dir, worker_index, num_workers)
    if earlier and not overwrite:
        raise ValueError(f"{out_dir} already holds {len(earlier)} file(s) of an earlier `data create` run ("
                         f"{', '.join(os.path.basename(p) for p in earlier[:3])}{', ...' if len(earlier) > 3 else ''})"
                         f": choose another --out, or pass --overwrite to replace them")
    return earlier


def with_recorded_vocab(config: PretrainingDataConfig) -> PretrainingDataConfig:
    """The config as its metadata records it: a local vocab path made absolute, so that shards read from any
    working directory find their vocabulary (gs:// and other URLs are absolute already). Made by the driver, not
    by a worker, whose working directory may be another."""
    if not config.vocab or "://" in config.vocab:
        return config
    return config.replace(vocab=os.path.abspath(config.vocab))


def no_instances_error(config: PretrainingDataConfig, out_dir: str) -> ValueError:
    return ValueError(f"no instances from {config.input!r}: the input has no document with text (nothing "
                      f"written to {out_dir})")


def finish_run(config: PretrainingDataConfig, out_dir: str, prefix: str, paths: list[str], counts: list[int],
               stats: dict, start: float, earlier: list[str], log=print, **extra) -> dict:
    """Writes `<prefix>-metadata.json` for the finished shards `paths` (with `counts` examples each), removes the
    earlier run's files that this run did not replace, and returns the summary (`extra` keys are added to it:
    `input_formats`, and `corpus_files`, each corpus file's size and SHA-256, the shards' provenance)."""
    for path in earlier:
        if path not in paths and tf.io.gfile.exists(path):
            tf.io.gfile.remove(path)
    summary = {
        "shards": [os.path.basename(p) for p in paths],
        "examples_per_shard": [int(c) for c in counts],
        "examples": int(sum(counts)),
        # Readers compare each shard's size with this: a shard cut short or replaced is named before training.
        "bytes_per_shard": [tf.io.gfile.stat(p).length for p in paths],
        "stats": dict(sorted(stats.items())),
        "seconds": round(time.time() - start, 3),
        "config": dataclasses.asdict(config),
        "feature_spec": tfrecord.feature_spec_metadata(config),
        **extra,
    }
    tfrecord.write_metadata(out_dir, prefix, summary)
    log(f"wrote {summary['examples']} examples to {len(paths)} shard(s) in {out_dir} "
        f"({summary['seconds']:.1f} s); " + ", ".join(f"{k}={v}" for k, v in summary["stats"].items()))
    warning = nsp_warning(summary["stats"]) if config.next_sentence_prediction else None
    if warning:
        log(f"warning: {warning}")
    return summary


def create_pretraining_data(config: PretrainingDataConfig, out_dir: str, num_shards: int, *,
                            worker_index: int = 0, num_workers: int = 1, write_batch: int = 512,
                            overwrite: bool = False, log=print) -> dict:
    """Write `num_shards` TFRecord shards (+ metadata JSON) for this worker's share of the input files.

    Returns the summary that is also written to pretrain-metadata.json: examples per shard and the
    counters (documents, empty documents/files skipped, invalid UTF-8 and truncated lines...).
    """
    if config.input_kind == "tfrecord":
        raise ValueError("data create reads text corpora (input_kind='text')")
    config = with_recorded_vocab(config.replace(input_kind="text"))
    config.require_input()
    config = format_detect.resolve(config, log)
    if note := config.masking_note(config.max_seq_length):
        log(note)
    with out_dir_lib.owned(out_dir, log, out_dir_lib.lock_name(worker_index, num_workers)):
        return _create(config, out_dir, num_shards, worker_index, num_workers, write_batch, overwrite, log)


def _create(config: PretrainingDataConfig, out_dir: str, num_shards: int, worker_index: int, num_workers: int,
            write_batch: int, overwrite: bool, log) -> dict:
    """`create_pretraining_data` in the --out it holds."""
    earlier = earlier_run_check(out_dir, overwrite, worker_index, num_workers)
    start = time.time()
    file_formats = {} if config.is_tfds else corpus.file_formats(config)
    files, share = (([], (0, 1)) if config.is_tfds else
                    corpus.files_for_process(list(file_formats), config, worker_index, num_workers))
    formats = collections.Counter(file_readers.check_input_files(files, config, file_formats))
    tokenizer = load_tokenizer(config.vocab, config.lower_case)
    stats = collections.Counter(input_files=len(files), empty_files=count_empty_files(files))
    nulls_before = file_readers.NULL_TEXTS.total()
    ds = serialized_instances(config, files, tokenizer, stats, worker_index, share, file_formats)
    ds = ds.shuffle(config.shuffle_buffer, seed=config.seed + worker_index).batch(write_batch).prefetch(4)
    prefix = tfrecord.shard_prefix(worker_index, num_workers)
    with tfrecord.ShardWriter(out_dir, num_shards, prefix=prefix) as writer:
        for records in ds.as_numpy_iterator():
            writer.write(records)
    if any(file_formats[f] in RECORD_FORMATS for f in files):
        stats["null_texts"] = file_readers.NULL_TEXTS.total() - nulls_before  # records skipped: no text
    if writer.counts.sum() == 0:
        out_dir_lib.remove_quietly(*writer.paths)
        raise no_instances_error(config, out_dir)
    try:
        return finish_run(config, out_dir, prefix, writer.paths, writer.counts.tolist(), stats, start, earlier, log,
                          input_formats=dict(sorted(formats.items())),
                          corpus_files={path: input_files.fingerprint(path) for path in files})
    except BaseException:  # no metadata: shards that none lists are this run's leftovers
        out_dir_lib.remove_quietly(*writer.paths)
        raise
