"""Pretraining instances from a buffer of tokenized documents (google-research/bert's algorithm).

The original create_pretraining_data.py holds the whole corpus in RAM; here the unit of work is a
*block*: a bounded buffer of documents. Per document it follows the original exactly (target length
with short_seq_prob, A/B split at a random segment, 50% random next from another document of the
buffer with the unused segments put back, truncate_seq_pair). Sentences are contiguous in a document,
so every segment is a token span [start, end) of the block's flat token array; instances are
assembled into padded arrays in one vectorised step.

Without NSP the sentences are packed RoBERTa-style (FULL-SENTENCES): contiguous sentences up to the
length budget, crossing documents with an extra [SEP] at each document boundary.
"""
from __future__ import annotations

import collections
import dataclasses
import random

import numpy as np

from bertjax.data.data_config import InstanceConfig


@dataclasses.dataclass
class Block:
    """Tokenized documents: sentence j is ids[sentence_splits[j]:sentence_splits[j+1]], document d is
    sentences doc_splits[d]:doc_splits[d+1]. Build with `Block.from_ragged` to drop empty entries."""

    ids: np.ndarray
    sentence_splits: np.ndarray
    doc_splits: np.ndarray

    @classmethod
    def from_ragged(cls, ids: np.ndarray, sentence_splits: np.ndarray, doc_splits: np.ndarray,
                    stats: collections.Counter | None = None) -> "Block":
        """Drops sentences without tokens and documents without sentences (counted in `stats`)."""
        sentence_len = np.diff(sentence_splits)
        keep_sentence = sentence_len > 0
        sentence_doc = np.repeat(np.arange(len(doc_splits) - 1), np.diff(doc_splits))
        kept_per_doc = np.bincount(sentence_doc[keep_sentence], minlength=len(doc_splits) - 1)
        if stats is not None:
            stats["documents_read"] += len(doc_splits) - 1
            stats["empty_documents"] += int(np.sum(kept_per_doc == 0))
            stats["empty_sentences"] += int(np.sum(~keep_sentence))
        kept_docs = kept_per_doc[kept_per_doc > 0]
        new_sentence_splits = np.concatenate([[0], np.cumsum(sentence_len[keep_sentence])])
        return cls(ids=np.asarray(ids), sentence_splits=new_sentence_splits.astype(np.int64),
                   doc_splits=np.concatenate([[0], np.cumsum(kept_docs)]).astype(np.int64))

    @property
    def num_documents(self) -> int:
        return len(self.doc_splits) - 1


@dataclasses.dataclass
class Instances:
    """Instances as token spans: part k of instance part_instance[k] is ids[part_start[k]:part_end[k]],
    followed by [SEP], in segment part_segment[k]. `document` is the source document of segment A."""

    part_instance: np.ndarray
    part_start: np.ndarray
    part_end: np.ndarray
    part_segment: np.ndarray
    next_sentence_label: np.ndarray
    document: np.ndarray

    def __len__(self) -> int:
        return len(self.next_sentence_label)


class _PartsBuilder:
    def __init__(self):
        self.parts: list[tuple[int, int, int, int]] = []
        self.labels: list[int] = []
        self.documents: list[int] = []

    def add(self, parts: list[tuple[int, int, int]], label: int, document: int):
        n = len(self.labels)
        self.parts.extend((n, start, end, segment) for start, end, segment in parts)
        self.labels.append(label)
        self.documents.append(document)

    def build(self) -> Instances:
        parts = np.array(self.parts, np.int64).reshape(-1, 4)
        return Instances(part_instance=parts[:, 0], part_start=parts[:, 1], part_end=parts[:, 2],
                         part_segment=parts[:, 3], next_sentence_label=np.array(self.labels, np.int32),
                         document=np.array(self.documents, np.int64))


def _truncate_seq_pair(a: list[int], b: list[int], max_num_tokens: int, rng: random.Random):
    """truncate_seq_pair on spans [start, end): one token at a time off the longer (B on a tie), from the
    front or the back with equal odds.

    Computed in closed form with the same distribution: which side loses a token depends only on the
    lengths, and each removal's front/back coin is independent, so the front removals of a side are
    Binomial(k, 1/2) (the popcount of k random bits) instead of k separate draws.
    """
    len_a, len_b = a[1] - a[0], b[1] - b[0]
    if len_a + len_b <= max_num_tokens:
        return
    half_up, half_down = (max_num_tokens + 1) // 2, max_num_tokens // 2
    if len_a <= len_b:  # B is trimmed while it is at least as long as A
        new_a, new_b = (len_a, max_num_tokens - len_a) if 2 * len_a <= max_num_tokens + 1 else (half_up, half_down)
    else:  # A is trimmed while it is strictly longer
        new_a, new_b = (max_num_tokens - len_b, len_b) if 2 * len_b <= max_num_tokens else (half_up, half_down)
    for span, removed in ((a, len_a - new_a), (b, len_b - new_b)):
        if removed:
            front = bin(rng.getrandbits(removed)).count("1")
            span[0] += front
            span[1] -= removed - front


def _nsp_instances(block: Block, config: InstanceConfig, rng: random.Random, out: _PartsBuilder,
                   stats: collections.Counter):
    splits, doc_splits = block.sentence_splits.tolist(), block.doc_splits.tolist()
    num_docs = block.num_documents
    max_num_tokens = config.max_seq_length - 3
    for doc in range(num_docs):
        first, end = doc_splits[doc], doc_splits[doc + 1]
        target = max_num_tokens
        if rng.random() < config.short_seq_prob:
            target = rng.randint(2, max_num_tokens)
            stats["short_target_documents"] += 1
        chunk_first, current_length, i = first, 0, first
        while i < end:
            current_length += splits[i + 1] - splits[i]
            if i == end - 1 or current_length >= target:
                chunk_size = i - chunk_first + 1
                a_end = rng.randint(1, chunk_size - 1) if chunk_size >= 2 else 1
                span_a = [splits[chunk_first], splits[chunk_first + a_end]]
                # A one-segment chunk is always a random next (so short targets push the label-1 share
                # above 50%, as in the original); otherwise a fair coin decides.
                stats["forced_random_next"] += chunk_size == 1
                if chunk_size == 1 or rng.random() < 0.5:
                    label = 1
                    target_b = target - (span_a[1] - span_a[0])
                    for _ in range(10):
                        other = rng.randint(0, num_docs - 1)
                        if other != doc:
                            break
                    stats["random_next_same_document"] += other == doc
                    other_first, other_end = doc_splits[other], doc_splits[other + 1]
                    j = other_first + rng.randint(0, other_end - other_first - 1)
                    b_start = splits[j]
                    while True:  # whole sentences until the target is reached or the document ends
                        b_end = splits[j + 1]
                        if b_end - b_start >= target_b or j == other_end - 1:
                            break
                        j += 1
                    span_b = [b_start, b_end]
                    i -= chunk_size - a_end  # put the unused segments back
                else:
                    label = 0
                    span_b = [splits[chunk_first + a_end], splits[i + 1]]
                _truncate_seq_pair(span_a, span_b, max_num_tokens, rng)
                out.add([(span_a[0], span_a[1], 0), (span_b[0], span_b[1], 1)], label, doc)
                chunk_first, current_length = i + 1, 0
            i += 1


def _packed_instances(block: Block, config: InstanceConfig, rng: random.Random, out: _PartsBuilder):
    """FULL-SENTENCES packing: [CLS] doc_x sentences [SEP] doc_y sentences [SEP] ... up to max_seq_length."""
    splits, doc_splits = block.sentence_splits.tolist(), block.doc_splits.tolist()
    budget = config.max_seq_length - 1  # after [CLS]; every part pays one [SEP]
    order = list(range(block.num_documents))
    rng.shuffle(order)
    parts: list[tuple[int, int, int]] = []
    used = 0
    first_doc = -1
    for doc in order:
        part = None
        for j in range(doc_splits[doc], doc_splits[doc + 1]):
            start, end = splits[j], splits[j + 1]
            extra = (end - start) + (1 if part is None else 0)
            if used + extra > budget and (parts or part is not None):
                if part is not None:
                    parts.append(tuple(part))
                out.add(parts, 0, first_doc)
                parts, part, used = [], None, 0
                extra = (end - start) + 1
            if part is None:
                part = [start, end, 0]
                first_doc = doc if not parts else first_doc
            else:
                part[1] = end
            used += extra
            if used > budget:  # a sentence longer than the whole budget is cut
                part[1] -= used - budget
                used = budget
        if part is not None:
            parts.append(tuple(part))
    if parts:
        out.add(parts, 0, first_doc)


def create_instances(block: Block, config: InstanceConfig, rng: random.Random,
                     stats: collections.Counter | None = None, shuffle: bool = True) -> Instances:
    """All instances of one pass over the block's documents, shuffled (as the original does)."""
    stats = stats if stats is not None else collections.Counter()
    out = _PartsBuilder()
    if block.num_documents:
        if config.next_sentence_prediction:
            _nsp_instances(block, config, rng, out, stats)
        else:
            _packed_instances(block, config, rng, out)
    instances = out.build()
    stats["document_passes"] += block.num_documents
    stats["instances"] += len(instances)
    if shuffle and len(instances) > 1:
        order = list(range(len(instances)))
        rng.shuffle(order)
        instances = _reorder(instances, np.array(order))
    return instances


def _reorder(instances: Instances, order: np.ndarray) -> Instances:
    rank = np.empty_like(order)
    rank[order] = np.arange(len(order))
    new_instance = rank[instances.part_instance]
    sort = np.argsort(new_instance, kind="stable")  # parts stay in order within an instance
    return Instances(part_instance=new_instance[sort], part_start=instances.part_start[sort],
                     part_end=instances.part_end[sort], part_segment=instances.part_segment[sort],
                     next_sentence_label=instances.next_sentence_label[order], document=instances.document[order])


def assemble(block: Block, instances: Instances, max_seq_length: int, cls_id: int, sep_id: int,
             pad_id: int) -> dict[str, np.ndarray]:
    """Padded int32 arrays: input_ids, input_mask, segment_ids [N, max_seq_length]; next_sentence_labels [N]."""
    n = len(instances)
    lengths = instances.part_end - instances.part_start
    cost = lengths + 1  # each part is followed by [SEP]
    # Offset of each part inside its instance: 1 ([CLS]) + the costs of the earlier parts.
    instance_first_part = np.searchsorted(instances.part_instance, np.arange(n))
    cum = np.cumsum(cost) - cost
    offset = 1 + cum - cum[instance_first_part][instances.part_instance]
    total = np.bincount(instances.part_instance, weights=cost, minlength=n).astype(np.int64)
    if n and total.max() + 1 > max_seq_length:
        raise AssertionError(f"instance of length {total.max() + 1} exceeds max_seq_length {max_seq_length}")

    input_ids = np.full((n, max_seq_length), pad_id, np.int32)
    segment_ids = np.zeros((n, max_seq_length), np.int32)
    input_ids[:, 0] = cls_id
    part_of_token = np.repeat(np.arange(len(lengths)), lengths)
    within = np.arange(int(lengths.sum())) - np.repeat(np.cumsum(lengths) - lengths, lengths)
    rows = instances.part_instance[part_of_token]
    cols = offset[part_of_token] + within
    input_ids[rows, cols] = block.ids[instances.part_start[part_of_token] + within]
    segment_ids[rows, cols] = instances.part_segment[part_of_token]
    sep_cols = offset + lengths
    input_ids[instances.part_instance, sep_cols] = sep_id
    segment_ids[instances.part_instance, sep_cols] = instances.part_segment
    input_mask = (np.arange(max_seq_length)[None, :] < (total + 1)[:, None]).astype(np.int32)
    return {"input_ids": input_ids, "input_mask": input_mask, "segment_ids": segment_ids,
            "next_sentence_labels": instances.next_sentence_label.astype(np.int32)}


def nsp_warning(stats) -> str | None:
    """Why next-sentence prediction cannot be formed as BERT defines it on this corpus, from the instance counters
    (None when it can): random next segments drawn from the same document (a one-document corpus: BERT takes
    them from another), or most instances forced to "random next" (documents of one sentence have no next)."""
    instances = stats.get("instances", 0)
    same = stats.get("random_next_same_document", 0)
    forced = stats.get("forced_random_next", 0)
    problems = []
    if same:
        problems.append(f"{same} random-next second segment(s) came from the same document (one document in "
                        f"the corpus, or in a process's share of it)")
    if instances and forced > instances / 2:
        problems.append(f"{forced} of {instances} instances were forced to random-next (documents of one "
                        f"sentence have no actual next), so the NSP labels are mostly 'random'")
    if not problems:
        return None
    return ("next-sentence prediction cannot be formed as BERT defines it: " + "; ".join(problems) +
            ". Give many documents of several sentences each (a blank line between documents), or train without "
            "NSP (data.next_sentence_prediction=false / --no-nsp)")

