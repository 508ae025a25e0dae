"""In-graph tokenizers: WordPiece (BERT vocab.txt) and SentencePiece (.model), both on tensorflow-text.

`tokenize` runs inside tf.data graphs; `encode` is the eager convenience that lays out
[CLS] A [SEP] (B [SEP]) with padding, matching HuggingFace's `BertTokenizerFast` ids.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np
import tensorflow as tf
import tensorflow_text as tf_text

from bertjax.runtime.errors import at_file
from bertjax.data.token_layout import SPECIAL_TOKENS, Tokenizer, _special_ids, check_unique  # noqa: F401


def read_vocab(vocab_path: str) -> list[str]:
    """Tokens of a vocab.txt file (one per line, id = line number); gs:// paths work via tf.io.gfile."""
    with at_file(vocab_path):
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


class _Tokenizer(Tokenizer):
    """In-graph tokenizers; subclasses provide `_tokenize_normalized`."""

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

    def pieces(self, texts: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
        ragged = self.tokenize(list(texts))
        return ragged.flat_values.numpy(), ragged.row_splits.numpy()


class WordPieceTokenizer(_Tokenizer):
    """BERT WordPiece from a vocab.txt, via tensorflow-text's FastBertTokenizer (in-graph)."""

    def __init__(self, vocab: str | Sequence[str], lower_case: bool = True, max_bytes_per_word: int = 100,
                 source: str | None = None):
        """vocab: a vocab.txt path, or the tokens themselves (id = position), e.g. a checkpoint's vocabulary."""
        if isinstance(vocab, str):
            self._take_vocabulary(read_vocab(vocab), vocab, lower_case)
        else:
            self._take_vocabulary(vocab, source or "the given token list", lower_case)
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

    The model must be a unigram one that defines the BERT special pieces [PAD] [UNK] [CLS] [SEP] [MASK] (as `bertjax
    vocab train --type sentencepiece` writes). Whole words start with the "▁" marker. Its `spec` is the model as an
    HF tokenizer.json (tokenizer_json.py: transformers' conversion; the same ids on text, save a near-tie of two
    segmentations' scores in a long text, and special tokens written in the text, which it keeps whole), which
    checkpoints keep: fine-tuning, `predict`, `embed` and the export tokenise with it.
    """

    WORD_START = "\u2581"

    def __init__(self, model_path: str, lower_case: bool = False):
        import sentencepiece  # the vocab listing; tokenization itself is tensorflow-text's

        with at_file(model_path):
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
        from bertjax.data.tokenizer_json import sentencepiece_json

        self.spec = {"json": sentencepiece_json(model, lower_case, model_path), "special": dict(SPECIAL_TOKENS)}
        self._tokenizer = tf_text.SentencepieceTokenizer(model=model, out_type=tf.int32)

    def _tokenize_normalized(self, texts):
        if self.lower_case:
            texts = tf.strings.lower(texts, encoding="utf-8")
        return self._tokenizer.tokenize(texts)

    def word_continuation_table(self) -> np.ndarray:
        # [UNK] stands for unknown characters *inside* a word here (not for a whole word as in WordPiece).
        specials = set(SPECIAL_TOKENS.values()) - {"[UNK]"}
        return np.array([not t.startswith(self.WORD_START) and t not in specials for t in self.vocab], bool)


class TokenizerJsonTokenizer(_Tokenizer):
    """An HF tokenizer.json (e.g. ModernBERT's BPE) in tf.data graphs: HF's Rust `tokenizers` on the host through a
    stateless `tf.numpy_function` (its pieces are json_tokenizer.HostJsonTokenizer's), so a pipeline that uses it
    still saves and restores its position. The special tokens are those of a tokenizer_config.json beside the file,
    else BERT's names. `lower_case` is the tokenizer's own business (its normaliser): not applied here."""

    def __init__(self, path: str):
        from bertjax.data.json_tokenizer import HostJsonTokenizer, read_spec
        from bertjax.runtime.input_files import read_json

        with at_file(path):
            if not tf.io.gfile.exists(path):
                raise FileNotFoundError(f"tokenizer file not found: {path}")
        beside = {}
        for name in ("tokenizer_config.json", "special_tokens_map.json"):
            other = path.rsplit("/", 1)[0] + "/" + name if "/" in path else name
            with at_file(other):
                found = tf.io.gfile.exists(other)
            if found:
                values = read_json(other, f"a tokenizer's {name}")
                beside[name] = values if isinstance(values, dict) else {}
        spec = read_spec(path, beside.get("tokenizer_config.json", {}), beside.get("special_tokens_map.json", {}))
        self._host = HostJsonTokenizer.from_spec(spec, path)
        self.spec, self.source, self.vocab, self.lower_case = self._host.spec, path, self._host.vocab, False
        ids = self._host.special_token_ids
        self.pad_id, self.unk_id, self.cls_id, self.sep_id, self.mask_id = (ids[k] for k in
                                                                          ("pad", "unk", "cls", "sep", "mask"))

    def _tokenize_normalized(self, texts):
        def host(strings):
            ids, splits = self._host.pieces([s.decode("utf-8", errors="replace") for s in strings.reshape(-1)])
            return ids.astype(np.int32), splits.astype(np.int64)

        ids, splits = tf.numpy_function(host, [texts], (tf.int32, tf.int64), stateful=False)
        ids.set_shape([None])
        splits.set_shape([None])
        return tf.RaggedTensor.from_row_splits(ids, splits, validate=False)

    def word_continuation_table(self) -> np.ndarray:
        return self._host.word_continuation_table()


def load_tokenizer(path: str, lower_case: bool | None = None) -> _Tokenizer:
    """WordPiece for a vocab.txt, SentencePiece for a .model file (lower_case defaults: True / False), an HF
    tokenizer.json for a .json file (its own normaliser)."""
    if path.endswith(".model"):
        return SentencePieceTokenizer(path, lower_case=bool(lower_case))
    if path.endswith(".json"):
        return TokenizerJsonTokenizer(path)
    return WordPieceTokenizer(path, lower_case=True if lower_case is None else lower_case)
