"""The pretraining job (`bertjax pretrain`): one loop from corpus to checkpoints, resumable to the same bits."""
from __future__ import annotations

import dataclasses
import time

import jax
import ml_collections
import numpy as np
import orbax.checkpoint as ocp
from etils import epath

from bertjax import checkpoint as checkpoint_lib
from bertjax import metrics as metrics_lib
from bertjax import model as model_lib
from bertjax import sharding, train
from bertjax import train_config as train_config_lib


class TooManyNonFiniteSteps(RuntimeError):
    pass


def data_config_for(config: ml_collections.ConfigDict, *, inputs: str, seed_offset: int = 0, masking=None,
                    num_epochs=None):
    """The input pipeline's config from the job's data.* keys."""
    from bertjax.data.pipeline import PretrainingDataConfig

    d = config.data
    return PretrainingDataConfig(
        inputs=tuple(part for part in inputs.split(",") if part), input_kind=d.input_kind,
        vocab_path=d.vocab or None, lower_case=d.lower_case, corpus_format=d.corpus_format,
        max_seq_length=d.max_seq_length, max_predictions_per_seq=d.max_predictions_per_seq,
        masked_lm_prob=d.masked_lm_prob, short_seq_prob=d.short_seq_prob,
        next_sentence_prediction=d.next_sentence_prediction, whole_word_masking=d.whole_word_masking,
        masking=masking or d.masking, dupe_factor=d.dupe_factor, doc_buffer_size=d.doc_buffer_size,
        shuffle_buffer=d.shuffle_buffer, seed=d.seed + seed_offset, num_epochs=num_epochs)


def _vocab(config: ml_collections.ConfigDict) -> tuple[list[str], bool]:
    from bertjax.data.tokenizers import load_tokenizer

    tokenizer = load_tokenizer(config.data.vocab, config.data.lower_case)
    return list(tokenizer.vocab), bool(getattr(tokenizer, "lower_case", config.data.lower_case))


def _numpy_batch(element) -> dict:
    return {k: v.numpy() for k, v in element.items()}


def _merge_pretrained(state, source: str, shardings) -> "train.TrainState":
    """Replaces the state's params with those a pretrained checkpoint holds (heads it lacks stay initialised)."""
    from bertjax.interop import load_pretrained

    loaded = load_pretrained(source)
    flat_loaded = {tuple(k.key for k in path): leaf
                   for path, leaf in jax.tree_util.tree_flatten_with_path(loaded.params)[0]}
    flat_params = jax.tree_util.tree_flatten_with_path(state.params)[0]
    treedef = jax.tree_util.tree_structure(state.params)
    flat_shardings = jax.tree_util.tree_leaves(shardings.params)
    new_leaves = []
    for (path, leaf), leaf_sharding in zip(flat_params, flat_shardings):
        key = tuple(k.key for k in path)
        if key in flat_loaded:
            value = np.asarray(flat_loaded.pop(key))
            if value.shape != leaf.shape:
                raise ValueError(f"--init-from {source}: tensor {'/'.join(key)} has shape {value.shape}, the "
                                 f"model expects {leaf.shape}")
            leaf = jax.device_put(value.astype(leaf.dtype), leaf_sharding)
        new_leaves.append(leaf)
    if flat_loaded:
        raise ValueError(f"--init-from {source}: tensors not in the model: {sorted('/'.join(k) for k in flat_loaded)}")
    return state.replace(params=jax.tree_util.tree_unflatten(treedef, new_leaves))


def _restore_step_dir(step_dir: str, abstract_state):
    """Params, optimizer state and train meta from a training step directory (a continued schedule)."""
    handlers = {checkpoint_lib.PARAMS: ocp.StandardCheckpointHandler(),
                checkpoint_lib.OPT_STATE: ocp.StandardCheckpointHandler(),
                checkpoint_lib.TRAIN_META: ocp.StandardCheckpointHandler()}
    meta = {"step": abstract_state.step, "rng": abstract_state.rng,
            "nonfinite_total": abstract_state.nonfinite_total,
            "nonfinite_consecutive": abstract_state.nonfinite_consecutive}
    with ocp.Checkpointer(ocp.CompositeCheckpointHandler(**handlers)) as checkpointer:
        restored = checkpointer.restore(epath.Path(step_dir).absolute(), args=ocp.args.Composite(**{
            checkpoint_lib.PARAMS: ocp.args.StandardRestore(abstract_state.params),
            checkpoint_lib.OPT_STATE: ocp.args.StandardRestore(abstract_state.opt_state),
            checkpoint_lib.TRAIN_META: ocp.args.StandardRestore(meta)}))
    return abstract_state.replace(params=restored[checkpoint_lib.PARAMS],
                                  opt_state=restored[checkpoint_lib.OPT_STATE], **restored[checkpoint_lib.TRAIN_META])


@dataclasses.dataclass
class RunResult:
    final_step: int
    status: str            # "completed" | "preempted" | "stopped" (max_steps_this_run)
    last_metrics: dict


def run(config: ml_collections.ConfigDict, workdir: str, *, init_from: str = "",
        max_steps_this_run: int | None = None) -> RunResult:
    """Trains until config.train.steps (resuming from the workdir's latest checkpoint), or until preempted."""
    from bertjax.data import pipeline as pipeline_lib

    train_config_lib.validate(config, jax.device_count())
    init_from = init_from or config.init_from
    process_index, process_count = jax.process_index(), jax.process_count()
    mesh = sharding.make_mesh(config.mesh.data, config.mesh.fsdp, config.mesh.tensor)
    vocab, lower_case = _vocab(config)
    bert_config = train_config_lib.model_config(config, len(vocab))
    model = model_lib.BertForPreTraining(bert_config)
    optimizer, schedule = train.make_optimizer_for(config)
    seq_len, num_masked = config.data.max_seq_length, config.data.max_predictions_per_seq
    step_config = train.StepConfig(grad_accum_steps=config.train.grad_accum_steps, nsp_loss=config.train.nsp_loss)

    rng = jax.random.key(config.train.seed)
    checkpointer = checkpoint_lib.TrainCheckpointer(
        workdir, every=config.checkpoint.every, keep=config.checkpoint.keep,
        keep_every=config.checkpoint.keep_every, async_save=config.checkpoint.async_save)
    dataset = pipeline_lib.make_pretraining_dataset(
        data_config_for(config, inputs=config.data.input), config.train.batch_size, process_index, process_count)
    iterator = iter(dataset)
    latest = checkpointer.latest_step()
    if latest is not None:
        shardings, abstract = train.abstract_state(rng, model=model, config=bert_config, optimizer=optimizer,
                                                   mesh=mesh, seq_len=seq_len, num_masked=num_masked)
        state = checkpointer.restore(latest, abstract)
        pipeline_lib.restore_iterator(iterator, pipeline_lib.iterator_checkpoint_path(
            checkpointer.input_state_dir(latest), process_index))
        _log(f"resumed from {workdir}/checkpoints/{latest}")
    else:
        state, shardings, abstract = train.make_sharded_state(
            rng, model=model, config=bert_config, optimizer=optimizer, mesh=mesh, seq_len=seq_len,
            num_masked=num_masked)
        if init_from:
            step_dir = epath.Path(init_from)
            if not config.reset_schedule and (step_dir / checkpoint_lib.OPT_STATE).exists():
                state = _restore_step_dir(init_from, abstract)
                _log(f"continuing from {init_from} at step {int(state.step)} (optimizer state and schedule kept)")
            else:
                state = _merge_pretrained(state, init_from, shardings)
                _log(f"initialised from {init_from} (fresh optimizer state and schedule)")
    train_step, eval_step = train.compile_steps(model=model, optimizer=optimizer, schedule=schedule,
                                                step_config=step_config, state_shardings_tree=shardings, mesh=mesh)

    eval_batches = _eval_batches(config, process_index, process_count) if config.train.eval_every else None
    writer = metrics_lib.MetricsWriter(workdir, config.train.steps, enabled=process_index == 0)
    flops_per_seq = metrics_lib.train_flops_per_sequence(bert_config, seq_len, num_masked)
    peak_flops, peak_source = metrics_lib.device_peak_flops(dtype=bert_config.dtype)
    _log(f"mesh {dict(mesh.shape)}, {jax.device_count()} devices, {process_count} processes; model "
         f"{sum(np.size(x) for x in jax.tree_util.tree_leaves(abstract.params)):,} params; peak "
         f"{peak_flops / 1e12:.3g} TFLOP/s per device ({peak_source})")

    save_input = lambda directory: pipeline_lib.save_iterator(
        iterator, pipeline_lib.iterator_checkpoint_path(directory, process_index))
    save = lambda step, force=False: checkpointer.save(
        step, state, config=bert_config, vocab=vocab, lower_case=lower_case, job_config=config.to_dict(),
        save_input_state=save_input, force=force)

    preemption = train.PreemptionFlag()
    step = int(state.step)
    start_step = step
    status, last_metrics, previous = "completed", {}, None
    interval_start, interval_steps = None, 0
    try:
        with sharding.activate(mesh):
            while step < config.train.steps:
                batch = train.global_batch(_numpy_batch(next(iterator)), mesh)
                state, step_metrics = train_step(state, batch)
                step += 1
                if previous is not None and int(previous["nonfinite_consecutive"]) >= \
                        config.train.max_consecutive_nonfinite:
                    raise TooManyNonFiniteSteps(
                        f"{int(previous['nonfinite_consecutive'])} consecutive steps had a non-finite gradient "
                        f"(up to step {step - 1}); stopping. Lower optimizer.learning_rate, or check the data.")
                previous = step_metrics  # read one step late, so the check never stalls dispatch
                if interval_start is None:
                    jax.block_until_ready(step_metrics)  # the first step includes compilation: not timed
                    interval_start, interval_steps = time.perf_counter(), 0
                    writer.mark_start(step)
                else:
                    interval_steps += 1
                if step % config.train.log_every == 0 or step == config.train.steps:
                    last_metrics = train.to_python(step_metrics)
                    if interval_steps:
                        seconds = (time.perf_counter() - interval_start) / interval_steps
                        last_metrics.update(train.step_seconds_metrics(
                            seconds, config.train.batch_size, seq_len, flops_per_seq, peak_flops))
                    interval_start, interval_steps = time.perf_counter(), 0
                    writer.write(step, last_metrics)
                    writer.console(step, last_metrics)
                if eval_batches and step % config.train.eval_every == 0:
                    writer.write(step, _evaluate(eval_step, state.params, eval_batches, mesh,
                                                 config.train.nsp_loss), prefix="eval_")
                save(step)
                if preemption.agreed(step):
                    status = "preempted"
                    break
                if max_steps_this_run is not None and step - start_step >= max_steps_this_run:
                    status = "stopped"
                    break
        if checkpointer.latest_step() != step:
            save(step, force=True)
        _log(f"{status} at step {step}; checkpoints in {workdir}/checkpoints")
    finally:
        checkpointer.close()
        writer.close()
        preemption.restore()
    return RunResult(step, status, last_metrics)


def _eval_batches(config, process_index, process_count) -> list[dict]:
    """A fixed held-out set: static masks from a fixed seed, so evals at different steps are comparable."""
    from bertjax.data import pipeline as pipeline_lib

    if not config.data.eval_input:
        raise ValueError("train.eval_every is set but data.eval_input is empty")
    dataset = pipeline_lib.make_pretraining_dataset(
        data_config_for(config, inputs=config.data.eval_input, seed_offset=1, masking="static"),
        config.train.batch_size, process_index, process_count)
    return [_numpy_batch(element) for element in dataset.take(config.train.eval_batches)]


def _evaluate(eval_step, params, batches, mesh, nsp_loss: bool) -> dict:
    totals = None
    for batch in batches:
        sums = jax.device_get(eval_step(params, train.global_batch(batch, mesh)))
        totals = sums if totals is None else {k: totals[k] + sums[k] for k in sums}
    return train.to_python(train.summarize(totals, nsp_loss))


def _log(message: str) -> None:
    if jax.process_index() == 0:
        print(message, flush=True)
