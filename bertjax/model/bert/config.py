"""BertConfig: the model hyperparameters, in Google's bert_config.json schema and HF's config.json.

Validated on construction, as every family's config (`config_base.ConfigBase`: the checks and methods both share).
"""
from __future__ import annotations

import dataclasses
import json
from typing import Any

from etils import epath

from bertjax.model.config_base import ConfigBase, memory_shortfall, read_config_json


_SIZE_FIELDS = ("vocab_size", "hidden_size", "num_hidden_layers", "intermediate_size", "max_position_embeddings",
                "type_vocab_size")


def _param_count(values: dict[str, int]) -> int:
    """BertForPreTraining's parameters for the sizes in `values` (BertConfig fields)."""
    h, i, layers = values["hidden_size"], values["intermediate_size"], values["num_hidden_layers"]
    embeddings = (values["vocab_size"] + values["max_position_embeddings"] + values["type_vocab_size"]) * h + 2 * h
    layer = 4 * (h * h + h) + (h * i + i) + (i * h + h) + 4 * h  # q, k, v, out; intermediate; output; 2 LayerNorms
    heads = (h * h + h) + (h * h + 3 * h + values["vocab_size"]) + (2 * h + 2)  # pooler; MLM transform, bias; NSP
    return embeddings + layers * layer + heads


# Keys of Google's bert_config.json; all of them are BertConfig fields under the same name.
BERT_CONFIG_KEYS = (
    "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
    "hidden_act", "hidden_dropout_prob", "attention_probs_dropout_prob", "max_position_embeddings",
    "type_vocab_size", "initializer_range",
)

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
class BertConfig(ConfigBase):
    """BERT hyperparameters plus bertjax's compute settings (dtype, attention backend)."""

    model_type = "bert"

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
        problems = self.positive_int_problems(("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                                               "intermediate_size", "max_position_embeddings", "type_vocab_size"))
        if not problems:
            problems += self._memory_problems()
        if not problems:
            problems += self.heads_problems()
        problems += self.activation_problems(("hidden_act",))
        problems += self.rate_problems(("hidden_dropout_prob", "attention_probs_dropout_prob"))
        self.raise_problems(problems + self.compute_problems())

    def param_count(self) -> int:
        """The parameters of a BertForPreTraining of this config (closed form: nothing is built or allocated)."""
        return _param_count(dataclasses.asdict(self))

    def _memory_problems(self) -> list[str]:
        """A size whose float32 params alone would not fit this machine's memory, named before anything is
        allocated or compiled (an absurd config.json would otherwise end in MemoryError or an XLA abort)."""
        values = dataclasses.asdict(self)
        shortfall = memory_shortfall(_param_count(values))
        if shortfall is None:
            return []
        # Named: the field that, at its default, shrinks the model most.
        defaults = {f.name: f.default for f in dataclasses.fields(self)}
        field = min(_SIZE_FIELDS, key=lambda name: _param_count({**values, name: min(values[name], defaults[name])}))
        return [f"{field}={values[field]}: {shortfall}"]

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
    def from_json_file(cls, path: str) -> "BertConfig":
        """Reads Google's bert_config.json, an HF config.json, or bertjax's own config.json."""
        values = read_config_json(path)
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
