"""BertConfig: the model hyperparameters, in Google's bert_config.json schema and HF's config.json.

The same object travels with every checkpoint, so it is validated on construction: a bad config fails here
with a message naming the field, not later as a shape error deep inside a compiled function (or, for sizes whose
params would not fit the machine's memory, a MemoryError or an XLA abort).
"""
from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

from etils import epath

from bertjax.runtime.input_files import read_json


_SIZE_FIELDS = ("vocab_size", "hidden_size", "num_hidden_layers", "intermediate_size", "max_position_embeddings",
                "type_vocab_size")


def _param_count(values: dict[str, int]) -> int:
    """BertForPreTraining's parameters for the sizes in `values` (BertConfig fields)."""
    h, i, layers = values["hidden_size"], values["intermediate_size"], values["num_hidden_layers"]
    embeddings = (values["vocab_size"] + values["max_position_embeddings"] + values["type_vocab_size"]) * h + 2 * h
    layer = 4 * (h * h + h) + (h * i + i) + (i * h + h) + 4 * h  # q, k, v, out; intermediate; output; 2 LayerNorms
    heads = (h * h + h) + (h * h + 3 * h + values["vocab_size"]) + (2 * h + 2)  # pooler; MLM transform, bias; NSP
    return embeddings + layers * layer + heads


def host_memory_bytes() -> int:
    """This machine's physical memory."""
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


# Keys of Google's bert_config.json; all of them are BertConfig fields under the same name.
BERT_CONFIG_KEYS = (
    "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
    "hidden_act", "hidden_dropout_prob", "attention_probs_dropout_prob", "max_position_embeddings",
    "type_vocab_size", "initializer_range",
)

# HF's meanings (transformers.activations.ACT2FN): "gelu" is the exact erf form; the tanh approximation goes by
# "gelu_new" / "gelu_pytorch_tanh" (what Google's TF code computed although its configs say "gelu").
ACTIVATIONS = ("gelu", "gelu_new", "gelu_pytorch_tanh", "gelu_fast", "relu", "tanh", "silu", "swish")
DTYPES = ("float32", "bfloat16", "float16")
REMAT_POLICIES = ("none", "dots", "full")
ATTENTION_BACKENDS = ("auto", "reference", "chunked", "dot_product", "cudnn", "pallas_tpu", "splash_tpu",
                      "flash_dropout_tpu", "flash_dropout_gpu")

# name -> (layers, hidden, heads); intermediate = 4 * hidden, vocab 30522 (uncased WordPiece).
PRESETS = {
    "tiny": (2, 128, 2),
    "mini": (4, 256, 4),
    "small": (4, 512, 8),
    "medium": (8, 512, 8),
    "base": (12, 768, 12),
    "large": (24, 1024, 16),
}


@dataclasses.dataclass(frozen=True)
class BertConfig:
    """BERT hyperparameters plus bertjax's compute settings (dtype, attention backend)."""

    vocab_size: int = 30522
    hidden_size: int = 768
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    intermediate_size: int = 3072
    hidden_act: str = "gelu"
    hidden_dropout_prob: float = 0.1
    attention_probs_dropout_prob: float = 0.1
    max_position_embeddings: int = 512
    type_vocab_size: int = 2
    initializer_range: float = 0.02
    layer_norm_eps: float = 1e-12
    pad_token_id: int = 0
    # Compute dtype of matmuls; params stay float32, softmax/LayerNorm/losses run in float32.
    dtype: str = "float32"
    attention_backend: str = "auto"
    # The encoder layers as one `nn.scan` over stacked params (`bert/layers/...`, leading axis = layer): XLA compiles
    # one layer instead of num_hidden_layers. Checkpoints record it here; `load_model` hands out the per-layer layout.
    scan_layers: bool = False
    # Rematerialisation of each encoder layer in the backward pass (jax.checkpoint): "none" keeps every activation
    # the gradient needs; "dots" keeps only the matmul outputs and recomputes the rest (softmax, GELU, LayerNorm,
    # dropout); "full" keeps only each layer's input and recomputes the layer (~1/3 more FLOPs, least memory).
    remat: str = "none"

    def __post_init__(self):
        problems = []
        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                     "intermediate_size", "max_position_embeddings", "type_vocab_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                problems.append(f"{name} must be a positive integer, got {value!r}")
        if not problems:
            problems += self._memory_problems()
        if not problems and self.hidden_size % self.num_attention_heads:
            problems.append(f"hidden_size {self.hidden_size} is not divisible by num_attention_heads "
                            f"{self.num_attention_heads}")
        if self.hidden_act not in ACTIVATIONS:
            problems.append(f"unknown hidden_act {self.hidden_act!r}; expected one of {', '.join(ACTIVATIONS)}")
        for name in ("hidden_dropout_prob", "attention_probs_dropout_prob"):
            if not 0.0 <= getattr(self, name) < 1.0:
                problems.append(f"{name} must be in [0, 1), got {getattr(self, name)!r}")
        if self.dtype not in DTYPES:
            problems.append(f"unknown dtype {self.dtype!r}; expected one of {', '.join(DTYPES)}")
        if self.remat not in REMAT_POLICIES:
            problems.append(f"unknown remat {self.remat!r}; expected one of {', '.join(REMAT_POLICIES)}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            problems.append(f"unknown attention_backend {self.attention_backend!r}; "
                            f"expected one of {', '.join(ATTENTION_BACKENDS)}")
        if not 0 <= self.pad_token_id < (self.vocab_size if isinstance(self.vocab_size, int) else 1):
            problems.append(f"pad_token_id {self.pad_token_id} is outside the vocabulary of {self.vocab_size}")
        if problems:
            raise ValueError("invalid BertConfig: " + "; ".join(problems))

    def param_count(self) -> int:
        """The parameters of a BertForPreTraining of this config (closed form: nothing is built or allocated)."""
        return _param_count(dataclasses.asdict(self))

    def _memory_problems(self) -> list[str]:
        """A size whose float32 params alone would not fit this machine's memory, named before anything is
        allocated or compiled (an absurd config.json would otherwise end in MemoryError or an XLA abort)."""
        values, memory = dataclasses.asdict(self), host_memory_bytes()
        need = 4 * _param_count(values)
        if need <= memory:
            return []
        # Named: the field that, at its default, shrinks the model most.
        defaults = {f.name: f.default for f in dataclasses.fields(self)}
        field = min(_SIZE_FIELDS, key=lambda name: _param_count({**values, name: min(values[name], defaults[name])}))
        return [f"{field}={values[field]}: the model's {need // 4:,} float32 parameters alone need "
                f"{need / 2**30:,.1f} GiB, more than this machine's {memory / 2**30:,.1f} GiB of memory"]

    def check_length(self, length: int, flag: str) -> None:
        """Refuses sequences longer than the position table, before any data is read (`flag` names the option)."""
        if length > self.max_position_embeddings:
            raise ValueError(f"{flag} {length} exceeds the model's max_position_embeddings "
                             f"{self.max_position_embeddings}: give at most {self.max_position_embeddings}")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    def replace(self, **changes) -> "BertConfig":
        return dataclasses.replace(self, **changes)

    # ---- presets -------------------------------------------------------------------------------------------
    @classmethod
    def preset(cls, name: str, **overrides) -> "BertConfig":
        """A named size (tiny, mini, small, medium, base, large) as in Google's BERT release."""
        if name not in PRESETS:
            raise ValueError(f"unknown preset {name!r}; expected one of {', '.join(PRESETS)}")
        layers, hidden, heads = PRESETS[name]
        fields = dict(num_hidden_layers=layers, hidden_size=hidden, num_attention_heads=heads,
                      intermediate_size=4 * hidden)
        fields.update(overrides)
        return cls(**fields)

    # ---- Google's bert_config.json ---------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any], source: str = "config") -> "BertConfig":
        """Builds a config from a dict holding BertConfig fields; unknown keys are an error naming them."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"{source}: unknown BertConfig keys {unknown}; expected a subset of {sorted(known)}")
        try:
            return cls(**values)
        except ValueError as error:
            raise ValueError(f"{source}: {error}") from None

    @classmethod
    def from_json_file(cls, path: str) -> "BertConfig":
        """Reads Google's bert_config.json, an HF config.json, or bertjax's own config.json."""
        values = _read_json(path)
        if "model_type" in values or "architectures" in values:
            return cls.from_hf_dict(values, source=path)
        missing = [key for key in BERT_CONFIG_KEYS if key not in values]
        if missing:
            raise ValueError(f"{path}: not a bert_config.json, missing keys {missing}")
        return cls.from_dict(values, source=path)

    def to_bert_config_dict(self) -> dict[str, Any]:
        """The keys of Google's bert_config.json (what run_pretraining.py reads)."""
        return {key: getattr(self, key) for key in BERT_CONFIG_KEYS}

    def to_json_file(self, path: str) -> None:
        epath.Path(path).write_text(json.dumps(self.to_dict(), indent=2, sort_keys=True))

    # ---- HF config.json -------------------------------------------------------------------------------------
    @classmethod
    def from_hf_dict(cls, values: dict[str, Any], source: str = "config.json") -> "BertConfig":
        """Builds a config from an HF BertConfig dict; keys HF adds that do not change the model are ignored."""
        model_type = values.get("model_type", "bert")
        if model_type != "bert":
            raise ValueError(f"{source}: model_type {model_type!r} is not 'bert'")
        if values.get("position_embedding_type", "absolute") != "absolute":
            raise ValueError(f"{source}: position_embedding_type {values['position_embedding_type']!r} "
                             "is not supported (only 'absolute', as in BERT)")
        fields = {key: values[key] for key in BERT_CONFIG_KEYS if key in values}
        for key in ("layer_norm_eps", "pad_token_id"):
            if values.get(key) is not None:
                fields[key] = values[key]
        return cls.from_dict(fields, source=source)

    def to_hf_dict(self, architecture: str = "BertForPreTraining", **extra) -> dict[str, Any]:
        """An HF config.json dict for `architecture`; extra keys (num_labels, id2label...) are merged in."""
        values = self.to_bert_config_dict()
        values.update(
            model_type="bert",
            architectures=[architecture],
            layer_norm_eps=self.layer_norm_eps,
            pad_token_id=self.pad_token_id,
            position_embedding_type="absolute",
            torch_dtype="float32",
            use_cache=False,
        )
        values.update(extra)
        return values


def _read_json(path: str) -> dict[str, Any]:
    if not epath.Path(path).exists():
        raise FileNotFoundError(f"config file {path} does not exist")
    values = read_json(path, "a model config (JSON)")
    if not isinstance(values, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(values).__name__}")
    return values

