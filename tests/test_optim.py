"""bertjax.pretraining.optim against hand-computed values and against torch.optim.AdamW + HF's linear schedule."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bertjax.pretraining.optim import (
    OptimizerConfig,
    decay_mask,
    linear_warmup_constant,
    linear_warmup_linear_decay,
    make_optimizer,
)


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
