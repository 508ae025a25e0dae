"""Run a bertjax command as N local processes joined by jax.distributed: the TPU-pod code path, on one machine.

    bertjax launch local --processes 2 --devices-per-process 4 -- pretrain --config bert-tiny --workdir runs/mp ...

Each process gets its own share of CPU devices (XLA_FLAGS), the coordinator on 127.0.0.1, and the same
`--coordinator/--num-processes/--process-id` flags a multi-host job passes; its output is prefixed with its index.
The launcher exits with the first non-zero exit code, terminating the others; a worker that stopped before the
job's end with its state saved (STOPPED_EXIT) ends nothing: the others are waited for (they stop at the same step),
and the launcher exits STOPPED_EXIT too. With --max-restarts K it babysits the job (bertjax/cloud/babysitter.py): a
run whose worker was killed, or that stopped so, is started again, and resumes from its checkpoints.

The workers end with their launcher, always (orphans would sit idle holding memory and the workdir's lock): a
SIGTERM, SIGINT or SIGHUP to the launcher is passed on to every worker (a job saves at its next step boundary and
exits), the launcher waits STOP_GRACE_S for them, then kills what is left; a launcher killed outright (SIGKILL) takes
its workers with it (PR_SET_PDEATHSIG: the kernel kills each when the launcher dies, as a host lost takes its job;
they resume from their last checkpoint, and their lock is a dead holder's, free to take). A launcher stopped so
exits with its workers' status (STOPPED_EXIT for a training job that saved before its end; babysat: STOPPED_EXIT
unless the job completed), never restarting them.
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import ctypes
import os
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time

from bertjax import options
from bertjax.cloud.babysitter import USAGE_ERROR_EXIT, babysit
from bertjax.runtime.preemption import STOP_SIGNALS, STOPPED_EXIT
from bertjax.runtime.quiet import START_UP_LINE

# How long workers asked to stop get to save and exit before they are killed (a save is seconds; a scheduler's
# own grace after its SIGTERM is typically 30 s).
STOP_GRACE_S = 30.0
PR_SET_PDEATHSIG = 1  # linux/prctl.h


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _relay(prefix: str, stream, sink, tail=None, quiet: bool = True) -> None:
    """A worker's output lines, prefixed with its name; `quiet`: without the native start-up lines (gloo's "Rank N
    is connected", printed whenever the workers' CPU devices join a new collective)."""
    for line in iter(stream.readline, b""):
        if quiet and START_UP_LINE.search(line):
            continue
        text = f"[{prefix}] " + line.decode(errors="replace")
        sink.write(text)
        sink.flush()
        if tail is not None:
            tail.append(text)


def _dies_with_parent(parent_pid: int, prctl):
    """A worker's pre-exec step: the kernel sends it SIGKILL when its launcher dies (if the launcher is already gone,
    it ends now). Only a preloaded C call and os calls: a forked child of a threaded process must not take locks.
    None where there is no prctl (not Linux)."""
    if prctl is None:
        return None

    def arrange() -> None:
        prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != parent_pid:  # died between fork and prctl: nobody would send the signal
            os._exit(1)
    return arrange


class LocalProcesses:
    """The local backend: a job's workers as N processes on this machine, joined by jax.distributed.

    A worker killed by a signal (SIGKILL, as a preempted host dies) ends the run as a preemption: the others are
    killed too, as a slice's workers all go with it. Exit code 2 (bertjax's bad input or configuration) is a
    refusal; any other non-zero exit is a failure (the others are stopped either way), but STOPPED_EXIT: the job
    saved and stopped before its end (all its workers at one step, so the others are waited for), a "resumable"
    end. A stop signal to the launcher (`stopping_on_signals`) is passed on to the workers: then the run ends as
    "stopped", whatever their codes.
    """

    def __init__(self, processes: int, devices_per_process: int, env: dict | None = None,
                 program: list[str] | None = None, tail_lines: int = 40, grace_s: float = STOP_GRACE_S):
        self.processes, self.devices_per_process = processes, devices_per_process
        self.env, self.program, self.tail_lines, self.grace_s = env, program, tail_lines, grace_s
        self.children: list[subprocess.Popen] = []
        self.stop_signal: int | None = None  # the signal that asked the launcher to stop
        self._kill_at = float("inf")
        self._prctl = getattr(ctypes.CDLL(None), "prctl", None)  # loaded here, not in the forked child

    @contextlib.contextmanager
    def stopping_on_signals(self):
        """While in it, SIGTERM/SIGINT/SIGHUP to the launcher are passed on to the workers (see `wait`)."""
        previous = {sig: signal.signal(sig, self._stop) for sig in STOP_SIGNALS}
        try:
            yield self
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _stop(self, signum, frame) -> None:
        if self.stop_signal is None:
            self.stop_signal, self._kill_at = signum, time.monotonic() + self.grace_s
            print(f"bertjax launch: {_signal_name(signum)}: passing it on to the workers; each stops at its next "
                  f"step boundary (killed after {self.grace_s:.0f}s)", file=sys.stderr, flush=True)
        for child in self.children:
            if child.poll() is None:
                child.send_signal(signum)

    def start(self, command: list[str]) -> None:
        port = free_port()
        self.children, self._tail = [], collections.deque(maxlen=self.tail_lines)
        # Before the workers' first lines, which come once each has imported JAX and TensorFlow and joined the
        # others (34 s on a busy 2-core machine): the launcher said nothing that long.
        print(f"bertjax launch: starting {self.processes} process(es) of {self.devices_per_process} CPU device(s) "
              f"each, joined through 127.0.0.1:{port}: {shlex.join(self.program or ['bertjax'])} "
              f"{shlex.join(command)}; their lines follow once each has imported JAX and TensorFlow and joined the "
              f"others (~30 s on 2 cores)", file=sys.stderr, flush=True)
        for index in range(self.processes):
            child_env = dict(os.environ if self.env is None else self.env)
            child_env["JAX_PLATFORMS"] = "cpu"
            child_env["XLA_FLAGS"] = (child_env.get("XLA_FLAGS", "").replace(
                "--xla_force_host_platform_device_count=8", "") +
                f" --xla_force_host_platform_device_count={self.devices_per_process}").strip()
            argv = [*(self.program or [sys.executable, "-m", "bertjax.cli"]), *command,
                    "--coordinator", f"127.0.0.1:{port}", "--num-processes", str(self.processes),
                    "--process-id", str(index)]
            child = subprocess.Popen(argv, env=child_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     preexec_fn=_dies_with_parent(os.getpid(), self._prctl))
            threading.Thread(target=_relay, args=(f"p{index}", child.stdout, sys.stdout, self._tail,
                                                  "--verbose" not in command), daemon=True).start()
            self.children.append(child)
            if self.stop_signal is not None:  # it came while the workers were being started
                child.send_signal(self.stop_signal)

    def wait(self) -> tuple[int, str]:
        """(the first abnormal exit code, or 0; the kind of end: "exited" | "resumable" (STOPPED_EXIT) |
        "preempted" | "refused" | "failed" | "stopped", by a signal to the launcher: its workers are waited for,
        those left after the grace killed)."""
        while True:
            codes = [child.poll() for child in self.children]
            if self.stop_signal is not None:
                if None not in codes:
                    return next((code for code in codes if code != 0), 0), "stopped"
                if time.monotonic() >= self._kill_at:
                    print(f"bertjax launch: {codes.count(None)} worker(s) still running {self.grace_s:.0f}s after "
                          f"{_signal_name(self.stop_signal)}; killing them", file=sys.stderr, flush=True)
                    self._kill_all()
            elif bad := [code for code in codes if code not in (None, 0, STOPPED_EXIT)]:
                index = codes.index(bad[0])
                how = (f"was killed by {_signal_name(-bad[0])}" if bad[0] < 0 else f"exited with status {bad[0]}")
                print(f"bertjax launch: worker p{index} (pid {self.children[index].pid}) {how}; stopping the "
                      f"{len(self.children) - 1} other(s)", file=sys.stderr, flush=True)
                self._kill_all()
                kind = "preempted" if bad[0] < 0 else "refused" if bad[0] == USAGE_ERROR_EXIT else "failed"
                return bad[0], kind
            elif None not in codes:  # every worker ended by itself, each done or saved and stopped at one step
                return (STOPPED_EXIT, "resumable") if STOPPED_EXIT in codes else (0, "exited")
            time.sleep(0.2)

    def _kill_all(self) -> None:
        for child in self.children:
            if child.poll() is None:
                child.kill()
        for child in self.children:
            child.wait()

    def run(self, command: list[str]) -> tuple[str, str]:
        """Runs the job to its end: (kind of end, the last lines of its output), for bertjax.cloud.babysitter."""
        if self.stop_signal is not None:  # asked to stop between two runs: no new one
            return "stopped", ""
        self.start(command)
        _, kind = self.wait()
        time.sleep(0.2)  # let the relay threads take the last lines
        return kind, "".join(self._tail)


def launch(command: list[str], processes: int, devices_per_process: int, env: dict | None = None,
           program: list[str] | None = None, grace_s: float = STOP_GRACE_S) -> int:
    """Starts `bertjax <command>` (or `program + command`) in `processes` processes, each with
    `--coordinator/--num-processes/--process-id` appended; returns the first non-zero exit code (or 0): a job
    stopped before its end, by itself or by a stop signal passed on, STOPPED_EXIT."""
    workers = LocalProcesses(processes, devices_per_process, env, program, grace_s=grace_s)
    with workers.stopping_on_signals():
        workers.start(command)
        code = workers.wait()[0]
    return 128 - code if code < 0 else code  # a worker killed by signal N: the shell's 128 + N


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The launcher's flags (`bertjax launch local` and `python launch/local.py` alike)."""
    parser.add_argument("--processes", type=options.ints(1), default=2, help="jax.distributed processes to run")
    parser.add_argument("--devices-per-process", type=options.ints(1), default=4,
                        help="CPU devices each process gets (XLA's host platform device count)")
    parser.add_argument("--max-restarts", type=options.ints(0), default=0,
                        help="babysit a pretrain command: run it again after a preemption (a worker killed) until "
                             "its workdir has the completion marker, at most this many times")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the bertjax command after --")


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """Runs the parsed launcher command; usage errors through `parser.error`."""
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the bertjax command after --, e.g. -- pretrain --config bert-tiny ...")
    if not args.max_restarts:
        return launch(command, args.processes, args.devices_per_process)
    if "--workdir" not in command[:-1]:
        parser.error("--max-restarts babysits a pretrain command: it needs the command's --workdir")
    with LocalProcesses(args.processes, args.devices_per_process).stopping_on_signals() as workers:
        return babysit(workers, command, command[command.index("--workdir") + 1], args.max_restarts)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv), parser)

if __name__ == "__main__":
    sys.exit(main())
