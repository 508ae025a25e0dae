"""The GLUE job end to end on a tiny random BERT: it learns a separable synthetic task, writes GLUE's submission
format, and its HF export gives the same dev predictions in transformers."""
from __future__ import annotations

import json
import random
import re
from pathlib import Path

import numpy as np
import pytest

from bertjax.finetune import glue_data, glue_metrics
from bertjax.finetune.settings import TrainSettings
from tests.conftest import save_tiny_checkpoint

FILLER = "the a movie film plot actor scene story music was is very quite rather and but with of".split()


@pytest.fixture(scope="module")
def tiny_init(tmp_path_factory, minilm_dir) -> str:
    return save_tiny_checkpoint(tmp_path_factory.mktemp("init") / "ckpt", minilm_dir / "vocab.txt", seed=0)


def _sentence(rng: random.Random, keyword: str) -> str:
    words = rng.choices(FILLER, k=rng.randint(3, 12))
    words.insert(rng.randint(0, len(words)), keyword)
    return " ".join(words)


def _write(path: Path, rows: list[list[str]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join("\t".join(r) + "\n" for r in rows), encoding="utf-8")


def _synthetic_glue(root: Path) -> Path:
    """SST-2 (label = which keyword the sentence holds) and MNLI (label = keyword of the hypothesis)."""
    rng = random.Random(0)
    sst = {1: "great", 0: "awful"}
    for split, n in (("train", 160), ("dev", 48)):
        labels = [i % 2 for i in range(n)]
        _write(root / "SST-2" / f"{split}.tsv", [["sentence", "label"]] + [[_sentence(rng, sst[y]), str(y)] for y in labels])
    _write(root / "SST-2" / "test.tsv", [["index", "sentence"]] + [[str(i), _sentence(rng, sst[i % 2])] for i in range(10)])
    nli = {"entailment": "yes", "neutral": "maybe", "contradiction": "no"}

    def mnli_row(i, n_cols, label=None):
        label_word = nli[label] if label else rng.choice(list(nli.values()))
        fields = [str(i)] + ["x"] * 7 + [_sentence(rng, "premise"), _sentence(rng, label_word)]
        return fields + ["x"] * (n_cols - 10 - (1 if label else 0)) + ([label] if label else [])

    names = list(nli)
    _write(root / "MNLI" / "train.tsv", [["h"] * 12] + [mnli_row(i, 12, names[i % 3]) for i in range(60)])
    for m in ("matched", "mismatched"):
        _write(root / "MNLI" / f"dev_{m}.tsv", [["h"] * 16] + [mnli_row(i, 16, names[i % 3]) for i in range(12)])
        _write(root / "MNLI" / f"test_{m}.tsv", [["h"] * 10] + [mnli_row(100 + i, 10) for i in range(5)])
    return root


def test_glue_all_learns_and_writes_submissions(tiny_init, tmp_path):
    from bertjax.finetune import glue

    data = _synthetic_glue(tmp_path / "glue")
    settings = TrainSettings(learning_rate=1e-2, batch_size=16, epochs=6, seed=1, eval_batch_size=16)
    summary = glue.run_all(str(data), str(tmp_path / "work"), settings, init=tiny_init, tasks=("sst2", "mnli", "rte"),
                           max_seq_length=32, eval_each_epoch=True, save_checkpoint=True, export_hf=True)
    # The keyword decides the label: a working loop reaches (near) perfect dev accuracy from a random encoder.
    assert summary["tasks"]["sst2"]["metrics"]["dev"]["accuracy"] >= 0.95
    assert "missing" in summary["tasks"]["rte"] and summary["tasks_scored"] == 2
    mnli = summary["tasks"]["mnli"]
    assert set(mnli["metrics"]) == {"matched", "mismatched"}
    assert mnli["score"] == pytest.approx(np.mean([m["accuracy"] for m in mnli["metrics"].values()]))
    assert summary["glue_average"] == pytest.approx(np.mean([summary["tasks"][t]["score"] for t in ("sst2", "mnli")]))
    table = (tmp_path / "work" / "summary.md").read_text()
    assert "| sst2 |" in table and "rte | data missing" in table and "2/3 tasks" in table

    result = json.loads((tmp_path / "work" / "sst2" / "metrics.json").read_text())
    assert len(result["history"]) == 6 and result["total_steps"] == 6 * 10 and result["warmup_steps"] == 6
    assert result["history"][-1]["train_loss"] < result["history"][0]["train_loss"]
    assert "dev" in result["history"][0] and len(result["seconds_per_epoch"]) == 6
    # The training curve and each epoch's dev metrics, as pretraining writes them.
    records = [json.loads(l) for l in (tmp_path / "work" / "sst2" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "loss" in r] == [50, 60]  # every log_every=50 steps, and the last
    assert [r["step"] for r in records if "eval_accuracy" in r] == [10 * e for e in range(1, 7)]
    assert any(p.name.startswith("events.out.tfevents") for p in (tmp_path / "work" / "sst2" / "tensorboard").iterdir())

    lines = (tmp_path / "work" / "sst2" / "SST-2.tsv").read_text().splitlines()
    assert lines[0] == "index\tprediction" and len(lines) == 11
    assert [line.split("\t")[0] for line in lines[1:]] == [str(i) for i in range(10)]
    assert {line.split("\t")[1] for line in lines[1:]} <= {"0", "1"}
    for name in ("MNLI-m.tsv", "MNLI-mm.tsv"):
        rows = (tmp_path / "work" / "mnli" / name).read_text().splitlines()
        assert [r.split("\t")[0] for r in rows[1:]] == ["100", "101", "102", "103", "104"]
        assert {r.split("\t")[1] for r in rows[1:]} <= {"entailment", "neutral", "contradiction"}
    _check_export(tmp_path / "work" / "sst2", "sst2", data, tiny_init, summary["tasks"]["sst2"]["metrics"]["dev"])


def _hf_logits(hf_dir: Path, feats: dict) -> np.ndarray:
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    model = transformers.BertForSequenceClassification.from_pretrained(str(hf_dir)).eval()
    with torch.no_grad():
        out = model(input_ids=torch.tensor(feats["input_ids"], dtype=torch.long),
                    attention_mask=torch.tensor(feats["input_mask"], dtype=torch.long),
                    token_type_ids=torch.tensor(feats["segment_ids"], dtype=torch.long))
    return out.logits.numpy()


def _check_export(out: Path, task_name: str, data: Path, init: str, dev_metrics: dict) -> None:
    """The job's bertjax checkpoint and its HF export give the same dev logits, and the HF predictions give
    the dev metrics the job reported."""
    import jax

    from bertjax.finetune import glue
    from bertjax.interop.load import load_init, load_pretrained
    from bertjax.model.bert import BertForSequenceClassification

    task = glue_data.get_task(task_name)
    _, tokenizer = load_init(init)
    feats = glue_data.featurize(glue_data.load_task(task, str(data))["dev:dev"], tokenizer, 32)
    fine_tuned = load_pretrained(str(out / "checkpoint"))
    assert set(fine_tuned.params) == {"bert", "classifier"}
    ours = np.asarray(BertForSequenceClassification(fine_tuned.config, task.num_labels).apply(
        {"params": jax.device_get(fine_tuned.params)}, feats["input_ids"], feats["input_mask"], feats["segment_ids"]))
    theirs = _hf_logits(out / "hf", feats)
    np.testing.assert_allclose(theirs, ours, atol=1e-4, rtol=1e-4)
    hf_metrics = glue_metrics.compute_metrics(task_name, glue.predictions_from_logits(task, theirs), feats["labels"])
    config = json.loads((out / "hf" / "config.json").read_text())
    assert config["architectures"] == ["BertForSequenceClassification"]
    if task.is_regression:
        assert hf_metrics == pytest.approx(dev_metrics, abs=1e-3)  # scores agree to float rounding
        assert config["num_labels"] == 1 and config["problem_type"] == "regression"
    else:
        assert hf_metrics == dev_metrics  # the same predicted labels
        assert config["id2label"] == {str(i): label for i, label in enumerate(task.labels)}


def test_regression_export_gives_same_dev_predictions_in_transformers(tiny_init, tmp_path):
    from bertjax.finetune import glue

    data = _synthetic_glue(tmp_path / "glue")
    # STS-B-shaped regression: score 5 if the sentence holds "great" else 0.
    rows = [r.split("\t") for r in (data / "SST-2" / "train.tsv").read_text().splitlines()[1:]]
    header = ["index", "genre", "filename", "year", "old_index", "source1", "source2", "sentence1", "sentence2", "score"]
    for split in ("train", "dev"):
        _write(data / "STS-B" / f"{split}.tsv", [header] + [[str(i)] + ["x"] * 6 + [s, "a film", f"{5.0 * int(y):.3f}"]
                                                            for i, (s, y) in enumerate(rows[:60])])
    settings = TrainSettings(learning_rate=1e-3, batch_size=16, epochs=1, seed=3)
    result = glue.run_task("stsb", str(data), str(tmp_path / "work"), settings, init=tiny_init, max_seq_length=32,
                           save_checkpoint=True, export_hf=True)
    _check_export(tmp_path / "work", "stsb", data, tiny_init, result["metrics"]["dev"])


def _overflowing_stsb(root: Path) -> Path:
    """STS-B rows with finite labels so large that the squared error overflows float32: every gradient is inf."""
    header = ["index", "genre", "filename", "year", "old_index", "source1", "source2", "sentence1", "sentence2", "score"]
    for split in ("train", "dev"):
        _write(root / "STS-B" / f"{split}.tsv", [header] + [[str(i)] + ["x"] * 6 + ["a film", "a movie", "1e30"]
                                                            for i in range(40)])
    return root


@pytest.mark.parametrize("patience, message", [
    # After max_consecutive_nonfinite such steps the job stops before saving anything.
    (3, "3 consecutive steps had a non-finite gradient"),
    # Fewer steps (5) than that, all non-finite: the head never trained, so no score either.
    (10, "every one of the 5 steps had a non-finite gradient"),
])
def test_non_finite_gradients_skip_updates_and_stop_the_job(tiny_init, tmp_path, patience, message):
    from bertjax.finetune import glue
    from bertjax.pretraining.step import TooManyNonFiniteSteps

    data = _overflowing_stsb(tmp_path / "glue")
    settings = TrainSettings(learning_rate=1e-3, batch_size=8, epochs=1, max_consecutive_nonfinite=patience)
    with pytest.raises(TooManyNonFiniteSteps, match=message):
        glue.run_task("stsb", str(data), str(tmp_path / "work"), settings, init=tiny_init, max_seq_length=16,
                      save_checkpoint=True)
    written = [p.name for p in (tmp_path / "work").rglob("*")]
    assert not [n for n in written if n.endswith(".safetensors") or n in ("params", "metrics.json")], written


@pytest.mark.parametrize("key, value, message", [
    ("learning_rate", -1e-3, "learning_rate=-0.001 must be > 0"),
    ("warmup_proportion", 1.5, r"warmup_proportion=1.5 must be in \[0, 1\]"),
    ("batch_size", 0, "batch_size=0 must be >= 1"),
    ("epochs", 0.0, "epochs=0.0 must be > 0"),
])
def test_settings_out_of_range_are_refused(key, value, message):
    with pytest.raises(ValueError, match=message):
        TrainSettings(**{key: value})


def test_cli_finetune_glue(tiny_init, tmp_path, capsys):
    from bertjax.cli import main

    data = _synthetic_glue(tmp_path / "glue")
    rc = main(["finetune", "glue", "--task", "sst2", "--init", tiny_init, "--data", str(data), "--workdir",
               str(tmp_path / "w"), "--epochs", "1", "--batch-size", "16", "--max-seq-length", "32",
               "--learning-rate", "1e-3"])
    assert rc == 0
    out = capsys.readouterr().out.strip().splitlines()
    printed = json.loads(out[-1])
    assert printed["task"] == "sst2" and 0.0 <= printed["metrics"]["dev"]["accuracy"] <= 1.0
    assert (tmp_path / "w" / "SST-2.tsv").exists() and (tmp_path / "w" / "metrics.json").exists()
    # Where everything went, and the dev predictions as `finetune features` writes them.
    assert out[-3].endswith(f"outputs in {tmp_path / 'w'}: SST-2.tsv, checkpoint/, dev_predictions.tsv, "
                            f"metrics.json, metrics.jsonl, run.json, tensorboard/"), out[-3]
    assert out[-2].endswith(f"fine-tuned model: {tmp_path / 'w' / 'checkpoint'} (`bertjax predict --model "
                            f"{tmp_path / 'w'}` uses it; --no-save-checkpoint keeps none)"), out[-2]
    dev = (tmp_path / "w" / "dev_predictions.tsv").read_text().splitlines()
    assert dev[0] == "split\tindex\tprediction\tlabel" and len(dev) == 1 + 48
    # The kept model works with predict as that line says: the dev sentences get the job's own dev predictions.
    assert main(["predict", "--model", str(tmp_path / "w"), "--input", str(data / "SST-2" / "dev.tsv"),
                 "--text-column", "sentence", "--max-seq-length", "32", "--output", str(tmp_path / "p.jsonl")]) == 0
    predicted = [json.loads(line)["label"] for line in (tmp_path / "p.jsonl").read_text().splitlines()]
    assert predicted == [line.split("\t")[2] for line in dev[1:]]
    # One console style: timestamped lines, the compile, progress with learning rate and ETA.
    assert all(re.match(r"\d\d:\d\d:\d\d ", line) for line in out[:-1]), out
    assert any("compiling the train step" in line for line in out)
    assert any(re.search(r" step (\d+)/\1 epoch=1 mean_loss=\S+ \(steps 1-\1\) learning_rate=\S+ examples_per_s=\S+ "
                         r"eta \S+$", line)
               for line in out), out
    # Bad input: a TSV row with the wrong column count is one clear error line naming file and line.
    with open(data / "SST-2" / "train.tsv", "a", encoding="utf-8") as f:
        f.write("one\ttoo\tmany\n")
    rc = main(["finetune", "glue", "--task", "sst2", "--init", tiny_init, "--data", str(data), "--workdir",
               str(tmp_path / "w2")])
    assert rc == 2
    assert f"{data / 'SST-2' / 'train.tsv'}:162: expected 2 tab-separated columns" in capsys.readouterr().err


def test_a_fine_tune_can_be_made_small_and_says_how_its_evaluation_goes(tiny_init, tmp_path, capsys):
    from bertjax.cli import main

    data = _synthetic_glue(tmp_path / "glue")
    assert main(["finetune", "glue", "--task", "sst2", "--init", tiny_init, "--data", str(data), "--workdir",
                 str(tmp_path / "w"), "--batch-size", "8", "--max-seq-length", "32", "--max-train-examples", "40",
                 "--max-steps", "3", "--log-every", "1", "--eval-batch-size", "16", "--eval-every", "2",
                 "--max-eval-examples", "20"]) == 0
    out = capsys.readouterr().out
    assert "training: 40 examples (a seeded subset of 160), 3 steps of 8 = 0.6 epochs (--max-steps 3; 3 asked)" in out
    records = [json.loads(line) for line in (tmp_path / "w" / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], "eval_accuracy" in r) for r in records] == [(1, False), (2, False), (2, True), (3, False)]
    assert re.search(r"eval at step 2: accuracy=\S+", out), out
    # dev (20 of 48 rows) and test (10 rows) predictions, each said before and timed after
    assert re.search(r"predicting 20 rows \(2 batches of 16\) \.\.\.\n.*\n?.*predicted 20 rows in \S+", out), out
    assert len((tmp_path / "w" / "dev_predictions.tsv").read_text().splitlines()) == 1 + 20
    # a batch of --eval-batch-size cut to the 10 rows, rounded up to the devices (10 on one, 16 on 8)
    assert re.search(r"predicting 10 rows \(1 batch of (10|16)\) \.\.\.", out), out


def test_glue_all_with_overwrite_trains_every_task_again(tiny_init, tmp_path, capsys):
    """`glue --task all --overwrite` with new settings removed the earlier run's summary but kept its task folders,
    whose metrics.json the new run then took as those tasks finished: the old scores reported as the new run's."""
    from bertjax.cli import main

    data = _synthetic_glue(tmp_path / "glue")
    (data / "MNLI").rename(tmp_path / "no-mnli")  # SST-2 alone: one task to train
    work = tmp_path / "w"
    argv = ["finetune", "glue", "--task", "all", "--init", tiny_init, "--data", str(data), "--workdir", str(work),
            "--batch-size", "8", "--max-seq-length", "32", "--max-train-examples", "16", "--max-steps", "2",
            "--max-eval-examples", "8", "--no-save-checkpoint"]
    assert main(argv) == 0
    stale = json.loads((work / "sst2" / "metrics.json").read_text())
    (work / "sst2" / "metrics.json").write_text(json.dumps({**stale, "score": 123.0}))  # an earlier run's result
    capsys.readouterr()
    assert main(argv + ["--learning-rate", "1e-3", "--overwrite"]) == 0
    assert "removed the earlier run's outputs (--overwrite)" in capsys.readouterr().out
    summary = json.loads((work / "summary.json").read_text())
    assert summary["tasks"]["sst2"]["score"] != 123.0 and 0 <= summary["tasks"]["sst2"]["score"] <= 1
    assert json.loads((work / "sst2" / "metrics.json").read_text())["score"] == summary["tasks"]["sst2"]["score"]
