"""Long contexts: a ModernBERT fine-tuned and predicting at lengths where the reference attention's [S, S] scores
would not fit (on a CPU its layers run the chunked attention from attention.CHUNKED_MIN_LENGTH tokens), equal to
transformers' pipeline at the run's length; `bertjax predict` takes the length a model was fine-tuned at and says
so; the fine-tune's memory floor counts no [S, S] scores where none are held."""
from __future__ import annotations

import csv
import json
import random
import shutil

import pytest
import transformers

from bertjax.cli import main as cli
from tests import modernbert_fixture

LENGTH = 1024
FILLER = "the a movie film plot actor scene story music was is very quite rather and but with of".split()


def _text(rng: random.Random, words: int, keyword: str) -> str:
    chosen = rng.choices(FILLER, k=words)
    chosen.insert(rng.randint(0, words), keyword)
    return " ".join(chosen)


def _fine_tune(root, length: int):
    """A classify run at --max-seq-length `length` from a tiny ModernBERT that takes it (8 rows of length / 2 to
    length words, one step), its model kept both ways; the run's workdir."""
    init = modernbert_fixture.write_masked_lm(root / "init", max_position_embeddings=length)
    rng = random.Random(0)
    rows = [[_text(rng, rng.randint(length // 2, length), keyword), label]
            for label, keyword in [("bad", "awful"), ("good", "great")] * 4]
    with open(root / "train.csv", "w", newline="", encoding="utf-8") as f:
        csv.writer(f).writerows([["text", "label"]] + rows)
    work = root / "run"
    assert cli(["finetune", "classify", "--train", str(root / "train.csv"), "--init", str(init), "--workdir",
                str(work), "--epochs", "1", "--max-seq-length", str(length), "--batch-size", "8",
                "--eval-batch-size", "8", "--learning-rate", "1e-3", "--export-hf", "--save-checkpoint"]) == 0
    return work


@pytest.fixture(scope="module")
def long_run(tmp_path_factory):
    return _fine_tune(tmp_path_factory.mktemp("long"), LENGTH)


def _predict_equals_the_pipeline_at_the_runs_length(work, length: int, tmp_path, capsys):
    """`predict --model WORKDIR` without --max-seq-length: the run's length, said in a line, and the scores of
    transformers' pipeline truncating there; a text longer than it, whose tokens past 128 change its scores (so a
    prediction at the old default of 128 would fail here), and a short one."""
    rng = random.Random(1)
    texts = [_text(rng, length + 100, "great"), _text(rng, length // 3, "awful")]
    with open(tmp_path / "new.csv", "w", newline="", encoding="utf-8") as f:
        csv.writer(f).writerows([["text"]] + [[t] for t in texts])
    capsys.readouterr()
    assert cli(["predict", "--model", str(work), "--input", str(tmp_path / "new.csv"), "--output",
                str(tmp_path / "out.jsonl"), "--batch-size", "8"]) == 0
    said = capsys.readouterr().out
    assert f"{work}: --max-seq-length {length} (the length it was fine-tuned at, recorded with the model)" in said
    ours = [json.loads(line)["scores"] for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    pipe = transformers.pipeline("text-classification", model=str(work / "hf"), top_k=None, device="cpu")

    def scores(text, max_length):
        return {r["label"]: r["score"] for r in pipe([text], truncation=True, max_length=max_length)[0]}
    for text, row in zip(texts, ours):
        assert row == pytest.approx(scores(text, length), abs=1e-5)
    assert abs(scores(texts[0], 128)["good"] - ours[0]["good"]) > 1e-4, "the test cannot tell the length apart"


def test_fine_tune_and_predict_at_a_long_length_equal_transformers(long_run, tmp_path, capsys):
    _predict_equals_the_pipeline_at_the_runs_length(long_run, LENGTH, tmp_path, capsys)


@pytest.mark.slow
def test_fine_tune_and_predict_at_8192_tokens_equal_transformers(tmp_path, capsys):
    """ModernBERT's own context, 8192 tokens: the fine-tune's step and `predict` on a CPU (586 s on the busy 2-core
    machine)."""
    _predict_equals_the_pipeline_at_the_runs_length(_fine_tune(tmp_path, 8192), 8192, tmp_path, capsys)


def test_predict_takes_the_length_recorded_with_the_model_else_its_runs(long_run, tmp_path):
    """The length travels with the model (an export's config.json, a checkpoint's head): copied out of the workdir,
    each still predicts at it. An export from before lengths were recorded: its run's run.json where it sits in
    the workdir, else the old default of 128, saying which."""
    from bertjax.finetune.predict import Predictor

    for name in ("hf", "checkpoint"):
        shutil.copytree(long_run / name, tmp_path / name)
        predictor = Predictor(str(tmp_path / name))
        assert (predictor.max_seq_length, predictor.length_note) == (
            LENGTH, f"--max-seq-length {LENGTH} (the length it was fine-tuned at, recorded with the model)")
    assert json.loads((long_run / "hf/config.json").read_text())["max_seq_length"] == LENGTH
    assert Predictor(str(tmp_path / "hf"), max_seq_length=96).length_note == "--max-seq-length 96 (as given)"

    older = tmp_path / "older"
    shutil.copytree(long_run / "hf", older / "hf")
    config = json.loads((older / "hf/config.json").read_text())
    del config["max_seq_length"]
    (older / "hf/config.json").write_text(json.dumps(config))
    predictor = Predictor(str(older))
    assert (predictor.max_seq_length, predictor.length_note) == (
        128, "--max-seq-length 128 (the default: the model records no length it was fine-tuned at)")
    (older / "run.json").write_text(json.dumps({"job": "classify", "max_seq_length": 48}))
    predictor = Predictor(str(older))
    assert (predictor.max_seq_length, predictor.length_note) == (
        48, f"--max-seq-length 48 (the length its run was fine-tuned at ({older / 'run.json'}))")


def test_the_memory_floor_counts_scores_only_where_a_layer_holds_them():
    """The fine-tune's refusal of steps that cannot fit (shapes.activation_floor_bytes) counted a [heads, S] row of
    probabilities a token and layer whatever ran, ~4 GiB a row of 8192 tokens for the tiny model: a CPU refused
    what it runs in ~1 GiB. Counted now where the layer's attention holds them: the reference's."""
    from bertjax.model import shapes
    from bertjax.model.modernbert_config import ModernBertConfig

    config = ModernBertConfig.from_hf_dict({**modernbert_fixture.TINY, "model_type": "modernbert",
                                            "max_position_embeddings": 8192, "pad_token_id": 0})
    per_token_layer = (9 * config.hidden_size + 2 * config.intermediate_size) * 4
    scores = lambda length: config.num_attention_heads * length * 4  # noqa: E731
    layers = config.num_hidden_layers
    assert shapes.activation_floor_bytes(config, 2, 8192, training=True, platform="cpu") == \
        2 * 8192 * per_token_layer * layers   # chunked: none held
    assert shapes.activation_floor_bytes(config, 2, 256, training=True, platform="cpu") == \
        2 * 256 * (per_token_layer + scores(256)) * layers   # the reference below CHUNKED_MIN_LENGTH
    reference = config.replace(attention_backend="reference")
    assert shapes.activation_floor_bytes(reference, 2, 8192, training=True, platform="cpu") == \
        2 * 8192 * (per_token_layer + scores(8192)) * layers
    assert shapes.activation_floor_bytes(config, 2, 8192, training=False, platform="cpu") == \
        2 * 8192 * per_token_layer
    assert shapes.activation_floor_bytes(config, 2, 8192) == 2 * 8192 * (per_token_layer + scores(8192)) * layers
