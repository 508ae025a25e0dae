"""Sentence vectors from a BERT checkpoint (feature extraction: BERT vectors feeding a downstream model)."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from bertjax.checkpoint import ModelCheckpoint
from bertjax.data.tokenizers import WordPieceTokenizer
from bertjax.model import BertModel

POOLINGS = ("cls", "mean")


@functools.partial(jax.jit, static_argnames=("model", "pooling"))
def _pooled(params, input_ids, input_mask, segment_ids, *, model: BertModel, pooling: str):
    sequence, _ = model.apply({"params": params}, input_ids, input_mask, segment_ids)
    sequence = sequence.astype(jnp.float32)
    if pooling == "cls":
        return sequence[:, 0]
    weights = input_mask.astype(jnp.float32)[..., None]
    return (sequence * weights).sum(1) / jnp.maximum(weights.sum(1), 1e-9)


def embed_sentences(checkpoint: ModelCheckpoint, sentences: list[str], *, pooling: str = "cls",
                    max_len: int = 128, batch_size: int = 64) -> np.ndarray:
    """float32 [len(sentences), hidden]: the [CLS] vector or the mean of the token vectors (padding excluded).

    Every batch is padded to `batch_size` x `max_len`, so the model compiles once.
    """
    if pooling not in POOLINGS:
        raise ValueError(f"unknown pooling {pooling!r}; expected one of {', '.join(POOLINGS)}")
    if max_len > checkpoint.config.max_position_embeddings:
        raise ValueError(f"max_len {max_len} exceeds the model's max_position_embeddings "
                         f"{checkpoint.config.max_position_embeddings}")
    model = BertModel(checkpoint.config, add_pooler=False)
    params = {k: v for k, v in checkpoint.params["bert"].items() if k != "pooler"}
    tokenizer = WordPieceTokenizer(checkpoint.vocab, lower_case=checkpoint.lower_case, source="the checkpoint")
    encoded = tokenizer.encode(sentences, max_len=max_len)
    outputs = []
    for start in range(0, len(sentences), batch_size):
        batch = {k: v[start:start + batch_size] for k, v in encoded.items()}
        count = len(batch["input_ids"])
        batch = {k: np.pad(v, [(0, batch_size - count), (0, 0)]) for k, v in batch.items()}
        pooled = _pooled(params, batch["input_ids"], batch["input_mask"], batch["segment_ids"], model=model,
                         pooling=pooling)
        outputs.append(np.asarray(pooled)[:count])
    hidden = checkpoint.config.hidden_size
    return np.concatenate(outputs) if outputs else np.zeros((0, hidden), np.float32)


def nearest_neighbours(embeddings: np.ndarray) -> list[tuple[int, float]]:
    """For each row, (index, cosine similarity) of the most similar other row."""
    unit = embeddings / np.maximum(np.linalg.norm(embeddings, axis=1, keepdims=True), 1e-12)
    similarity = unit @ unit.T
    np.fill_diagonal(similarity, -np.inf)
    best = similarity.argmax(1)
    return [(int(j), float(similarity[i, j])) for i, j in enumerate(best)]
