"""XLA options the train step is compiled with, by the platform its mesh runs on.

Given to `jax.jit(compiler_options=...)`, so the job on a GPU host and `bertjax compile --topology h100x8` (the
same jit, deviceless) build the same program, and no process-wide XLA_FLAGS are needed.

On GPU hosts with more than one GPU the update is sharded: the gradients are reduce-scattered. XLA:GPU combines
reduce-scatters up to its threshold into one collective; by default that is every layer's, which can only start
after the whole backward (`h100x8`, BERT-base: 0.33 of 0.43 ms not hidden, docs/performance-history.md). In chunks of
8 MiB (an encoder layer's bf16 gradients are 14 MB) they start as the backward leaves a few layers and the
latency-hiding scheduler hides them behind the layers below (priced: none exposed).
"""
from __future__ import annotations

REDUCE_SCATTER_COMBINE_BYTES = 8 * 2**20


def compiler_options(mesh) -> dict[str, str]:
    """The options for a step on `mesh` (its devices' platform and count); empty where XLA's defaults serve."""
    devices = mesh.devices.flat
    if devices[0].platform != "gpu" or mesh.devices.size == 1:
        return {}
    return {"xla_gpu_reduce_scatter_combine_threshold_bytes": str(REDUCE_SCATTER_COMBINE_BYTES)}
