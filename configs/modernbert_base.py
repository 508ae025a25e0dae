"""ModernBERT-base with ModernBERT's phase-1 recipe: seq 1024, batch 4,608, MLM alone at 30%, packed rows, lr 8e-4.

Shapes: L22/H768/A12, GeGLU 1152 (its GELU by tanh), window 128, a global layer every third. The recipe (Warner et
al. 2024, section 2.2 and appendix A; the AnswerDotAI/ModernBERT repository's
yamls/modernbert/modernbert-base-pretrain.yaml): MLM alone at 30% masking (80/10/10), contiguous text packed into
the rows, no NSP, no dropout (their 0.1 on the attention output is not set: HF's config has one rate for it and the
probabilities); 4,608 sequences of 1024 tokens a step (4.7M tokens) in 9 microbatches, after a batch-size warmup
(the yaml's batch_size_warmup_min_size = its device microbatch, batch_size_warmup_tokens = 50B: from one microbatch,
512 rows here, a microbatch at a time, over the first 50B tokens: 21,194 steps, as on their 8 GPUs of 6 microbatches
of 96; another grad_accum_steps starts from its own microbatch, as theirs from the device's, in about as many steps);
the yaml's max_duration of 1.719T tokens = 374,901 steps (they counted real tokens, here rows x 1024). The
optimizer, as the yaml states it: `decoupled_stableadamw` (optimi's StableAdamW with decouple_lr=True:
optimizer.name=stableadamw, decouple_lr=true) at 8e-4, betas 0.9/0.98, eps 1e-6, weight decay 1e-5 scaled by
lr_t / 8e-4 and not on biases or norms (filter_bias_norm_wd); no gradient clipping (the yaml sets none, and their
main.py warns that StableAdamW replaces it: clip_norm=0). The schedule: warmup_stable_decay with a 3B-token warmup
and t_decay 0, so the rate is held after the warmup (decay=constant; the schedule counts tokens: 636 full steps'
worth = 3B tokens); the decay to 0 is a phase of its own, started from a checkpoint of this run with its optimizer
state and no batch-size warmup (docs/usage.md, "Phases"). Not stated by the paper or the yaml: the decoupled decay's
max_lr after a phase boundary (optimi's defaults to the run's lr; here the phase's own optimizer.learning_rate).
RoPE's theta 10,000 in every layer (the yaml's rotary_emb_base; the context extension raises the global layers' to
160,000). The embedding table and MLM softmax have ModernBERT's 50,368 rows (its tokenizer's tokens padded to a
multiple of 64; the yaml's vocab_size): a smaller vocabulary leaves rows unused (said at the start;
`--set model.vocab_size=0` sizes the table to the vocabulary), a larger one is refused.
The next phases: configs/modernbert_base_context.py (seq 8,192), then configs/modernbert_base_decay.py.

Run (TPU pod slice):
  bertjax pretrain --config modernbert-base --workdir gs://BUCKET/modernbert-base \
      --set data.input='gs://BUCKET/corpus/*.txt' --set data.vocab=gs://BUCKET/tokenizer.json
Price it first (`bertjax compile --config modernbert-base --topology v5litepod-16 --price-per-chip-hour ...`); a
budget run: configs/modernbert_base_budget.py.
"""
from bertjax.pretraining.config import default_config


def get_config():
    c = default_config()
    c.model.preset = "modernbert-base"
    c.model.dtype = "bfloat16"
    c.model.max_position_embeddings = 8192  # RoPE: no table; the longest input the model takes
    c.model.vocab_size = 50_368
    c.model.modernbert.global_rope_theta = 10_000.0
    # GeGLU's GELU by tanh (transformers' "gelu_pytorch_tanh", which the export names), as the BERT TPU presets:
    # tanh runs on TPU's transcendental unit where the exact erf is a long polynomial on the vector unit.
    c.model.modernbert.hidden_activation = "gelu_pytorch_tanh"
    c.data.max_seq_length = 1024
    c.data.next_sentence_prediction = False
    c.data.masked_lm_prob = 0.3
    c.data.max_predictions_per_seq = 307  # round(1024 x 0.3)
    c.data.packing = True
    c.train.nsp_loss = False
    c.train.steps = 374_901  # 1.719T tokens: 50B in the batch-size warmup's 21,194 steps, then 4,608 x 1024 a step
    c.train.batch_size = 4608
    c.train.grad_accum_steps = 9
    c.train.batch_size_warmup_tokens = 50_000_000_000
    c.train.batch_size_warmup_min = 0  # one microbatch (512 rows), as the yaml's device_train_microbatch_size
    c.train.log_every = 100
    c.optimizer.name = "stableadamw"
    c.optimizer.learning_rate = 8e-4
    c.optimizer.warmup_steps = 636  # 3B tokens of 4608 x 1024
    c.optimizer.decay = "constant"
    c.optimizer.b2 = 0.98
    c.optimizer.weight_decay = 1e-5
    c.optimizer.decouple_lr = True
    c.optimizer.clip_norm = 0.0
    c.checkpoint.every = 5_000
    c.checkpoint.keep_every = 50_000
    return c
