"""The pretraining batch: feature names, dtypes and widths, as in google-research/bert's TFRecords, plus the
features of packed rows.

Read by the TFRecord writer/reader, the pipeline and the train step's batch assembly; no TensorFlow or JAX here,
so all sides import it.

A packed row holds several complete instances ([CLS] A [SEP] B [SEP] each) one after the other:
- `packing_ids` [seq]: 1..k for the instance a token belongs to, 0 for padding (attention stays inside an id);
- `position_ids` [seq]: positions restarting at 0 for each instance;
- `instance_cls_positions` [k]: where each instance's [CLS] is (its NSP head reads there);
- `next_sentence_labels` / `next_sentence_weights` [k]: per instance, weight 0 for empty slots;
- masked_lm_* [max_predictions_per_seq + k]: the masks of all its instances (see `predictions_per_row`).
Unpacked rows keep exactly the original seven features.

Span masking (SpanBERT, `data.masking_scheme=span`) adds, per prediction, the span boundary of the span boundary
objective: `span_left_positions` / `span_right_positions` [pred], the unmasked tokens just outside the masked span
the prediction lies in (x_{s-1} and x_{e+1}; [CLS] or [SEP] at the sequence ends), 0 in empty slots.
"""
from __future__ import annotations

# The file `data create` writes beside its shards (tfrecord.write_metadata): their shapes, counts, config, and the
# corpus files they were made from. Here so that readers without TensorFlow (the model card) find it too.
METADATA_SUFFIX = "-metadata.json"

# name -> (dtype in a batch, width: "seq" = max_seq_length, "pred" = predictions per row, "inst" = instances
# per row (1 unpacked)).
FEATURES = {
    "input_ids": ("int32", "seq"),
    "input_mask": ("int32", "seq"),
    "segment_ids": ("int32", "seq"),
    "masked_lm_positions": ("int32", "pred"),
    "masked_lm_ids": ("int32", "pred"),
    "masked_lm_weights": ("float32", "pred"),
    "next_sentence_labels": ("int32", "inst"),
}
PACKED_FEATURES = {
    **FEATURES,
    "packing_ids": ("int32", "seq"),
    "position_ids": ("int32", "seq"),
    "instance_cls_positions": ("int32", "inst"),
    "next_sentence_weights": ("float32", "inst"),
}
SPAN_FEATURES = {
    "span_left_positions": ("int32", "pred"),
    "span_right_positions": ("int32", "pred"),
}
FEATURE_NAMES = tuple(FEATURES)
_ALL = {**PACKED_FEATURES, **SPAN_FEATURES}


def predictions_per_row(max_predictions_per_seq: int, instances_per_row: int | None) -> int:
    """Width of the masked_lm_* features of a row.

    An instance of n tokens gets min(max_pred, max(1, round(0.15 n))) <= 0.15 n + 1 masks, and max_pred is at
    least round(0.15 max_seq_length) (MaskingConfig.validate), so the k instances of a packed row (n summing to at
    most max_seq_length) need at most max_pred + k slots: a cap that grows with k, not k times max_pred (the MLM
    head's vocabulary projection runs at every slot).
    """
    return max_predictions_per_seq + (instances_per_row or 0)


def is_packed(feature_names) -> bool:
    """Whether a batch (or a spec) with these feature names has the packed layout."""
    return "packing_ids" in feature_names


def has_span_boundaries(feature_names) -> bool:
    """Whether a batch (or a spec) with these feature names carries span boundaries (span masking)."""
    return "span_left_positions" in feature_names


def batch_features(packed: bool, span: bool = False) -> dict[str, tuple[str, str]]:
    return {**(PACKED_FEATURES if packed else FEATURES), **(SPAN_FEATURES if span else {})}


def feature_shapes(max_seq_length: int, max_predictions_per_seq: int,
                   instances_per_row: int | None = None, span: bool = False) -> dict[str, tuple[int]]:
    """Per-example shape of every feature; `instances_per_row` (packing) gives the packed layout, `span` adds the
    span boundaries of span masking."""
    widths = {"seq": max_seq_length, "pred": predictions_per_row(max_predictions_per_seq, instances_per_row),
              "inst": instances_per_row or 1}
    return {name: (widths[width],) for name, (_, width) in batch_features(bool(instances_per_row), span).items()}


def feature_dtypes(feature_names) -> dict[str, str]:
    """dtype of each of these features (a batch, a spec or a list of names)."""
    return {name: _ALL[name][0] for name in feature_names}
