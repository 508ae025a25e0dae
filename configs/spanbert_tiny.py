"""SpanBERT-style BERT-tiny (L2/H128/A2): span masking, the span boundary objective, single segments, no NSP.

Run:  bertjax pretrain --config spanbert-tiny --workdir runs/spanbert-tiny --set data.input=CORPUS_GLOB
      --set data.vocab=VOCAB
Time: about bert-tiny's (300 steps of batch 32, seq 128: a few minutes on a 2-core CPU); the SBO head adds a
second vocabulary projection per masked token.
"""
from bertjax.configs import bert_tiny


def get_config():
    c = bert_tiny.get_config()
    c.data.masking_scheme = "span"
    c.data.next_sentence_prediction = False
    c.train.nsp_loss = False
    c.train.span_boundary_objective = True
    return c
