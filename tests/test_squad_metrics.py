"""The official SQuAD metric logic on crafted predictions with hand-computed scores."""
import pytest

from bertjax.finetune import squad_metrics


def _dataset(qas):
    return [{"title": "t", "paragraphs": [{"context": "c", "qas": qas}]}]


def test_normalize_answer():
    assert squad_metrics.normalize_answer("The  Quick, brown fox!") == "quick brown fox"
    assert squad_metrics.normalize_answer("an apple a day") == "apple day"
    assert squad_metrics.normalize_answer("Theatre (A) the end.") == "theatre end"  # articles only as whole words
    assert squad_metrics.normalize_answer("  U.S.  ") == "us"
    assert squad_metrics.normalize_answer("¿Qué?") == "¿qué"  # only ASCII punctuation is removed, as the official script


def test_f1_em_pairs():
    # gold [cat, sat], pred [cat, sat, on]: P = 2/3, R = 1 -> F1 = 0.8
    assert squad_metrics.compute_f1("the cat sat", "a cat sat on") == pytest.approx(0.8)
    assert squad_metrics.f1_score_v1("a cat sat on", "the cat sat") == pytest.approx(0.8)
    assert squad_metrics.compute_exact("The Broncos", "broncos.") == 1
    # repeated tokens count by multiplicity: gold [a? no: "b b c"] vs pred "b c c" -> common {b:1, c:1}
    assert squad_metrics.compute_f1("b b c", "b c c") == pytest.approx(2 / 3)
    # empty vs empty: 1 in v2 (no-answer agreement), 0 in v1
    assert squad_metrics.compute_f1("", "") == 1.0 and squad_metrics.compute_exact("", "") == 1
    assert squad_metrics.compute_f1("", "something") == 0.0
    assert squad_metrics.f1_score_v1("", "") == 0.0


QAS = [
    {"id": "q1", "answers": [{"text": "Denver Broncos"}, {"text": "Broncos"}]},
    {"id": "q2", "answers": [{"text": "1990"}, {"text": "1990"}]},
    {"id": "q3", "answers": []},
    {"id": "q4", "answers": []},
]
PREDS = {"q1": "the Broncos", "q2": "in 1990", "q3": "", "q4": "something"}


def test_v2_eval_with_breakdown():
    out = squad_metrics.evaluate_v2(_dataset(QAS), PREDS)
    # EM: q1 1 (vs "Broncos"), q2 0, q3 1 ("" vs ""), q4 0. F1: 1, 2/3 (P 1/2, R 1), 1, 0.
    assert out["exact"] == pytest.approx(50.0)
    assert out["f1"] == pytest.approx(100 * (1 + 2 / 3 + 1 + 0) / 4)
    assert out["total"] == 4
    assert out["HasAns_exact"] == pytest.approx(50.0) and out["HasAns_f1"] == pytest.approx(100 * (5 / 3) / 2)
    assert out["NoAns_exact"] == pytest.approx(50.0) and out["NoAns_total"] == 2
    assert "best_f1" not in out


def test_v2_na_prob_threshold_and_best_threshold():
    na = {"q1": 0.1, "q2": 0.9, "q3": 0.8, "q4": 0.3}
    out = squad_metrics.evaluate_v2(_dataset(QAS), PREDS, na_probs=na, na_prob_thresh=0.5)
    # q2 and q3 have na > 0.5 -> predicted no-answer: q2 scores 0, q3 scores 1; q1 1, q4 0.
    assert out["exact"] == pytest.approx(50.0)
    assert out["f1"] == pytest.approx(50.0)
    # Sweep in na order q1 .1, q4 .3, q3 .8, q2 .9 from 2 (all abstain): +1 (q1) = 3 <- best, then -1 (q4),
    # 0 (q3), +0 / +2/3 (q2). Best: answer only q1 = 3/4, threshold 0.1.
    assert out["best_exact"] == pytest.approx(75.0) and out["best_exact_thresh"] == pytest.approx(0.1)
    assert out["best_f1"] == pytest.approx(75.0) and out["best_f1_thresh"] == pytest.approx(0.1)


def test_best_threshold_when_answering_more_pays():
    # q4's wrong answer is cheap to drop, q2's partial answer is worth keeping: best is answering q1 and q2.
    na = {"q1": 0.1, "q2": 0.2, "q3": 0.5, "q4": 0.7}
    preds = dict(PREDS, q2="1990")
    out = squad_metrics.evaluate_v2(_dataset(QAS), preds, na_probs=na)
    # from 2: q1 +1 = 3, q2 +1 = 4 (thresh 0.2), q3 +0 = 4 (not > 4), q4 -1 = 3
    assert out["best_exact"] == pytest.approx(100.0) and out["best_exact_thresh"] == pytest.approx(0.2)


def test_missing_predictions_v1_vs_v2(capsys):
    preds = {"q1": "Broncos"}
    v1 = squad_metrics.evaluate_v1(_dataset(QAS[:2]), preds)
    assert v1 == pytest.approx({"exact_match": 50.0, "f1": 50.0})  # q2 counts as 0
    v2 = squad_metrics.evaluate_v2(_dataset(QAS[:2]), preds)
    assert v2["exact"] == pytest.approx(100.0) and v2["total"] == 1  # q2 left out of the total
    err = capsys.readouterr().err
    assert "Unanswered question q2" in err and "Missing prediction for q2" in err


def test_evaluate_dispatches_on_version():
    data = {"version": "v2.0", "data": _dataset(QAS)}
    assert "HasAns_exact" in squad_metrics.evaluate(data, PREDS)
    data = {"version": "1.1", "data": _dataset(QAS[:2])}
    assert squad_metrics.evaluate(data, {"q1": "a Denver Broncos", "q2": "1990"}) == pytest.approx({"exact_match": 100.0, "f1": 100.0})
