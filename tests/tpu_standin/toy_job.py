"""A stand-in for `bertjax pretrain` on the stand-in's workers, for tests of the launcher's mechanics that need
no training: `pretrain --workdir W [--set train.steps=N] [--max-steps-this-run K] [--fail MESSAGE] --distributed`.
Each worker counts steps from its saved position in W (resuming as a real job does), prints a step line every 0.2 s
(a resumed run: every 0.02 s, for the tests only need to see it resume and end), and worker 0 writes W/COMPLETED at
the end; after K steps of a run short of the end it exits STOPPED_EXIT, as a real job stopped so does; --fail
prints MESSAGE as an error and exits 1 instead."""
import os
import pathlib
import sys
import time

from bertjax.runtime.preemption import STOPPED_EXIT


def main(argv: list[str]) -> int:
    workdir = pathlib.Path(argv[argv.index("--workdir") + 1])
    steps = next((int(a.split("=")[1]) for a in argv if a.startswith("train.steps=")), 20)
    worker = int(os.environ["JAX_PROCESS_ID"])
    if "--fail" in argv:
        print(f"toy job: worker {worker} starting", flush=True)
        print(f"ValueError: {argv[argv.index('--fail') + 1]} (pid {os.getpid()})", flush=True)
        return 1
    workdir.mkdir(parents=True, exist_ok=True)
    position = workdir / f"position-{worker}"
    start = int(position.read_text()) if position.exists() else 0
    print(f"toy job: worker {worker} resumes at step {start}", flush=True)
    pace = 0.2 if start == 0 else 0.02
    end = min(steps, start + int(argv[argv.index("--max-steps-this-run") + 1])) if "--max-steps-this-run" in argv \
        else steps
    for step in range(start + 1, end + 1):
        time.sleep(pace)
        print(f"step {step}/{steps}", flush=True)
        # Atomically, as a real job saves: a preemption between truncate and write left an empty file.
        position.with_suffix(".tmp").write_text(str(step))
        os.replace(position.with_suffix(".tmp"), position)
    if end < steps:
        print(f"toy job: worker {worker} stopped at step {end} of {steps}", flush=True)
        return STOPPED_EXIT
    if worker == 0:
        (workdir / "COMPLETED").write_text("")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
