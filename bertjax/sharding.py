"""Device mesh (data, fsdp, tensor) and the logical-axis rules that place BERT on it.

Parameters and activations are annotated with logical axis names in `bertjax.model.bert`; the rules below are the only
place that says which mesh axis each name is split over (MaxText's scheme). Changing a parallelism strategy means
changing rules, not model code.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
from typing import Mapping, Sequence

import flax.linen as nn
import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from bertjax.options import ints, option, range_problems

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


def logical_axis_size(name: str) -> int:
    """Into how many parts the active mesh splits the logical axis `name` under the rules in force (1 outside a
    mesh, or where no rule maps it)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return 1
    return math.prod(dict(mesh.shape)[axis] for axis in _axes(nn.logical_to_mesh_axes((name,))[0]))


def manual_batch_offset(local_rows: int):
    """Where this device's rows start in the global batch, inside a `shard_map` whose manual axes include batch
    axes (`lax.axis_index` over them, data-major as the batch is split); 0 outside one. Per-row random bits
    (dropout masks) hash global row numbers with it, so they do not depend on how the batch is split."""
    mesh = jax.sharding.get_abstract_mesh()
    manual = () if mesh.empty else tuple(a for a in BATCH_AXES if a in getattr(mesh, "manual_axes", ()))
    if not manual:
        return 0
    return jax.lax.axis_index(manual if len(manual) > 1 else manual[0]) * local_rows


def without_axis(rules, axis: str):
    """The logical rules with mesh axis `axis` removed (inside a shard_map manual over it, activations name only
    the others)."""
    def drop(target):
        if isinstance(target, (tuple, list)):
            kept = tuple(a for a in target if a != axis)
            return kept if len(kept) > 1 else (kept[0] if kept else None)
        return None if target == axis else target
    return tuple((name, drop(target)) for name, target in rules)


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

    data: int = option(-1, "data-parallel replicas within a slice (-1: the devices left)", valid=ints(-1))
    fsdp: int = option(1, "parameter/optimizer-state shards (ZeRO-3 style), also data-parallel for the batch",
                       valid=ints(-1))
    tensor: int = option(1, "tensor-parallel split of heads, MLP and vocabulary", valid=ints(-1))
    dcn_data: int = option(1, "slices (multi-slice TPU over the data-center network): the data axis spans them, "
                           "data-parallel only, so only gradients cross the slower network", valid=ints(1))
    shard_optimizer: bool | None = option(None, "weight-update sharding (Xu et al. 2020): params and optimizer "
                                          "moments split over the data axis, gradients reduce-scattered, the "
                                          "update on 1/data of each tensor, params all-gathered in the compute "
                                          "dtype; unset: on for TPU and GPU meshes, off on the CPU")
    reduce_in_float32: bool = option(False, "with shard_optimizer: reduce the gradients in float32 (twice the "
                                     "bytes) rather than in the compute dtype the backward produced them in")

    def __post_init__(self):
        problems = range_problems(self)
        if problems:
            raise ValueError("mesh: " + "; ".join(problems))

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
