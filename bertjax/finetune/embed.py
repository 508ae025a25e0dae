"""Features from a BERT or ModernBERT checkpoint: chosen hidden layers, pooled per sentence or kept per token.

Layers are numbered as transformers' `output_hidden_states`: 0 is the embeddings' output (after their
LayerNorm), i the output of encoder layer i, num_hidden_layers the last (ModernBERT's after its final norm, as
transformers gives it). A `--layers` spec is one of
`last`, `second-to-last`, `sum-last-4` (sum of the last four hidden states), `concat-last-4` (the last four
concatenated, deepest last) or a comma list of indices `N[,M...]` (negative ones count from the end, -1 = last),
concatenated in the order given. Pooling: `cls` (the [CLS] position), `mean` (mean over the real tokens,
[CLS] and [SEP] included, padding excluded), or `none` (every token's vector, see `embed_tokens`).
"""
from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from bertjax.checkpoint import ModelCheckpoint
from bertjax.model import family

POOLINGS = ("cls", "mean", "none")
NAMED_LAYERS = ("last", "second-to-last", "sum-last-4", "concat-last-4")
INPUT_KEYS = ("input_ids", "input_mask", "segment_ids")


@dataclasses.dataclass(frozen=True)
class LayerSelection:
    """Hidden-state indices (0 = embeddings output) and how they are combined ("sum" or "concat")."""
    indices: tuple[int, ...]
    combine: str = "concat"

    def width(self, hidden_size: int) -> int:
        return hidden_size * (1 if self.combine == "sum" else len(self.indices))


def parse_layers(spec: str, num_layers: int) -> LayerSelection:
    """A --layers spec for a model with `num_layers` encoder layers (so num_layers + 1 hidden states)."""
    last = num_layers
    spec = spec.strip()
    if spec in ("last", "second-to-last", "sum-last-4", "concat-last-4"):
        if spec == "second-to-last" and num_layers < 1:
            raise ValueError("--layers second-to-last needs a model with at least one encoder layer")
        if spec.endswith("last-4") and num_layers + 1 < 4:
            raise ValueError(f"--layers {spec} needs 4 hidden states; the model has {num_layers + 1}")
        return {"last": LayerSelection((last,)), "second-to-last": LayerSelection((last - 1,)),
                "sum-last-4": LayerSelection(tuple(range(last - 3, last + 1)), "sum"),
                "concat-last-4": LayerSelection(tuple(range(last - 3, last + 1)))}[spec]
    indices = []
    for part in spec.split(","):
        try:
            index = int(part)
        except ValueError:
            raise ValueError(f"--layers {spec!r}: expected one of {', '.join(NAMED_LAYERS)} or comma-separated "
                             f"hidden-state indices (0 = embeddings, {last} = last)") from None
        if not -(last + 1) <= index <= last:
            raise ValueError(f"--layers {spec!r}: index {index} is out of range; the model has hidden states "
                             f"0..{last} (0 = embeddings output)")
        indices.append(index % (last + 1))
    return LayerSelection(tuple(indices))


@functools.partial(jax.jit, static_argnames=("model", "selection", "pooling"))
def _features(params, input_ids, input_mask, segment_ids, *, model, selection: LayerSelection,
              pooling: str):
    _, state = model.apply({"params": params}, input_ids, input_mask, segment_ids, mutable=["intermediates"])
    states = state["intermediates"]["hidden_states"]
    chosen = [states[i].astype(jnp.float32) for i in selection.indices]
    x = functools.reduce(jnp.add, chosen) if selection.combine == "sum" else jnp.concatenate(chosen, axis=-1)
    if pooling == "cls":
        return x[:, 0]
    if pooling == "mean":
        weights = input_mask.astype(jnp.float32)[..., None]
        return (x * weights).sum(1) / jnp.maximum(weights.sum(1), 1e-9)
    return x


def encoded_features(checkpoint: ModelCheckpoint, arrays: dict[str, np.ndarray], *, layers: str = "last",
                     pooling: str = "cls", batch_size: int = 64, length_bucket: int = 32,
                     progress=None) -> np.ndarray:
    """Features of already-encoded rows (input_ids/input_mask/segment_ids [N, L], e.g. GLUE's featurization).

    Returns float32 [N, D] (cls/mean) or [N, L, D] (none; padding positions hold the padding's vectors), with
    D = hidden_size x (number of concatenated layers). Batches are padded to `batch_size` rows and cut to a
    multiple of `length_bucket` tokens, so the model compiles once per length bucket. `progress`: a
    console.Progress advanced once per batch.
    """
    if pooling not in POOLINGS:
        raise ValueError(f"unknown pooling {pooling!r}; expected one of {', '.join(POOLINGS)}")
    if batch_size < 1:  # range() would stop at 0 or yield nothing (a 0 x D matrix) below
        raise ValueError(f"batch_size={batch_size} must be >= 1")
    config = checkpoint.config
    selection = parse_layers(layers, config.num_hidden_layers)
    n, max_len = arrays["input_ids"].shape
    config.check_length(max_len, "--max-len")
    batch_size = min(batch_size, max(n, 1))  # rows of padding would cost memory and time for nothing
    model = family.encoder(config)
    params = {k: v for k, v in checkpoint.params["bert"].items() if k != "pooler"}
    lengths = arrays["input_mask"].sum(axis=1)
    outputs = []
    for start in range(0, n, batch_size):
        count = min(batch_size, n - start)
        length = min(max_len, max(length_bucket, math.ceil(lengths[start:start + count].max() / length_bucket)
                                  * length_bucket))
        batch = [np.pad(np.asarray(arrays[k][start:start + count, :length], np.int32),
                        [(0, batch_size - count), (0, 0)]) for k in INPUT_KEYS]
        out = np.asarray(_features(params, *batch, model=model, selection=selection, pooling=pooling))[:count]
        if pooling == "none":
            out = np.pad(out, [(0, 0), (0, max_len - length), (0, 0)])
        outputs.append(out)
        if progress is not None:
            progress.advance()
    width = selection.width(config.hidden_size)
    if not outputs:
        return np.zeros((0, width) if pooling != "none" else (0, max_len, width), np.float32)
    return np.concatenate(outputs)


def _tokenizer(checkpoint: ModelCheckpoint):
    """The checkpoint's tokenizer: its tokenizer.json on the host, else WordPiece in-graph on its vocab."""
    if checkpoint.tokenizer is not None:
        from bertjax.data.json_tokenizer import HostJsonTokenizer

        return HostJsonTokenizer.from_spec(checkpoint.tokenizer, "the checkpoint's tokenizer.json")
    from bertjax.data.tokenizers import WordPieceTokenizer

    return WordPieceTokenizer(checkpoint.vocab, lower_case=checkpoint.lower_case, source="the checkpoint")


def cut_lines(checkpoint: ModelCheckpoint, sentences: list[str], max_len: int) -> list[int]:
    """The 1-based numbers of the sentences whose tokens, with [CLS] and [SEP], exceed `max_len` (embedded cut to
    it, as `encode` truncates)."""
    _, splits = _tokenizer(checkpoint).pieces(sentences)
    return (np.flatnonzero(np.diff(splits) > max_len - 2) + 1).tolist()


def embed_sentences(checkpoint: ModelCheckpoint, sentences: list[str], *, pooling: str = "cls",
                    layers: str = "last", max_len: int = 128, batch_size: int = 64) -> np.ndarray:
    """float32 [len(sentences), D]: the [CLS] vector or the mean of the token vectors of the chosen layers."""
    if pooling == "none":
        raise ValueError("pooling 'none' gives per-token vectors: use embed_tokens")
    encoded = _tokenizer(checkpoint).encode(sentences, max_len=max_len)
    return encoded_features(checkpoint, encoded, layers=layers, pooling=pooling, batch_size=batch_size)


def word_spans(tokenizer, sentences: list[str], kept_tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The word -> token map: words are the whitespace-separated words of each sentence (as transformers'
    `is_split_into_words`); BERT splits on whitespace before anything else, so a word's pieces are those of the
    word tokenized alone.

    Returns (word_offsets int64 [N+1], spans int32 [W, 2]): sentence i's words are spans[word_offsets[i]:
    word_offsets[i+1]], each [start, end) in token positions of that sentence (0 = [CLS]). A word cut off by
    truncation keeps the pieces that remain; a word with none left (or none at all) is (-1, -1).
    `kept_tokens` [N]: how many word pieces of each sentence were kept (without [CLS]/[SEP]).
    """
    words = [s.split() for s in sentences]
    flat = [w for ws in words for w in ws]
    after_space = [i > 0 for ws in words for i in range(len(ws))]
    counts = np.array([len(ids) for ids in tokenizer.word_lists(flat, after_space)], np.int64) \
        if any(words) else np.zeros(0, np.int64)
    word_offsets = np.concatenate([[0], np.cumsum([len(ws) for ws in words])]).astype(np.int64)
    spans = np.full((len(counts), 2), -1, np.int32)
    for i in range(len(sentences)):
        c = counts[word_offsets[i]:word_offsets[i + 1]]
        end = 1 + np.cumsum(c)
        start = end - c
        end = np.minimum(end, 1 + kept_tokens[i])
        keep = end > start
        spans[word_offsets[i]:word_offsets[i + 1]] = np.where(keep[:, None], np.stack([start, end], 1), -1)
    return word_offsets, spans


def embed_tokens(checkpoint: ModelCheckpoint, sentences: list[str], *, layers: str = "last", max_len: int = 128,
                 batch_size: int = 64) -> dict[str, np.ndarray]:
    """Per-token vectors of the chosen layers, as the arrays `bertjax embed --pooling none` writes to .npz:

    vectors float32 [T, D]: every real token of every sentence, [CLS] and [SEP] included, sentence after sentence;
    sentence_offsets int64 [N+1]: sentence i's tokens are vectors[sentence_offsets[i]:sentence_offsets[i+1]];
    token_ids int32 [T]: the vocabulary id of each of those tokens;
    word_offsets int64 [N+1], word_spans int32 [W, 2]: the word -> token map (see `word_spans`);
    layers int32 [k] and combine (str): the hidden states used and how they were combined.
    """
    tokenizer = _tokenizer(checkpoint)
    encoded = tokenizer.encode(sentences, max_len=max_len)
    per_token = encoded_features(checkpoint, encoded, layers=layers, pooling="none", batch_size=batch_size)
    mask = encoded["input_mask"].astype(bool)
    lengths = mask.sum(axis=1)
    word_offsets, spans = word_spans(tokenizer, sentences, lengths - 2)
    selection = parse_layers(layers, checkpoint.config.num_hidden_layers)
    return {"vectors": per_token[mask], "sentence_offsets": np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
            "token_ids": encoded["input_ids"][mask].astype(np.int32), "word_offsets": word_offsets,
            "word_spans": spans, "layers": np.asarray(selection.indices, np.int32),
            "combine": np.asarray(selection.combine)}


def nearest_neighbours(embeddings: np.ndarray) -> list[tuple[int, float]]:
    """For each row, (index, cosine similarity) of the most similar other row."""
    unit = embeddings / np.maximum(np.linalg.norm(embeddings, axis=1, keepdims=True), 1e-12)
    similarity = unit @ unit.T
    np.fill_diagonal(similarity, -np.inf)
    best = similarity.argmax(1)
    return [(int(j), float(similarity[i, j])) for i, j in enumerate(best)]
