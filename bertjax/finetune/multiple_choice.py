"""The SWAG multiple-choice job: fine-tune BertForMultipleChoice on train.csv, score val.csv, predict test.csv.

Each example's four (context, ending) rows go through the encoder; the pooled [CLS] of each gets one score
(Dense(1)), and a softmax across the four is trained with cross-entropy on the gold ending (the shared Trainer and
its classification loss: the logits are [batch, 4]). Writes to <workdir>/: metrics.json (val accuracy, per-epoch
loss and wall time, the settings), val_predictions.csv and test_predictions.csv (id, prediction, and for val the
label and the four scores), and optionally the model (bertjax checkpoint; HF BertForMultipleChoice directory).
"""
from __future__ import annotations

import csv
import dataclasses
import logging
import os
import time

import numpy as np

from bertjax.runtime import jsonio
from bertjax.finetune import glue_metrics, swag_data
from bertjax.finetune.settings import TrainSettings, check_metric_for_best
from bertjax.finetune.trainer import Trainer, classification_loss, write_fine_tuned
from bertjax.model import family
from bertjax.runtime.outputs import open_whole

log = logging.getLogger(__name__)


def write_predictions(path: str, examples: swag_data.ChoiceExamples, logits: np.ndarray) -> None:
    with open_whole(path, "w", encoding="utf-8", newline="") as f:
        writer = csv.writer(f)
        has_labels = examples.labels is not None
        writer.writerow(["id", "prediction"] + (["label"] if has_labels else [])
                        + [f"score{i}" for i in range(logits.shape[1])])
        for i, row in enumerate(logits):
            writer.writerow([examples.ids[i], int(np.argmax(row))] + ([int(examples.labels[i])] if has_labels else [])
                            + [f"{s:.5f}" for s in row])


def choice_metrics(logits: np.ndarray, labels) -> dict[str, float]:
    return {"accuracy": glue_metrics.accuracy(np.argmax(logits, axis=-1), labels)}


def run(data: str, workdir: str, settings: TrainSettings, *, init: str | None = None, loaded=None,
        max_seq_length: int = 128, save_checkpoint: bool = False, export_hf: bool = False) -> dict:
    """Fine-tune on <data>/train.csv, evaluate <data>/val.csv, predict <data>/test.csv if present."""
    from bertjax.interop.load import load_init

    train = swag_data.read_swag(os.path.join(data, "train.csv"))
    if train.labels is None:
        raise ValueError(f"{os.path.join(data, 'train.csv')}: no label column; the training file needs one")
    val = swag_data.head(swag_data.read_swag(os.path.join(data, "val.csv")), settings.max_eval_examples)
    test_path = os.path.join(data, "test.csv")
    test = swag_data.head(swag_data.read_swag(test_path), settings.max_eval_examples) \
        if os.path.exists(test_path) and settings.predict_test else None
    check_metric_for_best(settings, None if val.labels is None else list(choice_metrics(np.zeros((2, 2)), [0, 1])))
    ckpt, tokenizer = loaded if loaded is not None else load_init(init)
    ckpt.config.check_length(max_seq_length, "--max-seq-length")
    os.makedirs(workdir, exist_ok=True)
    started = time.perf_counter()

    trainer = Trainer(family.multiple_choice(ckpt.config), ckpt.config, ckpt.params, classification_loss, settings,
                      source=init or "checkpoint")
    features = {"train": swag_data.featurize(train, tokenizer, max_seq_length),
                "val": swag_data.featurize(val, tokenizer, max_seq_length)}

    def evaluate() -> dict:
        return choice_metrics(trainer.predict(features["val"]), val.labels)

    train_info = trainer.train(features["train"], workdir=workdir,
                               evaluate=evaluate if val.labels is not None else None)

    val_logits = trainer.predict(features["val"])
    write_predictions(os.path.join(workdir, "val_predictions.csv"), val, val_logits)
    metrics = {}
    if val.labels is not None:
        metrics.update(choice_metrics(val_logits, val.labels))
    if test is not None:
        test_logits = trainer.predict(swag_data.featurize(test, tokenizer, max_seq_length))
        write_predictions(os.path.join(workdir, "test_predictions.csv"), test, test_logits)
    write_fine_tuned(trainer.params, ckpt, workdir, bertjax_checkpoint=save_checkpoint, hf=export_hf,
                     architecture="BertForMultipleChoice", max_seq_length=max_seq_length)

    result = {"metrics": metrics, "num_train_examples": train_info.pop("num_train_rows"),
              "num_train_available": len(train), "num_val_examples": len(val),
              "num_test_examples": 0 if test is None else len(test), "max_seq_length": max_seq_length,
              "settings": dataclasses.asdict(settings), **train_info,
              "seconds_per_epoch": [h["seconds"] for h in train_info["history"]],
              "total_seconds": time.perf_counter() - started, "init": init}
    with open_whole(os.path.join(workdir, "metrics.json"), "w") as f:
        jsonio.dump(result, f, indent=2)
    log.info("multiple choice: %s", metrics)
    return result
