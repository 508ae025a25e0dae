"""The pretraining job's config: one typed tree of the options the job's parts define, presets, `--set KEY=VALUE`.

`PretrainConfig` nests the config class of each part (model options derived from BertConfig, the data pipeline's
PretrainingDataConfig, the loop's TrainConfig, OptimizerConfig, CheckpointConfig, MeshConfig); no option is
restated here. A preset (configs/<name>.py with `get_config()`, big_vision style) edits the ConfigDict derived
from those fields; `--set` overrides parse to each field's declared type, so an unknown key or a value of the
wrong type is an error naming the key, and `validate` checks cross-field facts before anything is compiled.
"""
from __future__ import annotations

import ast
import dataclasses
import importlib.resources
import importlib.util
import json
import pathlib

import ml_collections

from bertjax import options
from bertjax.checkpoint import CheckpointConfig, ModelCheckpoint, ResumeRefused
from bertjax.data.data_config import PretrainingDataConfig
from bertjax.runtime.input_files import JSON_LIMIT, check_regular, read_json
from bertjax.model import family
from bertjax.model.family import ModelConfig
from bertjax.model.model_options import (
    ALL_PRESETS,
    PRESET_FIELDS,
    ModelOptions,
    build_model_config,
    is_modernbert_preset,
    options_of,
    preset_sizes,
)
from bertjax.options import ints, option, range_problems
from bertjax.pretraining import batch_schedule
from bertjax.pretraining.optim import OptimizerConfig
from bertjax.sharding import MeshConfig

# configs/ at the top of the repository, installed as the package bertjax.configs (see pyproject.toml).
CONFIGS_DIR = pathlib.Path(str(importlib.resources.files("bertjax.configs")))


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """The loop and the step (`train.*` keys; google-research/bert run_pretraining.py's defaults)."""

    steps: int = option(1_000_000, "optimizer updates in the whole run", valid=ints(1))
    batch_size: int = option(256, "global batch, in sequences", valid=ints(1))
    grad_accum_steps: int = option(1, "microbatches per step (each forward pass sees batch_size / this)",
                                   valid=ints(1))
    batch_size_warmup_tokens: int = option(0, "batch-size warmup: over the first this many tokens (rows x "
                                           "data.max_seq_length) the batch grows from batch_size_warmup_min to "
                                           "batch_size a microbatch at a time, each size for about the same steps, "
                                           "and the learning-rate schedule counts tokens (ModernBERT's; 0: none)",
                                           valid=ints(0, 10**15))  # a Python int: never a 32-bit counter
    batch_size_warmup_min: int = option(0, "the batch the warmup starts from, in sequences: a multiple of the "
                                        "microbatch (batch_size / grad_accum_steps); 0: one microbatch (ModernBERT's "
                                        "start; with grad_accum_steps=1 the batch is full from the start)",
                                        valid=ints(0))
    seed: int = option(0, "parameter initialisation and dropout", valid=ints(0))
    log_every: int = option(100, "steps between metric lines", valid=ints(1))
    eval_every: int = option(0, "steps between evaluations on data.eval_input (0: none)", valid=ints(0))
    eval_batches: int = option(10, "batches per evaluation", valid=ints(1))
    max_consecutive_nonfinite: int = option(10, "this many non-finite gradients in a row stop the job",
                                            valid=ints(1))
    nsp_loss: bool = option(True, "add the NSP loss (needs data.next_sentence_prediction)")
    span_boundary_objective: bool = option(False, "add SpanBERT's span boundary objective head and loss (needs "
                                           "data.masking_scheme=span)")
    wandb_project: str = option("", "also log metrics to this Weights & Biases project (needs wandb: the "
                                "[tracking] extra); WANDB_MODE=offline keeps them in WORKDIR/wandb")
    compilation_cache_dir: str = option("", "JAX's persistent compilation cache (local or gs://), so a restart "
                                        "reads the compiled step back: '' = $JAX_COMPILATION_CACHE_DIR, else "
                                        "~/.cache/bertjax/jax; 'off' = none")

    def __post_init__(self):
        problems = range_problems(self)
        if problems:
            raise ValueError("train: " + "; ".join(problems))
        if self.batch_size % self.grad_accum_steps:
            raise ValueError(f"train.batch_size={self.batch_size} is not divisible by "
                             f"train.grad_accum_steps={self.grad_accum_steps}")


@dataclasses.dataclass(frozen=True)
class PretrainConfig:
    """Every option of a pretraining job, grouped by the part that uses it."""

    model: ModelOptions = option(default_factory=ModelOptions)
    data: PretrainingDataConfig = option(default_factory=PretrainingDataConfig)
    train: TrainConfig = option(default_factory=TrainConfig)
    optimizer: OptimizerConfig = option(default_factory=OptimizerConfig)
    checkpoint: CheckpointConfig = option(default_factory=CheckpointConfig)
    mesh: MeshConfig = option(default_factory=MeshConfig)
    init_from: str = option("", "checkpoint to start from (phase 2 from phase 1; HF/TF too)")
    reset_schedule: bool = option(True, "with init_from: restart the step count and LR schedule (false: continue "
                                  "a pretraining step's whole state: step, schedule, optimizer)")
    init_optimizer_state: bool = option(False, "with init_from a pretraining step: also start from its optimizer "
                                        "state (Adam's moments and step count), the schedule restarting: a phase "
                                        "that continues the last one's optimizer, as ModernBERT's decay did")
    model_over_init: str = option("", "with --init: the model keys (after `model.`, comma-separated) this config "
                                  "sets over the checkpoint's model: a phase that changes the model, as "
                                  "ModernBERT's context extension raised modernbert.global_rope_theta")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def bert_config(self, vocab_size: int, special_ids: dict | None = None) -> ModelConfig:
        """The model config the job trains, BERT's or ModernBERT's by the preset (`vocab_size`: its vocabulary's,
        unless model.vocab_size is set; `special_ids`: the vocabulary's [PAD]/[CLS]/[SEP] ids, ModernBERT's)."""
        return build_model_config(self.model, vocab_size, special_ids)

    def batch_schedule(self) -> batch_schedule.BatchSchedule:
        """The rows of each step (the batch-size warmup's, then train.batch_size) and the tokens before it."""
        return batch_schedule.of(self.train, self.data.max_seq_length)

    def with_model_sizes(self, vocab_size: int = 0) -> "PretrainConfig":
        """This config with the model sizes left at 0 written out: the preset's sizes and, when `vocab_size` is
        given (the vocabulary's), the vocab size. The same job; what `config show` and WORKDIR/config.json show."""
        bert = self.bert_config(vocab_size or self.model.vocab_size or 1)
        sizes = {key: getattr(bert, key) for key in PRESET_FIELDS if key != "vocab_size" or vocab_size}
        return dataclasses.replace(self, model=dataclasses.replace(self.model, **sizes))

    def eval_data(self) -> PretrainingDataConfig:
        """The held-out stream: data.eval_input with static masks from its own seed, so evals compare."""
        return self.data.replace(input=self.data.eval_input, input_kind="auto", masking="static",
                                 seed=self.data.seed + 1)


def default_config() -> ml_collections.ConfigDict:
    """Every key of a pretraining job with its default (what presets start from)."""
    return options.to_config_dict(PretrainConfig())


def presets() -> dict[str, str]:
    """{preset name: the first line of its docstring} for every preset in configs/."""
    found = {}
    for path in sorted(CONFIGS_DIR.glob("*.py")):
        if path.stem.startswith("_"):
            continue
        doc = ast.get_docstring(ast.parse(path.read_text())) or ""
        found[path.stem.replace("_", "-")] = doc.strip().splitlines()[0] if doc.strip() else ""
    return found


def _config_values(name_or_path: str) -> ml_collections.ConfigDict:
    """The ConfigDict a --config names: a preset in configs/, a .py with get_config(), or a JSON config (a run's
    WORKDIR/config.json, or the run directory holding it)."""
    path = pathlib.Path(name_or_path)
    if path.is_dir() and (path / "config.json").exists():
        path = path / "config.json"
    if path.suffix == ".json":
        if not path.exists():
            raise ValueError(f"config file {path} does not exist")
        values = read_json(path, "a pretraining config (JSON)")
        try:  # keys added since the file was written take their defaults
            return options.to_config_dict(options.from_config_dict(PretrainConfig, values))
        except (TypeError, ValueError) as error:
            raise ValueError(f"{path}: {error}") from None
    if path.suffix != ".py":
        path = CONFIGS_DIR / (name_or_path.replace("-", "_") + ".py")
    if not path.exists():
        raise ValueError(f"unknown config {name_or_path!r}: not a preset ({sorted(presets())}, see bertjax config "
                         f"list), a .py file with get_config(), a config.json or a run directory")
    check_regular(path, "a config (.py with get_config())", JSON_LIMIT)
    spec = importlib.util.spec_from_file_location(f"bertjax_config_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
        if not callable(getattr(module, "get_config", None)):
            raise ValueError(f"{path}: defines no get_config() (a config .py returns its ConfigDict from it)")
        return module.get_config()
    except ValueError as error:
        if str(error).startswith(str(path)):
            raise
        raise ValueError(_user_error(path, error)) from None
    except Exception as error:  # noqa: BLE001 - the user's code: its error, not bertjax's traceback
        raise ValueError(_user_error(path, error)) from None


def _user_error(path: pathlib.Path, error: BaseException) -> str:
    """`FILE:LINE: TypeName: message` of an error in a config .py: the line in the user's file (the innermost
    frame there; a SyntaxError's own), not bertjax's frames around it."""
    line = getattr(error, "lineno", None) if isinstance(error, SyntaxError) else None
    if line is None:
        import traceback

        frames = [f for f in traceback.extract_tb(error.__traceback__) if pathlib.Path(f.filename) == path.absolute()
                  or f.filename == str(path)]
        line = frames[-1].lineno if frames else None
    message = (error.msg if isinstance(error, SyntaxError) else str(error)) or ""
    return f"{path}{f':{line}' if line else ''}: {type(error).__name__}" + (f": {message}" if message else "") + \
        " (in the config file)"


# `--config init`: the --init checkpoint's model (architecture and vocabulary), the default recipe for the rest,
# its warmup as BERT's share (10k of 1M steps) so that a shorter train.steps needs no new warmup.
INIT_CONFIG = "init"
_INIT_WARMUP_RATIO = 0.01
# What `--config init` takes from an --init checkpoint a bertjax pretraining run saved: the shape of its batch (the
# default recipe's 256 x 128 can be far more than the run was sized for: bert-tiny's is 32 x 128).
INIT_RUN_KEYS = ("train.batch_size", "train.grad_accum_steps", "data.max_seq_length", "data.max_predictions_per_seq")


def init_run_settings(job_config: dict | None) -> dict:
    """{key: value} of INIT_RUN_KEYS in a checkpoint's saved pretraining job config ({} for none, or another job's)."""
    flat = _flat(job_config or {})
    return {key: flat[key] for key in INIT_RUN_KEYS if key in flat}


def _take_init_model(values: ml_collections.ConfigDict, init: ModelCheckpoint, name_or_path: str) -> None:
    """`values` (a preset's, or a file's) with the model of the --init checkpoint `init`: its sizes and every setting
    that shapes what its weights compute (activations, RoPE thetas, window, norms, biases, tied decoder), so that
    the run continues the model it loads; the recipe's dropout and fresh-weight init stay, and the keys it names in
    `model_over_init` (a phase that changes the model). A recipe of the other family is refused."""
    checkpoint_family = "ModernBERT" if family.is_modernbert(init.config) else "BERT"
    recipe_family = "ModernBERT" if is_modernbert_preset(values.model.preset) else "BERT"
    if checkpoint_family != recipe_family:
        raise ValueError(f"the --init checkpoint is a {checkpoint_family}, --config {name_or_path} a {recipe_family} "
                         f"recipe (model.preset={values.model.preset}): use a {checkpoint_family} preset, or "
                         f"--config init (the checkpoint's model with the default recipe)")
    kept = _model_keys(values.model_over_init)
    for key, value in options_of(init.config).items():
        if key != "preset" and "dropout" not in key and "initializer" not in key and key not in kept:
            options.apply_override(values, PretrainConfig, f"model.{key}={value}")


def _model_keys(text: str) -> tuple[str, ...]:
    """The keys of a `model_over_init` value, each checked to be a `model.*` key."""
    keys = tuple(key.strip() for key in text.split(",") if key.strip())
    known = options.dotted_keys(ModelOptions)
    for key in keys:
        if key not in known:
            raise ValueError(f"model_over_init: {options.unknown_key(ModelOptions, key, 'model.')}")
    return keys


def recipe_over_init(config: PretrainConfig, init: ModelCheckpoint) -> list[str]:
    """`model.KEY=VALUE (the --init checkpoint's: OLD)` for each key of `model_over_init` where the run's model
    differs from the checkpoint's: what the phase changes (said when it starts)."""
    theirs, ours = options_of(init.config), options_of(config.bert_config(init.config.vocab_size))
    return [f"model.{key}={ours[key]} (the --init checkpoint's: {theirs[key]})"
            for key in _model_keys(config.model_over_init) if key in theirs and ours.get(key) != theirs[key]]


def model_changes(before: PretrainConfig, after: PretrainConfig) -> list[str]:
    """`model.KEY=VALUE (was OLD)` for each key of the model two configs of a job build that differs (the preset's
    sizes and window written out; the vocabulary's size, which the run reads, left out)."""
    old, new = (options_of(config.bert_config(1)) for config in (before, after))
    return [f"model.{key}={new[key]} (was {old[key]})" for key in sorted(new)
            if key not in ("preset", "vocab_size") and new[key] != old.get(key)]


def load_config(name_or_path: str, overrides: list[str] = (), require_data: bool = True,
                init: ModelCheckpoint | None = None, init_vocab_file: str = "",
                init_run: dict | None = None) -> PretrainConfig:
    """A preset (name in configs/, a .py with get_config(), a run's config.json, or `init`: the model of the --init
    checkpoint `init`, and the batch of the run that saved it, `init_run` as init_run_settings gives), then
    KEY=VALUE overrides, validated (`require_data=False`: a config that is only compiled needs no input files).
    With an init checkpoint, the model is the checkpoint's under any recipe (_take_init_model; `--set` still wins),
    and an empty data.vocab becomes `init_vocab_file` (its vocab or tokenizer.json). An override of one of
    optimizer.warmup_steps / warmup_ratio alone wins over the other's preset value (the key set is the one used)."""
    if name_or_path == INIT_CONFIG:
        if init is None:
            raise ValueError("--config init takes the model of the --init checkpoint: give --init CHECKPOINT")
        values = default_config()
        values.lock()
        for key, value in options_of(init.config).items():
            options.apply_override(values, PretrainConfig, f"model.{key}={value}")
        if is_modernbert_preset(values.model.preset):  # its objective: MLM alone
            options.apply_override(values, PretrainConfig, "train.nsp_loss=false")
        for key, value in {"optimizer.warmup_ratio": _INIT_WARMUP_RATIO, **(init_run or {})}.items():
            options.apply_override(values, PretrainConfig, f"{key}={value}")
    else:
        values = _config_values(name_or_path)
        values.lock()
        if init is not None:
            _take_init_model(values, init, name_or_path)
    for override in overrides:
        options.apply_override(values, PretrainConfig, override)
    overridden = {override.split("=", 1)[0].strip() for override in overrides}
    if "optimizer.warmup_steps" in overridden and "optimizer.warmup_ratio" not in overridden:
        values.optimizer.warmup_ratio = 0.0  # a ratio would replace the steps asked for
    if {"optimizer.warmup_steps", "optimizer.warmup_ratio"} <= overridden and values.optimizer.warmup_ratio:
        raise ValueError(f"optimizer.warmup_steps={values.optimizer.warmup_steps} and optimizer.warmup_ratio="
                         f"{values.optimizer.warmup_ratio:g} are both set (--set): a ratio replaces the steps; set "
                         "one of them")
    try:
        config = options.from_config_dict(PretrainConfig, values)
    except (TypeError, ValueError) as error:
        raise ValueError(f"invalid pretraining config: {error}") from None
    if init is not None and not config.data.vocab and init_vocab_file:
        config = dataclasses.replace(config, data=config.data.replace(vocab=init_vocab_file,
                                                                      lower_case=init.lower_case))
    validate(config, require_data=require_data)
    return config


# Resuming a run with a changed config (the step directory holds the config it was saved with):
# - these keys define the state or the stream's shapes: a change cannot continue the run;
_FIXED_ON_RESUME = ("model.", "data.max_seq_length", "data.max_predictions_per_seq", "data.packing",
                    "data.max_instances_per_row", "data.next_sentence_prediction", "data.masking_scheme",
                    "train.span_boundary_objective")
# - these only change how the run is watched, saved or laid out: free;
_FREE_ON_RESUME = ("train.log_every", "train.eval_every", "train.eval_batches", "train.max_consecutive_nonfinite",
                   "checkpoint.", "mesh.", "data.prefetch_batches", "data.eval_input", "init_from",
                   "reset_schedule", "init_optimizer_state", "train.compilation_cache_dir", "train.wandb_project")
# - the rest (the schedule, the optimizer, the batch, the stream) change the run's meaning mid-way: refused
#   unless asked for (`--allow-config-change`).


def _flat(tree: dict, prefix: str = "") -> dict:
    flat = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            flat.update(_flat(value, f"{prefix}{key}."))
        else:
            flat[prefix + key] = value
    return flat


def _sizes_written_out(flat: dict, other: dict) -> dict:
    """`flat` with model sizes left at 0 replaced by the preset's, so that a config that writes them out (a run's
    config.json given back as --config) equals one that does not; a vocab size of 0 on either side (the
    vocabulary's size) equals any."""
    flat = dict(flat)
    preset = flat.get("model.preset")
    if preset in ALL_PRESETS:
        sizes = preset_sizes(preset)
        for key in PRESET_FIELDS:
            if flat.get(f"model.{key}") == 0:
                flat[f"model.{key}"] = sizes[key] if key != "vocab_size" else other.get(f"model.{key}")
    return flat


def check_resume_config(saved: dict, current: dict, *, allow_changes: bool, where: str) -> list[str]:
    """The keys whose value differs between the config a checkpoint was saved with and this run's.

    Raises ResumeRefused (a ValueError) naming them if any cannot change on resume, or if any changes the run's
    meaning and `allow_changes` is false; returns the changed keys otherwise (free ones included).
    """
    # As JSON stores them (tuples become lists); a key the saved config lacks is an option added since, whose
    # default reproduces the older behaviour: not a change.
    old, new = _flat(saved), _flat(json.loads(json.dumps(current)))
    old, new = _sizes_written_out(old, new), _sizes_written_out(new, old)
    changed = sorted(k for k in old.keys() & new.keys() if old[k] != new[k])
    show = lambda keys: ", ".join(f"{k}: {old.get(k)!r} -> {new.get(k)!r}" for k in keys)
    fixed = [k for k in changed if k.startswith(_FIXED_ON_RESUME)]
    if fixed:
        raise ResumeRefused(f"{where} was saved with another model or data shape ({show(fixed)}); these cannot change "
                            f"when resuming: use a new --workdir (with --init to start from its weights)")
    meaningful = [k for k in changed if not k.startswith(_FREE_ON_RESUME)]
    if meaningful and not allow_changes:
        raise ResumeRefused(f"{where} was saved with a different config ({show(meaningful)}); resuming would change "
                            f"the run mid-way (e.g. rescale the learning-rate schedule): pass --allow-config-change "
                            f"to resume with it anyway, or use a new --workdir")
    return changed


def validate(config: PretrainConfig, num_devices: int | None = None, require_data: bool = True) -> None:
    """Cross-field checks, run before any compile. With `num_devices`, also the mesh and batch split;
    `require_data=False` for a config that is only compiled, never run (no input needed)."""
    problems = []
    if config.model.preset not in ALL_PRESETS:
        problems.append(f"model.preset={config.model.preset!r}; expected one of {', '.join(ALL_PRESETS)}")
    try:
        _model_keys(config.model_over_init)
    except ValueError as error:
        problems.append(str(error))
    else:
        try:  # the model's own checks (ranges, head split), before a vocabulary is read
            config.bert_config(config.model.vocab_size or 30522)
        except ValueError as error:
            problems.append(f"model: {error}")
    train = config.train
    microbatch = train.batch_size // train.grad_accum_steps
    if train.batch_size_warmup_min % microbatch or train.batch_size_warmup_min > train.batch_size:
        problems.append(f"train.batch_size_warmup_min={train.batch_size_warmup_min} must be a multiple of the "
                        f"microbatch (train.batch_size / grad_accum_steps = {microbatch}) and at most "
                        f"train.batch_size={train.batch_size} (0: one microbatch)")
    else:
        schedule_steps = config.batch_schedule().full_steps_before(train.steps)
        if config.optimizer.warmup_for(schedule_steps) > schedule_steps:
            counted = (f" (with the batch-size warmup the schedule counts tokens: train.steps={train.steps} are "
                       f"{schedule_steps:,.1f} full steps' worth)" if schedule_steps != train.steps else "")
            problems.append(f"optimizer.warmup_steps={config.optimizer.warmup_steps} must be in [0, train.steps="
                            f"{train.steps}]{counted} (or set optimizer.warmup_ratio, e.g. 0.1 of the steps)")
    max_positions = config.model.max_position_embeddings
    if config.data.max_seq_length > max_positions:
        problems.append(f"data.max_seq_length={config.data.max_seq_length} exceeds "
                        f"model.max_position_embeddings={max_positions}")
    if config.train.nsp_loss and not config.data.next_sentence_prediction:
        problems.append("train.nsp_loss=true needs data.next_sentence_prediction=true")
    if is_modernbert_preset(config.model.preset):
        for key in ("nsp_loss", "span_boundary_objective"):
            if getattr(config.train, key):
                problems.append(f"train.{key}=true: model.preset={config.model.preset} (ModernBERT) has no such "
                                "head; its objective is MLM alone (set train.nsp_loss=false)")
    if config.train.span_boundary_objective and config.data.masking_scheme != "span":
        problems.append(f"train.span_boundary_objective=true needs data.masking_scheme=span (the SBO predicts the "
                        f"tokens of masked spans from their boundaries), got {config.data.masking_scheme!r}")
    if config.train.eval_every and not config.data.eval_input:
        problems.append("train.eval_every is set but data.eval_input is empty")
    if require_data:
        try:
            config.data.require_input()
        except ValueError as error:
            problems.append(str(error))
    if num_devices is not None and not problems:
        try:
            data, fsdp, _ = config.mesh.shape(num_devices)
        except ValueError as error:
            problems.append(f"mesh: {error}")
        else:
            micro = config.train.batch_size // config.train.grad_accum_steps
            if micro % (data * fsdp):
                problems.append(f"train.batch_size={config.train.batch_size} / grad_accum_steps="
                                f"{config.train.grad_accum_steps} = {micro} sequences per microbatch is not "
                                f"divisible by the data-parallel size {data * fsdp} (mesh data={data} x "
                                f"fsdp={fsdp})")
    if problems:
        raise ValueError("invalid pretraining config: " + "; ".join(problems))
