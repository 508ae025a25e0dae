"""ModernBERT-base on MosaicBERT's budget recipe: seq 128, batch 4,096, MLM at 30%, 8,200 steps.

The recipe (Portes et al. 2023; mosaicml/examples, benchmarks/bert/yamls/main/mosaic-bert-base-uncased.yaml):
sequence length 128, batch 4,096, MLM alone at 30%, AdamW at 5e-4 (betas 0.9/0.98, eps 1e-6; the yaml's
`decoupled_adamw` is Composer's DecoupledAdamW, whose weight decay 1e-5 is scaled by lr_t / 5e-4:
optimizer.decouple_lr=true; here not on biases and LayerNorms, where its main.py decays every parameter:
DecoupledAdamW(model.parameters())), no gradient clipping (the yaml sets none), warmup 6% then linear decay (to 0
here; the yaml's alpha_f is 0.02), no dropout in attention; trained for 8,200 steps, the length of MosaicBERT-Base's
1.13-hour run on 8 A100s (79.6 average GLUE dev, its paper's abstract; the steps read off its Pareto figure as 1.13
h of a ~9.65 h 70,000-step run: not stated by the paper). The quality is the source's claim for its own architecture
and data (C4), not measured here.

  bertjax compile --config modernbert-base-budget --topology v5litepod-16 --price-per-chip-hour 1.2
"""
from bertjax.configs.modernbert_base import get_config as modernbert_base


def get_config():
    c = modernbert_base()
    c.data.max_seq_length = 128
    c.data.max_predictions_per_seq = 38  # round(128 x 0.3)
    c.train.steps = 8_200
    c.train.batch_size = 4096
    c.train.grad_accum_steps = 1
    c.train.batch_size_warmup_tokens = 0  # MosaicBERT's batch is full from the first step
    c.optimizer.name = "adamw"  # MosaicBERT's (modernbert-base's StableAdamW is ModernBERT's)
    c.optimizer.learning_rate = 5e-4
    c.optimizer.warmup_ratio = 0.06
    c.optimizer.decay = "linear"
    c.checkpoint.every = 1_000
    c.checkpoint.keep_every = 0
    return c
