"""GLUE metrics, per task as the GLUE benchmark reports them.

CoLA: Matthews correlation; STS-B: Pearson and Spearman; MRPC/QQP: F1 (positive class 1) and accuracy;
MNLI (matched / mismatched), SST-2, QNLI, RTE, WNLI: accuracy. Implemented in numpy so the job does not need
scikit-learn or scipy (the tests cross-check against them).
"""
from __future__ import annotations

import numpy as np


def accuracy(preds, labels) -> float:
    preds, labels = np.asarray(preds), np.asarray(labels)
    return float(np.mean(preds == labels))


def f1_binary(preds, labels) -> float:
    """F1 of the positive class 1; 0.0 when there are no true positives (as scikit-learn)."""
    preds, labels = np.asarray(preds), np.asarray(labels)
    tp = int(np.sum((preds == 1) & (labels == 1)))
    fp = int(np.sum((preds == 1) & (labels != 1)))
    fn = int(np.sum((preds != 1) & (labels == 1)))
    if tp == 0:
        return 0.0
    return 2.0 * tp / (2.0 * tp + fp + fn)


def matthews_corrcoef(preds, labels) -> float:
    """Binary Matthews correlation; 0.0 when a marginal is empty (as scikit-learn)."""
    preds, labels = np.asarray(preds), np.asarray(labels)
    tp = float(np.sum((preds == 1) & (labels == 1)))
    tn = float(np.sum((preds != 1) & (labels != 1)))
    fp = float(np.sum((preds == 1) & (labels != 1)))
    fn = float(np.sum((preds != 1) & (labels == 1)))
    denom = np.sqrt((tp + fp) * (tp + fn) * (tn + fp) * (tn + fn))
    if denom == 0.0:
        return 0.0
    return float((tp * tn - fp * fn) / denom)


def pearson(x, y) -> float:
    x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
    xc, yc = x - x.mean(), y - y.mean()
    denom = np.sqrt(np.sum(xc * xc) * np.sum(yc * yc))
    if denom == 0.0:
        return float("nan")  # undefined for a constant input (scipy also returns nan)
    return float(np.sum(xc * yc) / denom)


def _average_ranks(x: np.ndarray) -> np.ndarray:
    """Ranks 1..n with ties given their mean rank (what Spearman's rho is defined on)."""
    order = np.argsort(x, kind="mergesort")
    sorted_x = x[order]
    ranks = np.empty(len(x), np.float64)
    start = 0
    while start < len(x):
        stop = start
        while stop + 1 < len(x) and sorted_x[stop + 1] == sorted_x[start]:
            stop += 1
        ranks[order[start:stop + 1]] = (start + stop) / 2.0 + 1.0
        start = stop + 1
    return ranks


def spearman(x, y) -> float:
    return pearson(_average_ranks(np.asarray(x, np.float64)), _average_ranks(np.asarray(y, np.float64)))


def compute_metrics(task: str, preds, labels) -> dict[str, float]:
    """Metrics of one GLUE task (or one MNLI dev split) from predicted label ids / scores and gold ones."""
    if task == "cola":
        return {"mcc": matthews_corrcoef(preds, labels), "accuracy": accuracy(preds, labels)}
    if task == "stsb":
        return {"pearson": pearson(preds, labels), "spearman": spearman(preds, labels)}
    if task in ("mrpc", "qqp"):
        return {"f1": f1_binary(preds, labels), "accuracy": accuracy(preds, labels)}
    if task in ("sst2", "mnli", "qnli", "rte", "wnli", "ax"):
        return {"accuracy": accuracy(preds, labels)}
    raise ValueError(f"unknown GLUE task {task!r}")


def task_score(task: str, metrics: dict[str, float]) -> float:
    """The one number the GLUE leaderboard averages for a task: the mean of its metrics (CoLA: MCC only)."""
    if task == "cola":
        return metrics["mcc"]
    if task == "stsb":
        return (metrics["pearson"] + metrics["spearman"]) / 2.0
    if task in ("mrpc", "qqp"):
        return (metrics["f1"] + metrics["accuracy"]) / 2.0
    return metrics["accuracy"]
