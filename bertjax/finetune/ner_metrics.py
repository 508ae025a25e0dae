"""Entity-level precision / recall / F1 exactly as CoNLL's `conlleval` script computes them.

A chunk (entity) counts as correct only when gold and guess start at the same token, end at the same token and
have the same type. Chunk boundaries follow conlleval's rules for the B/I/O prefixes, so IOB1 (a chunk may open
with I-) and IOB2 both score correctly, and an I- tag after O or after another type opens a chunk, as in
conlleval. Sentence boundaries end every open chunk (conlleval reads a blank line as an "O" token).

conlleval reports percentages; here precision/recall/F1 are fractions in [0, 1] and `overall` repeats its
accuracy over tokens.
"""
from __future__ import annotations

import dataclasses
from collections import Counter
from typing import Sequence

OUTSIDE = "O"


def split_tag(tag: str, where: str = "") -> tuple[str, str]:
    """("B"|"I"|"O", type) of an IOB tag; anything else is an error naming `where`."""
    if tag == OUTSIDE:
        return OUTSIDE, ""
    prefix, sep, kind = tag.partition("-")
    if prefix not in ("B", "I") or not sep or not kind:
        raise ValueError(f"{where + ': ' if where else ''}tag {tag!r} is not O, B-<type> or I-<type>")
    return prefix, kind


def _end_of_chunk(prev_tag: str, tag: str, prev_type: str, kind: str) -> bool:
    """conlleval's endOfChunk for B/I/O: did a chunk end between the previous token and this one?"""
    return (prev_tag in ("B", "I") and tag in ("B", "O")) or (prev_tag != OUTSIDE and prev_type != kind)


def _start_of_chunk(prev_tag: str, tag: str, prev_type: str, kind: str) -> bool:
    """conlleval's startOfChunk for B/I/O: does a chunk start at this token?"""
    return tag == "B" or (prev_tag == OUTSIDE and tag == "I") or (tag != OUTSIDE and prev_type != kind)


@dataclasses.dataclass
class ChunkCounts:
    correct: Counter = dataclasses.field(default_factory=Counter)  # per type: exact span + type matches
    gold: Counter = dataclasses.field(default_factory=Counter)     # per type: chunks in the gold tags
    guessed: Counter = dataclasses.field(default_factory=Counter)  # per type: chunks in the predicted tags
    correct_tags: int = 0
    tokens: int = 0


def count_chunks(gold: Sequence[Sequence[str]], guessed: Sequence[Sequence[str]]) -> ChunkCounts:
    """conlleval's counts over sentences of gold and predicted tags (same lengths)."""
    if len(gold) != len(guessed):
        raise ValueError(f"{len(gold)} gold sentences but {len(guessed)} predicted ones")
    counts = ChunkCounts()
    for s, (gold_sent, guess_sent) in enumerate(zip(gold, guessed)):
        if len(gold_sent) != len(guess_sent):
            raise ValueError(f"sentence {s}: {len(gold_sent)} gold tags but {len(guess_sent)} predicted tags")
        last_c, last_c_type, last_g, last_g_type = OUTSIDE, "", OUTSIDE, ""
        in_correct = False
        # The trailing "O" is conlleval's sentence boundary: it closes whatever chunk is open.
        for i, (c_tag, g_tag) in enumerate(list(zip(gold_sent, guess_sent)) + [(OUTSIDE, OUTSIDE)]):
            c, c_type = split_tag(c_tag, f"sentence {s} token {i} (gold)")
            g, g_type = split_tag(g_tag, f"sentence {s} token {i} (predicted)")
            if in_correct:
                c_end = _end_of_chunk(last_c, c, last_c_type, c_type)
                g_end = _end_of_chunk(last_g, g, last_g_type, g_type)
                if c_end and g_end and last_g_type == last_c_type:
                    in_correct = False
                    counts.correct[last_c_type] += 1
                elif c_end != g_end or g_type != c_type:
                    in_correct = False
            c_start = _start_of_chunk(last_c, c, last_c_type, c_type)
            g_start = _start_of_chunk(last_g, g, last_g_type, g_type)
            if c_start and g_start and g_type == c_type:
                in_correct = True
            if c_start:
                counts.gold[c_type] += 1
            if g_start:
                counts.guessed[g_type] += 1
            if i < len(gold_sent):
                counts.correct_tags += int(c == g and c_type == g_type)
                counts.tokens += 1
            last_c, last_c_type, last_g, last_g_type = c, c_type, g, g_type
    return counts


def _prf(correct: int, gold: int, guessed: int) -> dict:
    precision = correct / guessed if guessed else 0.0
    recall = correct / gold if gold else 0.0
    f1 = 2 * precision * recall / (precision + recall) if precision + recall else 0.0
    return {"precision": precision, "recall": recall, "f1": f1, "gold": gold, "predicted": guessed,
            "correct": correct}


def entity_scores(gold: Sequence[Sequence[str]], guessed: Sequence[Sequence[str]]) -> dict:
    """{"overall": {precision, recall, f1, gold, predicted, correct, accuracy}, "per_type": {type: {...}}}."""
    counts = count_chunks(gold, guessed)
    overall = _prf(sum(counts.correct.values()), sum(counts.gold.values()), sum(counts.guessed.values()))
    overall["accuracy"] = counts.correct_tags / counts.tokens if counts.tokens else 0.0
    types = sorted(set(counts.gold) | set(counts.guessed))
    return {"overall": overall,
            "per_type": {t: _prf(counts.correct[t], counts.gold[t], counts.guessed[t]) for t in types}}
