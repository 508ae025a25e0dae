"""Long contexts: one training step of a small ModernBERT at 1k-8k tokens, bertjax vs transformers (sdpa), on the CPU.

    .venv/bin/python bench/long_context.py [--lengths 1024,2048,4096,8192] [--layers 3] [--steps 3]

The model: ModernBERT-base's shape (hidden 768, 12 heads of 64, GeGLU 1152, a window of 128 = 64 tokens each side,
a global layer every third, vocabulary 50,368, max_position_embeddings 8192) with --layers layers (3: one global and
two windowed, base's ratio), as a sequence classifier of 2 labels (what `finetune classify` trains); random weights
written once by transformers (safetensors) and loaded by both sides. One step: a batch of 1 row of L random tokens,
forward, backward, AdamW (lr 1e-5, weight decay 0.01, clip 1.0), float32, no dropout (ModernBERT's default).
bertjax: the fine-tune's module, loss and optimizer, its attention as `auto` picks it on a CPU (`chunked` from
attention.CHUNKED_MIN_LENGTH tokens); transformers: ModernBertForSequenceClassification with
attn_implementation="sdpa" (torch's CPU flash attention; the windowed layers take the sliding mask) and torch's AdamW.

Each (side, length) runs in a fresh child process, one after another (never two at once): its peak RSS is the
process's ru_maxrss (imports, the load, the compile, the steps); the time is the median of --steps steps after that warm-up
step (the compile excluded), wall and the CPU seconds of all the process's threads. The load average is printed
before and after: on a busy machine the sides slow unequally, so ratios are an idle machine's figures or go with
the load and both sides' CPU seconds.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SHAPE = dict(vocab_size=50368, hidden_size=768, intermediate_size=1152, num_attention_heads=12, local_attention=128,
             global_attn_every_n_layers=3, max_position_embeddings=8192, pad_token_id=50283, cls_token_id=50281,
             sep_token_id=50282, bos_token_id=50281, eos_token_id=50282, num_labels=2)
LEARNING_RATE, WEIGHT_DECAY, CLIP = 1e-5, 0.01, 1.0


def write_model(directory: Path, layers: int) -> None:
    """A random ModernBertForSequenceClassification, written by transformers (seed 0)."""
    import torch
    import transformers

    from tokenizers import Tokenizer, models, pre_tokenizers

    torch.manual_seed(0)
    config = transformers.ModernBertConfig(**SHAPE, num_hidden_layers=layers)
    transformers.ModernBertForSequenceClassification(config).save_pretrained(directory)
    # A tokenizer the loader reads (the steps take token ids): one word a token id, ModernBERT's special tokens.
    special = {"[CLS]": SHAPE["cls_token_id"], "[SEP]": SHAPE["sep_token_id"], "[PAD]": SHAPE["pad_token_id"],
               "[UNK]": 50280, "[MASK]": 50284}
    vocab = {**{f"w{i}": i for i in range(SHAPE["vocab_size"]) if i not in special.values()}, **special}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="[UNK]", cls_token="[CLS]",
                                         sep_token="[SEP]", pad_token="[PAD]",
                                         mask_token="[MASK]").save_pretrained(directory)


def batch(length: int) -> dict:
    import numpy as np

    rng = np.random.default_rng(length)
    ids = rng.integers(100, 50000, (1, length)).astype(np.int32)
    ids[0, 0], ids[0, -1] = SHAPE["cls_token_id"], SHAPE["sep_token_id"]
    return {"input_ids": ids, "input_mask": np.ones_like(ids), "labels": np.array([1], np.int32)}


def ours(model: str, length: int):
    """bertjax's step on `model`: (one step -> loss)."""
    import jax
    import jax.numpy as jnp
    import optax

    from bertjax.finetune.trainer import classification_loss
    from bertjax.interop.load import load_pretrained
    from bertjax.model import family
    from bertjax.pretraining.optim import OptimizerConfig, make_optimizer
    from bertjax.runtime import host_memory

    host_memory.release_freed_memory_after_compiles(os.environ)   # as the fine-tune's Trainer does
    checkpoint = load_pretrained(model)
    module = family.sequence_classifier(checkpoint.config, SHAPE["num_labels"])
    optimizer, _ = make_optimizer(OptimizerConfig(learning_rate=LEARNING_RATE, warmup_steps=0,
                                                  weight_decay=WEIGHT_DECAY, clip_norm=CLIP), 1000)
    params = jax.device_put(checkpoint.params)
    state = {"params": params, "opt": optimizer.init(params)}
    data = jax.device_put(batch(length))

    def loss_fn(params, data):
        logits = module.apply({"params": params}, data["input_ids"], data["input_mask"], None, deterministic=False,
                              rngs={"dropout": jax.random.key(0)})
        return jnp.mean(classification_loss(logits, data))

    @functools.partial(jax.jit, donate_argnums=(0, 1))   # as the Trainer's step: params and moments updated in place
    def step(params, opt_state, data):
        loss, grads = jax.value_and_grad(loss_fn)(params, data)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    def run() -> float:
        state["params"], state["opt"], loss = step(state["params"], state["opt"], data)
        return float(loss)
    return run


def transformers_side(model: str, length: int):
    """transformers' step on `model` (sdpa, float32): (one step -> loss)."""
    import torch
    import transformers

    net = transformers.ModernBertForSequenceClassification.from_pretrained(
        model, attn_implementation="sdpa", dtype=torch.float32).train()
    optimizer = torch.optim.AdamW(net.parameters(), lr=LEARNING_RATE, weight_decay=WEIGHT_DECAY)
    b = batch(length)
    inputs = dict(input_ids=torch.from_numpy(b["input_ids"]).long(),
                  attention_mask=torch.from_numpy(b["input_mask"]).long(), labels=torch.from_numpy(b["labels"]).long())

    def run() -> float:
        loss = net(**inputs).loss
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(net.parameters(), CLIP)
        optimizer.step()
        return float(loss)
    return run


def child(side: str, model: str, length: int, steps: int) -> None:
    """One side at one length in this (fresh) process: a JSON line of its figures on stdout."""
    run = (ours if side == "bertjax" else transformers_side)(model, length)
    start = time.perf_counter()
    first_loss = run()   # compiles (bertjax), warms up (both)
    warm_up = time.perf_counter() - start
    walls, cpus = [], []
    for _ in range(steps):
        start, cpu = time.perf_counter(), time.process_time()
        run()
        walls.append(time.perf_counter() - start)
        cpus.append(time.process_time() - cpu)
    print(json.dumps({"side": side, "length": length, "wall": statistics.median(walls), "cpu": statistics.median(cpus),
                      "warm_up": warm_up, "loss": first_loss,
                      "peak": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}), flush=True)


def load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="1024,2048,4096,8192")
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--steps", type=int, default=3, help="timed steps per side and length (after a warm-up)")
    parser.add_argument("--child", nargs=4, metavar=("SIDE", "MODEL", "LENGTH", "STEPS"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        side, model, length, steps = args.child
        child(side, model, int(length), int(steps))
        return 0
    lengths = [int(x) for x in args.lengths.split(",")]
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    print(f"ModernBERT-base's shape, {args.layers} layers, sequence classification, batch 1; load average {load()}")
    rows = []
    with tempfile.TemporaryDirectory() as directory:
        write_model(Path(directory), args.layers)
        for length in lengths:
            for side in ("transformers", "bertjax"):
                out = subprocess.run([sys.executable, __file__, "--child", side, directory, str(length),
                                      str(args.steps)], env=env, capture_output=True, text=True)
                if out.returncode:
                    print(f"  {side} at {length} failed (exit {out.returncode}):\n{out.stderr[-3000:]}")
                    return 1
                rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
                r = rows[-1]
                print(f"  {length:>5} {side:<12} step {r['wall']:7.2f} s wall {r['cpu']:7.2f} s CPU   peak RSS "
                      f"{r['peak'] / 2**30:5.2f} GiB   loss {r['loss']:.4f}   "
                      f"[load {load()}]", flush=True)
    print(f"\nratios bertjax / transformers (memory target <= 1.0, time <= 1.2); load average {load()}")
    print("| tokens | peak RSS | step wall | step CPU |")
    print("|---|---|---|---|")
    by = {(r["side"], r["length"]): r for r in rows}
    for length in lengths:
        a, b = by["bertjax", length], by["transformers", length]
        print(f"| {length} | {a['peak'] / b['peak']:.2f}x ({a['peak'] / 2**30:.2f} / {b['peak'] / 2**30:.2f} GiB) | "
              f"{a['wall'] / b['wall']:.2f}x ({a['wall']:.2f} / {b['wall']:.2f} s) | "
              f"{a['cpu'] / b['cpu']:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
