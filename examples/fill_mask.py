"""Fill-mask with transformers on an HF directory exported by `bertjax export` (proof the export loads in HF).

    python examples/fill_mask.py HF_DIR "The [MASK] statement is used for conditional execution."
"""
import sys

import transformers


def main(hf_dir: str, *sentences: str) -> int:
    fill = transformers.pipeline("fill-mask", model=hf_dir, tokenizer=hf_dir, device="cpu")
    for sentence in sentences:
        predictions = fill(sentence, top_k=5)
        shown = ", ".join(f"{p['token_str']!r} ({p['score']:.2f})" for p in predictions)
        print(f"{sentence}\n  -> {shown}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], *sys.argv[2:]))
