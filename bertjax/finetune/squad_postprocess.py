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


def predict_answers(examples, features, start_logits: np.ndarray, end_logits: np.ndarray, n_best_size: int = 20,
                    max_answer_length: int = 30, version_2: bool = False, null_score_diff_threshold: float = 0.0):
    """(predictions, nbest, null_odds, best_non_null) keyed by question id.

    predictions: the answer text after the v2 null rule; best_non_null: the best non-empty answer regardless of
    the threshold (what a threshold search needs); null_odds: null score - best non-null score (v2.0 only).
    """
    start_logits = np.asarray(start_logits, np.float32)
    end_logits = np.asarray(end_logits, np.float32)
    by_example = collections.defaultdict(list)
    for feature_index, example_index in enumerate(features.example_index):
        by_example[int(example_index)].append(feature_index)
    predictions, nbest_json, null_odds, best_non_null = {}, {}, {}, {}
    for example_index, ex in enumerate(examples):
        prelim = []  # (score, feature_index, start, end, start_logit, end_logit)
        score_null, null_start, null_end = float("inf"), 0.0, 0.0
        for f in by_example.get(example_index, []):
            sl, el = start_logits[f], end_logits[f]
            if version_2 and sl[0] + el[0] < score_null:
                score_null, null_start, null_end = float(sl[0] + el[0]), float(sl[0]), float(el[0])
            s, e = _candidates(sl, el, features.token_offsets[f], features.max_context[f], n_best_size,
                               max_answer_length)
            prelim.extend((float(sl[a] + el[b]), f, int(a), int(b), float(sl[a]), float(el[b])) for a, b in zip(s, e))
        if version_2 and by_example.get(example_index):
            prelim.append((null_start + null_end, -1, 0, 0, null_start, null_end))
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
            nbest.append((text, sl, el))
        if version_2 and "" not in seen:
            nbest.append(("", null_start, null_end))
        if not nbest:
            nbest.append(("", 0.0, 0.0))
        probs = _softmax([sl + el for _, sl, el in nbest])
        nbest_json[ex.qas_id] = [{"text": t, "probability": float(p), "start_logit": sl, "end_logit": el}
                                 for (t, sl, el), p in zip(nbest, probs)]
        non_null = next((n for n in nbest if n[0]), None)
        best_non_null[ex.qas_id] = non_null[0] if non_null else ""
        if not version_2:
            predictions[ex.qas_id] = nbest[0][0]
            continue
        if non_null is None:
            score_diff = NO_SPAN_SCORE_DIFF
        else:
            score_diff = score_null - non_null[1] - non_null[2]
        null_odds[ex.qas_id] = float(score_diff)
        predictions[ex.qas_id] = "" if score_diff > null_score_diff_threshold else non_null[0]
    return predictions, nbest_json, null_odds, best_non_null
