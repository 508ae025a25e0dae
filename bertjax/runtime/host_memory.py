"""glibc malloc settings for XLA:CPU jobs: keep freed memory in the process instead of returning it to the OS.

XLA:CPU allocates all of a step's temporaries as one block from a worker thread (1.6 GB for a BERT-base train
step at batch 8, seq 128). glibc serves a block that large from a fresh mmap, unmaps it when the step ends, and
the next step faults the same 1.6 GB back in as zeroed 4 KiB pages: 400k page faults and ~0.6 s of kernel time
in a 3.3 s step on a 2-core machine (measured; torch's CPU step pays the same, 260k faults). Serving every
thread from the main arena with mmap off and trimming off makes the block stay mapped and reused: no faults.

Applied only where JAX can only run on the CPU (on TPU and GPU hosts the step's memory is on the device, and a
single arena could slow tf.data's many threads) and the user has not chosen malloc settings or another malloc
of their own. The price is memory: the heap never shrinks, and when a step's temporaries are allocated before
the previous step's are back it grows by another copy (measured: BERT-base at batch 8 holds 3.4 GiB, at times
4.9 GiB; a 128 MB-per-call microbenchmark settled at 1.1 GB after ~10 calls). Where that matters, any
MALLOC_*/GLIBC_TUNABLES malloc setting, or a preloaded malloc, turns this off.
"""
from __future__ import annotations

import ctypes
import os
import sys
from collections.abc import Callable, Mapping

from bertjax.runtime.platforms import jax_runs_on_cpu_only

# mallopt() parameters, from glibc's <malloc.h>.
_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4
_M_ARENA_MAX = -8


_USER_MALLOC_VARIABLES = ("MALLOC_ARENA_MAX", "MALLOC_MMAP_MAX_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_",
                          "MALLOC_TOP_PAD_")


def user_chose_malloc(environ: Mapping[str, str]) -> bool:
    """True when the environment sets glibc malloc parameters or preloads another malloc (jemalloc, tcmalloc)."""
    return (any(name in environ for name in _USER_MALLOC_VARIABLES)
            or "glibc.malloc." in environ.get("GLIBC_TUNABLES", "")
            or "malloc" in environ.get("LD_PRELOAD", ""))


def should_keep_freed_memory(environ: Mapping[str, str]) -> bool:
    """Whether the `bertjax` command applies keep_freed_memory() in a process with this environment."""
    return jax_runs_on_cpu_only(environ) and not user_chose_malloc(environ)


def keep_freed_memory_if_cpu_job(environ: Mapping[str, str]) -> bool:
    """keep_freed_memory() where should_keep_freed_memory(environ); True if applied. Call it first thing."""
    return should_keep_freed_memory(environ) and keep_freed_memory()


def keep_freed_memory() -> bool:
    """Sets glibc's malloc to one arena, no mmap and no trimming; True if applied (glibc on Linux only).

    Call it before JAX creates its worker threads (before the first JAX computation): a thread that has already
    attached to its own arena keeps it, and large blocks from such an arena are still mmapped.
    """
    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(None)
    if not hasattr(libc, "gnu_get_libc_version"):  # musl and other C libraries have no such knobs
        return False
    settings = ((_M_ARENA_MAX, 1), (_M_MMAP_MAX, 0), (_M_TRIM_THRESHOLD, -1))  # -1: never trim
    return all(libc.mallopt(parameter, value) == 1 for parameter, value in settings)


_COMPILED = "/jax/core/compile/backend_compile_duration"  # JAX's event after a compile or a persistent-cache read


def release_freed_memory_after_compiles(environ: Mapping[str, str]) -> bool:
    """After each XLA compile or persistent-cache read in this process, glibc's freed heap goes back to the OS
    (malloc_trim), where should_keep_freed_memory(environ) but the job runs several shapes (fine-tuning, predict:
    not keep_freed_memory's case). The compiler frees what it used in small blocks that glibc keeps: reading the
    MiniLM fine-tune's train step from the cache left ~0.4 GB held, under the step's own 0.37 GB of temporaries, so
    the peak was both. A fresh compile is trimmed before JAX serializes it for the persistent cache too (see
    _trim_before_cache_writes). True if the listener is registered (once per process)."""
    global _releasing
    if _releasing or not should_keep_freed_memory(environ) or not sys.platform.startswith("linux"):
        return _releasing
    libc = ctypes.CDLL(None)
    if not hasattr(libc, "malloc_trim"):
        return False
    import jax

    def release(event: str, duration: float, **kwargs) -> None:
        if event == _COMPILED:
            libc.malloc_trim(0)

    jax.monitoring.register_event_duration_secs_listener(release)
    _trim_before_cache_writes(lambda: libc.malloc_trim(0))
    _releasing = True
    return True


def _trim_before_cache_writes(trim: Callable[[], object]) -> None:
    """Calls `trim` before JAX serializes a freshly compiled executable for the persistent cache, which it does
    before it reports the compile (the event above): the serializer's memory came on top of the compiler's freed
    heap. The MiniLM fine-tune's train step: ~0.5 GB freed by the compiler, ~0.2 GB to serialize it, the peak of a
    first run (1.21 GiB; 1.08 trimmed first). JAX calls `compilation_cache.put_executable_and_time` through its
    module (jax is pinned)."""
    from jax._src import compilation_cache

    write = compilation_cache.put_executable_and_time

    def trim_then_write(*args, **kwargs):
        trim()
        return write(*args, **kwargs)

    compilation_cache.put_executable_and_time = trim_then_write


_releasing = False


def host_ram_bytes() -> int | None:
    """This machine's physical memory, or its cgroup's limit where lower (None where the OS does not say)."""
    try:
        total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None
    try:  # a container's limit (cgroup v2): "max" where there is none
        limit = open("/sys/fs/cgroup/memory.max").read().strip()
        return min(total, int(limit)) if limit.isdigit() else total
    except OSError:
        return total


def device_memory_bytes(device) -> tuple[int, str] | None:
    """(bytes one program may hold on `device`, where that memory is) or None where unknown: a CPU device's is the
    host's RAM (shared by all its CPU devices), an accelerator's what its runtime reports as its limit."""
    if device.platform == "cpu":
        ram = host_ram_bytes()
        return None if ram is None else (ram, "this host's memory")
    limit = (device.memory_stats() or {}).get("bytes_limit")
    return None if not limit else (int(limit), f"a {device.device_kind} device's memory")


def memory_warning(need_per_device: int, device, local_devices: int) -> str:
    """One line when a compiled step needs more memory than the devices have ("" when it fits or is unknown): what
    was asked, what the host has, and what to lower."""
    capacity = device_memory_bytes(device)
    if capacity is None:
        return ""
    have, where = capacity
    # CPU devices share the host's RAM: all of this process's devices need it at once.
    need = need_per_device * (local_devices if device.platform == "cpu" else 1)
    if need <= have:
        return ""
    gib = 2**30
    asked = (f"{need_per_device / gib:.2f} GiB per device x {local_devices} devices = {need / gib:.2f} GiB"
             if need != need_per_device else f"{need / gib:.2f} GiB per device")
    return (f"warning: the step needs {asked}, more than the {have / gib:.2f} GiB of {where}: lower "
            f"train.batch_size (or raise train.grad_accum_steps) or data.max_seq_length")


# What JAX, XLA and TensorFlow map to start on this kind of machine (their libraries, thread stacks and malloc
# arenas): measured, a tiny `embed` aborted natively (a failed pthread_create, "Check failure") under ulimit -v
# 3 GB, ran under 4 GB; under 2 GB it spun without end. More cores map more (an arena and a stack per thread).
ADDRESS_SPACE_FLOOR = 4 << 30


def check_address_space(floor: int = ADDRESS_SPACE_FLOOR) -> None:
    """Refuses to start under an address-space limit (ulimit -v) below `floor`, naming it: past the libraries'
    start the failures under it are native (an abort, a segfault, a spin) and no line of ours could follow."""
    import resource

    soft = resource.getrlimit(resource.RLIMIT_AS)[0]
    if soft != resource.RLIM_INFINITY and soft < floor:
        raise ValueError(f"the address-space limit (ulimit -v) is {soft / 2**30:.1f} GiB: JAX, XLA and TensorFlow "
                         f"map more than that to start (libraries, thread stacks, allocator arenas) and would abort "
                         f"without a word; raise it to at least {floor / 2**30:.0f} GiB (ulimit -v unlimited)")
