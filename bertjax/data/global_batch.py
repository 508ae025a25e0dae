"""Per-host numpy batches -> global sharded jax.Arrays (one process per host; multi-host safe)."""
from __future__ import annotations

from typing import Mapping

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec


def host_batch_to_global(batch: Mapping[str, np.ndarray], mesh: Mesh,
                         partition_spec: PartitionSpec | Mapping[str, PartitionSpec]) -> dict[str, jax.Array]:
    """Assemble each host's slice of the global batch into one jax.Array per feature.

    Every process passes its own per-host batch (global_batch / process_count rows, in process-index
    order along the batch axis); `partition_spec` (one for all features, or one per feature) names the
    mesh axes the leading batch dimension is sharded over, e.g. PartitionSpec(("data", "fsdp")).
    Trailing dimensions not named in the spec are replicated.
    """
    arrays = {}
    for name, value in batch.items():
        spec = partition_spec[name] if isinstance(partition_spec, Mapping) else partition_spec
        arrays[name] = jax.make_array_from_process_local_data(NamedSharding(mesh, spec), np.asarray(value))
    return arrays
