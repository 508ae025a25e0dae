"""A checkpoint's own HF `tokenizer.json` (the released ModernBERT models' BPE, or any model HF's Rust `tokenizers`
reads), on the host, with the special tokens its tokenizer_config.json names.

Its pieces are the tokenizer's own (its normaliser, pre-tokeniser and model, no special tokens added, its truncation
and padding off); the [CLS] A [SEP] (B [SEP]) layout and truncation are token_layout's, as for WordPiece (ModernBERT's
template is that layout). A word that follows a space is tokenised with the space before it: byte-level BPE and
Metaspace tokenisers mark a word's start in its first piece, so a text's words give the pieces of the running text.
"""
from __future__ import annotations

import json
from typing import Sequence

import numpy as np
from tokenizers import Tokenizer as RustTokenizer

from bertjax.data.host_tokenizer import ragged_pieces
from bertjax.data.token_layout import SPECIAL_TOKENS, Tokenizer
from bertjax.runtime import jsonio
from bertjax.runtime.input_files import JSON_LIMIT, read_text

# The spec a checkpoint stores: {"json": tokenizer.json's text, "special": {"cls": "[CLS]", ...}}.
SPEC_KEYS = ("json", "special")


def special_tokens_from_config(tokenizer_config: dict, special_tokens_map: dict) -> dict[str, str]:
    """{"pad", "unk", "cls", "sep", "mask"} -> token text, from tokenizer_config.json / special_tokens_map.json
    (a value may be a string or {"content": ...}); BERT's names where neither says."""
    out = {}
    for name, default in SPECIAL_TOKENS.items():
        value = tokenizer_config.get(f"{name}_token", special_tokens_map.get(f"{name}_token", default))
        out[name] = value.get("content", default) if isinstance(value, dict) else (value or default)
    return out


class HostJsonTokenizer(Tokenizer):
    """The tokenizer of an HF `tokenizer.json` text, with `special` naming its [CLS]/[SEP]/[PAD]/[UNK]/[MASK]."""

    def __init__(self, tokenizer_json: str, special: dict[str, str], source: str = "tokenizer.json"):
        jsonio.check_depth(tokenizer_json, source, "a tokenizer.json")  # ours, not the Rust parser's, error
        try:
            self._tokenizer = RustTokenizer.from_str(tokenizer_json)
        except Exception as error:  # noqa: BLE001 - tokenizers raises a bare Exception for a malformed file
            raise ValueError(f"{source}: not a tokenizer.json that HF tokenizers reads ({error})") from None
        self._tokenizer.no_truncation()
        self._tokenizer.no_padding()
        self.spec = {"json": tokenizer_json, "special": dict(special)}
        self.source, self.lower_case = source, False
        self.vocab = _tokens_by_id(self._tokenizer)
        ids = {name: self._tokenizer.token_to_id(token) for name, token in special.items()}
        missing = [special[name] for name in ("cls", "sep", "pad") if ids.get(name) is None]
        if missing:
            raise ValueError(f"{source}: the tokenizer has no {', '.join(missing)} token (its special tokens, as "
                             "tokenizer_config.json names them, must be in its vocabulary)")
        self.cls_id, self.sep_id, self.pad_id, self.mask_id = ids["cls"], ids["sep"], ids["pad"], ids.get("mask")
        # A byte-level BPE has no unknown piece; where a word has no piece at all, [PAD] stands for it.
        self.unk_id = ids["unk"] if ids.get("unk") is not None else self.pad_id

    @classmethod
    def from_spec(cls, spec: dict, source: str) -> "HostJsonTokenizer":
        return cls(spec["json"], spec["special"], source)

    def pieces(self, texts: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
        return ragged_pieces(self._tokenizer, texts)

    def word_lists(self, words: Sequence[str], after_space: Sequence[bool]) -> list[list[int]]:
        """The pieces of each word as it reads in running text: after a space where `after_space` says so."""
        return [ids for ids, _ in self.words_with_offsets(words, after_space)]

    def words_with_offsets(self, words: Sequence[str], after_space: Sequence[bool]
                           ) -> list[tuple[list[int], list[tuple[int, int]]]]:
        """Each word's pieces and their character spans [start, end) in the word (the tokenizer's offsets)."""
        texts = [(" " + w) if space else w for w, space in zip(words, after_space)]
        out = []
        for word, space, encoding in zip(words, after_space,
                                         self._tokenizer.encode_batch(texts, add_special_tokens=False)):
            shift = 1 if space else 0
            spans = [(min(max(a - shift, 0), len(word)), min(max(b - shift, 0), len(word)))
                     for a, b in encoding.offsets]
            out.append((list(encoding.ids), spans))
        return out

    def word_continuation_table(self) -> np.ndarray:
        """True for pieces that continue a word: those without the start-of-word mark of a byte-level BPE ("Ġ") or
        a Metaspace tokenizer ("▁"), and not special tokens."""
        special = set(self.spec["special"].values())
        return np.array([bool(t) and not t.startswith(("Ġ", "▁")) and t not in special for t in self.vocab], bool)


def _tokens_by_id(tokenizer: RustTokenizer) -> list[str]:
    """The token of every id up to the largest (added tokens included); an id without one gets a placeholder."""
    vocab = tokenizer.get_vocab(with_added_tokens=True)
    size = max(vocab.values()) + 1 if vocab else 0
    tokens = [f"<unassigned-{i}>" for i in range(size)]
    for token, index in vocab.items():
        tokens[index] = token
    return tokens


def spec_differences(spec: dict, other: dict) -> list[str]:
    """What tells two tokenizer specs apart (empty: the same tokenizer): the top-level parts of tokenizer.json whose
    content differs (`model`: its vocabulary or merges; `normalizer`, `pre_tokenizer`, ...), and the special
    tokens. Formatting (indentation, key order) is not a difference."""
    ours, theirs = json.loads(spec["json"]), json.loads(other["json"])
    parts = [key for key in sorted(set(ours) | set(theirs)) if ours.get(key) != theirs.get(key)]
    return parts + (["special tokens"] if spec["special"] != other["special"] else [])


def read_spec(tokenizer_json_path, tokenizer_config: dict, special_tokens_map: dict) -> dict:
    """The spec of an HF directory's tokenizer.json (an epath), with its special tokens."""
    text = read_text(tokenizer_json_path, "a tokenizer.json", JSON_LIMIT)
    jsonio.loads(text, str(tokenizer_json_path), "a tokenizer.json")  # a file HF tokenizers would refuse: told here
    return {"json": text, "special": special_tokens_from_config(tokenizer_config, special_tokens_map)}
