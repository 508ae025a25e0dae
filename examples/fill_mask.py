"""Fill-mask with transformers on an HF directory exported by `bertjax export` (proof the export loads in HF).

    python examples/fill_mask.py HF_DIR "Module attributes can be [MASK:assigned] to."

`[MASK:word]` masks `word` and reports its rank among the model's guesses; a plain `[MASK]` just shows them.
The export is loaded with the class its config.json names (BertForPreTraining for a pretraining run), so every
tensor is used and transformers has nothing to report.
"""
import re
import sys

import torch
import transformers

TOP_K = 5


def fill_mask_with(hf_dir: str):
    """A function `masked sentence -> [{"token_str", "score"}] * TOP_K` over the export's MLM head."""
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


def main(hf_dir: str, *sentences: str) -> int:
    fill = fill_mask_with(hf_dir)
    found = 0
    for sentence in sentences:
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
    scored = sum(bool(re.search(r"\[MASK:", s)) for s in sentences)
    if scored:
        print(f"held-out words in the top {TOP_K}: {found} of {scored}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], *sys.argv[2:]))
