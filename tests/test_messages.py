"""Bad input on the command line gets one line that names the file, not a traceback (exit code 2)."""
from __future__ import annotations

import json
import os
import re
from pathlib import Path

import numpy as np
import pytest

from bertjax.cli import main as bertjax_main
from tests import stall_watch
from tests.conftest import save_tiny_checkpoint


class Payload:
    """Stands for any pickled object that is not a tensor."""


def _error(capsys, argv: list[str]) -> str:
    """Runs `bertjax argv`; asserts exit code 2 and one error line; returns it."""
    assert bertjax_main(argv) == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("bertjax ")]
    assert len(lines) == 1, lines
    return lines[0]


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory, minilm_dir) -> str:
    return save_tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny", minilm_dir / "vocab.txt", seed=0)


@pytest.mark.parametrize("damage", ["truncated params", "garbage metadata"])
def test_a_damaged_checkpoint_is_named(tiny_checkpoint, tmp_path, capsys, damage):
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(tiny_checkpoint, broken)
    if damage == "truncated params":
        for path in (broken / "params").rglob("*"):
            if path.is_file() and path.stat().st_size > 64 and path.name != "_METADATA":
                path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    else:
        (broken / "params" / "_METADATA").write_bytes(np.random.default_rng(0).bytes(300))
    line = _error(capsys, ["info", str(broken)])
    assert f"{broken}: cannot read the checkpoint" in line


SQUAD = {"version": "v2.0", "data": [{"title": "t", "paragraphs": [{"context": "Paris is in France.", "qas": [
    {"id": "q1", "question": "Where is Paris?", "is_impossible": False,
     "answers": [{"text": "France", "answer_start": 12}]}]}]}]}


@pytest.mark.parametrize("predictions, message", [
    ({}, r"none of its 0 question id\(s\) is one of the 1 questions"),
    ({"other": "France"}, r"none of its 1 question id\(s\) is one of the 1 questions"),
    (["France"], r"expected a JSON object \{question id: answer text\}, got list"),
    ({"q1": 3}, r"got dict with non-string answers"),
])
def test_eval_squad_refuses_predictions_of_another_shape_or_dataset(tmp_path, capsys, predictions, message):
    (tmp_path / "data.json").write_text(json.dumps(SQUAD))
    (tmp_path / "pred.json").write_text(json.dumps(predictions))
    line = _error(capsys, ["eval", "squad", "--data", str(tmp_path / "data.json"), "--predictions",
                           str(tmp_path / "pred.json")])
    assert str(tmp_path / "pred.json") in line and re.search(message, line)


def test_eval_squad_warns_about_ids_it_ignores(tmp_path, capsys):
    (tmp_path / "data.json").write_text(json.dumps(SQUAD))
    (tmp_path / "pred.json").write_text(json.dumps({"q1": "France", "x": "a", "y": "b"}))
    assert bertjax_main(["eval", "squad", "--data", str(tmp_path / "data.json"), "--predictions",
                         str(tmp_path / "pred.json")]) == 0
    captured = capsys.readouterr()
    assert "2 of its 3 question id(s) are not in" in captured.err
    assert json.loads(captured.out)["exact"] == 100.0


def test_an_empty_glue_file_is_named(tiny_checkpoint, tmp_path, capsys):
    (tmp_path / "SST-2").mkdir()
    (tmp_path / "SST-2" / "train.tsv").write_text("sentence\tlabel\n")
    (tmp_path / "SST-2" / "dev.tsv").write_text("sentence\tlabel\ngood\t1\n")
    line = _error(capsys, ["finetune", "glue", "--task", "sst2", "--data", str(tmp_path), "--init", tiny_checkpoint,
                           "--workdir", str(tmp_path / "work")])
    assert f"{tmp_path / 'SST-2' / 'train.tsv'}: no examples" in line


def test_a_tf_checkpoint_without_its_data_file_is_named(tmp_path, capsys, minilm_dir):
    import tensorflow as tf

    prefix = str(tmp_path / "model.ckpt")
    variables = {"bert/embeddings/word_embeddings": tf.Variable(np.zeros((4, 2), np.float32))}
    checkpoint = tf.train.Checkpoint(**{k.replace("/", "_"): v for k, v in variables.items()})
    written = checkpoint.write(prefix)
    for data in Path(tmp_path).glob("model.ckpt.data-*"):
        data.unlink()
    (tmp_path / "bert_config.json").write_text(json.dumps({
        "vocab_size": 4, "hidden_size": 4, "num_hidden_layers": 1, "num_attention_heads": 2, "intermediate_size": 8,
        "hidden_act": "gelu", "hidden_dropout_prob": 0.1, "attention_probs_dropout_prob": 0.1,
        "max_position_embeddings": 16, "type_vocab_size": 2, "initializer_range": 0.02}))
    line = _error(capsys, ["convert", "--from", "tf", written, "--config", str(tmp_path / "bert_config.json"),
                           "--vocab", str(minilm_dir / "vocab.txt"), "--out", str(tmp_path / "out")])
    assert written in line


def test_a_pickle_with_code_is_refused_with_the_safetensors_advice(tmp_path, capsys):
    torch = pytest.importorskip("torch")
    directory = tmp_path / "hf"
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps({"model_type": "bert", "vocab_size": 4, "hidden_size": 4,
                                                       "num_attention_heads": 2, "intermediate_size": 8}))
    # An object of a class of ours: loading it would import and run our code, which weights_only refuses.
    torch.save({"weights": Payload()}, directory / "pytorch_model.bin")
    line = _error(capsys, ["info", str(directory)])
    assert "pytorch_model.bin holds more than tensors" in line and "never unpickles code" in line
    assert "weights_only=False" not in line


def _all_drawn(controller: int) -> bytes:
    """Everything written to a pseudo-terminal whose terminal side is closed (then closes the controller)."""
    drawn = b""
    while True:
        try:
            chunk = os.read(controller, 65536)
        except OSError:  # the terminal side is closed: all read
            break
        if not chunk:
            break
        drawn += chunk
    os.close(controller)
    return drawn


@pytest.mark.parametrize("columns", [0, 100])
def test_progress_bar_draws_on_any_terminal(columns):
    # A pseudo-terminal as `script` or `docker exec -t` give one: unsized (0 columns) or sized.
    import fcntl
    import pty
    import struct
    import termios

    from bertjax.runtime.console import Console

    controller, terminal = pty.openpty()
    fcntl.ioctl(terminal, termios.TIOCSWINSZ, struct.pack("HHHH", 24 if columns else 0, columns, 0, 0))
    with os.fdopen(terminal, "w") as stream:
        console = Console(stream=stream)
        console.start_progress(10)
        console.advance(10)
        console.line("a line above the bar")
        console.close_progress()
    drawn = _all_drawn(controller)
    assert b"10/10" in drawn and b"a line above the bar" in drawn, drawn


def test_progress_is_a_bar_on_a_terminal_and_counted_lines_in_a_log():
    """console.Progress (feature extraction, cross-validation, prediction): on a terminal a bar of its units and
    no count lines; in a log (a file) the count and ETA as lines; both said before and timed after."""
    import io
    import pty

    from bertjax.runtime.console import Console, Progress

    controller, terminal = pty.openpty()
    with os.fdopen(terminal, "w") as stream:
        work = Progress("cross-validating C", 3, unit="fold", console=Console(stream=stream), every_s=0)
        for _ in range(3):
            work.advance()
        work.close()
    drawn = _all_drawn(controller)
    assert b"cross-validating C (3 folds) ..." in drawn and b"| 0/3 [" in drawn, drawn  # tqdm's bar
    assert b"fold 1/3" not in drawn and b"cross-validating C: done in" in drawn, drawn

    log = io.StringIO()
    work = Progress("predicting 20 rows", 2, console=Console(stream=log), every_s=0, detail=" of 16")
    work.advance()
    work.advance()
    work.close("predicted 20 rows")
    messages = [line.split(" ", 1)[1] for line in log.getvalue().splitlines()]
    assert messages[0] == "predicting 20 rows (2 batches of 16) ..."
    assert re.fullmatch(r"predicting 20 rows: batch 1/2, eta \d+s", messages[1]), messages
    assert re.fullmatch(r"predicted 20 rows in \d+s", messages[2]) and len(messages) == 3, messages


def test_a_vocab_with_a_duplicate_token_is_one_line_naming_it(tmp_path, capsys, minilm_dir):
    tokens = (minilm_dir / "vocab.txt").read_text(encoding="utf-8").splitlines()
    tokens.insert(5000, "guitar")  # already at another line
    (tmp_path / "vocab.txt").write_text("".join(t + "\n" for t in tokens), encoding="utf-8")
    (tmp_path / "corpus.txt").write_text("A sentence.\nAnother one.\n\nA second document.\nIts end.\n")
    line = _error(capsys, ["data", "create", "--input", str(tmp_path / "corpus.txt"), "--vocab",
                           str(tmp_path / "vocab.txt"), "--out", str(tmp_path / "out")])
    first = tokens.index("guitar") + 1
    assert line == (f"bertjax data: error: vocab {tmp_path / 'vocab.txt'}: token 'guitar' is on line {first} and "
                    f"again on line 5001; each token must appear once (its line number is its id)")


def test_mask_is_needed_only_to_mask(minilm_dir):
    from bertjax.data.data_config import MaskingConfig
    from bertjax.data.masking import masker_for_tokenizer
    from bertjax.data.tokenizers import WordPieceTokenizer

    tokens = [t if t != "[MASK]" else "[unused999]" for t in
              (minilm_dir / "vocab.txt").read_text(encoding="utf-8").splitlines()]
    tokenizer = WordPieceTokenizer(tokens, source="no-mask vocab")  # features and fine-tuning need no [MASK]
    assert tokenizer.mask_id is None and tokenizer.encode(["a guitar"], max_len=8)["input_ids"][0][1] > 0
    with pytest.raises(ValueError, match="vocab no-mask vocab has no \\[MASK\\] token, which masked-LM pretraining"):
        masker_for_tokenizer(MaskingConfig(), tokenizer)


def test_small_messages_name_the_right_flag_and_file(tmp_path, minilm_dir):
    from bertjax.data.corpus import expand_inputs
    from bertjax.pretraining.config import load_config

    with pytest.raises(ValueError, match=r"max_predictions_per_seq=130 exceeds the 125 maskable tokens"):
        load_config("bert-tiny", ["data.input=x", "data.vocab=v", "data.max_predictions_per_seq=130"])
    literal = tmp_path / "corp[1].txt"  # glob characters in a real name
    literal.write_text("text\n")
    assert expand_inputs([str(literal)]) == [str(literal)]


@pytest.mark.parametrize("job", [["finetune", "glue", "--task", "mrpc", "--data", "GLUE"],
                                 ["finetune", "squad", "--version", "2.0", "--train", "SQUAD"]])
def test_a_sequence_longer_than_the_position_table_is_refused_up_front(tiny_checkpoint, shared_data, tmp_path,
                                                                       capsys, job):
    job = [str(shared_data / "glue") if a == "GLUE" else
           str(shared_data / "squad" / "sample-dev-v2.0.json") if a == "SQUAD" else a for a in job]
    line = _error(capsys, [*job, "--init", tiny_checkpoint, "--workdir", str(tmp_path / "w"),
                           "--max-seq-length", "1024"])
    assert line.endswith("error: --max-seq-length 1024 exceeds the model's max_position_embeddings 128: give at "
                         "most 128"), line


def test_info_of_a_damaged_checkpoint_ends_on_its_line_every_time(tiny_checkpoint, tmp_path):
    """As a program (two runs: Orbax's dying threads printed 'Event loop is closed' tracebacks after the line in
    one of three): the line is last, exit 2."""
    import shutil
    import sys

    broken = tmp_path / "broken"
    shutil.copytree(tiny_checkpoint, broken)
    for path in (broken / "params").rglob("*"):
        if path.is_file() and path.stat().st_size > 64 and path.name != "_METADATA":
            path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    for _ in range(2):
        done = stall_watch.run([sys.executable, "-m", "bertjax.cli", "info", str(broken)])
        assert done.returncode == 2
        last = done.stderr.rstrip("\n").splitlines()[-1]
        assert last.startswith(f"bertjax info: error: {broken}: cannot read the checkpoint"), done.stderr[-2000:]


def _with_config(source: Path, out: Path, config_file: str, **changes) -> str:
    """A copy of the checkpoint directory `source` whose config (the JSON file `config_file` in it) says `changes`."""
    import shutil

    shutil.copytree(source, out)
    values = json.loads((out / config_file).read_text())
    (out / config_file).write_text(json.dumps({**values, **changes}))
    return str(out)


CONFIG_EDITS = [({"hidden_size": 16}, "hidden_size=16", "LayerNorm/bias has shape (32,) (the config gives (16,))"),
                ({"vocab_size": 1000}, "vocab_size=1000",
                 "word_embeddings/embedding has shape (30522, 32) (the config gives (1000, 32))")]


@pytest.mark.parametrize("changes, said, tensor", CONFIG_EDITS)
def test_a_checkpoint_config_that_disagrees_with_its_tensors_is_refused_naming_both(
        tiny_checkpoint, shared_data, tmp_path, capsys, changes, said, tensor):
    """An Orbax checkpoint's model_config edited to another size: info, export and a fine-tune's --init refuse,
    naming the field and value and the tensor and its shape; nothing is written."""
    edited = _with_config(Path(tiny_checkpoint), tmp_path / "edited", "model_config/metadata", **changes)
    for argv in (["info", edited], ["export", edited, "--out", str(tmp_path / "hf")],
                 ["finetune", "glue", "--task", "mrpc", "--data", str(shared_data / "glue"), "--init", edited,
                  "--workdir", str(tmp_path / "w")]):
        line = _error(capsys, argv)
        assert f"error: {edited}: model_config says {said} but tensor bert/embeddings/" in line, line
        assert line.endswith(tensor), line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["edited"]


@pytest.mark.parametrize("changes, said, tensor", [
    ({"hidden_size": 16}, "hidden_size=16", "(30522, 32) (the config gives (30522, 16))"),
    ({"vocab_size": 1000}, "vocab_size=1000", "(30522, 32) (the config gives (1000, 32))")])
def test_an_hf_config_that_disagrees_with_its_tensors_is_refused_naming_both(
        minilm_dir, shared_data, tmp_path, capsys, changes, said, tensor):
    """The same for an HF directory's config.json: convert and a fine-tune's --init refuse."""
    from tests.conftest import save_tiny_hf

    source = save_tiny_hf(tmp_path / "source", minilm_dir / "vocab.txt", seed=0)
    edited = _with_config(Path(source), tmp_path / "edited", "config.json", **changes)
    for argv in (["convert", edited, "--from", "hf", "--out", str(tmp_path / "out")],
                 ["finetune", "glue", "--task", "mrpc", "--data", str(shared_data / "glue"), "--init", edited,
                  "--workdir", str(tmp_path / "w")]):
        line = _error(capsys, argv)
        assert line.endswith(f"error: {edited}: config.json says {said} but tensor "
                             f"embeddings.word_embeddings.weight has shape {tensor}"), line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["edited", "source"]


def test_a_config_json_too_big_for_the_machine_is_one_line_before_anything_is_allocated(minilm_dir, shared_data,
                                                                                        tmp_path, capsys):
    """An HF config.json of absurd size: info and a fine-tune's --init refuse in one line naming the field and the
    memory; `pretrain --config init` (a process) exits 2 in seconds with that line last, leaving no workdir."""
    import subprocess
    import sys
    import time

    from tests.conftest import save_tiny_hf

    source = save_tiny_hf(tmp_path / "source", minilm_dir / "vocab.txt", seed=0)
    edited = _with_config(Path(source), tmp_path / "edited", "config.json", vocab_size=10**10)
    said = "vocab_size=10000000000: the model's "
    for argv in (["info", edited], ["finetune", "glue", "--task", "mrpc", "--data", str(shared_data / "glue"),
                                    "--init", edited, "--workdir", str(tmp_path / "w")]):
        line = _error(capsys, argv)
        assert f"{edited}/config.json: invalid BertConfig: {said}" in line and "GiB of memory" in line, line
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "bertjax.cli", "pretrain", "--config", "init", "--init", edited,
                           "--workdir", str(tmp_path / "run")], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr[-2000:]
    assert time.monotonic() - started < 90  # imports on a loaded machine; an XLA compile would take minutes
    last = done.stderr.rstrip("\n").splitlines()[-1]
    assert last.startswith("bertjax pretrain: error: ") and said in last and "Traceback" not in done.stderr, last
    assert sorted(p.name for p in tmp_path.iterdir()) == ["edited", "source"]


@pytest.mark.parametrize("escape", ["dot-dot", "absolute", "symlink", "hub cache blob"])
def test_a_sharded_index_naming_a_file_outside_the_model_directory_is_refused(minilm_dir, tmp_path, capsys, escape):
    """model.safetensors.index.json names the shard files; one outside the model directory (`..`, an absolute
    path, a symlink out of it) is never read: one line naming the index and the entry. Inside, the shards read, and
    so do the hub cache's links from a snapshot into its blobs."""
    from safetensors.numpy import load

    from tests.conftest import save_tiny_hf

    snapshots = tmp_path / "models--owner--tiny" / "snapshots"  # the hub cache's layout
    model = Path(save_tiny_hf(snapshots / "rev", minilm_dir / "vocab.txt", seed=0))
    weights = (model / "model.safetensors").read_bytes()
    (model / "model.safetensors").unlink()
    (model / "model-00001-of-00001.safetensors").write_bytes(weights)
    (snapshots / "outside.safetensors").write_bytes(weights)  # readable: only the check keeps it from being read

    def index(entry):
        (model / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": {}, "weight_map": {name: entry for name in load(weights)}}))

    index("model-00001-of-00001.safetensors")
    assert bertjax_main(["info", str(model)]) == 0
    entry = {"dot-dot": "../outside.safetensors", "absolute": str(snapshots / "outside.safetensors")}.get(
        escape, "linked.safetensors")
    if escape == "symlink":
        (model / "linked.safetensors").symlink_to(snapshots / "outside.safetensors")
    if escape == "hub cache blob":
        (tmp_path / "models--owner--tiny" / "blobs").mkdir()
        (tmp_path / "models--owner--tiny" / "blobs" / "0123abcd").write_bytes(weights)
        (model / "linked.safetensors").symlink_to("../../blobs/0123abcd")
    index(entry)
    capsys.readouterr()
    if escape == "hub cache blob":
        assert bertjax_main(["info", str(model)]) == 0
        return
    line = _error(capsys, ["info", str(model)])
    assert line.endswith(f"error: {model}/model.safetensors.index.json: entry {entry!r} names a file outside the "
                         f"model directory {model}; shards must be files in it"), line


@pytest.mark.parametrize("argv", [["config", "show", "bert-base-phase1"], ["info", "TINY"]])
def test_any_command_whose_reader_stopped_ends_quietly_as_unix_tools_do(argv, tiny_checkpoint, tmp_path):
    """`bertjax info X | head -1`: the reader gone (closed before the command writes, so it is gone every time)
    ends the command by SIGPIPE (the shell's status 141), without BrokenPipeError's traceback."""
    import signal
    import subprocess
    import sys

    argv = [str(tiny_checkpoint) if a == "TINY" else a for a in argv]
    with open(tmp_path / "stderr", "wb") as stderr:
        process = subprocess.Popen([sys.executable, "-m", "bertjax.cli", *argv], stdout=subprocess.PIPE,
                                   stderr=stderr)
        process.stdout.close()
        assert process.wait(timeout=300) == -signal.SIGPIPE
    err = (tmp_path / "stderr").read_text()
    assert "Traceback" not in err and "BrokenPipe" not in err, err[-3000:]


@pytest.mark.parametrize("changes, said", [
    ({"problem_type": "regression"}, "problem_type regression (one output: a number)"),
    ({"id2label": {"0": "neg"}, "label2id": {"neg": 0}}, "id2label of 1 label(s) (0: 'neg')"),
    ({"num_labels": 3}, "num_labels 3"),
    ({"id2label": {"0": "neg", "1": "pos", "2": "meh"}}, "id2label of 3 label(s) (0: 'neg', 1: 'pos', 2: 'meh')")])
def test_a_head_that_contradicts_its_config_is_refused_naming_both(minilm_dir, tmp_path, capsys, monkeypatch,
                                                                   changes, said):
    """An export whose config.json describes another head than its classifier's two outputs: `predict` read one of
    two logits as a regression score, or invented a label LABEL_1. It is refused, naming the description and the
    classifier, by every command that loads it (predict, a fine-tune's --init, export); nothing is written."""
    import io
    import sys

    from tests.conftest import save_tiny_classifier_hf

    source = save_tiny_classifier_hf(tmp_path / "source", minilm_dir / "vocab.txt")
    edited = _with_config(Path(source), tmp_path / "edited", "config.json", **changes)
    (tmp_path / "train.csv").write_text("text,label\ngood,1\nbad,0\n")
    for argv in (["predict", "--model", edited],
                 ["finetune", "classify", "--train", str(tmp_path / "train.csv"), "--init", edited, "--workdir",
                  str(tmp_path / "w")],
                 ["convert", edited, "--from", "hf", "--out", str(tmp_path / "out")]):
        monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"a good film\n")))
        line = _error(capsys, argv)
        assert f"error: {edited}/config.json says {said}, but its classifier has 2 outputs (classifier bias [2])" \
            in line, line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["edited", "source", "train.csv"]


def test_a_checkpoint_head_that_contradicts_its_classifier_is_refused_naming_both(minilm_dir, tmp_path, capsys,
                                                                                  monkeypatch):
    """The same for a bertjax checkpoint's head item (what a fine-tune's --save-checkpoint writes)."""
    import io
    import sys

    from tests.conftest import save_tiny_classifier_hf

    checkpoint = save_tiny_classifier_hf(tmp_path / "ckpt", minilm_dir / "vocab.txt", head={
        "architecture": "BertForSequenceClassification", "id2label": {"0": "neg", "1": "pos"},
        "problem_type": "regression"})
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"a good film\n")))
    line = _error(capsys, ["predict", "--model", checkpoint])
    assert line.endswith(f"error: {checkpoint} (its head item) says problem_type regression (one output: a number), "
                         "but its classifier has 2 outputs (classifier bias [2]): read as described, its outputs "
                         "would be reported as something they are not; export the model again, or correct the "
                         "description"), line


def test_a_config_py_that_fails_is_told_by_its_own_line_not_by_bertjaxs_traceback(tmp_path, capsys):
    """A syntax error or an exception in a config .py is the user's code: the file, its line and the error, not
    bertjax's import machinery in a traceback."""
    broken = tmp_path / "broken.py"
    broken.write_text("import ml_collections\n\n\ndef get_config(:\n    return None\n")
    raises = tmp_path / "raises.py"
    raises.write_text("import ml_collections\n\n\ndef get_config():\n    sizes = {}\n    return sizes['hidden']\n")
    empty = tmp_path / "empty.py"
    empty.write_text("x = 1\n")
    for path, expected in ((broken, f"{broken}:4: SyntaxError: "), (raises, f"{raises}:6: KeyError: 'hidden' (in "
                                                                            "the config file)"),
                           (empty, f"{empty}: defines no get_config()")):
        assert bertjax_main(["config", "show", str(path)]) == 2
        err = capsys.readouterr().err
        assert "Traceback" not in err and err.strip().splitlines()[-1].startswith(f"bertjax config: error: {expected}")


def _classify(tmp_path, workdir, *extra) -> list[str]:
    train = tmp_path / "train.csv"
    if not train.exists():
        train.write_text("text,label\n" + "".join(f"row {i},{i % 2}\n" for i in range(8)))
    return ["finetune", "classify", "--train", str(train), "--init", str(tmp_path / "no-model"), "--workdir",
            str(workdir), *extra]


def test_a_cut_run_record_is_named_and_a_users_train_state_file_is_not_a_run(tmp_path, capsys):
    """run.json cut by a full disk: its path and where it stops, not a JSONDecodeError naming nothing. A file of the
    user's named `train_state` in the workdir is not "another fine-tuning run" whose --overwrite advice would delete
    it: it is named, and kept, --overwrite or not."""
    cut = tmp_path / "cut"
    cut.mkdir()
    (cut / "run.json").write_text('{"job": "classify", "train": "tr')
    (cut / "metrics.jsonl").write_text("")
    assert bertjax_main(_classify(tmp_path, cut)) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"bertjax finetune: error: {cut / 'run.json'}: not valid JSON (cut short?): Unterminated string starting at "
        "(line 1, column 30); expected a fine-tune's run record (run.json)")

    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "train_state").write_text("my notes on the training state\n")
    for extra in ((), ("--overwrite",)):
        assert bertjax_main(_classify(tmp_path, mine, *extra)) == 2
        last = capsys.readouterr().err.strip().splitlines()[-1]
        assert last == (f"bertjax finetune: error: {mine / 'train_state'} is a file no fine-tuning run wrote (a run "
                        "writes its train_state as a directory); move it out of the way, or use another --workdir")
    assert (mine / "train_state").read_text() == "my notes on the training state\n"


def test_an_error_quoting_a_users_row_is_cut_to_a_readable_length(tmp_path, capsys):
    """A table without a header line: its first row, a whole paragraph, was quoted whole as the columns the file
    has. A quoted value is cut in its middle, saying how long it was, and no error line runs past 1000 characters."""
    train = tmp_path / "train.csv"
    paragraph = "word " * 600
    train.write_text(f"{paragraph},1\nanother row,0\n")
    assert bertjax_main(_classify(tmp_path, tmp_path / "work")) == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith(f"bertjax finetune: error: {train}: no column 'text', 'label'; it has 'word word") and \
        "' (3,002 characters), '1'" in last and len(last) < 300, last
    from bertjax.runtime.errors import clipped

    assert len(clipped("x" * 5000)) <= 1000 and "(4,040 characters cut)" in clipped("x" * 5000)


# ------------------------------------------------------------------------------------------- nothing silently wrong

def test_non_finite_weights_are_refused_at_load_naming_the_tensor(minilm_dir, tmp_path, capsys):
    """NaN or infinite weights gave NaN embeddings and predictions with exit 0; every load (embed, predict, a
    fine-tune's --init, convert, export: interop.load.load_pretrained) refuses them naming the tensor."""
    from safetensors.numpy import load_file, save_file

    from tests.conftest import save_tiny_hf

    model = Path(save_tiny_hf(tmp_path / "hf", minilm_dir / "vocab.txt", seed=0))
    tensors = load_file(str(model / "model.safetensors"))
    query = next(name for name in tensors if "layer.0.attention.self.query.weight" in name)
    tensors[query][0, :2], tensors[query][1, 0] = np.nan, np.inf
    save_file(tensors, str(model / "model.safetensors"))
    lines = tmp_path / "lines.txt"
    lines.write_text("a sentence\n")
    for argv in (["embed", "--checkpoint", str(model), "--input", str(lines), "--output", str(tmp_path / "e.npy")],
                 ["convert", str(model), "--from", "hf", "--out", str(tmp_path / "converted")]):
        line = _error(capsys, argv)
        assert re.fullmatch(rf"bertjax {argv[0]}: error: {re.escape(str(model))}: tensor bert/layer_0/"
                            rf"attention/self/query/kernel holds 2 NaN and 1 infinite values of {tensors[query].size:,}"
                            r"; the weights are damaged \(a run that diverged before it was saved\?\): use another "
                            r"checkpoint", line), line
    assert not (tmp_path / "e.npy").exists() and not (tmp_path / "converted").exists()


def test_embed_says_how_many_lines_it_cut_to_its_max_length(minilm_dir, tmp_path, capsys):
    from tests.conftest import save_tiny_hf

    model = save_tiny_hf(tmp_path / "hf", minilm_dir / "vocab.txt", seed=0)
    lines = tmp_path / "lines.txt"
    lines.write_text("one two three four five six seven eight nine\nshort\nten eleven twelve\n")
    assert bertjax_main(["embed", "--checkpoint", model, "--input", str(lines), "--output", str(tmp_path / "e.npy"),
                         "--max-len", "7"]) == 0
    # 9 words, one token each in MiniLM's vocabulary, with [CLS] and [SEP]: 11 tokens, cut to 7; 3 words: 5 fit.
    assert f"--input {lines}: 1 of 3 line(s) longer than --max-len 7 tokens ([CLS] and [SEP] included), cut to it " \
           "(lines 1); raise --max-len to embed more of them" in capsys.readouterr().out
    assert np.load(tmp_path / "e.npy").shape[0] == 3


def test_a_glue_row_whose_text_is_only_spaces_is_refused_as_classify_refuses_it(tmp_path, capsys):
    """`finetune glue` scored a dev row that is only spaces as if it were a text (classify and predict refuse it);
    it is refused naming its file, line and column, before any model loads."""
    glue = tmp_path / "glue" / "SST-2"
    glue.mkdir(parents=True)
    (glue / "train.tsv").write_text("sentence\tlabel\n" + "".join(f"a film {i}\t{i % 2}\n" for i in range(8)))
    (glue / "dev.tsv").write_text("sentence\tlabel\na good film\t1\n   \t0\n")
    line = _error(capsys, ["finetune", "glue", "--task", "sst2", "--data", str(tmp_path / "glue"), "--init",
                           str(tmp_path / "no-model"), "--workdir", str(tmp_path / "w")])
    assert line == f"bertjax finetune: error: {glue / 'dev.tsv'}:3: column 1 (the first text) is empty; expected " \
                   "the text"


def test_a_config_without_model_type_is_told_what_is_missing(tmp_path, capsys):
    """An HF config.json without model_type was read as BERT's, and a ModernBERT's tensors were "not found ... is
    this a BERT checkpoint?"; the line now says what is missing (transformers refuses such a config too)."""
    from tests import modernbert_fixture

    model = modernbert_fixture.write_masked_lm(tmp_path / "modernbert")
    config = json.loads((model / "config.json").read_text())
    del config["model_type"]
    (model / "config.json").write_text(json.dumps(config))
    assert _error(capsys, ["info", str(model)]) == (
        f"bertjax info: error: {model / 'config.json'}: an HF config.json without model_type (architectures "
        "['ModernBertForMaskedLM']): it says which family the model is; add \"model_type\": \"bert\" or "
        "\"modernbert\"")


def test_a_symlink_loop_in_a_workdir_is_named_as_one(tmp_path, capsys):
    """A workdir, or a folder in it, that is a symbolic link to itself was a raw `[Errno 17] File exists`."""
    loop = tmp_path / "loop"
    loop.symlink_to(loop)
    assert _error(capsys, _classify(tmp_path, loop)) == (
        f"bertjax finetune: error: {loop} is a symbolic link that leads back to itself (a loop); remove it, or point "
        "it at a folder")
