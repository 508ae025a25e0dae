"""Continued pretraining from a released checkpoint: `--init` supplies the model (`--config init`) and the
vocabulary, and the run says which modules start fresh."""
import json

import numpy as np
import pytest
import torch
import transformers

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


# ---- ModernBERT: continued pretraining from a released checkpoint (`--config modernbert-base --init ...`) -------

@pytest.fixture(scope="module")
def released(tmp_path_factory):
    """A released ModernBertForMaskedLM as transformers writes it (model.safetensors without the tied decoder,
    tokenizer.json): modernbert_fixture's tiny one, every weight off its init."""
    from tests import modernbert_fixture

    return modernbert_fixture.write_masked_lm(tmp_path_factory.mktemp("released") / "hf")


# ModernBERT-base's recipe (betas 0.9/0.98, eps 1e-6, lr 8e-4 held) at the test's size; its weight decay (1e-5)
# raised so that a tensor decayed on one side only would show (8e-4 x 0.1 x |w| ~ 1e-5, against 1e-6 tolerances).
ONE_STEP = ["data.input=unused", "model.dtype=float32", "data.max_seq_length=24", "data.max_predictions_per_seq=4",
            "data.packing=false", "train.batch_size=8", "train.grad_accum_steps=1", "train.steps=10",
            "optimizer.warmup_steps=0", "optimizer.weight_decay=0.1"]


def _explicit_batch(tokenizer, seq: int, masked: int, rows: int = 8, seed: int = 0) -> dict:
    """Rows of [CLS] ids [SEP] of varied lengths (padding after), `masked` predictions a row (the last slot of every
    third row empty, as in the shards): the masked tokens replaced by [MASK], their labels given."""
    rng = np.random.default_rng(seed)
    ids = tokenizer.special_token_ids
    lengths = rng.integers(12, seq + 1, rows)
    input_mask = (np.arange(seq)[None, :] < lengths[:, None]).astype(np.int32)
    input_ids = rng.integers(5, len(tokenizer.vocab), (rows, seq)).astype(np.int32)  # past the 5 special tokens
    input_ids[:, 0], input_ids[np.arange(rows), lengths - 1] = ids["cls"], ids["sep"]
    input_ids[input_mask == 0] = ids["pad"]
    positions = np.stack([rng.choice(np.arange(1, length - 1), masked, replace=False) for length in lengths])
    weights = np.ones((rows, masked), np.float32)
    weights[::3, -1] = 0.0
    positions = (positions * weights).astype(np.int32)
    labels = np.take_along_axis(input_ids, positions, 1) * weights.astype(np.int32)
    for row in range(rows):
        input_ids[row, positions[row][weights[row] > 0]] = ids["mask"]
    return dict(input_ids=input_ids, input_mask=input_mask, segment_ids=np.zeros_like(input_ids),
                masked_lm_positions=positions, masked_lm_ids=labels, masked_lm_weights=weights,
                next_sentence_labels=np.zeros((rows, 1), np.int32))


def _torch_step(directory, batch, optimizer_config):
    """transformers' ModernBertForMaskedLM from `directory`, one step of the recipe's optimizer on `batch` (labels
    -100 but at the masked positions), decay on the matrices only (embeddings and kernels, as the recipe's
    decay_mask): optimi's StableAdamW (ModernBERT's, fully decoupled decay) for `stableadamw`, else torch's AdamW;
    the gradient clipped at `clip_norm` where set: (loss, {name: updated tensor})."""
    config = optimizer_config
    model = transformers.ModernBertForMaskedLM.from_pretrained(directory, attn_implementation="eager").train()
    labels = np.full(batch["input_ids"].shape, -100, np.int64)
    for row, (positions, ids, weights) in enumerate(zip(batch["masked_lm_positions"], batch["masked_lm_ids"],
                                                        batch["masked_lm_weights"])):
        labels[row, positions[weights > 0]] = ids[weights > 0]
    named = dict(model.named_parameters())  # the tied decoder weight is the embeddings' one parameter
    groups = [{"params": [p for p in named.values() if p.ndim >= 2], "weight_decay": config.weight_decay},
              {"params": [p for p in named.values() if p.ndim < 2], "weight_decay": 0.0}]
    if config.name == "stableadamw":
        optimi = pytest.importorskip("optimi")
        optimizer = optimi.StableAdamW(groups, lr=config.learning_rate, betas=(config.b1, config.b2),
                                       eps=config.eps, decouple_lr=config.decouple_lr, max_lr=config.learning_rate,
                                       kahan_sum=False, foreach=False, triton=False)
    else:
        optimizer = torch.optim.AdamW(groups, lr=config.learning_rate, betas=(config.b1, config.b2), eps=config.eps)
    loss = model(input_ids=torch.from_numpy(batch["input_ids"]).long(),
                 attention_mask=torch.from_numpy(batch["input_mask"]).long(), labels=torch.from_numpy(labels)).loss
    loss.backward()
    if config.clip_norm:
        torch.nn.utils.clip_grad_norm_(model.parameters(), config.clip_norm)
    optimizer.step()
    return loss.item(), {name: p.detach().numpy() for name, p in model.state_dict().items()}


def test_one_step_from_a_released_modernbert_equals_transformers_step_with_the_recipes_optimizer(released):
    """`--config modernbert-base --init DIR`: the checkpoint's model (its activation, RoPE thetas, window, sizes)
    under the recipe, every tensor from the checkpoint (encoder, the head's dense and norm, the tied decoder, its
    bias), a fresh optimizer (the recipe's StableAdamW): one step on an explicit batch gives transformers' loss and,
    tensor by tensor through the interop table, the weights optimi's StableAdamW gives the same model in torch."""
    import jax

    from bertjax import sharding
    from bertjax.data.tokenizers import load_tokenizer
    from bertjax.interop import convert
    from bertjax.model import family
    from bertjax.pretraining import loop
    from bertjax.pretraining import state as train_state
    from bertjax.pretraining.job import build_job_step

    init = describe_pretrained(str(released))
    config = pretrain_config.load_config("modernbert-base", [*ONE_STEP, f"data.vocab={released}/tokenizer.json"],
                                         init=init)
    assert (config.model.modernbert.hidden_activation, config.model.modernbert.global_rope_theta,
            config.model.num_hidden_layers) == ("gelu", 1000.0, 4)  # the checkpoint's, not the preset's
    assert (config.optimizer.b2, config.optimizer.decay, config.data.masked_lm_prob) == (0.98, "constant", 0.3)
    tokenizer = load_tokenizer(config.data.vocab)
    mesh = config.mesh.build()
    job = build_job_step(config, mesh, len(tokenizer.vocab), tokenizer.special_token_ids)
    state = train_state.init_sharded_state(job.rng, job.shardings, mesh, **job.state_args)
    lines = []
    state = loop._init_from(state, str(released), job.shardings, job.abstract_state, True, False, tokenizer.vocab,
                            family.activation(job.bert_config), lines.append)
    assert lines == [f"initialised from {released} (fresh optimizer state and schedule)"]  # nothing left fresh
    before = convert.tensors_from_params(jax.device_get(state.params), job.bert_config, "hf")
    batch = _explicit_batch(tokenizer, config.data.max_seq_length, config.data.max_predictions_per_seq)
    with sharding.activate(mesh):
        state, metrics = job.train_step(state, sharding.global_batch(batch, mesh))
    ours = convert.tensors_from_params(jax.device_get(state.params), job.bert_config, "hf")

    assert config.optimizer.name == "stableadamw" and config.optimizer.decouple_lr  # the recipe's, as ModernBERT's
    loss, theirs = _torch_step(released, batch, config.optimizer)
    np.testing.assert_allclose(float(metrics["loss"]), loss, rtol=1e-5)
    assert set(ours) == set(theirs) - {"decoder.weight"} and len(ours) == 29
    for name, tensor in ours.items():
        moved = np.abs(tensor - before[name]).max()
        assert moved > 1e-4, f"{name} did not move ({moved}): the comparison would be trivial"
        np.testing.assert_allclose(tensor, theirs[name], rtol=0, atol=2e-6, err_msg=name)  # measured: <= 8.8e-7


def _continue_argv(released, workdir, corpus, *extra):
    """`pretrain --config modernbert-base --init RELEASED` at the CPU's size (the preset's recipe otherwise)."""
    return ["pretrain", "--config", "modernbert-base", "--init", str(released), "--workdir", str(workdir),
            "--set", f"data.input={corpus}", "--set", "data.max_seq_length=64", "--set",
            "data.max_predictions_per_seq=19", "--set", "data.doc_buffer_size=40", "--set", "data.shuffle_buffer=100",
            "--set", "train.batch_size=8", "--set", "train.grad_accum_steps=1", "--set", "train.steps=2",
            "--set", "optimizer.warmup_steps=1", "--set", "checkpoint.every=2", *extra]


def test_continued_at_learning_rate_0_exports_the_released_model_bit_for_bit(released, tmp_path, monkeypatch,
                                                                             capsys):
    """The documented path end to end: the checkpoint's tokenizer.json tokenises the data (data.vocab unset), its
    model replaces the preset's (named), two steps at a learning rate of 0 train nothing, and the export is the
    input again: every tensor the same bytes, the same architecture to transformers, the same tokenizer.json."""
    from safetensors.numpy import load_file

    train_path, _ = write_demo_corpus(str(tmp_path / "corpus"))
    workdir = tmp_path / "run"
    output = _run_here(_continue_argv(released, workdir, train_path, "--set", "optimizer.learning_rate=0"),
                       monkeypatch, capsys)
    assert f"data.vocab: the --init checkpoint's tokenizer.json (300 tokens), {released}/tokenizer.json\n" in output
    assert "model.modernbert.hidden_activation=gelu (was gelu_pytorch_tanh)" in output, output
    assert f"initialised from {released} (fresh optimizer state and schedule)\n" in output  # nothing left fresh
    assert "completed at step 2/2" in output
    _run_here(["export", str(workdir), "--out", str(tmp_path / "hf")], monkeypatch, capsys)

    given, exported = load_file(released / "model.safetensors"), load_file(tmp_path / "hf" / "model.safetensors")
    assert sorted(exported) == sorted(given) and len(given) == 29
    for name, tensor in given.items():
        assert exported[name].dtype == tensor.dtype and exported[name].tobytes() == tensor.tobytes(), name
    # transformers' config, but for where it was read from and the older spelling of the layer pattern (layer_types,
    # compared, holds it).
    unread = ("_name_or_path", "transformers_version", "global_attn_every_n_layers")
    architecture = lambda directory: {k: v for k, v in transformers.AutoConfig.from_pretrained(  # noqa: E731
        directory).to_dict().items() if k not in unread}
    assert architecture(tmp_path / "hf") == architecture(released)
    assert (tmp_path / "hf" / "tokenizer.json").read_bytes() == (released / "tokenizer.json").read_bytes()


def test_a_tokenizer_other_than_the_checkpoints_is_refused_naming_both(released, tmp_path, monkeypatch, capsys):
    """data.vocab set to another tokenizer.json (another BPE of the same texts) or to a WordPiece vocab.txt, with an
    --init that has its own tokenizer.json: refused in one line before anything trains; its own is accepted."""
    from tests import modernbert_fixture

    modernbert_fixture.bpe_tokenizer(vocab_size=290).save_pretrained(tmp_path / "other")
    (tmp_path / "vocab.txt").write_text("".join(t + "\n" for t in modernbert_fixture.SPECIAL_TOKENS + ["a", "b"]))
    train_path, _ = write_demo_corpus(str(tmp_path / "corpus"))
    for vocab, problem in ((tmp_path / "other" / "tokenizer.json", "is not the tokenizer.json of --init "
                                                                   f"{released} (they differ in: model)"),
                           (tmp_path / "vocab.txt", f"is not a tokenizer.json, but --init {released} has its own "
                                                    "tokenizer.json")):
        code, out, err = _in_process(_continue_argv(released, tmp_path / vocab.stem, train_path,
                                                    "--set", f"data.vocab={vocab}"), monkeypatch, capsys)
        assert code == 2, err[-2000:]
        assert err.strip().splitlines()[-1] == (
            f"bertjax pretrain: error: data.vocab={vocab} {problem}, which its embeddings were trained with: leave "
            "data.vocab unset to tokenise the data with it"), err[-2000:]
        assert "step" not in out


def test_a_bertjax_checkpoints_tokenizer_is_written_for_the_data(released, tmp_path, monkeypatch, capsys):
    """From a bertjax checkpoint (the tokenizer.json kept inside it), data.vocab becomes a tokenizer.json written
    into the workdir, with its special tokens beside it: the data pipeline's tokenizer is the checkpoint's."""
    from bertjax.data.json_tokenizer import spec_differences
    from bertjax.data.tokenizers import load_tokenizer
    from bertjax.pretraining.cli import _init_vocab_file

    _run_here(["convert", "--from", "hf", str(released), "--out", str(tmp_path / "ours")], monkeypatch, capsys)
    checkpoint = describe_pretrained(str(tmp_path / "ours"))
    path = _init_vocab_file(str(tmp_path / "ours"), checkpoint, str(tmp_path / "run"))
    assert path == str(tmp_path / "run" / "init_tokenizer" / "tokenizer.json")
    tokenizer = load_tokenizer(path)
    assert spec_differences(checkpoint.tokenizer, tokenizer.spec) == [] and tokenizer.vocab == checkpoint.vocab
    assert _init_vocab_file(str(released), describe_pretrained(str(released)), "unused") == \
        f"{released}/tokenizer.json"
