"""ModernBERT sharded over a CPU mesh of several host devices (data=2 x tensor=2: tests/device_schedule.py gives
this file a worker that has them)."""
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bertjax import sharding
from bertjax.model.modernbert import model as modernbert
from bertjax.model.modernbert.config import ModernBertConfig


@pytest.mark.parametrize("platform", ["tpu", "gpu"])
def test_the_feed_forward_split_over_tensor_moves_no_activations_between_devices(monkeypatch, platform):
    """With "mlp" split over a tensor axis (data=2 x tensor=2 CPU devices) Wi's halves are taken apart, not merged
    with the split axis (TPU's [H, 2I] product and the GELU's pair gradient were resharded by all-to-alls and
    permutes): the compiled gradient's only collectives are all-reduces; values and gradients those of one device."""
    config = ModernBertConfig(hidden_size=64, num_attention_heads=4, intermediate_size=128, vocab_size=100,
                              pad_token_id=0, hidden_activation="gelu_pytorch_tanh")
    x = jnp.asarray(np.random.default_rng(8).normal(size=(4, 8, 64)), jnp.float32)
    layer = modernbert.GatedMLP(config)
    params = nn.meta.unbox(layer.init(jax.random.key(0), x, True))
    grad = jax.jit(jax.value_and_grad(lambda p, x: jnp.sum(jnp.sin(layer.apply(p, x, True))), argnums=(0, 1)))
    want = grad(params, x)
    monkeypatch.setattr(modernbert, "target_platform", lambda: platform)
    mesh = sharding.make_mesh(data=2, fsdp=1, tensor=2, devices=jax.devices()[:4])
    with sharding.activate(mesh):
        assert (sharding.logical_axis_size("mlp"), sharding.logical_axis_size("embed")) == (2, 1)
        shardings = sharding.param_shardings(layer.init(jax.random.key(0), x, True), mesh)
        placed = jax.device_put(params, shardings)
        compiled = grad.lower(placed, x).compile().as_text()
        got = grad(placed, x)
    assert sharding.logical_axis_size("mlp") == 1   # outside a mesh
    collectives = set(re.findall(r"= \S+ (all-to-all|collective-permute|all-gather|all-reduce)", compiled))
    assert collectives <= {"all-reduce"}, collectives
    for g, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-5 * np.abs(np.asarray(w)).max())
