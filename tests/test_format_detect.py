"""`data create`, `vocab train` and pretraining's input without a format read JSON Lines and Parquet as such
(detected from the extension or the bytes by one function, and said), and refuse a format the files contradict."""
from __future__ import annotations

import collections
import importlib.util
import json
import re

import numpy as np
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


def _gutenberg_book(rng) -> str:
    """Project Gutenberg's layout: paragraphs of lines wrapped at ~60 characters, a blank line between paragraphs,
    four between tales (`wrapped`, whose documents end at 3 blank lines)."""
    import textwrap

    tales = []
    for _ in range(4):
        paragraphs = [" ".join(_sentence(rng) for _ in range(rng.randint(2, 4))) for _ in range(3)]
        tales.append("\n\n".join(textwrap.fill(p, 60) for p in paragraphs))
    return "\n\n\n\n".join(tales) + "\n"


def _wikitext(rng) -> str:
    """WikiText's layout: ` = Title = ` lines open articles, ` = = Heading = = ` lines are dropped."""
    lines = []
    for article in ("Castle", "River", "Queen"):
        lines += [f" = {article} = ", " ", " " + " ".join(_sentence(rng) for _ in range(3)) + " ", " ",
                  " = = History = = ", " ", " " + " ".join(_sentence(rng) for _ in range(2)) + " ", " "]
    return "\n".join(lines) + "\n"


def _sentence(rng) -> str:
    words = "king queen castle river forest stone bread winter night road gold child old wise long".split()
    return " ".join(rng.choice(words) for _ in range(rng.randint(4, 9))).capitalize() + "."


def _tokens(batches) -> collections.Counter:
    """Every real token of the rows (masked positions given back their ids), less [CLS], [SEP] and [PAD]."""
    counted = collections.Counter()
    for batch in batches:
        ids = np.array(batch["input_ids"])
        rows, slots = np.nonzero(batch["masked_lm_weights"] > 0)
        ids[rows, batch["masked_lm_positions"][rows, slots]] = batch["masked_lm_ids"][rows, slots]
        counted.update(ids[np.asarray(batch["input_mask"]) > 0].tolist())
    for special in (101, 102):  # [CLS] and [SEP] of the MiniLM (BERT uncased) vocabulary: one per row and part
        counted.pop(special, None)
    return counted


def _shard_tokens(out) -> collections.Counter:
    import tensorflow as tf

    from bertjax.data import schema, tfrecord

    shapes = schema.feature_shapes(64, 10)
    return _tokens({k: v.numpy() for k, v in tfrecord.parse_batch(serialized, shapes).items()}
                   for serialized in tf.data.TFRecordDataset(tfrecord.find_shards([str(out)])).batch(256))


def test_a_mixed_corpus_makes_one_set_of_shards_with_the_per_format_runs_documents(tmp_path, minilm_dir, capsys):
    """Gutenberg's wrapped books, WikiText and JSON Lines in one `data create` (a FORMAT: per input, JSON Lines
    detected): one set of shards whose documents are those of the three per-format runs (their count, and every
    token: whole-sentence rows without NSP keep each sentence once), read alike by the Beam runner and by
    pretraining's pipeline on the same inputs. A FORMAT: its files contradict, or one input whose files differ, is
    refused in one line."""
    import random

    from bertjax.data import format_detect
    from bertjax.data.data_config import CorpusConfig, PretrainingDataConfig
    from bertjax.data.pipeline import make_pretraining_dataset
    from bertjax.data.tokenizers import load_tokenizer

    rng = random.Random(0)
    book, wiki, docs = tmp_path / "tales.txt", tmp_path / "wiki.train.tokens", tmp_path / "notes.jsonl"
    book.write_text(_gutenberg_book(rng), encoding="utf-8")
    wiki.write_text(_wikitext(rng), encoding="utf-8")
    docs.write_text("".join(json.dumps({"text": _sentence(rng) + " " + _sentence(rng)}) + "\n" for _ in range(5)),
                    encoding="utf-8")
    vocab = minilm_dir / "vocab.txt"
    flags = ["--no-nsp", "--max-seq-length", "64", "--max-predictions", "10", "--dupe-factor", "1"]

    def create(out, inputs, *extra):
        argv = ["data", "create", "--vocab", str(vocab), "--out", str(tmp_path / out), *flags, *extra]
        assert main(argv + [x for i in inputs for x in ("--input", i)]) == 0
        return json.loads((tmp_path / out / "pretrain-metadata.json").read_text())

    parts = [create("book", [f"wrapped:{book}"]), create("wiki", [str(wiki)], "--format", "wikitext"),
             create("docs", [str(docs)])]
    capsys.readouterr()
    inputs = [f"wrapped:{book}", f"wikitext:{wiki}", str(docs)]
    mixed = create("mixed", inputs)
    said = capsys.readouterr().out
    assert f"--format mixed, a format per input: wrapped:{book}; wikitext:{wiki}; jsonl:{docs} (detected: " in said
    assert mixed["input_formats"] == {"jsonl": 1, "wikitext": 1, "wrapped": 1}
    assert (mixed["config"]["corpus_format"], mixed["config"]["input"]) == (
        "mixed", f"wrapped:{book},wikitext:{wiki},jsonl:{docs}")
    assert [p["stats"]["documents_read"] for p in parts] == [4, 3, 5]
    assert mixed["stats"]["documents_read"] == 12 and mixed["shards"] == ["pretrain-00000-of-00001.tfrecord"]
    tokens = _shard_tokens(tmp_path / "mixed")
    assert tokens == sum((_shard_tokens(tmp_path / name) for name in ("book", "wiki", "docs")), collections.Counter())
    tokenizer = load_tokenizer(str(vocab), None)
    assert tokens[tokenizer.vocab.index("castle")] > 0 and tokenizer.vocab.index("=") not in tokens  # no headings

    beam = create("beam", inputs, "--runner", "beam") if importlib.util.find_spec("apache_beam") else None
    if beam is not None:
        assert beam["stats"]["documents_read"] == 12 and _shard_tokens(tmp_path / "beam") == tokens
    streamed = make_pretraining_dataset(PretrainingDataConfig(
        input=f"wrapped:{book},wikitext:{wiki},{docs}", vocab=str(vocab), max_seq_length=64, max_predictions_per_seq=10,
        next_sentence_prediction=False, masking="static", num_epochs=1), 8, drop_remainder=False)
    assert _tokens(b for b in streamed.as_numpy_iterator()) == tokens

    def resolve(pattern):
        return format_detect.resolve(CorpusConfig(input=pattern), print).corpus_format

    with pytest.raises(ValueError, match=rf"^jsonl:{book} does not match its files: {book}: plain text, by its "
                                         r"bytes; write sentences \(or another text layout\):\.\.\., or leave its "
                                         r"FORMAT: out$"):
        resolve(f"jsonl:{book}")
    with pytest.raises(ValueError, match=r"the input mixes formats: .* give each format its own --input"):
        resolve(f"{tmp_path}/*.*")


def test_a_name_that_contradicts_the_bytes_is_one_policy_in_every_reader(tales, tmp_path, minilm_dir, capsys):
    """One policy for a file whose name says one thing and bytes another, in every reader: `data create`, `vocab
    train`, pretraining's eval input (format_detect.resolve, as `_eval_batches` calls it), and the users' tables of
    the fine-tunes and `predict` (table_data.read_rows). A name that says what the file is must agree with the
    bytes, else the file is refused naming both; a gzip-compressed Parquet file is refused the same way in each
    (`vocab train` detected it as Parquet, then refused it showing gzip bytes); a name that says nothing leaves it
    to the bytes, said in the detection line."""
    import gzip

    from bertjax.data import format_detect
    from bertjax.data.data_config import PretrainingDataConfig
    from bertjax.data.input_source import resolve
    from bertjax.finetune.table_data import read_rows

    vocab = minilm_dir / "vocab.txt"
    parquet_gz, text_jsonl, text_gz = tmp_path / "grimm.parquet.gz", tmp_path / "grimm.jsonl", tmp_path / "grimm.txt.gz"
    pq.write_table(pa.table({"text": tales, "label": ["a", "b"] * (len(tales) // 2)}), tmp_path / "grimm.parquet")
    parquet_gz.write_bytes(gzip.compress((tmp_path / "grimm.parquet").read_bytes()))
    text_jsonl.write_text("\n\n".join(tales), encoding="utf-8")
    text_gz.write_text("\n\n".join(tales), encoding="utf-8")
    rows_csv = tmp_path / "rows.csv"  # a table named CSV holding JSON Lines
    rows_csv.write_text("".join(json.dumps({"text": t, "label": "a"}) + "\n" for t in tales), encoding="utf-8")
    table_gz = tmp_path / "rows.csv.gz"  # a table named gzip-compressed holding plain CSV
    table_gz.write_text("text,label\n" + "".join(f"row {i},a\n" for i in range(4)), encoding="utf-8")
    compressed = (f"{parquet_gz}: a Parquet/Arrow file inside gzip compression: these are read as they are (Parquet "
                  "compresses its own pages); decompress it")
    corpus_lines = {parquet_gz: compressed, text_gz: f"{text_gz}: named as gzip-compressed, but its bytes are not ",
                    text_jsonl: f"{text_jsonl}: named as jsonl but its bytes are plain text: rename it, or set "}

    def last_error():
        return capsys.readouterr().err.strip().splitlines()[-1]

    for path, line in corpus_lines.items():
        assert main(["data", "create", "--input", str(path), "--vocab", str(vocab), "--out",
                     str(tmp_path / "records")]) == 2
        assert last_error().startswith(f"bertjax data: error: {line}")
        assert main(["vocab", "train", "--input", str(path), "--type", "wordpiece", "--vocab-size", "300",
                     "--out", str(tmp_path / "vocab")]) == 2
        assert last_error().startswith(f"bertjax vocab: error: {line}")
        eval_data = PretrainingDataConfig(input=str(path), vocab=str(vocab), max_seq_length=64)
        with pytest.raises(ValueError) as caught:
            resolve(eval_data, "data.eval_input", log=lambda said: None)
        assert str(caught.value).startswith(line)
    for path, line in ((parquet_gz, compressed), (text_jsonl, f"{text_jsonl}: named as JSON Lines but its bytes are "
                                                             "plain text: rename it to what it is"),
                       (rows_csv, f"{rows_csv}: named as CSV but its bytes are JSON Lines (each line a JSON "
                                  "object): rename it to what it is"),
                       (table_gz, f"{table_gz}: named as gzip-compressed, but its bytes are not ")):
        with pytest.raises(ValueError) as caught:
            read_rows(str(path), ["text"])
        assert str(caught.value).startswith(line), str(caught.value)

    # A name that says nothing: the bytes decide, said.
    unnamed = tmp_path / "grimm.data"
    unnamed.write_bytes(gzip.compress("".join(json.dumps({"text": t}) + "\n" for t in tales).encode()))
    assert format_detect.detect([str(unnamed)]) == ("jsonl", f"{unnamed}: JSON Lines (each line a JSON object), by "
                                                             "its bytes")
