"""A fine-tune workdir belongs to one run, as a pretraining workdir does.

The job records what defines its run (task, data, init, every training setting, and the size and SHA-256 of each
file it reads) in WORKDIR/run.json. A rerun with the same record resumes from the newest training state (trainer.py
saves it every --save-every steps and on SIGTERM) or, when the run completed (metrics.json written), says so and
stops; a rerun with another record, or on changed files, is refused naming what changed, unless --overwrite, which
removes the earlier run's outputs first (only what a run writes: a user's files beside them stay). Without this,
two runs' curves interleave in one metrics.jsonl and TensorBoard directory, or one run trains on two datasets.
"""
from __future__ import annotations

import json
import os

from etils import epath

from bertjax.runtime import jsonio, workdir_paths
from bertjax.runtime.input_files import INPUT_KEY, read_json
from bertjax.runtime.outputs import open_whole, write_whole

RUN_RECORD = "run.json"
TRAIN_STATE = "train_state"
COMPLETED_METRICS = "metrics.json"
# What a finished run leaves: its metrics (one task), or the summary of all (`finetune glue --task all`).
COMPLETED = (COMPLETED_METRICS, "summary.json")
# The fine-tuned model a run keeps (a bertjax checkpoint by default, an HF export with --export-hf).
MODELS = ("checkpoint", "hf")
# What a run writes that a rerun would be mixed with (predictions are rewritten whole by each run), and its model,
# which `predict --model WORKDIR` would take for the new run's; in tensorboard/ only its event files are the run's (a
# user's own runs may sit beside them).
RUN_OUTPUTS = (RUN_RECORD, TRAIN_STATE, *COMPLETED, "metrics.jsonl", *MODELS)
# Those of them a run writes as directories (the rest are files).
RUN_DIRECTORIES = (TRAIN_STATE, *MODELS)
TENSORBOARD, EVENT_FILES = "tensorboard", "events.out.tfevents.*"
# Settings that change how a run is watched or saved, not what it computes: free to change on a rerun.
FREE_KEYS = ("compilation_cache_dir", "eval_batch_size", "save_checkpoint", "export_hf", "overwrite", "verbose")
# Settings that leave the weights trained so far as they are (when to log, save and evaluate, which evaluation is
# kept): a resume takes their new values and says so in one line; the record keeps the newest.
RESUMABLE_KEYS = ("metric_for_best", "eval_every", "early_stopping_patience", "log_every", "save_every")
# Recorded, not compared: the command as typed (for the model card); flags in another order are the same run.
UNCOMPARED_KEYS = ("argv",)
# Settings that name a file or directory the run reads: recorded and compared resolved (`train.csv`, `./train.csv`,
# its absolute path, or the same file named from another directory are one input), their content by `input:` keys.
PATH_KEYS = ("data", "train", "dev", "test", "predict", "init")


def _resolved(value):
    """A local path that exists, resolved (workdir_paths.canonical); anything else (a hub id, gs://) as given."""
    return workdir_paths.canonical(value) if isinstance(value, str) and os.path.exists(value) else value


def run_outputs(root: epath.Path, subruns: tuple[str, ...] = ()) -> list[epath.Path]:
    """What a bertjax run wrote in `root` (its record aside): nothing else there is removed by --overwrite. A
    `tensorboard/` that is a symlink holding event files is itself the output: the link goes, what it points to
    (outside the workdir) stays. `subruns`: the folders of a run made of several (`glue --task all`: one per task),
    each the run's where it holds a run's outputs."""
    found = [root / name for name in RUN_OUTPUTS if name != RUN_RECORD and (root / name).exists()
             and (root / name).is_dir() == (name in RUN_DIRECTORIES)]
    found += [root / name for name in subruns if (root / name).is_dir() and run_outputs(root / name)]
    board = root / TENSORBOARD
    events = sorted(board.glob(EVENT_FILES)) if board.is_dir() else []
    return found + ([board] if events and os.path.islink(board) else events)


def claim(workdir: str, record: dict, *, overwrite: bool, log, subruns: tuple[str, ...] = ()) -> str:
    """Makes `workdir` this run's: "new" (nothing there, or --overwrite cleared it), "resume" (the same run, not
    finished) or "completed" (the same run, finished). Raises ValueError for another run's workdir, or for this
    run's when the files it read changed since (`input:` keys, see input_fingerprints). `subruns`: see
    run_outputs (a task's folder left by --overwrite was read by the new run as that task finished)."""
    root = epath.Path(workdir)
    record = {k: _resolved(v) if k in PATH_KEYS else v for k, v in json.loads(json.dumps(record)).items()
              if k not in FREE_KEYS}
    for name in RUN_OUTPUTS:  # a user's own file or folder under a name a run writes: not a run's, never removed
        other = root / name
        if other.exists() and other.is_dir() != (name in RUN_DIRECTORIES):
            written_as = "directory" if name in RUN_DIRECTORIES else "file"
            raise ValueError(f"{other} is a {'directory' if other.is_dir() else 'file'} no fine-tuning run wrote (a "
                             f"run writes its {name} as a {written_as}); move it out of the way, or use another "
                             "--workdir")
    path = root / RUN_RECORD
    earlier = read_json(path, "a fine-tune's run record (run.json)") if path.exists() else None
    if earlier is not None and not isinstance(earlier, dict):
        raise ValueError(f"{path}: expected a JSON object (the fine-tune's run record), got {type(earlier).__name__}")
    if earlier is not None and isinstance(earlier.get("workdir"), str):  # recorded before workdirs were canonical
        earlier["workdir"] = workdir_paths.canonical(earlier["workdir"])
    if earlier is not None:  # recorded before inputs were resolved: as they resolve here
        earlier.update({k: _resolved(earlier[k]) for k in PATH_KEYS if k in earlier})
    outputs = run_outputs(root, subruns)
    if earlier is not None and not outputs:
        earlier = None  # recorded, but it stopped before writing anything (bad input): nothing to keep
    mixed = earlier is None and bool(outputs)
    if earlier is not None and not any(k.startswith(INPUT_KEY) for k in earlier):  # recorded before inputs were
        record = {k: v for k, v in record.items() if not k.startswith(INPUT_KEY)}
    changed = sorted(k for k in set(record) | set(earlier or {})
                     if k not in UNCOMPARED_KEYS and (earlier or {}).get(k) != record.get(k)) \
        if earlier is not None else []
    # A resumable key the earlier record lacks (recorded since) is not a change.
    resumable = [k for k in changed if k in RESUMABLE_KEYS and k in earlier]
    changed = [k for k in changed if k not in RESUMABLE_KEYS]
    if (changed or mixed) and not overwrite:
        what = (", ".join(f"{k}: {earlier.get(k)!r} -> {record.get(k)!r}" for k in changed) if changed else
                "it holds the outputs of a run that recorded no settings")
        inputs_only = changed and all(k.startswith(INPUT_KEY) for k in changed)
        head = f"{workdir}: the files its run read changed since" if inputs_only else \
            f"{workdir} belongs to another fine-tuning run"
        raise ValueError(f"{head} ({what}): pass --overwrite to replace it, or use another --workdir")
    if overwrite and (earlier is not None or mixed):
        for target in outputs + [path]:
            workdir_paths.remove(target)
        log(f"{workdir}: removed the earlier run's outputs (--overwrite)")
        earlier = None
    root.mkdir(parents=True, exist_ok=True)
    if earlier is None:
        write_whole(path, json.dumps(record, indent=2, sort_keys=True) + "\n")
        return "new"
    if any((root / name).exists() for name in COMPLETED):
        return "completed"
    if resumable or earlier != record:  # the newest values, for the next resume to compare with
        write_whole(path, json.dumps(record, indent=2, sort_keys=True) + "\n")
    if resumable:
        log(f"{workdir}: resuming; changed since: " + ", ".join(
            f"--{k.replace('_', '-')} {_shown(earlier[k])} -> {_shown(record.get(k))}" for k in resumable)
            + " (the weights trained so far stay valid)")
    return "resume"


def _shown(value) -> str:
    """A setting's value as the user typed it ("" as '')."""
    return repr(value) if value in ("", None) else str(value)


def write_summary(directory: str, summary: dict, table: str) -> None:
    """A finished multi-task run's summary.json and its Markdown table summary.md, each written whole."""
    os.makedirs(directory, exist_ok=True)
    with open_whole(os.path.join(directory, "summary.json"), "w") as f:
        jsonio.dump(summary, f, indent=2)
    with open_whole(os.path.join(directory, "summary.md"), "w") as f:
        f.write(table)
