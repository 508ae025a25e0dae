"""Learning per FLOP: ModernBERT-tiny against BERT-tiny, each with its preset's recipe, on the same corpus and the
same WordPiece vocabulary, trained to the same training FLOPs (not steps), both scored by the same held-out MLM loss
at 15% masking; two seeds each.

- Corpus: WikiText-2 (../shared/data): wiki.test.raw to train on, wiki.valid.raw held out. A WordPiece vocabulary
  trained on the training text (`bertjax vocab train`), used by both models.
- Runs: `bertjax pretrain --config bert-tiny` (MLM at 15% + NSP, the classic recipe) and `--config modernbert-tiny`
  (MLM alone at 30%, packed rows), both at sequence length 128, batch 32, their presets' learning rates and warmup;
  the ModernBERT run's steps chosen so that its training FLOPs equal BERT's: FLOPs of a step are
  `metrics.train_flops_per_sequence` (the model's matmuls on full rows, forward and backward) x the batch.
- Held-out loss: the same batches for both (static 15% masks, 80/10/10, single segments, from wiki.valid.raw),
  the MLM cross-entropy of every checkpoint (saved at tenths of the run) on them.
- Output: a table of (FLOPs, loss) per run, the FLOPs at which each ModernBERT run reaches its seed's BERT run's
  final held-out loss (interpolated along its curve) as a share of BERT's FLOPs, results.json, and the curves as
  an SVG (loss against FLOPs).

    .venv/bin/python bench/learning_per_flop.py [--data ../shared/data] [--bert-steps 3000] [--seeds 0,1]
"""
from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SEQ, BATCH, EVAL_BATCHES = 128, 32, 16
MODELS = ("bert-tiny", "modernbert-tiny")


def bertjax(*argv: str, log: Path) -> None:
    """A bertjax command in a subprocess (its own JAX and TensorFlow), its output appended to `log`."""
    with open(log, "a") as out:
        result = subprocess.run([sys.executable, "-m", "bertjax.cli", *argv], stdout=out, stderr=subprocess.STDOUT,
                                cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    if result.returncode:
        raise SystemExit(f"bertjax {' '.join(argv[:2])} failed (exit {result.returncode}); see {log}")


def step_flops(preset: str, vocab: str) -> float:
    """Training FLOPs of one step of `preset` at SEQ x BATCH (full rows), with this vocabulary."""
    from bertjax.pretraining import metrics
    from bertjax.pretraining.config import load_config

    config = load_config(preset, [f"data.vocab={vocab}", "data.input=x", f"data.max_seq_length={SEQ}"],
                         require_data=False)
    size = sum(1 for _ in open(vocab, encoding="utf-8"))
    return BATCH * metrics.train_flops_per_sequence(config.bert_config(size), SEQ,
                                                    config.data.max_predictions_per_seq)


def eval_batches(valid: str, vocab: str) -> list[dict]:
    """The held-out batches: static 15% masks, 80/10/10, one segment a row, the same for every model."""
    from bertjax.data.data_config import PretrainingDataConfig
    from bertjax.data.pipeline import make_pretraining_dataset

    config = PretrainingDataConfig(input=valid, corpus_format="wikitext", vocab=vocab, max_seq_length=SEQ,
                                   max_predictions_per_seq=20, masked_lm_prob=0.15, next_sentence_prediction=False,
                                   masking="static", dupe_factor=1, num_epochs=1, shuffle_buffer=1, seed=4242)
    batches = []
    for batch in make_pretraining_dataset(config, BATCH).as_numpy_iterator():
        batches.append(batch)
        if len(batches) == EVAL_BATCHES:
            break
    return batches


def held_out_loss(checkpoint: str, batches: list[dict]) -> float:
    """MLM cross-entropy (mean over the masked tokens) of a checkpoint on the held-out batches."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from bertjax.checkpoint import load_model
    from bertjax.model import family

    model = load_model(checkpoint)
    module = family.pretraining_model(model.config)

    @jax.jit
    def nll_sum(params, batch):
        out = module.apply({"params": params}, batch["input_ids"], batch["input_mask"], batch["segment_ids"],
                           batch["masked_lm_positions"])
        logp = jax.nn.log_softmax(out["mlm_logits"].astype(jnp.float32), axis=-1)
        nll = -jnp.take_along_axis(logp, batch["masked_lm_ids"][..., None], axis=-1)[..., 0]
        return jnp.sum(nll * batch["masked_lm_weights"]), jnp.sum(batch["masked_lm_weights"])

    total = count = 0.0
    for batch in batches:
        inputs = {k: batch[k] for k in ("input_ids", "input_mask", "segment_ids", "masked_lm_positions",
                                        "masked_lm_ids", "masked_lm_weights")}
        a, b = nll_sum(model.params, inputs)
        total, count = total + float(a), count + float(b)
    return total / max(count, 1.0) if np.isfinite(total) else math.inf


def flops_to_reach(curve: list[tuple[float, float]], target: float) -> float | None:
    """The FLOPs at which a (FLOPs, loss) curve first reaches `target`, interpolated linearly; None if never."""
    if curve and curve[0][1] <= target:
        return curve[0][0]
    for (f0, l0), (f1, l1) in zip(curve, curve[1:]):
        if l1 <= target:   # l0 > target >= l1: the crossing between them
            return f0 + (f1 - f0) * (l0 - target) / (l0 - l1)
    return None


def svg(curves: dict[str, list[tuple[float, float]]], path: Path) -> None:
    """Loss against FLOPs, one polyline a run (BERT blue, ModernBERT orange; seeds dashed after the first)."""
    width, height, pad = 720, 420, 60
    points = [p for curve in curves.values() for p in curve]
    fmax = max(f for f, _ in points)
    lmin, lmax = min(loss for _, loss in points), max(loss for _, loss in points)
    x = lambda f: pad + (width - 2 * pad) * f / fmax  # noqa: E731
    y = lambda loss: height - pad - (height - 2 * pad) * (loss - lmin) / max(lmax - lmin, 1e-9)  # noqa: E731
    lines = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="sans-serif" '
             'font-size="12">', f'<rect width="{width}" height="{height}" fill="white"/>',
             f'<line x1="{pad}" y1="{height - pad}" x2="{width - pad}" y2="{height - pad}" stroke="black"/>',
             f'<line x1="{pad}" y1="{pad}" x2="{pad}" y2="{height - pad}" stroke="black"/>',
             f'<text x="{width / 2}" y="{height - 15}" text-anchor="middle">training FLOPs (max {fmax:.3g})</text>',
             f'<text x="15" y="{height / 2}" transform="rotate(-90 15 {height / 2})" text-anchor="middle">'
             'held-out MLM loss (15% masking)</text>',
             f'<text x="{pad - 5}" y="{y(lmax) + 4}" text-anchor="end">{lmax:.2f}</text>',
             f'<text x="{pad - 5}" y="{y(lmin) + 4}" text-anchor="end">{lmin:.2f}</text>']
    for i, (name, curve) in enumerate(sorted(curves.items())):
        color = "#d95f02" if name.startswith("modernbert") else "#1b62a5"
        dash = ' stroke-dasharray="6 3"' if not name.endswith("seed 0") else ""
        coords = " ".join(f"{x(f):.1f},{y(loss):.1f}" for f, loss in curve)
        lines.append(f'<polyline points="{coords}" fill="none" stroke="{color}" stroke-width="2"{dash}/>')
        lines.append(f'<text x="{width - pad - 150}" y="{pad + 16 * i}" fill="{color}">{name}</text>')
    path.write_text("\n".join(lines + ["</svg>"]) + "\n")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", default=str(ROOT.parent / "shared" / "data"))
    parser.add_argument("--workdir", default=str(ROOT / "runs" / "learning-per-flop"))
    parser.add_argument("--bert-steps", type=int, default=3000, help="BERT-tiny's steps: the FLOPs budget")
    parser.add_argument("--seeds", default="0,1")
    parser.add_argument("--vocab-size", type=int, default=8000)
    args = parser.parse_args()
    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    log = work / "log.txt"
    train, valid = (str(Path(args.data) / "wikitext-2" / name) for name in ("wiki.test.raw", "wiki.valid.raw"))
    vocab = work / "vocab" / "vocab.txt"
    if not vocab.exists():
        bertjax("vocab", "train", "--input", train, "--format", "wikitext", "--type", "wordpiece", "--vocab-size",
                str(args.vocab_size), "--out", str(vocab.parent), log=log)
    flops = {preset: step_flops(preset, str(vocab)) for preset in MODELS}
    budget = args.bert_steps * flops["bert-tiny"]
    steps = {"bert-tiny": args.bert_steps, "modernbert-tiny": max(10, round(budget / flops["modernbert-tiny"]))}
    print(f"training FLOPs per step: bert-tiny {flops['bert-tiny']:.4g}, modernbert-tiny "
          f"{flops['modernbert-tiny']:.4g}; budget {budget:.4g} FLOPs = {steps['bert-tiny']} and "
          f"{steps['modernbert-tiny']} steps", flush=True)
    batches = eval_batches(valid, str(vocab))
    curves = {}
    for seed in [int(s) for s in args.seeds.split(",")]:
        for preset in MODELS:
            run = work / f"{preset}-seed{seed}"
            every = max(1, steps[preset] // 10)
            bertjax("pretrain", "--config", preset, "--workdir", str(run), "--set", f"data.input={train}",
                    "--set", "data.corpus_format=wikitext", "--set", f"data.vocab={vocab}",
                    "--set", f"data.max_seq_length={SEQ}", "--set", f"train.batch_size={BATCH}",
                    "--set", f"train.steps={steps[preset]}", "--set", f"train.seed={seed}",
                    "--set", f"data.seed={seed + 1}", "--set", f"checkpoint.every={every}",
                    "--set", "checkpoint.keep=20", "--set", "train.log_every=100", log=log)
            saved = sorted(int(p.name) for p in (run / "checkpoints").iterdir() if p.name.isdigit())
            curve = [(step * flops[preset], held_out_loss(str(run / "checkpoints" / str(step)), batches))
                     for step in saved]
            curves[f"{preset} seed {seed}"] = curve
            print(f"{preset} seed {seed}: " + ", ".join(f"{f:.3g}:{loss:.4f}" for f, loss in curve), flush=True)
    summary = {}
    for seed in [int(s) for s in args.seeds.split(",")]:
        bert_flops, bert_loss = curves[f"bert-tiny seed {seed}"][-1]
        reached = flops_to_reach(curves[f"modernbert-tiny seed {seed}"], bert_loss)
        summary[seed] = {"bert_final_loss": bert_loss, "bert_flops": bert_flops,
                         "modernbert_final_loss": curves[f"modernbert-tiny seed {seed}"][-1][1],
                         "modernbert_flops_to_reach": reached,
                         "share": None if reached is None else reached / bert_flops}
        share = "never within the budget" if reached is None else f"{reached / bert_flops:.2f}x BERT's FLOPs"
        print(f"seed {seed}: bert-tiny final held-out loss {bert_loss:.4f} at {bert_flops:.4g} FLOPs; modernbert-tiny "
              f"reaches it at {share}; its own final loss {summary[seed]['modernbert_final_loss']:.4f}")
    (work / "results.json").write_text(json.dumps({"steps": steps, "step_flops": flops, "curves": curves,
                                                   "summary": summary}, indent=2))
    svg(curves, work / "learning_per_flop.svg")
    print(f"wrote {work / 'results.json'} and {work / 'learning_per_flop.svg'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
