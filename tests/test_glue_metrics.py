"""GLUE metrics on hand-computed cases, cross-checked with scikit-learn / scipy on random data."""
import math

import numpy as np
import pytest

from bertjax.finetune import glue_metrics

# preds/labels: tp=2 (0, 4), fp=1 (1), tn=2 (2, 3), fn=1 (5)
PREDS = [1, 1, 0, 0, 1, 0]
LABELS = [1, 0, 0, 0, 1, 1]


def test_mcc_hand():
    # (tp*tn - fp*fn) / sqrt((tp+fp)(tp+fn)(tn+fp)(tn+fn)) = (4 - 1) / sqrt(3*3*3*3) = 1/3
    assert glue_metrics.matthews_corrcoef(PREDS, LABELS) == pytest.approx(1 / 3)
    assert glue_metrics.matthews_corrcoef([1, 0, 1], [1, 0, 1]) == pytest.approx(1.0)
    assert glue_metrics.matthews_corrcoef([0, 1, 0], [1, 0, 1]) == pytest.approx(-1.0)
    assert glue_metrics.matthews_corrcoef([1, 1, 1], [1, 0, 1]) == 0.0  # a constant prediction has no correlation


def test_f1_and_accuracy_hand():
    assert glue_metrics.f1_binary(PREDS, LABELS) == pytest.approx(2 / 3)  # 2tp / (2tp + fp + fn) = 4/6
    assert glue_metrics.accuracy(PREDS, LABELS) == pytest.approx(4 / 6)
    assert glue_metrics.f1_binary([0, 0], [1, 0]) == 0.0


def test_pearson_spearman_hand():
    assert glue_metrics.pearson([1, 2, 3], [1, 3, 2]) == pytest.approx(0.5)
    # ranks with a tie: x -> [1, 2.5, 2.5, 4]; rho = 4.5 / sqrt(4.5 * 5) = 3 / sqrt(10)
    assert glue_metrics.spearman([1, 2, 2, 3], [1, 2, 3, 4]) == pytest.approx(3 / math.sqrt(10))
    assert glue_metrics.spearman([10, 20, 30], [0.1, 5.0, 7.0]) == pytest.approx(1.0)  # monotone, not linear
    assert math.isnan(glue_metrics.pearson([1, 1, 1], [1, 2, 3]))


def test_against_sklearn_and_scipy():
    sklearn_metrics = pytest.importorskip("sklearn.metrics")
    stats = pytest.importorskip("scipy.stats")
    rng = np.random.default_rng(0)
    for _ in range(5):
        p, y = rng.integers(0, 2, 200), rng.integers(0, 2, 200)
        assert glue_metrics.matthews_corrcoef(p, y) == pytest.approx(sklearn_metrics.matthews_corrcoef(y, p))
        assert glue_metrics.f1_binary(p, y) == pytest.approx(sklearn_metrics.f1_score(y, p))
        x, z = rng.normal(size=100), rng.integers(0, 6, 100).astype(float)  # z has many ties
        assert glue_metrics.pearson(x, z) == pytest.approx(stats.pearsonr(x, z)[0])
        assert glue_metrics.spearman(x, z) == pytest.approx(stats.spearmanr(x, z)[0])
        assert glue_metrics.spearman(z, np.round(x)) == pytest.approx(stats.spearmanr(z, np.round(x))[0])


def test_compute_metrics_per_task_and_score():
    m = glue_metrics.compute_metrics("mrpc", PREDS, LABELS)
    assert m == pytest.approx({"f1": 2 / 3, "accuracy": 4 / 6})
    assert glue_metrics.task_score("mrpc", m) == pytest.approx((2 / 3 + 4 / 6) / 2)
    cola = glue_metrics.compute_metrics("cola", PREDS, LABELS)
    assert glue_metrics.task_score("cola", cola) == pytest.approx(1 / 3)
    sts = glue_metrics.compute_metrics("stsb", [1, 2, 3], [1, 3, 2])
    assert glue_metrics.task_score("stsb", sts) == pytest.approx((0.5 + 0.5) / 2)
    assert glue_metrics.compute_metrics("rte", [0, 1], [0, 0]) == {"accuracy": 0.5}
    with pytest.raises(ValueError, match="unknown GLUE task"):
        glue_metrics.compute_metrics("squad", PREDS, LABELS)
