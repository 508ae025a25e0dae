"""bertjax.pretraining.optim against hand-computed values, torch.optim.AdamW + HF's linear schedule, the schedules'
formulas, and StableAdamW against a float64 reference of optimi's update and against optimi itself."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from bertjax.pretraining.optim import (
    OptimizerConfig,
    decay_mask,
    make_optimizer,
    restart_schedule,
    warmup_then_decay,
)


def linear_warmup_linear_decay(learning_rate, num_train_steps, warmup_steps):
    return warmup_then_decay("linear", learning_rate, num_train_steps, warmup_steps)


def linear_warmup_constant(learning_rate, num_train_steps, warmup_steps):
    return warmup_then_decay("constant", learning_rate, num_train_steps, warmup_steps)


def test_schedule_hand_values():
    sched = linear_warmup_linear_decay(1e-3, num_train_steps=10, warmup_steps=4)
    got = [float(sched(s)) for s in range(12)]
    # warmup 0, .25, .5, .75 of peak; then (10 - s) / 6 of peak; 0 past the end.
    want = [0, 0.25e-3, 0.5e-3, 0.75e-3, 1e-3, 5 / 6e3, 4 / 6e3, 3 / 6e3, 2 / 6e3, 1 / 6e3, 0, 0]
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-12)


def test_constant_schedule_hand_values():
    """Warmup then held; without warmup the peak from the first update (step 0), as the linear schedule's."""
    warm = linear_warmup_constant(1e-3, num_train_steps=10, warmup_steps=4)
    np.testing.assert_allclose([float(warm(s)) for s in range(6)], [0, 0.25e-3, 0.5e-3, 0.75e-3, 1e-3, 1e-3],
                               rtol=1e-6, atol=1e-12)
    cold = linear_warmup_constant(1e-3, num_train_steps=10, warmup_steps=0)
    assert [float(cold(s)) for s in (0, 1, 9)] == [float(np.float32(1e-3))] * 3
    assert float(linear_warmup_linear_decay(1e-3, 10, 0)(0)) == float(cold(0))


def test_schedule_matches_transformers():
    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    param = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([param], lr=2e-5)
    hf = transformers.get_linear_schedule_with_warmup(opt, num_warmup_steps=7, num_training_steps=50)
    sched = linear_warmup_linear_decay(2e-5, 50, 7)
    for step in range(50):
        assert float(sched(step)) == pytest.approx(opt.param_groups[0]["lr"], rel=1e-5, abs=1e-12)
        opt.step()
        hf.step()


def test_schedule_rejects_bad_steps():
    with pytest.raises(ValueError, match="warmup_steps"):
        linear_warmup_linear_decay(1e-4, 10, 11)
    with pytest.raises(ValueError, match="num_train_steps"):
        linear_warmup_linear_decay(1e-4, 0, 0)


def test_decay_mask_excludes_layernorm_and_bias():
    params = {"embeddings": {"word_embeddings": {"embedding": np.zeros((5, 4))},
                             "LayerNorm": {"scale": np.zeros(4), "bias": np.zeros(4)}},
              "dense": {"kernel": np.zeros((4, 4)), "bias": np.zeros(4)},
              "cls": {"output_bias": np.zeros(5)}}
    mask = decay_mask(params)
    assert mask == {"embeddings": {"word_embeddings": {"embedding": True},
                                   "LayerNorm": {"scale": False, "bias": False}},
                    "dense": {"kernel": True, "bias": False}, "cls": {"output_bias": False}}


def _run_ours(params, grads, num_train_steps, **kw):
    opt, _ = make_optimizer(OptimizerConfig(**kw), num_train_steps)
    state = opt.init(params)
    for g in grads:
        updates, state = opt.update(g, state, params)
        params = jax.tree_util.tree_map(lambda p, u: p + u, params, updates)
    return params


def test_adamw_matches_torch_adamw_with_clip_and_schedule():
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    rng = np.random.default_rng(0)
    init = {"kernel": rng.normal(size=(3, 4)).astype(np.float32), "bias": rng.normal(size=4).astype(np.float32)}
    # Some gradients have global norm > 1 so clipping is exercised, some < 1.
    grads = [{k: (rng.normal(size=v.shape) * scale).astype(np.float32) for k, v in init.items()}
             for scale in (3.0, 0.05, 2.0, 0.1, 1.5, 0.2, 4.0, 0.3)]
    kw = dict(learning_rate=1e-2, num_train_steps=8, warmup_steps=2, weight_decay=0.1, eps=1e-6)
    ours = _run_ours(jax.tree_util.tree_map(jnp.asarray, init), [jax.tree_util.tree_map(jnp.asarray, g) for g in grads], **kw)

    tparams = {k: torch.nn.Parameter(torch.tensor(v)) for k, v in init.items()}
    topt = torch.optim.AdamW([{"params": [tparams["kernel"]], "weight_decay": 0.1},
                              {"params": [tparams["bias"]], "weight_decay": 0.0}],
                             lr=1e-2, betas=(0.9, 0.999), eps=1e-6)
    tsched = transformers.get_linear_schedule_with_warmup(topt, 2, 8)
    for g in grads:
        for k, p in tparams.items():
            p.grad = torch.tensor(g[k])
        torch.nn.utils.clip_grad_norm_(list(tparams.values()), 1.0)
        topt.step()
        tsched.step()
    for k in init:
        np.testing.assert_allclose(np.asarray(ours[k]), tparams[k].detach().numpy(), rtol=1e-5, atol=1e-6)


def test_adamw_without_bias_correction_hand_computed():
    # One parameter, no clipping, no warmup: two steps of the original BERT update by hand.
    p0, g1, g2 = 1.0, 0.5, -0.2
    lr, wd, eps, b1, b2 = 0.1, 0.01, 1e-6, 0.9, 0.999
    out = _run_ours({"w": jnp.full((2, 2), p0)}, [{"w": jnp.full((2, 2), g1)}, {"w": jnp.full((2, 2), g2)}],
                    learning_rate=lr, num_train_steps=2, warmup_steps=0, weight_decay=wd, clip_norm=0.0,
                    bias_correction=False)
    m1, v1 = (1 - b1) * g1, (1 - b2) * g1 ** 2
    p1 = p0 - lr * 1.0 * (m1 / (np.sqrt(v1) + eps) + wd * p0)  # schedule factor 1 at step 0
    m2, v2 = b1 * m1 + (1 - b1) * g2, b2 * v1 + (1 - b2) * g2 ** 2
    p2 = p1 - lr * 0.5 * (m2 / (np.sqrt(v2) + eps) + wd * p1)  # factor (2 - 1) / 2 at step 1
    np.testing.assert_allclose(np.asarray(out["w"]), np.full((2, 2), p2), rtol=1e-5)


def test_unknown_optimizer_name():
    with pytest.raises(ValueError, match="unknown optimizer"):
        OptimizerConfig(name="sgd")


def test_unknown_decay_and_stableadamw_without_bias_correction_are_refused():
    with pytest.raises(ValueError, match="unknown decay 'sqrt'; expected one of linear, cosine, 1-sqrt, constant"):
        OptimizerConfig(decay="sqrt")
    with pytest.raises(ValueError, match="stableadamw has Adam's bias correction"):
        OptimizerConfig(name="stableadamw", bias_correction=False)


# --- The schedules: each decay against its formula, in float64 ---------------------------------------------------

def _schedule_reference(decay, lr, total, warmup, step):
    if step < warmup:
        return lr * step / warmup
    progress = min(max((step - warmup) / (total - warmup), 0.0), 1.0)
    return lr * {"linear": 1 - progress, "cosine": 0.5 * (1 + np.cos(np.pi * progress)),
                 "1-sqrt": 1 - np.sqrt(progress), "constant": 1.0}[decay]


@pytest.mark.parametrize("decay", ["linear", "cosine", "1-sqrt", "constant"])
@pytest.mark.parametrize("warmup", [0, 7])
def test_each_decay_follows_its_formula(decay, warmup):
    # warmup 0: a decay phase of its own (the first update at the full rate); 7: warmup then decay in one run.
    lr, total = 8e-4, 50
    schedule = jax.jit(warmup_then_decay(decay, lr, total, warmup))
    steps = [0, 1, 3, warmup, warmup + 1, 20, 37, total - 2, total - 1, total, total + 5]
    got = np.array([float(schedule(s)) for s in steps])
    want = np.array([_schedule_reference(decay, lr, total, warmup, s) for s in steps])
    np.testing.assert_allclose(got, want, rtol=2e-6, atol=lr * 1e-6)
    if decay == "1-sqrt":  # hand values: a quarter of the decay done = half of the rate gone
        decay_steps = total - warmup
        quarter = warmup + decay_steps / 4
        if quarter == int(quarter):
            assert float(schedule(quarter)) == pytest.approx(lr / 2, rel=1e-6)
        assert float(schedule(warmup)) == pytest.approx(lr, rel=1e-7)
    if decay != "constant":
        assert float(schedule(total)) == 0.0


# --- StableAdamW: a float64 reference of optimi's update, and optimi itself ---------------------------------------

B1, B2, EPS = 0.9, 0.98, 1e-6  # ModernBERT's betas and eps
LAYERS = 2


def _params(rng):
    """A params tree with stacked layers (axis 0 = layer, under bert/layers) and a vector of its own."""
    return {"bert": {"layers": {"dense": {"kernel": rng.normal(size=(LAYERS, 3, 4)),
                                          "bias": rng.normal(size=(LAYERS, 4))}},
                     "embeddings": {"embedding": rng.normal(size=(5, 4))}},
            "cls": {"output_bias": rng.normal(size=5)}}


def _tensors(tree) -> dict:
    """{name: tensor} as the torch model holds them: each stacked layer its own tensor."""
    flat = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        name = "/".join(k.key for k in path)
        if name.startswith("bert/layers/"):
            flat.update({f"{name}#{i}": np.asarray(leaf[i]) for i in range(LAYERS)})
        else:
            flat[name] = np.asarray(leaf)
    return flat


# Each tensor's gradient scale per step (per layer for the stacked ones): the spikes after small steps make the
# clipping bite (RMS(g^2 / v) > 1) for that tensor alone, layer 1 of the kernel at step 3 but not layer 0.
SCALES = [{"kernel": (1.0, 1.0), "bias": (1.0, 1.0), "embedding": 1.0, "output_bias": 1e-7},
          {"kernel": (0.1, 0.1), "bias": (0.2, 1.0), "embedding": 0.1, "output_bias": 1e-7},
          {"kernel": (0.1, 6.0), "bias": (1.0, 1.0), "embedding": 5.0, "output_bias": 1e-7},
          {"kernel": (1.0, 1.0), "bias": (0.5, 0.5), "embedding": 0.5, "output_bias": 1.0},
          {"kernel": (0.01, 0.01), "bias": (8.0, 0.1), "embedding": 0.2, "output_bias": 1.0}]


def _grads(rng, shapes):
    steps = []
    for scales in SCALES:
        def one(path, leaf):
            key = path[-1].key
            scale = np.asarray(scales[key], np.float64).reshape((-1,) + (1,) * (leaf.ndim - 1)) \
                if isinstance(scales[key], tuple) else scales[key]
            return rng.normal(size=leaf.shape) * scale
        steps.append(jax.tree_util.tree_map_with_path(one, shapes))
    return steps


def _optimi_reference(params, grads, lrs, *, weight_decay, decouple_lr, max_lr):
    """optimi's StableAdamW step (optimi/stableadamw.py, `_single_param_stableadamw`) in float64 per tensor:
    debiased betas, the moments by lerp, RMS of g^2 / max(v, eps^2), lr / max(1, RMS) for the step and the decay.
    Returns (params, [{tensor: RMS} per step])."""
    p = {k: v.astype(np.float64) for k, v in _tensors(params).items()}
    m = {k: np.zeros_like(v) for k, v in p.items()}
    v = {k: np.zeros_like(x) for k, x in p.items()}
    rms_log = []
    for t, (step_grads, lr) in enumerate(zip(grads, lrs), start=1):
        beta1_hat, beta2_hat = (B1 ** t - B1) / (B1 ** t - 1), (B2 ** t - B2) / (B2 ** t - 1)
        rms_log.append({})
        for k, g in _tensors(step_grads).items():
            g = g.astype(np.float64)
            m[k] = m[k] + (1 - beta1_hat) * (g - m[k])
            v[k] = v[k] * beta2_hat + (1 - beta2_hat) * g * g
            rms = np.sqrt(np.mean(g * g / np.maximum(v[k], EPS ** 2)))
            rms_log[-1][k] = rms
            step_lr = lr / max(1.0, rms)
            if p[k].ndim >= 2:  # ModernBERT's filter_bias_norm_wd: no decay for vectors
                p[k] = p[k] * (1 - (step_lr / max_lr if decouple_lr else step_lr) * weight_decay)
            p[k] = p[k] - step_lr * m[k] / (np.sqrt(v[k]) + EPS)
    return p, rms_log


def _run_optimizer(config, params, grads):
    optimizer, schedule = make_optimizer(config, len(grads))
    update = jax.jit(optimizer.update)
    params = jax.tree_util.tree_map(lambda x: jnp.asarray(x, jnp.float32), params)
    state = optimizer.init(params)
    for g in grads:
        updates, state = update(jax.tree_util.tree_map(lambda x: jnp.asarray(x, jnp.float32), g), state, params)
        params = optax.apply_updates(params, updates)
    return params, state, [float(schedule(t)) for t in range(len(grads))]


@pytest.fixture(scope="module")
def stable_case():
    rng = np.random.default_rng(7)
    params = _params(rng)
    return params, _grads(rng, params)


@pytest.mark.parametrize("decouple_lr", [True, False])
def test_stableadamw_matches_a_float64_reference_of_optimis_update(stable_case, decouple_lr):
    params, grads = stable_case
    lr, weight_decay = 1e-2, (1e-4 if decouple_lr else 0.1)
    # ModernBERT's: no gradient clipping, the decay phase's 1-sqrt from the full rate.
    config = OptimizerConfig(name="stableadamw", learning_rate=lr, warmup_steps=0, decay="1-sqrt", b1=B1, b2=B2,
                             eps=EPS, weight_decay=weight_decay, decouple_lr=decouple_lr, clip_norm=0.0)
    ours, _, lrs = _run_optimizer(config, params, grads)
    np.testing.assert_allclose(lrs, [lr * (1 - np.sqrt(t / len(grads))) for t in range(len(grads))], rtol=1e-6)
    want, rms_log = _optimi_reference(params, grads, lrs, weight_decay=weight_decay, decouple_lr=decouple_lr,
                                      max_lr=lr)
    # The steps exercise both sides of the clip: per tensor, and per layer of a stacked tensor.
    assert all(rms <= 1.0 + 1e-9 for rms in rms_log[0].values())  # step 1: g^2 / v = 1 (bias-corrected v)
    assert rms_log[2]["bert/layers/dense/kernel#1"] > 1.2 and rms_log[2]["bert/layers/dense/kernel#0"] < 1.0
    assert rms_log[2]["bert/embeddings/embedding"] > 1.2 and rms_log[1]["bert/embeddings/embedding"] < 1.0
    assert rms_log[4]["bert/layers/dense/bias#0"] > 1.2 and rms_log[4]["bert/layers/dense/bias#1"] < 1.0
    assert rms_log[1]["cls/output_bias"] < 0.3  # gradients ~1e-7, below eps: v floored at eps^2 (unfloored: ~1)
    got = _tensors(ours)
    for name, value in want.items():
        np.testing.assert_allclose(got[name], value, rtol=2e-5, atol=2e-6, err_msg=name)


def test_stableadamw_is_adamw_but_where_the_clipping_bites(stable_case):
    # Three steps as AdamW and as StableAdamW: they differ in exactly the tensors (layers) whose RMS exceeded 1.
    params, grads = stable_case
    common = dict(learning_rate=1e-2, warmup_steps=0, decay="constant", b1=B1, b2=B2, eps=EPS, weight_decay=0.0,
                  clip_norm=0.0)
    stable = _tensors(_run_optimizer(OptimizerConfig(name="stableadamw", **common), params, grads[:3])[0])
    adamw = _tensors(_run_optimizer(OptimizerConfig(name="adamw", **common), params, grads[:3])[0])
    _, rms_log = _optimi_reference(params, grads[:3], [1e-2] * 3, weight_decay=0.0, decouple_lr=False, max_lr=1e-2)
    bitten = {name for name in stable if any(step[name] > 1.0 for step in rms_log)}
    assert {"bert/layers/dense/kernel#1", "bert/embeddings/embedding"} <= bitten
    assert "bert/layers/dense/kernel#0" not in bitten and "cls/output_bias" not in bitten
    differing = {name for name in stable if not np.allclose(stable[name], adamw[name], rtol=1e-6, atol=1e-7)}
    assert differing == bitten


@pytest.mark.parametrize("name", ["stableadamw", "adamw"])
def test_stableadamw_and_decoupled_adamw_match_optimi(stable_case, name):
    optimi = pytest.importorskip("optimi")
    torch = pytest.importorskip("torch")
    params, grads = stable_case
    lr, weight_decay = 1e-2, 1e-4
    config = OptimizerConfig(name=name, learning_rate=lr, warmup_steps=0, decay="1-sqrt", b1=B1, b2=B2, eps=EPS,
                             weight_decay=weight_decay, decouple_lr=True, clip_norm=0.0)
    ours, _, lrs = _run_optimizer(config, params, grads)
    tensors = {k: torch.nn.Parameter(torch.tensor(v, dtype=torch.float32)) for k, v in _tensors(params).items()}
    groups = [{"params": [p for p in tensors.values() if p.ndim >= 2], "weight_decay": weight_decay},
              {"params": [p for p in tensors.values() if p.ndim < 2], "weight_decay": 0.0}]
    kind = optimi.StableAdamW if name == "stableadamw" else optimi.AdamW
    optimizer = kind(groups, lr=lr, betas=(B1, B2), eps=EPS, decouple_lr=True, max_lr=lr, kahan_sum=False,
                     foreach=False, triton=False)
    for step_grads, step_lr in zip(grads, lrs):
        for group in optimizer.param_groups:
            group["lr"] = step_lr
        for k, g in _tensors(step_grads).items():
            tensors[k].grad = torch.tensor(g, dtype=torch.float32)
        optimizer.step()
    got = _tensors(ours)
    for k, p in tensors.items():
        np.testing.assert_allclose(got[k], p.detach().numpy(), rtol=2e-5, atol=2e-6, err_msg=k)


def test_restart_schedule_keeps_the_moments_and_adams_count():
    params = {"w": jnp.ones((2, 3))}
    optimizer, _ = make_optimizer(OptimizerConfig(name="stableadamw", warmup_steps=0, decay="1-sqrt",
                                                  clip_norm=0.0), 10)
    state = optimizer.init(params)
    for scale in (1.0, 2.0, 3.0):
        _, state = optimizer.update({"w": jnp.full((2, 3), scale)}, state, params)
    restarted = restart_schedule(state, optimizer.init(params))
    counts = lambda s, kind: [n.count for n in jax.tree_util.tree_leaves(  # noqa: E731
        s, is_leaf=lambda x: isinstance(x, kind)) if isinstance(n, kind)]
    assert counts(state, optax.ScaleByScheduleState) == [3] and counts(restarted, optax.ScaleByScheduleState) == [0]
    assert counts(restarted, optax.ScaleByAdamState) == [3]
    adam = [n for n in jax.tree_util.tree_leaves(restarted, is_leaf=lambda x: isinstance(x, optax.ScaleByAdamState))
            if isinstance(n, optax.ScaleByAdamState)][0]
    np.testing.assert_allclose(adam.mu["w"], (1 - 0.9) * (0.81 * 1 + 0.9 * 2 + 3))  # b1 = 0.9's EMA, by hand
