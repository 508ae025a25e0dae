"""`bertjax data create` and `bertjax pretrain` read the same corpus into the same tokens.

Both paths take their data options from one definition; this test runs each the way its command does, on the
embedded demo corpus with a cased SentencePiece vocabulary trained here, and compares the instances' tokens (masks
undone). It caught the two paths disagreeing on whether SentencePiece text is lower-cased.
"""
from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

from bertjax.cli import main as bertjax_main
from bertjax.data import schema, tfrecord
from bertjax.data.demo_corpus import write_demo_corpus
from bertjax.data.pipeline import make_pretraining_dataset
from bertjax.pretraining.config import load_config


def _unmasked_rows(batch: dict) -> list[tuple[int, ...]]:
    """Each row's input_ids with the masked positions given back their original ids."""
    ids = np.array(batch["input_ids"])
    rows, slots = np.nonzero(batch["masked_lm_weights"] > 0)
    ids[rows, batch["masked_lm_positions"][rows, slots]] = batch["masked_lm_ids"][rows, slots]
    return [tuple(row[mask > 0].tolist()) for row, mask in zip(ids, batch["input_mask"])]


@pytest.fixture(scope="module")
def cased_sentencepiece(tmp_path_factory):
    folder = tmp_path_factory.mktemp("corpus")
    train_path, _ = write_demo_corpus(str(folder))
    assert bertjax_main(["vocab", "train", "--input", str(train_path), "--vocab-size", "800",
                         "--type", "sentencepiece", "--out", str(folder / "sp")]) == 0
    return str(train_path), str(folder / "sp" / "spm.model")


def test_data_create_and_pretraining_give_the_same_tokens(cased_sentencepiece, tmp_path):
    corpus, model = cased_sentencepiece
    out = tmp_path / "records"
    assert bertjax_main(["data", "create", "--input", corpus, "--vocab", model, "--out", str(out),
                         "--dupe-factor", "1", "--doc-buffer", "200", "--shuffle-buffer", "1"]) == 0
    created = []
    for serialized in tf.data.TFRecordDataset(tfrecord.find_shards([str(out)])).batch(256):
        created += _unmasked_rows({k: v.numpy() for k, v in tfrecord.parse_batch(serialized, schema.feature_shapes(128, 20)).items()})

    config = load_config("bert-tiny", [f"data.input={corpus}", f"data.vocab={model}", "data.masking=static",
                                       "data.shuffle_buffer=1", "data.doc_buffer_size=200"])
    streamed = []
    for batch in make_pretraining_dataset(config.data, 32).as_numpy_iterator():
        streamed += _unmasked_rows(batch)
        if len(streamed) >= len(created):
            break
    # The demo corpus is cased prose: a lower-casing path would give other pieces.
    assert len(created) > 100
    assert sorted(streamed[:len(created)]) == sorted(created)
