"""Tensor dicts (HF or TF naming) <-> our nested params, driven by the table in `names`."""
from __future__ import annotations

from typing import Mapping

import flax.linen as nn
import jax
import numpy as np

from bertjax.interop import names as names_lib
from bertjax.model import bert as model_lib
from bertjax.model.config import BertConfig


def param_shapes(config: BertConfig, num_labels: int | None = None) -> dict[tuple[str, ...], tuple[int, ...]]:
    """Shape of every param path of a BertForPreTraining with the SBO head (+ classifier / qa_outputs heads), from
    the model."""
    def shapes_of(module, heads_only: tuple[str, ...] = ()):
        tree = jax.eval_shape(lambda: model_lib.init_params(module, config, jax.random.key(0)))
        flat = jax.tree_util.tree_flatten_with_path(nn.meta.unbox(tree))[0]
        out = {tuple(k.key for k in path): tuple(leaf.shape) for path, leaf in flat}
        return {p: s for p, s in out.items() if not heads_only or p[0] in heads_only}

    shapes = shapes_of(model_lib.BertForPreTraining(config, span_boundary_objective=True))
    shapes.update(shapes_of(model_lib.BertForQuestionAnswering(config), ("qa_outputs",)))
    if num_labels is not None:
        shapes.update(shapes_of(model_lib.BertForSequenceClassification(config, num_labels), ("classifier",)))
    return shapes


def params_from_tensors(tensors: Mapping[str, np.ndarray], config: BertConfig, source: str, origin: str,
                        ignored: tuple[str, ...] = ()) -> dict:
    """Our nested float32 params from a flat tensor dict named the `source` way ("hf" or "tf").

    Only groups the checkpoint holds are converted (a BertModel dump has no MLM head). Within a held group a
    missing tensor, and anywhere an unexpected tensor or a shape mismatch, is an error naming the tensor.
    """
    table = names_lib.tensor_names(config.num_hidden_layers)
    key_of = (lambda n: n.hf) if source == "hf" else (lambda n: n.tf)
    held_groups = {n.group for n in table if key_of(n) in tensors}
    if "encoder" not in held_groups:
        raise ValueError(f"{origin}: no BERT encoder tensors found (looked for e.g. "
                         f"{key_of(table[0])!r}); is this a BERT checkpoint?")
    num_labels = None
    if "classifier" in held_groups:
        classifier = next(n for n in table if n.group == "classifier" and n.hf_is_linear)
        value = tensors.get(key_of(classifier))
        if value is not None:
            num_labels = int(value.shape[0] if (source == "hf" or classifier.tf_transposed) else value.shape[1])
    shapes = param_shapes(config, num_labels)

    params: dict = {}
    for name in table:
        if name.group not in held_groups:
            continue
        key = key_of(name)
        if key not in tensors:
            raise ValueError(f"{origin}: missing tensor {key!r} (expected shape "
                             f"{names_lib.expected_source_shape(name, shapes[name.path], source)})")
        try:
            value = names_lib.from_source(name, np.asarray(tensors[key], np.float32), shapes[name.path], source)
        except ValueError as error:
            raise ValueError(f"{origin}: {error}") from None
        node = params
        for part in name.path[:-1]:
            node = node.setdefault(part, {})
        node[name.path[-1]] = value

    used = {key_of(n) for n in table if n.group in held_groups}
    unexpected = sorted(k for k in tensors if k not in used and k not in ignored)
    if unexpected:
        details = ", ".join(f"{k} {tuple(np.shape(tensors[k]))}" for k in unexpected[:10])
        raise ValueError(f"{origin}: unexpected tensors not part of a BERT model: {details}"
                         + (f" and {len(unexpected) - 10} more" if len(unexpected) > 10 else ""))
    return params


def tensors_from_params(params: Mapping, config: BertConfig, target: str) -> dict[str, np.ndarray]:
    """Flat tensor dict named the `target` way ("hf" or "tf") for every param the tree holds (either layer
    layout: stacked layers are named per layer)."""
    params = model_lib.with_layout(params, config, stacked=False)
    table = names_lib.tensor_names(config.num_hidden_layers)
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
                       ("qa_outputs", "qa_outputs"), ("span_boundary", names_lib.SBO_GROUP)):
        if top in params:
            groups.add(group)
    return groups
