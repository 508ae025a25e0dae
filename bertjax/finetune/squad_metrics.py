"""The official SQuAD evaluation logic, v1.1 and v2.0, ported function by function.

The two official scripts differ in ways that change numbers, so both are kept:
- v1.1 counts an unanswered question as 0 in the total; F1 of two empty strings is 0.
- v2.0 leaves unanswered questions out of the total; gold answers that normalize to "" are dropped and a
  question without answers has the gold [""], so F1/EM of "" vs "" is 1. With na_probs it adds
  best_exact/best_f1 and the na-probability thresholds that reach them.
One deviation: where the official v2 script crashes on a missing prediction (KeyError in the HasAns/NoAns
breakdown), the breakdown here covers the answered questions, consistent with its totals.
"""
from __future__ import annotations

import collections
import re
import string
import sys

_PUNCTUATION = set(string.punctuation)
_ARTICLES = re.compile(r"\b(a|an|the)\b", re.UNICODE)


def normalize_answer(s: str) -> str:
    """Lower text and remove punctuation, articles and extra whitespace."""
    s = s.lower()
    s = "".join(ch for ch in s if ch not in _PUNCTUATION)
    s = _ARTICLES.sub(" ", s)
    return " ".join(s.split())


# ----------------------------------------------------------------------------------------------- v1.1

def f1_score_v1(prediction: str, ground_truth: str) -> float:
    prediction_tokens = normalize_answer(prediction).split()
    ground_truth_tokens = normalize_answer(ground_truth).split()
    common = collections.Counter(prediction_tokens) & collections.Counter(ground_truth_tokens)
    num_same = sum(common.values())
    if num_same == 0:
        return 0.0
    precision = num_same / len(prediction_tokens)
    recall = num_same / len(ground_truth_tokens)
    return (2 * precision * recall) / (precision + recall)


def exact_match_score_v1(prediction: str, ground_truth: str) -> bool:
    return normalize_answer(prediction) == normalize_answer(ground_truth)


def evaluate_v1(dataset: list, predictions: dict[str, str]) -> dict[str, float]:
    """Official v1.1 `evaluate`: {"exact_match", "f1"} in percent over all questions of `dataset` (the 'data' list)."""
    f1 = exact_match = total = 0.0
    for article in dataset:
        for paragraph in article["paragraphs"]:
            for qa in paragraph["qas"]:
                total += 1
                if qa["id"] not in predictions:
                    print(f"Unanswered question {qa['id']} will receive score 0.", file=sys.stderr)
                    continue
                ground_truths = [answer["text"] for answer in qa["answers"]]
                prediction = predictions[qa["id"]]
                exact_match += max(exact_match_score_v1(prediction, gt) for gt in ground_truths)
                f1 += max(f1_score_v1(prediction, gt) for gt in ground_truths)
    return {"exact_match": 100.0 * exact_match / total, "f1": 100.0 * f1 / total}


# ----------------------------------------------------------------------------------------------- v2.0

def make_qid_to_has_ans(dataset: list) -> dict[str, bool]:
    return {qa["id"]: bool(qa["answers"])
            for article in dataset for p in article["paragraphs"] for qa in p["qas"]}


def get_tokens(s: str) -> list[str]:
    if not s:
        return []
    return normalize_answer(s).split()


def compute_exact(a_gold: str, a_pred: str) -> int:
    return int(normalize_answer(a_gold) == normalize_answer(a_pred))


def compute_f1(a_gold: str, a_pred: str) -> float:
    gold_toks = get_tokens(a_gold)
    pred_toks = get_tokens(a_pred)
    common = collections.Counter(gold_toks) & collections.Counter(pred_toks)
    num_same = sum(common.values())
    if len(gold_toks) == 0 or len(pred_toks) == 0:
        # If either is no-answer, then F1 is 1 if they agree, 0 otherwise.
        return float(gold_toks == pred_toks)
    if num_same == 0:
        return 0.0
    precision = num_same / len(pred_toks)
    recall = num_same / len(gold_toks)
    return (2 * precision * recall) / (precision + recall)


def get_raw_scores(dataset: list, preds: dict[str, str]) -> tuple[dict, dict]:
    exact_scores, f1_scores = {}, {}
    for article in dataset:
        for p in article["paragraphs"]:
            for qa in p["qas"]:
                qid = qa["id"]
                gold_answers = [a["text"] for a in qa["answers"] if normalize_answer(a["text"])]
                if not gold_answers:
                    # For unanswerable questions, the only correct answer is the empty string.
                    gold_answers = [""]
                if qid not in preds:
                    print(f"Missing prediction for {qid}", file=sys.stderr)
                    continue
                a_pred = preds[qid]
                exact_scores[qid] = max(compute_exact(a, a_pred) for a in gold_answers)
                f1_scores[qid] = max(compute_f1(a, a_pred) for a in gold_answers)
    return exact_scores, f1_scores


def apply_no_ans_threshold(scores: dict, na_probs: dict, qid_to_has_ans: dict, na_prob_thresh: float) -> dict:
    new_scores = {}
    for qid, s in scores.items():
        pred_na = na_probs[qid] > na_prob_thresh
        new_scores[qid] = float(not qid_to_has_ans[qid]) if pred_na else s
    return new_scores


def make_eval_dict(exact_scores: dict, f1_scores: dict, qid_list: list | None = None) -> dict:
    if not qid_list:
        total = len(exact_scores)
        return collections.OrderedDict([
            ("exact", 100.0 * sum(exact_scores.values()) / total),
            ("f1", 100.0 * sum(f1_scores.values()) / total),
            ("total", total),
        ])
    total = len(qid_list)
    return collections.OrderedDict([
        ("exact", 100.0 * sum(exact_scores[k] for k in qid_list) / total),
        ("f1", 100.0 * sum(f1_scores[k] for k in qid_list) / total),
        ("total", total),
    ])


def merge_eval(main_eval: dict, new_eval: dict, prefix: str) -> None:
    for k in new_eval:
        main_eval[f"{prefix}_{k}"] = new_eval[k]


def find_best_thresh(preds: dict, scores: dict, na_probs: dict, qid_to_has_ans: dict) -> tuple[float, float]:
    """Sweep the na-probability threshold over the sorted na_probs; returns (best score %, its threshold)."""
    num_no_ans = len([k for k in qid_to_has_ans if not qid_to_has_ans[k]])
    cur_score = num_no_ans
    best_score = cur_score
    best_thresh = 0.0
    qid_list = sorted(na_probs, key=lambda k: na_probs[k])
    for qid in qid_list:
        if qid not in scores:
            continue
        if qid_to_has_ans[qid]:
            diff = scores[qid]
        else:
            diff = -1 if preds[qid] else 0
        cur_score += diff
        if cur_score > best_score:
            best_score = cur_score
            best_thresh = na_probs[qid]
    return 100.0 * best_score / len(scores), best_thresh


def find_all_best_thresh(main_eval: dict, preds: dict, exact_raw: dict, f1_raw: dict, na_probs: dict,
                         qid_to_has_ans: dict) -> None:
    best_exact, exact_thresh = find_best_thresh(preds, exact_raw, na_probs, qid_to_has_ans)
    best_f1, f1_thresh = find_best_thresh(preds, f1_raw, na_probs, qid_to_has_ans)
    main_eval["best_exact"] = best_exact
    main_eval["best_exact_thresh"] = exact_thresh
    main_eval["best_f1"] = best_f1
    main_eval["best_f1_thresh"] = f1_thresh


def evaluate_v2(dataset: list, preds: dict[str, str], na_probs: dict[str, float] | None = None,
                na_prob_thresh: float = 1.0) -> dict:
    """Official v2.0 `main` minus the file/plot handling: exact, f1, total, HasAns_*, NoAns_*, best_* (with na_probs)."""
    has_na_probs = na_probs is not None
    if na_probs is None:
        na_probs = {k: 0.0 for k in preds}
    qid_to_has_ans = make_qid_to_has_ans(dataset)
    has_ans_qids = [k for k, v in qid_to_has_ans.items() if v]
    no_ans_qids = [k for k, v in qid_to_has_ans.items() if not v]
    exact_raw, f1_raw = get_raw_scores(dataset, preds)
    # The official script raises KeyError here when a prediction is missing; break down the answered ones.
    has_ans_qids = [k for k in has_ans_qids if k in exact_raw]
    no_ans_qids = [k for k in no_ans_qids if k in exact_raw]
    exact_thresh = apply_no_ans_threshold(exact_raw, na_probs, qid_to_has_ans, na_prob_thresh)
    f1_thresh = apply_no_ans_threshold(f1_raw, na_probs, qid_to_has_ans, na_prob_thresh)
    out_eval = make_eval_dict(exact_thresh, f1_thresh)
    if has_ans_qids:
        merge_eval(out_eval, make_eval_dict(exact_thresh, f1_thresh, qid_list=has_ans_qids), "HasAns")
    if no_ans_qids:
        merge_eval(out_eval, make_eval_dict(exact_thresh, f1_thresh, qid_list=no_ans_qids), "NoAns")
    if has_na_probs:
        find_all_best_thresh(out_eval, preds, exact_raw, f1_raw, na_probs, qid_to_has_ans)
    return dict(out_eval)


def evaluate(dataset_json: dict, preds: dict[str, str], na_probs: dict[str, float] | None = None,
             version: str | None = None, na_prob_thresh: float = 1.0) -> dict:
    """Score a predictions dict against an official-format dataset JSON; version from the file unless given."""
    version = (version or str(dataset_json.get("version", "1.1"))).lstrip("v")
    if version.startswith("1"):
        return evaluate_v1(dataset_json["data"], preds)
    return evaluate_v2(dataset_json["data"], preds, na_probs, na_prob_thresh)


def evaluate_file(data_file: str, predictions_file: str, na_prob_file: str | None = None,
                  na_prob_thresh: float = 1.0, version: str | None = None) -> dict:
    """`bertjax eval squad`: the official script's output for a predictions file (and optional null odds). Reads
    JSON only: no TensorFlow or JAX is imported, so the command starts in a second and writes no native lines."""
    from bertjax.finetune import squad_data

    data = squad_data.load_squad_json(data_file)
    preds = squad_data.read_json(predictions_file, "predictions (JSON: {question id: answer text})")
    na_probs = squad_data.read_json(na_prob_file, "null odds (JSON: {question id: probability})") if na_prob_file \
        else None
    _check_predictions(data, preds, data_file, predictions_file)
    return evaluate(data, preds, na_probs, version, na_prob_thresh)


def _check_predictions(data: dict, preds, data_file: str, predictions_file: str) -> None:
    """A predictions file must map this dataset's question ids to answer strings (the official script would
    divide by zero or score a wrong file as 0 without a word)."""
    if not isinstance(preds, dict) or not all(isinstance(v, str) for v in preds.values()):
        raise ValueError(f"{predictions_file}: expected a JSON object {{question id: answer text}}, got "
                         f"{type(preds).__name__}" + (" with non-string answers" if isinstance(preds, dict) else ""))
    ids = {qa["id"] for article in data["data"] for paragraph in article["paragraphs"] for qa in paragraph["qas"]}
    if not ids:
        raise ValueError(f"{data_file}: the dataset has no questions")
    if not ids & preds.keys():
        raise ValueError(f"{predictions_file}: none of its {len(preds)} question id(s) is one of the {len(ids)} "
                         f"questions of {data_file} (predictions of another dataset?)")
    extra = len(preds.keys() - ids)
    if extra:
        print(f"warning: {predictions_file}: {extra} of its {len(preds)} question id(s) are not in {data_file}; "
              f"ignored", file=sys.stderr)
