"""`model.scan_layers`: the encoder as one `nn.scan` over stacked params against the unrolled model (the same
losses, gradients and updates in float32), and every reader and writer of params across the two layouts
(checkpoints, `--init`, HF export, a scanned run's bit-exact resume)."""
import functools
import signal

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bertjax import checkpoint as checkpoint_lib
from bertjax import sharding
from bertjax.interop.hf import export_hf
from bertjax.model.bert import model as model_lib
from bertjax.model import layer_layout
from bertjax.model.bert.config import BertConfig
from bertjax.pretraining import optim
from bertjax.pretraining import state as train_state
from bertjax.pretraining import step as train_step
from bertjax.runtime.preemption import STOPPED_EXIT
from tests.test_pretrain import (  # noqa: F401
    MIDDLE,
    STEPS,
    _argv,
    _final_params,
    _losses,
    _run,
    _run_until,
    corpus,
)
from tests.test_train_step import _batches

# bert-tiny's shape (L2/H128/A2) and a 4-layer one; fp32, no dropout: the two layouts must compute the same values.
CONFIGS = {
    "tiny": BertConfig(vocab_size=90, hidden_size=128, num_hidden_layers=2, num_attention_heads=2,
                       intermediate_size=512, max_position_embeddings=32, hidden_dropout_prob=0.0,
                       attention_probs_dropout_prob=0.0),
    "four_layers": BertConfig(vocab_size=90, hidden_size=32, num_hidden_layers=4, num_attention_heads=4,
                              intermediate_size=64, max_position_embeddings=32, hidden_dropout_prob=0.0,
                              attention_probs_dropout_prob=0.0),
}
SEQ, MASKED, STEPS_COMPARED = 24, 4, 3


def _state(config: BertConfig, mesh, optimizer: str):
    model = model_lib.BertForPreTraining(config)
    optimizer, schedule = optim.make_optimizer(
        optim.OptimizerConfig(name=optimizer, learning_rate=5e-3, warmup_steps=1), 10)
    state, shardings, _ = train_state.make_sharded_state(jax.random.key(0), model=model, config=config,
                                                         optimizer=optimizer, mesh=mesh, seq_len=SEQ,
                                                         num_masked=MASKED)
    return model, optimizer, schedule, state, shardings


@functools.cache
def _pair(name: str, optimizer: str = "adamw"):
    """(config, mesh, unrolled (model, optimizer, schedule, state, shardings), the scanned ones) with the
    scanned state holding the unrolled state's params and optimizer moments, stacked."""
    config = CONFIGS[name]
    mesh = sharding.make_mesh(data=-1)
    unrolled = _state(config, mesh, optimizer)
    scanned = _state(config.replace(scan_layers=True), mesh, optimizer)
    state, shardings = scanned[3], scanned[4]
    stacked = layer_layout.stack_layers(jax.device_get(unrolled[3]))
    stacked = jax.device_put(stacked.replace(rng=state.rng), shardings)
    return config, mesh, unrolled, (*scanned[:3], stacked, shardings)


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def pair(request):
    return _pair(request.param)


def _loss_and_grads(model, params, batch):
    def loss(p):
        sums = train_step.pretraining_sums(train_step.forward(model, p, batch, deterministic=True), batch)
        return train_step.summarize(sums, nsp_loss=True)["loss"]
    return jax.jit(jax.value_and_grad(loss))(params)


def _assert_close(actual, expected, rtol=1e-6):
    """Every tensor to `rtol`, relative to the largest magnitude in the tree (the attention key bias's gradient
    is zero up to rounding, ~1e-13: no elementwise relative error is meaningful there)."""
    scale = max(float(np.max(np.abs(leaf))) for leaf in jax.tree_util.tree_leaves(expected))
    for path, a in jax.tree_util.tree_flatten_with_path(actual)[0]:
        np.testing.assert_allclose(np.asarray(a), np.asarray(_at(expected, path)), rtol=rtol, atol=rtol * scale,
                                   err_msg=jax.tree_util.keystr(path))


def _at(tree, path):
    for key in path:
        tree = tree[key.key]
    return tree


def test_stacked_params_are_named_by_layer_and_replicated_over_it(pair):
    config, mesh, _, (model, *_rest) = pair
    boxed = jax.eval_shape(lambda: model_lib.init_params(model, config.replace(scan_layers=True),
                                                         jax.random.key(0)))
    query = boxed["bert"]["layers"]["attention"]["self"]["query"]["kernel"]
    assert query.names == ("layers", "embed", "heads")
    assert query.value.shape == (config.num_hidden_layers, config.hidden_size,
                                 config.num_attention_heads * config.head_dim)
    assert "layer_0" not in boxed["bert"]
    spec = nn.logical_to_mesh_sharding(nn.get_partition_spec(boxed), mesh, sharding.DEFAULT_RULES)
    assert spec["bert"]["layers"]["attention"]["self"]["query"]["kernel"].spec[0] is None


def test_scan_gives_the_unrolled_loss_and_gradients(pair):
    config, _, unrolled, scanned = pair
    batch = _batches(1, seed=3)[0]
    loss, grads = _loss_and_grads(unrolled[0], unrolled[3].params, batch)
    scan_loss, scan_grads = _loss_and_grads(scanned[0], scanned[3].params, batch)
    np.testing.assert_allclose(float(scan_loss), float(loss), rtol=1e-6)
    _assert_close(jax.device_get(scan_grads), jax.device_get(grads))  # the state holds both stacked


@pytest.mark.parametrize("optimizer", ["adamw", pytest.param("lamb", marks=pytest.mark.slow)])
def test_stacked_layers_take_the_same_optimizer_updates(optimizer):
    """The train state holds the layers stacked: weight decay skips stacked LayerNorm/bias vectors, LAMB's trust
    ratio is per layer, so the updates are those of the same optimizer on the per-layer tensors."""
    config, _, (model, tx, _, state, _), _ = _pair("four_layers", optimizer)
    per_layer = lambda tree: layer_layout.unstack_layers(jax.device_get(tree), config.num_hidden_layers)
    grads = _loss_and_grads(model, state.params, _batches(1, seed=6)[0])[1]
    assert layer_layout.is_stacked(state.params) and layer_layout.is_stacked(grads)
    updates = []
    for params, g in ((state.params, grads), (per_layer(state.params), per_layer(grads))):
        opt_state = tx.init(params)
        for _ in range(2):  # the first step's learning rate is 0 (warmup)
            update, opt_state = jax.jit(tx.update)(g, opt_state, params)
        updates.append(jax.device_get(update))
    _assert_close(per_layer(updates[0]), updates[1])


@pytest.mark.slow
def test_scan_gives_the_unrolled_train_steps():
    """The jitted train step (optimizer, clipping, stacked Adam moments) on a mesh: the same losses and params."""
    config, mesh, unrolled, scanned = _pair("tiny")
    results = []
    for model, optimizer, schedule, state, shardings in (unrolled, scanned):
        step, _ = train_step.compile_steps(model=model, optimizer=optimizer, schedule=schedule, grad_accum_steps=1,
                                           nsp_loss=True, state_shardings_tree=shardings, mesh=mesh)
        state = jax.tree_util.tree_map(jnp.copy, state)  # the step donates its input
        losses, norms = [], []
        with sharding.activate(mesh):
            for batch in _batches(STEPS_COMPARED, seed=4):
                state, metrics = step(state, sharding.global_batch(batch, mesh))
                losses.append(float(metrics["loss"]))
                norms.append(float(metrics["grad_norm"]))
        results.append((losses, norms, jax.device_get(state.params)))
    (losses, norms, params), (scan_losses, scan_norms, scan_params) = results
    np.testing.assert_allclose(scan_losses, losses, rtol=1e-6)
    np.testing.assert_allclose(scan_norms, norms, rtol=1e-6)
    _assert_close(scan_params, params, rtol=1e-5)


def test_hidden_states_are_sown_per_layer_under_scan():
    config, _, unrolled, scanned = _pair("four_layers")
    batch = _batches(1, seed=5)[0]
    args = (batch["input_ids"], batch["input_mask"], batch["segment_ids"])
    states = []
    for (_, _, _, state, _), cfg in ((unrolled, config), (scanned, config.replace(scan_layers=True))):
        params = layer_layout.with_layout(state.params["bert"], cfg, stacked=cfg.scan_layers)
        _, sown = model_lib.BertModel(cfg).apply({"params": params}, *args, mutable=["intermediates"])
        states.append(sown["intermediates"]["hidden_states"])
    assert len(states[1]) == config.num_hidden_layers + 1
    for a, b in zip(states[1], states[0]):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-6)


# Unrolled slow-marked, for the default suite's time: the scanned layers take the same remat policies.
@pytest.mark.parametrize("scan", [pytest.param(False, marks=pytest.mark.slow), True], ids=["unrolled", "scanned"])
def test_remat_recomputes_the_same_loss_and_gradients_dropout_included(scan):
    """model.remat ("dots", "full") recomputes parts of each layer in the backward pass: with dropout on, the
    recomputed masks are the same (hash bits from the same keys), so loss and gradients equal the kept ones'."""
    config = CONFIGS["four_layers"].replace(scan_layers=scan, hidden_dropout_prob=0.1,
                                            attention_probs_dropout_prob=0.1)
    batch = _batches(1, seed=7)[0]
    params = model_lib.init_params(model_lib.BertForPreTraining(config), config, jax.random.key(0))
    params = nn.unbox(params)
    results, losses = {}, {}
    for remat in ("none", "dots", "full"):
        model = model_lib.BertForPreTraining(config.replace(remat=remat))

        def loss(p, model=model):
            outputs = train_step.forward(model, p, batch, deterministic=False, rng=jax.random.key(5))
            return train_step.summarize(train_step.pretraining_sums(outputs, batch), nsp_loss=True)["loss"]

        losses[remat] = loss
        results[remat] = jax.device_get(jax.jit(jax.value_and_grad(loss))(params))
    for remat in ("dots", "full"):
        np.testing.assert_allclose(float(results[remat][0]), float(results["none"][0]), rtol=1e-6)
        _assert_close(results[remat][1], results["none"][1])
    # and the remat is real: only the rematerialised programs recompute in the backward pass (JAX's remat2)
    programs = {remat: str(jax.make_jaxpr(jax.grad(loss))(params)) for remat, loss in losses.items()}
    assert [remat for remat, program in programs.items() if "remat2[" in program] == ["dots", "full"]


def test_a_scanned_checkpoint_reads_and_exports_as_the_unrolled_one(tmp_path):
    """load_model hands out the per-layer layout; the HF export is the same bytes; --init stacks a per-layer
    checkpoint for a scanned model (merge_params)."""
    config, _, unrolled, scanned = _pair("four_layers")
    vocab = [f"t{i}" for i in range(config.vocab_size)]
    scan_params = jax.device_get(scanned[3].params)
    params = layer_layout.unstack_layers(jax.device_get(unrolled[3].params), config.num_hidden_layers)
    checkpoint_lib.save_model(str(tmp_path / "scanned"), scan_params, config.replace(scan_layers=True), vocab)
    loaded = checkpoint_lib.load_model(str(tmp_path / "scanned"))
    assert not loaded.config.scan_layers and "layer_0" in loaded.params["bert"]
    _assert_close(loaded.params, params, rtol=0)

    export_hf(params, config, vocab, str(tmp_path / "hf_unrolled"))
    export_hf(loaded.params, loaded.config, vocab, str(tmp_path / "hf_from_scanned"))
    export_hf(scan_params, config.replace(scan_layers=True), vocab, str(tmp_path / "hf_stacked"))
    expected = (tmp_path / "hf_unrolled" / "model.safetensors").read_bytes()
    assert (tmp_path / "hf_from_scanned" / "model.safetensors").read_bytes() == expected
    assert (tmp_path / "hf_stacked" / "model.safetensors").read_bytes() == expected

    fresh = jax.tree_util.tree_map(np.zeros_like, scan_params)
    merged = checkpoint_lib.merge_params(fresh, params, source="test", encoder_only=False)
    _assert_close(merged, scan_params, rtol=0)


@pytest.mark.parametrize("name", ["tiny", pytest.param("four_layers", marks=pytest.mark.slow)])
def test_a_per_layer_step_continues_stacked_and_back(name, tmp_path):
    """restore_train_state (a resume, or `--init STEP_DIR` keeping the schedule) converts params and Adam moments
    between the layouts, either way: a step saved per layer (as states were held before they held the layers
    stacked) continues stacked."""
    config, _, unrolled, scanned = _pair(name)
    vocab = [f"t{i}" for i in range(config.vocab_size)]
    stacked = unrolled[3]
    per_layer = jax.jit(lambda s: layer_layout.unstack_layers(s, config.num_hidden_layers))(stacked)
    assert layer_layout.is_stacked(stacked.params) and not layer_layout.is_stacked(per_layer.params)
    for layout, (state, target, cfg) in {"per_layer": (per_layer, stacked, config),
                                         "stacked": (scanned[3], per_layer, config.replace(scan_layers=True))}.items():
        checkpointer = checkpoint_lib.TrainCheckpointer(str(tmp_path / layout),
                                                        checkpoint_lib.CheckpointConfig(async_save=False))
        checkpointer.save(0, state, config=cfg, vocab=vocab, lower_case=True, job_config={},
                          save_input_state=lambda _: None, force=True)
        checkpointer.close()
        abstract = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                                          target)
        restored = checkpoint_lib.restore_train_state(checkpointer.step_dir(0), abstract)
        assert jax.tree_util.tree_structure(restored) == jax.tree_util.tree_structure(target)
        for a, b in zip(jax.tree_util.tree_leaves(restored), jax.tree_util.tree_leaves(target)):
            assert a.sharding == b.sharding
            assert np.array_equal(np.asarray(a), np.asarray(b))


def test_a_fine_tune_state_saved_per_layer_resumes_scanned(tmp_path):
    """A fine-tune's train state (params, Adam moments, the best evaluation's params) saved per layer, as fine-tunes
    held their layers before they scanned them, resumes into the stacked layout bit for bit, and back."""
    from bertjax.finetune.trainer import BestTracker, TrainStateSaver

    config, _, unrolled, scanned = _pair("tiny")
    stacked = unrolled[3]
    per_layer = jax.jit(lambda s: layer_layout.unstack_layers(s, config.num_hidden_layers))(stacked)
    for layout, (saved, wanted) in {"per_layer": (per_layer, stacked), "stacked": (stacked, per_layer)}.items():
        best = BestTracker("accuracy", 0)
        best.update(3, {"accuracy": 0.75}, saved.params)
        TrainStateSaver(str(tmp_path / layout)).save(3, saved.params, saved.opt_state, best)
        zeros = jax.tree_util.tree_map(jnp.zeros_like, (wanted.params, wanted.opt_state))
        resumed_best, said = BestTracker("accuracy", 0), []
        params, opt_state, step = TrainStateSaver(str(tmp_path / layout)).restore(
            *zeros, resumed_best, said.append, config=config)
        assert step == 3 and not said and resumed_best.step == 3
        for restored, target in ((params, wanted.params), (opt_state, wanted.opt_state),
                                 (resumed_best.params, wanted.params)):
            assert jax.tree_util.tree_structure(restored) == jax.tree_util.tree_structure(target)
            for a, b in zip(jax.tree_util.tree_leaves(restored), jax.tree_util.tree_leaves(target)):
                assert a.sharding == b.sharding
                assert np.array_equal(np.asarray(a), np.asarray(b))


def test_a_step_with_split_head_kernels_continues_with_2d_kernels(tmp_path):
    """A step saved by an older bertjax, the attention kernels as [H, heads, head_dim] / [heads, head_dim, H] and
    the layers per layer, resumes with 2-D kernels, stacked (params and Adam moments); its model reads the same."""
    config, _, unrolled, _ = _pair("tiny")
    vocab = [f"t{i}" for i in range(config.vocab_size)]
    stacked = unrolled[3]

    def split_heads(state):
        state = layer_layout.unstack_layers(state, config.num_hidden_layers)
        return jax.tree_util.tree_map_with_path(
            lambda path, x: x.reshape(layer_layout.split_head_shape(path, x.shape, config)), state)
    old = jax.jit(split_heads)(stacked)
    query = old.params["bert"]["layer_0"]["attention"]["self"]["query"]["kernel"]
    assert query.shape == (config.hidden_size, config.num_attention_heads, config.head_dim)
    checkpointer = checkpoint_lib.TrainCheckpointer(str(tmp_path), checkpoint_lib.CheckpointConfig(async_save=False))
    checkpointer.save(0, old, config=config, vocab=vocab, lower_case=True, job_config={},
                      save_input_state=lambda _: None, force=True)
    checkpointer.close()
    abstract = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), stacked)
    restored = checkpoint_lib.restore_train_state(checkpointer.step_dir(0), abstract)
    assert jax.tree_util.tree_structure(restored) == jax.tree_util.tree_structure(stacked)
    for a, b in zip(jax.tree_util.tree_leaves(restored), jax.tree_util.tree_leaves(stacked)):
        assert a.sharding == b.sharding
        assert np.array_equal(np.asarray(a), np.asarray(b))
    model = checkpoint_lib.load_model(checkpointer.step_dir(0))
    per_layer = layer_layout.unstack_layers(stacked.params, config.num_hidden_layers)
    _assert_close(model.params, per_layer, rtol=0)


SCAN = ("--set", "model.scan_layers=true")


@pytest.fixture(scope="module")
def uninterrupted_scanned(tmp_path_factory, corpus):  # noqa: F811
    workdir = tmp_path_factory.mktemp("uninterrupted_scanned")
    _run(_argv(workdir, corpus, *SCAN))
    return workdir


@pytest.mark.slow
def test_a_scanned_run_resumes_bit_exactly(uninterrupted_scanned, corpus, tmp_path):  # noqa: F811
    workdir = tmp_path / "preempted"
    code, output = _run_until(_argv(workdir, corpus, *SCAN), f"step {MIDDLE}/", signal.SIGTERM)
    assert code == STOPPED_EXIT and "preempted at step" in output, output[-3000:]
    _run(_argv(workdir, corpus, *SCAN))
    expected, resumed = _losses(uninterrupted_scanned), _losses(workdir)
    assert [resumed[s] for s in range(MIDDLE + 1, STEPS + 1)] == [expected[s] for s in range(MIDDLE + 1, STEPS + 1)]
    for a, b in zip(_final_params(workdir), _final_params(uninterrupted_scanned)):
        assert np.array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.slow
def test_init_across_layouts(uninterrupted_scanned, corpus, tmp_path):  # noqa: F811
    """An unscanned job starts from the scanned run, then a scanned job from that unscanned one (run directories:
    their newest step, fresh optimizer state)."""
    source = uninterrupted_scanned
    for name, extra in (("unscanned", ()), ("scanned", SCAN)):
        argv = _argv(tmp_path / name, corpus, "--init", str(source), *extra)
        argv[argv.index(f"train.steps={STEPS}")] = "train.steps=2"
        argv[argv.index("optimizer.warmup_steps=5")] = "optimizer.warmup_steps=1"
        output = _run(argv)
        assert f"initialised from {source}/checkpoints/" in output
        # The first step sees trained weights: far below a freshly initialised model's first loss.
        assert _losses(tmp_path / name)[1] < _losses(uninterrupted_scanned)[1] - 0.5
        source = tmp_path / name
