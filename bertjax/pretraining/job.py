"""The job's step on a mesh, built once: what the loop trains with and what `bertjax compile` compiles for a TPU
slice (`build_job_step`), and that step compiled for any devices without running it (`compile_step`). Both the
loop and the cloud compiler import this module; it imports neither.
"""
from __future__ import annotations

import dataclasses
import re

import jax
import numpy as np

from bertjax import sharding
from bertjax.data import schema
from bertjax.model import family
from bertjax.model.family import ModelConfig
from bertjax.pretraining import state as train_state
from bertjax.pretraining import step as train_step
from bertjax.pretraining.config import PretrainConfig
from bertjax.pretraining.optim import make_optimizer

_OUT_OF_HBM = re.compile(r"RESOURCE_EXHAUSTED.*?\(([\d.]+)([KMGT])\).*?available HBM \(([\d.]+)([KMGT])\)", re.S)
_UNITS = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


@dataclasses.dataclass
class JobStep:
    """What a pretraining job computes on a mesh: its model, the state's layout and the jitted steps."""

    bert_config: ModelConfig  # BERT's or ModernBERT's
    rng: jax.Array
    state_args: dict          # model, config, optimizer, seq_len, num_masked: how the state is initialised
    shardings: object         # NamedShardings of every state leaf
    abstract_state: object    # the state as ShapeDtypeStructs with those shardings (what restores and AOT take)
    train_step: object        # jitted, state donated
    eval_step: object
    update_sharded: bool = False   # params and moments split over data (`update_sharding.py`)


def build_job_step(config: PretrainConfig, mesh, vocab_size: int, special_ids: dict | None = None) -> JobStep:
    """The model, state layout and steps of the job on `mesh`: what `run` trains with and `bertjax compile`
    compiles for a TPU slice (one builder, so the two cannot drift apart). `special_ids`: the vocabulary's
    [PAD]/[CLS]/[SEP] ids (ModernBERT's config records them)."""
    bert_config = config.bert_config(vocab_size, special_ids)
    model = family.pretraining_model(bert_config, config.train.span_boundary_objective)
    batches = config.batch_schedule()
    # With a batch-size warmup the learning-rate schedule counts tokens: a step of k of the K microbatches is k / K
    # of a full step (batch_schedule.py); without, the step count itself (the same program as before it existed).
    optimizer, schedule = (make_optimizer(config.optimizer, batches.full_steps_before(config.train.steps),
                                          steps_done=batches.traced_full_steps_before) if batches.warming else
                           make_optimizer(config.optimizer, config.train.steps))
    state_args = dict(model=model, config=bert_config, optimizer=optimizer, seq_len=config.data.max_seq_length,
                      num_masked=config.data.max_predictions_per_seq)
    rng = jax.random.key(config.train.seed)
    shard_update = shards_update(config.mesh, mesh)
    shardings, abstract = train_state.abstract_state(rng, mesh=mesh, shard_update=shard_update, **state_args)
    update = train_state.make_update_sharding(rng, mesh=mesh, reduce_in_float32=config.mesh.reduce_in_float32,
                                              **state_args) if shard_update else None
    step_fn, eval_fn = train_step.compile_steps(
        model=model, optimizer=optimizer, schedule=schedule, microbatch_rows=batches.microbatch_rows,
        nsp_loss=config.train.nsp_loss, state_shardings_tree=shardings, mesh=mesh, update_sharding=update)
    return JobStep(bert_config, rng, state_args, shardings, abstract, step_fn, eval_fn, shard_update)


def shards_update(mesh_config: sharding.MeshConfig, mesh) -> bool:
    """Whether the job splits its update over the data axis: `mesh.shard_optimizer`, or where it is unset, on
    TPU and GPU meshes with data > 1 (the priced estimate's choice) and not on the CPU (no interconnect to save,
    and XLA:CPU runs the shard_map'ed step no faster)."""
    if mesh.shape["data"] == 1:
        return False
    if mesh_config.shard_optimizer is not None:
        return mesh_config.shard_optimizer
    return mesh.devices.flat[0].platform in ("tpu", "gpu")


@dataclasses.dataclass
class CompiledStep:
    """What compiling one configuration gave: the per-chip need and FLOPs, or the out-of-memory size."""

    fits: bool
    hbm_bytes_per_chip: int          # arguments + outputs + temporaries - aliased (or the size XLA said it needs)
    xla_flops_per_chip: float | None
    argument_bytes_per_chip: int | None = None   # the train state and the batch (the state is donated)
    temp_bytes_per_chip: int | None = None       # activations, gradients, gathered params...
    detail: str = ""
    hlo_text: str | None = None                  # the compiled program (XLA:TPU's cycle estimates are in it)
    update_sharded: bool = False


def abstract_batch(config: PretrainConfig, mesh) -> dict:
    """The shapes, dtypes and shardings of one global batch of the job (the full batch: a batch-size warmup's steps
    are programs of fewer of its microbatches), for lowering its step ahead of time."""
    batch_sharding = sharding.batch_sharding(mesh)
    shapes = config.data.feature_shapes()
    dtypes = schema.feature_dtypes(shapes)
    return {name: jax.ShapeDtypeStruct((config.train.batch_size,) + shape, np.dtype(dtypes[name]),
                                       sharding=batch_sharding)
            for name, shape in shapes.items()}


def compile_step(config: PretrainConfig, devices: list, vocab_size: int,
                 special_ids: dict | None = None) -> CompiledStep:
    """Compiles the job's train step for `devices` (this machine's, or a TPU slice's or GPU host's compile-only
    devices); never runs it."""
    mesh = config.mesh.build(devices)
    job = build_job_step(config, mesh, vocab_size, special_ids)
    with sharding.activate(mesh):
        lowered = job.train_step.lower(job.abstract_state, abstract_batch(config, mesh))
    return compile_lowered(lowered, job.update_sharded)


def compile_lowered(lowered, update_sharded: bool = False) -> CompiledStep:
    """Compiles a lowered step (never runs it): the per-chip need, FLOPs and program, or, where XLA says it does not
    fit HBM, the size it asked for."""
    try:
        compiled = lowered.compile()
    except jax.errors.JaxRuntimeError as error:
        match = _OUT_OF_HBM.search(str(error))
        if not match:
            raise
        need = int(float(match[1]) * _UNITS[match[2]])
        return CompiledStep(False, need, None, detail=str(error).strip().splitlines()[0][:400],
                            update_sharded=update_sharded)
    memory = compiled.memory_analysis()
    need = (memory.argument_size_in_bytes + memory.output_size_in_bytes + memory.temp_size_in_bytes
            - memory.alias_size_in_bytes)
    cost = compiled.cost_analysis()   # None from deviceless XLA:GPU
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    flops = None if cost is None else float(cost.get("flops", 0.0))
    return CompiledStep(True, int(need), flops, int(memory.argument_size_in_bytes),
                        int(memory.temp_size_in_bytes), hlo_text=compiled.as_text(), update_sharded=update_sharded)
