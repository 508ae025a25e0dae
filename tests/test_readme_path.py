"""The README's whole path (corpus -> vocab -> shards -> pretrain -> export -> GLUE fine-tune) run literally: the
bash block after `<!-- the-whole-path -->`, in a fresh directory, at tiny sizes through the variables it documents."""
import json
import os
import pathlib
import re
import subprocess
import sys

from tests.conftest import REPO_ROOT


def readme_path_block() -> str:
    """The bash block that follows the README's `<!-- the-whole-path -->` marker."""
    readme = (REPO_ROOT / "README.md").read_text(encoding="utf-8")
    found = re.search(r"<!-- the-whole-path -->\n```bash\n(.*?)\n```", readme, re.S)
    assert found, "README.md has no bash block after <!-- the-whole-path -->"
    return found.group(1)


def test_the_readme_path_runs_literally(shared_data, tmp_path):
    # The console script of this interpreter's environment, as a user's shell would find it after `make install`.
    bin_dir = pathlib.Path(sys.executable).parent
    env = dict(os.environ, STEPS="20", EPOCHS="0.01", GLUE_DIR=str(shared_data / "glue"), JAX_PLATFORMS="cpu",
               PATH=f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}")
    script = "set -euo pipefail\n" + readme_path_block()
    result = subprocess.run(["bash", "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True,
                            timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    # The shards' shapes came from their metadata (bert-tiny's preset asks for 128 / 20).
    assert "from the shards' metadata: data.max_seq_length=64, data.max_predictions_per_seq=10\n" in result.stdout
    # Each step consumed the one before: the shards' vocab, the run's 20 steps, the export, the fine-tune's score.
    vocab = (tmp_path / "vocab" / "vocab.txt").read_text(encoding="utf-8").splitlines()
    metadata = json.loads(next((tmp_path / "records").glob("*.json")).read_text())
    assert len(vocab) > 500 and metadata["examples"] > 1000 and metadata["config"]["vocab"] == "vocab/vocab.txt"
    steps = [json.loads(line).get("step") for line in (tmp_path / "runs/p1/metrics.jsonl").read_text().splitlines()]
    assert max(s for s in steps if s is not None) == 20
    assert (tmp_path / "hf" / "model.safetensors").exists() and (tmp_path / "hf" / "vocab.txt").exists()
    mrpc = json.loads((tmp_path / "runs/mrpc/metrics.json").read_text())
    assert "f1" in json.dumps(mrpc) and "accuracy" in json.dumps(mrpc)
