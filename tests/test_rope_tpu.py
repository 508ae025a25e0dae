"""ModernBERT's RoPE kernel for TPU (`bertjax.model.kernels.tpu.rope_tpu`): values and gradients against
`rope.apply_rotary` (transformers' rotation, which the ModernBERT parity tests hold) in interpret mode on CPU, per-token
positions (packed rows) and shared ones, heads of 32, 64 and 128; and its compile through Mosaic for a TPU
(compile-only)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from bertjax.model import rope
from bertjax.model.kernels.tpu import rope_tpu


def _inputs(batch, length, heads, head_dim, packed, dtype=jnp.float32, seed=0):
    rng = np.random.default_rng(seed)
    q, k = (jnp.asarray(rng.normal(size=(batch, length, heads * head_dim)), dtype) for _ in range(2))
    positions = rng.integers(0, 4 * length, size=(batch if packed else 1, length))
    return q, k, rope.cos_sin(jnp.asarray(positions), head_dim, 10_000.0)


def _loss(rotate):
    # Unequal weights per lane: a gradient that swapped or mis-signed the partner lanes would show.
    return lambda q, k: sum(jnp.sum(jnp.sin(out.astype(jnp.float32)) * (1.0 + 0.01 * jnp.arange(out.shape[-1])))
                            for out in rotate(q, k))


@pytest.mark.parametrize("heads, head_dim, packed", [(12, 64, True), (4, 64, False), (4, 32, True), (2, 128, False)])
def test_the_kernel_rotates_as_transformers_values_and_gradients(heads, head_dim, packed):
    q, k, (cos, sin) = _inputs(2, 32, heads, head_dim, packed)
    tables = rope_tpu.lane_tables(cos, sin, head_dim)
    kernel = lambda q, k: rope_tpu.rotate_qk(q, k, *tables, head_dim)  # noqa: E731
    reference = lambda q, k: tuple(rope.apply_rotary(x, cos, sin, head_dim) for x in (q, k))  # noqa: E731
    with pltpu.force_tpu_interpret_mode():
        out = kernel(q, k)
        grads = jax.grad(_loss(kernel), argnums=(0, 1))(q, k)
    expected, expected_grads = reference(q, k), jax.grad(_loss(reference), argnums=(0, 1))(q, k)
    for got, want in zip((*out, *grads), (*expected, *expected_grads), strict=True):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-6)


def test_bfloat16_is_the_float32_rotation_rounded_once():
    q, k, (cos, sin) = _inputs(2, 16, 12, 64, packed=True, dtype=jnp.bfloat16)
    with pltpu.force_tpu_interpret_mode():
        out = rope_tpu.rotate_qk(q, k, *rope_tpu.lane_tables(cos, sin, 64), 64)
    for got, x in zip(out, (q, k), strict=True):
        assert got.dtype == jnp.bfloat16
        want = rope.apply_rotary(x.astype(jnp.float32), cos, sin, 64).astype(jnp.bfloat16)
        np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=2 ** -8)


def test_what_the_kernel_takes():
    assert rope_tpu.supported(768, 64, 128) and rope_tpu.supported(768, 64, 1024) and rope_tpu.supported(256, 128, 8)
    assert not rope_tpu.supported(96, 32, 128)    # 96 lanes: not whole 128-lane blocks
    assert not rope_tpu.supported(768, 48, 128)   # heads of 48 straddle a block's edge
    assert not rope_tpu.supported(768, 64, 100)   # no block of rows divides 100


@pytest.mark.usefixtures("no_cache_writes")
def test_forward_and_backward_compile_through_mosaic_for_tpu():
    """modernbert-base's q and k (12 heads of 64, bf16, packed positions), compiled by XLA:TPU and Mosaic for a
    compile-only v5e (libtpu; no TPU needed): both directions one Mosaic kernel each, their costs declared."""
    pytest.importorskip("libtpu", reason="compiling for TPU needs libtpu")
    from bertjax.cloud import topologies

    device = topologies.compile_only_devices(topologies.parse_topology("v5e:2x2"))[0]
    on_device = jax.sharding.SingleDeviceSharding(device)
    qk = jax.ShapeDtypeStruct((8, 128, 768), jnp.bfloat16, sharding=on_device)
    table = jax.ShapeDtypeStruct((8, 128, 128), jnp.float32, sharding=on_device)

    def step(q, k, cos, sin):
        return jax.value_and_grad(_loss(lambda q, k: rope_tpu.rotate_qk(q, k, cos, sin, 64)), argnums=(0, 1))(q, k)
    compiled = jax.jit(step).lower(qk, qk, table, table).compile()
    hlo = compiled.as_text()
    assert hlo.count('custom_call_target="tpu_custom_call"') == 2 and "rope_qk" in hlo
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    assert cost["bytes accessed"] >= 2 * 2 * 2 * 8 * 128 * 768 * 2   # q and k read and written, both directions


# Slow-marked for the default suite's time (~45 s): the kernel's own tests above hold its values on CPU.
@pytest.mark.slow
@pytest.mark.usefixtures("no_cache_writes")
def test_modernbert_tinys_train_step_rotates_in_the_kernel_on_each_chip(tmp_path):
    """The job's whole train step for 4 v5e chips (data parallel: the kernel runs on each chip's shard, as XLA
    cannot partition a Mosaic call), its q and k rotated by the kernel in every layer, both directions."""
    pytest.importorskip("libtpu", reason="compiling for TPU needs libtpu")
    from bertjax.cloud import compile as tpu_compile
    from bertjax.cloud import topologies
    from bertjax.pretraining.config import load_config

    config = load_config("modernbert-tiny", [], require_data=False)
    result = tpu_compile.compile_for_topology(config, topologies.parse_topology("v5e:2x2"),
                                              dump_hlo=str(tmp_path / "step.hlo"))
    assert result["fits"]
    hlo = (tmp_path / "step.hlo").read_text()
    calls = [line for line in hlo.splitlines() if 'custom_call_target="tpu_custom_call"' in line and "rope_qk" in line]
    assert len(calls) == 2 * 4   # modernbert-tiny's 4 layers, forward and backward
