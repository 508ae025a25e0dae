"""The command that installs one of bertjax's extras (pyproject.toml's optional dependencies) where bertjax runs.

bertjax is not on PyPI: an extra does not install by the package's name. Run from a checkout (an editable install,
or the checkout on PYTHONPATH), the line installs the extra from that checkout; installed from a wheel, it installs
the extra's own requirements as the installed metadata pins them. Either way with this interpreter's pip, so the
line works as printed, from any directory.
"""
from __future__ import annotations

import importlib.metadata
import os
import re
import shlex
import sys

# bertjax/runtime/extras.py -> the directory holding the bertjax package.
_PACKAGE_PARENT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def checkout_of(package_parent: str = _PACKAGE_PARENT) -> str | None:
    """The checkout bertjax runs from (the directory of its pyproject.toml), or None when it runs installed."""
    return package_parent if os.path.isfile(os.path.join(package_parent, "pyproject.toml")) else None


def extra_requirements(extra: str) -> list[str]:
    """The requirements the installed bertjax's metadata lists for `extra` (`['jax[cuda12]==0.10.2']`)."""
    found = []
    for requirement in importlib.metadata.requires("bertjax") or []:
        spec, _, marker = requirement.partition(";")
        if re.fullmatch(rf"""\s*extra\s*==\s*["']{re.escape(extra)}["']\s*""", marker):
            found.append(spec.strip().replace(" ", ""))
    return found


def install_line(extra: str, *, package_parent: str = _PACKAGE_PARENT) -> str:
    """`/path/python -m pip install -e '/path/checkout[gpu]'` from a checkout, else `/path/python -m pip install
    'jax[cuda12]==0.10.2'` (the extra's requirements)."""
    pip = f"{shlex.quote(sys.executable)} -m pip install"
    checkout = checkout_of(package_parent)
    if checkout is not None:
        return f"{pip} -e {shlex.quote(f'{checkout}[{extra}]')}"
    requirements = extra_requirements(extra)
    if not requirements:
        raise ValueError(f"the installed bertjax has no extra {extra!r}")
    return f"{pip} {' '.join(shlex.quote(r) for r in requirements)}"
