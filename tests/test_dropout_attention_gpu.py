"""The fused Pallas GPU attention with attention dropout (bertjax.model.kernels.gpu.dropout_attention_gpu): forward and
gradients against the reference attention with the TPU kernel's keep mask (`dropout_attention.dropout_keep_mask`), run
in Pallas' interpreter on CPU; and `auto`'s choice of it for a GPU, lowered through Triton (no GPU needed)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bertjax.model.kernels.tpu import dropout_attention as da
from bertjax.model.kernels.gpu import dropout_attention_gpu as dg
from bertjax.model.attention import dot_product_attention, reference_attention
from bertjax.model.bert.model import BertModel
from bertjax.model.bert.config import BertConfig
from tests.kernel_references import _biases, _inputs, _reference, _segments, _value_and_grads
from tests.kernel_references import stacked_attention_kernel_and_reference
from tests.kernel_references import attention_kernel_and_reference as _kernel_and_reference


def _assert_close(actual, expected, rtol, scale=None):
    """Equal within rtol of `scale`, by default the expected values' largest magnitude (gradients have entries
    near 0)."""
    actual, expected = np.asarray(actual, np.float32), np.asarray(expected, np.float32)
    assert np.isfinite(actual).all()
    scale = np.abs(expected).max() if scale is None else scale
    np.testing.assert_allclose(actual, expected, rtol=rtol, atol=rtol * scale)


def _assert_gradients_close(grads, expected_grads, rtol):
    """q/k/v gradients each on its own scale; the biases' on the value bias's (the key bias's is ~0 in both:
    softmax ignores a shift of a row's logits)."""
    for grad, expected_grad in zip(grads[:3], expected_grads[:3]):
        _assert_close(grad, expected_grad, rtol=rtol)
    bias_scale = np.abs(np.asarray(expected_grads[3][2])).max()
    for grad, expected_grad in zip(grads[3], expected_grads[3]):
        assert grad.shape == expected_grad.shape and grad.dtype == jnp.float32
        _assert_close(grad, expected_grad, rtol=rtol, scale=bias_scale)


@pytest.mark.parametrize("length, heads, head_dim, layout, blocks", [
    (128, 2, 16, "padding", {}),                                              # 2 x 2 blocks of 64
    (128, 3, 64, "packing", {"block_q": 32, "block_k": 16, "block_bwd": 32}),  # BERT's head size; uneven blocks
    pytest.param(512, 2, 16, "packing", {"block_q": 128}, marks=pytest.mark.slow),   # attention.py's 512 blocks
])
def test_forward_and_gradients_equal_the_reference_with_the_tpu_kernels_mask(length, heads, head_dim, layout,
                                                                            blocks):
    q, k, v = _inputs(2, length, heads, head_dim)
    biases = _biases(heads, head_dim)
    segment_ids = _segments(2, length, layout)
    (out, grads), (expected, expected_grads) = _kernel_and_reference(q, k, v, biases, segment_ids, 0.1, 2024,
                                                                     **blocks)
    valid = np.asarray(segment_ids) != 0
    _assert_close(np.asarray(out)[valid], np.asarray(expected)[valid], rtol=1e-5)
    _assert_gradients_close(grads, expected_grads, rtol=1e-5)
    # The mask and the biases mattered: without either the output is another.
    for other in (_reference(q + biases[0], k + biases[1], v + biases[2], segment_ids, None, 0.0),
                  _reference(q, k, v, segment_ids, da.dropout_keep_mask(2024, 2, heads, length, length, 0.1), 0.1)):
        assert np.abs(np.asarray(out - other)[valid]).max() > 1e-2


@pytest.mark.parametrize("rate, blocks", [(0.1, {"block_q": 32, "block_k": 16, "block_bwd": 16}), (0.0, {})])
def test_a_window_skips_the_blocks_outside_it_and_masks_the_rest(rate, blocks):
    """A sliding window (ModernBERT's local layers, 20 tokens each side of 128): forward and gradients of the
    windowed reference with the kernel's mask, packed rows and ModernBERT's heads of 64."""
    q, k, v = _inputs(1, 128, 2, 64)
    biases = _biases(2, 64)
    segment_ids = _segments(1, 128, "packing")
    (out, grads), (expected, expected_grads) = _kernel_and_reference(q, k, v, biases, segment_ids, rate, 11,
                                                                     window=20, **blocks)
    valid = np.asarray(segment_ids) != 0
    _assert_close(np.asarray(out)[valid], np.asarray(expected)[valid], rtol=1e-5)
    _assert_gradients_close(grads, expected_grads, rtol=1e-5)
    full = _reference(q + biases[0], k + biases[1], v + biases[2], segment_ids, None, 0.0)
    assert np.abs(np.asarray(out - full)[valid]).max() > 1e-2   # the window mattered
    assert [int(x) for x in dg._window_blocks(64, 32, 16, 8, 20)] == [2, 8]   # keys 44..115: blocks 2..7


@pytest.mark.parametrize("rate, window", [(0.1, 20), (0.0, None)])
def test_stacked_qkv_with_rotary_positions_equals_the_rotated_reference(rate, window):
    """ModernBERT's path: q/k/v stacked [B, S, 3, H, D] as one projection writes them, the biases added and q and k
    rotated (packed positions, restarting per sequence) in the kernels: output and the gradients of the stacked
    array (one array, the unrotated q's and k's) and the biases equal the reference on rope.apply_rotary's q and k,
    with the kernel's mask; uneven blocks; without the rotation the output is another."""
    qkv = jnp.stack(_inputs(2, 128, 2, 64, seed=8), axis=2)
    biases = _biases(2, 64)
    segment_ids = _segments(2, 128, "packing")
    (out, grads), (expected, expected_grads) = stacked_attention_kernel_and_reference(
        qkv, biases, segment_ids, rate, 5, window=window, block_q=32, block_k=16, block_bwd=32)
    valid = np.asarray(segment_ids) != 0
    _assert_close(np.asarray(out)[valid], np.asarray(expected)[valid], rtol=1e-5)
    assert grads[0].shape == qkv.shape
    _assert_gradients_close([grads[0][:, :, i] for i in range(3)] + [grads[1]],
                            [expected_grads[0][:, :, i] for i in range(3)] + [expected_grads[1]], rtol=1e-5)
    mask = da.dropout_keep_mask(5, 2, 2, 128, 128, rate) if rate else None
    unrotated = _reference(*(qkv[:, :, i] + biases[i] for i in range(3)), segment_ids, mask, rate, window)
    assert np.abs(np.asarray(out - unrotated)[valid]).max() > 1e-2


def test_bfloat16_forward_and_gradients_are_the_float32_references_within_bfloat16_precision():
    """BERT's heads of 64 in bf16 (the GPU's dtype) with float32 biases (the parameters'): output and q/k/v/bias
    gradients within bf16 rounding of the float32 reference on the same (bf16-valued) inputs with the same mask;
    rate 0 is the plain attention."""
    q, k, v = (x.astype(jnp.bfloat16) for x in _inputs(2, 128, 2, 64, seed=1))
    biases = _biases(2, 64, seed=6)
    segment_ids = _segments(2, 128, "packing")
    valid = np.asarray(segment_ids) != 0
    for rate in (0.1, 0.0):
        (out, grads), (expected, expected_grads) = _kernel_and_reference(q, k, v, biases, segment_ids, rate, 9)
        assert grads[0].dtype == jnp.bfloat16
        _assert_close(np.asarray(out)[valid], np.asarray(expected)[valid], rtol=2e-2)
        _assert_gradients_close(grads, expected_grads, rtol=3e-2)


def test_the_kernel_applies_exactly_the_tpu_kernels_mask():
    """With q = k = 0 a row's probabilities are uniform, and with v the identity each output row is the row of the
    keep mask, scaled: out[b, i, h, j] = keep[b, h, i, j] / ((1 - rate) * length): the mask of
    `dropout_keep_mask`, which the TPU kernel draws too, bit for bit; with batch/head offsets (a shard of a mesh),
    the global arrays' rows of it."""
    batch, length, heads, rate = 2, 128, 3, 0.25
    q = k = jnp.zeros((batch, length, heads, length), jnp.float32)
    v = jnp.broadcast_to(jnp.eye(length, dtype=jnp.float32)[None, :, None, :], (batch, length, heads, length))
    segment_ids = jnp.ones((batch, length), jnp.int32)
    run = lambda q, k, v, **offsets: dg.flash_attention_with_dropout(
        q, k, v, segment_ids[:q.shape[0]], dropout_rate=rate, seed=99, interpret=True, **offsets)
    recovered = lambda out: np.asarray(out).transpose(0, 2, 1, 3) * (1 - rate) * length
    mask = np.asarray(da.dropout_keep_mask(99, batch, heads, length, length, rate)).astype(np.float32)
    np.testing.assert_allclose(recovered(run(q, k, v)), mask, rtol=1e-6)
    shard = lambda x: x[1:, :, 1:]   # the second example's last two heads
    np.testing.assert_allclose(recovered(run(shard(q), shard(k), shard(v), batch_offset=1, head_offset=1)),
                               mask[1:, 1:], rtol=1e-6)


def test_the_entry_point_pads_to_its_blocks_and_equals_the_reference_with_its_mask():
    """`dot_product_attention(backend="flash_dropout_gpu")` at 250 tokens (padded to 256: query blocks of 128), with
    the projections' biases (added by the kernel): output and gradients of q/k/v and the biases equal the
    reference's with the kernel's mask (the key bias's is ~0 in both, softmax ignoring a shift of a row's logits:
    compared on the value bias's scale); deterministic (eval), the plain attention."""
    batch, length, heads, head_dim, rate = 2, 250, 2, 16, 0.1
    q, k, v = _inputs(batch, length, heads, head_dim, seed=3)
    biases = tuple(jnp.asarray(np.random.default_rng(4).normal(size=(3, heads, head_dim)), jnp.float32))
    input_mask = np.ones((batch, length), np.int32)
    input_mask[1, 150:] = 0
    packing_ids = np.zeros((batch, length), np.int32)
    packing_ids[0, 100:] = 1
    rng = jax.random.key(11)
    mask = da.dropout_keep_mask(da.seed_from_rng(rng), batch, heads, length, length, rate)
    weights = jnp.asarray(input_mask, jnp.float32)[:, :, None, None]
    kernel = lambda q, k, v, b: dot_product_attention(q, k, v, input_mask, packing_ids, backend="flash_dropout_gpu",
                                                      dropout_rate=rate, dropout_rng=rng, deterministic=False,
                                                      biases=b)
    reference = lambda q, k, v, b: reference_attention(q + b[0], k + b[1], v + b[2], input_mask, packing_ids,
                                                       dropout_rate=rate, deterministic=False, keep_mask=mask)
    (out, grads), (expected, expected_grads) = (_value_and_grads(f, weights, q, k, v, biases)
                                                for f in (kernel, reference))
    valid = input_mask.astype(bool)
    _assert_close(np.asarray(out)[valid], np.asarray(expected)[valid], rtol=1e-5)
    for grad, expected_grad in zip(grads[:3], expected_grads[:3]):
        _assert_close(grad, expected_grad, rtol=1e-5)
    bias_scale = np.abs(np.asarray(expected_grads[3][2])).max()
    for grad, expected_grad in zip(grads[3], expected_grads[3]):
        _assert_close(grad, expected_grad, rtol=1e-5, scale=bias_scale)
    eval_out = dot_product_attention(q, k, v, input_mask, packing_ids, backend="flash_dropout_gpu",
                                     dropout_rate=rate, deterministic=True)
    _assert_close(np.asarray(eval_out)[valid],
                  np.asarray(reference_attention(q, k, v, input_mask, packing_ids))[valid], rtol=1e-5)


def _lowered_for_a_gpu(function, *args):
    """`function(*args)` traced for a one-GPU mesh (the platform `auto` chooses by) and lowered for CUDA, on this CPU:
    StableHLO text."""
    device = jax.sharding.AbstractDevice(device_kind="NVIDIA H100 80GB HBM3", num_cores=None, platform="gpu")
    mesh = jax.sharding.AbstractMesh((1, 1, 1), ("data", "fsdp", "tensor"), abstract_device=device)
    with jax.sharding.use_abstract_mesh(mesh):
        return jax.jit(function).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def _triton_calls(text, name="flash_dropout_gpu"):
    """The Triton kernels named `name`... in the text (the attention's; the LayerNorms are Triton kernels too)."""
    return sum("custom_call @__gpu$xla.gpu.triton" in line and f'name = "{name}' in line for line in text.splitlines())


@pytest.mark.parametrize("length", [128, 512])
def test_auto_on_a_gpu_lowers_attention_dropout_to_the_triton_kernels(length):
    """BERT-base attention (12 heads of 64, bf16) with attention dropout, `auto`, traced for a GPU mesh and lowered
    for CUDA on this CPU: a forward and a backward Triton kernel, and no [S, S] array (scores, probabilities, mask)
    outside them. Without dropout `auto` stays `dot_product` (no Triton kernel)."""
    qkv = jax.ShapeDtypeStruct((4, length, 12, 64), jnp.bfloat16)
    input_mask = jax.ShapeDtypeStruct((4, length), jnp.int32)

    def step(deterministic):
        def gradients(q, k, v, input_mask):
            loss = lambda q, k, v: jnp.sum(dot_product_attention(
                q, k, v, input_mask, dropout_rate=0.1, dropout_rng=jax.random.key(0),
                deterministic=deterministic).astype(jnp.float32))
            return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)
        return gradients

    text = _lowered_for_a_gpu(step(deterministic=False), qkv, qkv, qkv, input_mask)
    assert _triton_calls(text) == 2
    assert "flash_dropout_gpu_fwd" in text and "flash_dropout_gpu_bwd" in text
    assert f"{length}x{length}x" not in text
    assert _triton_calls(_lowered_for_a_gpu(step(deterministic=True), qkv, qkv, qkv, input_mask)) == 0


def test_bert_training_on_a_gpu_runs_attention_dropout_in_the_triton_kernels():
    """The model's own path (`attention_backend="auto"`, the layer's dropout key, packed rows, the projections'
    biases), 2 layers in bf16 with dropout, its gradients lowered for a GPU: each layer's attention is a forward and
    a backward Triton kernel, and no [S, S] array is left outside them."""
    config = BertConfig(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=128, max_position_embeddings=256, dtype="bfloat16")
    model = BertModel(config, add_pooler=False)
    ids = jax.ShapeDtypeStruct((2, 256), jnp.int32)
    params = jax.eval_shape(lambda: model.init(jax.random.key(0), *(jnp.zeros((2, 256), jnp.int32),) * 3))["params"]

    def gradients(params, input_ids, input_mask, packing_ids):
        def loss(params):
            out = model.apply({"params": params}, input_ids, input_mask, jnp.zeros_like(input_ids),
                              packing_ids=packing_ids, deterministic=False, rngs={"dropout": jax.random.key(1)})[0]
            return jnp.sum(out.astype(jnp.float32))
        return jax.grad(loss)(params)

    text = _lowered_for_a_gpu(gradients, params, ids, ids, ids)
    assert _triton_calls(text) == 2 * 2
    assert "256x256x" not in text


def test_modernbert_training_on_a_gpu_runs_its_attention_in_the_triton_kernels_on_stacked_qkv():
    """ModernBERT's own path on a GPU (`auto`, packed rows, bf16, windows and global layers): each layer's attention is
    a forward and a backward Triton kernel taking the projection's [B, S, 3, H, D] output, and no [S, S] array is left
    outside them."""
    from bertjax.model.modernbert import model as modernbert
    from bertjax.model.modernbert.config import ModernBertConfig

    config = ModernBertConfig(hidden_size=128, num_attention_heads=2, intermediate_size=192, num_hidden_layers=3,
                              local_attention=64, vocab_size=128, pad_token_id=0, dtype="bfloat16")
    model = modernbert.ModernBertForMaskedLM(config)
    ids = jax.ShapeDtypeStruct((2, 256), jnp.int32)
    params = jax.eval_shape(lambda: model.init(jax.random.key(0), *(jnp.zeros((2, 256), jnp.int32),) * 2))["params"]

    def gradients(params, input_ids, input_mask, packing_ids, position_ids):
        def loss(params):
            out = model.apply({"params": params}, input_ids, input_mask, packing_ids=packing_ids,
                              position_ids=position_ids, deterministic=False,
                              rngs={"dropout": jax.random.key(1)})["mlm_logits"]
            return jnp.sum(out)
        return jax.grad(loss)(params)

    text = _lowered_for_a_gpu(gradients, params, ids, ids, ids, ids)
    assert _triton_calls(text) == 2 * 3
    kernels = [line for line in text.splitlines() if 'name = "flash_dropout_gpu' in line]
    assert all("tensor<2x256x3x2x64xbf16>" in line for line in kernels)
    assert "256x256x" not in text
