"""`data create` on Apache Beam's DirectRunner (multi-processing, N workers) vs the local `data create`, same corpus,
same run: instances/s, and the peak RSS of every process (the runner and each SDK worker), sampled from /proc.

The corpus is real text (WikiText-2 valid + test from ../shared/data) repeated k times, one file per copy with the
article titles renamed per copy (distinct documents, distinct keys); `--scales 1,50` runs it at 1x and 50x.

    .venv/bin/python bench/beam_create.py --scales 1,50 --workers 2

Both commands run as subprocesses with the same flags; instances/s = examples / the command's wall time (Python,
TensorFlow and Beam start-up included), and also / the job's own seconds from the metadata.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared" / "data"
VOCAB = SHARED / "bert" / "uncased_L-4_H-256_A-4" / "vocab.txt"
_TITLE = re.compile(r"^( = )([^=].*[^=])( = )$")


def write_corpus(directory: Path, copies: int, sources=("wiki.valid.raw", "wiki.test.raw")) -> list[Path]:
    """`copies` files, each all of `sources` with every article title suffixed by the copy number."""
    text = "".join((SHARED / "wikitext-2" / name).read_text(encoding="utf-8") for name in sources)
    lines = text.splitlines(keepends=True)
    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    for copy in range(copies):
        path = directory / f"wiki-{copy:04d}.txt"
        path.write_text("".join(_TITLE.sub(lambda m: f"{m[1]}{m[2]} {copy}{m[3]}", line.rstrip("\n")) + "\n"
                                if _TITLE.match(line.rstrip("\n")) else line for line in lines), encoding="utf-8")
        paths.append(path)
    return paths


def _rss_kb(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def _descendants(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    found, stack = [], [root]
    while stack:
        pid = stack.pop()
        found.append(pid)
        stack.extend(children.get(pid, []))
    return found


def _role(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmdline = f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return "?"
    return "worker" if "sdk_worker_main" in cmdline else "runner"


def run_sampled(command: list[str], interval: float = 0.25, env=None, timeout: float | None = None) -> dict:
    """Runs `command`, sampling the RSS of it and every descendant; returns wall seconds, the exit code and
    {pid: (role, peak RSS MiB, samples MiB)} (samples every `interval` s, for a flat-memory check)."""
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=ROOT)
    peaks: dict[int, list] = {}
    output: list[str] = []
    reader = threading.Thread(target=lambda: output.extend(proc.stdout), daemon=True)
    reader.start()
    start = time.time()
    while proc.poll() is None:
        for pid in _descendants(proc.pid):
            rss = _rss_kb(pid) / 1024
            if rss:
                entry = peaks.setdefault(pid, [_role(pid), 0.0, []])
                entry[1] = max(entry[1], rss)
                entry[2].append((round(time.time() - start, 2), round(rss, 1)))
        if timeout and time.time() - start > timeout:
            proc.kill()
        time.sleep(interval)
    wall = time.time() - start
    reader.join(timeout=10)
    return {"wall_s": wall, "returncode": proc.returncode, "processes": peaks, "output": "".join(output)}


def data_create_command(inputs: str, out: Path, runner: str, workers: int, extra: list[str]) -> list[str]:
    command = [sys.executable, "-m", "bertjax.cli", "data", "create", "--input", inputs, "--format", "wikitext",
               "--vocab", str(VOCAB), "--out", str(out), *extra]
    if runner == "beam":
        command += ["--runner", "beam", "--beam-option", "direct_running_mode=multi_processing",
                    "--beam-option", f"direct_num_workers={workers}"]
    return command


def measure(inputs: str, out: Path, runner: str, workers: int, extra: list[str]) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TF_CPP_MIN_LOG_LEVEL": "3", "CUDA_VISIBLE_DEVICES": ""}
    result = run_sampled(data_create_command(inputs, out, runner, workers, extra), env=env)
    if result["returncode"] != 0:
        raise RuntimeError(f"{runner} data create failed:\n{result['output'][-3000:]}")
    meta = json.loads((out / "pretrain-metadata.json").read_text())
    roles: dict[str, list[float]] = {}
    for role, peak, _ in result["processes"].values():
        if peak >= 20:  # not the shell wrappers that start the workers
            roles.setdefault(role, []).append(round(peak))
    return {"runner": runner, "examples": meta["examples"], "wall_s": round(result["wall_s"], 1),
            "job_s": meta["seconds"], "instances_per_s_wall": round(meta["examples"] / result["wall_s"], 1),
            "instances_per_s_job": round(meta["examples"] / meta["seconds"], 1),
            "peak_rss_mib": {role: sorted(peaks, reverse=True) for role, peaks in roles.items()}}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scales", default="1,50", help="corpus copies to run, comma-separated")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--local-at", default="1", help="scales at which the local data create runs too")
    parser.add_argument("--flags", default="--max-seq-length 128 --max-predictions 20 --dupe-factor 1 "
                        "--shards 8 --doc-buffer 100", help="data create flags shared by both runners")
    args = parser.parse_args()
    if not VOCAB.exists():
        print(f"needs {SHARED} (WikiText-2 and BERT's uncased vocab)", file=sys.stderr)
        return 1
    extra = args.flags.split()
    local_at = {int(s) for s in args.local_at.split(",") if s}
    with tempfile.TemporaryDirectory(prefix="beam-bench-") as tmp:
        tmp = Path(tmp)
        for scale in (int(s) for s in args.scales.split(",")):
            files = write_corpus(tmp / f"corpus-{scale}", scale)
            size_mb = sum(p.stat().st_size for p in files) / 1e6
            inputs = str(tmp / f"corpus-{scale}" / "*.txt")
            rows = []
            if scale in local_at:
                rows.append(measure(inputs, tmp / f"local-{scale}", "local", 1, extra))
            rows.append(measure(inputs, tmp / f"beam-{scale}", "beam", args.workers, extra))
            for row in rows:
                print(json.dumps({"scale": scale, "corpus_mb": round(size_mb, 1), "files": len(files), **row}),
                      flush=True)
            if len(rows) == 2:
                print(f"scale {scale}x ({size_mb:.1f} MB): Beam DirectRunner ({args.workers} workers) / local = "
                      f"{rows[1]['instances_per_s_wall'] / rows[0]['instances_per_s_wall']:.2f}x instances/s "
                      f"(wall), {rows[1]['instances_per_s_job'] / rows[0]['instances_per_s_job']:.2f}x (job)",
                      flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
