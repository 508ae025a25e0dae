"""Device mesh (data, fsdp, tensor) and the logical-axis rules that place BERT on it.

Parameters and activations are annotated with logical axis names in `bertjax.model.bert`; the rules below are the only
place that says which mesh axis each name is split over (MaxText's scheme). Changing a parallelism strategy means
changing rules, not model code.
"""
from __future__ import annotations

import contextlib
import dataclasses
from typing import Mapping, Sequence

import flax.linen as nn
import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from bertjax.options import option

MESH_AXES = ("data", "fsdp", "tensor")
BATCH_AXES = ("data", "fsdp")

# logical name -> mesh axis (or axes, or None = replicated).
DEFAULT_RULES: tuple[tuple[str, str | tuple[str, ...] | None], ...] = (
    # parameters
    ("vocab", "tensor"),
    ("embed", "fsdp"),
    ("embed_out", "tensor"),
    ("heads", "tensor"),
    ("kv", None),
    ("mlp", "tensor"),
    ("layers", None),  # the layer axis of stacked params (model.scan_layers): every chip holds every layer
    # activations
    ("activation_batch", BATCH_AXES),
    ("activation_length", None),
    ("activation_embed", None),
    ("activation_heads", "tensor"),
    ("activation_kv", None),
    ("activation_mlp", "tensor"),
)


def target_platform() -> str:
    """The platform the program being traced will run on: the active mesh's (`jax.set_mesh`; while compiling for
    a TPU slice on a CPU machine that is "tpu"), else JAX's default backend."""
    mesh = jax.sharding.get_abstract_mesh()
    device = None if mesh.empty else getattr(mesh, "abstract_mesh", mesh).abstract_device
    return (device.platform if device is not None else None) or jax.default_backend()


def mesh_shape(num_devices: int, data: int = -1, fsdp: int = 1, tensor: int = 1) -> tuple[int, int, int]:
    """(data, fsdp, tensor) sizes for `num_devices`; one axis may be -1 to take the remaining devices."""
    sizes = [data, fsdp, tensor]
    if sum(1 for s in sizes if s == -1) > 1:
        raise ValueError(f"at most one mesh axis may be -1, got data={data} fsdp={fsdp} tensor={tensor}")
    known = int(np.prod([s for s in sizes if s != -1]))
    if any(s == 0 or s < -1 for s in sizes) or num_devices % known:
        raise ValueError(f"mesh data={data} fsdp={fsdp} tensor={tensor} does not divide {num_devices} devices")
    sizes = [num_devices // known if s == -1 else s for s in sizes]
    if int(np.prod(sizes)) != num_devices:
        raise ValueError(f"mesh {sizes[0]}x{sizes[1]}x{sizes[2]} (data x fsdp x tensor) needs "
                         f"{int(np.prod(sizes))} devices, have {num_devices}")
    return tuple(sizes)


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """Mesh axis sizes (a pretraining job's `mesh.*` keys); -1 takes the remaining devices of a slice."""

    data: int = option(-1, "data-parallel replicas within a slice")
    fsdp: int = option(1, "parameter/optimizer-state shards (ZeRO-3 style), also data-parallel for the batch")
    tensor: int = option(1, "tensor-parallel split of heads, MLP and vocabulary")
    dcn_data: int = option(1, "slices (multi-slice TPU over the data-center network): the data axis spans them, "
                           "data-parallel only, so only gradients cross the slower network")
    shard_optimizer: bool = option(False, "ZeRO-1: the optimizer moments and update are split over the data axis "
                                   "too (each replica updates a slice of every tensor, then the float32 params "
                                   "are all-gathered); the same updates, less HBM per chip, more ICI traffic")

    def __post_init__(self):
        if self.dcn_data < 1:
            raise ValueError(f"mesh.dcn_data={self.dcn_data} must be >= 1")

    def shape(self, num_devices: int) -> tuple[int, int, int]:
        """(data over all slices, fsdp, tensor) for `num_devices` devices in all."""
        if num_devices % self.dcn_data:
            raise ValueError(f"{num_devices} devices do not split into mesh.dcn_data={self.dcn_data} slices")
        data, fsdp, tensor = mesh_shape(num_devices // self.dcn_data, self.data, self.fsdp, self.tensor)
        return data * self.dcn_data, fsdp, tensor

    def build(self, devices: Sequence | None = None) -> Mesh:
        return make_mesh(self.data, self.fsdp, self.tensor, devices, dcn_data=self.dcn_data)


def make_mesh(data: int = -1, fsdp: int = 1, tensor: int = 1, devices: Sequence | None = None,
              dcn_data: int = 1) -> Mesh:
    """A (data, fsdp, tensor) mesh over `devices` (default: all), laid out for the physical topology; with
    `dcn_data` slices, a hybrid mesh whose data axis runs across the slices (devices need a slice_index)."""
    devices = list(devices if devices is not None else jax.devices())
    # Auto axis types: shardings come from the rules and jit, not from explicit-sharding types.
    axis_types = (AxisType.Auto,) * 3
    if dcn_data == 1:
        return jax.make_mesh(mesh_shape(len(devices), data, fsdp, tensor), MESH_AXES, axis_types=axis_types,
                             devices=devices)
    slices = {getattr(d, "slice_index", None) for d in devices}
    if None in slices or len(slices) != dcn_data:
        raise ValueError(f"mesh.dcn_data={dcn_data} needs devices from {dcn_data} slices; these come from "
                         f"{'no multi-slice setup' if None in slices else f'{len(slices)} slice(s)'}")
    ici = mesh_shape(len(devices) // dcn_data, data, fsdp, tensor)
    grid = mesh_utils.create_hybrid_device_mesh(ici, (dcn_data, 1, 1), devices)
    return Mesh(grid, MESH_AXES, axis_types=axis_types)


@contextlib.contextmanager
def activate(mesh: Mesh, rules=DEFAULT_RULES):
    """Context in which the model's activation sharding constraints resolve against `mesh`."""
    with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
        yield


def param_shardings(boxed_params, mesh: Mesh, rules=DEFAULT_RULES):
    """NamedShardings for a tree of logically annotated params (boxed, abstract or concrete)."""
    specs = nn.get_partition_spec(boxed_params)
    return nn.logical_to_mesh_sharding(specs, mesh, rules)


def split_over_data(named: NamedSharding, shape: Sequence[int]) -> NamedSharding:
    """`named` also split over the data axis (ZeRO-1: each data-parallel replica keeps and updates a slice of the
    optimizer state), on the first dimension that divides evenly; unchanged when none does or data is 1."""
    mesh = named.mesh
    data = mesh.shape["data"]
    spec = tuple(named.spec) + (None,) * (len(shape) - len(named.spec))
    if data == 1 or any("data" in _axes(entry) for entry in spec):
        return named
    for dim, entry in enumerate(spec):
        axes = _axes(entry)
        shards = int(np.prod([mesh.shape[a] for a in axes])) * data
        if shape[dim] % shards == 0:
            spec = spec[:dim] + (axes + ("data",),) + spec[dim + 1:]
            return NamedSharding(mesh, PartitionSpec(*spec))
    return named


def _axes(entry) -> tuple[str, ...]:
    """The mesh axes of one PartitionSpec entry (None, a name or a tuple of names) as a tuple."""
    if entry is None:
        return ()
    return tuple(entry) if isinstance(entry, (tuple, list)) else (entry,)


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Batch-major arrays are split over data x fsdp and replicated over tensor."""
    return NamedSharding(mesh, PartitionSpec(BATCH_AXES))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())


def global_batch(host_batch: Mapping[str, np.ndarray], mesh: Mesh) -> dict[str, jax.Array]:
    """Each process's numpy batch -> global jax.Arrays split over data x fsdp (multi-host: the global batch is the
    processes' batches stacked in process order)."""
    sharding = batch_sharding(mesh)
    out = {}
    for key in host_batch:
        local = np.asarray(host_batch[key])
        global_shape = (local.shape[0] * jax.process_count(),) + local.shape[1:]
        out[key] = jax.make_array_from_process_local_data(sharding, local, global_shape)
    return out
