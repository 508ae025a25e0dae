"""The Trainer-level options of every fine-tune job: gradient accumulation is one big batch, bfloat16 trains with
float32 master weights, --metric-for-best keeps and exports the best evaluation's params (not the last), early
stopping stops, and a run with all of them resumes bit-exactly after SIGTERM."""
from __future__ import annotations

import json
import random

import jax
import numpy as np
import pytest

from bertjax.model.bert.config import BertConfig
from bertjax.finetune.settings import TrainSettings
from bertjax.finetune.table_data import TableSpec
from tests.conftest import save_tiny_hf
from tests.test_classify_job import _sentence, _write_csv


@pytest.fixture(scope="module")
def tiny_init(tmp_path_factory, minilm_dir) -> str:
    return save_tiny_hf(tmp_path_factory.mktemp("init") / "hf", minilm_dir / "vocab.txt", seed=0)


def _trainer(init: str, **settings):
    from bertjax.finetune.trainer import Trainer, classification_loss
    from bertjax.interop.load import load_init
    from bertjax.model.bert.model import BertForSequenceClassification

    ckpt, tokenizer = load_init(init)
    config = ckpt.config.replace(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    trainer = Trainer(BertForSequenceClassification(config, 2), config, ckpt.params, classification_loss,
                      TrainSettings(**{"batch_size": 16, "epochs": 1, "seed": 3, "learning_rate": 1e-3, **settings}))
    rng = random.Random(0)
    labels = np.array([i % 2 for i in range(48)], np.int32)
    encoded = tokenizer.encode([_sentence(rng, "great" if y else "awful") for y in labels], 32)
    return trainer, {**encoded, "labels": labels}


def test_the_dev_set_predicted_again_with_the_same_params_is_not_run_again(tiny_init):
    """A job evaluates its dev set after the last epoch, then predicts it for its metrics and predictions file: the
    second ask, the same arrays with the same params, returns the first outputs without running the model; after
    a step (new params) or for other arrays it runs again, and gives what a fresh run of the model gives."""
    trainer, arrays = _trainer(tiny_init)
    dev = {k: v[:20] for k, v in arrays.items()}
    first = trainer.predict(dev)
    rows = trainer.predicted_rows
    assert trainer.predict(dev) is first and trainer.predicted_rows == rows
    copy = {k: v.copy() for k, v in dev.items()}
    np.testing.assert_array_equal(trainer.predict(copy), first)
    assert trainer.predicted_rows == rows + 20
    trainer.train(arrays, epoch_end=lambda epoch, seconds: {"rows": len(trainer.predict(dev))})
    after = trainer.predicted_rows
    trained = trainer.predict(dev)
    assert trainer.predicted_rows == after and after == rows + 40   # evaluated once after training, not again
    assert not np.allclose(trained, first)
    np.testing.assert_allclose(trained, np.asarray(trainer._predict(trainer.params, {
        k: dev[k] for k in ("input_ids", "input_mask", "segment_ids")})), rtol=1e-5, atol=1e-6)


def test_grad_accumulation_is_one_big_batch(tiny_init):
    whole, arrays = _trainer(tiny_init)
    whole.train(arrays)
    accumulated, _ = _trainer(tiny_init, grad_accum_steps=2)  # 2 micro-batches of 8 rows, one row a device
    accumulated.train(arrays)
    for a, b in zip(jax.tree_util.tree_leaves(whole.params), jax.tree_util.tree_leaves(accumulated.params)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-6, atol=2e-6)  # only the sum order differs
    first = jax.tree_util.tree_leaves(whole.params)[0]
    assert not np.allclose(np.asarray(first), np.asarray(jax.tree_util.tree_leaves(_trainer(tiny_init)[0].params)[0]))


def test_bfloat16_computes_in_bfloat16_and_keeps_float32_weights(tiny_init):
    trainer, arrays = _trainer(tiny_init, dtype="bfloat16")
    assert trainer.module.config.dtype == "bfloat16"
    from bertjax.model.bert.model import BertModel

    hidden = BertModel(trainer.module.config).apply({"params": trainer.params["bert"]}, arrays["input_ids"][:8],
                                                    arrays["input_mask"][:8], arrays["segment_ids"][:8])[0]
    assert hidden.dtype == np.dtype("bfloat16")
    trainer.train(arrays)
    assert {np.asarray(x).dtype for x in jax.tree_util.tree_leaves(trainer.params)} == {np.dtype("float32")}
    float32, _ = _trainer(tiny_init)
    float32.train(arrays)
    deltas = [np.abs(np.asarray(a) - np.asarray(b)).max() for a, b in
              zip(jax.tree_util.tree_leaves(trainer.params), jax.tree_util.tree_leaves(float32.params))]
    assert 0 < max(deltas) < 1e-2  # another rounding, the same training


def test_best_evaluation_is_kept_and_exported_and_early_stopping_stops(tiny_init, tmp_path):
    """Dev labels are the training labels inverted: the more the model learns, the worse its dev accuracy, so the
    best evaluation is an early one and every later one is worse."""
    from bertjax.finetune import classify

    rng = random.Random(5)
    words = {"pos": "great", "neg": "awful"}
    flipped = {"pos": "neg", "neg": "pos"}
    rows = [[_sentence(rng, words[y]), y] for y in ["pos", "neg"] * 80]
    dev_rows = [[_sentence(rng, words[y]), flipped[y]] for y in ["pos", "neg"] * 16]
    train, dev = (_write_csv(tmp_path / f"{n}.csv", ["text", "label"], r) for n, r in (("t", rows), ("d", dev_rows)))
    settings = TrainSettings(learning_rate=1e-2, batch_size=16, epochs=8, seed=1, eval_batch_size=16,
                             eval_every=5, metric_for_best="accuracy", early_stopping_patience=8)
    work = tmp_path / "work"
    result = classify.run(str(train), str(work), settings, TableSpec(), init=tiny_init, dev=str(dev),
                          max_seq_length=32, export_hf=True)
    evals = [json.loads(line) for line in (work / "metrics.jsonl").read_text().splitlines()]
    evals = [(e["step"], e["eval_accuracy"]) for e in evals if "eval_accuracy" in e]
    best_step, best_value = max(evals, key=lambda e: (e[1], -e[0]))
    assert result["best"] == {"metric": "accuracy", "value": best_value, "step": best_step, "stale": 8}
    assert evals[-1][1] < best_value  # the last evaluation is worse than the kept one
    # Early stopping: 8 evaluations after the best, before the 80 steps of 8 epochs.
    assert result["stopped_early"] and evals[-1][0] == best_step + 8 * 5 == result["steps_run"] < 80
    assert result["metrics"]["dev"]["accuracy"] == best_value  # the job evaluated the kept params

    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForSequenceClassification.from_pretrained(work / "hf").eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(work / "hf")
    with torch.no_grad():
        logits = model(**tokenizer([r[0] for r in dev_rows], padding=True, return_tensors="pt")).logits.numpy()
    names = result["labels"]
    assert np.mean([names[i] == r[1] for i, r in zip(logits.argmax(-1), dev_rows)]) == best_value


def test_bfloat16_accumulation_and_best_resume_bit_exactly(tmp_path, capsys, minilm_dir):
    """SIGTERM mid-run, then the same command: the same weights as the uninterrupted run, to the bit."""
    from bertjax.checkpoint import load_model
    from bertjax.cli import main
    from bertjax.runtime.preemption import STOPPED_EXIT
    from tests.conftest import save_tiny_checkpoint
    from tests.test_finetune_resume import _sigterm_once_training, _steps

    init = save_tiny_checkpoint(tmp_path / "init", minilm_dir / "vocab.txt", seed=0)
    rng = random.Random(7)
    rows = [[_sentence(rng, "great" if i % 2 else "awful"), "pos" if i % 2 else "neg"] for i in range(160)]
    train = _write_csv(tmp_path / "train.csv", ["text", "label"], rows)
    dev = _write_csv(tmp_path / "dev.csv", ["text", "label"], rows[:32])

    def argv(workdir):
        return ["finetune", "classify", "--train", str(train), "--dev", str(dev), "--init", init, "--workdir",
                str(workdir), "--epochs", "3", "--batch-size", "16", "--max-seq-length", "32", "--learning-rate",
                "1e-3", "--log-every", "1", "--save-every", "0", "--save-checkpoint", "--dtype", "bfloat16",
                "--grad-accum-steps", "2", "--metric-for-best", "accuracy", "--eval-every", "3"]

    assert main(argv(tmp_path / "whole")) == 0
    cut = tmp_path / "cut"
    watcher = _sigterm_once_training(cut)
    assert main(argv(cut)) == STOPPED_EXIT
    watcher.join()
    assert "of 30 (SIGTERM), its state saved in" in capsys.readouterr().out
    stopped_at = max(_steps(cut))
    assert 1 <= stopped_at < 30
    assert main(argv(cut)) == 0
    assert f"resumed from {cut}/train_state/{stopped_at}" in capsys.readouterr().out
    whole, resumed = (load_model(str(w / "checkpoint")).params for w in (tmp_path / "whole", cut))
    for a, b in zip(jax.tree_util.tree_leaves(whole), jax.tree_util.tree_leaves(resumed)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    results = [json.loads((w / "metrics.json").read_text()) for w in (tmp_path / "whole", cut)]
    assert results[0]["best"] == results[1]["best"] and results[0]["metrics"] == results[1]["metrics"]


def test_a_metric_for_best_the_job_lacks_is_refused_before_the_checkpoint_loads(tiny_init, tmp_path, capsys):
    """`--metric-for-best f1` on a single-label classifier (it names accuracy, macro_f1, micro_f1, mcc): one line
    listing the valid names, exit 2 within seconds, nothing compiled and no workdir left; likewise without --dev."""
    import time

    from bertjax.cli import main

    rng = random.Random(2)
    rows = [[_sentence(rng, "great" if i % 2 else "awful"), "pos" if i % 2 else "neg"] for i in range(32)]
    train = _write_csv(tmp_path / "train.csv", ["text", "label"], rows)
    work = tmp_path / "work"
    argv = ["finetune", "classify", "--train", str(train), "--dev", str(train), "--init", tiny_init, "--workdir",
            str(work), "--batch-size", "16", "--max-seq-length", "32", "--metric-for-best", "f1"]
    started = time.perf_counter()
    assert main(argv) == 2
    assert time.perf_counter() - started < 30  # imports on a loaded machine; before, it failed after the first eval
    captured = capsys.readouterr()
    assert ("error: --metric-for-best 'f1' is not among this job's dev metrics; expected one of accuracy, macro_f1, "
            "mcc, micro_f1") in captured.err
    assert "compiling" not in captured.out and "training:" not in captured.out and not work.exists()
    without_dev = argv[:4] + argv[6:-1] + ["accuracy"]  # no --dev, a metric the classifier has
    assert main(without_dev) == 2
    assert "--metric-for-best accuracy: this run has no dev set to evaluate" in capsys.readouterr().err
    assert not work.exists()


def test_a_resume_that_adds_or_changes_the_metric_for_best_keeps_the_weights_and_tracks_it_anew(tmp_path):
    """A train state saved without a best (or with one by another metric) restores its params and moments under a
    --metric-for-best: the best is tracked again from the resumed step, with a line saying so."""
    from bertjax.finetune.trainer import BestTracker, TrainStateSaver

    params = {"w": jax.numpy.arange(6.0).reshape(2, 3)}
    moments = {"m": jax.numpy.ones(3)}
    TrainStateSaver(str(tmp_path / "plain")).save(4, params, moments)
    by_f1 = BestTracker("f1", 0)
    by_f1.update(4, {"f1": 0.5}, params)
    TrainStateSaver(str(tmp_path / "by_f1")).save(4, params, moments, by_f1)
    for run, metric, kept in (("plain", "accuracy", False), ("by_f1", "accuracy", False), ("by_f1", "f1", True)):
        said, best = [], BestTracker(metric, 0)
        zeros = jax.tree_util.tree_map(jax.numpy.zeros_like, (params, moments))
        restored = TrainStateSaver(str(tmp_path / run)).restore(*zeros, best, said.append, config=BertConfig())
        np.testing.assert_array_equal(np.asarray(restored[0]["w"]), np.asarray(params["w"]))
        np.testing.assert_array_equal(np.asarray(restored[1]["m"]), np.asarray(moments["m"]))
        assert restored[2] == 4
        assert (best.value, best.step) == ((0.5, 4) if kept else (None, None))
        assert said == ([] if kept else [f"--metric-for-best {metric}: no best evaluation by it saved; tracked "
                                         f"from step 4 on"])


@pytest.fixture(scope="module")
def short_run(tiny_init):
    """A 20-step fine-tune (--log-every 50, the default) evaluated at steps 10 and 20, its output captured as a log
    file takes it (not a terminal), with the programs each evaluation lowered (JAX's own compile events)."""
    import contextlib
    import io

    from jax._src.dispatch import JAXPR_TO_MLIR_MODULE_EVENT

    trainer, arrays = _trainer(tiny_init, epochs=7, max_steps=20, eval_every=10, eval_batch_size=8)
    dev = {k: v[:40] for k, v in arrays.items()}  # 40 rows: 3 batches of 16 (the train batch: more than 8)
    compiled, evaluations = [], []

    def count(event: str, seconds: float, **_) -> None:
        if event == JAXPR_TO_MLIR_MODULE_EVENT:
            compiled[-1] += 1

    def evaluate() -> dict:
        compiled.append(0)
        logits = trainer.predict(dev)
        evaluations.append(compiled[-1])
        return {"accuracy": float(np.mean(logits.argmax(-1) == dev["labels"]))}

    out = io.StringIO()
    jax.monitoring.register_event_duration_secs_listener(count)
    try:
        with contextlib.redirect_stdout(out):
            compiled.append(0)
            trainer.train(arrays, evaluate=evaluate)
    finally:
        jax.monitoring.unregister_event_duration_listener(count)
    return out.getvalue(), evaluations


def test_a_short_run_written_to_a_log_says_where_it_is_every_tenth_of_its_steps(short_run):
    out, _ = short_run
    steps = [int(m) for m in __import__("re").findall(r"step (\d+)/20 epoch=", out)]
    assert steps == list(range(2, 21, 2))  # before: only step 20 (log_every 50)


def test_the_console_loss_is_the_mean_since_the_last_record_and_says_of_which_steps(tiny_init, tmp_path):
    """A progress line's loss is the mean of the steps since the last metrics.jsonl record (at a logged step, that
    record's own loss), not the step's: its label says so, with the steps it averages."""
    import contextlib
    import io
    import re

    trainer, arrays = _trainer(tiny_init, epochs=3, log_every=4)   # 3 steps an epoch; a line every step (9 // 10)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        trainer.train(arrays, workdir=str(tmp_path))
    lines = re.findall(r"step (\d+)/9 epoch=\S+ mean_loss=(\S+) \((steps? [\d-]+)\) learning_rate=", out.getvalue())
    assert [(int(step), averaged) for step, _, averaged in lines] == [
        (1, "step 1"), (2, "steps 1-2"), (3, "steps 1-3"), (4, "steps 1-4"), (5, "step 5"), (6, "steps 5-6"),
        (7, "steps 5-7"), (8, "steps 5-8"), (9, "step 9")], out.getvalue()
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    recorded = {r["step"]: r["loss"] for r in records if "loss" in r}
    assert sorted(recorded) == [4, 8, 9]
    for step, shown, _ in lines:
        if int(step) in recorded:
            assert float(shown) == pytest.approx(recorded[int(step)], rel=1e-3)


def test_a_second_evaluation_compiles_nothing_and_each_eval_line_says_its_rows_and_seconds(short_run):
    import re

    out, evaluations = short_run
    assert len(evaluations) == 2 and evaluations[0] > 0 and evaluations[1] == 0
    assert re.search(r"predicting 40 rows \(3 batches of 16\)", out), out  # the train batch, not --eval-batch-size 8
    lines = re.findall(r"eval at step (\d+): accuracy=\S+ \((\d+) rows, (\d+\.\d) s\)", out)
    assert [(step, rows) for step, rows, _ in lines] == [("10", "40"), ("20", "40")], out


def test_the_eta_sets_aside_the_steps_that_compiled_a_new_length_and_the_first_evaluation(tiny_init, monkeypatch):
    """A batch of a length bucket not met before compiles the train step again: that step's time is set aside from
    the ETA (at step 2 of a 10-minute MiniLM run it said 1h53m), as is the first evaluation's (it compiles the
    predict step); later steps of a length met before and later evaluations are not."""
    from bertjax.finetune.trainer import Trainer
    from bertjax.pretraining.metrics import MetricsWriter

    trainer, arrays = _trainer(tiny_init, epochs=3, eval_every=3, length_bucket=8)
    arrays["input_mask"][2:, 6:] = 0   # two rows longer than 8 tokens: a batch holding one is cut at 16, others at 8
    lengths, aside, predicting = [], [], []
    batches = Trainer._batches

    def recorded(self, *args):   # the training batches' lengths, in step order
        for batch, rows in batches(self, *args):
            if not predicting:
                lengths.append(batch["input_ids"].shape[1])
            yield batch, rows

    def evaluate():
        predicting.append(True)
        logits = trainer.predict(arrays)
        predicting.clear()
        return {"accuracy": float(np.mean(logits.argmax(-1) == arrays["labels"]))}

    monkeypatch.setattr(Trainer, "_batches", recorded)
    monkeypatch.setattr(MetricsWriter, "set_aside", lambda self, seconds, steps=0: aside.append((len(lengths), steps)))
    trainer.train(arrays, evaluate=evaluate)
    new = [step for step in range(2, len(lengths) + 1) if lengths[step - 1] not in lengths[:step - 1]]
    assert new, lengths   # rows of different lengths: more than one bucket met after the first step
    assert [step for step, steps in aside if steps == 1] == new
    assert [step for step, steps in aside if steps == 0] == [3]   # the first evaluation only (steps 3, 6, 9)


def test_a_cpu_fine_tune_scans_the_encoder_and_writes_it_per_layer(tiny_init, tmp_path):
    """On a CPU the encoder's layers are held stacked (XLA compiles one layer), and the kept model is written
    per layer (`layer_0`..), as every earlier bertjax wrote it; on other platforms they stay unrolled (ModernBERT's
    scanned, its steps following torch: tests/test_modernbert_finetune.py)."""
    import orbax.checkpoint as ocp

    from bertjax import checkpoint
    from bertjax.finetune.trainer import scans_layers, write_fine_tuned
    from bertjax.interop.load import load_init
    from bertjax.model import layer_layout

    trainer, _ = _trainer(tiny_init)
    assert trainer.config.scan_layers and layer_layout.is_stacked(trainer.params)
    init = load_init(tiny_init)[0]
    write_fine_tuned(trainer.params, init, str(tmp_path), bertjax_checkpoint=True, hf=False,
                     architecture="BertForSequenceClassification", id2label={0: "a", 1: "b"})
    with ocp.Checkpointer(ocp.CompositeCheckpointHandler(**checkpoint.item_handlers())) as reader:
        stored = checkpoint._stored_params(reader, checkpoint.orbax_path(str(tmp_path / "checkpoint")))
    assert sorted(k for k in stored["bert"] if k.startswith("layer")) == \
        [f"layer_{i}" for i in range(init.config.num_hidden_layers)]
    assert not checkpoint.load_model(str(tmp_path / "checkpoint")).config.scan_layers
    assert scans_layers("cpu") and not scans_layers("tpu") and not scans_layers("gpu")
