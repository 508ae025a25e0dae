"""Sequence-packing benchmark (issue 13): padding before/after packing on real text, and the train step's real
tokens per second packed vs unpacked, measured in the same run on the same machine.

(a) One epoch of the pretraining stream (static masks, NSP pairs) over WikiText-2 valid and the Gutenberg books,
    unpacked and packed (best-fit decreasing per block): instances, rows, padding fraction, rows per instance.
(b) The jitted train step on batches of that stream, unpacked vs packed (same model, same batch size in rows):
    real (non-padding) tokens per second of train step, and the ratio = the effective speed-up.

    .venv/bin/python bench/packing.py [--data ../shared/data] [--model mini] [--seqs 128,512] [--steps 5]
"""
from __future__ import annotations

import argparse
import functools
import os
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BATCH_TOKENS = 4096  # rows per train step = BATCH_TOKENS / seq (the same for packed and unpacked)


def corpora(data: Path) -> dict[str, dict]:
    return {"wikitext-2 valid": dict(input=str(data / "wikitext-2" / "wiki.valid.raw"), corpus_format="wikitext"),
            "gutenberg (3 books)": dict(input=str(data / "gutenberg" / "*.txt"), corpus_format="wrapped")}


def stream_config(corpus: dict, vocab: str, seq: int, packing: bool, max_instances: int):
    from bertjax.data.data_config import PretrainingDataConfig

    return PretrainingDataConfig(**corpus, vocab=vocab, max_seq_length=seq,
                                 max_predictions_per_seq=round(seq * 0.15), masking="static", num_epochs=1,
                                 shuffle_buffer=1000, packing=packing, max_instances_per_row=max_instances)


def epoch_figures(config) -> dict:
    from bertjax.data.pipeline import make_pretraining_dataset

    rows = real = instances = 0
    start = time.perf_counter()
    for batch in make_pretraining_dataset(config, 64, drop_remainder=False).as_numpy_iterator():
        rows += len(batch["input_ids"])
        real += int(batch["input_mask"].sum())
        instances += int(batch["next_sentence_weights"].sum()) if config.packing else len(batch["input_ids"])
    seconds = time.perf_counter() - start
    return {"rows": rows, "instances": instances, "padding": 1 - real / (rows * config.max_seq_length),
            "rows_per_instance": rows / instances, "instances_per_s": instances / seconds}


def step_real_tokens_per_s(configs: dict, model_name: str, steps: int) -> dict[str, tuple[float, float]]:
    """{case: (real tokens per second of train step, padding fraction of the timed batches)} for each stream in
    `configs`; the cases' steps alternate (one of each in turn), so drifts of the machine hit them alike."""
    import flax.linen as nn
    import jax
    import numpy as np

    from bertjax.data.pipeline import make_pretraining_dataset
    from bertjax.model.bert import model as model_lib
    from bertjax.model.bert.config import BertConfig
    from bertjax.pretraining import optim
    from bertjax.pretraining import state as train_state
    from bertjax.pretraining import step as train_step

    seq = next(iter(configs.values())).max_seq_length
    rows = BATCH_TOKENS // seq
    bert = BertConfig.preset(model_name, vocab_size=30522, max_position_embeddings=max(512, seq))
    model = model_lib.BertForPreTraining(bert)
    optimizer, schedule = optim.make_optimizer(optim.OptimizerConfig(warmup_steps=10), 1000)
    step = jax.jit(functools.partial(train_step.train_step, model=model, optimizer=optimizer, schedule=schedule,
                                     grad_accum_steps=1, nsp_loss=True), donate_argnums=(0,))
    states, batches, seconds = {}, {}, {}
    for case, config in configs.items():
        states[case] = nn.meta.unbox(train_state.init_state(
            jax.random.key(0), model=model, config=bert, optimizer=optimizer, seq_len=seq,
            num_masked=config.max_predictions_per_seq))
        stream = make_pretraining_dataset(config.replace(num_epochs=None), rows).take(steps + 1)
        batches[case] = [{k: jax.numpy.asarray(v) for k, v in b.items()} for b in stream.as_numpy_iterator()]
        states[case], metrics = step(states[case], batches[case][0])  # compiles
        jax.block_until_ready(metrics)
        seconds[case] = 0.0
    for i in range(1, steps + 1):
        for case in configs:
            start = time.perf_counter()
            states[case], metrics = step(states[case], batches[case][i])
            jax.block_until_ready(metrics)
            seconds[case] += time.perf_counter() - start
    out = {}
    for case in configs:
        real = sum(int(np.asarray(b["input_mask"]).sum()) for b in batches[case][1:])
        out[case] = (real / seconds[case], 1 - real / (steps * rows * seq))
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", default=str(ROOT.parent / "shared" / "data"))
    parser.add_argument("--vocab", default="", help="default: the BERT-Mini vocab under --data")
    parser.add_argument("--model", default="mini")
    parser.add_argument("--seqs", default="128,512")
    parser.add_argument("--max-instances", type=int, default=4)
    parser.add_argument("--steps", type=int, default=5, help="timed train steps per case")
    parser.add_argument("--skip-steps", action="store_true", help="only the padding figures")
    args = parser.parse_args()
    data = Path(args.data)
    vocab = args.vocab or str(data / "bert" / "uncased_L-4_H-256_A-4" / "vocab.txt")
    from bertjax.runtime import platforms

    platforms.use_cpu_where_no_accelerator(os.environ)  # before jax is imported: no TPU probing without a TPU
    import jax

    print(f"device: {jax.devices()[0].device_kind}; model {args.model}; {BATCH_TOKENS} row positions per step; "
          f"packing: best-fit decreasing per block, <= {args.max_instances} instances per row")
    for seq in (int(s) for s in args.seqs.split(",")):
        for name, corpus in corpora(data).items():
            plain, packed = (epoch_figures(stream_config(corpus, vocab, seq, p, args.max_instances))
                             for p in (False, True))
            print(f"seq {seq} {name}: {plain['instances']} instances; padding {plain['padding']:.3f} -> "
                  f"{packed['padding']:.3f}; rows per instance 1 -> {packed['rows_per_instance']:.3f}; "
                  f"pipeline {plain['instances_per_s']:.0f} -> {packed['instances_per_s']:.0f} instances/s")
            if args.skip_steps:
                continue
            rates = step_real_tokens_per_s(
                {p: stream_config(corpus, vocab, seq, p, args.max_instances) for p in (False, True)}, args.model,
                args.steps)
            (plain_rate, plain_pad), (packed_rate, packed_pad) = rates[False], rates[True]
            print(f"  train step real tokens/s: unpacked {plain_rate:.0f} (padding {plain_pad:.3f}), packed "
                  f"{packed_rate:.0f} (padding {packed_pad:.3f}): speed-up x{packed_rate / plain_rate:.2f}")


if __name__ == "__main__":
    main()
