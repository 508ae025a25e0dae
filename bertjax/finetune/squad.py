"""The SQuAD fine-tuning job (v1.1 / v2.0): train on one official-format file, predict and score another.

Writes to the workdir: predictions.json, nbest_predictions.json, null_odds.json (v2.0), metrics.json (the
official metrics when the predict file has answers; for v2.0 also best_f1/best_f1_thresh, searched exactly over
the best non-null answers), and optionally the model (bertjax checkpoint / HF BertForQuestionAnswering).
"""
from __future__ import annotations

import dataclasses
import logging
import os
import time

from bertjax.runtime import jsonio
from bertjax.finetune import squad_data, squad_metrics
from bertjax.finetune.settings import SquadSettings, TrainSettings, check_metric_for_best
from bertjax.finetune.squad_postprocess import predict_answers
from bertjax.finetune.trainer import Trainer, span_loss, write_fine_tuned
from bertjax.interop.load import load_init
from bertjax.model import family
from bertjax.runtime.outputs import open_whole

log = logging.getLogger(__name__)


def best_threshold(dataset: list, best_non_null: dict[str, str], null_odds: dict[str, float]) -> dict:
    """The official best_exact/best_f1 sweep, run on the answers the model gives when it does answer.

    (Sweeping over predictions already thresholded, as the official script is usually fed, undercounts
    questions whose answer was suppressed.)
    """
    qid_to_has_ans = squad_metrics.make_qid_to_has_ans(dataset)
    exact_raw, f1_raw = squad_metrics.get_raw_scores(dataset, best_non_null)
    out = {}
    squad_metrics.find_all_best_thresh(out, best_non_null, exact_raw, f1_raw, null_odds, qid_to_has_ans)
    return out


def score(data: dict, preds: dict, null_odds: dict, best_non_null: dict, version_2: bool) -> dict:
    """The official metrics of `preds` on the dataset JSON `data` (v2.0: also the best threshold's)."""
    version = "2.0" if version_2 else "1.1"
    metrics = squad_metrics.evaluate(data, preds, null_odds if version_2 else None, version=version)
    if version_2:
        metrics.update(best_threshold(data["data"], best_non_null, null_odds))
    return metrics


def metric_names(data: dict, version_2: bool) -> list[str]:
    """What the job's evaluation names: the numbers `score` gives for empty answers to `data`'s questions."""
    empty = {qa["id"]: "" for article in data["data"] for p in article["paragraphs"] for qa in p["qas"]}
    metrics = score(data, empty, dict.fromkeys(empty, 0.0), empty, version_2)
    return [k for k, v in metrics.items() if isinstance(v, (int, float))]


def first_questions(data: dict, n: int) -> dict:
    """The SQuAD JSON with only its first `n` questions (all of them for n = 0); emptied paragraphs and articles
    are dropped."""
    if not n:
        return data
    articles = []
    for article in data["data"]:
        paragraphs = []
        for paragraph in article["paragraphs"]:
            qas = paragraph["qas"][:n]
            n -= len(qas)
            if qas:
                paragraphs.append({**paragraph, "qas": qas})
        if paragraphs:
            articles.append({**article, "paragraphs": paragraphs})
    return {**data, "data": articles}


def run(workdir: str, train_settings: TrainSettings, squad: SquadSettings, *, init: str, train_file: str | None,
        predict_file: str | None, save_checkpoint: bool = False, export_hf: bool = False) -> dict:
    if not train_file and not predict_file:
        raise ValueError("nothing to do: give --train and/or --predict")
    if predict_file:  # the files read and checked before the checkpoint loads
        predict_data = first_questions(squad_data.load_squad_json(predict_file), train_settings.max_eval_examples)
        scored = any(qa.get("answers") or qa.get("is_impossible") for a in predict_data["data"]
                     for p in a["paragraphs"] for qa in p["qas"])
    if train_file:
        data = squad_data.load_squad_json(train_file)
        check_metric_for_best(train_settings, metric_names(predict_data, squad.version_2)
                              if predict_file and scored else None)
    ckpt, tokenizer = load_init(init)
    ckpt.config.check_length(squad.max_seq_length, "--max-seq-length")
    if not train_file and "qa_outputs" not in ckpt.params:
        raise ValueError(f"{init} has no span head (qa_outputs); give --train to fine-tune one")
    os.makedirs(workdir, exist_ok=True)
    trainer = Trainer(family.question_answering(ckpt.config), ckpt.config, ckpt.params, span_loss, train_settings,
                      source=init)
    featurize = dict(max_seq_length=squad.max_seq_length, doc_stride=squad.doc_stride,
                     max_query_length=squad.max_query_length)
    result: dict = {"settings": dataclasses.asdict(squad), "train_settings": dataclasses.asdict(train_settings),
                    "init": init}
    if predict_file:
        predict_examples, predict_feats = squad_data.featurize(predict_data, tokenizer, ckpt.lower_case, False,
                                                               squad.version_2, source=predict_file, **featurize)

    def predict() -> tuple:
        start_logits, end_logits = trainer.predict(predict_feats.arrays(), per_token=True)
        started = time.perf_counter()
        answers = predict_answers(predict_examples, predict_feats, start_logits, end_logits, squad.n_best_size,
                                  squad.max_answer_length, squad.version_2, squad.null_score_diff_threshold)
        return answers, time.perf_counter() - started

    def evaluate() -> dict:
        (preds, _, null_odds, best_non_null), _ = predict()
        metrics = score(predict_data, preds, null_odds, best_non_null, squad.version_2)
        return {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float))}

    if train_file:
        examples, feats = squad_data.featurize(data, tokenizer, ckpt.lower_case, True, squad.version_2,
                                               source=train_file, **featurize)
        log.info("train: %d questions -> %d windows", len(examples), len(feats))
        result.update(trainer.train(feats.arrays(), workdir=workdir,
                                    evaluate=evaluate if predict_file and scored else None),
                      num_train_examples=len(examples), num_train_windows_available=len(feats))
        result["num_train_windows"] = result.pop("num_train_rows")
        result["seconds_per_epoch"] = [h["seconds"] for h in result["history"]]
    if predict_file:
        (preds, nbest, null_odds, best_non_null), seconds = predict()
        result["postprocess_seconds_per_1k_questions"] = 1000.0 * seconds / max(len(predict_examples), 1)
        _write_json(os.path.join(workdir, "predictions.json"), preds)
        _write_json(os.path.join(workdir, "nbest_predictions.json"), nbest)
        if squad.version_2:
            _write_json(os.path.join(workdir, "null_odds.json"), null_odds)
        if scored:
            # printed once, as JSON, by the command
            result["metrics"] = score(predict_data, preds, null_odds, best_non_null, squad.version_2)
    write_fine_tuned(trainer.params, ckpt, workdir, bertjax_checkpoint=save_checkpoint, hf=export_hf,
                     architecture="BertForQuestionAnswering", squad=dataclasses.asdict(squad))
    _write_json(os.path.join(workdir, "metrics.json"), result)
    return result


def _write_json(path: str, value) -> None:
    with open_whole(path, "w", encoding="utf-8") as f:
        jsonio.dump(value, f, indent=2, ensure_ascii=False)
