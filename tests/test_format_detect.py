"""`data create`, `vocab train` and pretraining's input without a format read JSON Lines and Parquet as such
(detected from the extension or the bytes by one function, and said), and refuse a format the files contradict."""
from __future__ import annotations

import json
import re

import pytest

from bertjax.cli import main

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")


@pytest.fixture(scope="module")
def tales(shared_data) -> list[str]:
    """Real text: the first 30 stretches of 10 paragraphs of Grimm's fairy tales, a record each."""
    text = (shared_data / "gutenberg" / "grimms_fairy_tales_pg52521.txt").read_text(encoding="utf-8")
    paragraphs = [" ".join(p.split()) for p in re.split(r"\n\s*\n", text) if p.strip()]
    return ["\n".join(paragraphs[i:i + 10]) for i in range(200, 500, 10)]


def _create(inputs, out, vocab, *extra) -> dict:
    assert main(["data", "create", "--input", str(inputs), "--vocab", str(vocab), "--out", str(out),
                 "--max-seq-length", "64", "--max-predictions", "10", "--dupe-factor", "1", *extra]) == 0
    return json.loads(next(out.glob("*.json")).read_text())


def test_json_lines_and_parquet_are_detected_and_read_as_with_their_format(tales, tmp_path, minilm_dir, capsys):
    vocab = minilm_dir / "vocab.txt"
    jsonl = tmp_path / "grimm.jsonl"
    jsonl.write_text("".join(json.dumps({"text": t}) + "\n" for t in tales), encoding="utf-8")
    # Parquet under a name that does not say so: told by its bytes.
    parquet = tmp_path / "grimm.data"
    pq.write_table(pa.table({"text": tales}), parquet)

    named = _create(jsonl, tmp_path / "named", vocab, "--format", "jsonl")
    capsys.readouterr()
    detected = _create(jsonl, tmp_path / "detected", vocab)
    out = capsys.readouterr().out
    assert f"--format jsonl, detected: {jsonl}: JSON Lines (each line a JSON object), by its extension and bytes" \
        in out, out
    assert detected["stats"] == named["stats"] and detected["input_formats"] == {"jsonl": 1}
    assert named["stats"]["documents_read"] == len(tales)

    from_parquet = _create(parquet, tmp_path / "parquet", vocab)
    assert f"--format parquet, detected: {parquet}: Parquet/Arrow, by its bytes" in capsys.readouterr().out
    assert from_parquet["input_formats"] == {"parquet": 1}
    assert from_parquet["stats"]["documents_read"] == len(tales) and from_parquet["examples"] == named["examples"]

    # A --format the files contradict: one line naming the file, what it is, and the flag to give.
    assert main(["data", "create", "--input", str(jsonl), "--vocab", str(vocab), "--out", str(tmp_path / "bad"),
                 "--format", "sentences"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"bertjax data: error: --format sentences does not match the input: {jsonl}: JSON Lines "
                   f"(each line a JSON object), by its extension and bytes; pass --format jsonl, or leave --format "
                   f"out"], err
    assert not (tmp_path / "bad").exists()


def test_text_is_the_sentences_layout_and_mixed_or_misnamed_files_are_refused(tales, tmp_path):
    from bertjax.data import format_detect
    from bertjax.data.data_config import CorpusConfig

    def resolve(pattern, corpus_format="auto", key="--format"):
        return format_detect.resolve(CorpusConfig(input=pattern, corpus_format=corpus_format), said.append,
                                     key).corpus_format

    text = tmp_path / "grimm.txt"
    text.write_text("\n\n".join(tales), encoding="utf-8")
    said = []
    assert resolve(str(text)) == "sentences"
    assert said == [f"--format sentences, detected: {text}: plain text, by its bytes (paragraphs, wikitext and "
                    f"wrapped text need --format)"]
    assert resolve(str(text), "wrapped") == "wrapped"
    jsonl = tmp_path / "grimm.jsonl"
    jsonl.write_text(json.dumps({"text": tales[0]}) + "\n", encoding="utf-8")
    with pytest.raises(ValueError, match=r"the input mixes formats: .*grimm.jsonl is JSON Lines .*grimm.txt is "
                                         r"plain text"):
        resolve(f"{tmp_path}/grimm.*")
    # Pretraining names its own key.
    with pytest.raises(ValueError, match=r"^data.corpus_format=paragraphs does not match the input: .*grimm.jsonl: "
                                         r"JSON Lines .*; set data.corpus_format=jsonl, or auto$"):
        resolve(str(jsonl), "paragraphs", "data.corpus_format")
    misnamed = tmp_path / "tales.jsonl"
    misnamed.write_text(tales[0], encoding="utf-8")
    with pytest.raises(ValueError, match=r"tales.jsonl: named as jsonl but its bytes are plain text"):
        resolve(str(misnamed))


def test_every_command_that_reads_a_corpus_detects_its_format_alike(tales, tmp_path, minilm_dir, capsys):
    """`data create`, `vocab train` and pretraining's input, each on the same JSON Lines, gzipped JSON Lines and
    Parquet file without a format, say the same detection and read the records' text (never the raw lines: those
    would bring `{"text":` into every sentence)."""
    import gzip

    import tensorflow as tf

    from bertjax.data.data_config import PretrainingDataConfig
    from bertjax.data.pipeline import make_pretraining_dataset
    from bertjax.data.tokenizers import load_tokenizer

    vocab = minilm_dir / "vocab.txt"
    lines = "".join(json.dumps({"text": t}) + "\n" for t in tales)
    files = {"jsonl": tmp_path / "grimm.jsonl", "jsonl+gzip": tmp_path / "grimm.jsonl.gz",
             "parquet": tmp_path / "grimm.parquet"}
    files["jsonl"].write_text(lines, encoding="utf-8")
    files["jsonl+gzip"].write_bytes(gzip.compress(lines.encode()))
    pq.write_table(pa.table({"text": tales}), files["parquet"])
    tokenizer = load_tokenizer(str(vocab), None)
    brace = tokenizer.vocab.index("{")
    assert not any("{" in t for t in tales)
    for kind, path in files.items():
        said = f"detected: {path}: " + ("Parquet/Arrow, by its extension and bytes" if kind == "parquet" else
                                        "JSON Lines (each line a JSON object), by its extension and bytes")
        family = kind.split("+")[0]
        capsys.readouterr()
        created = _create(path, tmp_path / f"{kind}-records", vocab)
        assert f"--format {family}, {said}" in capsys.readouterr().out
        assert created["stats"]["documents_read"] == len(tales) and created["input_formats"] == {kind: 1}

        out = tmp_path / f"{kind}-vocab"
        assert main(["vocab", "train", "--input", str(path), "--type", "wordpiece", "--vocab-size", "300",
                     "--min-count", "1", "--out", str(out)]) == 0
        assert f"--format {family}, {said}" in capsys.readouterr().out
        pieces = (out / "vocab.txt").read_text(encoding="utf-8").split("\n")
        assert "{" not in pieces and "w" in pieces  # every character of the text read, none of the JSON

        batches = make_pretraining_dataset(PretrainingDataConfig(
            input=str(path), vocab=str(vocab), max_seq_length=64, max_predictions_per_seq=10, num_epochs=1,
            doc_buffer_size=100), 16, drop_remainder=False)
        assert f"data.corpus_format={family}, {said}" in capsys.readouterr().out
        ids = tf.concat([b["input_ids"] for b in batches], 0).numpy()
        assert ids.size and brace not in ids
