"""The user docs' whole path (corpus -> vocab -> shards -> pretrain -> export -> fine-tune) run literally: the bash
block after `<!-- the-whole-path -->` (docs/usage.md), in a fresh directory, at tiny sizes through the variables it
documents, without GLUE data (its fall-back to the checkout's labelled CSVs); then (slow) the fine-tune and `launch
local` examples, as written, on what it built."""
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys

import pytest

from tests.conftest import REPO_ROOT, SUITE_COMPILE_FLAGS, USER_DOCS, user_docs_text


def readme_blocks(marker: str) -> list[str]:
    """The bash blocks that follow the `<!-- MARKER -->` markers of README.md and docs/usage.md, in order."""
    found = re.findall(rf"<!-- {marker} -->\n```bash\n(.*?)\n```", user_docs_text(), re.S)
    assert found, f"{' and '.join(USER_DOCS)} have no bash block after <!-- {marker} -->"
    return found


def readme_path_block() -> str:
    """The bash block that follows the `<!-- the-whole-path -->` marker."""
    [block] = readme_blocks("the-whole-path")
    return block


def _head(source: pathlib.Path, target: pathlib.Path, lines: int, *, blank_line_end: bool = False) -> None:
    """The first `lines` lines of a real data file (with blank_line_end: on to the end of the sentence)."""
    kept = []
    with open(source, encoding="utf-8") as f:
        for line in f:
            if len(kept) >= lines and (not blank_line_end or not line.strip()):
                break
            kept.append(line)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text("".join(kept), encoding="utf-8")


def _fine_tune_inputs(shared_data: pathlib.Path, root: pathlib.Path) -> None:
    """The fine-tune examples' inputs under the docs' names, cut from the real data to a few hundred rows."""
    for split, rows in (("train", 200), ("dev", 64), ("test", 32)):
        _head(shared_data / "glue" / "RTE" / f"{split}.tsv", root / "glue_data" / "RTE" / f"{split}.tsv", 1 + rows)
    for split, lines in (("train", 1500), ("valid", 400), ("test", 400)):
        _head(shared_data / "conll2003" / f"{split}.txt", root / "conll2003" / f"{split}.txt", lines,
              blank_line_end=True)
    for name in ("train-v2.0.json", "dev-v2.0.json"):  # the one SQuAD 2.0 sample here: trained and predicted on
        (root / name).write_bytes((shared_data / "squad" / "sample-dev-v2.0.json").read_bytes())


def _strict(text: str):
    """JSON as a strict parser reads it (NaN / Infinity are errors)."""
    return json.loads(text, parse_constant=lambda name: (_ for _ in ()).throw(ValueError(f"not JSON: {name}")))


@pytest.fixture(scope="module")
def path_run(tmp_path_factory):
    """The path block run once in a fresh directory, as a user without GLUE data runs it: (directory, environment,
    its stdout)."""
    root = tmp_path_factory.mktemp("readme")
    # The console script of this interpreter's environment, as a user's shell would find it after `make install`;
    # the checkout's labelled CSVs where the block finds them when run in the checkout.
    bin_dir = pathlib.Path(sys.executable).parent
    env = dict(os.environ, STEPS="5", EPOCHS="0.01", REVIEWS=str(REPO_ROOT / "examples" / "reviews"),
               JAX_PLATFORMS="cpu", PATH=f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}")
    env.pop("GLUE_DIR", None)
    script = "set -euo pipefail\n" + readme_path_block()
    result = subprocess.run(["bash", "-c", script], cwd=root, env=env, capture_output=True, text=True,
                            timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return root, env, result.stdout


def _run_block(block: str, root: pathlib.Path, env: dict) -> None:
    result = subprocess.run(["bash", "-c", "set -euo pipefail\n" + block], cwd=root, env=env, capture_output=True,
                            text=True, timeout=900)
    assert result.returncode == 0, block + "\n" + result.stdout[-3000:] + result.stderr[-3000:]


def test_the_readme_path_runs_literally(path_run):
    tmp_path, _, stdout = path_run
    # The shards' shapes came from their metadata (bert-tiny's preset asks for 128 / 20).
    assert "from the shards' metadata: data.max_seq_length=64, data.max_predictions_per_seq=10\n" in stdout
    # Each step consumed the one before: the shards' vocab, the run's 5 steps, the export, the fine-tune's score.
    vocab = (tmp_path / "vocab" / "vocab.txt").read_text(encoding="utf-8").splitlines()
    metadata = json.loads(next((tmp_path / "records").glob("*.json")).read_text())
    assert len(vocab) > 500 and metadata["examples"] > 1000
    assert metadata["config"]["vocab"] == str((tmp_path / "vocab/vocab.txt").resolve())  # recorded absolute
    steps = [json.loads(line).get("step") for line in (tmp_path / "runs/p1/metrics.jsonl").read_text().splitlines()]
    assert max(s for s in steps if s is not None) == 5
    assert (tmp_path / "hf" / "model.safetensors").exists() and (tmp_path / "hf" / "vocab.txt").exists()
    # No GLUE here: the fine-tune fell back to the shipped CSVs, all 40 training rows, all 12 dev rows scored.
    assert not (tmp_path / "runs/mrpc").exists()
    reviews = _strict((tmp_path / "runs/reviews-p1/metrics.json").read_text())
    assert reviews["labels"] == ["negative", "positive"] and reviews["num_train_examples"] == 40
    assert 0 <= reviews["metrics"]["dev"]["accuracy"] <= 1
    assert len((tmp_path / "runs/reviews-p1/dev_predictions.jsonl").read_text().splitlines()) == 12


@pytest.mark.slow  # ~2 minutes here: MiniLM fine-tuned for 20 steps, two predictions, transformers on the export
def test_the_quick_path_runs_offline_from_minilm_by_its_hub_id(tmp_path, minilm_dir):
    """The README's quick path blocks, as written, in a directory with the checkout's examples, offline with an
    empty hub cache: `--init sentence-transformers/all-MiniLM-L6-v2` is the installed package's copy."""
    shutil.copytree(REPO_ROOT / "examples", tmp_path / "examples")
    bin_dir = pathlib.Path(sys.executable).parent
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_HUB_CACHE=str(tmp_path / "hub"), JAX_PLATFORMS="cpu",
               XLA_FLAGS=SUITE_COMPILE_FLAGS, PATH=f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}")
    for block in readme_blocks("the-quick-path"):
        _run_block(block, tmp_path, env)
    result = _strict((tmp_path / "runs/reviews/metrics.json").read_text())
    assert result["labels"] == ["negative", "positive"] and result["num_train_examples"] == 40
    assert result["metrics"]["dev"]["accuracy"] > result["majority_baseline"]["metrics"]["dev"]["accuracy"]
    rows = [json.loads(line) for line in (tmp_path / "predictions.jsonl").read_text().splitlines()]
    assert [row["where"].rsplit(":", 1)[1] for row in rows] == ["2", "3", "4"]
    assert {row["label"] for row in rows} <= {"negative", "positive"}
    card = (tmp_path / "runs/reviews/hf/README.md").read_text()
    assert "\nbase_model: sentence-transformers/all-MiniLM-L6-v2\n" in card  # the card and --init agree
    assert not (tmp_path / "hub").exists()  # nothing fetched


@pytest.mark.slow  # MiniLM fine-tuned for a step of 32 pairs, then sentence-transformers on the export
def test_the_readmes_embedding_path_runs_offline_from_minilm_by_its_hub_id(tmp_path, minilm_dir):
    """The README's embedding block, as written, offline: the checkout's pairs in, a directory out that
    sentence-transformers loads and embeds with (MiniLM's 384 dimensions)."""
    shutil.copytree(REPO_ROOT / "examples", tmp_path / "examples")
    bin_dir = pathlib.Path(sys.executable).parent
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_HUB_CACHE=str(tmp_path / "hub"), JAX_PLATFORMS="cpu",
               XLA_FLAGS=SUITE_COMPILE_FLAGS, PATH=f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}")
    [block] = readme_blocks("the-embedding-path")
    result = subprocess.run(["bash", "-c", "set -euo pipefail\n" + block], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert result.stdout.strip().splitlines()[-1] == "(1, 384)"
    metrics = _strict((tmp_path / "runs/search/metrics.json").read_text())
    assert metrics["num_train_examples"] == 32 and metrics["total_steps"] == 1
    modules = _strict((tmp_path / "runs/search/hf/modules.json").read_text())
    assert [m["path"] for m in modules] == ["", "1_Pooling", "2_Normalize"]
    assert not (tmp_path / "hub").exists()  # nothing fetched


@pytest.mark.slow  # ~4 minutes here beside the path's 3
def test_the_readme_examples_run_as_written_on_what_the_path_built(shared_data, path_run):
    """The fine-tune examples and the `launch local` example, each block after its marker, as written."""
    tmp_path, env, _ = path_run
    _fine_tune_inputs(shared_data, tmp_path)
    # On this machine's one CPU device, as a user's shell has it (the suite's 8 forced devices would refuse SQuAD's
    # default batch of 12); the suite's cheaper compile kept.
    user_env = dict(env, XLA_FLAGS=SUITE_COMPILE_FLAGS)
    for block in readme_blocks("the-fine-tune-examples"):
        _run_block(block, tmp_path, user_env)
    rte = _strict((tmp_path / "runs/rte/metrics.json").read_text())
    assert 0 <= rte["metrics"]["dev"]["accuracy"] <= 1 and rte["num_train_examples"] == 200
    assert len((tmp_path / "runs/rte/RTE.tsv").read_text().splitlines()) == 1 + 32
    squad = _strict((tmp_path / "runs/squad2/metrics.json").read_text())
    assert "exact" in json.dumps(squad) and (tmp_path / "runs/squad2/null_odds.json").exists()
    ner = _strict((tmp_path / "runs/ner/metrics.json").read_text())
    assert 0 <= ner["metrics"]["valid"]["overall"]["f1"] <= 1
    assert (tmp_path / "runs/ner/hf/config.json").exists() and (tmp_path / "runs/ner/checkpoint").is_dir()

    # 2 processes, each on its own shard of the records the block writes.
    [block] = readme_blocks("the-launch-local-example")
    _run_block(block, tmp_path, user_env)
    assert (tmp_path / "runs/mp/COMPLETED").exists()
    steps = [json.loads(line).get("step") for line in (tmp_path / "runs/mp/metrics.jsonl").read_text().splitlines()]
    assert max(s for s in steps if s is not None) == 100


@pytest.mark.slow  # ~1 minute of CPU (3 minutes of wall on a busy 2-core machine): six commands, each a start
def test_the_readmes_modernbert_path_runs_offline_from_text_to_fill_mask_and_a_fine_tune(tmp_path):
    """README.md's `<!-- the-modernbert-path -->` block, as written, at tiny size offline, on "the corpus above" (the
    README's `demo-corpus`) in a directory with the checkout's examples: a BPE vocabulary of ModernBERT's kind, its
    shards, modernbert-tiny pretrained on them, the export filling a mask in transformers' pipeline with the tokenizer
    the run trained with, and a fine-tune from the run."""
    [block] = readme_blocks("the-modernbert-path")
    shutil.copytree(REPO_ROOT / "examples", tmp_path / "examples")
    bin_dir = pathlib.Path(sys.executable).parent
    env = dict(os.environ, STEPS="5", EPOCHS="0.01", HF_HUB_OFFLINE="1", HF_HUB_CACHE=str(tmp_path / "hub"),
               JAX_PLATFORMS="cpu", XLA_FLAGS=SUITE_COMPILE_FLAGS,
               PATH=f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}")
    result = subprocess.run(["bash", "-c", "set -euo pipefail\nbertjax demo-corpus --out corpus/\n" + block],
                            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]

    tokenizer = json.loads((tmp_path / "bpe/tokenizer.json").read_text(encoding="utf-8"))
    size = len(tokenizer["model"]["vocab"]) + sum(t["id"] >= len(tokenizer["model"]["vocab"])
                                                  for t in tokenizer["added_tokens"])
    assert size % 64 == 0 and tokenizer["pre_tokenizer"]["type"] == "ByteLevel"
    metadata = json.loads(next((tmp_path / "shards").glob("*.json")).read_text())
    assert metadata["config"]["vocab"] == str((tmp_path / "bpe/tokenizer.json").resolve())
    assert metadata["config"]["packing"] and not metadata["config"]["next_sentence_prediction"]
    steps = [json.loads(line).get("step") for line in (tmp_path / "runs/modern/metrics.jsonl").read_text().splitlines()]
    assert max(s for s in steps if s is not None) == 5
    # The export carries the tokenizer the run trained with; the pipeline filled the mask with one of its tokens.
    assert (tmp_path / "modern-hf/tokenizer.json").read_text() == (tmp_path / "bpe/tokenizer.json").read_text()
    assert json.loads((tmp_path / "modern-hf/config.json").read_text())["architectures"] == ["ModernBertForMaskedLM"]
    filled = [line for line in result.stdout.splitlines() if line.startswith("{'score': ")]
    assert len(filled) == 1 and "'sequence': 'A" in filled[0], result.stdout[-2000:]
    reviews = _strict((tmp_path / "runs/reviews-modern/metrics.json").read_text())
    assert reviews["labels"] == ["negative", "positive"] and reviews["num_train_examples"] == 40
    assert (tmp_path / "runs/reviews-modern/hf/tokenizer.json").exists()
    assert not (tmp_path / "hub").exists()  # nothing fetched
