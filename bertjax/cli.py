"""The `bertjax` command line: one subcommand group per module that owns the job.

Each module listed in COMMAND_MODULES exposes `register(subparsers)`, which adds its subcommands and sets
`func` on each parser to a callable taking the parsed args and returning an exit code.
"""
from __future__ import annotations

import argparse
import importlib
import os
import re
import sys

from bertjax import host_memory, platforms, quiet

COMMAND_MODULES = (
    "bertjax.interop.cli",
    "bertjax.data.cli",
    "bertjax.finetune.cli",
    "bertjax.pretraining.cli",
    "bertjax.cloud.cli",
)


# Commands whose steps all have one shape, where keeping freed memory pays (see host_memory).
FIXED_SHAPE_COMMANDS = ("pretrain",)
# Commands that never import TensorFlow (the others start it quietly before they run).
WITHOUT_TENSORFLOW = ("config", "launch", "eval", "demo-corpus", "goodput")


class HelpWithDefaults(argparse.HelpFormatter):
    """Help lines end with the option's default, where it has a meaningful one."""

    def _get_help_string(self, action):
        text = action.help or ""
        shown = action.default not in (None, "", argparse.SUPPRESS, False) or isinstance(action.default, bool) \
            and action.nargs == 0 and not isinstance(action, argparse._StoreTrueAction)
        if "%(default)" in text or "(default" in text or not action.option_strings or not shown or action.required:
            return text
        return f"{text} (default: %(default)s)"


def build_parser() -> argparse.ArgumentParser:
    """The full argument parser with every registered subcommand; every command shows its defaults in --help
    and takes --verbose."""
    parser = argparse.ArgumentParser(prog="bertjax", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=version_line())
    subparsers = parser.add_subparsers(dest="command", required=True)
    for module_name in COMMAND_MODULES:
        importlib.import_module(module_name).register(subparsers)
    for path, command in walk_commands(parser):
        command.formatter_class = HelpWithDefaults
        if not _subcommands(command):
            command.add_argument("--verbose", action="store_true",
                                 help="also show TensorFlow's and XLA's native start-up log lines")
    return parser


def version_line() -> str:
    """`bertjax 0.1.0 (jax 0.10.2, Python 3.11.9) at /path/to/bertjax`: the installed version and where it runs from
    (an editable install and a checkout on PYTHONPATH can differ), without importing JAX."""
    import importlib.metadata

    def installed(name: str) -> str:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            return "not installed"

    here = os.path.dirname(os.path.abspath(__file__))
    return f"bertjax {installed('bertjax')} (jax {installed('jax')}, Python {sys.version.split()[0]}) at {here}"


def walk_commands(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()):
    """(("data", "create"), parser) for every parser of the tree, the root first (path ())."""
    yield path, parser
    for name, child in _subcommands(parser).items():
        yield from walk_commands(child, path + (name,))


def _subcommands(parser: argparse.ArgumentParser) -> dict:
    for action in parser._actions:  # argparse keeps the subparsers only here
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def main(argv: list[str] | None = None) -> int:
    # Before JAX starts: no probing for accelerators that are not there (libtpu installed on a CPU machine).
    platforms.use_cpu_where_no_accelerator(os.environ)
    args = build_parser().parse_args(argv)  # imports neither JAX nor TensorFlow
    if args.command in FIXED_SHAPE_COMMANDS:
        # Before anything starts JAX's threads (see host_memory): ~9% faster CPU train steps. Only for jobs that
        # run one compiled shape over and over: with several shapes (fine-tuning's length buckets, eval,
        # prediction) the never-shrinking heap grew to 12 GB for a 22M-parameter fine-tune.
        host_memory.keep_freed_memory_if_cpu_job(os.environ)
    if args.command not in WITHOUT_TENSORFLOW:
        quiet.start_tensorflow(verbose=args.verbose)
    try:
        return int(args.func(args) or 0)
    except (ValueError, FileNotFoundError, KeyError) as error:
        # Bad input is reported as one clear line, not a traceback. One that ends a job while Orbax's writer threads
        # are dying with tracebacks of their own starts on a line of its own (theirs may be half written).
        line = f"bertjax {args.command}: error: {error}"
        if getattr(error, "exit_now", False):
            # Orbax's writer threads may still be dying with tracebacks of their own: their stderr goes to /dev/null
            # first, then our line goes to the real stderr, so it stays the last line whatever they do meanwhile.
            sys.stdout.flush()
            sys.stderr.flush()
            real_stderr = os.dup(2)
            os.dup2(os.open(os.devnull, os.O_WRONLY), 2)
            os.write(real_stderr, f"\n{line}\n".encode())
            os._exit(2)
        print(line, file=sys.stderr)
        return 2
    except Exception as error:
        # Bad input found while tf.data reads a file (file_readers.CorpusError inside a numpy_function) arrives wrapped in
        # TensorFlow's error, with a traceback in its message: told as the same one line.
        found = re.search(r"CorpusError: (.*)", str(error))
        if not found or type(error).__module__.split(".")[0] != "tensorflow":
            raise
        print(f"bertjax {args.command}: error: {found.group(1)}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
