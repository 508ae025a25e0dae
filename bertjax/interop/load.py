"""Loading any checkpoint a job starts from: a bertjax checkpoint, an HF directory or a TF checkpoint prefix."""
from __future__ import annotations

import jax
import numpy as np
from etils import epath

from bertjax.checkpoint import (
    ModelCheckpoint,
    is_model_checkpoint,
    load_description,
    load_model,
    read_vocab_file,
    resolve_checkpoint,
)
from bertjax.runtime.console import Console
from bertjax.data.host_tokenizer import HostWordPieceTokenizer
from bertjax.data.json_tokenizer import HostJsonTokenizer, spec_differences
from bertjax.data.token_layout import Tokenizer
from bertjax.interop.hf import hf_head, hf_num_labels, load_hf, read_tokenizer
from bertjax.interop.hub import local_model_path
from bertjax.interop.tf import load_tf
from bertjax.model import family
from bertjax.model.config import BertConfig


def detect_format(src: str) -> str:
    """"bertjax", "hf" or "tf" for a checkpoint path (a TF checkpoint is given by its prefix)."""
    path = epath.Path(src)
    if is_model_checkpoint(src):
        return "bertjax"
    if path.is_dir() and (path / "config.json").exists():
        return "hf"
    if epath.Path(src + ".index").exists():
        return "tf"
    raise FileNotFoundError(f"{src} is neither a bertjax checkpoint (a step, or a run directory with complete "
                            "steps), an HF model directory (config.json + weights) nor a TF checkpoint prefix "
                            "(<prefix>.index)")


def load_pretrained(src: str, config_path: str | None = None, vocab_path: str | None = None) -> ModelCheckpoint:
    """Params, config and vocab from any supported checkpoint (a run directory: its newest complete step; a
    Hugging Face hub id: its files in the hub cache, downloaded where a network is available).

    A TF checkpoint takes its bert_config.json and vocab.txt from `config_path` / `vocab_path`, defaulting to
    the files beside the prefix, as Google's releases lay them out. Weights that are not finite are refused
    (check_finite).
    """
    src = resolve_checkpoint(local_model_path(src))
    checkpoint = _loaded(src, config_path, vocab_path)
    check_finite(checkpoint.params, src)
    return checkpoint


def _loaded(src: str, config_path: str | None, vocab_path: str | None) -> ModelCheckpoint:
    kind = detect_format(src)
    if kind == "bertjax":
        checkpoint = load_model(src)
        check_head(checkpoint.head, checkpoint.params, f"{src} (its head item)")
        return checkpoint
    if kind == "hf":
        params, config, vocab, lower_case, spec = load_hf(src)
        check_vocab_fits(len(vocab), embedding_rows(params), f"{src}/{'tokenizer.json' if spec else 'vocab.txt'}",
                         src, quiet=spec is not None)
        checkpoint = ModelCheckpoint(params, config, vocab, lower_case, hf_head(src), spec)
        check_head({**(checkpoint.head or {}), "num_labels": hf_num_labels(src)}, params, f"{src}/config.json")
        return checkpoint
    folder = epath.Path(src).parent
    params, config = load_tf(src, config_path or str(folder / "bert_config.json"))
    vocab_file = vocab_path or str(folder / "vocab.txt")
    vocab = read_vocab_file(vocab_file)
    check_vocab_fits(len(vocab), embedding_rows(params), vocab_file, src)
    return ModelCheckpoint(params, config, vocab, _tf_lower_case(src))


def check_finite(params: dict, source: str) -> None:
    """Weights that are NaN or infinite (a run that diverged and was saved, a damaged file) are refused at load,
    naming the first such tensor and how many of its values are: read as they are, every embedding and prediction
    came out NaN, with exit status 0."""
    leaves = jax.tree_util.tree_flatten_with_path(params)[0]
    for path, value in leaves:
        value = np.asarray(value)
        if not np.issubdtype(value.dtype, np.floating) or np.isfinite(value).all():
            continue
        name = "/".join(str(getattr(key, "key", key)) for key in path)
        nan, inf = int(np.isnan(value).sum()), int(np.isinf(value).sum())
        bad = sum(1 for _, v in leaves if np.issubdtype(np.asarray(v).dtype, np.floating)
                  and not np.isfinite(np.asarray(v)).all())
        raise ValueError(f"{source}: tensor {name} holds {nan:,} NaN and {inf:,} infinite values of {value.size:,}"
                         + (f" ({bad} tensors hold some)" if bad > 1 else "") + "; the weights are damaged (a "
                         "run that diverged before it was saved?): use another checkpoint")


# The heads whose outputs are labels (a multiple-choice head's one output scores a choice).
_LABELLED_HEADS = ("BertForSequenceClassification", "BertForTokenClassification")


def check_head(head: dict | None, params: dict, where: str) -> None:
    """A classifier head (`params`' classifier) that contradicts its description `head` is refused, naming both
    (`where`: the description): id2label or num_labels naming another number of labels than the classifier has
    outputs, a regression problem on more than one output, a single-label one on fewer than two. Read as the
    description says, one of two logits was reported as a score, and a label `LABEL_1` invented."""
    head = head or {}
    if head.get("architecture") not in _LABELLED_HEADS or "classifier" not in params:
        return
    outputs = int(params["classifier"]["bias"].shape[0])
    has = f"its classifier has {outputs} output{'s' if outputs != 1 else ''} (classifier bias [{outputs}])"
    problems = []
    id2label = head.get("id2label")
    if id2label is not None and sorted(id2label, key=str) != sorted(str(i) for i in range(outputs)):
        shown = ", ".join(f"{k}: {v!r}" for k, v in list(id2label.items())[:4]) + (", ..." if len(id2label) > 4
                                                                                   else "")
        problems.append(f"id2label of {len(id2label)} label(s) ({shown})")
    if head.get("num_labels") is not None and head["num_labels"] != outputs:
        problems.append(f"num_labels {head['num_labels']}")
    problem_type = head.get("problem_type")
    if head["architecture"] == "BertForSequenceClassification" and problem_type:
        if problem_type == "regression" and outputs != 1:
            problems.append("problem_type regression (one output: a number)")
        if problem_type == "single_label_classification" and outputs < 2:
            problems.append("problem_type single_label_classification (two outputs or more)")
    if problems:
        raise ValueError(f"{where} says {', '.join(problems)}, but {has}: read as described, its outputs would be "
                         "reported as something they are not; export the model again, or correct the description")


def embedding_rows(params: dict) -> int:
    """The rows of a model's word-embedding table (BERT's word embeddings, ModernBERT's token embeddings)."""
    embeddings = params["bert"]["embeddings"]
    if "tok_embeddings" in embeddings:
        return embeddings["tok_embeddings"].shape[0]
    return embeddings["word_embeddings"]["embedding"].shape[0]


def check_vocab_fits(vocab_size: int, rows: int, vocab_file: str, weights: str, quiet: bool = False) -> None:
    """The vocabulary's ids must all have a word-embedding row (`rows` of them): more tokens than rows is an error
    (those ids would read outside the table: NaN features, NaN losses); fewer is legal (HF pads tables) and said
    once (`quiet`: not said, for a tokenizer.json, whose padded tables are the rule). The one check of every job
    that pairs a vocabulary with a model (fine-tune, embed, pretrain)."""
    if vocab_size > rows:
        raise ValueError(f"{vocab_file} has {vocab_size} tokens but the word embeddings of {weights} have {rows} "
                         f"rows: ids {rows}..{vocab_size - 1} have no embedding; use the vocab the checkpoint was "
                         f"trained with")
    if vocab_size < rows and not quiet:
        Console().line(f"note: {vocab_file} has {vocab_size} tokens, the word embeddings of {weights} {rows} rows: "
                       f"the last {rows - vocab_size} rows are never used")


def check_init_tokenizer(checkpoint: ModelCheckpoint, source: str, vocab_file: str, spec: dict | None) -> None:
    """A job that starts from `checkpoint` (`source`: as named) and tokenises its data with `vocab_file` (`spec`:
    its tokenizer.json spec; None for a vocab.txt or a SentencePiece model): where the checkpoint has its own
    tokenizer.json, anything but that tokenizer is refused, naming both. Its embedding rows were trained for its own
    tokens: other ids would train them on other words, with no error anywhere."""
    if checkpoint.tokenizer is None:
        return  # a WordPiece vocabulary: compared token by token where the weights are loaded (a warning)
    if spec is None:
        raise ValueError(f"data.vocab={vocab_file} is not a tokenizer.json, but --init {source} has its own "
                         f"tokenizer.json, which its embeddings were trained with: leave data.vocab unset to "
                         f"tokenise the data with it")
    differences = spec_differences(checkpoint.tokenizer, spec)
    if differences:
        raise ValueError(f"data.vocab={vocab_file} is not the tokenizer.json of --init {source} (they differ in: "
                         f"{', '.join(differences)}), which its embeddings were trained with: leave data.vocab "
                         f"unset to tokenise the data with it")


def describe_pretrained(src: str) -> ModelCheckpoint:
    """What `load_pretrained(src)` would give, less the tensors (`params` is None): config, vocab, lower-casing."""
    src = resolve_checkpoint(local_model_path(src))
    kind = detect_format(src)
    if kind == "bertjax":
        return load_description(src)
    folder = epath.Path(src) if kind == "hf" else epath.Path(src).parent
    if kind == "hf":
        vocab, lower_case, spec = read_tokenizer(src)
        return ModelCheckpoint(None, family.config_from_json_file(str(folder / "config.json")), vocab, lower_case,
                               hf_head(src), spec)
    return ModelCheckpoint(None, BertConfig.from_json_file(str(folder / "bert_config.json")),
                           read_vocab_file(str(folder / "vocab.txt")), _tf_lower_case(src))


def _tf_lower_case(prefix: str) -> bool:
    # Google's uncased releases lower-case; cased ones say so in their directory name.
    return "cased" not in epath.Path(prefix).parent.name.replace("uncased", "")


def load_init(src: str) -> tuple[ModelCheckpoint, Tokenizer]:
    """A checkpoint to start a job from (any format `load_pretrained` reads) and its own tokenizer (on the host:
    fine-tuning tokenises its data once, before it trains)."""
    checkpoint = load_pretrained(src)
    return checkpoint, checkpoint_tokenizer(checkpoint, src)


def checkpoint_tokenizer(checkpoint: ModelCheckpoint, source: str) -> Tokenizer:
    """A checkpoint's own tokenizer on the host: its tokenizer.json where it has one, else WordPiece on its vocab."""
    if checkpoint.tokenizer is not None:
        return HostJsonTokenizer.from_spec(checkpoint.tokenizer, source)
    return HostWordPieceTokenizer(checkpoint.vocab, lower_case=checkpoint.lower_case, source=source)
