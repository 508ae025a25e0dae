"""`bertjax convert | export | info | embed`: checkpoint interop and feature extraction.

The jobs (JAX, TensorFlow) are imported only when a command runs, so `bertjax --help` stays fast.
"""
from __future__ import annotations

import argparse
import collections

import numpy as np
from etils import epath


_ANY_CHECKPOINT = ("bertjax checkpoint (a step directory, or a run directory: its newest complete step), HF model "
                   "directory or TF checkpoint prefix")


def register(subparsers) -> None:
    convert = subparsers.add_parser("convert", help="import an HF or original TF checkpoint as a bertjax checkpoint")
    convert.add_argument("src", help="HF model directory, or TF checkpoint prefix (e.g. .../bert_model.ckpt)")
    convert.add_argument("--from", dest="source", choices=("hf", "tf"), required=True)
    convert.add_argument("--out", required=True, help="output checkpoint directory (must not exist)")
    convert.add_argument("--config", help="bert_config.json (TF; default: beside the prefix)")
    convert.add_argument("--vocab", help="vocab.txt (TF; default: beside the prefix)")
    convert.add_argument("--cased", action="store_true", help="the vocabulary is cased (TF; no lower-casing)")
    convert.set_defaults(func=_convert)

    export = subparsers.add_parser("export", help="export a checkpoint to an HF directory (safetensors)")
    export.add_argument("checkpoint", help=_ANY_CHECKPOINT)
    export.add_argument("--to", choices=("hf",), default="hf")
    export.add_argument("--out", required=True, help="output HF directory (must not exist)")
    export.set_defaults(func=_export)

    info = subparsers.add_parser("info", help="print a checkpoint's config and parameter counts by module")
    info.add_argument("checkpoint", help=_ANY_CHECKPOINT)
    info.set_defaults(func=_info)

    embed = subparsers.add_parser(
        "embed", help="features of sentences (one per line): pooled vectors to .npy, or per-token vectors to .npz")
    embed.add_argument("--checkpoint", required=True, help=_ANY_CHECKPOINT)
    embed.add_argument("--input", required=True, help="text file, one sentence per line")
    embed.add_argument("--output", required=True,
                       help="cls/mean: .npy file for the float32 [sentences, D] matrix; none: .npz file of "
                            "per-token vectors and the word-to-token map (layout in bertjax/embed.py)")
    embed.add_argument("--layers", default="last",
                       help="last | second-to-last | sum-last-4 | concat-last-4 | N[,M...] (hidden states numbered "
                            "as transformers' output_hidden_states: 0 = embeddings output, -1 = last; a list is "
                            "concatenated in the order given)")
    embed.add_argument("--pooling", choices=("cls", "mean", "none"), default="cls",
                       help="none: every token's vector with a map from whitespace words to token positions")
    embed.add_argument("--max-len", type=int, default=128)
    embed.add_argument("--batch-size", type=int, default=64)
    embed.add_argument("--show-neighbours", action="store_true",
                       help="print each sentence's nearest neighbour by cosine similarity (cls/mean)")
    embed.set_defaults(func=_embed)


def _convert(args: argparse.Namespace) -> int:
    from bertjax.checkpoint import save_model
    from bertjax.interop.load import load_pretrained

    if epath.Path(args.out).exists():
        raise ValueError(f"--out {args.out} already exists; choose a new directory")
    if args.source == "hf":
        if not epath.Path(args.src).is_dir():
            raise FileNotFoundError(f"HF model directory {args.src} does not exist")
        loaded = load_pretrained(args.src)
    else:
        if not epath.Path(args.src + ".index").exists():
            raise FileNotFoundError(f"TF checkpoint {args.src}.index does not exist (give the prefix, e.g. "
                                    ".../bert_model.ckpt)")
        loaded = load_pretrained(args.src, config_path=args.config, vocab_path=args.vocab)
        loaded.lower_case = not args.cased
    save_model(args.out, loaded.params, loaded.config, loaded.vocab, loaded.lower_case, head=loaded.head)
    print(f"wrote {args.out}: {_count(loaded.params):,} parameters, modules {sorted(loaded.params)}")
    return 0


def _export(args: argparse.Namespace) -> int:
    from bertjax.checkpoint import resolve_checkpoint
    from bertjax.interop.hf import export_hf
    from bertjax.interop.load import load_pretrained

    if epath.Path(args.out).exists():
        raise ValueError(f"--out {args.out} already exists; choose a new directory")
    source = resolve_checkpoint(args.checkpoint)
    loaded = load_pretrained(source)
    head = loaded.head or {}  # a fine-tune job's class and labels; otherwise inferred from the tensors held
    id2label = {int(i): label for i, label in head["id2label"].items()} if "id2label" in head else None
    architecture = export_hf(loaded.params, loaded.config, loaded.vocab, args.out, lower_case=loaded.lower_case,
                             architecture=head.get("architecture"), id2label=id2label)
    print(f"wrote {args.out} as {architecture} (from {source})")
    if "span_boundary" in loaded.params:
        from bertjax.interop.names import SBO_FILE

        print(f"note: the span boundary objective (SBO) head is not part of HF BERT; its weights are in "
              f"{args.out}/{SBO_FILE} (PyTorch layout), which transformers ignores")
    return 0


def _info(args: argparse.Namespace) -> int:
    from bertjax.interop.load import load_pretrained

    from bertjax.checkpoint import resolve_checkpoint

    source = resolve_checkpoint(args.checkpoint)
    loaded = load_pretrained(source)
    print(f"checkpoint: {source}")
    for key, value in loaded.config.to_dict().items():
        print(f"  {key}: {value}")
    print(f"vocabulary: {len(loaded.vocab)} tokens, lower_case={loaded.lower_case}")
    print("parameters by module:")
    for module, count in parameter_counts(loaded.params).items():
        print(f"  {module:<32} {count:>14,}")
    print(f"  {'total':<32} {_count(loaded.params):>14,}")
    return 0


def _embed(args: argparse.Namespace) -> int:
    from bertjax.embed import embed_sentences, embed_tokens, nearest_neighbours
    from bertjax.interop.load import load_pretrained

    path = epath.Path(args.input)
    if not path.exists():
        raise FileNotFoundError(f"--input {args.input} does not exist")
    sentences = [line.strip() for line in path.read_bytes().decode("utf-8", errors="replace").splitlines()]
    sentences = [s for s in sentences if s]
    if not sentences:
        raise ValueError(f"--input {args.input} holds no sentences (one per line expected)")
    loaded = load_pretrained(args.checkpoint)
    if args.pooling == "none":
        arrays = embed_tokens(loaded, sentences, layers=args.layers, max_len=args.max_len,
                              batch_size=args.batch_size)
        with open(args.output, "wb") as f:  # a file object: np.savez would add .npz to any other suffix
            np.savez(f, **arrays)
        print(f"wrote {args.output}: {len(sentences)} sentences, {arrays['vectors'].shape[0]} tokens x "
              f"{arrays['vectors'].shape[1]} float32, {arrays['word_spans'].shape[0]} words (layers "
              f"{args.layers})")
        return 0
    vectors = embed_sentences(loaded, sentences, pooling=args.pooling, layers=args.layers, max_len=args.max_len,
                              batch_size=args.batch_size)
    with open(args.output, "wb") as f:
        np.save(f, vectors)
    print(f"wrote {args.output}: {vectors.shape[0]} x {vectors.shape[1]} float32 ({args.pooling} pooling, "
          f"layers {args.layers})")
    if args.show_neighbours:
        for i, (j, similarity) in enumerate(nearest_neighbours(vectors)):
            print(f"  {similarity:5.3f}  {sentences[i]!r}  ->  {sentences[j]!r}")
    return 0


def parameter_counts(params) -> dict[str, int]:
    """Parameter count per module: embeddings, each encoder layer, pooler, and each head."""
    counts: dict[str, int] = collections.OrderedDict()
    for top, subtree in params.items():
        if top == "bert":
            for module, leaves in subtree.items():
                counts[f"bert/{module}"] = _count(leaves)
        else:
            counts[top] = _count(subtree)
    return counts


def _count(tree) -> int:
    return int(sum(np.size(leaf) for leaf in _leaves(tree)))


def _leaves(tree):
    """Every array of a nested dict of params (plain recursion: no JAX import for `info`)."""
    if isinstance(tree, dict):
        for value in tree.values():
            yield from _leaves(value)
    else:
        yield tree
