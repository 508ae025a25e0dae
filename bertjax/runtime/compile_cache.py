"""JAX's persistent compilation cache for every training job: where it lives, switched on before the step
compiles, and how many compiles it answered.

A restarted job (a preempted Spot slice, a babysitter restart) compiles the same programs again; with the cache
it reads the executables back instead. An entry is found only by the same key: the program (HLO), the jaxlib
version, the backend and its version (libtpu's on TPU), XLA flags, the compile options (the device assignment
included) and the devices' kind and topology. So a cache serves the same job on the same slice shape with the
same software; anything else is a miss, never a wrong executable.
"""
from __future__ import annotations

import os
import pathlib

# Values of train.compilation_cache_dir that turn the cache off.
DISABLED = ("off", "none", "false")
# How JAX_ENABLE_COMPILATION_CACHE says no (JAX's own parsing of boolean environment variables).
_FALSE = ("0", "false", "f", "no", "n", "off")
# JAX's default (1 s) keeps the quick compiles out of the cache; a restart pays for those too (eval step, state
# init), and on a remote (gs://) cache a read is cheaper than a compile of more than ~0.5 s.
MIN_COMPILE_SECONDS = 0.5

_HIT, _MISS = "/jax/compilation_cache/cache_hits", "/jax/compilation_cache/cache_misses"


def default_dir(environ=os.environ) -> str:
    """JAX_COMPILATION_CACHE_DIR where set (the test suite shares one this way), else a per-user directory:
    $XDG_CACHE_HOME/bertjax/jax, else ~/.cache/bertjax/jax."""
    if environ.get("JAX_COMPILATION_CACHE_DIR"):
        return environ["JAX_COMPILATION_CACHE_DIR"]
    base = environ.get("XDG_CACHE_HOME") or str(pathlib.Path(environ.get("HOME") or pathlib.Path.home()) / ".cache")
    return str(pathlib.Path(base) / "bertjax" / "jax")


def resolve(setting: str, environ=os.environ) -> str | None:
    """The cache directory a `compilation_cache_dir` setting means: "" the default (none where JAX's own switch,
    JAX_ENABLE_COMPILATION_CACHE, is false), "off" none, else itself."""
    if setting.strip().lower() in DISABLED:
        return None
    if not setting and environ.get("JAX_ENABLE_COMPILATION_CACHE", "").strip().lower() in _FALSE:
        return None
    return setting or default_dir(environ)


class CacheStats:
    """Counts the persistent cache's hits and misses in this process from JAX's monitoring events, from
    `start()` until `close()`."""

    def __init__(self):
        self.hits = self.misses = 0
        self.registered = False

    def start(self) -> CacheStats:
        import jax

        jax.monitoring.register_event_listener(self)
        self.registered = True
        return self

    def __call__(self, event: str, **kwargs) -> None:
        if event == _HIT:
            self.hits += 1
        elif event == _MISS:
            self.misses += 1

    def close(self) -> None:
        """Stops counting (a process that runs several jobs registers one counter per job)."""
        import jax

        if self.registered:
            jax.monitoring.unregister_event_listener(self)
            self.registered = False


def enable(setting: str, key: str = "train.compilation_cache_dir") -> str | None:
    """Points JAX's persistent cache at `resolve(setting)` and returns that directory (None: off). Call before the
    job's programs compile: a program compiled earlier in the process is not cached."""
    import jax

    directory = resolve(setting)
    if directory is None:
        jax.config.update("jax_enable_compilation_cache", False)
        return None
    if "://" not in directory:
        try:
            pathlib.Path(directory).mkdir(parents=True, exist_ok=True)
        except OSError as error:
            if not setting:  # the default place (a read-only home): the job runs, only without the cache
                jax.config.update("jax_enable_compilation_cache", False)
                return None
            raise ValueError(f"{key}={directory!r}: cannot create the compilation cache directory ({error}); set "
                             f"it to a writable path, or to 'off'") from None
    jax.config.update("jax_enable_compilation_cache", True)
    jax.config.update("jax_compilation_cache_dir", directory)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", MIN_COMPILE_SECONDS)
    _remove_entries_that_fail_to_read()
    return directory


def _remove_entries_that_fail_to_read() -> None:
    """Makes an entry that cannot be read (cut by a full disk, damaged) be removed when it fails: JAX warns and
    compiles, but never writes over an existing entry, so every later run would warn and compile again until the
    directory is deleted by hand. JAX calls `compilation_cache.get_executable_and_time` through its module (jax is
    pinned); wrapped once per process."""
    from jax._src import compilation_cache, lru_cache

    read = compilation_cache.get_executable_and_time
    if getattr(read, "removes_bad_entries", False):
        return

    def read_or_remove(cache_key: str, compile_options, backend, *args, **kwargs):
        try:
            return read(cache_key, compile_options, backend, *args, **kwargs)
        except Exception:
            cache = compilation_cache._get_cache(backend)
            for suffix in (lru_cache._CACHE_SUFFIX, lru_cache._ATIME_SUFFIX):
                entry = getattr(cache, "path", None) and cache.path / f"{cache_key}{suffix}"
                if entry and entry.exists():
                    entry.unlink()  # the compile that follows writes it again
            raise

    read_or_remove.removes_bad_entries = True
    compilation_cache.get_executable_and_time = read_or_remove
