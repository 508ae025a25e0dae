"""Training metrics: model FLOPs, MFU against a per-device peak, and the writers (JSONL, TensorBoard, console)."""
from __future__ import annotations

import hashlib
import json
import os
import pathlib
import platform
import socket
import time
import zlib

import jax
import jax.numpy as jnp
import numpy as np
from etils import epath

from bertjax.runtime import jsonio
from bertjax.runtime.console import Console, duration, metric_text
from bertjax.runtime.errors import OutputWriteError, at_file
from bertjax.runtime.extras import install_line
from bertjax.runtime.input_files import read_json, read_text
from bertjax.runtime.outputs import write_whole
from bertjax.model import family
from bertjax.model.family import ModelConfig

# The step metrics shown on the console (all of them go to metrics.jsonl and TensorBoard).
CONSOLE_KEYS = ("loss", "mlm_loss", "sbo_loss", "mlm_accuracy", "nsp_accuracy", "learning_rate", "padding_fraction",
                "real_tokens_per_s", "mfu")

# Dense bf16 peak FLOP/s per chip (vendor figures), keyed by a substring of jax's device_kind.
PEAK_FLOPS_BY_DEVICE_KIND = {
    "TPU v4": 275e12,
    "TPU v5 lite": 197e12,
    "TPU v5e": 197e12,
    "TPU v5p": 459e12,
    "TPU v5": 459e12,
    "TPU v6 lite": 918e12,
    "TPU v6e": 918e12,
    "H200": 989e12,
    "H100": 989e12,
    "A100": 312e12,
}


def train_flops(config: ModelConfig, seq_len: int, real_tokens: float, masked_tokens: float,
                instances: float, sbo: bool = False, windowed: bool = True) -> float:
    """Matmul FLOPs of forward + backward (twice the forward) of the family's pretraining model on real tokens only,
    as the family counts them (`EncoderFamily.train_flops`). Padding positions count nothing, so packed and
    unpacked runs are compared on the work that trains the model. `windowed`: ModernBERT's sliding layers attend
    over their window (the model's work); False: over the whole row (see computed_train_flops_per_sequence)."""
    return family.of(config).train_flops(config, seq_len, real_tokens, masked_tokens, instances, sbo, windowed)


def train_flops_per_sequence(config: ModelConfig, seq_len: int, num_masked: int) -> float:
    """train_flops of one full (unpadded) sequence with `num_masked` predictions."""
    return train_flops(config, seq_len, seq_len, num_masked, 1)


def computed_train_flops_per_sequence(config: ModelConfig, seq_len: int, num_masked: int) -> float:
    """The matmul FLOPs of one row's forward + backward as dense kernels compute them, which is what a CPU (XLA's
    reference attention) spends: every position of the row, padding included; every one of the `num_masked`
    prediction slots (max_predictions_per_seq), filled or not; ModernBERT's sliding layers over the whole row,
    masked, not the window. train_flops counts the model's work instead (real tokens, the window): MFU's."""
    return train_flops(config, seq_len, seq_len, num_masked, 1, windowed=False)


def device_peak_flops(device=None, dtype: str = "bfloat16", cache_dir: str | None = None) -> tuple[float, str]:
    """(peak FLOP/s of one device, where the figure comes from). Accelerators: the vendor table. CPUs: a matmul
    peak measured once per machine and cached (see cached_matmul_peak), so MFU compares across runs."""
    device = device or jax.devices()[0]
    if device.platform != "cpu":
        for kind, peak in PEAK_FLOPS_BY_DEVICE_KIND.items():
            if kind.lower() in device.device_kind.lower():
                return peak, f"{device.device_kind} bf16 table"
    dtype = jnp.float32 if dtype == "float32" or device.platform == "cpu" else jnp.bfloat16
    if device.platform != "cpu":
        return measure_matmul_peak(dtype), f"measured {device.device_kind} matmul peak"
    # Processes of one job read the cache as it is, so that their MFU figures share one denominator.
    peak, source = cached_matmul_peak(device, dtype, cache_dir, recheck=jax.process_count() == 1)
    # One CPU device's matmul uses every core; the devices of this host (forced ones, other local processes) share
    # them, so each device's peak is its share: MFU is then the host's utilisation, as on an accelerator.
    sharing = cpu_devices_on_this_host()
    if sharing > 1:
        return peak / sharing, f"{source}, shared by the {sharing} CPU devices of this host"
    return peak, source


def cpu_devices_on_this_host() -> int:
    """This process's CPU devices times the processes on this host (`launch local` runs them all on one); a
    collective when there are several processes: every process calls it."""
    local = jax.local_device_count()
    if jax.process_count() == 1:
        return local
    from jax.experimental import multihost_utils

    host = zlib.crc32(socket.gethostname().encode()) & 0x7FFFFFFF  # an int32: JAX's default integers
    hosts = np.asarray(multihost_utils.process_allgather(np.asarray(host, np.int32)))
    return local * int((hosts == host).sum())


# How much a fresh CPU matmul peak must beat the cached one to replace it: more than the spread of quick
# measurements on an idle machine, so the figure (and MFU) stays put from run to run.
RAISE_CACHED_PEAK = 1.25


def cached_matmul_peak(device, dtype, cache_dir: str | None = None, recheck: bool = True) -> tuple[float, str]:
    """The CPU matmul peak from DIR/matmul_peak.json (default $XDG_CACHE_HOME/bertjax, else ~/.cache/bertjax),
    measured and stored on the first call for this machine (CPU model, core count, JAX version, dtype).

    Re-measuring at every start gave 0.065-0.204 TFLOP/s on one 2-core machine (other load, frequency), which made
    MFU incomparable between runs, so the cache keeps the highest figure: with `recheck`, a quick measurement that
    beats the cached one by RAISE_CACHED_PEAK replaces it (one taken on a busy machine had the demo report MFU 1.98).
    """
    directory = pathlib.Path(cache_dir or os.environ.get("XDG_CACHE_HOME") or pathlib.Path.home() / ".cache")
    path = directory / "bertjax" / "matmul_peak.json" if cache_dir is None else directory / "matmul_peak.json"
    key = f"{_cpu_model()} | {os.cpu_count()} cores | {device.device_kind} | jax {jax.__version__} | " \
          f"{jnp.dtype(dtype).name}"
    try:
        cache = read_json(path, "the cached matmul peaks (JSON)")
    except (OSError, ValueError):  # none yet, or unreadable: measured again (and rewritten)
        cache = {}
    replaced = ""  # what a higher measurement replaced, for the source line
    if key in cache:
        cached = float(cache[key]["flops"])
        peak = measure_matmul_peak(dtype) if recheck else 0.0
        if peak <= RAISE_CACHED_PEAK * cached:
            return cached, f"cpu matmul peak measured {cache[key]['measured']}, cached in {path}"
        replaced = f" above the cached {cached / 1e12:.3g} (measured {cache[key]['measured']} on a busier machine)"
    else:
        peak = measure_matmul_peak(dtype, repeats=20)
    cache[key] = {"flops": peak, "measured": time.strftime("%Y-%m-%d")}
    try:  # a read-only home only costs the caching
        path.parent.mkdir(parents=True, exist_ok=True)
        write_whole(path, json.dumps(cache, indent=1))
        where = f"cached in {path}"
    except (OSError, OutputWriteError) as error:
        where = f"not cached: {error}"
    return peak, f"cpu matmul peak measured now{replaced}, {where}"


def _cpu_model() -> str:
    try:
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def measure_matmul_peak(dtype=jnp.float32, size: int = 1024, repeats: int = 5) -> float:
    """FLOP/s of a square matmul on the default device (best of `repeats`), as the CPU reference peak."""
    a = jnp.ones((size, size), dtype)
    matmul = jax.jit(lambda x, y: x @ y)
    matmul(a, a).block_until_ready()
    best = np.inf
    for _ in range(repeats):
        start = time.perf_counter()
        matmul(a, a).block_until_ready()
        best = min(best, time.perf_counter() - start)
    return 2 * size ** 3 / best


def to_python(values: dict) -> dict[str, float]:
    return {k: float(v) for k, v in jax.device_get(values).items()}


def interval_metrics(seconds: float, steps: int, rows: int, seq_len: int, counts: dict,
                     config: ModelConfig, peak_flops: float, sbo: bool = False) -> dict[str, float]:
    """Throughput and utilisation over `steps` steps of `rows` rows in all (a batch-size warmup's steps have fewer)
    that took `seconds`; `counts`: the steps' summed real_tokens, masked_tokens and instances (as the train step
    reports them); `sbo`: the SBO head runs."""
    flops = train_flops(config, seq_len, counts["real_tokens"], counts["masked_tokens"], counts["instances"], sbo)
    per_device = flops / seconds / jax.device_count()
    return {"steps_per_s": steps / seconds, "sequences_per_s": rows / seconds,
            "tokens_per_s": rows * seq_len / seconds,
            "real_tokens_per_s": counts["real_tokens"] / seconds, "instances_per_s": counts["instances"] / seconds,
            "tflops_per_device": per_device / 1e12, "mfu": per_device / peak_flops}


def _wandb_run(project: str, directory: epath.Path, run_config: dict | None):
    """A Weights & Biases run for the workdir: its id derived from the workdir's path, so a restarted job continues
    the same run (W&B ignores steps at or below the last one it has: what a killed run logged past its checkpoint
    stays there). WANDB_MODE=offline keeps it on disk (WORKDIR/wandb) for a later `wandb sync`."""
    try:
        import wandb
    except ImportError:
        raise ValueError(f"train.wandb_project needs Weights & Biases (the `tracking` extra): "
                         f"{install_line('tracking')}") from None
    run_id = hashlib.sha1(str(directory.absolute()).encode()).hexdigest()[:16]
    with at_file(directory / "wandb", writing=True):
        return wandb.init(project=project, name=directory.name, id=run_id, resume="allow", dir=str(directory),
                          config=run_config or {})


def _tensorboard_restart(logdir: str, step: int) -> None:
    """TensorBoard's restart marker: SessionLog START events at `step` + 1, after which TensorBoard discards the
    events of earlier files at steps >= `step` + 1 (what a killed run logged past its checkpoint)."""
    from tensorboard.compat.proto import event_pb2
    from tensorboard.summary.writer.event_file_writer import EventFileWriter

    # Event files are read in name order, and names start with the second they were created: the marker's must
    # come after the killed run's files, and the new summary writer's after the marker's.
    _next_second()
    with at_file(logdir, writing=True):
        writer = EventFileWriter(logdir)
        # TensorBoard takes a run's first START for its beginning, not a restart: runs before this one wrote none.
        for _ in range(2):
            writer.add_event(event_pb2.Event(wall_time=time.time(), step=step + 1,
                                             session_log=event_pb2.SessionLog(status=event_pb2.SessionLog.START)))
        writer.close()
    _next_second()


def _next_second() -> None:
    time.sleep(1.0 - time.time() % 1.0)


class MetricsWriter:
    """Writes each logged step to DIR/metrics.jsonl and TensorBoard event files (process 0 only), and the step
    line with its ETA to the console."""

    def __init__(self, workdir: str, total_steps: int, enabled: bool = True, console: Console | None = None,
                 start_step: int | None = None, wandb_project: str = "", run_config: dict | None = None,
                 work=None):
        """`work`: step -> the work before it, what the ETA extrapolates (a batch-size warmup's steps are smaller:
        BatchSchedule.full_steps_before); default the step count. `start_step`: the step a run starts (or resumes) at. What an earlier run logged past it (steps this run
        recomputes), and a last line cut by a kill mid-write, are dropped from metrics.jsonl, and TensorBoard is
        told to drop them too, so both read as one run with increasing steps. `wandb_project`: also log to
        Weights & Biases (`run_config` as the run's config), one W&B run per workdir, continued by restarts."""
        self.enabled = enabled
        self.total_steps = total_steps
        self.work = work or (lambda step: step)
        self.console_out = console or Console(enabled)
        self.start_time = time.time()
        self.start_step: int | None = None
        self._aside_seconds, self._aside_steps = 0.0, 0
        directory = epath.Path(workdir)
        self.jsonl_path = directory / "metrics.jsonl"
        self.tensorboard_dir = directory / "tensorboard"
        if not enabled:
            return
        with at_file(directory, writing=True):
            directory.mkdir(parents=True, exist_ok=True)
        if start_step is not None:
            self._continue_from(start_step)
        from bertjax.runtime.tensorboard_events import ScalarWriter

        self.tensorboard = ScalarWriter(str(self.tensorboard_dir))
        self.wandb = _wandb_run(wandb_project, directory, run_config) if wandb_project else None

    def _continue_from(self, step: int) -> None:
        kept, dropped, cut = [], 0, False
        if self.jsonl_path.exists():
            text = read_text(self.jsonl_path, "the run's metrics (JSON Lines)")
            lines = text.split("\n")
            cut = bool(lines[-1])  # no newline at the end: a write the kill interrupted
            for number, line in enumerate(lines[:-1], 1):
                try:
                    record = jsonio.loads(line, f"{self.jsonl_path}: line {number}", "a metrics record", row=True)
                except ValueError:  # damaged (too deep, not JSON): dropped as a cut line is
                    dropped += 1
                    continue
                if record.get("step", 0) > step:
                    dropped += 1
                else:
                    kept.append(line + "\n")
            if dropped or cut:
                write_whole(self.jsonl_path, "".join(kept))  # a kill now leaves the old file or the new one
                self.console_out.line(f"{self.jsonl_path}: dropped {dropped} record(s) logged past step {step} "
                                      f"(recomputed now)" + (" and a line cut by the kill" if cut else ""))
                # The same records went to TensorBoard; a clean resume (nothing past the step) needs no marker.
                if self.tensorboard_dir.exists():
                    _tensorboard_restart(str(self.tensorboard_dir), step)

    def write(self, step: int, values: dict[str, float], prefix: str = "") -> None:
        if not self.enabled:
            return
        record = {"step": int(step), **{prefix + k: float(v) for k, v in values.items()}}
        self._append(record)
        for key, value in record.items():
            if key != "step":
                self.tensorboard.scalar(key, value, step)
        self.tensorboard.flush()
        self._to_wandb({k: v for k, v in record.items() if k != "step"}, step)

    def write_event(self, step: int, event: str, values: dict) -> None:
        """One `{"step", "event", ...}` record (e.g. the run's goodput account); TensorBoard gets its numbers as
        EVENT/KEY scalars."""
        if not self.enabled:
            return
        self._append({"step": int(step), "event": event, **values})
        for key, value in values.items():
            if isinstance(value, (int, float)):
                self.tensorboard.scalar(f"{event}/{key}", value, step)
        self.tensorboard.flush()
        self._to_wandb({f"{event}/{k}": v for k, v in values.items() if isinstance(v, (int, float))}, step)

    def _append(self, record: dict) -> None:
        with at_file(self.jsonl_path, writing=True), self.jsonl_path.open("a") as f:
            f.write(jsonio.dumps(record) + "\n")

    def _to_wandb(self, values: dict, step: int) -> None:
        if self.wandb is not None:
            with at_file(self.jsonl_path.parent / "wandb", writing=True):
                self.wandb.log(values, step=int(step))

    def mark_start(self, step: int) -> None:
        """The ETA extrapolates from here (call after the first, compiling, step)."""
        self.start_step, self.start_time = step, time.time()
        self._aside_seconds, self._aside_steps = 0.0, 0

    def set_aside(self, seconds: float, steps: float = 0) -> None:
        """Time since `mark_start` the ETA does not extrapolate from: `steps` steps (in `work`'s units) that compiled
        (a fine-tune's batch of a length not met before, a batch-size warmup's next size), an evaluation that
        compiled its step. The ETA is the other steps' mean time (with what else they paid) times the work left;
        "?" until there is one."""
        self._aside_seconds += seconds
        self._aside_steps += steps

    def console(self, step: int, values: dict[str, float], keys=CONSOLE_KEYS, labels: dict | None = None,
                notes: dict | None = None) -> None:
        """`step 40/100 loss=2.301 ... eta 1m05s`: `values` in the order of `keys`, each named by its `labels` entry
        (its key without one) and followed by its `notes` entry in parentheses (what a value is: `mean_loss=0.69
        (steps 31-40)`)."""
        timed = 0 if self.start_step is None else self.work(step) - self.work(self.start_step) - self._aside_steps
        if timed <= 1e-9:
            eta = "?"
        else:
            rate = max(time.time() - self.start_time - self._aside_seconds, 0.0) / timed
            eta = duration(rate * (self.work(self.total_steps) - self.work(step)))
        self.console_out.line(" ".join(filter(None, (f"step {step}/{self.total_steps}",
                                                     metric_text(values, keys, labels, notes), f"eta {eta}"))))

    def close(self) -> None:
        if self.enabled:
            self.tensorboard.close()
            if self.wandb is not None:
                import wandb

                with at_file(self.jsonl_path.parent / "wandb", writing=True):
                    self.wandb.finish()
                    # finish() returns once W&B's service process took the run's end, not once it wrote it: its
                    # run file (offline) could still lack the history under load. teardown waits for that process
                    # to end, which W&B otherwise leaves to an atexit hook (not run when a fatal error ends the job).
                    wandb.teardown()
