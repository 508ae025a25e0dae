"""The CoNLL reader and NER featurization: DOCSTART and blank lines, IOB1 -> IOB2, labels on first sub-tokens
only, windows with a stride where every word is scored exactly once (in its max-context window)."""
from __future__ import annotations

import numpy as np
import pytest

from bertjax.finetune import ner_data
from bertjax.finetune.ner_data import IGNORE


@pytest.fixture(scope="module")
def toy_tokenizer():
    from bertjax.data.tokenizers import WordPieceTokenizer

    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "a", "b", "c", "d", "e", "f", "##x"]
    return WordPieceTokenizer(vocab, lower_case=True)


def test_reader_drops_docstart_and_splits_on_blank_lines(tmp_path):
    path = tmp_path / "train.txt"
    path.write_text("-DOCSTART- -X- -X- O\n\nEU NNP B-NP I-ORG\nrejects VBZ B-VP O\n\n\nPeter NNP B-NP I-PER\n"
                    "Blackburn NNP I-NP I-PER\n-DOCSTART- -X- -X- O\nBRUSSELS NNP B-NP I-LOC\n", encoding="utf-8")
    s = ner_data.read_conll(str(path))
    assert s.words == [["EU", "rejects"], ["Peter", "Blackburn"], ["BRUSSELS"]]
    assert s.tags == [["I-ORG", "O"], ["I-PER", "I-PER"], ["I-LOC"]]  # kept as written (IOB1 here)
    assert ner_data.label_list(s) == ["O", "B-LOC", "I-LOC", "B-ORG", "I-ORG", "B-PER", "I-PER"]

    path.write_text("EU B-ORG\nrejects\n", encoding="utf-8")
    with pytest.raises(ValueError, match=f"{path}:2: expected 'word ... tag'"):
        ner_data.read_conll(str(path))
    path.write_text("EU B-ORG\nrejects S-ORG\n", encoding="utf-8")
    with pytest.raises(ValueError, match=f"{path}:2: tag 'S-ORG' is not O, B-<type> or I-<type>"):
        ner_data.read_conll(str(path))
    path.write_text("EU B-ORG\n", encoding="utf-8")
    with pytest.raises(FileNotFoundError, match="valid.txt not found"):
        ner_data.read_conll_dir(str(tmp_path))


def test_real_conll2003_counts(shared_data):
    splits = ner_data.read_conll_dir(str(shared_data / "conll2003"))
    # PROVENANCE.md: sentences / tokens (-DOCSTART- lines are not tokens).
    for split, sentences, tokens in (("train", 14041, 203621), ("valid", 3250, 51362), ("test", 3453, 46435)):
        s = splits[split]
        assert len(s) == sentences
        assert sum(len(w) for w in s.words) == tokens
        assert all(ner_data.iob1_to_iob2(t) == t for t in s.tags)  # the shared copy is IOB2
    assert ner_data.label_list(splits["train"]) == ["O", "B-LOC", "I-LOC", "B-MISC", "I-MISC", "B-ORG", "I-ORG",
                                                    "B-PER", "I-PER"]


def test_windows_score_every_word_once_on_its_first_sub_token(toy_tokenizer):
    # Sub-tokens: a | b ##x | c | d ##x ##x | e | f  (positions 0..8). 4 tokens per window, stride 2:
    # windows [0-3] [2-5] [4-7] [6-8]. Max context of each word's first sub-token (min(left, right) + 0.01 len):
    # a@0, b@1 -> window 0; c@3 -> window 1 (1.04 vs 0.04); d@4 -> window 1 (1.04 vs 0.04); e@7, f@8 -> window 3.
    s = ner_data.Sentences([["a", "bx", "c", "dxx", "e", "f"]], [["I-PER", "I-PER", "O", "I-LOC", "B-LOC", "O"]])
    labels = ["O", "B-LOC", "I-LOC", "B-PER", "I-PER"]
    f = ner_data.featurize(s, toy_tokenizer, labels, max_seq_length=6, doc_stride=2)
    v = {t: i for i, t in enumerate(toy_tokenizer.vocab)}
    assert f.arrays["input_ids"].tolist() == [
        [v[t] for t in row] for row in (["[CLS]", "a", "b", "##x", "c", "[SEP]"], ["[CLS]", "##x", "c", "d", "##x", "[SEP]"],
                                        ["[CLS]", "d", "##x", "##x", "e", "[SEP]"], ["[CLS]", "##x", "e", "f", "[SEP]", "[PAD]"])]
    assert f.arrays["input_mask"][3].tolist() == [1, 1, 1, 1, 1, 0]
    assert f.word.tolist() == [[-1, 0, 1, -1, -1, -1], [-1, -1, 2, 3, -1, -1], [-1] * 6, [-1, -1, 4, 5, -1, -1]]
    assert f.sentence.tolist() == [0, 0, 0, 0]
    # IOB1 -> IOB2 before labelling: B-PER I-PER O B-LOC B-LOC O.
    B_PER, I_PER, O, B_LOC = 3, 4, 0, 1
    assert f.arrays["label_ids"].tolist() == [[IGNORE, B_PER, I_PER, IGNORE, IGNORE, IGNORE],
                                              [IGNORE, IGNORE, O, B_LOC, IGNORE, IGNORE],
                                              [IGNORE] * 6,
                                              [IGNORE, IGNORE, B_LOC, O, IGNORE, IGNORE]]
    # Prediction features carry no labels; decoding reads each word at its scored position.
    g = ner_data.featurize(s, toy_tokenizer, None, max_seq_length=6, doc_stride=2)
    assert (g.arrays["label_ids"] == IGNORE).all() and (g.word == f.word).all()
    logits = np.zeros(g.word.shape + (len(labels),))
    logits[..., 2] = 1.0  # I-LOC everywhere, except at the scored positions: the gold label there
    rows, cols = np.nonzero(f.arrays["label_ids"] >= 0)
    logits[rows, cols, f.arrays["label_ids"][rows, cols]] = 5.0
    assert ner_data.decode(g, logits, s, labels) == [["B-PER", "I-PER", "O", "B-LOC", "B-LOC", "O"]]


def test_short_sentences_are_one_window_and_unknown_tags_are_named(toy_tokenizer):
    s = ner_data.Sentences([["a", "bx"], ["c"]], [["B-PER", "O"], ["B-MISC"]], source="x.txt")
    f = ner_data.featurize(s, toy_tokenizer, None, max_seq_length=8, doc_stride=2)
    assert f.sentence.tolist() == [0, 1] and f.word[0].tolist() == [-1, 0, 1, -1, -1, -1, -1, -1]
    with pytest.raises(ValueError, match=r"x.txt: sentence 1 has tags \['B-MISC'\] that are not among the labels"):
        ner_data.featurize(s, toy_tokenizer, ["O", "B-PER", "I-PER"], max_seq_length=8, doc_stride=2)


def test_token_loss_is_the_mean_over_labelled_tokens_of_the_batch():
    """As HF's BertForTokenClassification: every labelled token of the batch weighs the same (a padding row of
    weight 0 counts for nothing), through the Trainer's weighted mean over rows."""
    import jax.numpy as jnp
    import optax

    from bertjax.finetune.trainer import token_classification_loss

    rng = np.random.default_rng(0)
    logits = rng.normal(size=(3, 4, 5)).astype(np.float32)
    labels = np.array([[-1, 2, 3, -1, -1], [-1, 1, -1, -1, -1], [-1, 4, 4, 4, -1]], np.int32)  # 5 wide: cut to 4
    weights = np.array([1.0, 1.0, 0.0], np.float32)
    per_row = token_classification_loss(jnp.asarray(logits), {"label_ids": jnp.asarray(labels),
                                                              "weights": jnp.asarray(weights)})
    trainer_loss = float(jnp.sum(per_row * weights) / jnp.sum(weights))
    token_losses = optax.softmax_cross_entropy_with_integer_labels(logits, np.maximum(labels[:, :4], 0))
    expected = (token_losses[0, 1] + token_losses[0, 2] + token_losses[1, 1]) / 3
    assert trainer_loss == pytest.approx(float(expected), rel=1e-6)
