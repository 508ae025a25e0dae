"""SWAG multiple-choice data: the CSV files of rowanz/swagaf `data/` (train.csv, val.csv; test.csv without labels).

Layout ("regular" SWAG): a header `,video-id,fold-ind,startphrase,sent1,sent2,gold-source,ending0,ending1,ending2,
ending3,label` (the first, unnamed column is the row index; test.csv has no `label`), standard CSV quoting (endings
contain commas). Columns are found by their header names, so their order does not matter. Each example becomes
four (context, ending) pairs as in transformers' run_swag example: context = sent1, ending = sent2 + " " +
ending_k, encoded [CLS] context [SEP] ending [SEP] with longest-first truncation. A row with the wrong number of
fields, a missing column or a label outside 0..3 is a ValueError naming file and line.
"""
from __future__ import annotations

import csv
import dataclasses
import io
import os

import numpy as np

from bertjax.data import file_readers
from bertjax.runtime.errors import shown

NUM_CHOICES = 4
ENDINGS = tuple(f"ending{i}" for i in range(NUM_CHOICES))
REQUIRED_COLUMNS = ("video-id", "fold-ind", "startphrase", "sent1", "sent2", "gold-source") + ENDINGS


@dataclasses.dataclass
class ChoiceExamples:
    """A split as parallel lists: ids (the unnamed index column, else the row number), contexts (sent1), the four
    endings per example (sent2 + " " + ending_k) and label ids (None for test files)."""
    ids: list[str]
    contexts: list[str]
    endings: list[list[str]]
    labels: np.ndarray | None

    def __len__(self) -> int:
        return len(self.ids)


def head(examples: ChoiceExamples, n: int) -> ChoiceExamples:
    """The first `n` examples (all of them for n = 0)."""
    if not n:
        return examples
    labels = None if examples.labels is None else examples.labels[:n]
    return ChoiceExamples(examples.ids[:n], examples.contexts[:n], examples.endings[:n], labels)


def read_swag(path: str) -> ChoiceExamples:
    """One SWAG CSV file (train.csv, val.csv or test.csv)."""
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path}: no such file (expected SWAG's train.csv / val.csv / test.csv)")
    ids, contexts, endings, labels = [], [], [], []
    reader = csv.reader(io.StringIO(file_readers.read_text(path, "a SWAG CSV file (UTF-8)"), newline=""))
    header = next(reader, None)
    if header is None:
        raise ValueError(f"{path}: empty file (expected a SWAG header line)")
    missing = [c for c in REQUIRED_COLUMNS if c not in header]
    if missing:
        raise ValueError(f"{path}:1: header lacks the SWAG column(s) {missing}; expected "
                         f"{','.join(('',) + REQUIRED_COLUMNS + ('label',))}")
    col = {name: i for i, name in enumerate(header)}
    has_labels = "label" in col
    start = reader.line_num + 1
    for row in reader:
        where = f"{path}:{start}"
        start = reader.line_num + 1
        if not row:
            continue
        if len(row) != len(header):
            raise ValueError(f"{where}: expected {len(header)} comma-separated fields as in the header, got "
                             f"{len(row)}")
        ids.append(row[0] if header[0] == "" else str(len(ids)))
        contexts.append(row[col["sent1"]])
        endings.append([f"{row[col['sent2']]} {row[col[e]]}" for e in ENDINGS])
        if has_labels:
            raw = row[col["label"]].strip()
            if raw not in {str(i) for i in range(NUM_CHOICES)}:
                raise ValueError(f"{where}: label {shown(raw)} is not one of 0..{NUM_CHOICES - 1}")
            labels.append(int(raw))
    if not ids:
        raise ValueError(f"{path}: no examples after the header")
    return ChoiceExamples(ids, contexts, endings, np.asarray(labels, np.int32) if has_labels else None)


def featurize(examples: ChoiceExamples, tokenizer, max_seq_length: int) -> dict[str, np.ndarray]:
    """input_ids / input_mask / segment_ids int32 [N, 4, max_seq_length] (+ labels [N] when known)."""
    contexts = [c for c in examples.contexts for _ in range(NUM_CHOICES)]
    endings = [e for per_example in examples.endings for e in per_example]
    enc = tokenizer.encode(contexts, max_seq_length, text_pairs=endings)
    out = {k: np.asarray(enc[k], np.int32).reshape(len(examples), NUM_CHOICES, max_seq_length)
           for k in ("input_ids", "input_mask", "segment_ids")}
    if examples.labels is not None:
        out["labels"] = examples.labels
    return out
