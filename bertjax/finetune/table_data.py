"""A user's own labelled text: CSV, TSV, JSON Lines or Parquet files (local or gs://) -> GLUE-style `Examples`.

Each row is told by where it is (`file:line` for the text formats, `file: row N` for Parquet), so a bad one (no text,
a text that is not a string, a label the training file never had, a non-numeric regression label) is a ValueError
naming file, line and column. Text formats are UTF-8 (Excel's byte-order mark skipped; a bad byte named by line);
CSV is read strictly, so a quote that opens a field and never closes is named instead of taking in the rows after
it; a column read that the header (or a JSON object) names twice is refused. Label names stay as given: the label
set is the training file's, sorted (numerically where every name is a number), and it becomes config.json's
id2label. Three problems, named as transformers' `problem_type` spells them: single-label classification (label
ids; 2 labels or more), multi-label (a JSON/Parquet list or one string cut at a separator; a 0/1 matrix) and
regression (floats).
"""
from __future__ import annotations

import csv
import dataclasses
import io
import math
import sys

import numpy as np
from etils import epath

from bertjax.data import file_readers, format_detect
from bertjax.runtime import jsonio
from bertjax.runtime.errors import shown, shown_list
from bertjax.finetune.glue_data import Examples

PROBLEMS = ("single_label_classification", "multi_label_classification", "regression")
FORMATS = {".csv": "csv", ".tsv": "tsv", ".jsonl": "jsonl", ".json": "jsonl", ".parquet": "parquet"}


@dataclasses.dataclass(frozen=True)
class TableSpec:
    """Which columns hold what, and what the label is."""
    text_column: str = "text"
    text_pair_column: str | None = None
    label_column: str = "label"
    problem: str = "single_label_classification"
    label_separator: str = ","  # multi-label labels given as one string

    def __post_init__(self):
        if self.problem not in PROBLEMS:
            raise ValueError(f"unknown problem {self.problem!r}; expected one of {', '.join(PROBLEMS)}")


def file_format(path: str) -> str:
    """csv | tsv | jsonl | parquet, from the file name's suffix (under a compression's: `train.csv.gz`)."""
    suffix = epath.Path(file_readers.without_compression(path)).suffix.lower()
    if suffix not in FORMATS:
        raise ValueError(f"{path}: unknown table format {suffix or '(no suffix)'!r}; expected one of "
                         f"{', '.join(FORMATS)}")
    return FORMATS[suffix]


def read_rows(path: str, columns: list[str], optional: tuple[str, ...] = ()) -> list[tuple[str, dict]]:
    """(where, {column: value}) for every data row of `path`; `where` is `file:line` (`file: row N` for Parquet).
    A column of `columns` the file lacks is an error naming the columns it has; one of `optional` is read where the
    file has it. The text formats are read by file_readers.read_text (compressed files decompressed; Parquet,
    binary and NUL bytes refused)."""
    kind = file_format(path)
    source = epath.Path(path)
    if not source.exists():
        raise FileNotFoundError(f"{path}: no such file")
    if kind == "parquet":
        with file_readers.parquet_table(path) as parquet:
            names = parquet.schema_arrow.names
            _check_columns(path, names, columns)
            values = parquet.read(columns=columns + [c for c in optional if c in names]).to_pylist()
        return [(f"{path}: row {i + 1}", row) for i, row in enumerate(values)]
    text = file_readers.read_text(path, f"a {kind.upper() if kind != 'jsonl' else 'JSON Lines'} file (UTF-8)")
    seen = format_detect.by_bytes(path)  # a name that contradicts the bytes: refused, as in every reader
    if (seen == "jsonl") != (kind == "jsonl") and text.strip():
        raise ValueError(format_detect.named_otherwise(path, "JSON Lines" if kind == "jsonl" else kind.upper(), seen))
    if kind == "jsonl":
        rows, seen = [], set()
        for number, line in enumerate(text.splitlines(), start=1):
            if not line.strip():
                continue
            where = f"{path}:{number}"
            row = jsonio.loads(line, where, "a JSON object", row=True,
                               object_pairs_hook=lambda pairs: _named_once(where, pairs, columns + list(optional)))
            if not isinstance(row, dict):
                raise ValueError(f"{where}: expected a JSON object, got {type(row).__name__}")
            seen |= set(row)
            rows.append((where, row))
        _check_columns(path, sorted(seen), columns)
        return rows
    csv.field_size_limit(sys.maxsize)
    # TSV: no quoting (sentences hold unbalanced quotes; a tab never sits inside a field), as GLUE's files. CSV:
    # strict, so that a field opened by an unbalanced quote is an error instead of swallowing the rows after it.
    dialect = dict(delimiter="\t", quoting=csv.QUOTE_NONE) if kind == "tsv" else dict(strict=True)
    reader = csv.reader(io.StringIO(text, newline=""), **dialect)
    rows, line = [], 1
    try:
        header = next(reader, None)
        if header is None:
            raise ValueError(f"{path}: empty file (a header line naming the columns is expected)")
        _check_columns(path, header, columns)
        line = reader.line_num + 1
        for fields in reader:
            if fields:  # a blank line is no row
                if len(fields) != len(header):
                    raise ValueError(f"{path}:{line}: {len(fields)} fields, the header has {len(header)}")
                rows.append((f"{path}:{line}", dict(zip(header, fields))))
            line = reader.line_num + 1  # a quoted field may span lines: the next row starts after this one
    except csv.Error as error:
        fault = (f"is never closed (the field would run to the end of the file, line {reader.line_num})"
                 if "end of data" in str(error) else f"closes before the field ends (line {reader.line_num}: {error})")
        raise ValueError(f"{path}:{line}: the quote that opens a field here {fault}; a quote inside a field is "
                         f"written \"\" in a field wrapped in quotes") from None
    return rows


def _named_once(where: str, pairs: list[tuple], columns: list[str]) -> dict:
    """`pairs` (name, value) as a dict; a column of `columns` named twice is an error (which one is meant?)."""
    names = [name for name, _ in pairs]
    twice = [c for c in columns if names.count(c) > 1]
    if twice:
        raise ValueError(f"{where}: column {twice[0]!r} is named {names.count(twice[0])} times; each column a "
                         f"command reads must be named once")
    return dict(pairs)


def _check_columns(path: str, have: list[str], wanted: list[str]) -> None:
    _named_once(path, [(name, None) for name in have], wanted)
    missing = [c for c in wanted if c not in have]
    if missing:
        raise ValueError(f"{path}: no column {', '.join(map(shown, missing))}; it has "
                         f"{shown_list(have)[1:-1]}")


def _missing(value) -> bool:
    return value is None or (isinstance(value, float) and math.isnan(value)) or (isinstance(value, str)
                                                                                   and not value.strip())


def text_value(where: str, row: dict, column: str) -> str:
    """A row's text in `column`: a string (a number or list there is an error, as is a missing value)."""
    value = row.get(column)
    if value is None or isinstance(value, float) and math.isnan(value):
        raise ValueError(f"{where}: column {column!r} is empty; expected the text")
    if not isinstance(value, str):
        raise ValueError(f"{where}: column {column!r} is {shown(value)}, not a text; expected a string")
    return value


def non_blank_text(where: str, row: dict, column: str) -> str:
    """A row's text as every command reads one (training, dev, test, predict's input): text_value, not blank."""
    value = text_value(where, row, column)
    if not value.strip():
        raise ValueError(f"{where}: column {column!r} is empty; expected the text")
    return value


def _label_names(spec: TableSpec, where: str, value) -> list[str]:
    """The label names of one row (one for single-label)."""
    if spec.problem == "multi_label_classification":
        if value is None or (isinstance(value, float) and math.isnan(value)):
            return []
        items = value if isinstance(value, (list, tuple, np.ndarray)) else str(value).split(spec.label_separator)
        return [str(item).strip() for item in items if str(item).strip()]
    if isinstance(value, (list, tuple, np.ndarray, dict)):  # str() would make "['0']" a class of its own
        raise ValueError(f"{where}: column {spec.label_column!r} is {shown(value)}, not one label; single-label "
                         "classification takes one label a row (a list per row: --problem "
                         "multi_label_classification)")
    if _missing(value):
        raise ValueError(f"{where}: column {spec.label_column!r} is empty; expected a label")
    if isinstance(value, float) and value.is_integer():
        value = int(value)  # a Parquet/JSON 1.0 is the label "1"
    return [str(value)]


def _regression_value(spec: TableSpec, where: str, value) -> float:
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{where}: column {spec.label_column!r} is {shown(value)}, not a number (regression "
                         f"labels are numbers)") from None
    if not math.isfinite(number):
        raise ValueError(f"{where}: column {spec.label_column!r} is {shown(value)}, not a finite number")
    return number


def _label_key(name: str):
    """What two spellings of one label share: the number they write ("1", "01", "1.0", " 1"), else the name less
    surrounding spaces."""
    try:
        number = float(name)
    except ValueError:
        return name.strip()
    return number if math.isfinite(number) else name.strip()


def _same_label(a: str, b: str) -> bool:
    return a != b and _label_key(a) == _label_key(b)


def _check_one_spelling(spec: TableSpec, wheres: list[str], per_row: list[list[str]]) -> None:
    """Two spellings of one label in a training file (" 1", "01", "1.0" and "1") would become classes of their own,
    each with a share of the rows: refused, naming both and where each first appears."""
    first: dict = {}  # label key -> (spelling, where)
    for where, names in zip(wheres, per_row):
        for name in names:
            spelling, at = first.setdefault(_label_key(name), (name, where))
            if spelling != name:
                raise ValueError(f"{where}: column {spec.label_column!r}: label {shown(name)} is "
                                 f"{shown(spelling)} ({at}) "
                                 "written another way; write each label one way (they would be two classes)")


def label_order(names) -> list[str]:
    """The label set in id order: numeric where every name is a number ("2" before "10"), else by name."""
    names = sorted(set(names))
    try:
        return sorted(names, key=float)
    except ValueError:
        return names


def read_split(path: str, spec: TableSpec, labels: list[str] | None = None,
               with_labels: bool = True) -> tuple[Examples, list[str] | None]:
    """One file as Examples (guids are its `where`s) and the label names in id order: found here when `labels` is
    None (the training file), else `labels`, and a label outside them is an error. `with_labels=False` (a test
    file) reads the texts only."""
    columns = [spec.text_column] + ([spec.text_pair_column] if spec.text_pair_column else [])
    rows = read_rows(path, columns + ([spec.label_column] if with_labels else []))
    if not rows:
        raise ValueError(f"{path}: no rows")
    wheres = [where for where, _ in rows]
    text_a = [non_blank_text(where, row, spec.text_column) for where, row in rows]
    text_b = ([non_blank_text(where, row, spec.text_pair_column) for where, row in rows] if spec.text_pair_column
              else None)
    if not with_labels:
        return Examples(wheres, text_a, text_b, None), labels
    raw = [row.get(spec.label_column) for _, row in rows]
    if spec.problem == "regression":
        values = np.asarray([_regression_value(spec, where, v) for where, v in zip(wheres, raw)], np.float32)
        return Examples(wheres, text_a, text_b, values), None
    per_row = [_label_names(spec, where, v) for where, v in zip(wheres, raw)]
    if labels is None:
        _check_one_spelling(spec, wheres, per_row)
        labels = label_order(name for names in per_row for name in names)
        if not labels:
            raise ValueError(f"{path}: column {spec.label_column!r} holds no labels")
        if len(labels) == 1 and spec.problem == "single_label_classification":
            raise ValueError(f"{path}: column {spec.label_column!r} holds one label, {shown(labels[0])}, in every "
                             "row; "
                             "a classifier needs at least 2 (numbers to predict: --problem regression)")
    ids = {name: i for i, name in enumerate(labels)}
    for where, names in zip(wheres, per_row):
        for name in names:
            if name not in ids:
                same = next((label for label in labels if _same_label(label, name)), None)
                raise ValueError(f"{where}: column {spec.label_column!r}: label {shown(name)} is not among the "
                                 f"training file's labels {shown_list(labels)}"
                                 + (f" (it writes this one {shown(same)})" if same else ""))
    if spec.problem == "multi_label_classification":
        matrix = np.zeros((len(rows), len(labels)), np.float32)
        for i, names in enumerate(per_row):
            matrix[i, [ids[name] for name in names]] = 1.0
        return Examples(wheres, text_a, text_b, matrix), labels
    return Examples(wheres, text_a, text_b, np.asarray([ids[names[0]] for names in per_row], np.int32)), labels
