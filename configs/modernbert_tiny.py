"""ModernBERT-tiny (L4/H128/A2, window 32) with the modern recipe: the CPU demo and test size.

GeGLU 192, a global layer every third.

The recipe, each part an option: MLM alone at 30% masking (80/10/10), no NSP, contiguous text (RoBERTa's full
sentences) packed into the rows, no dropout, and ModernBERT's optimizer (modernbert-base's: StableAdamW, betas
0.9/0.98, eps 1e-6, weight decay 1e-5 scaled by lr_t / peak, no gradient clipping); at this size one run with a 10%
warmup and a linear decay rather than ModernBERT's phases. The vocabulary may be a vocab.txt (WordPiece), a
SentencePiece .model or an HF tokenizer.json.
Run:  bertjax pretrain --config modernbert-tiny --workdir runs/mtiny --set data.input=CORPUS_GLOB \
          --set data.vocab=tokenizer.json
"""
from bertjax.pretraining.config import default_config


def get_config():
    c = default_config()
    c.model.preset = "modernbert-tiny"
    c.model.max_position_embeddings = 128
    c.data.max_seq_length = 128
    c.data.next_sentence_prediction = False
    c.data.masked_lm_prob = 0.3
    c.data.max_predictions_per_seq = 38  # round(128 x 0.3)
    c.data.packing = True
    c.data.doc_buffer_size = 200
    c.data.shuffle_buffer = 1000
    c.train.nsp_loss = False
    c.train.steps = 300
    c.train.batch_size = 32
    c.train.log_every = 20
    c.optimizer.name = "stableadamw"
    c.optimizer.learning_rate = 1e-3
    c.optimizer.warmup_ratio = 0.1
    c.optimizer.b2 = 0.98
    c.optimizer.weight_decay = 1e-5
    c.optimizer.decouple_lr = True
    c.optimizer.clip_norm = 0.0
    c.checkpoint.every = 100
    return c
