"""Checks of pretraining instances against the published facts of google-research/bert's
create_pretraining_data.py, shared by the tests of each way of making them (numpy instances, local and Beam
`data create` records)."""
from __future__ import annotations

import numpy as np


def check_nsp_layout(x: dict, max_seq: int, cls_id: int, sep_id: int, pad_id: int):
    """[CLS] A [SEP] B [SEP] then padding: exactly two [SEP]s (the last closing the sequence), segment ids 0/1,
    input_mask over the real tokens. x: unmasked input_ids / input_mask / segment_ids [N, max_seq]."""
    length = x["input_mask"].sum(1)
    assert length.max() <= max_seq and (length >= 5).all()
    for ids, mask, seg, ln in zip(x["input_ids"], x["input_mask"], x["segment_ids"], length):
        assert (mask[:ln] == 1).all() and (mask[ln:] == 0).all() and (ids[ln:] == pad_id).all()
        seps = np.flatnonzero(ids[:ln] == sep_id)
        assert ids[0] == cls_id and len(seps) == 2 and seps[1] == ln - 1 and seps[0] >= 2
        assert (seg[:seps[0] + 1] == 0).all() and (seg[seps[0] + 1:ln] == 1).all() and (seg[ln:] == 0).all()
        assert cls_id not in ids[1:ln]


def check_nsp_balance(labels: np.ndarray, forced_random_next: int, tolerance: float):
    """Random next is a fair coin except for one-segment chunks, which are always random next."""
    n = len(labels)
    assert abs((labels.sum() - forced_random_next) / (n - forced_random_next) - 0.5) <= tolerance


def check_static_masks(original: dict, m: dict, max_pred: int, special_ids, mask_id: int, *,
                       rate_tolerance: float, split_tolerance: float, rate_of: str = "candidates"):
    """15% of the non-special tokens, the original's count per sequence (Python round, at least 1, at most
    max_pred), increasing positions, labels = the original ids, only recorded positions changed, and each chosen
    token 80% [MASK] / 10% kept / 10% a random id. rate_of: "candidates" (non-special tokens) or "tokens" (all,
    the original's base: at short lengths the 3 special tokens weigh, e.g. 10 of 61 candidates at 64). original: the unmasked input_ids / input_mask; m: the masked
    input_ids and masked_lm_positions / _ids / _weights."""
    weights = m["masked_lm_weights"]
    special = np.isin(original["input_ids"], list(special_ids))
    candidates = ((original["input_mask"] == 1) & ~special).sum()
    base = candidates if rate_of == "candidates" else original["input_mask"].sum()
    assert abs(weights.sum() / base - 0.15) <= rate_tolerance
    expected = [min(max_pred, max(1, int(round(n * 0.15)))) for n in original["input_mask"].sum(1)]
    np.testing.assert_array_equal(weights.sum(1), expected)

    rows = np.repeat(np.arange(len(weights)), max_pred).reshape(weights.shape)
    valid = weights > 0
    pos, r = m["masked_lm_positions"][valid], rows[valid]
    both = valid[:, 1:] & valid[:, :-1]
    assert (valid[:, 1:] <= valid[:, :-1]).all()  # real predictions first, then padding
    assert (np.diff(m["masked_lm_positions"], axis=1)[both] > 0).all()  # increasing positions
    assert not special[r, pos].any()  # [CLS]/[SEP]/[PAD] are never chosen
    np.testing.assert_array_equal(m["masked_lm_ids"][valid], original["input_ids"][r, pos])
    assert (m["masked_lm_ids"][~valid] == 0).all() and (m["masked_lm_positions"][~valid] == 0).all()
    changed = m["input_ids"] != original["input_ids"]
    recorded = np.zeros_like(changed)
    recorded[r, pos] = True
    assert not (changed & ~recorded).any()  # only the recorded positions changed
    new = m["input_ids"][r, pos]
    as_mask = np.mean(new == mask_id)
    kept = np.mean(new == original["input_ids"][r, pos])
    assert abs(as_mask - 0.8) <= split_tolerance and abs(kept - 0.1) <= split_tolerance
    assert abs(1 - as_mask - kept - 0.1) <= split_tolerance
    random_ids = new[(new != mask_id) & (new != original["input_ids"][r, pos])]
    assert len(np.unique(random_ids)) > 0.5 * len(random_ids)  # random ids are spread over the vocab
