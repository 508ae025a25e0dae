"""The check of bertjax's Pallas GPU kernels on the card before a job's first step
(`model/kernels/gpu/gpu_kernel_check.py`): its verdict cached per card, jax version and kernel source, the check run
only without one, and a family that disagreed with XLA left out of the model (`model/kernels/gpu/gpu_kernels.py`);
`bertjax compile`'s line for a GPU program with kernels never checked on that card. The verdicts here are faked (the
check's own cases, interpreted, are tests/test_gpu_kernels.py's); the model's choice is traced with the GPU as the
target platform."""
import json
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bertjax.cloud import compile as aot
from bertjax.cloud import gpus
from bertjax.model import attention, layer_norm, norm_dropout
from bertjax.model.kernels.gpu import gpu_kernel_check, gpu_kernels, layer_norm_gpu

H100 = types.SimpleNamespace(device_kind="NVIDIA H100 80GB HBM3")
H200 = types.SimpleNamespace(device_kind="NVIDIA H200")
FAILED_LINE = "attention bfloat16 [2,128,2,64] padding, dropout 0.1, biases: max rel error 3.1e-01 (dq), " \
    "tolerance 5e-02: FAIL [1.2 s]"


@pytest.fixture(autouse=True)
def all_kernels_after():
    yield
    gpu_kernels.run_xla_for(set())


class FakeCheck:
    """A check's verdict without a GPU: every family ok but `failing`; counts its runs."""

    def __init__(self, failing=()):
        self.failing, self.runs = set(failing), 0

    def __call__(self):
        self.runs += 1
        return {"families": {f: "FAIL" if f in self.failing else "ok" for f in gpu_kernels.FAMILIES},
                "lines": [FAILED_LINE if "attention" in self.failing else "attention ...: ok [1.0 s]",
                          "layer_norm ...: FAIL [0.5 s]" if "layer_norm" in self.failing else "layer_norm ...: ok"]}


def test_the_check_runs_once_per_card_jax_version_and_kernel_source(tmp_path, monkeypatch):
    check, lines = FakeCheck(), []
    assert gpu_kernel_check.prepare("gpu", lines.append, device=H100, check=check, cache_dir=str(tmp_path)) == set()
    assert check.runs == 1
    assert lines[0].startswith("checking bertjax's Pallas GPU kernels against XLA on this NVIDIA H100 80GB HBM3 "
                               f"(the first job with jax {jax.__version__} and these kernels on this card")
    assert lines[1].startswith("GPU kernel check: all ok in ") and str(tmp_path) in lines[1]
    cached = json.loads((tmp_path / "bertjax" / "gpu_kernels.json").read_text())
    key = f"NVIDIA H100 80GB HBM3 | jax {jax.__version__} | kernels {gpu_kernel_check.fingerprint()}"
    assert cached[key]["families"] == {"attention": "ok", "layer_norm": "ok"} and cached[key]["checked"]
    # The next job on this card takes the verdict: no check, not a line.
    lines.clear()
    assert gpu_kernel_check.prepare("gpu", lines.append, device=H100, check=check, cache_dir=str(tmp_path)) == set()
    assert check.runs == 1 and lines == []
    assert gpu_kernel_check.passed(H100.device_kind, cache_dir=str(tmp_path))
    # Another card, another jax, edited kernels: checked again.
    gpu_kernel_check.prepare("gpu", lines.append, device=H200, check=check, cache_dir=str(tmp_path))
    assert check.runs == 2
    monkeypatch.setattr(jax, "__version__", "0.99.0")
    gpu_kernel_check.prepare("gpu", lines.append, device=H100, check=check, cache_dir=str(tmp_path))
    assert check.runs == 3
    monkeypatch.undo()
    monkeypatch.setattr(gpu_kernel_check, "fingerprint", lambda: "0123456789ab")
    gpu_kernel_check.prepare("gpu", lines.append, device=H100, check=check, cache_dir=str(tmp_path))
    assert check.runs == 4
    assert len(json.loads((tmp_path / "bertjax" / "gpu_kernels.json").read_text())) == 4


def test_off_a_gpu_nothing_is_checked_or_changed(tmp_path):
    check, lines = FakeCheck(failing=["attention"]), []
    for platform in ("cpu", "tpu"):
        assert gpu_kernel_check.prepare(platform, lines.append, device=H100, check=check,
                                        cache_dir=str(tmp_path)) == set()
    assert check.runs == 0 and lines == [] and not (tmp_path / "bertjax").exists()
    assert gpu_kernels.runs_kernel("attention") and gpu_kernels.runs_kernel("layer_norm")


def test_a_kernel_that_disagrees_runs_xlas_path_said_in_one_line_and_cached(tmp_path):
    check, lines = FakeCheck(failing=["attention"]), []
    assert gpu_kernel_check.prepare("gpu", lines.append, device=H100, check=check,
                                    cache_dir=str(tmp_path)) == {"attention"}
    assert lines[1].startswith("GPU kernel check: FAILED: attention in ")
    warning = lines[2]
    assert warning.startswith("warning: flash_dropout_gpu (attention with dropout) disagreed with XLA on this "
                              f"NVIDIA H100 80GB HBM3 ({FAILED_LINE}): this job runs XLA's path instead")
    assert "bash bench/gpu_check.sh" in warning and "layer_norm_gpu" not in warning
    # Attention with dropout runs XLA's reference on the GPU, asked for by name or not; the LayerNorms keep theirs.
    assert attention.resolve_backend("auto", True, "gpu", length=128) == "reference"
    assert attention.resolve_backend("flash_dropout_gpu", True, "gpu", length=128) == "reference"
    assert attention.resolve_backend("auto", False, "gpu", length=128) == "dot_product"
    assert attention.resolve_backend("auto", True, "tpu", length=128) == "flash_dropout_tpu"
    assert gpu_kernels.runs_kernel("layer_norm") and not gpu_kernels.runs_kernel("attention")
    # A later job on the card (a new process: the switch as it starts) takes the cached verdict and says it again.
    gpu_kernels.run_xla_for(set())
    lines.clear()
    assert gpu_kernel_check.prepare("gpu", lines.append, device=H100, check=check,
                                    cache_dir=str(tmp_path)) == {"attention"}
    assert check.runs == 1 and len(lines) == 1 and lines[0] == warning
    assert not gpu_kernel_check.passed(H100.device_kind, cache_dir=str(tmp_path))
    assert attention.resolve_backend("auto", True, "gpu", length=128) == "reference"


def test_an_unreadable_cache_is_checked_again_and_a_read_only_one_costs_only_the_caching(tmp_path):
    (tmp_path / "bertjax").mkdir()
    (tmp_path / "bertjax" / "gpu_kernels.json").write_text("{not json")
    check, lines = FakeCheck(), []
    gpu_kernel_check.prepare("gpu", lines.append, device=H100, check=check, cache_dir=str(tmp_path))
    assert check.runs == 1 and gpu_kernel_check.passed(H100.device_kind, cache_dir=str(tmp_path))
    blocked = tmp_path / "file"
    blocked.write_text("")   # a file where the cache's folder should be
    gpu_kernel_check.prepare("gpu", lines.append, device=H100, check=check, cache_dir=str(blocked))
    assert check.runs == 2 and "not cached: " in lines[-1]


def _xla_layer_norms(x, residual, scale, bias, rng):
    return (layer_norm.layer_norm(x, scale, bias, 1e-12, jnp.float32),
            layer_norm.residual_layer_norm(x, residual, scale, bias, 1e-12, jnp.float32, 0.1, rng),
            norm_dropout.norm_then_dropout(x, scale, bias, 1e-12, jnp.float32, 0.1, rng))


def test_the_layer_norms_on_a_gpu_follow_the_switch(monkeypatch):
    """Traced for a GPU, the three LayerNorms call the Pallas kernels; with the family switched to XLA they compute
    what the CPU computes (the XLA custom_vjps) and call no kernel."""
    x = jax.random.normal(jax.random.PRNGKey(0), (2, 8, 64))
    residual, scale, bias = jnp.ones_like(x), jnp.full((64,), 1.5), jnp.full((64,), 0.25)
    rng = jax.random.PRNGKey(3)
    on_cpu = _xla_layer_norms(x, residual, scale, bias, rng)
    for module in (layer_norm, norm_dropout):
        monkeypatch.setattr(module, "target_platform", lambda: "gpu")
    called = []

    def kernel(*args, **kwargs):
        called.append(args[0].shape)
        return None   # as where a mesh cannot split the rows: the caller keeps XLA's

    monkeypatch.setattr(layer_norm_gpu, "per_device_layer_norm", kernel)
    _xla_layer_norms(x, residual, scale, bias, rng)
    assert len(called) == 3   # each LayerNorm asked the kernels first
    called.clear()
    gpu_kernels.run_xla_for({"layer_norm"})
    on_gpu_by_xla = _xla_layer_norms(x, residual, scale, bias, rng)
    assert called == []
    for got, want in zip(on_gpu_by_xla, on_cpu):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    with pytest.raises(ValueError, match="unknown GPU kernel families"):
        gpu_kernels.run_xla_for({"gelu"})


# The lines of a compiled GPU program that name our kernels (trimmed from a deviceless H200 compile of bert-tiny).
_TRITON_CALLS = """
  %custom-call.1 = (f32[4096,128]{1,0}) custom-call(%p0), custom_call_target="__gpu$xla.gpu.triton", metadata={op_name="jit(train_step)/jvp(BertForPreTraining)/bert/embeddings/LayerNorm/layer_norm_gpu_fwd/pallas_call"}
  %custom-call.2 = (f32[32,128,2,64]{3,2,1,0}) custom-call(%p1), custom_call_target="__gpu$xla.gpu.triton", metadata={op_name="jit(train_step)/jvp(BertForPreTraining)/bert/layer_0/attention/self/flash_dropout_gpu_fwd/pallas_call"}
"""


def test_compile_says_when_the_priced_program_holds_kernels_never_checked_on_the_card(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert gpu_kernel_check.kernels_in_program(_TRITON_CALLS) == ["attention", "layer_norm"]
    assert gpu_kernel_check.kernels_in_program(_TRITON_CALLS.splitlines()[1]) == ["layer_norm"]
    assert gpu_kernel_check.kernels_in_program("%f = f32[2] fusion(%p), metadata={op_name=\"layer_norm_gpu\"}") == []
    topology = aot.parse_target("h100x8")
    report = aot.gpu_kernels_report(topology, _TRITON_CALLS)
    assert report["card"] == gpus.CARDS["h100"].device_kind and report["checked"] is False
    note = report["note"]
    assert note.startswith("GPU kernels: the priced program runs bertjax's Pallas kernels flash_dropout_gpu "
                           "(attention with dropout), layer_norm_gpu (the LayerNorms), which have not passed their "
                           f"check on an NVIDIA H100 80GB HBM3 with jax {jax.__version__}")
    assert "`bash bench/gpu_check.sh`" in note and "runs XLA's path for one that disagrees" in note
    result = {"accelerator_type": "h100x8", "chip": "GPU", "chips": 8, "mesh": {}, "global_batch": 256,
              "per_chip_batch": 32, "grad_accum_steps": 1, "seq_len": 128, "hbm_bytes_per_chip": 2**30,
              "hbm_capacity_bytes_per_chip": 2**34, "fits": True, "model_flops_per_step": 1e12,
              "xla_flops_per_step": None, "estimated_step_seconds": None, "step_seconds": None, "gpu_kernels": report}
    assert aot.describe(result).splitlines()[-1] == note
    # Checked on this card (this machine's verdict, or recorded in the project): no line.
    gpu_kernel_check.prepare("gpu", lambda line: None, device=H100, check=FakeCheck())
    assert aot.gpu_kernels_report(topology, _TRITON_CALLS)["note"] == ""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "elsewhere"))
    assert aot.gpu_kernels_report(topology, _TRITON_CALLS)["note"]
    monkeypatch.setattr(gpu_kernel_check, "PASSED_ON", ((H100.device_kind, jax.__version__,
                                                         gpu_kernel_check.fingerprint()),))
    assert aot.gpu_kernels_report(topology, _TRITON_CALLS) == {"card": H100.device_kind, "in_program": [
        "attention", "layer_norm"], "checked": True, "note": ""}
    # Without our kernels in the program, or off GPU: nothing to say.
    assert aot.gpu_kernels_report(aot.parse_target("h200"), "ENTRY %main {}")["note"] == ""
    assert aot.gpu_kernels_report(aot.parse_target("v5litepod-16"), _TRITON_CALLS) is None


def test_the_pretraining_job_checks_before_it_builds_its_step_on_a_gpu_only(monkeypatch):
    from bertjax.pretraining import loop

    called = []
    monkeypatch.setattr(gpu_kernel_check, "prepare", lambda platform, log: called.append(platform))
    for platform in ("cpu", "tpu", "gpu"):
        device = types.SimpleNamespace(platform=platform)
        loop._check_gpu_kernels(types.SimpleNamespace(devices=types.SimpleNamespace(flat=[device])), print)
    assert called == ["gpu"]
