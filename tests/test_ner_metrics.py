"""Entity-level scores as conlleval computes them, on hand-computed cases (boundary and type errors, chunks that
open with I-, IOB1 input, sentence boundaries)."""
from __future__ import annotations

import pytest

from bertjax.finetune.ner_data import iob1_to_iob2
from bertjax.finetune.ner_metrics import entity_scores


def _overall(gold, pred):
    return entity_scores(gold, pred)["overall"]


def test_exact_match_scores_one():
    gold = [["B-PER", "I-PER", "O", "B-LOC"], ["B-ORG", "I-ORG", "I-ORG"]]
    o = _overall(gold, gold)
    assert (o["precision"], o["recall"], o["f1"], o["gold"], o["correct"], o["accuracy"]) == (1, 1, 1, 3, 3, 1)


def test_boundary_errors_count_as_wrong_chunks():
    # Gold: PER[0-1], LOC[3], ORG[5-6]. Guess: PER[0] (too short), LOC[3-4] (too long), ORG[5-6] (right).
    gold = [["B-PER", "I-PER", "O", "B-LOC", "O", "B-ORG", "I-ORG"]]
    pred = [["B-PER", "O", "O", "B-LOC", "I-LOC", "B-ORG", "I-ORG"]]
    scores = entity_scores(gold, pred)
    o = scores["overall"]
    assert (o["gold"], o["predicted"], o["correct"]) == (3, 3, 1)
    assert o["precision"] == pytest.approx(1 / 3) and o["recall"] == pytest.approx(1 / 3)
    assert o["f1"] == pytest.approx(1 / 3)
    assert o["accuracy"] == pytest.approx(5 / 7)
    assert scores["per_type"]["ORG"]["f1"] == 1.0 and scores["per_type"]["PER"]["f1"] == 0.0


def test_type_errors_and_per_type_counts():
    # Gold: LOC[0], PER[2-3], MISC[5]. Guess: ORG[0] (type error), PER[2-3], MISC[5], LOC[6] (spurious).
    gold = [["B-LOC", "O", "B-PER", "I-PER", "O", "B-MISC", "O"]]
    pred = [["B-ORG", "O", "B-PER", "I-PER", "O", "B-MISC", "B-LOC"]]
    scores = entity_scores(gold, pred)
    o = scores["overall"]
    assert (o["gold"], o["predicted"], o["correct"]) == (3, 4, 2)
    p, r = 2 / 4, 2 / 3
    assert o["f1"] == pytest.approx(2 * p * r / (p + r))  # 4/7
    t = scores["per_type"]
    assert set(t) == {"LOC", "ORG", "PER", "MISC"}
    assert (t["LOC"]["gold"], t["LOC"]["predicted"], t["LOC"]["correct"]) == (1, 1, 0)
    assert (t["ORG"]["gold"], t["ORG"]["predicted"], t["ORG"]["precision"], t["ORG"]["recall"]) == (0, 1, 0.0, 0.0)
    assert t["PER"]["f1"] == 1.0


def test_chunks_that_start_with_i_count_as_in_conlleval():
    # I- after O opens a chunk; I-LOC right after B-PER opens a new LOC chunk (type change); both match gold.
    gold = [["O", "B-PER", "I-PER", "B-LOC", "O"]]
    pred = [["O", "I-PER", "I-PER", "I-LOC", "O"]]
    o = _overall(gold, pred)
    assert (o["gold"], o["predicted"], o["correct"]) == (2, 2, 2)
    # An I- chunk in the guess at the very start of a sentence, and one whose end is wrong.
    o = _overall([["B-ORG", "I-ORG", "O"]], [["I-ORG", "I-ORG", "I-ORG"]])
    assert (o["gold"], o["predicted"], o["correct"]) == (1, 1, 0)


def test_adjacent_same_type_chunks_need_b():
    # Two adjacent PER chunks in gold; the guess merges them into one: no correct chunk, 2 gold, 1 guessed.
    o = _overall([["B-PER", "B-PER"]], [["B-PER", "I-PER"]])
    assert (o["gold"], o["predicted"], o["correct"]) == (2, 1, 0)


def test_iob1_input_scores_like_its_iob2_form():
    # IOB1: I- opens a chunk; B- only separates two adjacent chunks of one type. Chunks: PER[0-1], PER[2], LOC[4].
    iob1 = ["I-PER", "I-PER", "B-PER", "O", "I-LOC", "I-LOC"]
    iob2 = ["B-PER", "I-PER", "B-PER", "O", "B-LOC", "I-LOC"]
    assert iob1_to_iob2(iob1) == iob2
    assert iob1_to_iob2(iob2) == iob2
    o = _overall([iob1], [iob2])
    assert (o["gold"], o["predicted"], o["correct"], o["f1"]) == (3, 3, 3, 1.0)
    o = _overall([iob1], [["B-PER", "I-PER", "I-PER", "O", "B-LOC", "I-LOC"]])  # PER chunks merged
    assert (o["gold"], o["predicted"], o["correct"]) == (3, 2, 1)


def test_sentence_boundary_ends_chunks():
    # The same type at the end of one sentence and the start of the next are two chunks, both right.
    gold = [["O", "B-LOC"], ["I-LOC", "O"]]
    o = _overall(gold, [["O", "B-LOC"], ["B-LOC", "O"]])
    assert (o["gold"], o["predicted"], o["correct"]) == (2, 2, 2)


def test_no_entities_and_bad_tags():
    o = _overall([["O", "O"]], [["O", "O"]])
    assert (o["precision"], o["recall"], o["f1"], o["accuracy"]) == (0.0, 0.0, 0.0, 1.0)
    with pytest.raises(ValueError, match=r"sentence 0 token 1 \(predicted\): tag 'X-PER' is not O"):
        _overall([["O", "B-PER"]], [["O", "X-PER"]])
    with pytest.raises(ValueError, match="sentence 0: 2 gold tags but 1 predicted"):
        _overall([["O", "O"]], [["O"]])
