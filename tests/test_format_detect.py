"""`data create` and `vocab train` without --format read JSON Lines and Parquet as such (detected from the
extension or the bytes, and said), and refuse a --format the files contradict."""
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

    text = tmp_path / "grimm.txt"
    text.write_text("\n\n".join(tales), encoding="utf-8")
    said = []
    assert format_detect.resolve([str(text)], None, said.append) == "sentences"
    assert said == [f"--format sentences, detected: {text}: plain text, by its bytes (paragraphs, wikitext and "
                    f"wrapped text need --format)"]
    assert format_detect.resolve([str(text)], "wrapped", said.append) == "wrapped"
    jsonl = tmp_path / "grimm.jsonl"
    jsonl.write_text(json.dumps({"text": tales[0]}) + "\n", encoding="utf-8")
    with pytest.raises(ValueError, match=r"the input mixes formats: .*grimm.jsonl is JSON Lines .*grimm.txt is "
                                         r"plain text"):
        format_detect.resolve([f"{tmp_path}/grimm.*"], None, said.append)
    misnamed = tmp_path / "tales.jsonl"
    misnamed.write_text(tales[0], encoding="utf-8")
    with pytest.raises(ValueError, match=r"tales.jsonl: named as jsonl but its bytes are plain text"):
        format_detect.resolve([str(misnamed)], None, said.append)
