"""A pretraining job's `model.*` options, for either family, and the model config they build.

`model.preset` names a size: BERT's (tiny .. large, as Google released them) or ModernBERT's (`modernbert-tiny`,
`-base`, `-large`); the preset decides the family. The other `model.*` keys are BertConfig's fields (derived from
it: no option or default written twice), the sizes and compute settings shared by both families; ModernBERT's own
settings are `model.modernbert.*` (ModernBertConfig's fields, its layer pattern as `global_attn_every_n_layers`). A
key of the other family changed from its default is refused, naming the family's own key where it has one.
"""
from __future__ import annotations

import dataclasses

from bertjax.model.config import ACTIVATIONS, ATTENTION_BACKENDS, DTYPES, PRESETS, REMAT_POLICIES, BertConfig
from bertjax.model.modernbert_config import ModernBertConfig, alternating_layer_types
from bertjax.options import floats, ints, option

# name -> (layers, hidden, heads, intermediate, window): ModernBERT's released shapes, and a tiny one for tests and
# the CPU demo (BERT-tiny's width; the window half the demo's 64-token rows).
MODERNBERT_PRESETS = {
    "modernbert-tiny": (4, 128, 2, 192, 32),
    "modernbert-base": (22, 768, 12, 1152, 128),
    "modernbert-large": (28, 1024, 16, 2624, 128),
}
ALL_PRESETS = (*PRESETS, *MODERNBERT_PRESETS)
# The fields a preset sets (and vocab_size, which a job takes from its vocabulary).
PRESET_FIELDS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size")
# Shared by both families: sizes, positions and bertjax's compute settings.
COMPUTE = ("dtype", "attention_backend", "scan_layers", "remat")  # bertjax's own, not a checkpoint's architecture
SHARED_FIELDS = (*PRESET_FIELDS, "max_position_embeddings", "initializer_range", *COMPUTE)
# What each field is, as a pretraining job's `model.*` key (`config show --describe`, --help).
FIELD_HELP = {
    "vocab_size": "rows of the word embedding table and the MLM softmax (0: the vocabulary's size)",
    "hidden_size": "width of every layer (0: the preset's)",
    "num_hidden_layers": "encoder layers (0: the preset's)",
    "num_attention_heads": "attention heads per layer; hidden_size must divide by it (0: the preset's)",
    "intermediate_size": "feed-forward inner width (0: the preset's, 4 x hidden_size)",
    "hidden_act": f"feed-forward activation: {' | '.join(ACTIVATIONS)} (gelu: the exact erf form; gelu_new: the "
                  "tanh approximation google-research/bert computed)",
    "hidden_dropout_prob": "dropout on the embeddings and on each sublayer's output",
    "attention_probs_dropout_prob": "dropout on the attention probabilities",
    "max_position_embeddings": "position embedding rows: the longest sequence the model takes",
    "type_vocab_size": "token type (segment A/B) embedding rows",
    "initializer_range": "standard deviation of the truncated normal that initialises fresh weights",
    "layer_norm_eps": "LayerNorm's epsilon",
    "pad_token_id": "the padding token's id",
    "dtype": f"compute dtype of the matmuls: {' | '.join(DTYPES)} (params stay float32; softmax, LayerNorm and the "
             "losses run in float32)",
    "attention_backend": f"{' | '.join(ATTENTION_BACKENDS)} (auto: by the platform compiled for, the length and "
                         "attention dropout)",
    "scan_layers": "run the encoder as one nn.scan over stacked layers (XLA compiles one layer; slower steps)",
    # ModernBERT's own (model.modernbert.*)
    "hidden_activation": f"ModernBERT's GeGLU activation: {' | '.join(ACTIVATIONS)}",
    "initializer_cutoff_factor": "fresh weights: a normal cut at this many standard deviations",
    "norm_eps": "LayerNorm's epsilon",
    "norm_bias": "LayerNorms with a bias",
    "attention_bias": "biases in the q/k/v and output projections",
    "attention_dropout": "dropout on the attention probabilities and on the attention block's output",
    "global_rope_theta": "RoPE's theta in the global layers",
    "local_rope_theta": "RoPE's theta in the sliding-window layers",
    "embedding_dropout": "dropout on the embeddings' output",
    "mlp_bias": "biases in the GeGLU's projections",
    "mlp_dropout": "dropout inside the GeGLU, before its output projection",
    "decoder_bias": "a bias on the MLM decoder's logits",
    "classifier_pooling": "a task head's pooling: cls (the first token) | mean (over the real tokens)",
    "classifier_dropout": "dropout before a task's classifier",
    "classifier_bias": "a bias in the prediction head's dense layer",
    "classifier_activation": f"the prediction head's activation: {' | '.join(ACTIVATIONS)}",
    "tie_word_embeddings": "the MLM decoder's weight is the token embeddings",
    "remat": f"recompute each layer in the backward pass: {' | '.join(REMAT_POLICIES)} (dots: keep the matmul "
             "outputs; full: keep only each layer's input, ~1/3 more FLOPs, least memory)",
}


# The ranges of the model's numeric keys, checked as `--set model.KEY=VALUE` is parsed (the config classes check
# them again, with the sizes, when the job builds the model).
_PROBABILITY, _POSITIVE = floats(0, 1, high_open=True), floats(0, low_open=True)
_MODEL_RANGES = {"hidden_dropout_prob": _PROBABILITY, "attention_probs_dropout_prob": _PROBABILITY,
                 "max_position_embeddings": ints(1), "type_vocab_size": ints(1), "initializer_range": _POSITIVE,
                 "layer_norm_eps": _POSITIVE, "pad_token_id": ints(0),
                 # ModernBERT's
                 "initializer_cutoff_factor": _POSITIVE, "norm_eps": _POSITIVE, "attention_dropout": _PROBABILITY,
                 "global_rope_theta": _POSITIVE, "local_rope_theta": _POSITIVE, "local_attention": ints(0),
                 "embedding_dropout": _PROBABILITY, "mlp_dropout": _PROBABILITY, "classifier_dropout": _PROBABILITY}
# BERT's keys with a ModernBERT counterpart of another name (what a refusal points to).
_MODERNBERT_NAME = {"hidden_act": "model.modernbert.hidden_activation", "layer_norm_eps": "model.modernbert.norm_eps",
                    "hidden_dropout_prob": "model.modernbert.embedding_dropout / mlp_dropout",
                    "attention_probs_dropout_prob": "model.modernbert.attention_dropout"}


def _modernbert_option_fields() -> list:
    # Token ids come from the job's vocabulary; the layer pattern is given as HF's older, simpler key.
    skipped = {*SHARED_FIELDS, "pad_token_id", "bos_token_id", "eos_token_id", "cls_token_id", "sep_token_id",
               "layer_types"}
    fields = [(f.name, f.type, option(f.default, FIELD_HELP.get(f.name, ""), valid=_MODEL_RANGES.get(f.name)))
              if f.name != "local_attention" else (f.name, int, option(0, "the whole window of sliding-window layers (HF's local_attention); 0: "
                                           "the preset's", valid=ints(0)))
              for f in dataclasses.fields(ModernBertConfig) if f.name not in skipped]
    fields.append(("global_attn_every_n_layers", int, option(3, "every n-th layer (from the first) attends "
                                                                "globally, the others in the window", valid=ints(1))))
    return fields


# `model.modernbert.*`: what a ModernBERT preset's job sets beyond the shared keys.
ModernBertOptions = dataclasses.make_dataclass("ModernBertOptions", _modernbert_option_fields(), frozen=True,
                                               namespace={"__module__": __name__})


def _model_option_fields() -> list:
    fields = [("preset", str, option("base", f"model size and family: {' | '.join(ALL_PRESETS)}"))]
    for field in dataclasses.fields(BertConfig):
        if field.name in PRESET_FIELDS:
            fields.append((field.name, int, option(0, FIELD_HELP[field.name], valid=ints(0))))
        else:
            fields.append((field.name, field.type, option(field.default, FIELD_HELP.get(field.name, ""),
                                                          valid=_MODEL_RANGES.get(field.name))))
    fields.append(("modernbert", ModernBertOptions, option(default_factory=ModernBertOptions,
                                                           help="ModernBERT's own settings (modernbert-* presets)")))
    return fields


# A pretraining job's `model.*` keys. Size fields left at 0 come from the preset.
ModelOptions = dataclasses.make_dataclass("ModelOptions", _model_option_fields(), frozen=True,
                                          namespace={"__module__": __name__})


def is_modernbert_preset(preset: str) -> bool:
    return preset in MODERNBERT_PRESETS


def preset_sizes(preset: str) -> dict[str, int]:
    """The sizes a preset gives (PRESET_FIELDS but the vocabulary's)."""
    if preset in MODERNBERT_PRESETS:
        layers, hidden, heads, intermediate, _ = MODERNBERT_PRESETS[preset]
    elif preset in PRESETS:
        layers, hidden, heads = PRESETS[preset]
        intermediate = 4 * hidden
    else:
        raise ValueError(f"model.preset={preset!r}; expected one of {', '.join(ALL_PRESETS)}")
    return dict(num_hidden_layers=layers, hidden_size=hidden, num_attention_heads=heads,
                intermediate_size=intermediate)


def other_family_keys(model) -> list[str]:
    """`model.*` keys of the family the preset does not name, changed from their defaults (refused: they would be
    ignored)."""
    defaults = ModelOptions()
    if is_modernbert_preset(model.preset):
        bert_only = [f.name for f in dataclasses.fields(BertConfig) if f.name not in SHARED_FIELDS]
        return [f"model.{k}" + (f" (ModernBERT's: {_MODERNBERT_NAME[k]})" if k in _MODERNBERT_NAME else "")
                for k in bert_only if getattr(model, k) != getattr(defaults, k)]
    return [f"model.modernbert.{f.name}" for f in dataclasses.fields(ModernBertOptions)
            if getattr(model.modernbert, f.name) != getattr(defaults.modernbert, f.name)]


def build_model_config(model, vocab_size: int, special_ids: dict[str, int | None] | None = None):
    """The BertConfig or ModernBertConfig of a job's `model.*` options, with `vocab_size` from its vocabulary
    unless set; `special_ids` ({"pad", "cls", "sep"}: the vocabulary's) give ModernBERT's token ids."""
    sizes = preset_sizes(model.preset)
    sizes.update({k: getattr(model, k) for k in PRESET_FIELDS if k != "vocab_size" and getattr(model, k)})
    sizes["vocab_size"] = model.vocab_size or vocab_size
    wrong = other_family_keys(model)
    if wrong:
        family = "ModernBERT" if is_modernbert_preset(model.preset) else "BERT"
        raise ValueError(f"model.preset={model.preset} is a {family} model; {', '.join(wrong)} belong to the other "
                         "family and would be ignored: leave them at their defaults")
    shared = {k: getattr(model, k) for k in SHARED_FIELDS if k not in PRESET_FIELDS}
    if not is_modernbert_preset(model.preset):
        values = {f.name: getattr(model, f.name) for f in dataclasses.fields(BertConfig)}
        return BertConfig(**{**values, **sizes})
    options = dataclasses.asdict(model.modernbert)
    every = options.pop("global_attn_every_n_layers")
    ids = special_ids or {}
    tokens = {"pad_token_id": ids.get("pad", 0) or 0}
    for key, name in (("cls_token_id", "cls"), ("sep_token_id", "sep"), ("bos_token_id", "cls"),
                      ("eos_token_id", "sep")):
        tokens[key] = ids.get(name)
    options["local_attention"] = options["local_attention"] or MODERNBERT_PRESETS[model.preset][4]
    return ModernBertConfig(**sizes, **shared, **options, **tokens,
                            layer_types=alternating_layer_types(sizes["num_hidden_layers"], every))


def options_of(config) -> dict[str, object]:
    """The `model.*` keys (dotted, below `model.`) that build `config` again (`--config init`: a checkpoint's model
    as a job's options). A ModernBERT whose layer pattern is not every-n-th-global is refused naming it."""
    if not isinstance(config, ModernBertConfig):  # its architecture; compute settings stay the job's
        return {f.name: getattr(config, f.name) for f in dataclasses.fields(BertConfig) if f.name not in COMPUTE}
    every = next((n for n in range(1, config.num_hidden_layers + 1)
                  if alternating_layer_types(config.num_hidden_layers, n) == config.layer_types), None)
    if every is None:
        raise ValueError(f"the checkpoint's layer_types {list(config.layer_types)} are not a global layer every "
                         "n-th (from the first), the pattern model.modernbert.global_attn_every_n_layers sets")
    values = {"preset": "modernbert-base", **{k: getattr(config, k) for k in PRESET_FIELDS},
              "max_position_embeddings": config.max_position_embeddings,
              "initializer_range": config.initializer_range, "modernbert.global_attn_every_n_layers": every}
    for field in dataclasses.fields(ModernBertOptions):
        if field.name != "global_attn_every_n_layers":
            values[f"modernbert.{field.name}"] = getattr(config, field.name)
    return values
