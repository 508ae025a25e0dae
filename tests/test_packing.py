"""Sequence packing: the best-fit-decreasing packer, packed rows that unpack to the same instances, and the model
and train step giving the same outputs, losses and gradients for the same instances packed and unpacked, with no
attention across instances in any backend."""
from __future__ import annotations

import dataclasses
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from bertjax.data.packing import best_fit_decreasing, pack_instances
from bertjax.model.bert import model as model_lib
from bertjax.model import layer_layout
from bertjax.model.bert.config import BertConfig
from bertjax.pretraining import optim
from bertjax.pretraining import state as train_state
from bertjax.pretraining import step as train_step

SEQ, MASKED, MAX_INSTANCES, VOCAB, CLS, SEP = 32, 4, 4, 90, 2, 3
CONFIG = BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                    intermediate_size=64, max_position_embeddings=SEQ, hidden_dropout_prob=0.0,
                    attention_probs_dropout_prob=0.0, attention_backend="reference")


def test_best_fit_decreasing_by_hand():
    # Decreasing: 6 -> new row 0 (room 2); 5 -> new row 1 (room 3); 4 -> no room anywhere, new row 2;
    # 3 -> the tightest fit is row 1 (room 3); 2 -> row 0 (room 2).
    row, slot, offset, num_rows = best_fit_decreasing(np.array([5, 3, 4, 2, 6]), capacity=8, max_items=3)
    assert num_rows == 3
    assert row.tolist() == [1, 1, 2, 0, 0] and slot.tolist() == [0, 1, 0, 1, 0]
    assert offset.tolist() == [0, 5, 0, 6, 0]
    # The instance cap: three items of 1 with max_items=2 need two rows.
    assert best_fit_decreasing(np.array([1, 1, 1]), capacity=8, max_items=2)[3] == 2
    with pytest.raises(ValueError, match=r"lengths must be in \[1, 8\]"):
        best_fit_decreasing(np.array([9]), capacity=8, max_items=2)


def test_best_fit_decreasing_invariants():
    rng = np.random.default_rng(0)
    lengths = rng.integers(5, 129, 2000)
    row, slot, offset, num_rows = best_fit_decreasing(lengths, capacity=128, max_items=3)
    used = np.bincount(row, weights=lengths, minlength=num_rows)
    assert used.max() <= 128 and np.bincount(row).max() <= 3
    for r in range(0, num_rows, 37):  # items of a row lie back to back, slots in offset order
        items = np.flatnonzero(row == r)
        items = items[np.argsort(slot[items])]
        assert offset[items].tolist() == np.concatenate([[0], np.cumsum(lengths[items])[:-1]]).tolist()
    # Sorting first leaves little room unused: well under the rows one instance per row would need.
    assert num_rows < 0.75 * len(lengths) and 1 - lengths.sum() / (128 * num_rows) < 0.05


def _instances(count: int, seed: int) -> dict[str, np.ndarray]:
    """Masked [CLS] A [SEP] B [SEP] instances of random lengths, one per row, as the masker leaves them."""
    rng = np.random.default_rng(seed)
    out = {k: np.zeros((count, SEQ), np.int32) for k in ("input_ids", "input_mask", "segment_ids")}
    out.update(masked_lm_positions=np.zeros((count, MASKED), np.int32),
               masked_lm_ids=np.zeros((count, MASKED), np.int32),
               masked_lm_weights=np.zeros((count, MASKED), np.float32),
               next_sentence_labels=rng.integers(0, 2, count).astype(np.int32))
    for i in range(count):
        length = int(rng.integers(5, SEQ + 1))
        a = int(rng.integers(1, length - 3))  # tokens of A; B gets length - 3 - a >= 1
        ids = rng.integers(5, VOCAB, length)
        ids[0], ids[a + 1], ids[length - 1] = CLS, SEP, SEP
        out["input_ids"][i, :length] = ids
        out["input_mask"][i, :length] = 1
        out["segment_ids"][i, a + 2:length] = 1
        candidates = np.setdiff1d(np.arange(1, length - 1), [a + 1])
        chosen = np.sort(rng.choice(candidates, min(len(candidates), int(rng.integers(1, MASKED + 1))),
                                    replace=False))
        out["masked_lm_positions"][i, :len(chosen)] = chosen
        out["masked_lm_ids"][i, :len(chosen)] = ids[chosen]
        out["masked_lm_weights"][i, :len(chosen)] = 1.0
        out["input_ids"][i, chosen] = 4  # [MASK]
    return out


@pytest.fixture(scope="module")
def packed_and_unpacked():
    unpacked = _instances(24, seed=1)
    packed = pack_instances(unpacked, MAX_INSTANCES, pad_id=0)
    lengths = unpacked["input_mask"].sum(1)
    row, slot, offset, num_rows = best_fit_decreasing(lengths, SEQ, MAX_INSTANCES)
    assert num_rows == len(packed["input_ids"]) < len(lengths)
    unpacked = dict(unpacked, next_sentence_labels=unpacked["next_sentence_labels"][:, None])
    return unpacked, packed, (row, slot, offset)


def test_packed_rows_unpack_to_the_same_instances(packed_and_unpacked):
    unpacked, packed, (row, slot, offset) = packed_and_unpacked
    for i in range(len(row)):
        n = int(unpacked["input_mask"][i].sum())
        r, where = row[i], slice(offset[i], offset[i] + n)
        np.testing.assert_array_equal(packed["packing_ids"][r, where], slot[i] + 1)
        np.testing.assert_array_equal(packed["position_ids"][r, where], np.arange(n))
        for name in ("input_ids", "segment_ids", "input_mask"):
            np.testing.assert_array_equal(packed[name][r, where], unpacked[name][i, :n])
        assert packed["instance_cls_positions"][r, slot[i]] == offset[i]
        assert packed["next_sentence_labels"][r, slot[i]] == unpacked["next_sentence_labels"][i, 0]
        assert packed["next_sentence_weights"][r, slot[i]] == 1.0
        valid = unpacked["masked_lm_weights"][i] > 0
        in_row = packed["masked_lm_weights"][r] > 0
        mine = (packed["masked_lm_positions"][r] >= offset[i]) & (packed["masked_lm_positions"][r] < offset[i] + n)
        np.testing.assert_array_equal(packed["masked_lm_positions"][r][in_row & mine] - offset[i],
                                      unpacked["masked_lm_positions"][i][valid])
        np.testing.assert_array_equal(packed["masked_lm_ids"][r][in_row & mine], unpacked["masked_lm_ids"][i][valid])
    # Padding and empty slots carry nothing.
    assert packed["input_mask"].sum() == unpacked["input_mask"].sum()
    assert packed["next_sentence_weights"].sum() == len(row)
    assert packed["masked_lm_weights"].sum() == unpacked["masked_lm_weights"].sum()
    np.testing.assert_array_equal(packed["packing_ids"] > 0, packed["input_mask"] > 0)


@pytest.fixture(scope="module")
def params():
    model = model_lib.BertForPreTraining(CONFIG)
    return nn.meta.unbox(model_lib.init_params(model, CONFIG, jax.random.key(0), length=SEQ, num_masked=MASKED))


def _outputs(params, batch):
    model = model_lib.BertForPreTraining(CONFIG)
    return jax.device_get(train_step.forward(model, params, {k: jnp.asarray(v) for k, v in batch.items()},
                                             deterministic=True))


def test_model_outputs_per_instance_equal_packed_and_unpacked(params, packed_and_unpacked):
    unpacked, packed, (row, slot, offset) = packed_and_unpacked
    plain, joint = _outputs(params, unpacked), _outputs(params, packed)
    assert joint["nsp_logits"].shape == (len(packed["input_ids"]), MAX_INSTANCES, 2)
    np.testing.assert_allclose(joint["nsp_logits"][row, slot], plain["nsp_logits"], rtol=1e-5, atol=1e-5)
    compared = 0
    for i in range(len(row)):
        for j in np.flatnonzero(unpacked["masked_lm_weights"][i] > 0):
            target = unpacked["masked_lm_positions"][i, j] + offset[i]
            k = np.flatnonzero((packed["masked_lm_positions"][row[i]] == target)
                               & (packed["masked_lm_weights"][row[i]] > 0))
            assert len(k) == 1
            np.testing.assert_allclose(joint["mlm_logits"][row[i], k[0]], plain["mlm_logits"][i, j],
                                       rtol=1e-5, atol=1e-5)
            compared += 1
    assert compared == unpacked["masked_lm_weights"].sum()


def _loss(params, batch):
    sums = train_step.pretraining_sums(train_step.forward(model_lib.BertForPreTraining(CONFIG), params, batch,
                                                          deterministic=True), batch)
    return sums["mlm_loss_sum"] / sums["mlm_weight"] + sums["nsp_loss_sum"] / sums["nsp_count"]


def test_losses_and_gradients_equal_packed_and_unpacked(params, packed_and_unpacked):
    unpacked, packed, _ = packed_and_unpacked
    loss_and_grad = jax.jit(jax.value_and_grad(_loss))
    (loss_plain, grads_plain), (loss_packed, grads_packed) = (
        jax.device_get(loss_and_grad(params, {k: jnp.asarray(v) for k, v in b.items()})) for b in (unpacked, packed))
    np.testing.assert_allclose(loss_packed, loss_plain, rtol=1e-5)
    flat_plain = dict(jax.tree_util.tree_leaves_with_path(grads_plain))
    # Relative to the largest gradient: some are exactly zero in exact arithmetic (the key bias, which softmax
    # ignores) and hold only rounding noise (~1e-14) in both.
    scale = max(np.abs(g).max() for g in flat_plain.values())
    for path, grad in jax.tree_util.tree_leaves_with_path(grads_packed):
        np.testing.assert_allclose(grad, flat_plain[path], rtol=1e-5, atol=1e-6 * scale,
                                   err_msg=jax.tree_util.keystr(path))

    # The train step (its normalisation by real masked tokens and instances) agrees too.
    model = model_lib.BertForPreTraining(CONFIG)
    optimizer, schedule = optim.make_optimizer(optim.OptimizerConfig(learning_rate=1e-3, warmup_steps=0), 10)
    state = nn.meta.unbox(train_state.init_state(jax.random.key(0), model=model, config=CONFIG, optimizer=optimizer,
                                                 seq_len=SEQ, num_masked=MASKED)).replace(
        params=layer_layout.stack_layers(params))  # the state holds the layers stacked
    step = jax.jit(functools.partial(train_step.train_step, model=model, optimizer=optimizer, schedule=schedule,
                                     grad_accum_steps=1, nsp_loss=True))
    metrics = [jax.device_get(step(state, {k: jnp.asarray(v) for k, v in b.items()})[1])
               for b in (unpacked, packed)]
    for name in ("loss", "mlm_loss", "nsp_loss", "grad_norm", "real_tokens", "masked_tokens", "instances"):
        np.testing.assert_allclose(metrics[1][name], metrics[0][name], rtol=1e-5, err_msg=name)
    assert metrics[1]["padding_fraction"] < metrics[0]["padding_fraction"]


@pytest.mark.parametrize("backend", ["reference", "dot_product", "pallas_tpu", "splash_tpu"])
def test_no_attention_across_instances(params, packed_and_unpacked, backend):
    """Changing every token of one instance leaves each other instance's outputs bit-identical."""
    if backend.endswith("_tpu") and jax.default_backend() == "gpu":
        pytest.skip("the Pallas TPU interpret mode runs on CPU (and TPU), not on a GPU backend")
    _, packed, (row, slot, offset) = packed_and_unpacked
    r = int(np.argmax(np.bincount(row)))  # a row holding the most instances
    assert np.bincount(row)[r] >= 2
    batch = {k: v[r:r + 1] for k, v in packed.items()}
    changed = {k: v.copy() for k, v in batch.items()}
    victim = changed["packing_ids"][0] == 1
    changed["input_ids"][0, victim] = (changed["input_ids"][0, victim] + 7) % VOCAB
    model = model_lib.BertModel(dataclasses.replace(CONFIG, attention_backend=backend), add_pooler=False)
    bert_params = {k: v for k, v in params["bert"].items() if k != "pooler"}

    def sequence(b):
        return model.apply({"params": bert_params}, b["input_ids"], b["input_mask"], b["segment_ids"],
                           packing_ids=b["packing_ids"], position_ids=b["position_ids"])[0]

    with pltpu.force_tpu_interpret_mode():
        before, after = (np.asarray(jax.jit(sequence)({k: jnp.asarray(v) for k, v in b.items()}))
                         for b in (batch, changed))
    others = (batch["packing_ids"][0] > 1)
    assert others.any()
    np.testing.assert_array_equal(after[0, others], before[0, others])
    assert not np.allclose(after[0, victim], before[0, victim])
