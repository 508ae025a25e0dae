"""The jobs end to end on gs:// only (the session's local Cloud Storage, conftest.gcs_standin): a pretraining run
with its corpus, vocab and workdir in a bucket, SIGKILLed after a checkpoint and resumed bit-exactly from the
bucket; `info`, `export` to gs://, `goodput` on its workdir. Slow: each is a real job in a subprocess."""
import json
import signal
import subprocess
import sys

import numpy as np
import pytest

from bertjax.checkpoint import complete_steps
from tests import stall_watch
from tests.conftest import REPO_ROOT
from tests.test_pretrain import EVERY, MIDDLE, STEPS, _argv, _env, _run, _run_until

pytestmark = pytest.mark.slow


def _gfile():
    import tensorflow as tf

    return tf.io.gfile


@pytest.fixture(scope="module")
def gs_corpus(gcs_standin, minilm_dir, tmp_path_factory):
    """The demo corpus and MiniLM's vocab, copied into the bucket."""
    from bertjax.data.demo_corpus import write_demo_corpus
    from tests.conftest import GCS_BUCKET

    train_path, _ = write_demo_corpus(str(tmp_path_factory.mktemp("corpus")))
    gfile, root = _gfile(), f"gs://{GCS_BUCKET}/e2e-inputs"
    gfile.copy(train_path, f"{root}/train.txt", overwrite=True)
    gfile.copy(str(minilm_dir / "vocab.txt"), f"{root}/vocab.txt", overwrite=True)
    return f"{root}/train.txt", f"{root}/vocab.txt"


def _records(workdir) -> list[dict]:
    return [json.loads(line) for line in _gfile().GFile(f"{workdir}/metrics.jsonl").read().splitlines()]


def _losses(workdir) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in _records(workdir) if "loss" in r}


def _params(checkpoint):
    import jax

    from bertjax.checkpoint import load_model

    return jax.tree_util.tree_leaves(load_model(checkpoint).params)


@pytest.fixture(scope="module")
def gs_uninterrupted(gs_corpus):
    from tests.conftest import GCS_BUCKET

    workdir = f"gs://{GCS_BUCKET}/e2e-uninterrupted"
    _run(_argv(workdir, gs_corpus), devices=1)
    return workdir


def test_pretrain_on_gs_killed_after_a_checkpoint_resumes_bit_exactly_from_the_bucket(gs_uninterrupted, gs_corpus):
    from tests.conftest import GCS_BUCKET

    workdir = f"gs://{GCS_BUCKET}/e2e-killed"
    code, output = _run_until(_argv(workdir, gs_corpus), f"step {MIDDLE}/", signal.SIGKILL, devices=1)
    assert code == -signal.SIGKILL, output[-3000:]
    # The steps bertjax itself takes for complete (on gs://, Orbax's commit marker written): a save the kill cut
    # short leaves a numbered directory without it, which a resume rightly passes over.
    complete = complete_steps(workdir)
    assert complete and complete[-1] in (MIDDLE - EVERY, MIDDLE), complete
    output = _run(_argv(workdir, gs_corpus), devices=1)
    assert f"resumed from {workdir}/checkpoints/{complete[-1]}" in output, output[-3000:]
    expected, resumed = _losses(gs_uninterrupted), _losses(workdir)
    assert [resumed[s] for s in range(complete[-1] + 1, STEPS + 1)] == \
           [expected[s] for s in range(complete[-1] + 1, STEPS + 1)]
    for a, b in zip(_params(f"{workdir}/checkpoints/{STEPS}"), _params(f"{gs_uninterrupted}/checkpoints/{STEPS}")):
        assert np.array_equal(np.asarray(a), np.asarray(b))
    assert not _gfile().exists(f"{workdir}/LOCK")


def _bertjax(*args):
    result = subprocess.run([sys.executable, "-m", "bertjax.cli", *args], env=_env(1), cwd=REPO_ROOT,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result.stdout


def test_info_export_and_goodput_of_a_gs_workdir(gs_uninterrupted):
    import safetensors.numpy

    checkpoint = f"{gs_uninterrupted}/checkpoints/{STEPS}"
    assert "parameters" in _bertjax("info", checkpoint).lower()
    out = f"{gs_uninterrupted}-hf"
    _bertjax("export", checkpoint, "--out", out)
    exported = safetensors.numpy.load(_gfile().GFile(f"{out}/model.safetensors", "rb").read())
    ours = _params(checkpoint)
    assert sum(v.size for v in exported.values()) >= sum(np.asarray(p).size for p in ours) - 10_000
    assert json.loads(_gfile().GFile(f"{out}/config.json").read())["hidden_size"] == 128
    report = _bertjax("goodput", gs_uninterrupted)
    assert "goodput" in report.lower()


def test_two_pretrain_jobs_started_at_once_on_one_gs_workdir_exactly_one_runs(gs_corpus):
    """Both processes race for the bucket's LOCK (create-if-absent by generation): one trains to the end and
    releases it, the other is refused in one line naming the holder, and nothing of its own reaches the bucket."""
    from tests.conftest import GCS_BUCKET

    workdir = f"gs://{GCS_BUCKET}/e2e-two-jobs"
    seeds = (0, 7)
    codes, outputs, pids = stall_watch.run_at_once(
        [_argv(workdir, gs_corpus, "--set", f"train.seed={seed}") for seed in seeds], env=_env(1), cwd=REPO_ROOT)
    assert sorted(codes) == [0, 2], list(zip(codes, [o[-2000:] for o in outputs]))
    runner, refused = (0, 1) if codes[0] == 0 else (1, 0)
    assert f"{workdir} is in use by another job (pid {pids[runner]}" in outputs[refused], outputs[refused][-2000:]
    assert len(outputs[refused].strip().splitlines()) <= 3, outputs[refused]
    config = json.loads(_gfile().GFile(f"{workdir}/config.json").read())
    assert config["train"]["seed"] == seeds[runner]
    steps = [r["step"] for r in _records(workdir) if "loss" in r]
    assert steps == list(range(1, STEPS + 1))
    assert not _gfile().exists(f"{workdir}/LOCK")
