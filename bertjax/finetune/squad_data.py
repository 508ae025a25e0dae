"""SQuAD reading and featurizing: official JSON -> examples -> sliding-window features.

Follows run_squad.py: the context is split on whitespace, each whitespace word is WordPiece-tokenized on its own
(tok_to_orig), long contexts become windows of max_seq_length with doc_stride, the query is cut to
max_query_length, and each token remembers whether this window gives it maximal context. Unlike run_squad, every
wordpiece also carries its character span in the original context (aligned within its word), so the answer
text is recovered by slicing the context rather than by re-tokenizing (get_final_text).
"""
from __future__ import annotations

import collections
import dataclasses
import logging
import unicodedata

import numpy as np

from bertjax.data import file_readers
from bertjax.runtime import jsonio

log = logging.getLogger(__name__)


@dataclasses.dataclass
class SquadExample:
    qas_id: str
    question: str
    context: str
    context_index: int  # examples of one paragraph share their context's tokenization
    answers: list[str]  # gold texts (evaluation only uses the dataset JSON; kept for inspection)
    is_impossible: bool = False
    start_char: int = -1  # training answer span [start_char, end_char) in context; -1 when none
    end_char: int = -1


@dataclasses.dataclass
class SquadFeatures:
    """One row per window. token_offsets: [N, L, 2] char span of each context token, -1 elsewhere."""
    input_ids: np.ndarray
    input_mask: np.ndarray
    segment_ids: np.ndarray
    start_positions: np.ndarray
    end_positions: np.ndarray
    example_index: np.ndarray
    token_offsets: np.ndarray
    max_context: np.ndarray

    def __len__(self) -> int:
        return len(self.input_ids)

    def arrays(self) -> dict[str, np.ndarray]:
        return {"input_ids": self.input_ids, "input_mask": self.input_mask, "segment_ids": self.segment_ids,
                "start_positions": self.start_positions, "end_positions": self.end_positions}


# ------------------------------------------------------------------------------------------------ reading

def load_squad_json(src: str) -> dict:
    """The official JSON of `src`: a file path, or "tfds:squad/v1.1" / "tfds:squad/v2.0[:split]" prepared locally."""
    if src.startswith("tfds:"):
        return _tfds_to_json(src[len("tfds:"):])
    data = read_json(src)
    if not isinstance(data, dict) or "data" not in data:
        raise ValueError(f"{src}: not a SQuAD JSON file (no 'data' key)")
    _check_ids_once(data, src)
    return data


def _check_ids_once(data: dict, src: str) -> None:
    """A question id that appears twice is refused, naming both places: predictions and scores are keyed by id, so
    one of the two would silently stand for both."""
    seen = {}
    for a, article in enumerate(data["data"]):
        for p, paragraph in enumerate(article.get("paragraphs", [])):
            for q, qa in enumerate(paragraph.get("qas", [])):
                where = f"article {a}, paragraph {p}, question {q}"
                qid = qa.get("id") if isinstance(qa, dict) else None
                if qid in seen:
                    raise ValueError(f"{src}: question id {qid!r} appears twice ({seen[qid]}; {where}); each "
                                     "question needs its own id")
                seen[qid] = where


def read_json(path: str, what: str = "a JSON file (UTF-8)"):
    """A JSON file (read by file_readers.read_text: compressed bytes decompressed, Parquet, binary and NUL bytes
    refused; parsed by jsonio.loads, its nesting checked first); an error is a ValueError naming the file, where it
    stops and `what` was expected."""
    return jsonio.loads(file_readers.read_text(path, what), path, what)


def _tfds_to_json(spec: str) -> dict:
    import tensorflow_datasets as tfds

    name, _, split = spec.partition(":")
    builder = tfds.builder(name)
    if not builder.is_prepared():
        raise FileNotFoundError(f"tfds {name} is not prepared under {builder.data_dir}")
    paragraphs: dict[tuple[str, str], list] = {}
    for ex in tfds.as_numpy(builder.as_dataset(split=split or "validation")):
        title, context = ex["title"].decode("utf-8"), ex["context"].decode("utf-8")
        answers = [{"text": t.decode("utf-8"), "answer_start": int(s)}
                   for t, s in zip(ex["answers"]["text"], ex["answers"]["answer_start"])]
        qa = {"id": ex["id"].decode("utf-8"), "question": ex["question"].decode("utf-8"), "answers": answers}
        if "is_impossible" in ex:
            qa["is_impossible"] = bool(ex["is_impossible"])
        paragraphs.setdefault((title, context), []).append(qa)
    data: dict[str, list] = {}
    for (title, context), qas in paragraphs.items():
        data.setdefault(title, []).append({"context": context, "qas": qas})
    version = "v2.0" if "2" in name.split("/")[-1] else "1.1"
    return {"version": version, "data": [{"title": t, "paragraphs": ps} for t, ps in data.items()]}


def is_whitespace(c: str) -> bool:
    return c in " \t\r\n" or ord(c) == 0x202F


def whitespace_words(text: str) -> list[tuple[int, int]]:
    """Character spans [start, end) of run_squad's whitespace tokens (doc_tokens)."""
    spans, start = [], None
    for i, c in enumerate(text):
        if is_whitespace(c):
            if start is not None:
                spans.append((start, i))
                start = None
        elif start is None:
            start = i
    if start is not None:
        spans.append((start, len(text)))
    return spans


def read_examples(dataset: dict, is_training: bool, version_2: bool, source: str = "<json>"):
    """(examples, contexts, n_skipped). A training answer's span is the annotated one when the text there is the
    answer text; otherwise the only occurrence of the answer text in the context; otherwise it is skipped. The
    counts of each kind are said in one line when any answer was not at its annotated start."""
    examples, contexts, kinds = [], [], collections.Counter()
    for article in dataset["data"]:
        for paragraph in article["paragraphs"]:
            context = paragraph["context"]
            contexts.append(context)
            context_index = len(contexts) - 1
            for qa in paragraph["qas"]:
                is_impossible = bool(qa.get("is_impossible", False)) if version_2 else False
                ex = SquadExample(qa["id"], qa["question"], context, context_index,
                                  [a["text"] for a in qa.get("answers", [])], is_impossible)
                if is_training and not is_impossible:
                    if len(qa["answers"]) != 1:
                        raise ValueError(f"{source}: question {qa['id']}: for training, each question should "
                                         f"have exactly 1 answer, got {len(qa['answers'])}")
                    try:
                        kind, span = answer_span(context, qa["answers"][0])
                    except (ValueError, TypeError, KeyError) as error:
                        raise ValueError(f"{source}: question {qa['id']}: answer {qa['answers'][0]!r}: expected a "
                                         f"'text' and an integer 'answer_start' ({error})") from None
                    kinds[kind] += 1
                    if span is None:
                        continue
                    ex.start_char, ex.end_char = span
                examples.append(ex)
    if kinds["relocated"] or kinds["skipped"]:
        log.warning("%s: training answers: %d at their answer_start, %d whose text is not at answer_start moved "
                    "to the only occurrence of that text in the context, %d skipped (their text is not at "
                    "answer_start and occurs %s)", source, kinds["exact"], kinds["relocated"], kinds["skipped"],
                    "nowhere or more than once in the context")
    return examples, contexts, kinds["skipped"]


def _normalized(text: str) -> str:
    return " ".join(text.split())


def answer_span(context: str, answer: dict) -> tuple[str, tuple[int, int] | None]:
    """("exact" | "relocated" | "skipped", [start, end) of the answer in context or None).

    The annotated span counts only when the context there reads as the answer text (whitespace normalised), as
    google-research/bert's run_squad checks it; a start that is off (a shifted offset) is not trusted to find a
    span nearby, which would train on the wrong words: the answer text is looked up instead, and used when it
    occurs exactly once."""
    text, start = answer["text"], int(answer["answer_start"])
    if not text.strip():
        return "skipped", None
    end = start + len(text)
    if 0 <= start and end <= len(context) and _normalized(context[start:end]) == _normalized(text):
        return "exact", (start, end)
    found = [i for i in range(len(context)) if context.startswith(text, i)]
    if len(found) == 1:
        return "relocated", (found[0], found[0] + len(text))
    return "skipped", None


# ------------------------------------------------------------------------------------------- tokenization

def _is_punctuation(c: str) -> bool:
    cp = ord(c)
    if 33 <= cp <= 47 or 58 <= cp <= 64 or 91 <= cp <= 96 or 123 <= cp <= 126:
        return True
    return unicodedata.category(c).startswith("P")


def _is_cjk(c: str) -> bool:
    cp = ord(c)
    return (0x4E00 <= cp <= 0x9FFF or 0x3400 <= cp <= 0x4DBF or 0x20000 <= cp <= 0x2A6DF
            or 0x2A700 <= cp <= 0x2B73F or 0x2B740 <= cp <= 0x2B81F or 0x2B820 <= cp <= 0x2CEAF
            or 0xF900 <= cp <= 0xFAFF or 0x2F800 <= cp <= 0x2FA1F)


def _normalized_chars(word: str, lower_case: bool) -> list[tuple[str, int, bool]]:
    """(char, index in word, starts a new basic token) after BERT's text normalization, for alignment.

    Mirrors the tokenizer's cleanup: whitespace separates, control/format/unassigned chars and U+FFFD vanish."""
    out, boundary = [], True
    for i, c in enumerate(word):
        cat = unicodedata.category(c)
        if c.isspace() or cat == "Zs":
            boundary = True
            continue
        if c == "\uFFFD" or cat.startswith("C"):
            continue
        pieces = c
        if lower_case:
            # The tokenizer's order (bertjax.data.tokenizers): NFD, drop Mn, then lowercase.
            pieces = "".join(ch for ch in unicodedata.normalize("NFD", c)
                             if unicodedata.category(ch) != "Mn").lower()
        for ch in pieces:
            split = _is_punctuation(ch) or _is_cjk(ch)
            out.append((ch, i, boundary or split))
            boundary = split  # a punctuation / CJK char is a basic token of its own
    return out


def align_pieces(word: str, pieces: list[str], lower_case: bool, unk: str = "[UNK]") -> list[tuple[int, int]] | None:
    """Character span [start, end) within `word` of each wordpiece, or None if they cannot be aligned."""
    chars = _normalized_chars(word, lower_case)
    spans, pos = [], 0
    for piece in pieces:
        if piece == unk:
            # [UNK] stands for a whole basic token: one punctuation/CJK char, or a run up to the next boundary.
            if pos >= len(chars):
                return None
            stop = pos + 1
            if not (_is_punctuation(chars[pos][0]) or _is_cjk(chars[pos][0])):
                while stop < len(chars) and not chars[stop][2]:
                    stop += 1
        else:
            text = piece[2:] if piece.startswith("##") else piece
            stop = pos + len(text)
            if not text or "".join(ch for ch, _, _ in chars[pos:stop]) != text:
                return None
        spans.append((chars[pos][1], chars[stop - 1][1] + 1))
        pos = stop
    if pos != len(chars):
        return None
    if not lower_case:
        return spans
    # Combining accents stripped by normalization belong to the piece before them (as HF's offsets).
    extended = []
    for k, (a, b) in enumerate(spans):
        limit = spans[k + 1][0] if k + 1 < len(spans) else len(word)
        while b < limit and unicodedata.category(word[b]) == "Mn":
            b += 1
        extended.append((a, b))
    return extended


@dataclasses.dataclass
class ContextTokens:
    ids: list[int]
    offsets: list[tuple[int, int]]  # char span in the context of each wordpiece


def tokenize_contexts(contexts: list[str], tokenizer, lower_case: bool) -> tuple[list[ContextTokens], int]:
    """WordPiece each whitespace word of every context (one batched tokenizer call); also returns how many
    words could not be aligned char by char (their pieces get the whole word's span)."""
    words_per_context = [whitespace_words(c) for c in contexts]
    flat = [c[a:b] for c, spans in zip(contexts, words_per_context) for a, b in spans]
    if hasattr(tokenizer, "words_with_offsets"):  # a tokenizer.json: its pieces of running text, its own offsets
        after_space = [a > 0 for spans in words_per_context for a, _ in spans]
        return _tokenize_with_offsets(words_per_context, tokenizer.words_with_offsets(flat, after_space)), 0
    piece_ids = tokenizer.token_lists(flat) if flat else []
    vocab = tokenizer.vocab
    out, k, unaligned = [], 0, 0
    for context, spans in zip(contexts, words_per_context):
        ids, offsets = [], []
        for a, b in spans:
            word_ids = [int(t) for t in piece_ids[k]]
            k += 1
            aligned = align_pieces(context[a:b], [vocab[t] for t in word_ids], lower_case)
            if aligned is None:
                unaligned += 1
                aligned = [(0, b - a)] * len(word_ids)
            ids.extend(word_ids)
            offsets.extend((a + s, a + e) for s, e in aligned)
        out.append(ContextTokens(ids, offsets))
    return out, unaligned


def _tokenize_with_offsets(words_per_context, pieces) -> list[ContextTokens]:
    """ContextTokens from each word's (ids, spans in the word), the words' spans in their context given."""
    out, k = [], 0
    for spans in words_per_context:
        ids, offsets = [], []
        for a, _ in spans:
            word_ids, word_spans = pieces[k]
            k += 1
            ids.extend(word_ids)
            offsets.extend((a + s, a + e) for s, e in word_spans)
        out.append(ContextTokens(ids, offsets))
    return out


# ---------------------------------------------------------------------------------------------- windowing

def doc_spans(num_tokens: int, max_tokens_for_doc: int, doc_stride: int) -> list[tuple[int, int]]:
    """(start, length) windows over the context tokens, as run_squad; one empty window for an empty context."""
    spans, start = [], 0
    while start < num_tokens:
        length = min(num_tokens - start, max_tokens_for_doc)
        spans.append((start, length))
        if start + length == num_tokens:
            break
        start += min(length, doc_stride)
    return spans or [(0, 0)]


def max_context_mask(spans: list[tuple[int, int]], num_tokens: int) -> list[np.ndarray]:
    """Per window, whether each of its tokens has maximal context there: the window maximizing
    min(left, right) + 0.01 * length; ties go to the earlier window."""
    best_score = np.full(num_tokens, -np.inf)
    best_span = np.full(num_tokens, -1)
    for index, (start, length) in enumerate(spans):
        pos = np.arange(start, start + length)
        score = np.minimum(pos - start, start + length - 1 - pos) + 0.01 * length
        better = score > best_score[pos]
        best_score[pos[better]] = score[better]
        best_span[pos[better]] = index
    return [best_span[start:start + length] == index for index, (start, length) in enumerate(spans)]


def convert_examples_to_features(examples: list[SquadExample], contexts: list[ContextTokens], tokenizer,
                                 max_seq_length: int = 384, doc_stride: int = 128, max_query_length: int = 64,
                                 is_training: bool = False) -> SquadFeatures:
    """Windows of [CLS] query [SEP] context-part [SEP], padded to max_seq_length."""
    queries = tokenizer.token_lists([ex.question for ex in examples]) if examples else []
    rows = {k: [] for k in ("input_ids", "segment_ids", "start", "end", "example", "offsets", "max_context")}
    cls_id, sep_id = tokenizer.cls_id, tokenizer.sep_id
    for example_index, ex in enumerate(examples):
        query = [int(t) for t in queries[example_index]][:max_query_length]
        ctx = contexts[ex.context_index]
        max_tokens_for_doc = max_seq_length - len(query) - 3
        if max_tokens_for_doc <= 0:
            raise ValueError(f"max_seq_length {max_seq_length} leaves no room for the context after a "
                             f"{len(query)}-token query")
        tok_start = tok_end = None
        if is_training and not ex.is_impossible:
            inside = [i for i, (a, b) in enumerate(ctx.offsets) if a < ex.end_char and b > ex.start_char]
            if not inside:
                log.warning("question %s: answer covers no token; skipped", ex.qas_id)
                continue
            tok_start, tok_end = inside[0], inside[-1]
        spans = doc_spans(len(ctx.ids), max_tokens_for_doc, doc_stride)
        for (start, length), is_max in zip(spans, max_context_mask(spans, len(ctx.ids))):
            doc_offset = len(query) + 2
            ids = [cls_id] + query + [sep_id] + ctx.ids[start:start + length] + [sep_id]
            segments = [0] * doc_offset + [1] * (length + 1)
            offsets = np.full((max_seq_length, 2), -1, np.int32)
            offsets[doc_offset:doc_offset + length] = np.asarray(ctx.offsets[start:start + length]).reshape(-1, 2)
            max_context = np.zeros(max_seq_length, bool)
            max_context[doc_offset:doc_offset + length] = is_max
            s = e = 0  # [CLS]: no answer in this window (or an impossible question)
            if tok_start is not None and start <= tok_start and tok_end <= start + length - 1:
                s, e = tok_start - start + doc_offset, tok_end - start + doc_offset
            rows["input_ids"].append(ids)
            rows["segment_ids"].append(segments)
            rows["start"].append(s)
            rows["end"].append(e)
            rows["example"].append(example_index)
            rows["offsets"].append(offsets)
            rows["max_context"].append(max_context)
    n = len(rows["input_ids"])
    input_ids = np.full((n, max_seq_length), tokenizer.pad_id, np.int32)
    input_mask = np.zeros((n, max_seq_length), np.int32)
    segment_ids = np.zeros((n, max_seq_length), np.int32)
    for i, (ids, segments) in enumerate(zip(rows["input_ids"], rows["segment_ids"])):
        input_ids[i, :len(ids)] = ids
        input_mask[i, :len(ids)] = 1
        segment_ids[i, :len(ids)] = segments
    return SquadFeatures(
        input_ids=input_ids, input_mask=input_mask, segment_ids=segment_ids,
        start_positions=np.asarray(rows["start"], np.int32), end_positions=np.asarray(rows["end"], np.int32),
        example_index=np.asarray(rows["example"], np.int32),
        token_offsets=np.stack(rows["offsets"]) if n else np.zeros((0, max_seq_length, 2), np.int32),
        max_context=np.stack(rows["max_context"]) if n else np.zeros((0, max_seq_length), bool))


def featurize(dataset: dict, tokenizer, lower_case: bool, is_training: bool, version_2: bool,
              max_seq_length: int = 384, doc_stride: int = 128, max_query_length: int = 64, source: str = "<json>"):
    """(examples, features) for an official-format dataset."""
    examples, contexts, _ = read_examples(dataset, is_training, version_2, source)
    context_tokens, unaligned = tokenize_contexts(contexts, tokenizer, lower_case)
    if unaligned:
        log.warning("%s: %d words could not be aligned piece by piece; their answers use whole-word spans",
                    source, unaligned)
    features = convert_examples_to_features(examples, context_tokens, tokenizer, max_seq_length, doc_stride,
                                            max_query_length, is_training)
    return examples, features
