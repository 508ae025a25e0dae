"""`bertjax score`: a checkpoint's downstream scores, as MosaicBERT's and ModernBERT's evaluation harnesses give
them. Each GLUE task whose train and dev files are present is fine-tuned from the checkpoint with that task's
recipe, once per seed (`glue.run_task`, the `finetune glue` job); the dev metrics of every run, each task's GLUE
score over its seeds and their average go to OUT/summary.json and OUT/summary.md (OUT: the run's `scores/`).

The recipes are MosaicBERT's (Portes et al. 2023), as its harness runs them: mosaicml/examples,
examples/benchmarks/bert/src/glue/finetuning_jobs.py at 10b8a9a6 (per task the peak learning rate, batch, epochs and
decoupled weight decay; 256 tokens; every task 6% linear warmup, then linear decay to 0:
yamls/finetuning/glue/mosaic-bert-base-uncased.yaml at c44effac, which also gives the number of seeds per task).
Composer's DecoupledAdamW decays each weight by `weight_decay` per step, not times the learning rate; the trainer
here (optax's form) multiplies it by the learning rate, so it is given as weight_decay / learning_rate (0.1, RTE
1.0). What differs from that harness: Adam's beta2 is the trainer's 0.999 (0.98 there), gradients are clipped at
norm 1 (not there), LayerNorm and biases are not decayed (they are there), and RTE, MRPC and STS-B start from the
checkpoint, not from its MNLI fine-tune (which needs MNLI's data). WNLI is not scored, as neither BERT nor MosaicBERT
scored it.

A task's score is GLUE's (`glue_metrics.task_score`: CoLA MCC, STS-B the mean of Pearson and Spearman, MRPC and QQP
of F1 and accuracy, MNLI of matched and mismatched accuracy, the others accuracy), on the dev set; over seeds the
mean, as MosaicBERT's glue.py takes it. The average over the tasks scored names them: over fewer than the eight it
is not a GLUE score. Resumable: each task and seed is a fine-tune run of its own (run_record.py), so the same
command again skips the finished runs and resumes an interrupted one; other settings are refused unless --overwrite.
"""
from __future__ import annotations

import dataclasses
import os

import numpy as np

from bertjax.finetune import glue_data, run_record
from bertjax.finetune.settings import TrainSettings
from bertjax.options import floats, ints, option, range_problems
from bertjax.runtime.input_files import read_json

SOURCE = ("MosaicBERT's GLUE recipe (Portes et al. 2023; mosaicml/examples benchmarks/bert "
          "src/glue/finetuning_jobs.py)")
AGGREGATE = "mean over seeds"
MAX_SEQ_LENGTH = 256
WARMUP_PROPORTION = 0.06


@dataclasses.dataclass(frozen=True)
class Recipe:
    """One task's fine-tuning recipe, as MosaicBERT's harness gives it."""

    learning_rate: float
    batch_size: int
    epochs: float
    seeds: int               # how many seeds the harness runs
    decay_per_step: float    # Composer's DecoupledAdamW weight_decay (not multiplied by the learning rate)

    @property
    def weight_decay(self) -> float:
        """The same decay in TrainSettings' (optax's) form, which multiplies it by the learning rate."""
        return round(self.decay_per_step / self.learning_rate, 12)


RECIPES = {
    "cola": Recipe(5e-5, 32, 10, 4, 5e-6),
    "sst2": Recipe(3e-5, 16, 3, 3, 3e-6),
    "mrpc": Recipe(8e-5, 32, 10, 5, 8e-6),
    "stsb": Recipe(3e-5, 32, 10, 5, 3e-6),
    "qqp": Recipe(3e-5, 16, 5, 1, 3e-6),
    "mnli": Recipe(5e-5, 48, 3, 1, 5e-6),
    "qnli": Recipe(1e-5, 16, 10, 1, 1e-6),
    "rte": Recipe(1e-5, 16, 3, 5, 1e-5),
}
SCORED_TASKS = tuple(name for name in glue_data.TASKS if name in RECIPES)  # GLUE's order, WNLI left out

# What each task's score is, as the table and summary.json name it.
HEADLINE = {"cola": "mcc", "stsb": "(pearson + spearman) / 2", "mrpc": "(f1 + accuracy) / 2",
            "qqp": "(f1 + accuracy) / 2", "mnli": "(matched + mismatched accuracy) / 2"}


def _names(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


@dataclasses.dataclass(frozen=True)
class ScoreSettings:
    """What `bertjax score` runs (its flags; `pretrain --score-set KEY=VALUE` sets the same keys)."""

    tasks: str = option("", "comma-separated GLUE tasks to score (default: the recipe's eight, " +
                        ",".join(SCORED_TASKS) + "); a task without its train or dev file is skipped and said")
    seeds: str = option("", "comma-separated seeds: each task is fine-tuned once per seed (default: as many as "
                        "the recipe runs, from 0: CoLA 4, SST-2 3, MRPC, STS-B and RTE 5, MNLI, QQP and QNLI 1)")
    epochs: float = option(0.0, "passes over each training set (0: the recipe's: 3 to 10 by task)", valid=floats(0))
    max_seq_length: int = option(MAX_SEQ_LENGTH, "tokens per example (the recipe's 256)", valid=ints(3))
    max_train_examples: int = option(0, "train each run on a seeded random subset of this many rows (0: all), for "
                                     "quick runs", valid=ints(0))
    max_eval_examples: int = option(0, "score the first N dev rows of each task (0: all), for quick runs; the "
                                    "summary says so", valid=ints(0))

    def __post_init__(self):
        problems = range_problems(self)
        unknown = [name for name in _names(self.tasks) if name not in RECIPES]
        if unknown:
            problems.append(f"tasks: {', '.join(unknown)} not scored (expected some of {', '.join(SCORED_TASKS)})")
        try:
            seeds = [int(seed) for seed in _names(self.seeds)]
        except ValueError:
            seeds = None
        if seeds is None or any(not 0 <= seed <= 2**31 - 1 for seed in seeds) or len(set(seeds)) != len(seeds):
            problems.append(f"seeds={self.seeds!r}: expected distinct integers >= 0, comma-separated (e.g. 0,1)")
        if problems:
            raise ValueError("score settings: " + "; ".join(problems))

    def task_names(self) -> list[str]:
        asked = _names(self.tasks)
        return [name for name in SCORED_TASKS if name in asked] if asked else list(SCORED_TASKS)

    def seeds_of(self, task: str) -> list[int]:
        return [int(seed) for seed in _names(self.seeds)] or list(range(RECIPES[task].seeds))

    def train_settings(self, task: str, seed: int) -> TrainSettings:
        """The fine-tune of `task` with `seed`: the recipe, with these settings' caps."""
        recipe = RECIPES[task]
        return TrainSettings(learning_rate=recipe.learning_rate, batch_size=recipe.batch_size,
                             epochs=self.epochs or recipe.epochs, warmup_proportion=WARMUP_PROPORTION,
                             weight_decay=recipe.weight_decay, seed=seed,
                             max_train_examples=self.max_train_examples, max_eval_examples=self.max_eval_examples,
                             predict_test=False)


def settings_from_overrides(overrides: list[str], flag: str = "--score-set") -> ScoreSettings:
    """ScoreSettings from `KEY=VALUE` strings (`pretrain --score-set`), each parsed and checked as its flag is."""
    from bertjax import options

    values = options.to_config_dict(ScoreSettings())
    for override in overrides:
        try:
            options.apply_override(values, ScoreSettings, override)
        except ValueError as error:
            raise ValueError(str(error).replace("--set ", f"{flag} ", 1)) from None
    return options.from_config_dict(ScoreSettings, values)


def command_flags(settings: ScoreSettings) -> list[str]:
    """The `bertjax score` flags that give `settings` (those off their default)."""
    from bertjax.options import flag_name

    return [word for field in dataclasses.fields(settings) if getattr(settings, field.name) != field.default
            for word in (flag_name(field.name), str(getattr(settings, field.name)))]


def missing_files(task: str, data: str) -> list[str]:
    """The files of `task` that scoring needs (train and dev) and `data` (a GLUE directory) lacks; none for tfds,
    whose absence its reader tells."""
    if data == "tfds" or data.startswith("tfds:"):
        return []
    spec = glue_data.get_task(task)
    folder = os.path.join(data, spec.dir_name)
    needed = [os.path.join(folder, "train.tsv")] + [os.path.join(folder, split.dev_file) for split in spec.splits]
    return [path for path in needed if not os.path.isfile(path)]


def run_dir(out: str, task: str, seed: int) -> str:
    return os.path.join(out, task, f"seed{seed}")


def score(checkpoint: str, data: str, out: str, settings: ScoreSettings, *, overwrite: bool = False,
          log=print) -> dict:
    """Scores `checkpoint` on the GLUE tasks of `settings` present in `data` (see the module docstring); writes
    OUT/summary.json and OUT/summary.md and returns the summary. `log`: one line per decision (a task skipped, a
    run finished earlier)."""
    from bertjax.checkpoint import resolve_checkpoint
    from bertjax.finetune import glue
    from bertjax.interop.hub import local_model_path
    from bertjax.interop.load import load_init
    from bertjax.runtime.input_files import input_fingerprints
    from bertjax.runtime.workdir_lock import WorkdirLock
    from bertjax.runtime.workdir_paths import canonical

    data = data if data == "tfds" or data.startswith("tfds:") else canonical(data)  # one spelling, recorded
    missing = {task: files for task in settings.task_names() if (files := missing_files(task, data))}
    for task, files in missing.items():
        log(f"{task}: not scored, {data} lacks {', '.join(os.path.relpath(f, data) for f in files)}")
    present = [task for task in settings.task_names() if task not in missing]
    if not present:
        raise ValueError(f"--glue {data}: none of the tasks asked ({', '.join(settings.task_names())}) has its "
                         "train and dev files (<Task>/train.tsv and dev.tsv, as GLUE's download lays them out)")
    # The step scored, not the run directory: a run that trains on has another newest step, and other scores.
    source = canonical(resolve_checkpoint(local_model_path(checkpoint)))
    loaded = None
    runs = {}
    with WorkdirLock(out, flag="--out", log=log):
        for task in present:
            spec = glue_data.get_task(task)
            inputs = input_fingerprints([os.path.join(data, spec.dir_name)])
            for seed in settings.seeds_of(task):
                where, train = run_dir(out, task, seed), settings.train_settings(task, seed)
                record = {"job": "score", "task": task, "seed": seed, "data": data, "init": source,
                          "max_seq_length": settings.max_seq_length, **dataclasses.asdict(train), **inputs}
                if run_record.claim(where, record, overwrite=overwrite, log=log) == "completed":
                    log(f"{task} seed {seed}: finished earlier ({where}/metrics.json)")
                    result = read_json(os.path.join(where, "metrics.json"), "a finished task's metrics (JSON)")
                else:
                    log(f"{task} seed {seed}: fine-tuning (lr {train.learning_rate:g}, batch {train.batch_size}, "
                        f"{train.epochs:g} epochs) into {where}")
                    loaded = loaded or load_init(checkpoint)
                    result = glue.run_task(task, data, where, train, init=source, loaded=loaded,
                                           max_seq_length=settings.max_seq_length)
                runs.setdefault(task, []).append({"seed": seed, "metrics": result["metrics"],
                                                  "score": result["score"], "run": os.path.relpath(where, out)})
        summary = summarize(runs, missing, source=source, data=data, settings=settings)
        run_record.write_summary(out, summary, summary_table(summary))
    return summary


def summarize(runs: dict, missing: dict, *, source: str, data: str, settings: ScoreSettings) -> dict:
    """summary.json's content: per task its runs, its score and metrics as the mean over seeds; the average of
    the task scores, naming the tasks it covers."""
    from bertjax.finetune.glue import flat

    tasks = {}
    for task in settings.task_names():
        if task in missing:
            tasks[task] = {"missing": [os.path.relpath(path, data) for path in missing[task]]}
            continue
        scores = [run["score"] for run in runs[task]]
        metrics = [flat(run["metrics"]) for run in runs[task]]
        recipe = settings.train_settings(task, 0)
        tasks[task] = {
            "headline": HEADLINE.get(task, "accuracy"), "score": float(np.mean(scores)),
            "score_min": float(np.min(scores)), "score_max": float(np.max(scores)),
            "metrics": {name: float(np.mean([m[name] for m in metrics])) for name in metrics[0]},
            "runs": runs[task],
            "recipe": {"learning_rate": recipe.learning_rate, "batch_size": recipe.batch_size,
                       "epochs": recipe.epochs, "weight_decay": recipe.weight_decay,
                       "warmup_proportion": recipe.warmup_proportion, "max_seq_length": settings.max_seq_length},
        }
    scored = [task for task in tasks if "score" in tasks[task]]
    average = float(np.mean([tasks[task]["score"] for task in scored]))
    full = scored == list(SCORED_TASKS)
    return {
        "checkpoint": source, "glue": data, "recipe": SOURCE, "aggregate": AGGREGATE, "split": "dev",
        "max_train_examples": settings.max_train_examples or None,
        "max_eval_examples": settings.max_eval_examples or None,
        "tasks": tasks, "average": average, "average_over": scored,
        "not_scored": [task for task in tasks if task not in scored],
        "average_is": ("the GLUE dev average (8 tasks, WNLI left out as BERT left it)" if full else
                       f"the mean of {len(scored)} of GLUE's 8 scored tasks ({', '.join(scored)}): not a GLUE score"),
    }


def summary_table(summary: dict) -> str:
    """summary.md: a Markdown table of the dev scores (x100), per seed and their mean, and the average."""
    caps = [f"trained on {summary['max_train_examples']:,} rows" if summary["max_train_examples"] else "",
            f"dev: first {summary['max_eval_examples']:,} rows" if summary["max_eval_examples"] else ""]
    caps = "; ".join(cap for cap in caps if cap)
    lines = [f"Dev scores of {summary['checkpoint']}, {summary['recipe']}; {summary['aggregate']}"
             + (f" ({caps}: quick runs, not the recipe's scores)" if caps else "") + ".", "",
             "| task | score (GLUE's, dev) | per seed | mean | metrics (mean over seeds) |", "|---|---|---|---|---|"]
    for task, entry in summary["tasks"].items():
        if "missing" in entry:
            lines.append(f"| {task} | not scored: no {', '.join(entry['missing'])} | | - | |")
            continue
        seeds = ", ".join(f"{run['seed']}: {100 * run['score']:.2f}" for run in entry["runs"])
        metrics = ", ".join(f"{name} {100 * value:.2f}" for name, value in entry["metrics"].items())
        lines.append(f"| {task} | {entry['headline']} | {seeds} | {100 * entry['score']:.2f} | {metrics} |")
    lines.append(f"| **average** | {summary['average_is']} | | {100 * summary['average']:.2f} | |")
    return "\n".join(lines) + "\n"
