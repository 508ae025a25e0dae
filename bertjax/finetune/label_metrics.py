"""Metrics of the own-data classifier, in numpy as glue_metrics (the tests cross-check them with scikit-learn):
multi-class accuracy, macro/micro F1 and Matthews correlation; multi-label micro/macro F1 and subset accuracy;
regression Pearson, Spearman and MSE."""
from __future__ import annotations

import numpy as np

from bertjax.finetune.glue_metrics import accuracy, pearson, spearman


def _f1(tp, fp, fn) -> np.ndarray:
    """Per-class F1 from counts; 0 where a class has no true positive (as scikit-learn's zero_division=0)."""
    tp, fp, fn = (np.asarray(x, np.float64) for x in (tp, fp, fn))
    denom = 2 * tp + fp + fn
    return np.where(denom > 0, 2 * tp / np.maximum(denom, 1e-300), 0.0)


def multiclass_mcc(confusion: np.ndarray) -> float:
    """Gorodkin's multi-class Matthews correlation from a confusion matrix [true, predicted] (0 when undefined)."""
    c = confusion.astype(np.float64)
    t, p, correct, s = c.sum(axis=1), c.sum(axis=0), np.trace(c), c.sum()
    denom = np.sqrt((s * s - p @ p) * (s * s - t @ t))
    return 0.0 if denom == 0 else float((correct * s - t @ p) / denom)


def single_label(preds, labels, num_labels: int) -> dict[str, float]:
    """accuracy, macro_f1 (mean over the classes), micro_f1 and mcc of label ids."""
    preds, labels = np.asarray(preds, np.int64), np.asarray(labels, np.int64)
    confusion = np.zeros((num_labels, num_labels), np.int64)
    np.add.at(confusion, (labels, preds), 1)
    tp = np.diag(confusion)
    fp, fn = confusion.sum(axis=0) - tp, confusion.sum(axis=1) - tp
    present = (confusion.sum(axis=0) + confusion.sum(axis=1)) > 0  # scikit-learn averages over the labels seen
    return {"accuracy": accuracy(preds, labels), "macro_f1": float(_f1(tp, fp, fn)[present].mean()),
            "micro_f1": float(_f1(tp.sum(), fp.sum(), fn.sum())), "mcc": multiclass_mcc(confusion)}


def multi_label(preds, labels) -> dict[str, float]:
    """micro_f1, macro_f1 (over every label) and subset accuracy (every label of a row right) of 0/1 matrices."""
    preds, labels = np.asarray(preds) > 0.5, np.asarray(labels) > 0.5
    tp = (preds & labels).sum(axis=0)
    fp, fn = (preds & ~labels).sum(axis=0), (~preds & labels).sum(axis=0)
    return {"micro_f1": float(_f1(tp.sum(), fp.sum(), fn.sum())), "macro_f1": float(_f1(tp, fp, fn).mean()),
            "subset_accuracy": float(np.mean(np.all(preds == labels, axis=1)))}


def regression(preds, labels) -> dict[str, float]:
    preds, labels = np.asarray(preds, np.float64), np.asarray(labels, np.float64)
    return {"pearson": pearson(preds, labels), "spearman": spearman(preds, labels),
            "mse": float(np.mean((preds - labels) ** 2))}
