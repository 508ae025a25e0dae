"""`finetune embedding` against sentence-transformers: on the real all-MiniLM-L6-v2 weights (a sentence-transformers
model) and one batch, the ranking loss and every parameter gradient equal its MultipleNegativesRankingLoss (with hard
negatives), the symmetric form and CachedMultipleNegativesRankingLoss (dropout off on both sides); the 8-device loss
over the global batch equals one device's; cached equals uncached; the job's export loads in `SentenceTransformer`
and embeds as `bertjax embed` does, for BERT and ModernBERT; bad input is one line naming file, line and column."""
from __future__ import annotations

import json
import re
import os

import jax
import numpy as np
import pytest

from bertjax import sharding
from bertjax.cli import main as bertjax_main
from bertjax.finetune import contrastive, embedding, retrieval
from bertjax.interop import convert
from bertjax.interop.load import load_init
from bertjax.model import layer_layout
from bertjax.model.sentence_embedder import SentenceEmbedder
from tests import modernbert_fixture
from tests.conftest import save_tiny_hf

torch = pytest.importorskip("torch")
sentence_transformers = pytest.importorskip("sentence_transformers")
from sentence_transformers import SentenceTransformer  # noqa: E402
from sentence_transformers.sentence_transformer import losses  # noqa: E402

ANCHORS = ["how do I bake bread at home", "what is the capital of France", "symptoms of the common cold",
           "best way to learn the guitar", "how far away is the moon", "who wrote the novel war and peace",
           "how to keep tomato plants healthy", "why is the sky blue"]
POSITIVES = ["mix flour, water, yeast and salt, let the dough rise, then bake it in a hot oven",
             "Paris is the capital and largest city of France", "a runny nose, a sore throat and sneezing",
             "practise chords every day and learn songs you like", "the moon is about 384,000 km from the earth",
             "Leo Tolstoy wrote War and Peace", "water them at the roots and give them plenty of sun",
             "air scatters blue light from the sun more than red light"]
NEGATIVES = ["the bakery on the corner closes at six", "France won the football world cup in 2018",
             "the cold war ended in 1991", "the guitar is a stringed instrument", "the moon landing was in 1969",
             "peace talks resumed on monday", "tomato soup is easy to make", "the blue whale is the largest animal"]
LENGTH = 32  # tokens a text: every text above fits, so both sides see the same tokens
# A loss is a difference of terms near the scale (20): float32 rounds them at ~2e-6 each.
LOSS_ABS = 1e-5


@pytest.fixture(scope="module")
def minilm(minilm_dir):
    """bertjax's MiniLM (scanned: one layer to compile), its tokenizer, and the batch as [8, 3, L] features."""
    ckpt, tokenizer = load_init(str(minilm_dir))
    config = ckpt.config.replace(scan_layers=True)
    params = layer_layout.with_layout({"bert": {k: v for k, v in ckpt.params["bert"].items() if k != "pooler"}},
                                      config, stacked=True)
    batch = embedding.featurize([ANCHORS, POSITIVES, NEGATIVES], tokenizer, LENGTH)
    assert batch["input_mask"].sum(-1).max() < LENGTH  # nothing cut
    batch["weights"] = np.ones(len(ANCHORS), np.float32)
    return config, params, batch


@pytest.fixture(scope="module")
def reference(minilm_dir):
    model = SentenceTransformer(str(minilm_dir), device="cpu")
    model.eval()  # dropout off, as deterministic=True on ours
    return model


def _ours(config, params, batch, loss, chunks=1, mesh=None):
    module = SentenceEmbedder(config, "mean", True)

    def run(params, batch):
        return contrastive.loss_and_grads(module, params, batch, jax.random.PRNGKey(0), loss, chunks=chunks,
                                          deterministic=True)

    if mesh is None:
        value, grads = jax.jit(run)(params, batch)
        program = None
    else:
        with sharding.activate(mesh):
            batch = jax.device_put(batch, sharding.batch_sharding(mesh))
            compiled = jax.jit(run).lower(params, batch).compile()
            value, grads = compiled(params, batch)
            program = compiled.as_text()
    hf = convert.tensors_from_params(jax.device_get(grads), config, "hf")
    return float(value), hf, program


def _theirs(model, loss_fn, columns):
    model.zero_grad()
    model.max_seq_length = LENGTH
    value = loss_fn([model.preprocess(texts) for texts in columns], None)
    value.backward()
    grads = {name: p.grad.numpy().copy() for name, p in model[0].auto_model.named_parameters() if p.grad is not None}
    return float(value.detach()), grads


def _assert_same_grads(ours: dict, theirs: dict) -> None:
    """Every tensor's gradient within 1e-4 of its largest entry (measured: at most 3.2e-6); the attention keys' biases,
    whose gradient is 0 in exact arithmetic (a softmax ignores a shift), within float32 noise of the largest
    gradient of all (their entries, ~1e-8, are that noise on both sides)."""
    assert set(ours) == set(theirs)  # every encoder tensor but the pooler, which the embeddings do not use
    largest = max(np.abs(grad).max() for grad in theirs.values())
    for name, expected in theirs.items():
        np.testing.assert_allclose(ours[name], expected, rtol=1e-4,
                                   atol=1e-4 * np.abs(expected).max() + 1e-6 * largest, err_msg=name)


@pytest.fixture(scope="module")
def plain(minilm):
    return _ours(*minilm, contrastive.RankingLoss())


def test_loss_and_gradients_equal_sentence_transformers_mnrl(minilm, reference, plain):
    value, grads = _theirs(reference, losses.MultipleNegativesRankingLoss(reference, scale=20.0),
                           [ANCHORS, POSITIVES, NEGATIVES])
    assert plain[0] == pytest.approx(value, rel=1e-5, abs=LOSS_ABS)
    _assert_same_grads(plain[1], grads)


def test_symmetric_loss_equals_sentence_transformers_symmetric(minilm, reference):
    """MultipleNegativesSymmetricRankingLoss, as sentence-transformers 6 spells it: the two directions' partitions
    averaged (the positives against every anchor; the hard negatives only on the anchors' side)."""
    loss = losses.MultipleNegativesRankingLoss(reference, scale=20.0, directions=("query_to_doc", "doc_to_query"),
                                               partition_mode="per_direction")
    value, grads = _theirs(reference, loss, [ANCHORS, POSITIVES, NEGATIVES])
    ours = _ours(*minilm, contrastive.RankingLoss(symmetric=True))
    assert ours[0] == pytest.approx(value, rel=1e-5, abs=LOSS_ABS)
    _assert_same_grads(ours[1], grads)


def test_cached_equals_sentence_transformers_cached_and_uncached(minilm, reference, plain):
    """Chunks of 2 rows: GradCache's two passes give the one-pass loss and gradients, as its reference does."""
    value, grads = _theirs(reference, losses.CachedMultipleNegativesRankingLoss(reference, scale=20.0,
                                                                                mini_batch_size=2),
                           [ANCHORS, POSITIVES, NEGATIVES])
    cached = _ours(*minilm, contrastive.RankingLoss(), chunks=4)
    assert cached[0] == pytest.approx(value, rel=1e-5, abs=LOSS_ABS)
    _assert_same_grads(cached[1], grads)
    assert cached[0] == pytest.approx(plain[0], rel=1e-6, abs=LOSS_ABS)
    _assert_same_grads(cached[1], plain[1])


def test_eight_devices_score_the_global_batch_as_one_device(minilm, plain):
    """The batch sharded one row a device: each anchor is scored against all 8 rows' candidates, gathered, and the
    loss and gradients (through the gather) are the unsharded ones."""
    assert len(jax.devices()) == 8
    mesh = sharding.make_mesh(data=8)
    value, grads, program = _ours(*minilm, contrastive.RankingLoss(), mesh=mesh)
    # The candidates' embeddings, [k - 1 = 2, 8 rows, 384], are what the devices gather (the encoder runs on each
    # device's own row).
    assert re.search(r"= f32\[2,8,384\]\S* all-gather\(", program), "no all-gather of the candidates"
    assert value == pytest.approx(plain[0], rel=1e-5, abs=LOSS_ABS)
    _assert_same_grads(grads, plain[1])


def test_padding_rows_change_nothing_and_give_finite_gradients():
    """A row of weight 0 (the Trainer's padding) is neither anchor nor candidate, in both directions."""
    rng = np.random.default_rng(0)
    embeddings = rng.normal(size=(6, 3, 5)).astype(np.float32)
    weights = np.array([1, 1, 1, 1, 0, 0], np.float32)
    loss = jax.jit(contrastive.ranking_loss, static_argnums=3)  # one program each, not one per op
    grad_of = jax.jit(jax.grad(contrastive.ranking_loss), static_argnums=3)
    for symmetric in (False, True):
        full = loss(embeddings, weights, 20.0, symmetric)
        real = loss(embeddings[:4], weights[:4], 20.0, symmetric)
        assert float(full) == pytest.approx(float(real), rel=1e-6)
        grad = np.asarray(grad_of(embeddings, weights, 20.0, symmetric))
        assert np.isfinite(grad).all() and not grad[4:].any() and grad[:4].any()


def _write_jsonl(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def _embed(checkpoint, texts, tmp_path, pooling="mean"):
    sentences = tmp_path / "sentences.txt"
    sentences.write_text("\n".join(texts) + "\n")
    out = tmp_path / f"embedded-{pooling}.npy"
    assert bertjax_main(["embed", "--checkpoint", checkpoint, "--input", str(sentences), "--output", str(out),
                         "--pooling", pooling, "--max-len", str(LENGTH)]) == 0
    return np.load(out)


def _unit(x):
    return x / np.linalg.norm(x, axis=-1, keepdims=True)


def test_job_exports_a_sentence_transformers_model_that_embeds_as_bertjax_embed(minilm_dir, tmp_path,
                                                                                monkeypatch):
    """A tiny BERT trained by the command line on pairs with hard negatives; its export, loaded offline by
    SentenceTransformer, embeds as `bertjax embed` on the job's checkpoint does (unit length: Normalize)."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    init = save_tiny_hf(tmp_path / "init", minilm_dir / "vocab.txt", seed=0)
    rows = [{"anchor": a, "positive": p, "negative": n} for a, p, n in zip(ANCHORS, POSITIVES, NEGATIVES)]
    train = _write_jsonl(tmp_path / "train.jsonl", rows * 2)
    dev = _write_jsonl(tmp_path / "dev.jsonl", rows[:4])
    work = tmp_path / "work"
    assert bertjax_main(["finetune", "embedding", "--train", train, "--dev", dev, "--init", init, "--workdir",
                         str(work), "--max-seq-length", str(LENGTH), "--batch-size", "16", "--epochs", "2",
                         "--learning-rate", "1e-3", "--cache-chunk", "8", "--learned-scale", "--export-hf"]) == 0
    result = json.loads((work / "metrics.json").read_text())
    assert result["hard_negatives"] and result["total_steps"] == 2 and result["num_dev_pairs"] == 4
    assert np.isfinite(result["history"][-1]["train_loss"]) and result["learned_scale"] != 20.0
    hf = work / "hf"
    modules = json.loads((hf / "modules.json").read_text())
    assert [m["type"].rsplit(".", 1)[1] for m in modules] == ["Transformer", "Pooling", "Normalize"]
    assert json.loads((hf / "1_Pooling" / "config.json").read_text())["pooling_mode_mean_tokens"]
    card = (hf / "README.md").read_text()  # the Hub files it as a sentence-transformers model
    assert "\nlibrary_name: sentence-transformers\n" in card and "SentenceTransformer(\"REPO\")" in card
    from transformers import BertModel

    _, loading = BertModel.from_pretrained(str(hf), output_loading_info=True)
    assert not loading["missing_keys"] and not loading["unexpected_keys"]  # the init's pooler kept for it
    model = SentenceTransformer(str(hf), device="cpu", local_files_only=True)
    assert model.max_seq_length == LENGTH  # the length trained at (sentence_bert_config.json)
    theirs = model.encode(ANCHORS, convert_to_numpy=True)
    ours = _embed(str(work / "checkpoint"), ANCHORS, tmp_path)
    np.testing.assert_allclose(theirs, _unit(ours), atol=2e-5)
    # The dev pairs scored as retrieval: the job's scores are those of the export's embeddings.
    expected = retrieval.retrieval_scores(model.encode(ANCHORS[:4]), model.encode(POSITIVES[:4]), [0, 1, 2, 3])
    assert set(result["metrics"]["dev"]) == {"recall@1", "recall@5", "recall@10", "mrr@10", "ndcg@10"}
    assert result["metrics"]["dev"] == pytest.approx(expected, abs=1e-6)
    np.testing.assert_allclose(np.linalg.norm(theirs, axis=-1), 1.0, atol=1e-5)


def test_modernbert_job_runs_and_exports(tmp_path, monkeypatch):
    """From a ModernBERT HF directory, CLS pooling, not normalised, symmetric: the export embeds as `bertjax embed
    --pooling cls` on the job's checkpoint does."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    init = str(modernbert_fixture.write_masked_lm(tmp_path / "modernbert"))
    train = _write_jsonl(tmp_path / "train.jsonl",
                         [{"query": a, "passage": p} for a, p in zip(ANCHORS, POSITIVES)])
    work = tmp_path / "work"
    assert bertjax_main(["finetune", "embedding", "--train", train, "--anchor-column", "query",
                         "--positive-column", "passage", "--init", init, "--workdir", str(work), "--max-seq-length",
                         "64", "--batch-size", "8", "--epochs", "1", "--pooling", "cls", "--no-normalize",
                         "--symmetric", "--export-hf"]) == 0
    result = json.loads((work / "metrics.json").read_text())
    assert not result["hard_negatives"] and np.isfinite(result["history"][-1]["train_loss"])
    hf = work / "hf"
    assert not (hf / "2_Normalize").exists()
    assert json.loads((hf / "config.json").read_text())["architectures"] == ["ModernBertModel"]
    model = SentenceTransformer(str(hf), device="cpu", local_files_only=True)
    assert model.max_seq_length == 64
    theirs = model.encode(ANCHORS, convert_to_numpy=True)
    ours = _embed(str(work / "checkpoint"), ANCHORS, tmp_path, pooling="cls")
    np.testing.assert_allclose(theirs, ours, atol=5e-5, rtol=1e-4)


@pytest.mark.parametrize("flags, said", [
    (["--grad-accum-steps", "2"], r"--grad-accum-steps: the ranking loss scores each anchor against the whole batch"),
    (["--metric-for-best", "loss"], r"--metric-for-best loss: `finetune embedding` scores its --dev pairs once"),
    (["--eval-every", "10"], r"--eval-every: `finetune embedding` has no use for it"),
    (["--no-predict-test"], r"--predict-test: `finetune embedding` has no use for it"),
    (["--pooling", "max"], r"pooling='max' must be one of mean, cls"),
    (["--scale", "0"], r"argument --scale: must be in \(0, 100\], got 0"),
])
def test_options_the_job_cannot_take_are_refused_before_the_checkpoint_loads(tmp_path, capsys, flags, said):
    path = tmp_path / "train.csv"
    path.write_text("anchor,positive\na,b\n")
    try:
        code = bertjax_main(["finetune", "embedding", "--train", str(path), "--init", "none", "--workdir",
                             str(tmp_path / "w"), *flags])
    except SystemExit as stop:  # argparse's own: a flag out of its range
        code = stop.code
    assert code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert re.search(said, last), last


@pytest.mark.parametrize("content, said", [
    ("anchor,positive\n", r"train.csv: no rows"),
    ("", r"train.csv: empty file"),
    ("anchor,other\na,b\n", r"train.csv: no column 'positive'; it has 'anchor', 'other'"),
    ("anchor,positive\na,b\nc,\n", r"train.csv:3: column 'positive' is empty; expected the text"),
    ("anchor,positive,negative\na,b,c\nd,e, \n", r"train.csv:3: column 'negative' is empty; expected the text"),
])
def test_bad_input_is_one_line_naming_file_line_and_column(tmp_path, capsys, content, said):
    path = tmp_path / "train.csv"
    path.write_text(content)
    # Refused before the checkpoint loads (there is none).
    assert bertjax_main(["finetune", "embedding", "--train", str(path), "--init", "none", "--workdir",
                         str(tmp_path / "w")]) == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert re.search(said, last), last
    assert not os.path.exists(tmp_path / "w")
