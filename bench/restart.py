"""A restarted pretraining job with a cold vs a warm persistent compilation cache, same run, same checkpoint.

    .venv/bin/python bench/restart.py [--config bert-base-phase1] [--batch 2] [--repeats 2] [--set KEY=VALUE ...]

One `bertjax pretrain` run writes a checkpoint at step 1 and fills a compilation cache. Then the same job is
restarted from copies of that checkpoint, taking turns: with an empty cache (cold) and with the filled one
(warm). Each restart is timed from its process start to the line saying its first new step ran, by this script's
clock (not the job's own), and its goodput record gives the parts. Prints the medians and the cold/warm ratio.
The demo corpus (embedded) and a WordPiece vocab trained on it are the data; float32 on a CPU. With
XLA_FLAGS=--xla_force_host_platform_device_count=8 (and a --batch divisible by 8) the job compiles an SPMD program
over 8 devices, as a TPU host's job does.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bertjax.runtime.preemption import STOPPED_EXIT

BIN = Path(sys.executable).parent
PARTS = ("startup_s", "setup_s", "restore_s", "compile_s", "checkpoint_s")


def _bertjax(*args: str) -> None:
    subprocess.run([str(BIN / "bertjax"), *args], check=True, stdout=subprocess.DEVNULL)


def _pretrain(root: Path, workdir: Path, cache: Path, args: argparse.Namespace) -> tuple[float, dict]:
    """Runs one step of the job in `workdir`; returns (seconds from process start to its first new step, the
    run's goodput record)."""
    command = [str(BIN / "bertjax"), "pretrain", "--config", args.config, "--workdir", str(workdir),
               "--set", f"data.input={root / 'corpus' / 'train.txt'}", "--set", f"data.vocab={root / 'vocab' / 'vocab.txt'}",
               "--set", "model.dtype=float32", "--set", f"train.batch_size={args.batch}", "--set", "train.steps=1000",
               "--set", "optimizer.warmup_steps=0", "--set", "checkpoint.every=1", "--set", "train.log_every=1",
               "--set", f"train.compilation_cache_dir={cache}", "--max-steps-this-run", "1"]
    for override in args.set:
        command += ["--set", override]
    started = time.perf_counter()
    first_step = None
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as job:
        for line in job.stdout:
            if first_step is None and " compiled and ran in " in line:
                first_step = time.perf_counter() - started
    if job.returncode != STOPPED_EXIT or first_step is None:  # a step of its 1000: stopped, as asked
        raise SystemExit(f"pretrain in {workdir} failed (exit {job.returncode})")
    records = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    return first_step, [r for r in records if r.get("event") == "goodput"][-1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="bert-base-phase1")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=2, help="restarts of each kind, taking turns")
    parser.add_argument("--set", action="append", default=[], help="more --set overrides for the job")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="bench-restart-") as tmp:
        root = Path(tmp)
        _bertjax("demo-corpus", "--out", str(root / "corpus"))
        _bertjax("vocab", "train", "--input", str(root / "corpus" / "train.txt"), "--type", "wordpiece",
                 "--vocab-size", "4000", "--out", str(root / "vocab"))
        first, _ = _pretrain(root, root / "base", root / "cache-warm", args)
        print(f"{args.config}, batch {args.batch}: the first run reached step 1 in {first:.1f} s (fills the cache)")
        times = {"cold": [], "warm": []}
        parts = {"cold": [], "warm": []}
        for repeat in range(args.repeats):
            for kind in ("cold", "warm"):
                workdir = root / f"{kind}-{repeat}"
                shutil.copytree(root / "base", workdir)
                cache = root / ("cache-warm" if kind == "warm" else f"cache-cold-{repeat}")
                seconds, record = _pretrain(root, workdir, cache, args)
                times[kind].append(seconds)
                parts[kind].append(record)
                print(f"  {kind} restart {repeat + 1}: first new step after {seconds:.1f} s "
                      f"({', '.join(f'{p[:-2]} {record.get(p, 0.0):.1f}' for p in PARTS)})")
                shutil.rmtree(workdir)
        cold, warm = statistics.median(times["cold"]), statistics.median(times["warm"])
        print(f"median time to the first new step: cold cache {cold:.1f} s, warm cache {warm:.1f} s: "
              f"warm is {cold / warm:.2f}x sooner")
        for kind in ("cold", "warm"):
            medians = {p: statistics.median(r.get(p, 0.0) for r in parts[kind]) for p in PARTS}
            print(f"  {kind}: " + ", ".join(f"{p[:-2]} {v:.1f} s" for p, v in medians.items()))


if __name__ == "__main__":
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    main()
