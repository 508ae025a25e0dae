"""`bertjax predict`: a fine-tuned model on new text, as JSON Lines, with the numbers of transformers' pipeline.

The model is a fine-tune workdir (its hf/ export, else its checkpoint/), an exported HF directory or a bertjax
checkpoint with a head. Rows are batched on the mesh by the fine-tuning Trainer's predict (progress included).
- sequence classification: `label`, `score` and `scores` per label (softmax; sigmoid and `labels` over 0.5 for
  multi-label; the value as `score` for regression), as pipeline("text-classification", top_k=None);
- token classification: `entities`, each {entity_group, score, word, start, end} with character offsets, as
  pipeline("token-classification", aggregation_strategy="first"): a word takes its first piece's label and score,
  adjacent words of one type (B- opens a new one) form an entity with their mean score. Words are BERT's
  pre-tokens: runs of word characters, and each other non-space character alone;
- question answering (spans): `answer`, `score`, `start`, `end` per (question, context), the SQuAD job's answer
  (its windows and best-span rule, and for SQuAD 2.0 its null-score rule: "" when no answer wins) with character
  offsets into the context and the score of transformers' former pipeline("question-answering"). The decoding
  settings are those the SQuAD run recorded in its metrics.json, else those its model carries (an export's
  config.json `squad_settings`, a checkpoint's head): a SQuAD 2.0 export needs no --squad-version.
"""
from __future__ import annotations

import dataclasses
import re

import jax
import numpy as np
from etils import epath

from bertjax.finetune import classify, squad_data
from bertjax.finetune.run_record import MODELS, RUN_RECORD
from bertjax.finetune.settings import SquadSettings, TrainSettings
from bertjax.finetune.squad_postprocess import answer_spans
from bertjax.finetune.trainer import Trainer
from bertjax.interop.load import describe_pretrained, load_init
from bertjax.model import family

# A fine-tuned head's task (by BERT's class name, either family) -> its module for (config, num_labels).
HEADS = {"BertForSequenceClassification": family.sequence_classifier,
         "BertForTokenClassification": family.token_classifier,
         "BertForQuestionAnswering": lambda config, num_labels: family.question_answering(config)}
SPANS = "BertForQuestionAnswering"
MULTIPLE_CHOICE = "BertForMultipleChoice"
_MULTIPLE_CHOICE_REFUSED = ("{model}: a multiple-choice model (finetune multiple-choice): `bertjax predict` runs "
                            "classifiers, token classifiers and span models; the multiple-choice job scores the "
                            "test.csv beside its train.csv")
_WORD = re.compile(r"\w+|[^\w\s]")


def resolve_model(model: str) -> str:
    """A fine-tune workdir's model (hf/, else checkpoint/), or `model` itself; a workdir that kept neither is an
    error saying so."""
    root = epath.Path(model)
    for name in ("hf", "checkpoint"):
        if (root / name).is_dir():
            return str(root / name)
    if (root / RUN_RECORD).exists():
        raise FileNotFoundError(f"{model} is a fine-tune run that kept no model (no checkpoint/ or hf/: it ran with "
                                "--no-save-checkpoint): rerun its command with --overwrite and without that flag")
    return model


def recorded_columns(model: str) -> tuple[str | None, str | None] | None:
    """(text column, text pair column) that the `finetune classify` run `model` (its workdir, or the checkpoint/ or
    hf/ in it) was trained on, from its metrics.json or run.json; None for any other model."""
    root = epath.Path(model)
    for run in (root, root.parent) if root.name in MODELS else (root,):
        for name, read in (("metrics.json", lambda r: r.get("columns")), (RUN_RECORD, lambda r: r)):
            path = run / name
            record = read(squad_data.read_json(str(path), f"a fine-tune's {name}")) if path.is_file() else None
            if isinstance(record, dict) and isinstance(record.get("text_column"), str):
                return record["text_column"], record.get("text_pair_column") or None
    return None


def answers_questions(model: str) -> bool:
    """Whether `model` (as `--model` takes it) has a span head, told by its description (no tensors loaded); a
    head `predict` does not run (multiple choice) is refused here, before the input is read."""
    architecture = (describe_pretrained(resolve_model(model)).head or {}).get("architecture")
    if architecture == MULTIPLE_CHOICE:
        raise ValueError(_MULTIPLE_CHOICE_REFUSED.format(model=model))
    return architecture == SPANS


def squad_settings(model: str, head: dict | None = None, **overrides) -> SquadSettings:
    """The SQuAD settings a fine-tune workdir's run recorded (metrics.json), else those its model carries (`head`'s
    "squad": an export's config.json, a checkpoint's head), else the job's defaults; `overrides` that are not
    None win."""
    recorded = epath.Path(model) / "metrics.json"
    settings = squad_data.read_json(str(recorded), "a fine-tune's metrics.json").get("settings", {}) \
        if recorded.is_file() else {}
    settings = settings or (head or {}).get("squad") or {}
    known = {field.name for field in dataclasses.fields(SquadSettings)}
    settings = {k: v for k, v in settings.items() if k in known}
    return SquadSettings(**{**settings, **{k: v for k, v in overrides.items() if v is not None}})


# What `predict` takes for a model that records no length it was trained at (one fine-tuned before runs recorded it).
DEFAULT_MAX_SEQ_LENGTH = 128


def trained_length(model: str, head: dict | None) -> tuple[int, str] | None:
    """(the --max-seq-length the fine-tune of `model` trained at, where that was read): the model's own record (a
    checkpoint's head, an export's config.json `max_seq_length`), else its run's run.json (`model` a fine-tune
    workdir, or the checkpoint/ or hf/ in one); None where neither says."""
    if isinstance((head or {}).get("max_seq_length"), int):
        return head["max_seq_length"], "the length it was fine-tuned at, recorded with the model"
    root = epath.Path(model)
    for run in (root, root.parent) if root.name in MODELS else (root,):
        path = run / RUN_RECORD
        record = squad_data.read_json(str(path)) if path.is_file() else None
        if isinstance(record, dict) and isinstance(record.get("max_seq_length"), int):
            return record["max_seq_length"], f"the length its run was fine-tuned at ({path})"
    return None


class Predictor:
    """A fine-tuned classifier, token classifier or span (question-answering) model, ready to predict batches.

    max_seq_length: None for the length the model was fine-tuned at (`trained_length`; a span model: its SQuAD
    settings' window), else DEFAULT_MAX_SEQ_LENGTH. A span model's settings are squad_settings(model, **squad):
    SquadSettings fields to override, None for the recorded one. `length_note` says which length it took and why."""

    def __init__(self, model: str, *, max_seq_length: int | None = None, batch_size: int = 64, **squad):
        self.source = resolve_model(model)
        ckpt, self.tokenizer = load_init(self.source)
        head = ckpt.head or {}
        self.architecture = head.get("architecture")
        self.spans = self.architecture == SPANS
        # BERT's span head is `qa_outputs`, ModernBERT's `classifier` (HF's names).
        if self.architecture == MULTIPLE_CHOICE:
            raise ValueError(_MULTIPLE_CHOICE_REFUSED.format(model=model))
        if self.architecture not in HEADS or not {"qa_outputs", "classifier"} & set(ckpt.params):
            raise ValueError(f"{model}: no fine-tuned classifier, token classifier or span head (architecture "
                             f"{self.architecture!r}); `bertjax predict` needs a model a fine-tune job wrote")
        given = max_seq_length
        if self.spans:
            self.squad = squad_settings(model, head, **squad, max_seq_length=max_seq_length)
            max_seq_length, self.lower_case = self.squad.max_seq_length, ckpt.lower_case
            why = "the window of its SQuAD settings"
            module = family.question_answering(ckpt.config)
        else:
            if given is None:
                max_seq_length, why = trained_length(model, head) or (
                    DEFAULT_MAX_SEQ_LENGTH, "the default: the model records no length it was fine-tuned at")
            num_labels = int(np.shape(ckpt.params["classifier"]["bias"])[0])
            self.id2label = [head.get("id2label", {}).get(str(i), f"LABEL_{i}") for i in range(num_labels)]
            self.problem = head.get("problem_type") or (
                "regression" if num_labels == 1 else "single_label_classification")
            module = HEADS[self.architecture](ckpt.config, num_labels)
        ckpt.config.check_length(max_seq_length, "--max-seq-length")
        self.max_seq_length = max_seq_length
        self.length_note = f"--max-seq-length {max_seq_length} ({'as given' if given is not None else why})"
        # batch_size: the Trainer's check that it divides over the devices applies to both fields.
        settings = TrainSettings(batch_size=batch_size, eval_batch_size=batch_size)
        self.trainer = Trainer(module, ckpt.config, ckpt.params, loss_fn=None, settings=settings, source=self.source)
        self.trainer.predict_flag = "--batch-size"

    def predict(self, texts: list[str], pairs: list[str] | None = None, wheres: list[str] | None = None) -> list[dict]:
        """One JSON-ready dict per text (a span model answers questions: `answers`)."""
        if self.spans:
            raise ValueError(f"{self.source} answers questions: it takes a question and a context a row, not texts")
        wheres = wheres or [str(i + 1) for i in range(len(texts))]
        if self.architecture == "BertForSequenceClassification":
            encoded = self.tokenizer.encode(texts, self.max_seq_length, text_pairs=pairs)
            logits = np.asarray(self.trainer.predict(encoded), np.float32)
            rows = classify.prediction_rows(self.problem, logits, self.id2label, wheres)
            for row in rows:
                if "label" in row:
                    row["score"] = row["scores"][row["label"]]
            return rows
        return [{"where": where, **entities} for where, entities in zip(wheres, self._entities(texts))]

    def answers(self, questions: list[str], contexts: list[str], wheres: list[str]) -> list[dict]:
        """A span model's answer to each question in its context, by the SQuAD job's windows and decoding."""
        # Each row as one SQuAD paragraph with one question (its id: where it came from).
        dataset = {"data": [{"paragraphs": [{"context": context, "qas": [{"id": where, "question": question}]}]}
                            for question, context, where in zip(questions, contexts, wheres)]}
        s = self.squad
        examples, features = squad_data.featurize(
            dataset, self.tokenizer, self.lower_case, False, s.version_2, max_seq_length=s.max_seq_length,
            doc_stride=s.doc_stride, max_query_length=s.max_query_length, source="--input")
        start_logits, end_logits = self.trainer.predict(features.arrays(), per_token=True)
        spans = answer_spans(examples, features, start_logits, end_logits, s.n_best_size, s.max_answer_length,
                             s.version_2, s.null_score_diff_threshold)
        return [{"where": where, **span} for where, span in zip(wheres, spans)]

    def _entities(self, texts: list[str]) -> list[dict]:
        words = [[(m.start(), m.end()) for m in _WORD.finditer(text)] for text in texts]
        flat = [text[s:e] for text, spans in zip(texts, words) for s, e in spans]
        after_space = [s > 0 and text[s - 1].isspace() for text, spans in zip(texts, words) for s, _ in spans]
        lists = self.tokenizer.word_lists(flat, after_space) if flat else [[]]
        splits = np.concatenate([[0], np.cumsum([len(ids) for ids in lists])]).astype(np.int64)
        pieces = np.asarray([i for ids in lists for i in ids], np.int32)
        ids = np.full((len(texts), self.max_seq_length), self.tokenizer.pad_id, np.int32)
        mask = np.zeros_like(ids)
        first, word_index = [], 0  # per text: (word's character span, position of its first piece)
        for row, spans in enumerate(words):
            tokens, kept, full = [self.tokenizer.cls_id], [], False
            for span in spans:
                word_pieces = pieces[splits[word_index]:splits[word_index + 1]]
                word_index += 1
                full = full or len(tokens) + len(word_pieces) >= self.max_seq_length  # [SEP] must fit too
                if len(word_pieces) and not full:  # a word without pieces (a control character) is no token
                    kept.append((span, len(tokens)))
                    tokens.extend(word_pieces.tolist())
            tokens.append(self.tokenizer.sep_id)
            ids[row, :len(tokens)], mask[row, :len(tokens)] = tokens, 1
            first.append(kept)
        logits = self.trainer.predict({"input_ids": ids, "input_mask": mask, "segment_ids": np.zeros_like(ids)},
                                      per_token=True)
        probs = np.asarray(jax.nn.softmax(np.asarray(logits, np.float32), axis=-1))
        out = []
        for text, kept, p in zip(texts, first, probs):
            word_entities = []
            for (start, end), position in kept:
                label = int(p[position].argmax())
                word_entities.append({"entity": self.id2label[label], "score": float(p[position, label]),
                                      "start": start, "end": end})
            out.append({"entities": [dict(group, word=text[group["start"]:group["end"]])
                                     for group in group_entities(word_entities) if group["entity_group"] != "O"]})
        return out


def _tag(name: str) -> tuple[str, str]:
    return (name[0], name[2:]) if name[:2] in ("B-", "I-") else ("I", name)


def group_entities(words: list[dict]) -> list[dict]:
    """Adjacent words of one entity type as one entity (a B- word opens a new one): type, mean score, span."""
    groups, current = [], []
    for word in words:
        if current and (_tag(word["entity"])[1] != _tag(current[-1]["entity"])[1] or _tag(word["entity"])[0] == "B"):
            groups.append(current)
            current = []
        current.append(word)
    if current:
        groups.append(current)
    return [{"entity_group": _tag(g[0]["entity"])[1], "score": float(np.mean([w["score"] for w in g])),
             "start": g[0]["start"], "end": g[-1]["end"]} for g in groups]
