"""SWAG multiple choice. No SWAG data is available here, so every file below is written by the test in SWAG's exact
CSV layout (rowanz/swagaf data/{train,val,test}.csv): the reader, the (context, ending) encoding against
transformers' tokenizer, the model's shapes for 4 choices, a short training run on a separable example (the gold
ending holds a word the others lack), and the HF export as transformers.BertForMultipleChoice."""
from __future__ import annotations

import csv
import json
import random
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bertjax.finetune import swag_data
from tests.conftest import save_tiny_hf

HEADER = ["", "video-id", "fold-ind", "startphrase", "sent1", "sent2", "gold-source", "ending0", "ending1",
          "ending2", "ending3", "label"]
FILLER = "the a man woman dog ball walks runs looks at down up into room street slowly then".split()


def _write_csv(path: Path, rows: list[list[str]], header=HEADER) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(header)
        writer.writerows(rows)
    return path


def _row(i: int, sent1: str, sent2: str, endings: list[str], label: int | None) -> list[str]:
    fields = [str(i), f"anetv_video{i}", str(1000 + i), f"{sent1} {sent2}", sent1, sent2, "gold"] + endings
    return fields + ([str(label)] if label is not None else [])


def _separable(n: int, seed: int, labels: bool = True) -> list[list[str]]:
    """The gold ending (at a random position) holds the word "yes"; the others only filler."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        words = lambda k: " ".join(rng.choices(FILLER, k=k))  # noqa: E731
        endings = [words(rng.randint(2, 6)) for _ in range(4)]
        gold = rng.randrange(4)
        endings[gold] = f"{words(2)} yes {words(2)}"
        rows.append(_row(i, words(rng.randint(4, 8)).capitalize() + ".", "He", endings, gold if labels else None))
    return rows


def test_reader_takes_swag_rows(tmp_path):
    rows = [_row(0, "Students lower their eyes nervously.", "She",
                 ["pats her shoulder, then saunters toward someone.", "turns with two students.",
                  "walks slowly towards someone.", "wheels around as her dog thunders out."], 2),
            _row(1, "He rides the motorcycle down the hall.", "He", ["a", "b, \"quoted\" c", "d", "e"], 0)]
    examples = swag_data.read_swag(str(_write_csv(tmp_path / "val.csv", rows)))
    assert examples.ids == ["0", "1"] and examples.labels.tolist() == [2, 0]
    assert examples.contexts[0] == "Students lower their eyes nervously."
    assert examples.endings[0][0] == "She pats her shoulder, then saunters toward someone."
    assert examples.endings[1][1] == 'He b, "quoted" c'
    test = swag_data.read_swag(str(_write_csv(tmp_path / "test.csv", [r[:-1] for r in rows], HEADER[:-1])))
    assert test.labels is None and len(test) == 2


def test_reader_names_file_and_line_of_bad_rows(tmp_path):
    good = _separable(3, seed=0)
    path = _write_csv(tmp_path / "train.csv", good[:2] + [good[2][:-2]])
    with pytest.raises(ValueError, match=rf"{tmp_path / 'train.csv'}:4: expected 12 comma-separated fields.*got 10"):
        swag_data.read_swag(str(path))
    path = _write_csv(tmp_path / "bad_label.csv", good[:1] + [good[1][:-1] + ["4"]])
    with pytest.raises(ValueError, match=r"bad_label.csv:3: label '4' is not one of 0..3"):
        swag_data.read_swag(str(path))
    path = _write_csv(tmp_path / "no_sent2.csv", [r[:5] + r[6:] for r in good], [h for h in HEADER if h != "sent2"])
    with pytest.raises(ValueError, match=r"no_sent2.csv:1: header lacks the SWAG column\(s\) \['sent2'\]"):
        swag_data.read_swag(str(path))


def test_pairs_encoded_as_transformers_run_swag(minilm_dir, tmp_path):
    """Each choice is tokenizer(sent1, sent2 + " " + ending_k) with longest-first truncation, as run_swag does."""
    transformers = pytest.importorskip("transformers")
    from bertjax.data.tokenizers import WordPieceTokenizer

    rows = _separable(3, seed=1)
    rows[0][4] = "A very long context " + "that goes on and on " * 8
    examples = swag_data.read_swag(str(_write_csv(tmp_path / "val.csv", rows)))
    ours = swag_data.featurize(examples, WordPieceTokenizer(str(minilm_dir / "vocab.txt")), 24)
    assert ours["input_ids"].shape == (3, 4, 24) and ours["labels"].tolist() == [int(r[-1]) for r in rows]
    tokenizer = transformers.BertTokenizerFast.from_pretrained(str(minilm_dir))
    first = [r[4] for r in rows for _ in range(4)]
    second = [f"{r[5]} {r[7 + k]}" for r in rows for k in range(4)]
    ref = tokenizer(first, second, truncation=True, max_length=24, padding="max_length", return_tensors="np")
    np.testing.assert_array_equal(ours["input_ids"].reshape(12, 24), ref["input_ids"])
    np.testing.assert_array_equal(ours["segment_ids"].reshape(12, 24), ref["token_type_ids"])
    np.testing.assert_array_equal(ours["input_mask"].reshape(12, 24), ref["attention_mask"])


def test_each_choice_scored_on_its_own_cls():
    """Logits [batch, 4]: choice k's score is the score of its row alone; one loss per example."""
    import flax.linen as nn

    from bertjax.finetune.trainer import classification_loss
    from bertjax.model.bert import BertForMultipleChoice, init_params
    from bertjax.model.config import BertConfig

    config = BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=32, max_position_embeddings=16)
    model = BertForMultipleChoice(config)
    params = nn.meta.unbox(jax.jit(lambda key: init_params(model, config, key))(jax.random.PRNGKey(0)))
    apply = jax.jit(lambda ids, mask: model.apply({"params": params}, ids, mask, jnp.zeros_like(ids)))
    ids = np.random.default_rng(1).integers(5, 50, size=(2, 4, 8)).astype(np.int32)
    mask = np.ones_like(ids)
    mask[:, :, 6:] = 0
    logits = np.asarray(apply(ids, mask))
    assert logits.shape == (2, 4)
    alone = apply(ids[1, 2][None], mask[1, 2][None])
    np.testing.assert_allclose(logits[1, 2], alone[0], rtol=1e-6, atol=1e-6)
    labels = np.array([3, 0])
    loss = np.asarray(jax.jit(classification_loss)(logits, {"labels": labels}))
    assert loss.shape == (2,)
    shifted = logits - logits.max(axis=1, keepdims=True)
    expected = -(shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True)))[np.arange(2), labels]
    np.testing.assert_allclose(loss, expected, rtol=1e-6, atol=1e-6)


def test_multiple_choice_job_learns_separable_example_and_exports(minilm_dir, tmp_path, capsys):
    """A short run picks the gold ending of unseen examples; the HF export gives BertForMultipleChoice the same
    scores. Its closing line says `bertjax predict` does not run the model it kept, and predict refuses it so."""
    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    from bertjax.cli import main as cli

    data = tmp_path / "swag"
    _write_csv(data / "train.csv", _separable(96, seed=2))
    val_rows = _separable(32, seed=3)
    _write_csv(data / "val.csv", val_rows)
    _write_csv(data / "test.csv", [r[:-1] for r in _separable(5, seed=4)], HEADER[:-1])
    init = save_tiny_hf(tmp_path / "init", minilm_dir / "vocab.txt", seed=0)
    work = tmp_path / "work"
    assert cli(["finetune", "multiple-choice", "--data", str(data), "--init", init, "--workdir", str(work),
                "--max-seq-length", "32", "--learning-rate", "1e-2", "--batch-size", "16", "--epochs", "8",
                "--eval-batch-size", "16", "--seed", "1", "--export-hf", "--save-checkpoint", "--eval-every",
                "24"]) == 0
    closing = capsys.readouterr().out.strip().splitlines()[-2]
    assert closing.endswith(f"fine-tuned model: {work / 'checkpoint'} and {work / 'hf'} (another job's --init reads "
                            "it; `bertjax predict` runs no multiple-choice head: this job scores the test.csv beside "
                            "its train.csv; --no-save-checkpoint keeps none)"), closing
    for kept in (work, work / "checkpoint"):
        assert cli(["predict", "--model", str(kept), "--input", str(data / "test.csv")]) == 2
        assert capsys.readouterr().err.strip().splitlines()[-1] == (
            f"bertjax predict: error: {kept}: a multiple-choice model (finetune multiple-choice): `bertjax predict` "
            "runs classifiers, token classifiers and span models; the multiple-choice job scores the test.csv "
            "beside its train.csv")
    result = json.loads((work / "metrics.json").read_text())
    assert result["metrics"]["accuracy"] >= 0.9, result
    records = [json.loads(line) for line in (work / "metrics.jsonl").read_text().splitlines()]
    evals = {r["step"]: r["eval_accuracy"] for r in records if "eval_accuracy" in r}  # 8 epochs of 6 steps
    assert sorted(evals) == [24, 48] and evals[48] == pytest.approx(result["metrics"]["accuracy"])
    assert result["history"][-1]["train_loss"] < result["history"][0]["train_loss"] < 1.5  # ln 4 = 1.386 at chance
    with open(work / "val_predictions.csv", newline="") as f:
        predictions = list(csv.DictReader(f))
    assert [p["label"] for p in predictions] == [r[-1] for r in val_rows]
    accuracy = np.mean([p["prediction"] == p["label"] for p in predictions])
    assert result["metrics"]["accuracy"] == pytest.approx(accuracy)
    with open(work / "test_predictions.csv", newline="") as f:
        assert len(list(csv.DictReader(f))) == 5

    reference = transformers.BertForMultipleChoice.from_pretrained(str(work / "hf")).eval()
    tokenizer = transformers.BertTokenizerFast.from_pretrained(str(work / "hf"))
    first = [r[4] for r in val_rows for _ in range(4)]
    second = [f"{r[5]} {r[7 + k]}" for r in val_rows for k in range(4)]
    batch = tokenizer(first, second, truncation=True, max_length=32, padding=True, return_tensors="pt")
    with torch.no_grad():
        logits = reference(**{k: v.view(len(val_rows), 4, -1) for k, v in batch.items()}).logits.numpy()
    ours = np.array([[float(p[f"score{k}"]) for k in range(4)] for p in predictions])
    np.testing.assert_allclose(logits, ours, rtol=1e-4, atol=1e-4)
    # The saved checkpoint remembers its head: a later `bertjax export` writes BertForMultipleChoice (the tensors
    # alone read as a one-label sequence classifier), and so does a round trip through `convert`.
    assert cli(["export", str(work / "checkpoint"), "--out", str(tmp_path / "later")]) == 0
    assert cli(["convert", str(tmp_path / "later"), "--from", "hf", "--out", str(tmp_path / "converted")]) == 0
    assert cli(["export", str(tmp_path / "converted"), "--out", str(tmp_path / "again")]) == 0
    for exported in ("later", "again"):
        config = json.loads((tmp_path / exported / "config.json").read_text())
        assert config["architectures"] == ["BertForMultipleChoice"] and "id2label" not in config
    later = transformers.BertForMultipleChoice.from_pretrained(str(tmp_path / "again")).eval()
    with torch.no_grad():
        again = later(**{k: v.view(len(val_rows), 4, -1) for k, v in batch.items()}).logits.numpy()
    np.testing.assert_allclose(again, logits, rtol=1e-6, atol=1e-6)
