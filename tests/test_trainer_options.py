"""The Trainer-level options of every fine-tune job: gradient accumulation is one big batch, bfloat16 trains with
float32 master weights, --metric-for-best keeps and exports the best evaluation's params (not the last), early
stopping stops, and a run with all of them resumes bit-exactly after SIGTERM."""
from __future__ import annotations

import json
import random

import jax
import numpy as np
import pytest

from bertjax.finetune.settings import TrainSettings
from bertjax.finetune.table_data import TableSpec
from tests.conftest import save_tiny_hf
from tests.test_classify_job import _sentence, _write_csv


@pytest.fixture(scope="module")
def tiny_init(tmp_path_factory, minilm_dir) -> str:
    return save_tiny_hf(tmp_path_factory.mktemp("init") / "hf", minilm_dir / "vocab.txt", seed=0)


def _trainer(init: str, **settings):
    from bertjax.finetune.trainer import Trainer, classification_loss
    from bertjax.interop.load import load_init
    from bertjax.model.bert import BertForSequenceClassification

    ckpt, tokenizer = load_init(init)
    config = ckpt.config.replace(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    trainer = Trainer(BertForSequenceClassification(config, 2), config, ckpt.params, classification_loss,
                      TrainSettings(batch_size=16, epochs=1, seed=3, learning_rate=1e-3, **settings))
    rng = random.Random(0)
    labels = np.array([i % 2 for i in range(48)], np.int32)
    encoded = tokenizer.encode([_sentence(rng, "great" if y else "awful") for y in labels], 32)
    return trainer, {**encoded, "labels": labels}


def test_grad_accumulation_is_one_big_batch(tiny_init):
    whole, arrays = _trainer(tiny_init)
    whole.train(arrays)
    accumulated, _ = _trainer(tiny_init, grad_accum_steps=2)  # 2 micro-batches of 8 rows, one row a device
    accumulated.train(arrays)
    for a, b in zip(jax.tree_util.tree_leaves(whole.params), jax.tree_util.tree_leaves(accumulated.params)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-6, atol=2e-6)  # only the sum order differs
    first = jax.tree_util.tree_leaves(whole.params)[0]
    assert not np.allclose(np.asarray(first), np.asarray(jax.tree_util.tree_leaves(_trainer(tiny_init)[0].params)[0]))


def test_bfloat16_computes_in_bfloat16_and_keeps_float32_weights(tiny_init):
    trainer, arrays = _trainer(tiny_init, dtype="bfloat16")
    assert trainer.module.config.dtype == "bfloat16"
    from bertjax.model.bert import BertModel

    hidden = BertModel(trainer.module.config).apply({"params": trainer.params["bert"]}, arrays["input_ids"][:8],
                                                    arrays["input_mask"][:8], arrays["segment_ids"][:8])[0]
    assert hidden.dtype == np.dtype("bfloat16")
    trainer.train(arrays)
    assert {np.asarray(x).dtype for x in jax.tree_util.tree_leaves(trainer.params)} == {np.dtype("float32")}
    float32, _ = _trainer(tiny_init)
    float32.train(arrays)
    deltas = [np.abs(np.asarray(a) - np.asarray(b)).max() for a, b in
              zip(jax.tree_util.tree_leaves(trainer.params), jax.tree_util.tree_leaves(float32.params))]
    assert 0 < max(deltas) < 1e-2  # another rounding, the same training


def test_best_evaluation_is_kept_and_exported_and_early_stopping_stops(tiny_init, tmp_path):
    """Dev labels are the training labels inverted: the more the model learns, the worse its dev accuracy, so the
    best evaluation is an early one and every later one is worse."""
    from bertjax.finetune import classify

    rng = random.Random(5)
    words = {"pos": "great", "neg": "awful"}
    flipped = {"pos": "neg", "neg": "pos"}
    rows = [[_sentence(rng, words[y]), y] for y in ["pos", "neg"] * 80]
    dev_rows = [[_sentence(rng, words[y]), flipped[y]] for y in ["pos", "neg"] * 16]
    train, dev = (_write_csv(tmp_path / f"{n}.csv", ["text", "label"], r) for n, r in (("t", rows), ("d", dev_rows)))
    settings = TrainSettings(learning_rate=1e-2, batch_size=16, epochs=8, seed=1, eval_batch_size=16,
                             eval_every=5, metric_for_best="accuracy", early_stopping_patience=8)
    work = tmp_path / "work"
    result = classify.run(str(train), str(work), settings, TableSpec(), init=tiny_init, dev=str(dev),
                          max_seq_length=32, export_hf=True)
    evals = [json.loads(line) for line in (work / "metrics.jsonl").read_text().splitlines()]
    evals = [(e["step"], e["eval_accuracy"]) for e in evals if "eval_accuracy" in e]
    best_step, best_value = max(evals, key=lambda e: (e[1], -e[0]))
    assert result["best"] == {"metric": "accuracy", "value": best_value, "step": best_step, "stale": 8}
    assert evals[-1][1] < best_value  # the last evaluation is worse than the kept one
    # Early stopping: 8 evaluations after the best, before the 80 steps of 8 epochs.
    assert result["stopped_early"] and evals[-1][0] == best_step + 8 * 5 == result["steps_run"] < 80
    assert result["metrics"]["dev"]["accuracy"] == best_value  # the job evaluated the kept params

    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForSequenceClassification.from_pretrained(work / "hf").eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(work / "hf")
    with torch.no_grad():
        logits = model(**tokenizer([r[0] for r in dev_rows], padding=True, return_tensors="pt")).logits.numpy()
    names = result["labels"]
    assert np.mean([names[i] == r[1] for i, r in zip(logits.argmax(-1), dev_rows)]) == best_value


def test_bfloat16_accumulation_and_best_resume_bit_exactly(tmp_path, capsys, minilm_dir):
    """SIGTERM mid-run, then the same command: the same weights as the uninterrupted run, to the bit."""
    from bertjax.checkpoint import load_model
    from bertjax.cli import main
    from tests.conftest import save_tiny_checkpoint
    from tests.test_finetune_resume import _sigterm_once_training, _steps

    init = save_tiny_checkpoint(tmp_path / "init", minilm_dir / "vocab.txt", seed=0)
    rng = random.Random(7)
    rows = [[_sentence(rng, "great" if i % 2 else "awful"), "pos" if i % 2 else "neg"] for i in range(160)]
    train = _write_csv(tmp_path / "train.csv", ["text", "label"], rows)
    dev = _write_csv(tmp_path / "dev.csv", ["text", "label"], rows[:32])

    def argv(workdir):
        return ["finetune", "classify", "--train", str(train), "--dev", str(dev), "--init", init, "--workdir",
                str(workdir), "--epochs", "3", "--batch-size", "16", "--max-seq-length", "32", "--learning-rate",
                "1e-3", "--log-every", "1", "--save-every", "0", "--save-checkpoint", "--dtype", "bfloat16",
                "--grad-accum-steps", "2", "--metric-for-best", "accuracy", "--eval-every", "3"]

    assert main(argv(tmp_path / "whole")) == 0
    cut = tmp_path / "cut"
    watcher = _sigterm_once_training(cut)
    assert main(argv(cut)) == 0
    watcher.join()
    assert "stopped by a signal at step" in capsys.readouterr().out
    stopped_at = max(_steps(cut))
    assert 1 <= stopped_at < 30
    assert main(argv(cut)) == 0
    assert f"resumed from {cut}/train_state/{stopped_at}" in capsys.readouterr().out
    whole, resumed = (load_model(str(w / "checkpoint")).params for w in (tmp_path / "whole", cut))
    for a, b in zip(jax.tree_util.tree_leaves(whole), jax.tree_util.tree_leaves(resumed)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    results = [json.loads((w / "metrics.json").read_text()) for w in (tmp_path / "whole", cut)]
    assert results[0]["best"] == results[1]["best"] and results[0]["metrics"] == results[1]["metrics"]
