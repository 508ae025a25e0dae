"""Input-pipeline benchmark (issue 3): figures as ratios to google-research/bert's create_pretraining_data.py.

Reference, measured earlier on this machine with the original script (single process, whole corpus in RAM):
WikiText-2 test x4 (~5 MB, original one-sentence-per-line format), max_seq_length 128, max_predictions 20,
dupe_factor 5 -> 55,871 instances in ~24.8 s wall (~2,250 instances/s), peak RSS ~930 MB.

Measures here:
  (a) raw text -> masked batches in the training pipeline (tokenize + pair + mask + batch), seq/s
  (b) TFRecords -> parsed batches, seq/s
  (c) `bertjax data create` wall time and peak RSS (fresh process), then peak RSS on a 10x larger corpus
  (d) the same documents as Parquet and as JSON Lines -> masked batches, seq/s against (a)'s plain text, in turns
      in the same run (`--formats-only`: only this)

    .venv/bin/python bench/input_pipeline.py [--wikitext ../shared/data/wikitext-2/wiki.test.raw] [--skip-10x]
    .venv/bin/python bench/input_pipeline.py --formats-only --format-sequences 4000
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
    from bertjax.data.corpus import documents_from_files
    from bertjax.data.data_config import CorpusConfig

    docs = documents_from_files([raw], CorpusConfig(input=raw, corpus_format="wikitext"))
    text = "".join("\n".join(s.decode() for s in d["sentences"]) + "\n\n" for d in docs.as_numpy_iterator())
    paths = []
    for i in range(copies):
        path = out_dir / f"corpus-{i:03d}.txt"
        path.write_text(text, encoding="utf-8")
        paths.append(str(path))
    return paths


_WRAPPER = ("import resource, subprocess, sys; r = subprocess.run(sys.argv[1:]); "
            "u = resource.getrusage(resource.RUSAGE_CHILDREN); "
            "print('CHILD', u.ru_maxrss, u.ru_utime + u.ru_stime, file=sys.stderr); sys.exit(r.returncode)")


def run_measured(cmd: list[str]) -> tuple[float, float, float, str]:
    """Run cmd in a fresh process: (wall s, CPU s, peak RSS MB, stdout). A wrapper process reports the
    rusage of its only child, so each run is measured on its own."""
    start = time.time()
    proc = subprocess.run([sys.executable, "-c", _WRAPPER, *cmd], capture_output=True, text=True, cwd=ROOT,
                          env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"})
    wall = time.time() - start
    if proc.returncode:
        raise SystemExit(f"{' '.join(cmd[:4])} failed:\n{proc.stderr[-3000:]}")
    rss_kb, cpu = proc.stderr.split("CHILD")[-1].split()[:2]
    return wall, float(cpu), int(rss_kb) / 1024, proc.stdout


def run_create(corpus_glob: str, vocab: str, out: Path, extra: list[str],
               entry: tuple[str, ...] = ("-m", "bertjax.cli", "data", "create")) -> tuple[float, float, float, str]:
    """`bertjax data create` with the reference's flags: (wall s, CPU s, peak RSS MB, last log line)."""
    cmd = [sys.executable, *entry, "--input", corpus_glob, "--vocab", vocab,
           "--out", str(out), "--max-seq-length", "128", "--max-predictions", "20", "--dupe-factor", "5",
           "--shards", "8", *extra]
    wall, cpu, rss, stdout = run_measured(cmd)
    return wall, cpu, rss, (stdout.strip().splitlines() or [""])[-1]


def write_record_formats(files: list[str], out_dir: Path) -> dict[str, str]:
    """The original-format files as Parquet (row groups of 256 documents) and JSON Lines, one record per document
    (its sentences, one per line), a file each: {format: glob}."""
    import json

    import pyarrow as pa
    import pyarrow.parquet as pq

    globs = {}
    for fmt in ("parquet", "jsonl"):
        (out_dir / fmt).mkdir()
        globs[fmt] = str(out_dir / fmt / f"*.{fmt}")
    for i, path in enumerate(files):
        texts = [d.strip() for d in Path(path).read_text(encoding="utf-8").split("\n\n") if d.strip()]
        pq.write_table(pa.table({"text": texts}), out_dir / "parquet" / f"corpus-{i:03d}.parquet",
                       row_group_size=256)
        (out_dir / "jsonl" / f"corpus-{i:03d}.jsonl").write_text("".join(json.dumps({"text": t}) + "\n"
                                                                          for t in texts), encoding="utf-8")
    return globs


def measure_formats(text_glob: str, tmp: Path, vocab: str, args) -> None:
    """(d): seq/s of the training pipeline from plain text, Parquet and JSON Lines holding the same documents,
    measured in turns (text, parquet, jsonl, twice) so that load on the machine affects each alike."""
    import tensorflow as tf

    from bertjax.data.data_config import PretrainingDataConfig
    from bertjax.data.pipeline import make_pretraining_dataset

    sources = {"text": (text_glob, "sentences"),
               **{fmt: (glob, fmt) for fmt, glob in write_record_formats(sorted(tf.io.gfile.glob(text_glob)),
                                                                          tmp).items()}}
    rates: dict[str, list[float]] = {name: [] for name in sources}
    for _ in range(2):
        for name, (glob, fmt) in sources.items():
            config = PretrainingDataConfig(input=glob, corpus_format=fmt, vocab=vocab, max_seq_length=128,
                                           max_predictions_per_seq=20, doc_buffer_size=args.doc_buffer)
            count, wall, _ = _timed_take(make_pretraining_dataset(config, args.batch), 2, args.format_sequences)
            rates[name].append(count / wall)
    best = {name: max(r) for name, r in rates.items()}
    print("(d) the same documents -> masked batches, best of 2 turns: " + ", ".join(
        f"{name} {rate:,.0f} seq/s (x{rate / best['text']:.2f} text)" for name, rate in best.items()))


def _timed_take(dataset, warmup_batches: int, sequences: int) -> tuple[int, float, float]:
    """(sequences taken, wall seconds, CPU seconds) for at least `sequences` after `warmup_batches` untimed."""
    it = dataset.as_numpy_iterator()
    for _ in range(warmup_batches):
        next(it)
    count, start, cpu_start = 0, time.time(), time.process_time()
    while count < sequences:
        count += len(next(it)["input_ids"])
    return count, time.time() - start, time.process_time() - cpu_start


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--wikitext", default=str(ROOT / ".." / "shared" / "data" / "wikitext-2" / "wiki.test.raw"))
    parser.add_argument("--vocab", default=str(ROOT / ".." / "shared" / "data" / "bert" / "uncased_L-4_H-256_A-4"
                                               / "vocab.txt"))
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--doc-buffer", type=int, default=200)
    parser.add_argument("--skip-10x", action="store_true", help="skip the 10x-corpus RSS run (slow)")
    parser.add_argument("--formats-only", action="store_true", help="only (d): text vs Parquet vs JSON Lines")
    parser.add_argument("--format-sequences", type=int, default=11_000, help="(d): sequences timed per turn")
    args = parser.parse_args(argv)
    for path in (args.wikitext, args.vocab):
        if not Path(path).exists():
            raise SystemExit(f"missing {path} (the shared data is only present beside the project)")

    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import numpy as np
    import tensorflow as tf

    from bertjax.data.data_config import PretrainingDataConfig
    from bertjax.data.pipeline import make_pretraining_dataset

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        (tmp / "x4").mkdir()
        files = write_original_format(args.wikitext, tmp / "x4", 4)
        size_mb = sum(Path(f).stat().st_size for f in files) / 1e6
        print(f"corpus: WikiText-2 test x4 in the original format, {size_mb:.2f} MB, {len(files)} files; "
              f"{os.cpu_count()} CPU cores (shared)")
        if args.formats_only:
            measure_formats(str(tmp / "x4" / "*.txt"), tmp, args.vocab, args)
            return 0

        # Fixed cost of any `bertjax` command: interpreter + imports of every registered CLI module.
        s_wall, s_cpu, s_rss, _ = run_measured([sys.executable, "-c", "import bertjax.cli, bertjax.data.create; "
                                                "bertjax.cli.build_parser()"])
        print(f"    startup (imports, parser): {s_wall:.1f} s wall, {s_cpu:.1f} s CPU, {s_rss:.0f} MB RSS")
        # (c) data create, fresh process, same flags as the reference.
        wall, cpu, rss, log = run_create(str(tmp / "x4" / "*.txt"), args.vocab, tmp / "records",
                                         ["--doc-buffer", str(args.doc_buffer)])
        print(f"  {log}")
        examples = int(log.split("wrote ")[1].split(" ")[0])
        print(f"(c) data create: {examples} instances in {wall:.1f} s wall ({examples / wall:,.0f} inst/s; "
              f"{cpu:.1f} s CPU), peak RSS {rss:.0f} MB | reference {REFERENCE_INSTANCES} in {REFERENCE_SECONDS} s"
              f": speed-up x{REFERENCE_SECONDS / wall:.2f} wall (target >= x2), RSS ratio {rss / REFERENCE_RSS_MB:.2f}")

        # The same job through pipelines/create_pretraining_data.py, which imports only the data modules.
        wall_p, cpu_p, rss_p, _ = run_create(str(tmp / "x4" / "*.txt"), args.vocab, tmp / "records-p",
                                             ["--doc-buffer", str(args.doc_buffer)],
                                             entry=(str(ROOT / "pipelines" / "create_pretraining_data.py"),))
        print(f"(c) via pipelines/create_pretraining_data.py: {wall_p:.1f} s wall ({cpu_p:.1f} s CPU), peak RSS "
              f"{rss_p:.0f} MB | speed-up x{REFERENCE_SECONDS / wall_p:.2f} wall")

        # (a) raw text -> masked batches, dynamic masking, 3 epochs after one warm-up epoch.
        config = PretrainingDataConfig(input=str(tmp / "x4" / "*.txt"), vocab=args.vocab,
                                       max_seq_length=128, max_predictions_per_seq=20, masking="dynamic",
                                       doc_buffer_size=args.doc_buffer, num_epochs=None)
        per_epoch = REFERENCE_INSTANCES // 5
        count, wall_a, cpu_a = _timed_take(make_pretraining_dataset(config, args.batch), per_epoch // args.batch,
                                           3 * per_epoch)
        rate_a = count / wall_a
        print(f"(a) raw text -> masked batches: {rate_a:,.0f} seq/s ({count / cpu_a:,.0f} seq per CPU-second) | "
              f"x{rate_a / REFERENCE_RATE:.2f} the reference's {REFERENCE_RATE:,.0f} inst/s "
              f"(target {TARGET_A:,.0f} = x2): {'OK' if rate_a >= TARGET_A else 'BELOW'}")

        # (b) TFRecords -> parsed batches.
        rec_config = PretrainingDataConfig(input=str(tmp / "records"), input_kind="tfrecord", num_epochs=None)
        count, wall_b, cpu_b = _timed_take(make_pretraining_dataset(rec_config, args.batch), 20, 4 * examples)
        rate_b = count / wall_b
        print(f"(b) TFRecords -> batches: {rate_b:,.0f} seq/s ({count / cpu_b:,.0f} seq per CPU-second) | "
              f"x{rate_b / REFERENCE_RATE:.2f} the reference's {REFERENCE_RATE:,.0f} inst/s; target {TARGET_B:,.0f} "
              f"seq/s (x{TARGET_B / REFERENCE_RATE:.1f}): {'OK' if rate_b >= TARGET_B else 'BELOW'}")
        del np, tf
        measure_formats(str(tmp / "x4" / "*.txt"), tmp, args.vocab, args)

        if not args.skip_10x:
            (tmp / "x40").mkdir()
            write_original_format(args.wikitext, tmp / "x40", 40)
            wall10, cpu10, rss10, log10 = run_create(str(tmp / "x40" / "*.txt"), args.vocab, tmp / "records10",
                                                     ["--doc-buffer", str(args.doc_buffer)])
            print(f"  {log10}")
            print(f"(c') data create on 10x the corpus ({10 * size_mb:.0f} MB): {wall10:.1f} s wall, {cpu10:.1f} s CPU, "
                  f"peak RSS {rss10:.0f} MB (x{rss10 / rss:.2f} the 1x run; the reference grows with the corpus)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
