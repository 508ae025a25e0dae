"""The pretraining job (`bertjax pretrain`): one loop from corpus to checkpoints, resumable to the same bits.

build mesh -> init or restore the state (sharded by the logical rules) -> for each step: next batch, jitted step
that donates the state, log, eval, checkpoint, check for preemption.
"""
from __future__ import annotations

import collections
import contextlib
import dataclasses
import json
import sys
import time

import jax
import numpy as np
from etils import epath
from flax import traverse_util

from bertjax import checkpoint as checkpoint_lib
from bertjax import sharding
from bertjax.runtime import compile_cache
from bertjax.checkpoint import COMPLETION_MARKER, ResumeRefused
from bertjax.runtime.errors import OutputWriteError
from bertjax.runtime.console import Console, LineSchedule, duration, metric_text
from bertjax.data import input_source, tfrecord
from bertjax.data import pipeline as pipeline_lib
from bertjax.data.instances import nsp_warning
from bertjax.data.tokenizers import load_tokenizer
from bertjax.runtime.host_memory import memory_warning
from bertjax.runtime.input_files import read_json
from bertjax.interop.load import check_init_tokenizer, check_vocab_fits, describe_pretrained, load_pretrained
from bertjax.runtime.outputs import write_whole
from bertjax.model import bert as model_lib
from bertjax.model import family
from bertjax.runtime.preemption import PreemptionFlag, stopped_line
from bertjax.pretraining import goodput as goodput_lib
from bertjax.pretraining import metrics as metrics_lib
from bertjax.pretraining import optim as optim_lib
from bertjax.pretraining import progress as progress_lib
from bertjax.pretraining import state as train_state
from bertjax.pretraining import step as train_step
from bertjax.pretraining.config import PretrainConfig, check_resume_config, validate
from bertjax.pretraining.job import build_job_step, compile_step
from bertjax.pretraining.step import TooManyNonFiniteSteps
from bertjax.runtime.workdir_lock import WorkdirLock


def _resolved_input(data, log) -> input_source.InputSource:
    """data.input resolved (input_source.resolve); a run needs a vocabulary (its size shapes the model, checkpoints
    carry it)."""
    source = input_source.resolve(data, log=log)
    if not source.config.vocab:
        raise ValueError(f"data.vocab is empty and the `data create` metadata of data.input={data.input!r} names no "
                         f"readable vocabulary: set data.vocab to the vocab the shards were made with")
    return source


def _shapes_taken(requested, resolved) -> str:
    """`data.KEY=VALUE, ...` for the data shapes the shards' metadata set differently from the config."""
    return ", ".join(f"data.{k}={getattr(resolved, k)}" for k in input_source.SHARD_SHAPE_KEYS
                     if getattr(requested, k) != getattr(resolved, k))


def _check_gpu_kernels(mesh, log) -> None:
    """On a GPU, before the step is built: our Pallas kernels checked on the card (once per card, jax and kernel
    source), a family that disagrees with XLA left out of the step (model/gpu_kernel_check.py)."""
    if mesh.devices.flat[0].platform == "gpu":
        from bertjax.model import gpu_kernel_check

        gpu_kernel_check.prepare("gpu", log)


def _numpy_batch(element) -> dict:
    return {k: v.numpy() for k, v in element.items()}


def _step_rows(iterator, elements: int) -> dict:
    """This process's rows of the next step: `elements` of the pipeline's (a batch-size warmup's microbatches, or
    one full batch), element i interleaved as rows j * elements + i: the train step's microbatch i."""
    taken = [_numpy_batch(next(iterator)) for _ in range(elements)]
    if elements == 1:
        return taken[0]
    return {key: np.stack([element[key] for element in taken], axis=1).reshape((-1,) + value.shape[1:])
            for key, value in taken[0].items()}


def _refuse_warmup_from_init(config: PretrainConfig, init_from: str) -> None:
    """A run that starts a trained model's next phase from step 0 (--init, the schedule reset) with a batch-size
    warmup would grow its batch again from a microbatch: ModernBERT's later phases ran at their full batch. Refused,
    naming the key (a preset's warmup is easily inherited)."""
    batches = config.batch_schedule()
    if init_from and config.reset_schedule and batches.warmup_steps:
        raise ValueError(f"--init {init_from}: train.batch_size_warmup_tokens={config.train.batch_size_warmup_tokens} "
                         f"would warm the batch up again ({batches.warmup_steps:,} steps from "
                         f"{batches.rows_at(0):,} rows), which is for a training from scratch: set "
                         f"train.batch_size_warmup_tokens=0 for a phase that continues a model")


def _init_from(state, source: str, shardings, abstract, reset_schedule: bool, keep_optimizer: bool,
               vocab: list[str], hidden_act: str, log):
    """The state started from a checkpoint: a trainer step directory continues its schedule unless
    `reset_schedule`, or with `keep_optimizer` continues its optimizer state (moments, Adam's step count) on a
    schedule from step 0; anything else (ours, HF, TF) gives its params, the rest stays initialised. A run
    directory stands for its newest complete step."""
    source = checkpoint_lib.resolve_checkpoint(source)
    has_optimizer = (epath.Path(source) / checkpoint_lib.OPT_STATE).exists()
    if keep_optimizer and not has_optimizer:
        raise ValueError(f"init_optimizer_state=true: --init {source} holds no optimizer state (a model checkpoint, "
                         f"not a step of a bertjax pretraining run); set init_optimizer_state=false to start from "
                         f"its params alone")
    if has_optimizer and (keep_optimizer or not reset_schedule):
        described = checkpoint_lib.load_description(source)
        _warn_other_activation(family.activation(described.config), hidden_act, source, log)
        _warn_other_vocab(vocab, described.vocab, source, log)
        restored = _restore_optimizer_state(source, abstract)
        if not reset_schedule:
            log(f"continuing from {source} at step {int(restored.step)} (optimizer state and schedule kept)")
            return restored
        # This run's step count, RNG, counters and schedule position (all fresh), the checkpoint's params and moments.
        log(f"started from {source}: its params and optimizer state (Adam's moments, at its step "
            f"{int(restored.step)}), the schedule from step 0")
        return state.replace(params=restored.params,
                             opt_state=optim_lib.restart_schedule(restored.opt_state, state.opt_state))
    checkpoint = load_pretrained(source)
    _warn_other_activation(family.activation(checkpoint.config), hidden_act, source, log)
    _warn_other_vocab(vocab, checkpoint.vocab, source, log)
    initialised, loaded = jax.device_get(state.params), checkpoint.params
    merged = checkpoint_lib.merge_params(initialised, loaded, source=f"--init {source}", encoder_only=False)
    # The state holds the layers stacked, a checkpoint hands them out per layer: compared by module, not tensor.
    fresh = _modules_missing(initialised, model_lib.stack_layers(loaded, stack=lambda leaves: leaves[0]))
    log(f"initialised from {source} (fresh optimizer state and schedule)" +
        (f"; not in the checkpoint, freshly initialised: {', '.join(fresh)}" if fresh else ""))
    return state.replace(params=jax.device_put(merged, shardings.params))


def _restore_optimizer_state(source: str, abstract):
    """The whole train state of the step directory `source`; one error line where it does not fit this run's
    (another model, or an optimizer state of another shape: another optimizer.name, clip_norm on or off,
    bias_correction)."""
    try:
        return checkpoint_lib.restore_train_state(source, abstract)
    except (ValueError, KeyError, TypeError) as error:
        saved = (checkpoint_lib.load_job_config(source) or {}).get("optimizer", {})
        said = ", ".join(f"optimizer.{key}={saved[key]}" for key in ("name", "clip_norm", "bias_correction")
                         if key in saved)
        detail = (str(error).strip().splitlines() or [type(error).__name__])[0].rstrip(":")
        raise ValueError(f"--init {source}: its train state does not fit this run's model and optimizer"
                         + (f" (it was saved with {said}: continuing its optimizer takes the same optimizer.name, "
                            f"clip_norm on or off, and bias_correction)" if said else "")
                         + f": {detail[:300]}") from None


def _warn_other_vocab(vocab: list[str], trained: list[str], source: str, log) -> None:
    differing = sum(a != b for a, b in zip(vocab, trained)) + abs(len(vocab) - len(trained))
    if differing:  # same size (the shapes check that), other tokens: embedding rows now stand for other words
        shown = [f"{i}: {b!r} -> {a!r}" for i, (a, b) in enumerate(zip(vocab, trained)) if a != b][:3]
        log(f"warning: data.vocab differs from the vocabulary of --init {source} in {differing} token(s) "
            f"({', '.join(shown)}{', ...' if differing > 3 else ''}): their embedding rows were trained for other "
            f"words")


def _warn_other_activation(trained: str, computed: str, source: str, log) -> None:
    # The shapes do not tell: phase 2 from a phase-1 run of another activation would silently change the function.
    if trained != computed:
        log(f"warning: --init {source} has hidden_act={trained!r}; this job computes {computed!r} (set "
            f"model.hidden_act={trained} to continue with the checkpoint's)")


def _modules_missing(params: dict, loaded: dict) -> list[str]:
    """The modules of `params` that `loaded` has no tensor of: heads (`predictions`, `seq_relationship`) and the
    encoder's parts (`bert/pooler`)."""
    module = lambda path: "/".join(path[:2]) if path[0] == "bert" else path[0]  # noqa: E731
    have = {module(path) for path in traverse_util.flatten_dict(loaded)}
    return sorted({module(path) for path in traverse_util.flatten_dict(params)} - have)


def _resume(checkpointer, abstract, dataset, config: PretrainConfig, allow_config_change: bool,
            process_index: int, log):
    """(state, input iterator) from the newest step that restores, or None without any step.

    `checkpointer.restore_newest` sets a step that cannot be read (a truncated or missing file, garbage metadata)
    aside as `<step>.corrupt` and tries the next older one; a config that cannot resume from the step is a
    ResumeRefused (check_resume_config), which it lets through: the config, not the step, is at fault.
    """
    def restore(step: int):
        where = checkpointer.step_dir(step)
        changed = check_resume_config(checkpointer.saved_job_config(step), config.to_dict(),
                                      allow_changes=allow_config_change, where=where)
        if changed:
            log(f"resuming with changed config keys: {', '.join(changed)}")
        try:
            state = checkpointer.restore(step, abstract)
            iterator = iter(dataset)
            pipeline_lib.restore_iterator(iterator, pipeline_lib.iterator_checkpoint_path(
                checkpointer.input_state_dir(step), process_index))
        except ValueError as error:
            data_changes = [k for k in changed if k.startswith("data.")]
            if data_changes:  # the change, not the step, is the problem
                raise ResumeRefused(f"{where}: the input pipeline cannot continue with the changed "
                                    f"{', '.join(data_changes)} ({error})") from None
            raise
        log(f"resumed from {where}")
        return state, iterator

    found = checkpointer.restore_newest(restore, log)
    return None if found is None else found[1]


# What a run read: each input file's size and modification time, to tell a resume on replaced files.
INPUTS_RECORD = "inputs.json"


def _input_stamps(data) -> dict:
    """{file: "<size> bytes, modified <mtime_nsec>"} of the run's input files (a stat each: corpora are too big to
    hash at every start)."""
    import tensorflow as tf

    from bertjax.data.corpus import expand_inputs

    if not data.input or data.is_tfds:
        return {}
    stamps = {}
    for path in expand_inputs(data.inputs):
        stat = tf.io.gfile.stat(path)
        stamps[path] = f"{stat.length} bytes, modified {stat.mtime_nsec}"
    return stamps


def _check_inputs_unchanged(record, data, resumed: bool, writer: bool, log) -> None:
    """On resume, warns when the input files differ from those the run started on (replaced, grown, added or
    removed): the restored input position then points into other data. Records the current ones."""
    stamps = _input_stamps(data)
    earlier = read_json(record, "the run's input files (JSON)") if resumed and record.exists() else None
    if earlier is not None and earlier != stamps:
        changed = sorted(f for f in set(earlier) | set(stamps) if earlier.get(f) != stamps.get(f))
        log(f"warning: {len(changed)} input file(s) changed since this run started ({', '.join(changed[:3])}"
            f"{', ...' if len(changed) > 3 else ''}): it continues on them from the saved input position, which "
            f"was a position in the old files")
    if writer and earlier != stamps:
        write_whole(record, json.dumps(stamps, indent=1, sort_keys=True) + "\n")


def plan(config: PretrainConfig, workdir: str, *, init_from: str = "", assumed_mfu: float = 0.5) -> str:
    """`pretrain --dry-run`: everything a run checks before its first step, then the step compiled on this
    machine's devices, as lines for a person (nothing is written but the compilation cache's entries)."""
    compile_cache.enable(config.train.compilation_cache_dir)
    source = _resolved_input(config.data, Console(enabled=jax.process_index() == 0).line)
    config = dataclasses.replace(config, data=source.config)
    validate(config, jax.device_count())
    mesh = config.mesh.build()
    _check_gpu_kernels(mesh, Console(enabled=jax.process_index() == 0).line)
    tokenizer = load_tokenizer(config.data.vocab, config.data.lower_case)
    batches = config.batch_schedule()
    with tfrecord.damaged_records_named(source.files):
        batch = _numpy_batch(next(iter(pipeline_lib.make_pretraining_dataset(
            source, batches.pipeline_rows, jax.process_index(), jax.process_count()))))
    saved = checkpoint_lib.complete_steps(workdir)
    if not saved:
        _refuse_warmup_from_init(config, init_from or config.init_from)
    if init_from or config.init_from:  # readable, and its tokenizer the data's, before any device time is spent
        check_init_tokenizer(load_pretrained(init_from or config.init_from), init_from or config.init_from,
                             config.data.vocab, getattr(tokenizer, "spec", None))
    special = tokenizer.special_token_ids
    compiled = compile_step(config, jax.devices(), len(tokenizer.vocab), special)
    bert_config = config.bert_config(len(tokenizer.vocab), special)
    params = sum(np.size(x) for x in jax.tree_util.tree_leaves(
        build_job_step(config, mesh, len(tokenizer.vocab), special).abstract_state.params))
    peak, peak_source = metrics_lib.device_peak_flops(dtype=bert_config.dtype)
    flops = config.train.batch_size * metrics_lib.train_flops_per_sequence(
        bert_config, config.data.max_seq_length, config.data.max_predictions_per_seq)
    step_seconds = flops / (jax.device_count() * peak * assumed_mfu)
    gib = 2**30
    warning = memory_warning(compiled.hbm_bytes_per_chip or 0, jax.local_devices()[0], jax.local_device_count())
    return "\n".join([
        f"config valid; mesh {dict(mesh.shape)} over {jax.device_count()} {jax.devices()[0].platform} device(s), "
        f"{jax.process_count()} process(es)",
        f"model {params:,} params ({config.model.preset}, dtype {bert_config.dtype}), vocabulary "
        f"{len(tokenizer.vocab):,} ({config.data.vocab})",
        f"input {config.data.input!r} ({config.data.input_kind}): first batch read, "
        f"{' '.join(f'{k}{list(v.shape)}' for k, v in batch.items() if k in ('input_ids', 'masked_lm_ids'))}",
        f"step compiled: {compiled.hbm_bytes_per_chip / gib:.2f} GiB per device (state and batch "
        f"{(compiled.argument_bytes_per_chip or 0) / gib:.2f} GiB, temporaries "
        f"{(compiled.temp_bytes_per_chip or 0) / gib:.2f} GiB)",
        *([warning] if warning else []),
        f"model FLOPs per step {flops:.4g}; at {assumed_mfu:.0%} MFU of {peak / 1e12:.3g} TFLOP/s per device "
        f"({peak_source}): {step_seconds:.3g} s/step, {config.train.steps} steps = "
        f"{duration(batches.full_steps_before(config.train.steps) * step_seconds)}"
        + (" (a warmup step at its share of the full step's microbatches)" if batches.warmup else ""),
        *([batches.describe(config.train.steps)] if batches.warming else []),
        f"workdir {workdir}: " + (f"would resume from step {saved[-1]} (checkpoints: {saved})" if saved else
                                  "no checkpoints; would start at step 0"
                                  + (f" from {init_from or config.init_from}" if init_from or config.init_from
                                     else "")),
        "dry run: nothing trained or written",
    ])


@dataclasses.dataclass
class RunResult:
    final_step: int
    status: str            # "completed" | "preempted" | "stopped" (max_steps_this_run); the last two: STOPPED_EXIT
    last_metrics: dict


def run(config: PretrainConfig, workdir: str, *, init_from: str = "", max_steps_this_run: int | None = None,
        allow_config_change: bool = False, lock: WorkdirLock | None, command: list[str] | None = None) -> RunResult:
    """Trains until config.train.steps (resuming from the workdir's latest checkpoint), or until preempted.
    The run's goodput account (goodput.py) goes to WORKDIR/goodput/ as it runs, and to metrics.jsonl at its end;
    `command` (the argv after `bertjax`) to metrics.jsonl at its start, for the export's model card.
    The workdir is this job's alone while it runs: `lock` (process 0's, None on the others; workdir_lock.py: another
    live job there is refused) is held from before anything is written to the end. A workdir the caller created is
    the caller's to remove on failure (new_workdir.py, in cli.py)."""
    if lock is not None:
        checkpoint_lib.check_writable(str(epath.Path(workdir) / "checkpoints"))  # a full disk: one line, first
        lock.acquire()  # before anything else is written
    try:
        return _run(config, workdir, init_from=init_from, max_steps_this_run=max_steps_this_run,
                    allow_config_change=allow_config_change, command=command)
    finally:
        if lock is not None:
            lock.release()


def _start(config: PretrainConfig, workdir: str, *, init_from: str, allow_config_change: bool) -> tuple[_Run, object]:
    """Everything before the first step, each part's time charged to the run's goodput account: (the run, its
    train state, resumed, initialised or started from `init_from`)."""
    # Before anything compiles: a restart reads the step's executable back instead of compiling it.
    compile_cache.enable(config.train.compilation_cache_dir)
    account = goodput_lib.RunAccount(workdir, enabled=jax.process_index() == 0)
    # The input kind decided (and the vocab and shapes of `data create` shards found) once, before anything is
    # saved; validated after, as the shards may have set the shapes.
    requested = config.data
    process_index, process_count = jax.process_index(), jax.process_count()
    console = Console(enabled=process_index == 0)
    log = console.line
    source = _resolved_input(config.data, log)
    config = dataclasses.replace(config, data=source.config)
    validate(config, jax.device_count())
    init_from = init_from or config.init_from
    mesh = config.mesh.build()
    _check_gpu_kernels(mesh, log)
    account.mark("startup_s")
    tokenizer = load_tokenizer(config.data.vocab, config.data.lower_case)
    vocab, lower_case = list(tokenizer.vocab), tokenizer.lower_case
    rows = config.bert_config(len(vocab), tokenizer.special_token_ids).vocab_size
    check_vocab_fits(len(vocab), rows, config.data.vocab, f"the model (model.vocab_size={rows})")
    job = build_job_step(config, mesh, len(vocab), tokenizer.special_token_ids)
    bert_config, shardings, abstract = job.bert_config, job.shardings, job.abstract_state
    seq_len = config.data.max_seq_length

    from_shards = _shapes_taken(requested, config.data)
    if from_shards:
        log(f"from the shards' metadata: {from_shards}")
    run_start = time.perf_counter()
    checkpointer = checkpoint_lib.TrainCheckpointer(workdir, config.checkpoint)
    if process_index == 0:  # the effective config of this run (sizes written out), readable without Orbax
        effective = config.with_model_sizes(len(vocab)).to_dict()
        write_whole(epath.Path(workdir) / "config.json", json.dumps(effective, indent=2) + "\n")
    input_stats = collections.Counter()
    batches = config.batch_schedule()
    dataset = pipeline_lib.make_pretraining_dataset(source, batches.pipeline_rows, process_index,
                                                    process_count, stats=input_stats)
    account.mark("setup_s")
    cache_stats = account.cache_stats = compile_cache.CacheStats().start()  # the compiles from here: init, steps
    try:
        resumed = _resume(checkpointer, abstract, dataset, config, allow_config_change, process_index, log)
        if resumed is None and init_from:  # before any device time is spent
            _refuse_warmup_from_init(config, init_from)
            check_init_tokenizer(describe_pretrained(init_from), init_from, config.data.vocab,
                                 getattr(tokenizer, "spec", None))
    except ValueError:
        checkpointer.close()  # its background threads would keep the process alive
        cache_stats.close()
        raise
    if resumed is not None:
        state, iterator = resumed
    else:
        iterator = iter(dataset)
        state = train_state.init_sharded_state(job.rng, shardings, mesh, **job.state_args)
        if init_from:
            state = _init_from(state, init_from, shardings, abstract, config.reset_schedule,
                               config.init_optimizer_state, vocab, family.activation(bert_config), log)
    _check_inputs_unchanged(epath.Path(workdir) / INPUTS_RECORD, config.data, resumed is not None,
                            process_index == 0, log)
    jax.block_until_ready(state)  # restored or initialised, not only dispatched: the time is charged now
    # Restore is reading a checkpoint (a resume, or --init's weights); a fresh state is part of the setup.
    account.mark("restore_s" if resumed is not None or init_from else "setup_s")
    if account.enabled:
        account.resumed_at(int(state.step), workdir)

    eval_batches = (_eval_batches(config, requested.corpus_format, process_index, process_count, log)
                    if config.train.eval_every else None)
    writer = metrics_lib.MetricsWriter(workdir, config.train.steps, enabled=process_index == 0, console=console,
                                       start_step=int(state.step), wandb_project=config.train.wandb_project,
                                       run_config=config.to_dict(), work=batches.full_steps_before)
    peak_flops, peak_source = metrics_lib.device_peak_flops(dtype=bert_config.dtype)
    log(f"mesh {dict(mesh.shape)}, {jax.device_count()} devices, {process_count} processes; model "
        f"{sum(np.size(x) for x in jax.tree_util.tree_leaves(abstract.params)):,} params; batch "
        f"{config.train.batch_size} x {seq_len} tokens; peak {peak_flops / 1e12:.3g} TFLOP/s per device "
        f"({peak_source})")
    if batches.warming:
        log(batches.describe(config.train.steps))
    clock = progress_lib.StepClock(int(state.step), config.train.steps, batches=batches,
                                   seq_len=seq_len, bert_config=bert_config, peak_flops=peak_flops,
                                   sbo=config.train.span_boundary_objective, run_start=run_start, account=account,
                                   writer=writer, console=console)
    save = _Saver(checkpointer, iterator, account, config=config, bert_config=bert_config, vocab=vocab,
                  lower_case=lower_case, tokenizer=getattr(tokenizer, "spec", None))
    evaluate = _Evaluator(job.eval_step, eval_batches, config.train.eval_every, mesh, config.train.nsp_loss, writer,
                          log, account)
    return _Run(config=config, mesh=mesh, train_step=job.train_step, batches=batches, iterator=iterator,
                input_files=source.files, input_stats=input_stats, account=account, cache_stats=cache_stats,
                console=console, writer=writer, clock=clock, checkpointer=checkpointer, save=save,
                evaluate=evaluate), state


@dataclasses.dataclass
class _Run:
    """A run set up to take its first step (`_start`): what the loop steps and calls."""
    config: PretrainConfig  # its data resolved
    mesh: object
    train_step: object
    batches: object  # batch_schedule.BatchSchedule: the rows of each step
    iterator: object
    input_files: tuple[str, ...]  # what the iterator reads (all processes')
    input_stats: collections.Counter  # the input pipeline's counters (this process's)
    account: goodput_lib.RunAccount
    cache_stats: compile_cache.CacheStats
    console: Console
    writer: metrics_lib.MetricsWriter
    clock: progress_lib.StepClock
    checkpointer: checkpoint_lib.TrainCheckpointer
    save: _Saver
    evaluate: _Evaluator


def _run(config: PretrainConfig, workdir: str, *, init_from: str, max_steps_this_run: int | None,
         allow_config_change: bool, command: list[str] | None) -> RunResult:
    """The loop: next batch, step, log, eval, save, until train.steps, a preemption or `max_steps_this_run`."""
    run, state = _start(config, workdir, init_from=init_from, allow_config_change=allow_config_change)
    config, account, writer, log = run.config, run.account, run.writer, run.console.line
    step = start_step = int(state.step)
    if command is not None:
        writer.write_event(step, "command", {"argv": command, "init": init_from or config.init_from})
    preemption = PreemptionFlag()
    nonfinite = _NonFiniteGuard(config.train.max_consecutive_nonfinite)
    status, why, last_metrics, reported_input = "completed", "", {}, collections.Counter()
    account.mark("setup_s")
    account.snapshot(step, force=True)
    try:
        with sharding.activate(run.mesh), tfrecord.damaged_records_named(run.input_files):
            if step == 0:  # where learning starts from, for the eval curve
                run.evaluate(step, state.params)
            lines = LineSchedule(config.train.steps, config.train.log_every)
            while step < config.train.steps:
                with account.charged_to("input_wait_s"):
                    batch = sharding.global_batch(_step_rows(run.iterator, run.batches.elements_at(step)),
                                                  run.mesh)
                run.clock.before_step(step)
                state, step_metrics = run.train_step(state, batch)
                step += 1
                nonfinite.check(step, step_metrics)
                run.clock.after_step(step, step_metrics)
                line_due = lines.due(step)
                if step % config.train.log_every == 0 or step == config.train.steps:
                    last_metrics = {**_step_values(step_metrics), **run.clock.interval(),
                                    **_input_metrics(run.input_stats)}
                    writer.write(step, last_metrics)
                    writer.console(step, last_metrics)
                    reported_input = _warn_about_input(run.input_stats, reported_input, config.data.max_line_chars,
                                                       config.data.next_sentence_prediction, log)
                    account.snapshot(step)
                elif line_due:  # where the run is, between metric lines (no device read)
                    writer.console(step, {})
                run.evaluate(step, state.params)  # when due, as the save
                run.save(step, state)
                if step == config.train.steps:  # done: a stop asked at the last step changes nothing
                    break
                if preemption.agreed(step):
                    status, why = "preempted", preemption.reason()
                    break
                if max_steps_this_run is not None and step - start_step >= max_steps_this_run:
                    status, why = "stopped", f"--max-steps-this-run {max_steps_this_run}"
                    break
        if run.checkpointer.latest_step() != step:
            run.save(step, state, force=True)
    finally:
        goodput = _finish(run, step, status, preemption)
    for text in progress_lib.summary(status, step, run.clock, last_metrics, run.evaluate.results,
                                     run.checkpointer.latest_step(), workdir, writer):
        log(text)
    log(goodput_lib.format_run(goodput))
    if status != "completed":  # last: the job's exit status (STOPPED_EXIT, cli.py) says it to a script or launcher
        log(stopped_line(step, config.train.steps, why, f"{workdir}/checkpoints/{run.checkpointer.latest_step()}"))
    elif jax.process_index() == 0:
        # After the last save is finalised: a babysitter restarts the job until this file exists.
        write_whole(epath.Path(workdir) / COMPLETION_MARKER, json.dumps({"final_step": step}))
    return RunResult(step, status, last_metrics)


def _finish(run: _Run, step: int, status: str, preemption: PreemptionFlag) -> dict:
    """Ends a run, also one an error is leaving: waits for the last save, closes the goodput account (its final
    snapshot, and when nothing failed its record in metrics.jsonl), the writers and the signal handlers. Returns
    the account's record."""
    run.console.close_progress()
    failing = sys.exc_info()[1] is not None
    run.account.mark("step_s")
    try:
        run.checkpointer.close()
    except checkpoint_lib.CheckpointWriteError:
        if not failing:  # else the error already on its way out says it
            raise
    finally:
        run.account.mark("checkpoint_s")  # the wait for the last save to be finalised
        run.account.step = step
        run.cache_stats.close()
        goodput = run.account.record()
        failed = sys.exc_info()[1] is not None
        # The disk that failed a save fails these writes too: the error on its way out is the one to name.
        unless_failed = contextlib.suppress(OSError, OutputWriteError) if failed else contextlib.nullcontext()
        try:
            with unless_failed:
                run.account.snapshot(step, ended=True, status="failed" if failed else status)
            if not failed:
                run.writer.write_event(step, "goodput", {k: v for k, v in goodput.items() if k != "step"})
            with unless_failed:
                run.writer.close()
        finally:
            preemption.restore()
    return goodput


class _NonFiniteGuard:
    """Stops the run after train.max_consecutive_nonfinite steps in a row had a non-finite gradient. A step's
    counter is read one step late, so the check never stalls dispatch."""

    def __init__(self, limit: int):
        self.limit, self.previous = limit, None

    def check(self, step: int, step_metrics: dict) -> None:
        """`step_metrics`: of the step that led to `step`; the previous step's counter is read."""
        previous, self.previous = self.previous, step_metrics
        if previous is not None and int(previous["nonfinite_consecutive"]) >= self.limit:
            raise TooManyNonFiniteSteps(
                f"{int(previous['nonfinite_consecutive'])} consecutive steps had a non-finite gradient "
                f"(up to step {step - 1}); stopping. Lower optimizer.learning_rate, or check the data.")


class _Saver:
    """Saves the train state with what a resume needs (the model's config and vocabulary, the job's config, this
    process's input position) when the step is due or forced; its blocking part charged to checkpoint_s."""

    def __init__(self, checkpointer, iterator, account, *, config: PretrainConfig, bert_config, vocab: list[str],
                 lower_case: bool, tokenizer: dict | None = None):
        self.checkpointer, self.iterator, self.account, self.config = checkpointer, iterator, account, config
        self.model = dict(config=bert_config, vocab=vocab, lower_case=lower_case, tokenizer=tokenizer)

    def __call__(self, step: int, state, force: bool = False) -> bool:
        with self.account.charged_to("checkpoint_s"):
            saved = self.checkpointer.save(step, state, **self.model, job_config=self.config.to_dict(),
                                           save_input_state=self._save_input, force=force)
        if saved:  # a killed run's account then reaches at least its last checkpoint
            self.account.snapshot(step, force=True)
        return saved

    def _save_input(self, directory: str) -> None:
        pipeline_lib.save_iterator(self.iterator, pipeline_lib.iterator_checkpoint_path(directory,
                                                                                         jax.process_index()))


def _step_values(step_metrics: dict) -> dict:
    """A step's metrics as logged (its token counts go into the interval's throughput instead)."""
    return {k: v for k, v in metrics_lib.to_python(step_metrics).items() if k not in progress_lib.COUNTED}


# The input pipeline's counters (this process's; blocks read ahead of training included) as metrics.
_INPUT_COUNTERS = {"documents_read": "input_documents", "empty_documents": "input_empty_documents",
                   "instances": "input_instances", "invalid_utf8_lines": "input_invalid_utf8_lines",
                   "truncated_lines": "input_truncated_lines"}


def _input_metrics(stats) -> dict:
    return {name: float(stats[key]) for key, name in _INPUT_COUNTERS.items()}


def _warn_about_input(stats, reported, max_line_chars: int, nsp: bool, log):
    """A console line whenever more input lines were damaged or cut since the last one, and once if NSP cannot be
    formed as BERT defines it (`nsp`: the stream makes NSP pairs); returns what is reported."""
    invalid = stats["invalid_utf8_lines"] - reported["invalid_utf8_lines"]
    truncated = stats["truncated_lines"] - reported["truncated_lines"]
    if invalid:
        log(f"input: {stats['invalid_utf8_lines']} line(s) with invalid UTF-8 so far (the bad bytes replaced by "
             f"U+FFFD)")
    if truncated:
        log(f"input: {stats['truncated_lines']} line(s) longer than data.max_line_chars={max_line_chars} so far; "
             f"each was cut there and the rest of it is not trained on")
    nsp_said = reported["nsp_warning"]
    warning = None if nsp_said or not nsp else nsp_warning(stats)
    if warning:  # once per run
        log(f"warning: input: {warning}")
    return collections.Counter({**{k: stats[k] for k in ("invalid_utf8_lines", "truncated_lines")},
                                "nsp_warning": int(nsp_said or warning is not None)})


def _eval_batches(config: PretrainConfig, corpus_format: str, process_index: int, process_count: int,
                  log) -> list[dict]:
    """A fixed held-out set: static masks from a fixed seed, so evals at different steps are comparable.
    `corpus_format`: as asked for (not as data.input resolved it): the eval input's own is detected."""
    source = input_source.resolve(config.eval_data().replace(corpus_format=corpus_format), "data.eval_input", log)
    dataset = pipeline_lib.make_pretraining_dataset(source, config.train.batch_size, process_index, process_count)
    with tfrecord.damaged_records_named(source.files, "data.eval_input"):
        return [_numpy_batch(element) for element in dataset.take(config.train.eval_batches)]


class _Evaluator:
    """The held-out eval of the params at a step where one is due (every train.eval_every steps; none without eval
    batches): written, logged and kept in `results` (step, metrics) for the summary; its time charged to eval_s."""

    def __init__(self, eval_step, batches: list[dict] | None, every: int, mesh, nsp_loss: bool, writer, log,
                 account):
        self.eval_step, self.batches, self.every, self.mesh, self.nsp_loss = eval_step, batches, every, mesh, nsp_loss
        self.writer, self.log, self.account = writer, log, account
        self.results = []

    def __call__(self, step: int, params) -> None:
        if not self.batches or step % self.every:
            return
        with self.account.charged_to("eval_s"):
            values = {**_evaluate(self.eval_step, params, self.batches, self.mesh, self.nsp_loss),
                      "most_frequent_token_accuracy": most_frequent_token_accuracy(self.batches)}
            nsp = ""
            if "nsp_accuracy" in values:
                values["majority_nsp_accuracy"] = majority_nsp_accuracy(self.batches)
                nsp = f"; always predicting the most frequent NSP label: nsp_accuracy=" \
                      f"{values['majority_nsp_accuracy']:.4g}"
            self.writer.write(step, values, prefix="eval_")
            self.log(f"eval at step {step}: {metric_text(values, ('loss', 'mlm_accuracy', 'nsp_accuracy'))} (always "
                     f"predicting the most frequent masked token: "
                     f"mlm_accuracy={values['most_frequent_token_accuracy']:.4g}{nsp})")
            self.results.append((step, values))


def most_frequent_token_accuracy(batches: list[dict]) -> float:
    """The MLM accuracy of always predicting the eval set's most frequent masked token: the baseline a model
    must beat to have learned more than the token distribution."""
    ids = np.concatenate([b["masked_lm_ids"].ravel() for b in batches])
    weights = np.concatenate([b["masked_lm_weights"].ravel() for b in batches]) > 0
    counts = np.bincount(ids[weights])
    return float(counts.max() / max(weights.sum(), 1)) if counts.size else 0.0


def majority_nsp_accuracy(batches: list[dict]) -> float:
    """The NSP accuracy of always predicting the eval set's most frequent next-sentence label (the instances a row
    holds, where packed): what the NSP head must beat, as random next sentences are drawn with probability 0.5
    only on average, and fewer where a document ends."""
    labels = np.concatenate([b["next_sentence_labels"].ravel() for b in batches])
    weights = (np.concatenate([b["next_sentence_weights"].ravel() for b in batches]) > 0
               if "next_sentence_weights" in batches[0] else np.ones(labels.size, bool))
    counts = np.bincount(labels[weights].astype(np.int64))
    return float(counts.max() / max(weights.sum(), 1)) if counts.size else 0.0


def _evaluate(eval_fn, params, batches, mesh, nsp_loss: bool) -> dict:
    totals = None
    for batch in batches:
        sums = jax.device_get(eval_fn(params, sharding.global_batch(batch, mesh)))
        totals = sums if totals is None else {k: totals[k] + sums[k] for k in sums}
    return metrics_lib.to_python(train_step.summarize(totals, nsp_loss))

