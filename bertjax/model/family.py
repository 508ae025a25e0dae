"""The two encoder families behind one set of functions: BERT (`bert.py`, BertConfig) and ModernBERT
(`modernbert.py`, ModernBertConfig). Which config a dict or an HF config.json describes (by `model_type`), and each
task's module for a config; every job, reader and writer asks here instead of naming a family's classes.
"""
from __future__ import annotations

from typing import Any, Union

from etils import epath

from bertjax.runtime.input_files import read_json
from bertjax.model import bert, modernbert
from bertjax.model.config import BertConfig
from bertjax.model.modernbert_config import MODEL_TYPE as MODERNBERT
from bertjax.model.modernbert_config import ModernBertConfig

ModelConfig = Union[BertConfig, ModernBertConfig]
MODEL_TYPES = ("bert", MODERNBERT)


def is_modernbert(config: ModelConfig) -> bool:
    return isinstance(config, ModernBertConfig)


def config_from_dict(values: dict[str, Any], source: str = "config") -> ModelConfig:
    """A checkpoint's own config JSON: ModernBERT's carries `model_type`, BERT's (older ones too) does not."""
    if values.get("model_type", "bert") == MODERNBERT:
        return ModernBertConfig.from_dict(values, source=source)
    return BertConfig.from_dict({k: v for k, v in values.items() if k != "model_type"}, source=source)


def config_from_hf_dict(values: dict[str, Any], source: str = "config.json") -> ModelConfig:
    """An HF config.json's dict, by its model_type ("bert" or "modernbert"; others refused naming them)."""
    model_type = values.get("model_type", "bert")
    if model_type == MODERNBERT:
        return ModernBertConfig.from_hf_dict(values, source=source)
    if model_type != "bert":
        raise ValueError(f"{source}: model_type {model_type!r} is neither 'bert' nor 'modernbert'")
    return BertConfig.from_hf_dict(values, source=source)


def config_from_json_file(path: str) -> ModelConfig:
    """Google's bert_config.json, an HF config.json (BERT or ModernBERT), or bertjax's own config.json."""
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
                             f"\"bert\" or \"modernbert\"")
        if isinstance(values, dict) and values.get("model_type") == MODERNBERT:
            if "architectures" in values or "rope_parameters" in values or "global_rope_theta" in values:
                return ModernBertConfig.from_hf_dict(values, source=path)
            return ModernBertConfig.from_dict(values, source=path)
    return BertConfig.from_json_file(path)


# ---- each task's module -------------------------------------------------------------------------------------------

def encoder(config: ModelConfig):
    """The bare encoder, returning (sequence [B, L, H], None): no pooler."""
    return modernbert.ModernBertModel(config) if is_modernbert(config) else bert.BertModel(config, add_pooler=False)


def sequence_classifier(config: ModelConfig, num_labels: int):
    if is_modernbert(config):
        return modernbert.ModernBertForSequenceClassification(config, num_labels)
    return bert.BertForSequenceClassification(config, num_labels)


def token_classifier(config: ModelConfig, num_labels: int):
    if is_modernbert(config):
        return modernbert.ModernBertForTokenClassification(config, num_labels)
    return bert.BertForTokenClassification(config, num_labels)


def question_answering(config: ModelConfig):
    if is_modernbert(config):
        return modernbert.ModernBertForQuestionAnswering(config)
    return bert.BertForQuestionAnswering(config)


def multiple_choice(config: ModelConfig):
    if is_modernbert(config):
        return modernbert.ModernBertForMultipleChoice(config)
    return bert.BertForMultipleChoice(config)


def init_params(module, config: ModelConfig, rng, length: int = 8, num_masked: int = 2):
    """Initial (boxed, logically partitioned) params of any module of either family."""
    if is_modernbert(config):
        return modernbert.init_params(module, config, rng, length, num_masked)
    return bert.init_params(module, config, rng, length, num_masked)


# ---- HF class names ----------------------------------------------------------------------------------------------
# bertjax names a fine-tuned head's task by BERT's class ("BertForSequenceClassification"), whatever the family; the
# class written to (or read from) an HF config.json is the family's.

def task_architecture(architecture: str | None) -> str | None:
    """An HF class name as the task it is, by BERT's class name ("ModernBertForTokenClassification" ->
    "BertForTokenClassification"); BERT's names and None unchanged."""
    if architecture and architecture.startswith("ModernBert"):
        return "Bert" + architecture[len("ModernBert"):]
    return architecture


def hf_architecture(config: ModelConfig, task: str) -> str:
    """The family's HF class for a task named by BERT's class (ModernBERT has no NSP: pretraining is its
    ModernBertForMaskedLM)."""
    if not is_modernbert(config):
        return task
    return "ModernBertForMaskedLM" if task in ("BertForPreTraining", "BertForMaskedLM") else "Modern" + task


def counted_params(params: dict, config: ModelConfig) -> dict:
    """`params` as transformers counts them: without ModernBERT's unused layer-0 attention norm (HF's Identity)."""
    layer_0 = params.get("bert", {}).get("layer_0")
    if not is_modernbert(config) or layer_0 is None or "attn_norm" not in layer_0:
        return params
    return {**params, "bert": {**params["bert"],
                               "layer_0": {k: v for k, v in layer_0.items() if k != "attn_norm"}}}


def loop_invariant_params(params: dict, config: ModelConfig) -> dict:
    """`params` as a loop over microbatches takes them: ModernBERT's projection kernels already in the compute dtype
    (`modernbert.with_compute_dtype`: cast once a step, the same bits); BERT's as they are."""
    return modernbert.with_compute_dtype(params, config) if is_modernbert(config) else params


def pretraining_model(config: ModelConfig, span_boundary_objective: bool = False):
    """The module a pretraining job trains: BERT's MLM + NSP (+ SBO) model, ModernBERT's masked LM (MLM alone)."""
    if is_modernbert(config):
        if span_boundary_objective:
            raise ValueError("ModernBERT has no span boundary objective head")
        return modernbert.ModernBertForMaskedLM(config)
    return bert.BertForPreTraining(config, span_boundary_objective=span_boundary_objective)


def activation(config: ModelConfig) -> str:
    """The feed-forward activation's name (BERT's hidden_act, ModernBERT's hidden_activation)."""
    return config.hidden_activation if is_modernbert(config) else config.hidden_act
