"""The `bertjax` command line: one subcommand group per module that owns the job.

Each module listed in COMMAND_MODULES exposes `register(subparsers)`, which adds its subcommands and sets
`func` on each parser to a callable taking the parsed args and returning an exit code.
"""
from __future__ import annotations

import argparse
import importlib
import os
import re
import signal
import sys
import traceback

from bertjax.runtime import errors, host_memory, platforms, preemption, quiet

COMMAND_MODULES = (
    "bertjax.interop.cli",
    "bertjax.data.cli",
    "bertjax.finetune.cli",
    "bertjax.pretraining.cli",
    "bertjax.cloud.cli",
)


# Commands whose steps all have one shape, where keeping freed memory pays (see host_memory).
FIXED_SHAPE_COMMANDS = ("pretrain",)
# Commands that never import TensorFlow (the others start it quietly before they run): ~5 CPU-s and ~0.7 GB of
# resident memory that a fine-tune on a table file and a prediction do without (their tokenizer is host_tokenizer's).
WITHOUT_TENSORFLOW = ("config", "launch", "eval", "demo-corpus", "goodput", "predict", "finetune classify")
# Commands that run JAX on this machine's own devices (`compile` compiles for others, through their plugins).
OWN_DEVICE_COMMANDS = ("pretrain", "finetune", "predict", "embed", "score")
# Commands that start neither JAX nor TensorFlow (no address-space floor to check).
WITHOUT_JAX_OR_TENSORFLOW = ("config", "launch", "eval", "demo-corpus", "goodput")
# Commands that pass stop signals on to the jobs they run; every other one is stopped by them in one line, its
# cleanup run (preemption.Stopped; training loops take them as a request to save and stop at a step boundary).
PASSES_STOP_SIGNALS_ON = ("launch",)


class HelpWithDefaults(argparse.HelpFormatter):
    """Help lines end with the option's default: every option that takes a value and is not required (`none` where
    it has none). An option whose default follows another's says so in its own help, `(default: ...)`, kept as is;
    a flag (store_true) has none to show."""

    def _get_help_string(self, action):
        text = action.help or ""
        flag = action.nargs == 0 and not isinstance(action, argparse.BooleanOptionalAction)
        if "(default" in text or not action.option_strings or action.required or flag \
                or action.default is argparse.SUPPRESS:
            return text
        return f"{text} (default: {self._default_text(action)})"

    @staticmethod
    def _default_text(action) -> str:
        """`%(default)s`; `none` for an unset one (None, an empty list), '' where the help says what '' means."""
        if action.default is None or action.default == [] or action.default == "" and "''" not in (action.help or ""):
            return "none"
        return "''" if action.default == "" else "%(default)s"


def build_parser() -> argparse.ArgumentParser:
    """The full argument parser with every registered subcommand; every command shows its defaults in --help
    and takes --verbose."""
    parser = argparse.ArgumentParser(prog="bertjax", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action=PrintVersion)
    subparsers = parser.add_subparsers(dest="command", required=True)
    for module_name in COMMAND_MODULES:
        importlib.import_module(module_name).register(subparsers)
    for path, command in walk_commands(parser):
        command.formatter_class = HelpWithDefaults
        if not _subcommands(command):
            command.add_argument("--verbose", action="store_true",
                                 help="also show TensorFlow's and XLA's native start-up log lines")
    return parser


class PrintVersion(argparse.Action):
    """`--version`: `version_line()` as one line (argparse's own version action wraps it at the terminal's width,
    which a long install path crosses)."""

    def __init__(self, option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS,
                 help="show the version and where bertjax runs from, then exit"):  # noqa: A002 - argparse's name
        super().__init__(option_strings, dest=dest, default=default, nargs=0, help=help)

    def __call__(self, parser, namespace, values, option_string=None):
        print(version_line())
        parser.exit()


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
    """Runs a command; its exit status: 0 done, 1 a failure (a bug: its traceback), 2 refused for its input or setup,
    preemption.STOPPED_EXIT (75) a training job stopped before its end with its state saved (the same command
    resumes it), 128 + N a command without a training loop stopped by signal N (docs/usage.md, "Exit statuses")."""
    # Before JAX starts: no probing for accelerators that are not there (libtpu installed on a CPU machine).
    platforms.use_cpu_where_no_accelerator(os.environ)
    args = build_parser().parse_args(argv)  # imports neither JAX nor TensorFlow
    # The command as typed, for the records a job keeps of its run (run.json, metrics.jsonl) and the model card.
    args.argv = list(sys.argv[1:] if argv is None else argv)
    if args.command in FIXED_SHAPE_COMMANDS:
        # Before anything starts JAX's threads (see host_memory): ~9% faster CPU train steps. Only for jobs that
        # run one compiled shape over and over: with several shapes (fine-tuning's length buckets, eval,
        # prediction) the never-shrinking heap grew to 12 GB for a 22M-parameter fine-tune.
        host_memory.keep_freed_memory_if_cpu_job(os.environ)
    if args.command in OWN_DEVICE_COMMANDS:
        platforms.skip_accelerator_plugins(os.environ)
    with preemption.stopped_by_raising(args.command not in PASSES_STOP_SIGNALS_ON):
        return _run(args, argv)


def _run(args: argparse.Namespace, argv: list[str] | None) -> int:
    """Runs the command; a job-ending error, a stop signal or a closed stdout told as `main` says."""
    try:
        if args.command not in WITHOUT_JAX_OR_TENSORFLOW:
            host_memory.check_address_space()
        if command_path(args) not in WITHOUT_TENSORFLOW and args.command not in WITHOUT_TENSORFLOW:
            quiet.start_tensorflow(verbose=args.verbose)
        return int(args.func(args) or 0)
    except preemption.Stopped as stopped:
        line = f"bertjax {args.command}: {stopped}"
        if argv is not None:
            print(line, file=sys.stderr)
            return 128 + stopped.signum
        end_process(line, 128 + stopped.signum)
    except BrokenPipeError:
        if argv is not None:
            raise
        ended_by_a_closed_pipe()  # pragma: no cover - the process ends there
    except Exception as error:  # noqa: BLE001 - every job-ending error is told as one line
        line = job_error_line(error)
        if line is None and argv is not None:  # a bug, in-process (tests): raised as it is
            raise
        if line is None:  # a bug, not bad input: its traceback is what its reader needs; exit 1, a failure
            traceback.print_exc()
        code = 2 if line is not None else 1  # 2: refused for its input or setup (a babysitter does not retry it)
        line = errors.clipped(f"bertjax {args.command}: error: {line or errors.first_line(error)}")
        if argv is None or getattr(error, "exit_now", False):
            end_process(line, code)
        print(line, file=sys.stderr)
        return 2


def command_path(args: argparse.Namespace) -> str:
    """"finetune classify" for a command with a job, else the command ("predict"). `launch` keeps the job's argv
    in `command` (a list): no name of its own here."""
    return " ".join(part for part in (args.command, getattr(args, "job", None)) if isinstance(part, str))


def job_error_line(error: BaseException) -> str | None:
    """The one line that tells a job-ending error caused by its input or setup, or None for a bug. Bad input found
    while tf.data reads a file (file_readers.CorpusError inside a numpy_function) arrives wrapped in TensorFlow's
    error, with a traceback in its message: told by the reader's own line."""
    limit = errors.limit_line(error)  # a process limit (ulimit -n, -f, -v) hit: named, with its value
    # bertjax's own lines name what they need; a library's raw status (TensorStore's "RESOURCE_EXHAUSTED: ...",
    # an OSError's "[Errno 24] ...") does not.
    raw = re.match(r"[A-Z_]+: |\[Errno \d+\]", str(error))
    if limit is None and isinstance(error, OSError) and errors.is_file_failure(error):  # the file and why, no errno
        return errors.file_failure_line(error)
    if isinstance(error, (ValueError, FileNotFoundError, KeyError)) and (limit is None or not raw):
        return str(error)
    if limit is not None:
        where = getattr(error, "filename", None)
        return f"{where}: {limit}" if where and not limit.startswith(str(where)) else limit
    if isinstance(error, OSError) and error.filename:  # the machine's state, not a bug
        return str(error)
    found = re.search(r"CorpusError: (.*)", str(error))
    if found and type(error).__module__.split(".")[0] == "tensorflow":
        return found.group(1)
    if errors.is_file_failure(error):  # a library's file failure no boundary (errors.at_file) caught: by its path
        return errors.file_failure_line(error)
    return None


def ended_by_a_closed_pipe() -> None:
    """Ends the process as a Unix tool ends when the reader of its stdout has gone (`bertjax info X | head -1`): by
    SIGPIPE, the shell's status 141, quietly (Python ignores SIGPIPE and raises BrokenPipeError instead, whose
    traceback, and a second one at exit when stdout is flushed, would follow)."""
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # nothing left to flush at exit
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGPIPE)


def end_process(line: str, code: int) -> None:
    """Ends the process now: `line` last on stderr, exit status `code`, no teardown. A job's fatal error must end it
    within seconds, and teardown can block forever: a tf.data iterator whose reader raised waits in its destructor
    for work that never finishes (it runs when the error's traceback is freed), and Orbax's, the lock heartbeat's
    and W&B's threads may still be alive. The job's own cleanup (lock release, partial output removed, writers
    closed) has run on the way out of its `with`/`finally` blocks; other threads' stderr goes to /dev/null first,
    so the line stays last whatever they print meanwhile (Orbax's dying threads print 'Event loop is closed')."""
    sys.stdout.flush()
    sys.stderr.flush()
    real_stderr = os.dup(2)
    os.dup2(os.open(os.devnull, os.O_WRONLY), 2)
    os.write(real_stderr, f"\n{line}\n".encode())
    os._exit(code)


if __name__ == "__main__":
    sys.exit(main())
