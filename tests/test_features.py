"""Feature-based use: the chosen hidden layers of the real all-MiniLM-L6-v2 equal transformers'
`output_hidden_states` (cls / mean / per-token), the word -> token map equals transformers' word_ids, and
`finetune features` runs end to end on real SST-2 rows with its metric recomputable from its predictions."""
from __future__ import annotations

import json
import re

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from bertjax.cli import main as cli  # noqa: E402
from bertjax.finetune.embed import (  # noqa: E402
    LayerSelection,
    embed_sentences,
    parse_layers,
    word_spans,
)
from tests.conftest import save_tiny_hf  # noqa: E402

SENTENCES = ["A man is playing a guitar.", "Someone plays an instrument on stage tonight, unbelievably well.",
             "Stocks fell.", "The café's naïve owner didn't re-open on Tuesday!"]
MAX_LEN = 32


@pytest.fixture(scope="module")
def minilm(minilm_dir):
    from bertjax.interop.load import load_pretrained

    return load_pretrained(str(minilm_dir))


@pytest.fixture(scope="module")
def reference(minilm_dir):
    """transformers' hidden states (7 = embeddings + 6 layers) and attention mask for SENTENCES."""
    tokenizer = transformers.BertTokenizerFast.from_pretrained(str(minilm_dir))
    model = transformers.BertModel.from_pretrained(str(minilm_dir)).eval()
    batch = tokenizer(SENTENCES, padding=True, return_tensors="pt")
    with torch.no_grad():
        states = model(**batch, output_hidden_states=True).hidden_states
    return [s.numpy() for s in states], batch["attention_mask"].numpy(), batch["input_ids"].numpy()


def _pool(x, mask, pooling):
    if pooling == "cls":
        return x[:, 0]
    weights = mask[..., None].astype(np.float32)
    return (x * weights).sum(1) / weights.sum(1)


def _check_layers(minilm, reference, layers, pooling):
    states, mask, _ = reference
    selection = parse_layers(layers, 6)
    chosen = [states[i] for i in selection.indices]
    expected = sum(chosen) if selection.combine == "sum" else np.concatenate(chosen, axis=-1)
    ours = embed_sentences(minilm, SENTENCES, pooling=pooling, layers=layers, max_len=MAX_LEN, batch_size=4)
    assert ours.shape == (len(SENTENCES), selection.width(384))
    np.testing.assert_allclose(ours, _pool(expected, mask, pooling), rtol=1e-4, atol=1e-4,
                               err_msg=f"{layers}/{pooling}")


def test_layer_names_follow_output_hidden_states_numbering():
    """0 = embeddings output, 6 = last layer of a 6-layer model; lists keep their order; negatives from the end."""
    assert parse_layers("last", 6) == LayerSelection((6,))
    assert parse_layers("second-to-last", 6) == LayerSelection((5,))
    assert parse_layers("sum-last-4", 6) == LayerSelection((3, 4, 5, 6), "sum")
    assert parse_layers("concat-last-4", 6) == LayerSelection((3, 4, 5, 6))
    assert parse_layers("0,-1,2", 6) == LayerSelection((0, 6, 2))


@pytest.mark.parametrize("layers, pooling", [("concat-last-4", "cls"), ("sum-last-4", "mean")])
def test_layers_equal_transformers_hidden_states(minilm, reference, layers, pooling):
    _check_layers(minilm, reference, layers, pooling)


@pytest.mark.slow
@pytest.mark.parametrize("layers", ["last", "second-to-last", "sum-last-4", "concat-last-4", "0,-1,2"])
@pytest.mark.parametrize("pooling", ["cls", "mean"])
def test_every_layer_choice_and_pooling_equals_transformers(minilm, reference, layers, pooling):
    _check_layers(minilm, reference, layers, pooling)


def test_pooling_none_cli_writes_tokens_and_word_map(minilm_dir, reference, tmp_path):
    """--pooling none: every real token's vector (transformers' hidden states at the same positions) and the map
    from whitespace words to token spans (transformers' word_ids with is_split_into_words)."""
    states, mask, ids = reference
    (tmp_path / "in.txt").write_text("\n".join(SENTENCES) + "\n")
    assert cli(["embed", "--checkpoint", str(minilm_dir), "--input", str(tmp_path / "in.txt"), "--output",
                str(tmp_path / "tokens.npz"), "--pooling", "none", "--layers", "concat-last-4",
                "--max-len", str(MAX_LEN)]) == 0
    out = np.load(tmp_path / "tokens.npz")
    expected = np.concatenate(states[3:], axis=-1)[mask.astype(bool)]
    assert out["vectors"].shape == expected.shape == (int(mask.sum()), 4 * 384)
    np.testing.assert_allclose(out["vectors"], expected, rtol=1e-4, atol=1e-4)
    np.testing.assert_array_equal(out["token_ids"], ids[mask.astype(bool)])
    np.testing.assert_array_equal(np.diff(out["sentence_offsets"]), mask.sum(1))
    assert list(out["layers"]) == [3, 4, 5, 6] and str(out["combine"]) == "concat"

    tokenizer = transformers.BertTokenizerFast.from_pretrained(str(minilm_dir))
    for i, sentence in enumerate(SENTENCES):
        words = sentence.split()
        word_ids = tokenizer(words, is_split_into_words=True).word_ids()
        spans = out["word_spans"][out["word_offsets"][i]:out["word_offsets"][i + 1]]
        assert len(spans) == len(words)
        for w, (start, end) in enumerate(spans):
            assert [p for p, wid in enumerate(word_ids) if wid == w] == list(range(start, end)), (sentence, w)


def test_word_map_marks_truncated_words(minilm):
    """A word cut by truncation keeps its surviving pieces; words past the cut are (-1, -1)."""
    from bertjax.data.tokenizers import WordPieceTokenizer

    tokenizer = WordPieceTokenizer(minilm.vocab, lower_case=True)
    # "unbelievably" is un ##bel ##ie ##va ##bly; keeping 4 pieces leaves: one two three un.
    offsets, spans = word_spans(tokenizer, ["one two three unbelievably four five", "ok"], np.array([4, 1]))
    assert offsets.tolist() == [0, 6, 7]
    assert spans.tolist() == [[1, 2], [2, 3], [3, 4], [4, 5], [-1, -1], [-1, -1], [1, 2]]


def test_layer_specs_are_checked():
    assert parse_layers("sum-last-4", 3).indices == (0, 1, 2, 3)
    with pytest.raises(ValueError, match="needs 4 hidden states"):
        parse_layers("concat-last-4", 2)
    with pytest.raises(ValueError, match="out of range.*0..6"):
        parse_layers("7", 6)
    with pytest.raises(ValueError, match="expected one of last"):
        parse_layers("top", 6)


def _glue_slice(shared_data, root, train_rows: int, dev_rows: int):
    """The first rows of the real SST-2 train/dev files in the GLUE layout (header kept), and a test.tsv."""
    for name, rows in (("train", train_rows), ("dev", dev_rows)):
        lines = (shared_data / "glue" / "SST-2" / f"{name}.tsv").read_text(encoding="utf-8").splitlines()
        target = root / "SST-2" / f"{name}.tsv"
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text("\n".join(lines[:rows + 1]) + "\n", encoding="utf-8")
        if name == "dev":  # GLUE's test layout (index, sentence; no label) over the first dev sentences
            test = [f"{i}\t{line.split(chr(9))[0]}" for i, line in enumerate(lines[1:31])]
            (root / "SST-2" / "test.tsv").write_text("index\tsentence\n" + "\n".join(test) + "\n", encoding="utf-8")
    return root


def test_finetune_features_on_real_sst2(shared_data, minilm_dir, tmp_path, capsys, monkeypatch):
    """`bertjax finetune features` end to end on 300 real SST-2 train rows / 120 dev rows with a tiny random
    encoder: a C from the grid, and dev metrics that recompute from the written predictions. Its two long parts,
    the extraction and the cross-validation, show their progress: said before, counted, timed after."""
    from sklearn.metrics import accuracy_score

    from bertjax.runtime.console import Progress
    from bertjax.finetune import features

    # A progress line per unit of work (every 15 s otherwise, which these few rows never take).
    monkeypatch.setattr(Progress, "EVERY_S", 0.0)

    data = _glue_slice(shared_data, tmp_path / "glue", 300, 120)
    init = save_tiny_hf(tmp_path / "init", minilm_dir / "vocab.txt", seed=0)
    work = tmp_path / "work"
    assert cli(["finetune", "features", "--task", "sst2", "--data", str(data), "--init", init, "--workdir",
                str(work), "--layers", "0,1", "--pooling", "mean", "--max-train-examples", "200",
                "--max-seq-length", "32", "--cv-folds", "3"]) == 0
    out = capsys.readouterr().out
    # 200 train + 120 dev + 30 test rows in batches of 64: 4 + 2 + 1 batches.
    assert "sst2: extracting features of 350 rows (7 batches of 64: 200 train, 120 dev, 30 test) ...\n" in out, out
    assert re.findall(r"extracting features of 350 rows: batch (\d)/7, eta \S+\n", out) == list("123456"), out
    assert re.search(r"sst2: features of 350 rows \(64 wide\) in \S+\n", out), out
    assert "cross-validating C on 200 rows (3 folds, 7 values of C each) ...\n" in out, out
    assert re.findall(r"cross-validating C on 200 rows: fold (\d)/3, eta \S+\n", out) == ["1", "2"], out
    # (The score line that follows is a log record: where it lands depends on which test set up logging first.)
    assert re.search(r"cross-validated C and refitted on all 200 rows in \S+\n", out), out
    result = json.loads((work / "metrics.json").read_text())
    assert result["num_train_examples"] == 200 and result["num_train_available"] == 300
    assert result["feature_width"] == 64 and result["C"] in features.C_GRID
    assert result["classifier"] == "LogisticRegressionCV" and len(result["cv_mean_scores"]) == len(features.C_GRID)
    rows = [line.split("\t") for line in (work / "dev_predictions.tsv").read_text().splitlines()[1:]]
    assert len(rows) == 120
    accuracy = accuracy_score([r[3] for r in rows], [r[2] for r in rows])
    assert result["metrics"]["dev"]["accuracy"] == pytest.approx(accuracy)
    assert result["score"] == pytest.approx(accuracy)
    # GLUE's submission file for the test rows (here the first 30 dev sentences in the test layout, so each must
    # get the prediction its dev twin got).
    submission = [line.split("\t") for line in (work / "SST-2.tsv").read_text().splitlines()]
    assert submission[0] == ["index", "prediction"] and len(submission) == 31
    assert [r[0] for r in submission[1:]] == [str(i) for i in range(30)]
    assert [r[1] for r in submission[1:]] == [r[2] for r in rows[:30]]


def test_regression_tasks_get_ridge_with_alpha_from_the_grid():
    """STS-B's path: RidgeCV on standardised features recovers a linear target; alpha comes from the grid."""
    from bertjax.finetune import features

    rng = np.random.default_rng(0)
    x = rng.normal(size=(300, 20))
    y = x @ rng.normal(size=20) + 0.1 * rng.normal(size=300)
    preds, info = features.fit_predict(x[:200], y[:200], x[200:], regression=True)
    assert info["regressor"] == "RidgeCV" and info["alpha"] in features.ALPHA_GRID
    assert np.corrcoef(preds, y[200:])[0, 1] > 0.99


def test_train_subset_is_seeded_and_keeps_file_order():
    from bertjax.finetune import features
    from bertjax.finetune.glue_data import Examples

    examples = Examples([str(i) for i in range(50)], [f"s{i}" for i in range(50)], None, np.arange(50))
    a, b = features.subsample(examples, 10, seed=3), features.subsample(examples, 10, seed=3)
    assert a.guids == b.guids and a.guids == sorted(a.guids, key=int) and len(set(a.guids)) == 10
    assert [int(g) for g in a.guids] == a.labels.tolist()
    assert features.subsample(examples, 10, seed=4).guids != a.guids
    assert features.subsample(examples, None, seed=3) is examples
