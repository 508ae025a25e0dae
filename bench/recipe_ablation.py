"""One part of a pretraining recipe changed alone: BERT-tiny's classic run of the learning-per-FLOP bench
(bench/learning_per_flop.py: its corpus, vocabulary, held-out batches and run command) with the given `--set` values
added, and its held-out loss at each of the 20 checkpoints, to set beside that bench's curves.

  python bench/recipe_ablation.py --workdir W --name no-dropout model.hidden_dropout_prob=0 \
      model.attention_probs_dropout_prob=0

W is the bench's workdir (its vocab/vocab.txt, trained by the bench's first run); the run goes to W/ablation/NAME-...
and resumes there. Prints the command and NAME's curve (step:loss).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import learning_per_flop as bench  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", required=True, help="the learning-per-FLOP bench's workdir")
    parser.add_argument("--data", default=str(bench.ROOT.parent / "shared" / "data"))
    parser.add_argument("--name", required=True, help="names the run")
    parser.add_argument("--lr", type=float, default=3e-3, help="bert-tiny's kept rate at 3,000 steps")
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("changes", nargs="+", help="KEY=VALUE, as pretrain's --set takes them")
    args = parser.parse_args()
    work = Path(args.workdir)
    vocab = work / "vocab" / "vocab.txt"
    if not vocab.exists():
        raise SystemExit(f"{vocab} not found: run bench/learning_per_flop.py --workdir {work} first")
    arm = f"bert-tiny-{args.name}"
    bench.ARMS[arm] = ("bert-tiny", dict(change.split("=", 1) for change in args.changes))
    wikitext = Path(args.data) / "wikitext-2"
    run = work / "ablation" / f"{arm}-lr{args.lr:g}-seed{args.seed}-{args.steps}steps"
    run.parent.mkdir(parents=True, exist_ok=True)
    argv = bench.pretrain(arm, run, args.steps, args.lr, args.seed, args.steps // bench.CHECKPOINTS,
                          str(wikitext / "wiki.test.raw"), str(vocab), run.parent / f"log-{run.name}.txt")
    batches = bench.eval_batches(str(wikitext / "wiki.valid.raw"), str(vocab))
    curve = [(step, bench.held_out_loss(str(run / "checkpoints" / str(step)), batches))
             for step in bench.saved_steps(run)]
    print("bertjax " + " ".join(argv))
    print(arm, ", ".join(f"{step}:{loss:.3f}" for step, loss in curve), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
