"""Forward throughput of BERT-base shape: bertjax (JAX/XLA) vs transformers.BertModel (PyTorch), same run.

    .venv/bin/python bench/forward.py [--batch 8] [--seq 128] [--repeats 10] [--dtype float32]

Both sides get the same random weights (ours exported from the HF model) and the same inputs; the script checks
that the outputs agree before timing, then prints sequences/s for each and the ratio. Timings alternate between the
two sides so that machine noise hits both alike.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import numpy as np


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--preset", default="base")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    args = parser.parse_args()

    import jax
    import torch
    import transformers

    from bertjax.interop.load import load_pretrained
    from bertjax.model.bert import model as model_lib
    from bertjax.model.bert.config import BertConfig

    torch.set_num_threads(args.threads)
    config = BertConfig.preset(args.preset, dtype=args.dtype)
    hf_config = transformers.BertConfig(**config.to_bert_config_dict())
    torch.manual_seed(0)
    reference = transformers.BertModel(hf_config).eval()
    with tempfile.TemporaryDirectory() as folder:
        reference.save_pretrained(folder)
        with open(os.path.join(folder, "vocab.txt"), "w") as f:
            f.write("".join(f"[unused{i}]\n" for i in range(config.vocab_size)))
        loaded = load_pretrained(folder)
    params = loaded.params["bert"]
    model = model_lib.BertModel(config.replace(dtype=args.dtype))

    rng = np.random.default_rng(0)
    ids = rng.integers(1000, config.vocab_size, (args.batch, args.seq)).astype(np.int32)
    mask = np.ones_like(ids)
    segments = np.zeros_like(ids)
    forward = jax.jit(lambda p, i, m, s: model.apply({"params": p}, i, m, s)[0])
    ours = np.asarray(forward(params, ids, mask, segments))  # compile
    torch_inputs = dict(input_ids=torch.from_numpy(ids).long(), attention_mask=torch.from_numpy(mask).long(),
                        token_type_ids=torch.from_numpy(segments).long())
    with torch.inference_mode():
        expected = reference(**torch_inputs).last_hidden_state.numpy()
    difference = float(np.abs(ours.astype(np.float32) - expected).max())
    print(f"max |ours - transformers| = {difference:.2e}")

    def time_ours():
        start = time.perf_counter()
        forward(params, ids, mask, segments).block_until_ready()
        return time.perf_counter() - start

    def time_torch():
        start = time.perf_counter()
        with torch.inference_mode():
            reference(**torch_inputs)
        return time.perf_counter() - start

    time_ours(), time_torch()  # warm-up
    ours_times, torch_times = [], []
    for _ in range(args.repeats):
        ours_times.append(time_ours())
        torch_times.append(time_torch())
    ours_median, torch_median = statistics.median(ours_times), statistics.median(torch_times)
    print(f"BERT-{args.preset} forward, batch {args.batch}, seq {args.seq}, {args.dtype}, "
          f"{jax.devices()[0].device_kind}, torch threads {args.threads}, {args.repeats} runs (median)")
    print(f"  bertjax (JAX {jax.__version__}):          {args.batch / ours_median:8.2f} seq/s  "
          f"({ours_median * 1e3:.1f} ms/batch)")
    print(f"  transformers (torch {torch.__version__}): {args.batch / torch_median:8.2f} seq/s  "
          f"({torch_median * 1e3:.1f} ms/batch)")
    print(f"  ratio bertjax / transformers: {torch_median / ours_median:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
