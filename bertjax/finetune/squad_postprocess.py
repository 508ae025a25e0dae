"""SQuAD predictions from start/end logits, as run_squad's write_predictions.

Per question: the top n_best start and end indexes of every window, kept if both lie in the context, the start
token has maximal context in that window, end >= start and the span is at most max_answer_length tokens; the
text is the slice of the original context between the tokens' character offsets. v2.0: the null score is
start[0] + end[0] minimised over windows, and "" is predicted when null - best non-null > threshold.
Deviation: where no valid span exists at all (e.g. an empty context) the prediction is "" rather than "empty".
"""
from __future__ import annotations

import collections

import numpy as np

# The null-odds value written when a question has no valid non-null span (JSON has no infinity).
NO_SPAN_SCORE_DIFF = 1e9


def _softmax(scores: list[float]) -> list[float]:
    if not scores:
        return []
    x = np.asarray(scores, np.float64)
    e = np.exp(x - x.max())
    return list(e / e.sum())


def _best_indexes(logits: np.ndarray, n_best_size: int) -> np.ndarray:
    # Stable sort: among equal logits the earlier position wins, as Python's sorted() in run_squad.
    return np.argsort(-logits, kind="stable")[:n_best_size]


def _candidates(start_logits, end_logits, offsets, max_context, n_best_size, max_answer_length):
    """(start_index, end_index) pairs of one window that pass run_squad's validity checks."""
    starts = _best_indexes(start_logits, n_best_size)
    ends = _best_indexes(end_logits, n_best_size)
    s, e = np.meshgrid(starts, ends, indexing="ij")
    s, e = s.reshape(-1), e.reshape(-1)
    ok = ((offsets[s, 0] >= 0) & (offsets[e, 0] >= 0) & max_context[s] & (e >= s)
          & (e - s + 1 <= max_answer_length))
    return s[ok], e[ok]


def _ranked(ex, feature_indexes, features, start_logits, end_logits, n_best_size, max_answer_length, version_2):
    """One question's n-best answers, best first, as (text, start_logit, end_logit, feature, start, end) with
    feature -1 for the null answer; and the null candidate (score, start_logit, end_logit, feature)."""
    prelim = []  # (score, feature_index, start, end, start_logit, end_logit)
    null = (float("inf"), 0.0, 0.0, -1)
    for f in feature_indexes:
        sl, el = start_logits[f], end_logits[f]
        if version_2 and sl[0] + el[0] < null[0]:
            null = (float(sl[0] + el[0]), float(sl[0]), float(el[0]), f)
        s, e = _candidates(sl, el, features.token_offsets[f], features.max_context[f], n_best_size,
                           max_answer_length)
        prelim.extend((float(sl[a] + el[b]), f, int(a), int(b), float(sl[a]), float(el[b])) for a, b in zip(s, e))
    if version_2 and feature_indexes:
        prelim.append((null[1] + null[2], -1, 0, 0, null[1], null[2]))
    # Sort by total score only (stable), as run_squad.
    prelim.sort(key=lambda p: p[0], reverse=True)
    seen, nbest = set(), []
    for _, f, a, b, sl, el in prelim:
        if len(nbest) >= n_best_size:
            break
        if f >= 0:
            offsets = features.token_offsets[f]
            text = ex.context[offsets[a, 0]:offsets[b, 1]]
        else:
            text = ""
        if text in seen:
            continue
        seen.add(text)
        nbest.append((text, sl, el, f, a, b))
    if version_2 and "" not in seen:
        nbest.append(("", null[1], null[2], -1, 0, 0))
    if not nbest:
        nbest.append(("", 0.0, 0.0, -1, 0, 0))
    return nbest, null


def _by_example(features) -> dict[int, list[int]]:
    by_example = collections.defaultdict(list)
    for feature_index, example_index in enumerate(features.example_index):
        by_example[int(example_index)].append(feature_index)
    return by_example


def _choice(nbest, null, version_2: bool, null_score_diff_threshold: float):
    """(the answer taken: an nbest entry, or None for the null answer under v2's rule; null odds or None)."""
    non_null = next((n for n in nbest if n[0]), None)
    if not version_2:
        return nbest[0], None
    score_diff = NO_SPAN_SCORE_DIFF if non_null is None else null[0] - non_null[1] - non_null[2]
    return (None if score_diff > null_score_diff_threshold else non_null), float(score_diff)


def predict_answers(examples, features, start_logits: np.ndarray, end_logits: np.ndarray, n_best_size: int = 20,
                    max_answer_length: int = 30, version_2: bool = False, null_score_diff_threshold: float = 0.0):
    """(predictions, nbest, null_odds, best_non_null) keyed by question id.

    predictions: the answer text after the v2 null rule; best_non_null: the best non-empty answer regardless of
    the threshold (what a threshold search needs); null_odds: null score - best non-null score (v2.0 only).
    """
    start_logits = np.asarray(start_logits, np.float32)
    end_logits = np.asarray(end_logits, np.float32)
    by_example = _by_example(features)
    predictions, nbest_json, null_odds, best_non_null = {}, {}, {}, {}
    for example_index, ex in enumerate(examples):
        nbest, null = _ranked(ex, by_example.get(example_index, []), features, start_logits, end_logits,
                              n_best_size, max_answer_length, version_2)
        probs = _softmax([n[1] + n[2] for n in nbest])
        nbest_json[ex.qas_id] = [{"text": n[0], "probability": float(p), "start_logit": n[1], "end_logit": n[2]}
                                 for n, p in zip(nbest, probs)]
        best_non_null[ex.qas_id] = next((n[0] for n in nbest if n[0]), "")
        chosen, odds = _choice(nbest, null, version_2, null_score_diff_threshold)
        predictions[ex.qas_id] = chosen[0] if chosen else ""
        if version_2:
            null_odds[ex.qas_id] = odds
    return predictions, nbest_json, null_odds, best_non_null


def _window_probabilities(logits: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """Softmax over a window's [CLS] and context tokens (the others get 0), as transformers' QA pipeline."""
    allowed = offsets[:, 0] >= 0
    allowed[0] = True
    x = np.where(allowed, logits.astype(np.float64), -np.inf)
    e = np.exp(x - x.max())
    return e / e.sum()


def answer_spans(examples, features, start_logits: np.ndarray, end_logits: np.ndarray, n_best_size: int = 20,
                 max_answer_length: int = 30, version_2: bool = False,
                 null_score_diff_threshold: float = 0.0) -> list[dict]:
    """Per example, the answer predict_answers gives, as {answer, score, start, end}: character offsets into the
    context, and the score of transformers' QA pipeline (start probability x end probability, each a softmax over
    the answer's window's [CLS] and context tokens); the null answer is ("", its window's [CLS] x [CLS], 0, 0)."""
    start_logits = np.asarray(start_logits, np.float32)
    end_logits = np.asarray(end_logits, np.float32)
    by_example = _by_example(features)
    out = []
    for example_index, ex in enumerate(examples):
        nbest, null = _ranked(ex, by_example.get(example_index, []), features, start_logits, end_logits,
                              n_best_size, max_answer_length, version_2)
        chosen, _ = _choice(nbest, null, version_2, null_score_diff_threshold)
        text, _, _, f, a, b = chosen or ("", 0.0, 0.0, null[3], 0, 0)
        if f < 0:  # no window at all, or v1.1 without any valid span
            out.append({"answer": "", "score": 0.0, "start": 0, "end": 0})
            continue
        offsets = features.token_offsets[f]
        score = (_window_probabilities(start_logits[f], offsets)[a] *
                 _window_probabilities(end_logits[f], offsets)[b])
        start, end = (int(offsets[a, 0]), int(offsets[b, 1])) if text else (0, 0)
        out.append({"answer": text, "score": float(score), "start": start, "end": end})
    return out
