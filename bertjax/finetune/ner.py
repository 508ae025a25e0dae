"""The CoNLL-2003 NER job: fine-tune a token classifier on train.txt, score valid.txt and test.txt.

Writes to the workdir: predictions_{valid,test}.txt (`word gold predicted` per line, a blank line between
sentences: conlleval's input), metrics.json (entity-level precision/recall/F1 per type and overall as conlleval
computes them, per split; per-epoch loss and wall time; the labels and settings), labels.json, and optionally the
model (bertjax checkpoint / HF BertForTokenClassification with id2label).
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import time

from bertjax.runtime import jsonio
from bertjax.finetune import ner_data, ner_metrics
from bertjax.finetune.settings import NerSettings, TrainSettings, check_metric_for_best
from bertjax.finetune.trainer import (
    Trainer,
    token_classification_loss,
    write_fine_tuned,
)
from bertjax.interop.load import load_init
from bertjax.model import family
from bertjax.runtime.outputs import open_whole

log = logging.getLogger(__name__)


def run(data: str, workdir: str, settings: TrainSettings, ner: NerSettings, *, init: str, loaded=None,
        save_checkpoint: bool = False, export_hf: bool = False) -> dict:
    """Fine-tune and evaluate; returns the metrics.json content. `loaded`: (checkpoint, tokenizer) already read."""
    splits = ner_data.read_conll_dir(data)
    train = splits["train"]  # settings.max_train_examples subsets its windows in the Trainer
    eval_sentences = {split: splits[split].head(settings.max_eval_examples) for split in ("valid", "test")
                      if split in splits and (split != "test" or settings.predict_test)}
    check_metric_for_best(settings, list(ner_metrics.entity_scores([["B-X"]], [["B-X"]])["overall"])
                          if "valid" in eval_sentences else None)
    ckpt, tokenizer = loaded if loaded is not None else load_init(init)
    ckpt.config.check_length(ner.max_seq_length, "--max-seq-length")
    os.makedirs(workdir, exist_ok=True)
    started = time.perf_counter()

    labels = ner_data.label_list(dataclasses.replace(train, tags=[ner_data.iob1_to_iob2(t) for t in train.tags]))
    window = dict(max_seq_length=ner.max_seq_length, doc_stride=ner.doc_stride)
    train_features = ner_data.featurize(train, tokenizer, labels, **window)
    log.info("train: %d sentences -> %d windows, %d labels", len(train), len(train_features), len(labels))
    trainer = Trainer(family.token_classifier(ckpt.config, len(labels)), ckpt.config, ckpt.params,
                      token_classification_loss, settings, source=init)
    eval_features = {split: ner_data.featurize(sentences, tokenizer, None, **window)
                     for split, sentences in eval_sentences.items()}

    def predict(split: str) -> list:
        logits = trainer.predict(eval_features[split].arrays, per_token=True)
        return ner_data.decode(eval_features[split], logits, eval_sentences[split], labels)

    def evaluate_valid() -> dict:
        overall = ner_metrics.entity_scores(eval_sentences["valid"].tags, predict("valid"))["overall"]
        return {k: float(v) for k, v in overall.items()}

    train_info = trainer.train(train_features.arrays, workdir=workdir,
                               evaluate=evaluate_valid if "valid" in eval_sentences else None)

    metrics = {}
    for split, sentences in eval_sentences.items():
        predicted = predict(split)
        ner_data.write_predictions(os.path.join(workdir, f"predictions_{split}.txt"), sentences, predicted)
        metrics[split] = ner_metrics.entity_scores(sentences.tags, predicted)
        overall = metrics[split]["overall"]
        log.info("%s: precision %.4f recall %.4f F1 %.4f (%d sentences, %d windows)", split, overall["precision"],
                 overall["recall"], overall["f1"], len(sentences), len(eval_features[split]))

    write_fine_tuned(trainer.params, ckpt, workdir, bertjax_checkpoint=save_checkpoint, hf=export_hf,
                     architecture="BertForTokenClassification", id2label=dict(enumerate(labels)),
                     max_seq_length=ner.max_seq_length)
    result = {"metrics": metrics, "labels": labels, "num_train_sentences": len(train),
              "num_train_windows": train_info.pop("num_train_rows"),
              "num_train_windows_available": len(train_features), "settings": dataclasses.asdict(settings),
              "ner_settings": dataclasses.asdict(ner), **train_info,
              "seconds_per_epoch": [h["seconds"] for h in train_info["history"]],
              "total_seconds": time.perf_counter() - started, "init": init}
    with open_whole(os.path.join(workdir, "labels.json"), "w", encoding="utf-8") as f:
        json.dump(labels, f)
    with open_whole(os.path.join(workdir, "metrics.json"), "w", encoding="utf-8") as f:
        jsonio.dump(result, f, indent=2)
    return result
