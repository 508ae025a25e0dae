"""Options defined once, as fields of frozen dataclasses; everything else is derived from those fields.

A config class (BertConfig, PretrainingDataConfig, OptimizerConfig, ...) lists each option with its type, default
and help text, validates itself in `__post_init__`, and builds the object it configures. From the same fields:
- `to_config_dict` / `from_config_dict`: the ml_collections ConfigDict that presets (configs/*.py) edit, and back;
- `apply_override`: `--set KEY=VALUE`, parsed to the field's declared type, unknown keys named;
- `add_flags` / `from_flags`: argparse flags for commands that take the options one by one (`data create`,
  `finetune`), so a default is never restated in a parser.
"""
from __future__ import annotations

import argparse
import ast
import dataclasses
import difflib
import functools
import types
import typing
from typing import Any, Iterable

import ml_collections


def option(default: Any = dataclasses.MISSING, help: str = "", *, flags: Iterable[str] = (),
           repeatable: bool = False, default_factory: Any = dataclasses.MISSING) -> Any:
    """A dataclass field with its help text, extra command-line spellings (e.g. an older flag name), and for a
    list-like string option whether its flag may be repeated (the config class then joins the values)."""
    return dataclasses.field(default=default, default_factory=default_factory,
                             metadata={"help": help, "flags": tuple(flags), "repeatable": repeatable})


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


def at_least(minimum: int):
    """An argparse `type`: an integer >= `minimum` (a count of 0 would run nothing and exit 0)."""
    def parse(text: str) -> int:
        value = int(text)
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {value}")
        return value
    return parse
