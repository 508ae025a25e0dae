"""`bertjax pretrain` (config preset + --set overrides + distributed init), `bertjax goodput` and `bertjax config
list | show`.

JAX, TensorFlow and the job are imported only when the command runs: `bertjax --help` stays fast, and
jax.distributed.initialize must come before anything touches a device.
"""
from __future__ import annotations

import argparse
import functools

from bertjax import options


def register(subparsers) -> None:
    parser = subparsers.add_parser("pretrain", help="pretrain BERT (MLM + NSP) from a config preset")
    parser.add_argument("--config", required=True, help="preset name in configs/ (e.g. bert-tiny), a .py path with "
                        "get_config(), a run's config.json (or its run directory) to run the same config again, or "
                        "`init`: the --init checkpoint's model with the default recipe")
    parser.add_argument("--workdir", required=True, help="checkpoints, metrics and logs (local or gs://)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a config key (repeatable), e.g. --set train.steps=1000")
    parser.add_argument("--init", "--init-from", dest="init", default="",
                        help="start from this checkpoint: a step or run directory (phase 2 from phase 1), an HF "
                             "directory or hub id, or a TF checkpoint prefix; its model (the architecture) replaces "
                             "the preset's, and with data.vocab unset its vocabulary or tokenizer.json is used")
    parser.add_argument("--distributed", action="store_true",
                        help="call jax.distributed.initialize() with auto-detection (TPU pods, SLURM...)")
    parser.add_argument("--coordinator", help="host:port of process 0 (multi-process without auto-detection)")
    parser.add_argument("--num-processes", type=options.ints(1),
                        help="with --coordinator and --process-id: the job's number of processes")
    parser.add_argument("--process-id", type=options.ints(0),
                        help="with --coordinator and --num-processes: this process's index, from 0")
    parser.add_argument("--max-steps-this-run", type=options.ints(1),
                        help="stop (with a checkpoint) after this many steps")
    parser.add_argument("--allow-config-change", action="store_true",
                        help="resume a run whose schedule/optimizer/batch/data settings were changed since it "
                             "saved (model and data shapes can never change)")
    parser.add_argument("--score-glue", metavar="DIR",
                        help="when the run completes (not when it stops early), score it: `bertjax score WORKDIR "
                             "--glue DIR` (each GLUE task in DIR fine-tuned by MosaicBERT's recipe; WORKDIR/scores)")
    parser.add_argument("--score-set", dest="score_overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="a `bertjax score` setting for --score-glue (repeatable), e.g. --score-set seeds=0,1 "
                             "--score-set tasks=sst2,mrpc")
    parser.add_argument("--dry-run", action="store_true",
                        help="validate the config, read one batch, build the mesh and compile the step on this "
                             "machine's devices, print the plan (memory, FLOPs, time) and exit without training")
    parser.set_defaults(func=_pretrain)

    goodput = subparsers.add_parser(
        "goodput", help="where a pretraining job's wall time went, over all its runs (safe while it runs)")
    goodput.add_argument("workdir", help="the job's --workdir (local or gs://)")
    goodput.add_argument("--json", action="store_true", help="print the account as JSON")
    goodput.set_defaults(func=_goodput)

    config = subparsers.add_parser(
        "config", help="list the pretraining presets, or show one's effective config (--describe: what each key does)")
    configs = config.add_subparsers(dest="job", required=True)
    configs.add_parser("list", help="the presets in configs/ with their one-line descriptions").set_defaults(
        func=_config_list)
    show = configs.add_parser("show", help="the effective config of a preset (or .py, or a run's config.json) with "
                              "--set overrides, validated, model sizes written out, as JSON (what a run writes to "
                              "WORKDIR/config.json; usable as --config)")
    show.add_argument("name", help="preset name (see `bertjax config list`), a .py path or a config.json")
    show.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                      help="override a config key (repeatable)")
    show.add_argument("--describe", action="store_true",
                      help="each key with its value and what it does, one per line (instead of the JSON)")
    show.set_defaults(func=_config_show)


def initialize_distributed(args: argparse.Namespace) -> None:
    """jax.distributed.initialize() for multi-process runs; must run before any other JAX call."""
    import jax

    from bertjax.runtime.quiet import native_output_held

    explicit = args.coordinator is not None or args.num_processes is not None or args.process_id is not None
    if explicit and None in (args.coordinator, args.num_processes, args.process_id):
        raise ValueError("--coordinator, --num-processes and --process-id go together")
    if not (explicit or args.distributed):
        return
    # gloo's CPU collectives print their connection lines when they first connect: a first collective here.
    with native_output_held(args.verbose, fds=(1, 2)):
        if explicit:
            jax.distributed.initialize(coordinator_address=args.coordinator, num_processes=args.num_processes,
                                       process_id=args.process_id)
        else:
            # Auto-detection (TPU VMs, SLURM, ...). A cluster JAX does not detect can give the layout in the
            # environment: JAX reads JAX_COORDINATOR_ADDRESS itself, these two complete it (the tests' TPU stand-in).
            import os

            layout = {key: int(os.environ[var]) for key, var in (("num_processes", "JAX_NUM_PROCESSES"),
                                                                  ("process_id", "JAX_PROCESS_ID"))
                      if var in os.environ}
            jax.distributed.initialize(**layout)
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices("bertjax: all processes started")


def _pretrain(args: argparse.Namespace) -> int:
    from bertjax.pretraining import config as pretrain_config
    from bertjax.runtime.workdir_paths import canonical

    # One spelling of the workdir in what the run records (config.json's init_vocab.txt, LOCK, messages).
    args.workdir = canonical(args.workdir)

    # Validate what can be validated before touching devices, so a typo fails in a second.
    scoring = _score_command(args)
    if not args.init:
        config = pretrain_config.load_config(args.config, args.overrides)
    elif args.config != pretrain_config.INIT_CONFIG:  # its data may come from the --init checkpoint: checked below
        pretrain_config.load_config(args.config, args.overrides, require_data=False)
    initialize_distributed(args)
    import jax

    from bertjax.checkpoint import complete_steps
    from bertjax.runtime import preemption
    from bertjax.runtime.console import Console
    from bertjax.runtime.new_workdir import removed_if_failed_before_saving
    from bertjax.runtime.workdir_lock import WorkdirLock

    # From the first file written (the --init checkpoint's vocabulary, before the config is validated) to the job's
    # end: a workdir this command created and failed in before a checkpoint is removed. The lock (the job takes
    # it in loop.run) tells whether another job holds the workdir meanwhile: then nothing is removed.
    lock = WorkdirLock(args.workdir, log=Console().line) if jax.process_index() == 0 else None
    with removed_if_failed_before_saving(args.workdir, lambda: bool(complete_steps(args.workdir)), lock):
        if args.init:  # after distributed initialisation: reading an Orbax checkpoint starts JAX
            config = _config_with_init(args)
        from bertjax.data.input_source import check_set_keys
        from bertjax.pretraining import loop as pretrain

        check_set_keys(config.data, {override.split("=", 1)[0].strip() for override in args.overrides})
        if config.optimizer.sets_both_warmups():  # not silently: the ratio replaces the steps the config gives
            note = config.optimizer.warmup_note(config.train.steps)
            Console(enabled=jax.process_index() == 0).line(f"note: {note}")

        if args.dry_run:
            print(pretrain.plan(config, args.workdir, init_from=args.init))
            return 0
        result = pretrain.run(config, args.workdir, init_from=args.init, max_steps_this_run=args.max_steps_this_run,
                              allow_config_change=args.allow_config_change, lock=lock,
                              command=args.argv)
    if scoring and result.status != "completed" and jax.process_index() == 0:
        Console().line(f"--score-glue: not scored: the run ended at step {result.final_step} of {config.train.steps} "
                       f"({result.status}); the same command completes it, then scores it")
    elif scoring and result.status == "completed":
        return _score(scoring)
    # Stopped before its last step (a signal, --max-steps-this-run), saved: not 0, so that `pretrain ... && export`
    # does not export a half-trained model; a launcher reruns it (preemption.STOPPED_EXIT).
    return 0 if result.status == "completed" else preemption.STOPPED_EXIT


def _score_command(args: argparse.Namespace) -> list[str] | None:
    """The `bertjax score` command line that --score-glue runs after the run (None without it), checked now: a
    score setting's typo fails before training, not after."""
    if args.score_glue is None:
        if args.score_overrides:
            raise ValueError("--score-set needs --score-glue DIR (the GLUE data to score the run on)")
        return None
    from bertjax.finetune.score import command_flags, settings_from_overrides

    settings = settings_from_overrides(args.score_overrides)
    if "://" in args.workdir:
        raise ValueError(f"--score-glue writes WORKDIR/scores on a local disk, and --workdir {args.workdir} is not "
                         "one: run `bertjax score WORKDIR --glue DIR --out LOCAL_DIR` after the run")
    if args.dry_run:
        raise ValueError("--score-glue scores a run that trained; --dry-run trains nothing")
    return ["score", args.workdir, "--glue", args.score_glue, *command_flags(settings)]


def _score(command: list[str]) -> int:
    """Runs `bertjax score` in a process of its own: the fine-tunes start from the saved checkpoint, with none of
    the pretraining job's devices, mesh or malloc settings (host_memory) held."""
    import shlex
    import subprocess
    import sys

    import jax

    from bertjax.runtime import preemption
    from bertjax.runtime.console import Console

    if jax.process_index() != 0:
        return 0
    if jax.process_count() > 1:  # the fine-tunes run on one host
        Console().line(f"--score-glue: not scored by a {jax.process_count()}-process job; on one host run: "
                       + shlex.join(["bertjax", *command]))
        return 0
    Console().line("the run completed; scoring it: " + shlex.join(["bertjax", *command]))
    sys.stdout.flush()
    child = subprocess.Popen([sys.executable, "-m", "bertjax.cli", *command])
    try:
        return child.wait()
    except preemption.Stopped as stopped:  # passed on: the fine-tune saves its state and ends, resumed by a rerun
        child.send_signal(stopped.signum)
        child.wait()
        raise


def _config_with_init(args: argparse.Namespace):
    """The job's config where --init supplies what the user left out: the model (any --config: the checkpoint's
    architecture, under the recipe's training settings; `--config init`: with the default recipe) and, with
    data.vocab empty, the checkpoint's own vocabulary or tokenizer.json."""
    from bertjax.checkpoint import load_job_config, resolve_checkpoint
    from bertjax.runtime.console import Console
    from bertjax.interop.load import describe_pretrained
    from bertjax.interop.hub import local_model_path
    from bertjax.pretraining import config as pretrain_config

    init = describe_pretrained(args.init)
    init_run = {}
    if args.config == pretrain_config.INIT_CONFIG:
        init_run = pretrain_config.init_run_settings(load_job_config(resolve_checkpoint(local_model_path(args.init))))
        asked = {override.split("=", 1)[0].strip() for override in args.overrides}
        taken = {key: value for key, value in init_run.items() if key not in asked}
        if taken:
            Console().line("the --init run's own batch: " + ", ".join(f"{k}={v}" for k, v in taken.items()))
    load = functools.partial(pretrain_config.load_config, args.config, args.overrides, init=init, init_run=init_run)
    if args.config != pretrain_config.INIT_CONFIG:
        changed = pretrain_config.model_changes(
            pretrain_config.load_config(args.config, args.overrides, require_data=False), load(require_data=False))
        if changed:
            Console().line(f"model: the --init checkpoint's, where --config {args.config} differs: "
                           + ", ".join(changed))
        over = pretrain_config.recipe_over_init(load(require_data=False), init)
        if over:
            Console().line("model: this phase's (model_over_init), over the --init checkpoint's: " + ", ".join(over))
    if load(require_data=False).data.vocab:
        return load()
    vocab_file = _init_vocab_file(args.init, init, args.workdir)
    what = (f"tokenizer.json ({len(init.vocab):,} tokens)" if init.tokenizer is not None else
            f"vocabulary ({len(init.vocab):,} tokens, lower_case={init.lower_case})")
    Console().line(f"data.vocab: the --init checkpoint's {what}, {vocab_file}")
    return load(init_vocab_file=vocab_file)


# Where a pretraining run keeps the --init checkpoint's vocabulary when the checkpoint has no file of it to name.
INIT_VOCAB, INIT_TOKENIZER = "init_vocab.txt", "init_tokenizer/tokenizer.json"


def _init_vocab_file(init: str, checkpoint, workdir: str) -> str:
    """The --init checkpoint's tokenizer as a data.vocab: the vocab.txt or tokenizer.json of an HF directory (a TF
    prefix: the vocab.txt beside it), else (ours: kept inside the checkpoint) written once into the workdir, a
    tokenizer.json with a tokenizer_config.json of its special tokens beside it."""
    import json

    from etils import epath

    from bertjax.checkpoint import read_vocab_file, resolve_checkpoint
    from bertjax.interop.hub import local_model_path
    from bertjax.interop.load import detect_format

    source = resolve_checkpoint(local_model_path(init))
    kind = detect_format(source)
    folder = epath.Path(source if kind == "hf" else epath.Path(source).parent)
    if kind == "hf" and checkpoint.tokenizer is not None:
        return str(folder / "tokenizer.json")  # what load_hf read it from
    if kind != "bertjax" and checkpoint.tokenizer is None:
        beside = folder / "vocab.txt"
        if beside.exists() and read_vocab_file(str(beside)) == checkpoint.vocab:
            return str(beside)
    if checkpoint.tokenizer is None:
        files = {INIT_VOCAB: "".join(token + "\n" for token in checkpoint.vocab)}
    else:  # its special tokens first: a tokenizer.json found complete has them beside it
        special = {f"{name}_token": token for name, token in checkpoint.tokenizer["special"].items()}
        files = {str(epath.Path(INIT_TOKENIZER).parent / "tokenizer_config.json"): json.dumps(special, indent=2),
                 INIT_TOKENIZER: checkpoint.tokenizer["json"]}
    import jax

    if jax.process_index() == 0:
        for name, text in files.items():
            path = epath.Path(workdir) / name
            if not (path.exists() and path.read_text(encoding="utf-8") == text):
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(text, encoding="utf-8")
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices("bertjax: init vocabulary written")
    return str(epath.Path(workdir) / list(files)[-1])


def _goodput(args: argparse.Namespace) -> int:
    import sys

    from bertjax.runtime import jsonio
    from bertjax.pretraining import goodput

    account = goodput.job_account(args.workdir)
    print(jsonio.dumps(account, indent=1) if args.json else "\n".join(goodput.format_job(account, args.workdir)))
    if account["unreadable"]:  # an account that leaves a run out is not the job's: said, and not a success
        print(f"bertjax goodput: error: the account of {args.workdir} is incomplete: {len(account['unreadable'])} "
              f"run account(s) cannot be read ({'; '.join(account['unreadable'])})", file=sys.stderr)
        return 1
    return 0


def _config_list(args: argparse.Namespace) -> int:
    from bertjax.pretraining import config as pretrain_config

    for name, description in pretrain_config.presets().items():
        print(f"{name:<24} {description}")
    return 0


def _config_show(args: argparse.Namespace) -> int:
    import json
    import sys

    from bertjax.pretraining import config as pretrain_config

    config = pretrain_config.load_config(args.name, args.overrides, require_data=False)
    vocab_size = 0
    from etils import epath

    if config.data.vocab and not config.model.vocab_size and epath.Path(config.data.vocab).exists():
        # The size a run takes from its vocabulary (left at 0 while the vocabulary cannot be read).
        from bertjax.runtime import quiet

        quiet.start_tensorflow(args.verbose)  # `config` starts without it; the tokenizer needs it
        from bertjax.data.tokenizers import load_tokenizer

        vocab_size = len(load_tokenizer(config.data.vocab, config.data.lower_case).vocab)
    shown = config.with_model_sizes(vocab_size)
    print("\n".join(described_keys(shown)) if args.describe else json.dumps(shown.to_dict(), indent=2))
    # Beside the JSON (which stays a --config): both warmup keys are in it, one of them unused.
    print(f"note: {config.optimizer.warmup_note(config.train.steps)}", file=sys.stderr)
    return 0


def described_keys(config) -> list[str]:
    """`KEY = VALUE` and, indented below it, what the key does, for every key of a pretraining config."""
    import json

    from bertjax import options

    def leaves(values: dict, prefix: str = ""):
        for name, value in values.items():
            if isinstance(value, dict):
                yield from leaves(value, f"{prefix}{name}.")
            else:
                yield prefix + name, value

    described = options.key_help(type(config))
    return [line for key, value in leaves(config.to_dict())
            for line in (f"{key} = {json.dumps(value)}", f"    {described.get(key) or '(no description)'}")]
