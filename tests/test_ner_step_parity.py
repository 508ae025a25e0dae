"""Deterministic step parity of the NER recipe (slow: the real all-MiniLM-L6-v2 on both sides): with dropout off,
the same batches and the same start weights (our seed's classifier head copied into torch), our Trainer's model,
loss and optimizer follow bench/ner_parity.py's PyTorch loop (BertForTokenClassification, torch AdamW eps 1e-6,
decay off rank-1 params, get_linear_schedule_with_warmup, clip 1.0) step for step."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")


def _bench():
    path = Path(__file__).resolve().parents[1] / "bench" / "ner_step_parity.py"
    spec = importlib.util.spec_from_file_location("ner_step_parity", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_ours_and_the_torch_loop_agree_step_by_step(shared_data, minilm_dir):
    # 256 sentences, 8 batches of 32, 2 epochs: 16 steps, 1 of warmup (lr 0 at step 0 on both sides); the first
    # 6 cover the warmup, the peak and the decay.
    r = _bench().step_parity(str(shared_data / "conll2003"), str(minilm_dir), train_sentences=256, steps=6,
                             epochs=2, seed=1)
    assert r["alignment_differs"] == 0
    ours, theirs = np.array(r["ours"]), np.array(r["torch"])
    np.testing.assert_allclose(ours[:, 2], theirs[:, 2], rtol=1e-6)            # learning rate of each step
    np.testing.assert_allclose(ours[:, 0], theirs[:, 0], rtol=1e-4)            # loss
    np.testing.assert_allclose(ours[:, 1], theirs[:, 1], rtol=1e-4)            # gradient norm before clipping
    assert ours[-1, 0] < ours[0, 0]                                            # and it did train
