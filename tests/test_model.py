"""Model behaviour beyond HF parity: sharding invariance, dropout RNG, compute dtype, embedding CLI."""
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

from bertjax import sharding
from bertjax.cli import main as cli
from bertjax.model.bert import model as model_lib
from bertjax.model.bert.config import BertConfig

CONFIG = BertConfig.preset("tiny", vocab_size=96, hidden_size=64, num_attention_heads=4, intermediate_size=128,
                           max_position_embeddings=32)


@pytest.fixture(scope="module")
def pretraining():
    module = model_lib.BertForPreTraining(CONFIG)
    boxed = model_lib.init_params(module, CONFIG, jax.random.key(0))
    rng = np.random.default_rng(0)
    batch = dict(input_ids=rng.integers(0, 96, (8, 16)).astype(np.int32),
                 input_mask=np.ones((8, 16), np.int32), segment_ids=np.zeros((8, 16), np.int32),
                 masked_lm_positions=rng.integers(0, 12, (8, 3)).astype(np.int32))
    batch["input_mask"][3, 9:] = 0
    batch["segment_ids"][:, 8:] = 1
    return module, boxed, batch


def _apply(module):
    return lambda params, b: module.apply({"params": params}, b["input_ids"], b["input_mask"], b["segment_ids"],
                                          b["masked_lm_positions"])


@pytest.mark.parametrize("mesh_shape", [(8, 1, 1), (2, 2, 2), (1, 2, 4)])
def test_sharded_output_equals_unsharded(pretraining, mesh_shape):
    assert len(jax.devices()) == 8, "conftest sets 8 host devices"
    module, boxed, batch = pretraining
    params = nn.meta.unbox(boxed)
    expected = jax.jit(_apply(module))(params, batch)
    mesh = sharding.make_mesh(*mesh_shape)
    param_shardings = sharding.param_shardings(boxed, mesh)
    batch_sharding = sharding.batch_sharding(mesh)
    with sharding.activate(mesh):
        sharded_params = jax.device_put(params, param_shardings)
        sharded_batch = jax.device_put(batch, batch_sharding)
        out = jax.jit(_apply(module))(sharded_params, sharded_batch)
    # Parameters really are split: the query kernel is spread over fsdp x tensor.
    query = sharded_params["bert"]["layer_0"]["attention"]["self"]["query"]["kernel"]
    assert query.sharding.spec == jax.sharding.PartitionSpec("fsdp", "tensor")
    assert len(query.addressable_shards) == 8
    for key in expected:
        np.testing.assert_allclose(np.asarray(out[key]), np.asarray(expected[key]), rtol=1e-5, atol=1e-5)


def test_mesh_shape_validation():
    assert sharding.mesh_shape(8, data=-1, fsdp=2, tensor=2) == (2, 2, 2)
    with pytest.raises(ValueError, match="does not divide 8 devices"):
        sharding.mesh_shape(8, data=-1, fsdp=3)
    with pytest.raises(ValueError, match="at most one mesh axis may be -1"):
        sharding.mesh_shape(8, data=-1, fsdp=-1)


def test_every_param_has_logical_axis_names(pretraining):
    _, boxed, _ = pretraining
    leaves = jax.tree_util.tree_leaves(boxed, is_leaf=lambda x: isinstance(x, nn.LogicallyPartitioned))
    assert leaves and all(isinstance(leaf, nn.LogicallyPartitioned) for leaf in leaves)
    assert all(len(leaf.names) == leaf.value.ndim for leaf in leaves)


def test_dropout_uses_the_explicit_rng(pretraining):
    module, boxed, batch = pretraining
    params = nn.meta.unbox(boxed)
    run = lambda key: module.apply({"params": params}, batch["input_ids"], batch["input_mask"],
                                   batch["segment_ids"], batch["masked_lm_positions"], deterministic=False,
                                   rngs={"dropout": key})["mlm_logits"]
    a, b, c = run(jax.random.key(1)), run(jax.random.key(1)), run(jax.random.key(2))
    assert np.array_equal(a, b)
    assert not np.allclose(a, c)
    with pytest.raises(Exception, match="dropout"):
        module.apply({"params": params}, batch["input_ids"], batch["input_mask"], batch["segment_ids"],
                     batch["masked_lm_positions"], deterministic=False)


def test_bfloat16_compute_keeps_float32_params_and_logits(pretraining):
    module, boxed, batch = pretraining
    params = nn.meta.unbox(boxed)
    assert all(p.dtype == jnp.float32 for p in jax.tree_util.tree_leaves(params))
    bf16 = model_lib.BertForPreTraining(CONFIG.replace(dtype="bfloat16"))
    out = _apply(bf16)(params, batch)
    reference = _apply(module)(params, batch)
    assert out["mlm_logits"].dtype == jnp.float32
    # bf16 has ~3 significant digits: close to float32, but not identical.
    assert 0 < float(jnp.abs(out["mlm_logits"] - reference["mlm_logits"]).max()) < 0.1


def test_embed_cli_mean_pooling_matches_transformers(minilm_dir, tmp_path):
    sentences = ["A man is playing a guitar.", "Someone plays an instrument on stage tonight.", "Stocks fell."]
    (tmp_path / "in.txt").write_text("\n".join(sentences) + "\n")
    assert cli(["embed", "--checkpoint", str(minilm_dir), "--input", str(tmp_path / "in.txt"),
                "--output", str(tmp_path / "emb.npy"), "--pooling", "mean", "--max-len", "32",
                "--batch-size", "2"]) == 0
    ours = np.load(tmp_path / "emb.npy")
    tokenizer = transformers.BertTokenizerFast.from_pretrained(str(minilm_dir))
    reference = transformers.BertModel.from_pretrained(str(minilm_dir)).eval()
    batch = tokenizer(sentences, padding=True, return_tensors="pt")
    with torch.no_grad():
        hidden = reference(**batch).last_hidden_state
    mask = batch["attention_mask"][..., None].float()
    expected = ((hidden * mask).sum(1) / mask.sum(1)).numpy()
    assert ours.shape == (3, 384)
    np.testing.assert_allclose(ours, expected, rtol=1e-4, atol=1e-4)


def test_embed_gives_one_row_per_input_line(minilm_dir, tmp_path, capsys):
    # Python's splitlines() would cut lines 3-5 in two and drop line 2: rows would no longer match lines.
    lines = ["A man is playing a guitar.", "", "Two\u2028halves", "form\x0cfeed", "next\x85line", "bad \udcff"]
    data = "\r\n".join(lines[:-1]).encode("utf-8") + b"\nbad \xff\n"
    (tmp_path / "in.txt").write_bytes(data)
    argv = ["--checkpoint", str(minilm_dir), "--pooling", "mean", "--max-len", "16"]
    assert cli(["embed", "--input", str(tmp_path / "in.txt"), "--output", str(tmp_path / "all.npy"), *argv]) == 0
    assert (f"--input {tmp_path / 'in.txt'}: 6 lines, one row each; 1 blank line(s) embedded as the empty sequence "
            f"[CLS] [SEP]; 1 line(s) with invalid UTF-8 (lines 6)") in capsys.readouterr().out
    rows = np.load(tmp_path / "all.npy")
    assert rows.shape == (6, 384)
    for index in (0, 2, 4):  # each row is its line's own embedding
        (tmp_path / "one.txt").write_bytes(data.split(b"\n")[index].rstrip(b"\r") + b"\n")
        assert cli(["embed", "--input", str(tmp_path / "one.txt"), "--output", str(tmp_path / "one.npy"), *argv]) == 0
        np.testing.assert_allclose(np.load(tmp_path / "one.npy")[0], rows[index], rtol=1e-5, atol=1e-5)


def test_embed_cli_rejects_empty_input(minilm_dir, tmp_path, capsys):
    (tmp_path / "empty.txt").write_text("\n\n")
    assert cli(["embed", "--checkpoint", str(minilm_dir), "--input", str(tmp_path / "empty.txt"),
                "--output", str(tmp_path / "o.npy")]) == 2
    assert "holds no sentences" in capsys.readouterr().err


def test_embed_refuses_an_output_it_could_not_write_before_reading_anything(minilm_dir, tmp_path, capsys):
    """An --output in a missing directory, naming a directory, or naming the input is one line before any work:
    before the input is read (the empty input's own error does not come first) and the model loads; nothing is
    written and the input is kept."""
    source = tmp_path / "empty.txt"
    source.write_text("\n\n")
    (tmp_path / "folder").mkdir()
    for output, expected in ((tmp_path / "no" / "o.npy", f"no directory {tmp_path / 'no'}; create it first"),
                             (tmp_path / "folder", "is a directory; expected a file name"),
                             (source, f"is the input {source}; writing it would replace the input")):
        assert cli(["embed", "--checkpoint", str(minilm_dir), "--input", str(source), "--output", str(output)]) == 2
        last = capsys.readouterr().err.strip().splitlines()[-1]
        assert last.startswith(f"bertjax embed: error: --output {output}") and expected in last, last
    assert source.read_text() == "\n\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty.txt", "folder"]


def test_small_table_lookup_equals_gather_forward_and_gradient():
    """The token-type lookup (no gather, so no scatter-add gradient) is exactly table[ids], gradient included."""
    rng = np.random.default_rng(0)
    table = jnp.asarray(rng.normal(size=(3, 5)), jnp.float32)
    ids = jnp.asarray(rng.integers(0, 3, size=(4, 7)), jnp.int32)
    weights = jnp.asarray(rng.normal(size=(4, 7, 5)), jnp.float32)
    np.testing.assert_array_equal(model_lib.small_table_lookup(table, ids), jnp.take(table, ids, axis=0))
    grad = jax.grad(lambda t: jnp.sum(model_lib.small_table_lookup(t, ids) * weights))(table)
    expected = np.zeros((3, 5), np.float32)
    np.add.at(expected, np.asarray(ids), np.asarray(weights))
    np.testing.assert_allclose(grad, expected, rtol=1e-6, atol=1e-6)


def test_fresh_kernels_are_tf_berts_truncated_normal():
    """initializer_range is the std of the untruncated normal (TF BERT's truncated_normal_initializer), so a fresh
    kernel has std 0.8796 * 0.02 = 0.0176 and nothing beyond 2 * 0.02. The factor used to be applied twice (std
    0.0155): the NER head started smaller than BERT's or HF's."""
    config = BertConfig.preset("tiny", vocab_size=96, hidden_size=256, num_attention_heads=4, intermediate_size=512,
                               max_position_embeddings=32)
    params = nn.meta.unbox(model_lib.init_params(model_lib.BertForTokenClassification(config, 64), config,
                                                 jax.random.key(0)))
    kernel = np.asarray(params["classifier"]["kernel"])  # 16384 draws: the std is known to ~0.5%
    assert kernel.std() == pytest.approx(model_lib._TRUNCATED_STD * config.initializer_range, rel=0.02)
    assert np.abs(kernel).max() <= 2 * config.initializer_range
    assert np.all(np.asarray(params["classifier"]["bias"]) == 0)


@pytest.mark.parametrize("approximate", [False, True])
def test_gelu_keeps_only_its_input_for_the_backward_and_its_gradient_is_the_analytic_one(approximate):
    """The GELU's forward is jax.nn.gelu's bits; the backward saves x alone (jax.nn.gelu differentiated as written
    saved its intermediates too: on GPU three [B, L, 3072] tensors a layer) and its gradient equals the analytic
    derivative evaluated in float64."""
    from jax._src.ad_checkpoint import saved_residuals
    from scipy.special import erf
    x = jnp.linspace(-6.0, 6.0, 2001, dtype=jnp.float32)
    gelu = model_lib.activation("gelu_new" if approximate else "gelu")
    np.testing.assert_array_equal(gelu(x), jax.nn.gelu(x, approximate=approximate))
    residuals = [r for r, _ in saved_residuals(lambda v: gelu(v).sum(), x) if r.shape]
    assert [(r.shape, r.dtype) for r in residuals] == [(x.shape, x.dtype)]
    x64 = np.asarray(x, np.float64)
    if approximate:
        c = np.sqrt(2 / np.pi)
        t = np.tanh(c * (x64 + 0.044715 * x64 ** 3))
        expected = 0.5 * (1 + t) + 0.5 * x64 * (1 - t * t) * c * (1 + 3 * 0.044715 * x64 ** 2)
    else:
        expected = 0.5 * (1 + erf(x64 / np.sqrt(2))) + x64 * np.exp(-x64 ** 2 / 2) / np.sqrt(2 * np.pi)
    grad = jax.grad(lambda v: gelu(v).sum())(x)
    # The absolute floor: float32's 1 - tanh^2 cancels to 0 in the tails (x < -4.4), where the true slope is ~1e-6.
    np.testing.assert_allclose(grad, expected, rtol=1e-5, atol=1e-5 * np.abs(expected).max())


@pytest.mark.parametrize("approximate", [False, True])
@pytest.mark.parametrize("dtype, tol", [(jnp.float32, 1e-6), (jnp.bfloat16, 1e-2)])
def test_gelu_with_bias_keeps_the_matmul_output_and_bias_and_matches_autodiff(approximate, dtype, tol):
    """gelu(h + b) with the bias inside the custom_vjp: jax.nn.gelu's bits forward; residuals h and b (not h + b);
    the gradients of h and b those of the GELU before it (`gelu`, on h + b; bias summed over rows) and, in float32,
    of jax.nn.gelu(h + b) differentiated as written (in bfloat16 that one's own rounding is the larger error)."""
    from jax._src.ad_checkpoint import saved_residuals
    from bertjax.model.gelu import gelu, gelu_with_bias
    rng = np.random.default_rng(1)
    h = jnp.asarray(rng.normal(0, 2, (4, 6, 32)), dtype)
    bias = jnp.asarray(rng.normal(0, 1, 32), dtype)
    weights = jnp.asarray(rng.normal(0, 1, (4, 6, 32)), dtype)
    ours = lambda h, b: gelu_with_bias(h, b, approximate)
    plain = lambda h, b: jax.nn.gelu(h + b, approximate=approximate)
    before = lambda h, b: gelu(h + b, approximate)
    np.testing.assert_array_equal(ours(h, bias), plain(h, bias))
    residuals = [(r.shape, r.dtype) for r, _ in saved_residuals(lambda h, b: ours(h, b).sum(), h, bias) if r.shape]
    assert sorted(residuals) == sorted([(h.shape, h.dtype), (bias.shape, bias.dtype)])
    loss = lambda f: lambda h, b: jnp.sum((f(h, b) * weights).astype(jnp.float32))
    got = jax.grad(loss(ours), argnums=(0, 1))(h, bias)
    references = [before] + ([plain] if dtype == jnp.float32 else [])
    for g, w in ((g, w) for f in references for g, w in zip(got, jax.grad(loss(f), argnums=(0, 1))(h, bias))):
        assert g.dtype == w.dtype and g.shape == w.shape
        scale = float(np.abs(np.asarray(w, np.float32)).max())
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32), rtol=tol,
                                   atol=tol * scale)


@pytest.mark.parametrize("of_pair", [False, True])
@pytest.mark.parametrize("name", ["gelu", "gelu_pytorch_tanh", "silu"])
@pytest.mark.parametrize("dtype, tol", [(jnp.float32, 1e-6), (jnp.bfloat16, 1e-2)])
def test_the_gated_gelu_keeps_its_inputs_alone_and_its_gradient_is_autodiffs(of_pair, name, dtype, tol):
    """GeGLU's act(x) * gate, of two products (TPU) or of y [..., 2, width] = (x, gate) (one product elsewhere):
    jax.nn.gelu's bits forward; the GELUs' residuals are their inputs alone (as written, autodiff kept gelu(x)
    too); the gradients those of the expression differentiated as written (in bfloat16 that one's own rounding is
    the larger error)."""
    from jax._src.ad_checkpoint import saved_residuals
    rng = np.random.default_rng(4)
    y = jnp.asarray(rng.normal(0, 2, (3, 5, 2, 32)), dtype)
    weights = jnp.asarray(rng.normal(0, 1, (3, 5, 32)), dtype)
    gated = model_lib.gated_activation(name, of_pair)
    ours = gated if of_pair else lambda y: gated(y[..., 0, :], y[..., 1, :])
    plain = lambda y: model_lib.activation(name)(y[..., 0, :]) * y[..., 1, :]
    np.testing.assert_array_equal(ours(y), plain(y))
    if name != "silu":
        args = (y,) if of_pair else (y[..., 0, :], y[..., 1, :])
        residuals = [(r.shape, r.dtype) for r, _ in saved_residuals(lambda *a: gated(*a).sum(), *args) if r.shape]
        assert residuals == [(a.shape, a.dtype) for a in args]
    loss = lambda f: lambda y: jnp.sum((f(y) * weights).astype(jnp.float32))
    got, want = jax.grad(loss(ours))(y), jax.grad(loss(plain))(y)
    assert got.dtype == want.dtype == dtype and got.shape == y.shape
    scale = float(np.abs(np.asarray(want, np.float32)).max())
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=tol, atol=tol * scale)


def test_intermediate_is_dense_then_activation_with_the_same_params():
    """The feed-forward's first Dense with its activation (bias inside the GELU) equals nn.Dense then the GELU on
    the params nn.Dense names and shapes (`intermediate/kernel` [H, I], `intermediate/bias` [I]), gradients too."""
    config = BertConfig.preset("tiny", vocab_size=96, hidden_size=64, num_attention_heads=4, intermediate_size=128,
                               max_position_embeddings=32, hidden_act="gelu")
    x = jnp.asarray(np.random.default_rng(2).normal(size=(3, 5, 64)), jnp.float32)
    module = model_lib.Intermediate(config)
    params = nn.meta.unbox(module.init(jax.random.key(0), x)["params"])
    assert {k: v.shape for k, v in params.items()} == {"kernel": (64, 128), "bias": (128,)}
    params["bias"] = jnp.asarray(np.random.default_rng(3).normal(size=128), jnp.float32)
    dense = nn.Dense(128, param_dtype=jnp.float32)
    reference = lambda p: jnp.sum(jax.nn.gelu(dense.apply({"params": p}, x), approximate=False) ** 2)
    ours = lambda p: jnp.sum(module.apply({"params": p}, x) ** 2)
    np.testing.assert_allclose(ours(params), reference(params), rtol=1e-6)
    got, want = jax.grad(ours)(params), jax.grad(reference)(params)
    for name in ("kernel", "bias"):
        np.testing.assert_allclose(got[name], want[name], rtol=1e-5, atol=1e-6 * np.abs(want[name]).max())
