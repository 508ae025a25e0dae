"""The model card from a run's records, read back by huggingface_hub: NER's overall scores only, the license and
language of the base model's own card, the command line of run.json (no JAX: hand-written records)."""
from __future__ import annotations

import json

import pytest

from bertjax.interop.model_card import write_card


def test_card_from_an_ner_run_inherits_the_base_license(tmp_path, minilm_dir):
    hub = pytest.importorskip("huggingface_hub")
    run_dir, hf = tmp_path / "run", tmp_path / "run" / "hf"
    hf.mkdir(parents=True)
    (hf / "config.json").write_text(json.dumps({
        "architectures": ["BertForTokenClassification"], "num_hidden_layers": 6, "hidden_size": 384,
        "num_attention_heads": 12, "vocab_size": 30522, "id2label": {"0": "O", "1": "B-PER", "2": "I-PER"}}))
    overall = {"precision": 0.9, "recall": 0.8, "f1": 0.847}
    (run_dir / "metrics.json").write_text(json.dumps({
        "metrics": {"valid": {"overall": overall, "PER": {"f1": 0.5}}}, "settings": {"learning_rate": 5e-5},
        "init": str(minilm_dir)}))
    (run_dir / "run.json").write_text(json.dumps({"job": "ner", "data": "conll/", "init": str(minilm_dir),
                                                  "export_hf": True, "save_checkpoint": False}))
    card = hub.ModelCard.load(write_card(str(hf), str(run_dir)))
    # all-MiniLM-L6-v2's own card says apache-2.0 and en.
    assert (card.data.license, card.data.language) == ("apache-2.0", "en")
    assert card.data.pipeline_tag == "token-classification" and card.data.datasets == ["eriktks/conll2003"]
    assert {r.metric_name: r.metric_value for r in card.data.eval_results} == {
        f"valid overall {k}": v for k, v in overall.items()}
    assert f"bertjax finetune ner --data conll/ --export-hf --init {minilm_dir}" in card.text
    assert "Labels: O, B-PER, I-PER." in card.text and "hf upload" in card.text


def test_card_of_an_exported_checkpoint_without_a_run(tmp_path):
    hub = pytest.importorskip("huggingface_hub")
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["BertForMaskedLM"], "vocab_size": 10}))
    card = hub.ModelCard.load(write_card(str(tmp_path), None, base="runs/p1"))
    assert card.data.license == "other" and card.data.pipeline_tag == "fill-mask"
    assert card.data.eval_results is None and "Base checkpoint: `runs/p1`." in card.text
