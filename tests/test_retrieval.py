"""Embedding evaluation (bertjax/finetune/retrieval.py, `bertjax eval embedding`): the metrics on hand-ranked cases
and against sentence-transformers' own evaluators on the same embeddings; SQuAD as a retrieval set split by
article; the command on the real all-MiniLM-L6-v2 and ../shared/data's SQuAD sample and STS-B dev."""
from __future__ import annotations

import itertools
import json
import math

import numpy as np
import pytest

from bertjax.cli import main as bertjax_main
from bertjax.finetune import retrieval
from bertjax.finetune.retrieval import retrieval_scores, squad_retrieval_set, sts_spearman

# Four unit-ish passages in the plane: p0 east, p1 north, p2 north-east, p3 west.
PASSAGES = np.array([[1, 0], [0, 1], [1, 1], [-1, 0]], np.float32)


def test_hand_ranked_queries_give_beir_metrics():
    queries = np.array([[1, 0], [0, 2], [1, 1], [3, 0]], np.float32)
    # q0 (east): cosines p0 1, p2 .707, p1 0, p3 -1 -> order p0 p2 p1 p3; its positive p1 at rank 2 (0-based).
    # q1 (north, length 2: scale is ignored): p1 1, p2 .707, then p0 and p3 tied at 0 -> p0 first (lower index),
    #    so its positive p3 is at rank 3, not 2.
    # q2 (north-east), relevant {p0, p1}: p2 1, then p0 and p1 tied at .707 -> p0 rank 1, p1 rank 2.
    # q3 (east): its positive p0 at rank 0.
    positives = [1, 3, [0, 1], 0]
    scores = retrieval_scores(queries, PASSAGES, positives, ks=(1, 2, 3))
    # recall@k: the share of a query's relevant passages in its top k, averaged over the queries.
    assert scores["recall@1"] == pytest.approx((0 + 0 + 0 + 1) / 4)
    assert scores["recall@2"] == pytest.approx((0 + 0 + 1 / 2 + 1) / 4)
    assert scores["recall@3"] == pytest.approx((1 + 0 + 1 + 1) / 4)
    # MRR@10: 1 / (rank of the first relevant + 1).
    assert scores["mrr@10"] == pytest.approx((1 / 3 + 1 / 4 + 1 / 2 + 1) / 4)
    # nDCG@10: sum of 1/log2(rank + 2) over relevant passages, over the same for them ranked first.
    q2 = (1 / math.log2(3) + 1 / math.log2(4)) / (1 + 1 / math.log2(3))
    assert scores["ndcg@10"] == pytest.approx((1 / math.log2(4) + 1 / math.log2(5) + q2 + 1) / 4)
    assert sorted(scores) == ["mrr@10", "ndcg@10", "recall@1", "recall@2", "recall@3"]
    assert sorted(retrieval_scores(queries, PASSAGES, positives)) == ["mrr@10", "ndcg@10", "recall@1", "recall@10",
                                                                      "recall@5"]


def test_a_positive_past_rank_ten_counts_nothing_at_ten():
    angles = np.arange(12) * 0.1  # passage i at angle 0.1 i from the query: ranked i-th
    passages = np.stack([np.cos(angles), np.sin(angles)], 1)
    query = np.array([[1.0, 0.0]])
    at_nine = retrieval_scores(query, passages, [9])  # the 10th place: still inside @10
    assert at_nine["recall@10"] == 1 and at_nine["recall@5"] == 0
    assert at_nine["mrr@10"] == pytest.approx(1 / 10) and at_nine["ndcg@10"] == pytest.approx(1 / math.log2(11))
    assert retrieval_scores(query, passages, [10]) == {"recall@1": 0, "recall@5": 0, "recall@10": 0, "mrr@10": 0,
                                                       "ndcg@10": 0}


def test_queries_scored_in_chunks_give_the_same_scores(monkeypatch):
    rng = np.random.default_rng(0)
    queries, passages = rng.normal(size=(37, 8)), rng.normal(size=(50, 8))
    positives = [int(i) for i in rng.integers(0, 50, 37)]
    whole = retrieval_scores(queries, passages, positives)
    monkeypatch.setattr(retrieval, "SIMILARITY_FLOATS", 3 * 50)  # three query rows at a time
    assert retrieval_scores(queries, passages, positives) == whole


@pytest.mark.parametrize("positives, message", [([0, 1], "2 positives for 4 queries"),
                                                ([0, 1, 2, 4], r"query 3: relevant passage \[4\] out of range"),
                                                ([0, 1, 2, []], "query 3 has no relevant passage")])
def test_positives_that_name_no_passage_are_refused(positives, message):
    with pytest.raises(ValueError, match=message):
        retrieval_scores(PASSAGES, PASSAGES, positives)


def test_sts_spearman_by_hand():
    a = np.array([[1, 0]] * 4, np.float32)
    b = np.array([[1, 0], [math.cos(math.pi / 6), 0.5], [0.5, math.cos(math.pi / 6)], [0, 1]], np.float32)
    # cosines 1, .866, .5, 0 rank 4, 3, 2, 1; gold 5, 3, 4, 0 ranks 4, 2, 3, 1: d^2 sums to 2,
    # rho = 1 - 6 * 2 / (4 * (16 - 1)) = 0.8.
    assert sts_spearman(a, b, [5, 3, 4, 0]) == pytest.approx(0.8)
    assert sts_spearman(a, b, [5, 4, 3, 0]) == pytest.approx(1.0)


def _static_model(embeddings: np.ndarray):
    """A real SentenceTransformer whose text "tI" embeds as row I of `embeddings` (a StaticEmbedding over a
    one-token-per-text vocabulary: the mean of one token's vector is that vector)."""
    import torch
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import StaticEmbedding
    from tokenizers import Tokenizer, models, pre_tokenizers

    tokenizer = Tokenizer(models.WordLevel({f"t{i}": i for i in range(len(embeddings))}, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return SentenceTransformer(modules=[StaticEmbedding(tokenizer, torch.tensor(embeddings, dtype=torch.float32))],
                               device="cpu")


def test_scores_equal_sentence_transformers_evaluators_on_the_same_embeddings():
    pytest.importorskip("sentence_transformers")
    from sentence_transformers.sentence_transformer.evaluation import (EmbeddingSimilarityEvaluator,
                                                                       InformationRetrievalEvaluator)

    rng = np.random.default_rng(1)
    passages = rng.normal(size=(40, 16)).astype(np.float32)
    passages[[7, 21, 33]] = passages[5]  # exact ties with passage 5: broken by the lower index in both
    sources = rng.integers(0, 40, 30)
    queries = (passages[sources] + rng.normal(scale=1.5, size=(30, 16))).astype(np.float32)
    # Each query's source passage is relevant, and up to two passages at random.
    positives = [sorted({int(sources[i]), *map(int, rng.integers(0, 40, i % 3))}) for i in range(30)]
    positives[0], positives[1] = [21], [33, 7]  # relevant passages tied with a lower-index one
    model = _static_model(np.concatenate([queries, passages]))
    name = lambda i: f"t{i}"  # noqa: E731
    evaluator = InformationRetrievalEvaluator(
        queries={f"q{i:02d}": name(i) for i in range(30)},
        corpus={f"d{j:02d}": name(30 + j) for j in range(40)},  # ids sort as the indices do
        relevant_docs={f"q{i:02d}": {f"d{j:02d}" for j in p} for i, p in enumerate(positives)},
        precision_recall_at_k=[1, 5, 10], accuracy_at_k=[1], map_at_k=[10], corpus_chunk_size=16, batch_size=64,
        write_csv=False)
    reference = evaluator(model)
    ours = retrieval_scores(queries, passages, positives)
    assert 0 < ours["recall@1"] < ours["recall@10"] < 1  # a case that separates the metrics
    for key, value in ours.items():
        assert value == pytest.approx(reference[f"cosine_{key}"], abs=1e-6), key

    a, b = rng.normal(size=(50, 16)).astype(np.float32), rng.normal(size=(50, 16)).astype(np.float32)
    gold = np.round(rng.uniform(0, 5, 50), 1)  # rounded: tied gold scores, as STS-B has
    sts = EmbeddingSimilarityEvaluator([name(i) for i in range(50)], [name(50 + i) for i in range(50)], gold.tolist(),
                                       similarity_fn_names=["cosine"], write_csv=False)
    sts = sts(_static_model(np.concatenate([a, b])))
    assert sts_spearman(a, b, gold) == pytest.approx(sts["spearman_cosine"], abs=1e-6)


def _squad(titles_contexts_questions, path):
    """A SQuAD 2.0 file: per article (title, [(context, [(question, answerable)])])."""
    data = {"version": "v2.0", "data": [
        {"title": title, "paragraphs": [
            {"context": context, "qas": [{"id": f"{title}-{c}-{q}", "question": question, "is_impossible": not ok,
                                          "answers": [{"text": context.split()[0], "answer_start": 0}] if ok else []}
                                         for q, (question, ok) in enumerate(qas)]}
            for c, (context, qas) in enumerate(paragraphs)]}
        for title, paragraphs in titles_contexts_questions]}
    path.write_text(json.dumps(data))
    return str(path)


ARTICLES = [(f"Article {k}", [(f"Context {k}.{c} text.", [(f"Question {k}.{c}.{q}?", q != 1) for q in range(3)])
                              for c in range(2)]) for k in range(6)]


def test_squad_splits_by_title_whatever_the_order_of_the_file(tmp_path):
    split = squad_retrieval_set(_squad(ARTICLES, tmp_path / "a.json"))
    shuffled = squad_retrieval_set(_squad(ARTICLES[::-1], tmp_path / "b.json"))
    assert split.heldout_titles == shuffled.heldout_titles and len(split.heldout_titles) == 3  # half of 6
    assert sorted(split.heldout_titles + split.train_titles) == [f"Article {k}" for k in range(6)]
    # Queries: the answerable questions (2 of 3 per paragraph) of the held-out articles, each against its context.
    held = [k for k in range(6) if f"Article {k}" in split.heldout_titles]
    assert sorted(split.queries) == sorted(f"Question {k}.{c}.{q}?" for k in held for c in range(2) for q in (0, 2))
    assert len(split.passages) == 12  # every context of the file
    for query, positive in zip(split.queries, split.positives):
        assert split.passages[positive] == "Context {}.{} text.".format(*query.split()[1].split(".")[:2])
    train = [k for k in range(6) if k not in held]
    assert sorted(split.train_pairs) == sorted((f"Question {k}.{c}.{q}?", f"Context {k}.{c} text.")
                                               for k in train for c in range(2) for q in (0, 2))


def test_a_context_repeated_is_one_passage_and_one_article_is_all_held_out(tmp_path):
    one = squad_retrieval_set(_squad([("Only", [("Same.", [("A?", True)]), ("Same.", [("B?", True)])])],
                                     tmp_path / "one.json"))
    assert one.passages == ["Same."] and one.positives == [0, 0] and one.train_pairs == []


def test_squad_without_data_and_stsb_with_a_bad_score_are_one_line_before_the_model_loads(tmp_path, capsys):
    bad_squad = tmp_path / "bad.json"
    bad_squad.write_text('{"version": "v2.0"}')
    squad = _squad(ARTICLES, tmp_path / "squad.json")
    stsb = tmp_path / "dev.tsv"
    header = "index\tgenre\tfilename\tyear\told_index\tsource1\tsource2\tsentence1\tsentence2\tscore\n"
    stsb.write_text(header + "0\tg\tf\ty\t0\ts\ts\tA man.\tA person.\t4.2\n1\tg\tf\ty\t1\ts\ts\tA dog.\tA cat.\tfive\n")
    missing = str(tmp_path / "no-such-checkpoint")
    a_file = tmp_path / "a-file"
    a_file.write_text("kept\n")
    for argv, expected in [
            (["--squad", str(bad_squad)], f"{bad_squad}: not a SQuAD JSON file (no 'data' key)"),
            (["--squad", squad, "--stsb", str(stsb)], f"{stsb}:3: label 'five' is not a number"),
            (["--squad", squad, "--output", str(a_file)],
             f"--output {a_file} is a file; expected a directory (metrics.json, summary.md)"),
            ([], "eval embedding: nothing to score; give --squad, --pairs and/or --stsb"),
            (["--stsb", str(stsb), "--write-train-pairs", str(tmp_path / "p.jsonl")],
             "--write-train-pairs writes SQuAD's training articles: it needs --squad"),
            (["--pairs", str(a_file)], f"{a_file}: unknown table format")]:
        code = bertjax_main(["eval", "embedding", "--checkpoint", missing, "--output", str(tmp_path / "out"), *argv])
        lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("bertjax ")]
        assert code == 2 and len(lines) == 1 and lines[0].startswith(f"bertjax eval: error: {expected}"), lines
    assert not (tmp_path / "out").exists() and a_file.read_text() == "kept\n"


def _chance_p_value(mrr: float, queries: int, passages: int) -> float:
    """P(MRR@10 >= `mrr`) when each query's one positive lands at a uniformly random rank among `passages`: exact,
    over every assignment of ranks."""
    reciprocal = [1 / (r + 1) if r < 10 else 0.0 for r in range(passages)]
    totals = [sum(ranks) for ranks in itertools.product(reciprocal, repeat=queries)]
    return sum(total >= mrr * queries - 1e-9 for total in totals) / len(totals)


def test_minilm_ranks_held_out_squad_questions_above_chance_and_writes_the_train_pairs(shared_data, minilm_dir,
                                                                                        tmp_path, capsys):
    sample = shared_data / "squad" / "sample-dev-v2.0.json"
    pairs = tmp_path / "train.jsonl"
    assert bertjax_main(["eval", "embedding", "--checkpoint", str(minilm_dir), "--squad", str(sample), "--output",
                         str(tmp_path / "before"), "--write-train-pairs", str(pairs)]) == 0
    assert "| recall@1 |" in capsys.readouterr().out
    metrics = json.loads((tmp_path / "before" / "metrics.json").read_text())
    assert (tmp_path / "before" / "summary.md").read_text().startswith("# Embedding scores of")
    squad = metrics["squad"]
    # The sample: 2 articles, 8 answerable questions over 4 contexts; one article held out.
    assert squad["passages"] == 4 and len(squad["heldout_titles"]) == len(squad["train_titles"]) == 1
    raw = json.loads(sample.read_text())["data"]
    answerable = {a["title"]: [qa["question"] for p in a["paragraphs"] for qa in p["qas"] if not qa["is_impossible"]]
                  for a in raw}
    assert squad["queries"] == len(answerable[squad["heldout_titles"][0]]) == 4
    train = [json.loads(line) for line in pairs.read_text().splitlines()]
    assert sorted(row["anchor"] for row in train) == sorted(answerable[squad["train_titles"][0]])
    contexts = {qa["question"]: p["context"] for a in raw for p in a["paragraphs"] for qa in p["qas"]}
    assert all(row["positive"] == contexts[row["anchor"]] for row in train)
    # Chance on this sample: 4 queries, 4 passages. recall@5 and @10 are 1 even for a random ranking, so they
    # cannot tell MiniLM from chance here; MRR@10 can: random rankings (expected MRR H_4 / 4 = 0.52) reach
    # MiniLM's less than once in 20.
    scores = squad["scores"]
    assert scores["recall@10"] == 1.0
    assert _chance_p_value(scores["mrr@10"], squad["queries"], squad["passages"]) < 0.05, scores

    # The written pairs scored as held-out pairs (--pairs): each anchor's positive among the distinct positives,
    # the scores those of sentence-transformers' MiniLM embeddings (mean pooling, 256 tokens) ranked alike.
    assert bertjax_main(["eval", "embedding", "--checkpoint", str(minilm_dir), "--pairs", str(pairs), "--output",
                         str(tmp_path / "pairs")]) == 0
    scored = json.loads((tmp_path / "pairs" / "metrics.json").read_text())["pairs"]
    passages = list(dict.fromkeys(row["positive"] for row in train))
    assert (scored["queries"], scored["passages"]) == (len(train), len(passages))
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(minilm_dir), device="cpu", local_files_only=True)
    model.max_seq_length = 256
    theirs = retrieval_scores(model.encode([row["anchor"] for row in train]), model.encode(passages),
                              [passages.index(row["positive"]) for row in train])
    assert scored["scores"] == pytest.approx(theirs, abs=1e-6)


@pytest.mark.slow  # 3 min on the 2-core machine (busy): 3,000 sentences through MiniLM
def test_minilm_scores_stsb_dev_as_published(shared_data, minilm_dir, tmp_path):
    sample, stsb = shared_data / "squad" / "sample-dev-v2.0.json", shared_data / "glue" / "STS-B" / "dev.tsv"
    assert bertjax_main(["eval", "embedding", "--checkpoint", str(minilm_dir), "--squad", str(sample), "--stsb",
                         str(stsb), "--output", str(tmp_path / "before")]) == 0
    metrics = json.loads((tmp_path / "before" / "metrics.json").read_text())
    assert "| STS-B (1500 pairs) | spearman_cosine |" in (tmp_path / "before" / "summary.md").read_text()
    # all-MiniLM-L6-v2 reports 0.82 on STS-B test; its dev pairs score alike.
    assert metrics["stsb"]["pairs"] == 1500 and metrics["stsb"]["spearman"] > 0.7, metrics["stsb"]
