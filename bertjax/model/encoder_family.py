"""The contract an encoder family keeps: one object (a subclass of `EncoderFamily`, in the family's folder) holds its
config reader, its task modules, its HF class names and its hooks, and `family.py` registers it by HF's
`model_type`. The jobs, readers and writers ask `family.of(config)` (or family.py's functions) for these and never
name a family, so a family is one folder: its config, its Flax modules, this object, and its row in `FAMILIES`.

The defaults here are BERT's way (every param counted by transformers, the params a microbatch loop takes as they
are); a family overrides what it does otherwise.
"""
from __future__ import annotations

from typing import Any


class EncoderFamily:
    """One encoder family's answers to what bertjax asks of a model. Every method takes the family's config."""

    model_type: str        # HF config.json's model_type, the key it is registered by
    name: str              # as messages name it ("BERT", "ModernBERT")
    config_class: type     # its config dataclass (a config_base.ConfigBase)
    class_prefix: str      # its HF classes' prefix: "Bert" + "ForMaskedLM"
    presets: tuple[str, ...] = ()  # the `model.preset` names a pretraining job builds it from
    has_nsp_head: bool = False     # a next-sentence (and span boundary) head beside the masked LM
    # A config whose sizes are all different numbers (`shapes.size_field`: which field sets a dimension), and the
    # field each of its sizes is.
    shape_probe: Any = None
    field_of_size: dict[int, str] = {}

    # ---- the config ---------------------------------------------------------------------------------------------
    def config_from_dict(self, values: dict[str, Any], source: str):
        """bertjax's own config JSON (a checkpoint's)."""
        return self.config_class.from_dict(values, source=source)

    def config_from_hf_dict(self, values: dict[str, Any], source: str):
        """An HF config.json's dict."""
        return self.config_class.from_hf_dict(values, source=source)

    def is_hf_dict(self, values: dict[str, Any]) -> bool:
        """Whether a config file carrying this family's model_type is HF's config.json (else bertjax's own)."""
        return True

    def activation(self, config) -> str:
        """The feed-forward activation's name."""
        raise NotImplementedError

    def attention_dropout(self, config) -> float:
        """The attention probabilities' dropout rate."""
        raise NotImplementedError

    def windowed(self, config, layer: int) -> bool:
        """Whether `layer` attends within a window (not the whole row)."""
        return False

    # ---- the task modules -------------------------------------------------------------------------------------
    def encoder(self, config):
        """The bare encoder, returning (sequence [B, L, H], None): no pooler."""
        raise NotImplementedError

    def sequence_classifier(self, config, num_labels: int):
        raise NotImplementedError

    def token_classifier(self, config, num_labels: int):
        raise NotImplementedError

    def question_answering(self, config):
        raise NotImplementedError

    def multiple_choice(self, config):
        raise NotImplementedError

    def pretraining_model(self, config, span_boundary_objective: bool = False):
        """The module a pretraining job trains."""
        raise NotImplementedError

    def train_flops(self, config, seq_len: int, real_tokens: float, masked_tokens: float, instances: float,
                    sbo: bool = False, windowed: bool = True) -> float:
        """Matmul FLOPs of forward + backward (twice the forward) of the pretraining model on `real_tokens` tokens
        of rows of `seq_len`, `masked_tokens` predictions and `instances` sequences (`sbo`: with a span boundary
        head); padding counts nothing. `windowed`: windowed layers attend over their window (the model's work);
        False: over the whole row, as a kernel that masks the rest computes."""
        raise NotImplementedError

    def init_params(self, module, config, rng, length: int = 8, num_masked: int = 2):
        """Initial (boxed, logically partitioned) params of any of the family's modules."""
        raise NotImplementedError

    def shape_modules(self, config, num_labels: int | None) -> list[tuple[Any, tuple[str, ...]]]:
        """(module, the top-level param groups taken from it, () for all): together every param a checkpoint of
        `config` may hold, with a classifier of `num_labels` (None: none). Built per layer or stacked as the family
        builds `config`; `shapes.param_shapes` stacks per-layer ones where `config.scan_layers`."""
        raise NotImplementedError

    # ---- HF class names ---------------------------------------------------------------------------------------
    def hf_architecture(self, task: str) -> str:
        """The family's HF class for a task named by BERT's class ("BertForTokenClassification")."""
        return task

    # ---- hooks ------------------------------------------------------------------------------------------------
    def counted_params(self, params: dict) -> dict:
        """`params` as transformers counts them."""
        return params

    def with_uncounted_params(self, params: dict, config, shapes: dict) -> dict:
        """Params read from an HF checkpoint completed with those the family holds and transformers has not
        (`shapes`: every param's shape), in place; the inverse of `counted_params`."""
        return params

    def loop_invariant_params(self, params: dict, config) -> dict:
        """`params` as a loop over microbatches takes them (cast once a step, not per microbatch)."""
        return params
