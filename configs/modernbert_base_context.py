"""ModernBERT-base phase 2, the context extension: seq 8,192, global RoPE theta 160,000, lr 3e-4 held, 250B tokens.

From a phase-1 checkpoint (configs/modernbert_base.py), its optimizer state carried over (init_optimizer_state:
Adam's moments and count, the schedule from step 0) and the global layers' RoPE theta raised from the checkpoint's
10,000 to 160,000 (model_over_init; the local layers' stays 10,000, every other model setting the checkpoint's). The
recipe (Warner et al. 2024, section 2.2; the AnswerDotAI/ModernBERT repository's
yamls/modernbert/modernbert-base-context-extension.yaml on its pretraining_documentation branch, 0e9dbe6): 576
sequences of 8,192 tokens a step (4.7M tokens, phase 1's) in 9 microbatches here (4 sequences a chip of a
v5litepod-16; the yaml's 12 a GPU of 8: 6 microbatches); 250B tokens = 52,982 steps; packed rows, MLM alone at 30%
(2,458 predictions a row); decoupled StableAdamW at 3e-4, betas 0.9/0.98, eps 1e-6, weight decay 1e-5 (the yaml's
constant_with_warmup, t_warmup 0: no warmup, the rate held; its reset_time and restart_override: the schedule
restarts, the checkpoint's optimizer state is loaded). The paper trained it on the original pretraining mixture; the
corpus is data.input's (long documents fill the rows; shorter ones are packed into them). Not stated by the paper
or the yaml: the decoupled weight decay's max_lr after the phase boundary (here this phase's 3e-4); the data mix's
share of long documents. From an HF checkpoint of the released pretrain/ phase (no optimizer state): `--set
init_optimizer_state=false --set optimizer.warmup_ratio=0.01` (fresh moments want a warmup; its length is ours).

Run (TPU pod slice), from phase 1's newest step (or RUN/checkpoints/STEP):
  bertjax pretrain --config modernbert-base-context --init gs://BUCKET/modernbert-base \\
      --workdir gs://BUCKET/modernbert-base-context --set data.input='gs://BUCKET/corpus/*.txt'
(data.vocab unset: the checkpoint's tokenizer.json). Then the decay: configs/modernbert_base_decay.py. Price it:
`bertjax compile --config modernbert-base-context --topology v5litepod-16 --price-per-chip-hour 1.2`.
"""
from bertjax.configs.modernbert_base import get_config as modernbert_base


def get_config():
    c = modernbert_base()
    c.init_optimizer_state = True
    c.model_over_init = "modernbert.global_rope_theta"
    c.model.modernbert.global_rope_theta = 160_000.0
    c.model.modernbert.local_rope_theta = 10_000.0
    c.data.max_seq_length = 8192
    c.data.max_predictions_per_seq = 2458  # round(8192 x 0.3)
    c.train.steps = 52_982  # 250B tokens of 576 x 8192
    c.train.batch_size = 576
    c.train.grad_accum_steps = 9
    c.train.batch_size_warmup_tokens = 0  # the yamls' later phases grow no batch (phase 1 did)
    c.optimizer.learning_rate = 3e-4
    c.optimizer.warmup_steps = 0
    c.optimizer.decay = "constant"
    c.checkpoint.every = 4_000  # the yaml's save_interval
    c.checkpoint.keep_every = 20_000
    return c
