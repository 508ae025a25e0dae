"""bertjax's checkpoint format: one Orbax composite checkpoint directory per model.

Items:
- `params`: the float32 param tree (Orbax StandardSave: sharded tensorstore arrays, restorable onto any mesh);
- `model_config`: the model's config as JSON (BertConfig's; ModernBertConfig's with its `model_type`);
- `vocab`: {"tokens": [...], "lower_case": bool} and, for a model with an HF tokenizer.json (ModernBERT's BPE),
  "tokenizer": {"json": its text, "special": its special tokens}, so a checkpoint is self-contained;
- `head` (fine-tune jobs only): {"architecture": the HF class, "id2label": {"0": label, ...}}, so that
  `bertjax export` writes the job's own class and labels later (multiple choice is not inferable from tensors).
The pretraining trainer writes these same items (plus optimizer and data state) in each step directory, so every
command that takes a checkpoint also takes a training step directory.

A half-written checkpoint is never listed as one: on a local disk Orbax writes to a temporary name and renames
on completion; on gs:// (no atomic rename) it writes in place and finishes with a `commit_success.txt` object,
and a step directory without it is not finalised (not listed, not restored, removed by the next save of that step).
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import sys
import traceback as tb_lib
import uuid

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath
from flax import traverse_util
from jax.experimental import multihost_utils

from bertjax.runtime import workdir_paths
from bertjax.runtime.errors import OutputWriteError, cannot_write, first_line, is_permission_error
from bertjax.runtime.input_files import Unreadable, check_readable_tree, read_text
from bertjax.model import bert as model_lib
from bertjax.model import family, shapes
from bertjax.model.family import ModelConfig
from bertjax.options import ints, option, range_problems

# Written into a pretraining workdir by process 0 once the run's last checkpoint is finalised: the job is done
# (what the babysitter looks for before running the job again).
COMPLETION_MARKER = "COMPLETED"

log = logging.getLogger(__name__)

PARAMS, MODEL_CONFIG, VOCAB = "params", "model_config", "vocab"
OPT_STATE, TRAIN_META, JOB_CONFIG, HEAD = "opt_state", "train_meta", "job_config", "head"
# A fine-tune's train state also holds the best evaluation's params and its record (--metric-for-best).
BEST_PARAMS, BEST = "best_params", "best"
# Items that are trees of arrays (sharded tensorstore arrays, restorable onto any mesh) and items that are JSON.
ARRAY_ITEMS = (PARAMS, OPT_STATE, TRAIN_META, BEST_PARAMS)
JSON_ITEMS = (MODEL_CONFIG, VOCAB, JOB_CONFIG, HEAD, BEST)
# The fields of a train state that are saved as the `train_meta` item (the rest are params and opt_state).
TRAIN_META_FIELDS = ("step", "rng", "nonfinite_total", "nonfinite_consecutive")


def item_handlers() -> dict[str, ocp.CheckpointHandler]:
    """The Orbax handler of every item a bertjax checkpoint directory may hold. Named handlers let Orbax read an
    item's metadata (shapes) without restoring it, and a trainer step directory reads as a model checkpoint."""
    return {**{name: ocp.StandardCheckpointHandler() for name in ARRAY_ITEMS},
            **{name: ocp.JsonCheckpointHandler() for name in JSON_ITEMS}}


def _save_args(items: dict) -> ocp.args.Composite:
    """{item: tree of arrays, or JSON} as Orbax saves it (the kind of each item is fixed by its name)."""
    return ocp.args.Composite(**{name: (ocp.args.JsonSave if name in JSON_ITEMS else ocp.args.StandardSave)(value)
                                 for name, value in items.items()})


def _restore_args(items: dict) -> ocp.args.Composite:
    """{array item: its abstract tree (shapes, dtypes, shardings), JSON item: None} as Orbax restores it."""
    return ocp.args.Composite(**{name: ocp.args.JsonRestore() if name in JSON_ITEMS else
                                 ocp.args.StandardRestore(target) for name, target in items.items()})


def _model_items(params, config: ModelConfig, vocab: list[str], lower_case: bool,
                 tokenizer: dict | None = None) -> dict:
    vocab_item = {"tokens": list(vocab), "lower_case": bool(lower_case)}
    if tokenizer is not None:
        vocab_item["tokenizer"] = tokenizer
    return {PARAMS: params, MODEL_CONFIG: config.to_dict(), VOCAB: vocab_item}


def _train_state_items(abstract_state) -> dict:
    meta = {name: getattr(abstract_state, name) for name in TRAIN_META_FIELDS}
    return {PARAMS: abstract_state.params, OPT_STATE: abstract_state.opt_state, TRAIN_META: meta}


def _train_state_from(restored, abstract_state):
    return abstract_state.replace(params=restored[PARAMS], opt_state=restored[OPT_STATE], **restored[TRAIN_META])


@dataclasses.dataclass
class ModelCheckpoint:
    params: dict
    config: ModelConfig
    vocab: list[str]
    lower_case: bool
    head: dict | None = None  # a fine-tuned head's {"architecture", "id2label"}, where known
    tokenizer: dict | None = None  # an HF tokenizer.json's spec (data/json_tokenizer.py); None: WordPiece on `vocab`


def read_vocab_file(path: str) -> list[str]:
    """Tokens of a vocab.txt (one per line, id = line number)."""
    path = epath.Path(path)
    if not path.exists():
        raise FileNotFoundError(f"vocab file {path} does not exist")
    tokens = read_text(path, "a vocabulary (one token a line)").splitlines()
    if not tokens:
        raise ValueError(f"vocab file {path} is empty")
    return tokens


def write_vocab_file(tokens: list[str], path: str) -> None:
    epath.Path(path).write_text("".join(t + "\n" for t in tokens), encoding="utf-8")


def _check_vocab(config: ModelConfig, tokens: list[str], origin: str, tokenizer: dict | None = None) -> None:
    if tokenizer is not None and len(tokens) <= config.vocab_size:
        return  # a tokenizer.json's ids need rows; the table may have more (HF pads it, ModernBERT to 50,368)
    if len(tokens) != config.vocab_size:
        raise ValueError(f"vocab mismatch in {origin}: the vocabulary has {len(tokens)} tokens but "
                         f"config.vocab_size is {config.vocab_size}")


def orbax_path(directory) -> epath.Path:
    """`directory` as Orbax wants it: absolute. A gs:// path already is, and epath's absolute() would turn it into
    a local one (./gs:/BUCKET/...)."""
    return epath.Path(directory) if "://" in str(directory) else epath.Path(directory).absolute()


def save_model(directory: str, params, config: ModelConfig, vocab: list[str], lower_case: bool = True,
               head: dict | None = None, tokenizer: dict | None = None) -> None:
    """Writes params + config + vocab (+ a fine-tuned `head`'s description, a tokenizer.json's spec) as one
    composite checkpoint at `directory`."""
    _check_vocab(config, vocab, directory, tokenizer)
    items = _model_items(params, config, vocab, lower_case, tokenizer)
    if head is not None:
        items[HEAD] = head
    quiet_orbax_failures()
    with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as checkpointer:
        checkpointer.save(orbax_path(directory), args=_save_args(items))


def is_model_checkpoint(directory: str) -> bool:
    path = epath.Path(directory)
    return path.is_dir() and (path / MODEL_CONFIG).exists() and (path / PARAMS).exists()


def load_config(directory: str) -> ModelConfig:
    """The model config of a checkpoint, without reading its tensors."""
    _require_checkpoint(directory)
    with _reading(directory), ocp.Checkpointer(ocp.CompositeCheckpointHandler(**item_handlers())) as checkpointer:
        restored = checkpointer.restore(orbax_path(directory),
                                        args=ocp.args.Composite(**{MODEL_CONFIG: ocp.args.JsonRestore()}))
    return family.config_from_dict(restored[MODEL_CONFIG], source=f"{directory}/{MODEL_CONFIG}")


def load_description(directory: str) -> ModelCheckpoint:
    """A checkpoint's config, vocab, lower-casing and fine-tuned head's description, without reading its tensors
    (`params` is None). The head too: `predict` reads its input by it before the model loads (a span model's
    question and context columns; a SQuAD run's checkpoint was read as a classifier's text column)."""
    _require_checkpoint(directory)
    path = orbax_path(directory)
    with _reading(directory), ocp.Checkpointer(ocp.CompositeCheckpointHandler(**item_handlers())) as checkpointer:
        json_items = [MODEL_CONFIG, VOCAB] + ([HEAD] if (path / HEAD).exists() else [])
        restored = checkpointer.restore(path, args=ocp.args.Composite(
            **{name: ocp.args.JsonRestore() for name in json_items}))
    config = family.config_from_dict(restored[MODEL_CONFIG], source=f"{directory}/{MODEL_CONFIG}")
    vocab = restored[VOCAB]
    return ModelCheckpoint(None, config.replace(scan_layers=False), vocab["tokens"], vocab["lower_case"],
                           restored.get(HEAD), tokenizer=vocab.get("tokenizer"))


def load_job_config(directory: str) -> dict | None:
    """The job config a training step saved beside its model (None for a model checkpoint without one)."""
    path = orbax_path(directory)
    if not is_model_checkpoint(directory) or not (path / JOB_CONFIG).exists():
        return None
    with _reading(directory), ocp.Checkpointer(ocp.CompositeCheckpointHandler(**item_handlers())) as checkpointer:
        return checkpointer.restore(path, args=ocp.args.Composite(**{JOB_CONFIG: ocp.args.JsonRestore()}))[JOB_CONFIG]


def load_model(directory: str, abstract_params=None) -> ModelCheckpoint:
    """Reads a checkpoint written by `save_model` (or a trainer step directory).

    `abstract_params` (a tree of jax.ShapeDtypeStruct with shardings, in the checkpoint's own layer layout)
    restores straight onto a mesh; without it, arrays land on the default device. The params are handed out per
    layer (`layer_0`..) whatever layout the checkpoint holds, with `config.scan_layers` False to match, so every
    reader (export, convert, embed, fine-tuning, `--init`) sees one layout.
    """
    _require_checkpoint(directory)
    path = orbax_path(directory)
    with _reading(directory), ocp.Checkpointer(ocp.CompositeCheckpointHandler(**item_handlers())) as checkpointer:
        json_items = [MODEL_CONFIG, VOCAB] + ([HEAD] if (path / HEAD).exists() else [])
        metadata_only = checkpointer.restore(path, args=ocp.args.Composite(
            **{name: ocp.args.JsonRestore() for name in json_items}))
        tree = _stored_params(checkpointer, path)
    config = family.config_from_dict(metadata_only[MODEL_CONFIG], source=f"{directory}/{MODEL_CONFIG}")
    check_stored_config(tree, config, directory)  # before reading a tensor
    if abstract_params is None:
        # Restore as host numpy arrays on one device, whatever mesh wrote them.
        abstract_params = jax.tree_util.tree_map(
            lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype,
                                           sharding=jax.sharding.SingleDeviceSharding(jax.devices()[0])), tree)
    with _reading(directory), ocp.Checkpointer(ocp.CompositeCheckpointHandler(**item_handlers())) as checkpointer:
        restored = checkpointer.restore(path, args=ocp.args.Composite(
            **{PARAMS: ocp.args.StandardRestore(abstract_params)}))
    vocab = metadata_only[VOCAB]
    _check_vocab(config, vocab["tokens"], directory, vocab.get("tokenizer"))
    params = model_lib.with_layout(model_lib.merge_head_axes(restored[PARAMS]), config, stacked=False)
    return ModelCheckpoint(params, config.replace(scan_layers=False), vocab["tokens"], vocab["lower_case"],
                           metadata_only.get(HEAD), vocab.get("tokenizer"))


@contextlib.contextmanager
def _reading(directory):
    """Any error reading the checkpoint at `directory` as one ValueError line naming it."""
    try:
        yield
    except Unreadable:
        raise
    except Exception as error:  # noqa: BLE001 - Orbax/TensorStore raise many types for a damaged directory
        if is_permission_error(error):
            raise Unreadable(f"{directory}: cannot read the checkpoint: permission denied ({first_line(error)})") \
                from None
        raise ValueError(f"{directory}: cannot read the checkpoint ({first_line(error)}); it is damaged or "
                         f"incomplete") from None


def _stored_params(checkpointer, path):
    """The params' Orbax metadata tree (shapes, dtypes) of the checkpoint at `path`, nothing restored."""
    tree = checkpointer.metadata(path).item_metadata[PARAMS]
    return getattr(tree, "tree", tree)


def check_stored_config(metadata, config: ModelConfig, directory) -> None:
    """Refuses a checkpoint whose `model_config` disagrees with its params' stored shapes (`metadata`: the params'
    Orbax metadata tree), naming the field and the tensor (model.shapes)."""
    leaves = jax.tree_util.tree_flatten_with_path(metadata, is_leaf=lambda x: hasattr(x, "shape"))[0]
    stored = {tuple(str(k.key) for k in path): tuple(leaf.shape) for path, leaf in leaves}
    try:
        shapes.check_stored_shapes(stored, config, MODEL_CONFIG)
    except ValueError as error:
        raise ValueError(f"{directory}: {error}") from None


def _has_split_head_kernels(metadata) -> bool:
    leaves = jax.tree_util.tree_leaves_with_path(metadata, is_leaf=lambda x: hasattr(x, "shape"))
    return any(model_lib.is_split_head_kernel(path, len(leaf.shape)) for path, leaf in leaves)


def _abstract_layout(abstract, config: ModelConfig, stacked: bool):
    """Abstract arrays (with NamedShardings) in the other layer layout: a stacked leaf's layer axis is replicated."""
    def sharding(leaf, spec):
        return jax.sharding.NamedSharding(leaf.sharding.mesh, jax.sharding.PartitionSpec(*spec))

    def stack(leaves):
        leaf = leaves[0]
        return jax.ShapeDtypeStruct((len(leaves),) + leaf.shape, leaf.dtype,
                                    sharding=sharding(leaf, (None, *leaf.sharding.spec)))

    def take(leaf, _):
        return jax.ShapeDtypeStruct(leaf.shape[1:], leaf.dtype, sharding=sharding(leaf, tuple(leaf.sharding.spec)[1:]))

    return model_lib.with_layout(abstract, config, stacked, stack=stack, take=take)


def _abstract_split_heads(abstract, config: ModelConfig):
    """Abstract arrays with the attention kernels in the split-head shapes of an older checkpoint (replicated)."""
    def split(path, leaf):
        shape = model_lib.split_head_shape(path, leaf.shape, config)
        if shape == tuple(leaf.shape):
            return leaf
        replicated = jax.sharding.NamedSharding(leaf.sharding.mesh, jax.sharding.PartitionSpec())
        return jax.ShapeDtypeStruct(shape, leaf.dtype, sharding=replicated)
    return jax.tree_util.tree_map_with_path(split, abstract)


def restore_train_state(step_dir: str, abstract_state):
    """Params, optimizer state and train meta of a trainer step directory, laid out as `abstract_state` (any
    mesh: Orbax reshards on restore; either layer layout: a step saved per layer continues stacked, and back; a
    step of an older bertjax with split-head attention kernels continues with 2-D ones).
    For a resume and for continuing another run's schedule (`--init` a step directory)."""
    path = orbax_path(step_dir)
    check_readable_tree(step_dir, "in the checkpoint")
    with ocp.Checkpointer(ocp.CompositeCheckpointHandler(**item_handlers())) as checkpointer:
        metadata = _stored_params(checkpointer, path)
        stored, wanted = model_lib.is_stacked(metadata), model_lib.is_stacked(abstract_state.params)
        split_heads = _has_split_head_kernels(metadata)
        config = load_config(step_dir)
        check_stored_config(metadata, config, step_dir)
        target = abstract_state if stored == wanted else _abstract_layout(abstract_state, config, stored)
        if split_heads:
            target = _abstract_split_heads(target, config)
        restored = checkpointer.restore(path, args=_restore_args(_train_state_items(target)))
    state = _train_state_from(restored, target)
    if stored != wanted or split_heads:  # converted on the devices, into the wanted shardings
        shardings = jax.tree_util.tree_map(lambda leaf: leaf.sharding, abstract_state)
        state = jax.jit(lambda s: model_lib.with_layout(model_lib.merge_head_axes(s), config, wanted),
                        out_shardings=shardings)(state)
    return state


def merge_params(initialised: dict, loaded: dict, *, source: str, encoder_only: bool, note=None) -> dict:
    """`initialised` (a fresh model's params) with the tensors `loaded` (a checkpoint's) holds at the same paths.

    Every encoder tensor (embeddings and layers) must be in the checkpoint, with the model's shape; a missing
    pooler or head stays initialised. Strict (`encoder_only=False`: pretraining from a checkpoint): a checkpoint
    tensor the model lacks, or of another shape, is an error. Encoder-only (fine-tuning a new head): tensors the
    model lacks are ignored, and a head of another shape (another label count) stays initialised. Each tensor left
    initialised is told to `note` (default: the log), as a line.
    """
    note = note or log.info
    if model_lib.is_stacked(initialised):  # a scanned model (`load_model` hands out the per-layer layout)
        loaded = model_lib.stack_layers(loaded, stack=np.stack)
    flat = traverse_util.flatten_dict(initialised)
    flat_loaded = traverse_util.flatten_dict(loaded)
    merged = {}
    for path, value in flat.items():
        name = "/".join(path)
        is_encoder = path[0] == "bert" and path[1] != "pooler"
        if path not in flat_loaded:
            if is_encoder:
                raise ValueError(f"{source}: encoder tensor {name} is missing from the checkpoint")
            note(f"{source}: {name} is not in the checkpoint; freshly initialised")
            merged[path] = value
            continue
        tensor = np.asarray(flat_loaded[path])
        if tensor.shape != value.shape:
            if is_encoder or not encoder_only:
                raise ValueError(f"{source}: tensor {name} has shape {tensor.shape}, the model needs {value.shape}")
            note(f"{source}: head {name} has shape {tensor.shape}, not {value.shape}; freshly initialised")
            merged[path] = value
            continue
        merged[path] = tensor.astype(value.dtype)
    extra = sorted("/".join(path) for path in set(flat_loaded) - set(flat))
    if extra and not encoder_only:
        raise ValueError(f"{source}: tensors not in the model: {extra}")
    return traverse_util.unflatten_dict(merged)


def _require_checkpoint(directory: str) -> None:
    if not is_model_checkpoint(directory):
        raise FileNotFoundError(f"{directory} is not a bertjax checkpoint (expected the Orbax items "
                                f"{PARAMS}/ and {MODEL_CONFIG}/ in it)")
    check_readable_tree(directory, "in the checkpoint")


# ---- training checkpoints ------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
    """When a training job saves and what it keeps (a pretraining job's `checkpoint.*` keys)."""

    every: int = option(1000, "steps between saves (and always at the end and on preemption)", valid=ints(1))
    keep: int = option(3, "most recent checkpoints kept (0 would delete every one, the last included)",
                        valid=ints(1))
    keep_every: int = option(0, "also keep every N-th step forever (0: none)", valid=ints(0))
    async_save: bool = option(True, "write in the background while training goes on")

    def __post_init__(self):
        problems = range_problems(self)
        if problems:
            raise ValueError("checkpoint: " + "; ".join(problems))


class CheckpointWriteError(OutputWriteError):
    """A checkpoint could not be written (a full or read-only disk, ...): the job stops; older steps stay good."""

    # The command line exits at once after its one-line message: Orbax's failed background saves would otherwise
    # print a hundred "Event loop is closed" tracebacks at interpreter shutdown.
    exit_now = True


def _write_error(directory, error: Exception) -> CheckpointWriteError:
    return CheckpointWriteError(cannot_write(f"checkpoint to {directory}", error))


def check_writable(directory: str) -> None:
    """Creates `directory` and writes (then removes) a small file in it; CheckpointWriteError if it cannot. The
    file's name is this call's own: two jobs probing one directory at once must not remove each other's."""
    probe = epath.Path(directory) / f".bertjax-write-test-{jax.process_index()}-{uuid.uuid4().hex}"
    try:
        epath.Path(directory).mkdir(parents=True, exist_ok=True)
        probe.write_text("ok")
        probe.unlink()
    except OSError as error:
        raise _write_error(directory, error) from None


def complete_steps(run_dir: str) -> list[int]:
    """The finalised steps (oldest first) under a run directory (WORKDIR or WORKDIR/checkpoints); [] if none."""
    path = epath.Path(run_dir)
    if (path / "checkpoints").is_dir():
        path = path / "checkpoints"
    if not path.is_dir():
        return []
    return sorted(ocp.utils.checkpoint_steps(path))


def resolve_checkpoint(path: str) -> str:
    """A run directory (WORKDIR, or WORKDIR/checkpoints) stands for its newest complete step; any other path
    (a step, a model checkpoint, an HF directory, a TF prefix) is returned unchanged."""
    root = epath.Path(path)
    if is_model_checkpoint(path) or not root.is_dir():
        return path
    steps = complete_steps(path)
    if not steps:
        return path
    checkpoints = root / "checkpoints" if (root / "checkpoints").is_dir() else root
    return str(checkpoints / str(steps[-1]))


class ResumeRefused(ValueError):
    """The job's config cannot resume from a saved step (a refused config change): the config, not the step, is at
    fault, so `StepCheckpointer.restore_newest` lets it through instead of setting the step aside."""


def _drop_late_read_completions() -> None:
    """The completions of a failed restore's other reads (or a failed save's writes) are not printed as tracebacks.

    Orbax runs a restore on an event loop of its own and closes it when the first read fails; TensorStore then
    completes the reads still in flight by `loop.call_soon_threadsafe` on that closed loop and reports each
    RuntimeError('Event loop is closed') as unraisable: a dozen tracebacks after the one line saying which step was
    set aside. Only that error, raised there, is dropped (from now on in this process)."""
    if getattr(sys.unraisablehook, "drops_late_read_completions", False):
        return
    previous = sys.unraisablehook

    def hook(unraisable):
        frames = [frame.f_code.co_name for frame, _ in tb_lib.walk_tb(unraisable.exc_traceback)]
        if (unraisable.exc_type is RuntimeError and str(unraisable.exc_value) == "Event loop is closed"
                and "call_soon_threadsafe" in frames):
            return
        previous(unraisable)

    hook.drops_late_read_completions = True
    sys.unraisablehook = hook


def _orbax_failure_traceback(record: logging.LogRecord) -> bool:
    """False for Orbax's own ERROR record of a failed save or restore (a traceback on stderr, from its threads): the
    exception reaches the caller, which ends the job with it in one line (CheckpointWriteError) or sets the step
    aside; anything else Orbax logs passes."""
    return not (record.levelno >= logging.ERROR and record.exc_info and "orbax" in record.pathname)


def _unretrieved_read_failure(record: logging.LogRecord) -> bool:
    """False for asyncio's 'Task exception was never retrieved' of a TensorStore read (its errors carry their
    tensorstore_spec): when a restore's first read fails, Orbax abandons the others, and those that fail too (the
    same damaged files) are logged with a traceback when collected, after the step was set aside in one line."""
    exception = record.exc_info[1] if record.exc_info else None
    return not (str(record.msg).startswith("Task exception was never retrieved")
                and "tensorstore_spec=" in str(exception))


def quiet_orbax_failures() -> None:
    """A failed save or restore is told once, by its caller: not also by Orbax's threads (their ERROR records with
    a traceback), TensorStore's completions on a closed loop and its abandoned reads' failures."""
    _drop_late_read_completions()
    if _orbax_failure_traceback not in logging.getLogger("absl").filters:
        logging.getLogger("absl").addFilter(_orbax_failure_traceback)
    if _unretrieved_read_failure not in logging.getLogger("asyncio").filters:
        logging.getLogger("asyncio").addFilter(_unretrieved_read_failure)


class StepCheckpointer:
    """An Orbax CheckpointManager over `directory/<step>`, each step a set of our items; what a training job's saves
    and resumes go through.

    A step is listed only once Orbax has finalised it (renamed into place; on gs://, its commit_success.txt written
    last), so a save cut short is never restored; a failed write is one CheckpointWriteError line; a finalised step
    that cannot be read (a truncated or missing file) is set aside as `<step>.corrupt` by `restore_newest`, which
    then tries the step before it.
    """

    def __init__(self, directory, *, keep: int, keep_every: int | None = None, async_save: bool = False):
        quiet_orbax_failures()
        self.directory = orbax_path(directory)
        check_writable(str(self.directory))
        manager_options = ocp.CheckpointManagerOptions(max_to_keep=keep, keep_period=keep_every,
                                                       enable_async_checkpointing=async_save, create=True)
        self.manager = ocp.CheckpointManager(self.directory, options=manager_options, item_handlers=item_handlers())

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def steps(self) -> list[int]:
        """Every complete (finalised) step, oldest first."""
        return sorted(self.manager.all_steps())

    def step_dir(self, step: int) -> str:
        return str(self.directory / str(step))

    def save_items(self, step: int, items: dict) -> bool:
        """Saves `items` ({item name: tree of arrays, or JSON}) as `step`; with async_save in the background, and a
        failure then surfaces at the next save or in wait()/close()."""
        try:
            return self.manager.save(step, force=True, args=_save_args(items))
        except Exception as error:  # noqa: BLE001 - storage errors come as many types
            raise _write_error(self.directory, error) from None

    def restore_items(self, step: int, items: dict) -> dict:
        """The `items` of `step` ({array item: its abstract tree, laid out as wanted (Orbax reshards onto any mesh);
        JSON item: None})."""
        return self.manager.restore(step, args=_restore_args(items))

    def restore_items_any_layout(self, step: int, items: dict, config: ModelConfig) -> dict:
        """`restore_items`, where the step may hold its layers in the other layout than `items[PARAMS]` asks for
        (a fine-tune saved per layer by an older bertjax, resumed scanned): read as saved, then converted on the
        devices into the asked layout and shardings (every array item: params-shaped trees inside it too)."""
        metadata = self.manager.item_metadata(step)[PARAMS]
        stored = model_lib.is_stacked(getattr(metadata, "tree", metadata))
        wanted = model_lib.is_stacked(items[PARAMS])
        if stored == wanted:
            return self.restore_items(step, items)
        arrays = {name: tree for name, tree in items.items() if tree is not None}
        restored = self.restore_items(step, {**items, **_abstract_layout(arrays, config, stored)})
        shardings = jax.tree_util.tree_map(lambda leaf: leaf.sharding, arrays)
        converted = jax.jit(lambda trees: model_lib.with_layout(trees, config, wanted),
                            out_shardings=shardings)({name: restored[name] for name in arrays})
        return {**restored, **converted}

    def set_aside(self, step: int) -> str:
        """Moves a step that cannot be restored to `<step>.corrupt` (kept for inspection, never listed again);
        returns the new path. Process 0 moves it; every process then forgets the step."""
        target = epath.Path(self.step_dir(step) + ".corrupt")
        if jax.process_index() == 0:
            suffix = 1
            while target.exists():
                target, suffix = epath.Path(f"{self.step_dir(step)}.corrupt{suffix}"), suffix + 1
            epath.Path(self.step_dir(step)).rename(target)
        if jax.process_count() > 1:
            multihost_utils.sync_global_devices(f"bertjax set aside step {step}")
        self.manager.reload()
        return str(target)

    def restore_newest(self, restore, log):
        """(step, restore(step)) for the newest step that `restore` reads, or None without one. A step it cannot
        read is set aside with a one-line warning through `log`, and the one before it is tried; a ResumeRefused
        (the config, not the step, is at fault) and a permission error (the step may be whole: Unreadable, named)
        pass through, and nothing is set aside for them."""
        steps = self.steps()
        for step in reversed(steps):
            try:
                check_readable_tree(self.step_dir(step), "in the checkpoint")
                return step, restore(step)
            except (ResumeRefused, Unreadable):
                raise
            except Exception as error:  # noqa: BLE001 - any storage or format error makes the step unusable
                if is_permission_error(error):
                    raise Unreadable(f"cannot resume from {self.step_dir(step)}: permission denied "
                                     f"({first_line(error, 200)}); give this user read access to it") from None
                where, moved = self.step_dir(step), self.set_aside(step)
                log(f"warning: cannot restore {where} ({first_line(error, 200)}); moved it to {moved} and trying "
                    f"the previous checkpoint")
        if steps:
            log(f"warning: none of the {len(steps)} checkpoint(s) could be restored; starting from step 0 (the "
                f"broken ones are kept as *.corrupt)")
        return None

    def remove(self) -> None:
        """Closes the manager and deletes every step (a finished job's state); steps set aside stay."""
        self.close()
        if not self.directory.exists() or jax.process_index() != 0:
            return
        # A user's link out of the workdir is removed alone: what it points to stays.
        paths = [] if os.path.islink(str(self.directory)) else list(self.directory.iterdir())
        if not any(".corrupt" in path.name for path in paths):
            workdir_paths.remove(self.directory)  # one call (a directory on gs:// is only a prefix of its objects)
            return
        for path in paths:
            if ".corrupt" in path.name:
                continue
            if path.is_dir():
                path.rmtree()
            else:
                path.unlink()

    def wait(self) -> None:
        try:
            self.manager.wait_until_finished()
        except Exception as error:  # noqa: BLE001
            raise _write_error(self.directory, error) from None

    def close(self) -> None:
        failed = None
        try:
            self.wait()
        except CheckpointWriteError as error:
            failed = error
        try:
            self.manager.close()
        except Exception as error:  # noqa: BLE001 - after a failed save, close() re-raises the same failure
            if failed is None:
                raise _write_error(self.directory, error) from None
        if failed is not None:
            raise failed


class TrainCheckpointer(StepCheckpointer):
    """The pretraining job's steps at `<workdir>/checkpoints/<step>`, plus each process's input-pipeline position.

    A step directory holds the model items above (so `bertjax export` takes it) plus the optimizer state, the
    train meta (step, RNG, counters) and the job config. The input-pipeline position of process i is written to
    `<workdir>/input_state/<step>/process_i` *before* the step's Orbax save starts, so every checkpoint Orbax
    has finalised has its pipeline positions.
    """

    def __init__(self, workdir: str, config: CheckpointConfig):
        self.workdir = orbax_path(workdir)
        self.every = config.every
        super().__init__(self.workdir / "checkpoints", keep=config.keep, keep_every=config.keep_every or None,
                         async_save=config.async_save)

    def input_state_dir(self, step: int) -> str:
        return str(self.workdir / "input_state" / str(step))

    def save(self, step: int, state, *, config: ModelConfig, vocab: list[str], lower_case: bool, job_config: dict,
             save_input_state, force: bool = False, tokenizer: dict | None = None) -> bool:
        """Saves (asynchronously) if the step is due or `force`; `save_input_state(dir)` writes this process's
        pipeline position first."""
        if not (force or step % self.every == 0):
            return False
        try:
            save_input_state(self.input_state_dir(step))
        except Exception as error:  # noqa: BLE001 - storage errors come as many types
            raise _write_error(self.directory, error) from None
        saved = self.save_items(step, {**_model_items(state.params, config, vocab, lower_case, tokenizer),
                                       **_train_state_items(state), JOB_CONFIG: job_config})
        self._remove_stale_input_states()
        return saved

    def saved_job_config(self, step: int) -> dict:
        """The job config (PretrainConfig.to_dict()) the step was saved with."""
        return self.restore_items(step, {JOB_CONFIG: None})[JOB_CONFIG]

    def restore(self, step: int, abstract_state):
        """The train state at `step`, laid out as `abstract_state` (any mesh: Orbax reshards on restore; a step
        saved with its layers per layer, as before they were held stacked, continues stacked)."""
        return restore_train_state(self.step_dir(step), abstract_state)

    def _remove_stale_input_states(self) -> None:
        # Pipeline positions of checkpoints Orbax has deleted (or never finished) are dropped; the newest ones
        # stay, since the save that writes them may still be in flight.
        root = self.workdir / "input_state"
        if not root.exists() or jax.process_index() != 0:
            return
        kept = set(self.manager.all_steps())
        newest = max([int(p.name) for p in root.iterdir() if p.name.isdigit()], default=-1)
        for path in root.iterdir():
            if path.name.isdigit() and int(path.name) not in kept and int(path.name) < newest:
                path.rmtree()
