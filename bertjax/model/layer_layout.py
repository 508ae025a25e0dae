"""The layer layout of a param tree, any family's: the encoder (`bert`) holds its layers per layer (`layer_0`..) or
stacked (`layers`, leading axis = layer: `scan_layers`), and every reader and writer of params converts through
`with_layout`; an older checkpoint's split-head attention kernels read as the 2-D ones the model holds now.
"""
from __future__ import annotations

import re

import flax.linen as nn
import jax
import jax.numpy as jnp

STACKED = "layers"
_LAYER_KEY = re.compile(r"layer_(\d+)$")


def _layer_keys(node: dict) -> list[str]:
    keys = sorted((k for k in node if isinstance(k, str) and _LAYER_KEY.match(k)), key=lambda k: int(k[6:]))
    if keys and keys != [f"layer_{i}" for i in range(len(keys))]:
        raise ValueError(f"layers {keys} are not numbered 0..{len(keys) - 1}")
    return keys


def _is_encoder(node) -> bool:
    return isinstance(node, dict) and (STACKED in node or bool(_layer_keys(node)))


def is_stacked(params) -> bool:
    """Whether a param tree (or Orbax metadata tree) holds the encoder layers stacked (`bert/layers`)."""
    return STACKED in params.get("bert", {})


def is_stacked_path(path) -> bool:
    """Whether a leaf's key path (from the params' root, or from a state holding params-shaped trees) is in the
    stacked layers (its axis 0 = layer)."""
    keys = [getattr(k, "key", None) for k in path]
    return any(keys[i:i + 2] == ["bert", STACKED] for i in range(len(keys) - 1))


# The attention projections' kernels: "in" [H, heads * head_dim] (q/k/v), "out" [heads * head_dim, H].
_HEAD_KERNELS = {"query": "in", "key": "in", "value": "in", "output_dense": "out"}


def _head_kernel(path) -> str | None:
    keys = [getattr(k, "key", None) for k in path]
    return _HEAD_KERNELS.get(keys[-2]) if len(keys) >= 2 and keys[-1] == "kernel" else None


def is_split_head_kernel(path, ndim: int) -> bool:
    """Whether a leaf is an attention kernel with the heads as their own axes ([H, heads, head_dim] or [heads,
    head_dim, H], plus the layer axis when stacked): how bertjax saved them until 2026-11-26."""
    return _head_kernel(path) is not None and ndim == 3 + is_stacked_path(path)


def merge_head_axes(tree):
    """`tree` (params, or a state holding params-shaped trees) with split-head attention kernels (an older
    checkpoint's) as the 2-D matrices the model holds now: the same values, row-major."""
    def merge(path, x):
        if not is_split_head_kernel(path, x.ndim):
            return x
        *lead, a, b, c = x.shape
        return x.reshape((*lead, a, b * c) if _head_kernel(path) == "in" else (*lead, a * b, c))
    return jax.tree_util.tree_map_with_path(merge, tree)


def split_head_shape(path, shape, config) -> tuple[int, ...]:
    """The split-head shape an older checkpoint stored for an attention kernel of `shape` (others unchanged)."""
    kind = _head_kernel(path)
    if kind is None:
        return tuple(shape)
    *lead, rows, cols = shape
    heads = (config.num_attention_heads, config.head_dim)
    return (*lead, rows, *heads) if kind == "in" else (*lead, *heads, cols)


def _stack(leaves):
    """One tensor's layers stacked on a new axis 0; a logically partitioned one (init) names that axis `layers`."""
    if isinstance(leaves[0], nn.meta.AxisMetadata):
        stacked = leaves[0].replace_boxed(jnp.stack([leaf.unbox() for leaf in leaves]))
        return stacked.add_axis(0, {nn.PARTITION_NAME: STACKED})
    return jnp.stack(leaves)


def stack_layers(tree, stack=None):
    """Every encoder dict of `tree` (params, boxed or not, or an optimizer state holding params-shaped trees) with
    its `layer_0..layer_{N-1}` subtrees stacked into one `layers` subtree (leading axis = layer). `stack(leaves)`
    combines one tensor's N layers (default: jnp.stack). Trees already stacked are returned unchanged."""
    stack = stack or _stack

    def convert(node):
        keys = _layer_keys(node) if isinstance(node, dict) else []
        if not keys:
            return node
        rest = {k: v for k, v in node.items() if k not in keys}
        return {**rest, STACKED: jax.tree_util.tree_map(lambda *leaves: stack(leaves), *(node[k] for k in keys),
                                                        is_leaf=lambda x: isinstance(x, nn.meta.AxisMetadata))}

    return jax.tree_util.tree_map(convert, tree, is_leaf=_is_encoder)


def unstack_layers(tree, num_layers: int, take=None):
    """The inverse of `stack_layers`: `layers` split into `layer_0..layer_{num_layers-1}`; `take(leaf, i)` picks
    layer i of a stacked tensor (default: leaf[i]). Trees already per layer are returned unchanged."""
    take = take or (lambda leaf, i: leaf[i])

    def convert(node):
        if not (isinstance(node, dict) and STACKED in node):
            return node
        rest = {k: v for k, v in node.items() if k != STACKED}
        return {**rest, **{f"layer_{i}": jax.tree_util.tree_map(lambda leaf, i=i: take(leaf, i), node[STACKED])
                           for i in range(num_layers)}}

    return jax.tree_util.tree_map(convert, tree, is_leaf=_is_encoder)


def with_layout(tree, config, stacked: bool, stack=None, take=None):
    """`tree` in the stacked (`stacked=True`) or per-layer layout, whichever it is in now: the one conversion
    every reader and writer of params goes through (checkpoints, `--init`, export)."""
    if stacked:
        return stack_layers(tree, stack)
    return unstack_layers(tree, config.num_hidden_layers, take)
