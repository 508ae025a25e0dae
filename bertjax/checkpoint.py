"""bertjax's checkpoint format: one Orbax composite checkpoint directory per model.

Items:
- `params`: the float32 param tree (Orbax StandardSave: sharded tensorstore arrays, restorable onto any mesh);
- `model_config`: the BertConfig as JSON;
- `vocab`: {"tokens": [...], "lower_case": bool}, so a checkpoint is self-contained (no separate vocab.txt).
The pretraining trainer writes these same items (plus optimizer and data state) in each step directory, so every
command that takes a checkpoint also takes a training step directory.

Orbax writes to a temporary name and renames on completion, so a half-written checkpoint never has the final name.
"""
from __future__ import annotations

import dataclasses

import jax
import orbax.checkpoint as ocp
from etils import epath

from bertjax.config import BertConfig

PARAMS, MODEL_CONFIG, VOCAB = "params", "model_config", "vocab"


@dataclasses.dataclass
class ModelCheckpoint:
    params: dict
    config: BertConfig
    vocab: list[str]
    lower_case: bool


def read_vocab_file(path: str) -> list[str]:
    """Tokens of a vocab.txt (one per line, id = line number)."""
    path = epath.Path(path)
    if not path.exists():
        raise FileNotFoundError(f"vocab file {path} does not exist")
    tokens = path.read_text(encoding="utf-8").splitlines()
    if not tokens:
        raise ValueError(f"vocab file {path} is empty")
    return tokens


def write_vocab_file(tokens: list[str], path: str) -> None:
    epath.Path(path).write_text("".join(t + "\n" for t in tokens), encoding="utf-8")


def _check_vocab(config: BertConfig, tokens: list[str], origin: str) -> None:
    if len(tokens) != config.vocab_size:
        raise ValueError(f"vocab mismatch in {origin}: the vocabulary has {len(tokens)} tokens but "
                         f"config.vocab_size is {config.vocab_size}")


def save_model(directory: str, params, config: BertConfig, vocab: list[str], lower_case: bool = True,
               extra_items: dict | None = None) -> None:
    """Writes params + config + vocab (and any extra Orbax args) as one composite checkpoint at `directory`."""
    _check_vocab(config, vocab, directory)
    items = {
        PARAMS: ocp.args.StandardSave(params),
        MODEL_CONFIG: ocp.args.JsonSave(config.to_dict()),
        VOCAB: ocp.args.JsonSave({"tokens": list(vocab), "lower_case": bool(lower_case)}),
    }
    items.update(extra_items or {})
    with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as checkpointer:
        checkpointer.save(epath.Path(directory).absolute(), args=ocp.args.Composite(**items))


def is_model_checkpoint(directory: str) -> bool:
    path = epath.Path(directory)
    return path.is_dir() and (path / MODEL_CONFIG).exists() and (path / PARAMS).exists()


def load_config(directory: str) -> BertConfig:
    """The BertConfig of a checkpoint, without reading its tensors."""
    _require_checkpoint(directory)
    with ocp.Checkpointer(_handler()) as checkpointer:
        restored = checkpointer.restore(epath.Path(directory).absolute(),
                                        args=ocp.args.Composite(**{MODEL_CONFIG: ocp.args.JsonRestore()}))
    return BertConfig.from_dict(restored[MODEL_CONFIG], source=f"{directory}/{MODEL_CONFIG}")


def load_model(directory: str, abstract_params=None) -> ModelCheckpoint:
    """Reads a checkpoint written by `save_model` (or a trainer step directory).

    `abstract_params` (a tree of jax.ShapeDtypeStruct with shardings) restores straight onto a mesh; without
    it, arrays land on the default device.
    """
    _require_checkpoint(directory)
    path = epath.Path(directory).absolute()
    with ocp.Checkpointer(_handler()) as checkpointer:
        metadata_only = checkpointer.restore(path, args=ocp.args.Composite(
            **{MODEL_CONFIG: ocp.args.JsonRestore(), VOCAB: ocp.args.JsonRestore()}))
        if abstract_params is None:
            # Restore as host numpy arrays on one device, whatever mesh wrote them.
            tree = checkpointer.metadata(path).item_metadata[PARAMS]
            tree = getattr(tree, "tree", tree)
            abstract_params = jax.tree_util.tree_map(
                lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype,
                                               sharding=jax.sharding.SingleDeviceSharding(jax.devices()[0])),
                tree)
        restored = checkpointer.restore(path, args=ocp.args.Composite(
            **{PARAMS: ocp.args.StandardRestore(abstract_params)}))
    config = BertConfig.from_dict(metadata_only[MODEL_CONFIG], source=f"{directory}/{MODEL_CONFIG}")
    vocab = metadata_only[VOCAB]
    _check_vocab(config, vocab["tokens"], directory)
    return ModelCheckpoint(restored[PARAMS], config, vocab["tokens"], vocab["lower_case"])


def _handler() -> ocp.CompositeCheckpointHandler:
    # Named handlers let Orbax read each item's metadata (shapes) without restoring it; the training items are
    # named too, so a trainer step directory reads without "unknown item" warnings.
    return ocp.CompositeCheckpointHandler(**{PARAMS: ocp.StandardCheckpointHandler(),
                                             MODEL_CONFIG: ocp.JsonCheckpointHandler(),
                                             VOCAB: ocp.JsonCheckpointHandler(),
                                             "opt_state": ocp.StandardCheckpointHandler(),
                                             "train_meta": ocp.StandardCheckpointHandler(),
                                             "job_config": ocp.JsonCheckpointHandler()})


def _require_checkpoint(directory: str) -> None:
    if not is_model_checkpoint(directory):
        raise FileNotFoundError(f"{directory} is not a bertjax checkpoint (expected the Orbax items "
                                f"{PARAMS}/ and {MODEL_CONFIG}/ in it)")


# ---- training checkpoints ------------------------------------------------------------------------------------------

OPT_STATE, TRAIN_META, JOB_CONFIG = "opt_state", "train_meta", "job_config"


class TrainCheckpointer:
    """Orbax CheckpointManager over `<workdir>/checkpoints/<step>`, plus each process's input-pipeline position.

    A step directory holds the model items above (so `bertjax export` takes it) plus the optimizer state, the
    train meta (step, RNG, counters) and the job config. The input-pipeline position of process i is written to
    `<workdir>/input_state/<step>/process_i` *before* the step's Orbax save starts, so every checkpoint Orbax
    has finalised has its pipeline positions; Orbax finalises by renaming, so an interrupted save is never listed.
    """

    def __init__(self, workdir: str, *, every: int, keep: int, keep_every: int = 0, async_save: bool = True):
        # Orbax wants absolute local paths; remote ones (gs://...) already are.
        self.workdir = epath.Path(workdir) if "://" in str(workdir) else epath.Path(workdir).absolute()
        self.every = every
        options = ocp.CheckpointManagerOptions(
            save_interval_steps=every, max_to_keep=keep, keep_period=keep_every or None,
            enable_async_checkpointing=async_save, create=True)
        handlers = {PARAMS: ocp.StandardCheckpointHandler(), OPT_STATE: ocp.StandardCheckpointHandler(),
                    TRAIN_META: ocp.StandardCheckpointHandler(), MODEL_CONFIG: ocp.JsonCheckpointHandler(),
                    VOCAB: ocp.JsonCheckpointHandler(), JOB_CONFIG: ocp.JsonCheckpointHandler()}
        self.manager = ocp.CheckpointManager(self.workdir / "checkpoints", options=options,
                                             item_handlers=handlers)

    def input_state_dir(self, step: int) -> str:
        return str(self.workdir / "input_state" / str(step))

    def latest_step(self) -> int | None:
        return self.manager.latest_step()


    def save(self, step: int, state, *, config: BertConfig, vocab: list[str], lower_case: bool, job_config: dict,
             save_input_state, force: bool = False) -> bool:
        """Saves (asynchronously) if the step is due or `force`; `save_input_state(dir)` writes this process's
        pipeline position first."""
        if not (force or step % self.every == 0):
            return False
        save_input_state(self.input_state_dir(step))
        meta = {"step": state.step, "rng": state.rng, "nonfinite_total": state.nonfinite_total,
                "nonfinite_consecutive": state.nonfinite_consecutive}
        saved = self.manager.save(step, force=True, args=ocp.args.Composite(**{
            PARAMS: ocp.args.StandardSave(state.params),
            OPT_STATE: ocp.args.StandardSave(state.opt_state),
            TRAIN_META: ocp.args.StandardSave(meta),
            MODEL_CONFIG: ocp.args.JsonSave(config.to_dict()),
            VOCAB: ocp.args.JsonSave({"tokens": list(vocab), "lower_case": bool(lower_case)}),
            JOB_CONFIG: ocp.args.JsonSave(job_config),
        }))
        self._remove_stale_input_states()
        return saved

    def restore(self, step: int, abstract_state):
        """The train state at `step`, laid out as `abstract_state` (any mesh: Orbax reshards on restore)."""
        meta_target = {"step": abstract_state.step, "rng": abstract_state.rng,
                       "nonfinite_total": abstract_state.nonfinite_total,
                       "nonfinite_consecutive": abstract_state.nonfinite_consecutive}
        restored = self.manager.restore(step, args=ocp.args.Composite(**{
            PARAMS: ocp.args.StandardRestore(abstract_state.params),
            OPT_STATE: ocp.args.StandardRestore(abstract_state.opt_state),
            TRAIN_META: ocp.args.StandardRestore(meta_target),
        }))
        meta = restored[TRAIN_META]
        return abstract_state.replace(params=restored[PARAMS], opt_state=restored[OPT_STATE], **meta)

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

    def wait(self) -> None:
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()
