"""The train step against transformers.BertForPreTraining + torch AdamW, and its accumulation/skip behaviour."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

from bertjax import sharding
from bertjax.interop.hf import export_hf
from bertjax.model.bert import model as model_lib
from bertjax.model.bert.config import BertConfig
from bertjax.pretraining import optim
from bertjax.pretraining import state as train_state
from bertjax.pretraining import step as train_step

CONFIG = BertConfig(vocab_size=90, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                    intermediate_size=64, max_position_embeddings=32, hidden_dropout_prob=0.0,
                    attention_probs_dropout_prob=0.0)
BATCH, SEQ, MASKED, STEPS, WARMUP, LR = 8, 24, 4, 20, 5, 5e-3


def _batches(count, seed=0, batch=BATCH):
    BATCH = batch  # noqa: N806 (the rows of each batch)
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(count):
        input_mask = np.ones((BATCH, SEQ), np.int32)
        lengths = rng.integers(10, SEQ + 1, BATCH)
        input_mask[np.arange(SEQ)[None, :] >= lengths[:, None]] = 0
        input_ids = rng.integers(5, 90, (BATCH, SEQ)).astype(np.int32) * input_mask
        segment_ids = (np.arange(SEQ)[None, :] >= (lengths // 2)[:, None]).astype(np.int32) * input_mask
        positions = np.stack([rng.choice(np.arange(1, 10), MASKED, replace=False) for _ in range(BATCH)])
        weights = np.ones((BATCH, MASKED), np.float32)
        weights[::3, -1] = 0.0  # padded prediction slots, as in the TFRecord format
        positions = (positions * weights).astype(np.int32)
        out.append(dict(input_ids=input_ids, input_mask=input_mask, segment_ids=segment_ids,
                        masked_lm_positions=positions,
                        masked_lm_ids=np.take_along_axis(input_ids, positions, 1) * weights.astype(np.int32),
                        masked_lm_weights=weights,
                        next_sentence_labels=rng.integers(0, 2, (BATCH, 1)).astype(np.int32)))
    return out


@pytest.fixture(scope="module")
def setup():
    mesh = sharding.make_mesh(data=-1)
    model = model_lib.BertForPreTraining(CONFIG)
    optimizer, schedule = optim.make_optimizer(optim.OptimizerConfig(learning_rate=LR, warmup_steps=WARMUP), STEPS)
    state, shardings, _ = train_state.make_sharded_state(jax.random.key(0), model=model, config=CONFIG,
                                                   optimizer=optimizer, mesh=mesh, seq_len=SEQ, num_masked=MASKED)
    return mesh, model, optimizer, schedule, state, shardings


@pytest.fixture(scope="module")
def skipping_steps(setup):
    """The jitted step with the non-finite skip as a branch ("cond") and as a select, each compiled once for the
    tests that use them."""
    mesh, model, optimizer, schedule, state, shardings = setup
    return {skip: jax.jit(functools.partial(train_step.train_step, model=model, optimizer=optimizer,
                                            schedule=schedule, grad_accum_steps=1, nsp_loss=True,
                                            skip_nonfinite=skip))
            for skip in ("cond", "select")}


def _torch_losses(params, batches, tmp_path):
    export_hf(jax.device_get(params), CONFIG, [f"t{i}" for i in range(90)], str(tmp_path / "hf"))
    reference = transformers.BertForPreTraining.from_pretrained(str(tmp_path / "hf"))
    reference.train()  # dropout probabilities are 0, so train mode is deterministic
    decay = [p for n, p in reference.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in reference.named_parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.01}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=LR, betas=(0.9, 0.999), eps=1e-6)
    scheduler = transformers.get_linear_schedule_with_warmup(opt, WARMUP, STEPS)
    losses = []
    for batch in batches:
        labels = np.full((BATCH, SEQ), -100, np.int64)
        for b in range(BATCH):
            for p, i, w in zip(batch["masked_lm_positions"][b], batch["masked_lm_ids"][b],
                               batch["masked_lm_weights"][b]):
                if w > 0:
                    labels[b, p] = i
        out = reference(input_ids=torch.from_numpy(batch["input_ids"]).long(),
                        attention_mask=torch.from_numpy(batch["input_mask"]).long(),
                        token_type_ids=torch.from_numpy(batch["segment_ids"]).long(),
                        labels=torch.from_numpy(labels),
                        next_sentence_label=torch.from_numpy(batch["next_sentence_labels"][:, 0]).long())
        losses.append(out.loss.item())
        opt.zero_grad()
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0)
        opt.step()
        scheduler.step()
    return np.array(losses)


def test_twenty_adamw_steps_match_transformers_and_torch(setup, tmp_path):
    mesh, model, optimizer, schedule, state, shardings = setup
    batches = _batches(STEPS)
    expected = _torch_losses(state.params, batches, tmp_path)
    step, _ = train_step.compile_steps(model=model, optimizer=optimizer, schedule=schedule, grad_accum_steps=1,
                                       nsp_loss=True, state_shardings_tree=shardings, mesh=mesh)
    state = jax.tree_util.tree_map(jnp.copy, state)  # the step donates its input
    losses = []
    with sharding.activate(mesh):
        for batch in batches:
            state, metrics = step(state, sharding.global_batch(batch, mesh))
            losses.append(float(metrics["loss"]))
    losses = np.array(losses)
    assert expected[-1] < expected[0] * 0.97, "the reference run learns something, so the test is not trivial"
    np.testing.assert_allclose(losses, expected, rtol=1e-4)


def test_gradient_accumulation_equals_one_big_batch(setup):
    mesh, model, optimizer, schedule, state, shardings = setup
    batch = _batches(1, seed=5)[0]
    results = {}
    for accum in (1, 4):
        step = jax.jit(lambda s, b, a=accum: train_step.train_step(
            s, b, model=model, optimizer=optimizer, schedule=schedule,
            grad_accum_steps=a, nsp_loss=True))
        new_state, metrics = step(state, batch)
        results[accum] = (new_state, metrics)
    (one, m1), (four, m4) = results[1], results[4]
    np.testing.assert_allclose(float(m4["loss"]), float(m1["loss"]), rtol=1e-6)
    np.testing.assert_allclose(float(m4["grad_norm"]), float(m1["grad_norm"]), rtol=1e-5)
    for a, b in zip(jax.tree_util.tree_leaves(four.params), jax.tree_util.tree_leaves(one.params)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("skip", ["cond", "select"])
def test_non_finite_gradient_skips_the_update(setup, skipping_steps, skip):
    state = setup[4]
    batch = _batches(1, seed=6)[0]
    bad = jax.tree_util.tree_map(lambda x: x, state)
    bad = bad.replace(params=jax.tree_util.tree_map(lambda x: x, bad.params))
    bad.params["bert"]["embeddings"]["LayerNorm"]["scale"] = jnp.full((32,), jnp.nan)
    step = skipping_steps[skip]
    new_state, metrics = step(bad, batch)
    assert int(new_state.nonfinite_total) == 1 and int(new_state.nonfinite_consecutive) == 1
    assert int(new_state.step) == 1
    kernel = lambda s: np.asarray(s.params["bert"]["layers"]["intermediate"]["kernel"][0])
    assert np.array_equal(kernel(new_state), kernel(bad)), "a non-finite step must not change the params"
    good_state, _ = step(*step(state, batch)[:1], batch)  # two steps: the warmup's first learning rate is 0
    assert int(good_state.nonfinite_total) == 0 and not np.array_equal(kernel(good_state), kernel(state))


def test_select_and_branch_skips_give_the_same_updates(setup, skipping_steps):
    """The non-finite skip as a select fused into the update (TPU, GPU) and as a branch (CPU): the same 5 steps."""
    state = setup[4]
    assert train_step.skip_by_select("tpu") and train_step.skip_by_select("gpu")
    assert not train_step.skip_by_select("cpu")
    states = {}
    for skip, step in skipping_steps.items():
        states[skip] = state
        for batch in _batches(5, seed=7):
            states[skip], _ = step(states[skip], batch)
    for a, b in zip(jax.tree_util.tree_leaves(states["select"]), jax.tree_util.tree_leaves(states["cond"])):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)
    moved = np.asarray(states["cond"].params["bert"]["layers"]["intermediate"]["kernel"])
    assert not np.allclose(moved, np.asarray(state.params["bert"]["layers"]["intermediate"]["kernel"]))


def test_optimizer_state_is_sharded_like_its_params():
    mesh = sharding.make_mesh(data=2, fsdp=2, tensor=2)
    model = model_lib.BertForPreTraining(CONFIG)
    optimizer, _ = optim.make_optimizer(optim.OptimizerConfig(learning_rate=LR, warmup_steps=WARMUP), STEPS)
    state, shardings, _ = train_state.make_sharded_state(jax.random.key(0), model=model, config=CONFIG,
                                                   optimizer=optimizer, mesh=mesh, seq_len=SEQ, num_masked=MASKED)
    param_spec = state.params["bert"]["layers"]["intermediate"]["kernel"].sharding.spec
    adam_state = state.opt_state[1]
    assert param_spec == jax.sharding.PartitionSpec(None, "fsdp", "tensor")  # every chip holds every layer
    assert adam_state.mu["bert"]["layers"]["intermediate"]["kernel"].sharding.spec == param_spec
    assert adam_state.nu["bert"]["layers"]["intermediate"]["kernel"].sharding.spec == param_spec


def test_nsp_metrics_only_with_the_nsp_loss():
    """Hand-made sums: 4 masked tokens (3 right, loss sum 8), 2 instances (1 right, NSP loss sum 3). Without the
    NSP loss the untrained head's accuracy is not reported (it would read as a coin flip's)."""
    sums = {"mlm_loss_sum": jnp.float32(8.0), "mlm_correct": jnp.float32(3.0), "mlm_weight": jnp.float32(4.0),
            "nsp_loss_sum": jnp.float32(3.0), "nsp_correct": jnp.float32(1.0), "nsp_count": jnp.float32(2.0)}
    with_nsp = {k: float(v) for k, v in train_step.summarize(sums, nsp_loss=True).items()}
    assert with_nsp == {"mlm_loss": 2.0, "mlm_accuracy": 0.75, "nsp_loss": 1.5, "nsp_accuracy": 0.5, "loss": 3.5}
    without = {k: float(v) for k, v in train_step.summarize(sums, nsp_loss=False).items()}
    assert without == {"mlm_loss": 2.0, "mlm_accuracy": 0.75, "loss": 2.0}


# data x tensor slow-marked, for the default suite's time: the same update sharding as data x fsdp.
@pytest.mark.parametrize("mesh_shape, accum, scan", [pytest.param((4, 1, 2), 1, False, marks=pytest.mark.slow),
                                                     ((4, 2, 1), 2, True)],
                         ids=["data4xtensor2", "data4xfsdp2-accum2-scan"])
def test_update_sharded_over_data_gives_the_replicated_updates(mesh_shape, accum, scan):
    """Weight-update sharding (`mesh.shard_optimizer`): params and moments split over data, each replica's
    gradients reduce-scattered, the update on the slices; 5 steps with dropout on equal the replicated step's to
    1e-6 relative (the dropout masks hash global rows inside the shard_map too)."""
    import dataclasses

    data, fsdp, tensor = mesh_shape
    mesh = sharding.make_mesh(data=data, fsdp=fsdp, tensor=tensor)
    config = dataclasses.replace(CONFIG, hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1,
                                 scan_layers=scan)
    model = model_lib.BertForPreTraining(config)
    optimizer, schedule = optim.make_optimizer(optim.OptimizerConfig(learning_rate=LR, warmup_steps=2), STEPS)
    finals = {}
    for shard in (False, True):
        args = dict(model=model, config=config, optimizer=optimizer, mesh=mesh, seq_len=SEQ, num_masked=MASKED)
        state, shardings, _ = train_state.make_sharded_state(jax.random.key(0), shard_update=shard, **args)
        update = train_state.make_update_sharding(jax.random.key(0), **args) if shard else None
        step, _ = train_step.compile_steps(model=model, optimizer=optimizer, schedule=schedule,
                                           grad_accum_steps=accum, nsp_loss=True, state_shardings_tree=shardings,
                                           mesh=mesh, update_sharding=update)
        with sharding.activate(mesh):
            for batch in _batches(5, seed=9, batch=8 * accum):
                state, metrics = step(state, sharding.global_batch(batch, mesh))
        finals[shard] = state, metrics
    (sharded, sharded_metrics), (replicated, replicated_metrics) = finals[True], finals[False]
    layer = sharded.params["bert"]["layers"]["intermediate"]["kernel"]
    mu = sharded.opt_state[1].mu["bert"]["layers"]["intermediate"]["kernel"]
    assert "data" in jax.tree_util.tree_leaves(tuple(layer.sharding.spec)), layer.sharding.spec
    assert mu.sharding.spec == layer.sharding.spec
    for a, b in zip(jax.tree_util.tree_leaves(sharded), jax.tree_util.tree_leaves(replicated)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)
    for key in ("loss", "grad_norm", "mlm_accuracy"):
        np.testing.assert_allclose(float(sharded_metrics[key]), float(replicated_metrics[key]), rtol=1e-6)
    initial = train_state.make_sharded_state(jax.random.key(0), model=model, config=config, optimizer=optimizer,
                                             mesh=mesh, seq_len=SEQ, num_masked=MASKED)[0]
    moved = replicated.params["bert"]["layers"]["intermediate"]["kernel"]
    start = initial.params["bert"]["layers"]["intermediate"]["kernel"]
    assert not np.allclose(np.asarray(moved), np.asarray(start))


@pytest.mark.parametrize("dtype, tol", [(jnp.float32, 1e-6), (jnp.bfloat16, 1e-2)])
def test_token_nll_and_its_gradient_equal_log_softmax_differentiated_as_written(dtype, tol):
    """The MLM cross-entropy's own backward (softmax - onehot, one pass over the logits) against jax.nn.log_softmax
    and take_along_axis differentiated by autodiff: the same nll and hits, the same gradient (logits given in the
    compute dtype plus a float32 bias, as the MLM head makes them)."""
    rng = np.random.default_rng(0)
    logits = jnp.asarray(rng.normal(0, 3, (4, 5, 97)), dtype)
    bias = jnp.asarray(rng.normal(0, 1, 97), jnp.float32)
    labels = jnp.asarray(rng.integers(0, 97, (4, 5)), jnp.int32)
    labels = labels.at[:2].set(jnp.argmax(logits[:2].astype(jnp.float32) + bias, -1))   # hits, and misses
    weights = jnp.asarray(rng.random((4, 5)), jnp.float32)

    def reference(logits, bias):
        logp = jax.nn.log_softmax(logits.astype(jnp.float32) + bias, axis=-1)
        return -jnp.take_along_axis(logp, labels[..., None], axis=-1)[..., 0], logp.argmax(-1) == labels

    ours = lambda logits, bias: train_step._token_nll(logits.astype(jnp.float32) + bias, labels)
    (nll, hit), (want_nll, want_hit) = ours(logits, bias), reference(logits, bias)
    np.testing.assert_array_equal(nll, want_nll)
    np.testing.assert_array_equal(hit, want_hit)
    assert 10 <= int(want_hit.sum()) < 20
    loss = lambda f: lambda logits, bias: jnp.sum(f(logits, bias)[0] * weights)
    got = jax.grad(loss(ours), argnums=(0, 1))(logits, bias)
    want = jax.grad(loss(reference), argnums=(0, 1))(logits, bias)
    for g, w in zip(got, want):
        assert g.dtype == w.dtype
        scale = float(np.abs(np.asarray(w, np.float32)).max())
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32), rtol=tol,
                                   atol=tol * scale)


def _one_pass(logits, labels):
    """The GPU's forward (one variadic reduction), run here on the CPU."""
    return train_step._nll_and_hit(True, logits, labels)


def test_one_pass_nll_and_gradient_equal_log_softmax_within_float32_rounding():
    """The online-softmax reduction against jax.nn.log_softmax (and autodiff's gradient) over BERT's vocabulary,
    logits in the compute dtype plus a float32 bias as the MLM head makes them, and against float64."""
    rng = np.random.default_rng(1)
    logits = jnp.asarray(rng.normal(0, 4, (3, 7, 30522)), jnp.bfloat16)
    bias = jnp.asarray(rng.normal(0, 1, 30522), jnp.float32)
    labels = jnp.asarray(rng.integers(0, 30522, (3, 7)), jnp.int32).at[0, :3].set(jnp.argmax(
        logits[0, :3].astype(jnp.float32) + bias, -1))   # some hits

    def reference(logits, bias):
        logp = jax.nn.log_softmax(logits.astype(jnp.float32) + bias, axis=-1)
        return -jnp.take_along_axis(logp, labels[..., None], axis=-1)[..., 0], logp.argmax(-1) == labels

    ours = lambda logits, bias: _one_pass(logits.astype(jnp.float32) + bias, labels)
    (nll, hit), (want_nll, want_hit) = jax.jit(ours)(logits, bias), reference(logits, bias)
    x64 = np.asarray(logits, np.float64) + np.asarray(bias, np.float64)
    top = x64.max(-1)
    exact = top + np.log(np.exp(x64 - top[..., None]).sum(-1)) - np.take_along_axis(
        x64, np.asarray(labels)[..., None], -1)[..., 0]
    # A 30522-term float32 sum, summed serially here (XLA:CPU), in a tree on a GPU: a few ulps of log_sum.
    for want in (want_nll, exact):
        np.testing.assert_allclose(nll, want, rtol=2e-6, atol=2e-6 * np.abs(exact).max())
    np.testing.assert_array_equal(hit, want_hit)
    assert np.asarray(hit)[0, :3].all()
    weights = jnp.asarray(rng.random((3, 7)), jnp.float32)
    loss = lambda f: lambda logits, bias: jnp.sum(f(logits, bias)[0] * weights)
    got = jax.jit(jax.grad(loss(ours), argnums=(0, 1)))(logits, bias)
    want = jax.grad(loss(reference), argnums=(0, 1))(logits, bias)
    for g, w in zip(got, want):
        assert g.dtype == w.dtype
        scale = float(np.abs(np.asarray(w, np.float32)).max())
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32), rtol=1e-2,
                                   atol=1e-2 * scale)


def test_one_pass_by_hand_in_float64_ties_and_non_finite_rows():
    """softmax(log [1, 2, 3, 4]) = [.1, .2, .3, .4]: nll = -log p(label) and its gradient p - onehot, worked in
    float64 by hand, and a row shifted by 1e4 (exp of the unshifted row would overflow) against float64 on the same
    float32 inputs; tied maxima hit only at
    argmax's first index; a NaN logit makes its row's nll NaN (the step then skips its update), no other row's."""
    row = np.log([1.0, 2.0, 3.0, 4.0])
    logits = jnp.asarray(np.stack([row, row, row + 1e4 - 2]), jnp.float32)
    labels = jnp.asarray([3, 0, 2], jnp.int32)
    nll, hit = _one_pass(logits, labels)
    probabilities = np.array([0.1, 0.2, 0.3, 0.4])
    shifted = np.asarray(logits[2], np.float64)
    shifted_probabilities = np.exp(shifted - shifted.max()) / np.exp(shifted - shifted.max()).sum()
    np.testing.assert_allclose(nll, -np.log([0.4, 0.1, shifted_probabilities[2]]), rtol=2e-6)
    np.testing.assert_array_equal(hit, [True, False, False])
    grad = jax.grad(lambda x: jnp.sum(_one_pass(x, labels)[0]))(logits)
    want = np.stack([probabilities, probabilities, shifted_probabilities]) - np.eye(4)[[3, 0, 2]]
    np.testing.assert_allclose(grad, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())

    tied = jnp.asarray([[0.0, 2.0, 1.0, 2.0, 2.0, -1.0]] * 4 + [[0.0] * 6], jnp.float32)
    tied_labels = jnp.asarray([1, 3, 4, 0, 0], jnp.int32)
    _, tied_hit = _one_pass(tied, tied_labels)
    np.testing.assert_array_equal(tied_hit, [True, False, False, False, True])
    np.testing.assert_array_equal(tied_hit, tied.argmax(-1) == tied_labels)

    poisoned = logits.at[1, 2].set(jnp.nan)
    nll = np.asarray(_one_pass(poisoned, labels)[0])
    assert np.isnan(nll[1]) and np.isfinite(nll[[0, 2]]).all()
