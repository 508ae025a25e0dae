"""`bertjax compile --embedding`: `finetune embedding`'s train step compiled by XLA:TPU for a TPU topology (libtpu's
compile-only devices) on this CPU machine; its fit, the candidates' gather, the estimated time and price."""
import functools
import json

import pytest

pytest.importorskip("libtpu", reason="bertjax compile needs libtpu (pip install -e '.[test]' installs jax[tpu])")
# Compile-only executables cannot be read back from the suite's cache by a compile-only process: not written.
pytestmark = pytest.mark.usefixtures("no_cache_writes")

from bertjax.cli import main as bertjax_main  # noqa: E402
from bertjax.cloud import embedding_compile, topologies  # noqa: E402
from bertjax.model.bert.config import BertConfig  # noqa: E402
from bertjax.pretraining import metrics  # noqa: E402

# One layer of width 64 (one head of 64: the TPU's lane width) and a 512-token vocabulary: a compile of seconds;
# the intermediate width sets how much activation memory a row needs.
def _tiny(intermediate: int = 128) -> BertConfig:
    return BertConfig(vocab_size=512, hidden_size=64, num_hidden_layers=1, num_attention_heads=1,
                      intermediate_size=intermediate, max_position_embeddings=128)


@functools.cache
def _compiled(batch: int, seq: int, cache_chunk: int = 0, intermediate: int = 128, hard_negatives: bool = False,
              name: str = "v5e:2x2") -> dict:
    """The report of the tiny embedding step compiled for `name` (each configuration once per session), priced at
    $1.20 a chip-hour."""
    topology = topologies.parse_topology(name)
    step = embedding_compile.EmbeddingStep(_tiny(intermediate), batch, seq, hard_negatives, cache_chunk)
    return embedding_compile.compile_for_topology(step, topology, topologies.compile_only_devices(topology), 1.2)


def _check_report(result: dict, batch: int) -> None:
    """What every compiled embedding step of `batch` rows (hard negatives: 3 texts a row) on 4 chips reports."""
    assert (result["chips"], result["fits"], result["per_chip_batch"], result["texts_per_row"]) == (4, True,
                                                                                                 batch / 4, 3)
    assert 0 < result["hbm_bytes_per_chip"] < result["hbm_capacity_bytes_per_chip"]
    # Every chip gathers the whole batch's candidates (positives and hard negatives, [B * 2, 64] float32) for its
    # anchors to score: an all-gather of those bytes in the compiled program.
    assert result["candidates_bytes"] == batch * 2 * 64 * 4
    gathered = result["collectives"]["all-gather"]["bytes_by_dtype"]["f32"]
    assert gathered == result["candidates_bytes"], result["collectives"]
    # XLA:TPU's estimate of the step; pairs/s and the price of a million pairs follow from it (by hand).
    seconds = result["estimated_step_seconds"]
    assert result["step_time_source"] == "estimated" and 0 < seconds <= result["estimated_step_seconds_high"]
    assert result["pairs_per_second"] == pytest.approx(batch / seconds)
    assert result["usd_per_million_pairs"] == pytest.approx(4 * 1.2 * seconds / 3600 / batch * 1e6)
    # The model's FLOPs: every text's encoder forward and backward, as metrics counts them for pretraining.
    assert result["model_flops_per_step"] == batch * 3 * metrics.train_flops(_tiny(), 32, 32, 0, 0)
    text = embedding_compile.describe(result)
    assert "XLA's estimate (not a measurement)" in text and "per million pairs at $1.2 per chip-hour" in text


def test_the_embedding_step_compiles_for_a_slice_with_its_gather_time_and_price():
    _check_report(_compiled(64, 32, hard_negatives=True), 64)


@pytest.mark.slow  # a compile of its own (~1-2 min on a busy 2-core machine)
def test_the_cached_step_gathers_the_same_and_embeds_each_chunk_twice():
    one_pass, cached = _compiled(64, 32, hard_negatives=True), _compiled(64, 32, 16, hard_negatives=True)
    _check_report(cached, 64)
    assert "cached gradients in chunks of 16 rows" in embedding_compile.describe(cached)
    # Each chunk embedded twice (without, then with gradients): about 4/3 of the one pass's FLOPs (XLA's count of
    # the chunks' loop body times the chunks). Its memory at a batch this small is the fixed part's: see below.
    assert 1.2 < cached["xla_flops_per_step"] / one_pass["xla_flops_per_step"] < 1.6


def test_cached_gradients_fit_a_batch_whose_one_pass_step_does_not():
    # 8,192 rows of a 16,384-wide intermediate layer: the one-pass step's activations exceed a v5e chip's HBM (XLA says
    # so early: seconds); cached in chunks of 256 rows the same batch fits, with the same gather.
    one_pass = _compiled(8192, 64, 0, 16384)
    assert not one_pass["fits"] and one_pass["hbm_bytes_per_chip"] > one_pass["hbm_capacity_bytes_per_chip"]
    assert "DOES NOT FIT" in embedding_compile.describe(one_pass)


@pytest.mark.slow  # a compile of a wide layer (minutes on a busy 2-core machine)
def test_the_cached_step_fits_the_batch_the_one_pass_step_does_not():
    one_pass, cached = _compiled(8192, 64, 0, 16384), _compiled(8192, 64, 256, 16384)
    assert not one_pass["fits"]
    assert cached["fits"] and cached["hbm_bytes_per_chip"] < one_pass["hbm_capacity_bytes_per_chip"] / 4
    assert cached["collectives"]["all-gather"]["bytes_by_dtype"]["f32"] == 8192 * 64 * 4


def test_fit_batch_finds_the_largest_batch_within_an_eighth(monkeypatch):
    """The search alone (each compile minutes for a real model): a step fits up to a batch; doubling from the batch
    asked, then halving the interval, on multiples of the chips and the chunk, each batch compiled once."""
    topology = topologies.parse_topology("v5e:2x2")
    compiled = []

    def stand_in(step, topology, devices, price):  # fits up to `largest` rows
        compiled.append(step.batch_size)
        return {"fits": step.batch_size <= largest, "global_batch": step.batch_size, "hbm_bytes_per_chip": 0,
                "hbm_capacity_bytes_per_chip": 1}

    monkeypatch.setattr(embedding_compile, "compile_for_topology", stand_in)
    for largest, asked, chunk in ((5000, 1024, 0), (5000, 65536, 0), (300_000, 65536, 1024), (2, 64, 0)):
        compiled.clear()
        step = embedding_compile.EmbeddingStep(_tiny(), asked, 32, cache_chunk=chunk)
        found = embedding_compile.fit_batch(step, topology, [])
        unit = 1024 if chunk else 4
        if largest < unit:
            assert not found["fits"] and found["global_batch"] == unit
            continue
        assert found["fits"] and found["global_batch"] % unit == 0 and found["global_batch"] <= largest
        assert largest - found["global_batch"] < max(unit, found["global_batch"] // 8) + unit
        assert found["global_batch"] + found["fit_resolution"] > largest
        assert len(compiled) == len(set(compiled)) < 12


def test_the_command_checks_its_flags_before_compiling(capsys, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("compiled")

    monkeypatch.setattr(embedding_compile, "compile_embedding_step", refuse)
    base = ["compile", "--embedding", "--topology", "v5e:2x2"]
    for args, said in (([], "--embedding takes --init-config MODEL"),
                       (["--init-config", "mini", "--set", "train.steps=1"], "not --set"),
                       (["--init-config", "nothing"], "--init-config nothing: neither a model preset"),
                       (["--init-config", "mini", "--batch-size", "30"], "not divisible by the 4 data-parallel"),
                       (["--init-config", "mini", "--batch-size", "64", "--cache-chunk", "24"],
                        "--cache-chunk 24 must divide --batch-size 64"),
                       (["--init-config", "mini", "--max-seq-length", "4096"], "--max-seq-length")):
        assert bertjax_main(base + args) == 2, args
        assert said in capsys.readouterr().err.strip().splitlines()[-1], args
    assert bertjax_main(["compile", "--topology", "v5e:2x2"]) == 2  # neither step named
    assert "give --config (a pretraining preset) or --embedding --init-config MODEL" in capsys.readouterr().err


@pytest.mark.slow  # a compile of its own through the command (~1 min on a busy 2-core machine)
def test_the_command_prints_the_report_in_json(capsys, tmp_path):
    # A config.json as HF writes it (BERT's), the model read from it: no weights.
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"model_type": "bert", "vocab_size": 512, "hidden_size": 64, "num_hidden_layers": 1,
                                  "num_attention_heads": 1, "intermediate_size": 128,
                                  "max_position_embeddings": 128}))
    assert bertjax_main(["compile", "--embedding", "--init-config", str(config), "--topology", "v5e:2x2",
                         "--batch-size", "64", "--max-seq-length", "32", "--price-per-chip-hour", "1.2",
                         "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert (result["task"], result["global_batch"], result["hidden_size"], result["fits"]) == ("embedding", 64, 64,
                                                                                                True)
    assert result["usd_per_million_pairs"] == pytest.approx(
        4 * 1.2 * result["estimated_step_seconds"] / 3600 / 64 * 1e6)
