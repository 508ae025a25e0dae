"""The model card from a run's records, read back by huggingface_hub: NER's overall scores only, the license and
language of the base model's own card, the base model by its hub id, the command as typed, the data files with
their hashes, the step the weights are; and the acceptance: the card's command, rerun, trains the same model."""
from __future__ import annotations

import hashlib
import json
import random
import re
import shlex
import shutil

import pytest

from bertjax.cli import main as bertjax_main
from bertjax.interop.model_card import base_card, base_model, write_card
from tests.test_classify_job import _sentence, _write_csv, tiny_init  # noqa: F401 - the fixture


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
        "init": str(minilm_dir), "steps_run": 30, "total_steps": 30}))
    argv = ["finetune", "ner", "--data", "conll_2003/", "--init", str(minilm_dir), "--workdir", "run", "--export-hf"]
    (run_dir / "run.json").write_text(json.dumps({
        "job": "ner", "data": "conll_2003/", "init": str(minilm_dir), "export_hf": True, "save_checkpoint": False,
        "argv": argv, f"input:{tmp_path}/conll_2003/train.txt": "46029 bytes, sha256 0123456789abcdef"}))
    card = hub.ModelCard.load(write_card(str(hf), str(run_dir)))
    # all-MiniLM-L6-v2's own card says apache-2.0 and en; the package that ships it is named by the model's hub id.
    assert (card.data.license, card.data.language) == ("apache-2.0", "en")
    assert card.data.base_model == "sentence-transformers/all-MiniLM-L6-v2"
    assert "Base model: sentence-transformers/all-MiniLM-L6-v2." in card.text and "site-packages" not in \
        card.text.split("```bash")[0]
    assert card.data.pipeline_tag == "token-classification" and card.data.datasets == ["eriktks/conll2003"]
    assert {r.metric_name: r.metric_value for r in card.data.eval_results} == {
        f"valid overall {k}": v for k, v in overall.items()}
    assert f"```bash\nbertjax {shlex.join(argv)}\n```" in card.text
    assert "Weights: step 30 of 30, the last." in card.text
    assert "| conll_2003/train.txt | 46,029 | 0123456789abcdef |" in card.text and "input:" not in card.text
    assert "Labels: O, B-PER, I-PER." in card.text and "hf upload" in card.text


def test_card_of_an_exported_checkpoint_without_a_run(tmp_path):
    hub = pytest.importorskip("huggingface_hub")
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["BertForMaskedLM"], "vocab_size": 10}))
    card = hub.ModelCard.load(write_card(str(tmp_path), None, source="runs/p1"))
    assert card.data.license == "other" and card.data.pipeline_tag == "fill-mask"
    # Nothing is known of its training: no base model (the checkpoint is not its own base), no command.
    assert card.data.eval_results is None and "Base model" not in card.text and "## Training" not in card.text


def test_the_base_model_is_its_hub_id_or_a_local_checkpoint(tmp_path, minilm_dir):
    assert base_model(str(minilm_dir)) == ("sentence-transformers/all-MiniLM-L6-v2",) * 2  # a packaged checkpoint
    assert base_model("google-bert/bert-base-uncased") == ("google-bert/bert-base-uncased",) * 2
    snapshot = tmp_path / "hub" / "models--google-bert--bert-base-uncased" / "snapshots" / "86b5e09"
    snapshot.mkdir(parents=True)
    assert base_model(str(snapshot)) == ("google-bert/bert-base-uncased",) * 2  # huggingface_hub's cache
    other_package = tmp_path / "lib" / "python3.11" / "site-packages" / "some_models" / "bert"
    other_package.mkdir(parents=True)
    assert base_model(str(other_package)) == ("local checkpoint", None)
    assert base_model(str(tmp_path)) == (f"local checkpoint `{tmp_path}`", None)
    # The base's license comes from its own card, read where the hub id is installed (offline, nothing downloaded).
    assert base_card("sentence-transformers/all-MiniLM-L6-v2")["license"] == "apache-2.0"
    assert base_card("nobody/not-installed-or-cached") == {}


def test_the_cards_command_reruns_the_same_training(tiny_init, tmp_path, monkeypatch):  # noqa: F811
    """A fine-tune typed with relative paths (file names with underscores) and --metric-for-best: its card gives
    the command as typed, the step its best evaluation chose, and each data file with its size and SHA-256 as
    hashlib computes them. The command, run in another directory holding those files, trains the same model."""
    rng = random.Random(0)
    words = {"no": "awful", "yes": "great"}
    files = ("data/my_train.csv", "data/my_dev.csv")
    first, second = tmp_path / "first", tmp_path / "second"
    (first / "data").mkdir(parents=True)
    for name, count in zip(files, (32, 16)):
        _write_csv(first / name, ["text", "label"], [[_sentence(rng, words[label]), label] for label in
                                                     ["no", "yes"] * (count // 2)])
    argv = ["finetune", "classify", "--train", files[0], "--dev", files[1], "--init", tiny_init, "--workdir", "work",
            "--max-seq-length", "16", "--batch-size", "8", "--epochs", "2", "--learning-rate", "5e-3", "--seed", "1",
            "--eval-batch-size", "8", "--metric-for-best", "accuracy", "--export-hf"]
    monkeypatch.chdir(first)
    assert bertjax_main(argv) == 0
    text = (first / "work" / "hf" / "README.md").read_text()
    [command] = re.findall(r"```bash\nbertjax (.*)\n```", text)
    assert shlex.split(command) == argv
    result = json.loads((first / "work" / "metrics.json").read_text())
    best = result["best"]
    assert f"Weights: step {best['step']} of 8, the best evaluation by `accuracy` ({best['value']:.4f}; " in text
    for name in files:
        data = (first / name).read_bytes()
        assert f"| {name.split('/')[-1]} | {len(data):,} | {hashlib.sha256(data).hexdigest()[:16]} |" in text
    assert "input:" not in text

    (second / "data").mkdir(parents=True)
    for name in files:
        shutil.copy(first / name, second / name)
    monkeypatch.chdir(second)
    assert bertjax_main(shlex.split(command)) == 0
    again = json.loads((second / "work" / "metrics.json").read_text())
    assert (again["metrics"], again["best"]) == (result["metrics"], best)
    assert (second / "work" / "hf" / "model.safetensors").read_bytes() == \
        (first / "work" / "hf" / "model.safetensors").read_bytes()


def _outside_the_command(text: str) -> str:
    """The card less its command block (which keeps the paths as typed: it is the command to rerun)."""
    return re.sub(r"```bash\n.*?\n```", "", text, flags=re.S)


def test_a_fine_tune_card_names_its_data_by_file_name_and_hash(tmp_path, monkeypatch):
    """Own files typed as `../data/eval.jsonl` and an absolute temporary path: the card's model-index dataset and its
    files table name them by file name (the dev file with its SHA-256), never by where they lay."""
    hub = pytest.importorskip("huggingface_hub")
    (tmp_path / "work" / "run" / "hf").mkdir(parents=True)
    monkeypatch.chdir(tmp_path / "work")
    run_dir, hf = tmp_path / "work" / "run", tmp_path / "work" / "run" / "hf"
    (hf / "config.json").write_text(json.dumps({"architectures": ["BertForSequenceClassification"],
                                                "id2label": {"0": "no", "1": "yes"}}))
    train = tmp_path / "tmpabc123" / "train.jsonl"
    argv = ["finetune", "classify", "--train", str(train), "--dev", "../data/eval.jsonl", "--init", "runs/p1",
            "--workdir", "run"]
    (run_dir / "run.json").write_text(json.dumps({
        "job": "classify", "train": str(train), "dev": "../data/eval.jsonl", "init": "runs/p1", "argv": argv,
        f"input:{train}": "300 bytes, sha256 aaaaaaaaaaaaaaaa",
        f"input:{tmp_path / 'data' / 'eval.jsonl'}": "120 bytes, sha256 0123456789abcdef"}))
    (run_dir / "metrics.json").write_text(json.dumps({
        "task": "classify", "dev": "../data/eval.jsonl", "metrics": {"dev": {"accuracy": 0.75}}, "steps_run": 4}))
    card = hub.ModelCard.load(write_card(str(hf), str(run_dir)))
    [result] = card.data.eval_results
    assert (result.dataset_name, result.dataset_type) == ("eval.jsonl, sha256 0123456789abcdef", "eval.jsonl")
    assert "| train.jsonl | 300 | aaaaaaaaaaaaaaaa |" in card.text and "| eval.jsonl | 120 | 0123456789abcdef |" \
        in card.text
    rest = _outside_the_command(card.content)
    assert "../data" not in rest and str(tmp_path) not in rest, rest


def test_a_pretraining_card_names_the_corpus_data_create_recorded(tmp_path, minilm_dir, monkeypatch):
    """A run on `data create` shards: its card lists the corpus files the shards' metadata records (name, size,
    SHA-256 as hashlib computes it), not the shards; its data and dataset by name, never a local path."""
    import hashlib

    from bertjax.data.data_config import PretrainingDataConfig
    from bertjax.pretraining.loop import _input_stamps

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for name in ("a.txt", "b.txt"):
        (corpus / name).write_text("".join(f"The {name[0]} tale number {i} is told here.\nIt ends well.\n\n"
                                           for i in range(30)), encoding="utf-8")
    (corpus / "eval.txt").write_text("A held out line.\nAnother one.\n", encoding="utf-8")
    records = tmp_path / "records"
    assert bertjax_main(["data", "create", "--input", str(corpus / "a.txt"), "--input", str(corpus / "b.txt"),
                         "--vocab", str(minilm_dir / "vocab.txt"), "--out", str(records), "--max-seq-length", "32",
                         "--max-predictions", "5", "--dupe-factor", "1"]) == 0
    examples = json.loads((records / "pretrain-metadata.json").read_text())["examples"]
    run = tmp_path / "runs" / "p1"
    run.mkdir(parents=True)
    data = {"input": str(records), "eval_input": str(corpus / "eval.txt")}
    (run / "config.json").write_text(json.dumps({"data": data, "train": {"steps": 10}}))
    (run / "inputs.json").write_text(json.dumps(_input_stamps(PretrainingDataConfig(input=str(records)))))
    argv = ["pretrain", "--config", "bert-tiny", "--workdir", str(run), "--set", f"data.input={records}"]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in [
        {"step": 0, "event": "command", "argv": argv}, {"step": 10, "loss": 7.5, "mlm_accuracy": 0.01},
        {"step": 10, "eval_mlm_accuracy": 0.02}]))
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps({"architectures": ["BertForPreTraining"], "vocab_size": 30522}))
    hub = pytest.importorskip("huggingface_hub")
    card = hub.ModelCard.load(write_card(str(hf), str(run), step=10))
    for name in ("a.txt", "b.txt"):
        body = (corpus / name).read_bytes()
        assert f"| {name} | {len(body):,} | {hashlib.sha256(body).hexdigest()[:16]} |" in card.text, card.text
    assert ".tfrecord" not in card.text and "metadata.json" not in card.text
    assert f"Data: data.input=`records` ({examples:,} examples of TFRecord shards that `bertjax data create` made " \
           "from the corpus below), data.eval_input=`eval.txt`." in card.text
    [result] = {(r.dataset_name, r.dataset_type) for r in card.data.eval_results}
    assert result == ("eval.txt", "eval.txt")
    rest = _outside_the_command(card.content)
    assert str(tmp_path) not in rest, rest
