"""`bertjax data create --runner beam`: the same records, metadata and flags as the local `data create`, made by
an Apache Beam pipeline (DirectRunner, Dataflow, Flink, Spark) for corpora that outgrow one machine.

The algorithm at scale:
1. Each input file is read and tokenized by one worker (the local path's corpus reader and tokenizer); its
   non-empty documents are written in chunks of c = max(1, doc_buffer // 16) consecutive documents to a spill
   file under `out/beam-temp-<run id>/`, and only a reference per chunk (file index, chunk ordinal, documents,
   path, byte range) goes on. Documents never pass through the runner's shuffle or side inputs: the
   DirectRunner hands a worker its whole share of a grouped collection as one bundle, so a worker's memory grew
   with the corpus when documents were grouped by bucket (figures: docs/performance-history.md).
2. One step plans the buckets from the references (a few numbers per chunk): chunks get global indices in
   (file, ordinal) order, a keyed bijection (a Feistel network seeded by --seed) orders them, and bucket k takes
   the chunks whose first document falls in [k*n/B, (k+1)*n/B) of that order, B = max(1, n // (doc_buffer + c))
   for n documents. So every bucket holds more than `--doc-buffer` documents (all of them when the corpus is
   smaller) gathered from at least 16 places all over the corpus, and fewer than 2 * (doc_buffer + c) + c:
   random-next segments are drawn from at least that many other documents, and a worker holds one bucket.
3. A bucket is the local path's block: its chunks read back in permuted order, then `create.BlockPasses` (the one
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
import dataclasses
import hashlib
import os
import time
import uuid

import apache_beam as beam
import numpy as np
import tensorflow as tf
from apache_beam.metrics import Metrics
from apache_beam.metrics.metric import MetricsFilter
from apache_beam.options.pipeline_options import PipelineOptions

from bertjax.runtime import errors, input_files, quiet
from bertjax.data import corpus, create, file_readers, format_detect, tfrecord
from bertjax.data import out_dir as out_dir_lib
from bertjax.data.data_config import PretrainingDataConfig
from bertjax.data.instances import Block, nsp_warning
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


def documents_per_chunk(doc_buffer_size: int) -> int:
    """Documents per spilled chunk: a bucket gathers at least 16 chunks from places all over the corpus."""
    return max(1, doc_buffer_size // 16)


def plan_buckets(chunks: list[tuple[int, int, int]], doc_buffer_size: int, seed: int) -> dict:
    """(file index, chunk ordinal, documents) of every chunk -> the buckets: "members" [bucket] lists the chunks
    (their positions in `chunks`) in permuted order; "documents", "buckets", "documents_per_bucket" [min, max].

    Chunks get global indices in (file, ordinal) order, a seeded permutation orders them, and bucket k takes the
    chunks whose first document falls in [k*n/B, (k+1)*n/B) of that order, with B = max(1, n // (doc_buffer +
    c)) for n documents in chunks of at most c: so every bucket holds more than `doc_buffer` documents (all of
    them when the corpus is smaller) and fewer than 2 * (doc_buffer + c) + c."""
    order = sorted(range(len(chunks)), key=lambda i: chunks[i][:2])
    n = sum(c[2] for c in chunks)
    if n == 0:
        return {"members": [], "documents": 0, "buckets": 0, "documents_per_bucket": [0, 0]}
    largest = max(c[2] for c in chunks)
    buckets = max(1, n // (doc_buffer_size + largest))
    permuted = [order[permute_index(i, len(order), seed)] for i in range(len(order))]
    members: list[list[int]] = [[] for _ in range(buckets)]
    before = 0
    for position in permuted:
        members[before * buckets // n].append(position)
        before += chunks[position][2]
    sizes = [sum(chunks[i][2] for i in m) for m in members]
    return {"members": members, "documents": n, "buckets": buckets, "documents_per_bucket": [min(sizes), max(sizes)]}


def encode_chunk(documents: list[tuple[np.ndarray, np.ndarray]]) -> bytes:
    """Documents (token ids, sentence lengths) -> one spill record: counts, sentence lengths, ids (int32)."""
    header = np.array([len(documents), sum(len(d[1]) for d in documents), sum(len(d[0]) for d in documents)],
                      np.int64)
    parts = [header.tobytes(), np.array([len(d[1]) for d in documents], np.int32).tobytes()]
    parts += [d[1].astype(np.int32).tobytes() for d in documents] + [d[0].astype(np.int32).tobytes() for d in documents]
    return b"".join(parts)


def decode_chunk(data: bytes) -> list[tuple[np.ndarray, np.ndarray]]:
    """The inverse of `encode_chunk`."""
    docs, sentences, tokens = np.frombuffer(data[:24], np.int64)
    body = np.frombuffer(data[24:], np.int32)
    if len(body) != docs + sentences + tokens:
        raise ValueError(f"a spilled chunk of {len(data)} bytes does not hold {docs} documents, {sentences} "
                         f"sentences and {tokens} tokens")
    per_doc, lengths, ids = np.split(body, [docs, docs + sentences])
    sentence_splits = np.concatenate([[0], np.cumsum(per_doc)])
    token_splits = np.concatenate([[0], np.cumsum(lengths)])
    return [(ids[token_splits[sentence_splits[d]]:token_splits[sentence_splits[d + 1]]],
             lengths[sentence_splits[d]:sentence_splits[d + 1]]) for d in range(docs)]


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


class SpillDocuments(beam.DoFn):
    """(file index, path, format) -> the file's non-empty documents, tokenized, written in chunks of
    `documents_per_chunk` to a spill file in `temp_dir`; emits a reference per chunk: (file index, chunk
    ordinal, documents, spill path, byte offset, bytes), the file's counters on the "stats" output, and (path, its
    size and SHA-256) on the "files" output."""

    def __init__(self, config: PretrainingDataConfig, temp_dir: str, formats: list[str]):
        self.config = config
        self.temp_dir = temp_dir
        self.formats = sorted(set(formats))  # those of the corpus's files (a mixed corpus: several)
        self.chunk_size = documents_per_chunk(config.doc_buffer_size)

    def setup(self):
        tf.io.gfile.makedirs(self.temp_dir)
        tokenizer = load_tokenizer(self.config.vocab, self.config.lower_case)
        # One pipeline per format for every file (its source yields the current file): building one per file would
        # add its traced functions to TensorFlow's function library each time.
        self._path = None
        paths = tf.data.Dataset.from_generator(lambda: iter([self._path]),
                                               output_signature=tf.TensorSpec([], tf.string))
        self.blocks = {}
        for fmt in self.formats:
            own = dataclasses.replace(self.config, corpus_format=fmt)
            docs = paths.flat_map(lambda path, own=own: corpus.file_documents(path, own))
            self.blocks[fmt] = tokenized_blocks(docs, tokenizer, _TOKENIZE_BATCH)

    def _documents(self, stats: collections.Counter, corpus_format: str):
        for block in self.blocks[corpus_format].as_numpy_iterator():
            # The local path's input counters: the same function (Block.from_ragged) drops empty entries.
            stats.update(invalid_utf8_lines=int(block["invalid_utf8"].sum()),
                         truncated_lines=int(block["truncated"].sum()))
            clean = Block.from_ragged(block["ids"], block["sentence_splits"], block["doc_splits"], stats)
            splits, doc_splits = clean.sentence_splits, clean.doc_splits
            for d in range(clean.num_documents):
                sentence_splits = splits[doc_splits[d]:doc_splits[d + 1] + 1]
                yield clean.ids[sentence_splits[0]:sentence_splits[-1]], np.diff(sentence_splits)

    def process(self, item):
        file_index, self._path, corpus_format = item
        stats = collections.Counter()
        # A retried or duplicated bundle writes its own file: a reference names the attempt that made it.
        spill = os.path.join(self.temp_dir, f"documents-{file_index:06d}-{uuid.uuid4().hex}.bin")
        references, chunk, offset = [], [], 0
        with tf.io.gfile.GFile(spill, "wb") as out:
            def flush():
                nonlocal offset
                data = encode_chunk(chunk)
                out.write(data)
                references.append((file_index, len(references), len(chunk), spill, offset, len(data)))
                offset += len(data)
                chunk.clear()

            for document in self._documents(stats, corpus_format):
                chunk.append(document)
                if len(chunk) == self.chunk_size:
                    flush()
            if chunk:
                flush()
        _report(stats)
        yield from references
        yield beam.pvalue.TaggedOutput("stats", dict(stats))
        yield beam.pvalue.TaggedOutput("files", (self._path, input_files.fingerprint(self._path)))


def _read_chunk(reference) -> list[tuple[np.ndarray, np.ndarray]]:
    _, _, documents, path, offset, size = reference
    with tf.io.gfile.GFile(path, "rb") as f:
        f.seek(offset)
        data = f.read(size)
    if len(data) != size:
        raise ValueError(f"{path}: {len(data)} bytes at offset {offset}, expected {size}")
    chunk = decode_chunk(data)
    if len(chunk) != documents:
        raise ValueError(f"{path} at offset {offset}: {len(chunk)} documents, expected {documents}")
    return chunk


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
    """(bucket, buckets, [chunk reference] in permuted order) -> the serialized records of every dupe pass over
    the bucket's documents (read back from the spill files),
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

    def process(self, item):
        bucket, buckets, references = item
        documents = [document for reference in references for document in _read_chunk(reference)]
        ids = np.concatenate([d[0] for d in documents])
        sentence_lengths = np.concatenate([d[1] for d in documents])
        sentences_per_doc = np.array([len(d[1]) for d in documents], np.int64)
        block = {"ids": tf.constant(ids),
                 "sentence_splits": tf.constant(np.concatenate([[0], np.cumsum(sentence_lengths)]), tf.int64),
                 "doc_splits": tf.constant(np.concatenate([[0], np.cumsum(sentences_per_doc)]), tf.int64),
                 "invalid_utf8": tf.zeros([0], tf.int32), "truncated": tf.zeros([0], tf.int32)}
        self.stats.clear()
        records = np.concatenate([
            self.records(tf.constant(bucket, tf.int64), tf.constant(dupe, tf.int64), block).numpy()
            for dupe in range(self.config.dupe_factor)])
        records = records[np.random.default_rng([self.config.seed, 1, bucket]).permutation(len(records))]
        shards = bucket_shards(bucket, buckets, self.num_shards)
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


def _plan_references(references: list, doc_buffer_size: int, seed: int) -> dict:
    """`plan_buckets` over chunk references; "members" then holds each bucket's references in permuted order."""
    ordered = sorted(references, key=lambda r: r[:2])  # (file index, chunk ordinal): not the arrival order
    plan = plan_buckets([r[:3] for r in ordered], doc_buffer_size, seed)
    plan["members"] = [[ordered[i] for i in members] for members in plan["members"]]
    return plan


def _finish(_, stats: dict, shards: list, plan: dict, corpus_files: dict, config: PretrainingDataConfig,
            out_dir: str, temp_dir: str, num_shards: int, earlier: list[str], start: float, runner: str, run_id: str,
            input_formats: dict):
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
                          buckets=plan["buckets"], documents_per_bucket=plan["documents_per_bucket"],
                          input_formats=input_formats, corpus_files=dict(sorted(corpus_files.items())))
    if tf.io.gfile.exists(temp_dir):
        tf.io.gfile.rmtree(temp_dir)


def _temp_dir(out_dir: str, run_id: str) -> str:
    return os.path.join(out_dir, f"beam-temp-{run_id}")


def build_pipeline(pipeline, config: PretrainingDataConfig, files: list[str], out_dir: str, num_shards: int, *,
                   base_stats: dict, earlier: list[str], start: float, runner: str, run_id: str,
                   input_formats: dict | None = None, file_formats: dict[str, str] | None = None):
    """Adds the `data create` transforms to `pipeline` (see the module docstring); `file_formats`: each file's
    format (corpus.file_formats), default the config's."""
    temp_dir = _temp_dir(out_dir, run_id)
    formats = [(file_formats or {}).get(path, config.corpus_format) for path in files]
    read = (pipeline
            | "Files" >> beam.Create([(i, path, fmt) for i, (path, fmt) in enumerate(zip(files, formats))])
            | "SpreadFiles" >> beam.Reshuffle()  # one file per work item, on any worker
            | "ReadTokenizeSpill" >> beam.ParDo(SpillDocuments(config, temp_dir, formats)).with_outputs(
                "stats", "files", main="chunks"))
    # Only chunk references (a few numbers and a path each) go through the runner from here on.
    plan = (read.chunks
            | "AllChunks" >> beam.combiners.ToList()
            | "PlanBuckets" >> beam.Map(_plan_references, config.doc_buffer_size, config.seed))
    made = (plan
            | "Buckets" >> beam.FlatMap(lambda p: [(b, p["buckets"], refs) for b, refs in enumerate(p["members"])])
            | "SpreadBuckets" >> beam.Reshuffle()
            | "InstancesAndMasks" >> beam.ParDo(BucketRecords(config, temp_dir, num_shards)).with_outputs(
                "stats", main="fragments"))
    stats = ((pipeline | "BaseStats" >> beam.Create([base_stats]), read.stats, made.stats)
             | "AllStats" >> beam.Flatten()
             | "SumStats" >> beam.CombineGlobally(_sum_counters))
    plan_summary = plan | "PlanSummary" >> beam.Map(lambda p: {k: v for k, v in p.items() if k != "members"})
    shards = (made.fragments
              | "GroupShards" >> beam.GroupByKey()  # names and counts only
              | "ConcatenateShards" >> beam.ParDo(ConcatenateShard(temp_dir, num_shards)))
    (pipeline
     | "Once" >> beam.Create([None])
     | "WriteMetadata" >> beam.Map(_finish, beam.pvalue.AsSingleton(stats), beam.pvalue.AsList(shards),
                                   beam.pvalue.AsSingleton(plan_summary), beam.pvalue.AsDict(read.files),
                                   config=config, out_dir=out_dir,
                                   temp_dir=temp_dir, num_shards=num_shards, earlier=earlier, start=start,
                                   runner=runner, run_id=run_id, input_formats=input_formats or {}))


def _stale_temporary_directories(out_dir: str, overwrite: bool, log) -> None:
    """A killed job's `beam-temp-*` (spills, fragments, unfinished shards; never read as data): removed with
    --overwrite, named otherwise (another job may still be writing into the same --out)."""
    stale = sorted(tf.io.gfile.glob(os.path.join(out_dir, "beam-temp-*")))
    if not stale:
        return
    names = ", ".join(os.path.basename(p) for p in stale[:3]) + (", ..." if len(stale) > 3 else "")
    if overwrite:
        for path in stale:
            tf.io.gfile.rmtree(path)
        log(f"removed {len(stale)} temporary director{'y' if len(stale) == 1 else 'ies'} of unfinished runs "
            f"({names}) from {out_dir}")
    else:
        log(f"note: {out_dir} holds {len(stale)} temporary director{'y' if len(stale) == 1 else 'ies'} of "
            f"unfinished runs ({names}); delete them, or pass --overwrite, once no job writes there")


def create_with_beam(config: PretrainingDataConfig, out_dir: str, num_shards: int, *, runner: str = "DirectRunner",
                     beam_options: list[str] = (), overwrite: bool = False, log=print,
                     verbose: bool = False) -> dict:
    """Runs the pipeline to completion and returns the summary written to pretrain-metadata.json (plus
    "beam_metrics": the runner's committed counters). Local workers' start-up lines (each imports TensorFlow) are
    dropped unless `verbose`."""
    if config.input_kind == "tfrecord" or config.is_tfds:
        raise ValueError("data create --runner beam reads corpus files (not tfds: or TFRecord input)")
    config = create.with_recorded_vocab(config.replace(input_kind="text"))
    if num_shards < 1:
        raise ValueError(f"--shards must be >= 1, got {num_shards}")
    config.require_input()
    config = format_detect.resolve(config, log)
    if note := config.masking_note(config.max_seq_length):
        log(note)
    options = beam_pipeline_options(runner, list(beam_options))
    start = time.time()
    file_formats = corpus.file_formats(config)
    files = list(file_formats)
    formats = collections.Counter(file_readers.check_input_files(files, config, file_formats))
    load_tokenizer(config.vocab, config.lower_case)  # a bad vocab fails here, not on every worker
    with out_dir_lib.owned(out_dir, log):  # the --out of one run at a time (LOCK, held by this launching process)
        earlier = create.earlier_run_check(out_dir, overwrite)
        _stale_temporary_directories(out_dir, overwrite, log)
        base_stats = {"input_files": len(files), "empty_files": create.count_empty_files(files)}
        pipeline = beam.Pipeline(options=options)
        run_id = uuid.uuid4().hex  # tells this run's metadata from an earlier run's (--overwrite, nothing made)
        build_pipeline(pipeline, config, files, out_dir, num_shards, base_stats=base_stats, earlier=earlier,
                       start=start, runner=runner, run_id=run_id, input_formats=dict(sorted(formats.items())),
                       file_formats=file_formats)
        try:
            with quiet.native_lines_dropped(verbose):
                result = pipeline.run()
                result.wait_until_finish()
        except BaseException as error:  # a failed job's spills and fragments (never read) removed; a killed one's stay
            temp_dir = _temp_dir(out_dir, run_id)
            if tf.io.gfile.exists(temp_dir):
                tf.io.gfile.rmtree(temp_dir)
            if errors.is_full_disk(error):  # the worker's error arrives wrapped in the runner's, a traceback in it
                raise errors.OutputWriteError(errors.cannot_write(f"shards to {out_dir}", error)) from None
            raise
        metadata = os.path.join(out_dir, tfrecord.shard_prefix() + tfrecord.METADATA_SUFFIX)
        summary = {}
        if tf.io.gfile.exists(metadata):
            summary = input_files.read_json(metadata, "data create's metadata (JSON)")
        if summary.get("run_id") != run_id:
            raise create.no_instances_error(config, out_dir)
    counters = result.metrics().query(MetricsFilter().with_namespace(METRICS_NAMESPACE))["counters"]
    summary["beam_metrics"] = {c.key.metric.name: c.committed for c in counters}
    log(f"wrote {summary['examples']} examples to {len(summary['shards'])} shard(s) in {out_dir} with Beam's "
        f"{runner} ({time.time() - start:.1f} s, {summary['buckets']} buckets); "
        + ", ".join(f"{k}={v}" for k, v in summary["stats"].items()))
    warning = nsp_warning(summary["stats"]) if config.next_sentence_prediction else None
    if warning:
        log(f"warning: {warning}")
    return summary
