"""The pretraining data options, each defined once: where the text is (CorpusConfig), how instances are cut
(InstanceConfig), how they are masked (MaskingConfig), and all of them plus the stream's own settings
(PretrainingDataConfig, the `data.*` keys of a pretraining job and the flags of `bertjax data create`).

No TensorFlow here, so command lines can build their flags from these fields without importing it.
"""
from __future__ import annotations

import dataclasses
import math

from bertjax.data import schema
from bertjax.options import floats, ints, option, range_problems

TEXT_FORMATS = ("sentences", "paragraphs", "wikitext", "wrapped")
# Formats whose records are documents (one JSON object per line; a Parquet row or a `datasets` Arrow row).
RECORD_FORMATS = ("jsonl", "parquet")
FORMATS = TEXT_FORMATS + RECORD_FORMATS
# The corpus format detected from the files (format_detect.resolve, before anything reads them).
AUTO_FORMAT = "auto"
# A corpus of several formats: each input entry names its own, `FORMAT:PATTERN` (format_detect.resolve sets it when
# the inputs' formats differ, so one `data create` reads Gutenberg's wrapped books and WikiText together).
MIXED_FORMAT = "mixed"


def split_format(entry: str) -> tuple[str | None, str]:
    """(the format an input entry names, its pattern): `wrapped:books/*.txt` -> ("wrapped", "books/*.txt"); an entry
    without a known format before its first colon (`gs://...`, `hf:...`) -> (None, entry)."""
    head, colon, rest = entry.partition(":")
    return (head, rest) if colon and head in FORMATS and rest else (None, entry)
MASKING_MODES = ("dynamic", "static")
MASKING_SCHEMES = ("token", "span")
# SpanBERT (Joshi et al. 2020, section 3.1): span lengths in words ~ Geometric(p=0.2) on 1..10 (renormalised, as
# SpanBERT's code does: mean 3.8 words).
SPAN_GEOMETRIC_P = 0.2
SPAN_MAX_WORDS = 10
INPUT_KINDS = ("auto", "text", "tfrecord")


@dataclasses.dataclass(frozen=True)
class CorpusConfig:
    """Where the text is and how it is laid out."""

    input: str = option("", "comma-separated globs of corpus files (.gz/.zst/.bz2 read as such) or directories, "
                        "each with an optional FORMAT: of its own (wrapped:books/*.txt); tfds:NAME[:SPLIT], "
                        "hf:NAME[:CONFIG][@SPLIT] (a hub dataset's Parquet files), or (input_kind=tfrecord) TFRecord "
                        "files/directories", repeatable=True)
    corpus_format: str = option(AUTO_FORMAT, "auto: detected from each input's files and said (Parquet/Arrow, JSON "
                                "Lines, else sentences) | sentences: one per line, blank line between documents (the "
                                "original format) | paragraphs: one per line | wikitext | wrapped (hard-wrapped, e.g. "
                                "Gutenberg) | jsonl: one JSON object per line, a document each | parquet: a row per "
                                "document (also a `datasets.save_to_disk` directory; hf: inputs); the inputs without "
                                "a FORMAT: of their own take it (mixed: each input names its own)", flags=("--format",))
    doc_boundary_regex: str | None = option(None, "paragraphs: a full-matching line starts a new document")
    skip_regex: str | None = option(None, "paragraphs: full-matching lines are dropped")
    max_line_chars: int = option(100_000, "longer lines are truncated (and counted)", valid=ints(1))
    max_document_lines: int = option(100_000, "a document with more lines is cut (bounds memory)", valid=ints(1))
    text_field: str = option("text", "jsonl, parquet, hf:, tfds: the field holding the document text",
                             flags=("--text-field",))
    tfds_data_dir: str | None = option(None, "tfds: the data directory of prepared datasets")
    line_batch: int = option(1024, "lines processed per vectorised step", valid=ints(1))
    wrapped_doc_blank_lines: int = option(3, "wrapped: this many blank lines end a document (Gutenberg: chapters)",
                                          valid=ints(1))

    def __post_init__(self):
        # A list of patterns (a JSON/YAML config, repeated flags) is kept as one comma-separated string.
        if not isinstance(self.input, str):
            object.__setattr__(self, "input", ",".join(self.input))
        if self.is_hf and self.corpus_format == AUTO_FORMAT:  # a hub dataset is its Parquet files
            object.__setattr__(self, "corpus_format", "parquet")
        if self.is_hf and self.corpus_format != "parquet":
            raise ValueError(f"hf: inputs are read as Parquet; corpus_format={self.corpus_format!r} does not apply")
        if not self.is_tfds and self.corpus_format not in (AUTO_FORMAT, MIXED_FORMAT, *FORMATS):
            raise ValueError(f"unknown corpus format {self.corpus_format!r}; expected one of {AUTO_FORMAT}, "
                             f"{', '.join(FORMATS)}")
        problems = range_problems(self)
        if problems:  # the ranges of every field of the class (PretrainingDataConfig's too), checked once here
            raise ValueError("; ".join(problems))
        named = [(fmt, pattern) for fmt, pattern in self.input_entries if fmt]
        if any(pattern.startswith(("hf:", "tfds:")) for _, pattern in named):
            raise ValueError(f"{', '.join(f'{f}:{p}' for f, p in named)}: a FORMAT: prefix is for corpus files (hf: "
                             "inputs are Parquet, tfds: ones TFDS's)")
        if self.corpus_format == MIXED_FORMAT and len(named) != len(self.input_entries):
            raise ValueError(f"corpus_format={MIXED_FORMAT} needs a FORMAT: on every input (e.g. wrapped:books/*.txt), "
                             f"got {self.input!r}")

    @property
    def input_entries(self) -> tuple[tuple[str | None, str], ...]:
        """(the format it names or None, pattern) of each comma-separated input entry."""
        return tuple(split_format(part.strip()) for part in self.input.split(",") if part.strip())

    @property
    def inputs(self) -> tuple[str, ...]:
        """The input patterns, one per comma-separated entry (a FORMAT: prefix left out)."""
        return tuple(pattern for _, pattern in self.input_entries)

    @property
    def is_mixed(self) -> bool:
        """Whether each input entry names its own format (several formats in one corpus)."""
        return self.corpus_format == MIXED_FORMAT

    @property
    def is_tfds(self) -> bool:
        return len(self.inputs) == 1 and self.inputs[0].startswith("tfds:")

    @property
    def is_hf(self) -> bool:
        return bool(self.inputs) and all(part.startswith("hf:") for part in self.inputs)

    @property
    def is_records(self) -> bool:
        """Whether each record (JSON line, Parquet/Arrow row) is a document, rather than a text layout."""
        return self.corpus_format in RECORD_FORMATS


@dataclasses.dataclass(frozen=True)
class InstanceConfig:
    """Instance-shape parameters (names and defaults as in create_pretraining_data.py)."""

    max_seq_length: int = option(128, "tokens per instance, [CLS] and [SEP]s included ([CLS] A [SEP] B [SEP]: "
                                 "at least 5)", valid=ints(5))
    short_seq_prob: float = option(0.1, "probability of a shorter target length for a document's instances",
                                   valid=floats(0, 1))
    next_sentence_prediction: bool = option(True, "A/B pairs with 50% random next (false: RoBERTa-style "
                                            "full-sentence packing, no NSP labels)", flags=("--nsp",))

    def __post_init__(self):
        problems = range_problems(self)
        if problems:
            raise ValueError("; ".join(problems))


@dataclasses.dataclass(frozen=True)
class MaskingConfig:
    """Masked-LM parameters (names and defaults as in create_pretraining_data.py)."""

    masked_lm_prob: float = option(0.15, "fraction of tokens predicted",
                                   valid=floats(0, 1, low_open=True, high_open=True))
    max_predictions_per_seq: int = option(20, "most masked positions per instance", flags=("--max-predictions",),
                                          valid=ints(1))
    whole_word_masking: bool = option(False, "mask all pieces of a word together")
    masking_scheme: str = option("token", "token: BERT's per-token (or whole-word) choice | span: SpanBERT's "
                                 "whole-word spans, geometric lengths (p=0.2, at most 10 words), 80/10/10 per span, "
                                 "with span boundaries for the SBO; single-segment instances (no NSP)")

    def validate(self, max_seq_length: int):
        """Clear errors for values that cannot work with this sequence length."""
        if self.masking_scheme not in MASKING_SCHEMES:
            raise ValueError(f"masking_scheme={self.masking_scheme!r}; expected one of {', '.join(MASKING_SCHEMES)}")
        problems = range_problems(self)
        if problems:
            raise ValueError("; ".join(problems))
        if self.max_predictions_per_seq > max_seq_length - 3:
            raise ValueError(f"max_predictions_per_seq={self.max_predictions_per_seq} exceeds the "
                             f"{max_seq_length - 3} maskable tokens of max_seq_length={max_seq_length}")

    def full_predictions(self, max_seq_length: int) -> int:
        """The predictions a full sequence's share asks for: round(n x p) of its n tokens (the original's), span
        masking's ceil(p x tokens) with [CLS] and [SEP] not counted."""
        if self.masking_scheme == "span":
            return math.ceil((max_seq_length - 2) * self.masked_lm_prob)
        return round(max_seq_length * self.masked_lm_prob)

    def masking_note(self, max_seq_length: int) -> str | None:
        """One line where max_predictions_per_seq caps a full sequence's masked share (None where it does not). The
        original create_pretraining_data.py takes min(max_predictions_per_seq, round(n x p)), and so does bertjax:
        MLPerf's phase-2 reference (seq 512, 76 predictions at 15%: round(76.8) = 77) runs as it ran there."""
        full, most = self.full_predictions(max_seq_length), self.max_predictions_per_seq
        if most >= full:
            return None
        return (f"note: max_predictions_per_seq={most} caps the masked share: a full sequence of {max_seq_length} "
                f"tokens has {most} predictions, not the {full} of masked_lm_prob={self.masked_lm_prob:g} "
                f"({most / max_seq_length:.1%} of its tokens; create_pretraining_data.py's min(max, round(n x p)))")


@dataclasses.dataclass(frozen=True)
class PretrainingDataConfig(CorpusConfig, InstanceConfig, MaskingConfig):
    """Everything that defines the pretraining example stream (defaults = the original BERT flags).

    It *is* a CorpusConfig, an InstanceConfig and a MaskingConfig (their fields are its own, flat, as in the
    original flags), so each stage takes it directly.
    """

    input_kind: str = option("auto", "auto (tfrecord if the input is TFRecord files, else text) | text (corpus "
                             "files or tfds:NAME) | tfrecord (shards of `data create`)")
    vocab: str = option("", "vocab.txt (WordPiece) or .model (SentencePiece); with tfrecord input, defaults to "
                        "the one `data create` recorded in its metadata")
    lower_case: bool | None = option(None, "lower-case and strip accents before tokenizing (default: true for "
                                     "WordPiece, false for SentencePiece)")
    masking: str = option("dynamic", "dynamic: new masks every epoch (RoBERTa) | static: dupe_factor fixed copies "
                          "(the original)")
    dupe_factor: int = option(10, "static masking: distinct (instances, masks) copies before repeating",
                               valid=ints(1))
    doc_buffer_size: int = option(1000, "documents per instance-creation block (bounds memory; random-next "
                                  "sentences come from the same block)", flags=("--doc-buffer",), valid=ints(1))
    shuffle_buffer: int = option(10_000, "instances", valid=ints(1))
    prefetch_batches: int = option(2, "batches prepared ahead of the train step (0: none)", valid=ints(0))
    seed: int = option(12345, "seeds instances, masks and shuffles", valid=ints(0))
    num_epochs: int | None = option(None, "passes over the input (None: repeat forever)", valid=ints(1))
    file_cycle_length: int = option(4, "input files read in parallel", valid=ints(1))
    eval_input: str = option("", "held-out corpus for periodic MLM/NSP accuracy (pretraining; \"\" = none)")
    packing: bool = option(False, "pack several complete instances per row (best-fit decreasing over each "
                           "block's instances; attention stays inside an instance)", flags=("--pack",))
    max_instances_per_row: int = option(4, "packing: most instances in one row (NSP slots per row)", valid=ints(1))

    def __post_init__(self):
        CorpusConfig.__post_init__(self)
        InstanceConfig.__post_init__(self)
        self.validate(self.max_seq_length)
        if self.input_kind not in INPUT_KINDS:
            raise ValueError(f"input_kind={self.input_kind!r}; expected one of {INPUT_KINDS}")
        if self.masking not in MASKING_MODES:
            raise ValueError(f"masking={self.masking!r}; expected one of {MASKING_MODES}")
        if self.masking_scheme == "span":
            # SpanBERT trains on single contiguous segments without NSP: the FULL-SENTENCES instances of
            # next_sentence_prediction=false (segment ids all 0). They fill their rows, so packing has nothing to gain.
            if self.next_sentence_prediction:
                raise ValueError("masking_scheme=span trains on single segments without NSP (SpanBERT): set "
                                 "next_sentence_prediction=false (data.next_sentence_prediction / --no-nsp)")
            if self.packing:
                raise ValueError("masking_scheme=span does not support packing (its single-segment instances "
                                 "already fill max_seq_length): set packing=false")

    def require_input(self) -> None:
        """The checks that only a run (not a preset) needs: an input, and a vocab for text input."""
        if not self.inputs:
            raise ValueError("data.input is empty: give corpus files or `data create` shards (--set data.input=GLOB)")
        if self.input_kind == "text" and not self.vocab:
            raise ValueError("data.vocab is empty: text input needs a vocab.txt, a SentencePiece .model or an HF "
                             "tokenizer.json")

    @property
    def instances_per_row(self) -> int | None:
        """NSP slots per row when packing, None for the original one-instance rows."""
        return self.max_instances_per_row if self.packing else None

    def feature_shapes(self) -> dict[str, tuple[int]]:
        """Per-example shape of every feature of this stream's batches (or TFRecords)."""
        return schema.feature_shapes(self.max_seq_length, self.max_predictions_per_seq, self.instances_per_row,
                                     span=self.masking_scheme == "span")

    def replace(self, **changes) -> "PretrainingDataConfig":
        return dataclasses.replace(self, **changes)
