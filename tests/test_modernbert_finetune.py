"""Every fine-tune job from a ModernBERT checkpoint (a tiny one written by transformers, with its BPE tokenizer.json):
each learns a synthetic task only its inputs can tell, and its export is the transformers ModernBertFor* class whose
outputs are the job's own: the text-classification pipeline gives `bertjax predict`'s labels and scores, the other
heads give the job's logits and predictions. The training steps follow a PyTorch loop step for step."""
from __future__ import annotations

import csv
import json
import random

import numpy as np
import pytest
import torch
import transformers

from bertjax.cli import main as cli
from tests import modernbert_fixture

FILLER = "the a movie film plot actor scene story music was is very quite rather and but with of".split()
COMMON = ["--learning-rate", "5e-3", "--batch-size", "16", "--eval-batch-size", "16", "--seed", "1"]


@pytest.fixture(scope="module")
def init(tmp_path_factory) -> str:
    return str(modernbert_fixture.write_masked_lm(tmp_path_factory.mktemp("modernbert") / "hf"))


def _sentence(rng: random.Random, *keywords: str) -> str:
    words = rng.choices(FILLER, k=rng.randint(6, 14))  # longer than the window of 4 each side, with [CLS] first
    for keyword in keywords:
        words.insert(rng.randint(0, len(words)), keyword)
    return " ".join(words)


def _write_csv(path, header, rows):
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="", encoding="utf-8") as f:
        csv.writer(f).writerows([header] + rows)
    return path


def test_classify_own_data_then_predict_equals_the_text_classification_pipeline(init, tmp_path):
    rng = random.Random(0)
    words = {"bad": "awful", "good": "great"}
    rows = lambda n: [[_sentence(rng, words[label]), label] for label in ["bad", "good"] * (n // 2)]  # noqa: E731
    train = _write_csv(tmp_path / "train.csv", ["review", "verdict"], rows(96))
    dev = _write_csv(tmp_path / "dev.csv", ["review", "verdict"], rows(32))
    work = tmp_path / "run"
    assert cli(["finetune", "classify", "--train", str(train), "--dev", str(dev), "--text-column", "review",
                "--label-column", "verdict", "--init", init, "--workdir", str(work), "--epochs", "6",
                "--max-seq-length", "64", "--export-hf", *COMMON]) == 0
    assert json.loads((work / "metrics.json").read_text())["metrics"]["dev"]["accuracy"] >= 0.9
    config = json.loads((work / "hf/config.json").read_text())
    assert config["architectures"] == ["ModernBertForSequenceClassification"]
    assert config["id2label"] == {"0": "bad", "1": "good"}
    assert "ModernBertForSequenceClassification" in (work / "hf/README.md").read_text()

    new = [_sentence(rng, rng.choice(list(words.values()))) for _ in range(6)] + ["great", "an awful, awful film"]
    new.append(" ".join(rng.choices(FILLER, k=60)) + " great " + " ".join(rng.choices(FILLER, k=60)))  # > 64 tokens
    source = _write_csv(tmp_path / "new.csv", ["review"], [[t] for t in new])
    # `predict` reads at the run's --max-seq-length (64), truncating the long review where the training did; at its
    # former default of 128 this review's scores differ from the pipeline's at the run's length.
    assert cli(["predict", "--model", str(work), "--input", str(source), "--text-column", "review",
                "--output", str(tmp_path / "out.jsonl")]) == 0
    ours = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    pipe = transformers.pipeline("text-classification", model=str(work / "hf"), top_k=None, device="cpu")
    for text, row in zip(new, ours):
        theirs = {r["label"]: r["score"] for r in pipe([text], truncation=True, max_length=64)[0]}
        assert row["label"] == max(theirs, key=theirs.get), text
        assert row["scores"] == pytest.approx(theirs, abs=1e-5)


def _write_tsv(path, rows):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join("\t".join(r) + "\n" for r in rows), encoding="utf-8")


def test_glue_sst2_learns_and_its_export_gives_the_dev_predictions(init, tmp_path):
    rng = random.Random(1)
    keyword = {1: "great", 0: "awful"}
    for split, n in (("train", 96), ("dev", 32)):
        _write_tsv(tmp_path / "glue/SST-2" / f"{split}.tsv",
                   [["sentence", "label"]] + [[_sentence(rng, keyword[i % 2]), str(i % 2)] for i in range(n)])
    work = tmp_path / "work"
    assert cli(["finetune", "glue", "--task", "sst2", "--data", str(tmp_path / "glue"), "--init", init,
                "--workdir", str(work), "--epochs", "6", "--max-seq-length", "64", "--export-hf", *COMMON]) == 0
    metrics = json.loads((work / "metrics.json").read_text())["metrics"]
    assert metrics["dev"]["accuracy"] >= 0.9, metrics
    dev = [line.split("\t") for line in (tmp_path / "glue/SST-2/dev.tsv").read_text().splitlines()[1:]]
    tokenizer = transformers.AutoTokenizer.from_pretrained(work / "hf")
    model = transformers.ModernBertForSequenceClassification.from_pretrained(work / "hf").eval()
    with torch.no_grad():
        logits = model(**tokenizer([s for s, _ in dev], padding=True, truncation=True, max_length=64,
                                   return_tensors="pt")).logits.numpy()
    predictions = (work / "dev_predictions.tsv").read_text().splitlines()[1:]
    assert [int(line.split("\t")[2]) for line in predictions] == logits.argmax(-1).tolist()  # split, index, prediction, label
    # The checkpoint the run kept (by default) predicts as the job did.
    assert cli(["predict", "--model", str(work / "checkpoint"), "--input", str(tmp_path / "glue/SST-2/dev.tsv"),
                "--text-column", "sentence", "--max-seq-length", "64", "--output", str(tmp_path / "p.jsonl")]) == 0
    assert [json.loads(line)["label"] for line in (tmp_path / "p.jsonl").read_text().splitlines()] == \
        [line.split("\t")[2] for line in predictions]

    # The feature-based job on the same data, from the frozen encoder (its features: test_modernbert.py's embed).
    assert cli(["finetune", "features", "--task", "sst2", "--data", str(tmp_path / "glue"), "--init", init,
                "--workdir", str(tmp_path / "features"), "--pooling", "mean", "--max-seq-length", "64",
                "--cv-folds", "3"]) == 0
    assert json.loads((tmp_path / "features/metrics.json").read_text())["metrics"]["dev"]["accuracy"] >= 0.75


def _conll_sentence(rng: random.Random) -> list[tuple[str, str]]:
    words = [(w, "O") for w in rng.choices("the a went to with and saw met in from".split(), k=rng.randint(4, 9))]
    for names, tag in ((["alice", "bob", "carol"], "PER"), (["paris", "london", "rome"], "LOC")):
        at = rng.randint(0, len(words))
        words[at:at] = [(rng.choice(names), f"B-{tag}")]
    return words


def test_ner_learns_and_its_export_gives_the_jobs_logits_and_predict_its_entities(init, tmp_path):
    from bertjax.finetune import ner_data
    from bertjax.interop.load import load_init

    rng = random.Random(2)
    for split, n in (("train", 128), ("valid", 16)):
        (tmp_path / "conll").mkdir(exist_ok=True)
        (tmp_path / "conll" / f"{split}.txt").write_text("".join(
            "".join(f"{w} NN O {t}\n" for w, t in _conll_sentence(rng)) + "\n" for _ in range(n)))
    work = tmp_path / "work"
    assert cli(["finetune", "ner", "--data", str(tmp_path / "conll"), "--init", init, "--workdir", str(work),
                "--epochs", "6", "--max-seq-length", "64", "--doc-stride", "32", "--export-hf", *COMMON]) == 0
    metrics = json.loads((work / "metrics.json").read_text())
    assert metrics["metrics"]["valid"]["overall"]["f1"] >= 0.8, metrics["metrics"]
    config = json.loads((work / "hf/config.json").read_text())
    assert config["architectures"] == ["ModernBertForTokenClassification"]

    valid = ner_data.read_conll(str(tmp_path / "conll" / "valid.txt"))
    _, tokenizer = load_init(init)
    features = ner_data.featurize(valid, tokenizer, [config["id2label"][str(i)] for i in range(len(config["id2label"]))],
                                  max_seq_length=64, doc_stride=32)
    model = transformers.ModernBertForTokenClassification.from_pretrained(work / "hf").eval()
    arrays = features.arrays
    with torch.no_grad():
        logits = model(input_ids=torch.tensor(arrays["input_ids"], dtype=torch.long),
                       attention_mask=torch.tensor(arrays["input_mask"], dtype=torch.long)).logits.numpy()
    scored = arrays["label_ids"] >= 0
    tags = [config["id2label"][str(i)] for i in logits.argmax(-1)[scored]]
    gold = [config["id2label"][str(i)] for i in arrays["label_ids"][scored]]
    assert np.mean(np.array(tags) == np.array(gold)) >= 0.9

    text = "alice went to paris with bob"
    assert cli(["predict", "--model", str(work), "--output", str(tmp_path / "entities.jsonl"),
                "--input", str(_write_csv(tmp_path / "in.csv", ["text"], [[text]]))]) == 0
    entities = json.loads((tmp_path / "entities.jsonl").read_text())["entities"]
    assert [(e["entity_group"], e["word"]) for e in entities] == [("PER", "alice"), ("LOC", "paris"), ("PER", "bob")]
    assert cli(["predict", "--model", str(work / "checkpoint"), "--output", str(tmp_path / "kept.jsonl"),
                "--input", str(tmp_path / "in.csv")]) == 0  # the checkpoint the run kept: the same entities
    assert json.loads((tmp_path / "kept.jsonl").read_text())["entities"] == entities


def test_squad_v2_from_modernbert_and_its_export_gives_the_same_answers(init, shared_data, tmp_path):
    from bertjax.finetune import squad_data
    from bertjax.finetune.squad_postprocess import predict_answers
    from bertjax.interop.load import load_init

    sample = shared_data / "squad" / "sample-dev-v2.0.json"
    if not sample.exists():
        pytest.skip(f"SQuAD sample not found at {sample}")
    work = tmp_path / "work"
    assert cli(["finetune", "squad", "--version", "2.0", "--train", str(sample), "--predict", str(sample),
                "--init", init, "--workdir", str(work), "--epochs", "2", "--max-seq-length", "128",
                "--doc-stride", "32", "--max-query-length", "32", "--export-hf", "--learning-rate", "1e-3",
                "--batch-size", "8", "--eval-batch-size", "8", "--seed", "0"]) == 0
    assert json.loads((work / "hf/config.json").read_text())["architectures"] == ["ModernBertForQuestionAnswering"]
    data = json.loads(sample.read_text(encoding="utf-8"))
    preds = json.loads((work / "predictions.json").read_text(encoding="utf-8"))
    contexts = {qa["id"]: p["context"] for a in data["data"] for p in a["paragraphs"] for qa in p["qas"]}
    assert set(preds) == set(contexts) and all(t == "" or t in contexts[q] for q, t in preds.items())

    _, tokenizer = load_init(init)
    examples, features = squad_data.featurize(data, tokenizer, False, False, True, max_seq_length=128,
                                              doc_stride=32, max_query_length=32)
    model = transformers.ModernBertForQuestionAnswering.from_pretrained(work / "hf").eval()
    with torch.no_grad():
        out = model(input_ids=torch.tensor(features.input_ids, dtype=torch.long),
                    attention_mask=torch.tensor(features.input_mask, dtype=torch.long))
    hf_preds, *_ = predict_answers(examples, features, out.start_logits.numpy(), out.end_logits.numpy(),
                                   version_2=True)
    assert hf_preds == preds
    # The checkpoint the run kept (by default), as `predict --model` takes it: the job's answers, its SQuAD 2.0
    # settings from the checkpoint's head (it read the question/context rows as a classifier's `text` column).
    rows = [(qa["id"], qa["question"], p["context"]) for a in data["data"] for p in a["paragraphs"] for qa in p["qas"]]
    with open(tmp_path / "questions.csv", "w", newline="", encoding="utf-8") as f:
        csv.writer(f).writerows([("question", "context")] + [(q, c) for _, q, c in rows])
    assert cli(["predict", "--model", str(work / "checkpoint"), "--input", str(tmp_path / "questions.csv"),
                "--output", str(tmp_path / "answers.jsonl"), "--batch-size", "8"]) == 0
    answers = [json.loads(line)["answer"] for line in (tmp_path / "answers.jsonl").read_text().splitlines()]
    assert answers == [preds[qid] for qid, _, _ in rows]


def test_multiple_choice_learns_and_its_export_gives_the_jobs_scores(init, tmp_path):
    header = ["", "video-id", "fold-ind", "startphrase", "sent1", "sent2", "gold-source", "ending0", "ending1",
              "ending2", "ending3", "label"]
    filler = "the a man woman dog ball walks runs looks at down up into room street slowly then".split()

    def rows(n, seed):
        rng = random.Random(seed)
        out = []
        for i in range(n):
            words = lambda k: " ".join(rng.choices(filler, k=k))  # noqa: E731
            endings = [words(rng.randint(2, 6)) for _ in range(4)]
            gold = rng.randrange(4)
            endings[gold] = f"{words(2)} yes {words(2)}"
            sent1 = words(rng.randint(6, 10)).capitalize() + "."
            out.append([str(i), f"v{i}", str(i), f"{sent1} He", sent1, "He", "gold", *endings, str(gold)])
        return out

    val = rows(24, seed=3)
    _write_csv(tmp_path / "swag/train.csv", header, rows(96, seed=2))
    _write_csv(tmp_path / "swag/val.csv", header, val)
    work = tmp_path / "work"
    assert cli(["finetune", "multiple-choice", "--data", str(tmp_path / "swag"), "--init", init, "--workdir",
                str(work), "--max-seq-length", "32", "--epochs", "8", "--export-hf",
                *[("1e-2" if a == "5e-3" else a) for a in COMMON]]) == 0
    assert json.loads((work / "metrics.json").read_text())["metrics"]["accuracy"] >= 0.9
    with open(work / "val_predictions.csv", newline="") as f:
        ours = np.array([[float(p[f"score{k}"]) for k in range(4)] for p in csv.DictReader(f)])
    tokenizer = transformers.AutoTokenizer.from_pretrained(work / "hf")
    model = transformers.ModernBertForMultipleChoice.from_pretrained(work / "hf").eval()
    first = [r[4] for r in val for _ in range(4)]
    second = [f"{r[5]} {r[7 + k]}" for r in val for k in range(4)]
    batch = tokenizer(first, second, truncation=True, max_length=32, padding=True, return_tensors="pt")
    with torch.no_grad():
        logits = model(**{k: v.view(len(val), 4, -1) for k, v in batch.items()}).logits.numpy()
    np.testing.assert_allclose(logits, ours, rtol=1e-4, atol=1e-4)


def test_fine_tune_steps_follow_the_pytorch_loop(init, shared_data):
    """NER's recipe step by step (bench/ner_step_parity.py) from the tiny ModernBERT: the same loss, gradient norm
    and learning rate as transformers' ModernBertForTokenClassification under torch's AdamW, dropout off."""
    import importlib.util

    conll = shared_data / "conll2003"
    if not (conll / "train.txt").exists():
        pytest.skip(f"CoNLL-2003 not found at {conll}")
    spec = importlib.util.spec_from_file_location("ner_step_parity", modernbert_fixture.REPO_ROOT / "bench" /
                                                  "ner_step_parity.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    r = bench.step_parity(str(conll), init, train_sentences=64, steps=4, epochs=2, batch_size=16,
                          max_seq_length=64, learning_rate=1e-3, seed=1)
    ours, theirs = np.array(r["ours"]), np.array(r["torch"])
    np.testing.assert_allclose(ours[:, 2], theirs[:, 2], rtol=1e-6)   # learning rate
    np.testing.assert_allclose(ours[:, 0], theirs[:, 0], rtol=1e-4)   # loss
    np.testing.assert_allclose(ours[:, 1], theirs[:, 1], rtol=1e-4)   # gradient norm before clipping
    assert ours[-1, 0] < ours[0, 0]
