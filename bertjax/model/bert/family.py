"""BERT as an encoder family (`encoder_family.EncoderFamily`): Google's BERT, HF's Bert* classes."""
from __future__ import annotations

from bertjax.model.bert import model as bert
from bertjax.model.bert.config import PRESETS, BertConfig
from bertjax.model.encoder_family import EncoderFamily


class BertFamily(EncoderFamily):
    model_type = "bert"
    name = "BERT"
    config_class = BertConfig
    class_prefix = "Bert"
    presets = tuple(PRESETS)
    has_nsp_head = True
    # hidden 39 = 3 heads of 13; the SBO head's first dense takes 3 * hidden.
    shape_probe = BertConfig(vocab_size=43, hidden_size=39, num_hidden_layers=7, num_attention_heads=3,
                             intermediate_size=41, max_position_embeddings=47, type_vocab_size=5)
    field_of_size = {43: "vocab_size", 39: "hidden_size", 117: "hidden_size", 13: "hidden_size",
                     7: "num_hidden_layers", 3: "num_attention_heads", 41: "intermediate_size",
                     47: "max_position_embeddings", 5: "type_vocab_size"}

    def activation(self, config):
        return config.hidden_act

    def attention_dropout(self, config):
        return config.attention_probs_dropout_prob

    def encoder(self, config):
        return bert.BertModel(config, add_pooler=False)

    def sequence_classifier(self, config, num_labels):
        return bert.BertForSequenceClassification(config, num_labels)

    def token_classifier(self, config, num_labels):
        return bert.BertForTokenClassification(config, num_labels)

    def question_answering(self, config):
        return bert.BertForQuestionAnswering(config)

    def multiple_choice(self, config):
        return bert.BertForMultipleChoice(config)

    def pretraining_model(self, config, span_boundary_objective=False):
        """MLM + NSP (+ SBO)."""
        return bert.BertForPreTraining(config, span_boundary_objective=span_boundary_objective)

    def train_flops(self, config, seq_len, real_tokens, masked_tokens, instances, sbo=False, windowed=True):
        """BertForPreTraining's. Forward, per layer and real token: Q/K/V/output projections 4*2*H^2, feed-forward
        2*2*H*I, attention scores and context 2*2*L*H (L = the row length the kernels attend over); per masked token
        the MLM head (transform 2*H^2, decoder 2*H*V), and with the SBO head (`sbo`) its two layers (2*3H*H + 2*H^2)
        and decoder again; per instance the pooler and NSP classifier."""
        h, inter, layers = config.hidden_size, config.intermediate_size, config.num_hidden_layers
        per_token = layers * (8 * h * h + 4 * h * inter + 4 * seq_len * h)
        per_masked = 2 * h * h + 2 * h * config.vocab_size
        if sbo:
            per_masked += 2 * 3 * h * h + 2 * h * h + 2 * h * config.vocab_size
        forward = real_tokens * per_token + masked_tokens * per_masked + instances * (2 * h * h + 2 * h * 2)
        return 3.0 * float(forward)

    def init_params(self, module, config, rng, length=8, num_masked=2):
        return bert.init_params(module, config, rng, length, num_masked)

    def shape_modules(self, config, num_labels):
        """BertForPreTraining with the SBO head, the qa_outputs head, a classifier."""
        modules = [(bert.BertForPreTraining(config, span_boundary_objective=True), ()),
                   (bert.BertForQuestionAnswering(config), ("qa_outputs",))]
        if num_labels is not None:
            modules.append((bert.BertForSequenceClassification(config, num_labels), ("classifier",)))
        return modules


BERT = BertFamily()
