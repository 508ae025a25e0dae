"""`bertjax compile` for GPU hosts: the cards and host names (`cloud/gpus.py`), the per-kernel price of a compiled
XLA:GPU program (`cloud/gpu_estimate.py`) on a hand-written module and on the real H200 program of the BERT-base
step (../shared/gpu beside the repo: its optimized HLO, and the measured 63 ms a step), and the deviceless compile
itself (needs the jax CUDA plugin, the `gpu` extra: skipped without it)."""
import gzip
import importlib.util
import os
import pathlib
import subprocess
import sys

import pytest

from bertjax.cloud import compile as aot
from bertjax.cloud import gpu_estimate, gpus
from bertjax.cloud.estimate import _FREE, parse_hlo
from bertjax.pretraining import metrics
from bertjax.pretraining.config import load_config

ROOT = pathlib.Path(__file__).resolve().parents[1]
SHARED_GPU = ROOT.parent / "shared" / "gpu"   # beside the repo, as conftest's SHARED_DATA
MEASURED_H200_SEQ128_SECONDS = 0.063   # ../shared/gpu/README.md: seq 128, batch 256, one H200
CUDA_PLUGIN = importlib.util.find_spec("jax_plugins.xla_cuda12") is not None \
    if importlib.util.find_spec("jax_plugins") else False
needs_cuda_plugin = pytest.mark.skipif(not CUDA_PLUGIN, reason="the deviceless XLA:GPU compile needs the jax CUDA "
                                       "plugin: pip install -e '.[gpu]'")


@pytest.mark.parametrize("name, card, cards", [("h100", "h100", 1), ("H200", "h200", 1), ("a100", "a100", 1),
                                               ("h100x8", "h100", 8), ("a100x4", "a100", 4)])
def test_gpu_host_names(name, card, cards):
    topology = aot.parse_target(name)
    assert (topology.generation, topology.chips, topology.hosts, topology.topology) == (card, cards, 1,
                                                                                          f"1x1x{cards}")
    assert topology.peak_flops_per_chip == gpus.CARDS[card].peak_flops
    assert aot.is_gpu(topology) and not aot.is_gpu(aot.parse_target("v5p-8"))


# `h100x-1` and its kin read as a GPU host meant, not as a TPU generation ("unknown TPU generation 'h100x'").
@pytest.mark.parametrize("name, says", [("h300", "unknown GPU host"), ("h100x9", "9 cards"),
                                        ("h100x0", "0 cards"), ("h100x-1", "unknown GPU host 'h100x-1'"),
                                        ("a100-80gb", "unknown GPU host 'a100-80gb'"),
                                        ("h100x", "unknown GPU host 'h100x'"),
                                        ("b200", "unknown GPU host 'b200'")])
def test_bad_gpu_host_names_say_what_is_accepted(name, says):
    with pytest.raises(ValueError, match=says) as raised:
        aot.parse_target(name)
    assert "h100x8" in str(raised.value)


@pytest.mark.parametrize("name, says", [("8xh100", r"unknown target '8xh100': 8 h100 cards on one host are written "
                                                   r"h100x8; GPU hosts: h100, h200, a100"),
                                        ("tpu-16", r"unknown target 'tpu-16': a TPU slice \(accepted forms: .*v5litepod-N.*\) "
                                                 r"or a GPU host \(GPU hosts: h100, h200, a100 .*h100x8")])
def test_a_target_of_neither_kind_names_the_tpu_and_gpu_forms(name, says):
    """`bertjax compile --topology 8xh100` listed only TPU forms; a name of neither kind gives both."""
    with pytest.raises(ValueError, match=says):
        aot.parse_target(name)


def test_target_configs_carry_each_cards_figures():
    for card in gpus.CARDS.values():
        text = card.target_config()
        assert f"memory_bandwidth: {int(card.hbm_bytes_per_second)}\n" in text
        assert f"device_memory_size: {card.hbm_bytes}\n" in text
        assert f'device_description_str: "{card.device_kind}"' in text
    # The H100's is the shared one's (../shared/gpu/h100_target_config.pbtxt) field for field.
    shared = SHARED_GPU / "h100_target_config.pbtxt"
    if shared.exists():
        assert gpus.CARDS["h100"].target_config().split() == shared.read_text().split()


# A module in the shape XLA:GPU prints (trimmed): a fusion that slices one operand, a loop of 3 trips, an in-place
# dynamic-update-slice, a cuBLAS matmul, a Triton gemm fusion with a 64-wide side, two async all-reduces (one
# hidden by the matmul, one longer than the kernels between its start and done) and a synchronous all-gather.
_HLO = """HloModule jit_step, num_partitions=4

%fused_slice (p0: f32[4,256], p1: f32[256]) -> f32[256] {
  %p0 = f32[4,256]{1,0} parameter(0)
  %p1 = f32[256]{0} parameter(1)
  %s = f32[1,256]{1,0} slice(%p0), slice={[1:2], [0:256]}
  %b = f32[256]{0} bitcast(%s)
  ROOT %a = f32[256]{0} add(%b, %p1)
}

%fused_dus (q0: f32[4,256], q1: f32[256], q2: s32[]) -> f32[4,256] {
  %q0 = f32[4,256]{1,0} parameter(0)
  %q1 = f32[256]{0} parameter(1)
  %q2 = s32[] parameter(2)
  %u = f32[1,256]{1,0} bitcast(%q1)
  %z = s32[] constant(0)
  ROOT %d = f32[4,256]{1,0} dynamic-update-slice(%q0, %u, %q2, %z)
}

%gemm_computation (g0: bf16[8,128,64], g1: bf16[8,64,128]) -> bf16[8,128,128] {
  %g0 = bf16[8,128,64]{2,1,0} parameter(0)
  %g1 = bf16[8,64,128]{2,1,0} parameter(1)
  ROOT %dot = bf16[8,128,128]{2,1,0} dot(%g0, %g1), lhs_batch_dims={0}, lhs_contracting_dims={2}, rhs_batch_dims={0}, rhs_contracting_dims={1}
}

%body (w: (s32[], f32[4,256], f32[256])) -> (s32[], f32[4,256], f32[256]) {
  %w = (s32[], f32[4,256]{1,0}, f32[256]{0}) parameter(0)
  %i = s32[] get-tuple-element(%w), index=0
  %m = f32[4,256]{1,0} get-tuple-element(%w), index=1
  %v = f32[256]{0} get-tuple-element(%w), index=2
  %loop_add_fusion.2 = f32[256]{0} fusion(%m, %v), kind=kLoop, calls=%fused_slice, metadata={op_name="jit(step)/bert/layer_1/add"}
  ROOT %t = (s32[], f32[4,256]{1,0}, f32[256]{0}) tuple(%i, %m, %loop_add_fusion.2)
}

%cond (c: (s32[], f32[4,256], f32[256])) -> pred[] {
  %c = (s32[], f32[4,256]{1,0}, f32[256]{0}) parameter(0)
  ROOT %lt = pred[] constant(true)
}

%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %sum = f32[] add(%x, %y)
}

ENTRY %main (m: f32[4,256], v: f32[256], k: s32[], x: bf16[1024,512], wt: bf16[512,2048], l: bf16[8,128,64], r: bf16[8,64,128], big: f32[262144]) -> f32[4,256] {
  %m = f32[4,256]{1,0} parameter(0)
  %v = f32[256]{0} parameter(1)
  %k = s32[] parameter(2)
  %x = bf16[1024,512]{1,0} parameter(3)
  %wt = bf16[512,2048]{1,0} parameter(4)
  %l = bf16[8,128,64]{2,1,0} parameter(5)
  %r = bf16[8,64,128]{2,1,0} parameter(6)
  %big = f32[262144]{0} parameter(7)
  %loop_add_fusion = f32[256]{0} fusion(%m, %v), kind=kLoop, calls=%fused_slice, metadata={op_name="jit(step)/bert/layer_0/add"}
  %init = (s32[], f32[4,256]{1,0}, f32[256]{0}) tuple(%k, %m, %loop_add_fusion)
  %while = (s32[], f32[4,256]{1,0}, f32[256]{0}) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"3"}}
  %loop_dus_fusion = f32[4,256]{1,0} fusion(%m, %v, %k), kind=kLoop, calls=%fused_dus, metadata={op_name="jit(step)/update"}
  %all-reduce-start = f32[1024]{0} all-reduce-start(%v), replica_groups=[1,4]<=[4], to_apply=%add
  %custom-call.1 = (bf16[1024,2048]{1,0}, s8[33554432]{0}) custom-call(%x, %wt), custom_call_target="__cublas$lt$matmul", metadata={op_name="jit(step)/mlp/dot_general"}, backend_config={"gemm_backend_config":{"dot_dimension_numbers":{"lhs_batch_dimensions":[],"lhs_contracting_dimensions":["1"],"rhs_batch_dimensions":[],"rhs_contracting_dimensions":["0"]}}}
  %all-reduce-done = f32[1024]{0} all-reduce-done(%all-reduce-start)
  %all-reduce-start.2 = f32[262144]{0} all-reduce-start(%big), replica_groups=[1,4]<=[4], to_apply=%add
  %gemm_fusion_dot = bf16[8,128,128]{2,1,0} fusion(%l, %r), kind=kCustom, calls=%gemm_computation, metadata={op_name="jit(step)/attention/dot_general"}, backend_config={"fusion_backend_config":{"kind":"__triton_nested_gemm_fusion"}}
  %all-reduce-done.2 = f32[262144]{0} all-reduce-done(%all-reduce-start.2)
  %all-gather = f32[4096]{0} all-gather(%v), replica_groups=[1,4]<=[4], dimensions={0}
  %bitcast.1 = f32[1024]{0} bitcast(%all-gather)
  ROOT %out = f32[4,256]{1,0} copy(%loop_dus_fusion)
}
"""


def test_the_price_of_each_kernel_on_a_hand_written_module():
    peak, hbm, link = 1e12, 1e12, 1e9
    priced = gpu_estimate.price_program(_HLO, peak_flops=peak, hbm_bytes_per_second=hbm, link_bytes_per_second=link)
    bandwidth, launch = hbm * gpu_estimate.HBM_EFFICIENCY, gpu_estimate.LAUNCH_SECONDS
    # The add reads one row of its [4,256] f32 operand (the slice) and the [256] one, writes [256]: 3 x 1 KiB.
    add = 3 * 1024 / bandwidth + launch
    # In place: reads the [256] update and the s32 offset, writes the update; the [4,256] buffer is not moved.
    update = (1024 + 4 + 1024) / bandwidth + launch
    copy = 2 * 4096 / bandwidth + launch
    # [1024 x 512] @ [512 x 2048]: 2 x 1024 x 2048 x 512 FLOPs, smallest side 512 -> the top class.
    matmul = 2 * 1024 * 2048 * 512 / (peak * gpu_estimate.matmul_efficiency(512)) + launch
    # 8 batched [128 x 64] @ [64 x 128]: 2 x 8 x 128 x 128 x 64 FLOPs, a 64-wide side -> the bottom class (10%).
    attention = 2 * 8 * 128 * 128 * 64 / (peak * 0.10) + launch
    assert gpu_estimate.matmul_efficiency(512) == 0.78 and gpu_estimate.matmul_efficiency(64) == 0.10
    kernels = add * 4 + update + matmul + attention + copy   # the add once, and 3 times in the loop
    # Ring all-reduce of 1 MiB over 4 GPUs: 2 x 3/4 x 1 MiB at 1 GB/s, of which the gemm fusion hides its time;
    # the 4 KiB all-reduce hides under the matmul; the all-gather (3/4 x 16 KiB) is synchronous.
    all_reduce = 2 * 3 / 4 * 262144 * 4 / link
    exposed = (all_reduce - attention) + 3 / 4 * 4096 * 4 / link
    assert priced.compute_seconds == pytest.approx(kernels, rel=1e-9)
    assert priced.exposed_communication_seconds == pytest.approx(exposed, rel=1e-9)
    assert priced.seconds == pytest.approx(kernels + exposed, rel=1e-9)
    assert priced.coverage["kernels"] == {"memory-bound": 6, "matmul": 2}
    # Every kernel has a price here: nothing is left for a high end (`compile` says so), the range is one figure.
    assert priced.unpriced == {} and priced.high_seconds == priced.seconds
    assert priced.coverage["matmul_flops"] == 2 * 1024 * 2048 * 512 + 2 * 8 * 128 * 128 * 64
    assert [(c.kind, c.group_size, c.is_async) for c in priced.collectives] == [
        ("all-reduce", 4, True), ("all-reduce", 4, True), ("all-gather", 4, False)]
    assert priced.by_op_name["bert/layer_N/add"] == pytest.approx(4 * add, rel=1e-9)
    # Where the time goes by category, and the bytes moved outside matmuls by kernel (layers and loop trips merged).
    coverage = priced.coverage
    assert coverage["matmul_seconds"] == pytest.approx(matmul + attention - 2 * launch, rel=1e-9)
    assert coverage["launch_seconds"] == pytest.approx(8 * launch, rel=1e-9)
    assert coverage["non_matmul_bytes"] == 4 * 3 * 1024 + (1024 + 4 + 1024) + 2 * 4096
    assert coverage["non_matmul_seconds"] == pytest.approx(coverage["non_matmul_bytes"] / bandwidth, rel=1e-9)
    assert coverage["top_non_matmul"] == [
        {"kernel": "loop_add_fusion", "op_name": "bert/layer_N/add", "bytes": 4 * 3 * 1024},
        {"kernel": "out", "op_name": "(no op_name)", "bytes": 2 * 4096},
        {"kernel": "loop_dus_fusion", "op_name": "update", "bytes": 1024 + 4 + 1024}]


def test_a_kernel_with_several_results_is_priced_for_each_but_its_scratch():
    """A Pallas kernel's dk, dv or lse beside its first result are written to HBM as much as the first is; a
    custom call's s8 workspace (cuBLAS, cuDNN) is scratch, not traffic."""
    hlo = """HloModule step

ENTRY %main (q: bf16[64,64]) -> bf16[64,64] {
  %q = bf16[64,64]{1,0} parameter(0)
  %kernel = (bf16[64,64]{1,0}, f32[64]{0}, s8[1024]{0}) custom-call(%q), custom_call_target="__gpu$xla.gpu.triton", metadata={op_name="jit(step)/attention/pallas_call"}
  ROOT %gte = bf16[64,64]{1,0} get-tuple-element(%kernel), index=0
}
"""
    priced = gpu_estimate.price_program(hlo, peak_flops=1e12, hbm_bytes_per_second=1e12, link_bytes_per_second=1e9)
    assert priced.coverage["top_non_matmul"] == [
        {"kernel": "kernel", "op_name": "attention/pallas_call", "bytes": 64 * 64 * 2 + 64 * 64 * 2 + 64 * 4}]


def test_our_attention_kernels_are_priced_at_the_matmuls_of_the_pairs_they_declare():
    """Triton's custom call carries no cost estimate, and a deviceless program shows no window: our attention
    kernels name the query-key pairs they compute (`_p<pairs>`), and the forward is priced at its two matmuls per
    pair (the backward at seven), 2 x head_dim FLOPs each, at FLASH_EFFICIENCY of the peak, or its bytes if longer.
    The pairs are the whole blocks the loops visit: all of them, or those that meet a window."""
    from bertjax.model import dropout_attention_gpu as dg

    pairs = 1_000_000
    hlo = f"""HloModule step

ENTRY %main (s: s32[4], q: bf16[2,128,4,64]) -> bf16[2,128,4,64] {{
  %s = s32[4]{{0}} parameter(0)
  %q = bf16[2,128,4,64]{{3,2,1,0}} parameter(1)
  %kernel = (bf16[2,128,4,64]{{3,2,1,0}}, f32[2,4,128]{{2,1,0}}) custom-call(%s, %q), custom_call_target="__gpu$xla.gpu.triton", metadata={{op_name="jit(step)/attn/flash_dropout_gpu_fwd_p{pairs}/pallas_call"}}
  ROOT %gte = bf16[2,128,4,64]{{3,2,1,0}} get-tuple-element(%kernel), index=0
}}
"""
    priced = gpu_estimate.price_program(hlo, peak_flops=1e12, hbm_bytes_per_second=1e15, link_bytes_per_second=1e9)
    assert priced.coverage["matmul_flops"] == 2 * 2 * 64 * pairs
    assert priced.coverage["matmul_seconds"] == pytest.approx(2 * 2 * 64 * pairs / (1e12 * gpu_estimate.FLASH_EFFICIENCY))
    # Counted as the loops run: 4 key blocks of 32 for each of 2 held blocks of 64 without a window; with a window
    # of 10, the held block 0..63 meets keys 0..73 (blocks 0-2), 64..127 keys 54..127 (blocks 1-3).
    assert dg.priced_pairs(1, 1, 128, 64, 32, None) == 128 * 128
    assert dg.priced_pairs(1, 1, 128, 64, 32, 10) == (3 + 3) * 64 * 32


@pytest.fixture(scope="module")
def real_h200_program() -> str:
    path = SHARED_GPU / "step_seq128_after_optimizations.hlo.gz"
    if not path.exists():
        pytest.skip(f"{path} is absent (the real H200 program of the BERT-base step; see ../shared/gpu beside the repo)")
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return f.read()


def test_the_real_h200_step_is_priced_within_20_percent_of_its_measured_63_ms(real_h200_program):
    card = gpus.CARDS["h200"]
    priced = gpu_estimate.price_program(real_h200_program, peak_flops=card.peak_flops,
                                        hbm_bytes_per_second=card.hbm_bytes_per_second,
                                        link_bytes_per_second=card.nvlink_bytes_per_second)
    assert priced.seconds == pytest.approx(MEASURED_H200_SEQ128_SECONDS, rel=0.20)
    # Every matmul of the step is found: their FLOPs are the model's analytic count (seq 128, batch 256, 20 MLM
    # positions; attention and the vocabulary projection included) within 2%.
    bert = load_config("bert-base-phase1", [], require_data=False).bert_config(30522)
    model_flops = 256 * metrics.train_flops_per_sequence(bert, 128, 20)
    assert priced.coverage["matmul_flops"] == pytest.approx(model_flops, rel=0.02)
    # 1,090 fusions, 205 cuBLAS calls and 3 copies: what the profile's ~1,470 launches a step are, less memsets.
    assert sum(priced.coverage["kernels"].values()) == 1298


def test_without_the_cuda_plugin_a_gpu_host_is_one_line_naming_the_extra(tmp_path):
    # A `jax_plugins` package without the CUDA plugin ahead of the installed one on the path: as where the extra
    # is not installed.
    (tmp_path / "jax_plugins").mkdir()
    (tmp_path / "jax_plugins" / "__init__.py").write_text("")
    env = dict(os.environ, PYTHONPATH=f"{tmp_path}{os.pathsep}{ROOT}")
    done = subprocess.run([sys.executable, "-m", "bertjax.cli", "compile", "--config", "bert-tiny", "--topology",
                           "h100"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stderr
    last = done.stderr.strip().splitlines()[-1]
    # With the line that installs the extra from the checkout bertjax runs from (bertjax is not on PyPI).
    assert last == (f"bertjax compile: error: compiling for h100 needs the jax CUDA plugin (the `gpu` extra): "
                    f"{sys.executable} -m pip install -e '{ROOT}[gpu]'"), last
    assert "Traceback" not in done.stderr


@needs_cuda_plugin
def test_for_a_gpu_the_mlm_loss_reads_the_logits_once_forward_and_once_backward(no_cache_writes):
    """The MLM cross-entropy and its gradient, compiled deviceless for an H200: its forward is one variadic
    reduction over the logits (max, first argmax, online sum of exps, the label's logit), its backward one
    elementwise pass (reduced as written, the forward read them four times). Layout: [512, vocab] bf16 logits
    plus the float32 output bias, as the MLM head makes them."""
    import jax  # noqa: PLC0415
    import jax.numpy as jnp  # noqa: PLC0415
    import numpy as np  # noqa: PLC0415

    from bertjax.pretraining import step  # noqa: PLC0415

    mesh = jax.sharding.Mesh(np.array(aot.compile_only_devices(aot.parse_target("h200"))[:1]), ("data",))
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())

    def loss(logits, bias, labels):
        nll, hit = step._token_nll(logits.astype(jnp.float32) + bias, labels)
        return jnp.sum(nll), jnp.sum(hit)

    shapes = [jax.ShapeDtypeStruct(shape, dtype, sharding=replicated) for shape, dtype in
              (((512, 30522), jnp.bfloat16), ((30522,), jnp.float32), ((512,), jnp.int32))]
    with jax.set_mesh(mesh):
        text = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)).trace(*shapes).lower() \
            .compile().as_text()
    computations, entry = parse_hlo(text)
    logits = next(i.name for i in computations[entry] if i.opcode == "parameter" and i.result_type.startswith(
        "bf16[512,30522]"))
    readers = [i for i in computations[entry] if logits in i.operands and i.opcode not in _FREE]
    assert len(readers) == 2, [(i.name, i.op_name) for i in readers]
    assert sum("transpose(" in i.op_name for i in readers) == 1


@needs_cuda_plugin
def test_for_a_gpu_the_embeddings_gradient_neither_stores_the_dropout_mask_nor_transposes(no_cache_writes):
    """BERT-base's embeddings (32 sequences of 128) and their gradients, compiled deviceless for an H200: the
    dropout mask is hashed again in the backward, not stored (no boolean or byte array of the activations' size),
    and the positions' and token types' gradients are reduced without a transpose kernel (differentiated as
    written, XLA:GPU stored the mask and transposed the sum's gradient to [H, B, L])."""
    import flax.linen as nn  # noqa: PLC0415
    import jax  # noqa: PLC0415
    import jax.numpy as jnp  # noqa: PLC0415
    import numpy as np  # noqa: PLC0415

    from bertjax.model import bert  # noqa: PLC0415

    config = load_config("bert-base-phase1", [], require_data=False).bert_config(30522)
    embeddings = bert.Embeddings(config)
    mesh = jax.sharding.Mesh(np.array(aot.compile_only_devices(aot.parse_target("h200"))[:1]), ("data",))
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    ids = jax.ShapeDtypeStruct((32, 128), jnp.int32, sharding=replicated)

    def pullback(params, input_ids, segment_ids, cotangent):
        apply = lambda p: embeddings.apply({"params": p}, input_ids, segment_ids, None, False,
                                           rngs={"dropout": jax.random.key(0)})
        return jax.vjp(apply, params)[1](cotangent)[0]

    with jax.set_mesh(mesh):
        params = jax.eval_shape(lambda: embeddings.init(jax.random.key(0), jnp.zeros((2, 128), jnp.int32),
                                                        jnp.zeros((2, 128), jnp.int32), None, True))["params"]
        params = jax.tree_util.tree_map(lambda p: jax.ShapeDtypeStruct(p.shape, p.dtype, sharding=replicated),
                                        nn.unbox(params))
        cotangent = jax.ShapeDtypeStruct((32, 128, 768), jnp.bfloat16, sharding=replicated)
        text = jax.jit(pullback).trace(params, ids, ids, cotangent).lower().compile().as_text()
    computations, entry = parse_hlo(text)
    kernels = [i for i in computations[entry] if i.opcode not in _FREE]
    assert not [i.name for i in kernels if "transpose" in i.name]
    masks = [i.name for i in kernels for t in ("pred[32,128,768]", "u8[32,128,384]") if t in i.result_type]
    assert not masks


@pytest.mark.slow  # a deviceless XLA:GPU compile of its own (~1 min here)
@needs_cuda_plugin
def test_eight_gpus_split_the_update_and_price_the_gradient_reduction_on_nvlink():
    topology = aot.parse_target("h100x8")
    config = aot.job_for_topology(load_config("bert-tiny", ["model.num_hidden_layers=1", "model.dtype=bfloat16"],
                                              require_data=False), topology)
    compiled = aot.compile_step(config, aot.compile_only_devices(topology), 30522)
    result = aot.with_cost(aot.report(config, topology, None, compiled, 30522), 2.0)
    assert result["mesh"]["data"] == 8 and result["mesh"]["shard_optimizer"] is True
    assert result["fits"] and result["xla_flops_per_step"] is None and result["step_time_source"] == "estimated"
    # Gradients reduce-scattered, params all-gathered, each over the 8 GPUs and priced at a ring's traffic.
    collectives = result["collectives"]
    assert {"reduce-scatter", "all-gather"} <= set(collectives)
    step = aot.estimate_step(topology, compiled.hlo_text)
    for collective in step.collectives:
        assert collective.group_size == 8
        assert collective.seconds == pytest.approx(7 / 8 * collective.bytes * (2 if collective.kind == "all-reduce"
                                                                                else 1) / 450e9, rel=1e-9)
    assert result["estimated_step_seconds"] == pytest.approx(step.seconds)
    assert result["cost_usd"] == pytest.approx(result["chip_hours"] * 2.0)
    assert "GPU-hours x $2 per GPU-hour" in aot.describe(result)


@pytest.mark.slow  # a 2-layer BERT-base step compiled deviceless for 8 GPUs (~2 min here)
@needs_cuda_plugin
def test_on_eight_gpus_the_gradient_reduction_overlaps_the_backward():
    """XLA:GPU's default threshold combined every layer's reduce-scatter into one after the backward (2-layer
    BERT-base on h100x8: 3 collectives, 0.06 of 0.15 ms not hidden); in chunks of `xla_options`'s size each starts
    as the backward leaves its layer and is hidden by the layers below."""
    topology = aot.parse_target("h100x8")
    config = aot.job_for_topology(load_config("bert-base-phase1", ["model.num_hidden_layers=2",
                                                                   "model.hidden_act=gelu"], require_data=False),
                                  topology)
    compiled = aot.compile_step(config, aot.compile_only_devices(topology), 30522)
    reductions = [c for c in aot.estimate_step(topology, compiled.hlo_text).collectives
                  if c.kind == "reduce-scatter"]
    assert len(reductions) >= 4 and all(c.is_async for c in reductions)
    assert sum(c.exposed_seconds for c in reductions) <= 0.01 * sum(c.seconds for c in reductions)


@pytest.mark.slow  # the BERT-base step compiled deviceless for an H200 (~1-4 min here)
@needs_cuda_plugin
def test_bert_base_compiled_for_an_h200_without_one_prices_within_20_percent_of_the_measured_step():
    topology = aot.parse_target("h200")
    # As measured: the exact GELU, attention through the reference einsum (before the fused GPU kernel).
    config = load_config("bert-base-phase1", ["model.hidden_act=gelu", "model.attention_backend=reference"],
                         require_data=False)
    result = aot.compile_for_topology(config, topology)
    assert result["fits"] and result["hbm_bytes_per_chip"] < gpus.CARDS["h200"].usable_hbm_bytes
    assert result["step_seconds"] == pytest.approx(MEASURED_H200_SEQ128_SECONDS, rel=0.20)
    assert 0.2 < result["estimated_mfu"] < 0.4


@pytest.mark.slow  # the BERT-base step compiled deviceless for an H200 (~1-4 min here)
@needs_cuda_plugin
def test_bert_base_for_an_h200_moves_fewer_bytes_outside_matmuls():
    """The priced seq-128 step as the job compiles it (flash_dropout_gpu, the exact GELU): 50.2 ms, 75.5 GB moved
    outside matmuls at 1368772; with the GELU keeping only its input and LayerNorm over rows, 47.1 ms, 66.8 GB; with
    the q/k/v biases and D inside the attention kernels, the GELU taking its bias, the MLM loss's own backward and
    residual + dropout + LayerNorm as one gradient, 41.8 ms, 51.1 GB; with the LayerNorms as Pallas kernels, 39.8 ms,
    45.4%, 46.1 GB; with the Dense biases before them added in those kernels, 38.6 ms, 46.9%, 42.5 GB
    (docs/performance-history.md); with the MLM loss's forward in one pass and the embeddings' own gradients, 38.2 ms,
    47.4%, 41.3 GB. ESTIMATES."""
    topology = aot.parse_target("h200")
    config = load_config("bert-base-phase1", ["model.hidden_act=gelu"], require_data=False)
    result = aot.compile_for_topology(config, topology)
    coverage = result["estimate_coverage"]
    assert coverage["non_matmul_bytes"] < 43e9
    assert result["estimated_step_seconds"] < 0.0388 and result["estimated_mfu"] > 0.465
    # Each layer's LayerNorms are a forward and a backward Pallas kernel, each moving four [B*L, H] bf16 arrays
    # (x, residual in, s, y out; dy, s in, ds, dx out), and no XLA fusion of their own.
    layer_norms = [e for e in coverage["top_non_matmul"]
                   if "/layer_N/" in e["op_name"] and "LayerNorm/" in e["op_name"]]
    assert layer_norms and all("/layer_norm_gpu_" in e["op_name"] for e in layer_norms)
    assert max(e["bytes"] for e in layer_norms) < 12 * 4.2 * 256 * 128 * 768 * 2
    # The GELU's forward reads the matmul's output and writes its own: not the intermediates its backward used
    # to read, nor the bias's sum.
    gelu = [e["bytes"] for e in coverage["top_non_matmul"] if e["op_name"].endswith("layer_N/intermediate/mul")
            and "transpose(" not in e["op_name"]]
    assert gelu and max(gelu) < 12 * 2.1 * 256 * 128 * 3072 * 2
    # The q/k/v biases are added inside the attention kernels, the Dense biases before the LayerNorms inside theirs:
    # no XLA pass of its own for them.
    assert not any(e["op_name"].endswith(("attention/self/add", "attention/output_dense/add", "layer_N/output/add"))
                   for e in coverage["top_non_matmul"])
