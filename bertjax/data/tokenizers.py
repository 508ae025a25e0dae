"""In-graph tokenizers: WordPiece (BERT vocab.txt) and SentencePiece (.model), both on tensorflow-text.

`tokenize` runs inside tf.data graphs; `encode` is the eager convenience that lays out
[CLS] A [SEP] (B [SEP]) with padding, matching HuggingFace's `BertTokenizerFast` ids.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np
import tensorflow as tf
import tensorflow_text as tf_text

SPECIAL_TOKENS = {"pad": "[PAD]", "unk": "[UNK]", "cls": "[CLS]", "sep": "[SEP]", "mask": "[MASK]"}


def read_vocab(vocab_path: str) -> list[str]:
    """Tokens of a vocab.txt file (one per line, id = line number); gs:// paths work via tf.io.gfile."""
    if not tf.io.gfile.exists(vocab_path):
        raise FileNotFoundError(f"vocab file not found: {vocab_path}")
    with tf.io.gfile.GFile(vocab_path, "rb") as f:
        text = f.read().decode("utf-8")
    vocab = text.split("\n")
    if vocab and vocab[-1] == "":
        vocab.pop()
    vocab = [token.rstrip("\r") for token in vocab]
    if not vocab:
        raise ValueError(f"vocab file {vocab_path} is empty")
    return vocab


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


def _bert_normalize(texts: tf.Tensor, lower_case: bool) -> tf.Tensor:
    """BERT's text cleanup, as HF's BertNormalizer does it (clean_text, strip accents, lowercase).

    Done here rather than with tensorflow-text's own lower_case option because that uses Unicode
    *case folding* (µ -> μ, ς -> σ), which gives different ids than the released tokenizers.
    """
    texts = tf.strings.regex_replace(texts, r"[\t\n\r\p{Zs}]", " ")
    # Control/format/private/unassigned characters and U+FFFD are dropped (HF `_clean_text`).
    texts = tf.strings.regex_replace(texts, r"[\p{C}\x{FFFD}]", "")
    if lower_case:
        texts = tf_text.normalize_utf8(texts, "NFD")
        texts = tf.strings.regex_replace(texts, r"\p{Mn}", "")
        # ICU lowercases a word-final capital sigma to ς; Python/Rust (and so BERT vocabs) give σ.
        texts = tf.strings.regex_replace(texts, "Σ", "σ")
        texts = tf.strings.lower(texts, encoding="utf-8")
    return texts


def _as_string_tensor(texts) -> tf.Tensor:
    if isinstance(texts, str):
        texts = [texts]
    return tf.convert_to_tensor(texts, dtype=tf.string)


class _Tokenizer:
    """Shared layout logic; subclasses provide `_tokenize_normalized`, `vocab`, special ids."""

    vocab: list[str]
    pad_id: int
    unk_id: int
    cls_id: int
    sep_id: int
    mask_id: int | None  # None: a vocabulary without [MASK] (fine for features and fine-tuning)
    source: str

    @property
    def vocab_size(self) -> int:
        return len(self.vocab)

    @property
    def special_ids(self) -> np.ndarray:
        """Ids that are never masking candidates."""
        return np.array(sorted({self.pad_id, self.cls_id, self.sep_id}), np.int32)

    def word_continuation_table(self) -> np.ndarray:
        """bool[vocab_size]: True for pieces that continue the previous word (whole-word masking)."""
        raise NotImplementedError

    def tokenize(self, texts) -> tf.RaggedTensor:
        """int32 token ids, RaggedTensor [N, (tokens)] for a 1-D string input; usable inside tf.data."""
        texts = _as_string_tensor(texts)
        ids = self._tokenize_normalized(texts)
        if isinstance(ids, tf.RaggedTensor):
            while ids.ragged_rank > texts.shape.rank:
                ids = ids.merge_dims(-2, -1)
        return tf.cast(ids, tf.int32)

    def _tokenize_normalized(self, texts: tf.Tensor):
        raise NotImplementedError

    def encode(self, texts: Sequence[str], max_len: int = 128,
               text_pairs: Sequence[str] | None = None) -> dict[str, np.ndarray]:
        """[CLS] A [SEP] (B [SEP]) padded to max_len; int32 input_ids / input_mask / segment_ids [N, max_len].

        Over-long inputs are truncated at the end; pairs as HF's "longest_first" strategy does.
        """
        num_special = 3 if text_pairs is not None else 2
        if max_len < num_special:
            raise ValueError(f"max_len={max_len} leaves no room for the {num_special} special tokens")
        a = self.tokenize(list(texts))
        a_vals, a_splits = a.flat_values.numpy(), a.row_splits.numpy()
        len_a = np.diff(a_splits)
        n = len(len_a)
        if text_pairs is not None:
            if len(text_pairs) != n:
                raise ValueError(f"text_pairs has {len(text_pairs)} entries, texts has {n}")
            b = self.tokenize(list(text_pairs))
            b_vals, b_splits = b.flat_values.numpy(), b.row_splits.numpy()
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


class WordPieceTokenizer(_Tokenizer):
    """BERT WordPiece from a vocab.txt, via tensorflow-text's FastBertTokenizer (in-graph)."""

    def __init__(self, vocab: str | Sequence[str], lower_case: bool = True, max_bytes_per_word: int = 100,
                 source: str | None = None):
        """vocab: a vocab.txt path, or the tokens themselves (id = position), e.g. a checkpoint's vocabulary."""
        if isinstance(vocab, str):
            self.source, self.vocab = vocab, read_vocab(vocab)
        else:
            self.source, self.vocab = source or "the given token list", list(vocab)
        check_unique(self.vocab, self.source)
        ids = _special_ids(self.vocab, self.source)
        self.pad_id, self.unk_id, self.cls_id = ids["pad"], ids["unk"], ids["cls"]
        self.sep_id, self.mask_id = ids["sep"], ids["mask"]
        self.lower_case = lower_case
        # Normalisation is ours (see _bert_normalize); the fast tokenizer only splits and does WordPiece.
        self._tokenizer = tf_text.FastBertTokenizer(
            vocab=self.vocab, suffix_indicator="##", max_bytes_per_word=max_bytes_per_word,
            token_out_type=tf.int64, unknown_token="[UNK]", no_pretokenization=False,
            support_detokenization=False, lower_case_nfd_strip_accents=False)

    def _tokenize_normalized(self, texts):
        return self._tokenizer.tokenize(_bert_normalize(texts, self.lower_case))

    def word_continuation_table(self) -> np.ndarray:
        return np.array([t.startswith("##") and len(t) > 2 for t in self.vocab], bool)


class SentencePieceTokenizer(_Tokenizer):
    """SentencePiece .model via tensorflow-text's SentencepieceTokenizer (in-graph).

    The model must define the BERT special pieces [PAD] [UNK] [CLS] [SEP] [MASK] (as `bertjax vocab
    train --type sentencepiece` does). Whole words start with the "▁" marker.
    """

    WORD_START = "\u2581"

    def __init__(self, model_path: str, lower_case: bool = False):
        import sentencepiece  # the vocab listing; tokenization itself is tensorflow-text's

        if not tf.io.gfile.exists(model_path):
            raise FileNotFoundError(f"sentencepiece model not found: {model_path}")
        with tf.io.gfile.GFile(model_path, "rb") as f:
            model = f.read()
        processor = sentencepiece.SentencePieceProcessor()
        try:
            processor.LoadFromSerializedProto(model)
        except Exception as error:  # the library raises RuntimeError/OSError depending on the fault
            raise ValueError(f"{model_path} is not a sentencepiece model: {error}") from error
        self.source = model_path
        self.vocab = [processor.IdToPiece(i) for i in range(processor.GetPieceSize())]
        ids = _special_ids(self.vocab, model_path)
        self.pad_id, self.unk_id, self.cls_id = ids["pad"], ids["unk"], ids["cls"]
        self.sep_id, self.mask_id = ids["sep"], ids["mask"]
        self.lower_case = lower_case
        self._tokenizer = tf_text.SentencepieceTokenizer(model=model, out_type=tf.int32)

    def _tokenize_normalized(self, texts):
        if self.lower_case:
            texts = tf.strings.lower(texts, encoding="utf-8")
        return self._tokenizer.tokenize(texts)

    def word_continuation_table(self) -> np.ndarray:
        # [UNK] stands for unknown characters *inside* a word here (not for a whole word as in WordPiece).
        specials = set(SPECIAL_TOKENS.values()) - {"[UNK]"}
        return np.array([not t.startswith(self.WORD_START) and t not in specials for t in self.vocab], bool)


def load_tokenizer(path: str, lower_case: bool | None = None) -> _Tokenizer:
    """WordPiece for a vocab.txt, SentencePiece for a .model file (lower_case defaults: True / False)."""
    if path.endswith(".model"):
        return SentencePieceTokenizer(path, lower_case=bool(lower_case))
    return WordPieceTokenizer(path, lower_case=True if lower_case is None else lower_case)
