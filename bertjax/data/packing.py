"""Sequence packing: several complete pretraining instances per row, so that little of a batch is padding.

Packing is per instance-creation block (after masking): the block's instances are the bounded buffer, packed by
best-fit decreasing (BFD): instances in decreasing length, each into the open row with the least room that still
fits it (and has a free instance slot), else into a new row. A pure function of the block, so the packed stream
is as deterministic and resumable as the unpacked one. Measured on real text in bench/packing.py.

numpy only (the pipeline calls it through tf.numpy_function); the packed layout is described in data/schema.py.
"""
from __future__ import annotations

import numpy as np

from bertjax.data import schema


def best_fit_decreasing(lengths: np.ndarray, capacity: int, max_items: int):
    """Assigns items to rows of `capacity` with at most `max_items` each.

    Returns (row, slot, offset, num_rows): item i goes to row[i] as its slot[i]-th item, at token offset[i]
    (slots are in increasing offset order within a row).
    """
    lengths = np.asarray(lengths, np.int64)
    if lengths.size and (lengths.min() < 1 or lengths.max() > capacity):
        raise ValueError(f"item lengths must be in [1, {capacity}], got {lengths.min()}..{lengths.max()}")
    row = np.zeros(len(lengths), np.int64)
    slot, offset = np.zeros_like(row), np.zeros_like(row)
    open_rows: list[list[int]] = [[] for _ in range(capacity + 1)]  # rows with a free slot, by their free room
    has_open = np.zeros(capacity + 1, bool)
    used: list[int] = []
    count: list[int] = []
    for item in np.argsort(-lengths, kind="stable").tolist():
        length = int(lengths[item])
        room = length + int(np.argmax(has_open[length:]))
        if has_open[room]:
            r = open_rows[room].pop()
            has_open[room] = bool(open_rows[room])
        else:
            r = len(used)
            used.append(0)
            count.append(0)
        row[item], slot[item], offset[item] = r, count[r], used[r]
        used[r] += length
        count[r] += 1
        free = capacity - used[r]
        if count[r] < max_items and free > 0:
            open_rows[free].append(r)
            has_open[free] = True
    return row, slot, offset, len(used)


def pack_instances(features: dict[str, np.ndarray], max_instances: int, pad_id: int) -> dict[str, np.ndarray]:
    """Masked instances (one per row: input_ids, input_mask, segment_ids [N, L]; masked_lm_* [N, P];
    next_sentence_labels [N]) -> packed rows with the features of schema.PACKED_FEATURES."""
    mask = np.asarray(features["input_mask"]).astype(bool)
    n, seq_len = mask.shape
    pred_width = schema.predictions_per_row(np.shape(features["masked_lm_positions"])[1], max_instances)
    lengths = mask.sum(axis=1)
    row, slot, offset, num_rows = best_fit_decreasing(lengths, seq_len, max_instances)

    # Tokens: instance i's first lengths[i] positions move to row[i] at offset[i].
    token_instance = np.repeat(np.arange(n), lengths)
    within = np.arange(int(lengths.sum())) - np.repeat(np.cumsum(lengths) - lengths, lengths)
    rows, cols = row[token_instance], offset[token_instance] + within
    out = {}
    for name, fill in (("input_ids", pad_id), ("segment_ids", 0)):
        out[name] = np.full((num_rows, seq_len), fill, np.int32)
        out[name][rows, cols] = np.asarray(features[name])[token_instance, within]
    out["input_mask"] = np.zeros((num_rows, seq_len), np.int32)
    out["input_mask"][rows, cols] = 1
    out["packing_ids"] = np.zeros((num_rows, seq_len), np.int32)
    out["packing_ids"][rows, cols] = slot[token_instance] + 1
    out["position_ids"] = np.zeros((num_rows, seq_len), np.int32)
    out["position_ids"][rows, cols] = within

    # NSP: one slot per instance, at its own [CLS].
    out["instance_cls_positions"] = np.zeros((num_rows, max_instances), np.int32)
    out["instance_cls_positions"][row, slot] = offset
    out["next_sentence_labels"] = np.zeros((num_rows, max_instances), np.int32)
    out["next_sentence_labels"][row, slot] = np.asarray(features["next_sentence_labels"]).reshape(-1)
    out["next_sentence_weights"] = np.zeros((num_rows, max_instances), np.float32)
    out["next_sentence_weights"][row, slot] = 1.0

    # MLM: every instance's masks, shifted by its offset, in increasing position within the row.
    instance, k = np.nonzero(np.asarray(features["masked_lm_weights"]) > 0)
    target_row = row[instance]
    position = np.asarray(features["masked_lm_positions"])[instance, k] + offset[instance]
    order = np.lexsort((position, target_row))
    target_row, position = target_row[order], position[order]
    ids = np.asarray(features["masked_lm_ids"])[instance, k][order]
    rank = np.arange(len(order)) - np.searchsorted(target_row, target_row)
    if len(rank) and rank.max() >= pred_width:
        raise AssertionError(f"a packed row has {rank.max() + 1} masked positions, more than {pred_width}")
    for name, dtype, value in (("masked_lm_positions", np.int32, position), ("masked_lm_ids", np.int32, ids),
                               ("masked_lm_weights", np.float32, 1.0)):
        out[name] = np.zeros((num_rows, pred_width), dtype)
        out[name][target_row, rank] = value
    return out
