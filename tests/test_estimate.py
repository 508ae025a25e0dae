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
    assert estimate.collectives[0].group_size == 1 and estimate.exposed_communication_seconds == 0.0
    assert estimate.coverage["unknown_trip_counts"] == [] and estimate.coverage["trip_counts_from_condition"] == [5]



def test_the_high_end_charges_each_unpriced_instruction_its_bytes_at_hbm_bandwidth():
    """The range: the low end prices what XLA left unestimated at 0 (as above), the high end at its operands' and
    result's bytes over HBM bandwidth; an async copy's tuple result counts less the operand it aliases, and only the
    conditional branch the estimate takes is charged."""
    hlo = _HLO.replace(
        "  ROOT %copy.1 = f32[8]{0} copy(%k), backend_config={\"estimated_cycles\":\"10\"}",
        "  %never = f32[4096]{0} broadcast(%k), dimensions={}\n"  # in the branch not taken: never charged
        "  ROOT %copy.1 = f32[8]{0} copy(%k), backend_config={\"estimated_cycles\":\"10\"}").replace(
        "  %hint = ",
        "  %big = f32[1024,256]{1,0} parameter(1)\n"
        "  %copy-start.1 = (f32[1024,256]{1,0:S(1)}, f32[1024,256]{1,0}, u32[]) copy-start(%big)\n"
        "  %copy-done.1 = f32[1024,256]{1,0:S(1)} copy-done(%copy-start.1)\n"
        "  %hint = ")
    assert hlo.count("%never") == 1 and hlo.count("copy-start(%big)") == 1
    estimate = estimate_program(hlo, clock_hz=1e9, peak_flops=1e12, hbm_bytes_per_second=1e9)
    assert estimate.seconds == pytest.approx(1866e-9 + 3e-3)  # the low end: as before
    # By hand: the copy reads 1 MiB and writes 1 MiB (+ its 4-byte context); the add reads two f32[8] and writes
    # one; the hint reads f32[8] and writes s32[8].
    assert estimate.unpriced == {
        "copy-start": {"count": 1, "bytes": 2 * 2**20 + 4, "seconds": (2 * 2**20 + 4) / 1e9},
        "add": {"count": 1, "bytes": 96, "seconds": 96 / 1e9},
        "custom-call:AssumeGatherIndicesInBound": {"count": 1, "bytes": 64, "seconds": 64 / 1e9}}
    assert estimate.high_seconds == pytest.approx(estimate.seconds + (2 * 2**20 + 4 + 96 + 64) / 1e9)
    assert "broadcast" in estimate.coverage["without_estimate"]  # counted as without estimate, not charged


def test_a_pallas_kernel_without_a_cost_estimate_is_named_and_adds_no_time():
    """JAX's splash kernel declares no CostEstimate: the module's kernel without one is counted as such."""
    hlo = _HLO.replace(', "cost_estimate": {"flops": 3000000000, "transcendentals": 0, "bytes_accessed": 1000000}', "")
    assert hlo != _HLO
    estimate = estimate_program(hlo, clock_hz=1e9, peak_flops=1e12, hbm_bytes_per_second=1e9)
    assert estimate.kernel_seconds == 0 and estimate.seconds == pytest.approx(1866e-9)
    assert estimate.coverage["pallas_kernels_from_cost_estimate"] == 0
    assert estimate.coverage["without_estimate"] == {"Pallas kernel without a CostEstimate": 1,
                                                     "custom-call:AssumeGatherIndicesInBound": 1, "add": 1}

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


# Collectives as XLA:TPU prints them (trimmed): a synchronous all-reduce with its ring algorithm (4 colors), an
# async all-gather pair with 3000 cycles of compute scheduled between its start and its done, a reduce-scatter, and
# an all-gather in XLA:TPU's async collective fusions (start, a continuation fusion with 2000 cycles of compute,
# done; the done reads the start through tuple elements and the continuation).
_COLLECTIVES_HLO = """HloModule jit_step, is_scheduled=true, num_partitions=16

%sum (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %add = f32[] add(%x, %y)
}

%gather_body (p: bf16[62500]) -> (bf16[62500], bf16[1000000], u32[]) {
  %p = bf16[62500]{0} parameter(0)
  %all-gather.9 = bf16[1000000]{0} all-gather(%p), channel_id=4, replica_groups=[1,16]<=[16], dimensions={0}
  ROOT %cc = (bf16[62500]{0}, bf16[1000000]{0}, u32[]) custom-call(%p, %all-gather.9), custom_call_target="AsyncCollectiveFusionStart"
}

%async_collective_fusion.1 (q: bf16[1000000], r: bf16[1000000]) -> (bf16[8], bf16[1000000]) {
  %q = bf16[1000000]{0} parameter(0)
  %r = bf16[1000000]{0} parameter(1)
  ROOT %t = (bf16[8]{0}, bf16[1000000]{0}) tuple(%q, %r)
}

%done_body (d: bf16[1000000]) -> bf16[1000000] {
  ROOT %d = bf16[1000000]{0} parameter(0)
}

ENTRY %main (a: bf16[1000000], b: bf16[62500]) -> bf16[1000000] {
  %a = bf16[1000000]{0} parameter(0)
  %b = bf16[62500]{0} parameter(1)
  %all-reduce.1 = bf16[1000000]{0} all-reduce(%a), channel_id=1, replica_groups=[1,16]<=[16], to_apply=%sum, backend_config={"collective_algorithm_config":{"strategy":"UniDirectionNDRingStrategy","debug":"UniDirectionNDRingStrategy{colors:4 phases:2}"}}
  %all-gather-start.1 = (bf16[62500]{0}, bf16[1000000]{0}) all-gather-start(%b), channel_id=2, replica_groups={{0,1,2,3,4,5,6,7,8,9,10,11,12,13,14,15}}, dimensions={0}
  %fusion.1 = bf16[1000000]{0} fusion(%all-reduce.1), kind=kLoop, calls=%sum, backend_config={"estimated_cycles":"3000"}
  %all-gather-done.1 = bf16[1000000]{0} all-gather-done(%all-gather-start.1)
  %reduce-scatter.1 = bf16[62500]{0} reduce-scatter(%a), channel_id=3, replica_groups=mesh['axis_0'=16,'axis_1'=1] {'axis_0','axis_1'}, dimensions={0}, to_apply=%sum
  %async-collective-start = (bf16[62500]{0}, bf16[1000000]{0}, u32[]) fusion(%b), kind=kCustom, calls=%gather_body, backend_config={"estimated_cycles":"10"}
  %gte.1 = bf16[1000000]{0} get-tuple-element(%async-collective-start), index=1
  %fusion.7 = (bf16[8]{0}, bf16[1000000]{0}) fusion(%a, %gte.1), kind=kCustom, calls=%async_collective_fusion.1, backend_config={"estimated_cycles":"2000"}
  %gte.2 = bf16[1000000]{0} get-tuple-element(%fusion.7), index=1
  %async-collective-done = bf16[1000000]{0} fusion(%gte.2), kind=kCustom, calls=%done_body
  ROOT %r = bf16[1000000]{0} add(%fusion.1, %all-gather-done.1)
}
"""


def test_collectives_are_priced_at_the_ring_bandwidth_and_an_async_pair_only_where_compute_does_not_hide_it():
    from bertjax.cloud.estimate import Interconnect

    # 4 ports of 50 GB/s one way (v5e); 1 GHz clock: the fusion between the all-gather's start and done is 3 us.
    estimate = estimate_program(_COLLECTIVES_HLO, clock_hz=1e9, peak_flops=1e12, hbm_bytes_per_second=1e9,
                                interconnect=Interconnect(50e9, 4))
    all_reduce, all_gather, reduce_scatter, fused_gather = estimate.collectives
    # 2 MB over 16 chips in 4 rings: 2 x 15/16 x 2e6 B / 200e9 B/s = 18.75 us, all of it exposed (synchronous).
    assert (all_reduce.kind, all_reduce.bytes, all_reduce.group_size, all_reduce.colors) == \
        ("all-reduce", 2_000_000, 16, 4)
    assert all_reduce.seconds == pytest.approx(18.75e-6) and all_reduce.exposed_seconds == all_reduce.seconds
    # The gather's 2 MB result, (n-1)/n of it received over all 4 ports (no algorithm named): 9.375 us, of which
    # the 3 us fusion scheduled inside the pair hides 3 us.
    assert (all_gather.kind, all_gather.bytes, all_gather.is_async) == ("all-gather", 2_000_000, True)
    assert all_gather.seconds == pytest.approx(9.375e-6)
    assert all_gather.exposed_seconds == pytest.approx(6.375e-6)
    # A reduce-scatter moves (n-1)/n of its operand (16 x the 125 kB result): the same as the all-gather.
    assert (reduce_scatter.bytes, reduce_scatter.group_size) == (2_000_000, 16)
    assert reduce_scatter.seconds == pytest.approx(9.375e-6)
    # The fused async gather: the same 9.375 us, 2 us hidden by the continuation (its start's own 10 cycles are
    # not counted as hiding it).
    assert (fused_gather.kind, fused_gather.bytes, fused_gather.is_async) == ("all-gather", 2_000_000, True)
    assert fused_gather.exposed_seconds == pytest.approx(7.375e-6)
    assert estimate.compute_seconds == pytest.approx(3e-6 + 10e-9 + 2e-6)
    assert estimate.exposed_communication_seconds == pytest.approx(18.75e-6 + 6.375e-6 + 9.375e-6 + 7.375e-6)
    assert estimate.seconds == pytest.approx(estimate.compute_seconds + estimate.exposed_communication_seconds)
    assert estimate.communication_seconds == pytest.approx(18.75e-6 + 3 * 9.375e-6)
    kinds = estimate.collectives_by_kind()
    assert kinds["all-reduce"]["bytes_by_dtype"] == {"bf16": 2_000_000} and kinds["all-gather"]["async"] == 2
    assert estimate.by_op_name["communication: all-reduce bf16 (synchronous)"] == pytest.approx(18.75e-6)


@pytest.mark.usefixtures("no_cache_writes")
def test_collectives_of_a_compiled_program_are_found_with_their_groups_and_bytes():
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, PartitionSpec as P

    from bertjax.cloud.estimate import Interconnect
    from bertjax.cloud.topologies import compile_only_devices, parse_topology

    chip = GENERATIONS["v5e"]
    mesh = Mesh(np.array(compile_only_devices(parse_topology("v5e:2x2"))), ("data",))

    def program(x, y):
        summed = jax.lax.psum(x, "data")                                     # all-reduce of f32[256,1024]
        gathered = jax.lax.all_gather(y, "data", tiled=True)                 # bf16[512,1024] gathered
        scattered = jax.lax.psum_scatter(x, "data", scatter_dimension=0, tiled=True)  # f32[256,1024] in
        return summed, gathered, scattered

    step = jax.jit(jax.shard_map(program, mesh=mesh, in_specs=(P(), P("data")), out_specs=(P(), P(), P("data")),
                                 check_vma=False))
    x = jax.ShapeDtypeStruct((256, 1024), jnp.float32)
    y = jax.ShapeDtypeStruct((512, 1024), jnp.bfloat16)
    estimate = estimate_program(step.lower(x, y).compile().as_text(), clock_hz=chip.clock_hz,
                                peak_flops=chip.peak_flops_per_chip, hbm_bytes_per_second=chip.hbm_bytes_per_second,
                                interconnect=Interconnect(chip.ici_link_bytes_per_second, chip.ici_ports))
    kinds = estimate.collectives_by_kind()
    assert kinds["all-reduce"]["bytes_by_dtype"] == {"f32": 256 * 1024 * 4}
    assert kinds["all-gather"]["bytes_by_dtype"] == {"bf16": 512 * 1024 * 2}
    assert kinds["reduce-scatter"]["bytes_by_dtype"] == {"f32": 256 * 1024 * 4}
    assert {c.group_size for c in estimate.collectives} == {4}
    # Each priced by the ring formula at the bandwidth of the rings XLA:TPU chose (all 4 ports where it names none).
    for c in estimate.collectives:
        factor = {"all-reduce": 2 * 3 / 4, "all-gather": 3 / 4, "reduce-scatter": 3 / 4}[c.kind]
        rings = min(c.colors or chip.ici_ports, chip.ici_ports)
        assert c.seconds == pytest.approx(factor * c.bytes / (rings * chip.ici_link_bytes_per_second))
    assert estimate.seconds >= estimate.compute_seconds + sum(c.exposed_seconds for c in estimate.collectives) * 0.999
