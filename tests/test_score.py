"""A pretraining run ends with its scores: `pretrain --score-glue` scores a tiny completed run on real GLUE tasks
(../shared/data/glue) by MosaicBERT's recipe, quick-capped, two seeds; summary.json holds each run's own metrics,
each task's mean over seeds and the average of the tasks scored, a task without its data is skipped and said, a
stopped run is not scored, and `bertjax score` again skips what is done."""
import json
import os
import sys

import numpy as np
import pytest

from bertjax.data.demo_corpus import write_demo_corpus
from bertjax.finetune import score
from bertjax.runtime import preemption
from tests import stall_watch
from tests.conftest import REPO_ROOT

# Two tasks with their data (both binary: their fine-tunes share one compiled step), and QNLI, whose train.tsv
# ../shared/data lacks.
TASKS = "cola,mrpc,qnli"
CAPS = ("--score-set", f"tasks={TASKS}", "--score-set", "seeds=0,1", "--score-set", "epochs=1",
        "--score-set", "max_seq_length=32", "--score-set", "max_train_examples=64",
        "--score-set", "max_eval_examples=64")
SCORE_FLAGS = ["--tasks", TASKS, "--seeds", "0,1", "--epochs", "1", "--max-seq-length", "32",
               "--max-train-examples", "64", "--max-eval-examples", "64"]


def _bertjax(argv, monkeypatch, capfd) -> tuple[int, str]:
    """`bertjax ARGV` in this process (its subprocesses' output included): (exit status, stdout + stderr)."""
    from bertjax import cli

    monkeypatch.setattr(cli.host_memory, "keep_freed_memory_if_cpu_job", lambda environ: False)
    capfd.readouterr()
    code = cli.main(argv)
    out, err = capfd.readouterr()
    return code, out + err


@pytest.fixture(scope="module")
def glue_dir(shared_data):
    path = shared_data / "glue"
    if not (path / "CoLA" / "train.tsv").is_file() or not (path / "MRPC" / "train.tsv").is_file():
        pytest.skip(f"GLUE's CoLA and MRPC not found under {path}")
    return path


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_demo_corpus(str(tmp_path_factory.mktemp("corpus")))[0]


def _pretrain_argv(workdir, corpus, vocab, glue_dir) -> list[str]:
    return ["pretrain", "--config", "bert-tiny", "--workdir", str(workdir), "--set", f"data.input={corpus}",
            "--set", f"data.vocab={vocab}", "--set", "data.max_seq_length=64",
            "--set", "data.max_predictions_per_seq=10", "--set", "train.steps=4", "--set", "train.batch_size=8",
            "--score-glue", str(glue_dir), *CAPS]


@pytest.fixture(scope="module")
def scored_run(tmp_path_factory, corpus, minilm_dir, glue_dir):
    """A tiny BERT pretraining run, completed and scored, in a process of its own as a user runs it: (workdir, its
    output)."""
    workdir = tmp_path_factory.mktemp("run") / "tiny"
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
    result = stall_watch.run([sys.executable, "-m", "bertjax.cli",
                              *_pretrain_argv(workdir, corpus, minilm_dir / "vocab.txt", glue_dir)],
                             env=env, cwd=REPO_ROOT)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return workdir, result.stdout + result.stderr


def test_a_completed_run_ends_with_its_scores(scored_run):
    workdir, completed = scored_run
    out = workdir / "scores"
    assert f"the run completed; scoring it: bertjax score {workdir} --glue" in completed
    assert "qnli: not scored" in completed and "QNLI/train.tsv" in completed
    summary = json.loads((out / "summary.json").read_text())
    assert summary["checkpoint"] == str(workdir / "checkpoints" / "4")  # the step scored, not the run directory
    assert summary["split"] == "dev" and summary["aggregate"] == "mean over seeds"
    assert summary["average_over"] == ["cola", "mrpc"] and summary["not_scored"] == ["qnli"]
    assert summary["tasks"]["qnli"] == {"missing": ["QNLI/train.tsv"]}
    assert "not a GLUE score" in summary["average_is"] and "cola, mrpc" in summary["average_is"]
    assert summary["max_train_examples"] == 64 and summary["max_eval_examples"] == 64
    for task in ("cola", "mrpc"):
        entry = summary["tasks"][task]
        assert [run["seed"] for run in entry["runs"]] == [0, 1]
        for run in entry["runs"]:
            # Each run's numbers are its own fine-tune's, as `finetune glue` wrote them.
            own = json.loads((out / run["run"] / "metrics.json").read_text())
            assert run["run"] == os.path.join(task, f"seed{run['seed']}")
            assert run["metrics"] == own["metrics"] and run["score"] == own["score"]
            assert own["settings"]["seed"] == run["seed"] and own["max_seq_length"] == 32
            assert own["num_train_examples"] == 64 and own["settings"]["max_eval_examples"] == 64
            recipe = score.RECIPES[task]
            assert own["settings"]["learning_rate"] == recipe.learning_rate
            assert own["settings"]["batch_size"] == recipe.batch_size
            assert own["settings"]["warmup_proportion"] == 0.06
            assert own["settings"]["weight_decay"] == pytest.approx(0.1)  # 5e-6 (8e-6) per step over the lr
            # GLUE's score of the task, from its metrics by hand.
            metrics = own["metrics"]["dev"]
            expected = (metrics["f1"] + metrics["accuracy"]) / 2 if task == "mrpc" else metrics["mcc"]
            assert run["score"] == pytest.approx(expected)
        scores = [run["score"] for run in entry["runs"]]
        assert entry["score"] == pytest.approx(np.mean(scores))
        assert entry["score_min"] == min(scores) and entry["score_max"] == max(scores)
        assert entry["headline"] == score.HEADLINE[task]
        for name, value in entry["metrics"].items():
            assert value == pytest.approx(np.mean([run["metrics"]["dev"][name] for run in entry["runs"]]))
    assert summary["average"] == pytest.approx(np.mean([summary["tasks"][t]["score"] for t in ("cola", "mrpc")]))
    table = (out / "summary.md").read_text()
    assert "| qnli | not scored: no QNLI/train.tsv |" in table
    assert f"| mrpc | (f1 + accuracy) / 2 | 0: {100 * summary['tasks']['mrpc']['runs'][0]['score']:.2f}, 1: " in table
    assert f"| {100 * summary['average']:.2f} |" in table and "quick runs, not the recipe's scores" in table
    assert table in completed  # the table is printed too


def test_a_stopped_run_is_not_scored(scored_run, corpus, minilm_dir, glue_dir, tmp_path, monkeypatch, capfd):
    workdir = tmp_path / "stopped"
    code, text = _bertjax(_pretrain_argv(workdir, corpus, minilm_dir / "vocab.txt", glue_dir)
                          + ["--max-steps-this-run", "1"], monkeypatch, capfd)
    assert code == preemption.STOPPED_EXIT, text[-3000:]  # not done: `&&` goes no further
    assert "--score-glue: not scored: the run ended at step 1 of 4 (stopped); the same command completes it" in text
    assert (workdir / "checkpoints" / "1").is_dir() and not (workdir / "scores").exists()


def test_scoring_again_skips_finished_runs_and_refuses_other_settings(scored_run, glue_dir, monkeypatch, capfd):
    workdir, _ = scored_run
    out = workdir / "scores"
    before = {p: p.stat().st_mtime_ns for p in out.glob("*/seed*/metrics.json")}
    summary = (out / "summary.json").read_text()
    code, text = _bertjax(["score", str(workdir), "--glue", str(glue_dir), *SCORE_FLAGS], monkeypatch, capfd)
    assert code == 0, text[-3000:]
    assert text.count("finished earlier") == 4 and "fine-tuning" not in text
    assert {p: p.stat().st_mtime_ns for p in out.glob("*/seed*/metrics.json")} == before
    assert json.loads((out / "summary.json").read_text()) == json.loads(summary)

    changed = [flag if flag != "1" else "2" for flag in SCORE_FLAGS]  # --epochs 2
    code, text = _bertjax(["score", str(workdir), "--glue", str(glue_dir), *changed], monkeypatch, capfd)
    assert code == 2
    assert "belongs to another fine-tuning run (epochs: 1.0 -> 2.0): pass --overwrite" in text.splitlines()[-1]


def test_bad_score_settings_fail_before_anything_trains(tmp_path, glue_dir, monkeypatch, capfd):
    run = ["pretrain", "--config", "bert-tiny", "--workdir", str(tmp_path / "w"), "--score-glue", str(glue_dir)]
    for extra, message in (
            (["--score-set", "epoch=1"], "--score-set epoch: unknown config key (did you mean epochs?)"),
            (["--score-set", "tasks=wnli"], "tasks: wnli not scored"),
            (["--score-set", "seeds=1,1"], "seeds='1,1': expected distinct integers"),
            (["--dry-run"], "--score-glue scores a run that trained")):
        code, text = _bertjax(run + extra, monkeypatch, capfd)
        assert code == 2 and message in text.splitlines()[-1], text[-2000:]
    assert not (tmp_path / "w").exists()
    code, text = _bertjax(["score", str(tmp_path), "--glue", str(glue_dir)], monkeypatch, capfd)
    assert code == 2 and "is not a pretraining run directory (WORKDIR, whose scores/ it would hold): give --out DIR" \
        in text.splitlines()[-1]
    code, text = _bertjax(["score", str(tmp_path), "--glue", str(tmp_path), "--tasks", "mrpc", "--out",
                           str(tmp_path / "out")], monkeypatch, capfd)
    assert code == 2 and "none of the tasks asked (mrpc) has its train and dev files" in text.splitlines()[-1]
    assert "mrpc: not scored" in text and not (tmp_path / "out").exists()
