"""Run a bertjax command as N local processes joined by jax.distributed: the TPU-pod code path, on one machine.

    python launch/local.py --processes 2 --devices-per-process 4 -- pretrain --config bert-tiny --workdir runs/mp ...

Each process gets its own share of CPU devices (XLA_FLAGS), the coordinator on 127.0.0.1, and the same
`--coordinator/--num-processes/--process-id` flags a multi-host job passes; its output is prefixed with its index.
The launcher exits with the first non-zero exit code, terminating the others.
"""
from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import threading


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _relay(prefix: str, stream, sink) -> None:
    for line in iter(stream.readline, b""):
        sink.write(f"[{prefix}] " + line.decode(errors="replace"))
        sink.flush()


def launch(command: list[str], processes: int, devices_per_process: int, env: dict | None = None,
           program: list[str] | None = None) -> int:
    """Starts `bertjax <command>` (or `program + command`) in `processes` processes, each with
    `--coordinator/--num-processes/--process-id` appended; returns the first non-zero exit code (or 0)."""
    port = free_port()
    children = []
    for index in range(processes):
        child_env = dict(os.environ if env is None else env)
        child_env["JAX_PLATFORMS"] = "cpu"
        child_env["XLA_FLAGS"] = (child_env.get("XLA_FLAGS", "").replace(
            "--xla_force_host_platform_device_count=8", "") +
            f" --xla_force_host_platform_device_count={devices_per_process}").strip()
        argv = [*(program or [sys.executable, "-m", "bertjax.cli"]), *command, "--coordinator", f"127.0.0.1:{port}",
                "--num-processes", str(processes), "--process-id", str(index)]
        child = subprocess.Popen(argv, env=child_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        threading.Thread(target=_relay, args=(f"p{index}", child.stdout, sys.stdout), daemon=True).start()
        children.append(child)
    code = 0
    for child in children:
        result = child.wait()
        if result and not code:
            code = result
            for other in children:
                if other.poll() is None:
                    other.terminate()
    return code


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--devices-per-process", type=int, default=4)
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the bertjax command after --")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the bertjax command after --, e.g. -- pretrain --config bert-tiny ...")
    return launch(command, args.processes, args.devices_per_process)


if __name__ == "__main__":
    sys.exit(main())
