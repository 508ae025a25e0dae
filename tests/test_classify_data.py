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


def test_a_field_opened_by_an_unbalanced_quote_is_named_not_swallowed(tmp_path):
    """A quote that opens a field and never closes would take every later line into that field (fewer rows than
    lines, read without a word); one that closes mid-field would drop the quotes from the text."""
    unclosed = tmp_path / "unclosed.csv"
    unclosed.write_text('id,text\n1,fine\n2,"he said hi\n3,bye\n4,ok\n')
    with pytest.raises(ValueError, match=rf'^{unclosed}:3: the quote that opens a field here is never closed \(the '
                                         r'field would run to the end of the file, line 5\); a quote inside a field '
                                         r'is written "" in a field wrapped in quotes$'):
        table_data.read_rows(str(unclosed), ["text"])
    mid_field = tmp_path / "mid.csv"
    mid_field.write_text('text,label\nok,a\n"he said" hi,b\n')
    with pytest.raises(ValueError, match=rf"^{mid_field}:3: the quote that opens a field here closes before the "
                                         rf"field ends \(line 3: "):
        table_data.read_split(str(mid_field), TableSpec())
    # Quotes as a CSV writer writes them (doubled inside a quoted field, a line break inside one) are one row each.
    written = tmp_path / "written.csv"
    written.write_text('text\n"he said ""hi"""\n"two\nlines"\nsay "so"\n')
    assert [row["text"] for _, row in table_data.read_rows(str(written), ["text"])] == \
        ['he said "hi"', "two\nlines", 'say "so"']


def test_files_as_users_have_them_a_bom_read_and_bad_bytes_duplicates_and_non_texts_named(tmp_path):
    bom = b"\xef\xbb\xbf"  # Excel's "CSV UTF-8" starts with the byte-order mark
    for name, body in (("excel.csv", "text,label\nx,a\ny,b\n"), ("excel.tsv", "text\tlabel\nx\ta\ny\tb\n"),
                       ("bom.jsonl", '{"text": "x", "label": "a"}\n{"text": "y", "label": "b"}\n')):
        (tmp_path / name).write_bytes(bom + body.encode())
        examples, names = table_data.read_split(str(tmp_path / name), TableSpec())
        assert (examples.text_a, names) == (["x", "y"], ["a", "b"]), name

    latin1 = tmp_path / "latin1.csv"
    latin1.write_bytes("text,label\nok,a\ncaf\xe9,b\n".encode("latin-1"))
    with pytest.raises(ValueError, match=rf"^{latin1}:3: byte 0xe9 is not UTF-8; save the file as UTF-8$"):
        table_data.read_split(str(latin1), TableSpec())

    twice = "column 'text' is named 2 times; each column a command reads must be named once"
    header = tmp_path / "header.csv"
    header.write_text("text,label,text\nx,a,y\n")
    with pytest.raises(ValueError, match=rf"^{header}: {twice}$"):
        table_data.read_split(str(header), TableSpec())
    keys = tmp_path / "keys.jsonl"
    keys.write_text('{"text": "x", "label": "a"}\n{"text": "y", "label": "b", "text": "z"}\n')
    with pytest.raises(ValueError, match=rf"^{keys}:2: {twice}$"):
        table_data.read_split(str(keys), TableSpec())
    parquet = tmp_path / "twice.parquet"
    pq.write_table(pa.Table.from_arrays([pa.array(["x"]), pa.array(["y"]), pa.array(["a"])],
                                        names=["text", "text", "label"]), parquet)
    with pytest.raises(ValueError, match=rf"^{parquet}: {twice}$"):
        table_data.read_split(str(parquet), TableSpec())
    unused = tmp_path / "unused.csv"  # a column named twice that no command reads is no question
    unused.write_text("note,text,label,note\n1,x,a,2\n3,y,b,4\n")
    assert table_data.read_split(str(unused), TableSpec())[0].text_a == ["x", "y"]

    # A number where the text should be: training and predict refuse it by the same check.
    numbers = tmp_path / "numbers.jsonl"
    numbers.write_text('{"text": "x", "label": "a"}\n{"text": 5, "label": "b"}\n')
    expected = rf"^{numbers}:2: column 'text' is 5, not a text; expected a string$"
    with pytest.raises(ValueError, match=expected):
        table_data.read_split(str(numbers), TableSpec())
    from bertjax.finetune.cli import _input_columns
    with pytest.raises(ValueError, match=expected):
        _input_columns(str(numbers), ["text"])


def test_a_training_file_with_one_label_is_refused_for_single_label_classification(tmp_path):
    path = tmp_path / "train.csv"
    path.write_text("text,label\nx,pos\ny,pos\n")
    with pytest.raises(ValueError, match=rf"^{path}: column 'label' holds one label, 'pos', in every row; a "
                                         r"classifier needs at least 2 \(numbers to predict: --problem regression\)$"):
        table_data.read_split(str(path), TableSpec())
    # A dev file with one of the training file's labels, and regression's one value, are fine.
    assert table_data.read_split(str(path), TableSpec(), ["neg", "pos"])[0].labels.tolist() == [1, 1]
    same = tmp_path / "same.csv"
    same.write_text("text,score\nx,1.5\ny,1.5\n")
    assert table_data.read_split(str(same), REGRESSION)[0].labels.tolist() == [1.5, 1.5]


@pytest.mark.parametrize("other", [" 1", "01", "1.0", "1e0"])
def test_one_label_written_two_ways_is_refused_naming_both(tmp_path, capsys, other):
    """" 1", "01" and "1.0" beside "1" became classes of their own, each with a share of the rows."""
    from bertjax.cli import main

    path = tmp_path / "train.csv"
    path.write_text(f"text,label\na,1\nb,0\nc,\"{other}\"\nd,0\n")
    said = rf"^{path}:4: column 'label': label '{other}' is '1' \({path}:2\) written another way; write each label " \
           r"one way \(they would be two classes\)$"
    with pytest.raises(ValueError, match=said):
        table_data.read_split(str(path), TableSpec())
    # The command: one line, exit 2, before the checkpoint loads (there is none).
    assert main(["finetune", "classify", "--train", str(path), "--init", "none", "--workdir",
                 str(tmp_path / "w")]) == 2
    assert "written another way" in capsys.readouterr().err.strip().splitlines()[-1]
    # Multi-label, JSON Lines: the same rule for each name of a row's list.
    multi = tmp_path / "multi.jsonl"
    multi.write_text(json.dumps({"text": "a", "label": ["1", "2"]}) + "\n"
                     + json.dumps({"text": "b", "label": [other.strip() if other != " 1" else "01"]}) + "\n")
    with pytest.raises(ValueError, match=r"multi.jsonl:2: column 'label': label '.*' is '1' \(.*multi.jsonl:1\) "
                                         r"written another way"):
        table_data.read_split(str(multi), TableSpec(problem="multi_label_classification"))
    # A dev file's other spelling: the training file's own is named.
    dev = tmp_path / "dev.csv"
    dev.write_text("text,label\nx,1.0\n")
    with pytest.raises(ValueError, match=r"dev.csv:2: column 'label': label '1.0' is not among the training file's "
                                         r"labels \['0', '1'\] \(it writes this one '1'\)"):
        table_data.read_split(str(dev), TableSpec(), ["0", "1"])


@pytest.mark.parametrize("kind", ["parquet", "jsonl"])
def test_a_list_in_a_single_label_column_is_refused_naming_the_row(tmp_path, kind):
    """A Parquet list (or a JSON one) became the class name "['0']"."""
    if kind == "parquet":
        path = tmp_path / "train.parquet"
        pq.write_table(pa.table({"text": ["a", "b"], "label": [["0"], ["1"]]}), path)
        where = f"{path}: row 1"
    else:
        path = tmp_path / "train.jsonl"
        path.write_text(json.dumps({"text": "a", "label": ["0"]}) + "\n" + json.dumps({"text": "b", "label": "1"}))
        where = f"{path}:1"
    with pytest.raises(ValueError, match=rf"^{where}: column 'label' is \['0'\], not one label; single-label "
                                         r"classification takes one label a row \(a list per row: --problem "
                                         r"multi_label_classification\)$"):
        table_data.read_split(str(path), TableSpec())
    if kind == "parquet":  # what the lists are for
        assert table_data.read_split(str(path), TableSpec(problem="multi_label_classification"))[1] == ["0", "1"]


def test_a_table_named_for_another_format_than_its_bytes_is_told_as_what_it_is(tmp_path):
    """The one reader's detection, both ways round: a CSV or a gzip named .parquet, Parquet named .csv; a .csv.gz
    is a CSV, read decompressed."""
    import gzip

    csv_text = "text,label\na,0\nb,1\n"
    (tmp_path / "csv.parquet").write_text(csv_text)
    (tmp_path / "gz.parquet").write_bytes(gzip.compress(csv_text.encode()))
    pq.write_table(pa.table({"text": ["a"], "label": ["0"]}), tmp_path / "parquet.csv")
    (tmp_path / "train.csv.gz").write_bytes(gzip.compress(csv_text.encode()))
    for name, said in (("csv.parquet", "text"), ("gz.parquet", "gzip-compressed")):
        with pytest.raises(ValueError, match=rf"{name}: named as Parquet but its bytes are {said} \(no PAR1 magic\)"):
            table_data.read_split(str(tmp_path / name), TableSpec())
    with pytest.raises(ValueError, match=r"parquet.csv: a Parquet file, not text; expected a CSV file \(UTF-8\)"):
        table_data.read_split(str(tmp_path / "parquet.csv"), TableSpec())
    assert table_data.read_split(str(tmp_path / "train.csv.gz"), TableSpec())[1] == ["0", "1"]


def test_features_are_cut_to_the_longest_rows_length_bucket_as_every_batch_is():
    """classify.cut_to_longest: the token columns past the longest row's bucket (padding no batch reaches) are
    dropped and the rest kept bit for bit; never wider than given; labels untouched; the wide arrays not viewed."""
    from bertjax.finetune.classify import cut_to_longest

    rng = np.random.default_rng(0)
    lengths = np.array([5, 40, 33, 2])   # the longest, 40 tokens, is in the 64 bucket of 32
    mask = (np.arange(128)[None, :] < lengths[:, None]).astype(np.int32)
    features = {"input_ids": rng.integers(5, 300, (4, 128)).astype(np.int32) * mask, "input_mask": mask,
                "segment_ids": np.zeros((4, 128), np.int32), "labels": np.array([0, 1, 1, 0], np.int32)}
    cut = cut_to_longest(features, 32)
    for key in ("input_ids", "input_mask", "segment_ids"):
        assert cut[key].shape == (4, 64) and not np.shares_memory(cut[key], features[key])
        np.testing.assert_array_equal(cut[key], features[key][:, :64])
        assert not features[key][:, 64:].any()   # what was dropped was padding
    assert cut["labels"] is features["labels"]
    assert cut_to_longest(features, 256)["input_ids"].shape == (4, 128)   # a bucket wider than the rows: as given
    short = {k: (v[:, :16] if v.ndim == 2 else v) for k, v in features.items()}
    short["input_mask"] = np.ones((4, 16), np.int32)
    assert cut_to_longest(short, 32)["input_ids"].shape == (4, 16)
