"""WordPiece on the host, without TensorFlow: HF's Rust `tokenizers` set up as `BertTokenizerFast` sets it up (BERT
normaliser and pre-tokeniser, greedy longest-match WordPiece, words over 100 characters -> [UNK]).

For the jobs that tokenise their whole input once, before training or prediction (fine-tuning on a table file,
`bertjax predict`): they then never import TensorFlow (~5 CPU-s and ~0.7 GB resident at start). Pretraining
tokenises inside tf.data graphs with tokenizers.py's WordPieceTokenizer; the two give the same ids (the tests
check both against `BertTokenizerFast`).
"""
from __future__ import annotations

from typing import Sequence

import numpy as np
from tokenizers import Tokenizer as RustTokenizer
from tokenizers import models, normalizers, pre_tokenizers

from bertjax.data.token_layout import SPECIAL_TOKENS, Tokenizer


def ragged_pieces(tokenizer: RustTokenizer, texts: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
    """(ids int32 [total], splits int64 [len(texts) + 1]): each text's pieces, no special tokens, end to end."""
    encodings = tokenizer.encode_batch(list(texts), add_special_tokens=False)
    lengths = np.array([len(encoding.ids) for encoding in encodings], np.int64)
    splits = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    ids = np.fromiter((i for encoding in encodings for i in encoding.ids), np.int32, count=int(splits[-1]))
    return ids, splits


def wordpiece_tokenizer(vocab: Sequence[str], lower_case: bool) -> RustTokenizer:
    """WordPiece over `vocab` (id = position) with BERT's normaliser and pre-tokeniser, no special tokens added."""
    tokenizer = RustTokenizer(models.WordPiece({token: i for i, token in enumerate(vocab)},
                                               unk_token=SPECIAL_TOKENS["unk"], max_input_chars_per_word=100))
    # strip_accents=None: accents go with lower-casing, as BertTokenizerFast(do_lower_case=...) has it.
    tokenizer.normalizer = normalizers.BertNormalizer(
        clean_text=True, handle_chinese_chars=True, strip_accents=None, lowercase=lower_case)
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    return tokenizer


class HostWordPieceTokenizer(Tokenizer):
    """BERT WordPiece over a vocabulary given as its tokens (id = position), e.g. a checkpoint's."""

    def __init__(self, vocab: Sequence[str], lower_case: bool = True, source: str | None = None):
        self._take_vocabulary(vocab, source or "the given token list", lower_case)
        self._tokenizer = wordpiece_tokenizer(self.vocab, lower_case)

    def pieces(self, texts: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
        return ragged_pieces(self._tokenizer, texts)

    def word_continuation_table(self) -> np.ndarray:
        return np.array([t.startswith("##") and len(t) > 2 for t in self.vocab], bool)
