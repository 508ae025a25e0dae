"""Masked-LM predictions in-graph, vectorised over a batch (create_masked_lm_predictions of the original).

Per sequence: num_to_predict = min(max_predictions_per_seq, max(1, round(len(tokens) * masked_lm_prob)))
with len(tokens) counting [CLS]/[SEP] and Python's round-half-even; words are visited in random order
and taken whole while they fit (a word that would overshoot is skipped, as the original does); each
chosen piece becomes [MASK] 80%, stays 10%, becomes a random vocab id 10%. Without whole-word masking
every candidate token is its own word. All randomness is stateless in an explicit seed, so a batch's
masks are a pure function of (batch, seed): static masking uses a fixed seed per instance block,
dynamic masking a fresh seed per batch.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np
import tensorflow as tf

from bertjax.data.data_config import MaskingConfig


class Masker:
    """Applies MLM masking to a batch of padded instances."""

    def __init__(self, config: MaskingConfig, *, vocab_size: int, mask_id: int, special_ids: Sequence[int],
                 continuation_table: np.ndarray | None = None):
        """special_ids: never masked ([CLS], [SEP], [PAD]); continuation_table: bool[vocab_size], True for
        pieces continuing a word (required for whole-word masking)."""
        if config.whole_word_masking and continuation_table is None:
            raise ValueError("whole-word masking needs the tokenizer's word continuation table")
        self.config = config
        self.vocab_size = int(vocab_size)
        self.mask_id = int(mask_id)
        self.special_ids = tf.constant(sorted(set(int(i) for i in special_ids)), tf.int32)
        self.continuation = (tf.constant(np.asarray(continuation_table, bool)) if config.whole_word_masking
                             else None)

    def __call__(self, features: dict[str, tf.Tensor], seed: tf.Tensor) -> dict[str, tf.Tensor]:
        """features: int32 input_ids / input_mask [B, L] (other keys pass through); seed: int [2].

        Returns the features with masked input_ids plus masked_lm_positions, masked_lm_ids (int32) and
        masked_lm_weights (float32) [B, max_predictions_per_seq].
        """
        ids = tf.convert_to_tensor(features["input_ids"], tf.int32)
        real = tf.cast(features["input_mask"], tf.bool)
        batch, length = tf.shape(ids)[0], tf.shape(ids)[1]
        max_pred = self.config.max_predictions_per_seq
        seeds = tf.random.experimental.stateless_split(tf.cast(seed, tf.int64), 4)

        special = tf.reduce_any(ids[:, :, None] == self.special_ids[None, None, :], axis=-1)
        candidate = real & ~special
        if self.continuation is not None:
            previous_candidate = tf.pad(candidate[:, :-1], [[0, 0], [1, 0]])
            # A "##" piece right after [CLS]/[SEP] (its head was truncated away) starts its own word.
            continues = tf.gather(self.continuation, ids) & candidate & previous_candidate
        else:
            continues = tf.zeros_like(candidate)
        word_start = candidate & ~continues
        word_id = tf.cumsum(tf.cast(word_start, tf.int32), axis=1) - 1
        num_words = tf.reduce_sum(tf.cast(word_start, tf.int32), axis=1)

        num_tokens = tf.reduce_sum(tf.cast(real, tf.float64), axis=1)
        # tf.round is round-half-to-even, like Python's round() in the original.
        rounded = tf.round(num_tokens * tf.constant(self.config.masked_lm_prob, tf.float64))
        num_to_predict = tf.minimum(max_pred, tf.maximum(1, tf.cast(rounded, tf.int32)))

        # Visit words in a uniformly random order (the original shuffles its candidate list): a random
        # integer key per word id, made unique by the low bits so that there are no ties.
        bits = tf.random.stateless_uniform([batch, length], seeds[0], minval=0, maxval=1 << 40, dtype=tf.int64)
        word_index = tf.range(length)[None, :]
        keys = tf.where(word_index < num_words[:, None], bits * (1 << 20) + tf.cast(word_index, tf.int64),
                        tf.int64.max)
        if self.continuation is None:
            # Single-piece words: the num_to_predict smallest keys are taken, found with a top-k.
            smallest = -tf.math.top_k(-keys, k=max_pred, sorted=True).values
            threshold = tf.gather(smallest, num_to_predict - 1, batch_dims=1)
            taken_word = keys <= threshold[:, None]
        else:
            flat_word = tf.reshape(tf.range(batch)[:, None] * length + tf.maximum(word_id, 0), [-1])
            word_len = tf.reshape(tf.math.unsorted_segment_sum(
                tf.reshape(tf.cast(candidate, tf.int32), [-1]), flat_word, batch * length), [batch, length])
            order = tf.argsort(keys, axis=1)
            taken_in_order = self._greedy_whole_words(tf.gather(word_len, order, batch_dims=1), num_to_predict)
            taken_word = tf.gather(taken_in_order, tf.argsort(order, axis=1), batch_dims=1)
        chosen = candidate & tf.gather(taken_word, tf.maximum(word_id, 0), batch_dims=1)

        # 80% [MASK], 10% unchanged, 10% random id, drawn per piece.
        u = tf.random.stateless_uniform([batch, length], seeds[1])
        random_ids = tf.random.stateless_uniform([batch, length], seeds[2], minval=0, maxval=self.vocab_size,
                                                 dtype=tf.int32)
        replacement = tf.where(u < 0.8, self.mask_id, tf.where(u < 0.9, ids, random_ids))
        masked_ids = tf.where(chosen, replacement, ids)

        # Positions in increasing order (the original sorts by index), padded with 0 / weight 0.
        positions = tf.range(length)[None, :]
        sort_key = tf.where(chosen, positions, length + positions)
        first = -tf.math.top_k(-sort_key, k=max_pred, sorted=True).values
        valid = first < length
        masked_positions = tf.where(valid, first, 0)
        out = dict(features)
        out["input_ids"] = masked_ids
        out["masked_lm_positions"] = masked_positions
        out["masked_lm_ids"] = tf.where(valid, tf.gather(ids, masked_positions, batch_dims=1), 0)
        out["masked_lm_weights"] = tf.cast(valid, tf.float32)
        return out

    @staticmethod
    def _greedy_whole_words(len_in_order: tf.Tensor, num_to_predict: tf.Tensor) -> tf.Tensor:
        """Take each word (in order) if it still fits; a word that would overshoot is skipped."""
        def step(count, word_len):
            take = (word_len > 0) & (count + word_len <= num_to_predict)
            return count + tf.where(take, word_len, 0), take

        def body(carry, word_len):
            count, _ = carry
            return step(count, word_len)

        _, taken = tf.scan(body, tf.transpose(len_in_order),
                           initializer=(tf.zeros_like(num_to_predict), tf.zeros_like(num_to_predict, tf.bool)))
        return tf.transpose(taken)


def masker_for_tokenizer(config: MaskingConfig, tokenizer) -> Masker:
    """A Masker using the tokenizer's vocab size, [MASK] id, special ids and word-continuation table."""
    return Masker(config, vocab_size=tokenizer.vocab_size, mask_id=tokenizer.mask_id,
                  special_ids=tokenizer.special_ids,
                  continuation_table=tokenizer.word_continuation_table() if config.whole_word_masking else None)
