"""A workdir's paths: one spelling per directory, and removal that never leaves the workdir.

A workdir is recorded and compared (run.json, LOCK's holder, config.json) as `canonical` spells it: `runs/../w` and
`w/` are one run, not a second one refused or resumed beside the first. And what a run clears in its workdir may be
a symlink a user made (a `tensorboard/` on a shared disk): `remove` takes the link away, never what it points to,
which lies outside the workdir and is not the run's to delete.
"""
from __future__ import annotations

import os

from etils import epath


def canonical(workdir: str) -> str:
    """`workdir` resolved (absolute, `..` and symlinks followed, no trailing slash); a URL (gs://) as given."""
    return workdir if "://" in workdir else os.path.realpath(workdir)


def remove(path: epath.Path) -> None:
    """Removes `path` if it exists: a symlink as a link (its target untouched), a directory with what it holds
    (links inside removed as links), a file."""
    if os.path.islink(str(path)):
        os.unlink(path)
    elif path.is_dir():
        path.rmtree()
    elif path.exists():
        path.unlink()
