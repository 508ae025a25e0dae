"""Fill-mask with transformers on an HF directory exported by `bertjax export` (proof the export loads in HF).

    python examples/fill_mask.py HF_DIR "Module attributes can be [MASK:assigned] to."

`[MASK:word]` masks `word` and reports its rank among the model's guesses; a plain `[MASK]` just shows them.
"""
import re
import sys

import transformers

TOP_K = 5


def main(hf_dir: str, *sentences: str) -> int:
    fill = transformers.pipeline("fill-mask", model=hf_dir, tokenizer=hf_dir, device="cpu")
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
