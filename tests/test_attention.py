"""Every attention backend against the reference einsum, forward and gradient, with padding and packing."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from bertjax.model.attention import (
    CHUNKED_MIN_LENGTH,
    dot_product_attention,
    reference_attention,
    resolve_backend,
)
from bertjax.model.chunked_attention import chunk_block, chunked_attention

BATCH, LENGTH, HEADS, HEAD_DIM = 3, 40, 2, 16


@pytest.fixture(scope="module")
def inputs():
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.normal(size=(BATCH, LENGTH, HEADS, HEAD_DIM)), jnp.float32) for _ in range(3))
    input_mask = np.ones((BATCH, LENGTH), np.int32)
    input_mask[1, 25:] = 0            # padded example
    input_mask[2, 1:] = 0             # almost fully padded: only one real token
    packing_ids = np.zeros((BATCH, LENGTH), np.int32)
    packing_ids[0, 18:] = 1           # two sequences packed into row 0
    return q, k, v, input_mask, packing_ids


def _naive(q, k, v, input_mask, packing_ids, window=None):
    """Per-example, per-head numpy attention over the allowed keys only (an independent reference)."""
    q, k, v = (np.asarray(t, np.float64) for t in (q, k, v))
    out = np.zeros_like(q)
    for b in range(q.shape[0]):
        for i in range(q.shape[1]):
            allowed = (input_mask[b] == 1) & (packing_ids[b] == packing_ids[b, i])
            if window is not None:
                allowed &= np.abs(np.arange(q.shape[1]) - i) <= window
            if not input_mask[b, i] or not allowed.any():
                continue
            for h in range(q.shape[2]):
                logits = k[b, allowed, h] @ q[b, i, h] / np.sqrt(q.shape[-1])
                p = np.exp(logits - logits.max())
                out[b, i, h] = (p / p.sum()) @ v[b, allowed, h]
    return out


def _loss(backend, input_mask, packing_ids, window=None):
    weights = jnp.asarray(input_mask, jnp.float32)[:, :, None, None]

    def loss(q, k, v):
        out = dot_product_attention(q, k, v, input_mask, packing_ids, backend=backend, window=window)
        return jnp.sum(jnp.sin(out) * weights)
    return loss


@pytest.mark.parametrize("window", [None, 5])
def test_reference_matches_naive_attention(inputs, window):
    q, k, v, input_mask, packing_ids = inputs
    out = reference_attention(q, k, v, input_mask, packing_ids, window=window)
    valid = input_mask.astype(bool)
    np.testing.assert_allclose(np.asarray(out)[valid], _naive(q, k, v, input_mask, packing_ids, window)[valid],
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend, window", [("dot_product", None), ("pallas_tpu", None), ("splash_tpu", None),
                                             ("dot_product", 5), ("splash_tpu", 5), ("chunked", 5)])
def test_backend_matches_reference_forward_and_gradient(inputs, backend, window):
    """With a window (ModernBERT's local layers) as well: 5 tokens each side of rows of 40 with packing; splash
    takes it as its block-sparse local mask."""
    if backend.endswith("_tpu") and jax.default_backend() == "gpu":
        pytest.skip("the Pallas TPU interpret mode runs on CPU (and TPU), not on a GPU backend")
    q, k, v, input_mask, packing_ids = inputs
    valid = input_mask.astype(bool)
    # The Pallas TPU kernels run on CPU in interpret mode; the context must cover the backward trace too.
    with pltpu.force_tpu_interpret_mode():
        out = dot_product_attention(q, k, v, input_mask, packing_ids, backend=backend, window=window)
        grads = jax.grad(_loss(backend, input_mask, packing_ids, window), argnums=(0, 1, 2))(q, k, v)
    reference = reference_attention(q, k, v, input_mask, packing_ids, window=window)
    reference_grads = jax.grad(_loss("reference", input_mask, packing_ids, window), argnums=(0, 1, 2))(q, k, v)
    assert np.isfinite(np.asarray(out)).all(), "a padded row produced NaN/inf"
    np.testing.assert_allclose(np.asarray(out)[valid], np.asarray(reference)[valid], rtol=1e-5, atol=1e-5)
    for grad, expected in zip(grads, reference_grads):
        assert np.isfinite(np.asarray(grad)).all()
        np.testing.assert_allclose(np.asarray(grad), np.asarray(expected), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("length, window, block", [
    (40, 5, 16),     # the length not a multiple of the block; bands overlapping blocks on both sides
    (40, None, 16),  # global: every key for every block
    (40, 50, 16),    # a window wider than the row: every key, the window still applied
    (40, 5, 64),     # one block longer than the row
    (37, 4, 8),      # an odd length, blocks smaller than the band; the padded example's real tokens end in a block
])
def test_chunked_matches_reference_at_every_block_layout(length, window, block):
    """The chunked backend's blocks and bands against the reference, values and gradients, with a padded row, an
    almost empty one and two sequences packed into one (their boundary inside a block)."""
    rng = np.random.default_rng(length)
    q, k, v = (jnp.asarray(rng.normal(size=(3, length, 2, 8)), jnp.float32) for _ in range(3))
    input_mask = np.ones((3, length), np.int32)
    input_mask[1, length * 2 // 3:] = 0
    input_mask[2, 2:] = 0
    packing_ids = np.zeros((3, length), np.int32)
    packing_ids[0, length // 3 + 1:] = 1
    valid = input_mask.astype(bool)
    weights = jnp.asarray(input_mask, jnp.float32)[:, :, None, None]   # padding queries' outputs are ignorable

    def loss(attend):
        return lambda q, k, v: jnp.sum(jnp.sin(attend(q, k, v)) * weights)

    chunked = lambda q, k, v: chunked_attention(q, k, v, input_mask, packing_ids, window=window, block=block)  # noqa: E731
    reference = lambda q, k, v: reference_attention(q, k, v, input_mask, packing_ids, window=window)  # noqa: E731
    out = chunked(q, k, v)
    assert np.isfinite(np.asarray(out)).all()
    np.testing.assert_allclose(np.asarray(out)[valid], np.asarray(reference(q, k, v))[valid], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(out)[valid], _naive(q, k, v, input_mask, packing_ids, window)[valid],
                               rtol=1e-5, atol=1e-5)
    for grad, expected in zip(jax.grad(loss(chunked), argnums=(0, 1, 2))(q, k, v),
                              jax.grad(loss(reference), argnums=(0, 1, 2))(q, k, v)):
        np.testing.assert_allclose(np.asarray(grad), np.asarray(expected), rtol=1e-5, atol=1e-6)


def test_chunked_memory_grows_linearly_with_a_window():
    """The claim behind long contexts on a CPU: with a window, the chunked backend's forward and backward hold
    memory linear in the length (XLA's compiled temporaries, doubling with it), where the reference's [heads, S, S]
    scores quadruple; without a window its blocks' scores grow with the length once, not its square."""
    def temporaries(backend, length, window):
        shape = jax.ShapeDtypeStruct((1, length, 2, 16), jnp.float32)
        mask = jax.ShapeDtypeStruct((1, length), jnp.int32)
        attend = chunked_attention if backend == "chunked" else reference_attention
        loss = lambda q, k, v, m: jnp.sum(attend(q, k, v, m, window=window))  # noqa: E731
        compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(shape, shape, shape, mask).compile()
        return compiled.memory_analysis().temp_size_in_bytes

    windowed = [temporaries("chunked", length, 8) for length in (2048, 4096)]
    assert 1.8 < windowed[1] / windowed[0] < 2.2, windowed
    reference = temporaries("reference", 4096, 8)
    assert reference > 4096 * 4096 * 2 * 4 > 20 * windowed[1], (reference, windowed)
    assert temporaries("chunked", 4096, None) < reference / 4


def test_chunked_block_sizes():
    assert chunk_block(1, 8192, 12, window=64) == 64   # ModernBERT-base's 64 each side: a band of 192 keys
    assert chunk_block(1, 8192, 12, window=4) == 32
    assert chunk_block(1, 8192, 12, window=None) == 128   # 12 x 128 x 8192 float32 scores: 48 MiB
    assert chunk_block(1, 1024, 12, window=None) == 512
    assert chunk_block(64, 8192, 12, window=None) == 16


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="the cuDNN fused attention needs an NVIDIA GPU")
@pytest.mark.parametrize("backend", ["dot_product", "cudnn"])
def test_gpu_fused_backend_matches_reference_in_bfloat16(backend):
    """cuDNN flash attention (bf16 only) at a BERT-like shape against the float32 reference on the same inputs."""
    rng = np.random.default_rng(1)
    shape = (4, 128, 4, 64)
    q, k, v = (jnp.asarray(rng.normal(size=shape), jnp.bfloat16) for _ in range(3))
    input_mask = np.ones(shape[:2], np.int32)
    input_mask[1, 70:] = 0
    input_mask[3, 5:] = 0
    valid = input_mask.astype(bool)
    out = dot_product_attention(q, k, v, input_mask, backend=backend)
    grads = jax.grad(_loss(backend, input_mask, None), argnums=(0, 1, 2))(q, k, v)
    as32 = [t.astype(jnp.float32) for t in (q, k, v)]
    reference = reference_attention(*as32, input_mask)
    reference_grads = jax.grad(_loss("reference", input_mask, None), argnums=(0, 1, 2))(*as32)

    def relative(a, b):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        return np.linalg.norm(a - b) / np.linalg.norm(b)
    assert out.dtype == jnp.bfloat16
    assert relative(np.asarray(out, np.float32)[valid], np.asarray(reference)[valid]) < 1e-2
    for grad, expected in zip(grads, reference_grads):
        assert relative(grad, expected) < 2e-2


def test_fully_padded_rows_are_finite(inputs):
    q, k, v, _, _ = inputs
    no_tokens = np.zeros((BATCH, LENGTH), np.int32)
    out = reference_attention(q, k, v, no_tokens)
    assert np.isfinite(np.asarray(out)).all()


def test_attention_dropout_is_applied_and_rescaled(inputs):
    q, k, v, input_mask, _ = inputs
    v_ones = jnp.ones_like(v)
    out = reference_attention(q, k, v_ones, input_mask, dropout_rate=0.5, dropout_rng=jax.random.key(0),
                              deterministic=False)
    # With v = 1 each output is the sum of kept, rescaled probabilities: 1 in expectation, not exactly 1.
    valid = np.asarray(out)[input_mask.astype(bool)]
    assert not np.allclose(valid, 1.0)
    assert abs(valid.mean() - 1.0) < 0.1


def test_backend_selection():
    assert resolve_backend("auto", dropout_active=False, platform="tpu") == "splash_tpu"
    assert resolve_backend("auto", dropout_active=False, platform="gpu") == "dot_product"
    assert resolve_backend("auto", dropout_active=False, platform="cpu") == "reference"
    assert resolve_backend("auto", dropout_active=True, platform="gpu", length=128) == "flash_dropout_gpu"
    assert resolve_backend("auto", dropout_active=True, platform="gpu", length=512) == "flash_dropout_gpu"
    assert resolve_backend("auto", dropout_active=True, platform="gpu", length=127) == "reference"
    assert resolve_backend("auto", dropout_active=True, platform="cpu") == "reference"
    # Long rows on a CPU: chunked (scores never held whole), with or without a window; not with dropout.
    for windowed in (False, True):
        assert resolve_backend("auto", False, "cpu", CHUNKED_MIN_LENGTH, windowed=windowed) == "chunked"
        assert resolve_backend("auto", False, "cpu", CHUNKED_MIN_LENGTH - 1, windowed=windowed) == "reference"
        assert resolve_backend("auto", True, "cpu", 8192, windowed=windowed) == "reference"
    assert resolve_backend("auto", False, "tpu", 8192) == "splash_tpu"
    with pytest.raises(ValueError, match="'chunked' has no attention dropout"):
        resolve_backend("chunked", dropout_active=True)
    assert resolve_backend("auto", dropout_active=True, platform="tpu", length=512) == "flash_dropout_tpu"
    assert resolve_backend("auto", dropout_active=True, platform="tpu", length=256) == "flash_dropout_tpu"
    assert resolve_backend("auto", dropout_active=True, platform="tpu", length=128) == "flash_dropout_tpu"
    assert resolve_backend("auto", dropout_active=True, platform="tpu", length=127) == "reference"
    assert resolve_backend("flash_dropout_tpu", dropout_active=True) == "flash_dropout_tpu"
    assert resolve_backend("flash_dropout_gpu", dropout_active=True) == "flash_dropout_gpu"
    with pytest.raises(ValueError, match="has no attention dropout"):
        resolve_backend("pallas_tpu", dropout_active=True)
    # A window: the backends that take one (the dropout kernels do not).
    assert resolve_backend("auto", dropout_active=False, platform="tpu", windowed=True) == "splash_tpu"
    assert resolve_backend("auto", dropout_active=False, platform="gpu", windowed=True) == "dot_product"
    assert resolve_backend("auto", dropout_active=True, platform="tpu", length=512, windowed=True) == \
        "flash_dropout_tpu"
    assert resolve_backend("auto", dropout_active=False, platform="tpu", length=1024, windowed=True) == \
        "flash_dropout_tpu"
    assert resolve_backend("auto", dropout_active=True, platform="gpu", length=512, windowed=True) == \
        "flash_dropout_gpu"
    assert resolve_backend("auto", dropout_active=True, platform="gpu", length=64, windowed=True) == "reference"
    assert resolve_backend("flash_dropout_tpu", dropout_active=True, windowed=True) == "flash_dropout_tpu"
    with pytest.raises(ValueError, match="'cudnn' has no sliding window"):
        resolve_backend("cudnn", dropout_active=False, windowed=True)
    with pytest.raises(ValueError, match="'splash_tpu' has no attention dropout"):
        resolve_backend("splash_tpu", dropout_active=True, windowed=True)


@pytest.mark.usefixtures("no_cache_writes")
def test_splash_lowers_to_a_mosaic_kernel_for_a_tpu_mesh():
    """Traced for a TPU mesh (libtpu's compile-only devices on this CPU), the splash backend batches its kernel
    with vmap and lowers it to Mosaic; off TPU (the cases above) it loops over the examples in interpret mode.
    Lowered only: XLA:TPU's compile of the whole step is test_tpu_compile.py's (slow for splash)."""
    pytest.importorskip("libtpu", reason="lowering for TPU needs libtpu")
    from bertjax import sharding
    from bertjax.cloud import topologies

    devices = topologies.compile_only_devices(topologies.parse_topology("v5e:2x2"))
    mesh = sharding.make_mesh(data=len(devices), fsdp=1, tensor=1, devices=devices)
    qkv = jax.ShapeDtypeStruct((4, 128, 2, 64), jnp.float32)
    mask = jax.ShapeDtypeStruct((4, 128), jnp.int32)
    with sharding.activate(mesh):
        assert sharding.target_platform() == "tpu"
        lowered = jax.jit(lambda q, k, v, m: dot_product_attention(q, k, v, m, backend="splash_tpu")).lower(
            qkv, qkv, qkv, mask)
    text = lowered.as_text()
    assert text.count("tpu_custom_call") == 1 and "splash" in text, text[:2000]
