"""What every tokenizer shares, without TensorFlow: the special tokens and their ids, and the layout of
[CLS] A [SEP] (B [SEP]) with padding and HF's pair truncation over any tokenizer's pieces.

The tokenizers themselves: tokenizers.py (in-graph, tensorflow-text) and host_tokenizer.py (on the host, HF's Rust
`tokenizers`); both give `BertTokenizerFast`'s ids.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

SPECIAL_TOKENS = {"pad": "[PAD]", "unk": "[UNK]", "cls": "[CLS]", "sep": "[SEP]", "mask": "[MASK]"}


def _special_ids(vocab: Sequence[str], source: str) -> dict[str, int | None]:
    """The special tokens' ids; [MASK] may be missing (None): only masked-LM pretraining uses it."""
    index = {}
    for i, token in enumerate(vocab):
        index.setdefault(token, i)  # first occurrence wins, as in a dict built line by line
    ids = {}
    for name, token in SPECIAL_TOKENS.items():
        if token not in index and name != "mask":
            required = [t for t in SPECIAL_TOKENS.values() if t != "[MASK]"]
            raise ValueError(f"vocab {source} has no {token} token (required: {', '.join(required)})")
        ids[name] = index.get(token)
    return ids


def check_unique(vocab: Sequence[str], source: str) -> None:
    """One id per token: a token listed twice is an error naming it and both lines (the WordPiece table would
    refuse it deep inside TensorFlow; HF would silently give it the later id)."""
    first = {}
    for line, token in enumerate(vocab, start=1):
        if token in first:
            raise ValueError(f"vocab {source}: token {token!r} is on line {first[token]} and again on line {line}; "
                             f"each token must appear once (its line number is its id)")
        first[token] = line


class Tokenizer:
    """Shared layout logic; subclasses provide `pieces`, `vocab`, special ids."""

    vocab: list[str]
    pad_id: int
    unk_id: int
    cls_id: int
    sep_id: int
    mask_id: int | None  # None: a vocabulary without [MASK] (fine for features and fine-tuning)
    source: str

    def _take_vocabulary(self, vocab: Sequence[str], source: str, lower_case: bool) -> None:
        """Holds `vocab` (id = position; a token listed twice refused), where it came from (for messages), the
        special tokens' ids and the casing."""
        self.source, self.vocab = source, list(vocab)
        check_unique(self.vocab, self.source)
        ids = _special_ids(self.vocab, self.source)
        self.pad_id, self.unk_id, self.cls_id = ids["pad"], ids["unk"], ids["cls"]
        self.sep_id, self.mask_id = ids["sep"], ids["mask"]
        self.lower_case = lower_case

    @property
    def vocab_size(self) -> int:
        return len(self.vocab)

    @property
    def special_token_ids(self) -> dict[str, int | None]:
        """{"pad", "unk", "cls", "sep", "mask"} -> id (a model config records them: ModernBERT's)."""
        return {"pad": self.pad_id, "unk": self.unk_id, "cls": self.cls_id, "sep": self.sep_id, "mask": self.mask_id}

    @property
    def special_ids(self) -> np.ndarray:
        """Ids that are never masking candidates."""
        return np.array(sorted({self.pad_id, self.cls_id, self.sep_id}), np.int32)

    def word_continuation_table(self) -> np.ndarray:
        """bool[vocab_size]: True for pieces that continue the previous word (whole-word masking)."""
        raise NotImplementedError

    def pieces(self, texts: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
        """The WordPiece ids of each text, no special tokens: (int32 ids of all texts in a row, int64 row splits:
        text i's are ids[splits[i]:splits[i + 1]])."""
        raise NotImplementedError

    def token_lists(self, texts: Sequence[str]) -> list[list[int]]:
        """The WordPiece ids of each text, as lists."""
        ids, splits = self.pieces(texts)
        return [ids[start:end].tolist() for start, end in zip(splits[:-1], splits[1:])]

    def word_lists(self, words: Sequence[str], after_space: Sequence[bool]) -> list[list[int]]:
        """The ids of each word as it reads in running text (after a space where `after_space` says so). BERT's
        tokenizers split on whitespace first, so a word's pieces are the word's alone; a tokenizer.json's
        (json_tokenizer.py) mark a word's start."""
        return self.token_lists(words)

    def encode(self, texts: Sequence[str], max_len: int = 128,
               text_pairs: Sequence[str] | None = None) -> dict[str, np.ndarray]:
        """[CLS] A [SEP] (B [SEP]) padded to max_len; int32 input_ids / input_mask / segment_ids [N, max_len].

        Over-long inputs are truncated at the end; pairs as HF's "longest_first" strategy does.
        """
        num_special = 3 if text_pairs is not None else 2
        if max_len < num_special:
            raise ValueError(f"max_len={max_len} leaves no room for the {num_special} special tokens")
        a_vals, a_splits = self.pieces(list(texts))
        len_a = np.diff(a_splits)
        n = len(len_a)
        if text_pairs is not None:
            if len(text_pairs) != n:
                raise ValueError(f"text_pairs has {len(text_pairs)} entries, texts has {n}")
            b_vals, b_splits = self.pieces(list(text_pairs))
            len_b = np.diff(b_splits)
            keep_a, keep_b = _longest_first(len_a, len_b, max_len - 3)
        else:
            keep_a, keep_b = np.minimum(len_a, max_len - 2), np.zeros(n, np.int64)

        input_ids = np.full((n, max_len), self.pad_id, np.int32)
        segment_ids = np.zeros((n, max_len), np.int32)
        rows = np.arange(n)
        input_ids[:, 0] = self.cls_id
        r, c = _ragged_prefix_index(keep_a)
        input_ids[r, 1 + c] = a_vals[a_splits[r] + c]
        input_ids[rows, 1 + keep_a] = self.sep_id
        length = keep_a + 2
        if text_pairs is not None:
            r, c = _ragged_prefix_index(keep_b)
            input_ids[r, length[r] + c] = b_vals[b_splits[r] + c]
            input_ids[rows, length + keep_b] = self.sep_id
            position = np.arange(max_len)[None, :]
            segment_ids = ((position >= length[:, None])
                           & (position < (length + keep_b + 1)[:, None])).astype(np.int32)
            length = length + keep_b + 1
        input_mask = (np.arange(max_len)[None, :] < length[:, None]).astype(np.int32)
        return {"input_ids": input_ids, "input_mask": input_mask, "segment_ids": segment_ids}


def _ragged_prefix_index(take: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(row, column) index pairs of the first take[i] entries of each row i."""
    take = take.astype(np.int64)
    rows = np.repeat(np.arange(len(take)), take)
    cols = np.arange(int(take.sum())) - np.repeat(np.cumsum(take) - take, take)
    return rows, cols


def _longest_first(len_a: np.ndarray, len_b: np.ndarray, budget: int) -> tuple[np.ndarray, np.ndarray]:
    """Kept lengths under HF tokenizers' LongestFirst pair truncation (vectorised).

    If the total exceeds the budget: the shorter input stays whole when it fits in half the budget and
    the longer gets the rest; otherwise both are cut to budget // 2, the longer (B on a tie) getting
    the odd token.
    """
    a_is_short = len_a <= len_b
    short = np.minimum(len_a, len_b)
    halve = 2 * short > budget
    new_short = np.where(halve, budget // 2, short)
    new_long = np.where(halve, budget // 2 + budget % 2, budget - short)
    over = len_a + len_b > budget
    keep_a = np.where(over, np.where(a_is_short, new_short, new_long), len_a)
    keep_b = np.where(over, np.where(a_is_short, new_long, new_short), len_b)
    return np.minimum(keep_a, len_a), np.minimum(keep_b, len_b)


