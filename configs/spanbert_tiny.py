"""SpanBERT-style BERT-tiny (L2/H128/A2): span masking, the span boundary objective, single segments, no NSP.

Run:  bertjax pretrain --config spanbert-tiny --workdir runs/spanbert-tiny --set data.input=CORPUS_GLOB
      --set data.vocab=VOCAB
Time: about bert-tiny's (300 steps of batch 32, seq 128: a few minutes on a 2-core CPU); the SBO head adds a
second vocabulary projection per masked token.
"""
from bertjax.pretrain_config import default_config


def get_config():
    c = default_config()
    c.model.preset = "tiny"
    c.model.max_position_embeddings = 128
    c.data.max_seq_length = 128
    c.data.doc_buffer_size = 200
    c.data.shuffle_buffer = 1000
    c.data.masking_scheme = "span"
    c.data.next_sentence_prediction = False
    c.train.nsp_loss = False
    c.train.span_boundary_objective = True
    c.train.steps = 300
    c.train.batch_size = 32
    c.train.log_every = 20
    c.optimizer.learning_rate = 1e-3
    c.optimizer.warmup_steps = 30
    c.checkpoint.every = 100
    return c
