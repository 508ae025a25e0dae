"""`bertjax predict` on a token-classification run (the NER job on a synthetic CoNLL set) gives transformers'
pipeline("token-classification", aggregation_strategy="first") on the exported model: the same entities, offsets
and scores. (The classification side is checked in test_classify_job.py.)"""
from __future__ import annotations

import io
import json
import random
import subprocess
import sys

import pytest

from bertjax.cli import main as bertjax_main
from bertjax.finetune.settings import NerSettings, TrainSettings
from tests.conftest import save_tiny_hf

FILLER = "the a went to with and saw met in from".split()
PEOPLE, PLACES = ["alice", "bob", "carol"], ["paris", "london", "rome"]


def _sentence(rng: random.Random) -> list[tuple[str, str]]:
    words = [(w, "O") for w in rng.choices(FILLER, k=rng.randint(3, 8))]
    for names, tag in ((PEOPLE, "PER"), (PLACES, "LOC")):
        at = rng.randint(0, len(words))
        # A two-word person ("alice bob") is one entity: B- then I-.
        entity = [(rng.choice(names), f"B-{tag}")] + ([(rng.choice(names), f"I-{tag}")] if rng.random() < 0.3 else [])
        words[at:at] = entity
    return words


def _write_conll(path, sentences) -> None:
    path.write_text("".join("".join(f"{w} NN O {t}\n" for w, t in s) + "\n" for s in sentences))


@pytest.fixture(scope="module")
def ner_run(tmp_path_factory, minilm_dir):
    from bertjax.finetune import ner

    root = tmp_path_factory.mktemp("ner")
    init = save_tiny_hf(root / "init", minilm_dir / "vocab.txt", seed=0)
    rng = random.Random(0)
    _write_conll(root / "train.txt", [_sentence(rng) for _ in range(160)])
    _write_conll(root / "valid.txt", [_sentence(rng) for _ in range(16)])
    settings = TrainSettings(learning_rate=5e-3, batch_size=16, epochs=8, seed=1, eval_batch_size=16)
    result = ner.run(str(root), str(root / "work"), settings, NerSettings(max_seq_length=32, doc_stride=16),
                     init=init, export_hf=True)
    texts = [" ".join(w for w, _ in _sentence(rng)).replace("alice", "Alice") + "." for _ in range(12)]
    return root / "work", result, texts


def test_predict_token_classification_equals_pipeline(ner_run, tmp_path):
    work, result, texts = ner_run
    assert result["metrics"]["valid"]["overall"]["f1"] >= 0.5  # it learned: entities are there to compare
    source = tmp_path / "in.jsonl"
    source.write_text("".join(json.dumps({"sentence": t}) + "\n" for t in texts))
    assert bertjax_main(["predict", "--model", str(work), "--input", str(source), "--text-column", "sentence",
                         "--output", str(tmp_path / "out.jsonl"), "--max-seq-length", "64", "--batch-size", "8"]) == 0
    ours = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert [row["where"] for row in ours] == [f"{source}:{i + 1}" for i in range(len(texts))]

    transformers = pytest.importorskip("transformers")
    pipe = transformers.pipeline("token-classification", model=str(work / "hf"), aggregation_strategy="first",
                                 device="cpu")
    found = 0
    for text, row in zip(texts, ours):
        theirs = pipe(text)
        assert [(e["entity_group"], e["start"], e["end"]) for e in row["entities"]] == \
            [(e["entity_group"], e["start"], e["end"]) for e in theirs], text
        for mine, reference in zip(row["entities"], theirs):
            assert mine["score"] == pytest.approx(float(reference["score"]), abs=1e-4)
            assert mine["word"] == text[reference["start"]:reference["end"]]
        found += len(theirs)
    assert found >= len(texts)  # every sentence holds a person and a place

    # One text a line on stdin, JSON Lines on stdout (a process: nothing else on its stdout): the same entities.
    run = subprocess.run([sys.executable, "-m", "bertjax.cli", "predict", "--model", str(work / "hf"),
                          "--max-seq-length", "64", "--batch-size", "8"], input="\n".join(texts) + "\n",
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    piped = [json.loads(line) for line in run.stdout.splitlines()]  # nothing else on stdout
    assert [row["where"] for row in piped] == [f"stdin:{i + 1}" for i in range(len(texts))]
    assert [row["entities"] for row in piped] == [row["entities"] for row in ours]


def test_predict_refuses_a_model_without_a_head(minilm_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(b"a sentence\n")))
    assert bertjax_main(["predict", "--model", str(minilm_dir)]) == 2
    assert "no fine-tuned classifier or token classifier head" in capsys.readouterr().err.strip().splitlines()[-1]
