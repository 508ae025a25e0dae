"""`bertjax compile` (the pretraining step compiled for a TPU slice or a GPU host ahead of time), `bertjax launch
tpu` (a Cloud TPU queued resource, babysat through preemptions), `bertjax launch gke` (xpk) and `bertjax launch
local` (N local jax.distributed processes).

google-cloud-tpu (extra `cloud`) is imported only when the command runs, so `bertjax --help` stays fast.
"""
from __future__ import annotations

import argparse
import importlib.metadata
import os
import pathlib
import shlex
import shutil
import subprocess
import sys
import tempfile
import time

from bertjax import options


def register(subparsers) -> None:
    aot = subparsers.add_parser("compile", help="compile the pretraining step for a TPU slice or a GPU host on "
                                "this machine: HBM fit, FLOPs, time and chip-hours before renting it")
    aot.add_argument("--config", help="preset name in configs/ or a .py path (the pretraining step; or --embedding)")
    aot.add_argument("--topology", required=True, help="gcloud accelerator type (v5litepod-16, v4-32, v5p-16, "
                     "v6e-16) or topology (v5e:4x4, v4:2x2x4); or a GPU host: h100, h200, a100, or K cards on one "
                     "host such as h100x8 (needs the gpu extra)")
    aot.add_argument("--num-slices", type=options.ints(1), default=1,
                     help="multi-slice: this many slices (mesh.dcn_data)")
    aot.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                     help="override a config key (repeatable)")
    aot.add_argument("--mfu", type=options.floats(0, 1, low_open=True),
                     help="assume this model FLOPs utilisation for step time and hours instead of the estimate of "
                     "the compiled step (default: the estimate)")
    aot.add_argument("--dump-hlo", default="", metavar="FILE", help="write the compiled HLO text to FILE")
    aot.add_argument("--fit-batch", action="store_true", help="if the step does not fit, find the smallest "
                     "grad_accum_steps (largest per-chip microbatch) that does, by compiling")
    aot.add_argument("--price-per-chip-hour", type=options.floats(0, low_open=True), metavar="USD",
                     help="the price of one chip-hour or GPU-hour (the region's on-demand, Spot or committed rate): "
                     "the cost is the chip-hours at it, on one line and in --json as cost_usd (no price list is "
                     "built in)")
    aot.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    embedding = aot.add_argument_group("the embedding step (`finetune embedding`'s) instead of pretraining's")
    embedding.add_argument("--embedding", action="store_true", help="compile `finetune embedding`'s train step (the "
                           "ranking loss over the global batch, the candidates all-gathered): fit, the gather, pairs/s,"
                           " the price per million pairs; --fit-batch: the largest global batch that fits")
    embedding.add_argument("--init-config", metavar="MODEL", help="with --embedding: the encoder, a model preset "
                           "(bert-base, modernbert-base, ...) or a config.json (no weights needed)")
    embedding.add_argument("--batch-size", type=options.ints(1), default=1024, help="with --embedding: the global "
                           "batch of (anchor, positive) rows")
    embedding.add_argument("--max-seq-length", type=options.ints(1), default=128,
                           help="with --embedding: tokens a text")
    embedding.add_argument("--hard-negatives", action="store_true", help="with --embedding: a hard negative a row")
    embedding.add_argument("--cache-chunk", type=options.ints(0), default=0, help="with --embedding: cached gradients "
                           "in chunks of this many rows (0: one pass)")
    embedding.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                           help="with --embedding: the matmuls' compute dtype (finetune's --dtype)")
    aot.set_defaults(func=_compile)

    launch = subparsers.add_parser(
        "launch", help="run a job: tpu (Cloud TPU slices), watch (a tpu job again), gke, local (N processes here)"
    ).add_subparsers(dest="launch_command", required=True)
    tpu = launch.add_parser("tpu", help="create a TPU queued resource, install this bertjax on every worker, run "
                            "the command on all of them, and re-create the slice after preemptions")
    tpu.add_argument("--name", required=True, help="queued resource and node id")
    tpu.add_argument("--tpu-type", required=True, help="gcloud accelerator type, e.g. v5litepod-16, v4-32, v5p-16")
    tpu.add_argument("--zone", required=True)
    tpu.add_argument("--project", required=True)
    provisioning = tpu.add_mutually_exclusive_group()
    provisioning.add_argument("--spot", dest="provisioning", action="store_const", const="spot",
                              default="on-demand", help="Spot capacity (may be preempted at any time)")
    provisioning.add_argument("--reserved", dest="provisioning", action="store_const", const="reserved",
                              help="the project's reservation")
    tpu.add_argument("--runtime-version", default="", help="TPU VM runtime (default: the generation's JAX one)")
    _add_job_flags(tpu, restarts="job restarts (after preemptions the slice is re-created)",
                   dry_run="print the request and the gcloud equivalents")
    tpu.add_argument("--poll-seconds", type=options.floats(0, low_open=True), default=30.0,
                     help="how often the slice and the job are checked")
    tpu.set_defaults(func=_launch_tpu)

    watch = launch.add_parser("watch", help="re-attach to a job started by `launch tpu` (from another terminal, or "
                              "after the launcher was stopped): follow its log and babysit it to the end")
    watch.add_argument("name", help="the queued resource (--name of `launch tpu`)")
    watch.add_argument("--zone", required=True)
    watch.add_argument("--project", required=True)
    watch.add_argument("--max-restarts", type=options.ints(0), default=10, help="job restarts from now on")
    watch.add_argument("--wheel", help="the bertjax wheel to install after a re-creation (default: built from this "
                       "checkout)")
    watch.add_argument("--poll-seconds", type=options.floats(0, low_open=True), default=30.0,
                       help="how often the slice and the job are checked")
    watch.set_defaults(func=_launch_watch)

    gke = launch.add_parser("gke", help="run the command on TPU slices of a GKE cluster with xpk (a JobSet, "
                            "restarted after preemptions)")
    gke.add_argument("--cluster", required=True, help="the GKE cluster (with its TPU node pools, e.g. by xpk)")
    gke.add_argument("--name", required=True, help="the xpk workload name")
    gke.add_argument("--tpu-type", required=True, help="gcloud accelerator type of one slice, e.g. v5litepod-16")
    gke.add_argument("--num-slices", type=options.ints(1), default=1,
                     help="multi-slice: this many slices (mesh.dcn_data)")
    gke.add_argument("--zone", required=True)
    gke.add_argument("--project", required=True)
    gke.add_argument("--base-docker-image", default="python:3.11-slim",
                     help="the image each pod starts from (the wheel with its `tpu` extra is installed on it)")
    _add_job_flags(gke, restarts="JobSet restarts after failures/preemptions",
                   dry_run="print the xpk command instead of running it")
    gke.set_defaults(func=_launch_gke)

    local = launch.add_parser("local", help="run the command as N local jax.distributed processes (the pod code "
                              "path on one machine), babysat with --max-restarts")
    from bertjax.cloud import local as local_lib

    local_lib.add_arguments(local)
    local.set_defaults(func=lambda args: local_lib.run(args, local))


def _add_job_flags(parser: argparse.ArgumentParser, *, restarts: str, dry_run: str) -> None:
    """The flags every cloud launcher shares: restarts, the wheel, dry run, and the job's command after --."""
    parser.add_argument("--max-restarts", type=options.ints(0), default=10, help=restarts)
    parser.add_argument("--wheel", help="the bertjax wheel to install (default: built from this checkout)")
    parser.add_argument("--dry-run", action="store_true", help=dry_run)
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- pretrain --config ... --workdir gs://...")


def _compile(args: argparse.Namespace) -> int:
    from bertjax.runtime import jsonio
    from bertjax.cloud import compile as tpu_compile
    from bertjax.pretraining import config as pretrain_config

    topology = tpu_compile.parse_target(args.topology, args.num_slices)
    if args.embedding:
        return _compile_embedding(args, topology)
    if not args.config:
        raise ValueError("give --config (a pretraining preset) or --embedding --init-config MODEL")
    config = pretrain_config.load_config(args.config, args.overrides, require_data=False)
    if args.dump_hlo:
        from bertjax.runtime.outputs import check_file_target, one_writer

        check_file_target(args.dump_hlo, "--dump-hlo")
        with one_writer(args.dump_hlo, "--dump-hlo", log=lambda line: print(line, file=sys.stderr)):
            return _compiled(args, config, topology)
    return _compiled(args, config, topology)


def _compiled(args: argparse.Namespace, config, topology) -> int:
    from bertjax.runtime import jsonio
    from bertjax.cloud import compile as tpu_compile
    from bertjax.runtime.console import Console, duration

    # Progress on stderr under --json (stdout is then one JSON object): a BERT-base compile takes minutes.
    console = Console(stream=sys.stderr if args.json else sys.stdout)
    compiler = "XLA:GPU, deviceless" if tpu_compile.is_gpu(topology) else "XLA:TPU"
    console.line(f"compiling {args.config}'s train step for {args.topology} with {compiler} (minutes for "
                 "BERT-base) ...")
    started = time.perf_counter()
    result = tpu_compile.compile_for_topology(config, topology, args.mfu, dump_hlo=args.dump_hlo)
    console.line(f"compiled in {duration(time.perf_counter() - started)}")
    if not result["fits"] and args.fit_batch:
        console.line("--fit-batch: compiling with more gradient accumulation steps until the step fits ...")
        started = time.perf_counter()
        result["fit"] = tpu_compile.fit_batch(config, topology, args.mfu, requested=result, log=console.line)
        console.line(f"--fit-batch: searched in {duration(time.perf_counter() - started)}")
    result = tpu_compile.with_cost(result, args.price_per_chip_hour)
    print(jsonio.dumps(result) if args.json else tpu_compile.describe(result))
    if not result["fits"]:
        over = (result["hbm_bytes_per_chip"] - result["hbm_capacity_bytes_per_chip"]) / 2**30
        fit = result.get("fit")
        hint = ("try --fit-batch, a larger mesh.fsdp, or more chips" if fit is None else
                f"fits with --set train.grad_accum_steps={fit['grad_accum_steps']} (per-chip microbatch "
                f"{fit['per_chip_batch']:g}, {fit['hbm_bytes_per_chip'] / 2**30:.2f} GiB{_time_and_cost(fit)})"
                if fit["fits"] else
                "no grad_accum_steps fits either: try a larger mesh.fsdp or more chips")
        print(f"bertjax compile: the step does not fit HBM: {over:.2f} GiB per chip over; {hint}", file=sys.stderr)
    return 0 if result["fits"] else 1


def _compile_embedding(args: argparse.Namespace, topology) -> int:
    """`compile --embedding`: `finetune embedding`'s step for `topology`, and with --fit-batch the largest batch."""
    from bertjax.cloud import compile as tpu_compile
    from bertjax.cloud import embedding_compile
    from bertjax.runtime import jsonio
    from bertjax.runtime.console import Console, duration

    pretraining_only = [flag for flag, given in (("--config", args.config), ("--set", args.overrides),
                                                 ("--mfu", args.mfu), ("--dump-hlo", args.dump_hlo)) if given]
    if pretraining_only or not args.init_config:
        raise ValueError("--embedding takes --init-config MODEL" + (f", not {', '.join(pretraining_only)} (the "
                         "pretraining step's)" if pretraining_only else ""))
    step = embedding_compile.EmbeddingStep(
        embedding_compile.model_config(args.init_config), args.batch_size, args.max_seq_length,
        args.hard_negatives, args.cache_chunk, args.dtype)
    embedding_compile.check_step(step, topology)
    console = Console(stream=sys.stderr if args.json else sys.stdout)
    console.line(f"compiling the embedding step of {args.init_config} for {args.topology} (minutes for BERT-base) ...")
    devices = tpu_compile.compile_only_devices(topology)
    started = time.perf_counter()
    result = embedding_compile.compile_for_topology(step, topology, devices, args.price_per_chip_hour)
    console.line(f"compiled in {duration(time.perf_counter() - started)}")
    if args.fit_batch:
        result["fit"] = embedding_compile.fit_batch(step, topology, devices, args.price_per_chip_hour,
                                                    requested=result, log=console.line)
    print(jsonio.dumps(result) if args.json else embedding_compile.describe(result) + (
        "\n--fit-batch:\n  " + embedding_compile.describe(result["fit"]).replace("\n", "\n  ") if "fit" in result
        else ""))
    if not result["fits"]:
        print("bertjax compile: the embedding step does not fit HBM"
              + ("" if args.fit_batch else ": try --fit-batch, --cache-chunk or more chips"), file=sys.stderr)
    return 0 if result["fits"] else 1


def _time_and_cost(report: dict) -> str:
    """`; step 41.2 ms, 1000 steps = 0.01 h, 0.05 chip-hours` of a compile report (empty without a step time)."""
    if report.get("step_seconds") is None:
        return ""
    from bertjax.cloud.compile import chip_hours_text, cost_text

    return (f"; step {report['step_seconds'] * 1e3:.1f} ms, {report['steps']} steps = {report['total_hours']:.2f} h, "
            + (cost_text(report) or chip_hours_text(report)))


def _wheel_name() -> str:
    return f"bertjax-{importlib.metadata.version('bertjax')}-py3-none-any.whl"


def build_wheel(out_dir: str) -> str:
    """This checkout as a wheel (presets and everything a worker runs are inside it)."""
    root = pathlib.Path(__file__).resolve().parents[1]
    if not (root / "pyproject.toml").exists():
        raise ValueError("bertjax is not installed from a checkout: give --wheel PATH")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--wheel-dir", out_dir, str(root)],
                   check=True)
    return str(next(pathlib.Path(out_dir).glob("bertjax-*.whl")))


def _job_command(args: argparse.Namespace) -> list[str]:
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command or "--workdir" not in command[:-1]:
        raise ValueError("give the job after --, with its --workdir (gs://...), e.g. -- pretrain --config "
                         "bert-base-phase1 --workdir gs://BUCKET/run ...")
    return command


def _launch_gke(args: argparse.Namespace) -> int:
    from bertjax.cloud import gke

    command = _job_command(args)
    spec = gke.GkeSpec(args.cluster, args.name, args.tpu_type, args.zone, args.project, args.num_slices,
                       args.base_docker_image, args.max_restarts)
    if args.dry_run:
        print(shlex.join(gke.xpk_command(spec, "SCRIPT_DIR", args.wheel or _wheel_name(), command)))
        return 0
    with tempfile.TemporaryDirectory() as script_dir:
        wheel = args.wheel or build_wheel(script_dir)
        if os.path.dirname(os.path.abspath(wheel)) != script_dir:
            shutil.copy(wheel, script_dir)
        return subprocess.run(gke.xpk_command(spec, script_dir, wheel, command)).returncode


def _launch_tpu(args: argparse.Namespace) -> int:
    from bertjax.cloud import tpu as cloud_tpu

    command = _job_command(args)
    spec = cloud_tpu.SliceSpec(args.name, args.tpu_type, args.zone, args.project, args.provisioning,
                               args.runtime_version)
    if args.dry_run:
        print(cloud_tpu.dry_run(spec, args.wheel or _wheel_name(), command), end="")
        return 0
    with tempfile.TemporaryDirectory() as folder:
        wheel = args.wheel or build_wheel(folder)
        backend = cloud_tpu.CloudTpuBackend(spec, wheel, poll_seconds=args.poll_seconds)
        if (state := backend.slice.state()) != "GONE":
            raise ValueError(f"queued resource {spec.name} already exists ({state}): re-attach to its job with "
                             f"`bertjax launch watch {spec.name} --zone {spec.zone} --project {spec.project}`, or "
                             f"delete it with `{shlex.join(cloud_tpu.gcloud_delete(spec))}`")
        return _babysit_tpu(backend, command, args.max_restarts)


def _launch_watch(args: argparse.Namespace) -> int:
    from google.api_core import exceptions

    from bertjax.cloud import tpu as cloud_tpu
    from bertjax.cloud import tpu_slice

    client = tpu_slice.tpu_client()
    name = f"projects/{args.project}/locations/{args.zone}/queuedResources/{args.name}"
    try:
        resource = client.get_queued_resource(name=name, retry=tpu_slice.api_retry())
    except exceptions.NotFound:
        raise ValueError(f"no queued resource {args.name} in {args.zone} ({args.project}): nothing to watch; "
                         f"start the job with `bertjax launch tpu`") from None
    spec, command, wheel_name = cloud_tpu.job_from_resource(resource, args.zone, args.project)
    print(f"launch watch: {spec.name} ({spec.tpu_type}, {spec.provisioning}) runs: {shlex.join(command)}")
    with tempfile.TemporaryDirectory() as folder:
        wheel = args.wheel or build_wheel(folder)  # installed again if the slice has to be re-created
        if os.path.basename(wheel) != wheel_name:
            print(f"launch watch: the job was started with {wheel_name}; a re-created slice gets "
                  f"{os.path.basename(wheel)}")
        backend = cloud_tpu.CloudTpuBackend(spec, wheel, client=client, poll_seconds=args.poll_seconds,
                                            attach=True)
        return _babysit_tpu(backend, command, args.max_restarts)


def _babysit_tpu(backend, command: list[str], max_restarts: int) -> int:
    """Babysits the job on the slice; deletes the slice once the job completed or was given up. Ctrl-C detaches
    (the job runs on); a slice that cannot be had (quota, permission, stockouts past the limit) is exit status 1."""
    from bertjax.cloud import babysitter, tpu_slice

    spec = backend.spec
    try:
        code = babysitter.babysit(backend, command, command[command.index("--workdir") + 1], max_restarts)
    except tpu_slice.SliceError as error:
        print(f"launch tpu: {error}", file=sys.stderr)
        try:
            backend.release()  # a FAILED queued resource still holds quota until deleted
        except Exception as cleanup:  # noqa: BLE001
            print(f"launch tpu: could not delete {spec.name}: {cleanup}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"\nlaunch tpu: detached; the job keeps running on {spec.name}. Re-attach with `bertjax launch watch "
              f"{spec.name} --zone {spec.zone} --project {spec.project}`; stop it and free the slice with "
              f"`gcloud compute tpus queued-resources delete {spec.name} --zone {spec.zone} --project "
              f"{spec.project} --force`", file=sys.stderr)
        return 130
    backend.release()
    return code
