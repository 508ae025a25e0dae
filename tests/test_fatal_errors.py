"""A fatal error ends a job within seconds, non-zero, its last stderr line naming the file and how far it got: cut
and damaged compressed streams (gzip, zstd, bzip2, every layout) and a cut Arrow file, for each command that reads
corpora (`data create`, `vocab train`, `pretrain`), each watched for a stall (a reader error used to leave the
process blocked in the tf.data iterator's destructor forever). Real WikiText-2 text, cut by the test."""
from __future__ import annotations

import bz2
import gzip
import json
import os
import re
import sys
from pathlib import Path

import pytest

from tests import stall_watch

zstandard = pytest.importorskip("zstandard")
pa = pytest.importorskip("pyarrow")

ROOT = Path(__file__).resolve().parents[1]
_TITLE = re.compile(r"^ = [^=].* = $")
# bzip2 in 100 kB blocks: the cut leaves whole ones to read before it.
CODECS = {"gz": gzip.compress, "zst": lambda data: zstandard.ZstdCompressor().compress(data),
          "bz2": lambda data: bz2.compress(data, 1)}


def _articles(shared_data, count: int) -> list[str]:
    lines = (shared_data / "wikitext-2" / "wiki.valid.raw").read_text(encoding="utf-8").splitlines(keepends=True)
    starts = [i for i, line in enumerate(lines) if _TITLE.match(line)] + [len(lines)]
    return ["".join(lines[a:b]) for a, b in zip(starts[:count], starts[1:count + 1])]


@pytest.fixture(scope="module")
def corpus(shared_data, tmp_path_factory):
    """WikiText text (20 articles) and the same as JSON Lines, each compressed whole and cut at 60%."""
    root = tmp_path_factory.mktemp("fatal")
    articles = _articles(shared_data, 20)
    plain = {"txt": "".join(articles).encode(),
             "jsonl": "".join(json.dumps({"text": a}) + "\n" for a in articles).encode()}
    for layout, data in plain.items():
        for codec, compress in CODECS.items():
            whole = compress(data)
            (root / f"wiki.{layout}.{codec}").write_bytes(whole)
            (root / f"cut.{layout}.{codec}").write_bytes(whole[:len(whole) * 6 // 10])
    return {"root": root, "articles": articles, "plain": plain,
            "vocab": str(shared_data / "bert" / "uncased_L-4_H-256_A-4" / "vocab.txt")}


def _job(argv: list[str]) -> tuple[int, list[str], float]:
    """(exit status, stderr lines, seconds) of `bertjax ARGV` in a fresh process; a hang (no CPU time and no output
    for a while, `stall_watch`) fails the test, a slow start on a loaded machine does not."""
    try:
        done = stall_watch.run([sys.executable, "-m", "bertjax.cli", *argv], cwd=ROOT,
                               env={**os.environ, "JAX_PLATFORMS": "cpu"})
    except stall_watch.Stalled as stalled:
        pytest.fail(str(stalled))
    return done.returncode, done.stderr.strip().splitlines(), done.seconds


def _create(corpus, path: Path, corpus_format: str, out: Path) -> tuple[int, list[str], float]:
    return _job(["data", "create", "--input", str(path), "--format", corpus_format, "--vocab", corpus["vocab"],
                 "--out", str(out), "--max-seq-length", "64", "--max-predictions", "10"])


def _lines_before_cut(path: Path, codec: str) -> int:
    """How many whole lines the cut file holds (the reference: Python's own decompressors, read until they fail)."""
    if codec == "zst":  # zstandard's reader stops quietly where the bytes end
        return zstandard.ZstdDecompressor().stream_reader(path.read_bytes(), read_across_frames=True).read().count(b"\n")
    count = 0
    with {"gz": gzip.open, "bz2": bz2.open}[codec](path, "rb") as f:
        try:
            for _ in f:
                count += 1
        except EOFError:
            return count
    raise AssertionError(f"{path} is whole")


# Every codec and both layouts in the default suite, the other pairings slow-marked (each is a process start: the
# reading code is the same for a layout's codecs and a codec's layouts).
@pytest.mark.parametrize("layout, codec", [
    ("txt", "zst"), ("jsonl", "gz"), ("jsonl", "bz2"),
    *(pytest.param(layout, codec, marks=pytest.mark.slow) for layout, codec in
      (("txt", "gz"), ("txt", "bz2"), ("jsonl", "zst")))])
def test_a_cut_compressed_corpus_ends_data_create_with_its_line(corpus, tmp_path, layout, codec):
    """Every codec, text and record layouts: refused with the file and the last whole line read, no shard and no
    --out left."""
    path = corpus["root"] / f"cut.{layout}.{codec}"
    rc, err, _ = _create(corpus, path, "wikitext" if layout == "txt" else "jsonl", tmp_path / "out")
    codec_name = {"gz": "gzip", "zst": "zstd", "bz2": "bzip2"}[codec]
    assert rc != 0 and err, err
    found = re.fullmatch(rf"bertjax data: error: {re.escape(str(path))}: the {codec_name} stream ends before its "
                         r"end marker \(the file is cut\), after line (\d+)", err[-1])
    assert found, err[-3:]
    assert int(found.group(1)) == _lines_before_cut(path, codec) > 0
    assert not (tmp_path / "out").exists()  # the --out it made, removed


def test_the_whole_files_are_read_whole(corpus, tmp_path):
    """The same files uncut: every codec gives the plain file's lines (the decompressor reads multi-member too)."""
    from bertjax.data.file_readers import open_decompressed

    for layout, data in corpus["plain"].items():
        for codec in CODECS:
            with open_decompressed(str(corpus["root"] / f"wiki.{layout}.{codec}")) as f:
                assert f.read() == data, (layout, codec)
    two = tmp_path / "two.txt.gz"  # `cat a.gz b.gz`: two gzip members are one file
    two.write_bytes(gzip.compress(corpus["plain"]["txt"][:1000]) + gzip.compress(corpus["plain"]["txt"][1000:]))
    with open_decompressed(str(two)) as f:
        assert f.read() == corpus["plain"]["txt"]


def test_a_garbage_tail_after_a_zstd_frame_is_named(corpus, tmp_path):
    path = tmp_path / "tail.jsonl.zst"
    path.write_bytes((corpus["root"] / "wiki.jsonl.zst").read_bytes() + b"not a zstd frame at all" * 10)
    rc, err, _ = _create(corpus, path, "jsonl", tmp_path / "out")
    assert rc != 0
    assert re.fullmatch(rf"bertjax data: error: {re.escape(str(path))}: the zstd data is damaged "
                        r"\(ZstdError: .*\), after line 20", err[-1]), err[-3:]


def test_a_cut_arrow_file_of_a_saved_dataset_is_named(corpus, tmp_path):
    """A `datasets.save_to_disk` directory whose .arrow file is cut in half: named with the rows read before it."""
    directory = tmp_path / "saved"
    directory.mkdir()
    records = [{"text": a} for a in corpus["articles"]]
    table = pa.Table.from_pylist(records)
    arrow = directory / "data-00000-of-00001.arrow"
    with pa.ipc.new_stream(str(arrow), table.schema) as writer:
        writer.write_table(table, max_chunksize=4)
    (directory / "state.json").write_text(json.dumps({"_data_files": [{"filename": arrow.name}]}))
    (directory / "dataset_info.json").write_text("{}")
    arrow.write_bytes(arrow.read_bytes()[:arrow.stat().st_size // 2])
    rc, err, _ = _create(corpus, directory, "parquet", tmp_path / "out")
    assert rc != 0
    found = re.fullmatch(rf"bertjax data: error: {re.escape(str(arrow))}: the Arrow stream cannot be read after row "
                         r"(\d+) \(.*\)", err[-1])
    readable = 0  # the reference: pyarrow's own reader, batch by batch until it fails
    try:
        for batch in pa.ipc.open_stream(str(arrow)):
            readable += batch.num_rows
    except (pa.ArrowInvalid, OSError):
        pass
    assert found and int(found.group(1)) == readable and 0 < readable < len(records), (err[-3:], readable)


def test_vocab_train_on_a_cut_file_ends_with_its_line(corpus, tmp_path):
    path = corpus["root"] / "cut.txt.gz"
    rc, err, _ = _job(["vocab", "train", "--input", str(path), "--format", "wikitext", "--vocab-size", "200",
                       "--type", "wordpiece", "--out", str(tmp_path / "vocab")])
    assert rc != 0
    assert re.fullmatch(rf"bertjax vocab: error: {re.escape(str(path))}: the gzip stream ends before its end marker "
                        r"\(the file is cut\), after line \d+", err[-1]), err[-3:]
    assert not (tmp_path / "vocab").exists()  # the --out it made, removed


def test_pretrain_from_a_cut_file_ends_with_its_line(corpus, tmp_path):
    """Training reads the corpus as it goes: the error ends the job (it used to print TensorFlow's traceback and
    hang), the lock is released, and nothing is taken for a finished run."""
    path = corpus["root"] / "cut.jsonl.gz"
    argv = ["pretrain", "--config", "bert-tiny", "--workdir", str(tmp_path / "run"), "--set", f"data.input={path}",
            "--set", "data.corpus_format=jsonl", "--set", f"data.vocab={corpus['vocab']}",
            "--set", "data.max_seq_length=64", "--set", "data.max_predictions_per_seq=10",
            "--set", "data.doc_buffer_size=4", "--set", "data.shuffle_buffer=8", "--set", "train.batch_size=8",
            "--set", "train.steps=1000", "--set", "checkpoint.every=1000"]
    rc, err, _ = _job(argv)
    assert rc != 0
    assert re.fullmatch(rf"bertjax pretrain: error: {re.escape(str(path))}: the gzip stream ends before its end "
                        r"marker \(the file is cut\), after line \d+", err[-1]), err[-3:]
    assert not (tmp_path / "run" / "LOCK").exists()


def test_pretrain_on_a_shard_with_a_damaged_record_names_the_shard_and_record(corpus, tmp_path):
    """A byte flipped in the middle of one of three `data create` shards (its CRC no longer matches): the job ends
    with one line naming that shard and the record (TensorFlow's own reader, read up to the damage, says which),
    not TensorFlow's DataLossError traceback naming no file."""
    import tensorflow as tf

    from bertjax.cli import main

    source = tmp_path / "wiki.txt"
    source.write_bytes(corpus["plain"]["txt"])
    records = tmp_path / "records"
    assert main(["data", "create", "--input", str(source), "--format", "wikitext", "--vocab", corpus["vocab"],
                 "--out", str(records), "--max-seq-length", "64", "--max-predictions", "10", "--dupe-factor", "1",
                 "--shards", "3"]) == 0
    shard = sorted(records.glob("*.tfrecord"))[1]
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    intact = 0
    with pytest.raises(tf.errors.DataLossError):
        for _ in tf.data.TFRecordDataset(str(shard)):
            intact += 1
    argv = ["pretrain", "--config", "bert-tiny", "--workdir", str(tmp_path / "run"), "--set", f"data.input={records}",
            "--set", "train.batch_size=8", "--set", "train.steps=1000", "--set", "checkpoint.every=1000"]
    rc, err, _ = _job(argv)
    assert rc == 2 and not any("Traceback" in line for line in err), err[-5:]
    assert re.fullmatch(rf"bertjax pretrain: error: {re.escape(str(shard))}: record {intact} \(at byte \d+\) fails "
                        r"its CRC check: the file is damaged; expected intact TFRecords \(make them again: `data "
                        r"create --overwrite`\)", err[-1]), err[-3:]
    assert not (tmp_path / "run" / "LOCK").exists()


def test_a_workdir_that_cannot_be_made_is_one_line(tmp_path, capsys):
    """The machine's refusal (here a workdir below a regular file; a read-only disk the same way) is an OSError
    naming the path: one line, not a traceback."""
    from bertjax.cli import main

    (tmp_path / "a_file").write_text("x")
    workdir = tmp_path / "a_file" / "run"
    assert main(["finetune", "glue", "--task", "sst2", "--init", str(tmp_path / "none"), "--data", str(tmp_path),
                 "--workdir", str(workdir)]) == 2
    err = capsys.readouterr().err
    assert err.strip().splitlines()[-1] == f"bertjax finetune: error: {workdir}: not a directory"
    assert "Traceback" not in err


def test_a_fine_tune_on_a_read_only_workdir_is_one_line(tmp_path, capsys):
    """An existing workdir the job may not write (sysfs refuses writes even to root, as a read-only mount does)."""
    from bertjax.cli import main

    read_only = Path("/sys/kernel")
    if not read_only.is_dir() or os.access(read_only, os.W_OK) and _writable(read_only):
        pytest.skip("no read-only directory on this machine")
    assert main(["finetune", "glue", "--task", "sst2", "--init", str(tmp_path / "none"), "--data", str(tmp_path),
                 "--workdir", str(read_only)]) == 2
    err = capsys.readouterr().err
    last = err.strip().splitlines()[-1]
    assert last.startswith(f"bertjax finetune: error: {read_only}: cannot write there (") and \
        last.endswith("); give a writable --workdir"), last
    assert "Traceback" not in err


def _writable(directory: Path) -> bool:
    try:
        (directory / ".bertjax-probe").write_text("x")
    except OSError:
        return False
    (directory / ".bertjax-probe").unlink()
    return True


# ------------------------------------------------------------------------------------------- process limits

def _limited_job(argv: list[str], **limits: int) -> tuple[int, list[str]]:
    """(exit status, stderr lines) of `bertjax ARGV` under the process limits given (RLIMIT_NOFILE=30, ...)."""
    import subprocess

    from tests.conftest import limited, xla_flags

    done = subprocess.run(limited([sys.executable, "-m", "bertjax.cli", *argv], **limits), cwd=ROOT,
                          env={**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": xla_flags(1),
                               "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=600)
    return done.returncode, done.stderr.strip().splitlines()


def test_a_process_limit_hit_ends_the_command_in_one_line_naming_the_limit(corpus, tmp_path, minilm_dir):
    """Under `ulimit -n 30` a pretraining save reported "no space left on device" with 50 GB free; under a
    file-size limit a write was a bare `[Errno 27] File too large` naming no file; under an address-space limit
    too small for JAX, XLA and TensorFlow to start, a command aborted or crashed natively without a line of ours.
    Each now ends in one line naming the limit, its value and how to raise it."""
    from tests.conftest import save_tiny_classifier_hf

    argv = ["pretrain", "--config", "bert-tiny", "--workdir", str(tmp_path / "run"),
            "--set", f"data.input={corpus['root'] / 'wiki.txt.gz'}", "--set", f"data.vocab={corpus['vocab']}",
            "--set", "data.max_seq_length=64", "--set", "data.max_predictions_per_seq=10",
            "--set", "train.batch_size=8", "--set", "train.steps=3", "--set", "checkpoint.every=3"]
    rc, err = _limited_job(argv, RLIMIT_NOFILE=30)  # here the save opens the 30th (where it is may vary)
    assert rc == 2 and err[-1].startswith("bertjax pretrain: error: ") and err[-1].endswith(
        "too many open files: this process may have 30 open at once (ulimit -n 30); raise it (ulimit -n 65536)") \
        and "no space" not in err[-1], err[-5:]

    model = save_tiny_classifier_hf(tmp_path / "classifier", minilm_dir / "vocab.txt")
    rows = tmp_path / "rows.csv"
    rows.write_text("text\n" + "".join(f"row {i} of a table to predict\n" for i in range(200)))
    out = tmp_path / "predicted.jsonl"
    rc, err = _limited_job(["predict", "--model", model, "--input", str(rows), "--output", str(out)],
                           RLIMIT_FSIZE=8192)
    assert rc == 2 and err[-1] == (f"bertjax predict: error: cannot write {out}: a file grew past the file-size "
                                   "limit (ulimit -f: 8,192 bytes); raise it (ulimit -f unlimited)"), err[-5:]
    assert not out.exists() and "Traceback" not in "\n".join(err)

    rc, err = _limited_job(["predict", "--model", model, "--input", str(rows), "--output", str(out)],
                           RLIMIT_AS=2 << 30)
    assert rc == 2 and err[-1] == (
        "bertjax predict: error: the address-space limit (ulimit -v) is 2.0 GiB: JAX, XLA and TensorFlow map more "
        "than that to start (libraries, thread stacks, allocator arenas) and would abort without a word; raise it "
        "to at least 4 GiB (ulimit -v unlimited)"), err[-5:]
