"""The Pallas GPU LayerNorm kernels (bertjax.model.kernels.gpu.layer_norm_gpu), run in Pallas' interpreter on CPU
against the XLA custom_vjp they replace on GPUs (`layer_norm._fused`, `layer_norm.layer_norm`), its mask
(`dropout.keep_mask_fused`) element for element; sharded over a CPU mesh; and the model's LayerNorms lowered for a GPU
through Triton (no GPU needed)."""
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl

from bertjax import sharding
from bertjax.model import dropout as dropout_lib
from bertjax.model import layer_norm as ln
from bertjax.model.kernels.gpu import layer_norm_gpu as lg
from bertjax.model.bert.model import BertModel, DenseBeforeLayerNorm
from bertjax.model.bert.config import BertConfig
from tests.kernel_references import LAYER_NORM_EPS, LAYER_NORM_RATE, layer_norm_inputs, layer_norm_kernel_and_reference
from tests.kernel_references import layer_norm_value_and_grads as _value_and_grads
from tests.kernel_references import pre_norm_sum_kernel_and_reference
from tests.test_dropout_attention_gpu import _lowered_for_a_gpu

EPS, RATE = LAYER_NORM_EPS, LAYER_NORM_RATE
# 21 rows (not a multiple of the kernels' 8-row blocks, nor of the backward's 64) of 48 columns (held as 64).
SHAPE = (3, 7, 48)


def _inputs(dtype, shape=SHAPE):
    return layer_norm_inputs(dtype, shape)


def _assert_close(got, want, rtol, names=("y", "dx", "dresidual", "dscale", "dbias")):
    """Each of (y, gradients...) equal within rtol of its largest magnitude, in its dtype."""
    for name, g, w in zip(names, got, want):
        assert g.dtype == w.dtype and g.shape == w.shape, name
        g, w = np.asarray(g, np.float32), np.asarray(w, np.float32)
        np.testing.assert_allclose(g, w, rtol=rtol, atol=rtol * np.abs(w).max(), err_msg=name)


@pytest.mark.parametrize("with_dropout", [True, False])
@pytest.mark.parametrize("dtype, rtol", [(jnp.float32, 2e-6), (jnp.bfloat16, 1e-2)])
def test_kernels_equal_the_xla_custom_vjp(with_dropout, dtype, rtol):
    """Values and gradients of LayerNorm(dropout(x) + residual) against `layer_norm._fused` (what CPUs run): float32
    to reduction order, bfloat16 to a rounding (the sums are the same bits; the statistics add in another order)."""
    x, residual, scale, bias, cotangent = _inputs(dtype)
    seeds = dropout_lib.word_seeds(jax.random.PRNGKey(7)) if with_dropout else None
    _assert_close(*layer_norm_kernel_and_reference(x, residual, scale, bias, cotangent, dtype, seeds), rtol)


@pytest.mark.parametrize("with_dropout", [True, False])
@pytest.mark.parametrize("dtype, rtol", [(jnp.float32, 2e-6), (jnp.bfloat16, 1e-2)])
def test_the_dense_bias_added_in_the_kernels_equals_the_composition(with_dropout, dtype, rtol):
    """LayerNorm(dropout(x + b) + residual) with the Dense's bias b given to the kernels (`x_bias`): values and
    gradients (b's too: the column sums of the gradient after the mask) against autodiff of the composition, the
    bias added in x's dtype before `layer_norm._fused`."""
    x, residual, scale, bias, cotangent = _inputs(dtype)
    x_bias = 0.5 * jax.random.normal(jax.random.PRNGKey(9), SHAPE[-1:])
    seeds = dropout_lib.word_seeds(jax.random.PRNGKey(7)) if with_dropout else None
    got, want = layer_norm_kernel_and_reference(x, residual, scale, bias, cotangent, dtype, seeds, x_bias)
    # autodiff sums b's gradient in x's dtype; the kernel adds the same rounded dx in float32
    assert want[2].dtype == jnp.float32
    _assert_close(got, want, rtol, names=("y", "dx", "dx_bias", "dresidual", "dscale", "dbias"))
    assert np.abs(np.asarray(want[2])).max() > 0.1 * np.abs(np.asarray(want[4])).max()   # not a sum of zeros


def test_the_mask_is_keep_mask_fused_element_for_element_and_for_a_shards_rows():
    """The forward's sum s is `_dropout_sum`'s, bit for bit (the same mask, the same roundings); dx is 0 exactly
    where keep_mask_fused drops (ds is nowhere 0 here); a shard given its first global row draws the global mask's
    rows (the last two examples of three: rows from 7); rate 0 with a key drops nothing."""
    x, residual, scale, bias, cotangent = _inputs(jnp.bfloat16)
    seeds = dropout_lib.word_seeds(jax.random.PRNGKey(3))
    keep = np.asarray(dropout_lib.keep_mask_fused(seeds, RATE, SHAPE))
    assert 0 < (~keep).sum() < keep.size / 4
    _, (s, *_) = lg._layer_norm_forward(EPS, jnp.dtype(jnp.bfloat16), RATE, True, (False, True), True, False, x, None,
                                        residual, scale, bias, seeds, jnp.zeros(1, jnp.int32))
    np.testing.assert_array_equal(np.asarray(s, np.float32),
                                  np.asarray(ln._dropout_sum(x, residual, seeds, RATE), np.float32))
    grads = lambda x, r, row_offset, rate=RATE: _value_and_grads(
        lambda x, r: lg.layer_norm(x, scale, bias, EPS, jnp.bfloat16, r, rate, seeds, row_offset, interpret=True),
        cotangent[-x.shape[0]:], x, r)
    _, dx, ds = grads(x, residual, 0)
    assert np.all(np.asarray(ds) != 0)
    np.testing.assert_array_equal(np.asarray(dx) != 0, keep)
    _, shard_dx, _ = grads(x[1:], residual[1:], row_offset=SHAPE[1])
    np.testing.assert_array_equal(np.asarray(shard_dx) != 0, keep[1:])
    _, all_kept, ds = grads(x, residual, 0, rate=0.0)
    np.testing.assert_array_equal(np.asarray(all_kept), np.asarray(ds))


@pytest.mark.parametrize("dtype, rtol", [(jnp.float32, 2e-6), (jnp.bfloat16, 1e-2)])
def test_the_pre_norm_sum_and_its_norm_equal_the_composition(dtype, rtol):
    """ModernBERT's residual stream (`layer_norm.sum_and_layer_norm`): (residual + x, LayerNorm of it) from one kernel
    that returns the sum, whose own cotangent its backward adds to the norm's gradient: the sum bit for bit, the
    norm, and x's, the residual's, scale's and bias's gradients (both outputs carrying a cotangent) against the
    composition as XLA runs it (`layer_norm._fused` of the sum)."""
    x, residual, scale, bias, cotangent = _inputs(dtype)
    got, want = pre_norm_sum_kernel_and_reference(x, residual, scale, bias, cotangent, dtype)
    np.testing.assert_array_equal(np.asarray(got[0], np.float32), np.asarray(want[0], np.float32))
    _assert_close(got[1:], want[1:], rtol, names=("y", "dx", "dresidual", "dscale", "dbias"))
    # the sum's cotangent reached the inputs: without it their gradient differs by more than the tolerance
    kernel = lambda x, r: lg.layer_norm(x, scale, bias, EPS, dtype, r, interpret=True, return_sum=True)
    alone = jax.vjp(kernel, x, residual)[1]((cotangent, jnp.zeros_like(x)))[0]
    assert np.abs(np.asarray(alone, np.float32) - np.asarray(want[2], np.float32)).max() > 0.1


@pytest.mark.parametrize("with_dropout", [False, True])
def test_plain_layer_norm_equals_xlas(with_dropout):
    """No residual (the embeddings' LayerNorm: float32 in, bfloat16 out): values and gradients of the kernels against
    `layer_norm.layer_norm`'s XLA path; with dropout (the forward then keeps the dropped x for the backward) against
    the custom_vjp with a residual of zeros."""
    x, residual, scale, bias, cotangent = _inputs(jnp.float32)
    cotangent = cotangent.astype(jnp.bfloat16)
    seeds = dropout_lib.word_seeds(jax.random.PRNGKey(2)) if with_dropout else None
    kernel = lambda x, s, b: lg.layer_norm(x, s, b, EPS, jnp.bfloat16, rate=RATE, seeds=seeds, interpret=True)
    xla = lambda x, s, b: ln.layer_norm(x, s, b, EPS, jnp.bfloat16)
    if with_dropout:
        xla = lambda x, s, b: ln._fused(EPS, jnp.dtype(jnp.bfloat16), RATE, x, jnp.zeros_like(x), s, b, seeds)
    got, want = (_value_and_grads(f, cotangent, x, scale, bias) for f in (kernel, xla))
    _assert_close((got[0],), (want[0],), rtol=1e-2)
    _assert_close(got[1:], want[1:], rtol=2e-6, names=("dx", "dscale", "dbias"))   # float32


def test_sharded_over_a_mesh_each_device_draws_the_global_masks_rows():
    """`per_device_layer_norm` on a data=2 x tensor=2 CPU mesh (the batch split over data, the kernels per device
    in a shard_map): values and gradients those of the XLA custom_vjp over the whole batch, scale's, bias's and the
    Dense bias's gradients summed over the devices, dropped elements where keep_mask_fused drops them."""
    shape = (4, 3, 16)
    x, residual, scale, bias, cotangent = _inputs(jnp.float32, shape)
    x_bias = jax.random.normal(jax.random.PRNGKey(9), shape[-1:])
    seeds = dropout_lib.word_seeds(jax.random.PRNGKey(5))
    mesh = sharding.make_mesh(data=2, fsdp=1, tensor=2, devices=jax.devices()[:4])
    kernel = lambda x, r, s, b, xb: lg.per_device_layer_norm(x, s, b, EPS, jnp.float32, r, RATE, seeds, xb)
    with sharding.activate(mesh):
        got = jax.jit(lambda *a: _value_and_grads(kernel, cotangent, *a))(x, residual, scale, bias, x_bias)
    want = _value_and_grads(lambda x, r, s, b, xb: ln._fused(EPS, jnp.dtype(jnp.float32), RATE, x + xb, r, s, b,
                                                             seeds), cotangent, x, residual, scale, bias, x_bias)
    _assert_close(got, want, rtol=2e-6, names=("y", "dx", "dresidual", "dscale", "dbias", "dx_bias"))
    np.testing.assert_array_equal(np.asarray(got[1]) != 0, np.asarray(dropout_lib.keep_mask_fused(seeds, RATE,
                                                                                                  shape)))


CONFIG = BertConfig(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=128,
                    max_position_embeddings=128, dtype="bfloat16")


def _params_of(module, *inputs, on_a_gpu: bool):
    """{path: (shape, logical axis names)} of `module`'s initial params, traced for a GPU mesh or on this CPU."""
    init = lambda: module.init(jax.random.key(0), *inputs)["params"]
    if on_a_gpu:
        device = jax.sharding.AbstractDevice(device_kind="NVIDIA H100 80GB HBM3", num_cores=None, platform="gpu")
        with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((1,), ("data",), abstract_device=device)):
            assert sharding.target_platform() == "gpu"
            params = jax.eval_shape(init)
    else:
        params = jax.eval_shape(init)
    leaves = jax.tree_util.tree_leaves_with_path(params, is_leaf=lambda x: isinstance(x, nn.Partitioned))
    return {jax.tree_util.keystr(path): (leaf.value.shape, leaf.names) for path, leaf in leaves}


def test_on_a_gpu_the_model_keeps_its_dense_params_and_nn_denses():
    """The Denses before the residual LayerNorms hand their bias to the GPU kernels but keep their params: the
    model's tree traced for a GPU is the CPU one's (paths, shapes, logical axes; `attention/output_dense` and
    `output` each a kernel and a bias), and `DenseBeforeLayerNorm` is nn.Dense: the same initial params and axes,
    the same values, (x W, b) when it defers its bias."""
    ids = jnp.zeros((2, 8), jnp.int32)
    model = BertModel(CONFIG, add_pooler=False)
    on_cpu = _params_of(model, ids, ids, ids, on_a_gpu=False)
    assert _params_of(model, ids, ids, ids, on_a_gpu=True) == on_cpu
    for dense, kernel_shape in (("attention']['output_dense", (64, 64)), ("output", (128, 64))):
        assert on_cpu[f"['layer_1']['{dense}']['kernel']"][0] == kernel_shape
        assert on_cpu[f"['layer_1']['{dense}']['bias']"][0] == (64,)
    x = jax.random.normal(jax.random.PRNGKey(4), (2, 3, 128))
    reference = nn.Dense(64, dtype=jnp.bfloat16, param_dtype=jnp.float32,
                         kernel_init=nn.with_logical_partitioning(
                             nn.initializers.truncated_normal(stddev=CONFIG.initializer_range), ("mlp", "embed")),
                         bias_init=nn.with_logical_partitioning(nn.initializers.ones_init(), ("embed",)))
    variables = reference.init(jax.random.key(3), x)
    ours = DenseBeforeLayerNorm(CONFIG, 64, ("mlp", "embed"))
    ours_variables = ours.init(jax.random.key(3), x)
    assert _params_of(ours, x, on_a_gpu=False) == _params_of(reference, x, on_a_gpu=False)
    np.testing.assert_array_equal(ours_variables["params"]["kernel"].value, variables["params"]["kernel"].value)
    want = reference.apply(variables, x)   # a bias of ones: a visible term
    np.testing.assert_array_equal(ours.apply(variables, x), want)
    y, bias = DenseBeforeLayerNorm(CONFIG, 64, ("mlp", "embed"), defer_bias=True).apply(variables, x)
    assert bias.dtype == jnp.float32 and y.dtype == jnp.bfloat16
    np.testing.assert_array_equal(y + bias.astype(y.dtype), want)


def test_bert_on_a_gpu_runs_its_layer_norms_in_the_triton_kernels():
    """The model's gradients (2 layers, bf16, dropout) traced for a GPU mesh and lowered for CUDA on this CPU: the
    embeddings' LayerNorm and each layer's two residual ones are a forward and a backward Triton kernel each; the
    residual ones' forwards take the Dense's bias (float32 [H]) after x, their backwards write three partial sums
    per program (scale's, bias's, the Dense bias's gradients)."""
    config = CONFIG
    model = BertModel(config, add_pooler=False)
    ids = jax.ShapeDtypeStruct((2, 128), jnp.int32)
    params = jax.eval_shape(lambda: model.init(jax.random.key(0), *(jnp.zeros((2, 128), jnp.int32),) * 3))["params"]

    def gradients(params, input_ids, input_mask):
        def loss(params):
            out = model.apply({"params": params}, input_ids, input_mask, jnp.zeros_like(input_ids),
                              deterministic=False, rngs={"dropout": jax.random.key(1)})[0]
            return jnp.sum(out.astype(jnp.float32))
        return jax.grad(loss)(params)

    text = _lowered_for_a_gpu(gradients, params, ids, ids)
    names = re.findall(r'name = "(layer_norm_gpu_\w+)"', text)
    assert sorted(names) == ["layer_norm_gpu_bwd"] * 5 + ["layer_norm_gpu_fwd"] * 5
    calls = [re.search(r'name = "(layer_norm_gpu_\w+)".*: \((.*?)\) -> \((.*?)\)$', line).groups()
             for line in text.splitlines() if 'name = "layer_norm_gpu_' in line]
    rows = 2 * 128 * 64
    assert sum(name.endswith("fwd") and operands.startswith(f"tensor<2xi32>, tensor<1xi32>, tensor<{rows}xbf16>, "
                                                            "tensor<64xf32>, ") for name, operands, _ in calls) == 4
    programs = pl.cdiv(2 * 128, lg.ROWS * lg.BACKWARD_STEPS)
    assert sum(name.endswith("bwd") and results.endswith(f"tensor<{programs * 3 * 64}xf32>")
               for name, _, results in calls) == 4
