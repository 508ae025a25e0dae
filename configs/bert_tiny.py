"""BERT-tiny (L2/H128/A2) on a small corpus: the CPU demo and test size.

Run:  bertjax pretrain --config bert-tiny --workdir runs/tiny --set data.input=CORPUS_GLOB --set data.vocab=VOCAB
Time: 300 steps of batch 32, seq 128 take a few minutes on a 2-core CPU machine (see README for measured figures).
"""
from bertjax.pretraining.config import default_config


def get_config():
    c = default_config()
    c.model.preset = "tiny"
    c.model.max_position_embeddings = 128
    c.data.max_seq_length = 128
    c.data.doc_buffer_size = 200
    c.data.shuffle_buffer = 1000
    c.train.steps = 300
    c.train.batch_size = 32
    c.train.log_every = 20
    c.optimizer.learning_rate = 1e-3
    c.optimizer.warmup_ratio = 0.1  # 30 of the 300 steps, and a share of any other train.steps
    c.checkpoint.every = 100
    return c
