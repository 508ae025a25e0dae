"""The pretraining job end to end: in real subprocesses what is about the process (a run ended by SIGTERM, one
SIGKILLed during a save, restore onto fewer devices, multi-process equivalence, a quiet console, a full disk, and
(slow) the loss falling on real text); in this process what is about the job (the resumes after those signals,
refusals, a dry run, resumes from a set-aside or changed checkpoint, warnings on its input), which spares each a
process start."""
import json
import os
import pathlib
import re
import shlex
import shutil
import signal
import subprocess
import sys

import numpy as np
import pytest

from bertjax.checkpoint import complete_steps, load_model
from bertjax.data.demo_corpus import write_demo_corpus
from bertjax.runtime.preemption import STOPPED_EXIT
from tests import stall_watch
from tests.conftest import REPO_ROOT, SUITE_CACHE_ON, fill_disk, process_running, xla_flags

# Checkpoints every EVERY steps (the newest 3 kept); signals come at step MIDDLE, a save step.
STEPS, EVERY = 12, 3
MIDDLE = STEPS // 2


@pytest.fixture(scope="module")
def corpus(tmp_path_factory, minilm_dir):
    folder = tmp_path_factory.mktemp("corpus")
    train_path, eval_path = write_demo_corpus(str(folder))
    return train_path, str(minilm_dir / "vocab.txt")


def _argv(workdir, corpus, *extra):
    train_path, vocab = corpus
    return [sys.executable, "-m", "bertjax.cli", "pretrain", "--config", "bert-tiny", "--workdir", str(workdir),
            "--set", f"data.input={train_path}", "--set", f"data.vocab={vocab}", "--set", "data.max_seq_length=64",
            "--set", "data.max_predictions_per_seq=10", "--set", "data.doc_buffer_size=40",
            "--set", "data.shuffle_buffer=100", "--set", f"train.steps={STEPS}", "--set", "train.batch_size=8",
            "--set", "train.log_every=1", "--set", f"checkpoint.every={EVERY}", "--set", "optimizer.warmup_steps=5",
            *extra]


def _env(devices=8):
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=xla_flags(devices))
    # As in a user's shell: with the suite's TF_CPP_MIN_LOG_LEVEL=2 the console test missed TensorFlow's native
    # "DATA_LOSS: corrupted record" warning that telling text from TFRecords printed on every run.
    env.pop("TF_CPP_MIN_LOG_LEVEL", None)
    env["PYTHONPATH"] = str(REPO_ROOT)
    return env


def _run(argv, devices=8, keep=False, status=0):
    """The run in a process of its own, ended with exit `status` (STOPPED_EXIT: stopped before its last step)."""
    result = stall_watch.run(argv, env=_env(devices), cwd=REPO_ROOT)
    assert result.returncode == status, result.stdout[-3000:] + result.stderr[-3000:]
    return result if keep else result.stdout


def _in_process(argv, monkeypatch, capsys) -> tuple[int, str, str]:
    """`bertjax` with `_argv`'s arguments in this process, for what is decided before a job starts (refusals, a dry
    run, `config show`): (exit status, stdout, stderr). Pretraining's malloc setting for its own process
    (host_memory) is left off: it would outlive the call in this one."""
    from bertjax import cli

    monkeypatch.setattr(cli.host_memory, "keep_freed_memory_if_cpu_job", lambda environ: False)
    capsys.readouterr()
    code = cli.main(argv[3:] if argv[:3] == [sys.executable, "-m", "bertjax.cli"] else argv)
    out, err = capsys.readouterr()
    return code, out, err


def _run_here(argv, monkeypatch, capsys, status=0) -> str:
    """`_run` in this process (its 8 devices), for tests of what a job does rather than of its process (a resume,
    its warnings): the same job without a process start, which pays TensorFlow's and JAX's imports. Its stdout."""
    code, out, err = _in_process(argv, monkeypatch, capsys)
    assert code == status, out[-3000:] + err[-3000:]
    return out


TIMESTAMP = re.compile(r"^\d\d:\d\d:\d\d ")


def _message(line: str) -> str:
    """A console line without its timestamp."""
    return TIMESTAMP.sub("", line)


def _run_until(argv, line_prefix, sig, devices=8, then=None):
    """Starts a run, sends `sig` as soon as it prints a line starting with `line_prefix`; returns (code, output).
    `then`: the run as `bertjax ... && THEN` in bash, the signal sent to the job alone (as `kill PID` or a scheduler
    sends it); the code and output are then the shell's."""
    command = ["bash", "-c", f'"$@" && {then}', "bash", *argv] if then else argv
    process = subprocess.Popen(command, env=_env(devices), cwd=REPO_ROOT, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True)
    output = []
    for line in process.stdout:
        output.append(line)
        if _message(line).startswith(line_prefix):
            [job] = _children(process.pid) if then else [process.pid]
            os.kill(job, sig)
            break
    output += process.stdout.readlines()
    return process.wait(timeout=300), "".join(output)


def _children(pid: int) -> list[int]:
    """The processes `pid` started (Linux's /proc)."""
    return [int(child) for task in pathlib.Path(f"/proc/{pid}/task").iterdir()
            for child in (task / "children").read_text().split()]


def _step_records(workdir) -> list[dict]:
    """metrics.jsonl's step records (not the events, such as the goodput account a run appends at its end)."""
    records = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in records if "event" not in r]


def _goodput(workdir) -> list[dict]:
    """The goodput records of metrics.jsonl, one per run that ended by itself."""
    records = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in records if r.get("event") == "goodput"]


def _losses(workdir):
    by_step = {}
    for line in (workdir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if "loss" in record:
            by_step[record["step"]] = record["loss"]
    return by_step


def _final_params(workdir, step=STEPS):
    import jax

    return jax.tree_util.tree_leaves(load_model(str(workdir / "checkpoints" / str(step))).params)


PACKING = ("--set", "data.packing=true", "--set", "data.max_instances_per_row=3")


@pytest.fixture(scope="module")
def uninterrupted_run(tmp_path_factory, corpus):
    """(workdir, the finished process with its console output)."""
    workdir = tmp_path_factory.mktemp("uninterrupted")
    return workdir, _run(_argv(workdir, corpus), keep=True)


@pytest.fixture(scope="module")
def uninterrupted(uninterrupted_run):
    return uninterrupted_run[0]


@pytest.fixture
def uninterrupted_packed(tmp_path_factory, corpus, monkeypatch, capsys):
    """The packed run uninterrupted, in this process: the reference the SIGTERM test's processes must equal."""
    workdir = tmp_path_factory.mktemp("uninterrupted_packed")
    _run_here(_argv(workdir, corpus, *PACKING), monkeypatch, capsys)
    return workdir


def test_uninterrupted_run_writes_metrics_and_checkpoints(uninterrupted):
    losses = _losses(uninterrupted)
    assert sorted(losses) == list(range(1, STEPS + 1))
    last = _step_records(uninterrupted)[-1]
    for key in ("loss", "mlm_loss", "mlm_accuracy", "nsp_loss", "nsp_accuracy", "learning_rate", "grad_norm",
                "steps_per_s", "sequences_per_s", "tokens_per_s", "real_tokens_per_s", "padding_fraction",
                "tflops_per_device", "mfu"):
        assert key in last, key
    assert 0 < last["mfu"] < 1 and 0 <= last["padding_fraction"] < 1
    assert last["real_tokens_per_s"] == pytest.approx(last["tokens_per_s"] * (1 - last["padding_fraction"]), rel=0.5)
    assert any(p.name.startswith("events.out.tfevents") for p in (uninterrupted / "tensorboard").iterdir())
    # keep=3 most recent of the saves every EVERY steps
    assert complete_steps(str(uninterrupted)) == [STEPS - 2 * EVERY, STEPS - EVERY, STEPS]


def test_a_run_appends_its_goodput_account(uninterrupted):
    [account] = _goodput(uninterrupted)
    assert account["step"] == STEPS and account["first_step"] == 0 and account["lost_steps"] == 0
    categories = ("startup_s", "setup_s", "restore_s", "compile_s", "input_wait_s", "step_s", "eval_s", "checkpoint_s")
    assert all(account[k] >= 0 for k in categories) and account["compile_s"] > 0 and account["step_s"] > 0
    # A fresh run has nothing to restore: initialising its state is part of its setup.
    assert account["restore_s"] == 0 and account["setup_s"] > 0
    # Every second of the run is charged to one category, from process start (startup: imports, mesh) to the end.
    assert sum(account[k] for k in categories) == pytest.approx(account["wall_s"], rel=0.05)
    assert account["startup_s"] > 1 and account["goodput"] == pytest.approx(account["step_s"] / account["wall_s"],
                                                                            abs=1e-3)
    [snapshot] = (uninterrupted / "goodput").glob("*.json")
    saved = json.loads(snapshot.read_text())
    assert saved["ended"] and saved["status"] == "completed" and saved["wall_s"] == account["wall_s"]


# What TensorFlow, XLA and absl write natively at start-up (glog/absl prefixes such as "I0000 00:00:17...",
# "E0000 ... cuInit"), oneDNN's notice and gloo's connection lines: none of it belongs on a normal run's console.
NATIVE_LOG_LINE = re.compile(r"^[IWEF]\d{4} |absl::InitializeLog|cuInit|cudart|oneDNN|\[Gloo\]")


def test_the_console_is_quiet_timestamped_and_ends_with_a_summary(uninterrupted_run, monkeypatch, capsys):
    workdir, result = uninterrupted_run
    assert not [l for l in result.stderr.splitlines() if NATIVE_LOG_LINE.search(l)], result.stderr[:2000]
    lines = result.stdout.splitlines()
    assert lines and all(TIMESTAMP.match(line) for line in lines), lines[:5]
    messages = [_message(line) for line in lines]
    assert any(m.startswith("compiling the train step") for m in messages)
    assert any(re.match(r"step 1 compiled and ran in \d+", m) for m in messages)
    assert any(re.match(rf"step 1/{STEPS} loss=\S+ .* eta \S+$", m) for m in messages)
    summary = messages[messages.index(next(m for m in messages if m.startswith("completed at step"))):]
    assert re.match(rf"completed at step {STEPS}/{STEPS}: {STEPS} steps in \S+ \(timed steps: .* real tokens/s, "
                    r"mean MFU [\d.]+\)", summary[0]), summary
    assert summary[1].startswith("  last step: loss=")
    assert f"{workdir}/checkpoints (newest: step {STEPS})" in summary[2]
    assert f"{workdir}/metrics.jsonl" in summary[3] and f"{workdir}/tensorboard" in summary[3]
    assert re.match(r"  goodput [\d.]+% of [\d.]+s wall: startup [\d.]+s, .*compile [\d.]+s, .*step [\d.]+s",
                    summary[4]), summary
    assert "restore" not in summary[4], summary  # a fresh run: nothing restored
    # The effective config sits beside the checkpoints, equal to what `config show` prints for the same flags.
    written = json.loads((workdir / "config.json").read_text())
    argv = _argv(workdir, ("CORPUS", json.loads((workdir / "config.json").read_text())["data"]["vocab"]))
    overrides = [a for a in argv[argv.index("--set"):] if a != "--set"]
    code, shown, err = _in_process(["config", "show", "bert-tiny", *[x for o in overrides for x in ("--set", o)]],
                                   monkeypatch, capsys)
    assert code == 0, err
    expected = json.loads(shown)
    assert written["train"] == expected["train"] and written["model"] == expected["model"]
    assert written["data"]["input_kind"] == "text"  # auto, decided when the run started


def test_the_export_of_a_pretraining_run_carries_its_card(uninterrupted, corpus, tmp_path, capsys):
    """`bertjax export WORKDIR`: the card holds the run's command as typed, its data by name with each file's size,
    the steps trained and the last metrics logged, and no base model (it is not its own base)."""
    from bertjax import cli

    assert cli.main(["export", str(uninterrupted), "--out", str(tmp_path / "hf")]) == 0
    text = (tmp_path / "hf" / "README.md").read_text()
    assert f"```bash\nbertjax {shlex.join(_argv(uninterrupted, corpus)[3:])}\n```" in text
    assert "Base model: none (pretrained from scratch)." in text
    assert f"Weights: step {STEPS} of train.steps={STEPS}." in text
    train_path = corpus[0]  # named by its file name: where it lay on this machine says nothing to a reader
    assert f"Data: data.input=`{os.path.basename(train_path)}`." in text
    assert f"| {os.path.basename(train_path)} | {os.path.getsize(train_path):,} |" in text
    assert os.path.dirname(train_path) not in re.sub(r"```bash\n.*?\n```", "", text, flags=re.S)
    last = [r for r in _step_records(uninterrupted) if "loss" in r][-1]
    assert f"| train loss | {last['loss']:.4f} |" in text and f"| train mlm_accuracy | {last['mlm_accuracy']:.4f} |" \
        in text


def test_dry_run_compiles_and_plans_without_writing(corpus, tmp_path, monkeypatch, capsys):
    workdir = tmp_path / "planned"
    code, output, err = _in_process(_argv(workdir, corpus, "--dry-run"), monkeypatch, capsys)
    assert code == 0, err
    assert "config valid; mesh {'data': 8, 'fsdp': 1, 'tensor': 1} over 8 cpu device(s)" in output
    assert "first batch read, input_ids[8, 64] masked_lm_ids[8, 10]" in output
    assert re.search(r"step compiled: [\d.]+ GiB per device", output)
    assert "no checkpoints; would start at step 0" in output
    assert not workdir.exists()


def test_config_init_from_a_run_takes_its_batch_and_the_steps_alone(uninterrupted, corpus, tmp_path, monkeypatch,
                                                                     capsys):
    """`--config init` from one of our runs: that run's batch (8 x 64, 10 predictions), not the recipe's 256 x 128;
    `train.steps=10` alone is valid (the warmup a share of the steps)."""
    argv = ["pretrain", "--config", "init", "--init", str(uninterrupted), "--workdir", str(tmp_path / "continued"),
            "--set", f"data.input={corpus[0]}", "--set", "train.steps=10", "--dry-run"]
    code, output, err = _in_process(argv, monkeypatch, capsys)
    assert code == 0, err
    assert ("the --init run's own batch: train.batch_size=8, train.grad_accum_steps=1, data.max_seq_length=64, "
            "data.max_predictions_per_seq=10") in output
    assert "first batch read, input_ids[8, 64] masked_lm_ids[8, 10]" in output
    assert "10 steps =" in output and "warning" not in output


@pytest.mark.slow  # two dry runs at large batches (~90 s); memory_warning itself: test_host_memory.py
def test_dry_run_warns_when_the_step_needs_more_memory_than_the_host(corpus, tmp_path, monkeypatch, capsys):
    """A dry run whose step needs more than the host's RAM (8 CPU devices share it) says so in one line, with what
    to lower; the batch is sized from this host's RAM and the step's temporaries at batch 512."""
    from bertjax.runtime.host_memory import host_ram_bytes

    argv = _argv(tmp_path / "small", corpus, "--dry-run")
    argv[argv.index("train.batch_size=8")] = "train.batch_size=512"
    code, output, err = _in_process(argv, monkeypatch, capsys)
    assert code == 0, err
    assert "warning" not in output
    state, temporaries = (float(x) * 2**30 for x in re.search(
        r"state and batch ([\d.]+) GiB, temporaries ([\d.]+) GiB", output).groups())
    # The temporaries grow with the batch: twice the RAM over the 8 devices.
    batch = 512 * int((2 * host_ram_bytes() / 8 - state) / temporaries + 1)
    if batch > 65536:
        pytest.skip(f"this host's RAM would take a batch of {batch} to exceed")
    argv = _argv(tmp_path / "big", corpus, "--dry-run")
    argv[argv.index("train.batch_size=8")] = f"train.batch_size={batch}"
    code, output, err = _in_process(argv, monkeypatch, capsys)
    assert code == 0, err
    warnings = [line for line in output.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1, output
    need, devices, total, have = re.fullmatch(
        r"warning: the step needs ([\d.]+) GiB per device x (\d+) devices = ([\d.]+) GiB, more than the ([\d.]+) GiB "
        r"of this host's memory: lower train.batch_size \(or raise train.grad_accum_steps\) or "
        r"data.max_seq_length", warnings[0]).groups()
    assert devices == "8" and float(total) > float(have) == pytest.approx(host_ram_bytes() / 2**30, abs=0.01)
    assert f"step compiled: {need} GiB per device" in output


# Packed: slow-marked, for the default suite's time (its uninterrupted reference is a run of its own; the unpacked
# one is the module's): packed rows' input position resumes in a fresh process in test_data_pipeline.py, their
# losses and gradients equal the unpacked ones' in test_packing.py.
# SIGHUP: a dropped SSH session, which used to kill the job at once (no save, the lock left); slow-marked, for the
# default suite's time: the same handler as SIGTERM's, and test_finetune_resume.py sends a fine-tune SIGHUP.
@pytest.mark.parametrize("packing, sig", [(False, signal.SIGTERM),
                                          pytest.param(False, signal.SIGHUP, marks=pytest.mark.slow),
                                          pytest.param(True, signal.SIGTERM, marks=pytest.mark.slow)])
def test_sigterm_then_resume_is_bit_exact(request, corpus, tmp_path, monkeypatch, capsys, packing, sig):
    """Stopped, the job saves and exits STOPPED_EXIT (it was 0: `pretrain ... && export ...` exported a half-trained
    model), its last line saying where it stopped and how to go on; the same command resumes to the same bits."""
    uninterrupted = request.getfixturevalue("uninterrupted_packed" if packing else "uninterrupted")
    extra = PACKING if packing else ()
    workdir = tmp_path / "preempted"
    code, output = _run_until(_argv(workdir, corpus, *extra), f"step {MIDDLE}/", sig, then="echo NEXT")
    assert code == STOPPED_EXIT and "NEXT" not in output, output[-3000:]
    assert "preempted at step" in output and not (workdir / "LOCK").exists()
    stopped_at = int(output.split("preempted at step ")[1].split("/")[0])
    assert MIDDLE <= stopped_at < STEPS
    assert _message(output.strip().splitlines()[-1]) == (
        f"stopped at step {stopped_at} of {STEPS} ({sig.name}), its state saved in {workdir}/checkpoints/"
        f"{stopped_at}: not finished (exit status {STOPPED_EXIT}); run the same command again to resume from step "
        f"{stopped_at}"), output[-3000:]
    _run_here(_argv(workdir, corpus, *extra), monkeypatch, capsys)
    expected, resumed = _losses(uninterrupted), _losses(workdir)
    assert [resumed[s] for s in range(MIDDLE + 1, STEPS + 1)] == [expected[s] for s in range(MIDDLE + 1, STEPS + 1)]
    for a, b in zip(_final_params(workdir), _final_params(uninterrupted)):
        assert np.array_equal(np.asarray(a), np.asarray(b))


def test_sigkill_during_async_save_resumes_from_a_complete_checkpoint(uninterrupted, corpus, tmp_path, monkeypatch,
                                                                     capsys):
    workdir = tmp_path / "killed"
    code, output = _run_until(_argv(workdir, corpus), f"step {MIDDLE}/", signal.SIGKILL)
    assert code == -signal.SIGKILL
    complete = complete_steps(str(workdir))  # the product's own notion of a complete step
    assert complete and complete[-1] in (MIDDLE - EVERY, MIDDLE), complete
    killed_at = max(r["step"] for r in _step_records(workdir))  # the kill came at step MIDDLE or a little after
    # Whatever was in flight (a temporary directory, if any) is not a step: the resume restarts from `complete`.
    output = _run_here(_argv(workdir, corpus), monkeypatch, capsys)
    assert f"resumed from {workdir}/checkpoints/{complete[-1]}" in output
    # The steps past the checkpoint were computed twice: the goodput account says how many.
    [account] = _goodput(workdir)
    assert killed_at >= MIDDLE and account["lost_steps"] == killed_at - complete[-1], (killed_at, account)
    assert account["lost_s"] > 0 and account["first_step"] == complete[-1] and account["restore_s"] > 0
    # The killed run compiled the same step: this one read it from the suite's persistent compilation cache.
    assert account["compile_cache_hits"] >= 1 or not SUITE_CACHE_ON, account
    expected, resumed = _losses(uninterrupted), _losses(workdir)
    assert [resumed[s] for s in range(complete[-1] + 1, STEPS + 1)] == \
           [expected[s] for s in range(complete[-1] + 1, STEPS + 1)]


# One device: slow-marked, for the default suite's time; four devices run the same resharding restore.
@pytest.mark.parametrize("devices", [4, pytest.param(1, marks=pytest.mark.slow)])
def test_eight_device_checkpoint_continues_on_fewer_devices(uninterrupted, corpus, tmp_path, devices):
    workdir = tmp_path / f"on{devices}"
    shutil.copytree(uninterrupted, workdir)
    for step in (MIDDLE + EVERY, STEPS):  # go back to the 8-device checkpoint at step MIDDLE
        shutil.rmtree(workdir / "checkpoints" / str(step))
    (workdir / "metrics.jsonl").write_text("")
    output = _run(_argv(workdir, corpus, "--max-steps-this-run", "5"), devices=devices, status=STOPPED_EXIT)
    assert "resumed from" in output and f"checkpoints/{MIDDLE}" in output
    expected, continued = _losses(uninterrupted), _losses(workdir)
    after = range(MIDDLE + 1, MIDDLE + 6)
    assert sorted(continued) == list(after)
    # Same math, different reduction order across devices: equal to float32 rounding.
    np.testing.assert_allclose([continued[s] for s in after], [expected[s] for s in after],
                               rtol=1e-5)


def test_resume_with_a_changed_config_is_refused_or_allowed_by_name(uninterrupted, corpus, tmp_path, monkeypatch,
                                                                   capsys):
    """Raising train.steps on resume used to rescale the LR schedule silently; a model change dumped Orbax's tree."""
    workdir = tmp_path / "changed"
    shutil.copytree(uninterrupted, workdir)
    for step in (MIDDLE + EVERY, STEPS):
        shutil.rmtree(workdir / "checkpoints" / str(step))

    def argv(*extra):
        return [a.replace(f"train.steps={STEPS}", "train.steps=60") if "--bigger" in extra else a
                for a in _argv(workdir, corpus, *[e for e in extra if e != "--bigger"])]

    def error_line(*extra):  # one line of ours (refused before the job starts: in this process)
        code, _, err = _in_process(argv(*extra), monkeypatch, capsys)
        assert code == 2 and "Traceback" not in err, err[-2000:]
        [line] = [x for x in err.splitlines() if x.startswith("bertjax pretrain: error:")]
        return line

    refused = error_line("--bigger")
    assert f"train.steps: {STEPS} -> 60" in refused and "--allow-config-change" in refused
    shape = error_line("--set", "model.hidden_size=64", "--set", "model.num_attention_heads=2")
    assert "model.hidden_size: 128 -> 64" in shape and "cannot change when resuming" in shape
    allowed = _run_here(argv("--bigger", "--allow-config-change", "--set", "train.log_every=2",
                             "--max-steps-this-run", "2"), monkeypatch, capsys, status=STOPPED_EXIT)
    assert "resuming with changed config keys: train.log_every, train.steps" in allowed
    assert f"step {MIDDLE + 2}/60" in allowed


def test_a_corrupt_newest_checkpoint_is_set_aside_and_the_previous_one_resumes(uninterrupted, corpus, tmp_path,
                                                                               monkeypatch, capsys):
    """A truncated params file in the newest step used to block resuming behind ~150 lines of traceback. As a
    process: the reads the failed restore left in flight, completed on Orbax's closed event loop, printed a dozen
    'Event loop is closed' tracebacks after the warning (in most runs); the warning is all that is said now."""
    workdir = tmp_path / "corrupt"
    shutil.copytree(uninterrupted, workdir)
    newest, damaged = STEPS, MIDDLE + EVERY
    shutil.rmtree(workdir / "checkpoints" / str(newest))
    for path in (workdir / "checkpoints" / str(damaged) / "params").rglob("*"):
        if path.is_file() and path.stat().st_size > 64 and path.parent.name == "d":  # the arrays' data, not metadata
            path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    (workdir / "metrics.jsonl").write_text("")
    done = _run(_argv(workdir, corpus), keep=True)
    assert "Traceback" not in done.stderr and "Event loop is closed" not in done.stderr, done.stderr[-3000:]
    output = done.stdout
    [warning] = [_message(line) for line in output.splitlines() if _message(line).startswith("warning: cannot restore")]
    assert f"checkpoints/{damaged}" in warning and f"checkpoints/{damaged}.corrupt" in warning
    assert "resumed from" in output and f"checkpoints/{MIDDLE}" in output
    assert (workdir / "checkpoints" / f"{damaged}.corrupt").is_dir()
    expected, resumed = _losses(uninterrupted), _losses(workdir)
    assert [resumed[s] for s in range(MIDDLE + 1, STEPS + 1)] == [expected[s] for s in range(MIDDLE + 1, STEPS + 1)]


def test_damaged_input_is_reported_and_binary_input_refused(corpus, tmp_path, monkeypatch, capsys):
    """Invalid UTF-8 and cut lines reach the console and metrics.jsonl; a binary file is one error line."""
    train_path, vocab = corpus
    bad = tmp_path / "bad.txt"
    bad.write_bytes(open(train_path, "rb").read() + b"\n\nCaf\xe9 au lait is a drink.\n" + b"word " * 6000 + b"\n")
    workdir = tmp_path / "run"
    steps = ("--set", "train.steps=3", "--set", "optimizer.warmup_steps=1", "--set", "data.max_line_chars=20000",
             "--set", "data.doc_buffer_size=1000", "--set", "checkpoint.every=1000")
    output = _run_here(_argv(workdir, (str(bad), vocab), *steps), monkeypatch, capsys)
    assert "input: 1 line(s) with invalid UTF-8 so far" in output
    assert "input: 1 line(s) longer than data.max_line_chars=20000 so far" in output
    last = _step_records(workdir)[-1]
    assert last["input_invalid_utf8_lines"] == 1 and last["input_truncated_lines"] == 1
    assert last["input_documents"] > 10

    binary = tmp_path / "model.bin"
    binary.write_bytes(bytes(range(256)) * 64)
    code, _, err = _in_process(_argv(tmp_path / "run2", (str(binary), vocab), *steps), monkeypatch, capsys)
    assert code == 2 and "Traceback" not in err
    assert "model.bin: a NUL byte in line 1 (binary data, not text)" in err


def test_a_json_lines_corpus_is_detected_and_its_text_trained_on(corpus, tmp_path, monkeypatch, capsys):
    """data.input a .jsonl file, no data.corpus_format: the job says what it detected and trains on each record's
    text as a document (the raw lines read as one sentences-layout document would make instances of `{"text": ...`);
    the eval input, plain text, is detected as such on its own."""
    train_path, vocab = corpus
    documents = [d for d in pathlib.Path(train_path).read_text(encoding="utf-8").split("\n\n") if d.strip()]
    jsonl = tmp_path / "demo.jsonl"
    jsonl.write_text("".join(json.dumps({"text": d}) + "\n" for d in documents), encoding="utf-8")
    eval_path = pathlib.Path(train_path).with_name("eval.txt")
    workdir = tmp_path / "run"
    output = _run_here(_argv(workdir, (str(jsonl), vocab), "--set", "train.steps=2", "--set", "optimizer.warmup_steps=1",
                             "--set", "data.doc_buffer_size=1000", "--set", "checkpoint.every=1000",
                             "--set", f"data.eval_input={eval_path}", "--set", "train.eval_every=2",
                             "--set", "train.eval_batches=1"), monkeypatch, capsys)
    assert (f"data.corpus_format=jsonl, detected: {jsonl}: JSON Lines (each line a JSON object), by its extension "
            f"and bytes") in output, output
    assert f"data.corpus_format=sentences, detected: {eval_path}: plain text, by its bytes" in output, output
    assert json.loads((workdir / "config.json").read_text())["data"]["corpus_format"] == "jsonl"
    trained = [r for r in _step_records(workdir) if "loss" in r]
    assert trained[-1]["input_documents"] == len(documents)  # a document per record


def test_a_full_disk_is_named_and_nothing_is_marked_complete(corpus, small_disk):
    """A disk that is full at the start is one line before any work; one that fills at the first save ends the
    job with the same line, no traceback before it (Orbax's threads logged theirs, and TensorStore's writes still in
    flight reported a closed event loop, ~95 in all) and no COMPLETED marker."""
    argv = lambda workdir: _argv(workdir, corpus, "--set", "train.steps=3", "--set", "optimizer.warmup_steps=1",
                                 "--set", "checkpoint.every=1")
    expected = "bertjax pretrain: error: cannot write checkpoint to {}: no space left on device"

    fill_disk(small_disk / "filler")
    full = subprocess.run(argv(small_disk / "full"), env=_env(devices=1), cwd=REPO_ROOT, capture_output=True,
                          text=True, timeout=600)
    assert full.returncode == 2 and "Traceback" not in full.stderr
    assert full.stderr.strip().splitlines()[-1] == expected.format(small_disk / "full" / "checkpoints")
    (small_disk / "filler").unlink()

    fills = subprocess.run(argv(small_disk / "run"), env=_env(devices=1), cwd=REPO_ROOT, capture_output=True,
                           text=True, timeout=600)
    assert fills.returncode == 2 and "Traceback" not in fills.stderr, fills.stderr[-3000:]
    assert fills.stderr.strip().splitlines()[-1] == expected.format(small_disk / "run" / "checkpoints")
    assert not (small_disk / "run" / "COMPLETED").exists()


def test_phase_two_starts_from_a_phase_one_checkpoint(uninterrupted, corpus, tmp_path, monkeypatch, capsys):
    workdir = tmp_path / "phase2"
    argv = _argv(workdir, corpus, "--init", str(uninterrupted))  # a run directory: its newest complete step
    argv[argv.index("data.max_seq_length=64")] = "data.max_seq_length=128"  # phase 2: longer sequences
    argv[argv.index("data.max_predictions_per_seq=10")] = "data.max_predictions_per_seq=20"
    argv[argv.index(f"train.steps={STEPS}")] = "train.steps=2"
    argv[argv.index("optimizer.warmup_steps=5")] = "optimizer.warmup_steps=1"
    output = _run_here(argv, monkeypatch, capsys)
    assert f"initialised from {uninterrupted}/checkpoints/{STEPS} (fresh optimizer state and schedule)" in output
    phase2, fresh = _losses(workdir), _losses(uninterrupted)
    assert sorted(phase2) == [1, 2]
    # The first phase-2 step sees the phase-1 weights: far below a freshly initialised model's first loss.
    assert phase2[1] < fresh[1] - 0.5
    # Its export's card names the --init checkpoint as its base, not itself.
    from bertjax import cli

    assert cli.main(["export", str(workdir), "--out", str(tmp_path / "hf")]) == 0
    assert f"Base model: local checkpoint `{uninterrupted}`." in (tmp_path / "hf" / "README.md").read_text()


# --- A decay phase: a run of its own from a stable run's step, its optimizer state continued ----------------------

DECAY = 4  # the decay phase's steps; it starts from the uninterrupted run's step 9 (not its newest: any step)


def _decay_argv(workdir, corpus, uninterrupted, *extra):
    argv = _argv(workdir, corpus, "--init", str(uninterrupted / "checkpoints" / "9"), "--set",
                 "init_optimizer_state=true", "--set", "optimizer.decay=1-sqrt", *extra)
    argv[argv.index(f"train.steps={STEPS}")] = f"train.steps={DECAY}"
    argv[argv.index("optimizer.warmup_steps=5")] = "optimizer.warmup_steps=0"  # no warmup again
    return argv


def _job_state(argv, minilm_dir):
    """(the fresh state, job) the run of `argv` builds before its first step (nothing compiled but the init)."""
    from bertjax.pretraining import state as train_state
    from bertjax.pretraining.config import load_config
    from bertjax.pretraining.job import build_job_step

    overrides = [argv[i + 1] for i, arg in enumerate(argv) if arg == "--set"]
    config = load_config("bert-tiny", overrides)
    mesh = config.mesh.build()
    vocab = (minilm_dir / "vocab.txt").read_text().splitlines()
    job = build_job_step(config, mesh, len(vocab))
    return train_state.init_sharded_state(job.rng, job.shardings, mesh, **job.state_args), job, vocab


def _nodes(tree, kind) -> list:
    """The nodes of `tree` of type `kind` (an optimizer state's ScaleByAdamState...)."""
    import jax

    return [n for n in jax.tree_util.tree_leaves(tree, is_leaf=lambda x: isinstance(x, kind)) if isinstance(n, kind)]


def _counts(opt_state, kind) -> list[int]:
    return [int(node.count) for node in _nodes(opt_state, kind)]


def test_init_optimizer_state_takes_a_steps_moments_and_restarts_the_schedule(uninterrupted, corpus, minilm_dir,
                                                                              tmp_path):
    """The decay phase's start, without compiling a step: the params and the optimizer state (moments, Adam's
    count) of step 9 as saved, the step, schedule position, RNG and counters this run's own (fresh)."""
    import jax
    import optax

    from bertjax import checkpoint as checkpoint_lib
    from bertjax.model import family
    from bertjax.pretraining import loop

    state, job, vocab = _job_state(_decay_argv(tmp_path, corpus, uninterrupted), minilm_dir)
    source = str(uninterrupted / "checkpoints" / "9")
    lines = []
    started = loop._init_from(state, source, job.shardings, job.abstract_state, True, True, vocab,
                              family.activation(job.bert_config), lines.append)
    assert lines == [f"started from {source}: its params and optimizer state (Adam's moments, at its step 9), the "
                     f"schedule from step 0"]
    saved = checkpoint_lib.restore_train_state(source, job.abstract_state)
    assert int(saved.step) == 9 and int(started.step) == 0
    assert _counts(saved.opt_state, optax.ScaleByScheduleState) == [9]
    assert _counts(started.opt_state, optax.ScaleByScheduleState) == [0]   # this run's schedule, from its start
    assert _counts(started.opt_state, optax.ScaleByAdamState) == [9]       # Adam's bias correction continues
    for kept, want in ((started.params, saved.params), (_nodes(started.opt_state, optax.ScaleByAdamState),
                                                        _nodes(saved.opt_state, optax.ScaleByAdamState))):
        for a, b in zip(jax.tree_util.tree_leaves(kept), jax.tree_util.tree_leaves(want), strict=True):
            assert np.array_equal(np.asarray(a), np.asarray(b))
    for key in ("rng", "nonfinite_total", "nonfinite_consecutive"):
        assert np.array_equal(np.asarray(getattr(started, key)), np.asarray(getattr(state, key)))

    # Another optimizer's state, and a checkpoint without one: one line each, naming the checkpoint.
    lamb_state, lamb_job, _ = _job_state(_decay_argv(tmp_path, corpus, uninterrupted, "--set", "optimizer.name=lamb"),
                                         minilm_dir)
    with pytest.raises(ValueError, match=rf"--init {re.escape(source)}: its train state does not fit this run's model "
                       r"and optimizer \(it was saved with optimizer.name=adamw, optimizer.clip_norm=1.0, "
                       r"optimizer.bias_correction=True: ") as error:
        loop._init_from(lamb_state, source, lamb_job.shardings, lamb_job.abstract_state, True, True, vocab, "gelu",
                        lines.append)
    assert "\n" not in str(error.value)
    with pytest.raises(ValueError, match=r"init_optimizer_state=true: --init .* holds no optimizer state"):
        loop._init_from(state, str(minilm_dir), job.shardings, job.abstract_state, True, True, vocab, "gelu",
                        lines.append)


@pytest.mark.slow  # three short runs (~3 min on a loaded 2-core machine); the start alone is checked above
def test_a_decay_phase_takes_the_rate_to_zero_by_1_sqrt_and_resumes_bit_exactly(uninterrupted, corpus, minilm_dir,
                                                                                tmp_path, monkeypatch, capsys):
    whole = tmp_path / "decay"
    output = _run_here(_decay_argv(whole, corpus, uninterrupted), monkeypatch, capsys)
    assert f"started from {uninterrupted}/checkpoints/9: its params and optimizer state" in output
    rates = {r["step"]: r["learning_rate"] for r in _step_records(whole)}
    peak = 1e-3  # bert-tiny's learning_rate, the stable value the decay starts from
    want = {step: peak * (1 - np.sqrt((step - 1) / DECAY)) for step in range(1, DECAY + 1)}  # step s: s-1 updates done
    assert sorted(rates) == sorted(want)
    np.testing.assert_allclose([rates[s] for s in want], [want[s] for s in want], rtol=1e-6)
    # The optimizer continued: Adam's count is step 9's plus the phase's; the schedule's the phase's own.
    import optax

    from bertjax import checkpoint as checkpoint_lib

    _, job, _ = _job_state(_decay_argv(whole, corpus, uninterrupted), minilm_dir)
    final = checkpoint_lib.restore_train_state(str(whole / "checkpoints" / str(DECAY)), job.abstract_state)
    assert _counts(final.opt_state, optax.ScaleByAdamState) == [9 + DECAY]
    assert _counts(final.opt_state, optax.ScaleByScheduleState) == [DECAY]

    # Stopped at a checkpoint (EVERY = 3) and resumed: the same bits as the whole phase.
    stopped = tmp_path / "decay_stopped"
    assert f"stopped at step 3/{DECAY}" in _run_here(
        _decay_argv(stopped, corpus, uninterrupted, "--max-steps-this-run", "3"), monkeypatch, capsys)
    resumed_output = _run_here(_decay_argv(stopped, corpus, uninterrupted), monkeypatch, capsys)
    assert "resumed from" in resumed_output and "started from" not in resumed_output
    expected, resumed = _losses(whole), _losses(stopped)
    assert [resumed[s] for s in range(4, DECAY + 1)] == [expected[s] for s in range(4, DECAY + 1)]
    for a, b in zip(_final_params(stopped, DECAY), _final_params(whole, DECAY), strict=True):
        assert np.array_equal(np.asarray(a), np.asarray(b))


def test_two_processes_match_one_process():
    from bertjax.cloud.local import launch

    program = [sys.executable, str(REPO_ROOT / "tests/programs/fixed_batch_steps.py")]
    single = subprocess.run(program, env=_env(8), cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert single.returncode == 0, single.stderr[-3000:]
    expected = json.loads(single.stdout.split("LOSSES ")[1])

    import contextlib
    import io

    captured = io.StringIO()
    with contextlib.redirect_stdout(captured):
        code = launch([], processes=2, devices_per_process=4, env=_env(8), program=program)
    assert code == 0, captured.getvalue()[-3000:]
    lines = [l for l in captured.getvalue().splitlines() if "LOSSES " in l]
    assert len(lines) == 1 and lines[0].startswith("[p0]")
    np.testing.assert_allclose(json.loads(lines[0].split("LOSSES ")[1]), expected, rtol=1e-6)


# Slow: 2 processes' start and compile, 150 s on the loaded test machine; test_launch.py's stand-in workers hold the
# launcher's side in the default suite, test_sigterm_then_resume_is_bit_exact[SIGHUP] the job's.
@pytest.mark.slow
def test_a_dropped_session_stops_launch_local_and_its_workers_save_and_free_the_workdir(corpus, tmp_path):
    """SIGHUP (a dropped SSH session) to `launch local`: it used to end alone, its workers left running, orphaned
    and holding the workdir's lock. Now both workers stop at one step boundary after a save and end with it."""
    workdir = tmp_path / "launched"
    documents = pathlib.Path(corpus[0]).read_text(encoding="utf-8").split("\n\n")
    for half in (0, 1):  # a file per process
        (tmp_path / f"part{half}.txt").write_text("\n\n".join(documents[half::2]), encoding="utf-8")
    argv = _argv(workdir, (str(tmp_path / "part*.txt"), corpus[1]))
    argv[argv.index(f"train.steps={STEPS}")] = "train.steps=1000"  # far from done when the signal comes
    launcher = subprocess.Popen([*argv[:3], "launch", "local", "--processes", "2", "--devices-per-process", "1",
                                 "--", *argv[3:]], env=_env(), cwd=REPO_ROOT, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)
    output = []
    for line in launcher.stdout:
        output.append(line)
        if _message(line.removeprefix("[p0] ")).startswith("step 2/"):
            workers = _children(launcher.pid)
            launcher.send_signal(signal.SIGHUP)
            break
    output += launcher.stdout.readlines()
    assert launcher.wait(timeout=120) == STOPPED_EXIT, "".join(output[-40:])  # its workers' status
    assert len(workers) == 2 and not [pid for pid in workers if process_running(pid)]
    stopped_at = int("".join(output).split("preempted at step ")[1].split("/")[0])
    assert (workdir / "checkpoints" / str(stopped_at)).is_dir() and not (workdir / "LOCK").exists()


@pytest.mark.slow
def test_loss_falls_on_wikitext(shared_data, minilm_dir, tmp_path):
    workdir = tmp_path / "wikitext"
    argv = [sys.executable, "-m", "bertjax.cli", "pretrain", "--config", "bert-tiny", "--workdir", str(workdir),
            "--set", f"data.input={shared_data / 'wikitext-2/wiki.valid.raw'}", "--set", "data.corpus_format=wikitext",
            "--set", f"data.vocab={minilm_dir / 'vocab.txt'}", "--set", "train.steps=300",
            "--set", "train.log_every=10", "--set", "checkpoint.every=1000"]
    _run(argv, devices=1)
    losses = _losses(workdir)
    records = _step_records(workdir)
    print("mlm_loss curve:", [(r["step"], round(r["mlm_loss"], 3)) for r in records])
    assert records[-1]["mlm_loss"] < 0.75 * records[0]["mlm_loss"]
    assert losses[300] < losses[10]


def test_a_resume_on_replaced_input_files_warns(corpus, tmp_path, monkeypatch, capsys):
    """The run records its input files (size, modification time): a resume after one was replaced says so."""
    train_path, vocab = corpus
    text = pathlib.Path(train_path).read_text(encoding="utf-8")
    mine = tmp_path / "corpus.txt"
    mine.write_text(text, encoding="utf-8")
    workdir = tmp_path / "run"
    argv = _argv(workdir, (str(mine), vocab), "--set", "train.steps=4", "--set", "checkpoint.every=2",
                 "--set", "optimizer.warmup_steps=1",
                 "--max-steps-this-run", "2")
    first = _run_here(argv, monkeypatch, capsys, status=STOPPED_EXIT)  # stopped after 2 of its 4 steps
    assert "input file(s) changed" not in first
    assert json.loads((workdir / "inputs.json").read_text()).keys() == {str(mine)}
    documents = text.split("\n\n")
    mine.write_text("\n\n".join(reversed(documents)), encoding="utf-8")  # another file, same documents
    second = _run_here(argv, monkeypatch, capsys)  # its last 2 steps: completed, with its --max-steps-this-run 2
    assert f"resumed from {workdir}/checkpoints/2" in second and (workdir / "COMPLETED").exists(), second
    assert (f"warning: 1 input file(s) changed since this run started ({mine}): it continues on them from the saved "
            "input position, which was a position in the old files") in second
