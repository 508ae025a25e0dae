"""A stand-in for `gcloud compute tpus tpu-vm scp|ssh NAME --worker=all|N --zone Z --project P [--command CMD]`.

Workers are directories `$TPU_STANDIN_ROOT/<NAME>/worker-<i>/` (their home); the node is up while
`$TPU_STANDIN_ROOT/<NAME>/state` says ACTIVE (written by the API stand-in). `ssh` runs the command with bash in
every chosen worker's home, each in a session of its own, with the environment a TPU VM's metadata would give:
which worker it is and where the coordinator is (JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID;
one free port per ssh call), CPU devices, and the stand-in's worker bin first on PATH (its python3 and uv make the
set-up's venv and check the wheel was copied; the venv's `bertjax` runs this checkout). As sshd does when a
connection drops, the commands' process groups get SIGHUP when this process is told to stop, when its caller dies,
or when the node stops being ACTIVE (then it exits 255, as ssh does on a lost connection).
"""
from __future__ import annotations

import json
import os
import pathlib
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _fail(message: str, code: int = 1) -> int:
    print(f"ERROR: (gcloud.compute.tpus.tpu-vm) {message}", file=sys.stderr)
    return code


def _parse(argv: list[str]) -> tuple[str, list[str], dict]:
    if argv[:3] != ["compute", "tpus", "tpu-vm"] or len(argv) < 4:
        raise SystemExit(_fail(f"stand-in gcloud: unsupported command {argv}", 2))
    verb, positional, flags, rest = argv[3], [], {}, argv[4:]
    while rest:
        item = rest.pop(0)
        if item == "--command":
            flags["command"] = rest.pop(0)
        elif item.startswith("--"):
            key, _, value = item[2:].partition("=")
            flags[key] = value
        else:
            positional.append(item)
    return verb, positional, flags


def main(argv: list[str]) -> int:
    root = pathlib.Path(os.environ["TPU_STANDIN_ROOT"])
    config = json.loads((root / "config.json").read_text())
    verb, positional, flags = _parse(argv)
    name = positional[0] if verb == "ssh" else positional[1].rstrip(":")
    node = root / name
    state_file = node / "state"
    if not state_file.exists() or state_file.read_text() != "ACTIVE":
        return _fail(f"NOT_FOUND: node {name} is not ready")
    workers = sorted(node.glob("worker-*"), key=lambda path: int(path.name.split("-")[1]))
    chosen = workers if flags.get("worker", "0") == "all" else [workers[int(flags.get("worker", "0"))]]
    if verb == "scp":
        for worker in chosen:
            shutil.copy(positional[0], worker)
        return 0
    if verb != "ssh" or "command" not in flags:
        return _fail(f"stand-in gcloud: unsupported {verb} {flags}", 2)
    return _ssh(chosen, len(workers), flags["command"], state_file, config)


def _ssh(chosen, count, command, state_file, config) -> int:
    port = _free_port()
    children = []
    for worker in chosen:
        index = int(worker.name.split("-")[1])
        env = {"HOME": str(worker), "PATH": f"{config['worker_bin']}:/usr/bin:/bin", "LANG": "C.UTF-8",
               "JAX_PLATFORMS": "cpu", "TF_CPP_MIN_LOG_LEVEL": "2", "PYTHONPATH": config["repo"],
               "XLA_FLAGS": config["xla_flags"],
               "XDG_CACHE_HOME": config["cache"], "JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{port}",
               "JAX_NUM_PROCESSES": str(count), "JAX_PROCESS_ID": str(index)}
        children.append(subprocess.Popen(["bash", "-c", command], cwd=worker, env=env, start_new_session=True,
                                         stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                         stderr=subprocess.STDOUT))
    hung_up = threading.Event()

    def hang_up(*_):
        hung_up.set()
        for child in children:
            try:
                os.killpg(child.pid, signal.SIGHUP)
            except ProcessLookupError:
                pass

    signal.signal(signal.SIGTERM, hang_up)
    signal.signal(signal.SIGHUP, hang_up)

    def relay(child):
        try:
            for line in iter(child.stdout.readline, b""):
                sys.stdout.buffer.write(line)
                sys.stdout.buffer.flush()
        except (BrokenPipeError, ValueError):  # whoever read us is gone: the connection dropped
            hang_up()

    threads = [threading.Thread(target=relay, args=(child,), daemon=True) for child in children]
    for thread in threads:
        thread.start()
    parent = os.getppid()
    while any(child.poll() is None for child in children):
        if os.getppid() != parent or state_file.read_text() != "ACTIVE":
            hang_up()
        if hung_up.is_set():
            time.sleep(0.2)
            for child in children:
                if child.poll() is None:
                    try:
                        os.killpg(child.pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
            return 255
        time.sleep(0.1)
    for thread in threads:
        thread.join(timeout=5)
    return max((child.returncode for child in children), key=abs)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
