"""The pretraining train state: what it holds, how it is initialised, and its sharded layout on a mesh.

Everything a resumed run needs to continue bit-exactly (params, optimizer state, step, RNG, non-finite counters)
is in the state; the input-pipeline position is saved beside it (see checkpoint.TrainCheckpointer).
"""
from __future__ import annotations

import functools
from typing import Any

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp

from bertjax import sharding
from bertjax.model import layer_layout
from bertjax.model import family
from bertjax.model.family import ModelConfig
from bertjax.pretraining import update_sharding


@flax.struct.dataclass
class TrainState:
    step: jax.Array                   # int32: updates attempted so far
    params: Any
    opt_state: Any
    rng: jax.Array                    # raw key data (uint32) of the dropout base key; step and microbatch are
                                      # folded in, so the key itself never changes and checkpoints as plain ints
    nonfinite_total: jax.Array        # int32: steps whose gradient was not finite (update skipped)
    nonfinite_consecutive: jax.Array  # int32: such steps in a row, up to now


def init_state(rng, *, model, config: ModelConfig, optimizer, seq_len: int, num_masked: int) -> TrainState:
    """A fresh state with boxed (logically annotated) params and optimizer state."""
    params_rng, dropout_rng = jax.random.split(rng)
    # Held with the encoder's layers stacked whether the model runs them unrolled or scanned: the update then
    # runs on ~30 tensors instead of ~200 (on TPU each is its own kernels, priced at >= 1.2 us each).
    params = layer_layout.stack_layers(
        family.init_params(model, config, params_rng, length=seq_len, num_masked=num_masked))
    return TrainState(step=jnp.zeros([], jnp.int32), params=params, opt_state=optimizer.init(params),
                      rng=jax.random.key_data(dropout_rng), nonfinite_total=jnp.zeros([], jnp.int32),
                      nonfinite_consecutive=jnp.zeros([], jnp.int32))


def state_shardings(abstract_boxed_state: TrainState, mesh, rules=sharding.DEFAULT_RULES,
                    shard_update: bool = False):
    """NamedShardings for every leaf of the (unboxed) state; optimizer moments inherit their param's names. With
    `shard_update` the params and moments are also split over the data axis (`update_sharding.split_shardings`)."""
    specs = nn.get_partition_spec(abstract_boxed_state)
    shardings = nn.logical_to_mesh_sharding(specs, mesh, rules)
    if shard_update:
        unboxed = nn.meta.unbox(abstract_boxed_state)
        shardings = shardings.replace(
            params=update_sharding.split_shardings(shardings.params, unboxed.params),
            opt_state=update_sharding.split_shardings(shardings.opt_state, unboxed.opt_state))
    return shardings


def abstract_state(rng, *, model, config, optimizer, mesh, seq_len, num_masked, shard_update: bool = False):
    """(shardings, abstract unboxed state with those shardings): the layout to init or restore into."""
    abstract = abstract_boxed_state(rng, model=model, config=config, optimizer=optimizer, seq_len=seq_len,
                                    num_masked=num_masked)
    shardings = state_shardings(abstract, mesh, shard_update=shard_update)
    unboxed = jax.tree_util.tree_map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                                     nn.meta.unbox(abstract), shardings)
    return shardings, unboxed


def abstract_boxed_state(rng, *, model, config, optimizer, seq_len, num_masked):
    """The state's shapes with their logical axis names (nothing allocated)."""
    return jax.eval_shape(functools.partial(init_state, model=model, config=config, optimizer=optimizer,
                                            seq_len=seq_len, num_masked=num_masked), rng)


def make_update_sharding(rng, *, model, config, optimizer, mesh, seq_len, num_masked,
                         reduce_in_float32: bool = False):
    """The weight-update sharding of this state on `mesh` (`update_sharding.py`)."""
    del optimizer  # the update's layout does not depend on it
    # The params as the model computes with them (per layer unless scanned), not as the state holds them.
    abstract = jax.eval_shape(functools.partial(family.init_params, model, config, length=seq_len,
                                                num_masked=num_masked), rng)
    return update_sharding.make(mesh, sharding.DEFAULT_RULES, sharding.param_shardings(abstract, mesh),
                                nn.meta.unbox(abstract), config.dtype, reduce_in_float32)


def init_sharded_state(rng, shardings, mesh, *, model, config, optimizer, seq_len, num_masked) -> TrainState:
    """A fresh state initialised directly in its sharded layout (`shardings` from `abstract_state`)."""
    init = functools.partial(init_state, model=model, config=config, optimizer=optimizer, seq_len=seq_len,
                             num_masked=num_masked)
    with sharding.activate(mesh):
        return jax.jit(lambda r: nn.meta.unbox(init(r)), out_shardings=shardings)(rng)


def make_sharded_state(rng, *, model, config, optimizer, mesh, seq_len, num_masked, shard_update: bool = False):
    """(state initialised directly in its sharded layout, its shardings, the abstract unboxed state)."""
    shardings, abstract = abstract_state(rng, model=model, config=config, optimizer=optimizer, mesh=mesh,
                                         seq_len=seq_len, num_masked=num_masked, shard_update=shard_update)
    state = init_sharded_state(rng, shardings, mesh, model=model, config=config, optimizer=optimizer,
                               seq_len=seq_len, num_masked=num_masked)
    return state, shardings, abstract
