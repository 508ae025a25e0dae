"""Corpus sources: document boundaries, bad input, file sharding, TFDS — against plain-Python readings of the files."""
from __future__ import annotations

import re

import numpy as np
import pytest
import tensorflow as tf

from bertjax.data.corpus import documents_from_files, expand_inputs, shard_files, split_sentences, tfds_documents
from bertjax.data.data_config import CorpusConfig


def _read(files, **kwargs) -> list[dict]:
    config = CorpusConfig(input=tuple(files), **{"corpus_format": "sentences", **kwargs})
    return list(documents_from_files(files, config, cycle_length=1).as_numpy_iterator())


def _sentences(docs) -> list[list[str]]:
    return [[s.decode() for s in d["sentences"]] for d in docs]


def _python_documents(text: str) -> list[list[str]]:
    """The original format read the way create_pretraining_data.py reads it (strip; blank line = new doc)."""
    docs, current = [], []
    for line in text.splitlines():
        line = line.strip()
        if not line:
            if current:
                docs.append(current)
            current = []
        else:
            current.append(line)
    if current:
        docs.append(current)
    return docs


@pytest.mark.parametrize("line_batch", [1, 3, 1024])
def test_sentence_format_documents_match_a_plain_reading(tmp_path, line_batch):
    text = ("\n\n  First doc, sentence one.\r\nFirst doc, sentence two.\n \t \n\n\n"
            "Second doc only sentence.\n\nThird doc a.\nThird doc b.\nThird doc c.")  # no final newline
    path = tmp_path / "c.txt"
    path.write_bytes(text.encode())
    docs = _read([str(path)], line_batch=line_batch)
    assert _sentences(docs) == _python_documents(text)
    assert len(docs) == 3


def test_documents_never_span_files(tmp_path):
    (tmp_path / "a.txt").write_text("a one.\na two.")  # the last document of a ends with the file
    (tmp_path / "b.txt").write_text("b one.\n\nb two.\n")
    docs = _sentences(_read([str(tmp_path / "a.txt"), str(tmp_path / "b.txt")]))
    assert sorted(map(tuple, docs)) == [("a one.", "a two."), ("b one.",), ("b two.",)]


def test_invalid_utf8_is_replaced_and_counted_and_long_lines_are_truncated(tmp_path):
    path = tmp_path / "bad.txt"
    path.write_bytes(b"fine line\ncaf\xe9 latin-1 bytes\n\xff\xfe\n" + "x".encode() * 50 + b"\n\nnext doc \xc3\n")
    docs = _read([str(path)], max_line_chars=20)
    sentences = _sentences(docs)
    assert sentences[0][:2] == ["fine line", "caf\ufffd latin-1 bytes"]
    assert sentences[0][3] == "x" * 20
    assert [int(d["invalid_utf8"]) for d in docs] == [2, 1]
    assert [int(d["truncated"]) for d in docs] == [1, 0]
    assert sentences[1] == ["next doc \ufffd"]


def test_empty_files_and_blank_documents_are_skipped(tmp_path):
    (tmp_path / "empty.txt").write_bytes(b"")
    (tmp_path / "blank.txt").write_bytes(b"\n\n   \n\t\n")
    (tmp_path / "one.txt").write_text("\n\nOnly sentence.\n\n\n")
    docs = _sentences(_read(sorted(str(p) for p in tmp_path.iterdir())))
    assert docs == [["Only sentence."]]


def test_a_file_without_blank_lines_is_cut_into_bounded_documents(tmp_path):
    path = tmp_path / "one-huge-doc.txt"
    path.write_text("".join(f"Sentence number {i}.\n" for i in range(1000)))
    docs = _sentences(_read([str(path)], line_batch=64, max_document_lines=200))
    assert all(len(d) <= 200 + 64 for d in docs) and len(docs) >= 4
    assert sum(docs, []) == [f"Sentence number {i}." for i in range(1000)]  # nothing lost or reordered


def test_wikitext_articles_are_documents(shared_data):
    path = shared_data / "wikitext-2" / "wiki.test.raw"
    raw = path.read_text(encoding="utf-8")
    titles = re.findall(r"^ = [^=].* = $", raw, flags=re.M)
    docs = _sentences(_read([str(path)], corpus_format="wikitext"))
    assert len(docs) == len(titles) == 62
    assert docs[0][0].startswith("Robert Boulter is an English film , television and theatre actor .")
    heading = re.compile(r"^\s*=.*=\s*$")
    assert not any(heading.match(s) for d in docs for s in d)
    # Nothing but headings and whitespace is lost: the words of the file equal the words of the documents.
    body = [line for line in raw.splitlines() if not heading.match(line)]
    assert " ".join(" ".join(body).split()) == " ".join(" ".join(" ".join(d) for d in docs).split())


def test_wrapped_text_keeps_every_word_and_splits_at_blank_line_runs(shared_data):
    path = shared_data / "gutenberg" / "grimms_fairy_tales_pg52521.txt"
    raw = path.read_bytes().decode("utf-8").replace("\r", "")
    expected = [d for d in re.split(r"\n(?:[ \t]*\n){3,}", raw) if d.strip()]
    docs = _sentences(_read([str(path)], corpus_format="wrapped"))
    assert len(docs) == len(expected)
    for got, want in zip(docs, expected):
        assert " ".join(got).split() == want.split()
    assert np.median([len(d) for d in docs]) > 20  # tales, not single paragraphs


def test_sentence_splitter():
    text = tf.constant(['He left. She stayed! Did they? "Yes." 3 days later, Mr. Smith came (again). ok'])
    assert [s.decode() for s in split_sentences(text)[0].numpy()] == [
        "He left.", "She stayed!", "Did they?", '"Yes."', "3 days later, Mr.", "Smith came (again). ok"]


def test_expand_inputs(tmp_path):
    for name in ("b.txt", "a.txt", "c.md"):
        (tmp_path / name).write_text("x\n")
    (tmp_path / "dir.txt").mkdir()
    assert expand_inputs([str(tmp_path / "*.txt")]) == [str(tmp_path / "a.txt"), str(tmp_path / "b.txt")]
    assert expand_inputs([f"{tmp_path / 'c.md'},{tmp_path / 'a.txt'}"]) == [str(tmp_path / "a.txt"),
                                                                            str(tmp_path / "c.md")]
    with pytest.raises(FileNotFoundError, match=r"nothing-\*\.txt.*matches no files"):
        expand_inputs([str(tmp_path / "a.txt"), str(tmp_path / "nothing-*.txt")])


def test_shard_files_is_a_disjoint_cover():
    files = [f"f{i:02d}" for i in range(11)]
    shards = [shard_files(files, i, 3) for i in range(3)]
    assert sorted(sum(shards, [])) == files and all(not set(a) & set(b) for a in shards for b in shards if a is not b)
    assert shard_files(files, 1, 3) == shard_files(list(files), 1, 3)
    with pytest.raises(ValueError, match="2 input file.*4 processes"):
        shard_files(files[:2], 0, 4)
    with pytest.raises(ValueError, match="process_index 3"):
        shard_files(files, 3, 3)


def test_unknown_format_is_rejected():
    with pytest.raises(ValueError, match="unknown corpus format 'xml'"):
        CorpusConfig(input="x", corpus_format="xml")


def test_tfds_source_reads_a_local_dataset_and_never_downloads(tmp_path):
    tfds = pytest.importorskip("tensorflow_datasets")
    texts = ["First doc. It has two sentences.\nA second paragraph here.", "Other doc! Short.", "Third one."]
    builder = tfds.dataset_builders.TfDataBuilder(
        name="bertjax_test_corpus", config="default", version="1.0.0", data_dir=str(tmp_path),
        split_datasets={"train": tf.data.Dataset.from_tensor_slices({"body": texts})},
        features=tfds.features.FeaturesDict({"body": tfds.features.Text()}), description="test corpus")
    builder.download_and_prepare()
    config = CorpusConfig(input=("tfds:bertjax_test_corpus/default:train",), text_field="body",
                          tfds_data_dir=str(tmp_path))
    docs = _sentences(tfds_documents(config).as_numpy_iterator())
    assert docs == [["First doc.", "It has two sentences.", "A second paragraph here."], ["Other doc!", "Short."],
                    ["Third one."]]
    with pytest.raises(ValueError, match="no text field 'text'"):
        tfds_documents(CorpusConfig(input=config.inputs, tfds_data_dir=str(tmp_path)))
    with pytest.raises(FileNotFoundError, match="not prepared.*never downloads"):
        tfds_documents(CorpusConfig(input=("tfds:wikipedia/20230601.en",), tfds_data_dir=str(tmp_path)))
