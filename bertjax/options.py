"""Options defined once, as fields of frozen dataclasses; everything else is derived from those fields.

A config class (BertConfig, PretrainingDataConfig, OptimizerConfig, ...) lists each option with its type, default
and help text, validates itself in `__post_init__`, and builds the object it configures. From the same fields:
- `to_config_dict` / `from_config_dict`: the ml_collections ConfigDict that presets (configs/*.py) edit, and back;
- `apply_override`: `--set KEY=VALUE`, parsed to the field's declared type, unknown keys named;
- `add_flags` / `from_flags`: argparse flags for commands that take the options one by one (`data create`,
  `finetune`), so a default is never restated in a parser.
A numeric option declares its range (`valid=ints(1)`, `floats(0, 1)`); the range is checked wherever a value is
parsed, naming what the user typed: a flag (the argparse `type` is the range), `--set KEY=VALUE`, a config file's key.
Hand-written numeric flags take a range as their `type` too (`type=ints(1)`), so every number a command line accepts
is checked at parsing, by this one mechanism (tests/test_options.py walks every parser and config class).
"""
from __future__ import annotations

import argparse
import ast
import dataclasses
import difflib
import functools
import math
import types
import typing
from typing import Any, Iterable

import ml_collections


# The largest integer an option may hold unless it says otherwise: what a 32-bit counter (JAX's default integer, a
# step, a seed) holds. `train.steps=10**20` passed validation and ended in an OverflowError hours of set-up later.
INT_LIMIT = 2**31 - 1


@dataclasses.dataclass(frozen=True)
class Range:
    """The values a numeric option may take: `kind` (int or float) from `low` to `high` (None: unbounded; an int is
    then also at most INT_LIMIT, a float always finite), each end included unless `*_open`. As an argparse `type` it
    parses and checks a flag's text (argparse then names the flag)."""
    kind: type
    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False

    def problem(self, value) -> str | None:
        """"must be >= 1" (what `value` breaks), or None for a value in range."""
        if self.kind is float and not math.isfinite(value):
            return "must be a finite number"
        below = self.low is not None and (value <= self.low if self.low_open else value < self.low)
        above = self.high is not None and (value >= self.high if self.high_open else value > self.high)
        if self.low is not None and self.high is not None and (below or above):
            return f"must be in {'(' if self.low_open else '['}{_num(self.low)}, {_num(self.high)}" \
                   f"{')' if self.high_open else ']'}"
        if below:
            return f"must be {'>' if self.low_open else '>='} {_num(self.low)}"
        if above:
            return f"must be {'<' if self.high_open else '<='} {_num(self.high)}"
        if self.kind is int and self.high is None and abs(value) > INT_LIMIT:
            return f"must be <= {INT_LIMIT} (a 32-bit integer)" if value > 0 else f"must be >= {-INT_LIMIT}"
        return None

    def __call__(self, text: str):
        """An argparse `type`: the flag's text parsed as `kind` and checked."""
        try:
            value = self.kind(text.replace("_", ""))
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {_a(self.kind.__name__)}, got {text!r}") from None
        problem = self.problem(value)
        if problem:
            raise argparse.ArgumentTypeError(f"{problem}, got {text}")
        return value

    def __repr__(self) -> str:  # argparse names a type in its messages by repr
        return self.kind.__name__


def _num(value) -> str:
    return f"{value:g}"


def ints(low: int | None = None, high: int | None = None) -> Range:
    """An integer option from `low` to `high`, both included (without `high`, at most INT_LIMIT: a count held in
    32 bits)."""
    return Range(int, low, high)


def floats(low: float | None = None, high: float | None = None, *, low_open: bool = False,
           high_open: bool = False) -> Range:
    """A finite float option from `low` to `high` (ends included unless open: `floats(0, low_open=True)` is > 0)."""
    return Range(float, low, high, low_open, high_open)


def option(default: Any = dataclasses.MISSING, help: str = "", *, flags: Iterable[str] = (),
           repeatable: bool = False, default_factory: Any = dataclasses.MISSING, valid: Range | None = None) -> Any:
    """A dataclass field with its help text, extra command-line spellings (e.g. an older flag name), for a
    list-like string option whether its flag may be repeated (the config class then joins the values), and for a
    numeric one its range (`valid`; every int and float option has one)."""
    return dataclasses.field(default=default, default_factory=default_factory,
                             metadata={"help": help, "flags": tuple(flags), "repeatable": repeatable,
                                       "valid": valid})


def field_range(cls: type, name: str) -> Range | None:
    """The declared range of field `name` of `cls` (None for a non-numeric field)."""
    return next((f.metadata.get("valid") for f in dataclasses.fields(cls) if f.name == name), None)


def check_value(cls: type, name: str, value: Any, spelled: str) -> None:
    """A value of field `name` outside its declared range is an error naming it as the user wrote it (`spelled`:
    `--set train.steps=0`, `checkpoint.keep=0`)."""
    problem = _problem(field_range(cls, name), value)
    if problem:
        raise ValueError(f"{spelled} {problem}")


def range_problems(config: Any) -> list[str]:
    """"name=value must be ..." for each field of the dataclass instance `config` outside its declared range: a
    config class's `__post_init__` checks its ranges with this (the same ranges its flags and keys are parsed by)."""
    problems = []
    for field in dataclasses.fields(config):
        value = getattr(config, field.name)
        problem = _problem(field.metadata.get("valid"), value)
        if problem:
            problems.append(f"{field.name}={value} {problem}")
    return problems


def _problem(valid: Range | None, value) -> str | None:
    """What a value breaks of its range (None for no range, a value in range, or None where None is allowed)."""
    is_number = isinstance(value, (int, float)) and not isinstance(value, bool)
    return valid.problem(value) if valid is not None and is_number else None


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _base_type(hint: Any) -> tuple[type, bool]:
    """(the non-None type of a field, whether None is allowed)."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(args) != 1:
            raise TypeError(f"unsupported option type {hint}")
        return args[0], True
    return hint, False


def parse_value(raw: str, hint: Any, key: str) -> Any:
    """`raw` text as a value of the field type `hint` (int, float, bool, str, or one of them | None)."""
    kind, nullable = _base_type(hint)
    if nullable and raw.lower() in ("none", "null"):
        return None
    if kind is str:
        return raw
    if kind is bool:
        if raw.lower() in ("true", "1", "yes"):
            return True
        if raw.lower() in ("false", "0", "no"):
            return False
        raise ValueError(f"{key}={raw}: expected a boolean (true/false)")
    try:
        value = ast.literal_eval(raw.replace("_", "") if kind in (int, float) else raw)
    except (ValueError, SyntaxError):
        raise ValueError(f"{key}={raw}: expected {_a(kind.__name__)}") from None
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if not isinstance(value, kind) or isinstance(value, bool):
        raise ValueError(f"{key}={raw}: expected {_a(kind.__name__)}, got {type(value).__name__}")
    return value


def _a(noun: str) -> str:
    """`an int`, `a float`."""
    return f"{'an' if noun[0] in 'aeiou' else 'a'} {noun}"


def dotted_keys(cls: type, prefix: str = "") -> list[str]:
    """Every leaf key of the config class `cls`, dotted (`train.batch_size`)."""
    keys = []
    for field in dataclasses.fields(cls):
        hint = _hints(cls)[field.name]
        keys += dotted_keys(hint, f"{prefix}{field.name}.") if dataclasses.is_dataclass(hint) else [prefix + field.name]
    return keys


def key_help(cls: type, prefix: str = "") -> dict[str, str]:
    """Every leaf key of the config class `cls`, dotted, with its help text (what `config show --describe` says)."""
    described = {}
    for field in dataclasses.fields(cls):
        hint = _hints(cls)[field.name]
        if dataclasses.is_dataclass(hint):
            described.update(key_help(hint, f"{prefix}{field.name}."))
        else:
            described[prefix + field.name] = field.metadata.get("help", "")
    return described


def unknown_key(cls: type, key: str, prefix: str = "") -> str:
    """"KEY: unknown config key" for the dotted `key` under `cls` (which sits at `prefix` in the whole config),
    with the nearest known key when one is close."""
    near = difflib.get_close_matches(key, dotted_keys(cls), n=1, cutoff=0.75)
    return f"{prefix}{key}: unknown config key" + (f" (did you mean {prefix}{near[0]}?)" if near else "")


# ---- ConfigDict ----------------------------------------------------------------------------------------------------

def to_config_dict(config: Any) -> ml_collections.ConfigDict:
    """A (nested) ConfigDict holding every field of the dataclass instance `config`."""
    values = {}
    for field in dataclasses.fields(config):
        value = getattr(config, field.name)
        values[field.name] = to_config_dict(value) if dataclasses.is_dataclass(value) else value
    return ml_collections.ConfigDict(values)


def from_config_dict(cls: type, values: Any, prefix: str = "") -> Any:
    """An instance of `cls` from a (nested) ConfigDict or dict; unknown keys are an error naming them."""
    values = values.to_dict() if isinstance(values, ml_collections.ConfigDict) else dict(values)
    known = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - set(known))
    if unknown:
        raise ValueError("; ".join(unknown_key(cls, k, prefix) for k in unknown))
    kwargs = {}
    for name, value in values.items():
        hint = _hints(cls)[name]
        if dataclasses.is_dataclass(hint):
            value = from_config_dict(hint, value, f"{prefix}{name}.")
        elif not _fits(hint, value):  # a config file's value of another type (`"steps": "ten"`), named by its key
            raise ValueError(f"{prefix}{name}={value!r}: expected {_a(hint.__name__)}")
        else:
            check_value(cls, name, value, f"{prefix}{name}={value}")
        kwargs[name] = value
    return cls(**kwargs)


def _fits(hint, value) -> bool:
    """Whether `value` is of the plain type `hint` (an int is a float; a bool is no number); other hints pass."""
    if hint is bool:
        return isinstance(value, bool)
    if hint in (int, float):
        return isinstance(value, (int, float) if hint is float else int) and not isinstance(value, bool)
    if hint is str:
        return isinstance(value, str)
    return True


def apply_override(config: ml_collections.ConfigDict, cls: type, override: str) -> None:
    """Sets `KEY=VALUE` (dotted key) in `config`, a ConfigDict of `cls`, parsed to the field's declared type."""
    if "=" not in override:
        raise ValueError(f"--set {override!r}: expected KEY=VALUE")
    key, raw = (part.strip() for part in override.split("=", 1))
    node, node_cls = config, cls
    parts = key.split(".")
    for part in parts[:-1]:
        hint = _hints(node_cls).get(part) if dataclasses.is_dataclass(node_cls) else None
        if hint is None or not dataclasses.is_dataclass(hint):
            raise ValueError(f"--set {unknown_key(cls, key)}")
        node, node_cls = node[part], hint
    hint = _hints(node_cls).get(parts[-1])
    if hint is None or dataclasses.is_dataclass(hint):
        raise ValueError(f"--set {unknown_key(cls, key)}")
    value = parse_value(raw, hint, f"--set {key}")
    check_value(node_cls, parts[-1], value, f"--set {key}={value}")
    with node.ignore_type():  # the declared type decides, not the type of the value a preset left there
        node[parts[-1]] = value


# ---- argparse ------------------------------------------------------------------------------------------------------

def flag_name(name: str) -> str:
    return "--" + name.replace("_", "-")


def add_flags(parser: argparse.ArgumentParser, cls: type, *, exclude: Iterable[str] = (),
              defaults: dict[str, Any] | None = None, required: Iterable[str] = ()) -> None:
    """One flag per field of `cls` (less `exclude`), help and default from the field; `defaults` replaces some
    defaults for this command, `required` makes flags mandatory. Booleans get --x / --no-x."""
    defaults, exclude, required = defaults or {}, set(exclude), set(required)
    for field in dataclasses.fields(cls):
        if field.name in exclude:
            continue
        kind, nullable = _base_type(_hints(cls)[field.name])
        default = defaults.get(field.name, field.default)
        # Once each: a field's extra spelling may be its own name's (--text-field twice in --help otherwise).
        spellings = list(dict.fromkeys([flag_name(field.name), *field.metadata.get("flags", ())]))
        help_text = field.metadata.get("help", "")
        kind = field.metadata.get("valid") or kind  # a number's range parses and checks its flag
        # argparse %-formats help strings ("50%" would break); the default is shown by the help formatter.
        common = dict(dest=field.name, help=help_text.replace("%", "%%"))
        if kind is bool:
            parser.add_argument(*spellings, action=argparse.BooleanOptionalAction, default=default, **common)
        elif field.metadata.get("repeatable"):
            parser.add_argument(*spellings, action="append", required=field.name in required, **common)
        elif field.name in required:
            parser.add_argument(*spellings, type=kind, required=True, **common)
        else:
            parser.add_argument(*spellings, type=kind, default=default, **common)


def from_flags(cls: type, args: argparse.Namespace, **fixed) -> Any:
    """An instance of `cls` from parsed flags (fields without a flag keep their defaults), `fixed` on top."""
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if hasattr(args, f.name)}
    values.update(fixed)
    return cls(**values)

