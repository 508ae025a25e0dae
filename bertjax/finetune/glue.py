"""The GLUE fine-tuning job: one task (or all nine) from a pretrained encoder.

A task writes to its workdir (`all`: one <workdir>/<task>/ each): metrics.json (metrics per dev split, the GLUE task score, per-epoch
loss and wall time, the settings), the GLUE submission file(s) for the test split(s) (<TASK>.tsv with
`index<TAB>prediction`, label names as GLUE expects; MNLI-m/MNLI-mm, and AX.tsv when diagnostic/ is present),
metrics.jsonl and tensorboard/ (the training curve), and optionally the fine-tuned model (bertjax checkpoint and/or
HF directory). `all` adds summary.{json,md}.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import time

import numpy as np

from bertjax.runtime import jsonio
from bertjax.runtime.console import Console, metric_text
from bertjax.finetune import glue_data, glue_metrics, run_record
from bertjax.finetune.settings import TrainSettings, check_metric_for_best
from bertjax.finetune.trainer import (
    Trainer,
    classification_loss,
    regression_loss,
    write_fine_tuned,
)
from bertjax.interop.load import load_init
from bertjax.model import family
from bertjax.runtime.input_files import read_json
from bertjax.runtime.outputs import open_whole

log = logging.getLogger(__name__)


def predictions_from_logits(task: glue_data.GlueTask, logits: np.ndarray) -> np.ndarray:
    return logits[:, 0] if task.is_regression else np.argmax(logits, axis=-1)


def flat(metrics: dict) -> dict:
    """{split: {name: value}} as one dict; the names carry the split where a task has several (MNLI)."""
    return {(f"{split}_{k}" if len(metrics) > 1 else k): v for split, values in metrics.items()
            for k, v in values.items()}


def metric_names(task: glue_data.GlueTask) -> list[str]:
    """What the job's evaluation names (flat): the task's metric function on a two-row dummy prediction."""
    return list(flat({split.name: glue_metrics.compute_metrics(task.name, np.array([0, 1]), np.array([0, 1]))
                      for split in task.splits}))


def majority_baseline(task: glue_data.GlueTask, features: dict) -> dict | None:
    """The dev metrics of always predicting the training set's most frequent label (None for regression): what a
    score must beat before it says the model learned anything (MRPC's all-positive accuracy is 0.684)."""
    if task.is_regression:
        return None
    majority = int(np.argmax(np.bincount(features["train"]["labels"].astype(np.int64))))
    metrics = {split.name: glue_metrics.compute_metrics(
        task.name, np.full(len(features[f"dev:{split.name}"]["labels"]), majority),
        features[f"dev:{split.name}"]["labels"]) for split in task.splits}
    return {"label": glue_data.label_name(task, majority), "metrics": metrics}


def _read_diagnostic(data: str) -> glue_data.Examples | None:
    """GLUE's AX set (diagnostic/diagnostic.tsv: index, sentence1, sentence2), scored with the MNLI model."""
    path = os.path.join(data, "diagnostic", "diagnostic.tsv")
    if data.startswith("tfds") or not os.path.exists(path):
        return None
    layout = glue_data.Layout(3, True, 1, 2, None, index=0)
    return glue_data.read_split(dataclasses.replace(glue_data.get_task("mnli"), skip_short_rows=False), path, layout)


def run_task(task_name: str, data: str, workdir: str, settings: TrainSettings, *, init: str | None = None,
             loaded=None, max_seq_length: int = 128, eval_each_epoch: bool = False, save_checkpoint: bool = False,
             export_hf: bool = False) -> dict:
    """Fine-tune and evaluate one task, writing into `workdir`; returns the metrics.json content."""
    task = glue_data.get_task(task_name)
    splits = glue_data.load_task(task, data)
    check_metric_for_best(settings, metric_names(task))
    ckpt, tokenizer = loaded if loaded is not None else load_init(init)
    ckpt.config.check_length(max_seq_length, "--max-seq-length")
    out_dir = workdir
    os.makedirs(out_dir, exist_ok=True)
    started = time.perf_counter()

    module = family.sequence_classifier(ckpt.config, task.num_labels)
    loss = regression_loss if task.is_regression else classification_loss
    trainer = Trainer(module, ckpt.config, ckpt.params, loss, settings, source=init or "checkpoint")
    features = {name: glue_data.featurize(ex, tokenizer, max_seq_length) for name, ex in splits.items()}
    if not settings.predict_test:
        features = {name: f for name, f in features.items() if not name.startswith("test:")}
    if settings.max_eval_examples:  # dev and test rows alike
        features.update({name: {k: v[:settings.max_eval_examples] for k, v in f.items()}
                         for name, f in features.items() if name.startswith(("dev:", "test:"))})

    def evaluate(write_predictions: bool = False) -> dict:
        metrics, rows = {}, []
        for split in task.splits:
            feats = features[f"dev:{split.name}"]
            preds = predictions_from_logits(task, trainer.predict(feats))
            metrics[split.name] = glue_metrics.compute_metrics(task.name, preds, feats["labels"])
            rows += [f"{split.name}\t{guid}\t{glue_data.label_name(task, pred)}\t{glue_data.label_name(task, label)}\n"
                     for guid, pred, label in zip(splits[f"dev:{split.name}"].guids, preds, feats["labels"])]
        if write_predictions:  # as `finetune features` writes them
            with open_whole(os.path.join(out_dir, "dev_predictions.tsv"), "w", encoding="utf-8") as f:
                f.write("split\tindex\tprediction\tlabel\n" + "".join(rows))
        return metrics

    per_epoch = []

    def epoch_end(epoch: int, seconds: float) -> dict:
        per_epoch.append(evaluate())
        return flat(per_epoch[-1])

    train_info = trainer.train(features["train"], epoch_end=epoch_end if eval_each_epoch else None,
                               workdir=out_dir, evaluate=lambda: flat(evaluate()))
    metrics = evaluate(write_predictions=True)
    baseline = majority_baseline(task, features)
    if baseline:
        Console().line(f"dev: {metric_text(flat(metrics))}; always predicting the most frequent training label "
                       f"({baseline['label']!r}): {metric_text(flat(baseline['metrics']))}")
    for i, m in enumerate(per_epoch):
        train_info["history"][i]["dev"] = m
    score = float(np.mean([glue_metrics.task_score(task.name, m) for m in metrics.values()]))

    for split in task.splits:
        test = f"test:{split.name}"
        if test in features:
            preds = predictions_from_logits(task, trainer.predict(features[test]))
            guids = splits[test].guids[:len(preds)]
            glue_data.write_submission(task, os.path.join(out_dir, split.submission), guids, preds)
    if task.name == "mnli" and settings.predict_test and (ax := _read_diagnostic(data)) is not None:
        ax_features = glue_data.featurize(ax, tokenizer, max_seq_length)
        if settings.max_eval_examples:
            ax_features = {k: v[:settings.max_eval_examples] for k, v in ax_features.items()}
        preds = predictions_from_logits(task, trainer.predict(ax_features))
        glue_data.write_submission(task, os.path.join(out_dir, "AX.tsv"), ax.guids[:len(preds)], preds)

    id2label = None if task.is_regression else dict(enumerate(task.labels))
    write_fine_tuned(trainer.params, ckpt, out_dir, bertjax_checkpoint=save_checkpoint, hf=export_hf,
                     architecture="BertForSequenceClassification", id2label=id2label,
                     max_seq_length=max_seq_length)

    result = {
        "task": task.name, "metrics": metrics, "score": score, "majority_baseline": baseline,
        "num_train_examples": train_info.pop("num_train_rows"), "num_train_available": len(splits["train"]),
        "max_seq_length": max_seq_length,
        "settings": dataclasses.asdict(settings), **train_info,
        "seconds_per_epoch": [h["seconds"] for h in train_info["history"]],
        "total_seconds": time.perf_counter() - started, "init": init,
    }
    with open_whole(os.path.join(out_dir, "metrics.json"), "w") as f:
        jsonio.dump(result, f, indent=2)
    return result


def run_all(data: str, workdir: str, settings: TrainSettings, *, init: str, tasks=glue_data.TASKS, **kwargs) -> dict:
    """Every task in `tasks` whose data exists; summary.json / summary.md with the GLUE average."""
    for name in tasks:  # every task's before the first trains (a refusal at the last would waste the others)
        check_metric_for_best(settings, metric_names(glue_data.get_task(name)))
    loaded = load_init(init)
    rows = {}
    for name in tasks:
        done = os.path.join(workdir, name, "metrics.json")
        if os.path.exists(done):  # finished by an earlier, interrupted run of the same command
            result = read_json(done, "a finished task's metrics (JSON)")
            log.info("%s: finished earlier (%s)", name, done)
            rows[name] = {"metrics": result["metrics"], "score": result["score"]}
            continue
        try:
            result = run_task(name, data, os.path.join(workdir, name), settings, init=init, loaded=loaded, **kwargs)
        except FileNotFoundError as error:
            log.warning("%s: skipped (%s)", name, error)
            rows[name] = {"missing": str(error)}
            continue
        rows[name] = {"metrics": result["metrics"], "score": result["score"]}
    done = [r["score"] for r in rows.values() if "score" in r]
    summary = {"tasks": rows, "glue_average": float(np.mean(done)) if done else None,
               "tasks_scored": len(done), "tasks_total": len(tasks)}
    run_record.write_summary(workdir, summary, summary_table(summary))
    return summary


def summary_table(summary: dict) -> str:
    """Markdown table: task, metrics (x100), score; the average line says how many tasks it covers."""
    lines = ["| task | metrics | score |", "|---|---|---|"]
    for name, row in summary["tasks"].items():
        if "score" not in row:
            lines.append(f"| {name} | data missing | - |")
            continue
        parts = [f"{split} {k} {100 * v:.2f}" if len(row["metrics"]) > 1 else f"{k} {100 * v:.2f}"
                 for split, m in row["metrics"].items() for k, v in m.items()]
        lines.append(f"| {name} | {', '.join(parts)} | {100 * row['score']:.2f} |")
    avg = summary["glue_average"]
    label = "GLUE average" if summary["tasks_scored"] == summary["tasks_total"] else \
        f"average of the {summary['tasks_scored']}/{summary['tasks_total']} tasks with data (not the GLUE score)"
    lines.append(f"| **{label}** | | {'-' if avg is None else f'{100 * avg:.2f}'} |")
    return "\n".join(lines) + "\n"
