"""The own-data reader and metrics (no JAX): every format, label names kept, bad rows named by file, line and
column; the metrics against scikit-learn."""
from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from bertjax.finetune import label_metrics, table_data
from bertjax.finetune.table_data import TableSpec

MULTI = TableSpec(problem="multi_label_classification", label_separator="|")
REGRESSION = TableSpec(problem="regression", label_column="score")


def test_csv_labels_kept_as_named_and_lines_counted_across_quoted_newlines(tmp_path):
    path = tmp_path / "train.csv"
    path.write_text('id,text,label\n1,"a film, good",pos\n2,"two\nlines",neg\n\n3,fine,neutral\n', encoding="utf-8")
    examples, names = table_data.read_split(str(path), TableSpec())
    assert names == ["neg", "neutral", "pos"]
    assert examples.text_a == ["a film, good", "two\nlines", "fine"]
    assert examples.labels.tolist() == [2, 0, 1]
    # The row after the two-line field starts on line 5 (4 is blank): where an error would point.
    assert examples.guids == [f"{path}:2", f"{path}:3", f"{path}:6"]


def test_numeric_label_names_sort_as_numbers(tmp_path):
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps({"text": "x", "label": v}) + "\n" for v in (10, 2, 1.0)))
    assert table_data.read_split(str(path), TableSpec())[1] == ["1", "2", "10"]


def test_bad_rows_name_file_line_and_column(tmp_path):
    csv_path = tmp_path / "train.csv"
    csv_path.write_text("text,label\nok,a\n,b\n")
    with pytest.raises(ValueError, match=rf"^{csv_path}:3: column 'text' is empty; expected the text$"):
        table_data.read_split(str(csv_path), TableSpec())

    train, dev = tmp_path / "t.tsv", tmp_path / "d.tsv"
    train.write_text("text\tlabel\nx\ta\ny\tb\n")
    dev.write_text("text\tlabel\nx\ta\ny\tc\n")
    names = table_data.read_split(str(train), TableSpec())[1]
    with pytest.raises(ValueError, match=rf"^{dev}:3: column 'label': label 'c' is not among the training "
                                         rf"file's labels \['a', 'b'\]$"):
        table_data.read_split(str(dev), TableSpec(), names)

    reg = tmp_path / "r.jsonl"
    reg.write_text('{"text": "x", "score": 0.5}\n\n{"text": "y", "score": "high"}\n')
    with pytest.raises(ValueError, match=rf"^{reg}:3: column 'score' is 'high', not a number"):
        table_data.read_split(str(reg), REGRESSION)

    parquet = tmp_path / "p.parquet"
    pq.write_table(pa.table({"text": ["x", None], "label": ["a", "b"]}), parquet)
    with pytest.raises(ValueError, match=rf"^{parquet}: row 2: column 'text' is empty"):
        table_data.read_split(str(parquet), TableSpec())

    with pytest.raises(ValueError, match=r"no column 'sentence'; it has 'text', 'label'"):
        table_data.read_split(str(parquet), TableSpec(text_column="sentence"))
    with pytest.raises(ValueError, match=r"unknown table format '\.txt'"):
        table_data.read_split(str(tmp_path / "x.txt"), TableSpec())


def test_multi_label_from_separator_and_lists(tmp_path):
    csv_path = tmp_path / "train.csv"
    csv_path.write_text("text,label\na,red|blue\nb,\nc,blue\n")
    examples, names = table_data.read_split(str(csv_path), MULTI)
    assert names == ["blue", "red"]
    assert examples.labels.tolist() == [[1, 1], [0, 0], [1, 0]]
    parquet = tmp_path / "dev.parquet"
    pq.write_table(pa.table({"text": ["x", "y"], "label": [["red"], ["green", "blue"]]}), parquet)
    with pytest.raises(ValueError, match=rf"^{parquet}: row 2: column 'label': label 'green' is not among"):
        table_data.read_split(str(parquet), MULTI, names)


def test_text_pair_and_test_file_without_labels(tmp_path):
    path = tmp_path / "test.parquet"
    pq.write_table(pa.table({"premise": ["p1", "p2"], "hypothesis": ["h1", "h2"]}), path)
    spec = TableSpec(text_column="premise", text_pair_column="hypothesis")
    examples, names = table_data.read_split(str(path), spec, ["a", "b"], with_labels=False)
    assert (examples.text_a, examples.text_b, examples.labels, names) == (["p1", "p2"], ["h1", "h2"], None, ["a", "b"])


def test_metrics_equal_scikit_learn():
    sk = pytest.importorskip("sklearn.metrics")
    rng = np.random.default_rng(0)
    labels, preds = rng.integers(0, 4, 200), rng.integers(0, 4, 200)
    preds[:80] = labels[:80]
    got = label_metrics.single_label(preds, labels, 5)  # label 4 never seen: not in the macro mean
    assert got["accuracy"] == pytest.approx(sk.accuracy_score(labels, preds))
    assert got["macro_f1"] == pytest.approx(sk.f1_score(labels, preds, average="macro"))
    assert got["micro_f1"] == pytest.approx(sk.f1_score(labels, preds, average="micro"))
    assert got["mcc"] == pytest.approx(sk.matthews_corrcoef(labels, preds))
    y, p = rng.integers(0, 2, (100, 6)), rng.integers(0, 2, (100, 6))
    p[:50] = y[:50]
    got = label_metrics.multi_label(p, y)
    assert got["micro_f1"] == pytest.approx(sk.f1_score(y, p, average="micro"))
    assert got["macro_f1"] == pytest.approx(sk.f1_score(y, p, average="macro", zero_division=0))
    assert got["subset_accuracy"] == pytest.approx(sk.accuracy_score(y, p))
    stats = pytest.importorskip("scipy.stats")
    x, t = rng.normal(size=50), rng.normal(size=50)
    got = label_metrics.regression(x, t)
    assert got["pearson"] == pytest.approx(stats.pearsonr(x, t)[0])
    assert got["spearman"] == pytest.approx(stats.spearmanr(x, t)[0])
    assert got["mse"] == pytest.approx(sk.mean_squared_error(t, x))
