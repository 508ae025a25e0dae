"""Input-pipeline benchmark (issue 3): figures as ratios to google-research/bert's create_pretraining_data.py.

Reference, measured earlier on this machine with the original script (single process, whole corpus in RAM):
WikiText-2 test x4 (~5 MB, original one-sentence-per-line format), max_seq_length 128, max_predictions 20,
dupe_factor 5 -> 55,871 instances in ~24.8 s wall (~2,250 instances/s), peak RSS ~930 MB.

Measures here:
  (a) raw text -> masked batches in the training pipeline (tokenize + pair + mask + batch), seq/s
  (b) TFRecords -> parsed batches, seq/s
  (c) `bertjax data create` wall time and peak RSS (fresh process), then peak RSS on a 10x larger corpus

    .venv/bin/python bench/input_pipeline.py [--wikitext ../shared/data/wikitext-2/wiki.test.raw] [--skip-10x]
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REFERENCE_SECONDS = 24.8
REFERENCE_INSTANCES = 55_871
REFERENCE_RATE = 2_250.0
REFERENCE_RSS_MB = 930.0
TARGET_A, TARGET_B = 4_500.0, 20_000.0

ROOT = Path(__file__).resolve().parents[1]


def write_original_format(raw: str, out_dir: Path, copies: int) -> list[str]:
    """WikiText paragraphs -> the original format (sentence per line, blank line between articles), `copies` files."""
    from bertjax.data.corpus import CorpusConfig, documents_from_files

    docs = documents_from_files([raw], CorpusConfig(inputs=(raw,), format="wikitext"))
    text = "".join("\n".join(s.decode() for s in d["sentences"]) + "\n\n" for d in docs.as_numpy_iterator())
    paths = []
    for i in range(copies):
        path = out_dir / f"corpus-{i:03d}.txt"
        path.write_text(text, encoding="utf-8")
        paths.append(str(path))
    return paths


def run_create(corpus_glob: str, vocab: str, out: Path, extra: list[str]) -> tuple[float, float, str]:
    """`bertjax data create` in a fresh process: (wall seconds, peak RSS MB, last log line)."""
    cmd = [sys.executable, "-m", "bertjax.cli", "data", "create", "--input", corpus_glob, "--vocab", vocab,
           "--out", str(out), "--max-seq-length", "128", "--max-predictions", "20", "--dupe-factor", "5",
           "--shards", "8", *extra]
    # A wrapper process reports the peak RSS of its only child, so each run is measured on its own.
    wrapper = ("import resource, subprocess, sys; r = subprocess.run(sys.argv[1:]); "
               "print('PEAK_RSS_KB', resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, file=sys.stderr); "
               "sys.exit(r.returncode)")
    start = time.time()
    proc = subprocess.run([sys.executable, "-c", wrapper, *cmd], capture_output=True, text=True, cwd=ROOT,
                          env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"})
    wall = time.time() - start
    if proc.returncode:
        raise SystemExit(f"data create failed:\n{proc.stderr[-3000:]}")
    rss_kb = int(proc.stderr.split("PEAK_RSS_KB")[-1].split()[0])
    return wall, rss_kb / 1024, (proc.stdout.strip().splitlines() or [""])[-1]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--wikitext", default=str(ROOT / ".." / "shared" / "data" / "wikitext-2" / "wiki.test.raw"))
    parser.add_argument("--vocab", default=str(ROOT / ".." / "shared" / "data" / "bert" / "uncased_L-4_H-256_A-4"
                                               / "vocab.txt"))
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--doc-buffer", type=int, default=200)
    parser.add_argument("--skip-10x", action="store_true", help="skip the 10x-corpus RSS run (slow)")
    args = parser.parse_args(argv)
    for path in (args.wikitext, args.vocab):
        if not Path(path).exists():
            raise SystemExit(f"missing {path} (the shared data is only present beside the project)")

    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import numpy as np
    import tensorflow as tf

    from bertjax.data.pipeline import PretrainingDataConfig, make_pretraining_dataset

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        (tmp / "x4").mkdir()
        files = write_original_format(args.wikitext, tmp / "x4", 4)
        size_mb = sum(Path(f).stat().st_size for f in files) / 1e6
        print(f"corpus: WikiText-2 test x4 in the original format, {size_mb:.2f} MB, {len(files)} files; "
              f"{os.cpu_count()} CPU cores (shared)")

        # (c) data create, fresh process, same flags as the reference.
        wall, rss, log = run_create(str(tmp / "x4" / "*.txt"), args.vocab, tmp / "records",
                                    ["--doc-buffer", str(args.doc_buffer)])
        print(f"  {log}")
        examples = int(log.split("wrote ")[1].split(" ")[0])
        print(f"(c) data create: {examples} instances in {wall:.1f} s wall ({examples / wall:,.0f} inst/s), "
              f"peak RSS {rss:.0f} MB | reference {REFERENCE_INSTANCES} in {REFERENCE_SECONDS} s: "
              f"speed-up x{REFERENCE_SECONDS / wall:.2f} (target >= x2), RSS ratio {rss / REFERENCE_RSS_MB:.2f}")

        # (a) raw text -> masked batches, dynamic masking, 3 epochs after one warm-up epoch.
        config = PretrainingDataConfig(inputs=(str(tmp / "x4" / "*.txt"),), vocab_path=args.vocab,
                                       max_seq_length=128, max_predictions_per_seq=20, masking="dynamic",
                                       doc_buffer_size=args.doc_buffer, num_epochs=None)
        it = make_pretraining_dataset(config, args.batch).as_numpy_iterator()
        per_epoch = REFERENCE_INSTANCES // 5
        for _ in range(per_epoch // args.batch):
            next(it)
        count, start = 0, time.time()
        while count < 3 * per_epoch:
            count += len(next(it)["input_ids"])
        rate_a = count / (time.time() - start)
        print(f"(a) raw text -> masked batches: {rate_a:,.0f} seq/s | x{rate_a / REFERENCE_RATE:.2f} the reference's "
              f"{REFERENCE_RATE:,.0f} inst/s (target {TARGET_A:,.0f} = x2): {'OK' if rate_a >= TARGET_A else 'BELOW'}")

        # (b) TFRecords -> parsed batches.
        rec_config = PretrainingDataConfig(inputs=(str(tmp / "records"),), input_kind="tfrecord", num_epochs=None)
        it = make_pretraining_dataset(rec_config, args.batch).as_numpy_iterator()
        for _ in range(20):
            next(it)
        count, start = 0, time.time()
        while count < 4 * examples:
            count += len(next(it)["input_ids"])
        rate_b = count / (time.time() - start)
        print(f"(b) TFRecords -> batches: {rate_b:,.0f} seq/s | x{rate_b / REFERENCE_RATE:.2f} the reference rate; "
              f"target {TARGET_B:,.0f}: {'OK' if rate_b >= TARGET_B else 'BELOW'}")
        del it, np, tf

        if not args.skip_10x:
            (tmp / "x40").mkdir()
            write_original_format(args.wikitext, tmp / "x40", 40)
            wall10, rss10, log10 = run_create(str(tmp / "x40" / "*.txt"), args.vocab, tmp / "records10",
                                              ["--doc-buffer", str(args.doc_buffer)])
            print(f"  {log10}")
            print(f"(c') data create on 10x the corpus ({10 * size_mb:.0f} MB): {wall10:.1f} s, peak RSS "
                  f"{rss10:.0f} MB (x{rss10 / rss:.2f} the 1x run; the reference grows with the corpus)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
