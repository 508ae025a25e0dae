"""`bertjax finetune glue | classify | embedding | squad | ner | features | multiple-choice`, `eval squad | embedding`,
`embed` (features of sentences), `predict` (a fine-tuned model on new text), `score` (a checkpoint's GLUE dev scores
by a named recipe).

The flags come from the fields of `bertjax.finetune.settings`; the jobs (JAX, TensorFlow) are imported only when a
command runs, so `bertjax --help` stays fast.
"""
from __future__ import annotations

import argparse

from bertjax import options
from bertjax.runtime import jsonio
from bertjax.runtime.console import route_logging_to_console
from bertjax.finetune.glue_data import TASKS
from bertjax.finetune.score import ScoreSettings
from bertjax.finetune.settings import EmbeddingSettings, NerSettings, SquadSettings, TrainSettings
from bertjax.finetune.table_data import PROBLEMS
from bertjax.interop.cli import ANY_CHECKPOINT_HELP

# Every fine-tune's --max-seq-length (an option that derives from it says so in its own help).
MAX_SEQ_HELP = "tokens per example, [CLS] and [SEP] included (a pair's two texts together); longer ones are cut"
INIT_HELP = ("checkpoint to start from: a bertjax run directory (its newest complete step) or step, an HF model "
             "directory or a TF checkpoint prefix")


def _add_train_args(parser: argparse.ArgumentParser, **job_defaults) -> None:
    parser.add_argument("--init", required=True, help=INIT_HELP)
    parser.add_argument("--workdir", required=True, help="output directory")
    options.add_flags(parser, TrainSettings, defaults=job_defaults)
    parser.add_argument("--save-checkpoint", action=argparse.BooleanOptionalAction, default=True,
                        help="keep the fine-tuned model as a bertjax checkpoint in WORKDIR/checkpoint (what `bertjax "
                             "predict --model WORKDIR` and another job's --init read); --no-save-checkpoint keeps none")
    parser.add_argument("--export-hf", action="store_true", help="write the fine-tuned model as an HF directory")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace the earlier run in --workdir (a rerun with the same settings resumes it "
                             "instead; other settings are refused without this)")


def register(subparsers) -> None:
    finetune = subparsers.add_parser(
        "finetune", help="fine-tune: classify (your own CSV/TSV/JSON Lines/Parquet files), embedding (your "
                         "pairs, a sentence-transformers model), glue, squad, ner (CoNLL-2003), multiple-choice "
                         "(SWAG); or features (a classifier on frozen features)")
    jobs = finetune.add_subparsers(dest="job", required=True)

    glue = jobs.add_parser("glue", help="fine-tune and evaluate GLUE tasks; writes dev metrics and submission TSVs")
    glue.add_argument("--task", required=True, choices=TASKS + ("all",))
    glue.add_argument("--data", required=True, help="GLUE directory (<Task>/train.tsv ...) or 'tfds[:DATA_DIR]'")
    glue.add_argument("--max-seq-length", type=options.ints(3), default=128, help=MAX_SEQ_HELP)
    glue.add_argument("--eval-each-epoch", action="store_true", help="also record dev metrics after every epoch")
    _add_train_args(glue, learning_rate=2e-5, batch_size=32, epochs=3.0)
    glue.set_defaults(func=_glue)

    classify = jobs.add_parser(
        "classify", help="fine-tune a sequence classifier on your own CSV/TSV/JSON Lines/Parquet files "
                         "(single-label, multi-label or regression); dev metrics and predictions")
    classify.add_argument("--train", required=True, help="training file: .csv, .tsv, .jsonl or .parquet, local or "
                                                         "gs://, with a header (CSV/TSV) naming the columns")
    classify.add_argument("--dev", help="file scored after training (its labels must be among the training file's)")
    classify.add_argument("--test", help="file to predict (labels not needed)")
    classify.add_argument("--text-column", default="text", help="the column holding the text")
    classify.add_argument("--text-pair-column", help="second text of a pair (e.g. NLI's hypothesis)")
    classify.add_argument("--label-column", default="label",
                          help="the column holding the label (multi-label: several, see --problem)")
    classify.add_argument("--problem", default="single_label_classification", choices=PROBLEMS,
                          help="multi-label: a list per row (JSON Lines, Parquet) or one string cut at "
                               "--label-separator; regression: numbers (Pearson/Spearman)")
    classify.add_argument("--label-separator", default=",", help="multi-label labels given as one string")
    classify.add_argument("--max-seq-length", type=options.ints(3), default=128, help=MAX_SEQ_HELP)
    classify.add_argument("--eval-each-epoch", action="store_true", help="also record dev metrics after every epoch")
    _add_train_args(classify, learning_rate=2e-5, batch_size=32, epochs=3.0)
    classify.set_defaults(func=_classify)

    embedding = jobs.add_parser(
        "embedding", help="fine-tune a sentence-embedding model on your own (anchor, positive[, negative]) pairs "
                          "(the multiple-negatives ranking loss over the global batch); a sentence-transformers "
                          "directory with --export-hf")
    embedding.add_argument("--train", required=True, help="training pairs: .csv, .tsv, .jsonl or .parquet, local, "
                                                          "with a header (CSV/TSV) naming the columns")
    embedding.add_argument("--dev", help="held-out pairs, scored at the end as retrieval: each anchor's positive "
                                          "among all their positives (recall@1/5/10, MRR@10, nDCG@10)")
    embedding.add_argument("--anchor-column", default="anchor", help="the column holding the anchor (query)")
    embedding.add_argument("--positive-column", default="positive", help="the column holding its positive")
    embedding.add_argument("--negative-column", default="negative",
                           help="the column holding a hard negative, read where the file has it")
    embedding.add_argument("--max-seq-length", type=options.ints(3), default=128,
                           help="tokens per text, [CLS] and [SEP] included; longer ones are cut")
    options.add_flags(embedding, EmbeddingSettings)
    _add_train_args(embedding, learning_rate=2e-5, batch_size=32, epochs=1.0)
    embedding.set_defaults(func=_embedding)

    features = jobs.add_parser(
        "features", help="frozen features + scikit-learn logistic regression (C by cross-validation on train); "
                         "GLUE dev metric")
    features.add_argument("--task", required=True, choices=TASKS)
    features.add_argument("--data", required=True, help="GLUE directory (<Task>/train.tsv ...) or 'tfds[:DATA_DIR]'")
    features.add_argument("--init", required=True, help=INIT_HELP)
    features.add_argument("--workdir", required=True, help="output directory (metrics.json, dev_predictions.tsv)")
    features.add_argument("--layers", default="last",
                          help="last | second-to-last | sum-last-4 | concat-last-4 | N[,M...] (0 = embeddings "
                               "output, as transformers' output_hidden_states)")
    features.add_argument("--pooling", choices=("cls", "mean"), default="cls",
                          help="cls: the [CLS] token's vector; mean: the mean of the tokens' vectors")
    features.add_argument("--classifier", choices=("logreg",), default="logreg",
                          help="logreg: LogisticRegressionCV (STS-B: RidgeCV)")
    features.add_argument("--max-train-examples", type=options.ints(1),
                          help="fit on a seeded random subset of this many training examples (CPU budgets)")
    features.add_argument("--max-eval-examples", type=options.ints(0), default=0,
                          help="score the first N dev examples of each split (0: all), for quick runs")
    features.add_argument("--max-seq-length", type=options.ints(3), default=128, help=MAX_SEQ_HELP)
    features.add_argument("--batch-size", type=options.ints(1), default=64,
                          help="sequences per feature-extraction step")
    features.add_argument("--cv-folds", type=options.ints(2), default=5,
                          help="cross-validation folds that choose the classifier's C (STS-B: the ridge's alpha)")
    features.add_argument("--seed", type=options.ints(0), default=42, help="training subset and CV folds")
    features.set_defaults(func=_features)

    choice = jobs.add_parser("multiple-choice", help="fine-tune on SWAG-layout CSVs (train.csv, val.csv, optional "
                                                     "test.csv); val accuracy and predictions")
    choice.add_argument("--data", required=True, help="directory with SWAG's train.csv and val.csv (test.csv optional)")
    choice.add_argument("--max-seq-length", type=options.ints(3), default=128,
                        help="tokens per choice (the context and one ending), [CLS] and [SEP] included")
    # The BERT paper's SWAG recipe: lr 2e-5, batch 16, 3 epochs.
    _add_train_args(choice, learning_rate=2e-5, batch_size=16, epochs=3.0)
    choice.set_defaults(func=_multiple_choice)

    squad = jobs.add_parser("squad", help="fine-tune on SQuAD 1.1/2.0 and predict (official JSON or tfds:squad/...)")
    squad.add_argument("--train", help="training file (omit to only predict with a QA checkpoint)")
    squad.add_argument("--predict", help="file to predict (scored when it has answers)")
    options.add_flags(squad, SquadSettings, required=("version",))
    _add_train_args(squad, learning_rate=3e-5, batch_size=12, epochs=2.0)
    squad.set_defaults(func=_squad)

    ner = jobs.add_parser("ner", help="fine-tune a token classifier on CoNLL-2003 (column format); writes entity "
                          "P/R/F1 (conlleval) on valid/test and CoNLL-format predictions")
    ner.add_argument("--data", required=True, help="directory with train.txt, valid.txt (and test.txt)")
    options.add_flags(ner, NerSettings)
    _add_train_args(ner, learning_rate=5e-5, batch_size=32, epochs=3.0)
    ner.set_defaults(func=_ner)

    embed = subparsers.add_parser(
        "embed", help="features of sentences (one per line): pooled vectors to .npy, or per-token vectors to .npz")
    embed.add_argument("--checkpoint", required=True, help=ANY_CHECKPOINT_HELP)
    embed.add_argument("--input", required=True, help="text file, one sentence per line (.gz, .zst, .bz2 read "
                                                      "decompressed)")
    embed.add_argument("--output", required=True,
                       help="cls/mean: .npy file for the float32 [sentences, D] matrix; none: .npz file of "
                            "per-token vectors and the word-to-token map (layout in bertjax/finetune/embed.py)")
    embed.add_argument("--layers", default="last",
                       help="last | second-to-last | sum-last-4 | concat-last-4 | N[,M...] (hidden states numbered "
                            "as transformers' output_hidden_states: 0 = embeddings output, -1 = last; a list is "
                            "concatenated in the order given)")
    embed.add_argument("--pooling", choices=("cls", "mean", "none"), default="cls",
                       help="none: every token's vector with a map from whitespace words to token positions")
    embed.add_argument("--max-len", type=options.ints(3), default=128,
                       help="tokens per sentence, [CLS] and [SEP] included; longer ones are cut")
    embed.add_argument("--batch-size", type=options.ints(1), default=64, help="sentences per step")
    embed.add_argument("--show-neighbours", action="store_true",
                       help="print each sentence's nearest neighbour by cosine similarity (cls/mean)")
    embed.set_defaults(func=_embed)

    predict = subparsers.add_parser(
        "predict", help="a fine-tuned classifier, regressor, token classifier or question-answering (span) model on "
                        "new text -> JSON Lines (the numbers of transformers' pipeline on its export)")
    predict.add_argument("--model", required=True, help="fine-tune workdir, exported HF directory or bertjax "
                                                        "checkpoint with a classifier or span head")
    predict.add_argument("--input", default="-", help=".csv, .tsv, .jsonl or .parquet file (local or gs://), or '-' "
                                                      "(default): one text per line on stdin")
    predict.add_argument("--output", default="-", help="JSON Lines file, or '-' (default): stdout")
    predict.add_argument("--text-column", help="the text's column (default: a `finetune classify` run's own, else "
                                               "'text')")
    predict.add_argument("--text-pair-column", help="second text of a pair (sequence classification; default: a "
                                                    "`finetune classify` run's own)")
    predict.add_argument("--question-column", default="question", help="a span model's question")
    predict.add_argument("--context-column", default="context", help="a span model's context (long ones: windows)")
    predict.add_argument("--max-seq-length", type=options.ints(3),
                         help="tokens per row (default: the length the model was fine-tuned at, else 128; a span "
                              "model: per window, as its SQuAD run, else 384)")
    predict.add_argument("--doc-stride", type=options.ints(1),
                         help="a span model: tokens between window starts (default: as its SQuAD run, else a "
                              "third of --max-seq-length)")
    predict.add_argument("--squad-version", choices=("1.1", "2.0"),
                         help="a span model: 2.0 answers \"\" when no answer wins (default: as its SQuAD run "
                              "recorded, in its workdir or its export's config.json; else 1.1)")
    predict.add_argument("--batch-size", type=options.ints(1), default=64, help="rows (a span model: windows) per "
                                                                                  "prediction step")
    predict.set_defaults(func=_predict)

    scored = subparsers.add_parser(
        "score", help="a checkpoint's GLUE dev scores: each task present fine-tuned by MosaicBERT's recipe, once per "
                      "seed; summary.json and summary.md beside the run")
    scored.add_argument("checkpoint", help=ANY_CHECKPOINT_HELP + " (a pretraining run: its newest complete step)")
    scored.add_argument("--glue", required=True, help="GLUE directory (<Task>/train.tsv, dev.tsv ...) or "
                                                       "'tfds[:DATA_DIR]'")
    scored.add_argument("--out", help="output directory (default: CHECKPOINT/scores for a pretraining run directory)")
    options.add_flags(scored, ScoreSettings)
    scored.add_argument("--overwrite", action="store_true",
                        help="run again the task/seed runs done with other settings (the same command again skips "
                             "finished runs and resumes an interrupted one; other settings are refused without this)")
    scored.set_defaults(func=_score)

    evaluate = subparsers.add_parser("eval", help="score predictions with the official metrics: squad; or a "
                                                  "checkpoint's sentence embeddings as retrieval and STS: embedding")
    evals = evaluate.add_subparsers(dest="job", required=True)
    squad_eval = evals.add_parser("squad", help="the official SQuAD v1.1 / v2.0 evaluation of a predictions file")
    squad_eval.add_argument("--data", required=True, help="dataset JSON (its 'version' picks v1.1 or v2.0)")
    squad_eval.add_argument("--predictions", required=True, help="predictions JSON {question id: answer text}")
    squad_eval.add_argument("--na-prob-file", help="v2.0: null odds / no-answer probabilities JSON")
    squad_eval.add_argument("--na-prob-thresh", type=options.floats(), default=1.0,
                            help="v2.0: a question whose no-answer probability is above this counts as answered "
                                 "\"\" (the official script's)")
    squad_eval.add_argument("--version", choices=("1.1", "2.0"), help="override the dataset's version")
    squad_eval.set_defaults(func=_eval_squad)

    embedding_eval = evals.add_parser(
        "embedding", help="a checkpoint's sentence embeddings scored without training: recall@1/5/10, MRR@10, "
                          "nDCG@10 of held-out SQuAD questions among the file's contexts, or of held-out pairs; "
                          "STS-B Spearman")
    embedding_eval.add_argument("--checkpoint", required=True, help=ANY_CHECKPOINT_HELP)
    embedding_eval.add_argument("--squad",
                                help="SQuAD 1.1/2.0 JSON: the answerable questions of half its articles (by a hash of "
                                     "the title) are the queries, every unique context a passage")
    embedding_eval.add_argument("--pairs", help="held-out (anchor, positive) pairs, as `finetune embedding --dev` "
                                                "reads and scores them: each anchor's positive among the distinct "
                                                "positives")
    embedding_eval.add_argument("--stsb", help="STS-B dev.tsv (GLUE layout): Spearman's rho of the pairs' cosine "
                                               "similarity against their gold scores")
    embedding_eval.add_argument("--output", required=True, help="directory for metrics.json and summary.md")
    embedding_eval.add_argument("--write-train-pairs", metavar="JSONL",
                                help="also write the other articles' (question, context) pairs as JSON Lines "
                                     "{anchor, positive}: what `finetune embedding --train` reads, no held-out "
                                     "question among them")
    embedding_eval.add_argument("--pooling", choices=("mean", "cls"), default="mean",
                                help="mean: the mean of the last layer's token vectors (sentence-transformers' "
                                     "models, all-MiniLM-L6-v2's); cls: the [CLS] vector")
    embedding_eval.add_argument("--max-seq-length", type=options.ints(3), default=256,
                                help="tokens per text, [CLS] and [SEP] included; longer ones are cut (256: "
                                     "all-MiniLM-L6-v2's, most SQuAD contexts whole)")
    embedding_eval.add_argument("--batch-size", type=options.ints(1), default=64, help="texts per step")
    embedding_eval.set_defaults(func=_eval_embedding)


def _embed(args: argparse.Namespace) -> int:
    import numpy as np
    from etils import epath

    from bertjax.data.file_readers import read_text_bytes
    from bertjax.finetune.embed import cut_lines, embed_sentences, embed_tokens, nearest_neighbours
    from bertjax.interop.load import load_pretrained
    from bertjax.runtime.outputs import check_file_target, one_writer, replaced_when_whole

    check_file_target(args.output, "--output", [args.input, args.checkpoint])
    if not epath.Path(args.input).exists():
        raise FileNotFoundError(f"--input {args.input} does not exist")
    sentences, invalid = input_lines(read_text_bytes(args.input, expected="one sentence per line (UTF-8 text)"))
    if not any(sentence.strip() for sentence in sentences):
        raise ValueError(f"--input {args.input} holds no sentences (one per line expected)")
    blank = sum(not sentence.strip() for sentence in sentences)
    if blank or invalid:
        print(f"--input {args.input}: {len(sentences)} lines, one row each" +
              (f"; {blank} blank line(s) embedded as the empty sequence [CLS] [SEP]" if blank else "") +
              (f"; {len(invalid)} line(s) with invalid UTF-8 (lines {', '.join(map(str, invalid[:5]))}"
               f"{', ...' if len(invalid) > 5 else ''}), their bad bytes read as U+FFFD" if invalid else ""))
    with one_writer(args.output, "--output"):
        loaded = load_pretrained(args.checkpoint)
        cut = cut_lines(loaded, sentences, args.max_len)
        if cut:  # embedded from their first tokens: said, not silent
            shown = ", ".join(map(str, cut[:5])) + (", ..." if len(cut) > 5 else "")
            print(f"--input {args.input}: {len(cut)} of {len(sentences)} line(s) longer than --max-len "
                  f"{args.max_len} tokens ([CLS] and [SEP] included), cut to it (lines {shown}); raise --max-len "
                  "to embed more of them")
        if args.pooling == "none":
            arrays = embed_tokens(loaded, sentences, layers=args.layers, max_len=args.max_len,
                                  batch_size=args.batch_size)
            with replaced_when_whole(args.output) as partial, epath.Path(partial).open(mode="wb") as f:
                np.savez(f, **arrays)  # a file object: np.savez would add .npz to any other suffix
            print(f"wrote {args.output}: {len(sentences)} sentences, {arrays['vectors'].shape[0]} tokens x "
                  f"{arrays['vectors'].shape[1]} float32, {arrays['word_spans'].shape[0]} words (layers "
                  f"{args.layers})")
            return 0
        vectors = embed_sentences(loaded, sentences, pooling=args.pooling, layers=args.layers,
                                  max_len=args.max_len, batch_size=args.batch_size)
        with replaced_when_whole(args.output) as partial, epath.Path(partial).open(mode="wb") as f:
            np.save(f, vectors)
    print(f"wrote {args.output}: {vectors.shape[0]} x {vectors.shape[1]} float32 ({args.pooling} pooling, "
          f"layers {args.layers})")
    if args.show_neighbours:
        for i, (j, similarity) in enumerate(nearest_neighbours(vectors)):
            print(f"  {similarity:5.3f}  {sentences[i]!r}  ->  {sentences[j]!r}")
    return 0


def _predict(args: argparse.Namespace) -> int:
    import sys

    if args.output == "-":  # stdout holds the JSON Lines alone: progress and notes go to stderr
        real_stdout, sys.stdout = sys.stdout, sys.stderr
        try:
            lines = _predicted_lines(args)
        finally:
            sys.stdout = real_stdout
        # A reader that stopped (`| head -1`): BrokenPipeError, which `bertjax` ends by SIGPIPE (cli.main).
        sys.stdout.writelines(lines)
        sys.stdout.flush()
        return 0
    from etils import epath

    from bertjax.runtime.outputs import check_file_target, one_writer, replaced_when_whole

    check_file_target(args.output, "--output", [args.input, args.model])
    with one_writer(args.output, "--output"):
        lines = _predicted_lines(args)
        with replaced_when_whole(args.output) as partial:
            epath.Path(partial).write_text("".join(lines), encoding="utf-8")
    print(f"wrote {args.output}: {len(lines)} rows")
    return 0


def _predicted_lines(args: argparse.Namespace) -> list[str]:
    """`bertjax predict`'s output lines for its --input (a table file, or stdin lines)."""
    import sys

    from bertjax.runtime.console import Console
    from bertjax.data.file_readers import read_text_bytes
    from bertjax.finetune.predict import Predictor, answers_questions, recorded_columns

    route_logging_to_console()
    # The input is read and checked before the model loads (a bad file fails in seconds); its columns depend on the
    # model's head, which the model's description tells without its tensors.
    spans = answers_questions(args.model)
    # A classify run's own columns where no flag names one: a run trained on `sentence` reads `sentence`.
    recorded = None if spans else recorded_columns(args.model)
    if recorded and args.input == "-" and recorded[1] and not args.text_pair_column:
        raise ValueError(f"{args.model} was trained on text pairs (columns {recorded[0]!r} and {recorded[1]!r}): give "
                         "an --input file with both columns (stdin holds one text a line)")
    if recorded and args.input != "-":
        taken = [f"--text-column {recorded[0]}"] if args.text_column is None and recorded[0] != "text" else []
        taken += [f"--text-pair-column {recorded[1]}"] if recorded[1] and args.text_pair_column is None else []
        args.text_column = args.text_column or recorded[0]
        args.text_pair_column = args.text_pair_column or recorded[1]
        if taken:
            Console().line(f"--input {args.input}: read as {args.model} was trained ({', '.join(taken)})")
    args.text_column = args.text_column or "text"
    if spans:
        if args.input == "-":
            raise ValueError(f"{args.model} answers questions: give an --input file with the columns "
                             f"{args.question_column!r} and {args.context_column!r} (stdin holds one text a line)")
        wheres, (questions, contexts) = _input_columns(args.input, [args.question_column, args.context_column])
        texts = None
    elif args.input == "-":
        texts, invalid = input_lines(read_text_bytes("stdin", sys.stdin.buffer.read(), "one text a line (UTF-8)"))
        if invalid:
            raise ValueError(f"stdin: line {invalid[0]} is not valid UTF-8")
        if not texts:
            raise ValueError("--input - holds no rows")
        if args.text_pair_column:
            raise ValueError("--text-pair-column needs an --input file with that column (stdin holds one text a line)")
        wheres, pairs = [f"stdin:{i + 1}" for i in range(len(texts))], None
        for where, text in zip(wheres, texts):  # as a file's empty text is: not scored as if it were a text
            if not text.strip():
                raise ValueError(f"{where}: the line is blank; expected one text a line")
    else:
        wheres, (texts, *pairs) = _input_columns(
            args.input, [args.text_column] + ([args.text_pair_column] if args.text_pair_column else []))
        pairs = pairs[0] if pairs else None
    predictor = Predictor(args.model, max_seq_length=args.max_seq_length, batch_size=args.batch_size,
                          doc_stride=args.doc_stride, version=args.squad_version)
    Console().line(f"{args.model}: {predictor.length_note}")
    rows = predictor.predict(texts, pairs, wheres) if texts is not None else \
        predictor.answers(questions, contexts, wheres)
    return [jsonio.dumps(row, ensure_ascii=False) + "\n" for row in rows]


def _input_columns(path: str, columns: list[str]) -> tuple[list[str], list[list[str]]]:
    """(where each row came from, each column's texts) of a table file; a missing column or a row without a text
    there is an error naming the file (and line) and the column."""
    from bertjax.finetune.table_data import non_blank_text, read_rows

    rows = read_rows(path, columns)
    if not rows:
        raise ValueError(f"--input {path} holds no rows")
    return [where for where, _ in rows], [[non_blank_text(where, row, column) for where, row in rows]
                                          for column in columns]


def input_lines(data: bytes) -> tuple[list[str], list[int]]:
    """The lines of an `embed` input, split at "\\n" only (a Windows "\\r\\n" too): row i of the output is line i,
    whatever else a line holds (U+2028, form feed and NEL, where Python's splitlines() would split, stay inside
    it). Also the 1-based numbers of the lines that are not valid UTF-8 (decoded with U+FFFD)."""
    raw = data.split(b"\n")
    if raw and raw[-1] == b"":  # the final newline ends the last line, it does not start another
        raw.pop()
    lines, invalid = [], []
    for number, line in enumerate(raw, start=1):
        line = line[:-1] if line.endswith(b"\r") else line
        try:
            lines.append(line.decode("utf-8"))
        except UnicodeDecodeError:
            invalid.append(number)
            lines.append(line.decode("utf-8", errors="replace"))
    return lines, invalid


def _say_outputs(workdir: str, fine_tuned: bool = True, predicts: bool | str = True) -> None:
    """The job's closing lines: what it left in its workdir (metrics, predictions, curves), then, for a job that
    fine-tunes (`fine_tuned`), where its model is (or that it kept none) and, for a head `bertjax predict` runs
    (`predicts` True), how it takes it; else (`predicts`: why) that it does not."""
    from etils import epath

    from bertjax.runtime.console import Console

    root = epath.Path(workdir)
    names = sorted(p.name + ("/" if p.is_dir() else "") for p in root.iterdir() if not p.name.startswith((".", "LOCK")))
    console = Console()
    console.line(f"outputs in {workdir}: {', '.join(names)}")
    if not fine_tuned:
        return
    # `glue --task all` keeps one model per task, in WORKDIR/<task>/.
    runs = [root] if (root / "metrics.json").exists() else sorted(
        p for p in root.iterdir() if p.is_dir() and (p / "metrics.json").exists())
    kinds = [name for name in ("checkpoint", "hf") if any((p / name).is_dir() for p in runs)]
    if not kinds:
        console.line("no fine-tuned model kept (--no-save-checkpoint; by default it is kept in WORKDIR/checkpoint)")
        return
    use = "another job's --init reads it" + (f"; {predicts}" if isinstance(predicts, str) else "")
    predicts = predicts is True
    if len(runs) == 1:
        use = f"`bertjax predict --model {runs[0]}` uses it" if predicts else use
        console.line(f"fine-tuned model: {' and '.join(str(runs[0] / k) for k in kinds)} ({use}; "
                     "--no-save-checkpoint keeps none)")
    else:
        use = f"`bertjax predict --model {workdir}/<task>` uses it" if predicts else use
        console.line(f"fine-tuned models: {' and '.join(f'{workdir}/<task>/{k}' for k in kinds)}, one per task "
                     f"({use}; --no-save-checkpoint keeps none)")


def _write_model_cards(workdir: str) -> None:
    """README.md (the Hub's model card) in each HF directory the run exported: WORKDIR/hf, or one per task of
    `glue --task all`, from the run's run.json and metrics.json."""
    from etils import epath

    from bertjax.interop.model_card import write_card

    root = epath.Path(workdir)
    for run_dir in [root, *(p for p in root.iterdir() if p.is_dir())]:
        if (run_dir / "hf" / "config.json").exists() and (run_dir / "metrics.json").exists():
            write_card(str(run_dir / "hf"), str(run_dir), record_dir=workdir)


# The arguments that name the files a fine-tune reads (their content is part of its run record).
INPUT_ARGS = ("data", "train", "dev", "test", "predict")
# Fine-tunes whose every output is written through epath/Orbax, so that their --workdir may be gs://. The others
# write with open() and would put a gs:// workdir under ./gs:/ on the local disk: they refuse it instead.
CLOUD_WORKDIR_JOBS = ("classify",)


def _check_workdir(args: argparse.Namespace) -> None:
    if "://" in args.workdir and args.job not in CLOUD_WORKDIR_JOBS:
        raise ValueError(f"--workdir {args.workdir}: finetune {args.job} writes its outputs to a local directory "
                         f"only (finetune {', '.join(CLOUD_WORKDIR_JOBS)} takes a gs:// workdir); give a local "
                         "directory and copy it to the bucket after")


def _owned_run(job):
    """A fine-tune command on the workdir it owns (run_record.py): refused for another run's workdir, resumed for
    its own unfinished one, not rerun when finished; stopped by a signal after saving its state (exit status
    preemption.STOPPED_EXIT). A workdir it created and failed in before saving a training state is removed
    (new_workdir.py)."""
    import functools

    @functools.wraps(job)
    def run(args: argparse.Namespace) -> int:
        from bertjax.runtime.console import Console
        from bertjax.runtime.new_workdir import removed_if_failed_before_saving
        from bertjax.runtime.workdir_lock import WorkdirLock
        from bertjax.runtime.workdir_paths import canonical

        _check_workdir(args)
        args.workdir = canonical(args.workdir)  # one spelling: recorded in run.json, compared on a rerun
        console = Console()
        lock = WorkdirLock(args.workdir, log=console.line)
        with removed_if_failed_before_saving(args.workdir, lambda: _has_saved_state(args.workdir), lock):
            lock.acquire()
            try:
                return _claimed_run(job, args, console)
            finally:
                lock.release()

    return run


def _has_saved_state(workdir: str) -> bool:
    """Whether a fine-tune workdir holds a training state to resume from."""
    from etils import epath

    from bertjax.checkpoint import complete_steps
    from bertjax.finetune.run_record import TRAIN_STATE

    return bool(complete_steps(str(epath.Path(workdir) / TRAIN_STATE)))


def _claimed_run(job, args: argparse.Namespace, console) -> int:
    from bertjax.finetune.run_record import claim
    from bertjax.runtime.input_files import input_fingerprints
    from bertjax.finetune.trainer import Preempted
    from bertjax.runtime.preemption import STOPPED_EXIT

    record = {k: v for k, v in vars(args).items() if k not in ("func", "command", "job")}
    record.update(input_fingerprints(getattr(args, name, None) for name in INPUT_ARGS))
    # `glue --task all` writes a folder per task, which an --overwrite clears with the rest.
    subruns = TASKS if args.job == "glue" and getattr(args, "task", None) == "all" else ()
    state = claim(args.workdir, {"job": args.job, **record}, overwrite=args.overwrite, log=console.line,
                  subruns=subruns)
    if state == "completed":
        console.line(f"{args.workdir} already holds this run, completed (its metrics are there); "
                     f"--overwrite runs it again")
        return 0
    try:
        code = job(args)
    except Preempted as stopped:
        console.line(str(stopped))
        return STOPPED_EXIT  # not 0: `finetune ... && predict ...` must not go on with a half-trained model
    _write_model_cards(args.workdir)
    return code


@_owned_run
def _glue(args: argparse.Namespace) -> int:
    from bertjax.finetune import glue

    route_logging_to_console()
    settings = options.from_flags(TrainSettings, args)
    common = dict(max_seq_length=args.max_seq_length, eval_each_epoch=args.eval_each_epoch,
                  save_checkpoint=args.save_checkpoint, export_hf=args.export_hf)
    if args.task == "all":
        summary = glue.run_all(args.data, args.workdir, settings, init=args.init, **common)
        _say_outputs(args.workdir)
        print(glue.summary_table(summary), end="")
        return 0
    result = glue.run_task(args.task, args.data, args.workdir, settings, init=args.init, **common)
    _say_outputs(args.workdir)
    print(jsonio.dumps({"task": result["task"], "metrics": result["metrics"], "score": result["score"]}))
    return 0


@_owned_run
def _classify(args: argparse.Namespace) -> int:
    from bertjax.finetune import classify
    from bertjax.finetune.table_data import TableSpec

    route_logging_to_console()
    spec = TableSpec(text_column=args.text_column, text_pair_column=args.text_pair_column,
                     label_column=args.label_column, problem=args.problem, label_separator=args.label_separator)
    result = classify.run(args.train, args.workdir, options.from_flags(TrainSettings, args), spec, init=args.init,
                          dev=args.dev, test=args.test, max_seq_length=args.max_seq_length,
                          eval_each_epoch=args.eval_each_epoch, save_checkpoint=args.save_checkpoint,
                          export_hf=args.export_hf)
    _say_outputs(args.workdir)
    print(jsonio.dumps({"problem": result["problem"], "labels": result["labels"], "metrics": result["metrics"]}))
    return 0


@_owned_run
def _embedding(args: argparse.Namespace) -> int:
    from bertjax.finetune import embedding

    route_logging_to_console()
    spec = embedding.PairSpec(args.anchor_column, args.positive_column, args.negative_column)
    result = embedding.run(args.train, args.workdir, options.from_flags(TrainSettings, args),
                           options.from_flags(EmbeddingSettings, args), spec,
                           init=args.init, dev=args.dev, max_seq_length=args.max_seq_length,
                           save_checkpoint=args.save_checkpoint, export_hf=args.export_hf)
    _say_outputs(args.workdir, predicts="`bertjax embed --checkpoint WORKDIR/checkpoint` embeds with it; WORKDIR/hf "
                                        "(--export-hf) is a sentence-transformers directory")
    print(jsonio.dumps(result["metrics"]))
    return 0


def _features(args: argparse.Namespace) -> int:
    from bertjax.finetune import features

    _check_workdir(args)
    route_logging_to_console()
    result = features.run_task(args.task, args.data, args.workdir, init=args.init, layers=args.layers,
                               pooling=args.pooling, classifier=args.classifier, max_seq_length=args.max_seq_length,
                               max_train_examples=args.max_train_examples,
                               max_eval_examples=args.max_eval_examples, batch_size=args.batch_size,
                               cv_folds=args.cv_folds, seed=args.seed)
    _say_outputs(args.workdir, fine_tuned=False)
    print(jsonio.dumps({k: result[k] for k in ("task", "metrics", "score", "layers", "pooling",
                                              "num_train_examples")}))
    return 0


@_owned_run
def _multiple_choice(args: argparse.Namespace) -> int:
    from bertjax.finetune import multiple_choice

    route_logging_to_console()
    result = multiple_choice.run(args.data, args.workdir, options.from_flags(TrainSettings, args), init=args.init,
                                 max_seq_length=args.max_seq_length, save_checkpoint=args.save_checkpoint,
                                 export_hf=args.export_hf)
    _say_outputs(args.workdir, predicts="`bertjax predict` runs no multiple-choice head: this job scores the "
                                        "test.csv beside its train.csv")
    print(jsonio.dumps(result["metrics"]))
    return 0


@_owned_run
def _squad(args: argparse.Namespace) -> int:
    from bertjax.finetune import squad

    route_logging_to_console()
    result = squad.run(args.workdir, options.from_flags(TrainSettings, args), options.from_flags(SquadSettings, args),
                       init=args.init, train_file=args.train, predict_file=args.predict,
                       save_checkpoint=args.save_checkpoint, export_hf=args.export_hf)
    _say_outputs(args.workdir)
    print(jsonio.dumps(result.get("metrics", {})))
    return 0


@_owned_run
def _ner(args: argparse.Namespace) -> int:
    from bertjax.finetune import ner

    route_logging_to_console()
    result = ner.run(args.data, args.workdir, options.from_flags(TrainSettings, args),
                     options.from_flags(NerSettings, args), init=args.init, save_checkpoint=args.save_checkpoint,
                     export_hf=args.export_hf)
    _say_outputs(args.workdir)
    print(jsonio.dumps({split: m["overall"] for split, m in result["metrics"].items()}))
    return 0


def _score(args: argparse.Namespace) -> int:
    import os

    from bertjax.finetune import score
    from bertjax.runtime.console import Console
    from bertjax.runtime.workdir_paths import canonical

    route_logging_to_console()
    settings = options.from_flags(ScoreSettings, args)
    if args.out is None and not os.path.isdir(os.path.join(args.checkpoint, "checkpoints")):
        raise ValueError(f"{args.checkpoint} is not a pretraining run directory (WORKDIR, whose scores/ it would "
                         "hold): give --out DIR")
    out = canonical(args.out or os.path.join(args.checkpoint, "scores"))
    if "://" in out:
        raise ValueError(f"--out {out}: scores are written to a local directory only; give one with --out")
    summary = score.score(args.checkpoint, args.glue, out, settings, overwrite=args.overwrite, log=Console().line)
    Console().line(f"scores in {out}: summary.json, summary.md")
    print(score.summary_table(summary), end="")
    return 0


def _eval_squad(args: argparse.Namespace) -> int:
    from bertjax.finetune.squad_metrics import evaluate_file

    print(jsonio.dumps(evaluate_file(args.data, args.predictions, args.na_prob_file, args.na_prob_thresh, args.version),
                     indent=2))
    return 0


def _eval_embedding(args: argparse.Namespace) -> int:
    import os

    from bertjax.finetune import retrieval
    from bertjax.finetune.embed import cut_lines, embed_sentences
    from bertjax.interop.load import load_pretrained
    from bertjax.runtime.console import Console
    from bertjax.runtime.outputs import check_file_target, one_writer, write_whole

    route_logging_to_console()
    console = Console()
    from bertjax.finetune.embedding import PairSpec, read_pairs

    inputs = [path for path in (args.squad, args.pairs, args.stsb) if path]
    if not inputs:
        raise ValueError("eval embedding: nothing to score; give --squad, --pairs and/or --stsb")
    if args.write_train_pairs and not args.squad:
        raise ValueError("--write-train-pairs writes SQuAD's training articles: it needs --squad")
    if os.path.exists(args.output) and not os.path.isdir(args.output):
        raise ValueError(f"--output {args.output} is a file; expected a directory (metrics.json, summary.md)")
    if args.write_train_pairs:
        check_file_target(args.write_train_pairs, "--write-train-pairs", inputs)
    # Both sets are read and checked before the model loads: a bad file fails in seconds.
    squad = retrieval.squad_retrieval_set(args.squad) if args.squad else None
    pairs = read_pairs(args.pairs, PairSpec()) if args.pairs else None
    stsb = retrieval.stsb_pairs(args.stsb) if args.stsb else None
    os.makedirs(args.output, exist_ok=True)
    with one_writer(os.path.join(args.output, "metrics.json"), "--output", log=console.line):
        if args.write_train_pairs:
            retrieval.write_train_pairs(squad.train_pairs, args.write_train_pairs)
            console.line(f"wrote {args.write_train_pairs}: {len(squad.train_pairs)} (question, context) pairs of "
                         f"{len(squad.train_titles)} article(s) ({', '.join(squad.train_titles) or 'none'})")
        loaded = load_pretrained(args.checkpoint)

        def embedded(texts: list[str], what: str):
            cut = cut_lines(loaded, texts, args.max_seq_length)
            if cut:  # embedded from their first tokens: said, not silent
                console.line(f"{len(cut)} of {len(texts)} {what} longer than --max-seq-length {args.max_seq_length} "
                             "tokens, cut to it")
            return embed_sentences(loaded, texts, pooling=args.pooling, max_len=args.max_seq_length,
                                   batch_size=args.batch_size)

        metrics = {"checkpoint": args.checkpoint, "pooling": args.pooling, "max_seq_length": args.max_seq_length}
        if squad is not None:
            metrics["squad"] = {"file": args.squad, "queries": len(squad.queries), "passages": len(squad.passages),
                                "heldout_titles": squad.heldout_titles, "train_titles": squad.train_titles,
                                "scores": retrieval.retrieval_scores(embedded(squad.queries, "questions"),
                                                                     embedded(squad.passages, "contexts"),
                                                                     squad.positives)}
        if pairs is not None:
            passages, positives = retrieval.distinct_passages(pairs.positives)
            metrics["pairs"] = {"file": args.pairs, "queries": len(pairs.anchors), "passages": len(passages),
                                "scores": retrieval.retrieval_scores(embedded(pairs.anchors, "anchors"),
                                                                     embedded(passages, "positives"), positives)}
        if stsb is not None:
            metrics["stsb"] = {"file": args.stsb, "pairs": len(stsb), "spearman": retrieval.sts_spearman(
                embedded(stsb.text_a, "first sentences"), embedded(stsb.text_b, "second sentences"), stsb.labels)}
        write_whole(os.path.join(args.output, "metrics.json"), jsonio.dumps(metrics, indent=2) + "\n")
        write_whole(os.path.join(args.output, "summary.md"), retrieval.summary_markdown(metrics))
    console.line(f"scores in {args.output}: metrics.json, summary.md")
    print(retrieval.summary_markdown(metrics), end="")
    return 0
