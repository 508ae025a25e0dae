"""Which of bertjax's Pallas GPU kernels the model runs: every family, unless the check on the card
(`gpu_kernel_check.prepare`, before a job's first step) found one that disagrees with XLA there; that family then
runs XLA's path (the program CPUs and an unchecked build compile: slower on the card, correct).

Read while a step is traced, so a job sets it before it builds its step: `attention.resolve_backend`
(`flash_dropout_gpu`: XLA's reference attention instead), `layer_norm.py` and `norm_dropout.py` (`layer_norm_gpu`:
the XLA custom_vjp instead). Process-wide, as the card is.
"""
from __future__ import annotations

# family -> (its kernels' name in the program, what it computes): the names `bertjax compile` finds in a program.
FAMILIES = {"attention": ("flash_dropout_gpu", "attention with dropout"),
            "layer_norm": ("layer_norm_gpu", "the LayerNorms")}

_xla_instead: set[str] = set()


def runs_kernel(family: str) -> bool:
    """Whether the model runs `family`'s Pallas kernels on a GPU (False: XLA's path)."""
    return family not in _xla_instead


def run_xla_for(families) -> None:
    """From now on these families run XLA's path on a GPU, the others their kernels (an empty set: all kernels)."""
    unknown = set(families) - set(FAMILIES)
    if unknown:
        raise ValueError(f"unknown GPU kernel families {sorted(unknown)}; known: {sorted(FAMILIES)}")
    _xla_instead.clear()
    _xla_instead.update(families)


def xla_instead() -> frozenset[str]:
    return frozenset(_xla_instead)
