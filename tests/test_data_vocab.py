"""`bertjax vocab train` (WordPiece, SentencePiece and a byte-level BPE with BERT's special tokens) and the
SentencePiece path through the pretraining pipeline with whole-word masking."""
from __future__ import annotations

import os
import re

import numpy as np
import pytest

from bertjax.cli import main as bertjax_main
from bertjax.data.data_config import PretrainingDataConfig
from bertjax.data.pipeline import make_pretraining_dataset
from bertjax.data.tokenizers import SentencePieceTokenizer, TokenizerJsonTokenizer, WordPieceTokenizer

RESERVED = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]


@pytest.fixture(scope="module")
def texts(shared_data):
    train = shared_data / "gutenberg" / "romeo_and_juliet_pg1513.txt"
    held_out = (shared_data / "gutenberg" / "japanese_fairy_tales_ozaki_pg4018.txt").read_text(encoding="utf-8")
    lines = [" ".join(p.split()) for p in held_out.split("\n\n")[200:400] if p.strip()]
    return train, lines


def _refused_over_its_own(argv: list[str], vocab, capsys) -> None:
    """A second run into the --out of the first is refused before it trains, and the vocabulary stays as it was
    (a model trained with it would no longer match a new one)."""
    before = vocab.read_bytes()
    capsys.readouterr()
    assert bertjax_main(argv) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"bertjax vocab: error: {vocab} already exists: vocab train does not replace a vocabulary; remove it, or "
        "choose another --out")
    assert vocab.read_bytes() == before and "LOCK" not in os.listdir(vocab.parent)


def test_wordpiece_vocab_train(texts, tmp_path, capsys):
    train, held_out = texts
    out = tmp_path / "wp"
    argv = ["vocab", "train", "--input", str(train), "--format", "wrapped", "--vocab-size", "1500", "--type",
            "wordpiece", "--out", str(out), "--max-sentences", "3000"]
    assert bertjax_main(argv) == 0
    vocab = (out / "vocab.txt").read_text(encoding="utf-8").splitlines()
    # 3000 sentences of one play hold fewer frequent word pieces than asked: the closing line says so, and why.
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert len(vocab) < 1500
    assert f"vocab.txt: {len(vocab)} tokens of the 1500 asked: limited by --min-count 10" in line, line
    assert re.match(r"\d\d:\d\d:\d\d wrote ", line), line  # timestamped like every job's lines
    assert vocab[:5] == RESERVED and len(vocab) == len(set(vocab)) and len(vocab) > 500
    assert any(t.startswith("##") for t in vocab)
    tok = WordPieceTokenizer(str(out / "vocab.txt"))
    transformers = pytest.importorskip("transformers")
    hf = transformers.BertTokenizerFast(vocab=str(out / "vocab.txt"), do_lower_case=True)
    theirs = hf(held_out, max_length=256, padding="max_length", truncation=True)
    ours = tok.encode(held_out, max_len=256)
    np.testing.assert_array_equal(ours["input_ids"], np.asarray(theirs["input_ids"]))
    ids = ours["input_ids"][ours["input_mask"] == 1]
    assert np.mean(ids == tok.unk_id) < 0.02  # the learned vocab covers unseen English text
    assert sorted(os.listdir(out)) == ["vocab.txt"]
    _refused_over_its_own(argv, out / "vocab.txt", capsys)


def test_sentencepiece_vocab_train_and_whole_word_masking(texts, tmp_path, capsys):
    spm = pytest.importorskip("sentencepiece")
    train, held_out = texts
    out = tmp_path / "sp"
    argv = ["vocab", "train", "--input", str(train), "--format", "wrapped", "--vocab-size", "1200", "--type",
            "sentencepiece", "--out", str(out)]
    assert bertjax_main(argv) == 0
    model = out / "spm.model"
    _refused_over_its_own(argv, model, capsys)
    reference = spm.SentencePieceProcessor(model_file=str(model))
    assert [reference.id_to_piece(i) for i in range(5)] == RESERVED
    tok = SentencePieceTokenizer(str(model))
    assert tok.tokenize(held_out).to_list() == reference.encode(held_out)
    # Its tokenizer.json (what checkpoints keep, fine-tuning and exports tokenise with: transformers' conversion)
    # gives the in-graph ids, lower-cased too.
    from tokenizers import Tokenizer

    for lower_case in (False, True):
        in_graph = SentencePieceTokenizer(str(model), lower_case=lower_case)
        converted = Tokenizer.from_str(in_graph.spec["json"])
        assert [e.ids for e in converted.encode_batch(held_out, add_special_tokens=False)] == \
            in_graph.tokenize(held_out).to_list()

    # The SentencePiece path of the pipeline: whole-word masking never masks part of a "▁" word.
    config = PretrainingDataConfig(input=(str(train),), vocab=str(model), corpus_format="wrapped",
                                   max_seq_length=64, max_predictions_per_seq=10, whole_word_masking=True,
                                   doc_buffer_size=4, shuffle_buffer=100, num_epochs=1)
    partial = whole_multi = 0
    for batch in make_pretraining_dataset(config, 32).as_numpy_iterator():
        for row in range(len(batch["input_ids"])):
            valid = batch["masked_lm_weights"][row] > 0
            positions = batch["masked_lm_positions"][row][valid]
            original = batch["input_ids"][row].copy()
            original[positions] = batch["masked_lm_ids"][row][valid]  # undo the masking
            words, current = [], None
            for p in range(1, int(batch["input_mask"][row].sum())):
                if original[p] in (tok.sep_id, tok.cls_id):
                    current = None
                elif reference.id_to_piece(int(original[p])).startswith("\u2581") or current is None:
                    current = [p]
                    words.append(current)
                else:
                    current.append(p)
            chosen = set(positions.tolist())
            for word in words:
                hit = chosen.intersection(word)
                partial += bool(hit) and len(hit) != len(word)
                whole_multi += len(word) > 1 and len(hit) == len(word)
    assert partial == 0 and whole_multi > 20


@pytest.mark.parametrize("argv, message", [
    (["--vocab-size", "4", "--type", "wordpiece"], "leaves no room"),
])
def test_bad_vocab_arguments(texts, tmp_path, capsys, argv, message):
    train, _ = texts
    assert bertjax_main(["vocab", "train", "--input", str(train), "--out", str(tmp_path), *argv]) == 2
    assert message in capsys.readouterr().err


def test_wordpiece_min_count_steers_the_vocabulary_size(texts, tmp_path, capsys):
    """The same 3000 sentences: pieces seen twice or more are many more than those seen 10 times or more."""
    train, _ = texts
    sizes = {}
    for min_count in (10, 2):
        out = tmp_path / f"wp{min_count}"
        assert bertjax_main(["vocab", "train", "--input", str(train), "--format", "wrapped", "--vocab-size", "8000",
                             "--type", "wordpiece", "--out", str(out), "--max-sentences", "3000",
                             "--min-count", str(min_count)]) == 0
        sizes[min_count] = len((out / "vocab.txt").read_text(encoding="utf-8").splitlines())
        line = capsys.readouterr().out.strip().splitlines()[-1]
        assert f"{sizes[min_count]} tokens of the 8000 asked: limited by --min-count {min_count}" in line, line
    assert sizes[2] > 1.5 * sizes[10], sizes
    with pytest.raises(SystemExit) as refused:  # at parsing, as every number a command takes (options.ints)
        bertjax_main(["vocab", "train", "--input", str(train), "--vocab-size", "100", "--type", "wordpiece",
                      "--out", str(tmp_path / "bad"), "--min-count", "0"])
    assert refused.value.code == 2 and "argument --min-count: must be >= 1, got 0" in capsys.readouterr().err


def test_bpe_vocab_train_is_modernberts_kind_and_gives_the_tokenizers_librarys_ids(texts, tmp_path, capsys):
    """A byte-level BPE as ModernBERT's (NFC, byte-level pre-tokeniser and decoder, BERT's template), BERT's special
    tokens first, its size rounded up to a multiple of 64 with [unused] tokens; bertjax's tokenizer on it gives the
    `tokenizers` library's own ids and token types, singles and pairs, and AutoTokenizer reads it whole."""
    import json

    from tokenizers import Tokenizer

    train, held_out = texts
    out = tmp_path / "bpe"
    argv = ["vocab", "train", "--input", str(train), "--format", "wrapped", "--vocab-size", "1500", "--type", "bpe",
            "--out", str(out), "--max-sentences", "3000"]
    assert bertjax_main(argv) == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert line.endswith("wrote " + str(out / "tokenizer.json") + ": 1536 tokens (1500 learned and 36 [unused] ones, "
                         "a multiple of 64)"), line
    assert sorted(os.listdir(out)) == ["special_tokens_map.json", "tokenizer.json", "tokenizer_config.json"]
    spec = json.loads((out / "tokenizer.json").read_text(encoding="utf-8"))
    assert spec["normalizer"] == {"type": "NFC"} and spec["decoder"]["type"] == "ByteLevel"
    assert spec["pre_tokenizer"] == {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
                                     "use_regex": True}
    assert spec["model"]["type"] == "BPE" and spec["model"]["unk_token"] is None
    added = {token["id"]: token for token in spec["added_tokens"]}
    assert [added[i]["content"] for i in range(5)] == RESERVED and added[4]["lstrip"]  # "a [MASK]" as ModernBERT's
    assert [added[i]["content"] for i in range(1500, 1536)] == [f"[unused{i}]" for i in range(36)]

    ours = TokenizerJsonTokenizer(str(out / "tokenizer.json"))
    library = Tokenizer.from_file(str(out / "tokenizer.json"))
    assert len(ours.vocab) == library.get_vocab_size() == 1536
    assert (ours.pad_id, ours.unk_id, ours.cls_id, ours.sep_id, ours.mask_id) == (0, 1, 2, 3, 4)
    first, second = held_out[:90], held_out[90:180]
    for pairs in (None, second):
        encoded = ours.encode(first, max_len=2048, text_pairs=pairs)
        theirs = library.encode_batch(first if pairs is None else list(zip(first, pairs)))
        assert max(len(e.ids) for e in theirs) < 2048  # nothing truncated: the whole encodings compared
        for row, encoding in enumerate(theirs):
            length = len(encoding.ids)
            assert encoded["input_ids"][row, :length].tolist() == encoding.ids
            assert encoded["segment_ids"][row, :length].tolist() == encoding.type_ids
            assert encoded["input_mask"][row].sum() == length
    assert np.mean(ours.encode(held_out, max_len=2048)["input_ids"] == 1) == 0  # byte-level: no [UNK] ever

    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(out)
    assert hf.model_input_names == ["input_ids", "attention_mask"]  # ModernBERT's: no token types
    pair = hf(first, second, return_token_type_ids=True)
    encoded = ours.encode(first, max_len=2048, text_pairs=second)
    for row, (ids, types) in enumerate(zip(pair["input_ids"], pair["token_type_ids"])):
        assert encoded["input_ids"][row, :len(ids)].tolist() == ids
        assert encoded["segment_ids"][row, :len(types)].tolist() == types
    assert hf("It is a [MASK].")["input_ids"] == [2, *library.encode("It is a", add_special_tokens=False).ids, 4,
                                                   *library.encode(".", add_special_tokens=False).ids, 3]
    _refused_over_its_own(argv, out / "tokenizer.json", capsys)


def test_bpe_min_count_and_lower_case(texts, tmp_path, capsys):
    """--min-count bounds the merges (pairs seen that often); --lower-case lower-cases before the model."""
    train, held_out = texts
    sizes = {}
    for min_count in (50, 2):
        out = tmp_path / f"bpe{min_count}"
        assert bertjax_main(["vocab", "train", "--input", str(train), "--format", "wrapped", "--vocab-size", "6000",
                             "--type", "bpe", "--out", str(out), "--max-sentences", "3000", "--min-count",
                             str(min_count)] + (["--lower-case"] if min_count == 2 else [])) == 0
        line = capsys.readouterr().out.strip().splitlines()[-1]
        sizes[min_count] = TokenizerJsonTokenizer(str(out / "tokenizer.json")).vocab_size
        assert sizes[min_count] % 64 == 0 and f"of the 6000 asked: limited by --min-count {min_count}" in line, line
    assert sizes[2] > 1.5 * sizes[50], sizes
    lowered = TokenizerJsonTokenizer(str(tmp_path / "bpe2" / "tokenizer.json"))
    assert lowered.token_lists(["ROMEO And Juliet"]) == lowered.token_lists(["romeo and juliet"])
