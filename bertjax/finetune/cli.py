"""`bertjax finetune glue | finetune squad | finetune ner | eval squad`.

The flags come from the fields of `bertjax.finetune.settings`; the jobs (JAX, TensorFlow) are imported only when a
command runs, so `bertjax --help` stays fast.
"""
from __future__ import annotations

import argparse
import json
import logging

from bertjax import options
from bertjax.finetune.glue_data import TASKS
from bertjax.finetune.settings import NerSettings, SquadSettings, TrainSettings


def _add_train_args(parser: argparse.ArgumentParser, **job_defaults) -> None:
    parser.add_argument("--init", required=True, help="bertjax checkpoint, HF model directory or TF checkpoint prefix")
    parser.add_argument("--workdir", required=True, help="output directory")
    options.add_flags(parser, TrainSettings, defaults=job_defaults)
    parser.add_argument("--save-checkpoint", action="store_true", help="write the fine-tuned bertjax checkpoint")
    parser.add_argument("--export-hf", action="store_true", help="write the fine-tuned model as an HF directory")


def register(subparsers) -> None:
    finetune = subparsers.add_parser("finetune", help="fine-tune on GLUE, SQuAD or CoNLL-2003 NER")
    jobs = finetune.add_subparsers(dest="job", required=True)

    glue = jobs.add_parser("glue", help="fine-tune and evaluate GLUE tasks; writes dev metrics and submission TSVs")
    glue.add_argument("--task", required=True, choices=TASKS + ("all",))
    glue.add_argument("--data", required=True, help="GLUE directory (<Task>/train.tsv ...) or 'tfds[:DATA_DIR]'")
    glue.add_argument("--max-seq-length", type=int, default=128)
    glue.add_argument("--eval-each-epoch", action="store_true", help="also record dev metrics after every epoch")
    _add_train_args(glue, learning_rate=2e-5, batch_size=32, epochs=3.0)
    glue.set_defaults(func=_glue)

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

    evaluate = subparsers.add_parser("eval", help="score predictions with the official metrics")
    evals = evaluate.add_subparsers(dest="job", required=True)
    squad_eval = evals.add_parser("squad", help="the official SQuAD v1.1 / v2.0 evaluation of a predictions file")
    squad_eval.add_argument("--data", required=True, help="dataset JSON (its 'version' picks v1.1 or v2.0)")
    squad_eval.add_argument("--predictions", required=True, help="predictions JSON {question id: answer text}")
    squad_eval.add_argument("--na-prob-file", help="v2.0: null odds / no-answer probabilities JSON")
    squad_eval.add_argument("--na-prob-thresh", type=float, default=1.0)
    squad_eval.add_argument("--version", choices=("1.1", "2.0"), help="override the dataset's version")
    squad_eval.set_defaults(func=_eval_squad)


def _quiet_logs() -> None:
    """Progress (per-epoch loss, wall time) at INFO on stderr. The level is set on the "bertjax" logger, not the
    root: importing absl (TF, Orbax) later resets the root level to WARNING."""
    logging.basicConfig(format="%(asctime)s %(name)s: %(message)s")
    logging.getLogger("bertjax").setLevel(logging.INFO)


def _glue(args: argparse.Namespace) -> int:
    from bertjax.finetune import glue

    _quiet_logs()
    settings = options.from_flags(TrainSettings, args)
    common = dict(max_seq_length=args.max_seq_length, eval_each_epoch=args.eval_each_epoch,
                  save_checkpoint=args.save_checkpoint, export_hf=args.export_hf)
    if args.task == "all":
        summary = glue.run_all(args.data, args.workdir, settings, init=args.init, **common)
        print(glue.summary_table(summary), end="")
        return 0
    result = glue.run_task(args.task, args.data, args.workdir, settings, init=args.init, **common)
    print(json.dumps({"task": result["task"], "metrics": result["metrics"], "score": result["score"]}))
    return 0


def _squad(args: argparse.Namespace) -> int:
    from bertjax.finetune import squad

    _quiet_logs()
    result = squad.run(args.workdir, options.from_flags(TrainSettings, args), options.from_flags(SquadSettings, args),
                       init=args.init, train_file=args.train, predict_file=args.predict,
                       save_checkpoint=args.save_checkpoint, export_hf=args.export_hf)
    print(json.dumps(result.get("metrics", {})))
    return 0


def _ner(args: argparse.Namespace) -> int:
    from bertjax.finetune import ner

    _quiet_logs()
    result = ner.run(args.data, args.workdir, options.from_flags(TrainSettings, args),
                     options.from_flags(NerSettings, args), init=args.init, save_checkpoint=args.save_checkpoint,
                     export_hf=args.export_hf)
    print(json.dumps({split: m["overall"] for split, m in result["metrics"].items()}))
    return 0


def _eval_squad(args: argparse.Namespace) -> int:
    from bertjax.finetune.squad import eval_file

    print(json.dumps(eval_file(args.data, args.predictions, args.na_prob_file, args.na_prob_thresh, args.version),
                     indent=2))
    return 0
