"""Weight-update sharding (Xu et al. 2020, "Automatic cross-replica sharding of weight update in data-parallel
training"; what Google's MLPerf BERT runs): the data-parallel replicas split the update instead of repeating it.

Each chip keeps 1/data of every param and of its Adam/LAMB moments (float32), split on one dimension that no
other mesh axis splits. A step:
1. gathers the params from their slices, the matmul operands (kernels, the word-embedding table) in the compute
   dtype: an all-gather of bf16 bytes on TPU;
2. computes each replica's gradients of its own rows inside a `shard_map` over the data axis, microbatches summed
   locally (the tied word-embedding table gets its lookup and output-layer gradients summed here, once). Where
   the word table is split on its hidden dimension, the input's rows are looked up from the float32 slices
   (`lookup_rows`): the bf16 gather of the table is then needed only by the output layer, at the end of the
   forward, and XLA:TPU overlaps it with the encoder (it was the step's first, synchronous, transfer); the
   lookup's gradient arrives summed on the slice and is added after the output layer's is reduced;
3. reduce-scatters each gradient to the slices (one reduction per gradient per step: the bytes of one all-reduce,
   split into a reduce-scatter and the next step's all-gather);
4. runs the whole update (norm, non-finite skip, clipping, Adam/LAMB) on the slices.
The same updates as the replicated step up to float32 summation order (tested to 1e-6 over 5 steps).
"""
from __future__ import annotations

import dataclasses
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from bertjax import sharding

DATA = "data"


@dataclasses.dataclass(frozen=True)
class UpdateSharding:
    """How a job's update is split over the data axis (built by `make`)."""

    mesh: Mesh
    rules: tuple                 # the logical-axis rules the model is annotated with
    full: Any                    # per param: its NamedSharding to compute with (whole over data)
    dims: Any                    # per param: the dimension split over data; -1: none divides (reduced whole)
    compute_dtype: Any           # the dtype the matmul operands are gathered in
    reduce_in_float32: bool      # reduce the gradients in float32 (else in their compute dtype)
    word_table: tuple | None = None   # the word-embedding table's key path where it is split on its hidden
                                      # dimension: the input's rows are looked up from the slices (`lookup_rows`)


def split_dim(named: NamedSharding, shape) -> int:
    """The first dimension of a leaf that no mesh axis (of more than one device) splits yet and the data axis
    divides; -1 if none."""
    mesh = named.mesh
    data = mesh.shape[DATA]
    spec = tuple(named.spec) + (None,) * (len(shape) - len(named.spec))
    if data == 1 or any(DATA in sharding._axes(entry) for entry in spec):
        return -1
    for dim, entry in enumerate(spec):
        if all(mesh.shape[axis] == 1 for axis in sharding._axes(entry)) and shape[dim] % data == 0:
            return dim
    return -1


def _names(path) -> list:
    return [getattr(key, "key", getattr(key, "name", "")) for key in path]


def _is_word_table(path) -> bool:
    return _names(path)[-2:] == ["word_embeddings", "embedding"]


def leaf_split_dim(path, named: NamedSharding, shape) -> int:
    """`split_dim`, except that the word-embedding table is split on its hidden dimension where the data axis
    divides it: each chip then looks up its columns of every row of the global batch (`lookup_rows`), and the
    table's bf16 gather is needed only by the output layer, so it overlaps the encoder's forward."""
    dim = split_dim(named, shape)
    if _is_word_table(path) and dim == 0 and split_dim(named, (1,) + tuple(shape[1:])) == 1:
        return 1
    return dim


def _with_data(named: NamedSharding, dim: int) -> NamedSharding:
    if dim < 0:
        return named
    spec = list(named.spec) + [None] * (dim + 1 - len(named.spec))
    spec[dim] = DATA  # replaces only axes of one device: the same layout as (those axes, data)
    return NamedSharding(named.mesh, PartitionSpec(*spec))


def split_shardings(shardings_tree, abstract_tree):
    """Each leaf's sharding also split over data on its `leaf_split_dim` (params, moments: anything
    param-shaped)."""
    return jax.tree_util.tree_map_with_path(
        lambda path, named, x: _with_data(named, leaf_split_dim(path, named, x.shape)), shardings_tree,
        abstract_tree)


def make(mesh: Mesh, rules, param_shardings, abstract_params, compute_dtype, reduce_in_float32: bool = False):
    """The update sharding of params laid out by `param_shardings` (their own logical layout)."""
    dims = jax.tree_util.tree_map_with_path(lambda path, named, x: leaf_split_dim(path, named, x.shape),
                                            param_shardings, abstract_params)
    tables = [path for path, dim in jax.tree_util.tree_leaves_with_path(dims)
              if _is_word_table(path) and dim == len(path_shape(abstract_params, path)) - 1]
    return UpdateSharding(mesh, tuple(rules), param_shardings, dims, jnp.dtype(compute_dtype), reduce_in_float32,
                          tables[0] if len(tables) == 1 else None)


def path_shape(tree, path) -> tuple:
    """The shape of the leaf of `tree` at key path `path`."""
    for name in _names(path):
        tree = tree[name]
    return tuple(tree.shape)


def lookup_rows(table_slice, ids):
    """The word embeddings of this replica's `ids` ([B, L] -> float32 [B, L, H]) from the table's columns each
    replica holds ([V, H/data], inside the `shard_map` over data): every replica's ids gathered (int32, small),
    each replica looks up its columns of all of them, and an all-to-all hands every replica its own rows with all
    the columns. The rows are exact float32 (as the replicated step's lookup), and the lookup's gradient arrives
    already summed over the data axis, on the slice (the all-to-all's transpose)."""
    every = jax.lax.all_gather(ids, DATA, axis=0, tiled=True)
    columns = jnp.take(table_slice, every, axis=0)                                # [data * B, L, H / data]
    return jax.lax.all_to_all(columns, DATA, split_axis=0, concat_axis=columns.ndim - 1, tiled=True)


def _is_matmul_operand(path) -> bool:
    """Kernels and the word-embedding table: what the model only uses cast to its compute dtype (the table's rows
    are looked up from the gathered copy too, a bf16 lookup on TPU, unless it is split on its hidden dimension:
    `lookup_rows`). LayerNorm, biases and the position and token-type tables stay float32 (under 1% of the
    bytes)."""
    return _names(path)[-1] == "kernel" or _is_word_table(path)


def gather(update: UpdateSharding, params):
    """The params to compute with: every slice gathered, the matmul operands in the compute dtype."""
    def one(path, x, named):
        if jnp.issubdtype(x.dtype, jnp.floating) and _is_matmul_operand(path):
            x = x.astype(update.compute_dtype)
        return jax.lax.with_sharding_constraint(x, named)
    return jax.tree_util.tree_map_with_path(one, params, update.full)


def local_gradients(update: UpdateSharding, grads_and_sums, params, compute_params, batch: dict, *replicated):
    """(gradients split over data as float32, sums over the global batch): `grads_and_sums(compute_params, batch,
    *replicated)` run on each replica's rows, its gradients reduce-scattered (reduced whole where no dimension
    splits) and its sums added up. `params`: the state's split params (where the word table is split on its hidden
    dimension, the rows are looked up from its slices: `grads_and_sums(..., lookup=(slice, lookup_rows))` gives
    (params' gradients, the slice's))."""
    data_rules = sharding.without_axis(update.rules, DATA)
    leaf_specs = jax.tree_util.tree_map(
        lambda dim: PartitionSpec(*([None] * dim + [DATA])) if dim >= 0 else PartitionSpec(), update.dims)

    # XLA:CPU (jaxlib 0.10.2) aborts compiling this step when it reduces bf16 gradients ("Invalid binary
    # instruction opcode copy", a CHECK failure that kills the process): the CPU reduces in float32.
    in_float32 = update.reduce_in_float32 or sharding.target_platform() == "cpu"

    def body(params, rows, table_slice, *rest):
        with nn.logical_axis_rules(data_rules):
            if update.word_table is None:
                grads, sums = grads_and_sums(params, rows, *rest)
            else:
                (grads, table_grad), sums = grads_and_sums(params, rows, *rest,
                                                           lookup=(table_slice, lookup_rows))

        def reduce(grad, dim):
            wire = jnp.float32 if in_float32 else grad.dtype
            grad = grad.astype(wire)
            out = jax.lax.psum(grad, DATA) if dim < 0 else jax.lax.psum_scatter(
                grad, DATA, scatter_dimension=dim, tiled=True)
            return out.astype(jnp.float32)
        reduced = jax.tree_util.tree_map(reduce, grads, update.dims)
        if update.word_table is not None:  # the output layer's gradient, reduced, plus the lookup's, on the slice
            reduced = jax.tree_util.tree_map_with_path(
                lambda path, g: g + table_grad.astype(jnp.float32) if path == update.word_table else g, reduced)
        return reduced, jax.lax.psum(sums, DATA)

    batch_specs = jax.tree_util.tree_map(lambda _: PartitionSpec(DATA), batch)
    params_specs = jax.tree_util.tree_map(lambda _: PartitionSpec(), compute_params)
    if update.word_table is None:
        table_slice, table_spec = None, None
    else:
        table_slice = jax.tree_util.tree_leaves(
            jax.tree_util.tree_map_with_path(lambda path, x: x if path == update.word_table else None,
                                             params))[0]
        table_spec = PartitionSpec(None, DATA)
    return jax.shard_map(body, mesh=update.mesh, in_specs=(params_specs, batch_specs, table_spec) + (
        PartitionSpec(),) * len(replicated), out_specs=(leaf_specs, PartitionSpec()), axis_names={DATA},
        check_vma=False)(compute_params, batch, table_slice, *replicated)

