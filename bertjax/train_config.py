"""Pretraining job configuration: ml_collections ConfigDicts, named presets in configs/, `--set KEY=VALUE`.

Every key exists in `default_config()`, with its type; a preset (configs/<name>.py with `get_config()`) changes
values, and the command line overrides them. The config is locked before overrides, so an unknown key or a value of
the wrong type is an error that names the key, and `validate` checks cross-field facts (batch divisibility, ...)
before anything is compiled.
"""
from __future__ import annotations

import ast
import importlib.util
import pathlib

import ml_collections

from bertjax.config import PRESETS, BertConfig

CONFIGS_DIR = pathlib.Path(__file__).resolve().parents[1] / "configs"


def default_config() -> ml_collections.ConfigDict:
    """All keys of a pretraining job with BERT's defaults (google-research/bert run_pretraining.py flags)."""
    c = ml_collections.ConfigDict()
    c.model = dict(
        preset="base",                      # tiny | mini | small | medium | base | large
        vocab_size=0,                       # 0: the size of data.vocab
        dtype="float32",                    # compute dtype; params stay float32
        attention_backend="auto",
        hidden_dropout_prob=0.1,
        attention_probs_dropout_prob=0.1,
        max_position_embeddings=512,
        hidden_act="gelu",
    )
    c.data = dict(
        input="",                           # comma-separated globs of corpus files (one sentence per line,
                                            # blank line between documents), tfds:NAME, or TFRecord shards
        input_kind="text",                  # text | tfrecord
        corpus_format="sentences",          # sentences (original format) | paragraphs (one paragraph per line)
        vocab="",                           # vocab.txt (WordPiece) or .model (SentencePiece)
        lower_case=True,
        max_seq_length=128,
        max_predictions_per_seq=20,
        masked_lm_prob=0.15,
        short_seq_prob=0.1,
        next_sentence_prediction=True,
        whole_word_masking=False,
        masking="dynamic",                  # dynamic | static
        dupe_factor=10,
        doc_buffer_size=1000,
        shuffle_buffer=10_000,
        seed=12345,
        eval_input="",                      # held-out corpus for periodic MLM/NSP accuracy ("" = none)
    )
    c.train = dict(
        steps=1_000_000,
        batch_size=256,                     # global, in sequences
        grad_accum_steps=1,                 # microbatches per step (global batch / accum per forward pass)
        seed=0,
        log_every=100,
        eval_every=0,                       # 0: no periodic eval
        eval_batches=10,
        max_consecutive_nonfinite=10,       # this many non-finite gradients in a row stop the job
        nsp_loss=True,                      # add the NSP loss (needs next_sentence_prediction data)
    )
    c.optimizer = dict(
        name="adamw",                       # adamw | lamb
        learning_rate=1e-4,
        warmup_steps=10_000,
        decay="linear",                     # linear | cosine (to 0 at train.steps)
        weight_decay=0.01,
        b1=0.9,
        b2=0.999,
        eps=1e-6,
        clip_norm=1.0,                      # 0: no clipping
        bias_correction=True,               # False: the original TF AdamWeightDecayOptimizer
    )
    c.checkpoint = dict(
        every=1000,                         # steps between saves (and always at the end)
        keep=3,                             # most recent checkpoints kept
        keep_every=0,                       # also keep every N-th step forever (0: none)
        async_save=True,
    )
    c.mesh = dict(data=-1, fsdp=1, tensor=1)  # -1: all remaining devices
    c.init_from = ""                        # checkpoint to start from (phase 2 from phase 1; HF/TF too)
    c.reset_schedule = True                 # with init_from: restart the step count and LR schedule
    return c


def load_config(name_or_path: str, overrides: list[str] = ()) -> ml_collections.ConfigDict:
    """A preset (name in configs/ or a path to a .py with get_config()), then KEY=VALUE overrides, validated."""
    path = pathlib.Path(name_or_path)
    if path.suffix != ".py":
        path = CONFIGS_DIR / (name_or_path.replace("-", "_") + ".py")
    if not path.exists():
        known = sorted(p.stem.replace("_", "-") for p in CONFIGS_DIR.glob("*.py") if not p.stem.startswith("_"))
        raise ValueError(f"unknown config {name_or_path!r}: {path} does not exist; known presets: {known}")
    spec = importlib.util.spec_from_file_location(f"bertjax_config_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    config = module.get_config()
    config.lock()
    for override in overrides:
        apply_override(config, override)
    validate(config)
    return config


def apply_override(config: ml_collections.ConfigDict, override: str) -> None:
    """Sets `KEY=VALUE` (dotted key); the value is parsed to the key's existing type."""
    if "=" not in override:
        raise ValueError(f"--set {override!r}: expected KEY=VALUE")
    key, raw = override.split("=", 1)
    node = config
    parts = key.strip().split(".")
    for part in parts[:-1]:
        if part not in node or not isinstance(node[part], ml_collections.ConfigDict):
            raise ValueError(f"--set {key}: unknown config key")
        node = node[part]
    if parts[-1] not in node:
        raise ValueError(f"--set {key}: unknown config key")
    current = node[parts[-1]]
    node[parts[-1]] = _parse(raw.strip(), type(current), key)


def _parse(raw: str, kind: type, key: str):
    if kind is str:
        return raw
    if kind is bool:
        if raw.lower() in ("true", "1", "yes"):
            return True
        if raw.lower() in ("false", "0", "no"):
            return False
        raise ValueError(f"--set {key}={raw}: expected a boolean (true/false)")
    try:
        value = ast.literal_eval(raw.replace("_", "") if kind in (int, float) else raw)
    except (ValueError, SyntaxError):
        raise ValueError(f"--set {key}={raw}: expected a {kind.__name__}") from None
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if not isinstance(value, kind) or isinstance(value, bool):
        raise ValueError(f"--set {key}={raw}: expected a {kind.__name__}, got {type(value).__name__}")
    return value


def validate(config: ml_collections.ConfigDict, num_devices: int | None = None) -> None:
    """Cross-field checks, run before any compile. With `num_devices`, also the mesh and batch split."""
    problems = []
    if config.model.preset not in PRESETS:
        problems.append(f"model.preset={config.model.preset!r}; expected one of {sorted(PRESETS)}")
    for key in ("steps", "batch_size", "grad_accum_steps", "log_every"):
        if config.train[key] < 1:
            problems.append(f"train.{key}={config.train[key]} must be >= 1")
    if config.train.batch_size % max(config.train.grad_accum_steps, 1):
        problems.append(f"train.batch_size={config.train.batch_size} is not divisible by "
                        f"train.grad_accum_steps={config.train.grad_accum_steps}")
    if config.optimizer.name not in ("adamw", "lamb"):
        problems.append(f"optimizer.name={config.optimizer.name!r}; expected adamw or lamb")
    if config.optimizer.decay not in ("linear", "cosine"):
        problems.append(f"optimizer.decay={config.optimizer.decay!r}; expected linear or cosine")
    if not 0 <= config.optimizer.warmup_steps <= config.train.steps:
        problems.append(f"optimizer.warmup_steps={config.optimizer.warmup_steps} must be in [0, train.steps="
                        f"{config.train.steps}]")
    if config.checkpoint.every < 1:
        problems.append(f"checkpoint.every={config.checkpoint.every} must be >= 1")
    if config.data.max_seq_length > config.model.max_position_embeddings:
        problems.append(f"data.max_seq_length={config.data.max_seq_length} exceeds "
                        f"model.max_position_embeddings={config.model.max_position_embeddings}")
    if config.train.nsp_loss and not config.data.next_sentence_prediction:
        problems.append("train.nsp_loss=true needs data.next_sentence_prediction=true")
    if not config.data.input:
        problems.append("data.input is empty: give corpus files (--set data.input=GLOB)")
    if config.data.input_kind == "text" and not config.data.vocab:
        problems.append("data.vocab is empty: text input needs a vocab.txt or SentencePiece .model")
    if num_devices is not None and not problems:
        from bertjax.sharding import mesh_shape

        try:
            data, fsdp, _ = mesh_shape(num_devices, config.mesh.data, config.mesh.fsdp, config.mesh.tensor)
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


def model_config(config: ml_collections.ConfigDict, vocab_size: int) -> BertConfig:
    """The BertConfig a job trains, from its model.* keys."""
    m = config.model
    return BertConfig.preset(
        m.preset, vocab_size=m.vocab_size or vocab_size, dtype=m.dtype, attention_backend=m.attention_backend,
        hidden_dropout_prob=m.hidden_dropout_prob, attention_probs_dropout_prob=m.attention_probs_dropout_prob,
        max_position_embeddings=m.max_position_embeddings, hidden_act=m.hidden_act)
