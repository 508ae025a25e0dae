"""`bertjax data create`, `bertjax vocab train` and `bertjax demo-corpus`.

The data flags are derived from the fields of `bertjax.data.data_config` (one definition per option, shared with
the pretraining job's `data.*` keys). The jobs' modules import TensorFlow, so they are imported only when a
command runs: `bertjax --help` stays fast.
"""
from __future__ import annotations

import argparse

from bertjax import options
from bertjax.runtime.console import Console
from bertjax.runtime.extras import install_line
from bertjax.data.data_config import CorpusConfig, PretrainingDataConfig

# Options of the streaming pipeline only; `data create` writes one static pass per dupe.
_NOT_CREATE_FLAGS = ("input_kind", "masking", "num_epochs", "eval_input", "prefetch_batches")


def data_config_from_flags(args: argparse.Namespace) -> PretrainingDataConfig:
    """The data config `data create` runs with (static masking: the original's TFRecords); --format left out is
    `auto`, detected by the job (format_detect.resolve)."""
    return options.from_flags(PretrainingDataConfig, args, masking="static")


def _create(args: argparse.Namespace) -> int:
    if args.runner == "beam":
        if args.num_workers != 1 or args.worker_index != 0:
            raise ValueError("--runner beam spreads the work over Beam's workers itself: drop --worker-index/"
                             "--num-workers")
        try:
            from bertjax.data.beam_create import create_with_beam
        except ModuleNotFoundError as error:
            if (error.name or "").split(".")[0] != "apache_beam":
                raise
            raise ValueError(f"--runner beam needs Apache Beam (the `beam` extra): {install_line('beam')}") from None

        create_with_beam(data_config_from_flags(args), args.out, args.shards, runner=args.beam_runner,
                         beam_options=args.beam_option or [], overwrite=args.overwrite, log=Console().line,
                         verbose=args.verbose)
        return 0
    if args.beam_option or args.beam_runner != "DirectRunner":
        raise ValueError("--beam-runner/--beam-option need --runner beam")
    if args.worker_index >= args.num_workers:
        raise ValueError(f"--worker-index {args.worker_index} is not one of the {args.num_workers} workers' indices "
                         f"(0..{args.num_workers - 1})")
    from bertjax.data.create import create_pretraining_data

    create_pretraining_data(data_config_from_flags(args), args.out, args.shards, worker_index=args.worker_index,
                            num_workers=args.num_workers, overwrite=args.overwrite, log=Console().line)
    return 0


def _vocab_train(args: argparse.Namespace) -> int:
    from bertjax.data.vocab import train_vocab

    console = Console()
    vocab = train_vocab(options.from_flags(CorpusConfig, args), args.out, args.vocab_size, args.type,
                        lower_case=args.lower_case, max_sentences=args.max_sentences, min_count=args.min_count,
                        log=console.line)
    learned = vocab.size - vocab.unused
    line = f"wrote {vocab.path}: {vocab.size} tokens"
    if vocab.unused:
        line += f" ({learned} learned and {vocab.unused} [unused] ones, a multiple of 64)" + (
            f"; {learned}" if vocab.short_because else "")
    if vocab.short_because:
        line += f" of the {args.vocab_size} asked: {vocab.short_because}"
    console.line(line)
    return 0


def _demo_corpus(args: argparse.Namespace) -> int:
    from bertjax.data.demo_corpus import write_demo_corpus
    from bertjax.data.out_dir import owned

    with owned(args.out):
        train_path, eval_path = write_demo_corpus(args.out)
    Console().line(f"wrote {train_path} and {eval_path}")
    return 0


def register(subparsers) -> None:
    """Adds `data create`, `vocab train` and `demo-corpus`."""
    data = subparsers.add_parser("data", help="pretraining data: create (a corpus -> masked TFRecord shards)")
    data = data.add_subparsers(dest="data_command", required=True)
    create = data.add_parser("create", help="text corpus -> masked TFRecord shards (original BERT format)")
    options.add_flags(create, PretrainingDataConfig, exclude=_NOT_CREATE_FLAGS, required=("input", "vocab"))
    create.add_argument("--out", required=True, help="output directory (gs:// works)")
    create.add_argument("--shards", type=options.ints(1), default=1, help="TFRecord files the examples are spread over")
    create.add_argument("--worker-index", type=options.ints(0), default=0,
                        help="this worker's share of the input files (0 .. --num-workers - 1)")
    create.add_argument("--num-workers", type=options.ints(1), default=1,
                        help="the workers that share the input files, each run with its own --worker-index")
    create.add_argument("--overwrite", action="store_true",
                        help="replace an earlier run's shards in --out (removed once the new ones are complete)")
    create.add_argument("--runner", choices=("local", "beam"), default="local",
                        help="local: this machine (split by hand with --worker-index/--num-workers) | beam: an "
                        "Apache Beam pipeline (pipelines/beam_create.py), same records format and metadata")
    create.add_argument("--beam-runner", default="DirectRunner",
                        choices=("DirectRunner", "DataflowRunner", "FlinkRunner", "SparkRunner"),
                        help="--runner beam: where Beam runs the pipeline")
    create.add_argument("--beam-option", action="append", metavar="KEY=VALUE",
                        help="a Beam pipeline option, repeatable (e.g. project=P, region=R, temp_location=gs://..., "
                        "direct_num_workers=2)")
    create.set_defaults(func=_create)

    vocab = subparsers.add_parser("vocab", help="vocabularies: train (WordPiece, SentencePiece or byte-level BPE)")
    vocab = vocab.add_subparsers(dest="vocab_command", required=True)
    train = vocab.add_parser("train", help="train a WordPiece, SentencePiece or byte-level BPE (ModernBERT's kind) "
                             "vocab with BERT's special tokens")
    options.add_flags(train, CorpusConfig, required=("input",))
    train.add_argument("--lower-case", action=argparse.BooleanOptionalAction, default=None,
                       help="default: true for WordPiece, false for SentencePiece and BPE")
    train.add_argument("--vocab-size", type=options.ints(1), required=True,
                       help="the most tokens learned, the 5 special tokens included (BERT's English vocab: 30522; "
                       "ModernBERT's BPE: 50280); a small corpus may give fewer, and the closing line says how many "
                       "and why; bpe: then rounded up to a multiple of 64 with [unused0].. tokens")
    train.add_argument("--type", choices=("sentencepiece", "wordpiece", "bpe"), required=True,
                       help="wordpiece: vocab.txt (BERT's) | sentencepiece: spm.model (unigram) | bpe: tokenizer.json, "
                       "a byte-level BPE as ModernBERT's, with tokenizer_config.json beside it")
    train.add_argument("--out", required=True)
    train.add_argument("--max-sentences", type=options.ints(1), default=5_000_000,
                       help="read at most this many sentences of the corpus")
    train.add_argument("--min-count", type=options.ints(1), default=None,
                       help="wordpiece: keep only pieces seen at least this often (default 10); bpe: merge only pairs "
                       "seen at least this often (default 2); lower it on a small corpus for a larger vocabulary")
    train.set_defaults(func=_vocab_train)

    corpus = subparsers.add_parser("demo-corpus", help="write the embedded demo corpus (Python's reference "
                                   "help topics, shipped with CPython) in the original format")
    corpus.add_argument("--out", required=True, help="directory for train.txt and eval.txt")
    corpus.set_defaults(func=_demo_corpus)
