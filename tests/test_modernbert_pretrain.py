"""ModernBERT pretrained from scratch (`--config modernbert-tiny`, the modern recipe: MLM alone at 30%, packing, no
NSP) on a text corpus with an HF tokenizer.json as its vocabulary: stopped by SIGTERM and rerun, it ends with the
bits of an uninterrupted run; its export is transformers' ModernBertForMaskedLM with the same logits as the
checkpoint, and the tokenizer it trained with. The README's former command, on a WordPiece vocab.txt, exports a
directory that transformers' fill-mask pipeline reads whole."""
import json
import os
import signal
import sys

import numpy as np
import pytest
import torch
import transformers

from bertjax.checkpoint import load_model
from bertjax.data.demo_corpus import write_demo_corpus
from bertjax.model import family
from bertjax.runtime.preemption import STOPPED_EXIT
from tests import modernbert_fixture
from tests.conftest import host_devices
from tests.test_pretrain import _losses, _run, _run_here, _run_until

STEPS, EVERY = 8, 2
MIDDLE = STEPS // 2
# The subprocesses get this process's host devices: the resume runs here, and a batch split over another device
# count sums in another order (under `make test`, a 1-device worker: losses 1 ulp apart from 8-device runs').
DEVICES = host_devices(os.environ["XLA_FLAGS"])


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    folder = tmp_path_factory.mktemp("corpus")
    train_path, eval_path = write_demo_corpus(str(folder))
    modernbert_fixture.bpe_tokenizer().save_pretrained(folder / "tokenizer")
    return train_path, eval_path, str(folder / "tokenizer" / "tokenizer.json")


def _argv(workdir, corpus, *extra):
    train_path, eval_path, tokenizer = corpus
    return [sys.executable, "-m", "bertjax.cli", "pretrain", "--config", "modernbert-tiny", "--workdir",
            str(workdir), "--set", f"data.input={train_path}", "--set", f"data.vocab={tokenizer}",
            "--set", "data.max_seq_length=64", "--set", "data.max_predictions_per_seq=19", "--set",
            "data.doc_buffer_size=40", "--set", "data.shuffle_buffer=100", "--set", f"train.steps={STEPS}",
            "--set", "train.batch_size=8", "--set", "train.log_every=1", "--set", f"checkpoint.every={EVERY}",
            "--set", "optimizer.warmup_steps=2", "--set", "model.modernbert.attention_dropout=0.1",
            "--set", "model.modernbert.mlp_dropout=0.1", *extra]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, corpus):
    workdir = tmp_path_factory.mktemp("modernbert") / "run"
    output = _run(_argv(workdir, corpus, "--set", f"data.eval_input={corpus[1]}", "--set", "train.eval_every=4"),
                  devices=DEVICES)
    assert f"completed at step {STEPS}/{STEPS}" in output, output[-3000:]
    return workdir


def test_the_modern_recipe_trains_masked_lm_alone_on_packed_rows(uninterrupted):
    records = [json.loads(line) for line in (uninterrupted / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "loss" in r and "event" not in r and "eval_loss" not in r]
    assert [r["step"] for r in steps] == list(range(1, STEPS + 1))
    assert all(r["loss"] == r["mlm_loss"] and "nsp_loss" not in r for r in steps)  # MLM alone
    assert steps[-1]["loss"] < steps[0]["loss"]
    config = json.loads((uninterrupted / "config.json").read_text())
    assert (config["data"]["masked_lm_prob"], config["data"]["packing"]) == (0.3, True)
    assert any("eval_mlm_accuracy" in r for r in records)
    checkpoint = load_model(str(uninterrupted / "checkpoints" / str(STEPS)))
    assert family.of(checkpoint.config).name == "ModernBERT" and checkpoint.tokenizer is not None
    assert checkpoint.config.local_attention == 32 and checkpoint.config.layer_types[:2] == (
        "full_attention", "sliding_attention")


def test_sigterm_then_resume_is_bit_exact(uninterrupted, corpus, tmp_path, monkeypatch, capsys):
    workdir = tmp_path / "preempted"
    extra = ("--set", f"data.eval_input={corpus[1]}", "--set", "train.eval_every=4")
    code, output = _run_until(_argv(workdir, corpus, *extra), f"step {MIDDLE}/", signal.SIGTERM,
                                  devices=DEVICES)
    assert code == STOPPED_EXIT and "preempted at step" in output, output[-3000:]
    _run_here(_argv(workdir, corpus, *extra), monkeypatch, capsys)
    expected, resumed = _losses(uninterrupted), _losses(workdir)
    assert [resumed[s] for s in range(MIDDLE + 1, STEPS + 1)] == [expected[s] for s in range(MIDDLE + 1, STEPS + 1)]
    import jax

    ours = jax.tree_util.tree_leaves(load_model(str(workdir / "checkpoints" / str(STEPS))).params)
    theirs = jax.tree_util.tree_leaves(load_model(str(uninterrupted / "checkpoints" / str(STEPS))).params)
    assert all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(ours, theirs))


def test_the_export_loads_as_automodelformaskedlm_with_the_checkpoints_logits(uninterrupted, corpus, tmp_path,
                                                                             monkeypatch, capsys):
    _run_here(["export", str(uninterrupted), "--out", str(tmp_path / "hf")], monkeypatch, capsys)
    model = transformers.AutoModelForMaskedLM.from_pretrained(tmp_path / "hf").eval()
    assert type(model).__name__ == "ModernBertForMaskedLM"
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert (tmp_path / "hf/tokenizer.json").read_text() == open(corpus[2]).read()
    text = "Methods are functions that are called using the attribute notation, and their names are looked up."
    encoded = tokenizer(text, return_tensors="np")
    checkpoint = load_model(str(uninterrupted / "checkpoints" / str(STEPS)))
    ours = family.pretraining_model(checkpoint.config).apply(
        {"params": checkpoint.params}, encoded["input_ids"], encoded["attention_mask"])["mlm_logits"]
    with torch.no_grad():
        theirs = model(**tokenizer(text, return_tensors="pt")).logits.numpy()
    np.testing.assert_allclose(np.asarray(ours), theirs, rtol=1e-4, atol=1e-4)
    assert "ModernBertForMaskedLM" in (tmp_path / "hf/README.md").read_text()


def test_the_readmes_wordpiece_command_exports_what_the_fill_mask_pipeline_reads_whole(corpus, tmp_path,
                                                                                      monkeypatch, capsys):
    """`pretrain --config modernbert-tiny --set data.vocab=vocab/vocab.txt` (the README's command until its
    ModernBERT path moved to a BPE; a few steps) on a vocabulary from `vocab train --type wordpiece`, exported:
    AutoTokenizer gives the ids the run trained with and `pipeline("fill-mask", model=export)` the checkpoint's own
    scores at the mask (transformers 5 read no tokenizer from the export: it had no tokenizer.json)."""
    from bertjax.data.tokenizers import WordPieceTokenizer

    train_path, eval_path, _ = corpus
    _run_here(["vocab", "train", "--input", train_path, "--type", "wordpiece", "--vocab-size", "4000", "--out",
               str(tmp_path / "vocab")], monkeypatch, capsys)
    vocab = str(tmp_path / "vocab" / "vocab.txt")
    _run_here(["pretrain", "--config", "modernbert-tiny", "--workdir", str(tmp_path / "modern"), "--set",
               f"data.input={train_path}", "--set", f"data.vocab={vocab}", "--set", "train.steps=2"],
              monkeypatch, capsys)
    _run_here(["export", str(tmp_path / "modern"), "--out", str(tmp_path / "hf")], monkeypatch, capsys)

    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    sentences = [line for line in open(eval_path, encoding="utf-8").read().splitlines() if 0 < len(line) < 300][:64]
    assert len(sentences) == 64
    ours = WordPieceTokenizer(vocab).encode(sentences[:32], max_len=512, text_pairs=sentences[32:])
    theirs = tokenizer(sentences[:32], sentences[32:])
    for row, ids in enumerate(theirs["input_ids"]):
        assert ours["input_ids"][row, :len(ids)].tolist() == ids and ours["input_mask"][row].sum() == len(ids)

    text = "Methods are [MASK] that are called using the attribute notation."
    found = transformers.pipeline("fill-mask", model=str(tmp_path / "hf"), top_k=5)(text)
    encoded = tokenizer(text, return_tensors="np")
    checkpoint = load_model(str(tmp_path / "modern" / "checkpoints" / "2"))
    logits = family.pretraining_model(checkpoint.config).apply(
        {"params": checkpoint.params}, encoded["input_ids"], encoded["attention_mask"])["mlm_logits"]
    position = int(np.flatnonzero(encoded["input_ids"][0] == tokenizer.mask_token_id)[0])
    probabilities = np.asarray(torch.softmax(torch.from_numpy(np.asarray(logits[0, position], np.float64)), -1))
    assert [r["token"] for r in found] == list(np.argsort(-probabilities)[:5])
    np.testing.assert_allclose([r["score"] for r in found], np.sort(probabilities)[::-1][:5], rtol=1e-4)


@pytest.mark.slow
def test_a_scanned_run_starts_where_the_unrolled_one_is_and_trains_on(uninterrupted, corpus, tmp_path):
    """`model.scan_layers` pretraining (packed rows, dropout on): initialised from the unrolled run's checkpoint, its
    first loss is that of trained weights, it trains on, and its checkpoint is written per layer, as the unrolled
    run's (the same tree)."""
    workdir = tmp_path / "scanned"
    argv = _argv(workdir, corpus, "--set", "model.scan_layers=true", "--init", str(uninterrupted))
    argv[argv.index(f"train.steps={STEPS}")] = "train.steps=4"
    output = _run(argv, devices=DEVICES)
    assert "completed at step 4/4" in output, output[-3000:]
    losses, fresh = _losses(workdir), _losses(uninterrupted)
    assert losses[1] < fresh[1] - 0.5 and losses[4] < losses[1] + 0.5
    import jax

    ours = load_model(str(workdir / "checkpoints" / "4")).params
    theirs = load_model(str(uninterrupted / "checkpoints" / str(STEPS))).params
    assert jax.tree_util.tree_structure(ours) == jax.tree_util.tree_structure(theirs)
