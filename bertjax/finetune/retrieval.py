"""Embedding models scored as retrieval is: recall@k, MRR@10, nDCG@10 of each query's relevant passages among all
passages, and STS-B's Spearman; the sets they are scored on (SQuAD questions and contexts, STS-B's dev pairs).

The metrics are sentence-transformers' InformationRetrievalEvaluator's (BEIR's, binary relevance): passages ranked
by cosine similarity, ties broken by the lower passage index (its ascending corpus id), recall@k the share of a
query's relevant passages in its top k, MRR@k the reciprocal rank of the first one there, nDCG@k the DCG of the top
k over the DCG of the relevant passages ranked first; each a mean over the queries. STS: Spearman's rho between
each pair's cosine similarity and its gold score (EmbeddingSimilarityEvaluator's `spearman_cosine`).
"""
from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Collection, Sequence

import numpy as np

# Query rows scored at once: a chunk's similarity matrix holds at most this many floats (128 MiB in float32), so
# 10^5 passages never need a 10^5 x 10^5 matrix.
SIMILARITY_FLOATS = 1 << 25
RANK_CUTOFF = 10  # MRR@10 and nDCG@10, as BEIR and MTEB report them


def unit_rows(embeddings) -> np.ndarray:
    """float32 rows scaled to length 1 (a zero row stays zero, as torch's normalize leaves it)."""
    x = np.asarray(embeddings, np.float32)
    if x.ndim != 2:
        raise ValueError(f"expected a [rows, dims] matrix of embeddings, got shape {x.shape}")
    if not np.isfinite(x).all():
        raise ValueError("the embeddings hold NaN or infinite values")
    return x / np.maximum(np.linalg.norm(x, axis=1, keepdims=True), 1e-12)


def _relevant_sets(positives, num_queries: int, num_passages: int) -> list[np.ndarray]:
    if len(positives) != num_queries:
        raise ValueError(f"{len(positives)} positives for {num_queries} queries; expected one entry per query")
    sets = []
    for i, entry in enumerate(positives):
        indices = np.unique(np.asarray([entry] if np.isscalar(entry) else list(entry), np.int64))
        if not len(indices):
            raise ValueError(f"query {i} has no relevant passage")
        if indices.min() < 0 or indices.max() >= num_passages:
            raise ValueError(f"query {i}: relevant passage {indices.tolist()} out of range; there are "
                             f"{num_passages} passages")
        sets.append(indices)
    return sets


def relevant_ranks(query_embeddings, passage_embeddings, positives) -> list[np.ndarray]:
    """For each query, the 0-based rank of each of its relevant passages (sorted) when all passages are ordered by
    cosine similarity, highest first, ties by the lower passage index. Queries go in chunks (SIMILARITY_FLOATS)."""
    queries, passages = unit_rows(query_embeddings), unit_rows(passage_embeddings)
    if queries.shape[1] != passages.shape[1]:
        raise ValueError(f"queries have {queries.shape[1]} dimensions, passages {passages.shape[1]}")
    relevant = _relevant_sets(positives, len(queries), len(passages))
    chunk = max(1, SIMILARITY_FLOATS // max(len(passages), 1))
    ranks = []
    for start in range(0, len(queries), chunk):
        similarity = queries[start:start + chunk] @ passages.T
        for row, indices in zip(similarity, relevant[start:start + chunk]):
            scores = row[indices]
            # Passages before relevant passage j: those scoring higher, and those scoring the same with a lower index.
            above = (row[None, :] > scores[:, None]).sum(1)
            tied_before = ((row[None, :] == scores[:, None]) & (np.arange(len(row))[None, :] < indices[:, None])).sum(1)
            ranks.append(np.sort(above + tied_before))
    return ranks


def retrieval_scores(query_embeddings, passage_embeddings, positives: Sequence[int | Collection[int]],
                     ks: Sequence[int] = (1, 5, 10)) -> dict[str, float]:
    """recall@k for each k in `ks`, mrr@10 and ndcg@10 of the queries' relevant passages among all passages.

    query_embeddings [Q, D], passage_embeddings [P, D] (any scale: cosine similarity is computed here);
    positives[i]: the index, or a collection of indices, of query i's relevant passage(s).
    """
    ranks = relevant_ranks(query_embeddings, passage_embeddings, positives)
    if not ranks:
        raise ValueError("no queries to score")
    scores = {f"recall@{k}": float(np.mean([(r < k).sum() / len(r) for r in ranks])) for k in ks}
    cutoff = RANK_CUTOFF
    scores[f"mrr@{cutoff}"] = float(np.mean([1.0 / (r[0] + 1) if r[0] < cutoff else 0.0 for r in ranks]))
    discount = 1.0 / np.log2(np.arange(cutoff) + 2)
    scores[f"ndcg@{cutoff}"] = float(np.mean([discount[r[r < cutoff]].sum() / discount[:min(len(r), cutoff)].sum()
                                              for r in ranks]))
    return scores


def sts_spearman(embeddings_a, embeddings_b, gold_scores) -> float:
    """Spearman's rho between the cosine similarity of each pair (row i of a with row i of b) and its gold score."""
    from scipy.stats import spearmanr

    a, b = unit_rows(embeddings_a), unit_rows(embeddings_b)
    gold = np.asarray(gold_scores, np.float64)
    if a.shape != b.shape or gold.shape != (len(a),):
        raise ValueError(f"pairs of {a.shape} and {b.shape} embeddings with {gold.shape} gold scores; expected "
                         "one score per pair of rows")
    if len(gold) < 2:
        raise ValueError("Spearman's rho needs at least 2 pairs")
    return float(spearmanr(gold, (a * b).sum(1)).statistic)


# ------------------------------------------------------------------------------------------------ the sets

@dataclasses.dataclass(frozen=True)
class RetrievalSet:
    """SQuAD as retrieval: the held-out articles' answerable questions (`queries`) against every unique context
    of the file (`passages`), `positives[i]` the index of query i's context; `train_pairs` (question, context)
    from the other articles, for a fine-tune that never sees a held-out question."""
    queries: list[str]
    passages: list[str]
    positives: list[int]
    train_pairs: list[tuple[str, str]]
    heldout_titles: list[str]
    train_titles: list[str]


def heldout_titles(titles: Sequence[str], heldout_fraction: float) -> set[str]:
    """The titles held out: ordered by the SHA-256 of each title (a function of the title alone, not of the file's
    order or of the other titles' presence), the first round(fraction x count) of them, at least one, and at least
    one left for training where there are two or more."""
    if not 0 < heldout_fraction < 1:
        raise ValueError(f"heldout_fraction={heldout_fraction} must be in (0, 1)")
    unique = sorted(set(titles), key=lambda t: hashlib.sha256(t.encode("utf-8")).hexdigest())
    count = min(max(1, round(heldout_fraction * len(unique))), max(1, len(unique) - 1))
    return set(unique[:count])


def squad_retrieval_set(path: str, heldout_fraction: float = 0.5) -> RetrievalSet:
    """A SQuAD 1.1/2.0 JSON file as a retrieval set, split by article title (heldout_titles). Questions without an
    answer (2.0's is_impossible) are left out: they have no relevant passage. An article without a title, a
    paragraph without a context or a question without text is an error naming the file and where."""
    from bertjax.finetune.squad_data import load_squad_json

    data = load_squad_json(path)
    articles = data["data"]
    if not isinstance(articles, list) or not articles:
        raise ValueError(f"{path}: 'data' holds no articles; expected a list of {{title, paragraphs}}")
    titled = []
    for a, article in enumerate(articles):
        where = f"{path}: article {a}"
        if not isinstance(article, dict) or not isinstance(article.get("title"), str):
            raise ValueError(f"{where}: expected an object with a 'title' string (the split is by title)")
        if not isinstance(article.get("paragraphs"), list):
            raise ValueError(f"{where} ({article['title']!r}): expected a 'paragraphs' list")
        titled.append(article)
    held = heldout_titles([article["title"] for article in titled], heldout_fraction)
    passages, passage_index = [], {}
    queries, positives, train_pairs = [], [], []
    for a, article in enumerate(titled):
        for p, paragraph in enumerate(article["paragraphs"]):
            where = f"{path}: article {a} ({article['title']!r}), paragraph {p}"
            context = paragraph.get("context") if isinstance(paragraph, dict) else None
            if not isinstance(context, str) or not context.strip():
                raise ValueError(f"{where}: expected a non-empty 'context' string")
            if not isinstance(paragraph.get("qas"), list):
                raise ValueError(f"{where}: expected a 'qas' list")
            index = passage_index.setdefault(context, len(passages))
            if index == len(passages):
                passages.append(context)
            for q, qa in enumerate(paragraph["qas"]):
                question = qa.get("question") if isinstance(qa, dict) else None
                if not isinstance(question, str) or not question.strip():
                    raise ValueError(f"{where}, question {q}: expected a non-empty 'question' string")
                if qa.get("is_impossible", False):
                    continue
                if article["title"] in held:
                    queries.append(question)
                    positives.append(index)
                else:
                    train_pairs.append((question, context))
    if not queries:
        raise ValueError(f"{path}: the held-out articles ({', '.join(sorted(held))}) hold no answerable question")
    return RetrievalSet(queries, passages, positives, train_pairs, sorted(held),
                        sorted({a["title"] for a in titled} - held))


def distinct_passages(positives: Sequence[str]) -> tuple[list[str], list[int]]:
    """Held-out (anchor, positive) pairs as retrieval: the distinct positive texts (the passages, each once: a
    repeated one would rank beside itself as a miss) and, for each pair, its positive's index among them."""
    passages = list(dict.fromkeys(positives))
    index = {text: i for i, text in enumerate(passages)}
    return passages, [index[text] for text in positives]


def write_train_pairs(pairs: Sequence[tuple[str, str]], target: str) -> None:
    """The pairs as JSON Lines with sentence-transformers' column names, {"anchor": ..., "positive": ...} a line,
    written whole (what `bertjax finetune embedding --train` reads)."""
    from bertjax.runtime import jsonio
    from bertjax.runtime.outputs import write_whole

    write_whole(target, "".join(jsonio.dumps({"anchor": anchor, "positive": positive}, ensure_ascii=False) + "\n"
                                for anchor, positive in pairs))


def stsb_pairs(path: str):
    """STS-B's pairs with gold scores (GLUE's STS-B dev.tsv layout, read as `finetune glue` reads it): Examples with
    text_a, text_b and labels (float32 scores 0-5). A row with a non-numeric score is an error naming file:line."""
    from bertjax.finetune.glue_data import get_task, read_split

    task = get_task("stsb")
    return read_split(task, path, task.dev)


def summary_markdown(metrics: dict) -> str:
    """metrics.json's scores as a short Markdown table (summary.md)."""
    lines = [f"# Embedding scores of {metrics['checkpoint']}", "",
             f"{metrics['pooling']} pooling, {metrics['max_seq_length']} tokens", "", "| set | metric | value |",
             "|---|---|---|"]
    squad = metrics.get("squad")
    if squad:
        name = f"SQuAD held-out ({squad['queries']} questions, {squad['passages']} passages)"
        lines += [f"| {name} | {key} | {value:.4f} |" for key, value in squad["scores"].items()]
    pairs = metrics.get("pairs")
    if pairs:
        name = f"{pairs['file']} ({pairs['queries']} anchors, {pairs['passages']} positives)"
        lines += [f"| {name} | {key} | {value:.4f} |" for key, value in pairs["scores"].items()]
    stsb = metrics.get("stsb")
    if stsb:
        lines.append(f"| STS-B ({stsb['pairs']} pairs) | spearman_cosine | {stsb['spearman']:.4f} |")
    return "\n".join(lines) + "\n"
