"""Every command that reads text reads it by one reader, with the detection `data create` reads a corpus by
(file_readers): a gzip or zstd file is decompressed (a defect in its content is named by its line, so it was read),
a Parquet file under a text name is refused naming it, and a NUL byte is refused naming its line wherever it is (past
the first 64 KiB as in it). COMMANDS lists the commands; one with an input flag that is not listed fails
`test_every_command_that_takes_an_input_file_is_listed`, and a module of the fine-tunes that opens a file itself fails
`test_no_fine_tune_module_opens_an_input_file_itself`."""
from __future__ import annotations

import ast
import gzip
import io
import json
import pathlib
import sys

import pytest

from bertjax.cli import build_parser, main, walk_commands
from tests.conftest import save_tiny_classifier_hf

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")
zstandard = pytest.importorskip("zstandard")

# The line that holds the NUL byte: past the first 64 KiB of every payload below.
BAD_LINE = 3000


def _payload(header: str, row) -> bytes:
    """A file's text: `header`, then rows row(i) up to BAD_LINE, whose row holds a NUL byte, then a few more."""
    lines = ([header] if header else []) + [row(i) for i in range(BAD_LINE + 20 - bool(header))]
    lines[BAD_LINE - 1] = lines[BAD_LINE - 1][:2] + "\x00" + lines[BAD_LINE - 1][2:]
    text = "\n".join(lines) + "\n"
    assert text.encode().index(b"\x00") > 1 << 16
    return text.encode()


def _squad(i_max: int = BAD_LINE + 20) -> bytes:
    """A SQuAD file, one line per question (json.dumps with indent would not put a NUL where we want it)."""
    qas = [json.dumps({"id": f"q{i}", "question": "where is the cat sleeping tonight?",
                       "answers": [{"text": "here", "answer_start": 0}]}) for i in range(i_max)]
    head = '{"version": "1.1", "data": [{"title": "t", "paragraphs": [{"context": "here sleeps the cat", "qas": [\n'
    lines = [head.rstrip("\n")] + [q + ("," if i < i_max - 1 else "") for i, q in enumerate(qas)] + ["]}]}]}"]
    lines[BAD_LINE - 1] = lines[BAD_LINE - 1].replace("where", "wh\x00ere", 1)
    return ("\n".join(lines) + "\n").encode()


SENTENCES = _payload("", lambda i: f"sentence number {i} of the file")
CSV = _payload("text,label", lambda i: f"the review number {i},{i % 2}")
TSV = _payload("sentence\tlabel", lambda i: f"the review number {i}\t{i % 2}")
PAIRS = _payload("anchor,positive", lambda i: f"query number {i},the passage that answers it")
CONLL = _payload("", lambda i: "" if i % 7 == 6 else f"word{i}-of-a-sentence NN O {'B-PER' if i % 7 == 0 else 'O'}")
SWAG = _payload(",video-id,fold-ind,startphrase,sent1,sent2,gold-source,ending0,ending1,ending2,ending3,label",
                lambda i: f"{i},v,f,s,the sent {i},then,gold,end a,end b,end c,end d,{i % 4}")
SQUAD = _squad()


def _glue(root: pathlib.Path, content: bytes) -> pathlib.Path:
    (root / "glue" / "SST-2").mkdir(parents=True)
    (root / "glue" / "SST-2" / "train.tsv").write_bytes(content)
    (root / "glue" / "SST-2" / "dev.tsv").write_text("sentence\tlabel\ngood\t1\nbad\t0\n")
    return root / "glue" / "SST-2" / "train.tsv"


def _in_dir(root: pathlib.Path, name: str, content: bytes, others: dict[str, str]) -> pathlib.Path:
    (root / "data").mkdir()
    for other, text in others.items():
        (root / "data" / other).write_text(text)
    (root / "data" / name).write_bytes(content)
    return root / "data" / name


INIT = "no-such-checkpoint"  # never loaded: every input is read and checked before the checkpoint loads

# command -> (the payload, where it goes: root -> path, argv: (root, path, model) -> list).
COMMANDS = {
    "embed": (SENTENCES, lambda root, c: _write(root / "in.txt", c),
              lambda root, path, model: ["embed", "--checkpoint", INIT, "--input", str(path), "--output",
                                         str(root / "out.npy")]),
    "predict": (CSV, lambda root, c: _write(root / "in.csv", c),
                lambda root, path, model: ["predict", "--model", model, "--input", str(path), "--output",
                                           str(root / "out.jsonl")]),
    "predict stdin": (SENTENCES, lambda root, c: _write(root / "stdin", c),
                      lambda root, path, model: ["predict", "--model", model]),
    "finetune classify": (CSV, lambda root, c: _write(root / "train.csv", c),
                          lambda root, path, model: ["finetune", "classify", "--train", str(path), "--init", INIT,
                                                     "--workdir", str(root / "w")]),
    "finetune embedding": (PAIRS, lambda root, c: _write(root / "train.csv", c),
                           lambda root, path, model: ["finetune", "embedding", "--train", str(path), "--init", INIT,
                                                      "--workdir", str(root / "w")]),
    "finetune glue": (TSV, _glue, lambda root, path, model: ["finetune", "glue", "--task", "sst2", "--data",
                                                             str(root / "glue"), "--init", INIT, "--workdir",
                                                             str(root / "w")]),
    "finetune features": (TSV, _glue, lambda root, path, model: ["finetune", "features", "--task", "sst2", "--data",
                                                                 str(root / "glue"), "--init", INIT, "--workdir",
                                                                 str(root / "w")]),
    "finetune ner": (CONLL, lambda root, c: _in_dir(root, "train.txt", c, {"valid.txt": "w NN O O\n"}),
                     lambda root, path, model: ["finetune", "ner", "--data", str(root / "data"), "--init", INIT,
                                                "--workdir", str(root / "w")]),
    "finetune squad": (SQUAD, lambda root, c: _write(root / "train.json", c),
                       lambda root, path, model: ["finetune", "squad", "--version", "1.1", "--train", str(path),
                                                  "--init", INIT, "--workdir", str(root / "w")]),
    "finetune multiple-choice": (SWAG, lambda root, c: _in_dir(root, "train.csv", c, {"val.csv": SWAG_VAL}),
                                 lambda root, path, model: ["finetune", "multiple-choice", "--data",
                                                            str(root / "data"), "--init", INIT, "--workdir",
                                                            str(root / "w")]),
    "eval squad": (SQUAD, lambda root, c: _write(root / "dev.json", c),
                   lambda root, path, model: ["eval", "squad", "--data", str(path), "--predictions",
                                              str(_write(root / "p.json", b'{"q0": "here"}'))]),
    "eval embedding": (SQUAD, lambda root, c: _write(root / "dev.json", c),
                       lambda root, path, model: ["eval", "embedding", "--checkpoint", INIT, "--squad", str(path),
                                                  "--output", str(root / "w")]),
    "data create": (SENTENCES, lambda root, c: _write(root / "corpus.txt", c),
                    lambda root, path, model: ["data", "create", "--input", str(path), "--vocab", model + "/vocab.txt",
                                               "--out", str(root / "out"), "--max-seq-length", "32",
                                               "--max-predictions", "5", "--dupe-factor", "1"]),
    "vocab train": (SENTENCES, lambda root, c: _write(root / "corpus.txt", c),
                    lambda root, path, model: ["vocab", "train", "--input", str(path), "--type", "wordpiece",
                                               "--vocab-size", "60", "--out", str(root / "vocab")]),
}
SWAG_VAL = (",video-id,fold-ind,startphrase,sent1,sent2,gold-source,ending0,ending1,ending2,ending3,label\n"
            "0,v,f,s,a,b,g,c,d,e,f,0\n")
# Corpus commands read Parquet as a corpus (test_format_detect.py): the Parquet case is the text commands'.
CORPUS_COMMANDS = ("data create", "vocab train")


def _write(path: pathlib.Path, content: bytes) -> pathlib.Path:
    path.write_bytes(content)
    return path


@pytest.fixture(scope="module")
def classifier(tmp_path_factory, minilm_dir) -> str:
    """A tiny sequence classifier as an HF export (predict reads its head's description before its input)."""
    return save_tiny_classifier_hf(tmp_path_factory.mktemp("classifier") / "hf", minilm_dir / "vocab.txt")


def _compress(kind: str, data: bytes) -> bytes:
    return gzip.compress(data) if kind == "gzip" else zstandard.ZstdCompressor().compress(data)


def _error(capsys, argv, stdin: bytes | None, monkeypatch) -> str:
    if stdin is not None:
        monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(stdin)))
    assert main(argv) == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("bertjax ")]
    assert len(lines) == 1, lines
    return lines[0]


@pytest.mark.parametrize("case", ["nul past 64 KiB", "gzip", "zstd", "parquet"])
@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_command_reads_text_by_the_one_reader(command, case, tmp_path, classifier, capsys, monkeypatch):
    if case == "parquet" and command in CORPUS_COMMANDS:
        pytest.skip("a corpus command reads Parquet as a corpus")
    payload, place, argv = COMMANDS[command]
    if case == "parquet":
        buffer = io.BytesIO()
        pq.write_table(pa.table({"text": ["a document", "another one"], "label": ["0", "1"]}), buffer)
        content = buffer.getvalue()
    else:
        content = payload if case == "nul past 64 KiB" else _compress(case, payload)
    path = place(tmp_path, content)
    name = "stdin" if command == "predict stdin" else str(path)
    line = _error(capsys, argv(tmp_path, path, classifier), content if command == "predict stdin" else None,
                  monkeypatch)
    if case == "parquet":
        assert f"error: {name}: a Parquet file, not text; expected " in line, line
    else:
        decompressed = "" if case == "nul past 64 KiB" else f" (decompressed from {case})"
        said = f"{name}: a NUL byte in line {BAD_LINE} (binary data, not text){decompressed}; "
        if command in CORPUS_COMMANDS:  # read by tf.data, line by line: the line named when it is read
            said = f"{name}: a NUL byte in line {BAD_LINE} (binary data, not text); text corpora are read as"
        assert said in line, line
    assert not (tmp_path / "w").exists() and not (tmp_path / "out.npy").exists()


INPUT_FLAGS = ("--input", "--train", "--dev", "--test", "--data", "--predict", "--predictions", "--na-prob-file",
               "--squad", "--stsb")


def test_every_command_that_takes_an_input_file_is_listed():
    """A new command that reads text is listed in COMMANDS, so the test above holds it to the one reader."""
    taking = set()
    for path, parser in walk_commands(build_parser()):
        flags = {flag for action in parser._actions for flag in action.option_strings}
        if flags & set(INPUT_FLAGS):
            taking.add(" ".join(path))
    listed = {command.removesuffix(" stdin") for command in COMMANDS}
    assert taking == listed, f"not listed: {sorted(taking - listed)}; listed without an input: {sorted(listed - taking)}"


# Reads that are not of a user's input: a run's own records, and the input files' hashes.
OWN_FILES = {"run_record.py": "hashes the input files (bytes, not text) and reads its own run.json",
             "glue.py": "reads a finished task's own metrics.json (glue --task all)"}


def test_no_fine_tune_module_opens_an_input_file_itself():
    """The fine-tunes' modules read their users' files through file_readers only: no open() for reading, no
    Path.read_text()/read_bytes() of their own (`bertjax/finetune/*.py`)."""
    import bertjax.finetune

    found = []
    for module in sorted(pathlib.Path(bertjax.finetune.__file__).parent.glob("*.py")):
        if module.name in OWN_FILES:
            continue
        for node in ast.walk(ast.parse(module.read_text())):
            if not isinstance(node, ast.Call):
                continue
            name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
            mode = node.args[1].value if name == "open" and len(node.args) > 1 and isinstance(
                node.args[1], ast.Constant) else next((k.value.value for k in node.keywords if k.arg == "mode"), "r")
            if name in ("read_text", "read_bytes") and not (isinstance(node.func, ast.Attribute) and isinstance(
                    node.func.value, ast.Name) and node.func.value.id == "file_readers"):
                found.append(f"{module.name}:{node.lineno} {name}()")
            elif name == "open" and "w" not in mode and "a" not in mode:
                found.append(f"{module.name}:{node.lineno} open(..., {mode!r})")
    assert not found, f"input read without file_readers: {found}"


@pytest.mark.parametrize("command", CORPUS_COMMANDS)
@pytest.mark.parametrize("case", ["zip archive", "nul in the first line"])
def test_vocab_train_refuses_what_data_create_refuses(command, case, tmp_path, classifier, capsys, monkeypatch):
    """`vocab train` trained on a zip archive and a NUL-holding file that `data create` refused: both now resolve
    their input by format_detect.resolve, which checks the files."""
    import zipfile

    path = tmp_path / "corpus.txt"
    if case == "zip archive":
        with zipfile.ZipFile(path, "w") as archive:
            archive.writestr("inside.txt", "hello world\n" * 100)
    else:
        path.write_bytes(b"hello\x00world\nsecond line here\n")
    line = _error(capsys, COMMANDS[command][2](tmp_path, path, classifier), None, monkeypatch)
    said = "a zip archive, not text" if case == "zip archive" else "a NUL byte in line 1 (binary data, not text)"
    assert f"error: {path}: {said}; sentences corpora are read as UTF-8 lines" in line, line


def test_a_blank_text_is_refused_from_stdin_as_from_a_file(tmp_path, classifier, capsys, monkeypatch):
    line = _error(capsys, ["predict", "--model", classifier], b"a good film\n\nbad\n", monkeypatch)
    assert line.endswith("error: stdin:2: the line is blank; expected one text a line"), line
    table = tmp_path / "in.csv"
    table.write_text("text\na good film\n\"\"\nbad\n")
    line = _error(capsys, ["predict", "--model", classifier, "--input", str(table)], None, monkeypatch)
    assert line.endswith(f"error: {table}:3: column 'text' is empty; expected the text"), line


def test_embed_reads_a_compressed_file_as_the_lines_it_holds(tmp_path, classifier, capsys):
    """Two gzipped sentences are two rows (their gzip bytes were read as one line of replacement characters)."""
    import numpy as np

    sentences = b"the cat sat on the mat\na dog barked\n"
    for name, content in (("plain.txt", sentences), ("two.txt.gz", gzip.compress(sentences)),
                          ("two.zst", zstandard.ZstdCompressor().compress(sentences))):
        (tmp_path / name).write_bytes(content)
        assert main(["embed", "--checkpoint", classifier, "--input", str(tmp_path / name), "--output",
                     str(tmp_path / f"{name}.npy")]) == 0
    plain = np.load(tmp_path / "plain.txt.npy")
    assert plain.shape == (2, 32)
    for name in ("two.txt.gz", "two.zst"):
        np.testing.assert_array_equal(np.load(tmp_path / f"{name}.npy"), plain)
    assert "invalid UTF-8" not in capsys.readouterr().out
