"""What BertConfig and ModernBertConfig share: the compute settings' allowed values, the checks both run on
construction (each naming the field), reading a dict of fields, and the methods every job calls on either.

A config travels with every checkpoint, so it is validated on construction: a bad one fails here with a message
naming the field, not later as a shape error deep inside a compiled function (or, for sizes whose params would not
fit the machine's memory, a MemoryError or an XLA abort).
"""
from __future__ import annotations

import dataclasses
import os
from typing import Any

from etils import epath

from bertjax.runtime.input_files import read_json

# HF's meanings (transformers.activations.ACT2FN): "gelu" is the exact erf form; the tanh approximation goes by
# "gelu_new" / "gelu_pytorch_tanh" (what Google's TF code computed although its configs say "gelu").
ACTIVATIONS = ("gelu", "gelu_new", "gelu_pytorch_tanh", "gelu_fast", "relu", "tanh", "silu", "swish")
DTYPES = ("float32", "bfloat16", "float16")
REMAT_POLICIES = ("none", "dots", "full")
ATTENTION_BACKENDS = ("auto", "reference", "chunked", "dot_product", "cudnn", "pallas_tpu", "splash_tpu",
                      "flash_dropout_tpu", "flash_dropout_gpu")


def host_memory_bytes() -> int:
    """This machine's physical memory."""
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def memory_shortfall(param_count: int) -> str | None:
    """Why `param_count` float32 params cannot be held by this machine (None: they fit)."""
    need, memory = 4 * param_count, host_memory_bytes()
    if need <= memory:
        return None
    return (f"the model's {param_count:,} float32 parameters alone need {need / 2**30:,.1f} GiB, more than this "
            f"machine's {memory / 2**30:,.1f} GiB of memory")


def read_config_json(path: str) -> dict[str, Any]:
    """A model config file's JSON object; a missing file or another JSON value is an error naming the path."""
    if not epath.Path(path).exists():
        raise FileNotFoundError(f"config file {path} does not exist")
    values = read_json(path, "a model config (JSON)")
    if not isinstance(values, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(values).__name__}")
    return values


class ConfigBase:
    """The methods and checks of both families' frozen config dataclasses (BertConfig, ModernBertConfig)."""

    model_type: str  # HF config.json's model_type: the family's key in `family.FAMILIES`

    # ---- checks, each a list of problems naming the field ---------------------------------------------------
    def positive_int_problems(self, names) -> list[str]:
        problems = []
        for name in names:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                problems.append(f"{name} must be a positive integer, got {value!r}")
        return problems

    def heads_problems(self) -> list[str]:
        if self.hidden_size % self.num_attention_heads:
            return [f"hidden_size {self.hidden_size} is not divisible by num_attention_heads "
                    f"{self.num_attention_heads}"]
        return []

    def activation_problems(self, names) -> list[str]:
        return [f"unknown {name} {getattr(self, name)!r}; expected one of {', '.join(ACTIVATIONS)}"
                for name in names if getattr(self, name) not in ACTIVATIONS]

    def rate_problems(self, names) -> list[str]:
        return [f"{name} must be in [0, 1), got {getattr(self, name)!r}"
                for name in names if not 0.0 <= getattr(self, name) < 1.0]

    def compute_problems(self) -> list[str]:
        """The compute settings (dtype, remat, attention_backend) and the padding id."""
        problems = []
        if self.dtype not in DTYPES:
            problems.append(f"unknown dtype {self.dtype!r}; expected one of {', '.join(DTYPES)}")
        if self.remat not in REMAT_POLICIES:
            problems.append(f"unknown remat {self.remat!r}; expected one of {', '.join(REMAT_POLICIES)}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            problems.append(f"unknown attention_backend {self.attention_backend!r}; "
                            f"expected one of {', '.join(ATTENTION_BACKENDS)}")
        if isinstance(self.vocab_size, int) and not 0 <= self.pad_token_id < self.vocab_size:
            problems.append(f"pad_token_id {self.pad_token_id} is outside the vocabulary of {self.vocab_size}")
        return problems

    def raise_problems(self, problems: list[str]) -> None:
        if problems:
            raise ValueError(f"invalid {type(self).__name__}: " + "; ".join(problems))

    # ---- what every job asks of a config ----------------------------------------------------------------------
    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    def check_length(self, length: int, flag: str) -> None:
        """Refuses sequences longer than the position table, before any data is read (`flag` names the option)."""
        if length > self.max_position_embeddings:
            raise ValueError(f"{flag} {length} exceeds the model's max_position_embeddings "
                             f"{self.max_position_embeddings}: give at most {self.max_position_embeddings}")

    def replace(self, **changes):
        return dataclasses.replace(self, **changes)

    # ---- bertjax's own JSON (checkpoints) ---------------------------------------------------------------------
    @classmethod
    def from_dict(cls, values: dict[str, Any], source: str = "config"):
        """Builds a config from a dict of its fields (a `model_type` key aside); unknown keys are an error naming
        them, and so is a bad value (naming `source`)."""
        values = {k: v for k, v in values.items() if k != "model_type"}
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"{source}: unknown {cls.__name__} keys {unknown}; expected a subset of {sorted(known)}")
        try:
            return cls(**cls.fields_from_json(values))
        except (ValueError, TypeError) as error:
            raise ValueError(f"{source}: {error}") from None

    @classmethod
    def fields_from_json(cls, values: dict[str, Any]) -> dict[str, Any]:
        """JSON's values as the fields take them (a family with tuple fields converts its lists here)."""
        return values
