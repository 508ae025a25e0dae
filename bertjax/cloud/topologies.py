"""TPU generations and slice names, for compiling a step for a TPU slice on a machine without one.

`parse_topology` reads a gcloud accelerator type (`v4-32`, `v5p-16`, `v5litepod-16`, `v6e-16`) or a topology
string (`v4:2x2x4`, `v5e:4x4`) and says what `jax.experimental.topologies.get_topology_desc` needs to build that
slice's compile-only devices, how many chips and hosts (TPU VMs, i.e. JAX processes) the slice has, and the HBM
and bf16 peak of a chip. Pure Python: jax and libtpu are imported only by `compile_only_devices`.

Facts behind the table (checked with jax 0.10.2 + libtpu 0.0.42.1 on a CPU-only machine, and Google Cloud's TPU
docs):
- get_topology_desc wants `v4:AxBxC`, `v5e:AxB`, `v5p:AxBxC` (`v5:` works too), `v6e:AxB`; it rejects
  accelerator types (`v5litepod-16`) and the `v5litepod:` prefix.
- v4 must be asked for with chip_config_name="megacore" to get one device per chip as JAX on a v4 VM sees it
  (the default gives one device per TensorCore, 2 per chip). v5p is megacore by default.
- Hosts hold 2x2x1 chips by default; a 1x1 or 2x4 v5e/v6e slice (one VM of 1 or 8 chips) needs
  chips_per_host_bounds covering the whole slice, or get_topology_desc fails (1x1) or reports 2 hosts (2x4).
- The accelerator type's number counts TensorCores on v4 and v5p (2 per chip) and chips on v5e and v6e.
- usable_hbm_bytes_per_chip is the largest program libtpu compiles for one chip; above it compile() raises
  RESOURCE_EXHAUSTED "Ran out of memory on HBM ... exceeds available HBM (15.75G)".
"""
from __future__ import annotations

import dataclasses
import math
import os
import re

GiB = 2**30
MiB = 2**20


@dataclasses.dataclass(frozen=True)
class Generation:
    name: str                           # canonical name: v4, v5e, v5p, v6e
    prefix: str                         # topology_name prefix get_topology_desc accepts
    device_kind: str                    # jax Device.device_kind of its devices
    hbm_bytes_per_chip: int             # published capacity
    usable_hbm_bytes_per_chip: int      # what libtpu 0.0.42.1 lets one program use (measured)
    peak_flops_per_chip: float          # dense bf16, published
    cores_per_chip: int                 # TensorCores; the accelerator-type number counts these on v4/v5p
    rank: int                           # 3 for the 3D tori (v4, v5p), 2 for v5e/v6e
    max_single_host_chips: int          # slices up to this size are one VM holding every chip
    clock_hz: float                     # TensorCore clock: what XLA's estimated_cycles count (see below)
    hbm_bytes_per_second: float         # published HBM bandwidth per chip
    ici_link_bytes_per_second: float    # one ICI link, one direction (see below)
    ici_ports: int                      # ICI links per chip
    chip_config_name: str | None = None


# Clocks: the published bf16 peak divided by the MXUs' multiply-adds per cycle (2 FLOPs each). v4 and v5p: 2
# TensorCores x 4 MXUs of 128x128 per chip (275e12 / 262144 = 1.05 GHz; 459e12 / 262144 = 1.75 GHz); v5e: 1 core x 4
# MXUs of 128x128 (197e12 / 131072 = 1.5 GHz); v6e: 1 core x 4 MXUs of 256x256 (918e12 / 524288 = 1.75 GHz).
# Checked against XLA's estimate of an 8192^3 bf16 matmul on one compile-only chip (libtpu 0.0.42.1), which a
# right clock puts just under peak: v5e 88%, v4 93%, v5p 90% of peak; v6e 70% (its clock is the least certain).
# A 64M-element f32 add comes out at 57% (v5e), 69% (v4), 45% (v5p), 44% (v6e) of the HBM bandwidth.
# ICI links, from Google Cloud's TPU pages (read 2026-11-25): v5e 400 GB/s bidirectional per chip over 4 ports
# (all-reduce bandwidth per 256-chip pod 51.2 TB/s = 200 GB/s per chip = 4 links x 50 GB/s one way); v6e 800 GB/s
# over 4 ports (102.4 TB/s per pod: 4 x 100 GB/s); v5p 1200 GB/s bidirectional over 6 ports (3D torus: 6 x 100
# GB/s); v4 all-reduce bandwidth 1.1 PB/s per 4096-chip pod = 268 GB/s per chip over 6 ports (44.8 GB/s a link).
GENERATIONS: dict[str, Generation] = {
    g.name: g for g in (
        Generation("v4", "v4", "TPU v4", 32 * GiB, 31484 * MiB, 275e12, 2, 3, 4, clock_hz=1.05e9,
                   hbm_bytes_per_second=1.2e12, ici_link_bytes_per_second=44.8e9, ici_ports=6,
                   chip_config_name="megacore"),
        Generation("v5e", "v5e", "TPU v5 lite", 16 * GiB, 16125 * MiB, 197e12, 1, 2, 8, clock_hz=1.5e9,
                   hbm_bytes_per_second=819e9, ici_link_bytes_per_second=50e9, ici_ports=4),
        # Google's table says "95 GB", but libtpu lets a program use 95.74 GiB, so the chip has 96 GiB
        # (like v5e's 16 GiB less ~260 MiB that the runtime keeps).
        Generation("v5p", "v5p", "TPU v5", 96 * GiB, 98040 * MiB, 459e12, 2, 3, 4, clock_hz=1.75e9,
                   hbm_bytes_per_second=2765e9, ici_link_bytes_per_second=100e9, ici_ports=6),
        Generation("v6e", "v6e", "TPU v6 lite", 32 * GiB, 31995 * MiB, 918e12, 1, 2, 8, clock_hz=1.75e9,
                   hbm_bytes_per_second=1640e9, ici_link_bytes_per_second=100e9, ici_ports=4),
    )
}

# Names a user may write before "-N" (accelerator type) or ":AxB" (topology); v5litepod is gcloud's name for v5e.
_ALIASES = {"v4": "v4", "v5e": "v5e", "v5litepod": "v5e", "v5lite": "v5e", "v5p": "v5p", "v5": "v5p",
            "v6e": "v6e"}

# The 2D (v5e, v6e) slice shapes Google documents, by chip count; the only 2D shapes accepted.
_SHAPES_2D = {1: (1, 1), 4: (2, 2), 8: (2, 4), 16: (4, 4), 32: (4, 8), 64: (8, 8), 128: (8, 16), 256: (16, 16)}

ACCEPTED = ("accepted forms: gcloud accelerator types v4-N and v5p-N (N = TensorCores, 2 per chip), "
            "v5litepod-N (or v5e-N) and v6e-N (N = chips); or topologies v4:AxBxC, v5p:AxBxC, v5e:AxB, v6e:AxB")


@dataclasses.dataclass(frozen=True)
class Topology:
    generation: str          # v4, v5e, v5p, v6e
    topology: str            # topology_name for get_topology_desc, e.g. "v5e:4x4"
    shape: tuple[int, ...]   # chips along each torus axis
    chips: int               # in all slices
    hosts: int               # TPU VMs (JAX processes) in all slices
    num_slices: int
    hbm_bytes_per_chip: int
    usable_hbm_bytes_per_chip: int
    peak_flops_per_chip: float
    accelerator_type: str    # gcloud's name for one slice, e.g. "v5litepod-16"

    @property
    def chips_per_host(self) -> int:
        return self.chips // self.hosts

    @property
    def peak_flops(self) -> float:
        return self.peak_flops_per_chip * self.chips

    def topology_desc_kwargs(self) -> dict:
        """Keyword arguments for jax.experimental.topologies.get_topology_desc that build these devices."""
        gen = GENERATIONS[self.generation]
        bounds = tuple(self.shape) + (1,) * (3 - len(self.shape)) if self.hosts == self.num_slices else (2, 2, 1)
        kwargs = {"platform": "tpu", "topology_name": self.topology, "chips_per_host_bounds": bounds}
        if gen.chip_config_name:
            kwargs["chip_config_name"] = gen.chip_config_name
        if self.num_slices > 1:
            kwargs["num_slices"] = self.num_slices
        return kwargs


def parse_topology(name: str, num_slices: int = 1) -> Topology:
    """A Topology from an accelerator type (`v4-32`, `v5litepod-16`) or a topology (`v5e:4x4`, `v4:2x2x4`)."""
    if not isinstance(name, str):
        raise ValueError(f"TPU topology must be a string, got {name!r}; {ACCEPTED}")
    if not isinstance(num_slices, int) or num_slices < 1:
        raise ValueError(f"num_slices must be a positive integer, got {num_slices!r}")
    text = name.strip().lower()
    if match := re.fullmatch(r"([a-z0-9]+)-(\d+)", text):
        if match[1] in ("v5", "v5lite"):  # gcloud has no such types; v5-16 could mean v5e or v5p
            raise ValueError(f"ambiguous TPU accelerator type {name!r}: write v5p-N or v5litepod-N; {ACCEPTED}")
        gen = _generation(match[1], name)
        shape = _default_shape(gen, int(match[2]), name)
    elif match := re.fullmatch(r"([a-z0-9]+):(\d+(?:x\d+)*)", text):
        gen = _generation(match[1], name)
        shape = _checked_shape(gen, tuple(int(d) for d in match[2].split("x")), name)
    else:
        raise ValueError(f"unknown TPU topology {name!r}; {ACCEPTED}")
    chips_per_slice = math.prod(shape)
    hosts_per_slice = 1 if chips_per_slice <= gen.max_single_host_chips else chips_per_slice // 4
    type_name = "v5litepod" if gen.name == "v5e" else gen.name
    return Topology(generation=gen.name, topology=f"{gen.prefix}:{'x'.join(map(str, shape))}", shape=shape,
                    chips=chips_per_slice * num_slices, hosts=hosts_per_slice * num_slices, num_slices=num_slices,
                    hbm_bytes_per_chip=gen.hbm_bytes_per_chip,
                    usable_hbm_bytes_per_chip=gen.usable_hbm_bytes_per_chip,
                    peak_flops_per_chip=gen.peak_flops_per_chip,
                    accelerator_type=f"{type_name}-{chips_per_slice * gen.cores_per_chip}")


def compile_only_devices(topology: Topology) -> list:
    """The slice's compile-only jax devices (needs libtpu: the `tpu` extra); works on a CPU machine.

    Sets the libtpu environment a machine without TPUs needs (unless already set) before libtpu is loaded:
    without TPU_WORKER_HOSTNAMES libtpu logs an error, without TPU_ACCELERATOR_TYPE a warning.
    """
    os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
    # libtpu locks /tmp/libtpu_lockfile so one process owns the chips; compile-only devices own none, and
    # without this a second compiling process (or a test beside one) fails to load libtpu.
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
    os.environ.setdefault("TPU_ACCELERATOR_TYPE", topology.accelerator_type)
    from jax.experimental import topologies  # noqa: PLC0415 (keeps jax out of this module's import)
    return list(topologies.get_topology_desc(**topology.topology_desc_kwargs()).devices)


def _generation(word: str, name: str) -> Generation:
    if word not in _ALIASES:
        raise ValueError(f"unknown TPU generation {word!r} in {name!r} (known: v4, v5e a.k.a. v5litepod, v5p, "
                         f"v6e); {ACCEPTED}")
    return GENERATIONS[_ALIASES[word]]


def _default_shape(gen: Generation, count: int, name: str) -> tuple[int, ...]:
    if count % gen.cores_per_chip:
        raise ValueError(f"{name!r}: {gen.name} accelerator types count TensorCores ({gen.cores_per_chip} per "
                         f"chip), so the number must be even; {ACCEPTED}")
    chips = count // gen.cores_per_chip
    if gen.rank == 2:
        if chips not in _SHAPES_2D:
            raise ValueError(f"{name!r}: {gen.name} slices have {sorted(_SHAPES_2D)} chips; {ACCEPTED}")
        return _SHAPES_2D[chips]
    if chips < 4 or chips & (chips - 1):
        raise ValueError(f"{name!r}: {chips} chips has no default {gen.name} shape (power-of-two slices from "
                         f"4 chips); give the topology itself, e.g. '{gen.name}:4x4x12'; {ACCEPTED}")
    shape = [2, 2, 1]  # gcloud's defaults: 2x2x1, 2x2x2, 2x2x4, 2x4x4, 4x4x4, 4x4x8, 4x8x8, 8x8x8, ...
    while math.prod(shape) < chips:
        smallest = min(shape)
        last = max(i for i, d in enumerate(shape) if d == smallest)
        shape[last] *= 2
    return tuple(shape)


def _checked_shape(gen: Generation, shape: tuple[int, ...], name: str) -> tuple[int, ...]:
    if gen.rank == 2 and len(shape) == 3 and shape[2] == 1:
        shape = shape[:2]
    if gen.rank == 3 and len(shape) == 2:
        shape = shape + (1,)
    if len(shape) != gen.rank:
        raise ValueError(f"{name!r}: {gen.name} topologies have {gen.rank} dimensions; {ACCEPTED}")
    if min(shape) < 1:
        raise ValueError(f"{name!r}: every side of a topology is at least 1; {ACCEPTED}")
    if gen.rank == 2:
        if shape not in _SHAPES_2D.values():
            shapes = ", ".join("x".join(map(str, s)) for s in _SHAPES_2D.values())
            raise ValueError(f"{name!r}: {gen.name} slices are {shapes}; {ACCEPTED}")
    elif shape[0] % 2 or shape[1] % 2:
        raise ValueError(f"{name!r}: {gen.name} hosts hold 2x2x1 chips, so the first two sides must be even; "
                         f"{ACCEPTED}")
    return shape
