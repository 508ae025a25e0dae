"""The encoder families, registered by HF's `model_type`: which family a config, a dict or an HF config.json is, and
each task's module for a config. Every job, reader and writer asks here (or asks `of(config)`, the family object:
`encoder_family.EncoderFamily` is what it answers) instead of naming a family; a new family is a folder of its own
(config, modules, family object) and its row in FAMILIES.
"""
from __future__ import annotations

from typing import Any

from etils import epath

from bertjax.model.bert.family import BERT
from bertjax.model.config_base import ConfigBase
from bertjax.model.encoder_family import EncoderFamily
from bertjax.model.modernbert.family import MODERNBERT
from bertjax.runtime.input_files import read_json

ModelConfig = ConfigBase  # a config of any family
FAMILIES: dict[str, EncoderFamily] = {family.model_type: family for family in (BERT, MODERNBERT)}
MODEL_TYPES = tuple(FAMILIES)
# A config JSON without a model_type is BERT's (Google's bert_config.json, bertjax's older checkpoints).
DEFAULT_MODEL_TYPE = BERT.model_type


def of(config: ModelConfig) -> EncoderFamily:
    """The family of a config object."""
    return FAMILIES[config.model_type]


def by_model_type(model_type: str, source: str = "config.json") -> EncoderFamily:
    """The family HF's `model_type` names; another is refused naming the known ones."""
    if model_type not in FAMILIES:
        known = [repr(name) for name in FAMILIES]
        raise ValueError(f"{source}: model_type {model_type!r} is neither {' nor '.join(known)}")
    return FAMILIES[model_type]


def of_preset(preset: str) -> EncoderFamily:
    """The family a pretraining job's `model.preset` builds (BERT for a name no family has: the preset itself is
    refused by `model_options.preset_sizes`)."""
    return next((family for family in FAMILIES.values() if preset in family.presets), FAMILIES[DEFAULT_MODEL_TYPE])


# ---- config readers -----------------------------------------------------------------------------------------------

def config_from_dict(values: dict[str, Any], source: str = "config") -> ModelConfig:
    """A checkpoint's own config JSON: ModernBERT's carries `model_type`, BERT's (older ones too) does not."""
    return by_model_type(values.get("model_type", DEFAULT_MODEL_TYPE), source).config_from_dict(values, source)


def config_from_hf_dict(values: dict[str, Any], source: str = "config.json") -> ModelConfig:
    """An HF config.json's dict, by its model_type (one of MODEL_TYPES; others refused naming them)."""
    return by_model_type(values.get("model_type", DEFAULT_MODEL_TYPE), source).config_from_hf_dict(values, source)


def config_from_json_file(path: str) -> ModelConfig:
    """Google's bert_config.json, an HF config.json (of any family), or bertjax's own config.json."""
    file = epath.Path(path)
    if file.exists():
        try:
            values = read_json(file, "a model config (JSON)")
        except ValueError:  # told by BertConfig.from_json_file below
            values = None
        if isinstance(values, dict) and "architectures" in values and "model_type" not in values:
            # transformers refuses it too ("Should have a `model_type` key"); read as BERT, a ModernBERT's tensors
            # were "not found", and the user asked whether it is a BERT checkpoint.
            raise ValueError(f"{path}: an HF config.json without model_type (architectures "
                             f"{values['architectures']}): it says which family the model is; add \"model_type\": "
                             + " or ".join(f'"{name}"' for name in MODEL_TYPES))
        family = FAMILIES.get(values.get("model_type")) if isinstance(values, dict) else None
        if family is not None and family is not BERT:
            if family.is_hf_dict(values):
                return family.config_from_hf_dict(values, path)
            return family.config_from_dict(values, path)
    return BERT.config_class.from_json_file(path)


# ---- each task's module, and the hooks: the config's family answers ---------------------------------------------

def encoder(config: ModelConfig):
    """The bare encoder, returning (sequence [B, L, H], None): no pooler."""
    return of(config).encoder(config)


def sequence_classifier(config: ModelConfig, num_labels: int):
    return of(config).sequence_classifier(config, num_labels)


def token_classifier(config: ModelConfig, num_labels: int):
    return of(config).token_classifier(config, num_labels)


def question_answering(config: ModelConfig):
    return of(config).question_answering(config)


def multiple_choice(config: ModelConfig):
    return of(config).multiple_choice(config)


def pretraining_model(config: ModelConfig, span_boundary_objective: bool = False):
    """The module a pretraining job trains: BERT's MLM + NSP (+ SBO) model, ModernBERT's masked LM (MLM alone)."""
    return of(config).pretraining_model(config, span_boundary_objective)


def init_params(module, config: ModelConfig, rng, length: int = 8, num_masked: int = 2):
    """Initial (boxed, logically partitioned) params of any module of any family."""
    return of(config).init_params(module, config, rng, length, num_masked)


def counted_params(params: dict, config: ModelConfig) -> dict:
    """`params` as transformers counts them (ModernBERT's: without its unused layer-0 attention norm)."""
    return of(config).counted_params(params)


def loop_invariant_params(params: dict, config: ModelConfig) -> dict:
    """`params` as a loop over microbatches takes them (ModernBERT's projection kernels already in the compute
    dtype: cast once a step, the same bits)."""
    return of(config).loop_invariant_params(params, config)


def activation(config: ModelConfig) -> str:
    """The feed-forward activation's name (BERT's hidden_act, ModernBERT's hidden_activation)."""
    return of(config).activation(config)


# ---- HF class names ----------------------------------------------------------------------------------------------
# bertjax names a fine-tuned head's task by BERT's class ("BertForSequenceClassification"), whatever the family; the
# class written to (or read from) an HF config.json is the family's.

def task_architecture(architecture: str | None) -> str | None:
    """An HF class name as the task it is, by BERT's class name ("ModernBertForTokenClassification" ->
    "BertForTokenClassification"); BERT's names and None unchanged."""
    if not architecture:
        return architecture
    for family in sorted(FAMILIES.values(), key=lambda f: -len(f.class_prefix)):
        if architecture.startswith(family.class_prefix):
            return BERT.class_prefix + architecture[len(family.class_prefix):]
    return architecture


def hf_architecture(config: ModelConfig, task: str) -> str:
    """The family's HF class for a task named by BERT's class (ModernBERT has no NSP: pretraining is its
    ModernBertForMaskedLM)."""
    return of(config).hf_architecture(task)
