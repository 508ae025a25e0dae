"""ModernBertConfig: ModernBERT's hyperparameters, meaning what transformers' ModernBertConfig means by them.

The contract is transformers' `models/modernbert` (configuration_modernbert.py, modeling_modernbert.py): every field
here that changes the function is read from and written to an HF config.json under HF's name, in both of its
spellings (transformers 5's `layer_types` / `rope_parameters`, and the `global_attn_every_n_layers` /
`global_rope_theta` / `local_rope_theta` of the released checkpoints). Where both spellings are given and disagree,
the new one wins, as in transformers 5.23 (its `layer_types` is used as given, its `rope_parameters`' rope_theta
takes the old key's place), and a warning line says so. Like BertConfig it travels with every checkpoint and
validates itself on construction, naming the field.
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Any

from bertjax.model.config import ACTIVATIONS, ATTENTION_BACKENDS, DTYPES, REMAT_POLICIES, host_memory_bytes

MODEL_TYPE = "modernbert"
FULL, SLIDING = "full_attention", "sliding_attention"
POOLINGS = ("cls", "mean")
# HF's ModernBertConfig.default_theta.
DEFAULT_GLOBAL_THETA, DEFAULT_LOCAL_THETA = 160_000.0, 10_000.0

# Fields read from and written to config.json under the same name.
_HF_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "hidden_activation", "max_position_embeddings", "initializer_range", "initializer_cutoff_factor",
            "norm_eps", "norm_bias", "pad_token_id", "bos_token_id", "eos_token_id", "cls_token_id", "sep_token_id",
            "attention_bias", "attention_dropout", "local_attention", "embedding_dropout", "mlp_bias", "mlp_dropout",
            "decoder_bias", "classifier_pooling", "classifier_dropout", "classifier_bias", "classifier_activation",
            "tie_word_embeddings")


def alternating_layer_types(num_layers: int, global_every: int) -> tuple[str, ...]:
    """HF's default pattern: layer i is global where i % global_every == 0, else sliding-window."""
    return tuple(SLIDING if i % global_every else FULL for i in range(num_layers))


@dataclasses.dataclass(frozen=True)
class ModernBertConfig:
    """ModernBERT's hyperparameters (HF's names and defaults: ModernBERT-base) plus bertjax's compute settings."""

    vocab_size: int = 50368
    hidden_size: int = 768
    intermediate_size: int = 1152
    num_hidden_layers: int = 22
    num_attention_heads: int = 12
    hidden_activation: str = "gelu"
    max_position_embeddings: int = 8192
    initializer_range: float = 0.02
    initializer_cutoff_factor: float = 2.0
    norm_eps: float = 1e-5
    norm_bias: bool = False
    pad_token_id: int = 50283
    bos_token_id: int | None = 50281
    eos_token_id: int | None = 50282
    cls_token_id: int | None = 50281
    sep_token_id: int | None = 50282
    attention_bias: bool = False
    # On the attention probabilities and on the attention block's output (HF's `out_drop`).
    attention_dropout: float = 0.0
    # Per layer, FULL or SLIDING; empty: HF's default, a global layer every third.
    layer_types: tuple[str, ...] = ()
    global_rope_theta: float = DEFAULT_GLOBAL_THETA
    local_rope_theta: float = DEFAULT_LOCAL_THETA
    # The whole window of a sliding layer: a token attends to those at most local_attention // 2 away.
    local_attention: int = 128
    embedding_dropout: float = 0.0
    mlp_bias: bool = False
    mlp_dropout: float = 0.0
    decoder_bias: bool = True
    classifier_pooling: str = "cls"
    classifier_dropout: float = 0.0
    classifier_bias: bool = False
    classifier_activation: str = "gelu"
    tie_word_embeddings: bool = True
    # bertjax's compute settings, as BertConfig's.
    dtype: str = "float32"
    attention_backend: str = "auto"
    scan_layers: bool = False
    remat: str = "none"

    model_type = MODEL_TYPE

    def __post_init__(self):
        if not self.layer_types and isinstance(self.num_hidden_layers, int) and self.num_hidden_layers > 0:
            object.__setattr__(self, "layer_types", alternating_layer_types(self.num_hidden_layers, 3))
        object.__setattr__(self, "layer_types", tuple(self.layer_types))
        problems = []
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                     "max_position_embeddings", "local_attention"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                problems.append(f"{name} must be a positive integer, got {value!r}")
        if not problems:
            need = 4 * self.param_count()
            if need > host_memory_bytes():
                problems.append(f"the model's {need // 4:,} float32 parameters alone need {need / 2**30:,.1f} GiB, "
                                f"more than this machine's {host_memory_bytes() / 2**30:,.1f} GiB of memory")
            if self.hidden_size % self.num_attention_heads:
                problems.append(f"hidden_size {self.hidden_size} is not divisible by num_attention_heads "
                                f"{self.num_attention_heads}")
            elif self.head_dim % 2:
                problems.append(f"the head size {self.head_dim} (hidden_size / num_attention_heads) is odd; "
                                "rotary embeddings rotate pairs of dimensions")
            if len(self.layer_types) != self.num_hidden_layers:
                problems.append(f"layer_types has {len(self.layer_types)} entries for num_hidden_layers "
                                f"{self.num_hidden_layers}")
        unknown = sorted(set(self.layer_types) - {FULL, SLIDING})
        if unknown:
            problems.append(f"layer_types holds {unknown}; expected {FULL!r} or {SLIDING!r}")
        for name in ("hidden_activation", "classifier_activation"):
            if getattr(self, name) not in ACTIVATIONS:
                problems.append(f"unknown {name} {getattr(self, name)!r}; expected one of {', '.join(ACTIVATIONS)}")
        for name in ("attention_dropout", "embedding_dropout", "mlp_dropout", "classifier_dropout"):
            if not 0.0 <= getattr(self, name) < 1.0:
                problems.append(f"{name} must be in [0, 1), got {getattr(self, name)!r}")
        for name in ("global_rope_theta", "local_rope_theta", "norm_eps"):
            if not getattr(self, name) > 0:
                problems.append(f"{name} must be positive, got {getattr(self, name)!r}")
        if self.classifier_pooling not in POOLINGS:
            problems.append(f"classifier_pooling {self.classifier_pooling!r}; expected one of {', '.join(POOLINGS)}")
        if self.dtype not in DTYPES:
            problems.append(f"unknown dtype {self.dtype!r}; expected one of {', '.join(DTYPES)}")
        if self.remat not in REMAT_POLICIES:
            problems.append(f"unknown remat {self.remat!r}; expected one of {', '.join(REMAT_POLICIES)}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            problems.append(f"unknown attention_backend {self.attention_backend!r}; "
                            f"expected one of {', '.join(ATTENTION_BACKENDS)}")
        if isinstance(self.vocab_size, int) and not 0 <= self.pad_token_id < self.vocab_size:
            problems.append(f"pad_token_id {self.pad_token_id} is outside the vocabulary of {self.vocab_size}")
        if problems:
            raise ValueError("invalid ModernBertConfig: " + "; ".join(problems))

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def window(self) -> int:
        """How far a sliding layer's token sees on each side (HF's `sliding_window`, inclusive)."""
        return self.local_attention // 2

    def is_global(self, layer: int) -> bool:
        return self.layer_types[layer] == FULL

    def rope_theta(self, layer: int) -> float:
        return self.global_rope_theta if self.is_global(layer) else self.local_rope_theta

    def param_count(self) -> int:
        """The parameters of a ModernBertForMaskedLM of this config (closed form)."""
        h, i, layers = self.hidden_size, self.intermediate_size, self.num_hidden_layers
        norm = h * (2 if self.norm_bias else 1)
        attention = 3 * h * h + h * h + (4 * h if self.attention_bias else 0)
        mlp = 2 * h * i + i * h + (2 * i + h if self.mlp_bias else 0)
        # Embeddings and their norm, the layers (layer 0 without an attention norm), the final norm.
        encoder = self.vocab_size * h + norm + layers * (attention + mlp + 2 * norm) - norm + norm
        head = h * h + (h if self.classifier_bias else 0) + norm
        decoder = (0 if self.tie_word_embeddings else self.vocab_size * h) + (self.vocab_size if self.decoder_bias else 0)
        return encoder + head + decoder

    def check_length(self, length: int, flag: str) -> None:
        """Refuses sequences longer than the model was configured for (`flag` names the option)."""
        if length > self.max_position_embeddings:
            raise ValueError(f"{flag} {length} exceeds the model's max_position_embeddings "
                             f"{self.max_position_embeddings}: give at most {self.max_position_embeddings}")

    def replace(self, **changes) -> "ModernBertConfig":
        return dataclasses.replace(self, **changes)

    # ---- bertjax's own JSON (checkpoints) ---------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {"model_type": MODEL_TYPE, **dataclasses.asdict(self), "layer_types": list(self.layer_types)}

    @classmethod
    def from_dict(cls, values: dict[str, Any], source: str = "config") -> "ModernBertConfig":
        """Builds a config from a dict of its fields (and `model_type`); unknown keys are an error naming them."""
        values = {k: v for k, v in values.items() if k != "model_type"}
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"{source}: unknown ModernBertConfig keys {unknown}; expected a subset of {sorted(known)}")
        try:
            return cls(**{**values, "layer_types": tuple(values.get("layer_types", ()))})
        except (ValueError, TypeError) as error:
            raise ValueError(f"{source}: {error}") from None

    # ---- HF config.json -------------------------------------------------------------------------------------
    @classmethod
    def from_hf_dict(cls, values: dict[str, Any], source: str = "config.json") -> "ModernBertConfig":
        """Reads an HF ModernBertConfig dict as transformers does; a RoPE other than the default (scaled, YaRN...) is
        refused naming it. Keys that do not change the function (sparse prediction, flash-attention determinism,
        transformers' version...) are ignored."""
        if values.get("model_type") != MODEL_TYPE:
            raise ValueError(f"{source}: model_type {values.get('model_type')!r} is not {MODEL_TYPE!r}")
        fields = {key: values[key] for key in _HF_KEYS if values.get(key) is not None}
        layers = fields.get("num_hidden_layers", cls.num_hidden_layers)
        every = values.get("global_attn_every_n_layers", 3)
        if values.get("layer_types"):
            fields["layer_types"] = tuple(values["layer_types"])
            if "global_attn_every_n_layers" in values and isinstance(every, int) and every > 0 and \
                    fields["layer_types"] != alternating_layer_types(len(fields["layer_types"]), every):
                _said_new_key_wins(source, "layer_types", f"global_attn_every_n_layers={every}")
        else:
            if not isinstance(every, int) or every <= 0:
                raise ValueError(f"{source}: global_attn_every_n_layers must be a positive integer, got {every!r}")
            if isinstance(layers, int) and layers > 0:
                fields["layer_types"] = alternating_layer_types(layers, every)
        rope = values.get("rope_parameters") or {}
        scaling = values.get("rope_scaling")
        for layer_type, field, old_key in ((FULL, "global_rope_theta", "global_rope_theta"),
                                           (SLIDING, "local_rope_theta", "local_rope_theta")):
            params = dict(rope.get(layer_type) or {})
            if scaling:
                params.update(scaling)
            kind = params.get("rope_type", params.get("type", "default"))
            if kind != "default":
                raise ValueError(f"{source}: {layer_type} layers use rope_type {kind!r}; only the default rotary "
                                 "embeddings (ModernBERT's) are supported")
            theta = params.get("rope_theta", values.get(old_key))
            if "rope_theta" in params and values.get(old_key) is not None and values[old_key] != theta:
                _said_new_key_wins(source, f"rope_parameters.{layer_type}.rope_theta={theta}",
                                   f"{old_key}={values[old_key]}")
            if theta is not None:
                fields[field] = float(theta)
        return cls.from_dict(fields, source=source)

    def to_hf_dict(self, architecture: str = "ModernBertForMaskedLM", **extra) -> dict[str, Any]:
        """An HF config.json dict (transformers 5's spelling) for `architecture`; extra keys merged in."""
        values = {key: getattr(self, key) for key in _HF_KEYS}
        values.update(
            model_type=MODEL_TYPE,
            architectures=[architecture],
            layer_types=list(self.layer_types),
            rope_parameters={FULL: {"rope_type": "default", "rope_theta": self.global_rope_theta},
                             SLIDING: {"rope_type": "default", "rope_theta": self.local_rope_theta}},
            torch_dtype="float32",
        )
        values.update(extra)
        return values


def _said_new_key_wins(source: str, new: str, old: str) -> None:
    """One warning line: a config.json's two spellings of one setting disagree, and transformers' new one is used."""
    logging.getLogger(__name__).warning("%s: %s and %s disagree; %s is used, as transformers does", source, new, old,
                                        new.split("=")[0])
