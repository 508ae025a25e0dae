"""Every JSON document or JSON Lines row bertjax reads has its nesting checked before Python's parser recurses into
it (bertjax/runtime/jsonio.py): a file nested thousands of levels deep ended in a RecursionError traceback naming
no file (exit 1), in `data create` a TensorFlow UnknownError naming neither file nor line. Now each kind of file the
probe found is one line naming the file (and the line of a JSON Lines row), exit 2; a file at the limit still reads,
and real tokenizer.json files pass unchanged."""
from __future__ import annotations

import json
import shutil

import pytest

from bertjax.cli import main as bertjax_main
from bertjax.runtime import jsonio
from tests.conftest import save_tiny_checkpoint, save_tiny_hf
from tests.test_messages import SQUAD, _classify, _error

DEPTH = 5000  # deep enough that Python's own parser fails (the premise is checked below), a 10 kB file
DEEP = '{"nested": ' + "[" * (DEPTH - 1) + "]" * (DEPTH - 1) + "}"


def _too_deep(source, what: str) -> str:
    return (f"{source}: JSON nested {DEPTH:,} levels deep (arrays or objects within each other; {jsonio.MAX_DEPTH} at "
            f"most); expected {what}")


def _depth(value) -> int:
    """The nesting of a parsed JSON value: the reference the scan is held to."""
    if isinstance(value, (dict, list)):
        return 1 + max(map(_depth, value.values() if isinstance(value, dict) else value), default=0)
    return 0


def test_the_deep_file_is_one_pythons_parser_cannot_read():
    with pytest.raises(RecursionError):
        json.loads(DEEP)
    assert jsonio.nesting_depth(DEEP) == DEPTH


@pytest.fixture(scope="module")
def bpe_dir(tmp_path_factory):
    """An HF tokenizer directory as `tokenizers`/transformers write it (ModernBERT's byte-level BPE)."""
    from tests import modernbert_fixture

    path = tmp_path_factory.mktemp("bpe")
    modernbert_fixture.bpe_tokenizer().save_pretrained(str(path))
    return path


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory, minilm_dir):
    return save_tiny_hf(tmp_path_factory.mktemp("hf") / "hf", minilm_dir / "vocab.txt", seed=0)


def _hf_with_tokenizer_json(hf_dir, bpe_dir, path, deep_file: str):
    """The tiny HF model with a tokenizer.json (and its tokenizer_config.json) instead of vocab.txt, `deep_file`
    of it replaced by the deep JSON."""
    shutil.copytree(hf_dir, path)
    (path / "vocab.txt").unlink()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(bpe_dir / name, path / name)
    (path / deep_file).write_text(DEEP)
    return path


@pytest.mark.parametrize("deep_file, what", [("tokenizer.json", "a tokenizer.json"),
                                             ("tokenizer_config.json", "a tokenizer's tokenizer_config.json"),
                                             ("config.json", "a model config (JSON)")])
def test_an_hf_directorys_deep_json_is_named(hf_dir, bpe_dir, tmp_path, capsys, deep_file, what):
    """`info` (as `convert`, `export`, --init, predict: one loader) of an HF directory whose tokenizer.json,
    tokenizer_config.json or config.json is nested too deep; the tokenizer.json checked before HF tokenizers' own
    parser sees it."""
    model = _hf_with_tokenizer_json(hf_dir, bpe_dir, tmp_path / "hf", deep_file)
    assert _error(capsys, ["info", str(model)]) == f"bertjax info: error: {_too_deep(model / deep_file, what)}"


@pytest.mark.parametrize("deep_file, what", [("tokenizer.json", "a tokenizer.json"),
                                             ("tokenizer_config.json", "a tokenizer's tokenizer_config.json")])
def test_a_deep_tokenizer_given_to_data_create_is_named(bpe_dir, tmp_path, capsys, deep_file, what):
    """`data create --vocab tokenizer.json` (data.tokenizers reads it and the tokenizer_config.json beside it)."""
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(bpe_dir / name, tmp_path / name)
    (tmp_path / deep_file).write_text(DEEP)
    (tmp_path / "corpus.txt").write_text("One sentence. Another one.\n")
    line = _error(capsys, ["data", "create", "--input", str(tmp_path / "corpus.txt"), "--vocab",
                           str(tmp_path / "tokenizer.json"), "--out", str(tmp_path / "out")])
    assert line == f"bertjax data: error: {_too_deep(tmp_path / deep_file, what)}"


def test_a_runs_and_a_fine_tunes_deep_records_are_named(tmp_path, capsys):
    """A pretraining run's config.json (`config show RUN`), a fine-tune's run.json (a rerun in its workdir) and a
    run's goodput account (`goodput`)."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text(DEEP)
    assert _error(capsys, ["config", "show", str(run)]) == (
        f"bertjax config: error: {_too_deep(run / 'config.json', 'a pretraining config (JSON)')}")

    workdir = tmp_path / "finetune"
    workdir.mkdir()
    (workdir / "run.json").write_text(DEEP)
    (workdir / "metrics.jsonl").write_text("")
    record = _too_deep(workdir / "run.json", "a fine-tune's run record (run.json)")
    assert _error(capsys, _classify(tmp_path, workdir)) == f"bertjax finetune: error: {record}"

    (run / "goodput").mkdir()
    (run / "goodput" / "run-1.json").write_text(DEEP)
    line = _error(capsys, ["goodput", str(run)])
    assert line.startswith(f"bertjax goodput: error: {run / 'goodput'}: no run accounts") and line.endswith(
        "unreadable: goodput/run-1.json" + _too_deep("", "a run's goodput account (JSON)")), line


def test_deep_squad_predictions_are_named(tmp_path, capsys):
    (tmp_path / "data.json").write_text(json.dumps(SQUAD))
    (tmp_path / "pred.json").write_text(DEEP)
    line = _error(capsys, ["eval", "squad", "--data", str(tmp_path / "data.json"), "--predictions",
                           str(tmp_path / "pred.json")])
    assert line == "bertjax eval: error: " + _too_deep(tmp_path / "pred.json",
                                                       "predictions (JSON: {question id: answer text})")


def _rows_with_a_deep_one(path, number: int, **fields):
    rows = [json.dumps({key: f"{value} {i}" if isinstance(value, str) else value for key, value in fields.items()})
            for i in range(6)]
    rows[number - 1] = DEEP
    path.write_text("\n".join(rows) + "\n")
    return path


def test_a_deep_json_lines_row_is_named_by_file_and_line(hf_dir, minilm_dir, tmp_path, capsys):
    """`finetune classify --train`, `predict --input` (the fine-tune readers) and `data create --input` (read inside
    tf.data, whose error used to be TensorFlow's UnknownError naming neither file nor line)."""
    train = _rows_with_a_deep_one(tmp_path / "train.jsonl", 3, text="a row", label=1)
    line = _error(capsys, ["finetune", "classify", "--train", str(train), "--init", hf_dir, "--workdir",
                           str(tmp_path / "work")])
    assert line == f"bertjax finetune: error: {_too_deep(f'{train}:3', 'a JSON object')}"
    line = _error(capsys, ["predict", "--model", hf_dir, "--input", str(train), "--output", str(tmp_path / "p.jsonl")])
    assert line == f"bertjax predict: error: {_too_deep(f'{train}:3', 'a JSON object')}"

    corpus = _rows_with_a_deep_one(tmp_path / "corpus.jsonl", 4, text="One sentence. Another one.")
    line = _error(capsys, ["data", "create", "--input", str(corpus), "--vocab", str(minilm_dir / "vocab.txt"),
                           "--out", str(tmp_path / "records")])
    assert line == "bertjax data: error: " + _too_deep(f"{corpus}: line 4", "a JSON object with a 'text' field")


def test_a_deep_first_row_is_detected_as_json_lines_and_named_by_its_reader(tmp_path):
    """Format detection by bytes: a first line too deep to parse is still an object's line (JSON Lines), so the
    reader names it, rather than the file being taken for plain text."""
    from bertjax.data import format_detect

    corpus = _rows_with_a_deep_one(tmp_path / "corpus.data", 1, text="One sentence.")
    assert format_detect.by_bytes(str(corpus)) == "jsonl"


def test_a_checkpoints_deep_json_item_is_one_line(minilm_dir, tmp_path, capsys):
    """A checkpoint's own JSON (its model_config, read by Orbax) nested too deep: `predict --model` read its
    description outside the checkpoint's error handling and ended in a RecursionError traceback."""
    checkpoint = tmp_path / "ckpt"
    save_tiny_checkpoint(checkpoint, minilm_dir / "vocab.txt", seed=0)
    (checkpoint / "model_config" / "metadata").write_text(DEEP)
    (tmp_path / "in.csv").write_text("text\na row\n")
    for argv in (["info", str(checkpoint)],
                 ["predict", "--model", str(checkpoint), "--input", str(tmp_path / "in.csv"), "--output",
                  str(tmp_path / "p.jsonl")]):
        line = _error(capsys, argv)
        assert line.startswith(f"bertjax {argv[0]}: error: {checkpoint}: cannot read the checkpoint ("), line


def test_json_at_the_limit_reads_and_one_level_more_is_refused(tmp_path):
    from bertjax.runtime.input_files import read_json

    for depth in (jsonio.MAX_DEPTH, jsonio.MAX_DEPTH + 1):
        path = tmp_path / f"{depth}.json"
        path.write_text('{"a": ' + "[" * (depth - 1) + '"[[{"' + "]" * (depth - 1) + "}")  # brackets in a string
        if depth <= jsonio.MAX_DEPTH:
            assert _depth(read_json(path, "a config")) == depth
            assert _depth(jsonio.loads(path.read_text(), "row", "a row")) == depth
        else:
            with pytest.raises(jsonio.TooDeep, match=rf"^{path}: JSON nested {depth} levels deep .*; expected a "
                                                     "config$"):
                read_json(path, "a config")


def test_json_that_does_not_parse_is_named_where_it_stops():
    """A document by line and column; a JSON Lines row (its source names the line) by column."""
    with pytest.raises(ValueError, match=r"^f\.jsonl: line 2: not valid JSON \(cut short\?\): Expecting value "
                                         r"\(column 7\); expected a row$"):
        jsonio.loads('{"a": ', "f.jsonl: line 2", "a row", row=True)
    with pytest.raises(ValueError, match=r"^c\.json: not valid JSON: Expecting ',' delimiter \(line 2, column 9\); "
                                         r"expected a config$"):
        jsonio.loads('{"a": 1,\n "b": 2 "c": 3}', "c.json", "a config")


@pytest.mark.parametrize("text", ['[]', '{}', '"[[[["', r'["a\"[[{", [1, {"b": [2]}]]', '{"a": "\\\\", "b": [[]]}',
                                  '[[["\\u005b"], "}"]]', '  [ [ ] , [ [ [ ] ] ] ]  ', '3', '"x"'])
def test_the_depth_scan_agrees_with_pythons_parser(text):
    """Brackets inside strings (escaped quotes, backslashes, unicode escapes) are not counted."""
    assert jsonio.nesting_depth(text) == _depth(json.loads(text))


def test_real_tokenizer_files_pass_the_guard_unchanged(minilm_dir, bpe_dir):
    """MiniLM's tokenizer.json (the released model's) and one HF tokenizers wrote: the guard passes them, the spec
    keeps their text byte for byte, and the tokenizer built from it gives HF tokenizers' own pieces."""
    from tokenizers import Tokenizer

    from bertjax.data.json_tokenizer import HostJsonTokenizer, read_spec

    for directory in (minilm_dir, bpe_dir):
        path = directory / "tokenizer.json"
        text = path.read_text(encoding="utf-8")
        assert 1 < jsonio.nesting_depth(text) == _depth(json.loads(text)) <= 10
        config = json.loads((directory / "tokenizer_config.json").read_text())
        spec = read_spec(path, config, {})
        assert spec["json"] == text
        ours = HostJsonTokenizer.from_spec(spec, str(path))
        theirs = Tokenizer.from_file(str(path))
        theirs.no_padding()  # MiniLM's file pads every text to 128
        sentence = "The guard reads every tokenizer file unchanged."
        assert ours.pieces([sentence])[0].tolist() == theirs.encode(sentence, add_special_tokens=False).ids


def test_records_read_back_leave_a_deep_line_out_as_a_cut_one(tmp_path):
    """A run's own JSON Lines (metrics.jsonl) and a LOCK: a damaged line or record is passed over as a cut one is,
    never a RecursionError."""
    from bertjax.interop.model_card import metric_records
    from bertjax.runtime.workdir_lock import parse

    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 2.0}) + "\n" + DEEP + "\n" +
                                            json.dumps({"step": 2, "loss": 1.5}) + "\n")
    assert [r["step"] for r in metric_records(str(tmp_path))] == [1, 2]
    assert parse(DEEP.encode()) == {}
