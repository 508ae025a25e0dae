"""Corpora as users have them: JSON Lines, Parquet, compressed text, a `datasets.save_to_disk` directory and hf:
ids give the same documents, pretraining batches and `data create` records as the equivalent plain-text file
(real WikiText-2 text written by the test into each format); resume mid-Parquet-file, a split of row groups over
processes, bad input named by file and line."""
from __future__ import annotations

import bz2
import collections
import dataclasses
import gzip
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf

from bertjax.data.corpus import documents_from_files, expand_inputs
from bertjax.data.file_readers import check_input_files
from bertjax.data.data_config import CorpusConfig, PretrainingDataConfig
from bertjax.data.pipeline import make_pretraining_dataset, save_iterator
from tests.test_data_pipeline import assert_fresh_process_resumes

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")
zstandard = pytest.importorskip("zstandard")

ROOT = Path(__file__).resolve().parents[1]
SEQ, PRED = 64, 10
_TITLE = re.compile(r"^ = [^=].* = $")
_HEADING = re.compile(r"^\s*=.*=\s*$")


def _articles(text: str) -> list[str]:
    """WikiText articles as record texts: their paragraphs, one per line (titles and headings dropped)."""
    articles = []
    for line in text.splitlines():
        if _TITLE.match(line):
            articles.append([])
        elif line.strip() and not _HEADING.match(line):
            articles[-1].append(line)
    return ["\n".join(a) for a in articles if a]


def _zst(data: bytes) -> bytes:
    return zstandard.ZstdCompressor().compress(data)


@pytest.fixture(scope="module")
def corpus(shared_data, tmp_path_factory) -> dict:
    """The first 8 WikiText-2 validation articles as a wikitext file and in every other format (the records hold
    an `id` beside the text, as real dumps do)."""
    raw = (shared_data / "wikitext-2" / "wiki.valid.raw").read_text(encoding="utf-8").splitlines(keepends=True)
    starts = [i for i, line in enumerate(raw) if _TITLE.match(line)]
    text = "".join(raw[:starts[8]])
    records = [{"id": i, "text": t} for i, t in enumerate(_articles(text))]
    root = tmp_path_factory.mktemp("formats")
    jsonl = "".join(json.dumps(r) + "\n" for r in records).encode()
    files = {"wiki.txt": text.encode(), "wiki.txt.gz": gzip.compress(text.encode()),
             "wiki.txt.zst": _zst(text.encode()), "wiki.txt.bz2": bz2.compress(text.encode()), "wiki.jsonl": jsonl,
             "wiki.jsonl.gz": gzip.compress(jsonl), "wiki.jsonl.zst": _zst(jsonl)}
    for name, data in files.items():
        (root / name).write_bytes(data)
    table = pa.table({"id": [r["id"] for r in records], "text": [r["text"] for r in records]})
    pq.write_table(table, root / "wiki.parquet", row_group_size=3)  # 3 row groups
    _save_to_disk(records, root / "saved")
    paths = {name: str(root / name) for name in [*files, "wiki.parquet", "saved"]}
    return {"paths": paths, "records": records, "root": root,
            "vocab": str(shared_data / "bert" / "uncased_L-4_H-256_A-4" / "vocab.txt")}


def _save_to_disk(records: list[dict], directory: Path) -> None:
    """A `datasets.save_to_disk` directory: written by `datasets` itself where installed (the test extra), else
    its layout (Arrow IPC stream data files listed by state.json) by pyarrow."""
    try:
        import datasets
    except ImportError:
        directory.mkdir()
        table = pa.Table.from_pylist(records)
        with pa.ipc.new_stream(str(directory / "data-00000-of-00001.arrow"), table.schema) as writer:
            writer.write_table(table, max_chunksize=3)
        (directory / "dataset_info.json").write_text("{}")
        (directory / "state.json").write_text(json.dumps({"_data_files": [{"filename": "data-00000-of-00001.arrow"}]}))
        return
    datasets.Dataset.from_list(records).save_to_disk(str(directory))


def _format(name: str) -> str:
    return "wikitext" if ".txt" in name else "jsonl" if ".jsonl" in name else "parquet"


def _documents(path: str, corpus_format: str, **options) -> list[list[str]]:
    config = CorpusConfig(input=path, corpus_format=corpus_format, **options)
    return [[s.decode() for s in d["sentences"]]
            for d in documents_from_files(expand_inputs(config.inputs), config).as_numpy_iterator()]


FORMATS = ["wiki.txt.gz", "wiki.txt.zst", "wiki.txt.bz2", "wiki.jsonl", "wiki.jsonl.gz", "wiki.jsonl.zst",
           "wiki.parquet", "saved"]


def test_every_format_gives_the_text_files_documents(corpus):
    expected = _documents(corpus["paths"]["wiki.txt"], "wikitext")
    assert len(expected) == len(corpus["records"]) == 8
    for name in FORMATS:
        assert _documents(corpus["paths"][name], _format(name)) == expected, name
    kinds = {name: check_input_files(expand_inputs([corpus["paths"][name]]), CorpusConfig(
        corpus_format=_format(name))) for name in ("wiki.txt.zst", "wiki.jsonl.gz", "wiki.parquet", "saved")}
    assert kinds == {"wiki.txt.zst": ["wikitext+zstd"], "wiki.jsonl.gz": ["jsonl+gzip"], "wiki.parquet": ["parquet"],
                     "saved": ["arrow"]}
    assert pq.ParquetFile(corpus["paths"]["wiki.parquet"]).num_row_groups == 3


def _config(corpus, name: str, **overrides) -> PretrainingDataConfig:
    base = dict(input=corpus["paths"][name], corpus_format=_format(name), vocab=corpus["vocab"],
                max_seq_length=SEQ, max_predictions_per_seq=PRED, doc_buffer_size=3, shuffle_buffer=20, seed=7)
    return PretrainingDataConfig(**{**base, **overrides})


def _epoch(config) -> list[dict]:
    return list(make_pretraining_dataset(config.replace(num_epochs=1), 16, drop_remainder=False).as_numpy_iterator())


def _same(a: list[dict], b: list[dict]) -> bool:
    return len(a) == len(b) and all(np.array_equal(x[k], y[k]) for x, y in zip(a, b) for k in x)


def test_pretraining_batches_equal_the_text_files(corpus):
    """Same seed: the same batches (instances, masks, order) from Parquet, JSON Lines (zstd), zstd text and a
    save_to_disk directory as from the plain wikitext file."""
    expected = _epoch(_config(corpus, "wiki.txt"))
    assert sum(len(b["input_ids"]) for b in expected) > 100
    for name in ("wiki.parquet", "wiki.jsonl.zst", "wiki.txt.zst", "saved"):
        assert _same(_epoch(_config(corpus, name)), expected), name


def _records(out: Path) -> list[bytes]:
    return [r.numpy() for r in tf.data.TFRecordDataset(sorted(str(p) for p in out.glob("*.tfrecord")))]


def test_data_create_writes_the_text_files_records(corpus, tmp_path):
    """`data create` (local) from Parquet (with --text-field) and from gzip JSON Lines: byte-identical records;
    the metadata records the input format."""
    from bertjax.cli import main as bertjax_main

    def create(name, *extra):
        out = tmp_path / name
        assert bertjax_main(["data", "create", "--input", corpus["paths"][name], "--format", _format(name),
                             "--vocab", corpus["vocab"], "--out", str(out), "--max-seq-length", str(SEQ),
                             "--max-predictions", str(PRED), "--dupe-factor", "2", "--doc-buffer", "3", *extra]) == 0
        return out

    expected = _records(create("wiki.txt"))
    assert len(expected) > 200
    for name in ("wiki.parquet", "wiki.jsonl.gz"):
        out = create(name, "--text-field", "text")
        assert _records(out) == expected, name
        metadata = json.loads((out / "pretrain-metadata.json").read_text())
        assert metadata["config"]["corpus_format"] == _format(name)
        assert metadata["input_formats"] == {"wiki.parquet": {"parquet": 1}, "wiki.jsonl.gz": {"jsonl+gzip": 1}}[name]


@pytest.mark.slow  # ~43 s, two fresh processes; the in-process resume tests hold the same reader positions
def test_resume_mid_parquet_and_mid_zstd_file_in_a_fresh_process(corpus, tmp_path):
    """Saved after 30 batches of 8 (about half of the ~500 instances of an epoch: the Parquet file's second of 3 row
    groups; inside the .jsonl.zst and .txt.zst files, whose readers are reopened and skipped in the new process):
    the next 5 batches equal an uninterrupted run's."""
    cases, expected = [], []
    for n, name in enumerate(["wiki.parquet", "wiki.jsonl.zst", "wiki.txt.zst"]):
        config = _config(corpus, name, doc_buffer_size=2, shuffle_buffer=4, line_batch=2)
        it = iter(make_pretraining_dataset(config, 8))
        for _ in range(30):
            next(it)
        checkpoint = save_iterator(it, str(tmp_path / f"ckpt{n}" / "it"))
        expected.append([{k: v.numpy() for k, v in next(it).items()} for _ in range(5)])
        cases.append(dict(config=dataclasses.asdict(config), checkpoint=checkpoint, after=5, batch=8,
                          process_index=0, process_count=1, out=str(tmp_path / f"out{n}.npz")))
    assert_fresh_process_resumes(cases, expected)


@pytest.mark.parametrize("name", ["wiki.parquet", "wiki.jsonl.zst"])
def test_processes_split_one_files_units_without_overlap_or_loss(corpus, name):
    """One file, 2 and 3 processes: each reads its own row groups / record chunks (unit k of file i belongs to
    process (i + k) % count): disjoint, and together every document once; and the pipeline runs on each."""
    everything = sorted(map(tuple, _documents(corpus["paths"][name], _format(name))))
    config = CorpusConfig(input=corpus["paths"][name], corpus_format=_format(name), line_batch=2)
    for count in (2, 3):
        shares = [[tuple(s.decode() for s in d["sentences"]) for d in documents_from_files(
            [corpus["paths"][name]], config, share=(p, count)).as_numpy_iterator()] for p in range(count)]
        assert all(shares) and sorted(sum(shares, [])) == everything
    # Two files (the same documents twice), 3 processes: unit k of file i belongs to process (i + k) % 3.
    copy = str(corpus["root"] / f"copy-{name}")
    Path(copy).write_bytes(Path(corpus["paths"][name]).read_bytes())
    shares = [[tuple(s.decode() for s in d["sentences"]) for d in documents_from_files(
        [corpus["paths"][name], copy], config, share=(p, 3)).as_numpy_iterator()] for p in range(3)]
    assert collections.Counter(sum(shares, [])) == collections.Counter(everything * 2)
    stats = [collections.Counter() for _ in range(2)]
    for p in range(2):
        _epoch_stats = make_pretraining_dataset(_config(corpus, name, line_batch=2, num_epochs=1), 8, p, 2,
                                                stats=stats[p], drop_remainder=False)
        assert sum(1 for _ in _epoch_stats) > 0
    assert stats[0]["documents_read"] + stats[1]["documents_read"] == len(everything)


def test_a_hub_dataset_is_read_offline_from_the_hub_cache(corpus, tmp_path, monkeypatch):
    """hf:NAME[:CONFIG][@SPLIT] reads the `refs/convert/parquet` revision's CONFIG/SPLIT/*.parquet from the hub
    cache (a layout built here; HF_HUB_OFFLINE): the same documents as the Parquet file; a dataset the cache
    lacks is one line saying how to download it."""
    huggingface_hub = pytest.importorskip("huggingface_hub")
    cache = tmp_path / "hub"
    repo = cache / "datasets--bertjax--wiki-sample"
    commit = "0123456789abcdef0123456789abcdef01234567"
    (repo / "refs" / "refs" / "convert").mkdir(parents=True)
    (repo / "refs" / "refs" / "convert" / "parquet").write_text(commit)
    for config, split in (("default", "train"), ("articles", "validation")):
        folder = repo / "snapshots" / commit / config / split
        folder.mkdir(parents=True)
        (folder / "0000.parquet").write_bytes(Path(corpus["paths"]["wiki.parquet"]).read_bytes())
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    expected = _documents(corpus["paths"]["wiki.parquet"], "parquet")
    assert CorpusConfig(input="hf:bertjax/wiki-sample").corpus_format == "parquet"
    for spec in ("hf:bertjax/wiki-sample", "hf:bertjax/wiki-sample:articles@validation"):
        assert _documents(spec, "auto") == expected
    with pytest.raises(FileNotFoundError, match=r"hf:bertjax/absent: .*not in the hub cache.*hf download "
                                                r"bertjax/absent --repo-type dataset"):
        expand_inputs(["hf:bertjax/absent"])
    batches = list(make_pretraining_dataset(PretrainingDataConfig(
        input="hf:bertjax/wiki-sample", vocab=corpus["vocab"], max_seq_length=SEQ, max_predictions_per_seq=PRED,
        num_epochs=1), 16, drop_remainder=False).as_numpy_iterator())
    assert sum(len(b["input_ids"]) for b in batches) > 100


def test_bad_input_is_named_by_file_and_line(corpus, tmp_path):
    root = tmp_path
    text = Path(corpus["paths"]["wiki.txt"]).read_bytes()[:5000]
    cases = {
        "a.txt.xz": (b"\xfd7zXZ\x00" + bytes(200), "wikitext", r"a\.txt\.xz: an xz archive, not text"),
        "b.zip": (b"PK\x03\x04" + bytes(200), "sentences", r"b\.zip: a zip archive, not text"),
        "c.txt.gz": (gzip.compress(bytes(range(256)) * 100), "wikitext",
                     r"c\.txt\.gz: a NUL byte in line 1 \(binary data, not text\) \(decompressed from gzip\)"),
        "d.txt.gz": (text, "wikitext", r"d\.txt\.gz: named as gzip-compressed, but its bytes are not"),
        "e.parquet": (text, "parquet", r"e\.parquet: expected a Parquet file \(PAR1\), found text"),
    }
    for name, (data, fmt, message) in cases.items():
        (root / name).write_bytes(data)
        with pytest.raises(ValueError, match=message):
            check_input_files([str(root / name)], CorpusConfig(corpus_format=fmt))
    with pytest.raises(ValueError, match=r"wiki\.parquet: expected a 'body' column \(columns: id, text; set "
                                         r"data\.text_field"):
        check_input_files([corpus["paths"]["wiki.parquet"]], CorpusConfig(corpus_format="parquet", text_field="body"))
    lines = Path(corpus["paths"]["wiki.jsonl"]).read_text().splitlines()
    (root / "h.jsonl.gz").write_bytes(gzip.compress(b'{"body": "x"}\n' + "\n".join(lines).encode()))
    with pytest.raises(ValueError, match=r"h\.jsonl\.gz: line 1: expected a JSON object with a 'text' field"):
        check_input_files([str(root / "h.jsonl.gz")], CorpusConfig(corpus_format="jsonl"))
    (root / "f.jsonl").write_text("\n".join(lines[:2] + ['{"id": 9, "body": "x"}'] + lines[2:]) + "\n")
    (root / "g.jsonl").write_text(lines[0] + "\n\n" + '{"text": "cut\n')
    for name, message in (("f.jsonl", r"f\.jsonl: line 3: expected a JSON object with a 'text' field \(fields: "
                                      r"id, body"),
                          ("g.jsonl", r"g\.jsonl: line 3: not valid JSON \(cut short\?\): Unterminated string "
                                      r"starting at \(column 10\); expected a JSON object with a 'text' field")):
        with pytest.raises(tf.errors.OpError, match=message):
            _documents(str(root / name), "jsonl")


def test_data_create_tells_a_bad_record_in_one_line(corpus, tmp_path, capsys):
    """Found while tf.data reads (inside TensorFlow's error): the command line prints the reader's one line."""
    from bertjax.cli import main as bertjax_main

    (tmp_path / "f.jsonl").write_text('{"text": "One. Two."}\n{"id": 9, "body": "x"}\n')
    assert bertjax_main(["data", "create", "--input", str(tmp_path / "f.jsonl"), "--format", "jsonl", "--vocab",
                         corpus["vocab"], "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == (f"bertjax data: error: {tmp_path / 'f.jsonl'}: line 2: expected a JSON object with a "
                       "'text' field (fields: id, body; set data.text_field / --text-field)")


def test_damage_in_records_is_counted_as_in_text(tmp_path):
    """Invalid UTF-8 inside a JSON string and an over-long line: replaced/cut and counted, as in text files."""
    (tmp_path / "d.jsonl").write_bytes(b'{"text": "caf\xe9 ok.\\nFine line.\\n' + b"x" * 50 + b'"}\n{"text": ""}\n')
    config = CorpusConfig(input=str(tmp_path / "d.jsonl"), corpus_format="jsonl", max_line_chars=20)
    docs = list(documents_from_files([config.input], config).as_numpy_iterator())
    assert [[s.decode() for s in d["sentences"]] for d in docs] == [["caf\ufffd ok.", "Fine line.", "x" * 20]]
    assert (int(docs[0]["invalid_utf8"]), int(docs[0]["truncated"])) == (1, 1)


# VmHWM, not getrusage's maxrss: Linux carries maxrss over exec, so a child would report the forking test's size.
RSS_SCRIPT = """
import re, sys
from bertjax.data.corpus import documents_from_files
from bertjax.data.data_config import CorpusConfig
config = CorpusConfig(input=sys.argv[1], corpus_format="parquet")
count = sum(1 for _ in documents_from_files([sys.argv[1]], config).as_numpy_iterator())
print(count, int(re.search(r"VmHWM:\\s*(\\d+)", open("/proc/self/status").read()).group(1)) // 1024)
"""


@pytest.mark.slow
def test_parquet_memory_stays_flat_from_1x_to_20x(corpus, tmp_path):
    """Peak RSS of a fresh process reading every document of one Parquet file: 1x (the 8 articles 10 times, ~1
    MB of text) and 20x (~20 MB), row groups of 16 articles: within 50 MiB (read row group by row group)."""
    records = corpus["records"]
    peaks = {}
    for scale in (1, 20):
        path = tmp_path / f"x{scale}.parquet"
        texts = [r["text"] for r in records] * (10 * scale)
        pq.write_table(pa.table({"text": texts}), path, row_group_size=16)
        out = subprocess.run([sys.executable, "-c", RSS_SCRIPT, str(path)], check=True, cwd=ROOT, text=True,
                             capture_output=True, env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"}).stdout.split()
        assert int(out[0]) == len(texts)
        peaks[scale] = int(out[1])
    assert peaks[20] - peaks[1] < 50, peaks


@pytest.mark.slow  # Beam's pipeline start (~17 CPU-s); its records checked: test_data_beam.py, test_cloud_storage.py
def test_beam_data_create_writes_the_text_files_records(corpus, tmp_path):
    """`data create --runner beam` (DirectRunner) reads the same formats through the same per-file reader:
    Parquet, zstd JSON Lines and a save_to_disk directory give the text file's records, shard by shard."""
    pytest.importorskip("apache_beam")
    from bertjax.data.beam_create import create_with_beam

    def create(name):
        out = tmp_path / name
        create_with_beam(_config(corpus, name, dupe_factor=2, masking="static"), str(out), 2, log=lambda *_: None)
        return [[r.numpy() for r in tf.data.TFRecordDataset(str(p))] for p in sorted(out.glob("*.tfrecord"))]

    expected = create("wiki.txt")
    assert sum(map(len, expected)) > 200
    for name in ("wiki.parquet", "wiki.jsonl.zst", "saved"):
        assert create(name) == expected, name


def test_a_parquet_file_with_a_cut_footer_is_named(corpus, tmp_path):
    path = tmp_path / "cut.parquet"
    data = Path(corpus["paths"]["wiki.parquet"]).read_bytes()
    path.write_bytes(data[:-20])  # the footer's length and magic bytes gone
    with pytest.raises(ValueError, match=rf"^{path}: not a readable Parquet file \(ArrowInvalid: .*\); cut, or still "
                                         r"being written\?$"):
        check_input_files([str(path)], CorpusConfig(corpus_format="parquet"))


def test_null_texts_are_counted_by_data_create(corpus, tmp_path):
    """JSON null and Parquet nulls: no document, and counted in the run's stats (one per null record)."""
    from bertjax.data.create import create_pretraining_data

    records = corpus["records"]
    lines = [json.dumps({"id": r["id"], "text": None if i % 3 == 0 else r["text"]}) for i, r in enumerate(records)]
    (tmp_path / "n.jsonl").write_text("\n".join(lines) + "\n")
    texts = [None if i % 2 == 0 else r["text"] for i, r in enumerate(records)]
    pq.write_table(pa.table({"text": texts}), tmp_path / "n.parquet", row_group_size=3)
    for name, fmt, nulls in (("n.jsonl", "jsonl", 3), ("n.parquet", "parquet", 4)):  # 8 records: 0,3,6 / 0,2,4,6
        config = PretrainingDataConfig(input=str(tmp_path / name), corpus_format=fmt, vocab=corpus["vocab"],
                                       max_seq_length=SEQ, max_predictions_per_seq=PRED, masking="static")
        summary = create_pretraining_data(config, str(tmp_path / f"out-{fmt}"), 1, log=lambda line: None)
        assert summary["stats"]["null_texts"] == nulls, name
