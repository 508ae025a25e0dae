"""bertjax.cloud.topologies: TPU accelerator types and topology strings -> what get_topology_desc needs, chips, hosts.

The expected values come from Google Cloud's TPU docs (v4: 2 TensorCores a chip, v4-32 = 16 chips; v5p: v5p-32
= 32 TensorCores = 16 chips, 2x2x1 = 4 chips on 1 machine, 2x2x2 = 8 chips on 2; v5e/v6e: the number counts
chips, 1x1/2x2/2x4 are single-VM slices; peak bf16 and HBM per chip from each generation's page) and from
libtpu's compile-only devices (the slow tests, which need `pip install 'jax[tpu]'`).
"""
import json
import subprocess
import sys
import textwrap

import pytest

from bertjax.cloud.topologies import GiB, parse_topology


@pytest.mark.parametrize("name, topology, chips, hosts", [
    ("v4-8", "v4:2x2x1", 4, 1),
    ("v4-16", "v4:2x2x2", 8, 2),
    ("v4-32", "v4:2x2x4", 16, 4),
    ("v4-128", "v4:4x4x4", 64, 16),
    ("v5p-8", "v5p:2x2x1", 4, 1),
    ("v5p-16", "v5p:2x2x2", 8, 2),
    ("v5p-32", "v5p:2x2x4", 16, 4),
    ("v5litepod-1", "v5e:1x1", 1, 1),
    ("v5litepod-4", "v5e:2x2", 4, 1),
    ("v5litepod-8", "v5e:2x4", 8, 1),
    ("v5litepod-16", "v5e:4x4", 16, 4),
    ("v5litepod-256", "v5e:16x16", 256, 64),
    ("v5e-16", "v5e:4x4", 16, 4),
    ("v6e-8", "v6e:2x4", 8, 1),
    ("v6e-16", "v6e:4x4", 16, 4),
    ("v6e-256", "v6e:16x16", 256, 64),
])
def test_accelerator_types_map_to_topologies(name, topology, chips, hosts):
    parsed = parse_topology(name)
    assert (parsed.topology, parsed.chips, parsed.hosts) == (topology, chips, hosts)
    assert parsed.chips_per_host == chips // hosts


@pytest.mark.parametrize("name, topology, accelerator_type", [
    ("v5e:4x4", "v5e:4x4", "v5litepod-16"),
    ("v5litepod:4x4", "v5e:4x4", "v5litepod-16"),   # libtpu rejects the v5litepod: prefix; it is rewritten
    ("v5e:4x4x1", "v5e:4x4", "v5litepod-16"),
    ("v4:2x2x4", "v4:2x2x4", "v4-32"),
    ("v4:2x2", "v4:2x2x1", "v4-8"),
    ("v5:2x2x2", "v5p:2x2x2", "v5p-16"),
    ("v6e:4x4", "v6e:4x4", "v6e-16"),
    ("  V6E-16 ", "v6e:4x4", "v6e-16"),
])
def test_topology_strings_round_trip(name, topology, accelerator_type):
    parsed = parse_topology(name)
    assert parsed.topology == topology
    assert parsed.accelerator_type == accelerator_type
    assert parse_topology(accelerator_type) == parsed


def test_non_power_of_two_slices_need_the_topology_itself():
    parsed = parse_topology("v4:4x4x12")
    assert (parsed.chips, parsed.hosts, parsed.accelerator_type) == (192, 48, "v4-384")
    with pytest.raises(ValueError, match="give the topology itself"):
        parse_topology("v4-384")


def test_chip_facts_are_the_published_ones():
    v4, v5e, v5p, v6e = (parse_topology(n) for n in ("v4-8", "v5litepod-4", "v5p-8", "v6e-4"))
    assert [t.peak_flops_per_chip for t in (v4, v5e, v5p, v6e)] == [275e12, 197e12, 459e12, 918e12]
    assert [t.hbm_bytes_per_chip // GiB for t in (v4, v5e, v6e)] == [32, 16, 32]
    for topology in (v4, v5e, v5p, v6e):
        assert 0.9 * topology.hbm_bytes_per_chip < topology.usable_hbm_bytes_per_chip < topology.hbm_bytes_per_chip
    assert parse_topology("v5litepod-16").peak_flops == 16 * 197e12


def test_topology_desc_kwargs():
    v4 = parse_topology("v4-32").topology_desc_kwargs()
    assert v4 == {"platform": "tpu", "topology_name": "v4:2x2x4", "chips_per_host_bounds": (2, 2, 1),
                  "chip_config_name": "megacore"}     # one device per chip, as JAX on a v4 VM sees it
    # A single-VM slice of 8 (or 1) chips: bounds cover the slice, or libtpu reports 2 hosts (or fails).
    assert parse_topology("v5litepod-8").topology_desc_kwargs()["chips_per_host_bounds"] == (2, 4, 1)
    assert parse_topology("v6e-1").topology_desc_kwargs()["chips_per_host_bounds"] == (1, 1, 1)
    assert parse_topology("v6e-16").topology_desc_kwargs()["chips_per_host_bounds"] == (2, 2, 1)
    assert "num_slices" not in parse_topology("v5e:4x4").topology_desc_kwargs()


def test_multislice_counts_every_slice():
    two = parse_topology("v5litepod-16", num_slices=2)
    assert (two.chips, two.hosts, two.num_slices, two.accelerator_type) == (32, 8, 2, "v5litepod-16")
    assert two.topology_desc_kwargs()["num_slices"] == 2
    assert parse_topology("v5litepod-8", num_slices=2).hosts == 2


@pytest.mark.parametrize("name, fragment", [
    ("v3-8", "unknown TPU generation 'v3'"),
    ("v7x:2x2x1", "unknown TPU generation"),
    ("tpu-v5e", "unknown TPU topology"),
    ("v5-16", "ambiguous TPU accelerator type"),
    ("v5e", "unknown TPU topology"),
    ("v5e 4x4", "unknown TPU topology"),
    ("", "unknown TPU topology"),
    ("v4-7", "must be even"),
    ("v4-24", "no default v4 shape"),
    ("v5litepod-2", "slices have"),
    ("v6e-512", "slices have"),
    ("v5e:3x3", "v5e slices are 1x1, 2x2, 2x4, 4x4, 4x8, 8x8, 8x16, 16x16"),
    ("v6e:1x2", "v6e slices are"),
    ("v5e:2x6", "v5e slices are"),
    ("v5e:32x32", "v5e slices are"),
    ("v5e:2x2x2", "2 dimensions"),
    ("v4:3x2x2", "must be even"),
    ("v4:2x2x2x2", "3 dimensions"),
    ("v4:0x2x2", "at least 1"),
])
def test_unknown_names_say_what_is_accepted(name, fragment):
    with pytest.raises(ValueError, match="accepted forms") as error:
        parse_topology(name)
    assert fragment in str(error.value)


def test_rejects_bad_num_slices_and_non_strings():
    with pytest.raises(ValueError, match="num_slices"):
        parse_topology("v5e:4x4", num_slices=0)
    with pytest.raises(ValueError, match="accepted forms"):
        parse_topology(16)


def test_importing_the_module_does_not_import_jax():
    code = "import sys, bertjax.cloud.topologies; assert 'jax' not in sys.modules, 'jax imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


_DEVICE_COUNTS = textwrap.dedent("""
    import json, sys
    from bertjax.cloud.topologies import GENERATIONS, compile_only_devices, parse_topology
    result = {}
    for name in sys.argv[1:]:
        for num_slices in (1, 2):
            topology = parse_topology(name, num_slices=num_slices)
            devices = compile_only_devices(topology)
            result[f"{name}x{num_slices}"] = {
                "parsed": [topology.chips, topology.hosts],
                "libtpu": [len(devices), len({(getattr(d, "slice_index", 0), d.process_index) for d in devices})],
                "kinds": sorted({d.device_kind for d in devices}),
                "kind": GENERATIONS[topology.generation].device_kind,
                "platform": sorted({d.platform for d in devices})}
    print(json.dumps(result))
""")


def _run_with_libtpu(code, *args):
    pytest.importorskip("libtpu", reason="needs libtpu: pip install 'jax[tpu]'")
    pytest.importorskip("jax.experimental.topologies")
    completed = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=600)
    assert completed.returncode == 0, completed.stderr[-3000:]
    return json.loads(completed.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_parsed_counts_match_libtpu_compile_only_devices():
    names = ["v4-8", "v4-32", "v4:4x4x12", "v5p-8", "v5p-16", "v5p-128", "v5litepod-1", "v5litepod-8",
             "v5litepod-16", "v5e:16x16", "v6e-1", "v6e-8", "v6e-16", "v6e:8x8"]
    result = _run_with_libtpu(_DEVICE_COUNTS, *names)
    assert len(result) == 2 * len(names)
    for key, counts in result.items():
        assert counts["parsed"] == counts["libtpu"], key
        assert counts["kinds"] == [counts["kind"]], key
        assert counts["platform"] == ["tpu"], key


_COMPILE_SEMANTICS = textwrap.dedent("""
    import json, re
    import numpy as np
    from bertjax.cloud.topologies import compile_only_devices, parse_topology
    import jax, jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    topology = parse_topology("v5litepod-4")
    devices = compile_only_devices(topology)
    out = {"default_backend": jax.default_backend()}
    n = 4096
    for count in (1, 4):
        mesh = Mesh(np.array(devices[:count]), ("data",))
        rows, whole = NamedSharding(mesh, P("data", None)), NamedSharding(mesh, P())
        x = jax.ShapeDtypeStruct((n, n), jnp.bfloat16, sharding=rows)
        w = jax.ShapeDtypeStruct((n, n), jnp.bfloat16, sharding=whole)
        compiled = jax.jit(lambda x, w: x @ w, out_shardings=rows).lower(x, w).compile()
        memory = compiled.memory_analysis()
        out[count] = {"flops": compiled.cost_analysis()["flops"], "argument": memory.argument_size_in_bytes,
                      "output": memory.output_size_in_bytes}
    mesh = Mesh(np.array(devices[:1]), ("data",))
    whole = NamedSharding(mesh, P())
    too_big = jax.ShapeDtypeStruct((topology.hbm_bytes_per_chip // 4,), jnp.float32, sharding=whole)
    try:
        jax.jit(lambda a: a + 1, out_shardings=whole).lower(too_big).compile()
        out["oom"] = None
    except Exception as error:
        out["oom"] = f"{type(error).__name__}: {error}"
    print(json.dumps(out))
""")


@pytest.mark.slow
def test_aot_compile_reports_per_device_flops_and_memory_and_fails_over_hbm():
    result = _run_with_libtpu(_COMPILE_SEMANTICS)
    assert result["default_backend"] == "cpu"     # the compile-only TPU devices do not change JAX's default
    n = 4096
    one, four = result["1"], result["4"]
    assert one["flops"] == 2 * n**3                # the whole matmul on one chip
    assert four["flops"] == 2 * n**3 / 4            # cost_analysis counts one device's share, not the program's
    assert one["argument"] == 2 * n * n * 2
    assert four["argument"] == (n * n // 4 + n * n) * 2  # memory_analysis: one device's shard of x + all of w
    assert four["output"] == n * n // 4 * 2
    # 16 GiB in + 16 GiB out on a 16 GiB chip: compile() itself refuses, naming what the chip has.
    assert "RESOURCE_EXHAUSTED" in result["oom"] and "exceeds available HBM (15.75G)" in result["oom"]
