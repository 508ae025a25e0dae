"""`bertjax pretrain`: the pretraining job's command line (config preset + --set overrides + distributed init).

JAX, TensorFlow and the job are imported only when the command runs: `bertjax --help` stays fast, and
jax.distributed.initialize must come before anything touches a device.
"""
from __future__ import annotations

import argparse
import os


def register(subparsers) -> None:
    parser = subparsers.add_parser("pretrain", help="pretrain BERT (MLM + NSP) from a config preset")
    parser.add_argument("--config", required=True, help="preset name in configs/ (e.g. bert-tiny) or a .py path")
    parser.add_argument("--workdir", required=True, help="checkpoints, metrics and logs (local or gs://)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a config key (repeatable), e.g. --set train.steps=1000")
    parser.add_argument("--init-from", default="", help="start from this checkpoint (phase 2 from phase 1; "
                        "also HF directories and TF checkpoints)")
    parser.add_argument("--distributed", action="store_true",
                        help="call jax.distributed.initialize() with auto-detection (TPU pods, SLURM...)")
    parser.add_argument("--coordinator", help="host:port of process 0 (multi-process without auto-detection)")
    parser.add_argument("--num-processes", type=int)
    parser.add_argument("--process-id", type=int)
    parser.add_argument("--max-steps-this-run", type=int, help="stop (with a checkpoint) after this many steps")
    parser.set_defaults(func=_pretrain)


def initialize_distributed(args: argparse.Namespace) -> None:
    """jax.distributed.initialize() for multi-process runs; must run before any other JAX call."""
    import jax

    explicit = args.coordinator is not None or args.num_processes is not None or args.process_id is not None
    if explicit:
        if None in (args.coordinator, args.num_processes, args.process_id):
            raise ValueError("--coordinator, --num-processes and --process-id go together")
        jax.distributed.initialize(coordinator_address=args.coordinator, num_processes=args.num_processes,
                                   process_id=args.process_id)
    elif args.distributed:
        jax.distributed.initialize()


def _pretrain(args: argparse.Namespace) -> int:
    from bertjax import pretrain_config

    # Validate what can be validated before touching devices, so a typo fails in a second.
    config = pretrain_config.load_config(args.config, args.overrides)
    initialize_distributed(args)
    _keep_tensorflow_off_accelerators()
    from bertjax import pretrain

    result = pretrain.run(config, args.workdir, init_from=args.init_from,
                          max_steps_this_run=args.max_steps_this_run)
    return 0 if result.status in ("completed", "preempted", "stopped") else 1


def _keep_tensorflow_off_accelerators() -> None:
    # tf.data runs on the host; without this TensorFlow would reserve GPU memory that JAX needs.
    import tensorflow as tf

    tf.config.set_visible_devices([], "GPU")
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
