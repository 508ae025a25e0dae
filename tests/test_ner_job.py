"""`bertjax finetune ner` end to end on a slice of the real CoNLL-2003 from a tiny random BERT: predictions in
CoNLL format, conlleval metrics that the predictions file reproduces, and an HF BertForTokenClassification export
with the same logits as ours."""
from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

from bertjax.finetune import ner_data, ner_metrics
from tests.conftest import save_tiny_checkpoint


def _slice(src: Path, dst: Path, sentences: int) -> None:
    """The first `sentences` sentences of each split, lines unchanged (DOCSTART lines included)."""
    dst.mkdir(parents=True, exist_ok=True)
    for name in ("train.txt", "valid.txt", "test.txt"):
        out, seen = [], 0
        for line in (src / name).read_text(encoding="utf-8").splitlines(keepends=True):
            out.append(line)
            if not line.strip() and out[-2].strip() and not out[-2].startswith("-DOCSTART-"):
                seen += 1
                if seen == sentences:
                    break
        (dst / name).write_text("".join(out), encoding="utf-8")


def test_cli_finetune_ner_writes_predictions_metrics_and_hf_export(shared_data, minilm_dir, tmp_path, capsys):
    import jax

    from bertjax.cli import main
    from bertjax.interop.load import load_init, load_pretrained
    from bertjax.model.bert import BertForTokenClassification

    init = save_tiny_checkpoint(tmp_path / "init", minilm_dir / "vocab.txt", seed=0)
    data = tmp_path / "conll"
    _slice(shared_data / "conll2003", data, 48)
    work = tmp_path / "work"
    rc = main(["finetune", "ner", "--data", str(data), "--init", init, "--workdir", str(work), "--epochs", "4",
               "--batch-size", "16", "--learning-rate", "3e-3", "--max-seq-length", "64",   # --doc-stride: 32
               "--eval-batch-size", "32", "--length-bucket", "64", "--save-checkpoint", "--export-hf",
               "--eval-every", "6", "--max-eval-examples", "40"])
    assert rc == 0
    out = capsys.readouterr().out
    printed = json.loads(out.strip().splitlines()[-1])
    result = json.loads((work / "metrics.json").read_text())
    assert set(printed) == set(result["metrics"]) == {"valid", "test"}
    labels = result["labels"]
    assert labels == json.loads((work / "labels.json").read_text())
    assert labels[0] == "O" and len(labels) == 9
    assert result["num_train_sentences"] == 48 and len(result["seconds_per_epoch"]) == 4
    # --max-seq-length alone: the stride followed it (half the window), recorded as used.
    assert result["ner_settings"] == {"max_seq_length": 64, "doc_stride": 32}
    history = [h["train_loss"] for h in result["history"]]
    assert history[-1] < history[0]  # it learns (a random tiny encoder gets far from chance on the O tags)
    # --eval-every 6 of 12 steps: valid's entity scores, the last equal to the final ones
    records = [json.loads(line) for line in (work / "metrics.jsonl").read_text().splitlines()]
    evals = {r["step"]: r for r in records if "eval_f1" in r}
    assert sorted(evals) == [6, 12]
    assert evals[12]["eval_f1"] == pytest.approx(result["metrics"]["valid"]["overall"]["f1"])
    # ... and on the console, as GLUE's are
    for step in (6, 12):
        shown = re.search(rf"eval at step {step}: precision=\S+ recall=\S+ f1=(\S+)", out)
        assert shown and float(shown[1]) == pytest.approx(evals[step]["eval_f1"], rel=1e-3), out

    for split in ("valid", "test"):
        gold = ner_data.read_conll(str(data / f"{split}.txt")).head(40)  # --max-eval-examples 40
        pred_file = ner_data.read_conll(str(work / f"predictions_{split}.txt"))  # word gold predicted
        assert pred_file.words == gold.words
        lines = [l.split() for l in (work / f"predictions_{split}.txt").read_text().splitlines() if l.strip()]
        assert [l[1] for l in lines] == [t for sent in gold.tags for t in sent]
        assert {l[2] for l in lines} <= set(labels)
        # The metrics written are conlleval's on the predictions file written.
        assert ner_metrics.entity_scores(gold.tags, pred_file.tags) == result["metrics"][split]
        assert printed[split] == result["metrics"][split]["overall"]
        assert result["metrics"][split]["overall"]["gold"] > 0

    # The HF export: BertForTokenClassification with id2label/label2id, the same logits as the bertjax checkpoint.
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    config = json.loads((work / "hf" / "config.json").read_text())
    assert config["architectures"] == ["BertForTokenClassification"]
    assert config["id2label"] == {str(i): l for i, l in enumerate(labels)}
    assert config["label2id"] == {l: i for i, l in enumerate(labels)}
    fine_tuned = load_pretrained(str(work / "checkpoint"))
    assert set(fine_tuned.params) == {"bert", "classifier"} and "pooler" not in fine_tuned.params["bert"]
    _, tokenizer = load_init(init)
    feats = ner_data.featurize(ner_data.read_conll(str(data / "valid.txt")).head(40), tokenizer, None, 64,
                               32).arrays
    ours = np.asarray(BertForTokenClassification(fine_tuned.config, len(labels)).apply(
        {"params": jax.device_get(fine_tuned.params)}, feats["input_ids"], feats["input_mask"], feats["segment_ids"]))
    model = transformers.BertForTokenClassification.from_pretrained(str(work / "hf")).eval()
    assert model.config.id2label == dict(enumerate(labels))
    with torch.no_grad():
        theirs = model(input_ids=torch.tensor(feats["input_ids"], dtype=torch.long),
                       attention_mask=torch.tensor(feats["input_mask"], dtype=torch.long),
                       token_type_ids=torch.tensor(feats["segment_ids"], dtype=torch.long)).logits.numpy()
    real = feats["input_mask"].astype(bool)
    np.testing.assert_allclose(theirs[real], ours[real], atol=1e-4, rtol=1e-4)
    # The export reads back (the architecture is inferred: a classifier without a pooler).
    reread = load_pretrained(str(work / "hf"))
    np.testing.assert_allclose(reread.params["classifier"]["kernel"], fine_tuned.params["classifier"]["kernel"])
    # A later `bertjax export` of the saved checkpoint keeps the labels (not LABEL_0, ...).
    assert fine_tuned.head == {"architecture": "BertForTokenClassification",
                               "id2label": {str(i): l for i, l in enumerate(labels)}}
    assert reread.head == fine_tuned.head
    assert main(["export", str(work / "checkpoint"), "--out", str(tmp_path / "later")]) == 0
    later = json.loads((tmp_path / "later" / "config.json").read_text())
    assert later["architectures"] == config["architectures"] and later["id2label"] == config["id2label"]


def test_cli_finetune_ner_bad_file_is_one_line(tmp_path, capsys):
    from bertjax.cli import main

    for name, text in (("train.txt", "EU B-ORG\n\nPeter B-PER\nBlackburn\n"), ("valid.txt", "EU B-ORG\n")):
        (tmp_path / name).write_text(text, encoding="utf-8")
    rc = main(["finetune", "ner", "--data", str(tmp_path), "--init", str(tmp_path / "none"), "--workdir",
               str(tmp_path / "w")])
    assert rc == 2
    assert f"{tmp_path / 'train.txt'}:4: expected 'word ... tag'" in capsys.readouterr().err


def test_a_dev_or_test_tag_of_a_type_never_trained_is_refused_naming_it_and_its_line(tmp_path, capsys):
    """valid.txt's B-PERSON (train.txt spells the type PER) was scored as gold the model could never predict."""
    from bertjax.cli import main

    (tmp_path / "train.txt").write_text("EU NNP B-ORG\nsays VBZ O\n\nPeter NNP B-PER\n", encoding="utf-8")
    (tmp_path / "valid.txt").write_text("EU NNP B-ORG\n\nPeter NNP B-PER\nBlack NNP I-PER\n", encoding="utf-8")
    (tmp_path / "test.txt").write_text("says VBZ O\nAnn NNP B-PERSON\n", encoding="utf-8")
    argv = ["finetune", "ner", "--data", str(tmp_path), "--init", str(tmp_path / "none"), "--workdir",
            str(tmp_path / "w")]
    assert main(argv) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].endswith(
        f"{tmp_path / 'test.txt'}:2: tag 'B-PERSON': the entity type 'PERSON' is not in {tmp_path / 'train.txt'} "
        "(its types: ORG, PER); the model could never predict it")
    assert main([*argv, "--no-predict-test"]) == 2  # read and checked whether or not it is predicted
    assert not (tmp_path / "w").exists()
