"""SQuAD reading / windowing: token ids and character offsets vs HF BertTokenizerFast, run_squad's windowing."""
from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import pytest

from bertjax.finetune import squad_data

SHARED_DATA = Path(__file__).resolve().parents[1] / ".." / "shared" / "data"
TRICKY = ["µGuru ΣΑΣ κύριος İstanbul ÅNGSTRÖM naïve café co\u0301te Zoë's",
          "tab\there\u00a0nbsp\u200bzw\u0007bell\ufffdx end.",
          "中文字符測試 日本語テキスト 한국어", "emoji 😀 ok ☃snowman", "a" * 120 + " long word (and-dashes)",
          "“quotes” — em-dash… U.S.A. 3.14159 $5,000", "x\u00adsoft hyphen", "", "   ", "naïvely–unaffected"]


@pytest.fixture(scope="module")
def tok(minilm_dir):
    from bertjax.data.tokenizers import WordPieceTokenizer

    return WordPieceTokenizer(str(minilm_dir / "vocab.txt"))


@pytest.fixture(scope="module")
def hf(minilm_dir):
    transformers = pytest.importorskip("transformers")
    return transformers.BertTokenizerFast(vocab=str(minilm_dir / "vocab.txt"), do_lower_case=True)


def _sample() -> dict:
    path = SHARED_DATA / "squad" / "sample-dev-v2.0.json"
    if not path.exists():
        pytest.skip(f"SQuAD sample not found at {path} (shared data is only present beside the project)")
    return json.loads(path.read_text(encoding="utf-8"))


def test_whitespace_words():
    assert squad_data.whitespace_words("  a bc\td\u202fe\n") == [(2, 3), (4, 6), (7, 8), (9, 10)]
    assert squad_data.whitespace_words("") == []


def test_context_ids_and_offsets_match_hf(tok, hf):
    contexts = TRICKY + [p["context"] for a in _sample()["data"] for p in a["paragraphs"]]
    ours, unaligned = squad_data.tokenize_contexts(contexts, tok, lower_case=True)
    assert unaligned == 0
    for context, ct in zip(contexts, ours):
        ref = hf(context, add_special_tokens=False, return_offsets_mapping=True)
        assert ct.ids == ref["input_ids"], context
        spans = [context[a:b] for a, b in ct.offsets]
        ref_spans = [context[a:b] for a, b in ref["offset_mapping"]]
        assert spans == ref_spans, context


def test_align_pieces_unk_and_accents():
    # [UNK] takes a whole basic token: here the run "☃x" up to the punctuation.
    assert squad_data.align_pieces("☃x,y", ["[UNK]", ",", "y"], lower_case=True) == [(0, 2), (2, 3), (3, 4)]
    # a decomposed accent is dropped by normalization but belongs to the piece before it
    assert squad_data.align_pieces("Cafe\u0301!", ["cafe", "!"], lower_case=True) == [(0, 5), (5, 6)]
    assert squad_data.align_pieces("Café", ["Caf", "##é"], lower_case=False) == [(0, 3), (3, 4)]
    assert squad_data.align_pieces("abc", ["ab"], lower_case=True) is None  # pieces must cover the word


def _check_is_max_context(doc_spans, cur_span_index, position):
    """run_squad's original per-token loop, as the reference."""
    best_score, best_span_index = None, None
    for span_index, (start, length) in enumerate(doc_spans):
        end = start + length - 1
        if position < start or position > end:
            continue
        score = min(position - start, end - position) + 0.01 * length
        if best_score is None or score > best_score:
            best_score, best_span_index = score, span_index
    return cur_span_index == best_span_index


def test_doc_spans_and_max_context():
    assert squad_data.doc_spans(10, 4, 2) == [(0, 4), (2, 4), (4, 4), (6, 4)]
    assert squad_data.doc_spans(3, 4, 2) == [(0, 3)]
    assert squad_data.doc_spans(0, 4, 2) == [(0, 0)]  # an empty context still gets one window
    for n, width, stride in [(10, 4, 2), (50, 7, 3), (100, 20, 20), (33, 8, 1), (5, 5, 5)]:
        spans = squad_data.doc_spans(n, width, stride)
        masks = squad_data.max_context_mask(spans, n)
        for i, (start, length) in enumerate(spans):
            want = [_check_is_max_context(spans, i, start + k) for k in range(length)]
            assert list(masks[i]) == want
        # every token has maximal context in exactly one window
        counts = np.zeros(n, int)
        for (start, length), mask in zip(spans, masks):
            counts[start:start + length] += mask
        assert (counts == 1).all()


def test_training_features_point_at_the_answer(tok):
    data = _sample()
    for max_seq_length, stride in [(384, 128), (48, 8)]:
        examples, feats = squad_data.featurize(data, tok, True, is_training=True, version_2=True,
                                       max_seq_length=max_seq_length, doc_stride=stride)
        assert len(examples) == 14
        found = set()
        for f in range(len(feats)):
            ex = examples[feats.example_index[f]]
            s, e = feats.start_positions[f], feats.end_positions[f]
            if s == 0:
                assert e == 0
                continue
            off = feats.token_offsets[f]
            assert ex.context[off[s, 0]:off[e, 1]] == ex.context[ex.start_char:ex.end_char] == ex.answers[0]
            assert feats.segment_ids[f, s] == 1 and feats.input_mask[f, e] == 1
            found.add(ex.qas_id)
        assert found == {ex.qas_id for ex in examples if not ex.is_impossible}
        # layout: [CLS] query [SEP] context [SEP], padding after
        row = feats.input_ids[0]
        n = int(feats.input_mask[0].sum())
        assert row[0] == tok.cls_id and row[n - 1] == tok.sep_id and (row[n:] == tok.pad_id).all()
        assert (feats.token_offsets[0, :n][feats.segment_ids[0, :n] == 0] == -1).all()
    # The small windows make several windows per paragraph.
    assert len(feats) > 3 * len(examples)


def _one_paragraph(context, qas):
    return {"version": "v2.0", "data": [{"title": "t", "paragraphs": [{"context": context, "qas": qas}]}]}


def test_training_spans_read_the_answer_text_or_are_relocated_or_skipped(caplog):
    context = "Messi moved to Barcelona in Spain. 東京 is not 北京. Zürich is the city; the city is big."
    qas = [{"id": "exact", "question": "?", "answers": [{"text": "Barcelona", "answer_start": 15}]},
           # off by +5: the text there is "lona in S", not the answer: its only occurrence is used
           {"id": "shifted", "question": "?", "answers": [{"text": "Barcelona", "answer_start": 20}]},
           {"id": "cjk", "question": "?", "answers": [{"text": "東京", "answer_start": 42}]},
           {"id": "accent", "question": "?", "answers": [{"text": "Zürich", "answer_start": 53}]},
           {"id": "twice", "question": "?", "answers": [{"text": "the city", "answer_start": 3}]},
           {"id": "absent", "question": "?", "answers": [{"text": "Madrid", "answer_start": 15}]}]
    with caplog.at_level(logging.WARNING):
        examples, _, skipped = squad_data.read_examples(_one_paragraph(context, qas), True, True, source="x.json")
    spans = {ex.qas_id: context[ex.start_char:ex.end_char] for ex in examples}
    assert spans == {"exact": "Barcelona", "shifted": "Barcelona", "cjk": "東京", "accent": "Zürich"}
    assert skipped == 2
    assert ("x.json: training answers: 1 at their answer_start, 3 whose text is not at answer_start moved to the "
            "only occurrence of that text in the context, 2 skipped") in caplog.text


def test_real_squad_spans_with_shifted_starts_never_train_on_other_words(shared_data):
    """The real SQuAD 2.0 sample: as annotated every answer is where it says; with every start shifted by +5, an
    answer is either moved to its text or skipped, never taken at the shifted place."""
    dataset = json.loads((shared_data / "squad" / "sample-dev-v2.0.json").read_text(encoding="utf-8"))
    for article in dataset["data"]:  # training takes one answer per question
        for paragraph in article["paragraphs"]:
            for qa in paragraph["qas"]:
                qa["answers"] = qa["answers"][:1]
    examples, _, skipped = squad_data.read_examples(dataset, True, True)
    answerable = [ex for ex in examples if not ex.is_impossible]
    assert skipped == 0 and len(answerable) == 8
    assert all(ex.context[ex.start_char:ex.end_char] == ex.answers[0] for ex in answerable)

    for article in dataset["data"]:
        for paragraph in article["paragraphs"]:
            for qa in paragraph["qas"]:
                for answer in qa["answers"]:
                    answer["answer_start"] += 5
    shifted, _, skipped = squad_data.read_examples(dataset, True, True)
    moved = [ex for ex in shifted if not ex.is_impossible]
    assert len(moved) + skipped == len(answerable) and len(moved) > 0
    assert all(ex.context[ex.start_char:ex.end_char] == ex.answers[0] for ex in moved)


def test_training_needs_exactly_one_answer():
    qas = [{"id": "q", "question": "?", "answers": [{"text": "a", "answer_start": 0}] * 2}]
    with pytest.raises(ValueError, match="x.json: question q: .*exactly 1 answer"):
        squad_data.read_examples(_one_paragraph("a b", qas), True, False, source="x.json")


def test_empty_context_and_long_question(tok):
    long_q = " ".join(["why"] * 100)
    qas = [{"id": "empty", "question": "What?", "answers": [], "is_impossible": True},
           {"id": "long", "question": long_q, "answers": [], "is_impossible": True}]
    data = {"version": "v2.0", "data": [{"title": "t", "paragraphs": [
        {"context": "", "qas": qas[:1]}, {"context": "Some short context.", "qas": qas[1:]}]}]}
    examples, feats = squad_data.featurize(data, tok, True, is_training=True, version_2=True, max_seq_length=96,
                                   max_query_length=64)
    assert len(feats) == 2
    assert int(feats.input_mask[0].sum()) == 1 + 2 + 2  # [CLS] what ? [SEP] [SEP]
    query_part = (feats.segment_ids[1] == 0) & (feats.input_mask[1] == 1)
    assert int(query_part.sum()) == 1 + 64 + 1  # query cut to max_query_length
    with pytest.raises(ValueError, match="leaves no room"):
        squad_data.featurize(data, tok, True, is_training=False, version_2=True, max_seq_length=60, max_query_length=64)


def test_a_bad_answer_start_is_named_with_the_file_and_question():
    from bertjax.finetune.squad_data import read_examples

    dataset = {"data": [{"paragraphs": [{"context": "The cat sat on the mat.", "qas": [
        {"id": "q1", "question": "Who sat?", "answers": [{"text": "The cat", "answer_start": 0}]},
        {"id": "q2", "question": "Where?", "answers": [{"text": "the mat", "answer_start": "12a"}]}]}]}]}
    with pytest.raises(ValueError, match=r"^train-v1\.1\.json: question q2: answer \{'text': 'the mat', "
                                         r"'answer_start': '12a'\}: expected a 'text' and an integer 'answer_start' "
                                         r"\(invalid literal for int\(\) with base 10: '12a'\)$"):
        read_examples(dataset, is_training=True, version_2=False, source="train-v1.1.json")


def test_a_question_id_that_appears_twice_is_refused_naming_both_places(tmp_path, capsys):
    """Two questions with one id were collapsed into one prediction (and one score): `finetune squad` and `eval
    squad` refuse the file, naming the id and both places."""
    from bertjax.cli import main

    qa = {"id": "q1", "question": "who?", "answers": [{"text": "Ann", "answer_start": 0}]}
    data = {"version": "1.1", "data": [
        {"title": "a", "paragraphs": [{"context": "Ann went home.", "qas": [qa, {**qa, "id": "q2"}]}]},
        {"title": "b", "paragraphs": [{"context": "Ann sat down.", "qas": [qa]}]}]}
    path = tmp_path / "dev.json"
    path.write_text(json.dumps(data))
    said = (f"{path}: question id 'q1' appears twice (article 0, paragraph 0, question 0; article 1, paragraph 0, "
            "question 0); each question needs its own id")
    (tmp_path / "p.json").write_text(json.dumps({"q1": "Ann", "q2": "Ann"}))
    for argv in (["finetune", "squad", "--version", "1.1", "--train", str(path), "--init", "none", "--workdir",
                  str(tmp_path / "w")],
                 ["finetune", "squad", "--version", "1.1", "--predict", str(path), "--init", "none", "--workdir",
                  str(tmp_path / "w")],
                 ["eval", "squad", "--data", str(path), "--predictions", str(tmp_path / "p.json")]):
        assert main(argv) == 2
        assert capsys.readouterr().err.strip().splitlines()[-1].endswith(said)
    assert not (tmp_path / "w").exists()
