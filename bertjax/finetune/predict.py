"""`bertjax predict`: a fine-tuned model on new text, as JSON Lines, with the numbers of transformers' pipeline.

The model is a fine-tune workdir (its hf/ export, else its checkpoint/), an exported HF directory or a bertjax
checkpoint with a head. Rows are batched on the mesh by the fine-tuning Trainer's predict (progress included).
- sequence classification: `label`, `score` and `scores` per label (softmax; sigmoid and `labels` over 0.5 for
  multi-label; the value as `score` for regression), as pipeline("text-classification", top_k=None);
- token classification: `entities`, each {entity_group, score, word, start, end} with character offsets, as
  pipeline("token-classification", aggregation_strategy="first"): a word takes its first piece's label and score,
  adjacent words of one type (B- opens a new one) form an entity with their mean score. Words are BERT's
  pre-tokens: runs of word characters, and each other non-space character alone.
"""
from __future__ import annotations

import re

import jax
import numpy as np
from etils import epath

from bertjax.finetune import classify
from bertjax.finetune.settings import TrainSettings
from bertjax.finetune.trainer import Trainer
from bertjax.interop.load import load_init
from bertjax.model.bert import BertForSequenceClassification, BertForTokenClassification

HEADS = {"BertForSequenceClassification": BertForSequenceClassification,
         "BertForTokenClassification": BertForTokenClassification}
_WORD = re.compile(r"\w+|[^\w\s]")


def resolve_model(model: str) -> str:
    """A fine-tune workdir's model (hf/, else checkpoint/), or `model` itself."""
    root = epath.Path(model)
    for name in ("hf", "checkpoint"):
        if (root / name).is_dir():
            return str(root / name)
    return model


class Predictor:
    """A fine-tuned classifier or token classifier, ready to predict batches of texts."""

    def __init__(self, model: str, *, max_seq_length: int = 128, batch_size: int = 64):
        self.source = resolve_model(model)
        ckpt, self.tokenizer = load_init(self.source)
        head = ckpt.head or {}
        self.architecture = head.get("architecture")
        if self.architecture not in HEADS or "classifier" not in ckpt.params:
            raise ValueError(f"{model}: no fine-tuned classifier or token classifier head (architecture "
                             f"{self.architecture!r}); `bertjax predict` needs a model a fine-tune job wrote")
        ckpt.config.check_length(max_seq_length, "--max-seq-length")
        num_labels = int(np.shape(ckpt.params["classifier"]["bias"])[0])
        self.id2label = [head.get("id2label", {}).get(str(i), f"LABEL_{i}") for i in range(num_labels)]
        self.problem = head.get("problem_type") or (
            "regression" if num_labels == 1 else "single_label_classification")
        self.max_seq_length = max_seq_length
        module = HEADS[self.architecture](ckpt.config, num_labels)
        # batch_size: the Trainer's check that it divides over the devices applies to both fields.
        settings = TrainSettings(batch_size=batch_size, eval_batch_size=batch_size)
        self.trainer = Trainer(module, ckpt.config, ckpt.params, loss_fn=None, settings=settings, source=self.source)

    def predict(self, texts: list[str], pairs: list[str] | None = None, wheres: list[str] | None = None) -> list[dict]:
        """One JSON-ready dict per text."""
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

    def _entities(self, texts: list[str]) -> list[dict]:
        words = [[(m.start(), m.end()) for m in _WORD.finditer(text)] for text in texts]
        flat = [text[s:e] for text, spans in zip(texts, words) for s, e in spans]
        ragged = self.tokenizer.tokenize(flat if flat else [""])
        splits, pieces = ragged.row_splits.numpy(), ragged.flat_values.numpy()
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
