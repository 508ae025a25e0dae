"""Masked-LM predictions in-graph, vectorised over a batch (create_masked_lm_predictions of the original).

Per sequence: num_to_predict = min(max_predictions_per_seq, max(1, round(len(tokens) * masked_lm_prob)))
with len(tokens) counting [CLS]/[SEP] and Python's round-half-even; words are visited in random order
and taken whole while they fit (a word that would overshoot is skipped, as the original does); each
chosen piece becomes [MASK] 80%, stays 10%, becomes a random vocab id 10%. Without whole-word masking
every candidate token is its own word.

Span masking (SpanBERT, Joshi et al. 2020, section 3.1; `masking_scheme="span"`): the budget is SpanBERT's
ceil(masked_lm_prob * n) over the n maskable tokens ([CLS]/[SEP] not counted), capped at max_predictions_per_seq.
Spans are drawn until it is spent: a length in words from Geometric(0.2) on 1..10 (renormalised, mean 3.8), a
start word uniformly among the words not yet masked, then whole words from there. As in SpanBERT's code a span
runs on through words masked before (they cost nothing) and overlapping or touching spans merge into one, so the
tokens beside every span are unmasked (the SBO's boundaries); a span stops at [SEP]. The last span ends at the
last whole word that fits the budget (SpanBERT's code cuts it at the budget token, possibly inside a word).
80/10/10 is drawn once per (merged) span. All randomness is stateless in an explicit seed, so a batch's
masks are a pure function of (batch, seed): static masking uses a fixed seed per instance block,
dynamic masking a fresh seed per batch.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np
import tensorflow as tf

from bertjax.data.data_config import SPAN_GEOMETRIC_P, SPAN_MAX_WORDS, MaskingConfig


def span_length_probabilities(p: float = SPAN_GEOMETRIC_P, max_words: int = SPAN_MAX_WORDS) -> np.ndarray:
    """P(length = 1..max_words): Geometric(p) restricted to 1..max_words and renormalised (SpanBERT's code)."""
    weights = p * (1 - p) ** np.arange(max_words)
    return weights / weights.sum()


class Masker:
    """Applies MLM masking to a batch of padded instances."""

    def __init__(self, config: MaskingConfig, *, vocab_size: int, mask_id: int, special_ids: Sequence[int],
                 continuation_table: np.ndarray | None = None):
        """special_ids: never masked ([CLS], [SEP], [PAD]); continuation_table: bool[vocab_size], True for
        pieces continuing a word (required for whole-word masking)."""
        self.span = config.masking_scheme == "span"
        whole_words = config.whole_word_masking or self.span  # spans are whole words by definition
        if whole_words and continuation_table is None:
            raise ValueError("whole-word masking needs the tokenizer's word continuation table")
        self.config = config
        self.vocab_size = int(vocab_size)
        self.mask_id = int(mask_id)
        self.special_ids = tf.constant(sorted(set(int(i) for i in special_ids)), tf.int32)
        self.continuation = tf.constant(np.asarray(continuation_table, bool)) if whole_words else None

    def __call__(self, features: dict[str, tf.Tensor], seed: tf.Tensor) -> dict[str, tf.Tensor]:
        """features: int32 input_ids / input_mask [B, L] (other keys pass through); seed: int [2].

        Returns the features with masked input_ids plus masked_lm_positions, masked_lm_ids (int32) and
        masked_lm_weights (float32) [B, max_predictions_per_seq]; span masking adds span_left_positions and
        span_right_positions (int32, same shape).
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

        if self.span:
            return self._span_mask(features, ids, candidate, word_start, word_id, num_words, seeds)

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
        return self._replace_and_record(features, ids, chosen, u, seeds[2])

    def _replace_and_record(self, features, ids, chosen, u, seed):
        """Chosen tokens -> [MASK] where u < 0.8, kept where u < 0.9, else a random id; the positions (increasing,
        padded with 0 / weight 0), original ids and weights of the predictions."""
        batch, length = tf.shape(ids)[0], tf.shape(ids)[1]
        max_pred = self.config.max_predictions_per_seq
        random_ids = tf.random.stateless_uniform([batch, length], seed, minval=0, maxval=self.vocab_size,
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

    def _span_mask(self, features, ids, candidate, word_start, word_id, num_words, seeds):
        """SpanBERT's span masking (see the module docstring), vectorised over the batch: one loop iteration
        draws one span in every row that has budget left."""
        batch, length = tf.shape(ids)[0], tf.shape(ids)[1]
        max_pred = self.config.max_predictions_per_seq
        num_candidates = tf.reduce_sum(tf.cast(candidate, tf.float64), axis=1)
        # SpanBERT: ceil(len * mask_ratio), in float64 as Python computes it.
        budget = tf.cast(tf.math.ceil(num_candidates * tf.constant(self.config.masked_lm_prob, tf.float64)), tf.int32)
        budget = tf.minimum(max_pred, tf.maximum(1, budget))
        budget = tf.where(num_words > 0, budget, 0)

        # Words by index w: start position, token count, and whether word w + 1 follows it directly (no [SEP]).
        positions = tf.range(length)[None, :]
        word_pos = tf.sort(tf.where(word_start, positions, length + positions), axis=1)      # [B, L]: w -> start
        flat_word = tf.reshape(tf.range(batch)[:, None] * length + tf.maximum(word_id, 0), [-1])
        word_len = tf.reshape(tf.math.unsorted_segment_sum(
            tf.reshape(tf.cast(candidate, tf.int32), [-1]), flat_word, batch * length), [batch, length])
        word_index = tf.range(length)[None, :]
        is_word = word_index < num_words[:, None]
        next_pos = tf.concat([word_pos[:, 1:], tf.fill([batch, 1], 2 * length)], axis=1)
        joined = is_word & (next_pos == word_pos + word_len)                                 # w and w + 1 adjacent

        max_words = SPAN_MAX_WORDS
        log_probs = tf.math.log(tf.constant(span_length_probabilities(), tf.float32))[None, :]
        offsets = tf.range(max_words)[None, :]

        def body(i, masked_words, count, done):
            seed = tf.random.experimental.stateless_fold_in(seeds[3], tf.cast(i, tf.int64))
            draw = tf.random.experimental.stateless_split(seed, 2)
            span_words = 1 + tf.cast(tf.random.stateless_categorical(
                tf.tile(log_probs, [batch, 1]), 1, draw[0])[:, 0], tf.int32)                  # [B] in 1..10
            # The start: a uniformly random word that is not masked yet.
            free = is_word & ~masked_words
            keys = tf.where(free, tf.random.stateless_uniform([batch, length], draw[1]), 2.0)
            anchor = tf.cast(tf.argmin(keys, axis=1), tf.int32)
            has_free = tf.reduce_any(free, axis=1)
            # Words anchor .. anchor + k, while within the drawn length and not across a [SEP] / the end.
            index = tf.minimum(anchor[:, None] + offsets, length - 1)                       # [B, 10]
            link = tf.gather(joined, index, batch_dims=1)
            reachable = tf.concat([tf.ones([batch, 1], tf.bool),
                                   tf.cast(tf.math.cumprod(tf.cast(link[:, :-1], tf.int32), axis=1), tf.bool)], 1)
            wanted = reachable & (offsets < span_words[:, None]) & (anchor[:, None] + offsets < num_words[:, None])
            # Words masked before cost nothing (the span runs on through them, as in SpanBERT's code).
            cost = tf.where(tf.gather(masked_words, index, batch_dims=1), 0, tf.gather(word_len, index, batch_dims=1))
            spent = count[:, None] + tf.cumsum(tf.where(wanted, cost, 0), axis=1)
            take = wanted & (spent <= budget[:, None]) & (~done & has_free)[:, None]
            # A word that does not fit ends the span and the masking (its budget is spent).
            over_budget = tf.reduce_any(wanted & (spent > budget[:, None]), axis=1)
            hit = tf.reduce_any(tf.equal(index[:, :, None], word_index[:, None, :]) & take[:, :, None], axis=1)
            masked_words = masked_words | hit
            count = count + tf.reduce_sum(tf.where(take, cost, 0), axis=1)
            done = done | ~has_free | over_budget | (count >= budget)
            return i + 1, masked_words, count, done

        # Each iteration masks >= 1 token in every row not done, or finishes it: at most max_pred + 1 iterations.
        _, masked_words, _, _ = tf.while_loop(
            lambda i, masked_words, count, done: ~tf.reduce_all(done) & (i <= max_pred), body,
            (tf.constant(0), tf.zeros([batch, length], tf.bool), tf.zeros([batch], tf.int32), budget <= 0))
        chosen = candidate & tf.gather(masked_words, tf.maximum(word_id, 0), batch_dims=1)

        # Spans are the runs of chosen tokens; each run's first and last positions by a segment min / max.
        previous = tf.pad(chosen[:, :-1], [[0, 0], [1, 0]])
        run = tf.cumsum(tf.cast(chosen & ~previous, tf.int32), axis=1) - 1                   # run index per token
        flat_run = tf.reshape(tf.range(batch)[:, None] * length + tf.maximum(run, 0), [-1])
        flat_chosen = tf.reshape(chosen, [-1])
        flat_pos = tf.reshape(tf.broadcast_to(positions, [batch, length]), [-1])
        run_first = tf.reshape(tf.math.unsorted_segment_min(tf.where(flat_chosen, flat_pos, length), flat_run,
                                                            batch * length), [batch, length])
        run_last = tf.reshape(tf.math.unsorted_segment_max(tf.where(flat_chosen, flat_pos, -1), flat_run,
                                                           batch * length), [batch, length])
        # 80% [MASK], 10% unchanged, 10% random ids, drawn once per span.
        u = tf.gather(tf.random.stateless_uniform([batch, length], seeds[1]), tf.maximum(run, 0), batch_dims=1)
        out = self._replace_and_record(features, ids, chosen, u, seeds[2])
        valid = out["masked_lm_weights"] > 0
        prediction_run = tf.gather(tf.maximum(run, 0), out["masked_lm_positions"], batch_dims=1)
        out["span_left_positions"] = tf.where(valid, tf.gather(run_first, prediction_run, batch_dims=1) - 1, 0)
        out["span_right_positions"] = tf.where(valid, tf.gather(run_last, prediction_run, batch_dims=1) + 1, 0)
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
    whole_words = config.whole_word_masking or config.masking_scheme == "span"
    if tokenizer.mask_id is None:
        raise ValueError(f"vocab {tokenizer.source} has no [MASK] token, which masked-LM pretraining puts in place "
                         f"of the tokens it predicts: add it (BERT's vocabularies have it at id 103)")
    return Masker(config, vocab_size=tokenizer.vocab_size, mask_id=tokenizer.mask_id,
                  special_ids=tokenizer.special_ids,
                  continuation_table=tokenizer.word_continuation_table() if whole_words else None)
