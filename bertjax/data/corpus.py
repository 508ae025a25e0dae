"""Corpus sources -> a tf.data stream of documents (each a 1-D string tensor of sentences).

Formats (all read through tf.io.gfile, so gs:// paths work):
  sentences   the original BERT format: one sentence per line, blank line between documents
  paragraphs  one paragraph per line; a regex sentence splitter; each paragraph is a document unless
              `doc_boundary_regex` marks document starts
  wikitext    paragraphs with WikiText's ` = Title = ` lines starting articles (section headings dropped)
  wrapped     hard-wrapped text (e.g. Project Gutenberg): paragraphs separated by a blank line, documents
              (chapters, tales) by a run of `wrapped_doc_blank_lines` blank lines
  tfds:NAME[:SPLIT]  a locally prepared TFDS dataset; each example's text field is a document

Every stage is a stateless tf.data op or a scan, so the stream can be checkpointed mid-epoch.
"""
from __future__ import annotations

from typing import Sequence

import tensorflow as tf

from bertjax.data.data_config import CorpusConfig

# A sentence ends at . ! ? (plus closing quotes/brackets) followed by whitespace and an upper-case
# letter, digit or opening quote. RE2 has no look-ahead, so the next sentence's first char is re-emitted.
_SENTENCE_END = r"([.!?][\"'”’)\]]*)\s+([\"'“‘(\[]*[\p{Lu}0-9])"
_WIKITEXT_TITLE = r"\s*=\s[^=].*[^=]\s=\s*"
_WIKITEXT_HEADING = r"\s*(=\s)+.*(\s=)+\s*"


def expand_inputs(patterns: Sequence[str]) -> list[str]:
    """Sorted files matched by globs / paths (comma-separated lists allowed); a pattern matching nothing is an error."""
    files: list[str] = []
    for pattern in patterns:
        for part in (p.strip() for p in pattern.split(",")):
            if not part:
                continue
            matched = sorted(tf.io.gfile.glob(part))
            if not matched and tf.io.gfile.exists(part):  # a name with glob characters: `corp[1].txt` itself
                matched = [part]
            matched = [m for m in matched if not tf.io.gfile.isdir(m)]
            if not matched:
                raise FileNotFoundError(f"input pattern {part!r} matches no files")
            files.extend(matched)
    if not files:
        raise FileNotFoundError("no input files given")
    return sorted(dict.fromkeys(files))


def shard_files(files: Sequence[str], process_index: int, process_count: int) -> list[str]:
    """The disjoint subset of `files` read by one process: files[process_index::process_count]."""
    if not 0 <= process_index < process_count:
        raise ValueError(f"process_index {process_index} is not in [0, {process_count})")
    if len(files) < process_count:
        raise ValueError(f"{len(files)} input file(s) cannot be split over {process_count} processes; "
                         "write more shards (bertjax data create --shards N) or use fewer hosts")
    return list(files[process_index::process_count])


_SNIFF_BYTES = 1 << 16


def check_text_files(files: Sequence[str]) -> None:
    """Refuses files that are not UTF-8 text (judged by their first 64 KiB): a binary file or an archive would
    otherwise be read as a few lines of replacement characters, and a job would train on nothing."""
    for path in files:
        with tf.io.gfile.GFile(path, "rb") as f:
            head = f.read(_SNIFF_BYTES)
        if head.startswith((b"\x1f\x8b", b"PK\x03\x04", b"BZh", b"\xfd7zXZ")):
            problem = "a compressed archive (gzip/zip/bzip2/xz): decompress it first"
        elif b"\x00" in head:
            problem = "binary (NUL bytes in its first 64 KiB)"
        else:
            # A multi-byte character cut at the end of the sample is not an error.
            text = head.decode("utf-8", errors="replace")[:-1]
            invalid = text.count("\ufffd")
            problem = (f"not UTF-8 text ({invalid} of the first {len(text)} characters are invalid)"
                       if text and invalid > 0.05 * len(text) else None)
        if problem:
            raise ValueError(f"{path}: {problem}; text corpora are read as UTF-8 lines")


def split_sentences(paragraphs: tf.Tensor) -> tf.RaggedTensor:
    """Regex sentence splitter: [N] paragraphs -> ragged [N, (sentences)], stripped, empties dropped."""
    marked = tf.strings.regex_replace(paragraphs, _SENTENCE_END, "\\1\n\\2")
    sentences = tf.strings.strip(tf.strings.split(marked, "\n"))
    return tf.ragged.boolean_mask(sentences, tf.strings.length(sentences) > 0)


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


def _file_documents(path: tf.Tensor, config: CorpusConfig) -> tf.data.Dataset:
    """Documents of one text file (documents never span files)."""
    lines = tf.data.TextLineDataset(path)
    batches = lines.batch(config.line_batch).map(lambda b: _clean_lines(b, config.max_line_chars))
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
    """Documents of one text file (`path`: a scalar string tensor, so one pipeline can serve many files)."""
    return _file_documents(path, config)


def _lines_to_document(group: dict) -> dict:
    lines = group.pop("lines")
    return {"sentences": tf.boolean_mask(lines, tf.not_equal(lines, "")), **group}


def _wrapped_lines_to_document(group: dict) -> dict:
    """Hard-wrapped lines with blank lines between paragraphs -> the document's sentences."""
    text = tf.strings.reduce_join(group.pop("lines"), separator="\n")
    text = tf.strings.regex_replace(text, "\n\n+", "\x00")  # paragraph breaks
    paragraphs = tf.strings.split(tf.strings.regex_replace(text, "\n", " "), "\x00")
    return {"sentences": split_sentences(paragraphs).flat_values, **group}


def file_order(files: Sequence[str], order_seed=None) -> tf.data.Dataset:
    """The files as a dataset, permuted by a stateless RNG if `order_seed` (int [2]) is given.

    Stateless on purpose: a seeded Dataset.shuffle inside a per-epoch function cannot be checkpointed.
    """
    names = tf.constant(list(files))
    if order_seed is not None:
        keys = tf.random.stateless_uniform([len(files)], tf.cast(order_seed, tf.int64))
        names = tf.gather(names, tf.argsort(keys))
    return tf.data.Dataset.from_tensor_slices(names)


def documents_from_files(files: Sequence[str], config: CorpusConfig, *, cycle_length: int = 4,
                         order_seed=None) -> tf.data.Dataset:
    """Documents from text files, interleaving `cycle_length` files (deterministically).

    order_seed: if given (int [2]), the file order is permuted with it first (per-epoch seed: per-epoch order).
    """
    file_ds = file_order(files, order_seed)
    return file_ds.interleave(lambda f: _file_documents(f, config), cycle_length=cycle_length, block_length=1,
                              num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)


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
    if config.tfds_text_field not in builder.info.features:
        raise ValueError(f"TFDS dataset {name!r} has no text field {config.tfds_text_field!r}; "
                         f"fields: {', '.join(builder.info.features)}")
    read_config = tfds.ReadConfig(input_context=tf.distribute.InputContext(
        num_input_pipelines=process_count, input_pipeline_id=process_index))
    ds = builder.as_dataset(split=split, shuffle_files=False, read_config=read_config)

    def to_document(example):
        text = _clean_lines(tf.strings.split(example[config.tfds_text_field], "\n"), config.max_line_chars)
        sentences = split_sentences(text["lines"]).flat_values
        return {"sentences": sentences, "invalid_utf8": tf.reduce_sum(text["invalid_utf8"]),
                "truncated": tf.reduce_sum(text["truncated"])}

    return ds.map(to_document).filter(lambda d: tf.size(d["sentences"]) > 0)
