"""GLUE readers: the nine tasks' standard TSV layout (glue_data/<Task>/{train,dev,test}.tsv), or tfds glue/*.

Each task is a `GlueTask` record (columns per split, label names, submission file names) rather than a class
per task: the processors of run_classifier / HF differ only in these numbers. Rows are read with quoting off
(sentences contain unbalanced quotes). A row with the wrong number of columns or an unknown label is a
ValueError naming file and line; the header is skipped; QQP rows that are too short are skipped and counted,
as the HF processor does.
"""
from __future__ import annotations

import csv
import dataclasses
import io
import logging
import math
import os
import sys

import numpy as np

from bertjax.data import file_readers
from bertjax.runtime.errors import shown
from bertjax.runtime.outputs import open_whole

log = logging.getLogger(__name__)

TASKS = ("cola", "sst2", "mrpc", "stsb", "qqp", "mnli", "qnli", "rte", "wnli")


@dataclasses.dataclass(frozen=True)
class Layout:
    """Where the fields of one split's TSV are (column indices; label None for test files)."""
    columns: int
    header: bool
    text_a: int
    text_b: int | None
    label: int | None
    index: int | None = None  # the id GLUE's submission format wants (test files); else the row number


@dataclasses.dataclass(frozen=True)
class EvalSplit:
    """One dev/test pair: MNLI has two (matched, mismatched), the others one."""
    name: str
    dev_file: str
    test_file: str
    submission: str  # GLUE submission file name, e.g. "MNLI-m.tsv"


@dataclasses.dataclass(frozen=True)
class GlueTask:
    name: str
    dir_name: str
    labels: tuple[str, ...] | None  # None: regression (STS-B)
    train: Layout
    dev: Layout
    test: Layout
    splits: tuple[EvalSplit, ...]
    skip_short_rows: bool = False

    @property
    def num_labels(self) -> int:
        return 1 if self.labels is None else len(self.labels)

    @property
    def is_regression(self) -> bool:
        return self.labels is None


def _one(submission: str) -> tuple[EvalSplit, ...]:
    return (EvalSplit("dev", "dev.tsv", "test.tsv", submission),)


_BINARY = ("0", "1")
_NLI2 = ("entailment", "not_entailment")
_PAIR4 = Layout(4, True, 1, 2, 3)
_PAIR4_TEST = Layout(3, True, 1, 2, None, index=0)

GLUE_TASKS: dict[str, GlueTask] = {
    "cola": GlueTask("cola", "CoLA", _BINARY,
                     train=Layout(4, False, 3, None, 1), dev=Layout(4, False, 3, None, 1),
                     test=Layout(2, True, 1, None, None, index=0), splits=_one("CoLA.tsv")),
    "sst2": GlueTask("sst2", "SST-2", _BINARY,
                     train=Layout(2, True, 0, None, 1), dev=Layout(2, True, 0, None, 1),
                     test=Layout(2, True, 1, None, None, index=0), splits=_one("SST-2.tsv")),
    "mrpc": GlueTask("mrpc", "MRPC", _BINARY,
                     train=Layout(5, True, 3, 4, 0), dev=Layout(5, True, 3, 4, 0),
                     test=Layout(5, True, 3, 4, None, index=0), splits=_one("MRPC.tsv")),
    "stsb": GlueTask("stsb", "STS-B", None,
                     train=Layout(10, True, 7, 8, 9), dev=Layout(10, True, 7, 8, 9),
                     test=Layout(9, True, 7, 8, None, index=0), splits=_one("STS-B.tsv")),
    "qqp": GlueTask("qqp", "QQP", _BINARY,
                    train=Layout(6, True, 3, 4, 5), dev=Layout(6, True, 3, 4, 5),
                    test=Layout(3, True, 1, 2, None, index=0), splits=_one("QQP.tsv"),
                    skip_short_rows=True),
    "mnli": GlueTask("mnli", "MNLI", ("contradiction", "entailment", "neutral"),
                     train=Layout(12, True, 8, 9, 11), dev=Layout(16, True, 8, 9, 15),
                     test=Layout(10, True, 8, 9, None, index=0),
                     splits=(EvalSplit("matched", "dev_matched.tsv", "test_matched.tsv", "MNLI-m.tsv"),
                             EvalSplit("mismatched", "dev_mismatched.tsv", "test_mismatched.tsv", "MNLI-mm.tsv"))),
    "qnli": GlueTask("qnli", "QNLI", _NLI2, train=_PAIR4, dev=_PAIR4, test=_PAIR4_TEST,
                     splits=_one("QNLI.tsv")),
    "rte": GlueTask("rte", "RTE", _NLI2, train=_PAIR4, dev=_PAIR4, test=_PAIR4_TEST,
                    splits=_one("RTE.tsv")),
    "wnli": GlueTask("wnli", "WNLI", _BINARY, train=_PAIR4, dev=_PAIR4, test=_PAIR4_TEST,
                     splits=_one("WNLI.tsv")),
}


@dataclasses.dataclass
class Examples:
    """A split as parallel lists; `labels` are label ids (float scores for STS-B), None for test."""
    guids: list[str]
    text_a: list[str]
    text_b: list[str] | None
    labels: np.ndarray | None

    def __len__(self) -> int:
        return len(self.guids)

    def head(self, n: int) -> "Examples":
        """The first `n` examples (all of them for n = 0)."""
        if not n:
            return self
        return Examples(self.guids[:n], self.text_a[:n], None if self.text_b is None else self.text_b[:n],
                        None if self.labels is None else self.labels[:n])


def get_task(name: str) -> GlueTask:
    key = name.lower().replace("-", "")
    if key not in GLUE_TASKS:
        raise ValueError(f"unknown GLUE task {name!r}; expected one of {', '.join(TASKS)}")
    return GLUE_TASKS[key]


def read_tsv_rows(path: str) -> list[tuple[int, list[str]]]:
    """(1-based line number, fields) for every line; quoting off, BOM stripped (MRPC's header has one). Read by
    file_readers.read_text: compressed bytes decompressed, Parquet, binary and NUL bytes refused."""
    csv.field_size_limit(sys.maxsize)
    text = file_readers.read_text(path, "a GLUE TSV file (UTF-8)")
    reader = csv.reader(io.StringIO(text, newline=""), delimiter="\t", quotechar=None, quoting=csv.QUOTE_NONE)
    return [(reader.line_num, row) for row in reader]


def _parse_label(task: GlueTask, raw: str, where: str):
    if task.is_regression:
        try:
            value = float(raw)
        except ValueError:
            raise ValueError(f"{where}: label {shown(raw)} is not a number") from None
        if not math.isfinite(value):
            raise ValueError(f"{where}: label {shown(raw)} is not a finite number")
        return value
    if raw not in task.labels:
        raise ValueError(f"{where}: unknown label {shown(raw)} for {task.name}; expected one of {list(task.labels)}")
    return task.labels.index(raw)


def read_split(task: GlueTask, path: str, layout: Layout) -> Examples:
    """Read one TSV file of `task` laid out as `layout`."""
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path}: no such file (expected the GLUE {task.dir_name} layout)")
    guids, text_a, text_b, labels = [], [], [], []
    skipped = 0
    rows = read_tsv_rows(path)
    for i, (line, row) in enumerate(rows):
        if i == 0 and layout.header:
            continue
        where = f"{path}:{line}"
        if len(row) != layout.columns:
            if task.skip_short_rows and len(row) < layout.columns:
                skipped += 1
                continue
            raise ValueError(f"{where}: expected {layout.columns} tab-separated columns for {task.name}, got {len(row)}")
        # A text that is only spaces is no text: refused as `finetune classify` and `predict` refuse it (it was
        # scored as if it were one); QQP's rows without one are malformed rows, skipped as its short ones are.
        empty = next((column for column in (layout.text_a, layout.text_b)
                      if column is not None and not row[column].strip()), None)
        if empty is not None:
            if task.skip_short_rows:
                skipped += 1
                continue
            raise ValueError(f"{where}: column {empty + 1} (the {'first' if empty == layout.text_a else 'second'} "
                             f"text) is empty; expected the text")
        guids.append(row[layout.index] if layout.index is not None else str(len(guids)))
        text_a.append(row[layout.text_a])
        if layout.text_b is not None:
            text_b.append(row[layout.text_b])
        if layout.label is not None:
            labels.append(_parse_label(task, row[layout.label], where))
    if skipped:
        log.warning("%s: skipped %d malformed rows (too few columns, or a text missing)", path, skipped)
    if not guids:
        raise ValueError(f"{path}: no examples ({len(rows)} line(s), header included)")
    label_array = None
    if layout.label is not None:
        label_array = np.asarray(labels, np.float32 if task.is_regression else np.int32)
    return Examples(guids, text_a, text_b if layout.text_b is not None else None, label_array)


def read_glue_dir(task: GlueTask, data_dir: str) -> dict[str, Examples]:
    """{"train", "dev:<split>", "test:<split>"} from `data_dir/<Task>/`; test files are optional."""
    task_dir = os.path.join(data_dir, task.dir_name)
    out = {"train": read_split(task, os.path.join(task_dir, "train.tsv"), task.train)}
    for split in task.splits:
        out[f"dev:{split.name}"] = read_split(task, os.path.join(task_dir, split.dev_file), task.dev)
        test_path = os.path.join(task_dir, split.test_file)
        if os.path.exists(test_path):
            out[f"test:{split.name}"] = read_split(task, test_path, task.test)
    return out


# tfds glue/<config>: feature names of the two texts and the tfds split names.
_TFDS_TEXTS = {
    "cola": ("sentence", None), "sst2": ("sentence", None), "mrpc": ("sentence1", "sentence2"),
    "stsb": ("sentence1", "sentence2"), "qqp": ("question1", "question2"), "mnli": ("premise", "hypothesis"),
    "qnli": ("question", "sentence"), "rte": ("sentence1", "sentence2"), "wnli": ("sentence1", "sentence2"),
}


def read_tfds(task: GlueTask, data_dir: str | None = None) -> dict[str, Examples]:
    """The same splits from tfds `glue/<task>` prepared locally (nothing is downloaded)."""
    import tensorflow_datasets as tfds

    builder = tfds.builder(f"glue/{task.name}", data_dir=data_dir)
    if not builder.is_prepared():
        raise FileNotFoundError(f"tfds glue/{task.name} is not prepared under {builder.data_dir}")
    names = None if task.is_regression else builder.info.features["label"].names
    key_a, key_b = _TFDS_TEXTS[task.name]

    def load(split: str, with_labels: bool) -> Examples:
        guids, text_a, text_b, labels = [], [], [], []
        for ex in tfds.as_numpy(builder.as_dataset(split=split)):
            guids.append(str(int(ex["idx"])))
            text_a.append(ex[key_a].decode("utf-8"))
            if key_b:
                text_b.append(ex[key_b].decode("utf-8"))
            if with_labels:
                if task.is_regression:
                    labels.append(float(ex["label"]))
                else:
                    # tfds binary tasks name their classes (e.g. not_equivalent/equivalent) in GLUE's 0/1 order.
                    name = names[int(ex["label"])]
                    labels.append(int(ex["label"]) if task.labels == _BINARY else task.labels.index(name))
        arr = None
        if with_labels:
            arr = np.asarray(labels, np.float32 if task.is_regression else np.int32)
        return Examples(guids, text_a, text_b if key_b else None, arr)

    out = {"train": load("train", True)}
    for split in task.splits:
        suffix = "" if task.name != "mnli" else f"_{split.name}"
        out[f"dev:{split.name}"] = load(f"validation{suffix}", True)
        out[f"test:{split.name}"] = load(f"test{suffix}", False)
    return out


def load_task(task: GlueTask, data: str) -> dict[str, Examples]:
    """`data` is a GLUE directory, or "tfds" / "tfds:<data_dir>" for locally prepared tfds glue/*."""
    if data == "tfds" or data.startswith("tfds:"):
        return read_tfds(task, data.partition(":")[2] or None)
    return read_glue_dir(task, data)


def featurize(examples: Examples, tokenizer, max_seq_length: int) -> dict[str, np.ndarray]:
    """input_ids/input_mask/segment_ids [N, max_seq_length] int32 (+ labels when known) via the WordPiece tokenizer."""
    enc = tokenizer.encode(examples.text_a, max_seq_length, text_pairs=examples.text_b)
    out = {k: np.asarray(enc[k], np.int32) for k in ("input_ids", "input_mask", "segment_ids")}
    if examples.labels is not None:
        out["labels"] = examples.labels
    return out


def write_submission(task: GlueTask, path: str, guids: list[str], preds) -> None:
    """GLUE's submission TSV: a header, then index and the predicted label name (or score)."""
    with open_whole(path, "w", encoding="utf-8") as f:
        f.write("index\tprediction\n")
        for guid, pred in zip(guids, preds):
            f.write(f"{guid}\t{label_name(task, pred)}\n")


def label_name(task: GlueTask, pred) -> str:
    """A prediction as GLUE's submission format writes it (label name, or the score for STS-B)."""
    if task.is_regression:
        return f"{float(pred):.3f}"
    return task.labels[int(pred)]
