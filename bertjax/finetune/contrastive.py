"""The multiple-negatives ranking loss over the global batch, and its gradient in one pass or cached (GradCache).

A batch row holds k texts: an anchor, its positive and k - 2 hard negatives ([B, k, L] inputs, [B, k, D]
embeddings). The loss is sentence-transformers' MultipleNegativesRankingLoss (InfoNCE): for each anchor, the
cross-entropy of scale * cos(anchor, candidate) over every candidate of the batch, all positives then all hard
negatives (its own positive the target), averaged over the anchors; `symmetric` adds the positive -> anchors
direction and averages the two log-partitions (its MultipleNegativesSymmetricRankingLoss, now MNRL with
directions=("query_to_doc", "doc_to_query"), partition_mode="per_direction"). Rows of weight 0 (the Trainer's
padding) are neither anchors nor candidates.

The batch is the global one: under jit on a mesh, the candidates are constrained to be replicated, so every device
scores its own anchors against the embeddings of every device's rows (XLA all-gathers them, [B * (k - 1), D]; the
backward reduce-scatters their gradient), and the loss is the mean over all the batch's anchors. The same program
on one device gives the same loss and gradients.

Cached gradients (Gao et al. 2021, "Scaling Deep Contrastive Learning Batch Size under Memory Limited Setup";
sentence-transformers' CachedMultipleNegativesRankingLoss) split the batch into `chunks`: every chunk is embedded
without gradients, the loss and its gradient with respect to the embeddings are computed on all of them, then each
chunk is embedded again with gradients and backpropagated with its slice of that gradient, the parameter gradients
summed. The gradients equal the uncached ones (the same dropout masks in both passes of a chunk); activation memory
is one chunk's, so the batch, and with it the negatives each anchor sees, is bounded by the [B, B * (k - 1)] score
matrix (row-sharded over the devices) instead.
"""
from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp

from bertjax.finetune.settings import MAX_SCALE
from bertjax.model.sentence_embedder import LOG_SCALE, unit_length



@dataclasses.dataclass(frozen=True)
class RankingLoss:
    """The loss's settings: the fixed scale (or the learned one's start, `learned`), and the symmetric term."""
    scale: float = 20.0
    learned: bool = False
    symmetric: bool = False

    def scale_of(self, params) -> jax.Array:
        """The scale the loss multiplies cosine similarities by: fixed, or exp(params' log_scale) up to MAX_SCALE."""
        if not self.learned:
            return jnp.float32(self.scale)
        return jnp.minimum(jnp.exp(params[LOG_SCALE]), MAX_SCALE)


def ranking_loss(embeddings, weights, scale, symmetric: bool = False):
    """The multiple-negatives ranking loss of one batch: embeddings [B, k, D] (anchor, positive, negatives...),
    weights [B] (0: a padding row), scale a scalar. Returns the weighted mean over the anchors."""
    rows, texts = embeddings.shape[:2]
    unit = unit_length(embeddings.astype(jnp.float32))  # cos_sim normalises whether or not the model does
    anchors = nn.with_logical_constraint(unit[:, 0], ("activation_batch", None))
    # All positives, then each negative column: sentence-transformers' torch.cat(docs). Replicated: the gather.
    candidates = jnp.swapaxes(unit[:, 1:], 0, 1).reshape((texts - 1) * rows, unit.shape[-1])
    candidates = nn.with_logical_constraint(candidates, (None, None))
    real = weights > 0
    scores = scale * jnp.einsum("bd,nd->bn", anchors, candidates)
    scores = jnp.where(jnp.tile(real, texts - 1)[None, :], scores, -jnp.inf)
    positive = scale * jnp.sum(anchors * unit[:, 1], axis=-1)
    log_partition = jax.nn.logsumexp(scores, axis=1)
    if symmetric:  # each positive against every anchor: the columns of the positives' block
        backward = jnp.where(real[:, None], scores[:, :rows], -jnp.inf)
        log_partition = (log_partition + jax.nn.logsumexp(backward, axis=0)) / 2
    per_anchor = jnp.where(real, log_partition - positive, 0.0)
    return jnp.sum(per_anchor * weights) / jnp.maximum(jnp.sum(weights), 1.0)


def _chunked(x, chunks: int):
    """[B, ...] -> [chunks, B / chunks, ...]: rows j * chunks + i form chunk i, so that every device holds an equal
    share of each chunk (as the Trainer's micro-batches)."""
    return jnp.swapaxes(x.reshape((x.shape[0] // chunks, chunks) + x.shape[1:]), 0, 1)


def _unchunked(x):
    """The inverse of _chunked."""
    x = jnp.swapaxes(x, 0, 1)
    return x.reshape((x.shape[0] * x.shape[1],) + x.shape[2:])


INPUT_KEYS = ("input_ids", "input_mask", "segment_ids")


def loss_and_grads(module, params, batch, rng, loss: RankingLoss, *, chunks: int = 1, deterministic: bool = False):
    """(loss, d loss / d params) of `batch` (inputs [B, k, L], weights [B]) through `module` (a SentenceEmbedder):
    in one pass (`chunks` 1), or cached over `chunks` chunks of B / chunks rows. Chunk i's dropout key is `rng`
    folded with i, the same in both of its passes."""

    def embed(p, inputs, key):
        return module.apply({"params": p}, *(inputs[k] for k in INPUT_KEYS), deterministic=deterministic,
                            rngs={"dropout": key})

    def of_embeddings(embeddings, p):
        return ranking_loss(embeddings, batch["weights"], loss.scale_of(p), loss.symmetric)

    inputs = {k: batch[k] for k in INPUT_KEYS}
    if chunks == 1:
        return jax.value_and_grad(lambda p: of_embeddings(embed(p, inputs, rng), p))(params)
    pieces = jax.tree_util.tree_map(lambda x: _chunked(x, chunks), inputs)
    indices = jnp.arange(chunks)

    def forward(_, piece):
        index, chunk = piece
        return None, jax.lax.stop_gradient(embed(params, chunk, jax.random.fold_in(rng, index)))

    _, embedded = jax.lax.scan(forward, None, (indices, pieces))
    # The loss on every chunk's embeddings; its gradient with respect to them is the cache. The params' own term
    # (a learned scale) comes from here too.
    value, (cache, direct) = jax.value_and_grad(of_embeddings, argnums=(0, 1))(_unchunked(embedded), params)

    def backward(total, piece):
        index, chunk, cached = piece
        _, pullback = jax.vjp(lambda p: embed(p, chunk, jax.random.fold_in(rng, index)), params)
        return jax.tree_util.tree_map(jnp.add, total, pullback(cached)[0]), None

    grads, _ = jax.lax.scan(backward, direct, (indices, pieces, _chunked(cache, chunks)))
    return value, grads
