"""XLA:TPU's cycle estimates read from compiled HLO (`bertjax/cloud/estimate.py`): the reading rules on a hand-written
module, and the estimate against programs whose time is known (a large matmul near the MXUs' peak, an elementwise
add near HBM bandwidth) on two TPU generations' compile-only devices."""
import functools

import pytest

from bertjax.cloud.estimate import estimate_program, op_name_group
from bertjax.cloud.topologies import GENERATIONS

# A module in the shape XLA:TPU prints (trimmed): a loop of 3 trips, a conditional, a Pallas kernel with its declared
# CostEstimate, a collective and an index hint without estimates.
_HLO = """HloModule jit_step, entry_computation_layout={()->f32[8]}

%fused_computation (p: f32[8]) -> f32[8] {
  %p = f32[8]{0} parameter(0)
  ROOT %m = f32[8]{0} multiply(%p, %p)
}

%body (b: (s32[], f32[8])) -> (s32[], f32[8]) {
  %b = (s32[], f32[8]{0}) parameter(0)
  %x = f32[8]{0} get-tuple-element(%b), index=1
  %fusion.2 = f32[8]{0} fusion(%x), kind=kLoop, calls=%fused_computation, metadata={op_name="jit(step)/bert/layer_3/mlp/dot_general"}, backend_config={"estimated_cycles":"100"}
  ROOT %t = (s32[], f32[8]{0}) tuple(%i, %fusion.2)
}

%cond (c: (s32[], f32[8])) -> pred[] {
  %c = (s32[], f32[8]{0}) parameter(0)
  ROOT %lt = pred[] compare(%i, %n), direction=LT, backend_config={"estimated_cycles":"1"}
}

%cond2 (c: (s32[], f32[8])) -> pred[] {
  %c = (s32[], f32[8]{0}) parameter(0)
  %limit = s32[]{:T(128)} constant(5)
  %counter = s32[]{:T(128)} get-tuple-element(%c), index=0
  ROOT %lt.2 = pred[] compare(%counter, %limit), direction=LT, backend_config={"estimated_cycles":"2"}
}

%update (u: f32[8]) -> f32[8] {
  %u = f32[8]{0} parameter(0)
  ROOT %fusion.3 = f32[8]{0} fusion(%u), kind=kLoop, calls=%fused_computation, metadata={op_name="jit(step)/cond/branch_1_fun/add"}, backend_config={"estimated_cycles":"1000"}
}

%keep (k: f32[8]) -> f32[8] {
  %k = f32[8]{0} parameter(0)
  ROOT %copy.1 = f32[8]{0} copy(%k), backend_config={"estimated_cycles":"10"}
}

ENTRY %main (a: f32[8]) -> f32[8] {
  %a = f32[8]{0} parameter(0)
  %fusion.1 = f32[8]{0} fusion(%a), kind=kLoop, calls=%fused_computation, metadata={op_name="jit(step)/bert/layer_0/mlp/dot_general"}, backend_config={"estimated_cycles":"50"}
  %while.1 = (s32[], f32[8]{0}) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"3"}}
  %while.2 = (s32[], f32[8]{0}) while(%init), condition=%cond2, body=%body
  %kernel = f32[8]{0} custom-call(%a), custom_call_target="tpu_custom_call", metadata={op_name="jit(step)/attention/pallas"}, backend_config={"custom_call_config": {"body": "abc", "cost_estimate": {"flops": 3000000000, "transcendentals": 0, "bytes_accessed": 1000000}}}
  %hint = s32[8]{0} custom-call(%a), custom_call_target="AssumeGatherIndicesInBound"
  %all-reduce.1 = f32[1024]{0} all-reduce(%a), replica_groups={}, to_apply=%fused_computation
  %conditional.1 = f32[8]{0} conditional(%p, %a, %a), branch_computations={%keep, %update}
  ROOT %r = f32[8]{0} add(%fusion.1, %conditional.1)
}
"""


def test_reading_rules_on_a_hand_written_module():
    estimate = estimate_program(_HLO, clock_hz=1e9, peak_flops=1e12, hbm_bytes_per_second=1e9)
    # 50 (entry) + 3 x 100 (loop body) + 4 x 1 (loop condition, trips + 1) + 1000 (the larger branch); the second
    # loop has no known_trip_count: its condition `counter < 5` gives 5 x 100 + 6 x 2. The add without an
    # estimate counts nothing.
    assert estimate.cycles == 50 + 300 + 4 + 500 + 12 + 1000
    # The kernel: max(3e9 FLOPs / 1e12, 1e6 bytes / 1e9) = 3 ms.
    assert estimate.kernel_seconds == pytest.approx(3e-3)
    assert estimate.seconds == pytest.approx(1866e-9 + 3e-3)
    assert estimate.by_op_name["bert/layer_N/mlp/dot_general"] == pytest.approx(850e-9)  # layers merged
    assert list(estimate.by_op_name)[0] == "attention/pallas"                           # largest first
    assert estimate.coverage["pallas_kernels_from_cost_estimate"] == 1
    assert estimate.coverage["without_estimate"] == {"custom-call:AssumeGatherIndicesInBound": 1, "add": 1}
    assert estimate.coverage["collective_bytes"] == {"all-reduce": 4096}
    assert estimate.coverage["unknown_trip_counts"] == [] and estimate.coverage["trip_counts_from_condition"] == [5]


def test_op_name_groups_merge_layers_and_drop_the_jit_wrapper():
    assert op_name_group("jit(train_step)/jvp(Bert)/bert/layer_11/attention/self/lt") == \
        "jvp(Bert)/bert/layer_N/attention/self/lt"
    assert op_name_group("") == "(no op_name)"


libtpu = pytest.importorskip("libtpu", reason="compiling for TPU needs libtpu (pip install -e '.[test]')")


@functools.cache
def _estimated(generation: str, program: str) -> tuple[float, float]:
    """(estimated seconds, the program's time at the chip's peak FLOPs or HBM bandwidth) on one chip."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from bertjax.cloud.topologies import compile_only_devices, parse_topology

    chip = GENERATIONS[generation]
    topology = parse_topology({"v5e": "v5e:1x1", "v4": "v4-8"}[generation])
    whole = NamedSharding(Mesh(np.array(compile_only_devices(topology)[:1]), ("data",)), PartitionSpec())
    if program == "matmul":
        n = 8192
        x = jax.ShapeDtypeStruct((n, n), jnp.bfloat16, sharding=whole)
        compiled = jax.jit(lambda a, b: a @ b).lower(x, x).compile()
        ideal = 2 * n**3 / chip.peak_flops_per_chip
    else:
        n = 64 * 2**20
        x = jax.ShapeDtypeStruct((n,), jnp.float32, sharding=whole)
        compiled = jax.jit(lambda a, b: a + b).lower(x, x).compile()
        ideal = 3 * 4 * n / chip.hbm_bytes_per_second  # two reads and a write
    estimate = estimate_program(compiled.as_text(), clock_hz=chip.clock_hz, peak_flops=chip.peak_flops_per_chip,
                                hbm_bytes_per_second=chip.hbm_bytes_per_second)
    return estimate.seconds, ideal


@pytest.mark.usefixtures("no_cache_writes")
@pytest.mark.parametrize("generation", ["v5e", "v4"])
def test_a_large_matmul_is_estimated_just_under_the_chips_peak(generation):
    # With the right clock the MXU-bound matmul lands near peak (v5e 88%, v4 93% with libtpu 0.0.42.1); a clock
    # off by a factor of 2 (cores per chip, MXUs per core) would put it at ~45% or ~180%.
    seconds, at_peak = _estimated(generation, "matmul")
    assert 0.8 < at_peak / seconds <= 1.0


@pytest.mark.parametrize("generation", ["v5e", "v4"])
def test_an_elementwise_add_is_estimated_below_hbm_bandwidth(generation):
    # Memory bound: no faster than HBM allows, and within 2x of it (v5e 57%, v4 69%).
    seconds, at_bandwidth = _estimated(generation, "add")
    assert 0.5 < at_bandwidth / seconds <= 1.0
