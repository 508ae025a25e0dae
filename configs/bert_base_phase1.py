"""BERT-base phase 1 as in the paper: seq 128, batch 256, 90% of 1M steps, AdamW lr 1e-4, 10k warmup.

Run (TPU pod slice, one process per host; see launch/):
  bertjax pretrain --config bert-base-phase1 --workdir gs://BUCKET/bert-base \
      --set data.input='gs://BUCKET/wiki/*.txt' --set data.vocab=gs://BUCKET/vocab.txt
Compute: 900k steps x 256 seq x ~70 GFLOP/seq = 1.6e19 FLOP; ~2 h on a v4-32 (16 chips) at an assumed 50% MFU, bf16.
The compiled step's own estimate for a slice or GPU host: `bertjax compile --config bert-base-phase1 --topology
v5litepod-16` (or h100, h100x8...); the figures at a stated commit: docs/performance.md.
"""
from bertjax.pretraining.config import default_config


def get_config():
    c = default_config()
    c.model.preset = "base"
    c.model.dtype = "bfloat16"
    # The tanh GELU, as google-research/bert computed it (its configs say "gelu"; HF calls it "gelu_new"): on TPU
    # its tanh runs on the transcendental unit where the exact erf is a long polynomial on the vector unit.
    c.model.hidden_act = "gelu_new"
    c.data.max_seq_length = 128
    c.data.max_predictions_per_seq = 20
    c.train.steps = 900_000
    c.train.batch_size = 256
    c.train.log_every = 100
    c.optimizer.learning_rate = 1e-4
    c.optimizer.warmup_ratio = 10_000 / 900_000  # 10k steps, and the same share of any other train.steps
    c.checkpoint.every = 10_000
    c.checkpoint.keep_every = 100_000
    return c
