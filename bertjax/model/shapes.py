"""The param shapes a config (BERT's or ModernBERT's) implies, and a checkpoint's stored shapes checked against them.

A checkpoint's config is metadata that can disagree with its tensors (edited by hand, copied from another model):
every reader checks the tensors' shapes (Orbax metadata, safetensors or TF headers: nothing read) against the
shapes the model builds from the config, and a mismatch names the config field and value and the tensor and shape.
"""
from __future__ import annotations

import functools
import re

import flax.linen as nn
import jax

from bertjax.model import bert as model_lib
from bertjax.model import family
from bertjax.model import modernbert
from bertjax.model.config import BertConfig
from bertjax.model.modernbert_config import ModernBertConfig

# A config whose sizes are all different numbers: the shape the model builds from it tells which field sets each
# dimension (hidden 39 = 3 heads of 13; the SBO head's first dense takes 3 * hidden).
_PROBE = BertConfig(vocab_size=43, hidden_size=39, num_hidden_layers=7, num_attention_heads=3, intermediate_size=41,
                    max_position_embeddings=47, type_vocab_size=5)
_PROBE_LABELS = 11
_FIELD_OF_SIZE = {43: "vocab_size", 39: "hidden_size", 117: "hidden_size", 13: "hidden_size", 7: "num_hidden_layers",
                  3: "num_attention_heads", 41: "intermediate_size", 47: "max_position_embeddings",
                  5: "type_vocab_size"}
# ModernBERT's probe: its head size must be even (rotary embeddings), 3 and 2 are fixed axes of Wqkv and Wi.
_MODERNBERT_PROBE = ModernBertConfig(vocab_size=43, hidden_size=42, num_hidden_layers=7, num_attention_heads=3,
                                     intermediate_size=41, max_position_embeddings=47, pad_token_id=0)
_MODERNBERT_FIELD_OF_SIZE = {43: "vocab_size", 42: "hidden_size", 7: "num_hidden_layers", 41: "intermediate_size"}
_LAYER = re.compile(r"^layer_\d+$")

Path = tuple[str, ...]


def _shapes_of(module, config, heads_only: tuple[str, ...] = ()) -> dict[Path, tuple[int, ...]]:
    tree = jax.eval_shape(lambda: family.init_params(module, config, jax.random.key(0)))
    flat = jax.tree_util.tree_flatten_with_path(nn.meta.unbox(tree))[0]
    out = {tuple(k.key for k in path): tuple(leaf.shape) for path, leaf in flat}
    return {p: s for p, s in out.items() if not heads_only or p[0] in heads_only}


def param_shapes(config, num_labels: int | None = None) -> dict[Path, tuple[int, ...]]:
    """Shape of every param path of the config's family's largest model (BERT: BertForPreTraining with the SBO head
    and the qa_outputs head; ModernBERT: ModernBertForMaskedLM), + a classifier of `num_labels`, in the layer
    layout `config.scan_layers` says (per layer, or stacked under `bert/layers`)."""
    if family.is_modernbert(config):
        shapes = _shapes_of(modernbert.ModernBertForMaskedLM(config.replace(scan_layers=False)), config)
        if num_labels is not None:
            shapes.update(_shapes_of(modernbert.ModernBertForSequenceClassification(
                config.replace(scan_layers=False), num_labels), config, ("classifier",)))
        return _stacked_shapes(shapes, config.num_hidden_layers) if config.scan_layers else shapes
    shapes = _shapes_of(model_lib.BertForPreTraining(config, span_boundary_objective=True), config)
    shapes.update(_shapes_of(model_lib.BertForQuestionAnswering(config), config, ("qa_outputs",)))
    if num_labels is not None:
        shapes.update(_shapes_of(model_lib.BertForSequenceClassification(config, num_labels), config,
                                 ("classifier",)))
    return shapes


def _stacked_shapes(shapes: dict[Path, tuple[int, ...]], layers: int) -> dict[Path, tuple[int, ...]]:
    """Per-layer shapes as the stacked layout holds them: `bert/layers/...` with the layer axis first."""
    out = {}
    for path, shape in shapes.items():
        if len(path) > 1 and path[0] == "bert" and _LAYER.match(path[1]):
            if path[1] == "layer_0":
                out[("bert", model_lib.STACKED) + path[2:]] = (layers, *shape)
        else:
            out[path] = shape
    return out


@functools.lru_cache(maxsize=None)
def _probe_shapes(stacked: bool, modern: bool) -> dict[Path, tuple[int, ...]]:
    probe = _MODERNBERT_PROBE if modern else _PROBE
    return param_shapes(probe.replace(scan_layers=stacked), _PROBE_LABELS)


def probe_shape(path: Path, stacked: bool = False, config=None) -> tuple[int, ...] | None:
    """The shape of `path` in the probe model of `config`'s family (default BERT; any layer_N read as layer_0),
    for `size_field`."""
    path = tuple("layer_0" if _LAYER.match(part) else part for part in path)
    return _probe_shapes(stacked, config is not None and family.is_modernbert(config)).get(path)


def size_field(probe: tuple[int, ...] | None, stored: tuple[int, ...], expected: tuple[int, ...],
               config=None) -> str | None:
    """The config field that sets the first dimension where `stored` and `expected` differ (`probe`: the same
    tensor's shape in the probe model of `config`'s family, in the same layout), or None (a fixed size, or another
    rank)."""
    if probe is None or not len(probe) == len(stored) == len(expected):
        return None
    fields = _MODERNBERT_FIELD_OF_SIZE if config is not None and family.is_modernbert(config) else _FIELD_OF_SIZE
    for size, have, want in zip(probe, stored, expected):
        if have != want:
            return fields.get(size)
    return None


def mismatch_message(config: BertConfig, config_name: str, tensor: str, stored: tuple[int, ...],
                     expected: tuple[int, ...], field: str | None) -> str:
    """`config_name says FIELD=VALUE but tensor T has shape S (the config gives E)`."""
    if field is None:
        return f"tensor {tensor} has shape {tuple(stored)} but {config_name} gives {tuple(expected)}"
    return (f"{config_name} says {field}={getattr(config, field)} but tensor {tensor} has shape {tuple(stored)} "
            f"(the config gives {tuple(expected)})")


def check_stored_shapes(stored: dict[Path, tuple[int, ...]], config: BertConfig, config_name: str) -> None:
    """Refuses tensors (`stored`: our param path -> shape, per layer or stacked) that the model of `config` would
    not hold with that shape: a ValueError naming the config field and value and the tensor and its shape. Every
    encoder tensor must be there; the pooler and heads may be absent (a classifier's label count is its own)."""
    stacked = any(path[:2] == ("bert", model_lib.STACKED) for path in stored)
    labels = stored.get(("classifier", "bias"))
    expected = param_shapes(config.replace(scan_layers=stacked), labels[0] if labels else None)
    for path, shape in stored.items():
        name = "/".join(path)
        if path not in expected:
            if len(path) > 1 and _LAYER.match(path[1]):
                raise ValueError(f"{config_name} says num_hidden_layers={config.num_hidden_layers} but the "
                                 f"checkpoint holds tensor {name} {tuple(shape)}")
            raise ValueError(f"tensor {name} {tuple(shape)} is not part of the model {config_name} describes")
        want, probe = expected[path], probe_shape(path, stacked, config)
        keys = [jax.tree_util.DictKey(part) for part in path]
        if model_lib.is_split_head_kernel(keys, len(shape)):
            # An older checkpoint's [H, heads, head_dim] attention kernel: compared in that layout.
            want = model_lib.split_head_shape(keys, want, config)
            probe = model_lib.split_head_shape(keys, probe, _PROBE)
        if tuple(shape) != tuple(want):
            raise ValueError(mismatch_message(config, config_name, name, tuple(shape), want,
                                              size_field(probe, tuple(shape), want, config)))
    held_layers = {path[1] for path in stored if len(path) > 1}
    for path in expected:
        if path[0] == "bert" and path[1] != "pooler" and path not in stored:
            # A whole layer missing: the config has more layers than the checkpoint.
            said = (f"{config_name} says num_hidden_layers={config.num_hidden_layers} but "
                    if _LAYER.match(path[1]) and path[1] not in held_layers else "")
            raise ValueError(f"{said}encoder tensor {'/'.join(path)} is missing from the checkpoint")


def activation_floor_bytes(config, rows: int, tokens_per_row: int, dtype: str | None = None,
                           training: bool = True, platform: str | None = None) -> int:
    """What the activations of `rows` rows of `tokens_per_row` tokens must take at the least (a floor: XLA keeps
    more), to tell a batch that cannot fit before anything is compiled or allocated. Per token and layer: its input,
    q, k, v, context, projection, two LayerNorm inputs, the FFN's input, its intermediate before and after the
    activation, and a row of attention probabilities a head in the layers whose attention holds them (on `platform`:
    those that run the reference; all where no platform is given), in `dtype` (default: the config's); training
    keeps every layer's for the backward (under remat, each layer's input and one layer's whole), prediction one
    layer's."""
    dtype = dtype or getattr(config, "dtype", "float32")
    width = 4 if dtype == "float32" else 2
    per_token = (9 * config.hidden_size + 2 * config.intermediate_size) * width
    scores = config.num_attention_heads * tokens_per_row * width
    holding = _layers_holding_scores(config, tokens_per_row, training, platform)
    if not training:
        return rows * tokens_per_row * (per_token + (scores if holding else 0))
    layers = config.num_hidden_layers
    if getattr(config, "remat", "none") != "none":
        per_token_all = config.hidden_size * width * layers + per_token + (scores if holding else 0)
    else:
        per_token_all = per_token * layers + scores * holding
    return rows * tokens_per_row * per_token_all


def _layers_holding_scores(config, length: int, training: bool, platform: str | None) -> int:
    """How many layers' attention keeps its [heads, length] probabilities a query: those whose backend on `platform`
    is the reference (the kernels and the chunked backend recompute them); every layer where `platform` is None."""
    if platform is None:
        return config.num_hidden_layers
    from bertjax.model.attention import resolve_backend

    modern = family.is_modernbert(config)
    rate = config.attention_dropout if modern else config.attention_probs_dropout_prob
    return sum(resolve_backend(config.attention_backend, training and rate > 0, platform, length,
                               windowed=modern and not config.is_global(layer)) == "reference"
               for layer in range(config.num_hidden_layers))
