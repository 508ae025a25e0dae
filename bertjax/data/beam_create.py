"""`bertjax data create --runner beam`: the same records, metadata and flags as the local `data create`, made by
an Apache Beam pipeline (DirectRunner, Dataflow, Flink, Spark) for corpora that outgrow one machine.

The algorithm at scale:
1. Each input file is read and tokenized by one worker (the local path's corpus reader and tokenizer); every
   non-empty document is keyed (file index, ordinal in the file).
2. With the count of documents per file (a small side input), document keys become global indices 0..n-1, which
   a keyed bijection (a Feistel network seeded by --seed) permutes; bucket b holds the permuted indices in
   [b*n/B, (b+1)*n/B) for B = max(1, n // doc_buffer_size) buckets. So every bucket holds at least
   `--doc-buffer` documents (fewer only when the whole corpus has fewer: then one bucket holds all of them) and
   fewer than twice as many: random-next segments are drawn from at least that many other documents.
3. A bucket is the local path's block: its documents in permuted order, then `create.BlockPasses` (the one
   implementation of instances, static masking, packing and serialization) for each dupe with block index =
   bucket, so each dupe draws with its own seeds. The bucket's records are permuted (seeded) before writing.
4. Records never go through the runner: a bucket writes its records to fragment files under
   `out/beam-temp-<run id>/` (bucket b covers shards [b*S/B, max(b*S/B + 1, (b+1)*S/B)), its records dealt
   round-robin over them, so every shard gets records even when B < S) and emits only (shard, fragment) names.
   Each shard is the byte concatenation of its fragments in bucket order (TFRecord framing concatenates),
   written under the temporary directory.
5. A last step, after every shard is complete, renames the shards to their final names, writes
   `pretrain-metadata.json` (shards, sizes, counters, config), removes an earlier run's files (--overwrite) and
   the temporary directory. A worker that fails is retried by the runner (fragment and shard names carry a
   per-attempt id); a killed job leaves no file under a shard name, only `beam-temp-*`.

Every draw depends only on the seed and the input, never on bundle or worker layout: the same seed and input
give the same records in the same shards on any runner and worker count.
Counters go to Beam metrics (live, in the runner's UI) and, summed exactly once by a combine, to the metadata.
"""
from __future__ import annotations

import collections
import hashlib
import json
import os
import time
import uuid

import apache_beam as beam
import numpy as np
import tensorflow as tf
from apache_beam.metrics import Metrics
from apache_beam.metrics.metric import MetricsFilter
from apache_beam.options.pipeline_options import PipelineOptions

from bertjax.data import corpus, create, tfrecord
from bertjax.data.data_config import PretrainingDataConfig
from bertjax.data.instances import Block
from bertjax.data.stages import tokenized_blocks
from bertjax.data.tokenizers import load_tokenizer

BEAM_RUNNERS = ("DirectRunner", "DataflowRunner", "FlinkRunner", "SparkRunner")
METRICS_NAMESPACE = "bertjax"
_TOKENIZE_BATCH = 256  # documents tokenized per vectorised call while reading (does not change the output)
_COPY_CHUNK = 16 << 20  # bytes per read when a shard is concatenated from its fragments


def permute_index(index: int, n: int, seed: int, rounds: int = 4) -> int:
    """A seeded bijection of [0, n): a balanced Feistel network over the next even power of two, cycle-walked
    back into range (each walk step is a value of the same permutation, so it ends, and stays a bijection)."""
    if not 0 <= index < n:
        raise ValueError(f"index {index} is not in [0, {n})")
    half = max(1, ((n - 1).bit_length() + 1) // 2)
    mask = (1 << half) - 1
    x = index
    while True:
        left, right = x >> half, x & mask
        for r in range(rounds):
            digest = hashlib.blake2b(f"{seed}/{r}/{right}".encode(), digest_size=8).digest()
            left, right = right, left ^ (int.from_bytes(digest, "little") & mask)
        x = (left << half) | right
        if x < n:
            return x


def num_buckets(num_documents: int, documents_per_bucket: int) -> int:
    """Buckets of at least `documents_per_bucket` documents each (one bucket for a smaller corpus)."""
    return max(1, num_documents // documents_per_bucket)


def bucket_of(permuted: int, num_documents: int, buckets: int) -> int:
    """Contiguous ranges of permuted indices: bucket sizes are floor or ceil of num_documents / buckets."""
    return permuted * buckets // num_documents


def document_table(counts: dict[int, int], documents_per_bucket: int) -> dict:
    """Per-file document counts -> each file's first global index, the total and the number of buckets."""
    offsets, total = {}, 0
    for file_index in sorted(counts):
        offsets[file_index] = total
        total += counts[file_index]
    return {"offsets": offsets, "documents": total, "buckets": num_buckets(total, documents_per_bucket)}


def beam_pipeline_options(runner: str, options: list[str]):
    """PipelineOptions from --beam-option KEY=VALUE (or KEY, a boolean flag) strings."""
    if runner not in BEAM_RUNNERS:
        raise ValueError(f"--beam-runner {runner!r}; expected one of {', '.join(BEAM_RUNNERS)}")
    flags = []
    for option in options:
        key, sep, value = option.partition("=")
        if not key.strip() or key.startswith("-"):
            raise ValueError(f"--beam-option {option!r}: expected KEY=VALUE (e.g. project=my-project)")
        flags.append(f"--{key.strip()}={value}" if sep else f"--{key.strip()}")
    return PipelineOptions(flags, runner=runner)


def _sum_counters(counters) -> dict:
    total = collections.Counter()
    for counter in counters:
        total.update(counter)
    return dict(total)


def _report(stats: collections.Counter):
    for name, value in stats.items():
        if value:
            Metrics.counter(METRICS_NAMESPACE, name).inc(int(value))


class ReadDocuments(beam.DoFn):
    """(file index, path) -> ((file index, ordinal), (token ids, sentence lengths)) per non-empty document,
    plus the file's counters on the "stats" output (documents, empty ones, bad lines)."""

    def __init__(self, config: PretrainingDataConfig):
        self.config = config

    def setup(self):
        tokenizer = load_tokenizer(self.config.vocab, self.config.lower_case)
        # One pipeline for every file (its source yields the current file): building one per file would add its
        # traced functions to TensorFlow's function library each time.
        self._path = None
        paths = tf.data.Dataset.from_generator(lambda: iter([self._path]),
                                               output_signature=tf.TensorSpec([], tf.string))
        docs = paths.flat_map(lambda path: corpus.file_documents(path, self.config))
        self.blocks = tokenized_blocks(docs, tokenizer, _TOKENIZE_BATCH)

    def process(self, item):
        file_index, self._path = item
        stats = collections.Counter()
        ordinal = 0
        for block in self.blocks.as_numpy_iterator():
            # The local path's input counters: the same function (Block.from_ragged) drops empty entries.
            stats.update(invalid_utf8_lines=int(block["invalid_utf8"].sum()),
                         truncated_lines=int(block["truncated"].sum()))
            clean = Block.from_ragged(block["ids"], block["sentence_splits"], block["doc_splits"], stats)
            splits, doc_splits = clean.sentence_splits, clean.doc_splits
            for d in range(clean.num_documents):
                sentence_splits = splits[doc_splits[d]:doc_splits[d + 1] + 1]
                ids = clean.ids[sentence_splits[0]:sentence_splits[-1]]
                yield (file_index, ordinal), (ids.astype(np.int32), np.diff(sentence_splits).astype(np.int32))
                ordinal += 1
        _report(stats)
        yield beam.pvalue.TaggedOutput("stats", dict(stats))


def bucket_shards(bucket: int, buckets: int, num_shards: int) -> range:
    """The shards that bucket `bucket` of `buckets` writes to: contiguous, one per bucket when buckets >= shards
    (each shard then gets floor or ceil of buckets / shards buckets), several when fewer buckets than shards (the
    ranges then cover every shard)."""
    first = bucket * num_shards // buckets
    return range(first, max(first + 1, (bucket + 1) * num_shards // buckets))


def _write_records(path: str, records) -> None:
    with tf.io.TFRecordWriter(path) as writer:
        for record in records:
            writer.write(record)


class BucketRecords(beam.DoFn):
    """(bucket, [(permuted index, document)]) -> the serialized records of every dupe pass over the bucket,
    permuted with a seeded RNG and written to fragment files in `temp_dir` (one per shard the bucket covers);
    emits (shard, (bucket, fragment path, records)) and the bucket's counters on the "stats" output."""

    def __init__(self, config: PretrainingDataConfig, temp_dir: str, num_shards: int):
        self.config = config
        self.temp_dir = temp_dir
        self.num_shards = num_shards

    def setup(self):
        tf.io.gfile.makedirs(self.temp_dir)
        self.stats = collections.Counter()
        self.passes = create.BlockPasses(self.config, load_tokenizer(self.config.vocab, self.config.lower_case),
                                         self.stats)
        # One graph for every bucket (shapes vary): the masking ops run fused instead of op by op. The steps have
        # no Python control flow on tensors, so AutoGraph's conversion (seconds per worker) is skipped.
        self.records = tf.function(lambda index, dupe, block: self.passes.records(index, dupe, block, False),
                                   reduce_retracing=True, autograph=False)

    def process(self, item, table: dict):
        bucket, documents = item
        documents = sorted(documents, key=lambda d: d[0])  # permuted order: independent of arrival order
        ids = np.concatenate([d[1][0] for d in documents])
        sentence_lengths = np.concatenate([d[1][1] for d in documents])
        sentences_per_doc = np.array([len(d[1][1]) for d in documents], np.int64)
        block = {"ids": tf.constant(ids),
                 "sentence_splits": tf.constant(np.concatenate([[0], np.cumsum(sentence_lengths)]), tf.int64),
                 "doc_splits": tf.constant(np.concatenate([[0], np.cumsum(sentences_per_doc)]), tf.int64),
                 "invalid_utf8": tf.zeros([0], tf.int32), "truncated": tf.zeros([0], tf.int32)}
        self.stats.clear()
        records = np.concatenate([
            self.records(tf.constant(bucket, tf.int64), tf.constant(dupe, tf.int64), block).numpy()
            for dupe in range(self.config.dupe_factor)])
        records = records[np.random.default_rng([self.config.seed, 1, bucket]).permutation(len(records))]
        shards = bucket_shards(bucket, table["buckets"], self.num_shards)
        attempt = uuid.uuid4().hex  # a retried or duplicated bundle never writes over another attempt's file
        for i, shard in enumerate(shards):
            path = os.path.join(self.temp_dir, f"fragment-{shard:05d}-{bucket:09d}-{attempt}{tfrecord.SHARD_SUFFIX}")
            part = records[i::len(shards)]
            _write_records(path, part)
            yield shard, (bucket, path, len(part))
        stats = collections.Counter(self.stats)
        stats["buckets"] += 1
        _report(stats)
        yield beam.pvalue.TaggedOutput("stats", dict(stats))


class ConcatenateShard(beam.DoFn):
    """(shard, [(bucket, fragment path, records)]) -> the shard written under `temp_dir` as its fragments' bytes
    in bucket order; emits (shard, temporary path, records)."""

    def __init__(self, temp_dir: str, num_shards: int):
        self.temp_dir = temp_dir
        self.num_shards = num_shards

    def process(self, item):
        shard, fragments = item
        name = os.path.basename(_shard_path("", shard, self.num_shards))
        path = os.path.join(self.temp_dir, f"{uuid.uuid4().hex}-{name}")
        with tf.io.gfile.GFile(path, "wb") as out:
            for _, fragment, _ in sorted(fragments):
                with tf.io.gfile.GFile(fragment, "rb") as f:
                    while chunk := f.read(_COPY_CHUNK):
                        out.write(chunk)
        yield shard, path, sum(count for _, _, count in fragments)


def _shard_path(out_dir: str, shard: int, num_shards: int) -> str:
    return os.path.join(out_dir, f"{tfrecord.shard_prefix()}-{shard:05d}-of-{num_shards:05d}{tfrecord.SHARD_SUFFIX}")


def _assign_bucket(item, table: dict, seed: int):
    (file_index, ordinal), document = item
    n = table["documents"]
    permuted = permute_index(table["offsets"][file_index] + ordinal, n, seed)
    return bucket_of(permuted, n, table["buckets"]), (permuted, document)


def _finish(_, stats: dict, shards: list, table: dict, config: PretrainingDataConfig, out_dir: str, temp_dir: str,
            num_shards: int, earlier: list[str], start: float, runner: str, run_id: str):
    """The last step, once every shard is complete: the shards renamed to their final names and the metadata
    written (or, no instances, nothing), then the temporary directory removed."""
    shards = sorted(shards)
    if shards and sum(count for _, _, count in shards) > 0:
        if [shard for shard, _, _ in shards] != list(range(num_shards)):
            raise RuntimeError(f"shards {[s for s, _, _ in shards]} made, expected 0..{num_shards - 1}")
        paths = [_shard_path(out_dir, shard, num_shards) for shard, _, _ in shards]
        for (_, temporary, _), path in zip(shards, paths):
            tf.io.gfile.rename(temporary, path, overwrite=True)
        create.finish_run(config, out_dir, tfrecord.shard_prefix(), paths, [c for _, _, c in shards], stats, start,
                          earlier, log=lambda *_: None, runner=f"beam/{runner}", run_id=run_id,
                          buckets=table["buckets"], documents_per_bucket=[table["documents"] // table["buckets"],
                                                                          -(-table["documents"] // table["buckets"])])
    if tf.io.gfile.exists(temp_dir):
        tf.io.gfile.rmtree(temp_dir)


def build_pipeline(pipeline, config: PretrainingDataConfig, files: list[str], out_dir: str, num_shards: int, *,
                   base_stats: dict, earlier: list[str], start: float, runner: str, run_id: str):
    """Adds the `data create` transforms to `pipeline` (see the module docstring)."""
    seed = config.seed
    temp_dir = os.path.join(out_dir, f"beam-temp-{run_id}")
    read = (pipeline
            | "Files" >> beam.Create(list(enumerate(files)))
            | "SpreadFiles" >> beam.Reshuffle()  # one file per work item, on any worker
            | "ReadAndTokenize" >> beam.ParDo(ReadDocuments(config)).with_outputs("stats", main="documents"))
    documents = read.documents
    table = (documents
             | "FileOfDocument" >> beam.Map(lambda item: item[0][0])
             | "DocumentsPerFile" >> beam.combiners.Count.PerElement()
             | "CountsAsDict" >> beam.combiners.ToDict()
             | "DocumentTable" >> beam.Map(document_table, config.doc_buffer_size))
    made = (documents
            | "AssignBucket" >> beam.Map(_assign_bucket, beam.pvalue.AsSingleton(table), seed)
            | "GroupBuckets" >> beam.GroupByKey()
            | "InstancesAndMasks" >> beam.ParDo(BucketRecords(config, temp_dir, num_shards),
                                                beam.pvalue.AsSingleton(table)).with_outputs("stats", main="fragments"))
    stats = ((pipeline | "BaseStats" >> beam.Create([base_stats]), read.stats, made.stats)
             | "AllStats" >> beam.Flatten()
             | "SumStats" >> beam.CombineGlobally(_sum_counters))
    shards = (made.fragments
              | "GroupShards" >> beam.GroupByKey()  # names and counts only
              | "ConcatenateShards" >> beam.ParDo(ConcatenateShard(temp_dir, num_shards)))
    (pipeline
     | "Once" >> beam.Create([None])
     | "WriteMetadata" >> beam.Map(_finish, beam.pvalue.AsSingleton(stats), beam.pvalue.AsList(shards),
                                   beam.pvalue.AsSingleton(table), config=config, out_dir=out_dir,
                                   temp_dir=temp_dir, num_shards=num_shards, earlier=earlier, start=start,
                                   runner=runner, run_id=run_id))


def create_with_beam(config: PretrainingDataConfig, out_dir: str, num_shards: int, *, runner: str = "DirectRunner",
                     beam_options: list[str] = (), overwrite: bool = False, log=print) -> dict:
    """Runs the pipeline to completion and returns the summary written to pretrain-metadata.json (plus
    "beam_metrics": the runner's committed counters)."""
    if config.input_kind == "tfrecord" or config.is_tfds:
        raise ValueError("data create --runner beam reads text files (not tfds: or TFRecord input)")
    config = config.replace(input_kind="text")
    if num_shards < 1:
        raise ValueError(f"--shards must be >= 1, got {num_shards}")
    config.require_input()
    options = beam_pipeline_options(runner, list(beam_options))
    earlier = create.earlier_run_check(out_dir, overwrite)
    start = time.time()
    files = corpus.expand_inputs(config.inputs)
    corpus.check_text_files(files)
    load_tokenizer(config.vocab, config.lower_case)  # a bad vocab fails here, not on every worker
    tf.io.gfile.makedirs(out_dir)
    base_stats = {"input_files": len(files), "empty_files": create.count_empty_files(files)}
    pipeline = beam.Pipeline(options=options)
    run_id = uuid.uuid4().hex  # tells this run's metadata from an earlier run's (--overwrite, nothing made)
    build_pipeline(pipeline, config, files, out_dir, num_shards, base_stats=base_stats, earlier=earlier,
                   start=start, runner=runner, run_id=run_id)
    result = pipeline.run()
    result.wait_until_finish()
    metadata = os.path.join(out_dir, tfrecord.shard_prefix() + tfrecord.METADATA_SUFFIX)
    summary = {}
    if tf.io.gfile.exists(metadata):
        with tf.io.gfile.GFile(metadata) as f:
            summary = json.load(f)
    if summary.get("run_id") != run_id:
        raise create.no_instances_error(config, out_dir)
    counters = result.metrics().query(MetricsFilter().with_namespace(METRICS_NAMESPACE))["counters"]
    summary["beam_metrics"] = {c.key.metric.name: c.committed for c in counters}
    log(f"wrote {summary['examples']} examples to {len(summary['shards'])} shard(s) in {out_dir} with Beam's "
        f"{runner} ({time.time() - start:.1f} s, {summary['buckets']} buckets); "
        + ", ".join(f"{k}={v}" for k, v in summary["stats"].items()))
    return summary
