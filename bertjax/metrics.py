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


def forward_flops_per_sequence(config: BertConfig, seq_len: int, num_masked: int) -> float:
    """Matmul FLOPs of one forward pass of BertForPreTraining with the MLM head at `num_masked` positions.

    Per layer and token: Q/K/V/output projections 4*2*H^2, feed-forward 2*2*H*I, attention scores and
    context 2*2*L*H; plus the pooler, and the MLM head (transform 2*H^2 and decoder 2*H*V) at masked positions.
    """
    h, inter, layers = config.hidden_size, config.intermediate_size, config.num_hidden_layers
    per_token_layer = 8 * h * h + 4 * h * inter + 4 * seq_len * h
    encoder = layers * per_token_layer * seq_len
    heads = num_masked * (2 * h * h + 2 * h * config.vocab_size) + 2 * h * h + 2 * h * 2
    return float(encoder + heads)


def train_flops_per_sequence(config: BertConfig, seq_len: int, num_masked: int) -> float:
    """Forward + backward (the backward pass costs twice the forward)."""
    return 3.0 * forward_flops_per_sequence(config, seq_len, num_masked)


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


def step_seconds_metrics(step_time: float, batch_size: int, seq_len: int, flops_per_seq: float,
                         peak_flops: float) -> dict[str, float]:
    """Throughput and utilisation of one step that took `step_time` seconds."""
    sequences = batch_size / step_time
    per_device = sequences * flops_per_seq / jax.device_count()
    return {"steps_per_s": 1.0 / step_time, "sequences_per_s": sequences, "tokens_per_s": sequences * seq_len,
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
                         if k in ("loss", "mlm_accuracy", "nsp_accuracy", "learning_rate", "sequences_per_s", "mfu"))
        print(f"step {step}/{self.total_steps} {shown} eta {eta}", file=sys.stdout, flush=True)

    def close(self) -> None:
        if self.enabled:
            self.tensorboard.close()


def _duration(seconds: float) -> str:
    seconds = int(max(seconds, 0))
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m{seconds % 60:02d}s"
