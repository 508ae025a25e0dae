"""ModernBERT's three phases end to end at the CPU's size, each started from the last one's checkpoint by its preset:
phase 1 (`--config modernbert-base`), the context extension (`--config modernbert-base-context --init PHASE1`: rows
twice as long, the global layers' RoPE theta raised from 10,000 to 160,000, the optimizer state carried over), the
decay (`--config modernbert-base-decay --init PHASE2`: 1-sqrt to 0), then `export`: transformers'
ModernBertForMaskedLM loads it with the extension's RoPE settings and gives bertjax's logits."""
import json

import numpy as np
import pytest
import torch
import transformers

from bertjax.checkpoint import load_model
from bertjax.data.demo_corpus import write_demo_corpus
from bertjax.model import family
from tests import modernbert_fixture
from tests.test_pretrain import _run_here, _step_records

# ModernBERT-tiny's shapes under the base presets' recipes, in float32 (the logits compared with torch's); rows of
# 64 tokens in phase 1 and 128 after (the presets' 1,024 and 8,192 scaled down), 8 a step.
TINY = ("--set", "model.dtype=float32", "--set", "train.batch_size=8", "--set", "train.grad_accum_steps=1",
        "--set", "data.doc_buffer_size=40", "--set", "data.shuffle_buffer=100", "--set", "train.log_every=1")
PHASE1, PHASE2, PHASE3 = 4, 3, 4   # steps
TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    folder = tmp_path_factory.mktemp("corpus")
    train_path, _ = write_demo_corpus(str(folder))
    modernbert_fixture.bpe_tokenizer().save_pretrained(folder / "tokenizer")
    return train_path, str(folder / "tokenizer" / "tokenizer.json")


@pytest.mark.slow  # three short runs and an export (~2 min on a loaded 2-core machine); the presets' chain alone:
# tests/test_pretrain_config.py::test_modernberts_three_phases_chain_by_init_at_its_figures
def test_three_phases_then_an_export_that_transformers_loads_with_the_extensions_rope(corpus, tmp_path, monkeypatch,
                                                                                      capsys):
    train_path, tokenizer_file = corpus
    phase1, phase2, phase3 = (tmp_path / name for name in ("phase1", "phase2", "phase3"))
    run = lambda *argv: _run_here(["pretrain", *argv, "--set", f"data.input={train_path}", *TINY], monkeypatch,
                                  capsys)

    run("--config", "modernbert-base", "--workdir", str(phase1), "--set", "model.preset=modernbert-tiny",
        "--set", "model.vocab_size=0", "--set", f"data.vocab={tokenizer_file}", "--set", "data.max_seq_length=64",
        "--set", "data.max_predictions_per_seq=19", "--set", f"train.steps={PHASE1}", "--set",
        "optimizer.warmup_steps=1", "--set", f"checkpoint.every={PHASE1}")
    first = load_model(str(phase1 / "checkpoints" / str(PHASE1))).config
    assert (first.global_rope_theta, first.local_rope_theta, first.num_hidden_layers) == (1e4, 1e4, 4)

    output = run("--config", "modernbert-base-context", "--init", str(phase1), "--workdir", str(phase2),
                 "--set", "data.max_seq_length=128", "--set", "data.max_predictions_per_seq=38",
                 "--set", f"train.steps={PHASE2}", "--set", f"checkpoint.every={PHASE2}")
    assert ("model: this phase's (model_over_init), over the --init checkpoint's: "
            "model.modernbert.global_rope_theta=160000.0 (the --init checkpoint's: 10000.0)") in output, output
    assert (f"started from {phase1}/checkpoints/{PHASE1}: its params and optimizer state (Adam's moments, at its step "
            f"{PHASE1}), the schedule from step 0") in output, output
    assert f"completed at step {PHASE2}/{PHASE2}" in output
    second = load_model(str(phase2 / "checkpoints" / str(PHASE2))).config
    assert (second.global_rope_theta, second.local_rope_theta) == (160_000.0, 1e4)
    assert {k: v for k, v in vars(second).items() if k != "global_rope_theta"} == {
        k: v for k, v in vars(first).items() if k != "global_rope_theta"}   # the rest of the model is phase 1's
    rates = [r["learning_rate"] for r in _step_records(phase2)]
    assert rates == pytest.approx([3e-4] * PHASE2)   # held from the first step: no warmup again

    output = run("--config", "modernbert-base-decay", "--init", str(phase2), "--workdir", str(phase3),
                 "--set", "data.max_seq_length=128", "--set", "data.max_predictions_per_seq=38",
                 "--set", f"train.steps={PHASE3}", "--set", f"checkpoint.every={PHASE3}")
    assert f"started from {phase2}/checkpoints/{PHASE2}: its params and optimizer state" in output, output
    assert "model_over_init" not in output   # the decay changes no model setting
    rates = {r["step"]: r["learning_rate"] for r in _step_records(phase3)}
    want = {s: 3e-4 * (1 - np.sqrt((s - 1) / PHASE3)) for s in range(1, PHASE3 + 1)}  # step s: s-1 updates done
    assert sorted(rates) == sorted(want)
    np.testing.assert_allclose([rates[s] for s in want], [want[s] for s in want], rtol=1e-6)
    config = json.loads((phase3 / "config.json").read_text())
    assert config["model"]["modernbert"]["global_rope_theta"] == 160_000.0

    _run_here(["export", str(phase3), "--out", str(tmp_path / "hf")], monkeypatch, capsys)
    model = transformers.ModernBertForMaskedLM.from_pretrained(tmp_path / "hf").eval()
    rope = model.config.rope_parameters
    assert (rope["full_attention"]["rope_theta"], rope["sliding_attention"]["rope_theta"]) == (160_000.0, 1e4)
    assert model.config.local_attention == 32 and model.config.max_position_embeddings == 8192
    # A text longer than the window (16 tokens each side): the local layers attend within it, the global ones to
    # every token at theta 160,000; bertjax's checkpoint and the export agree on every logit.
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    text = " ".join(open(train_path).read().split()[:60])
    encoded = tokenizer(text, return_tensors="np")
    assert encoded["input_ids"].shape[1] > 64
    checkpoint = load_model(str(phase3 / "checkpoints" / str(PHASE3)))
    ours = family.pretraining_model(checkpoint.config).apply(
        {"params": checkpoint.params}, encoded["input_ids"], encoded["attention_mask"])["mlm_logits"]
    with torch.no_grad():
        theirs = model(**tokenizer(text, return_tensors="pt")).logits.numpy()
    # float32 on both sides: 7e-7 apart (measured); phase 1's theta moves them 3.5e-4 (the comparison sees it)
    np.testing.assert_allclose(np.asarray(ours), theirs, rtol=0, atol=TOLERANCE)
    model.config.rope_parameters["full_attention"]["rope_theta"] = 1e4
    at_phase1s_theta = transformers.ModernBertForMaskedLM(model.config).eval()
    at_phase1s_theta.load_state_dict(model.state_dict())
    with torch.no_grad():
        other = at_phase1s_theta(**tokenizer(text, return_tensors="pt")).logits.numpy()
    assert np.abs(other - theirs).max() > 10 * TOLERANCE
