"""The own-data classification job (`finetune classify`): a sequence classifier fine-tuned on the user's files.

The GLUE job's machinery with the user's table in place of a GLUE task: table_data.py reads the files into GLUE's
`Examples`, glue_data.featurize tokenizes them, the shared Trainer trains, and the head is the GLUE one
(BertForSequenceClassification) with a sigmoid loss for multi-label. Writes to the workdir: metrics.json (dev
metrics, the label names, per-epoch loss and time, the settings), dev_predictions.jsonl / test_predictions.jsonl
(one object per row: where it came from, the label(s) or score, the score per label), the training curve, and the
fine-tuned model with the label names as id2label (bertjax checkpoint and/or HF directory).
"""
from __future__ import annotations

import dataclasses
import time

import jax
import numpy as np
import optax
from etils import epath

from bertjax.runtime import jsonio
from bertjax.runtime.console import Console, metric_text
from bertjax.finetune import glue_data, label_metrics, table_data
from bertjax.finetune.settings import TrainSettings, check_metric_for_best
from bertjax.finetune.trainer import Trainer, classification_loss, regression_loss, write_fine_tuned
from bertjax.interop.load import load_init
from bertjax.model import family
from bertjax.runtime.outputs import write_whole


def multi_label_loss(logits, batch):
    """Binary cross-entropy per label, averaged over the labels (HF's BCEWithLogitsLoss for multi-label)."""
    return optax.sigmoid_binary_cross_entropy(logits, batch["labels"]).mean(axis=-1)


LOSSES = {"single_label_classification": classification_loss, "multi_label_classification": multi_label_loss,
          "regression": regression_loss}


# One program each (op by op, the softmax compiled five: ~0.14 s of a short run's compiles), the same values.
_SOFTMAX, _SIGMOID = jax.jit(lambda x: jax.nn.softmax(x, axis=-1)), jax.jit(jax.nn.sigmoid)


def scores(problem: str, logits: np.ndarray) -> np.ndarray:
    """What the pipeline reports per label: softmax (single-label), sigmoid (multi-label), the value (regression)."""
    if problem == "single_label_classification":
        return np.asarray(_SOFTMAX(logits))
    if problem == "multi_label_classification":
        return np.asarray(_SIGMOID(logits))
    return logits[:, 0]


def metrics_of(problem: str, logits: np.ndarray, labels: np.ndarray) -> dict[str, float]:
    if problem == "single_label_classification":
        return label_metrics.single_label(logits.argmax(axis=-1), labels, logits.shape[-1])
    if problem == "multi_label_classification":
        return label_metrics.multi_label(logits > 0, labels)
    return label_metrics.regression(logits[:, 0], labels)


def metric_names(problem: str) -> list[str]:
    """The names `metrics_of` gives for `problem`: its values on a two-row dummy prediction."""
    logits = np.zeros((2, 1 if problem == "regression" else 2), np.float32)
    labels = np.zeros((2, 2)) if problem == "multi_label_classification" else np.array([0, 1])
    return list(metrics_of(problem, logits, labels))


def majority_baseline(problem: str, train_labels: np.ndarray, dev_features: dict | None,
                      names: list[str] | None) -> dict | None:
    """The dev metrics of always predicting the training set's most frequent label (single-label classification
    with a dev set; None otherwise): what a score must beat before it says the model learned anything."""
    if problem != "single_label_classification" or dev_features is None:
        return None
    majority = int(np.argmax(np.bincount(np.asarray(train_labels, np.int64), minlength=len(names))))
    dev_labels = dev_features["labels"]
    return {"label": names[majority], "metrics": {"dev": label_metrics.single_label(
        np.full(len(dev_labels), majority), dev_labels, len(names))}}


def prediction_rows(problem: str, logits: np.ndarray, names: list[str] | None, guids: list[str]) -> list[dict]:
    """One JSON object per row: `where` (file:line), then `label` (single), `labels` (multi) or `score`
    (regression), and `scores` per label name for the classifiers."""
    values = scores(problem, logits)
    rows = []
    for where, value in zip(guids, values):
        if problem == "regression":
            rows.append({"where": where, "score": float(value)})
            continue
        per_label = {name: float(v) for name, v in zip(names, value)}
        chosen = ({"label": names[int(np.argmax(value))]} if problem == "single_label_classification" else
                  {"labels": [name for name, v in zip(names, value) if v > 0.5]})
        rows.append({"where": where, **chosen, "scores": per_label})
    return rows


def _write_jsonl(path: epath.Path, rows: list[dict]) -> None:
    write_whole(path, "".join(jsonio.dumps(row, ensure_ascii=False) + "\n" for row in rows))


def run(train: str, workdir: str, settings: TrainSettings, spec: table_data.TableSpec, *, init: str,
        dev: str | None = None, test: str | None = None, max_seq_length: int = 128, eval_each_epoch: bool = False,
        save_checkpoint: bool = False, export_hf: bool = False) -> dict:
    """Fine-tune on `train`, score `dev`, predict `test`; returns the metrics.json content. Every file is read
    (and every row checked) before the model is loaded, so a bad row fails in seconds."""
    problem = spec.problem
    train_examples, names = table_data.read_split(train, spec)
    dev_examples = table_data.read_split(dev, spec, names)[0].head(settings.max_eval_examples) if dev else None
    test_examples = table_data.read_split(test, spec, names, with_labels=False)[0] if test else None
    check_metric_for_best(settings, metric_names(problem) if dev else None)
    ckpt, tokenizer = load_init(init)
    ckpt.config.check_length(max_seq_length, "--max-seq-length")
    out = epath.Path(workdir)  # a local directory or gs://
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()

    num_labels = 1 if names is None else len(names)
    trainer = Trainer(family.sequence_classifier(ckpt.config, num_labels), ckpt.config, ckpt.params,
                      LOSSES[problem], settings, source=init)
    ckpt.params = {}  # the Trainer holds its own copy: the checkpoint's host copy would double them in memory
    featurize = lambda examples: glue_data.featurize(examples, tokenizer, max_seq_length)  # noqa: E731
    train_features = featurize(train_examples)
    dev_features = featurize(dev_examples) if dev_examples is not None else None

    def evaluate() -> dict:
        return metrics_of(problem, trainer.predict(dev_features), dev_features["labels"])

    per_epoch = []

    def epoch_end(epoch: int, seconds: float) -> dict:
        per_epoch.append(evaluate())
        return per_epoch[-1]

    train_info = trainer.train(train_features, epoch_end=epoch_end if eval_each_epoch and dev else None,
                               workdir=workdir, evaluate=evaluate if dev else None)
    for i, m in enumerate(per_epoch):
        train_info["history"][i]["dev"] = m
    metrics = {}
    if dev_features is not None:
        logits = trainer.predict(dev_features)
        metrics["dev"] = metrics_of(problem, logits, dev_features["labels"])
        _write_jsonl(out / "dev_predictions.jsonl",
                     prediction_rows(problem, logits, names, dev_examples.guids))
    baseline = majority_baseline(problem, train_features["labels"], dev_features, names)
    if baseline:
        Console().line(f"dev: {metric_text(metrics['dev'])}; always predicting the most frequent training label "
                       f"({baseline['label']!r}): {metric_text(baseline['metrics']['dev'])}")
    if test_examples is not None:
        _write_jsonl(out / "test_predictions.jsonl",
                     prediction_rows(problem, trainer.predict(featurize(test_examples)), names, test_examples.guids))

    write_fine_tuned(trainer.params, ckpt, workdir, bertjax_checkpoint=save_checkpoint, hf=export_hf,
                     architecture="BertForSequenceClassification",
                     id2label=None if names is None else dict(enumerate(names)), problem_type=problem,
                     max_seq_length=max_seq_length)
    result = {
        "task": "classify", "problem": problem, "labels": names, "metrics": metrics, "majority_baseline": baseline,
        "train": train, "dev": dev, "test": test, "columns": dataclasses.asdict(spec),
        "num_train_examples": train_info.pop("num_train_rows"), "num_train_available": len(train_examples),
        "max_seq_length": max_seq_length,
        "settings": dataclasses.asdict(settings), **train_info,
        "seconds_per_epoch": [h["seconds"] for h in train_info["history"]],
        "total_seconds": time.perf_counter() - started, "init": init,
    }
    write_whole(out / "metrics.json", jsonio.dumps(result, indent=2))
    return result
