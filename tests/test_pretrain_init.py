"""Continued pretraining from a released checkpoint: `--init` supplies the model (`--config init`) and the
vocabulary, and the run says which modules start fresh."""
import json

import pytest

from bertjax.data.demo_corpus import write_demo_corpus
from bertjax.interop.load import describe_pretrained, load_pretrained
from bertjax.pretraining import config as pretrain_config
from tests.conftest import save_tiny_checkpoint, save_tiny_hf
from tests.test_pretrain import _in_process, _run_here


def test_describe_gives_what_loading_gives_without_tensors(minilm_dir):
    described, loaded = describe_pretrained(str(minilm_dir)), load_pretrained(str(minilm_dir))
    assert described.params is None
    assert (described.config, described.vocab, described.lower_case) == (loaded.config, loaded.vocab,
                                                                          loaded.lower_case)


def test_config_init_is_the_checkpoints_model(minilm_dir):
    init = describe_pretrained(str(minilm_dir))
    config = pretrain_config.load_config("init", ["data.input=x", "train.steps=10", "optimizer.warmup_steps=1",
                                                  "model.hidden_dropout_prob=0.2"],
                                         init=init, init_vocab_file=str(minilm_dir / "vocab.txt"))
    model = config.bert_config(len(init.vocab))
    assert (model.num_hidden_layers, model.hidden_size, model.num_attention_heads, model.intermediate_size,
            model.vocab_size) == (6, 384, 12, 1536, 30522)  # all-MiniLM-L6-v2
    assert model.hidden_dropout_prob == 0.2  # --set still applies on top
    assert config.data.vocab == str(minilm_dir / "vocab.txt") and config.data.lower_case is True
    with pytest.raises(ValueError, match="--config init takes the model of the --init checkpoint"):
        pretrain_config.load_config("init", ["data.input=x"])


def test_pretrain_from_init_takes_its_model_and_vocab_and_names_fresh_heads(tmp_path, minilm_dir, monkeypatch,
                                                                            capsys):
    init = save_tiny_checkpoint(tmp_path / "init", minilm_dir / "vocab.txt", seed=0)  # an encoder, no MLM/NSP heads
    train_path, _ = write_demo_corpus(str(tmp_path / "corpus"))
    workdir = tmp_path / "run"
    output = _run_here(["pretrain", "--config", "init", "--init", init, "--workdir", str(workdir),
                        "--set", f"data.input={train_path}", "--set", "data.max_seq_length=64",
                        "--set", "data.max_predictions_per_seq=10", "--set", "data.doc_buffer_size=40",
                        "--set", "data.shuffle_buffer=100", "--set", "train.steps=2", "--set", "train.batch_size=8",
                        "--set", "optimizer.warmup_steps=1", "--set", "checkpoint.every=2"], monkeypatch, capsys)
    assert f"data.vocab: the --init checkpoint's vocabulary (30,522 tokens, lower_case=True), {workdir}/init_vocab.txt" \
        in output
    assert "not in the checkpoint, freshly initialised: predictions, seq_relationship\n" in output, output
    written = json.loads((workdir / "config.json").read_text())["model"]
    assert (written["num_hidden_layers"], written["hidden_size"], written["vocab_size"]) == (1, 32, 30522)
    assert (workdir / "init_vocab.txt").read_text() == (minilm_dir / "vocab.txt").read_text()


def test_a_vocab_or_activation_other_than_the_checkpoints_is_named(tmp_path, minilm_dir, monkeypatch, capsys):
    init = save_tiny_checkpoint(tmp_path / "init", minilm_dir / "vocab.txt", seed=0)
    tokens = (minilm_dir / "vocab.txt").read_text(encoding="utf-8").splitlines()
    tokens[2000], tokens[2001] = tokens[2001], tokens[2000]  # same size, two words' rows swapped
    (tmp_path / "vocab.txt").write_text("".join(t + "\n" for t in tokens), encoding="utf-8")
    train_path, _ = write_demo_corpus(str(tmp_path / "corpus"))
    output = _run_here(["pretrain", "--config", "init", "--init", init,
                        "--workdir", str(tmp_path / "run"), "--set", f"data.input={train_path}",
                        "--set", f"data.vocab={tmp_path / 'vocab.txt'}", "--set", "data.max_seq_length=32",
                        "--set", "data.max_predictions_per_seq=5", "--set", "train.steps=1",
                        "--set", "train.batch_size=8", "--set", "optimizer.warmup_steps=0",
                        "--set", "checkpoint.every=1", "--set", "model.hidden_act=gelu_new"], monkeypatch, capsys)
    assert (f"warning: --init {init} has hidden_act='gelu'; this job computes 'gelu_new' (set "
            f"model.hidden_act=gelu to continue with the checkpoint's)") in output, output
    assert (f"warning: data.vocab differs from the vocabulary of --init {init} in 2 token(s) (2000: "
            f"{tokens[2001]!r} -> {tokens[2000]!r}, 2001: {tokens[2000]!r} -> {tokens[2001]!r})") in output, output


def test_a_vocab_larger_than_the_embedding_table_is_refused(tmp_path, minilm_dir, capsys):
    hf = save_tiny_hf(tmp_path / "hf", minilm_dir / "vocab.txt", seed=0)
    with open(tmp_path / "hf" / "vocab.txt", "a", encoding="utf-8") as f:
        f.write("".join(f"[extra{i}]\n" for i in range(100)))
    with pytest.raises(ValueError, match=rf"{hf}/vocab.txt has 30622 tokens but the word embeddings of {hf} have "
                                         r"30522 rows: ids 30522..30621 have no embedding"):
        load_pretrained(hf)
    tokens = (minilm_dir / "vocab.txt").read_text(encoding="utf-8").splitlines()[:30000]
    (tmp_path / "hf" / "vocab.txt").write_text("".join(t + "\n" for t in tokens), encoding="utf-8")
    assert len(load_pretrained(hf).vocab) == 30000  # smaller is legal (HF pads tables), and said
    assert "vocab.txt has 30000 tokens, the word embeddings of" in capsys.readouterr().out


def test_pretrain_refuses_a_vocab_larger_than_the_models_table(tmp_path, minilm_dir, monkeypatch, capsys):
    """`--config init` takes the checkpoint's table size; a bigger data.vocab would index past it (NaN losses): refused
    before anything trains, by the same check as fine-tuning's and embed's."""
    init = save_tiny_checkpoint(tmp_path / "init", minilm_dir / "vocab.txt", seed=0)
    big = tmp_path / "big_vocab.txt"
    extra = "".join(f"[extra{i}]\n" for i in range(600))
    big.write_text((minilm_dir / "vocab.txt").read_text(encoding="utf-8") + extra, encoding="utf-8")
    train_path, _ = write_demo_corpus(str(tmp_path / "corpus"))
    code, out, err = _in_process(["pretrain", "--config", "init", "--init", init, "--workdir", str(tmp_path / "run"),
                                  "--set", f"data.input={train_path}", "--set", f"data.vocab={big}",
                                  "--set", "train.steps=2", "--set", "optimizer.warmup_steps=1"], monkeypatch, capsys)
    assert code == 2, err[-2000:]
    assert err.strip().splitlines()[-1] == (
        f"bertjax pretrain: error: {big} has 31122 tokens but the word embeddings of the model (model.vocab_size="
        f"30522) have 30522 rows: ids 30522..31121 have no embedding; use the vocab the checkpoint was trained with")
    assert "step" not in out


def test_a_cut_safetensors_file_is_named_in_one_line(tmp_path, minilm_dir, capsys):
    from bertjax.cli import main
    from tests.test_glue_job import _synthetic_glue

    _synthetic_glue(tmp_path / "glue")
    hf = save_tiny_hf(tmp_path / "hf", minilm_dir / "vocab.txt", seed=0)
    weights = tmp_path / "hf" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:weights.stat().st_size // 2])
    assert main(["finetune", "glue", "--task", "sst2", "--init", hf, "--data", str(tmp_path / "glue"),
                 "--workdir", str(tmp_path / "run")]) == 2
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line.startswith(f"bertjax finetune: error: {weights}: not a readable safetensors file (") and \
        line.endswith("); a cut download? fetch it again"), line
    assert not (tmp_path / "run").exists()  # the workdir it created and failed in before saving: removed
