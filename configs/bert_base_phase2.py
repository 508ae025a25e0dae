"""BERT-base phase 2: seq 512 for the last 10% (100k steps), from a phase-1 checkpoint.

Run:
  bertjax pretrain --config bert-base-phase2 --workdir gs://BUCKET/bert-base-p2 \
      --init gs://BUCKET/bert-base/checkpoints/900000 \
      --set data.input='gs://BUCKET/wiki/*.txt' --set data.vocab=gs://BUCKET/vocab.txt
Compute: 100k steps x 256 seq x 512 tokens x ~588 MFLOP/token = 7.7e18 FLOP; ~1 h on a v4-32 at an assumed 50% MFU.
The compiled step's own estimate: `bertjax compile --config bert-base-phase2 --topology v5litepod-16`; the figures
at a stated commit: docs/performance.md.
"""
from bertjax.pretraining.config import default_config


def get_config():
    c = default_config()
    c.model.preset = "base"
    c.model.dtype = "bfloat16"
    # The tanh GELU, as google-research/bert computed it (its configs say "gelu"; HF calls it "gelu_new"): on TPU
    # its tanh runs on the transcendental unit where the exact erf is a long polynomial on the vector unit.
    c.model.hidden_act = "gelu_new"
    c.data.max_seq_length = 512
    c.data.max_predictions_per_seq = 80
    c.train.steps = 100_000
    c.train.batch_size = 256
    c.optimizer.learning_rate = 1e-4
    c.optimizer.warmup_ratio = 0.01  # 1k of the 100k steps
    c.checkpoint.every = 10_000
    c.reset_schedule = True
    return c
