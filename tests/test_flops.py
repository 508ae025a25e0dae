"""The FLOP counts against hand-computed ones for tiny configs (metrics.train_flops' formula, counted by hand): the
model's work (real tokens, ModernBERT's sliding layers at their window) and the work as dense kernels compute it
(every position and prediction slot of the row, every layer over the whole row), which learning_per_flop.py
reports side by side."""
import pytest

from bertjax.model.bert.config import BertConfig
from bertjax.model.modernbert.config import FULL, SLIDING, ModernBertConfig
from bertjax.pretraining import metrics

SEQ, MASKED = 6, 2
# hidden 4, 1 layer, intermediate 8, vocabulary 10: per token 8*16 + 4*4*8 + 4*6*4 = 352 forward FLOPs (attention
# over the row of 6), per masked token 2*16 + 2*4*10 = 112, per instance (pooler, NSP) 2*16 + 2*4*2 = 48.
BERT = BertConfig(vocab_size=10, hidden_size=4, num_hidden_layers=1, num_attention_heads=1, intermediate_size=8)
# hidden 4, intermediate 8, vocabulary 10, a global layer then two sliding ones with a window of 2 (a token sees
# 3 keys): per token a global layer 8*16 + 6*4*8 + 4*6*4 = 416, a sliding one 8*16 + 6*4*8 + 4*3*4 = 368 (at the
# window) or 416 (the whole row); per masked token 2*16 + 2*4*10 = 112; no pooler in the MLM objective.
MODERN = ModernBertConfig(vocab_size=10, hidden_size=4, intermediate_size=8, num_hidden_layers=3,
                          num_attention_heads=1, local_attention=2, layer_types=(FULL, SLIDING, SLIDING),
                          pad_token_id=0, max_position_embeddings=SEQ)


def test_bert_counts_padding_as_computed_and_real_tokens_as_the_model_s_work():
    full_row = 3 * (SEQ * 352 + MASKED * 112 + 48)  # 7152: training is 3x the forward
    assert metrics.train_flops_per_sequence(BERT, SEQ, MASKED) == full_row
    assert metrics.computed_train_flops_per_sequence(BERT, SEQ, MASKED) == full_row  # no window to differ by
    # A row with 4 real tokens and 1 filled prediction slot: the model's work leaves out the padding ...
    assert metrics.train_flops(BERT, SEQ, 4, 1, 1) == 3 * (4 * 352 + 112 + 48)
    # ... which the kernels compute all the same.
    assert metrics.computed_train_flops_per_sequence(BERT, SEQ, MASKED) > metrics.train_flops(BERT, SEQ, 4, 1, 1)


def test_modernbert_sliding_layers_count_their_window_as_work_and_the_row_as_computed():
    assert metrics.train_flops_per_sequence(MODERN, SEQ, MASKED) == 3 * (SEQ * (416 + 2 * 368) + MASKED * 112)
    assert metrics.computed_train_flops_per_sequence(MODERN, SEQ, MASKED) == 3 * (SEQ * 3 * 416 + MASKED * 112)
    assert metrics.train_flops(MODERN, SEQ, 4, 1, 1) == 3 * (4 * (416 + 2 * 368) + 112)
    assert metrics.train_flops(MODERN, SEQ, 4, 1, 1, windowed=False) == 3 * (4 * 3 * 416 + 112)


@pytest.mark.parametrize("local_attention", [SEQ - 1, 64])
def test_a_window_as_wide_as_the_row_counts_the_row(local_attention):
    wide = ModernBertConfig(**{**{f: getattr(MODERN, f) for f in ("vocab_size", "hidden_size", "intermediate_size",
                                                                  "num_hidden_layers", "num_attention_heads",
                                                                  "layer_types", "pad_token_id")},
                               "local_attention": local_attention})
    assert metrics.train_flops_per_sequence(wide, SEQ, MASKED) == \
        metrics.computed_train_flops_per_sequence(wide, SEQ, MASKED) == 3 * (SEQ * 3 * 416 + MASKED * 112)
