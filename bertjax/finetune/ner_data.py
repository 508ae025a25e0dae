"""CoNLL-2003 NER data: the column-format reader, IOB1 -> IOB2, and sentence -> window featurization.

Each word is WordPiece-tokenized on its own; its label sits on its first sub-token, the other sub-tokens carry
IGNORE (no loss, not decoded). A sentence longer than one window is split into windows `doc_stride` sub-tokens
apart (SQuAD's windowing, `squad_data.doc_spans`), and each word is scored only in the window where its first
sub-token has the most context (`squad_data.max_context_mask`), so every word is labelled and predicted once.
"""
from __future__ import annotations

import dataclasses
import os

import numpy as np

from bertjax.data import file_readers
from bertjax.runtime.errors import shown
from bertjax.finetune.ner_metrics import OUTSIDE, split_tag
from bertjax.finetune.squad_data import doc_spans, max_context_mask
from bertjax.runtime.outputs import open_whole

DOCSTART = "-DOCSTART-"
SPLIT_FILES = {"train": "train.txt", "valid": "valid.txt", "test": "test.txt"}
IGNORE = -1  # label of sub-tokens that are not a word's first, of [CLS]/[SEP]/padding, and of words scored elsewhere


@dataclasses.dataclass
class Sentences:
    words: list[list[str]]
    tags: list[list[str]]
    source: str = "<memory>"
    lines: list[list[int]] | None = None  # each word's line in `source`, where read from a file

    def __len__(self) -> int:
        return len(self.words)

    def head(self, n: int) -> "Sentences":
        return Sentences(self.words[:n], self.tags[:n], self.source, self.lines and self.lines[:n]) if n else self


def read_conll(path: str) -> Sentences:
    """Sentences of a CoNLL column file: one token per line, first column the word, last column the tag, a blank
    line between sentences; `-DOCSTART-` lines (document boundaries) are dropped."""
    words, tags, lines, cur_words, cur_tags, cur_lines = [], [], [], [], [], []

    def flush():
        if cur_words:
            words.append(list(cur_words))
            tags.append(list(cur_tags))
            lines.append(list(cur_lines))
            cur_words.clear()
            cur_tags.clear()
            cur_lines.clear()

    text = file_readers.read_text(path, "a CoNLL column file (UTF-8)")
    for number, line in enumerate(text.split("\n"), 1):
        fields = line.split()
        if not fields:
            flush()
            continue
        if fields[0] == DOCSTART:
            flush()
            continue
        if len(fields) < 2:
            raise ValueError(f"{path}:{number}: expected 'word ... tag' (at least 2 space-separated columns), "
                             f"got {shown(line.rstrip())}")
        split_tag(fields[-1], f"{path}:{number}")
        cur_words.append(fields[0])
        cur_tags.append(fields[-1])
        cur_lines.append(number)
    flush()
    return Sentences(words, tags, path, lines)


def read_conll_dir(data: str) -> dict[str, Sentences]:
    """train / valid (required) and test (if present) from a CoNLL-2003 directory."""
    out = {}
    for split, name in SPLIT_FILES.items():
        path = os.path.join(data, name)
        if not os.path.exists(path):
            if split == "test":
                continue
            raise FileNotFoundError(f"{path} not found (a CoNLL-2003 directory holds train.txt, valid.txt and "
                                    "optionally test.txt)")
        out[split] = read_conll(path)
        if not len(out[split]):
            raise ValueError(f"{path}: no sentences")
    for split in ("valid", "test"):
        if split in out:
            check_types_trained(out[split], out["train"])
    return out


def check_types_trained(sentences: Sentences, train: Sentences) -> None:
    """An entity type of a dev or test file that the training file never has is refused, naming the tag and its
    line: the model could never predict it (a misspelt type, or another tag set), and its score would hide that."""
    trained = {split_tag(tag)[1] for sentence in train.tags for tag in sentence}
    for i, sentence in enumerate(sentences.tags):
        for j, tag in enumerate(sentence):
            kind = split_tag(tag)[1]
            if kind not in trained:
                line = f":{sentences.lines[i][j]}" if sentences.lines else ""
                raise ValueError(f"{sentences.source}{line}: tag {tag!r}: the entity type {kind!r} is not in "
                                 f"{train.source} (its types: {', '.join(sorted(trained - {''})) or 'none'}); the "
                                 "model could never predict it")


def iob1_to_iob2(tags: list[str]) -> list[str]:
    """IOB1 (I- opens a chunk unless it follows the same type) as IOB2 (every chunk opens with B-); IOB2 input
    comes back unchanged."""
    out, prev_type = [], ""
    for tag in tags:
        prefix, kind = split_tag(tag)
        if prefix == "I" and prev_type != kind:
            tag = "B-" + kind
        out.append(tag)
        prev_type = kind
    return out


def label_list(sentences: Sentences) -> list[str]:
    """O, then B-/I- of every entity type in the (IOB2) training tags, types sorted."""
    types = sorted({split_tag(t)[1] for sent in sentences.tags for t in sent} - {""})
    return [OUTSIDE] + [f"{p}-{t}" for t in types for p in ("B", "I")]


@dataclasses.dataclass
class Features:
    arrays: dict[str, np.ndarray]   # input_ids, input_mask, segment_ids, label_ids [windows, max_seq_length]
    sentence: np.ndarray            # [windows] sentence index of each window
    word: np.ndarray                # [windows, max_seq_length] word index scored at this position, else -1

    def __len__(self) -> int:
        return len(self.sentence)


def word_pieces(sentences: Sentences, tokenizer) -> list[list[list[int]]]:
    """WordPiece ids of every word (one batched tokenizer call); a word that tokenizes to nothing (only
    characters the tokenizer drops) becomes [UNK], so that every word has a first sub-token to label."""
    flat = [w for sent in sentences.words for w in sent]
    after_space = [i > 0 for sent in sentences.words for i in range(len(sent))]
    ids = tokenizer.word_lists(flat, after_space) if flat else []
    out, k = [], 0
    for sent in sentences.words:
        out.append([[int(t) for t in ids[k + i]] or [tokenizer.unk_id] for i in range(len(sent))])
        k += len(sent)
    return out


def featurize(sentences: Sentences, tokenizer, labels: list[str] | None, max_seq_length: int,
              doc_stride: int) -> Features:
    """Windows of [CLS] sub-tokens [SEP]; label_ids (IOB2 tag ids) at scored first sub-tokens when `labels` is
    given (training), else IGNORE everywhere."""
    label_id = {l: i for i, l in enumerate(labels)} if labels is not None else None
    max_tokens = max_seq_length - 2
    rows = []  # (sentence index, piece ids, label ids, word ids)
    for s, (pieces, tags) in enumerate(zip(word_pieces(sentences, tokenizer), sentences.tags)):
        if label_id is not None:
            tags = iob1_to_iob2(tags)
            unknown = sorted(set(tags) - set(label_id))
            if unknown:
                raise ValueError(f"{sentences.source}: sentence {s} has tags {unknown} that are not among the "
                                 f"labels {labels}")
        ids = [t for word in pieces for t in word]
        first = np.full(len(ids), -1)  # word index at each word's first sub-token
        starts = np.cumsum([0] + [len(w) for w in pieces[:-1]])
        first[starts] = np.arange(len(pieces))
        spans = doc_spans(len(ids), max_tokens, doc_stride)
        for (start, length), scored in zip(spans, max_context_mask(spans, len(ids))):
            words = np.where(scored, first[start:start + length], -1)
            label_ids = [label_id[tags[w]] if (w >= 0 and label_id is not None) else IGNORE for w in words]
            rows.append((s, ids[start:start + length], label_ids, words))

    n = len(rows)
    input_ids = np.full((n, max_seq_length), tokenizer.pad_id, np.int32)
    input_mask = np.zeros((n, max_seq_length), np.int32)
    label_ids = np.full((n, max_seq_length), IGNORE, np.int32)
    word = np.full((n, max_seq_length), -1, np.int64)
    for r, (_, ids, labs, words) in enumerate(rows):
        length = len(ids)
        input_ids[r, 0], input_ids[r, 1:1 + length], input_ids[r, 1 + length] = tokenizer.cls_id, ids, tokenizer.sep_id
        input_mask[r, :length + 2] = 1
        label_ids[r, 1:1 + length] = labs
        word[r, 1:1 + length] = words
    arrays = {"input_ids": input_ids, "input_mask": input_mask, "segment_ids": np.zeros_like(input_ids),
              "label_ids": label_ids}
    return Features(arrays, np.array([r[0] for r in rows], np.int64), word)


def decode(features: Features, logits: np.ndarray, sentences: Sentences, labels: list[str]) -> list[list[str]]:
    """Predicted tag of every word: the argmax at its first sub-token in the window that scores it."""
    best = np.argmax(logits, axis=-1)
    predicted: list[list[str | None]] = [[None] * len(sent) for sent in sentences.words]
    rows, cols = np.nonzero(features.word >= 0)
    for r, c in zip(rows, cols):
        predicted[features.sentence[r]][features.word[r, c]] = labels[best[r, c]]
    missing = [(s, w) for s, sent in enumerate(predicted) for w, tag in enumerate(sent) if tag is None]
    if missing:  # cannot happen with doc_spans/max_context_mask; guards the invariant the metrics rely on
        raise AssertionError(f"{len(missing)} words were never scored, first: sentence {missing[0][0]} word "
                             f"{missing[0][1]}")
    return predicted  # type: ignore[return-value]


def write_predictions(path: str, sentences: Sentences, predicted: list[list[str]]) -> None:
    """CoNLL format, `word gold predicted` per line, a blank line after each sentence (conlleval reads it)."""
    with open_whole(path, "w", encoding="utf-8") as f:
        for words, gold, pred in zip(sentences.words, sentences.tags, predicted):
            f.writelines(f"{w} {g} {p}\n" for w, g, p in zip(words, gold, pred))
            f.write("\n")
