"""JSON as every strict parser reads it: a non-finite number (NaN, +-Infinity) is written as null.

Python's json module writes `NaN` and `Infinity` by default, which is not JSON (JavaScript's JSON.parse, jq and
most other parsers reject the whole file). Every JSON file or line the project writes goes through here.
"""
from __future__ import annotations

import json
import math

import numpy as np


def finite(value):
    """`value` with every non-finite float (Python or numpy, at any depth of dicts, lists and tuples) replaced by
    None, and numpy scalars made Python numbers."""
    if isinstance(value, dict):
        return {key: finite(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite(item) for item in value]
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def dumps(value, **kwargs) -> str:
    """json.dumps of finite(value); refuses (ValueError) what would still not be JSON."""
    return json.dumps(finite(value), allow_nan=False, **kwargs)


def dump(value, f, **kwargs) -> None:
    """json.dump of finite(value) into the open text file `f`."""
    f.write(dumps(value, **kwargs))
