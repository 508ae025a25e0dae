"""What a fine-tune reports is what it did: --max-steps ends the loop (no empty epochs with a NaN mean), epochs are
fractional, the rows trained on are counted after --max-train-examples, a resume at the last step says it trained
nothing, and every JSON file written parses under a strict parser (no NaN / Infinity)."""
from __future__ import annotations

import json
import math
import os
import re
import signal

import numpy as np
import pytest

from bertjax.cli import main
from tests.test_glue_job import _synthetic_glue, tiny_init  # noqa: F401 - the fixture


def _strict(text: str):
    """json.loads as JavaScript's JSON.parse reads it: NaN, Infinity and -Infinity are errors."""
    def refuse(name):
        raise ValueError(f"not JSON: {name}")
    return json.loads(text, parse_constant=refuse)


def test_strict_json_writes_non_finite_numbers_as_null(tmp_path):
    from bertjax.runtime import jsonio
    from bertjax.pretraining.metrics import MetricsWriter

    value = {"a": float("nan"), "b": [1.5, float("inf"), np.float32("-inf")], "c": (np.float64(2.0), "x")}
    assert _strict(jsonio.dumps(value)) == {"a": None, "b": [1.5, None, None], "c": [2.0, "x"]}
    with pytest.raises(ValueError):
        _strict(json.dumps(value["a"]))  # what the standard library writes by default
    writer = MetricsWriter(str(tmp_path), total_steps=1)
    writer.write(1, {"loss": float("nan"), "learning_rate": 0.5})
    writer.write_event(1, "goodput", {"seconds": float("inf")})
    writer.close()
    lines = [_strict(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert lines == [{"step": 1, "loss": None, "learning_rate": 0.5},
                     {"step": 1, "event": "goodput", "seconds": None}]


def test_max_steps_ends_the_fine_tune_and_it_reports_what_it_trained(tiny_init, tmp_path, capsys):  # noqa: F811
    data = _synthetic_glue(tmp_path / "glue")  # SST-2: 160 training rows
    work = tmp_path / "w"
    # 40 of the 160 rows at batch 8: 5 steps an epoch; 7 steps are 1.4 epochs of the 3 asked (the default).
    assert main(["finetune", "glue", "--task", "sst2", "--init", tiny_init, "--data", str(data), "--workdir",
                 str(work), "--batch-size", "8", "--max-seq-length", "32", "--max-train-examples", "40",
                 "--max-steps", "7", "--log-every", "1", "--eval-batch-size", "16"]) == 0
    out = capsys.readouterr().out
    assert "training: 40 examples (a seeded subset of 160), 7 steps of 8 = 1.4 epochs (--max-steps 7; 3 asked)" \
        in out, out
    assert "nan" not in out.lower(), out
    assert re.search(r"epoch 1: 5 steps, mean loss \d", out) and re.search(r"epoch 2 \(0\.4 of it\): 7 steps, "
                                                                            r"mean loss \d", out), out
    assert "epoch 3" not in out
    assert re.search(r"trained 7 steps in .*, final epoch loss \d", out), out

    metrics = _strict((work / "metrics.json").read_text())
    # Beside the score, the score of always predicting the most frequent training label (SST-2 here: 80 of each
    # label, so label 0, "0"; half the 48 dev rows are 0).
    assert metrics["majority_baseline"] == {"label": "0", "metrics": {"dev": {"accuracy": 0.5}}}
    assert re.search(r"dev: accuracy=\S+; always predicting the most frequent training label \('0'\): "
                     r"accuracy=0\.5\n", out), out
    assert metrics["num_train_examples"] == 40 and metrics["num_train_available"] == 160
    assert metrics["total_steps"] == 7 and metrics["epochs"] == pytest.approx(1.4)
    assert [(h["epoch"], h["epoch_fraction"], h["steps"]) for h in metrics["history"]] == [(1, 1.0, 5), (2, 0.4, 7)]
    assert all(math.isfinite(h["train_loss"]) for h in metrics["history"])
    records = [_strict(line) for line in (work / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "loss" in r]
    # Where in the data each step ended: step 1 of a 5-step epoch is 0.2 of an epoch, not "epoch 1".
    assert [r["epoch"] for r in steps] == pytest.approx([0.2, 0.4, 0.6, 0.8, 1.0, 1.2, 1.4])
    for path in work.rglob("*.json"):  # every JSON file the run wrote
        _strict(path.read_text())


def test_a_fine_tune_resumed_at_its_last_step_says_it_trained_nothing(tiny_init, tmp_path, capsys):  # noqa: F811
    from bertjax.runtime.console import route_logging_to_console
    from bertjax.finetune import glue_data
    from bertjax.finetune.settings import TrainSettings
    from bertjax.finetune.trainer import Preempted, Trainer, classification_loss
    from bertjax.interop.load import load_init
    from bertjax.model.bert.model import BertForSequenceClassification

    data = _synthetic_glue(tmp_path / "glue")
    ckpt, tokenizer = load_init(tiny_init)
    train = glue_data.featurize(glue_data.load_task(glue_data.get_task("sst2"), str(data))["train"], tokenizer, 32)
    settings = TrainSettings(batch_size=16, epochs=1, max_steps=3, eval_every=3, log_every=1, save_every=0)

    def trainer():
        return Trainer(BertForSequenceClassification(ckpt.config, 2), ckpt.config, ckpt.params, classification_loss,
                       settings)

    def stop_now():  # a SIGTERM during the last step: its state is saved at step 3 of 3
        os.kill(os.getpid(), signal.SIGTERM)
        return {}

    route_logging_to_console()  # as the commands do: the checkpoint's log lines reach the console too
    with pytest.raises(Preempted, match="at step 3 of 3"):
        trainer().train(train, workdir=str(tmp_path / "w"), evaluate=stop_now)
    assert "classifier/kernel is not in the checkpoint; freshly initialised" in capsys.readouterr().out
    info = trainer().train(train, workdir=str(tmp_path / "w"))
    out = capsys.readouterr().out
    assert "resumed from" in out and "(step 3 of 3)" in out
    assert "freshly initialised" not in out, out  # the head is the resumed step's
    assert "nothing left to train: resumed at step 3 of 3" in out, out
    assert "nan" not in out.lower() and "trained 3 steps" not in out and not re.search(r"epoch \d", out), out
    assert info["history"] == [] and info["total_steps"] == 3


def test_quick_runs_limit_or_skip_the_test_predictions(tiny_init, tmp_path, capsys):  # noqa: F811
    data = _synthetic_glue(tmp_path / "glue")  # SST-2: 48 dev rows, 10 test rows
    argv = ["finetune", "glue", "--task", "sst2", "--init", tiny_init, "--data", str(data), "--batch-size", "16",
            "--max-seq-length", "32", "--max-steps", "2", "--eval-batch-size", "16", "--max-eval-examples", "4"]
    assert main([*argv, "--workdir", str(tmp_path / "limited")]) == 0
    out = capsys.readouterr().out
    # --max-eval-examples limits the test rows as it limits the dev rows
    # (in one batch: of --eval-batch-size 16, cut to the rows rounded up to what splits over the devices)
    assert out.count("predicting 4 rows (1 batch of ") == 2 and "predicting 10 rows" not in out, out
    submission = (tmp_path / "limited" / "SST-2.tsv").read_text().splitlines()
    assert submission[0] == "index\tprediction" and [row.split("\t")[0] for row in submission[1:]] == \
        ["0", "1", "2", "3"]
    assert main([*argv, "--workdir", str(tmp_path / "skipped"), "--no-predict-test"]) == 0
    out = capsys.readouterr().out
    assert out.count("predicting 4 rows") == 1, out  # dev only
    assert not (tmp_path / "skipped" / "SST-2.tsv").exists()
    assert (tmp_path / "skipped" / "metrics.json").exists()
