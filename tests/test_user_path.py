"""The user's path around the jobs: presets listed and shown, run directories standing for their newest step,
export's rules, the cached CPU peak, and the README's commands checked against the real argument parser."""
import json
import re
import shlex
import stat

import pytest

from bertjax import cli
from tests import stall_watch
from tests.conftest import REPO_ROOT, save_tiny_checkpoint, user_docs_text


def test_config_list_names_every_preset_with_its_description(capsys):
    assert cli.main(["config", "list"]) == 0
    listed = dict(line.split(None, 1) for line in capsys.readouterr().out.splitlines())
    files = sorted(p.stem.replace("_", "-") for p in (REPO_ROOT / "configs").glob("*.py") if p.stem != "__init__")
    assert sorted(listed) == files
    assert listed["bert-tiny"].startswith("BERT-tiny (L2/H128/A2)")


def test_the_version_is_one_line_whatever_the_terminal_width(monkeypatch, capsys):
    """argparse's version action wrapped the line at the terminal's width: a long install path split it in two."""
    import importlib.metadata

    monkeypatch.setenv("COLUMNS", "30")
    with pytest.raises(SystemExit) as exited:
        cli.main(["--version"])
    assert exited.value.code == 0
    out = capsys.readouterr().out
    assert out == cli.version_line() + "\n"
    assert out.startswith(f"bertjax {importlib.metadata.version('bertjax')} (jax ") and \
        out.rstrip().endswith(str(REPO_ROOT / "bertjax"))


def test_config_show_prints_the_validated_effective_config(capsys):
    assert cli.main(["config", "show", "bert-tiny", "--set", "train.steps=77", "--set", "optimizer.warmup_steps=7"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["train"]["steps"] == 77 and shown["model"]["preset"] == "tiny"
    # The values the job trains with, not the 0 that means "the preset's" (BERT-tiny: L2/H128/A2).
    model = shown["model"]
    assert (model["num_hidden_layers"], model["hidden_size"], model["num_attention_heads"],
            model["intermediate_size"]) == (2, 128, 2, 512)
    # The JSON holds both warmup keys; a note on stderr says which one sets the warmup.
    assert cli.main(["config", "show", "bert-tiny"]) == 0
    assert capsys.readouterr().err == ("note: optimizer.warmup_ratio=0.1 applies: 30 warmup steps of train.steps=300; "
                                       "optimizer.warmup_steps=10000 is not used\n")
    assert cli.main(["config", "show", "bert-tiny", "--set", "train.batchsize=1"]) == 2
    assert "train.batchsize: unknown config key (did you mean train.batch_size?)" in capsys.readouterr().err
    assert cli.main(["config", "show", "bert-tiny", "--set", "train.steps=5", "--set",
                     "optimizer.warmup_steps=30"]) == 2  # an explicit warmup longer than the run
    assert "optimizer.warmup_steps=30 must be in [0, train.steps=5]" in capsys.readouterr().err


def test_config_show_describes_every_key(capsys):
    """`config show --describe`: every key of the effective config, its value as the JSON has it, and what it does
    (from the option's own help: one definition, shared with --help and --set)."""
    assert cli.main(["config", "show", "bert-tiny", "--set", "train.steps=77"]) == 0
    values = json.loads(capsys.readouterr().out)
    assert cli.main(["config", "show", "bert-tiny", "--set", "train.steps=77", "--describe"]) == 0
    lines = capsys.readouterr().out.splitlines()
    keys, helps = lines[0::2], lines[1::2]
    def flatten(tree, prefix=""):  # nested groups too (model.modernbert.*)
        return {k: v for key, value in tree.items() for k, v in (
            flatten(value, f"{prefix}{key}.").items() if isinstance(value, dict) else [(prefix + key, value)])}

    flat = flatten(values)
    assert sorted(keys) == sorted(f"{key} = {json.dumps(value)}" for key, value in flat.items())
    assert "train.steps = 77" in keys
    undescribed = [k for k, h in zip(keys, helps) if not h.startswith("    ") or not h.strip()]
    assert not undescribed, undescribed
    assert helps[keys.index("optimizer.b2 = 0.999")] == \
        "    Adam's beta2: decay of the second-moment (variance) estimate"


def test_config_show_output_is_a_config_that_runs_the_same_job(tmp_path, capsys, minilm_dir):
    argv = ["--set", "train.steps=77", "--set", "optimizer.warmup_steps=7", "--set", f"data.vocab={minilm_dir}/vocab.txt"]
    assert cli.main(["config", "show", "bert-tiny", *argv]) == 0
    shown = capsys.readouterr().out
    assert json.loads(shown)["model"]["vocab_size"] == 30522  # the vocabulary's size, read from data.vocab
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "config.json").write_text(shown)
    # A config.json, or the run directory holding it, is a --config; shown again it is the same config.
    for name in (tmp_path / "run" / "config.json", tmp_path / "run"):
        assert cli.main(["config", "show", str(name)]) == 0
        assert json.loads(capsys.readouterr().out) == json.loads(shown)
    assert cli.main(["config", "show", str(tmp_path / "nope.json")]) == 2
    assert f"config file {tmp_path / 'nope.json'} does not exist" in capsys.readouterr().err
    (tmp_path / "bad.json").write_text('{"train": {"stepz": 3}}')
    assert cli.main(["config", "show", str(tmp_path / "bad.json")]) == 2
    assert "bad.json: train.stepz: unknown config key (did you mean train.steps?)" in capsys.readouterr().err


def test_demo_corpus_says_what_it_wrote_in_a_timestamped_line(tmp_path, capsys):
    assert cli.main(["demo-corpus", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert re.fullmatch(rf"\d\d:\d\d:\d\d wrote {tmp_path}/train.txt and {tmp_path}/eval.txt\n", out), out


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, minilm_dir):
    """A run directory as pretraining leaves it: finished steps 5 and 12, and an unfinished save of step 15."""
    run = tmp_path_factory.mktemp("run")
    for step, seed in ((5, 0), (12, 1)):
        save_tiny_checkpoint(run / "checkpoints" / str(step), minilm_dir / "vocab.txt", seed)
    (run / "checkpoints" / "15.orbax-checkpoint-tmp-1234").mkdir()
    return run


def test_a_run_directory_stands_for_its_newest_complete_step(run_dir, tmp_path, capsys):
    from bertjax.checkpoint import complete_steps, resolve_checkpoint

    assert complete_steps(str(run_dir)) == [5, 12]
    newest = str(run_dir / "checkpoints" / "12")
    assert resolve_checkpoint(str(run_dir)) == resolve_checkpoint(str(run_dir / "checkpoints")) == newest
    assert resolve_checkpoint(str(run_dir / "checkpoints" / "5")) == str(run_dir / "checkpoints" / "5")
    assert resolve_checkpoint(str(tmp_path)) == str(tmp_path)  # no steps: left for the loader to name
    assert cli.main(["info", str(run_dir)]) == 0
    assert capsys.readouterr().out.startswith(f"checkpoint: {newest}\n")


def test_info_on_a_run_directory_shows_its_progress_and_last_metrics(run_dir, tmp_path, capsys):
    import shutil

    run = tmp_path / "run"
    shutil.copytree(run_dir, run)
    (run / "config.json").write_text(json.dumps({"train": {"steps": 100}}))
    records = [{"step": 10, "loss": 7.5, "mlm_accuracy": 0.125, "learning_rate": 1e-4},
               {"step": 10, "eval_mlm_accuracy": 0.25, "eval_nsp_accuracy": 0.5},
               {"step": 12, "loss": 7.25, "mlm_accuracy": 0.25, "learning_rate": 2e-4}]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records) + '{"step": 13, "lo')
    assert cli.main(["info", str(run)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1:4] == ["run: newest checkpoint step 12 of 100 (not completed)",
                          "  last logged step 12: loss=7.25, mlm_accuracy=0.25, learning_rate=0.0002",
                          "  last eval at step 10: eval_mlm_accuracy=0.25, eval_nsp_accuracy=0.5"], lines


def test_export_takes_a_run_directory_writes_shareable_files_and_never_overwrites(run_dir, tmp_path, capsys):
    out = tmp_path / "hf"
    assert cli.main(["export", str(run_dir), "--out", str(out)]) == 0
    assert f"(from {run_dir}/checkpoints/12)" in capsys.readouterr().out
    for path in out.iterdir():
        assert path.stat().st_mode & stat.S_IROTH, f"{path.name} is not world-readable"
    before = (out / "model.safetensors").read_bytes()
    assert cli.main(["export", str(run_dir / "checkpoints" / "5"), "--out", str(out)]) == 2
    assert f"--out {out} already exists" in capsys.readouterr().err
    assert (out / "model.safetensors").read_bytes() == before
    # An HF directory exports too (every checkpoint command takes one).
    assert cli.main(["export", str(out), "--out", str(tmp_path / "again")]) == 0


def test_the_cpu_peak_is_measured_once_per_machine(tmp_path):
    import jax
    import jax.numpy as jnp

    from bertjax.pretraining.metrics import cached_matmul_peak

    first, where = cached_matmul_peak(jax.devices()[0], jnp.float32, cache_dir=str(tmp_path))
    assert first > 1e9 and "measured now" in where
    again, where = cached_matmul_peak(jax.devices()[0], jnp.float32, cache_dir=str(tmp_path), recheck=False)
    assert again == first and f"cached in {tmp_path}" in where
    [entry] = json.loads((tmp_path / "matmul_peak.json").read_text()).values()
    assert entry["flops"] == first


def test_a_cpu_peak_cached_on_a_busy_machine_is_raised(tmp_path):
    """A peak measured under load (here 1 MFLOP/s) gave MFU above 1: a start measures again and keeps the higher
    figure, saying so; a figure that is not beaten stays."""
    import jax
    import jax.numpy as jnp

    from bertjax.pretraining.metrics import cached_matmul_peak

    cached_matmul_peak(jax.devices()[0], jnp.float32, cache_dir=str(tmp_path))  # the cache file and its key
    cache_file = tmp_path / "matmul_peak.json"
    [(key, entry)] = json.loads(cache_file.read_text()).items()
    cache_file.write_text(json.dumps({key: {"flops": 1e6, "measured": "2026-01-01"}}))
    raised, where = cached_matmul_peak(jax.devices()[0], jnp.float32, cache_dir=str(tmp_path))
    assert raised > 1e9 and "above the cached 1e-06 (measured 2026-01-01 on a busier machine)" in where
    assert json.loads(cache_file.read_text())[key]["flops"] == raised
    cache_file.write_text(json.dumps({key: {"flops": 1e15, "measured": "2026-01-02"}}))
    assert cached_matmul_peak(jax.devices()[0], jnp.float32, cache_dir=str(tmp_path)) == (
        1e15, f"cpu matmul peak measured 2026-01-02, cached in {cache_file}")


def _readme_commands() -> list[list[str]]:
    """Every `bertjax ...` command line in the code blocks of README.md and docs/usage.md (continuation lines
    joined)."""
    text = user_docs_text()
    commands = []
    for block in re.findall(r"```(?:bash|sh)?\n(.*?)```", text, re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split(" #")[0].strip()
            if line.startswith("bertjax "):
                commands.append(shlex.split(line.replace("...", "")))
    return commands


def _check_command(words: list[str], tree: dict, leaves: set, line: str) -> tuple[str, ...]:
    """The command path of `bertjax WORDS...`, after checking its flags (a launcher's `-- JOB` is checked too)."""
    path = ()
    for word in words:
        if path + (word,) not in tree:
            break
        path += (word,)
    root_flags_only = not path and words and all(word.startswith("-") for word in words)  # bertjax --version
    assert path in leaves or root_flags_only, f"README: {line!r} is not a bertjax command"
    flags = {s for action in tree[path]._actions for s in action.option_strings}
    rest = words[len(path):]
    for index, word in enumerate(rest):
        if word == "--":
            _check_command(rest[index + 1:], tree, leaves, line)
            break
        if word.startswith("--"):
            assert word.split("=")[0] in flags, f"README: {line!r}: {word} is not a flag of {' '.join(path)}"
    return path


def test_every_command_is_documented_and_every_documented_command_parses():
    parser = cli.build_parser()
    tree = {path: command for path, command in cli.walk_commands(parser)}
    leaves = {path for path, command in tree.items() if not cli._subcommands(command)}
    documented = {_check_command(argv[1:], tree, leaves, " ".join(argv)) for argv in _readme_commands()}
    missing = sorted(" ".join(p) for p in leaves - documented)
    assert not missing, f"commands without an example in README.md or docs/usage.md: {missing}"


def test_the_top_level_help_names_every_command_of_each_group(capsys):
    """`bertjax --help` is where a user looks for a job: each group's line there names every command in it
    (`finetune classify` was missing from finetune's)."""
    import argparse

    parser = cli.build_parser()
    with pytest.raises(SystemExit):
        parser.parse_args(["--help"])
    shown = capsys.readouterr().out
    [groups] = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    for entry in groups._choices_actions:  # each command's line in `shown`
        commands = cli._subcommands(groups.choices[entry.dest])
        assert re.search(rf"^    {entry.dest} +{re.escape(entry.help.split()[0])}", shown, re.MULTILINE), shown
        unnamed = [name for name in commands if not re.search(rf"(?<![\w-]){re.escape(name)}(?![\w-])", entry.help)]
        assert not unnamed, f"bertjax --help: {entry.dest}'s line ({entry.help!r}) does not name {unnamed}"


def test_help_writes_no_native_log_lines():
    import sys

    result = stall_watch.run([sys.executable, "-m", "bertjax.cli", "--help"], cwd=REPO_ROOT)
    assert result.returncode == 0 and "finetune" in result.stdout
    assert result.stderr == ""
    shown = stall_watch.run([sys.executable, "-m", "bertjax.cli", "data", "create", "--help"], cwd=REPO_ROOT)
    assert "A/B pairs with 50% random next" in shown.stdout and "(default: 0.15)" in shown.stdout
    assert shown.stderr == ""


def test_an_export_that_fails_midway_leaves_nothing_at_out(tmp_path, minilm_dir, monkeypatch):
    import errno

    from etils.epath import gpath

    from bertjax.interop.hf import export_hf
    from bertjax.interop.load import load_pretrained
    from bertjax.runtime.errors import OutputWriteError

    loaded = load_pretrained(str(minilm_dir))
    out = tmp_path / "hf"
    # The disk fills after the weights are written: the tokenizer's files fail (an error injected at the one write).
    write_text = gpath._GPath.write_text

    def full_at_the_tokenizer(path, text, *args, **kwargs):
        if path.name == "tokenizer.json":
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        return write_text(path, text, *args, **kwargs)

    with monkeypatch.context() as patched:
        patched.setattr(gpath._GPath, "write_text", full_at_the_tokenizer)
        with pytest.raises(OutputWriteError, match=f"^cannot write {out}: no space left on device$"):
            export_hf(loaded.params, loaded.config, loaded.vocab, str(out))
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # no half directory, no leftover temporary
    export_hf(loaded.params, loaded.config, loaded.vocab, str(out))
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors", "special_tokens_map.json",
                                                     "tokenizer.json", "tokenizer_config.json", "vocab.txt"]


def test_the_readme_puts_bertjax_on_the_path_of_a_new_shell(tmp_path):
    """The README's `<!-- a-new-shell -->` block, run in a shell whose PATH lacks the environment (a new terminal
    after `make demo`), finds `bertjax` and prints its version."""
    import importlib.metadata
    import os
    import pathlib
    import subprocess
    import sys

    readme = (REPO_ROOT / "README.md").read_text(encoding="utf-8")
    block = re.search(r"<!-- a-new-shell -->\n```bash\n(.*?)\n```", readme, re.S).group(1)
    venv = pathlib.Path(sys.prefix)
    if not (venv / "bin" / "activate").exists():
        pytest.skip(f"{sys.prefix} is not a virtual environment")
    (tmp_path / ".venv").symlink_to(venv)  # the checkout's .venv, as `make install` makes it
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PATH")}
    env["PATH"] = "/usr/bin:/bin"
    assert subprocess.run(["bash", "-c", "command -v bertjax"], env=env, capture_output=True).returncode != 0
    result = stall_watch.run(["bash", "-c", "set -euo pipefail\n" + block], cwd=tmp_path, env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    version = importlib.metadata.version("bertjax")
    assert re.fullmatch(rf"bertjax {re.escape(version)} \(jax \S+, Python 3\.\d+\.\d+\) at \S+/bertjax\n",
                        result.stdout), result.stdout


def test_the_predictions_scores_compile_one_program_with_the_same_values():
    """Found by bench/user_path.py's breakdown: a fine-tune's dev predictions compiled their softmax op by op (5
    programs, ~0.14 s of a short run). One program now, bit for bit the same scores. (The progress lines' learning
    rate stays op by op: as one program XLA folds its division into a product, 1 ulp off.)"""
    import jax
    import numpy as np

    from bertjax.finetune import classify

    logits = np.random.default_rng(0).normal(scale=4.0, size=(13, 3)).astype(np.float32)
    compiled = []

    def count(event: str, seconds: float, **_) -> None:
        if event == "/jax/core/compile/backend_compile_duration":
            compiled.append(event)

    jax.monitoring.register_event_duration_secs_listener(count)
    try:
        softmax = classify.scores("single_label_classification", logits)
        assert len(compiled) == 1   # op by op: 5
        sigmoid = classify.scores("multi_label_classification", logits)
    finally:
        jax.monitoring.unregister_event_duration_listener(count)
    np.testing.assert_array_equal(softmax, np.asarray(jax.nn.softmax(logits, axis=-1)))
    np.testing.assert_array_equal(sigmoid, np.asarray(jax.nn.sigmoid(logits)))
    wide = np.random.default_rng(1).normal(scale=30.0, size=(64, 7)).astype(np.float32)
    np.testing.assert_array_equal(classify.scores("single_label_classification", wide),
                                  np.asarray(jax.nn.softmax(wide, axis=-1)))


def test_the_user_path_bench_says_where_a_commands_seconds_go(tmp_path):
    """bench/user_path.py's profiled run of a bertjax command (here `config list`, which starts no JAX): the command's
    own output, its timers written, its imports read from -X importtime; and the table of two runs' phases."""
    import importlib.util
    import os
    import subprocess
    import sys

    spec = importlib.util.spec_from_file_location("user_path", REPO_ROOT / "bench" / "user_path.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    profile = tmp_path / "profile.json"
    done = subprocess.run(bench.profiled(["bertjax", "config", "list"], profile), capture_output=True, text=True,
                          timeout=300, env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
    assert done.returncode == 0, done.stderr[-2000:]
    assert "bert-tiny" in done.stdout
    found = json.loads(profile.read_text())
    assert found["main_s"] > 0 and found["seconds"] == {} and found["compiles"] == {}   # no JAX, no timed part
    assert 0 < bench.import_seconds(done.stderr.splitlines()) < 60
    lines = ["import time: self [us] | cumulative | imported package", "import time:       100 |       2500 | jax",
             "import time:        50 |       2000 |   jax._src", "import time:        10 |        500 | numpy"]
    assert bench.import_seconds(lines) == 0.003   # top-level modules only: nested ones are in their cumulative time
    result = {"wall_s": 10.0, "import_s": 2.0}
    profile.write_text(json.dumps({"seconds": {"jax: tracing": 1.5}, "calls": {"jax: tracing": 3},
                                   "compiles": {"jit(step)": [4.0, 1.0], "jit(_predict_fn)": [0.5]}, "main_s": 9.0}))
    table = bench.breakdown_table([bench.breakdown(result, profile), bench.breakdown(result, profile)])
    assert "| process wall | 10.00 | 10.00 |" in table and "| jax: tracing | 1.50 (3x) | 1.50 (3x) |" in table
    assert "(empty cache): jit(step) 5.00 s (2x), jit(_predict_fn) 0.50 s" in table


# ---- install lines: every one the docs, the Makefile, bench/ and the messages give works from a checkout ----------

INSTALL_SOURCES = ("README.md", "Makefile", "docs/*.md", "bench/*", "bertjax/**/*.py")
# Installed with pip beside the project but not its requirements: pip itself, and GKE's launcher (its own CLI).
INSTALLED_BESIDE = {"pip", "xpk"}


def _install_texts() -> list[tuple[str, str]]:
    """(file, text) of each place an install line may sit: a Markdown file's code (fenced blocks, and inline spans
    with their line breaks joined), another file's lines with continuations (`\\` at a line's end) joined."""
    texts = []
    for pattern in INSTALL_SOURCES:
        for path in sorted(REPO_ROOT.glob(pattern)):
            if not path.is_file():
                continue
            text, name = path.read_text(encoding="utf-8"), str(path.relative_to(REPO_ROOT))
            if path.suffix == ".md":
                blocks = re.findall(r"```\w*\n(.*?)```", text, re.S)
                spans = re.findall(r"`([^`]+)`", re.sub(r"```\w*\n.*?```", "", text, flags=re.S))
                texts += [(name, block.replace("\\\n", " ")) for block in blocks]
                texts += [(name, span.replace("\n", " ")) for span in spans]
            else:
                texts.append((name, re.sub(r"\\{1,2}\n\s*", " ", text)))
    return texts


def _install_lines() -> list[tuple[str, list[str]]]:
    """(file, words) of each `pip install ...`: its words up to the end of its command (`;`, `&&`, `|`, a comment,
    the line's end, a closing quote or parenthesis of the text around it), quotes stripped."""
    found = []
    for name, text in _install_texts():
        for match in re.finditer(r"pip install\b(.*)", text):
            words = []
            for word in match.group(1).split():
                if word in ("&&", "|", "||") or word.startswith("#"):
                    break
                quoted = len(word) > 1 and word[0] == word[-1] and word[0] in "'\""
                inner = word[1:-1] if quoted else word
                words.append(inner.strip("'\"`);:,"))
                if inner.endswith(("'", '"', "`", ")", ";", ":")):
                    break
            found.append((name, [w for w in words if w]))
    return found


def _named(token: str) -> tuple[str, str | None, str]:
    """(name, extras, version spec) of a requirement as pip takes one (`jax[cuda12]==0.10.2`)."""
    name, extras, spec = re.fullmatch(r"([A-Za-z0-9_.\-]+)(?:\[([^\]]*)\])?(.*)", token).groups()
    return name.lower().replace("_", "-"), extras, spec


def _extras_named(words: list[str]) -> list[str]:
    """The extras that the install words name from the project itself: a path's or a wheel's `[X]`."""
    named = []
    for word in words:
        local = word.startswith((".", "/", "$")) or word.startswith("{")
        if local and re.search(r"\[([^\]]+)\]$", word):
            named += re.search(r"\[([^\]]+)\]$", word).group(1).split(",")
    return named


def test_every_install_line_names_an_extra_that_exists_in_a_form_that_works_from_a_checkout():
    """bertjax is not on PyPI: an install line names the project by its checkout (`pip install -e '.[cloud]'`, `make
    install-cloud`, a message's `pip install -e '/path/checkout[gpu]'`) or a wheel built from it, each extra one of
    pyproject.toml's; another package only where pyproject.toml requires it (jax at its pin: an unpinned `jax[cuda12]`
    replaces the project's jax), or the tools installed beside it. Parsed, not run (the GPU extra is 5 GB): the next
    test runs the form itself."""
    import tomllib

    project = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    extras = set(project["optional-dependencies"])
    required = {}
    for requirement in project["dependencies"] + sum(project["optional-dependencies"].values(), []):
        name, _, spec = _named(requirement.split(";")[0].replace(" ", ""))
        required[name] = spec or required.get(name, "")

    def placeholder(extra: str) -> bool:  # the docs' `.[EXTRA]`, the Makefile's `$*`
        return extra.isupper() or extra == "$*"

    problems, lines = [], _install_lines()
    assert len(lines) >= 10, lines  # the reader finds them
    for name, words in lines:
        line = f"{name}: pip install {' '.join(words)}"
        values = iter(words)
        for word in values:
            if word in ("--python", "--reinstall-package", "--target", "-t", "-r", "--requirement"):
                next(values, None)   # an option's value, not a requirement
                continue
            if word.startswith("-"):
                continue
            if word.startswith((".", "/", "$", "{")):   # the checkout, a wheel built from it, or a wheel directory
                problems += [f"{line}: no extra {x!r} in pyproject.toml" for x in _extras_named([word])
                             if x not in extras and not placeholder(x)]
                continue
            package, _, spec = _named(word)
            if package == "bertjax":
                problems.append(f"{line}: bertjax is not on PyPI (from the checkout: pip install -e '.[EXTRA]')")
            elif package in INSTALLED_BESIDE:
                continue
            elif package not in required:
                problems.append(f"{line}: {package} is not a requirement of pyproject.toml")
            elif "{" not in spec and (spec or package == "jax") and spec != required[package]:
                problems.append(f"{line}: {package}{spec or ' unpinned'}, where pyproject.toml pins "
                                f"{package}{required[package]}")
    for name, text in _install_texts():
        problems += [f"{name}: make install-{extra}: no such extra in pyproject.toml"
                     for extra in re.findall(r"make install-([\w$*]+)", text)
                     if extra not in extras and not placeholder(extra)]
        problems += [f"{name}: {text[max(m.start() - 20, 0):m.end() + 10]!r}: bertjax is not on PyPI"
                     for m in re.finditer(r"(?<![\w./{}-])bertjax\[", text)]
    for path in sorted((REPO_ROOT / "bertjax").rglob("*.py")):   # the messages' lines, made by install_line
        problems += [f"{path.relative_to(REPO_ROOT)}: install_line({extra!r}): no such extra"
                     for extra in re.findall(r"install_line\(['\"](\w+)['\"]\)", path.read_text(encoding="utf-8"))
                     if extra not in extras]
    assert not problems, "\n".join(problems)


def test_the_checkouts_install_form_resolves_each_extra_offline():
    """`pip install -e '.[EXTRA]'` in the checkout (what `make install-EXTRA` runs), as pip resolves it: dry, offline.
    The extras the test extras hold resolve to what is installed; pip warns about an extra the project lacks and goes
    on (it would install nothing of it), which this run sees; `gpu`, which the test extras leave out, resolves to the
    jax CUDA plugin at jax's pin (no index here: not found, unless it is installed)."""
    import importlib.metadata
    import subprocess
    import sys
    import tomllib

    extras = set(tomllib.loads((REPO_ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
                 ["optional-dependencies"])
    pip = [sys.executable, "-m", "pip", "install", "--dry-run", "--no-index", "--no-build-isolation",
           "--disable-pip-version-check", "-e"]
    held = sorted(extras - {"gpu", "test"})
    done = subprocess.run([*pip, f".[{','.join(held + ['nope'])}]"], cwd=REPO_ROOT, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0 and "Would install bertjax-" in done.stdout, done.stdout[-2000:] + done.stderr
    assert re.findall(r"does not provide the extra '(\w+)'", done.stderr) == ["nope"], done.stderr
    gpu = subprocess.run([*pip, ".[gpu]"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    try:
        importlib.metadata.version("jax-cuda12-plugin")
    except importlib.metadata.PackageNotFoundError:
        assert gpu.returncode != 0 and "jax-cuda12-plugin<=0.10.2,>=0.10.2" in gpu.stderr, gpu.stderr
    else:
        assert gpu.returncode == 0, gpu.stderr


def test_a_missing_extra_is_named_with_the_line_that_installs_it_where_bertjax_runs(tmp_path):
    """From a checkout: this interpreter's pip installs the extra from it (any directory); installed from a wheel:
    the extra's own requirements, as pyproject.toml lists them."""
    import shlex
    import sys
    import tomllib

    from packaging.requirements import Requirement

    from bertjax.runtime.extras import install_line

    python = shlex.quote(sys.executable)
    assert install_line("gpu") == f"{python} -m pip install -e '{REPO_ROOT}[gpu]'"
    listed = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"][
        "optional-dependencies"]
    for extra in ("gpu", "beam"):
        words = shlex.split(install_line(extra, package_parent=str(tmp_path)))   # no pyproject.toml there
        assert words[:4] == [sys.executable, "-m", "pip", "install"]
        assert sorted(map(Requirement, words[4:]), key=str) == sorted(map(Requirement, listed[extra]), key=str)
