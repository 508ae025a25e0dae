"""One pretraining step at BERT-base shape: bertjax vs transformers.BertForPreTraining + torch AdamW, same run.

    .venv/bin/python bench/train_step.py [--batch 8] [--seq 128] [--repeats 3] [--lengths 128,256,512]
        [--torch-peers eager,compile]

Prints each side's median step (wall seconds, and the CPU seconds of all its threads), sequences/s and their ratio,
model TFLOP/s and the fraction of a matmul peak measured in the same run (the CPU's reference for MFU: the faster of XLA's and torch's fp32 matmul), then bertjax's sequences/s at
each of --lengths. `--torch-peers eager,compile` also times the reference under torch.compile (the fairest PyTorch
peer on a GPU; its warm-up is untimed). The sides take turns of a few steps so that machine noise hits both alike; the reference runs in
a child process, never at the same time. On a CPU both sides run with the malloc settings of bertjax.runtime.host_memory,
which the `bertjax` command applies there. On an accelerator pass --dtype bfloat16 and the MFU is against the
device's table peak. The load average is printed before and after the timed turns: on a busy machine the sides slow
unequally, so a ratio is an idle machine's figure or goes with the load and both sides' CPU seconds.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np


def _batch(rng, batch, seq, masked, vocab):
    input_ids = rng.integers(1000, vocab, (batch, seq)).astype(np.int32)
    positions = np.stack([rng.choice(np.arange(1, seq), masked, replace=False) for _ in range(batch)]).astype(np.int32)
    return dict(input_ids=input_ids, input_mask=np.ones_like(input_ids), segment_ids=np.zeros_like(input_ids),
                masked_lm_positions=positions, masked_lm_ids=np.take_along_axis(input_ids, positions, 1),
                masked_lm_weights=np.ones((batch, masked), np.float32),
                next_sentence_labels=rng.integers(0, 2, (batch, 1)).astype(np.int32))


def _ours(config, batch, seq, masked):
    import jax

    from bertjax import sharding
    from bertjax.model.bert import model as model_lib
    from bertjax.pretraining import optim
    from bertjax.pretraining import state as train_state
    from bertjax.pretraining import step as train_step

    mesh = sharding.make_mesh(data=1, devices=jax.devices()[:1])
    model = model_lib.BertForPreTraining(config)
    optimizer, schedule = optim.make_optimizer(optim.OptimizerConfig(learning_rate=1e-4, warmup_steps=10), 1000)
    state, shardings, _ = train_state.make_sharded_state(jax.random.key(0), model=model, config=config,
                                                   optimizer=optimizer, mesh=mesh, seq_len=seq, num_masked=masked)
    step, _ = train_step.compile_steps(model=model, optimizer=optimizer, schedule=schedule, grad_accum_steps=1,
                                       nsp_loss=True, state_shardings_tree=shardings, mesh=mesh)
    data = sharding.global_batch(_batch(np.random.default_rng(0), batch, seq, masked, config.vocab_size), mesh)
    holder = {"state": state}

    def run():
        """(wall, CPU) seconds of one step: the CPU of every thread of this process."""
        start, cpu = time.perf_counter(), time.process_time()
        with sharding.activate(mesh):
            holder["state"], metrics = step(holder["state"], data)
        jax.block_until_ready(metrics)
        return time.perf_counter() - start, time.process_time() - cpu

    print(f"  bertjax step compiled and ran once in {run()[0]:.1f} s (scan_layers={config.scan_layers})")
    return run


def _torch(config, batch, seq, masked, threads, compiled=False):
    """The reference step; on a GPU machine it runs there, in bf16 autocast when config.dtype is bfloat16; with
    `compiled`, the model's forward and backward through torch.compile (the optimizer step stays eager, fused)."""
    import contextlib

    import torch
    import transformers

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    hf_config = transformers.BertConfig(**config.to_bert_config_dict())
    model = transformers.BertForPreTraining(hf_config).train().to(device)
    forward = torch.compile(model) if compiled else model
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, eps=1e-6, weight_decay=0.01,
                            fused=device == "cuda")
    autocast = (torch.autocast(device, dtype=torch.bfloat16) if config.dtype == "bfloat16"
                else contextlib.nullcontext())
    b = _batch(np.random.default_rng(0), batch, seq, masked, config.vocab_size)
    labels = np.full((batch, seq), -100, np.int64)
    np.put_along_axis(labels, b["masked_lm_positions"], b["masked_lm_ids"], 1)
    inputs = dict(input_ids=torch.from_numpy(b["input_ids"]).long(),
                  attention_mask=torch.from_numpy(b["input_mask"]).long(),
                  token_type_ids=torch.from_numpy(b["segment_ids"]).long(), labels=torch.from_numpy(labels),
                  next_sentence_label=torch.from_numpy(b["next_sentence_labels"][:, 0]).long())
    inputs = {name: tensor.to(device) for name, tensor in inputs.items()}

    def run():
        start = time.perf_counter()
        with autocast:
            loss = forward(**inputs).loss
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if device == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - start

    start = time.perf_counter()
    for _ in range(3 if compiled else 1):  # torch.compile specialises on the first calls, then recompiles once
        run()
    print(f"  transformers step ({'torch.compile' if compiled else 'eager'}) warmed up in "
          f"{time.perf_counter() - start:.1f} s")
    return run


def _same_host_malloc_as_bertjax() -> bool:
    """The malloc settings the `bertjax` command applies on CPU (bertjax.runtime.host_memory); both sides get them, for a
    fair ratio (torch's CPU step gains as much from them as ours)."""
    from bertjax.runtime import host_memory

    return host_memory.keep_freed_memory_if_cpu_job(os.environ)


def _torch_matmul_peak(size: int = 1024, repeats: int = 5) -> float | None:
    """FLOP/s of torch's fp32 square matmul on the CPU (its MKL sgemm beats XLA's matmuls on some CPUs), the same
    shape and best-of as bertjax.pretraining.metrics.measure_matmul_peak; None on a GPU."""
    import torch

    if torch.cuda.is_available():
        return None
    a = torch.ones(size, size)
    a @ a
    best = min(_seconds(lambda: a @ a) for _ in range(repeats))
    return 2 * size ** 3 / best


def _seconds(call) -> float:
    start = time.perf_counter()
    call()
    return time.perf_counter() - start


def _load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def _serve_torch(config, batch, seq, masked, threads, compiled, conn):
    """Child process: builds the reference step, then times one step per request on `conn`."""
    _same_host_malloc_as_bertjax()
    run = _torch(config, batch, seq, masked, threads, compiled)
    conn.send(("ready", _torch_matmul_peak()))
    while conn.recv():
        cpu = time.process_time()
        conn.send((run(), time.process_time() - cpu))   # (wall, CPU) seconds, as bertjax's side


def _torch_in_subprocess(config, batch, seq, masked, threads, compiled=False):
    """The reference step in its own process: in one process the two frameworks slow each other down (measured:
    bertjax 3.9 s/step alone, 4.9 s when its steps alternate with torch's in the same process)."""
    import multiprocessing

    context = multiprocessing.get_context("spawn")
    parent, child = context.Pipe()
    process = context.Process(target=_serve_torch, args=(config, batch, seq, masked, threads, compiled, child),
                                  daemon=True)
    process.start()
    ready, matmul_peak = parent.recv()
    assert ready == "ready"

    def run():
        parent.send(True)
        return parent.recv()

    def close():
        parent.send(False)
        process.join()
    run.close = close
    run.matmul_peak = matmul_peak
    return run


def _trace(run, trace_dir, host):
    import glob

    import jax
    from profile_top import top_ops

    with jax.profiler.trace(trace_dir):
        for _ in range(3):
            run()
    newest = max(glob.glob(f"{trace_dir}/**/*.xplane.pb", recursive=True), key=os.path.getmtime)
    print(f"  profile of 3 steps: {newest}")
    print("\n".join(top_ops(newest, top=15, host=host)))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--masked", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=3, help="turns per side")
    parser.add_argument("--steps-per-turn", type=int, default=3)
    parser.add_argument("--preset", default="base")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--lengths", default="128,256,512", help="bertjax-only sequence lengths to time ('' = none)")
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--skip-torch", action="store_true")
    parser.add_argument("--torch-peers", default="eager",
                        help="the transformers references to time: eager, compile (torch.compile), or both")
    parser.add_argument("--attention-backend", default="auto",
                        help="bertjax attention backend; the fused ones need --attention-dropout 0")
    parser.add_argument("--attention-dropout", type=float, default=0.1)
    parser.add_argument("--trace", metavar="DIR", help="also profile 3 bertjax steps into DIR and print the top ops")
    parser.add_argument("--scan-layers", action="store_true", help="bertjax's model.scan_layers (one layer compiled)")
    args = parser.parse_args()
    malloc_tuned = _same_host_malloc_as_bertjax()  # before JAX starts its threads

    import jax

    from bertjax.model.bert.config import BertConfig
    from bertjax.pretraining import metrics

    config = BertConfig.preset(args.preset, dtype=args.dtype, hidden_dropout_prob=0.1,
                               attention_probs_dropout_prob=args.attention_dropout,
                               attention_backend=args.attention_backend, scan_layers=args.scan_layers)
    device = jax.devices()[0]
    peers = [] if args.skip_torch else [p for p in args.torch_peers.split(",") if p]
    if set(peers) - {"eager", "compile"}:
        parser.error(f"--torch-peers: eager and/or compile, got {args.torch_peers!r}")
    references = {peer: _torch_in_subprocess(config, args.batch, args.seq, args.masked, args.threads,
                                             compiled=peer == "compile") for peer in peers}
    reference = next(iter(references.values()), None)
    if device.platform == "cpu":
        # The machine's peak is the faster of the two frameworks' matmuls, each measured here, now.
        peaks = {"XLA": metrics.measure_matmul_peak()}
        if reference and reference.matmul_peak:
            peaks["torch"] = reference.matmul_peak
        peak = max(peaks.values())
        peak_source = "best fp32 1024^3 matmul measured: " + ", ".join(
            f"{name} {value / 1e9:.1f}" for name, value in peaks.items())
    else:
        peak, peak_source = metrics.device_peak_flops(device, args.dtype)
    flops = metrics.train_flops_per_sequence(config, args.seq, args.masked)
    print(f"BERT-{args.preset} train step (MLM+NSP, AdamW, dropout 0.1/{args.attention_dropout}, attention "
          f"{args.attention_backend}), batch {args.batch}, seq {args.seq}, "
          f"{args.dtype}, {device.device_kind}; {flops / 1e9:.1f} GFLOP/sequence; peak {peak / 1e9:.1f} GFLOP/s "
          f"({peak_source})")
    print("  host malloc: " + ("keeps freed memory (bertjax.runtime.host_memory), both sides" if malloc_tuned
                               else "glibc defaults"))
    # A busy machine slows the sides unequally (PyTorch's threads suffer more): the load goes with the figures.
    print(f"  load average at the start: {_load()}")
    ours = _ours(config, args.batch, args.seq, args.masked)
    ours_times, torch_times = [], {peer: [] for peer in references}
    for _ in range(args.repeats):
        # Turns of a few steps per side; the first step after a switch is dropped: it pays for the other side's
        # memory traffic (measured here: +1 s on a 4 s step), which a training job never does.
        ours_times += [ours() for _ in range(args.steps_per_turn)][1:]
        for peer, run in references.items():
            torch_times[peer] += [run() for _ in range(args.steps_per_turn)][1:]
    for run in references.values():
        run.close()

    def report(name, times, seq):
        """The median step's wall time (and its rates), and the median CPU seconds a step (all threads)."""
        seconds, cpu = statistics.median(t[0] for t in times), statistics.median(t[1] for t in times)
        rate = args.batch / seconds
        achieved = rate * metrics.train_flops_per_sequence(config, seq, args.masked)  # one device each
        print(f"  {name:<34} {seconds:7.3f} s/step ({cpu:6.2f} CPU-s) {rate:8.2f} seq/s {achieved / 1e9:8.1f} "
              f"GFLOP/s = {achieved / peak:5.1%} of peak")
        return seconds

    ours_median = report("bertjax", ours_times, args.seq)
    for peer, times in torch_times.items():
        name = "transformers + torch AdamW" + (", torch.compile" if peer == "compile" else "")
        torch_median = report(name, times, args.seq)
        print(f"  ratio bertjax / transformers{' (torch.compile)' if peer == 'compile' else ''}: "
              f"{torch_median / ours_median:.2f}x (medians)")
    print(f"  load average after the timed turns: {_load()}")
    if args.trace:
        _trace(ours, args.trace, host=device.platform == "cpu")
    for length in [int(x) for x in args.lengths.split(",") if x]:
        if length == args.seq:
            continue
        run = _ours(config, args.batch, length, args.masked)
        report(f"bertjax seq {length}", [run() for _ in range(args.steps_per_turn)], length)
    return 0


if __name__ == "__main__":
    sys.exit(main())
