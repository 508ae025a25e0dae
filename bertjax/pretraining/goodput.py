"""Where a run's wall time went (goodput), per run and over every run of a workdir (`bertjax goodput`).

A run's clock splits its wall time, from process start, into consecutive intervals, each charged to one category
(`CATEGORIES`), so the categories add up to the wall time by construction. Process 0 keeps the account of its run
in WORKDIR/goodput/<run>.json, rewritten at least every SNAPSHOT_EVERY_S seconds and at every checkpoint, so a
run killed without warning (SIGKILL, a host gone) leaves its account up to then; a run that ends by itself also
appends it to metrics.jsonl as one `{"event": "goodput", ...}` record. Launchers (the babysitter) append their
start and end times to WORKDIR/goodput/launcher.jsonl: the time between runs, and the unrecorded end of a killed
run, come from there. No JAX here: `bertjax goodput` reads a workdir (local or gs://) while the job runs.
"""
from __future__ import annotations

import contextlib
import os
import time

from etils import epath

from bertjax.runtime import jsonio
from bertjax.runtime.input_files import read_json, read_text
from bertjax.runtime.errors import at_file
from bertjax.runtime.outputs import write_whole

GOODPUT_DIR = "goodput"
LAUNCHER_LOG = "launcher.jsonl"
SNAPSHOT_EVERY_S = 10.0
# In the order a run goes through them. startup: process start to mesh ready; setup: tokenizer, job, input
# pipeline, eval set, a fresh train state initialised; restore: the train state read from a checkpoint (a resume
# with its input position, or --init's weights); compile: the first step (compile + one run); input_wait: host
# time waiting for the next batch; step: the productive steps (dispatch, logging, the preemption check); eval;
# checkpoint: the blocking part of saves (and waiting for the last one at exit).
CATEGORIES = ("startup_s", "setup_s", "restore_s", "compile_s", "input_wait_s", "step_s", "eval_s", "checkpoint_s")


def process_start_time() -> float:
    """The wall-clock time this process started (Linux: /proc), else when this module was imported."""
    try:
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22: start time in clock ticks after boot
        with open("/proc/stat") as f:
            boot = next(int(line.split()[1]) for line in f if line.startswith("btime "))
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return _IMPORTED


_IMPORTED = time.time()


class RunClock:
    """Charges the time since the previous mark to a category; everything from `start` on is charged to one."""

    def __init__(self, start: float):
        self.start = self.last = start
        self.seconds = dict.fromkeys(CATEGORIES, 0.0)

    def mark(self, category: str) -> None:
        now = time.time()
        self.seconds[category] += now - self.last
        self.last = now


class RunAccount:
    """One run's goodput account: its clock, the work a previous run lost, and the snapshot file (process 0)."""

    def __init__(self, workdir: str, enabled: bool = True, start: float | None = None):
        self.clock = RunClock(process_start_time() if start is None else start)
        self.directory = epath.Path(workdir) / GOODPUT_DIR
        self.enabled = enabled
        self.run_id = time.strftime("%Y%m%dT%H%M%S", time.gmtime(self.clock.start)) + f"-{os.getpid()}"
        self.first_step = self.step = 0
        self.timed_steps = 0  # productive steps after the compiling one, for the mean step time
        self.lost_steps, self.lost_s_per_step = 0, None
        self.cache_stats = None  # a compile_cache.CacheStats counting this run's compiles, set by the loop
        self._written = 0.0

    def mark(self, category: str) -> None:
        self.clock.mark(category)

    @contextlib.contextmanager
    def charged_to(self, category: str):
        """The block's time is charged to `category`, the time before it (since the previous mark) to step_s: the
        loop's productive time. A block that raises is charged nothing: its time goes to the next mark."""
        self.mark("step_s")
        yield
        self.mark(category)

    def resumed_at(self, step: int, workdir: str) -> None:
        """The run starts at `step`: steps an earlier run computed beyond it are lost work, recomputed now."""
        self.first_step = self.step = step
        computed, seconds_per_step = previous_progress(workdir, exclude=self.run_id)
        self.lost_steps = max(0, computed - step)
        self.lost_s_per_step = seconds_per_step

    def record(self) -> dict:
        """The account so far as a flat dict (what metrics.jsonl and the snapshot hold)."""
        seconds = dict(self.clock.seconds)
        wall = self.clock.last - self.clock.start
        per_step = self.lost_s_per_step
        if per_step is None and self.timed_steps:  # no timing from the run that lost them: this run's pace
            per_step = seconds["step_s"] / self.timed_steps
        return {**{k: round(v, 3) for k, v in seconds.items()}, "wall_s": round(wall, 3),
                "lost_steps": self.lost_steps, "lost_s": round(self.lost_steps * (per_step or 0.0), 3),
                "goodput": round(seconds["step_s"] / wall, 4) if wall > 0 else 0.0,
                "compile_cache_hits": getattr(self.cache_stats, "hits", 0),
                "compile_cache_misses": getattr(self.cache_stats, "misses", 0),
                "first_step": self.first_step, "step": self.step, "timed_steps": self.timed_steps}

    def snapshot(self, step: int, *, force: bool = False, ended: bool = False, status: str = "") -> None:
        """Rewrites WORKDIR/goodput/<run>.json (at most every SNAPSHOT_EVERY_S unless `force`)."""
        self.step = step
        if not self.enabled or not (force or ended or time.time() - self._written >= SNAPSHOT_EVERY_S):
            return
        document = {"run": self.run_id, "process_start": self.clock.start, "updated": self.clock.last,
                    "ended": ended, "status": status, **self.record()}
        with at_file(self.directory, writing=True):
            self.directory.mkdir(parents=True, exist_ok=True)
        write_whole(self.directory / f"{self.run_id}.json", jsonio.dumps(document, indent=1) + "\n")
        self._written = time.time()


def launcher_event(workdir: str, event: str, **fields) -> None:
    """Appends {"event", "time", **fields} to WORKDIR/goodput/launcher.jsonl (a launcher's start/end of a run)."""
    path = epath.Path(workdir) / GOODPUT_DIR / LAUNCHER_LOG
    line = jsonio.dumps({"event": event, "time": time.time(), **fields}) + "\n"
    with at_file(path, writing=True):
        path.parent.mkdir(parents=True, exist_ok=True)
        if "://" in str(path):  # objects cannot be appended to: rewritten whole (the launcher is the only writer)
            path.write_text((path.read_text() if path.exists() else "") + line)
        else:
            with open(path, "a") as f:
                f.write(line)


def run_snapshots(workdir: str) -> list[dict]:
    """Every run's account in WORKDIR/goodput, oldest first (an unreadable file is skipped: see unreadable_runs)."""
    return _read_runs(workdir)[0]


def unreadable_runs(workdir: str) -> list[str]:
    """`goodput/<run>.json: why` for each run account that cannot be read (cut or damaged: written atomically, a
    whole one is never half there), which an account of the job leaves out."""
    return _read_runs(workdir)[1]


def _read_runs(workdir: str) -> tuple[list[dict], list[str]]:
    runs, unreadable = [], []
    directory = epath.Path(workdir) / GOODPUT_DIR
    if directory.exists():
        for path in sorted(directory.glob("*.json")):
            try:
                run = read_json(path, "a run's goodput account (JSON)")
                if not isinstance(run, dict) or "process_start" not in run:
                    raise ValueError("not a run account")
                runs.append(run)
            except (OSError, ValueError) as error:
                why, name = str(error), f"{GOODPUT_DIR}/{path.name}"
                unreadable.append(name + why[len(str(path)):] if why.startswith(str(path)) else f"{name}: {why}")
    return sorted(runs, key=lambda r: r["process_start"]), unreadable


def previous_progress(workdir: str, exclude: str = "") -> tuple[int, float | None]:
    """(the highest step earlier runs are known to have computed, the seconds per step of the run that computed
    it, or None): the most of the steps in metrics.jsonl and of the runs' accounts (a lower bound where
    train.log_every > 1 and the run was killed between snapshots)."""
    highest, per_step = 0, None
    for run in run_snapshots(workdir):
        if run["run"] != exclude and run["step"] >= highest:
            highest = run["step"]
            per_step = run["step_s"] / run["timed_steps"] if run.get("timed_steps") else None
    metrics = epath.Path(workdir) / "metrics.jsonl"
    if metrics.exists():
        for number, line in enumerate(read_text(metrics, "the run's metrics (JSON Lines)").splitlines(), 1):
            try:
                record = jsonio.loads(line, f"{metrics}: line {number}", "a metrics record", row=True)
            except ValueError:
                continue  # a line cut by a kill
            if "event" not in record and int(record.get("step", 0)) > highest:
                highest = int(record["step"])
    return highest, per_step


def job_account(workdir: str, now: float | None = None) -> dict:
    """Every run of the workdir added up: per-category seconds, the lost work per restart, the time outside the
    runs (from the launcher's log where there is one) and the goodput of the whole job; `unreadable` names the run
    accounts left out (the account is then incomplete)."""
    now = time.time() if now is None else now
    runs, unreadable = _read_runs(workdir)
    launcher = _launcher_events(workdir)
    if not runs:
        raise FileNotFoundError(f"{epath.Path(workdir) / GOODPUT_DIR}: no run accounts (is {workdir} the --workdir "
                                f"of a `bertjax pretrain` run?)" + (f"; unreadable: {'; '.join(unreadable)}"
                                                                     if unreadable else ""))
    ends = sorted(e["time"] for e in launcher if e["event"] == "end")
    totals = dict.fromkeys(CATEGORIES, 0.0)
    total = {"lost_steps": 0, "lost_s": 0.0, "unrecorded_s": 0.0, "runs": []}
    for run in runs:
        for key in CATEGORIES:
            totals[key] += run.get(key, 0.0)
        end = run["process_start"] + run["wall_s"]
        unrecorded = 0.0
        if not run["ended"]:
            # Killed: the launcher saw the run end after its last snapshot (without a launcher, a run still going).
            after = [t for t in ends if t >= end]
            if after:
                unrecorded = after[0] - end
                end = after[0]
        total["lost_steps"] += run["lost_steps"]
        total["lost_s"] += run["lost_s"]
        total["unrecorded_s"] += unrecorded
        total["runs"].append({"run": run["run"], "start": run["process_start"], "end": end,
                              "status": run["status"] or ("ended" if run["ended"] else "killed or running"),
                              "first_step": run["first_step"], "step": run["step"], "wall_s": run["wall_s"],
                              "unrecorded_s": round(unrecorded, 3), "lost_steps": run["lost_steps"],
                              "lost_s": run["lost_s"], "goodput": run["goodput"],
                              "compile_s": run["compile_s"], "compile_cache_hits": run.get("compile_cache_hits", 0)})
    starts = [e["time"] for e in launcher if e["event"] == "start"]
    first = min([runs[0]["process_start"], *starts])
    last = max([r["end"] for r in total["runs"]] + ends)
    wall = last - first
    in_runs = sum(r["wall_s"] + r["unrecorded_s"] for r in total["runs"])
    productive = max(0.0, totals["step_s"] - total["lost_s"])
    return {**{k: round(v, 3) for k, v in totals.items()}, "wall_s": round(wall, 3),
            "between_runs_s": round(max(0.0, wall - in_runs), 3), "unrecorded_s": round(total["unrecorded_s"], 3),
            "lost_steps": total["lost_steps"], "lost_s": round(total["lost_s"], 3),
            "productive_s": round(productive, 3), "goodput": round(productive / wall, 4) if wall > 0 else 0.0,
            "launcher_restarts": max(0, len(starts) - 1) if starts else None,
            "last_update_age_s": round(now - max(r["updated"] for r in runs), 1), "runs": total["runs"],
            "unreadable": unreadable}


def _launcher_events(workdir: str) -> list[dict]:
    path = epath.Path(workdir) / GOODPUT_DIR / LAUNCHER_LOG
    if not path.exists():
        return []
    events = []
    for number, line in enumerate(read_text(path, "the launchers' events (JSON Lines)").splitlines(), 1):
        try:
            events.append(jsonio.loads(line, f"{path}: line {number}", "a launcher's event", row=True))
        except ValueError:
            continue
    return events


def format_run(record: dict) -> str:
    """A run's account as the closing summary's line."""
    parts = [f"{key[:-2]} {record[key]:.1f}s" for key in CATEGORIES if record[key] >= 0.05]
    line = f"  goodput {record['goodput']:.1%} of {record['wall_s']:.1f}s wall: {', '.join(parts)}"
    if record["lost_steps"]:
        line += f"; {record['lost_steps']} step(s) lost by the previous run (~{record['lost_s']:.1f}s), recomputed"
    return line


def format_job(account: dict, workdir: str) -> list[str]:
    """`bertjax goodput`'s lines."""
    wall = account["wall_s"] or 1.0
    lines = [f"{workdir}: {len(account['runs'])} run(s), {account['wall_s']:.1f}s wall, goodput "
             f"{account['goodput']:.1%} ({account['productive_s']:.1f}s of productive steps)"]
    for key in (*CATEGORIES, "unrecorded_s", "between_runs_s", "lost_s"):
        label = {"unrecorded_s": "killed runs' unrecorded end", "between_runs_s": "between runs (launcher)",
                 "lost_s": "of which lost steps (recomputed)"}.get(key, key[:-2])
        lines.append(f"  {label:<34} {account[key]:>10.1f}s {account[key] / wall:>7.1%}")
    for index, run in enumerate(account["runs"]):
        lost = f", lost {run['lost_steps']} step(s) ~{run['lost_s']:.1f}s" if run["lost_steps"] else ""
        lines.append(f"  run {index + 1} {run['run']}: steps {run['first_step']} -> {run['step']}, "
                     f"{run['wall_s']:.1f}s (+{run['unrecorded_s']:.1f}s unrecorded), {run['status']}, compile "
                     f"{run['compile_s']:.1f}s ({run['compile_cache_hits']} cache hit(s)){lost}")
    if account["launcher_restarts"] is not None:
        lines.append(f"  launcher: {account['launcher_restarts']} restart(s) recorded")
    lines.append(f"  last update {account['last_update_age_s']:.0f}s ago")
    lines += [f"  incomplete: left out {name} (cut or damaged)" for name in account["unreadable"]]
    return lines
