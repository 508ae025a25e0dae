"""The pretraining batch: feature names, dtypes and widths, as in google-research/bert's TFRecords.

Read by the TFRecord writer/reader and by the train step's batch assembly; no TensorFlow or JAX here, so both
sides import it.
"""
from __future__ import annotations

# name -> (dtype in a batch, width: "seq" = max_seq_length, "pred" = max_predictions_per_seq, or a number).
FEATURES = {
    "input_ids": ("int32", "seq"),
    "input_mask": ("int32", "seq"),
    "segment_ids": ("int32", "seq"),
    "masked_lm_positions": ("int32", "pred"),
    "masked_lm_ids": ("int32", "pred"),
    "masked_lm_weights": ("float32", "pred"),
    "next_sentence_labels": ("int32", 1),
}
FEATURE_NAMES = tuple(FEATURES)
FLOAT_FEATURES = tuple(name for name, (dtype, _) in FEATURES.items() if dtype == "float32")


def feature_shapes(max_seq_length: int, max_predictions_per_seq: int) -> dict[str, tuple[int]]:
    """Per-example shape of every feature."""
    widths = {"seq": max_seq_length, "pred": max_predictions_per_seq}
    return {name: (widths.get(width, width),) for name, (_, width) in FEATURES.items()}
