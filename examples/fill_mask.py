"""Fill-mask with transformers on an HF directory exported by `bertjax export` (proof the export loads in HF).

    python examples/fill_mask.py [--run PRETRAIN_WORKDIR] HF_DIR "Module attributes can be [MASK:assigned] to."

`[MASK:word]` masks `word` and reports its rank among the model's guesses; a plain `[MASK]` just shows them. The
closing lines say what the count of words found means and, given the pretraining run's workdir (`--run`), how long
its pretraining took and the held-out accuracy it reached. The export is loaded with the class its config.json names
(BertForPreTraining for a pretraining run), so every tensor is used and transformers has nothing to report.
"""
import argparse
import json
import os
import re
import sys

TOP_K = 5


def fill_mask_with(hf_dir: str):
    """A function `masked sentence -> [{"token_str", "score"}] * TOP_K` over the export's MLM head."""
    import torch
    import transformers

    transformers.utils.logging.disable_progress_bar()
    config = transformers.AutoConfig.from_pretrained(hf_dir)
    model = getattr(transformers, config.architectures[0]).from_pretrained(hf_dir).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(hf_dir)

    def fill(masked: str, top_k: int):
        inputs = tokenizer(masked, return_tensors="pt")
        with torch.no_grad():
            output = model(**inputs)
        logits = output.prediction_logits if hasattr(output, "prediction_logits") else output.logits
        position = (inputs["input_ids"][0] == tokenizer.mask_token_id).nonzero()[0, 0]
        scores, ids = logits[0, position].softmax(-1).topk(top_k)
        return [{"token_str": tokenizer.decode([i]), "score": float(p)} for p, i in zip(scores, ids.tolist())]

    return fill


def closing_lines(found: int, scored: int, run_dir: str | None = None) -> list[str]:
    """What the count means, in words; with the pretraining workdir `run_dir`, how long its pretraining took (the
    wall time of its runs, from their `goodput` records in metrics.jsonl) and its last held-out evaluation."""
    lines = [f"held-out words in the top {TOP_K}: {found} of {scored}",
             f"  = of {scored} words masked in sentences the model never trained on (topics held out of its "
             f"corpus), {found} {'was' if found == 1 else 'were'} among its {TOP_K} likeliest guesses for the gap"]
    path = os.path.join(run_dir, "metrics.jsonl") if run_dir else None
    if not path or not os.path.exists(path):
        return lines
    with open(path, encoding="utf-8") as f:
        records = [json.loads(line) for line in f if line.strip().startswith("{")]
    runs = [r for r in records if r.get("event") == "goodput"]
    evals = [r for r in records if "eval_mlm_accuracy" in r]
    if runs:
        from bertjax.runtime.console import duration

        lines.append(f"pretraining: {runs[-1]['step']} steps in {duration(sum(r['wall_s'] for r in runs))}"
                     + (f" over {len(runs)} runs" if len(runs) > 1 else "") + f" ({run_dir})")
    if evals:
        last = evals[-1]
        lines.append(f"  held-out MLM accuracy {last['eval_mlm_accuracy']:.4f} at step {last['step']} (always "
                     f"guessing the most frequent masked token: {last['eval_most_frequent_token_accuracy']:.4f})"
                     if "eval_most_frequent_token_accuracy" in last else
                     f"  held-out MLM accuracy {last['eval_mlm_accuracy']:.4f} at step {last['step']}")
    return lines


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run", help="the pretraining workdir the export came from: its time and held-out accuracy")
    parser.add_argument("hf_dir")
    parser.add_argument("sentences", nargs="*")
    args = parser.parse_args(argv)
    fill = fill_mask_with(args.hf_dir)
    found = 0
    for sentence in args.sentences:
        answer = re.search(r"\[MASK:([^\]]+)\]", sentence)
        masked = re.sub(r"\[MASK(:[^\]]+)?\]", "[MASK]", sentence)
        guesses = fill(masked, top_k=TOP_K)
        shown = ", ".join(f"{g['token_str']!r} ({g['score']:.2f})" for g in guesses)
        verdict = ""
        if answer:
            words = [g["token_str"] for g in guesses]
            hit = answer[1] in words
            found += hit
            verdict = f"   [{answer[1]!r}: " + (f"guess {words.index(answer[1]) + 1}]" if hit else
                                                f"not in the top {TOP_K}]")
        print(f"{masked}\n  -> {shown}{verdict}")
    scored = sum(bool(re.search(r"\[MASK:", s)) for s in args.sentences)
    if scored:
        print("\n".join(closing_lines(found, scored, args.run)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
