"""ModernBERT as an encoder family (`encoder_family.EncoderFamily`): transformers' ModernBert* classes."""
from __future__ import annotations

import numpy as np

from bertjax.model.encoder_family import EncoderFamily
from bertjax.model.modernbert import model as modernbert
from bertjax.model.modernbert.config import MODEL_TYPE, PRESETS, ModernBertConfig


class ModernBertFamily(EncoderFamily):
    model_type = MODEL_TYPE
    name = "ModernBERT"
    config_class = ModernBertConfig
    class_prefix = "ModernBert"
    presets = tuple(PRESETS)
    has_nsp_head = False  # its objective: MLM alone
    # Its head size must be even (rotary embeddings); 3 and 2 are fixed axes of Wqkv and Wi.
    shape_probe = ModernBertConfig(vocab_size=43, hidden_size=42, num_hidden_layers=7, num_attention_heads=3,
                                   intermediate_size=41, max_position_embeddings=47, pad_token_id=0)
    field_of_size = {43: "vocab_size", 42: "hidden_size", 7: "num_hidden_layers", 41: "intermediate_size"}

    def is_hf_dict(self, values):
        # bertjax's own JSON spells the rotary thetas as fields and has no architectures.
        return "architectures" in values or "rope_parameters" in values or "global_rope_theta" in values

    def activation(self, config):
        return config.hidden_activation

    def attention_dropout(self, config):
        return config.attention_dropout

    def windowed(self, config, layer):
        return not config.is_global(layer)

    def encoder(self, config):
        return modernbert.ModernBertModel(config)

    def sequence_classifier(self, config, num_labels):
        return modernbert.ModernBertForSequenceClassification(config, num_labels)

    def token_classifier(self, config, num_labels):
        return modernbert.ModernBertForTokenClassification(config, num_labels)

    def question_answering(self, config):
        return modernbert.ModernBertForQuestionAnswering(config)

    def multiple_choice(self, config):
        return modernbert.ModernBertForMultipleChoice(config)

    def pretraining_model(self, config, span_boundary_objective=False):
        """The masked LM (MLM alone)."""
        if span_boundary_objective:
            raise ValueError("ModernBERT has no span boundary objective head")
        return modernbert.ModernBertForMaskedLM(config)

    def train_flops(self, config, seq_len, real_tokens, masked_tokens, instances, sbo=False, windowed=True):
        """Per layer and real token Wqkv and Wo 4*2*H^2, the GeGLU 3*2*H*I (Wi is 2I wide), attention 2*2*S*H where
        S is the keys a token attends: the row in global layers, the window (local_attention + 1, at most the row)
        in the others; per masked token the prediction head 2*H^2 and the decoder 2*H*V. A kernel that computes the
        whole row and masks it does more, which is not the model's work (`windowed` False counts it)."""
        h, inter = config.hidden_size, config.intermediate_size
        spans = [seq_len if config.is_global(i) or not windowed else min(seq_len, config.local_attention + 1)
                 for i in range(config.num_hidden_layers)]
        per_token = sum(8 * h * h + 6 * h * inter + 4 * span * h for span in spans)
        per_masked = 2 * h * h + 2 * h * config.vocab_size
        return 3.0 * float(real_tokens * per_token + masked_tokens * per_masked)

    def init_params(self, module, config, rng, length=8, num_masked=2):
        return modernbert.init_params(module, config, rng, length, num_masked)

    def shape_modules(self, config, num_labels):
        """ModernBertForMaskedLM and a classifier, per layer."""
        config = config.replace(scan_layers=False)
        modules = [(modernbert.ModernBertForMaskedLM(config), ())]
        if num_labels is not None:
            modules.append((modernbert.ModernBertForSequenceClassification(config, num_labels), ("classifier",)))
        return modules

    def hf_architecture(self, task):
        """ModernBERT has no NSP: pretraining is its ModernBertForMaskedLM."""
        return "ModernBertForMaskedLM" if task in ("BertForPreTraining", "BertForMaskedLM") else "Modern" + task

    def counted_params(self, params):
        """Without the unused layer-0 attention norm (HF's Identity)."""
        layer_0 = params.get("bert", {}).get("layer_0")
        if layer_0 is None or "attn_norm" not in layer_0:
            return params
        return {**params, "bert": {**params["bert"],
                                   "layer_0": {k: v for k, v in layer_0.items() if k != "attn_norm"}}}

    def with_uncounted_params(self, params, config, shapes):
        """HF's layer 0 has no attention norm; ours holds an unused one (one param tree for every layer)."""
        layer_0 = params["bert"]["layer_0"]
        layer_0["attn_norm"] = {"scale": np.ones(shapes[("bert", "layer_0", "attn_norm", "scale")], np.float32)}
        if config.norm_bias:
            layer_0["attn_norm"]["bias"] = np.zeros_like(layer_0["attn_norm"]["scale"])
        return params

    def loop_invariant_params(self, params, config):
        """The projection kernels already in the compute dtype (`modernbert.with_compute_dtype`: the same bits)."""
        return modernbert.with_compute_dtype(params, config)


MODERNBERT = ModernBertFamily()
