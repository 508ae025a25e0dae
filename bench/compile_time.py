"""The pretraining step's compile time for a TPU slice, unrolled vs `model.scan_layers`, same run, same machine.

    .venv/bin/python bench/compile_time.py [--config bert-base-phase1] [--topology v5litepod-16] [--set KEY=VALUE]

Each side compiles in its own fresh process (no compilation cache, nothing shared), timed in phases around the
calls `bertjax compile` makes (`job.compile_step`): imports, setup (config, compile-only devices, mesh, abstract
state), tracing, lowering, and XLA:TPU's compile (wall and CPU seconds). Prints both sides, the scan/unrolled
ratios, and XLA:TPU's estimated step time of each compiled program (an estimate, not a measurement). Needs libtpu
(`jax[tpu]`).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

PHASES = ("imports_s", "setup_s", "trace_s", "lower_s", "xla_wall_s", "xla_cpu_s")


def _one_side(config: str, topology: str, overrides: list[str]) -> dict:
    """Compiles in this process (a child of main) and returns its phase times and the estimated step time."""
    started = time.perf_counter()
    import jax  # noqa: PLC0415 (the imports are a timed phase)

    from bertjax import sharding  # noqa: PLC0415
    from bertjax.cloud import compile as tpu_compile  # noqa: PLC0415
    from bertjax.cloud import estimate, topologies  # noqa: PLC0415
    from bertjax.pretraining import config as pretrain_config  # noqa: PLC0415
    from bertjax.pretraining.job import abstract_batch, build_job_step  # noqa: PLC0415

    marks = {"imports_s": time.perf_counter() - started}
    jax.config.update("jax_enable_compilation_cache", False)
    slice_ = topologies.parse_topology(topology, 1)
    job_config = tpu_compile.job_for_topology(
        pretrain_config.load_config(config, overrides, require_data=False), slice_)
    mesh = job_config.mesh.build(topologies.compile_only_devices(slice_))
    job = build_job_step(job_config, mesh, tpu_compile.vocab_size_of(job_config))
    batch = abstract_batch(job_config, mesh)
    clock = time.perf_counter()
    marks["setup_s"] = clock - started - marks["imports_s"]
    with sharding.activate(mesh):
        traced = job.train_step.trace(job.abstract_state, batch)
    marks["trace_s"], clock = time.perf_counter() - clock, time.perf_counter()
    lowered = traced.lower()
    marks["lower_s"], clock = time.perf_counter() - clock, time.perf_counter()
    cpu = time.process_time()
    compiled = lowered.compile()
    marks["xla_wall_s"], marks["xla_cpu_s"] = time.perf_counter() - clock, time.process_time() - cpu
    generation = topologies.GENERATIONS[slice_.generation]
    step = estimate.estimate_program(compiled.as_text(), clock_hz=generation.clock_hz,
                                     peak_flops=generation.peak_flops_per_chip,
                                     hbm_bytes_per_second=generation.hbm_bytes_per_second)
    return {**marks, "whole_s": time.perf_counter() - started, "estimated_step_ms": 1e3 * step.seconds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="bert-base-phase1")
    parser.add_argument("--topology", default="v5litepod-16")
    parser.add_argument("--set", action="append", default=[], help="more KEY=VALUE overrides for both sides")
    parser.add_argument("--side", default="", help=argparse.SUPPRESS)  # internal: compile one side, print JSON
    args = parser.parse_args()
    if args.side:
        print(json.dumps(_one_side(args.config, args.topology, args.set + [f"model.scan_layers={args.side}"])))
        return
    results = {}
    for side, scan in (("unrolled", "false"), ("scan", "true")):
        command = [sys.executable, __file__, "--config", args.config, "--topology", args.topology, "--side", scan]
        for override in args.set:
            command += ["--set", override]
        out = subprocess.run(command, check=True, capture_output=True, text=True,
                             env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"}).stdout
        results[side] = json.loads(out.strip().splitlines()[-1])
        print(f"{side:9s} " + ", ".join(f"{k[:-2]} {results[side][k]:.1f} s" for k in (*PHASES, "whole_s"))
              + f"; estimated step {results[side]['estimated_step_ms']:.2f} ms")
    ratio = {k: results["scan"][k] / results["unrolled"][k] for k in ("whole_s", "xla_wall_s", "xla_cpu_s",
                                                                     "estimated_step_ms")}
    print(f"{args.config} on {args.topology}: scan / unrolled: whole run {ratio['whole_s']:.2f}x, XLA compile "
          f"{ratio['xla_wall_s']:.2f}x wall, {ratio['xla_cpu_s']:.2f}x CPU; estimated step "
          f"{ratio['estimated_step_ms']:.2f}x")


if __name__ == "__main__":
    main()
