"""A sentence-embedding model of any family: the encoder, then sentence-transformers' Pooling (the mean over the
real tokens, or the first token) and, optionally, its Normalize (unit length). What `finetune embedding` trains and
exports as a sentence-transformers directory.

Inputs [..., L] give embeddings [..., H] in float32 (a row of (anchor, positive, negatives...) texts, [B, k, L],
gives [B, k, H]). With `learned_scale`, the module also holds the contrastive loss's scale as a parameter,
`log_scale` (CLIP's learnable temperature), which the loss reads from the params; the embeddings do not use it.
"""
from __future__ import annotations

import math

import flax.linen as nn
import jax.numpy as jnp

from bertjax.model import family

POOLINGS = ("mean", "cls")
LOG_SCALE = "log_scale"


def pool(sequence, input_mask, pooling: str):
    """[B, H] float32 from [B, L, H] as sentence-transformers' Pooling: "mean", the mean over the tokens the mask
    keeps ([CLS] and [SEP] included, padding not; the count clamped at 1e-9 as it does), or "cls", the first
    token (sentence-transformers takes position 0 whatever the mask: rows are right-padded)."""
    sequence = sequence.astype(jnp.float32)
    if pooling == "cls":
        return sequence[:, 0]
    if pooling != "mean":
        raise ValueError(f"unknown pooling {pooling!r}; expected one of {', '.join(POOLINGS)}")
    weights = input_mask.astype(jnp.float32)[..., None]
    return (sequence * weights).sum(1) / jnp.maximum(weights.sum(1), 1e-9)


def unit_length(x):
    """x / max(||x||, 1e-12) along the last axis: torch's F.normalize, what sentence-transformers' Normalize and
    cos_sim apply."""
    return x / jnp.maximum(jnp.linalg.norm(x, axis=-1, keepdims=True), 1e-12)


class SentenceEmbedder(nn.Module):
    """encoder -> pool -> (unit length). The encoder is the family's bare one under `bert` (BERT without its
    pooler), so an encoder checkpoint of either family loads into it as into every task model."""

    config: family.ModelConfig
    pooling: str = "mean"
    normalize: bool = True
    learned_scale: float = 0.0  # > 0: a `log_scale` parameter initialised to log(this)

    @nn.compact
    def __call__(self, input_ids, input_mask, segment_ids=None, *, deterministic: bool = True):
        if self.learned_scale > 0:
            self.param(LOG_SCALE, nn.with_logical_partitioning(
                lambda *_: jnp.asarray(math.log(self.learned_scale), jnp.float32), ()))
        leading, length = input_ids.shape[:-1], input_ids.shape[-1]
        ids, mask = input_ids.reshape(-1, length), input_mask.reshape(-1, length)
        types = jnp.zeros_like(ids) if segment_ids is None else segment_ids.reshape(-1, length)
        encoder = family.encoder(self.config).clone(parent=self, name="bert")
        sequence, _ = encoder(ids, mask, types, deterministic=deterministic)
        embeddings = pool(sequence, mask, self.pooling)
        if self.normalize:
            embeddings = unit_length(embeddings)
        return embeddings.reshape(leading + embeddings.shape[-1:])
