"""Training metrics: model FLOPs, MFU against a per-device peak, and the writers (JSONL, TensorBoard, console)."""
from __future__ import annotations

import json
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from etils import epath

from bertjax.model_config import BertConfig

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


def train_flops(config: BertConfig, seq_len: int, real_tokens: float, masked_tokens: float,
                instances: float, sbo: bool = False) -> float:
    """Matmul FLOPs of forward + backward (twice the forward) of BertForPreTraining on real tokens only.

    Forward, per layer and real token: Q/K/V/output projections 4*2*H^2, feed-forward 2*2*H*I, attention scores
    and context 2*2*L*H (L = the row length the kernels attend over); per masked token the MLM head (transform
    2*H^2, decoder 2*H*V), and with the SBO head (`sbo`) its two layers (2*3H*H + 2*H^2) and decoder again; per
    instance the pooler and NSP classifier. Padding positions count nothing, so
    packed and unpacked runs are compared on the work that trains the model.
    """
    h, inter, layers = config.hidden_size, config.intermediate_size, config.num_hidden_layers
    per_token = layers * (8 * h * h + 4 * h * inter + 4 * seq_len * h)
    per_masked = 2 * h * h + 2 * h * config.vocab_size
    if sbo:
        per_masked += 2 * 3 * h * h + 2 * h * h + 2 * h * config.vocab_size
    forward = real_tokens * per_token + masked_tokens * per_masked + instances * (2 * h * h + 2 * h * 2)
    return 3.0 * float(forward)


def train_flops_per_sequence(config: BertConfig, seq_len: int, num_masked: int) -> float:
    """train_flops of one full (unpadded) sequence with `num_masked` predictions."""
    return train_flops(config, seq_len, seq_len, num_masked, 1)


def device_peak_flops(device=None, dtype: str = "bfloat16") -> tuple[float, str]:
    """(peak FLOP/s of one device, where the figure comes from). CPUs: a measured matmul peak."""
    device = device or jax.devices()[0]
    if device.platform != "cpu":
        for kind, peak in PEAK_FLOPS_BY_DEVICE_KIND.items():
            if kind.lower() in device.device_kind.lower():
                return peak, f"{device.device_kind} bf16 table"
    peak = measure_matmul_peak(jnp.float32 if dtype == "float32" or device.platform == "cpu" else jnp.bfloat16)
    return peak, f"measured {device.device_kind} matmul peak"


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


def interval_metrics(seconds: float, steps: int, rows_per_step: int, seq_len: int, counts: dict,
                     config: BertConfig, peak_flops: float, sbo: bool = False) -> dict[str, float]:
    """Throughput and utilisation over `steps` steps that took `seconds`; `counts`: the steps' summed
    real_tokens, masked_tokens and instances (as the train step reports them); `sbo`: the SBO head runs."""
    flops = train_flops(config, seq_len, counts["real_tokens"], counts["masked_tokens"], counts["instances"], sbo)
    per_device = flops / seconds / jax.device_count()
    return {"steps_per_s": steps / seconds, "sequences_per_s": steps * rows_per_step / seconds,
            "tokens_per_s": steps * rows_per_step * seq_len / seconds,
            "real_tokens_per_s": counts["real_tokens"] / seconds, "instances_per_s": counts["instances"] / seconds,
            "tflops_per_device": per_device / 1e12, "mfu": per_device / peak_flops}


class MetricsWriter:
    """Writes each logged step to DIR/metrics.jsonl, TensorBoard event files and a console line (process 0 only)."""

    def __init__(self, workdir: str, total_steps: int, enabled: bool = True):
        self.enabled = enabled
        self.total_steps = total_steps
        self.start_time = time.time()
        self.start_step: int | None = None
        if not enabled:
            return
        directory = epath.Path(workdir)
        directory.mkdir(parents=True, exist_ok=True)
        self.jsonl_path = directory / "metrics.jsonl"
        from flax.metrics import tensorboard

        self.tensorboard = tensorboard.SummaryWriter(str(directory / "tensorboard"))

    def write(self, step: int, values: dict[str, float], prefix: str = "") -> None:
        if not self.enabled:
            return
        record = {"step": int(step), **{prefix + k: float(v) for k, v in values.items()}}
        with self.jsonl_path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        for key, value in record.items():
            if key != "step":
                self.tensorboard.scalar(key, value, step)
        self.tensorboard.flush()

    def mark_start(self, step: int) -> None:
        """The ETA extrapolates from here (call after the first, compiling, step)."""
        self.start_step, self.start_time = step, time.time()

    def console(self, step: int, values: dict[str, float]) -> None:
        if not self.enabled:
            return
        if self.start_step is None or step <= self.start_step:
            eta = "?"
        else:
            rate = (time.time() - self.start_time) / (step - self.start_step)
            eta = _duration(rate * (self.total_steps - step))
        shown = " ".join(f"{k}={v:.4g}" for k, v in values.items()
                         if k in ("loss", "mlm_loss", "sbo_loss", "mlm_accuracy", "nsp_accuracy", "learning_rate",
                                  "padding_fraction",
                                   "real_tokens_per_s", "mfu"))
        print(f"step {step}/{self.total_steps} {shown} eta {eta}", file=sys.stdout, flush=True)

    def close(self) -> None:
        if self.enabled:
            self.tensorboard.close()


def _duration(seconds: float) -> str:
    seconds = int(max(seconds, 0))
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m{seconds % 60:02d}s"
