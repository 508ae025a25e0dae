"""bertjax.host_memory: the malloc settings stop XLA:CPU's per-execution temporaries from faulting in each call."""
import subprocess
import sys
import textwrap

import pytest

from bertjax import host_memory

# One execution of a jitted function with 64 MB temporaries; prints the page faults per call once warm.
_FAULTS_PER_CALL = textwrap.dedent("""
    import resource, sys
    from bertjax import host_memory
    if sys.argv[1] == "keep":
        assert host_memory.keep_freed_memory()
    import jax, jax.numpy as jnp
    x = jnp.ones((16_000_000,), jnp.float32)
    f = jax.jit(lambda x: jnp.sort(jnp.exp(x)).sum())
    for _ in range(2):
        f(x).block_until_ready()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(3):
        f(x).block_until_ready()
    print((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 3)
""")


def _faults_per_call(mode):
    result = subprocess.run([sys.executable, "-c", _FAULTS_PER_CALL, mode], capture_output=True, text=True,
                            env={"JAX_PLATFORMS": "cpu", "PATH": ""}, check=True)
    return float(result.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc settings (Linux only)")
def test_kept_memory_removes_the_page_faults_of_each_execution():
    default = _faults_per_call("default")
    kept = _faults_per_call("keep")
    # 64 MB of temporaries are 16k 4-KiB pages; glibc's default maps them afresh on every call.
    assert default > 15_000, default
    assert kept < default / 100, (kept, default)


@pytest.mark.parametrize("environ, expected", [
    ({"JAX_PLATFORMS": "cpu"}, True),
    ({"JAX_PLATFORMS": " cpu "}, True),
    ({"JAX_PLATFORMS": "tpu"}, False),
    ({"JAX_PLATFORMS": "cuda,cpu"}, False),
])
def test_cpu_only_follows_jax_platforms(environ, expected):
    assert host_memory.jax_runs_on_cpu_only(environ) is expected


def test_cpu_only_without_jax_platforms_depends_on_installed_accelerator_plugins(monkeypatch):
    import importlib.util

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: object() if name == "libtpu" else real_find_spec(name, *a))
    assert host_memory.jax_runs_on_cpu_only({}) is False
