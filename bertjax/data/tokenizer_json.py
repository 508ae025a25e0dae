"""HF `tokenizer.json` files for bertjax's vocabularies, built with HF's `tokenizers`, so that an export (and `vocab
train --type bpe`) is a tokenizer transformers loads whole and that gives the ids bertjax trained with:

- WordPiece (a vocab.txt): BertTokenizerFast's set-up (host_tokenizer.py's), its special tokens added;
- SentencePiece (a unigram .model): as transformers' SpmConverter converts one (the model's scores, its normaliser's
  precompiled rules, Metaspace), lower-casing first where the run lower-cased (tokenizers.py does it before the
  model); BERT's special tokens added, as the model's user-defined symbols are;
- a tokenizer.json (ModernBERT's BPE, `vocab train --type bpe`'s): as it is, unless its post-processor does not lay
  out BERT's template, which is then set.

Every one lays out [CLS] A [SEP] (B [SEP]) with B's token type 1 (token_layout.py's layout); `tokenizer_files` adds
the tokenizer_config.json and special_tokens_map.json that name its class and special tokens for transformers 5 (which
builds a ModernBERT's tokenizer from tokenizer.json whatever class is named: hence a tokenizer.json in every export).
"""
from __future__ import annotations

import json
import struct
from typing import Sequence

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

from bertjax.data.host_tokenizer import wordpiece_tokenizer
from bertjax.data.token_layout import SPECIAL_TOKENS

# What a class transformers 5 builds from tokenizer.json alone is named in tokenizer_config.json (the released
# ModernBERT's own); BERT's WordPiece keeps BertTokenizer's name, which builds the same tokenizer from vocab.txt.
JSON_CLASS, WORDPIECE_CLASS = "PreTrainedTokenizerFast", "BertTokenizer"
# sentencepiece_model.proto's TrainerSpec.ModelType (unigram 1, bpe 2, word 3, char 4) and SentencePiece.Type values.
_MODEL_TYPES = {1: "unigram", 2: "bpe", 3: "word", 4: "char"}
_UNIGRAM = 1
_NORMAL, _CONTROL, _USER_DEFINED = 1, 3, 4


def set_bert_template(tokenizer: Tokenizer, special: dict[str, str]) -> None:
    """Lays out [CLS] $A [SEP] and [CLS] $A [SEP] $B [SEP] (B and its [SEP] of token type 1), as BERT's and
    ModernBERT's; nothing where the vocabulary lacks [CLS] or [SEP] (no model of bertjax trains on one: only a
    checkpoint converted from elsewhere has one)."""
    cls, sep = special["cls"], special["sep"]
    cls_id, sep_id = tokenizer.token_to_id(cls), tokenizer.token_to_id(sep)
    if cls_id is not None and sep_id is not None:
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{cls}:0 $A:0 {sep}:0", pair=f"{cls}:0 $A:0 {sep}:0 $B:1 {sep}:1",
            special_tokens=[(cls, cls_id), (sep, sep_id)])


def special_token(token: str) -> AddedToken:
    """`token` as a special token: matched whole in the raw text, never split, skipped when decoding; [MASK] takes
    the space before it, as ModernBERT's does ("a [MASK]." predicts the word with its space)."""
    return AddedToken(token, special=True, normalized=False, lstrip=token == SPECIAL_TOKENS["mask"])


def _special_added_tokens(tokenizer: Tokenizer, tokens: Sequence[str]) -> None:
    """Marks those of `tokens` that the vocabulary holds as special tokens."""
    tokenizer.add_special_tokens([special_token(token) for token in tokens if tokenizer.token_to_id(token) is not None])


def wordpiece_json(vocab: Sequence[str], lower_case: bool) -> str:
    """The tokenizer.json of a WordPiece vocabulary (tokens by id), as BertTokenizerFast builds it."""
    tokenizer = wordpiece_tokenizer(vocab, lower_case)
    tokenizer.decoder = decoders.WordPiece(prefix="##")
    _special_added_tokens(tokenizer, list(SPECIAL_TOKENS.values()))
    set_bert_template(tokenizer, SPECIAL_TOKENS)
    return tokenizer.to_str()


def sentencepiece_json(model: bytes, lower_case: bool, source: str) -> str:
    """The tokenizer.json of a serialized SentencePiece unigram model with BERT's special pieces, as transformers'
    SpmConverter writes one (`source`: the file, for messages)."""
    spec = _sentencepiece_spec(model, source)
    if spec["model_type"] != _UNIGRAM:
        raise ValueError(f"{source}: a SentencePiece {_MODEL_TYPES.get(spec['model_type'], 'unknown')} model; bertjax "
                         "reads unigram models (`vocab train --type sentencepiece` writes one; --type bpe a "
                         "byte-level BPE tokenizer.json)")
    pieces = spec["pieces"]
    tokenizer = Tokenizer(models.Unigram([(piece, score) for piece, score, _ in pieces], spec["unk_id"],
                                         byte_fallback=spec["byte_fallback"]))
    steps = [normalizers.Lowercase()] if lower_case else []  # tokenizers.py lower-cases before the model
    if spec["charsmap"]:
        steps.append(normalizers.Precompiled(spec["charsmap"]))
    if spec["remove_extra_whitespaces"]:  # trailing spaces dropped, runs of them one
        steps += [normalizers.Strip(left=False, right=True), normalizers.Replace(Regex(" {2,}"), "\u2581")]
    tokenizer.normalizer = normalizers.Sequence(steps)
    prepend = "always" if spec["add_dummy_prefix"] else "never"
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme=prepend)
    tokenizer.decoder = decoders.Metaspace(replacement="\u2581", prepend_scheme=prepend)
    tokenizer.add_tokens([AddedToken(piece, normalized=False, special=kind == _CONTROL)
                          for piece, _, kind in pieces if kind in (_CONTROL, _USER_DEFINED)])
    _special_added_tokens(tokenizer, list(SPECIAL_TOKENS.values()))
    set_bert_template(tokenizer, SPECIAL_TOKENS)
    return tokenizer.to_str()


# sentencepiece_model.proto's numbers: ModelProto {pieces 1, trainer_spec 2, normalizer_spec 3}; SentencePiece {piece 1,
# score 2, type 3}; TrainerSpec {model_type 3, byte_fallback 35, unk_id 40}; NormalizerSpec {precompiled_charsmap 2,
# add_dummy_prefix 3, remove_extra_whitespaces 4}. Read from the wire format: the sentencepiece package's generated
# module needs protobuf 7, and the project runs on 6 (Beam's pin).
def _sentencepiece_spec(model: bytes, source: str) -> dict:
    """The fields of a SentencePiece ModelProto that its tokenizer.json needs (the proto's defaults where absent)."""
    try:
        fields = _proto_fields(model)
        trainer = _proto_fields(b"".join(fields.get(2, [])))
        normalizer = _proto_fields(b"".join(fields.get(3, [])))
        pieces = []
        for entry in fields.get(1, []):
            piece = _proto_fields(entry)
            score = struct.unpack("<f", piece[2][-1])[0] if 2 in piece else 0.0
            pieces.append((piece[1][-1].decode("utf-8"), score, piece.get(3, [_NORMAL])[-1]))
    except (IndexError, KeyError, ValueError, struct.error, UnicodeDecodeError) as error:
        raise ValueError(f"{source}: not a SentencePiece model ({error})") from None
    return {"pieces": pieces, "model_type": trainer.get(3, [_UNIGRAM])[-1], "unk_id": trainer.get(40, [0])[-1],
            "byte_fallback": bool(trainer.get(35, [0])[-1]), "charsmap": normalizer.get(2, [b""])[-1],
            "add_dummy_prefix": bool(normalizer.get(3, [1])[-1]),
            "remove_extra_whitespaces": bool(normalizer.get(4, [1])[-1])}


def _proto_fields(message: bytes) -> dict[int, list]:
    """A protobuf message's fields by number: varints as ints, length-delimited and 32-bit values as bytes (64-bit
    ones skipped)."""
    fields, at = {}, 0

    def varint():
        nonlocal at
        value = shift = 0
        while True:
            byte = message[at]
            at += 1
            value |= (byte & 0x7F) << shift
            shift += 7
            if byte < 0x80:
                return value

    while at < len(message):
        key = varint()
        number, wire = key >> 3, key & 7
        if wire == 0:
            value = varint()
        elif wire == 2:
            length = varint()
            value, at = message[at:at + length], at + length
        elif wire in (1, 5):
            size = 8 if wire == 1 else 4
            value, at = message[at:at + size], at + size
        else:
            raise ValueError(f"wire type {wire} at byte {at}")
        if at > len(message):
            raise ValueError("the message ends inside a field")
        fields.setdefault(number, []).append(value)
    return fields


def with_bert_template(tokenizer_json: str, special: dict[str, str], token_types: bool = True) -> str:
    """`tokenizer_json` as it is where its post-processor lays out BERT's template already (the released ModernBERT's
    does), else with that template set, so that transformers adds the special tokens bertjax's layout has (and, with
    `token_types`, B's token type 1: a model without token types, ModernBERT, reads none)."""
    tokenizer = Tokenizer.from_str(tokenizer_json)
    tokenizer.no_truncation()
    tokenizer.no_padding()
    cls, sep = tokenizer.token_to_id(special["cls"]), tokenizer.token_to_id(special["sep"])
    a, b = (tokenizer.encode(text, add_special_tokens=False).ids for text in ("a", "b"))
    laid_out = tokenizer.encode("a", "b")
    if cls is None or sep is None or (laid_out.ids == [cls, *a, sep, *b, sep] and (
            not token_types or laid_out.type_ids == [0] * (len(a) + 2) + [1] * (len(b) + 1))):
        return tokenizer_json
    set_bert_template(tokenizer, special)
    return tokenizer.to_str()


def tokenizer_files(tokenizer_json: str, special: dict[str, str], *, tokenizer_class: str,
                    model_input_names: Sequence[str], model_max_length: int | None = None,
                    lower_case: bool | None = None) -> list[tuple[str, str]]:
    """(file name, text) of an HF tokenizer: tokenizer.json, tokenizer_config.json (its class, special tokens, input
    names, and the length and do_lower_case where given), special_tokens_map.json."""
    special_map = {f"{name}_token": token for name, token in special.items()}
    config = {"tokenizer_class": tokenizer_class, **special_map, "model_input_names": list(model_input_names),
              "clean_up_tokenization_spaces": False}
    if model_max_length is not None:
        config["model_max_length"] = model_max_length
    if lower_case is not None:
        config["do_lower_case"] = lower_case
    return [("tokenizer.json", tokenizer_json), ("tokenizer_config.json", json.dumps(config, indent=2)),
            ("special_tokens_map.json", json.dumps(special_map, indent=2))]
