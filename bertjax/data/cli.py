"""`bertjax data create` and `bertjax vocab train`."""
from __future__ import annotations

import argparse

# Kept literal (= bertjax.data.corpus.FORMATS) so that building the parser does not import TensorFlow.
FORMATS = ("sentences", "paragraphs", "wikitext", "wrapped")


def _add_corpus_args(parser: argparse.ArgumentParser):
    parser.add_argument("--input", action="append", required=True,
                        help="glob, comma-separated list or tfds:NAME[:SPLIT]; repeatable")
    parser.add_argument("--format", default="sentences", choices=FORMATS,
                        help="sentences: one per line, blank line between documents (the original format)")
    parser.add_argument("--tfds-data-dir", default=None)
    parser.add_argument("--text-field", default="text", help="TFDS feature holding the text")
    parser.add_argument("--max-line-chars", type=int, default=100_000, help="longer lines are truncated (counted)")
    case = parser.add_mutually_exclusive_group()
    case.add_argument("--lower-case", dest="lower_case", action="store_true", default=None)
    case.add_argument("--no-lower-case", dest="lower_case", action="store_false")


def _create(args) -> int:
    from bertjax.data.create import create_pretraining_data
    from bertjax.data.pipeline import PretrainingDataConfig

    config = PretrainingDataConfig(
        inputs=tuple(args.input), vocab_path=args.vocab, lower_case=args.lower_case, corpus_format=args.format,
        max_seq_length=args.max_seq_length, max_predictions_per_seq=args.max_predictions,
        masked_lm_prob=args.masked_lm_prob, short_seq_prob=args.short_seq_prob,
        next_sentence_prediction=not args.no_nsp, whole_word_masking=args.whole_word_masking, masking="static",
        dupe_factor=args.dupe_factor, doc_buffer_size=args.doc_buffer, shuffle_buffer=args.shuffle_buffer,
        seed=args.seed, tfds_text_field=args.text_field, tfds_data_dir=args.tfds_data_dir,
        max_line_chars=args.max_line_chars)
    create_pretraining_data(config, args.out, args.shards, worker_index=args.worker_index,
                            num_workers=args.num_workers)
    return 0


def _vocab_train(args) -> int:
    from bertjax.data.corpus import CorpusConfig
    from bertjax.data.vocab import train_vocab

    config = CorpusConfig(inputs=tuple(args.input), format=args.format, text_field=args.text_field,
                          tfds_data_dir=args.tfds_data_dir, max_line_chars=args.max_line_chars)
    path = train_vocab(config, args.out, args.vocab_size, args.type, lower_case=args.lower_case,
                       max_sentences=args.max_sentences)
    print(f"wrote {path}")
    return 0


def register(subparsers) -> None:
    """Adds `data create` and `vocab train`."""
    data = subparsers.add_parser("data", help="pretraining data jobs").add_subparsers(dest="data_command",
                                                                                       required=True)
    create = data.add_parser("create", help="text corpus -> masked TFRecord shards (original BERT format)")
    _add_corpus_args(create)
    create.add_argument("--vocab", required=True, help="vocab.txt (WordPiece) or SentencePiece .model")
    create.add_argument("--out", required=True, help="output directory (gs:// works)")
    create.add_argument("--max-seq-length", type=int, default=128)
    create.add_argument("--max-predictions", type=int, default=20, help="max_predictions_per_seq")
    create.add_argument("--masked-lm-prob", type=float, default=0.15)
    create.add_argument("--short-seq-prob", type=float, default=0.1)
    create.add_argument("--dupe-factor", type=int, default=10)
    create.add_argument("--shards", type=int, default=1)
    create.add_argument("--whole-word-masking", action="store_true")
    create.add_argument("--no-nsp", action="store_true", help="RoBERTa-style full-sentence packing, no NSP pairs")
    create.add_argument("--doc-buffer", type=int, default=1000, help="documents per block (bounds memory)")
    create.add_argument("--shuffle-buffer", type=int, default=10_000, help="instances")
    create.add_argument("--seed", type=int, default=12345)
    create.add_argument("--worker-index", type=int, default=0, help="this worker's share of the input files")
    create.add_argument("--num-workers", type=int, default=1)
    create.set_defaults(func=_create)

    vocab = subparsers.add_parser("vocab", help="vocabularies").add_subparsers(dest="vocab_command", required=True)
    train = vocab.add_parser("train", help="train a WordPiece or SentencePiece vocab with BERT's special tokens")
    _add_corpus_args(train)
    train.add_argument("--vocab-size", type=int, required=True)
    train.add_argument("--type", choices=("sentencepiece", "wordpiece"), required=True)
    train.add_argument("--out", required=True)
    train.add_argument("--max-sentences", type=int, default=5_000_000)
    train.set_defaults(func=_vocab_train)
