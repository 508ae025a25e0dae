"""A fine-tune workdir belongs to one run, as a pretraining workdir does.

The job records what defines its run (task, data, init, every training setting) in WORKDIR/run.json. A rerun
with the same record resumes from the newest training state (trainer.py saves it every --save-every steps and on
SIGTERM) or, when the run completed (metrics.json written), says so and stops; a rerun with another record is
refused naming the changed keys, unless --overwrite, which removes the earlier run's outputs first. Without this,
two runs' curves interleave in one metrics.jsonl and TensorBoard directory.
"""
from __future__ import annotations

import json
import shutil

from etils import epath

RUN_RECORD = "run.json"
TRAIN_STATE = "train_state"
COMPLETED_METRICS = "metrics.json"
# What a finished run leaves: its metrics (one task), or the summary of all (`finetune glue --task all`).
COMPLETED = (COMPLETED_METRICS, "summary.json")
# What a run writes that a rerun would be mixed with (predictions and exports are rewritten whole by each run).
RUN_OUTPUTS = (RUN_RECORD, TRAIN_STATE, *COMPLETED, "metrics.jsonl", "tensorboard")
# Settings that change how a run is watched or saved, not what it computes: free to change on a rerun.
FREE_KEYS = ("log_every", "save_every", "compilation_cache_dir", "eval_batch_size", "save_checkpoint", "export_hf",
             "overwrite", "verbose")


def claim(workdir: str, record: dict, *, overwrite: bool, log) -> str:
    """Makes `workdir` this run's: "new" (nothing there, or --overwrite cleared it), "resume" (the same run, not
    finished) or "completed" (the same run, finished). Raises ValueError for another run's workdir."""
    root = epath.Path(workdir)
    record = {k: v for k, v in json.loads(json.dumps(record)).items() if k not in FREE_KEYS}
    path = root / RUN_RECORD
    earlier = json.loads(path.read_text()) if path.exists() else None
    if earlier is not None and not any((root / name).exists() for name in RUN_OUTPUTS if name != RUN_RECORD):
        earlier = None  # recorded, but it stopped before writing anything (bad input): nothing to keep
    mixed = earlier is None and any((root / name).exists() for name in RUN_OUTPUTS if name != RUN_RECORD)
    changed = sorted(k for k in set(record) | set(earlier or {}) if (earlier or {}).get(k) != record.get(k)) \
        if earlier is not None else []
    if (changed or mixed) and not overwrite:
        what = (", ".join(f"{k}: {earlier.get(k)!r} -> {record.get(k)!r}" for k in changed) if changed else
                "it holds the outputs of a run that recorded no settings")
        raise ValueError(f"{workdir} belongs to another fine-tuning run ({what}): pass --overwrite to replace it, "
                         f"or use another --workdir")
    if overwrite and (earlier is not None or mixed):
        for name in RUN_OUTPUTS:
            target = root / name
            if target.is_dir():
                shutil.rmtree(target)
            elif target.exists():
                target.unlink()
        log(f"{workdir}: removed the earlier run's outputs (--overwrite)")
        earlier = None
    root.mkdir(parents=True, exist_ok=True)
    if earlier is None:
        path.write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
        return "new"
    if any((root / name).exists() for name in COMPLETED):
        return "completed"
    return "resume"
