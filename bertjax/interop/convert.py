"""Tensor dicts (HF or TF naming) <-> our nested params, driven by the table in `names`."""
from __future__ import annotations

from typing import Mapping

import numpy as np

from bertjax.interop import names as names_lib
from bertjax.model import layer_layout
from bertjax.model import family
from bertjax.model import shapes as shapes_lib
from bertjax.model.family import ModelConfig

# The first layer of each HF layout, which a layer beyond the config's count starts with.
_LAYER_PREFIXES = ("encoder.layer.", "bert/encoder/layer_", "model.layers.")


def params_from_tensors(tensors: Mapping[str, np.ndarray], config: ModelConfig, source: str, origin: str,
                        config_name: str, ignored: tuple[str, ...] = ()) -> dict:
    """Our nested float32 params from a flat tensor dict named the `source` way ("hf" or "tf").

    Only groups the checkpoint holds are converted (a BertModel dump has no MLM head). Within a held group a
    missing tensor, and anywhere an unexpected tensor or a shape mismatch, is an error naming the tensor; a shape
    or layer count that `config` (read from `config_name`) does not give also names the config field.
    """
    table = names_lib.tensor_names_for(config)
    key_of = (lambda n: n.hf) if source == "hf" else (lambda n: n.tf)
    held_groups = {n.group for n in table if key_of(n) in tensors}
    if "encoder" not in held_groups:
        kind = family.of(config).name
        raise ValueError(f"{origin}: no {kind} encoder tensors found (looked for e.g. "
                         f"{key_of(table[0])!r}); is this a {kind} checkpoint?")
    num_labels = None
    if "classifier" in held_groups:
        classifier = next(n for n in table if n.group == "classifier" and n.hf_is_linear)
        value = tensors.get(key_of(classifier))
        if value is not None:
            num_labels = int(value.shape[0] if (source == "hf" or classifier.tf_transposed) else value.shape[1])
    shapes = shapes_lib.param_shapes(config, num_labels)
    layers = f"{config_name} says num_hidden_layers={config.num_hidden_layers} but "

    params: dict = {}
    for name in table:
        if name.group not in held_groups:
            continue
        key = key_of(name)
        expected = names_lib.expected_source_shape(name, shapes[name.path], source)
        if key not in tensors:
            # A whole layer missing: the config has more layers than the checkpoint.
            whole_layer = name.path[1].startswith("layer_") and not any(
                key_of(n) in tensors for n in table if n.path[1] == name.path[1])
            said = layers if whole_layer else ""
            raise ValueError(f"{origin}: {said}tensor {key!r} is missing (expected shape {expected})")
        stored = tuple(np.shape(tensors[key]))
        if stored != expected:
            probe = shapes_lib.probe_shape(name.path, config=config)
            field = shapes_lib.size_field(probe and names_lib.expected_source_shape(name, probe, source), stored,
                                          expected, config)
            raise ValueError(f"{origin}: "
                             + shapes_lib.mismatch_message(config, config_name, key, stored, expected, field))
        value = names_lib.from_source(name, np.asarray(tensors[key], np.float32), shapes[name.path], source)
        node = params
        for part in name.path[:-1]:
            node = node.setdefault(part, {})
        node[name.path[-1]] = value

    used = {key_of(n) for n in table if n.group in held_groups}
    unexpected = sorted(k for k in tensors if k not in used and k not in ignored)
    beyond = [k for k in unexpected if k.startswith(_LAYER_PREFIXES)]
    if beyond:
        raise ValueError(f"{origin}: {layers}the checkpoint holds tensor {beyond[0]} "
                         f"{tuple(np.shape(tensors[beyond[0]]))}")
    if unexpected:
        details = ", ".join(f"{k} {tuple(np.shape(tensors[k]))}" for k in unexpected[:10])
        kind = family.of(config).name
        raise ValueError(f"{origin}: unexpected tensors not part of a {kind} model: {details}"
                         + (f" and {len(unexpected) - 10} more" if len(unexpected) > 10 else ""))
    return family.of(config).with_uncounted_params(params, config, shapes)


def tensors_from_params(params: Mapping, config: ModelConfig, target: str) -> dict[str, np.ndarray]:
    """Flat tensor dict named the `target` way ("hf" or "tf") for every param the tree holds (either layer
    layout: stacked layers are named per layer)."""
    params = layer_layout.with_layout(params, config, stacked=False)
    table = names_lib.tensor_names_for(config)
    convert = names_lib.to_hf if target == "hf" else names_lib.to_tf
    out = {}
    for name in table:
        if target == "tf" and name.tf is None:
            continue
        node = params
        for part in name.path:
            node = node.get(part) if isinstance(node, Mapping) else None
            if node is None:
                break
        if node is None:
            continue
        out[name.hf if target == "hf" else name.tf] = convert(name, np.asarray(node, np.float32))
    return out


def held_groups(params: Mapping) -> set[str]:
    """Which tensor groups (names.GROUPS) a params tree holds."""
    groups = {"encoder"}
    if "pooler" in params.get("bert", {}):
        groups.add("pooler")
    for top, group in (("predictions", "mlm"), ("seq_relationship", "nsp"), ("classifier", "classifier"),
                       ("qa_outputs", "qa_outputs"), ("span_boundary", names_lib.SBO_GROUP), ("head", "head"),
                       ("decoder_bias", "mlm"), ("decoder", "mlm")):
        if top in params:
            groups.add(group)
    return groups
