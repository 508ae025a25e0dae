"""`bertjax finetune glue | finetune squad | eval squad`."""
from __future__ import annotations

import argparse
import json
import logging

from bertjax.finetune.glue_data import TASKS


def _add_train_args(parser: argparse.ArgumentParser, lr: float, batch: int, epochs: float) -> None:
    parser.add_argument("--init", required=True, help="bertjax checkpoint, HF model directory or TF checkpoint prefix")
    parser.add_argument("--workdir", required=True, help="output directory")
    parser.add_argument("--learning-rate", type=float, default=lr)
    parser.add_argument("--batch-size", type=int, default=batch)
    parser.add_argument("--epochs", type=float, default=epochs)
    parser.add_argument("--warmup-proportion", type=float, default=0.1)
    parser.add_argument("--weight-decay", type=float, default=0.01)
    parser.add_argument("--max-grad-norm", type=float, default=1.0)
    parser.add_argument("--eval-batch-size", type=int, default=64)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--save-checkpoint", action="store_true", help="write the fine-tuned bertjax checkpoint")
    parser.add_argument("--export-hf", action="store_true", help="write the fine-tuned model as an HF directory")


def register(subparsers) -> None:
    finetune = subparsers.add_parser("finetune", help="fine-tune on GLUE or SQuAD")
    jobs = finetune.add_subparsers(dest="job", required=True)

    glue = jobs.add_parser("glue", help="fine-tune and evaluate GLUE tasks; writes dev metrics and submission TSVs")
    glue.add_argument("--task", required=True, choices=TASKS + ("all",))
    glue.add_argument("--data", required=True, help="GLUE directory (<Task>/train.tsv ...) or 'tfds[:DATA_DIR]'")
    glue.add_argument("--max-seq-length", type=int, default=128)
    glue.add_argument("--eval-each-epoch", action="store_true", help="also record dev metrics after every epoch")
    _add_train_args(glue, lr=2e-5, batch=32, epochs=3.0)
    glue.set_defaults(func=_glue)

    squad = jobs.add_parser("squad", help="fine-tune on SQuAD 1.1/2.0 and predict (official JSON or tfds:squad/...)")
    squad.add_argument("--version", choices=("1.1", "2.0"), required=True)
    squad.add_argument("--train", help="training file (omit to only predict with a QA checkpoint)")
    squad.add_argument("--predict", help="file to predict (scored when it has answers)")
    squad.add_argument("--max-seq-length", type=int, default=384)
    squad.add_argument("--doc-stride", type=int, default=128)
    squad.add_argument("--max-query-length", type=int, default=64)
    squad.add_argument("--n-best-size", type=int, default=20)
    squad.add_argument("--max-answer-length", type=int, default=30)
    squad.add_argument("--null-score-diff-threshold", type=float, default=0.0)
    _add_train_args(squad, lr=3e-5, batch=12, epochs=2.0)
    squad.set_defaults(func=_squad)

    evaluate = subparsers.add_parser("eval", help="score predictions with the official metrics")
    evals = evaluate.add_subparsers(dest="job", required=True)
    squad_eval = evals.add_parser("squad", help="the official SQuAD v1.1 / v2.0 evaluation of a predictions file")
    squad_eval.add_argument("--data", required=True, help="dataset JSON (its 'version' picks v1.1 or v2.0)")
    squad_eval.add_argument("--predictions", required=True, help="predictions JSON {question id: answer text}")
    squad_eval.add_argument("--na-prob-file", help="v2.0: null odds / no-answer probabilities JSON")
    squad_eval.add_argument("--na-prob-thresh", type=float, default=1.0)
    squad_eval.add_argument("--version", choices=("1.1", "2.0"), help="override the dataset's version")
    squad_eval.set_defaults(func=_eval_squad)


def _settings(args: argparse.Namespace):
    from bertjax.finetune.trainer import TrainSettings  # imports jax: only when a job runs

    return TrainSettings(learning_rate=args.learning_rate, batch_size=args.batch_size, epochs=args.epochs,
                         warmup_proportion=args.warmup_proportion, weight_decay=args.weight_decay,
                         max_grad_norm=args.max_grad_norm, seed=args.seed, eval_batch_size=args.eval_batch_size)


def _quiet_logs() -> None:
    """Progress (per-epoch loss, wall time) at INFO on stderr. The level is set on the "bertjax" logger, not the
    root: importing absl (TF, Orbax) later resets the root level to WARNING."""
    logging.basicConfig(format="%(asctime)s %(name)s: %(message)s")
    logging.getLogger("bertjax").setLevel(logging.INFO)


def _glue(args: argparse.Namespace) -> int:
    from bertjax.finetune import glue

    _quiet_logs()
    common = dict(max_seq_length=args.max_seq_length, eval_each_epoch=args.eval_each_epoch,
                  save_checkpoint=args.save_checkpoint, export_hf=args.export_hf)
    if args.task == "all":
        summary = glue.run_all(args.data, args.workdir, _settings(args), init=args.init, **common)
        print(glue.summary_table(summary), end="")
        return 0
    result = glue.run_task(args.task, args.data, args.workdir, _settings(args), init=args.init, **common)
    print(json.dumps({"task": result["task"], "metrics": result["metrics"], "score": result["score"]}))
    return 0


def _squad(args: argparse.Namespace) -> int:
    from bertjax.finetune import squad

    _quiet_logs()
    settings = squad.SquadSettings(version=args.version, max_seq_length=args.max_seq_length,
                                   doc_stride=args.doc_stride, max_query_length=args.max_query_length,
                                   n_best_size=args.n_best_size, max_answer_length=args.max_answer_length,
                                   null_score_diff_threshold=args.null_score_diff_threshold)
    result = squad.run(args.workdir, _settings(args), settings, init=args.init, train_file=args.train,
                       predict_file=args.predict, save_checkpoint=args.save_checkpoint, export_hf=args.export_hf)
    print(json.dumps(result.get("metrics", {})))
    return 0


def _eval_squad(args: argparse.Namespace) -> int:
    from bertjax.finetune.squad import eval_file

    print(json.dumps(eval_file(args.data, args.predictions, args.na_prob_file, args.na_prob_thresh, args.version),
                     indent=2))
    return 0
