"""One pretraining step at BERT-base shape: bertjax vs transformers.BertForPreTraining + torch AdamW, same run.

    .venv/bin/python bench/train_step.py [--batch 8] [--seq 128] [--repeats 5] [--lengths 128,256,512]

Prints sequences/s of each side and their ratio, model TFLOP/s and the fraction of a matmul peak measured in the
same run (the CPU's reference for MFU), then bertjax's sequences/s at each of --lengths. Runs alternate between the
two sides so that machine noise hits both alike. On an accelerator pass --dtype bfloat16 and the MFU is against
the device's table peak.
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

    from bertjax import model as model_lib
    from bertjax import optim, sharding, train

    mesh = sharding.make_mesh(data=1, devices=jax.devices()[:1])
    model = model_lib.BertForPreTraining(config)
    optimizer, schedule = optim.make_optimizer(1e-4, 1000, 10)
    state, shardings, _ = train.make_sharded_state(jax.random.key(0), model=model, config=config,
                                                   optimizer=optimizer, mesh=mesh, seq_len=seq, num_masked=masked)
    step, _ = train.compile_steps(model=model, optimizer=optimizer, schedule=schedule,
                                  step_config=train.StepConfig(), state_shardings_tree=shardings, mesh=mesh)
    data = train.global_batch(_batch(np.random.default_rng(0), batch, seq, masked, config.vocab_size), mesh)
    holder = {"state": state}

    def run():
        start = time.perf_counter()
        with sharding.activate(mesh):
            holder["state"], metrics = step(holder["state"], data)
        jax.block_until_ready(metrics)
        return time.perf_counter() - start

    run()  # compile
    return run


def _torch(config, batch, seq, masked, threads):
    import torch
    import transformers

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    hf_config = transformers.BertConfig(**config.to_bert_config_dict())
    model = transformers.BertForPreTraining(hf_config).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, eps=1e-6, weight_decay=0.01)
    b = _batch(np.random.default_rng(0), batch, seq, masked, config.vocab_size)
    labels = np.full((batch, seq), -100, np.int64)
    np.put_along_axis(labels, b["masked_lm_positions"], b["masked_lm_ids"], 1)
    inputs = dict(input_ids=torch.from_numpy(b["input_ids"]).long(),
                  attention_mask=torch.from_numpy(b["input_mask"]).long(),
                  token_type_ids=torch.from_numpy(b["segment_ids"]).long(), labels=torch.from_numpy(labels),
                  next_sentence_label=torch.from_numpy(b["next_sentence_labels"][:, 0]).long())

    def run():
        start = time.perf_counter()
        loss = model(**inputs).loss
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        return time.perf_counter() - start

    run()
    return run


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--masked", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--preset", default="base")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--lengths", default="128,256,512", help="bertjax-only sequence lengths to time ('' = none)")
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--skip-torch", action="store_true")
    args = parser.parse_args()

    import jax

    from bertjax import metrics
    from bertjax.config import BertConfig

    config = BertConfig.preset(args.preset, dtype=args.dtype, hidden_dropout_prob=0.1,
                               attention_probs_dropout_prob=0.1)
    device = jax.devices()[0]
    if device.platform == "cpu":
        peak, peak_source = metrics.measure_matmul_peak(), "measured fp32 matmul peak"
    else:
        peak, peak_source = metrics.device_peak_flops(device, args.dtype)
    flops = metrics.train_flops_per_sequence(config, args.seq, args.masked)
    print(f"BERT-{args.preset} train step (MLM+NSP, AdamW, dropout 0.1), batch {args.batch}, seq {args.seq}, "
          f"{args.dtype}, {device.device_kind}; {flops / 1e9:.1f} GFLOP/sequence; peak {peak / 1e9:.1f} GFLOP/s "
          f"({peak_source})")
    ours = _ours(config, args.batch, args.seq, args.masked)
    reference = None if args.skip_torch else _torch(config, args.batch, args.seq, args.masked, args.threads)
    ours_times, torch_times = [], []
    for _ in range(args.repeats):
        ours_times.append(ours())
        if reference:
            torch_times.append(reference())

    def report(name, times, seq):
        seconds = statistics.median(times)
        rate = args.batch / seconds
        achieved = rate * metrics.train_flops_per_sequence(config, seq, args.masked)  # one device each
        print(f"  {name:<34} {seconds:7.3f} s/step {rate:8.2f} seq/s {achieved / 1e9:8.1f} GFLOP/s "
              f"= {achieved / peak:5.1%} of peak")
        return seconds

    ours_median = report("bertjax", ours_times, args.seq)
    if reference:
        torch_median = report("transformers + torch AdamW", torch_times, args.seq)
        print(f"  ratio bertjax / transformers: {torch_median / ours_median:.2f}x (median of {args.repeats})")
    for length in [int(x) for x in args.lengths.split(",") if x]:
        if length == args.seq:
            continue
        run = _ours(config, args.batch, length, args.masked)
        report(f"bertjax seq {length}", [run() for _ in range(max(2, args.repeats // 2))], length)
    return 0


if __name__ == "__main__":
    sys.exit(main())
