"""The SQuAD job end to end on a tiny random BERT and the real SQuAD 2.0 sample: output files, official metrics
recomputed from them, the HF BertForQuestionAnswering export, and `bertjax eval squad`."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from bertjax.finetune import squad_data
from bertjax.finetune import squad_metrics
from bertjax.finetune.squad_postprocess import predict_answers
from bertjax.finetune.settings import SquadSettings, TrainSettings
from tests.conftest import save_tiny_checkpoint

SAMPLE = Path(__file__).resolve().parents[1] / ".." / "shared" / "data" / "squad" / "sample-dev-v2.0.json"


def _sample() -> Path:
    if not SAMPLE.exists():
        pytest.skip(f"SQuAD sample not found at {SAMPLE} (shared data is only present beside the project)")
    return SAMPLE


@pytest.fixture(scope="module")
def tiny_init(tmp_path_factory, minilm_dir) -> str:
    return save_tiny_checkpoint(tmp_path_factory.mktemp("init") / "ckpt", minilm_dir / "vocab.txt", seed=1)


def test_squad_v2_job_outputs_metrics_and_hf_export(tiny_init, tmp_path):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from bertjax.finetune import squad
    from bertjax.interop.load import load_init

    sample = str(_sample())
    work = tmp_path / "work"
    settings = SquadSettings(version="2.0", max_seq_length=128, doc_stride=32, max_query_length=32)
    result = squad.run(str(work), TrainSettings(learning_rate=1e-3, batch_size=8, epochs=3, seed=0, eval_every=4),
                       settings, init=tiny_init, train_file=sample, predict_file=sample, save_checkpoint=True,
                       export_hf=True)
    assert result["num_train_examples"] == 14 and result["num_train_windows"] > 14  # several windows each
    assert result["history"][-1]["train_loss"] < result["history"][0]["train_loss"]
    # --eval-every: the official metrics every 4 steps; at the last step they are the final ones
    records = [json.loads(line) for line in (work / "metrics.jsonl").read_text().splitlines()]
    evals = {r["step"]: r for r in records if "eval_f1" in r}
    assert sorted(evals) == list(range(4, result["total_steps"] + 1, 4))
    if result["total_steps"] % 4 == 0:
        last = evals[result["total_steps"]]
        assert (last["eval_exact"], last["eval_f1"]) == pytest.approx((result["metrics"]["exact"],
                                                                         result["metrics"]["f1"]))

    data = json.loads(Path(sample).read_text(encoding="utf-8"))
    preds = json.loads((work / "predictions.json").read_text(encoding="utf-8"))
    null_odds = json.loads((work / "null_odds.json").read_text())
    nbest = json.loads((work / "nbest_predictions.json").read_text(encoding="utf-8"))
    qids = {qa["id"] for a in data["data"] for p in a["paragraphs"] for qa in p["qas"]}
    assert set(preds) == set(null_odds) == set(nbest) == qids
    contexts = {qa["id"]: p["context"] for a in data["data"] for p in a["paragraphs"] for qa in p["qas"]}
    for qid, text in preds.items():
        assert text == "" or text in contexts[qid]  # spans are slices of the original context
        assert (text == "") == (null_odds[qid] > 0.0)  # threshold 0
        entries = nbest[qid]
        texts = [e["text"] for e in entries]
        assert texts.count("") == 1 and len(set(texts)) == len(texts)  # v2: the null once, no duplicate spans
        assert all(t in contexts[qid] for t in texts)
        scores = np.array([e["start_logit"] + e["end_logit"] for e in entries])
        # At most the 20 best spans, then the null if it was not among them; all ranked by start + end logit.
        assert len(entries) <= 21 and np.all(np.diff(scores) <= 0), scores
        assert text == "" or text == next(t for t in texts if t)  # a span answer is the best-scored span
        np.testing.assert_allclose([e["probability"] for e in entries],
                                   np.exp(scores - scores.max()) / np.exp(scores - scores.max()).sum(), rtol=1e-6)
    official = squad_metrics.evaluate_v2(data["data"], preds, null_odds)
    assert {k: result["metrics"][k] for k in official if not k.startswith("best")} == \
        {k: v for k, v in official.items() if not k.startswith("best")}
    # The job's threshold search uses the answers given when answering; at its threshold the F1 is reached.
    best = result["metrics"]["best_f1_thresh"]
    rerun = squad.run(str(tmp_path / "again"), TrainSettings(), SquadSettings(
        version="2.0", max_seq_length=128, doc_stride=32, max_query_length=32, null_score_diff_threshold=best),
        init=str(work / "checkpoint"), train_file=None, predict_file=sample)
    assert rerun["metrics"]["f1"] == pytest.approx(result["metrics"]["best_f1"])
    # --max-eval-examples: the first questions of the predict file only, scored on themselves
    first = squad.run(str(tmp_path / "first"), TrainSettings(max_eval_examples=5), settings,
                      init=str(work / "checkpoint"), train_file=None, predict_file=sample)
    first_ids = [qa["id"] for a in data["data"] for p in a["paragraphs"] for qa in p["qas"]][:5]
    assert list(json.loads((tmp_path / "first" / "predictions.json").read_text())) == first_ids
    assert first["metrics"]["total"] == 5

    # HF export: same start/end logits on the predict windows, hence the same predictions.
    ckpt, tokenizer = load_init(tiny_init)
    examples, feats = squad_data.featurize(data, tokenizer, True, False, True, max_seq_length=128, doc_stride=32,
                                   max_query_length=32)
    model = transformers.BertForQuestionAnswering.from_pretrained(str(work / "hf")).eval()
    with torch.no_grad():
        out = model(input_ids=torch.tensor(feats.input_ids, dtype=torch.long),
                    attention_mask=torch.tensor(feats.input_mask, dtype=torch.long),
                    token_type_ids=torch.tensor(feats.segment_ids, dtype=torch.long))
    hf_preds, _, hf_odds, _ = predict_answers(examples, feats, out.start_logits.numpy(), out.end_logits.numpy(),
                                              version_2=True)
    assert hf_preds == preds
    np.testing.assert_allclose([hf_odds[q] for q in sorted(qids)], [null_odds[q] for q in sorted(qids)],
                               rtol=1e-3, atol=1e-3)


def test_predict_only_needs_a_span_head(tiny_init, tmp_path):
    from bertjax.finetune import squad

    with pytest.raises(ValueError, match="no span head"):
        squad.run(str(tmp_path), TrainSettings(), SquadSettings(max_seq_length=128), init=tiny_init, train_file=None,
                  predict_file=str(_sample()))


def test_cli_eval_squad_like_the_official_script(tmp_path, capsys):
    from bertjax.cli import main

    data = json.loads(_sample().read_text(encoding="utf-8"))
    qas = [qa for a in data["data"] for p in a["paragraphs"] for qa in p["qas"]]
    # Answer every answerable question right except one; predict "" for all impossible ones but one.
    preds = {qa["id"]: (qa["answers"][0]["text"] if qa["answers"] else "") for qa in qas}
    answerable = [qa["id"] for qa in qas if qa["answers"]]
    impossible = [qa["id"] for qa in qas if not qa["answers"]]
    preds[answerable[0]] = "Paris"
    preds[impossible[0]] = "Normandy"
    (tmp_path / "p.json").write_text(json.dumps(preds))
    assert main(["eval", "squad", "--data", str(_sample()), "--predictions", str(tmp_path / "p.json")]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["total"] == 14 and out["exact"] == pytest.approx(100 * 12 / 14)
    assert out["HasAns_exact"] == pytest.approx(100 * 7 / 8) and out["NoAns_exact"] == pytest.approx(100 * 5 / 6)
    # With null odds that flag exactly the impossible questions, a threshold between them is perfect.
    odds = {q: (1.0 if q in impossible else -1.0) for q in preds}
    (tmp_path / "n.json").write_text(json.dumps(odds))
    assert main(["eval", "squad", "--data", str(_sample()), "--predictions", str(tmp_path / "p.json"),
                 "--na-prob-file", str(tmp_path / "n.json"), "--na-prob-thresh", "0.5"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["NoAns_exact"] == 100.0 and out["HasAns_exact"] == pytest.approx(100 * 7 / 8)
    assert out["best_exact"] == pytest.approx(100 * 13 / 14) and out["best_exact_thresh"] == -1.0
