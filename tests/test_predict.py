"""`bertjax predict` on a token-classification run (the NER job on a synthetic CoNLL set) gives transformers'
pipeline("token-classification", aggregation_strategy="first") on the exported model: the same entities, offsets
and scores; on a SQuAD 2.0 run (the real sample) the job's own answers, and on its export the answers and scores of
transformers' question-answering pipeline. (The classification side is checked in test_classify_job.py.)"""
from __future__ import annotations

import csv
import io
import json
import random
import re
import subprocess
import sys

import numpy as np
import pytest

from bertjax.cli import main as bertjax_main
from bertjax.finetune.settings import NerSettings, TrainSettings
from tests.conftest import save_tiny_hf

FILLER = "the a went to with and saw met in from".split()
PEOPLE, PLACES = ["alice", "bob", "carol"], ["paris", "london", "rome"]


def _sentence(rng: random.Random) -> list[tuple[str, str]]:
    words = [(w, "O") for w in rng.choices(FILLER, k=rng.randint(3, 8))]
    for names, tag in ((PEOPLE, "PER"), (PLACES, "LOC")):
        at = rng.randint(0, len(words))
        # A two-word person ("alice bob") is one entity: B- then I-.
        entity = [(rng.choice(names), f"B-{tag}")] + ([(rng.choice(names), f"I-{tag}")] if rng.random() < 0.3 else [])
        words[at:at] = entity
    return words


def _write_conll(path, sentences) -> None:
    path.write_text("".join("".join(f"{w} NN O {t}\n" for w, t in s) + "\n" for s in sentences))


@pytest.fixture(scope="module")
def ner_run(tmp_path_factory, minilm_dir):
    from bertjax.finetune import ner

    root = tmp_path_factory.mktemp("ner")
    init = save_tiny_hf(root / "init", minilm_dir / "vocab.txt", seed=0)
    rng = random.Random(0)
    _write_conll(root / "train.txt", [_sentence(rng) for _ in range(160)])
    _write_conll(root / "valid.txt", [_sentence(rng) for _ in range(16)])
    settings = TrainSettings(learning_rate=5e-3, batch_size=16, epochs=8, seed=1, eval_batch_size=16)
    result = ner.run(str(root), str(root / "work"), settings, NerSettings(max_seq_length=32, doc_stride=16),
                     init=init, save_checkpoint=True, export_hf=True)
    texts = [" ".join(w for w, _ in _sentence(rng)).replace("alice", "Alice") + "." for _ in range(12)]
    return root / "work", result, texts


def test_predict_token_classification_equals_pipeline(ner_run, tmp_path):
    work, result, texts = ner_run
    assert result["metrics"]["valid"]["overall"]["f1"] >= 0.5  # it learned: entities are there to compare
    source = tmp_path / "in.jsonl"
    source.write_text("".join(json.dumps({"sentence": t}) + "\n" for t in texts))
    assert bertjax_main(["predict", "--model", str(work), "--input", str(source), "--text-column", "sentence",
                         "--output", str(tmp_path / "out.jsonl"), "--max-seq-length", "64", "--batch-size", "8"]) == 0
    ours = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert [row["where"] for row in ours] == [f"{source}:{i + 1}" for i in range(len(texts))]

    transformers = pytest.importorskip("transformers")
    pipe = transformers.pipeline("token-classification", model=str(work / "hf"), aggregation_strategy="first",
                                 device="cpu")
    found = 0
    for text, row in zip(texts, ours):
        theirs = pipe(text)
        assert [(e["entity_group"], e["start"], e["end"]) for e in row["entities"]] == \
            [(e["entity_group"], e["start"], e["end"]) for e in theirs], text
        for mine, reference in zip(row["entities"], theirs):
            assert mine["score"] == pytest.approx(float(reference["score"]), abs=1e-4)
            assert mine["word"] == text[reference["start"]:reference["end"]]
        found += len(theirs)
    assert found >= len(texts)  # every sentence holds a person and a place

    # One text a line on stdin, JSON Lines on stdout (a process: nothing else on its stdout): the same entities.
    run = subprocess.run([sys.executable, "-m", "bertjax.cli", "predict", "--model", str(work / "hf"),
                          "--max-seq-length", "64", "--batch-size", "8"], input="\n".join(texts) + "\n",
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    piped = [json.loads(line) for line in run.stdout.splitlines()]  # nothing else on stdout
    assert [row["where"] for row in piped] == [f"stdin:{i + 1}" for i in range(len(texts))]
    assert [row["entities"] for row in piped] == [row["entities"] for row in ours]


def test_a_ner_runs_kept_checkpoint_predicts_as_its_export(ner_run):
    """The model a NER run keeps by default (checkpoint/) gives `predict` the entities its export gives."""
    from bertjax.finetune.predict import Predictor

    work, _, texts = ner_run
    kept, exported = Predictor(str(work / "checkpoint")), Predictor(str(work / "hf"))
    ours = kept.predict(texts)
    assert ours == exported.predict(texts) and any(row["entities"] for row in ours)


def test_predict_refuses_an_unclosed_quote_and_bad_outputs_before_the_model_loads(ner_run, tmp_path, capsys):
    """Rows in are rows out: a CSV whose quote opens a field and never closes (which would take in the rows after
    it) is refused naming its line. An --output that could not be written, or would replace the input, is refused
    before the input is read (an input that would be refused too tells which came first), and nothing is written."""
    work = ner_run[0]
    source = tmp_path / "in.csv"
    source.write_text('sentence\nalice went to paris\n"bob said hi\ncarol met rome\nthe end\n')
    original = source.read_bytes()
    link = tmp_path / "link.csv"
    link.symlink_to(source)
    (tmp_path / "folder").mkdir()

    def refused(output) -> str:
        argv = ["predict", "--model", str(work), "--input", str(source), "--text-column", "sentence",
                "--output", str(output)]
        assert bertjax_main(argv) == 2
        return capsys.readouterr().err.strip().splitlines()[-1]

    assert refused(tmp_path / "out.jsonl") == (
        f"bertjax predict: error: {source}:3: the quote that opens a field here is never closed (the field would run "
        'to the end of the file, line 5); a quote inside a field is written "" in a field wrapped in quotes')
    assert refused(tmp_path / "missing" / "out.jsonl").endswith(
        f"--output {tmp_path / 'missing' / 'out.jsonl'}: no directory {tmp_path / 'missing'}; create it first")
    assert refused(tmp_path / "folder").endswith(f"--output {tmp_path / 'folder'} is a directory; expected a file name")
    for same in (source, link):
        assert refused(same).endswith(f"--output {same} is the input {source}; writing it would replace the input, "
                                      "give another file")
    assert source.read_bytes() == original
    assert sorted(p.name for p in tmp_path.iterdir()) == ["folder", "in.csv", "link.csv"]
    assert not any((tmp_path / "folder").iterdir())


def test_predict_to_a_reader_that_stopped_ends_quietly_as_unix_tools_do(ner_run, tmp_path):
    """`bertjax predict | head -1`: the reader gone before the rows are written (here: closed before they are
    computed, so it is gone every time) ends the command by SIGPIPE (the shell's status 141), no traceback."""
    import signal

    work, _, texts = ner_run
    with open(tmp_path / "stderr", "wb") as stderr:
        process = subprocess.Popen([sys.executable, "-m", "bertjax.cli", "predict", "--model", str(work / "hf"),
                                    "--max-seq-length", "64", "--batch-size", "8"], stdin=subprocess.PIPE,
                                   stdout=subprocess.PIPE, stderr=stderr)
        process.stdout.close()
        process.stdin.write(("\n".join(texts) + "\n").encode())
        process.stdin.close()
        assert process.wait(timeout=600) == -signal.SIGPIPE
    err = (tmp_path / "stderr").read_text()
    assert "Traceback" not in err and "BrokenPipe" not in err, err[-3000:]


def test_predict_refuses_a_model_without_a_head(minilm_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(b"a sentence\n")))
    assert bertjax_main(["predict", "--model", str(minilm_dir)]) == 2
    assert "no fine-tuned classifier, token classifier or span head" in capsys.readouterr().err.strip().splitlines()[-1]


# ------------------------------------------------------------------------------------------- answer spans

@pytest.fixture(scope="module")
def squad_run(tmp_path_factory, minilm_dir, shared_data):
    """A tiny SQuAD 2.0 run trained a few steps on the real sample (128-token windows, stride 32: several windows
    a paragraph), its predictions of the sample and its HF export; and the sample's rows."""
    from bertjax.finetune import squad
    from bertjax.finetune.settings import SquadSettings

    sample = shared_data / "squad" / "sample-dev-v2.0.json"
    if not sample.exists():
        pytest.skip(f"{sample} is absent")
    root = tmp_path_factory.mktemp("squad")
    init = save_tiny_hf(root / "init", minilm_dir / "vocab.txt", seed=1)
    result = squad.run(str(root / "work"), TrainSettings(learning_rate=1e-3, batch_size=8, epochs=3, seed=0),
                       SquadSettings(version="2.0", max_seq_length=128, doc_stride=32, max_query_length=32),
                       init=init, train_file=str(sample), predict_file=str(sample), save_checkpoint=True,
                       export_hf=True)
    assert result["num_train_windows"] > result["num_train_examples"]  # long contexts: several windows
    data = json.loads(sample.read_text(encoding="utf-8"))
    rows = [(qa["id"], qa["question"], p["context"]) for a in data["data"] for p in a["paragraphs"] for qa in p["qas"]]
    return root / "work", rows


def _pipeline_answer(tokenizer, model, question: str, context: str, max_seq_len: int, handle_impossible: bool):
    """transformers' pipeline("question-answering") (top_k=1, max_answer_len=30) on one window: removed from
    transformers 5, it is rebuilt here from its steps: the fast tokenizer's offsets, the model, and the decoding
    function the library keeps (select_starts_ends, shared with its document-QA pipeline)."""
    import torch
    from transformers.pipelines.document_question_answering import select_starts_ends

    encoded = tokenizer(question, context, truncation="only_second", max_length=max_seq_len,
                        return_offsets_mapping=True, return_overflowing_tokens=True, return_tensors="np")
    assert len(encoded["input_ids"]) == 1, "the reference is for one-window contexts"
    # p_mask as the pipeline: 1 where a token is not of the context, [CLS] 0.
    p_mask = np.asarray([[s != 1 for s in encoded.sequence_ids(0)]], np.int64)
    p_mask[0, 0] = 0
    with torch.no_grad():
        out = model(**{k: torch.tensor(encoded[k]) for k in ("input_ids", "attention_mask", "token_type_ids")})
    starts, ends, scores, null = select_starts_ends(out.start_logits.numpy(), out.end_logits.numpy(), p_mask,
                                                    encoded["attention_mask"], 1000000, 1, handle_impossible, 30)
    offsets = encoded["offset_mapping"][0]
    start, end = int(offsets[starts[0]][0]), int(offsets[ends[0]][1])
    if handle_impossible and null > scores[0]:
        return {"answer": "", "score": null, "start": 0, "end": 0}
    return {"answer": context[start:end], "score": float(scores[0]), "start": start, "end": end}


def _sentence_with_answer(context: str, seed: int) -> str:
    """One sentence of the context (a one-window context for the reference)."""
    sentences = [s for s in re.split(r"(?<=\.) ", context) if s]
    return sentences[seed % len(sentences)]


def test_predict_answer_spans_equal_the_squad_job_and_the_pipeline(squad_run, tmp_path):
    """The job's answers on its run (several windows a context), and the pipeline's on the export."""
    from bertjax.finetune.predict import Predictor

    work, rows = squad_run
    # 1. The run's workdir on the sample's own rows: the job's answers (its windows, best span, null rule).
    source = tmp_path / "in.jsonl"
    source.write_text("".join(json.dumps({"q": q, "context": c}) + "\n" for _, q, c in rows))
    assert bertjax_main(["predict", "--model", str(work), "--input", str(source), "--question-column", "q",
                         "--output", str(tmp_path / "out.jsonl"), "--batch-size", "8"]) == 0
    ours = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    job = json.loads((work / "predictions.json").read_text(encoding="utf-8"))
    assert [row["answer"] for row in ours] == [job[qid] for qid, _, _ in rows]
    assert [row["where"] for row in ours] == [f"{source}:{i + 1}" for i in range(len(rows))]
    for row, (_, _, context) in zip(ours, rows):
        assert context[row["start"]:row["end"]] == row["answer"] and 0 < row["score"] <= 1
    # The job's answers at other settings, recomputed from its nbest_predictions.json and null_odds.json: v1.1 (the
    # best non-empty answer, over several windows) and v2.0 at a threshold that answers half of the questions.
    nbest = json.loads((work / "nbest_predictions.json").read_text(encoding="utf-8"))
    best = {qid: next((n["text"] for n in candidates if n["text"]), "") for qid, candidates in nbest.items()}
    odds = json.loads((work / "null_odds.json").read_text())
    threshold = float(np.median(list(odds.values())))
    for version, expected in (("1.1", best), ("2.0", {q: "" if odds[q] > threshold else best[q] for q in odds})):
        predictor = Predictor(str(work), batch_size=8, version=version, null_score_diff_threshold=threshold)
        mine = predictor.answers([q for _, q, _ in rows], [c for _, _, c in rows], [qid for qid, _, _ in rows])
        assert [row["answer"] for row in mine] == [expected[qid] for qid, _, _ in rows]
        for row, (_, _, context) in zip(mine, rows):  # v1.1 without a valid span among the n best: "", score 0
            assert context[row["start"]:row["end"]] == row["answer"] and 0 < row["score"] <= 1 or row == {
                "where": row["where"], "answer": "", "score": 0.0, "start": 0, "end": 0}
    assert {bool(row["answer"]) for row in mine} == {True, False}

    # 2. The HF export on one-sentence contexts: the pipeline's answers, offsets and scores, with SQuAD 2.0's
    # no-answer (the pipeline's handle_impossible_answer) and without it.
    transformers = pytest.importorskip("transformers")
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(work / "hf"))
    model = transformers.AutoModelForQuestionAnswering.from_pretrained(str(work / "hf")).eval()
    questions = [q for _, q, _ in rows] * 2
    contexts = [_sentence_with_answer(c, i) for i, (_, _, c) in enumerate(rows)] + \
        [_sentence_with_answer(c, i + 1) for i, (_, _, c) in enumerate(rows)]
    wheres = [str(i) for i in range(len(questions))]
    kinds = set()
    for version in ("2.0", "1.1"):
        # n_best_size 128: every start and end of the window, the pipeline's exhaustive search (the job's 20 best
        # starts x 20 best ends can miss the best valid span of this barely trained model).
        predictor = Predictor(str(work / "hf"), max_seq_length=128, batch_size=8, version=version, n_best_size=128)
        mine = predictor.answers(questions, contexts, wheres)
        for question, context, row in zip(questions, contexts, mine):
            theirs = _pipeline_answer(tokenizer, model, question, context, 128, version == "2.0")
            assert (row["answer"], row["start"], row["end"]) == (theirs["answer"], theirs["start"], theirs["end"]), \
                (version, question, context, row, theirs)
            assert row["score"] == pytest.approx(theirs["score"], rel=1e-3, abs=1e-6)
            kinds.add(bool(row["answer"]))
    assert kinds == {True, False}  # answers and no-answers both compared


def test_a_squad2_export_keeps_its_version_and_windows_for_predict(squad_run, tmp_path):
    """The export's config.json records the run's SQuAD settings, so predict on the export alone (no metrics.json
    beside it, no --squad-version or --max-seq-length) gives the job's own answers, no-answers included."""
    import shutil

    from bertjax.finetune.predict import Predictor

    work, rows = squad_run
    exported = tmp_path / "exported"
    shutil.copytree(work / "hf", exported)
    recorded = json.loads((exported / "config.json").read_text())["squad_settings"]
    assert (recorded["version"], recorded["max_seq_length"], recorded["doc_stride"]) == ("2.0", 128, 32)
    predictor = Predictor(str(exported), batch_size=8)
    assert (predictor.squad.version, predictor.max_seq_length) == ("2.0", 128)
    mine = predictor.answers([q for _, q, _ in rows], [c for _, _, c in rows], [qid for qid, _, _ in rows])
    job = json.loads((work / "predictions.json").read_text(encoding="utf-8"))
    assert [row["answer"] for row in mine] == [job[qid] for qid, _, _ in rows]
    assert "" in job.values()  # a no-answer among them: what a 1.1 decoding would not give


def test_a_squad_run_that_kept_only_its_checkpoint_answers_as_the_job_did(squad_run, tmp_path, capsys):
    """A SQuAD run keeps its checkpoint by default, and its closing line says `predict --model WORKDIR` uses it: on a
    run that kept only that (no hf/), predict refused a question/context file (`no column 'text'`, the checkpoint's
    head was not read before the input) and ran a `text` file's rows as a token classifier (an IndexError). Now
    it answers as the job did, and a file of texts is refused naming the columns a span model reads."""
    import shutil

    work, rows = squad_run
    run = tmp_path / "run"
    run.mkdir()
    shutil.copytree(work / "checkpoint", run / "checkpoint")
    shutil.copy(work / "metrics.json", run / "metrics.json")
    source = tmp_path / "in.csv"
    with open(source, "w", newline="", encoding="utf-8") as f:
        csv.writer(f).writerows([("question", "context")] + [(q, c) for _, q, c in rows])
    assert bertjax_main(["predict", "--model", str(run), "--input", str(source), "--output",
                         str(tmp_path / "out.jsonl"), "--batch-size", "8"]) == 0
    job = json.loads((work / "predictions.json").read_text(encoding="utf-8"))
    answers = [json.loads(line)["answer"] for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert answers == [job[qid] for qid, _, _ in rows]
    # Decoded as SQuAD 1.1 (this barely trained model's 2.0 answers are all no-answers): the best non-empty span of
    # the job's n best, over several windows a context.
    assert bertjax_main(["predict", "--model", str(run), "--input", str(source), "--output",
                         str(tmp_path / "v1.jsonl"), "--batch-size", "8", "--squad-version", "1.1"]) == 0
    nbest = json.loads((work / "nbest_predictions.json").read_text(encoding="utf-8"))
    best = {qid: next((n["text"] for n in candidates if n["text"]), "") for qid, candidates in nbest.items()}
    answers = [json.loads(line)["answer"] for line in (tmp_path / "v1.jsonl").read_text().splitlines()]
    assert answers == [best[qid] for qid, _, _ in rows] and any(answers)

    texts = tmp_path / "texts.csv"
    texts.write_text("text\nWho wrote the report?\n")
    assert bertjax_main(["predict", "--model", str(run), "--input", str(texts)]) == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith(f"bertjax predict: error: {texts}") and "'question'" in last, last


def test_predict_spans_names_a_missing_column(squad_run, tmp_path, capsys):
    work = squad_run[0]
    source = tmp_path / "in.csv"
    source.write_text("question,passage\nWho?,Someone.\n")
    assert bertjax_main(["predict", "--model", str(work / "hf"), "--input", str(source),
                         "--max-seq-length", "128"]) == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert str(source) in last and "'context'" in last, last
