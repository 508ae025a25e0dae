"""ModernBERT, the second encoder family: equal to transformers' ModernBertModel and task models for the same weights
(padded batches with sentences longer than the window, packed rows), its config read in both of HF's spellings, and
HF -> bertjax -> HF bit-exact with the tokenizer.json carried through."""
import json

import numpy as np
import pytest
import torch
import transformers
from safetensors.numpy import load_file

from bertjax.cli import main as cli
from bertjax.checkpoint import save_model
from bertjax.interop.load import checkpoint_tokenizer, load_pretrained
from bertjax.model import family
from bertjax.model.modernbert import model as modernbert
from bertjax.model.modernbert.config import FULL, SLIDING, ModernBertConfig
from tests import modernbert_fixture

# Held out from the BPE's training text (examples/), each longer than the window of 8.
HELD_OUT = ["The orchestra tuned their instruments while the audience slowly found their seats.",
            "Rain fell on the harbour all night, and by morning the boats were gone.",
            "She wrote three letters.",
            "A compiler turns source code into a program that the machine can run."]


def relative_error(ours, theirs, where=None) -> float:
    ours, theirs = np.asarray(ours, np.float64), np.asarray(theirs, np.float64)
    if where is not None:
        ours, theirs = ours[where], theirs[where]
    return float(np.abs(ours - theirs).max() / np.abs(theirs).max())


@pytest.fixture(scope="module")
def tokenizer():
    return modernbert_fixture.bpe_tokenizer()


@pytest.fixture(scope="module")
def masked_lm_dir(tmp_path_factory):
    """ModernBERT's defaults: no biases, tied decoder with a bias, cls pooling."""
    return modernbert_fixture.write_masked_lm(tmp_path_factory.mktemp("modernbert") / "hf")


@pytest.fixture(scope="module")
def every_option(tokenizer):
    """The other side of every switch: norm, attention, MLP and head biases, an untied decoder without a bias,
    mean pooling, another activation, and a layer pattern given as layer_types."""
    config = modernbert_fixture.hf_config(
        tokenizer, norm_bias=True, attention_bias=True, mlp_bias=True, classifier_bias=True, decoder_bias=False,
        tie_word_embeddings=False, classifier_pooling="mean", hidden_activation="gelu_pytorch_tanh",
        classifier_activation="silu", layer_types=[FULL, SLIDING, FULL, SLIDING], norm_eps=1e-6)
    torch.manual_seed(1)
    return modernbert_fixture.perturbed(transformers.ModernBertForMaskedLM(config), seed=1)


def _batch(tokenizer, texts):
    encoded = tokenizer(texts, padding=True, return_tensors="np")
    ids, mask = encoded["input_ids"].astype(np.int32), encoded["attention_mask"].astype(np.int32)
    assert ids.shape[1] > 2 * 8, "the sentences must be longer than the window"
    return ids, mask


def _ours_from(reference, tokenizer, tmp_path):
    reference.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    return load_pretrained(str(tmp_path))


def test_hidden_states_and_logits_equal_transformers_on_padded_sentences_longer_than_the_window(
        masked_lm_dir, tokenizer):
    reference = transformers.ModernBertForMaskedLM.from_pretrained(masked_lm_dir).eval()
    loaded = load_pretrained(str(masked_lm_dir))
    ids, mask = _batch(tokenizer, HELD_OUT)
    with torch.no_grad():
        out = reference(input_ids=torch.from_numpy(ids).long(), attention_mask=torch.from_numpy(mask),
                        output_hidden_states=True)
    logits, state = modernbert.ModernBertForMaskedLM(loaded.config).apply(
        {"params": loaded.params}, ids, mask, mutable=["intermediates"])
    hidden = state["intermediates"]["bert"]["hidden_states"]
    assert len(hidden) == len(out.hidden_states) == loaded.config.num_hidden_layers + 1
    real = mask.astype(bool)
    for i, (ours, theirs) in enumerate(zip(hidden, out.hidden_states)):
        assert relative_error(ours, theirs.numpy(), real) < 1e-5, f"hidden state {i}"
    assert relative_error(logits["mlm_logits"], out.logits.numpy(), real) < 1e-5


def test_every_config_switch_equals_transformers(every_option, tokenizer, tmp_path):
    loaded = _ours_from(every_option, tokenizer, tmp_path)
    config = loaded.config
    assert (config.norm_bias, config.attention_bias, config.mlp_bias, config.classifier_bias) == (True,) * 4
    assert (config.decoder_bias, config.tie_word_embeddings, config.norm_eps) == (False, False, 1e-6)
    assert config.layer_types == (FULL, SLIDING, FULL, SLIDING)
    ids, mask = _batch(tokenizer, HELD_OUT)
    with torch.no_grad():
        out = every_option(input_ids=torch.from_numpy(ids).long(), attention_mask=torch.from_numpy(mask))
    logits = modernbert.ModernBertForMaskedLM(config).apply({"params": loaded.params}, ids, mask)["mlm_logits"]
    assert relative_error(logits, out.logits.numpy(), mask.astype(bool)) < 1e-5


def test_packed_rows_restart_positions_and_keep_to_their_sequence_and_window(masked_lm_dir, tokenizer):
    """Two sentences packed into one row with padding after them: each one's hidden states are those transformers
    gives it alone (RoPE positions restart; attention keeps to its own sequence and to the window)."""
    reference = transformers.ModernBertModel.from_pretrained(masked_lm_dir).eval()
    loaded = load_pretrained(str(masked_lm_dir))
    first, second = (tokenizer(text)["input_ids"] for text in HELD_OUT[:2])
    length = len(first) + len(second) + 5
    ids = np.full((1, length), tokenizer.pad_token_id, np.int32)
    ids[0, :len(first)], ids[0, len(first):len(first) + len(second)] = first, second
    mask = (np.arange(length) < len(first) + len(second)).astype(np.int32)[None]
    packing = np.where(np.arange(length) < len(first), 0, 1).astype(np.int32)[None]
    positions = np.concatenate([np.arange(len(first)), np.arange(length - len(first))]).astype(np.int32)[None]
    ours, _ = family.encoder(loaded.config).apply({"params": loaded.params["bert"]}, ids, mask,
                                                  packing_ids=packing, position_ids=positions)
    for start, tokens in ((0, first), (len(first), second)):
        with torch.no_grad():
            alone = reference(input_ids=torch.tensor([tokens])).last_hidden_state.numpy()[0]
        assert relative_error(np.asarray(ours)[0, start:start + len(tokens)], alone) < 1e-5


@pytest.mark.parametrize("task", ["SequenceClassification", "TokenClassification", "QuestionAnswering",
                                  "MultipleChoice"])
def test_task_heads_equal_transformers_and_export_back_bit_exact(task, tokenizer, tmp_path):
    config = modernbert_fixture.hf_config(tokenizer, num_labels=2 if task == "QuestionAnswering" else 3,
                                          classifier_pooling="mean" if task == "MultipleChoice" else "cls")
    torch.manual_seed(2)
    reference = modernbert_fixture.perturbed(getattr(transformers, f"ModernBertFor{task}")(config), seed=2)
    reference.save_pretrained(tmp_path / "src")
    tokenizer.save_pretrained(tmp_path / "src")
    loaded = load_pretrained(str(tmp_path / "src"))
    assert loaded.head["architecture"] == f"BertFor{task}"
    ids, mask = _batch(tokenizer, HELD_OUT)
    real = mask.astype(bool)
    if task == "MultipleChoice":
        ids, mask = ids.reshape(2, 2, -1), mask.reshape(2, 2, -1)
    with torch.no_grad():
        out = reference(input_ids=torch.from_numpy(ids).long(), attention_mask=torch.from_numpy(mask))
    module = {"SequenceClassification": lambda: family.sequence_classifier(loaded.config, 3),
              "TokenClassification": lambda: family.token_classifier(loaded.config, 3),
              "QuestionAnswering": lambda: family.question_answering(loaded.config),
              "MultipleChoice": lambda: family.multiple_choice(loaded.config)}[task]()
    ours = module.apply({"params": loaded.params}, ids, mask)
    if task == "QuestionAnswering":
        assert relative_error(ours[0], out.start_logits.numpy(), real) < 1e-5
        assert relative_error(ours[1], out.end_logits.numpy(), real) < 1e-5
    elif task == "TokenClassification":
        assert relative_error(ours, out.logits.numpy(), real) < 1e-5
    else:
        assert relative_error(ours, out.logits.numpy()) < 1e-5
    save_model(str(tmp_path / "ckpt"), loaded.params, loaded.config, loaded.vocab, head=loaded.head,
               tokenizer=loaded.tokenizer)
    assert cli(["export", str(tmp_path / "ckpt"), "--out", str(tmp_path / "hf")]) == 0
    assert json.loads((tmp_path / "hf/config.json").read_text())["architectures"] == [f"ModernBertFor{task}"]
    reloaded = getattr(transformers, f"ModernBertFor{task}").from_pretrained(tmp_path / "hf")
    for (name, a), (_, b) in zip(reference.state_dict().items(), reloaded.state_dict().items()):
        assert torch.equal(a, b), name


def test_convert_and_export_are_bit_exact_and_the_export_fills_masks_in_transformers(masked_lm_dir, tmp_path):
    assert cli(["convert", "--from", "hf", str(masked_lm_dir), "--out", str(tmp_path / "ckpt")]) == 0
    assert cli(["export", str(tmp_path / "ckpt"), "--out", str(tmp_path / "hf")]) == 0
    source, exported = load_file(str(masked_lm_dir / "model.safetensors")), load_file(str(tmp_path / "hf/model.safetensors"))
    assert set(exported) == set(source) - {"decoder.weight"}  # tied to the token embeddings: not written, as HF
    for key, value in exported.items():
        assert value.dtype == source[key].dtype and np.array_equal(value, source[key]), key
    assert (tmp_path / "hf/tokenizer.json").read_text() == (masked_lm_dir / "tokenizer.json").read_text()
    hf_config = json.loads((tmp_path / "hf/config.json").read_text())
    assert hf_config["architectures"] == ["ModernBertForMaskedLM"] and hf_config["model_type"] == "modernbert"
    assert "ModernBertForMaskedLM" in (tmp_path / "hf/README.md").read_text()
    fill = transformers.pipeline("fill-mask", model=str(tmp_path / "hf"))
    reference = transformers.pipeline("fill-mask", model=str(masked_lm_dir))
    sentence = "The boats were [MASK] by morning."
    assert [r["token"] for r in fill(sentence)] == [r["token"] for r in reference(sentence)]


def test_embed_equals_transformers_modernbertmodel_on_held_out_sentences(masked_lm_dir, tmp_path):
    (tmp_path / "held_out.txt").write_text("\n".join(HELD_OUT) + "\n")
    assert cli(["embed", "--checkpoint", str(masked_lm_dir), "--input", str(tmp_path / "held_out.txt"),
                "--output", str(tmp_path / "vectors.npy"), "--pooling", "mean"]) == 0
    tokenizer = transformers.AutoTokenizer.from_pretrained(masked_lm_dir)
    reference = transformers.ModernBertModel.from_pretrained(masked_lm_dir).eval()
    encoded = tokenizer(HELD_OUT, padding=True, return_tensors="pt")
    with torch.no_grad():
        hidden = reference(**encoded).last_hidden_state
    weights = encoded["attention_mask"][..., None].float()
    expected = ((hidden * weights).sum(1) / weights.sum(1)).numpy()
    assert relative_error(np.load(tmp_path / "vectors.npy"), expected) < 1e-4


def test_the_checkpoints_tokenizer_gives_transformers_ids(masked_lm_dir):
    loaded = load_pretrained(str(masked_lm_dir))
    ours = checkpoint_tokenizer(loaded, str(masked_lm_dir))
    theirs = transformers.AutoTokenizer.from_pretrained(masked_lm_dir)
    encoded = ours.encode(HELD_OUT, max_len=40, text_pairs=HELD_OUT[::-1])
    expected = theirs(HELD_OUT, HELD_OUT[::-1], padding="max_length", max_length=40, truncation="longest_first")
    np.testing.assert_array_equal(encoded["input_ids"], expected["input_ids"])
    np.testing.assert_array_equal(encoded["input_mask"], expected["attention_mask"])
    words = HELD_OUT[0].split()
    pieces = ours.word_lists(words, [i > 0 for i in range(len(words))])
    assert sum(pieces, []) == theirs(HELD_OUT[0], add_special_tokens=False)["input_ids"]


def test_config_reads_both_of_hfs_spellings_and_refuses_what_it_cannot_compute():
    old = {"model_type": "modernbert", "num_hidden_layers": 5, "global_attn_every_n_layers": 2,
           "global_rope_theta": 5000.0, "local_rope_theta": 20.0, "hidden_size": 32, "num_attention_heads": 4,
           "intermediate_size": 40, "vocab_size": 100, "pad_token_id": 0}
    config = family.config_from_hf_dict(old)
    assert config.layer_types == (FULL, SLIDING, FULL, SLIDING, FULL)
    assert (config.global_rope_theta, config.local_rope_theta) == (5000.0, 20.0)
    written = config.to_hf_dict()
    assert written["rope_parameters"][SLIDING]["rope_theta"] == 20.0
    assert family.config_from_hf_dict(written) == config
    hf = transformers.ModernBertConfig.from_dict(written)
    assert hf.layer_types == list(config.layer_types) and hf.sliding_window == config.window
    assert ModernBertConfig.from_dict(config.to_dict()) == config
    with pytest.raises(ValueError, match="rope_type 'yarn'"):
        family.config_from_hf_dict({**old, "rope_parameters": {FULL: {"rope_type": "yarn", "rope_theta": 1.0}}})
    with pytest.raises(ValueError, match="neither 'bert' nor 'modernbert'"):
        family.config_from_hf_dict({"model_type": "roberta"})
    with pytest.raises(ValueError, match="layer_types has 2 entries for num_hidden_layers 5"):
        family.config_from_hf_dict({**old, "layer_types": [FULL, SLIDING]})
    with pytest.raises(ValueError, match="head size 7 .* is odd"):
        ModernBertConfig(hidden_size=28, num_attention_heads=4, vocab_size=100, pad_token_id=0)


def test_a_config_whose_new_keys_contradict_its_old_ones_is_read_as_transformers_reads_it_said_in_a_line(caplog):
    """`layer_types` against `global_attn_every_n_layers`, `rope_parameters` against `*_rope_theta`: transformers
    5.23 lets the new keys win; so does bertjax, and it says so in a warning line each (it did it silently)."""
    contradicting = {"model_type": "modernbert", "num_hidden_layers": 5, "global_attn_every_n_layers": 2,
                     "layer_types": [FULL, FULL, SLIDING, SLIDING, FULL], "global_rope_theta": 5000.0,
                     "local_rope_theta": 20.0, "rope_parameters": {FULL: {"rope_type": "default", "rope_theta": 7000.0},
                                                                   SLIDING: {"rope_type": "default",
                                                                             "rope_theta": 20.0}},
                     "hidden_size": 32, "num_attention_heads": 4, "intermediate_size": 40, "vocab_size": 100,
                     "pad_token_id": 0}
    with caplog.at_level("WARNING"):
        config = family.config_from_hf_dict(contradicting, source="x/config.json")
    hf = transformers.ModernBertConfig.from_dict(contradicting)
    assert list(config.layer_types) == hf.layer_types == [FULL, FULL, SLIDING, SLIDING, FULL]
    assert (config.global_rope_theta, config.local_rope_theta) == (
        hf.rope_parameters[FULL]["rope_theta"], hf.rope_parameters[SLIDING]["rope_theta"]) == (7000.0, 20.0)
    assert [r.getMessage() for r in caplog.records] == [
        "x/config.json: layer_types and global_attn_every_n_layers=2 disagree; layer_types is used, as transformers "
        "does",
        "x/config.json: rope_parameters.full_attention.rope_theta=7000.0 and global_rope_theta=5000.0 disagree; "
        "rope_parameters.full_attention.rope_theta is used, as transformers does"]
    caplog.clear()
    family.config_from_hf_dict(config.to_hf_dict())  # agreeing spellings: nothing said
    assert caplog.records == []


@pytest.mark.parametrize("hidden, heads, length, dtype", [
    (768, 12, 8, "float32"), (768, 12, 8, "bfloat16"),     # the Pallas kernel (rope_tpu), interpreted
    (768, 12, 5, "float32"), (96, 3, 8, "bfloat16")])       # shapes it does not take: the rotation by the weights
def test_the_tpus_rotation_is_the_rotation_of_the_projection(monkeypatch, hidden, heads, length, dtype):
    """On TPU RoPE rotates q and k in a Pallas kernel (`rope_tpu`), or for shapes it does not take by the weights,
    x rotate_half(W) + rotate_half(b): the CPU's rotation of the same projection x W + b (whose outputs the parity
    tests above hold to transformers'), to float32 rounding (bit for bit by the weights); one bfloat16 rounding."""
    import jax
    import jax.numpy as jnp
    from jax.experimental.pallas import tpu as pltpu

    from bertjax.model import rope
    from bertjax.model.kernels.tpu import rope_tpu

    config = ModernBertConfig(hidden_size=hidden, num_attention_heads=heads, vocab_size=100, pad_token_id=0,
                              attention_bias=True, dtype=dtype)
    x = jnp.asarray(np.random.default_rng(3).normal(size=(2, length, hidden)), jnp.float32)
    rotary = rope.cos_sin(jnp.arange(length)[None], config.head_dim, 10_000.0)
    layer = modernbert.RotaryQKV(config)
    params = layer.init(jax.random.key(0), x, rotary)
    params = jax.tree_util.tree_map(lambda p: p + jax.random.normal(jax.random.key(1), p.shape), params)  # bias too
    on_cpu = layer.apply(params, x, rotary)
    monkeypatch.setattr(modernbert, "target_platform", lambda: "tpu")
    with pltpu.force_tpu_interpret_mode():
        on_tpu = layer.apply(params, x, rotary)
    in_kernel = rope_tpu.supported(hidden, config.head_dim, length)
    for cpu, tpu in zip(on_cpu, on_tpu, strict=True):
        if not in_kernel:
            np.testing.assert_array_equal(np.asarray(tpu, np.float32), np.asarray(cpu, np.float32))
        else:
            # bfloat16: the CPU rounds each product and sum, the kernel once; a unit in the last place of the
            # largest value bounds them where values cancel.
            cpu = np.asarray(cpu, np.float32)
            tol = 2 ** -7 if dtype == "bfloat16" else 1e-5
            np.testing.assert_allclose(np.asarray(tpu, np.float32), cpu, rtol=tol, atol=tol * np.abs(cpu).max())


@pytest.mark.parametrize("mlp_bias", [False, True])
def test_the_tpus_feed_forward_product_in_the_lanes_is_the_pair_elsewhere(monkeypatch, mlp_bias):
    """GeGLU's Wi: on TPU one product x W[H, 2I] with its halves side by side in the lanes (a [..., 2, I] product
    pads the 2 to 8 sublanes), elsewhere one [..., 2, I] product whose pair the GELU's own backward takes
    (`gated_gelu_of_pair`): the same feed-forward from the same params, its value and every gradient, to float32
    rounding."""
    import flax.linen as nn
    import jax
    import jax.numpy as jnp

    config = ModernBertConfig(hidden_size=64, num_attention_heads=4, intermediate_size=96, vocab_size=100,
                              pad_token_id=0, mlp_bias=mlp_bias, hidden_activation="gelu_pytorch_tanh")
    x = jnp.asarray(np.random.default_rng(5).normal(size=(2, 7, 64)), jnp.float32)
    weights = jnp.asarray(np.random.default_rng(6).normal(size=(2, 7, 64)), jnp.float32)
    layer = modernbert.GatedMLP(config)
    params = nn.meta.unbox(layer.init(jax.random.key(0), x, True))
    params = jax.tree_util.tree_map(lambda p: p + 0.1 * jax.random.normal(jax.random.key(1), p.shape), params)
    assert params["params"]["Wi"]["kernel"].shape == (64, 2, 96)
    loss = lambda p, x: jnp.sum(layer.apply(p, x, True) * weights)
    elsewhere = jax.value_and_grad(loss, argnums=(0, 1))(params, x)
    monkeypatch.setattr(modernbert, "target_platform", lambda: "tpu")
    on_tpu = jax.value_and_grad(loss, argnums=(0, 1))(params, x)
    for got, want in zip(jax.tree_util.tree_leaves(on_tpu), jax.tree_util.tree_leaves(elsewhere), strict=True):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5 * np.abs(want).max())


@pytest.mark.parametrize("backend", ["reference", pytest.param("flash_dropout_gpu", marks=pytest.mark.slow)])
def test_the_scanned_encoder_is_the_unrolled_one(backend):
    """`scan_layers` (what a fine-tune on a CPU runs): one layer scanned over the stacked params, told by its flags
    whether it is layer 0 (no attention norm) and global (no window, the global theta): on padded, packed rows
    with windows that matter, every hidden state, the output and each param's gradient are the unrolled
    encoder's (transformers' values, tests above), to float32 rounding; on the GPU attention kernel (run
    interpreted, q/k/v handed to it stacked) too."""
    import flax.linen as nn
    import jax
    import jax.numpy as jnp

    from bertjax.model import layer_layout

    config = ModernBertConfig(hidden_size=32, num_attention_heads=2, intermediate_size=48, num_hidden_layers=4,
                              local_attention=4, vocab_size=50, pad_token_id=0, attention_backend=backend,
                              global_rope_theta=500.0, local_rope_theta=20.0)
    ids = jnp.asarray(np.random.default_rng(13).integers(1, 50, (2, 12)), jnp.int32)
    mask = jnp.ones_like(ids).at[1, 10:].set(0)
    packing = jnp.asarray([[1] * 5 + [2] * 7, [1] * 10 + [0] * 2], jnp.int32)
    positions = jnp.asarray([list(range(5)) + list(range(7)), list(range(12))], jnp.int32)
    weights = jnp.asarray(np.random.default_rng(14).normal(size=(2, 12, 32)), jnp.float32) * mask[..., None]
    params = nn.meta.unbox(modernbert.ModernBertModel(config).init(jax.random.key(0), ids, mask))["params"]
    params = jax.tree.map(lambda x: x + 0.1 * jnp.sin(jnp.arange(x.size).reshape(x.shape)), params)

    def run(config, params):
        def loss(p):
            (out, _), state = modernbert.ModernBertModel(config).apply(
                {"params": p}, ids, mask, packing_ids=packing, position_ids=positions, mutable=["intermediates"])
            return jnp.sum(out * weights), state["intermediates"]["hidden_states"]
        return jax.value_and_grad(loss, has_aux=True)(params)

    (want_loss, want_states), want_grads = run(config, params)
    scanned = config.replace(scan_layers=True)
    (got_loss, got_states), got_grads = run(scanned, layer_layout.with_layout(params, scanned, stacked=True))
    assert "layers" in got_grads and len(got_states) == len(want_states) == 5
    got_grads = layer_layout.with_layout(got_grads, config, stacked=False)
    for g, w in zip(jax.tree_util.tree_leaves((got_loss, got_states, got_grads)),
                    jax.tree_util.tree_leaves((want_loss, want_states, want_grads)), strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-5 * np.abs(np.asarray(w)).max())
    # The windows and thetas matter here: a model of global layers alone differs.
    (all_global, _), _ = run(config.replace(local_attention=64, local_rope_theta=500.0), params)
    assert abs(float(all_global) - float(want_loss)) > 1e-3 * abs(float(want_loss))


# "full" slow-marked, for the default suite's time (~30 s): the same remat wrapper as "dots", another policy.
@pytest.mark.parametrize("remat", ["dots", pytest.param("full", marks=pytest.mark.slow)])
def test_rematerialised_layers_give_the_same_values_and_gradients(remat):
    """`model.remat` wraps each layer (its (hidden, branch) in and out, `deterministic` static) in nn.remat: the
    encoder's output and every gradient those without it, with dropout on (the same masks recomputed)."""
    import dataclasses

    import flax.linen as nn
    import jax
    import jax.numpy as jnp

    config = ModernBertConfig(hidden_size=32, num_attention_heads=2, intermediate_size=48, num_hidden_layers=3,
                              local_attention=4, vocab_size=50, pad_token_id=0, mlp_dropout=0.1,
                              embedding_dropout=0.1)
    ids = jnp.asarray(np.random.default_rng(12).integers(1, 50, (2, 9)), jnp.int32)
    mask = jnp.ones_like(ids)
    params = nn.meta.unbox(modernbert.ModernBertModel(config).init(jax.random.key(0), ids, mask))

    def grads(config):
        encoder = modernbert.ModernBertModel(config)
        loss = lambda p: jnp.sum(jnp.sin(encoder.apply(p, ids, mask, deterministic=False,
                                                       rngs={"dropout": jax.random.key(3)})[0]))
        return jax.value_and_grad(loss)(params)

    want, got = grads(config), grads(dataclasses.replace(config, remat=remat))
    for g, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-6, atol=1e-6 * np.abs(np.asarray(w)).max())


def test_the_encoder_on_a_gpus_layer_norm_kernels_is_the_encoder_elsewhere(monkeypatch):
    """The residual stream on a GPU: each layer's sum taken by the LayerNorm kernel that reads it (run interpreted),
    handed between layers as (hidden, branch), its gradient added in the kernels' backward: the encoder's output
    and every param's gradient those of XLA's composition (CPU), to float32 rounding; its hidden states too."""
    import flax.linen as nn
    import jax
    import jax.numpy as jnp

    from bertjax.model import layer_norm

    config = ModernBertConfig(hidden_size=32, num_attention_heads=2, intermediate_size=48, num_hidden_layers=4,
                              local_attention=4, vocab_size=50, pad_token_id=0)
    ids = jnp.asarray(np.random.default_rng(9).integers(1, 50, (2, 9)), jnp.int32)
    mask = jnp.ones_like(ids).at[1, 7:].set(0)
    encoder = modernbert.ModernBertModel(config)
    params = nn.meta.unbox(encoder.init(jax.random.key(0), ids, mask))
    weights = jnp.asarray(np.random.default_rng(10).normal(size=(2, 9, 32)), jnp.float32)

    def run(params):
        (out, _), state = encoder.apply(params, ids, mask, mutable=["intermediates"])
        return jnp.sum(out * weights), (out, state["intermediates"]["hidden_states"])

    want = jax.value_and_grad(run, has_aux=True)(params)
    monkeypatch.setattr(layer_norm, "target_platform", lambda: "gpu")
    got = jax.value_and_grad(run, has_aux=True)(params)
    for g, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-5 * np.abs(np.asarray(w)).max())


@pytest.mark.parametrize("attention_bias", [False, True])
def test_the_encoder_on_the_gpu_attention_kernel_is_the_encoder_on_the_reference(attention_bias):
    """On the GPU attention kernel (run interpreted) the projection's output goes to it stacked and the kernels add
    the biases and rotate q and k: on packed rows (positions restarting, two rotary thetas, windows) the encoder's
    output and every param's gradient are the reference attention's, to float32 rounding."""
    import dataclasses

    import flax.linen as nn
    import jax
    import jax.numpy as jnp

    config = ModernBertConfig(hidden_size=32, num_attention_heads=2, intermediate_size=48, num_hidden_layers=3,
                              local_attention=4, vocab_size=50, pad_token_id=0, attention_bias=attention_bias,
                              attention_backend="reference")
    ids = jnp.asarray(np.random.default_rng(11).integers(1, 50, (2, 12)), jnp.int32)
    mask = jnp.ones_like(ids).at[1, 10:].set(0)
    packing = jnp.asarray([[1] * 5 + [2] * 7, [1] * 10 + [0] * 2], jnp.int32)
    positions = jnp.asarray([list(range(5)) + list(range(7)), list(range(12))], jnp.int32)
    weights = jnp.asarray(np.random.default_rng(12).normal(size=(2, 12, 32)), jnp.float32) * mask[..., None]

    def grads(config):
        encoder = modernbert.ModernBertModel(config)
        params = nn.meta.unbox(encoder.init(jax.random.key(0), ids, mask))
        params = jax.tree.map(lambda x: x + 0.1 * jnp.sin(jnp.arange(x.size).reshape(x.shape)), params)
        loss = lambda p: jnp.sum(encoder.apply(p, ids, mask, packing_ids=packing, position_ids=positions)[0]
                                 * weights)
        return jax.value_and_grad(loss)(params)

    want = grads(config)
    got = grads(dataclasses.replace(config, attention_backend="flash_dropout_gpu"))
    for g, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-5 * np.abs(np.asarray(w)).max())


def test_kernels_cast_once_give_the_same_bits_as_kernels_cast_in_the_layers():
    """`with_compute_dtype` (the pretraining step's microbatch loop takes its kernels so cast, once per step): in
    bfloat16 the MLM logits and every param's gradient, converted back to float32, are the same bits as with the
    float32 params; the norms and embeddings stay float32."""
    import flax.linen as nn
    import jax
    import jax.numpy as jnp

    config = ModernBertConfig(hidden_size=32, num_attention_heads=2, intermediate_size=48, num_hidden_layers=3,
                              local_attention=4, vocab_size=50, pad_token_id=0, dtype="bfloat16", mlp_bias=True)
    ids = jnp.asarray(np.random.default_rng(13).integers(1, 50, (2, 9)), jnp.int32)
    mask = jnp.ones_like(ids)
    model = modernbert.ModernBertForMaskedLM(config)
    params = nn.meta.unbox(model.init(jax.random.key(0), ids, mask))
    loss = lambda p: jnp.sum(jnp.sin(model.apply(p, ids, mask)["mlm_logits"]))
    cast = modernbert.with_compute_dtype(params, config)
    dtypes = {jax.tree_util.keystr(path): x.dtype for path, x in jax.tree_util.tree_leaves_with_path(cast)}
    assert {name for name, dtype in dtypes.items() if dtype == jnp.bfloat16} == {
        name for name in dtypes if name.endswith("['kernel']")}
    assert any(name.endswith("['bias']") for name in dtypes) and dtypes["['params']['bert']['final_norm']['scale']"] \
        == jnp.float32
    want, got = jax.value_and_grad(loss)(params), jax.value_and_grad(loss)(cast)
    for g, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want), strict=True):
        np.testing.assert_array_equal(np.asarray(g.astype(jnp.float32)), np.asarray(w))


@pytest.mark.parametrize("dtype, tol", [("float32", 1e-6), ("bfloat16", 1e-2)])
def test_the_split_products_are_the_products_and_their_gradients_come_from_two_matmuls(dtype, tol):
    """q/k/v (`split_products`): x W[:, i] for each i, the same bits; their input gradient one matmul over
    the stacked cotangents and the whole kernel, the kernel's one more (2 + n dot_generals in all, where autodiff
    of n products has 3n), equal to autodiff's gradients to the dtype's rounding."""
    import jax
    import jax.numpy as jnp

    from bertjax.model.split_products import split_products

    rng = np.random.default_rng(7)
    x = jnp.asarray(rng.normal(size=(2, 5, 16)), dtype)
    kernel = jnp.asarray(rng.normal(size=(16, 3, 8)), dtype)
    weights = [jnp.asarray(rng.normal(size=(2, 5, 8)), dtype) for _ in range(3)]
    plain = lambda x, kernel: tuple(x @ kernel[:, i] for i in range(kernel.shape[1]))
    for got, want in zip(split_products(x, kernel), plain(x, kernel), strict=True):
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
    loss = lambda f: lambda x, kernel: sum(jnp.sum((y * w).astype(jnp.float32)) for y, w in zip(f(x, kernel), weights))
    matmuls = lambda f: str(jax.make_jaxpr(jax.grad(loss(f), argnums=(0, 1)))(x, kernel)).count("dot_general")
    assert (matmuls(split_products), matmuls(plain)) == (3 + 2, 3 * 3)
    got, want = (jax.grad(loss(f), argnums=(0, 1))(x, kernel) for f in (split_products, plain))
    for g, w in zip(got, want, strict=True):
        assert g.dtype == w.dtype and g.shape == w.shape
        w = np.asarray(w, np.float32)
        np.testing.assert_allclose(np.asarray(g, np.float32), w, rtol=tol, atol=tol * np.abs(w).max())


@pytest.mark.parametrize("tie", [True, False])
def test_the_decoder_multiplies_in_the_compute_dtype_and_returns_float32_logits(tie):
    """The MLM decoder (tied or not) runs in the compute dtype, as BERT's and transformers' under autocast: a
    float32 product wrote the [tokens, vocab] logits at twice the bytes (and a GPU multiplies float32 at half
    its bfloat16 rate or less); the logits, plus the decoder bias in float32, come back in float32."""
    import flax.linen as nn
    import jax
    import jax.numpy as jnp

    config = ModernBertConfig(hidden_size=64, num_attention_heads=4, intermediate_size=96, vocab_size=100,
                              num_hidden_layers=1, pad_token_id=0, dtype="bfloat16", tie_word_embeddings=tie)
    model = modernbert.ModernBertForMaskedLM(config)
    ids, mask = jnp.ones((2, 8), jnp.int32), jnp.ones((2, 8), jnp.int32)
    params = nn.meta.unbox(model.init(jax.random.key(0), ids, mask))
    jaxpr = jax.make_jaxpr(lambda p: model.apply(p, ids, mask)["mlm_logits"])(params)
    decoders = [e for e in jaxpr.jaxpr.eqns
                if e.primitive.name == "dot_general" and e.outvars[0].aval.shape[-1] == config.vocab_size]
    assert len(decoders) == 1
    assert [v.aval.dtype for v in decoders[0].invars] == [jnp.bfloat16, jnp.bfloat16]
    assert jaxpr.out_avals[0].dtype == jnp.float32 and jaxpr.out_avals[0].shape == (2, 8, 100)


def test_the_rotation_in_bfloat16_is_transformers_bit_for_bit():
    """RoPE on bfloat16 q and k off TPU (`rope.apply_rotary`) is transformers' `apply_rotary_pos_emb` with float32
    tables (its autocast case): float32 arithmetic rounded once, the same bits (rounding each product and the sum
    in bfloat16 differed in the last place)."""
    import jax.numpy as jnp
    from transformers.models.modernbert.modeling_modernbert import apply_rotary_pos_emb

    from bertjax.model import rope

    rng = np.random.default_rng(7)
    batch, length, heads, head_dim = 2, 24, 3, 64
    q, k = (rng.normal(0, 2, (batch, length, heads * head_dim)).astype(np.float32) for _ in range(2))
    positions = rng.integers(0, 500, (batch, length))
    cos, sin = rope.cos_sin(jnp.asarray(positions), head_dim, 10_000.0)
    ours = [rope.apply_rotary(jnp.asarray(x, jnp.bfloat16), cos, sin, head_dim) for x in (q, k)]
    as_heads = lambda x: torch.tensor(x).to(torch.bfloat16).reshape(batch, length, heads, head_dim).transpose(1, 2)
    theirs = apply_rotary_pos_emb(as_heads(q), as_heads(k), torch.tensor(np.asarray(cos)), torch.tensor(np.asarray(sin)))
    for got, want in zip(ours, theirs, strict=True):
        want = want.transpose(1, 2).reshape(batch, length, heads * head_dim).float().numpy()
        np.testing.assert_array_equal(np.asarray(got, np.float32), want)
