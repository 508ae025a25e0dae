"""ModernBERT-base (L22/H768/A12, GeGLU 1152, window 128, a global layer every third) with ModernBERT's phase-1
recipe: sequence length 1024, MLM alone at 30% masking (80/10/10), contiguous text packed into the rows, no NSP, no
dropout, learning rate 8e-4.

Run (TPU pod slice; see README for the budget run and its price):
  bertjax pretrain --config modernbert-base --workdir gs://BUCKET/modernbert-base \
      --set data.input='gs://BUCKET/corpus/*.txt' --set data.vocab=gs://BUCKET/tokenizer.json
"""
from bertjax.pretraining.config import default_config


def get_config():
    c = default_config()
    c.model.preset = "modernbert-base"
    c.model.dtype = "bfloat16"
    c.model.max_position_embeddings = 8192  # RoPE: no table; the longest input the model takes
    c.data.max_seq_length = 1024
    c.data.next_sentence_prediction = False
    c.data.masked_lm_prob = 0.3
    c.data.max_predictions_per_seq = 307  # round(1024 x 0.3)
    c.data.packing = True
    c.train.nsp_loss = False
    c.train.steps = 400_000
    c.train.batch_size = 512
    c.train.log_every = 100
    c.optimizer.learning_rate = 8e-4
    c.optimizer.warmup_ratio = 0.015
    c.checkpoint.every = 10_000
    c.checkpoint.keep_every = 100_000
    return c
