"""ModernBERT-base phase 3, the decay: seq 8,192, the learning rate from 3e-4 to 0 by 1-sqrt over 50B tokens.

From a context-extension checkpoint (configs/modernbert_base_context.py), its optimizer state carried over
(init_optimizer_state: Adam's moments and count, the schedule from step 0) and its model as it is (global RoPE theta
160,000). The recipe (Warner et al. 2024, section 2.2; the AnswerDotAI/ModernBERT repository's
yamls/modernbert/modernbert-base-learning-rate-decay.yaml on its pretraining_documentation branch, 0e9dbe6): phase
2's batch (576 x 8,192 in 9 microbatches here), 50B tokens = 10,597 steps, decoupled StableAdamW from 3e-4 with no
warmup, the yaml's one_minus_sqrt decay over the whole phase (lr (1 - sqrt(progress))). Not reproduced: the yaml's
alpha_f 0.001 (its rate ends at 3e-7; here at 0). The paper decayed on a mixture with its higher-quality sources
upsampled: give data.input the decay's own mix (which sources and by how much: not stated in either). Not stated
either: the decoupled weight decay's max_lr after the phase boundary (here this phase's 3e-4).

Run, from phase 2's newest step (or RUN/checkpoints/STEP), then the export (transformers' ModernBertForMaskedLM,
global_rope_theta 160,000):
  bertjax pretrain --config modernbert-base-decay --init gs://BUCKET/modernbert-base-context \\
      --workdir gs://BUCKET/modernbert-base-decay --set data.input='gs://BUCKET/decay-mix/*.txt'
  bertjax export gs://BUCKET/modernbert-base-decay --out modernbert-base-hf
Price it: `bertjax compile --config modernbert-base-decay --topology v5litepod-16 --price-per-chip-hour 1.2`.
"""
from bertjax.configs.modernbert_base_context import get_config as modernbert_base_context


def get_config():
    c = modernbert_base_context()
    c.model_over_init = ""  # the model as phase 2 left it
    c.train.steps = 10_597  # 50B tokens of 576 x 8192
    c.optimizer.decay = "1-sqrt"
    c.checkpoint.every = 1_000  # the yaml's save_interval
    c.checkpoint.keep_every = 0
    return c
