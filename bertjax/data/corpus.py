"""Corpus sources -> a tf.data stream of documents (each a 1-D string tensor of sentences).

Formats (all read through tf.io.gfile, so gs:// paths work; files compressed with gzip, zstd or bzip2 are read
as such, recognised by their magic bytes and checked against their extension):
  sentences   the original BERT format: one sentence per line, blank line between documents
  paragraphs  one paragraph per line; a regex sentence splitter; each paragraph is a document unless
              `doc_boundary_regex` marks document starts
  wikitext    paragraphs with WikiText's ` = Title = ` lines starting articles (section headings dropped)
  wrapped     hard-wrapped text (e.g. Project Gutenberg): paragraphs separated by a blank line, documents
              (chapters, tales) by a run of `wrapped_doc_blank_lines` blank lines
  jsonl       JSON Lines: each object is a document, its `text_field` the text
  parquet     Parquet files (read by row group), a `datasets.save_to_disk` directory (its Arrow files), or
              hf:NAME[:CONFIG][@SPLIT], a hub dataset's Parquet files in the Hugging Face cache: each row is a
              document, its `text_field` the text
  tfds:NAME[:SPLIT]  a locally prepared TFDS dataset; each example's text field is a document

A corpus may mix formats (corpus_format `mixed`: each input entry names its own, `wrapped:books/*.txt`): each file
is then read in its own format (`file_formats`), by the same readers.

A record's text becomes a document as a paragraph of the `paragraphs` layout does (`texts_to_documents`: split
at "\n", each line cleaned by `_clean_lines` and split by `split_sentences`): one implementation for JSON Lines,
Parquet, Arrow and TFDS.

Every stage is a stateless tf.data op, a scan, or a numpy_function declared stateless because its output is a
pure function of its inputs (a read unit: a Parquet row group, or chunk k of a file's lines or records), so the
stream can be checkpointed mid-epoch. `Dataset.from_generator` is not checkpointable and is not used for
pretraining. The units themselves, the compression and the input check are read in Python by file_readers.py.
"""
from __future__ import annotations

import dataclasses
import logging
import os
from typing import Mapping, Sequence

import tensorflow as tf

from bertjax.data import file_readers
from bertjax.data.data_config import CorpusConfig
from bertjax.runtime.extras import install_line
from bertjax.runtime.errors import at_file
from bertjax.runtime.input_files import read_json

# A sentence ends at . ! ? (plus closing quotes/brackets) followed by whitespace and an upper-case
# letter, digit or opening quote. RE2 has no look-ahead, so the next sentence's first char is re-emitted.
_SENTENCE_END = r"([.!?][\"'”’)\]]*)\s+([\"'“‘(\[]*[\p{Lu}0-9])"
_WIKITEXT_TITLE = r"\s*=\s[^=].*[^=]\s=\s*"
_WIKITEXT_HEADING = r"\s*(=\s)+.*(\s=)+\s*"


def expand_inputs(patterns: Sequence[str]) -> list[str]:
    """Sorted files matched by globs / paths (comma-separated lists allowed); a pattern matching nothing is an error.
    A directory gives its data files (`_directory_files`), hf:NAME[:CONFIG][@SPLIT] its Parquet files in the
    Hugging Face cache (`hf_dataset_files`)."""
    files: list[str] = []
    for pattern in patterns:
        for part in (p.strip() for p in pattern.split(",")):
            if not part:
                continue
            if part.startswith("hf:"):
                files.extend(hf_dataset_files(part))
                continue
            with at_file(part):
                files.extend(_matched_files(part))
    if not files:
        raise FileNotFoundError("no input files given")
    return sorted(dict.fromkeys(files))


def _matched_files(part: str) -> list[str]:
    """The files one input names: a directory's data files, or a glob's (or the path's itself) matches."""
    if tf.io.gfile.isdir(part):
        return _directory_files(part)
    matched = sorted(tf.io.gfile.glob(part))
    if not matched and tf.io.gfile.exists(part):  # a name with glob characters: `corp[1].txt` itself
        matched = [part]
    matched = [m for m in matched if not tf.io.gfile.isdir(m)]
    if not matched:
        raise FileNotFoundError(f"input pattern {part!r} matches no files")
    return matched


def file_formats(config: CorpusConfig) -> dict[str, str]:
    """Every corpus file of `config` (sorted, as expand_inputs gives them) -> the format it is read in: its input
    entry's own for a mixed corpus, else the config's. A file that two inputs of other formats name is an error."""
    if not config.is_mixed:
        return {path: config.corpus_format for path in expand_inputs(config.inputs)}
    formats: dict[str, str] = {}
    for fmt, pattern in config.input_entries:
        for path in expand_inputs([pattern]):
            if formats.setdefault(path, fmt) != fmt:
                raise ValueError(f"{path} is named by two inputs of other formats ({formats[path]}, {fmt}): name it "
                                 "once")
    return dict(sorted(formats.items()))


# What a `datasets.save_to_disk` directory holds beside its data (Arrow IPC stream files).
_HF_DISK_STATE = "state.json"


def _directory_files(directory: str) -> list[str]:
    """A directory's data files: those a `datasets.save_to_disk` state.json lists, else every file under it
    (recursively; names starting with "." or "_" and the datasets metadata files are not data)."""
    state = os.path.join(directory, _HF_DISK_STATE)
    if tf.io.gfile.exists(state):
        return [os.path.join(directory, entry["filename"])
                for entry in read_json(state, "a saved dataset's state.json")["_data_files"]]
    found = []
    for root, _, names in tf.io.gfile.walk(directory):
        found += [os.path.join(root, n) for n in names
                  if not n.startswith((".", "_")) and n not in ("dataset_info.json", "dataset_dict.json")]
    if not found:
        raise FileNotFoundError(f"input directory {directory!r} holds no files")
    return sorted(found)


def hf_dataset_files(spec: str) -> list[str]:
    """hf:NAME[:CONFIG][@SPLIT] -> the local paths of the dataset's Parquet files (CONFIG default "default", SPLIT
    "train"): the hub's `refs/convert/parquet` revision holds CONFIG/SPLIT/*.parquet for every dataset; they are
    fetched into huggingface_hub's cache (HF_HUB_CACHE) where a network is available, read from it offline."""
    try:
        import huggingface_hub
        from huggingface_hub import errors
    except ImportError:
        raise ImportError(f"{spec}: hf: inputs need huggingface_hub (the `hub` extra): {install_line('hub')}") \
            from None

    name, _, split = spec[len("hf:"):].partition("@")
    name, _, config = name.partition(":")
    config, split = config or "default", split or "train"
    try:
        folder = huggingface_hub.snapshot_download(
            name, repo_type="dataset", revision="refs/convert/parquet",
            allow_patterns=[f"{config}/{split}/*.parquet", f"{config}/partial-{split}/*.parquet"])
    except errors.LocalEntryNotFoundError:
        raise FileNotFoundError(
            f"{spec}: the dataset's Parquet files are not in the hub cache ({huggingface_hub.constants.HF_HUB_CACHE})"
            f" and the hub cannot be reached: on a machine with a network run `hf download {name} --repo-type "
            f"dataset --revision refs/convert/parquet --include '{config}/{split}/*.parquet'` (or set HF_HUB_CACHE "
            f"to a cache that holds them)") from None
    except (errors.RepositoryNotFoundError, errors.RevisionNotFoundError, errors.GatedRepoError) as error:
        raise FileNotFoundError(f"{spec}: the Hugging Face hub has no dataset {name} with Parquet files that this "
                                f"machine can read ({type(error).__name__})") from None
    files = sorted(tf.io.gfile.glob(os.path.join(folder, config, split, "*.parquet")))
    if not files:  # the hub converts only the first 5 GB of a larger split, under partial-SPLIT
        files = sorted(tf.io.gfile.glob(os.path.join(folder, config, f"partial-{split}", "*.parquet")))
        if files:
            logging.getLogger(__name__).warning(
                "%s: the hub's Parquet conversion holds only part of split %r (partial-%s, its first 5 GB); for the "
                "whole split, download the dataset's own files and give their directory", spec, split, split)
    if not files:
        raise FileNotFoundError(f"{spec}: no Parquet files for config {config!r}, split {split!r} in {folder}")
    return files


def shard_files(files: Sequence[str], process_index: int, process_count: int) -> list[str]:
    """The disjoint subset of `files` read by one process: files[process_index::process_count]."""
    if not 0 <= process_index < process_count:
        raise ValueError(f"process_index {process_index} is not in [0, {process_count})")
    if len(files) < process_count:
        raise ValueError(f"{len(files)} input file(s) cannot be split over {process_count} processes; "
                         "write more shards (bertjax data create --shards N) or use fewer hosts")
    return list(files[process_index::process_count])


def split_sentences(paragraphs: tf.Tensor) -> tf.RaggedTensor:
    """Regex sentence splitter: [N] paragraphs -> ragged [N, (sentences)], stripped, empties dropped."""
    marked = tf.strings.regex_replace(paragraphs, _SENTENCE_END, "\\1\n\\2")
    sentences = tf.strings.strip(tf.strings.split(marked, "\n"))
    return tf.ragged.boolean_mask(sentences, tf.strings.length(sentences) > 0)


def texts_to_documents(texts: tf.Tensor, max_line_chars: int) -> dict[str, tf.Tensor]:
    """[R] texts -> R documents {sentences: ragged [R, (sentences)], invalid_utf8 [R], truncated [R]}.

    The one reading of a record's text (JSON Lines, Parquet, Arrow, TFDS): split at "\n" into lines, each line
    cleaned (`_clean_lines`: invalid UTF-8 replaced, cut at max_line_chars, both counted per line) and split into
    sentences (`split_sentences`), as the `paragraphs` layout reads each of its lines.
    """
    lines = tf.strings.split(texts, "\n")
    clean = _clean_lines(lines.flat_values, max_line_chars)
    sentences = split_sentences(clean["lines"])
    per_text = tf.RaggedTensor.from_row_splits(sentences.flat_values,
                                               tf.gather(sentences.row_splits, lines.row_splits))

    def per_record(counter):
        return tf.reduce_sum(tf.RaggedTensor.from_row_splits(counter, lines.row_splits), axis=1)

    return {"sentences": per_text, "invalid_utf8": per_record(clean["invalid_utf8"]),
            "truncated": per_record(clean["truncated"])}


def _without_nul(lines: tf.Tensor, path: tf.Tensor) -> tf.Tensor:
    """`lines` of the text file `path`, checked: a NUL byte anywhere is refused as it is in the first 64 KiB
    (file_readers.check_input_files), by a CorpusError naming the file and line (file_readers.refuse_nul)."""
    # Split at NUL, not a regex: RE2 reads UTF-8, and invalid bytes (counted, not refused) would match no class.
    held = tf.size(tf.strings.split(tf.strings.reduce_join(lines), "\x00")) > 1
    checked = tf.cond(held, lambda: tf.numpy_function(file_readers.refuse_nul, [path], tf.bool, stateful=False),
                      lambda: tf.constant(True))
    with tf.control_dependencies([checked]):
        return tf.identity(lines)


def _clean_lines(lines: tf.Tensor, max_chars: int) -> dict[str, tf.Tensor]:
    """Invalid UTF-8 -> U+FFFD and over-long lines cut, each counted per line."""
    valid = tf.strings.unicode_transcode(lines, "UTF-8", "UTF-8", errors="replace", replacement_char=0xFFFD)
    too_long = tf.strings.length(valid, unit="UTF8_CHAR") > max_chars
    cut = tf.where(too_long, tf.strings.substr(valid, 0, max_chars, unit="UTF8_CHAR"), valid)
    return {"lines": tf.strings.strip(cut),
            "invalid_utf8": tf.cast(tf.not_equal(valid, lines), tf.int32),
            "truncated": tf.cast(too_long, tf.int32)}


def _paragraphs_to_sentence_lines(batch: dict, config: CorpusConfig) -> dict[str, tf.Tensor]:
    """A batch of paragraph lines -> the equivalent sentence-per-line stream ("" = document boundary)."""
    lines = batch["lines"]
    boundary_re, skip_re = config.doc_boundary_regex, config.skip_regex
    if config.corpus_format == "wikitext":
        boundary_re, skip_re = boundary_re or _WIKITEXT_TITLE, skip_re or _WIKITEXT_HEADING
    is_boundary = tf.strings.regex_full_match(lines, boundary_re) if boundary_re else tf.zeros_like(lines, tf.bool)
    is_skip = tf.strings.regex_full_match(lines, skip_re) if skip_re else tf.zeros_like(lines, tf.bool)
    is_text = ~is_boundary & ~is_skip & (tf.strings.length(lines) > 0)
    sentences = split_sentences(tf.where(is_text, lines, ""))
    # Each paragraph is its own document unless documents are delimited by boundary lines.
    ends_doc = is_boundary if boundary_re else is_text
    marker = tf.RaggedTensor.from_row_lengths(
        tf.fill([tf.reduce_sum(tf.cast(ends_doc, tf.int64))], ""), tf.cast(ends_doc, tf.int64))
    if boundary_re:  # the boundary line opens the next document: close the current one first
        rows = tf.concat([marker, sentences], axis=1)
    else:
        rows = tf.concat([sentences, marker], axis=1)

    def per_sentence(counter):
        # A line's count goes to its first sentence only (it is a count of lines, not of sentences).
        row = rows.value_rowids()
        first = tf.equal(tf.range(tf.size(row), dtype=row.dtype), tf.gather(rows.row_starts(), row))
        return tf.gather(counter, row) * tf.cast(first, counter.dtype)

    return {"lines": rows.flat_values, "invalid_utf8": per_sentence(batch["invalid_utf8"]),
            "truncated": per_sentence(batch["truncated"])}


def _group_step(state: dict, batch: dict, min_blank_run: int, max_lines: int):
    """scan step: append a batch of lines to the pending ones and emit every document that a run of
    `min_blank_run` blank lines closed. Shorter blank runs stay inside the document as "" lines.
    Pending lines never exceed ~max_lines: a longer document is cut there (memory stays bounded)."""
    lines = tf.concat([state["lines"], batch["lines"]], 0)
    invalid = tf.concat([state["invalid_utf8"], batch["invalid_utf8"]], 0)
    truncated = tf.concat([state["truncated"], batch["truncated"]], 0)
    blank = tf.equal(lines, "")
    index = tf.range(tf.size(lines))
    text_index = tf.cast(tf.where(~blank)[:, 0], tf.int32)
    last_text = tf.gather(tf.concat([[-1], text_index], 0), tf.searchsorted(text_index, index, side="right"))
    boundary = blank & tf.equal(index - last_text, min_blank_run)  # the n-th blank line of a run
    done = tf.reduce_max(tf.concat([[-1], tf.cast(tf.where(boundary)[:, 0], tf.int32)], 0)) + 1
    # No boundary and too many pending lines: close a document after the last line.
    cut = tf.equal(done, 0) & (tf.size(lines) > max_lines)
    done = tf.where(cut, tf.size(lines), done)
    closes = boundary[:done] | (cut & tf.equal(index[:done], done - 1))
    doc_of_line = tf.cumsum(tf.cast(closes, tf.int32), exclusive=True)
    num_docs = tf.reduce_sum(tf.cast(closes, tf.int32))
    keep = ~boundary[:done]
    doc_ids = tf.boolean_mask(doc_of_line, keep)
    docs = tf.RaggedTensor.from_value_rowids(tf.boolean_mask(lines[:done], keep), doc_ids, nrows=num_docs)
    has_text = tf.reduce_any(tf.not_equal(docs, ""), axis=1)  # blank-only groups are no documents

    def per_doc(counter):
        return tf.boolean_mask(tf.math.unsorted_segment_sum(tf.boolean_mask(counter[:done], keep), doc_ids,
                                                            num_docs), has_text)

    out = {"lines": tf.ragged.boolean_mask(docs, has_text), "invalid_utf8": per_doc(invalid),
           "truncated": per_doc(truncated)}
    new_state = {"lines": lines[done:], "invalid_utf8": invalid[done:], "truncated": truncated[done:]}
    return new_state, out


def _group_by_blank_lines(line_batches: tf.data.Dataset, min_blank_run: int = 1,
                          max_lines: int = 100_000) -> tf.data.Dataset:
    """Batches of cleaned lines -> groups of lines {lines, invalid_utf8, truncated} separated by runs of
    at least `min_blank_run` blank lines (the caller ends the stream with such a run)."""
    initial = {"lines": tf.zeros([0], tf.string), "invalid_utf8": tf.zeros([0], tf.int32),
               "truncated": tf.zeros([0], tf.int32)}
    return line_batches.scan(initial, lambda st, b: _group_step(st, b, min_blank_run, max_lines)).unbatch()


def _file_lines(path: tf.Tensor, config: CorpusConfig) -> tf.data.Dataset:
    """A text file's lines: plain text through TextLineDataset (native, checkpointable), compressed text (gzip, zstd,
    bzip2) in chunks of `line_batch` lines from a cached sequential reader (`file_readers.line_chunk`), which
    refuses a stream cut before its end marker (TextLineDataset's GZIP reader takes it for the end of the file).
    One structure for every file: the branch that does not apply reads nothing."""
    compression = tf.numpy_function(file_readers.compression_name, [path], tf.string, stateful=False)
    native = tf.reshape(tf.equal(compression, ""), [])
    text = tf.data.TextLineDataset(tf.boolean_mask(tf.reshape(path, [1]), tf.reshape(native, [1])))
    chunks = tf.data.Dataset.range(tf.where(native, tf.constant(0, tf.int64), _ENDLESS)).map(
        lambda k: tf.ensure_shape(tf.numpy_function(file_readers.line_chunk, [path, k, config.line_batch],
                                                    tf.string, stateful=False), [None]))
    return text.concatenate(chunks.take_while(lambda lines: tf.size(lines) > 0).unbatch())


def _file_documents(path: tf.Tensor, config: CorpusConfig, index=0, share=(0, 1)) -> tf.data.Dataset:
    """Documents of one file (documents never span files). `index`: the file's place in the sorted input;
    `share` (process index, process count): record formats read only this process's units of the file."""
    file_readers.require_format(config)
    if config.is_records:
        return _record_documents(path, config, index, share)
    lines = _file_lines(path, config)
    batches = lines.batch(config.line_batch).map(lambda b: _clean_lines(_without_nul(b, path), config.max_line_chars))
    if config.corpus_format in ("paragraphs", "wikitext"):
        batches = batches.map(lambda b: _paragraphs_to_sentence_lines(b, config))
    blank_run = config.wrapped_doc_blank_lines if config.corpus_format == "wrapped" else 1
    # Blank lines at the end close the file's last document.
    batches = batches.concatenate(tf.data.Dataset.from_tensors(
        {"lines": tf.fill([blank_run], ""), "invalid_utf8": tf.zeros([blank_run], tf.int32),
         "truncated": tf.zeros([blank_run], tf.int32)}))
    groups = _group_by_blank_lines(batches, blank_run, config.max_document_lines)
    to_document = _wrapped_lines_to_document if config.corpus_format == "wrapped" else _lines_to_document
    return groups.map(to_document)


def file_documents(path: tf.Tensor, config: CorpusConfig) -> tf.data.Dataset:
    """Documents of one file of any format (`path`: a scalar string tensor, so one pipeline can serve many files)."""
    return _file_documents(path, config)


def _mixed_file_documents(path: tf.Tensor, index, config: CorpusConfig, kinds: Sequence[str], kind_of_file,
                          share) -> tf.data.Dataset:
    """Documents of file `index` of a mixed corpus: a branch per format of the corpus, each taking the file only
    when it is of its format (`kind_of_file[index]` indexes `kinds`), so that one pipeline serves every file; the
    others read nothing."""
    kind = tf.gather(kind_of_file, index)
    branches = None
    for i, fmt in enumerate(kinds):
        own = dataclasses.replace(config, corpus_format=fmt)
        # Records' sentences come as a ragged spec of rank 0, the layouts' as a tensor: one spec for all.
        branch = tf.data.Dataset.from_tensors(path).filter(lambda _, i=i: tf.equal(kind, i)).flat_map(
            lambda p, own=own: _file_documents(p, own, index, share)).map(
            lambda d: {**d, "sentences": tf.reshape(d["sentences"], [-1])})
        branches = branch if branches is None else branches.concatenate(branch)
    return branches


# Units of a file read until one is empty (their number is found by reading).
_ENDLESS = tf.int64.max


def _record_documents(path: tf.Tensor, config: CorpusConfig, index, share) -> tf.data.Dataset:
    """A JSON Lines / Parquet / Arrow file's documents: unit k (chunk k of `line_batch` records, or row group k)
    read by a stateless numpy_function while units exist; unit k of file `index` belongs to process
    (index + k) % count, the others are skipped without parsing."""
    process, count = share

    def read(k):
        mine = tf.equal((tf.cast(index, tf.int64) + k) % count, process)
        texts, more = tf.numpy_function(file_readers.record_unit, [path, k, mine, config.corpus_format,
                                                                   config.text_field, config.line_batch],
                                        [tf.string, tf.bool], stateful=False)
        return tf.ensure_shape(texts, [None]), tf.ensure_shape(more, [])

    units = tf.data.Dataset.range(_ENDLESS).map(read).take_while(lambda texts, more: more)
    docs = units.map(lambda texts, more: texts_to_documents(texts, config.max_line_chars)).unbatch()
    return docs.filter(lambda d: tf.size(d["sentences"]) > 0)


def _lines_to_document(group: dict) -> dict:
    lines = group.pop("lines")
    return {"sentences": tf.boolean_mask(lines, tf.not_equal(lines, "")), **group}


def _wrapped_lines_to_document(group: dict) -> dict:
    """Hard-wrapped lines with blank lines between paragraphs -> the document's sentences."""
    text = tf.strings.reduce_join(group.pop("lines"), separator="\n")
    text = tf.strings.regex_replace(text, "\n\n+", "\x00")  # paragraph breaks
    paragraphs = tf.strings.split(tf.strings.regex_replace(text, "\n", " "), "\x00")
    return {"sentences": split_sentences(paragraphs).flat_values, **group}


def _file_entries(files: Sequence[str], order_seed=None) -> tf.data.Dataset:
    """(file, its index in `files`) as a dataset, permuted by a stateless RNG if `order_seed` (int [2]) is given.

    Stateless on purpose: a seeded Dataset.shuffle inside a per-epoch function cannot be checkpointed.
    """
    names, indices = tf.constant(list(files)), tf.range(len(files), dtype=tf.int64)
    if order_seed is not None:
        order = tf.argsort(tf.random.stateless_uniform([len(files)], tf.cast(order_seed, tf.int64)))
        names, indices = tf.gather(names, order), tf.gather(indices, order)
    return tf.data.Dataset.from_tensor_slices((names, indices))


def file_order(files: Sequence[str], order_seed=None) -> tf.data.Dataset:
    """The files as a dataset, permuted by a stateless RNG if `order_seed` (int [2]) is given."""
    return _file_entries(files, order_seed).map(lambda name, index: name)


def documents_from_files(files: Sequence[str], config: CorpusConfig, *, cycle_length: int = 4,
                         order_seed=None, share: tuple[int, int] = (0, 1),
                         formats: Mapping[str, str] | None = None) -> tf.data.Dataset:
    """Documents from corpus files, interleaving `cycle_length` files (deterministically).

    order_seed: if given (int [2]), the file order is permuted with it first (per-epoch seed: per-epoch order).
    share: (process index, process count) when every process reads every file of a record format and keeps its
    own units of each (`files_for_process`).
    formats: each file's format (`file_formats`), for a mixed corpus; default: every file in the config's.
    """
    if config.is_mixed:
        if formats is None:
            formats = file_formats(config)
        kinds = sorted({formats[f] for f in files})
        kind_of_file = tf.constant([kinds.index(formats[f]) for f in files], tf.int64)
        documents = lambda f, i: _mixed_file_documents(f, i, config, kinds, kind_of_file, share)  # noqa: E731
    else:
        documents = lambda f, i: _file_documents(f, config, i, share)  # noqa: E731
    return _file_entries(files, order_seed).interleave(
        documents, cycle_length=cycle_length, block_length=1, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)


def files_for_process(files: Sequence[str], config: CorpusConfig, process_index: int,
                      process_count: int) -> tuple[list[str], tuple[int, int]]:
    """The files one process reads and its share of their units: its own files (`shard_files`), or, for record
    formats in fewer files than processes, every file with share (process_index, process_count): unit k (row group
    or record chunk) of file i belongs to process (i + k) % process_count (the analogue of TFRecords split by
    record). Disjoint, covering and deterministic."""
    if config.is_records and len(files) < process_count:
        return list(files), (process_index, process_count)
    return shard_files(files, process_index, process_count), (0, 1)


def tfds_documents(config: CorpusConfig, process_index: int = 0, process_count: int = 1) -> tf.data.Dataset:
    """Documents from a locally prepared TFDS dataset `tfds:NAME[:SPLIT]` (never downloads)."""
    import tensorflow_datasets as tfds

    spec = config.inputs[0][len("tfds:"):]
    name, _, split = spec.partition(":")
    split = split or "train"
    try:
        builder = tfds.builder(name, data_dir=config.tfds_data_dir, try_gcs=False)
    except Exception as error:  # tfds raises several registry/not-found types
        raise FileNotFoundError(f"TFDS dataset {name!r} is unknown or unavailable: {error}") from error
    if not builder.is_prepared():
        raise FileNotFoundError(
            f"TFDS dataset {name!r} is not prepared under {builder.data_dir}; this job never downloads: run "
            f"tfds.builder({name!r}).download_and_prepare() where the network is available, or pass --tfds-data-dir")
    if config.text_field not in builder.info.features:
        raise ValueError(f"TFDS dataset {name!r} has no text field {config.text_field!r}; "
                         f"fields: {', '.join(builder.info.features)}")
    read_config = tfds.ReadConfig(input_context=tf.distribute.InputContext(
        num_input_pipelines=process_count, input_pipeline_id=process_index))
    ds = builder.as_dataset(split=split, shuffle_files=False, read_config=read_config)

    texts = ds.map(lambda example: example[config.text_field]).batch(256)
    docs = texts.map(lambda batch: texts_to_documents(batch, config.max_line_chars)).unbatch()
    return docs.filter(lambda d: tf.size(d["sentences"]) > 0)
