"""BERT-large phase 1 with LAMB at a large batch (You et al. / MLPerf-style): seq 128, batch 65536 via accumulation.

Run:
  bertjax pretrain --config bert-large-lamb-phase1 --workdir gs://BUCKET/bert-large \
      --set data.input='gs://BUCKET/wiki/*.txt' --set data.vocab=gs://BUCKET/vocab.txt
Compute: 7038 steps x 65536 seq x ~3.3 x 70 GFLOP/seq ~ 1.1e20 FLOP; ~14 h on a v4-32 at an assumed 50% MFU. The
compiled step's own estimate (weight-update sharding, the default): `bertjax compile --config bert-large-lamb-phase1
--topology v5p-128`; the figures at a stated commit: docs/performance.md.
"""
from bertjax.pretraining.config import default_config


def get_config():
    c = default_config()
    c.model.preset = "large"
    c.model.dtype = "bfloat16"
    # The tanh GELU, as google-research/bert computed it (its configs say "gelu"; HF calls it "gelu_new"): on TPU
    # its tanh runs on the transcendental unit where the exact erf is a long polynomial on the vector unit.
    c.model.hidden_act = "gelu_new"
    c.data.max_seq_length = 128
    c.train.steps = 7038
    c.train.batch_size = 65536
    c.train.grad_accum_steps = 16
    c.optimizer.name = "lamb"
    c.optimizer.learning_rate = 6e-3
    c.optimizer.warmup_ratio = 2000 / 7038  # 2000 steps (You et al.: 28.4%)
    c.optimizer.b2 = 0.999
    c.optimizer.weight_decay = 0.01
    c.checkpoint.every = 500
    return c
