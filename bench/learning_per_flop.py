"""Learning per FLOP, made fair: BERT-tiny (the classic recipe), BERT-tiny under the modern recipe and
ModernBERT-tiny, on the same corpus and vocabulary at the same training FLOPs, each at its best learning rate from
a sweep; two seeds; then each final checkpoint's downstream scores (`bertjax score`).

- Corpus: WikiText-2 (../shared/data: only its valid and test texts are there): wiki.test.raw to train on,
  wiki.valid.raw held out. One WordPiece vocabulary trained on the training text (`bertjax vocab train`).
- Arms (all at seq 128, batch 32, 10% warmup then linear decay): `bert-tiny` as its preset (MLM at 15% + NSP,
  unpacked rows, dropout 0.1, AdamW); `bert-tiny-modern`, BERT-tiny's architecture under modernbert-tiny's recipe
  (MODERN_RECIPE: MLM alone at 30%, packed rows, no dropout, StableAdamW as that preset has it); `modernbert-tiny`
  as its preset. So bert-tiny -> bert-tiny-modern is the recipe, bert-tiny-modern -> modernbert-tiny the
  architecture.
- FLOPs as computed (`metrics.computed_train_flops_per_sequence` x the batch): every position of every row, padding
  included, and ModernBERT's sliding layers over the whole row, as the CPU's attention computes them. The budget
  is --bert-steps of bert-tiny; each arm's steps give the same computed FLOPs. Beside them the model's FLOPs
  (`metrics.train_flops`: real tokens, the window), real tokens and seconds, each summed from the run's
  metrics.jsonl over its logging intervals (the loop's counts and timings; the compiling first step counted as
  its interval's mean).
- Learning-rate sweep: each arm at --sweep-fraction of its steps (seed 0) for each of --lrs, extended by one more
  value beyond the grid's end while the best is at an end (at most --max-extend times); the lowest final held-out
  loss keeps its learning rate. By default at the whole budget: a rate's rank at a fifth of it need not hold at the
  end (BERT-tiny at 3,000 steps: 3e-3 0.29 nats behind 1e-3 at a fifth, 0.02 ahead at the end).
- Full runs: each arm at its best learning rate with each of --seeds, a checkpoint at every twentieth of the run.
  Every run's folder is named by arm, learning rate, seed and steps (runs/), so at the whole budget the sweep's
  seed-0 run at the best rate is that seed's full run, not trained twice.
- Held-out loss: MLM cross-entropy at 15% masking (static, 80/10/10, single segments) on the same 16 batches of
  wiki.valid.raw for every checkpoint of every arm; beside it the unigram predictor's on the same targets (token
  frequencies of the training text, add-one smoothed).
- Crossings: for each seed, the FLOPs (computed and the model's), real tokens and seconds at which an arm's curve
  first reaches another arm's final held-out loss (interpolated between checkpoints), as a share of that arm's.
- Downstream: `bertjax score` on each full run's final checkpoint once every full run has ended: SST-2, MRPC,
  STS-B, CoLA from --glue, with fine-tune seeds --score-seeds, MosaicBERT's per-task recipe at seq 128 (the models'
  positions), the caps given.
- Output (--workdir): results.json, results.md (the tables), learning_per_flop.svg (the curves), log.txt (every
  bertjax command's output), rewritten after each full run and each scoring, so a bench cut short leaves every
  result it finished. Runs and scores already complete are not run again (rerun to continue).

    .venv/bin/python bench/learning_per_flop.py [--bert-steps 3000] [--sweep-fraction 1] [--lrs 1e-3,3e-3,1e-2]
        [--seeds 0,1] [--score-seeds 0,1] [--score-max-train 2000] [--jobs 3]
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SEQ, BATCH, EVAL_BATCHES = 128, 32, 16
CHECKPOINTS = 20
TASKS = "sst2,mrpc,stsb,cola"
# modernbert-tiny's recipe (configs/modernbert_tiny.py), all but its architecture: checked against the preset.
MODERN_RECIPE = {
    "data.next_sentence_prediction": False, "train.nsp_loss": False, "data.masked_lm_prob": 0.3,
    "data.max_predictions_per_seq": 38, "data.packing": True, "optimizer.name": "stableadamw", "optimizer.b2": 0.98,
    "optimizer.weight_decay": 1e-5, "optimizer.decouple_lr": True, "optimizer.clip_norm": 0.0,
}
NO_DROPOUT = {"model.hidden_dropout_prob": 0.0, "model.attention_probs_dropout_prob": 0.0}  # ModernBERT-tiny has none
ARMS = {  # name: (preset, overrides)
    "bert-tiny": ("bert-tiny", {}),
    "bert-tiny-modern": ("bert-tiny", {**MODERN_RECIPE, **NO_DROPOUT}),
    "modernbert-tiny": ("modernbert-tiny", {}),
}
WRITING = threading.Lock()   # the jobs' threads add to one results dict and rewrite its files
COLORS = {"bert-tiny": "#1b62a5", "bert-tiny-modern": "#1b9e77", "modernbert-tiny": "#d95f02"}


def check_modern_recipe() -> None:
    """MODERN_RECIPE holds modernbert-tiny's values, and that preset no dropout."""
    from bertjax.pretraining.config import load_config

    values = load_config("modernbert-tiny", ["data.vocab=x", "data.input=x"], require_data=False).to_dict()
    for key, value in MODERN_RECIPE.items():
        section, name = key.split(".")
        assert values[section][name] == value, f"{key}: modernbert-tiny has {values[section][name]!r}, not {value!r}"


def bertjax(argv: list[str], log: Path) -> None:
    """A bertjax command in a subprocess (its own JAX and TensorFlow), its output appended to `log`."""
    with open(log, "a") as out:
        out.write(f"$ bertjax {shlex.join(argv)}\n")
        out.flush()
        result = subprocess.run([sys.executable, "-m", "bertjax.cli", *argv], stdout=out, stderr=subprocess.STDOUT,
                                cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    if result.returncode:
        raise SystemExit(f"bertjax {' '.join(argv[:2])} failed (exit {result.returncode}); see {log}")


def overrides(arm: str, train: str, vocab: str) -> list[str]:
    """The --set values of an arm's runs (besides steps, seed, learning rate and checkpoints)."""
    data = {"data.input": train, "data.corpus_format": "wikitext", "data.vocab": vocab, "data.max_seq_length": SEQ,
            "train.batch_size": BATCH}
    return [f"{key}={str(value).lower() if isinstance(value, bool) else value}"
            for key, value in {**data, **ARMS[arm][1]}.items()]


def arm_config(arm: str, train: str, vocab: str):
    from bertjax.pretraining.config import load_config

    return load_config(ARMS[arm][0], overrides(arm, train, vocab), require_data=False)


def computed_step_flops(arm: str, train: str, vocab: str) -> float:
    """Training FLOPs of one step of `arm` as computed: full rows, every prediction slot, attention over the row."""
    from bertjax.pretraining import metrics

    config = arm_config(arm, train, vocab)
    size = sum(1 for _ in open(vocab, encoding="utf-8"))
    return BATCH * metrics.computed_train_flops_per_sequence(config.bert_config(size), SEQ,
                                                             config.data.max_predictions_per_seq)


def pretrain(arm: str, run: Path, steps: int, lr: float, seed: int, every: int, train: str, vocab: str,
             log: Path) -> list[str]:
    """Trains `arm` into `run` unless it completed before; returns the command's arguments."""
    argv = ["pretrain", "--config", ARMS[arm][0], "--workdir", str(run)]
    for value in overrides(arm, train, vocab) + [f"train.steps={steps}", f"optimizer.learning_rate={lr:g}",
                                                 f"train.seed={seed}", f"data.seed={seed + 1}",
                                                 f"checkpoint.every={every}", f"checkpoint.keep={CHECKPOINTS + 5}",
                                                 f"train.log_every={every}"]:
        argv += ["--set", value]
    if steps not in saved_steps(run):
        bertjax(argv, log)
    return argv


def run_folder(work: Path, arm: str, lr: float, seed: int, steps: int) -> Path:
    """The folder of `arm`'s run at `lr`, `seed` and `steps`: a sweep run and a full run alike in all four are one."""
    return work / "runs" / f"{arm}-lr{lr:g}-seed{seed}-{steps}steps"


def saved_steps(run: Path) -> list[int]:
    folder = run / "checkpoints"
    return sorted(int(p.name) for p in folder.iterdir() if p.name.isdigit()) if folder.is_dir() else []


def eval_batches(valid: str, vocab: str) -> list[dict]:
    """The held-out batches: static 15% masks, 80/10/10, one segment a row, the same for every model."""
    from bertjax.data.data_config import PretrainingDataConfig
    from bertjax.data.pipeline import make_pretraining_dataset

    config = PretrainingDataConfig(input=valid, corpus_format="wikitext", vocab=vocab, max_seq_length=SEQ,
                                   max_predictions_per_seq=20, masked_lm_prob=0.15, next_sentence_prediction=False,
                                   masking="static", dupe_factor=1, num_epochs=1, shuffle_buffer=1, seed=4242)
    batches = []
    for batch in make_pretraining_dataset(config, BATCH).as_numpy_iterator():
        batches.append({k: batch[k] for k in ("input_ids", "input_mask", "segment_ids", "masked_lm_positions",
                                              "masked_lm_ids", "masked_lm_weights")})
        if len(batches) == EVAL_BATCHES:
            break
    return batches


def unigram_loss(train: str, vocab: str, batches: list[dict]) -> float:
    """Cross-entropy on the held-out targets of the unigram predictor: the training text's token frequencies
    (add-one smoothed over the vocabulary), the best a model that ignores the context can do."""
    import numpy as np

    from bertjax.data.tokenizers import load_tokenizer

    tokenizer = load_tokenizer(vocab)
    lines = [line for line in open(train, encoding="utf-8") if line.strip()]
    ids, _ = tokenizer.pieces(lines)
    counts = np.bincount(ids, minlength=len(tokenizer.vocab)).astype(np.float64) + 1.0
    logp = np.log(counts / counts.sum())
    targets = np.concatenate([b["masked_lm_ids"].ravel() for b in batches])
    weights = np.concatenate([b["masked_lm_weights"].ravel() for b in batches])
    return float(-(logp[targets] * weights).sum() / weights.sum())


_EVALUATORS: dict = {}   # one compiled evaluator per model configuration: every checkpoint of an arm shares it


def held_out_loss(checkpoint: str, batches: list[dict]) -> float:
    """MLM cross-entropy (mean over the masked tokens) of a checkpoint on the held-out batches."""
    import jax
    import jax.numpy as jnp

    from bertjax.checkpoint import load_model
    from bertjax.model import family

    model = load_model(checkpoint)
    key = repr(model.config)
    if key not in _EVALUATORS:
        module = family.pretraining_model(model.config)

        @jax.jit
        def nll_sum(params, batch):
            out = module.apply({"params": params}, batch["input_ids"], batch["input_mask"], batch["segment_ids"],
                               batch["masked_lm_positions"])
            logp = jax.nn.log_softmax(out["mlm_logits"].astype(jnp.float32), axis=-1)
            nll = -jnp.take_along_axis(logp, batch["masked_lm_ids"][..., None], axis=-1)[..., 0]
            return jnp.sum(nll * batch["masked_lm_weights"]), jnp.sum(batch["masked_lm_weights"])

        _EVALUATORS[key] = nll_sum
    total = count = 0.0
    for batch in batches:
        a, b = _EVALUATORS[key](model.params, batch)
        total, count = total + float(a), count + float(b)
    return total / count if math.isfinite(total) else math.inf


def run_counts(run: Path) -> dict[int, dict]:
    """Per logged step the run's cumulative model FLOPs, real tokens and timed seconds, from metrics.jsonl's
    intervals (each logged record's rates are over the steps since the one before); the first, compiling, step
    is counted at the first interval's mean and not timed."""
    cumulative, previous, totals = {}, 0, {"model_flops": 0.0, "real_tokens": 0.0, "seconds": 0.0}
    for line in open(run / "metrics.jsonl", encoding="utf-8"):
        record = json.loads(line)
        if "steps_per_s" not in record:
            continue
        step, rate = record["step"], record["steps_per_s"]
        timed = step - max(previous, 1)   # the steps the interval timed
        per_step = {"model_flops": record["tflops_per_device"] * 1e12 / rate,   # one device: the CPU
                    "real_tokens": record["real_tokens_per_s"] / rate}
        for key, value in per_step.items():
            totals[key] += value * (step - previous)
        totals["seconds"] += timed / rate
        cumulative[step], previous = dict(totals), step
    return cumulative


def reach(curve: list[dict], target: float, key: str) -> float | None:
    """The `key` value at which a curve of checkpoints (step order) first reaches `target` held-out loss,
    interpolated linearly between checkpoints; None if it never does."""
    if curve and curve[0]["loss"] <= target:
        return curve[0][key]
    for a, b in zip(curve, curve[1:]):
        if b["loss"] <= target:   # a["loss"] > target >= b["loss"]: the crossing between them
            share = (a["loss"] - target) / (a["loss"] - b["loss"])
            return a[key] + share * (b[key] - a[key])
    return None


def score(run: Path, out: Path, args, log: Path) -> list[str]:
    argv = ["score", str(run), "--glue", args.glue, "--tasks", TASKS, "--seeds", args.score_seeds,
            "--max-seq-length", str(SEQ), "--out", str(out)]
    if args.score_max_train:
        argv += ["--max-train-examples", str(args.score_max_train)]
    if args.score_epochs:
        argv += ["--epochs", f"{args.score_epochs:g}"]
    if args.score_max_eval:
        argv += ["--max-eval-examples", str(args.score_max_eval)]
    if not (out / "summary.json").exists():
        bertjax(argv, log)
    return argv


def svg(curves: dict[str, list[dict]], unigram: float, path: Path) -> None:
    """Held-out loss against computed FLOPs, a polyline per run (seed 1 dashed), the unigram loss a grey line."""
    width, height, pad = 760, 440, 64
    points = [(p["flops"], p["loss"]) for curve in curves.values() for p in curve]
    fmax = max(f for f, _ in points)
    lmin, lmax = min(min(loss for _, loss in points), unigram), max(max(loss for _, loss in points), unigram)
    x = lambda f: pad + (width - 2 * pad) * f / fmax  # noqa: E731
    y = lambda loss: height - pad - (height - 2 * pad) * (loss - lmin) / max(lmax - lmin, 1e-9)  # noqa: E731
    lines = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="sans-serif" '
             'font-size="12">', f'<rect width="{width}" height="{height}" fill="white"/>',
             f'<line x1="{pad}" y1="{height - pad}" x2="{width - pad}" y2="{height - pad}" stroke="black"/>',
             f'<line x1="{pad}" y1="{pad}" x2="{pad}" y2="{height - pad}" stroke="black"/>',
             f'<text x="{width / 2}" y="{height - 20}" text-anchor="middle">training FLOPs as computed (max '
             f'{fmax:.3g})</text>',
             f'<text x="15" y="{height / 2}" transform="rotate(-90 15 {height / 2})" text-anchor="middle">'
             'held-out MLM loss (15% masking, nats)</text>',
             f'<text x="{pad - 5}" y="{y(lmax) + 4}" text-anchor="end">{lmax:.2f}</text>',
             f'<text x="{pad - 5}" y="{y(lmin) + 4}" text-anchor="end">{lmin:.2f}</text>',
             f'<line x1="{pad}" y1="{y(unigram):.1f}" x2="{width - pad}" y2="{y(unigram):.1f}" stroke="#999" '
             'stroke-dasharray="2 3"/>',
             f'<text x="{width - pad}" y="{y(unigram) - 4:.1f}" text-anchor="end" fill="#777">unigram '
             f'{unigram:.2f}</text>']
    for i, (name, curve) in enumerate(curves.items()):
        arm, seed = name.rsplit(" seed ", 1)
        dash = ' stroke-dasharray="6 3"' if seed != "0" else ""
        coords = " ".join(f"{x(p['flops']):.1f},{y(p['loss']):.1f}" for p in curve)
        lines.append(f'<polyline points="{coords}" fill="none" stroke="{COLORS[arm]}" stroke-width="2"{dash}/>')
        lines.append(f'<text x="{width - pad - 170}" y="{pad + 16 * i}" fill="{COLORS[arm]}">{name}</text>')
    path.write_text("\n".join(lines + ["</svg>"]) + "\n")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", default=str(ROOT.parent / "shared" / "data"))
    parser.add_argument("--glue", default="", help="GLUE directory for `bertjax score` (default DATA/glue)")
    parser.add_argument("--workdir", default=str(ROOT / "runs" / "learning-per-flop"))
    parser.add_argument("--bert-steps", type=int, default=3000, help="bert-tiny's steps: the FLOPs budget")
    parser.add_argument("--sweep-fraction", type=float, default=1.0, help="the sweep's share of each arm's steps")
    parser.add_argument("--lrs", default="1e-3,3e-3,1e-2", help="the sweep's learning rates, ascending")
    parser.add_argument("--max-extend", type=int, default=2, help="values added past a grid end the best sits at")
    parser.add_argument("--seeds", default="0,1")
    parser.add_argument("--score-seeds", default="0,1", help="fine-tune seeds of `bertjax score`")
    parser.add_argument("--score-max-train", type=int, default=2000, help="rows each fine-tune trains on (0: all)")
    parser.add_argument("--score-epochs", type=float, default=0, help="fine-tune epochs (0: the recipe's)")
    parser.add_argument("--score-max-eval", type=int, default=0, help="dev rows scored per task (0: all)")
    parser.add_argument("--vocab-size", type=int, default=8000)
    parser.add_argument("--jobs", type=int, default=3, help="bertjax commands run at once")
    args = parser.parse_args()
    args.glue = args.glue or str(Path(args.data) / "glue")
    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    log = work / "log.txt"
    check_modern_recipe()
    train, valid = (str(Path(args.data) / "wikitext-2" / name) for name in ("wiki.test.raw", "wiki.valid.raw"))
    vocab = str(work / "vocab" / "vocab.txt")
    commands = {}
    vocab_argv = ["vocab", "train", "--input", train, "--format", "wikitext", "--type", "wordpiece", "--vocab-size",
                  str(args.vocab_size), "--out", str(Path(vocab).parent)]
    if not Path(vocab).exists():
        bertjax(vocab_argv, log)
    commands["vocab"] = vocab_argv

    flops = {arm: computed_step_flops(arm, train, vocab) for arm in ARMS}
    budget = args.bert_steps * flops["bert-tiny"]
    steps = {arm: CHECKPOINTS * round(budget / flops[arm] / CHECKPOINTS) for arm in ARMS}  # 20 checkpoints a run
    print("computed training FLOPs per step: " + ", ".join(f"{arm} {flops[arm]:.4g}" for arm in ARMS) +
          f"; budget {budget:.4g} FLOPs = " + ", ".join(f"{arm} {steps[arm]}" for arm in ARMS) + " steps", flush=True)
    batches = eval_batches(valid, vocab)
    unigram = unigram_loss(train, vocab, batches)
    targets = int(sum(b["masked_lm_weights"].sum() for b in batches))
    print(f"held out: {EVAL_BATCHES} batches, {targets} masked targets; unigram predictor's loss {unigram:.4f}",
          flush=True)
    pool = ThreadPoolExecutor(args.jobs)

    # The learning-rate sweep, at a share of each arm's budget, seed 0; extended past an end the best sits at.
    grid = sorted(float(v) for v in args.lrs.split(","))
    sweep = {arm: {} for arm in ARMS}

    def sweep_run(arm: str, lr: float) -> None:
        short = max(CHECKPOINTS, round(args.sweep_fraction * steps[arm]))
        run = run_folder(work, arm, lr, 0, short)
        argv = pretrain(arm, run, short, lr, 0, short // CHECKPOINTS, train, vocab, log)
        sweep[arm][lr] = {"steps": short, "loss": held_out_loss(str(run / "checkpoints" / str(short)), batches),
                          "command": "bertjax " + shlex.join(argv)}
        print(f"sweep {arm} lr {lr:g} ({short} steps): held-out loss {sweep[arm][lr]['loss']:.4f}", flush=True)

    lrs = {arm: list(grid) for arm in ARMS}
    for extension in range(args.max_extend + 1):
        todo = [(arm, lr) for arm in ARMS for lr in lrs[arm] if lr not in sweep[arm]]
        list(pool.map(lambda job: sweep_run(*job), todo))
        for arm in ARMS:
            tried = sorted(sweep[arm])
            best = min(tried, key=lambda lr: sweep[arm][lr]["loss"])
            if extension < args.max_extend and best in (tried[0], tried[-1]) and len(tried) > 1:
                factor = tried[1] / tried[0] if best == tried[0] else tried[-1] / tried[-2]
                lrs[arm].append(best / factor if best == tried[0] else best * factor)
    best_lr = {arm: min(sweep[arm], key=lambda lr: sweep[arm][lr]["loss"]) for arm in ARMS}
    print("best learning rates: " + ", ".join(f"{arm} {best_lr[arm]:g}" for arm in ARMS), flush=True)

    # The full runs, each arm at its best learning rate, every seed, a checkpoint at every twentieth; then each
    # run's final checkpoint scored downstream. Curves first: a bench cut short has every arm's curve at every seed
    # (the comparison) before the scores, which cost more CPU than the runs here.
    seeds = [int(s) for s in args.seeds.split(",")]
    results = {"seq": SEQ, "batch": BATCH, "budget_flops": budget, "steps": steps, "step_flops": flops,
               "unigram_loss": unigram, "held_out_targets": targets, "sweep_fraction": args.sweep_fraction,
               "sweep": {arm: {f"{lr:g}": v for lr, v in sorted(sweep[arm].items())} for arm in ARMS},
               "best_lr": best_lr, "curves": {}, "crossings": {}, "scores": {},
               "score_settings": {"tasks": TASKS, "seeds": args.score_seeds, "max_seq_length": SEQ,
                                  "max_train_examples": args.score_max_train or None,
                                  "max_eval_examples": args.score_max_eval or None,
                                  "epochs": args.score_epochs or "the recipe's"},
               "commands": {"bench": "python bench/learning_per_flop.py " + shlex.join(sys.argv[1:]),
                            **commands, "full": {}, "score": {}}}
    names = [f"{arm} seed {seed}" for seed in seeds for arm in ARMS]

    def full_run(arm: str, seed: int) -> None:
        name, run = f"{arm} seed {seed}", run_folder(work, arm, best_lr[arm], seed, steps[arm])
        argv = pretrain(arm, run, steps[arm], best_lr[arm], seed, steps[arm] // CHECKPOINTS, train, vocab, log)
        results["commands"]["full"][name] = "bertjax " + shlex.join(argv)
        counts = run_counts(run)
        curve = []
        for step in saved_steps(run):
            curve.append({"step": step, "flops": step * flops[arm], **counts[step],
                          "loss": held_out_loss(str(run / "checkpoints" / str(step)), batches)})
        print(f"{name}: " + ", ".join(f"{p['step']}:{p['loss']:.3f}" for p in curve), flush=True)
        with WRITING:
            results["curves"][name] = curve
            write(results, names, work)

    def score_run(arm: str, seed: int) -> None:
        name, run = f"{arm} seed {seed}", run_folder(work, arm, best_lr[arm], seed, steps[arm])
        out = work / "scores" / run.name
        argv = score(run, out, args, log)
        summary = json.loads((out / "summary.json").read_text())
        entry = {"average": summary["average"], **{task: e["score"] for task, e in summary["tasks"].items()}}
        print(f"scores {name}: " + ", ".join(f"{k} {100 * v:.2f}" for k, v in entry.items()), flush=True)
        with WRITING:
            results["commands"]["score"][name] = "bertjax " + shlex.join(argv)
            results["scores"][name] = entry
            write(results, names, work)

    jobs = [(arm, seed) for seed in seeds for arm in ARMS]
    list(pool.map(lambda job: full_run(*job), jobs))
    list(pool.map(lambda job: score_run(*job), jobs))
    print(tables(results))
    print(f"wrote {work / 'results.json'}, {work / 'results.md'} and {work / 'learning_per_flop.svg'}")
    return 0


def crossings(curves: dict[str, list[dict]]) -> dict[str, dict]:
    """Where each arm's curve reaches each other arm's final loss (same seed), as a share of that arm's FLOPs,
    tokens and seconds; for the pairs of runs finished so far."""
    found = {}
    for name, mine in curves.items():
        arm, seed = name.rsplit(" seed ", 1)
        for other in ARMS:
            theirs = curves.get(f"{other} seed {seed}")
            if other == arm or theirs is None:
                continue
            entry = {"target_loss": theirs[-1]["loss"]}
            for key in ("flops", "model_flops", "real_tokens", "seconds"):
                at = reach(mine, theirs[-1]["loss"], key)
                entry[key] = at
                entry[f"{key}_share"] = None if at is None else at / theirs[-1][key]
            found[f"{arm} reaches {other} seed {seed}"] = entry
    return found


def write(results: dict, names: list[str], work: Path) -> None:
    """results.json and results.md as they stand: the runs finished so far, in the bench's order."""
    results["curves"] = {name: results["curves"][name] for name in names if name in results["curves"]}
    results["scores"] = {name: results["scores"][name] for name in names if name in results["scores"]}
    results["crossings"] = crossings(results["curves"])
    (work / "results.json").write_text(json.dumps(results, indent=2))
    (work / "results.md").write_text(tables(results))
    svg(results["curves"], results["unigram_loss"], work / "learning_per_flop.svg")


def tables(results: dict) -> str:
    """The Markdown tables: the sweep, the final losses, the crossings and the downstream scores."""
    def share(entry, key):
        value = entry[f"{key}_share"]
        return "never" if value is None else f"{value:.2f}x"

    out = [f"Budget {results['budget_flops']:.3g} training FLOPs as computed: " +
           ", ".join(f"{arm} {n:,} steps" for arm, n in results["steps"].items()) +
           f" of {results['batch']} x {results['seq']}. Unigram predictor on the held-out targets: "
           f"{results['unigram_loss']:.3f} nats.", "",
           "| arm | learning rate: held-out loss after the sweep's run | best |", "|---|---|---|"]
    for arm, runs in results["sweep"].items():
        steps = next(iter(runs.values()))["steps"]
        out.append(f"| {arm} ({steps} steps) | " + ", ".join(f"{lr}: {v['loss']:.3f}" for lr, v in runs.items()) +
                   f" | {results['best_lr'][arm]:g} |")
    out += ["", "| arm | seed | final held-out loss | below unigram | computed FLOPs | model FLOPs | real tokens | "
            "seconds |", "|---|---|---|---|---|---|---|---|"]
    for name, curve in results["curves"].items():
        arm, seed = name.rsplit(" seed ", 1)
        last = curve[-1]
        out.append(f"| {arm} | {seed} | {last['loss']:.3f} | {results['unigram_loss'] - last['loss']:.3f} | "
                   f"{last['flops']:.3g} | {last['model_flops']:.3g} | {last['real_tokens']:.3g} | "
                   f"{last['seconds']:.0f} |")
    out += ["", "| arm reaches | the final loss of | seed | computed FLOPs | model FLOPs | real tokens | seconds |",
            "|---|---|---|---|---|---|---|"]
    for name, entry in results["crossings"].items():
        pair, seed = name.rsplit(" seed ", 1)
        arm, other = pair.split(" reaches ")
        out.append(f"| {arm} | {other} ({entry['target_loss']:.3f}) | {seed} | " +
                   " | ".join(share(entry, key) for key in ("flops", "model_flops", "real_tokens", "seconds")) + " |")
    if not results["scores"]:
        return "\n".join(out + ["", "Downstream scores: not yet run."]) + "\n"
    tasks = results["score_settings"]["tasks"].split(",")
    out += ["", "| arm | seed | " + " | ".join(tasks) + " | mean of the four |", "|---|---|" + "---|" * (len(tasks) + 1)]
    for name, entry in results["scores"].items():
        arm, seed = name.rsplit(" seed ", 1)
        out.append(f"| {arm} | {seed} | " + " | ".join(f"{100 * entry[t]:.2f}" for t in tasks) +
                   f" | {100 * entry['average']:.2f} |")
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    sys.exit(main())
