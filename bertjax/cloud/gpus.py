"""NVIDIA GPU cards and hosts, for compiling a step for a GPU on a machine without one (deviceless XLA:GPU).

`parse_gpu_host` reads `h100`, `h200`, `a100` (one card) or `h100x8` (K cards on one host, NVLink between them)
into a `Topology` like a TPU slice's (chips = cards, one host), and `compile_only_devices` builds its devices from
the card's `GpuTargetConfig` text (what XLA:GPU compiles for when no GPU is attached; needs the `gpu` extra,
`jax[cuda12]`). Pure Python until `compile_only_devices` imports jax.

The cards' figures (dense bf16 without sparsity, HBM, NVLink) are NVIDIA's datasheets (read 2026-11-27):
H100 SXM5 80 GB: 989.4 TFLOP/s, HBM3 3.35 TB/s, NVLink 900 GB/s; H200 SXM 141 GB: 989.4 TFLOP/s, HBM3e 4.8 TB/s,
NVLink 900 GB/s; A100 SXM4 80 GB: 312 TFLOP/s, HBM2e 2.039 TB/s, NVLink 600 GB/s. NVLink's figure is both
directions together: a GPU sends at half of it. The target configs derive from the H100 SXM one in
../shared/gpu beside the project (XLA's GpuTargetConfig proto): the H200 differs in memory size and bandwidth; the A100 in
compute capability 8.0, 108 SMs, 64 FP32 lanes per SM, 164 KiB of shared memory per SM, 40 MiB of L2 and 1.41 GHz.
"""
from __future__ import annotations

import dataclasses
import os
import re

from bertjax.cloud.topologies import Topology
from bertjax.runtime.extras import install_line

@dataclasses.dataclass(frozen=True)
class Card:
    name: str                        # h100, h200, a100
    device_kind: str                 # what nvidia-smi (and jax's device_kind) call it
    hbm_bytes: int                   # the memory CUDA reports (device_memory_size)
    peak_flops: float                # dense bf16, datasheet
    hbm_bytes_per_second: float      # datasheet
    nvlink_bytes_per_second: float   # what one GPU sends per second (half the datasheet's bidirectional figure)
    compute_capability: tuple[int, int]
    sm_count: int
    fp32_lanes_per_sm: int
    shared_memory_per_sm: int
    shared_memory_per_block_optin: int
    l2_bytes: int
    clock_ghz: float

    @property
    def usable_hbm_bytes(self) -> int:
        """What one JAX process may allocate by default: 75% of the card (XLA_PYTHON_CLIENT_MEM_FRACTION)."""
        fraction = float(os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.75"))
        return int(self.hbm_bytes * fraction)

    def target_config(self) -> str:
        """The card's GpuTargetConfig in protobuf text (the fields deviceless XLA:GPU reads)."""
        major, minor = self.compute_capability
        minor_line = f"\n    minor: {minor}" if minor else ""   # protobuf text leaves a zero out
        return f"""gpu_device_info {{
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_core: {self.shared_memory_per_sm}
  threads_per_core_limit: 2048
  core_count: {self.sm_count}
  fpus_per_core: {self.fp32_lanes_per_sm}
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: {int(self.hbm_bytes_per_second)}
  l2_cache_size: {self.l2_bytes}
  clock_rate_ghz: {self.clock_ghz}
  device_memory_size: {self.hbm_bytes}
  shared_memory_per_block_optin: {self.shared_memory_per_block_optin}
  cuda_compute_capability {{
    major: {major}{minor_line}
  }}
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
}}
platform_name: "CUDA"
dnn_version_info {{
  major: 9
  minor: 7
}}
runtime_version {{
  major: 12
  minor: 8
  patch: 0
}}
device_description_str: "{self.device_kind}"
"""


CARDS: dict[str, Card] = {
    c.name: c for c in (
        # memory_bandwidth as in the shared H100 config (3.35 TB/s on the datasheet).
        Card("h100", "NVIDIA H100 80GB HBM3", 84929347584, 989.4e12, 3352.32e9, 450e9, (9, 0), 132, 128,
             233472, 232448, 50 * 2**20, 1.98),
        Card("h200", "NVIDIA H200", 150754820096, 989.4e12, 4800e9, 450e9, (9, 0), 132, 128, 233472, 232448,
             50 * 2**20, 1.98),
        Card("a100", "NVIDIA A100-SXM4-80GB", 85899345920, 312e12, 2039e9, 300e9, (8, 0), 108, 64, 167936,
             166912, 40 * 2**20, 1.41),
    )
}

ACCEPTED = f"GPU hosts: {', '.join(CARDS)} (one card) or e.g. h100x8 (K cards on one host, 1 <= K <= 8)"


def is_gpu_topology(name: str) -> bool:
    """Whether `name` is meant for a GPU host (`h100`, `a100x8`, a misspelt `h100x-1`...) rather than a TPU slice
    (TPU names start with v): a letter and three digits begin it."""
    return bool(re.match(r"[a-uw-z]\d{3}", name.strip().lower()))


def parse_gpu_host(name: str, num_slices: int = 1) -> Topology:
    """A Topology for `h100` / `h200` / `a100` or `h100x8` (cards on one host)."""
    match = re.fullmatch(r"([a-z]\d{3})(?:x(\d+))?", name.strip().lower())
    if not match or match[1] not in CARDS:
        raise ValueError(f"unknown GPU host {name!r}; {ACCEPTED}")
    cards = int(match[2] or 1)
    if not 1 <= cards <= 8:
        raise ValueError(f"{name!r}: {cards} cards; {ACCEPTED}")
    if num_slices != 1:
        raise ValueError(f"{name!r}: --num-slices is for TPU slices; a GPU host is one host")
    card = CARDS[match[1]]
    return Topology(generation=card.name, topology=f"1x1x{cards}", shape=(cards,), chips=cards, hosts=1,
                    num_slices=1, hbm_bytes_per_chip=card.hbm_bytes, usable_hbm_bytes_per_chip=card.usable_hbm_bytes,
                    peak_flops_per_chip=card.peak_flops,
                    accelerator_type=card.name if cards == 1 else f"{card.name}x{cards}")


def compile_only_devices(topology: Topology) -> list:
    """The host's compile-only CUDA devices (deviceless XLA:GPU; needs the `gpu` extra); works on a CPU machine."""
    # The CUDA plugin checks the installed CUDA libraries against a GPU driver; there is none here.
    os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")
    try:
        import jax_plugins.xla_cuda12  # noqa: F401, PLC0415
    except ImportError as error:
        raise ValueError(f"compiling for {topology.accelerator_type} needs the jax CUDA plugin (the `gpu` "
                         f"extra): {install_line('gpu')}") from error
    from jax.experimental import topologies  # noqa: PLC0415 (keeps jax out of this module's import)
    desc = topologies.get_topology_desc(platform="cuda", topology=topology.topology,
                                        target_config=CARDS[topology.generation].target_config())
    return list(desc.devices)
