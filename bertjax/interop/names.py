"""The one table of BERT tensors: our param path <-> HF PyTorch key <-> Google TF variable name.

Every importer and exporter is driven by this table, so a name is written down once. Layouts:
- ours (Flax): Dense kernels [in, out] (the attention projections' too); the q/k/v biases split by head,
  [heads, head_dim].
- HF PyTorch: Linear weight [out, in]; LayerNorm weight/bias.
- Google TF: kernels [in, out] (as ours, but unsplit); LayerNorm gamma/beta; seq_relationship/output_weights
  is [2, H], i.e. stored like a PyTorch weight.
"""
from __future__ import annotations

import dataclasses

import numpy as np

# Groups of tensors that a checkpoint may or may not hold (a BertModel dump has no MLM/NSP heads, a
# BertForMaskedLM has no pooler and no NSP head, a fine-tuned model has a classifier or qa_outputs). The
# sequence and token classifiers share the `classifier` tensors ([num_labels, H] in HF); only the sequence one has a pooler.
GROUPS = ("encoder", "pooler", "mlm", "nsp", "classifier", "qa_outputs", "sbo", "head")
# SpanBERT's span boundary objective head has no HF BERT counterpart: the HF export writes it to this file beside
# model.safetensors (PyTorch layout, the "hf" names of the table), so transformers loads the BERT model without
# unexpected keys.
SBO_GROUP, SBO_FILE = "sbo", "span_boundary_head.safetensors"


@dataclasses.dataclass(frozen=True)
class TensorName:
    path: tuple[str, ...]   # our param path
    hf: str                 # HF key without the "bert." prefix of the task models for encoder/pooler tensors
    tf: str | None          # Google TF variable name (None: no TF counterpart)
    kind: str               # "embedding" | "vector" | "kernel"
    group: str
    tf_transposed: bool = False  # TF stores this kernel as [out, in]

    @property
    def hf_is_linear(self) -> bool:
        return self.kind == "kernel"


def _encoder_names(num_layers: int) -> list[TensorName]:
    names = []

    def add(path, hf, tf, kind, group="encoder"):
        names.append(TensorName(path, hf, tf, kind, group))

    def layer_norm(path, hf, tf, group="encoder"):
        add(path + ("scale",), hf + ".weight", tf + "/gamma", "vector", group)
        add(path + ("bias",), hf + ".bias", tf + "/beta", "vector", group)

    def dense(path, hf, tf, group="encoder"):
        add(path + ("kernel",), hf + ".weight", tf + "/kernel", "kernel", group)
        add(path + ("bias",), hf + ".bias", tf + "/bias", "vector", group)

    emb = ("bert", "embeddings")
    for name in ("word_embeddings", "position_embeddings", "token_type_embeddings"):
        add(emb + (name, "embedding"), f"embeddings.{name}.weight", f"bert/embeddings/{name}", "embedding")
    layer_norm(emb + ("LayerNorm",), "embeddings.LayerNorm", "bert/embeddings/LayerNorm")
    for i in range(num_layers):
        ours, hf, tf = ("bert", f"layer_{i}"), f"encoder.layer.{i}", f"bert/encoder/layer_{i}"
        for proj in ("query", "key", "value"):
            dense(ours + ("attention", "self", proj), f"{hf}.attention.self.{proj}",
                  f"{tf}/attention/self/{proj}")
        dense(ours + ("attention", "output_dense"), f"{hf}.attention.output.dense",
              f"{tf}/attention/output/dense")
        layer_norm(ours + ("attention", "output_LayerNorm"), f"{hf}.attention.output.LayerNorm",
                   f"{tf}/attention/output/LayerNorm")
        dense(ours + ("intermediate",), f"{hf}.intermediate.dense", f"{tf}/intermediate/dense")
        dense(ours + ("output",), f"{hf}.output.dense", f"{tf}/output/dense")
        layer_norm(ours + ("output_LayerNorm",), f"{hf}.output.LayerNorm", f"{tf}/output/LayerNorm")
    dense(("bert", "pooler"), "pooler.dense", "bert/pooler/dense", group="pooler")
    return names


def tensor_names(num_layers: int) -> list[TensorName]:
    """All tensors of a BertForPreTraining plus the fine-tuning heads, for `num_layers` layers."""
    names = _encoder_names(num_layers)
    names += [
        TensorName(("predictions", "transform_dense", "kernel"), "cls.predictions.transform.dense.weight",
                   "cls/predictions/transform/dense/kernel", "kernel", "mlm"),
        TensorName(("predictions", "transform_dense", "bias"), "cls.predictions.transform.dense.bias",
                   "cls/predictions/transform/dense/bias", "vector", "mlm"),
        TensorName(("predictions", "transform_LayerNorm", "scale"), "cls.predictions.transform.LayerNorm.weight",
                   "cls/predictions/transform/LayerNorm/gamma", "vector", "mlm"),
        TensorName(("predictions", "transform_LayerNorm", "bias"), "cls.predictions.transform.LayerNorm.bias",
                   "cls/predictions/transform/LayerNorm/beta", "vector", "mlm"),
        TensorName(("predictions", "output_bias"), "cls.predictions.bias", "cls/predictions/output_bias",
                   "vector", "mlm"),
        TensorName(("seq_relationship", "kernel"), "cls.seq_relationship.weight",
                   "cls/seq_relationship/output_weights", "kernel", "nsp", tf_transposed=True),
        TensorName(("seq_relationship", "bias"), "cls.seq_relationship.bias", "cls/seq_relationship/output_bias",
                   "vector", "nsp"),
        # Fine-tuning heads (run_classifier / run_squad name them output_weights/output_bias too).
        TensorName(("classifier", "kernel"), "classifier.weight", "output_weights", "kernel", "classifier",
                   tf_transposed=True),
        TensorName(("classifier", "bias"), "classifier.bias", "output_bias", "vector", "classifier"),
        TensorName(("qa_outputs", "kernel"), "qa_outputs.weight", "cls/squad/output_weights", "kernel",
                   "qa_outputs", tf_transposed=True),
        TensorName(("qa_outputs", "bias"), "qa_outputs.bias", "cls/squad/output_bias", "vector", "qa_outputs"),
        # SpanBERT's SBO head (model.SpanBoundaryHead); no TF counterpart.
        TensorName(("span_boundary", "position_embeddings"), "span_boundary.position_embeddings.weight", None,
                   "embedding", SBO_GROUP),
    ]
    for i in (1, 2):
        names += [
            TensorName(("span_boundary", f"dense_{i}", "kernel"), f"span_boundary.dense_{i}.weight", None, "kernel",
                       SBO_GROUP),
            TensorName(("span_boundary", f"dense_{i}", "bias"), f"span_boundary.dense_{i}.bias", None, "vector",
                       SBO_GROUP),
            TensorName(("span_boundary", f"LayerNorm_{i}", "scale"), f"span_boundary.LayerNorm_{i}.weight", None,
                       "vector", SBO_GROUP),
            TensorName(("span_boundary", f"LayerNorm_{i}", "bias"), f"span_boundary.LayerNorm_{i}.bias", None,
                       "vector", SBO_GROUP),
        ]
    names.append(TensorName(("span_boundary", "output_bias"), "span_boundary.bias", None, "vector", SBO_GROUP))
    return names


# ---- ModernBERT (HF's ModernBertForMaskedLM and task models; no TF counterpart) ---------------------------------
# HF's task models hold the encoder under "model."; the prediction head ("head.") sits under every task, the MLM
# decoder's weight is the token embeddings (tied) and its bias "decoder.bias". Ours: the encoder under `bert` (as
# BERT's), Wqkv's kernel [H, 3, H] and Wi's [H, 2, I] (HF: [3H, H], [2I, H]; the same numbers, row-major).
MODERNBERT_HEAD_GROUPS = ("head", "mlm", "classifier")


def modernbert_tensor_names(config) -> list[TensorName]:
    """Every tensor of a ModernBertForMaskedLM of `config` plus the task models' classifier (optional biases as
    the config has them). Layer 0's attention norm, which HF does not have, is not listed."""
    names = []

    def add(path, hf, kind, group="encoder"):
        names.append(TensorName(path, hf, None, kind, group))

    def norm(path, hf, group="encoder"):
        add(path + ("scale",), hf + ".weight", "vector", group)
        if config.norm_bias:
            add(path + ("bias",), hf + ".bias", "vector", group)

    def linear(path, hf, bias: bool, group="encoder"):
        add(path + ("kernel",), hf + ".weight", "kernel", group)
        if bias:
            add(path + ("bias",), hf + ".bias", "vector", group)

    add(("bert", "embeddings", "tok_embeddings"), "model.embeddings.tok_embeddings.weight", "embedding")
    norm(("bert", "embeddings", "norm"), "model.embeddings.norm")
    for i in range(config.num_hidden_layers):
        ours, hf = ("bert", f"layer_{i}"), f"model.layers.{i}"
        if i:
            norm(ours + ("attn_norm",), f"{hf}.attn_norm")
        linear(ours + ("attn", "Wqkv"), f"{hf}.attn.Wqkv", config.attention_bias)
        linear(ours + ("attn", "Wo"), f"{hf}.attn.Wo", config.attention_bias)
        norm(ours + ("mlp_norm",), f"{hf}.mlp_norm")
        linear(ours + ("mlp", "Wi"), f"{hf}.mlp.Wi", config.mlp_bias)
        linear(ours + ("mlp", "Wo"), f"{hf}.mlp.Wo", config.mlp_bias)
    norm(("bert", "final_norm"), "model.final_norm")
    linear(("head", "dense"), "head.dense", config.classifier_bias, group="head")
    norm(("head", "norm"), "head.norm", group="head")
    if not config.tie_word_embeddings:
        add(("decoder", "kernel"), "decoder.weight", "kernel", "mlm")
    if config.decoder_bias:
        add(("decoder_bias",), "decoder.bias", "vector", "mlm")
    linear(("classifier",), "classifier", True, group="classifier")
    return names


def tensor_names_for(config) -> list[TensorName]:
    """The table of `config`'s family, by its model_type."""
    return _TABLES[config.model_type](config)


# HF's tensor names of each family (`family.FAMILIES`' keys).
_TABLES = {"bert": lambda config: tensor_names(config.num_hidden_layers), "modernbert": modernbert_tensor_names}


# ---- layout conversions -------------------------------------------------------------------------------------

def to_flat_inout(name: TensorName, ours: np.ndarray) -> np.ndarray:
    """Our tensor in the unsplit layout of TF (kernels [in, out], biases 1-D)."""
    if name.kind == "vector":
        return ours.reshape(-1)
    return ours.reshape(ours.shape[0], -1) if name.kind == "kernel" else ours


def to_hf(name: TensorName, ours: np.ndarray) -> np.ndarray:
    flat = to_flat_inout(name, ours)
    return np.ascontiguousarray(flat.T) if name.hf_is_linear else flat


def to_tf(name: TensorName, ours: np.ndarray) -> np.ndarray:
    flat = to_flat_inout(name, ours)
    return np.ascontiguousarray(flat.T) if name.tf_transposed else flat


def expected_source_shape(name: TensorName, our_shape: tuple[int, ...], source: str) -> tuple[int, ...]:
    """The shape `source` ("hf" or "tf") stores for a tensor whose shape is `our_shape` here."""
    return (to_hf if source == "hf" else to_tf)(name, np.empty(our_shape, np.float32)).shape


def from_source(name: TensorName, value: np.ndarray, our_shape: tuple[int, ...], source: str) -> np.ndarray:
    """A tensor read from `source` ("hf" or "tf"), of the shape `expected_source_shape` gives, in our layout."""
    transposed = name.hf_is_linear if source == "hf" else name.tf_transposed
    value = value.T if transposed else value
    return np.ascontiguousarray(value.reshape(our_shape))
