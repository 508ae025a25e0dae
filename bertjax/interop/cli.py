"""`bertjax convert | export | info`: checkpoint interop.

The jobs (JAX, TensorFlow) are imported only when a command runs, so `bertjax --help` stays fast.
"""
from __future__ import annotations

import argparse
import collections
import os

import numpy as np
from etils import epath

ANY_CHECKPOINT_HELP = ("bertjax checkpoint (a step directory, or a run directory: its newest complete step), HF model "
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
    export.add_argument("checkpoint", help=ANY_CHECKPOINT_HELP)
    export.add_argument("--to", choices=("hf",), default="hf",
                        help="the format: hf, a transformers directory (safetensors, config, tokenizer files)")
    export.add_argument("--out", required=True, help="output HF directory (must not exist)")
    export.set_defaults(func=_export)

    info = subparsers.add_parser("info", help="print a checkpoint's config and parameter counts by module")
    info.add_argument("checkpoint", help=ANY_CHECKPOINT_HELP)
    info.set_defaults(func=_info)


def _new_out(out: str) -> None:
    if epath.Path(out).exists() or os.path.islink(out):
        raise ValueError(f"--out {out} already exists; choose a new directory")


def _convert(args: argparse.Namespace) -> int:
    from bertjax.checkpoint import save_model
    from bertjax.interop.load import load_pretrained
    from bertjax.runtime.outputs import one_writer, replaced_when_whole

    _new_out(args.out)
    if args.source == "hf":
        from bertjax.interop.hub import is_hub_id

        if not epath.Path(args.src).is_dir() and not is_hub_id(args.src):
            raise FileNotFoundError(f"HF model directory {args.src} does not exist")
    elif not epath.Path(args.src + ".index").exists():
        raise FileNotFoundError(f"TF checkpoint {args.src}.index does not exist (give the prefix, e.g. "
                                ".../bert_model.ckpt)")
    with one_writer(args.out, "--out"):
        _new_out(args.out)  # again, holding it: a run that just finished wrote it
        if args.source == "hf":
            loaded = load_pretrained(args.src)
        else:
            loaded = load_pretrained(args.src, config_path=args.config, vocab_path=args.vocab)
            loaded.lower_case = not args.cased
        with replaced_when_whole(args.out, directory=True) as partial:
            save_model(partial, loaded.params, loaded.config, loaded.vocab, loaded.lower_case, head=loaded.head,
                       tokenizer=loaded.tokenizer)
    from bertjax.model.family import counted_params

    counted = counted_params(loaded.params, loaded.config)
    print(f"wrote {args.out}: {_count(counted):,} parameters, modules {sorted(loaded.params)}")
    return 0


def _export(args: argparse.Namespace) -> int:
    from bertjax.checkpoint import resolve_checkpoint
    from bertjax.interop.hf import export_hf
    from bertjax.interop.load import load_pretrained
    from bertjax.interop.model_card import CARD, run_of, write_card
    from bertjax.runtime.outputs import one_writer, replaced_when_whole

    _new_out(args.out)
    with one_writer(args.out, "--out"):
        _new_out(args.out)  # again, holding it: a run that just finished wrote it
        source = resolve_checkpoint(args.checkpoint)
        loaded = load_pretrained(source)
        head = loaded.head or {}  # a fine-tune job's class and labels; otherwise inferred from the tensors held
        id2label = {int(i): label for i, label in head["id2label"].items()} if "id2label" in head else None
        # A job's checkpoint sits in its workdir (a fine-tune's <workdir>/checkpoint, pretraining's
        # <workdir>/checkpoints/<step>), beside the run's records.
        run_dir, step = run_of(source)
        with replaced_when_whole(args.out, directory=True) as partial:
            epath.Path(partial).mkdir()  # export_hf writes an existing directory in place
            architecture = export_hf(loaded.params, loaded.config, loaded.vocab, partial,
                                     lower_case=loaded.lower_case, architecture=head.get("architecture"),
                                     id2label=id2label, problem_type=head.get("problem_type"),
                                     squad=head.get("squad"), tokenizer=loaded.tokenizer,
                                     max_seq_length=head.get("max_seq_length"))
            write_card(partial, run_dir, step=step, source=source, name=epath.Path(args.out).name)
    card = str(epath.Path(args.out) / CARD)
    print(f"wrote {args.out} as {architecture} (from {source}), model card {card}")
    if "span_boundary" in loaded.params:
        from bertjax.interop.names import SBO_FILE

        print(f"note: the span boundary objective (SBO) head is not part of HF BERT; its weights are in "
              f"{args.out}/{SBO_FILE} (PyTorch layout), which transformers ignores")
    return 0


def _info(args: argparse.Namespace) -> int:
    from bertjax.checkpoint import resolve_checkpoint
    from bertjax.interop.hub import local_model_path
    from bertjax.interop.load import load_pretrained

    source = resolve_checkpoint(local_model_path(args.checkpoint))
    loaded = load_pretrained(source)
    print(f"checkpoint: {source}")
    for line in _run_summary(args.checkpoint):
        print(line)
    for key, value in loaded.config.to_dict().items():
        print(f"  {key}: {value}")
    if loaded.tokenizer is not None:
        print(f"tokenizer: its tokenizer.json ({_tokenizer_model(loaded.tokenizer, source)}), {len(loaded.vocab)} "
              "tokens")
    else:
        print(f"vocabulary: {len(loaded.vocab)} tokens (WordPiece), lower_case={loaded.lower_case}")
    from bertjax.model.family import counted_params

    counted = counted_params(loaded.params, loaded.config)
    print("parameters by module:")
    for module, count in parameter_counts(counted).items():
        print(f"  {module:<32} {count:>14,}")
    print(f"  {'total':<32} {_count(counted):>14,}")
    return 0


def _tokenizer_model(spec: dict, source: str) -> str:
    """The model kind a tokenizer.json names ("BPE", "WordPiece", "Unigram"...); `source`: the model holding it."""
    from bertjax.runtime import jsonio

    values = jsonio.loads(spec["json"], f"{source}'s tokenizer.json", "a tokenizer.json")
    model = values.get("model") if isinstance(values, dict) else None
    return str(model.get("type", "unknown model") if isinstance(model, dict) else "unknown model")


def _run_summary(run_dir: str) -> list[str]:
    """For a pretraining run directory: its progress (step of train.steps, completed or not) and the last logged
    training and eval metrics, from WORKDIR/config.json and metrics.jsonl (nothing for other checkpoints)."""
    from bertjax.checkpoint import COMPLETION_MARKER, complete_steps
    from bertjax.runtime.input_files import read_json
    from bertjax.interop.model_card import metric_records

    root = epath.Path(run_dir)
    if not (root / "metrics.jsonl").exists():
        return []
    records = metric_records(run_dir)
    steps = complete_steps(run_dir)
    total = read_json(root / "config.json", "the run's config")["train"]["steps"] if (root / "config.json").exists() \
        else None
    state = "completed" if (root / COMPLETION_MARKER).exists() else "not completed"
    lines = [f"run: newest checkpoint step {steps[-1] if steps else 'none'}"
             + (f" of {total:,}" if total else "") + f" ({state})"]
    shown = ("loss", "mlm_accuracy", "nsp_accuracy", "learning_rate", "mfu")
    train = [r for r in records if "loss" in r and "step" in r]
    if train:
        lines.append(f"  last logged step {train[-1]['step']}: " + ", ".join(
            f"{k}={train[-1][k]:.4g}" for k in shown if isinstance(train[-1].get(k), (int, float))))
    evals = [r for r in records if "eval_mlm_accuracy" in r and "step" in r]
    if evals:
        lines.append(f"  last eval at step {evals[-1]['step']}: " + ", ".join(
            f"{k}={v:.4g}" for k, v in evals[-1].items() if k.startswith("eval_") and isinstance(v, (int, float))))
    return lines


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
