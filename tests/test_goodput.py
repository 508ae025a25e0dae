"""The whole-job goodput account (`bertjax goodput`) over run accounts and a launcher log, and where the
persistent compilation cache lives. Real runs' accounts are tested in test_pretrain.py and test_babysitter.py."""
import json
import subprocess
import sys

import pytest

from bertjax.runtime import compile_cache
from bertjax.cli import main as bertjax_main
from bertjax.pretraining import goodput
from tests.conftest import REPO_ROOT
from tests.test_pretrain import _env


def _run_account(start, wall, step_s, *, first_step, step, lost_steps=0, lost_s=0.0, ended=True):
    seconds = dict.fromkeys(goodput.CATEGORIES, 0.0)
    seconds.update(startup_s=5.0, compile_s=10.0, step_s=step_s, checkpoint_s=wall - 15.0 - step_s)
    return {"run": f"run-{start}", "process_start": start, "updated": start + wall, "ended": ended,
            "status": "completed" if ended else "", **seconds, "wall_s": wall, "lost_steps": lost_steps,
            "lost_s": lost_s, "goodput": step_s / wall, "compile_cache_hits": 0, "compile_cache_misses": 1,
            "first_step": first_step, "step": step, "timed_steps": step - first_step - 1}


@pytest.fixture
def two_runs(tmp_path):
    """A run killed at step 25 (its last snapshot at t=1080, the launcher saw it end at t=1090) and its restart
    from the step-20 checkpoint, which recomputed 5 steps (10 s) and completed."""
    folder = tmp_path / "goodput"
    folder.mkdir()
    (folder / "a.json").write_text(json.dumps(_run_account(1000, 80, 50, first_step=0, step=25, ended=False)))
    (folder / "b.json").write_text(json.dumps(_run_account(1100, 100, 70, first_step=20, step=50, lost_steps=5,
                                                           lost_s=10.0)))
    events = [("start", 998), ("end", 1090), ("start", 1095), ("end", 1201)]
    (folder / "launcher.jsonl").write_text("".join(json.dumps({"event": e, "time": t}) + "\n" for e, t in events))
    return tmp_path


def test_the_job_account_adds_up_runs_restarts_and_the_time_between(two_runs):
    account = goodput.job_account(str(two_runs), now=1300)
    assert account["wall_s"] == 1201 - 998  # the launcher's first start to its last end
    assert account["step_s"] == 120 and account["compile_s"] == 20
    assert account["unrecorded_s"] == 10  # the killed run's end after its last snapshot
    assert account["between_runs_s"] == pytest.approx(203 - 80 - 10 - 100)
    assert account["lost_steps"] == 5 and account["lost_s"] == 10
    assert account["goodput"] == pytest.approx((120 - 10) / 203, abs=1e-4)
    assert account["launcher_restarts"] == 1
    assert [r["status"] for r in account["runs"]] == ["killed or running", "completed"]
    # Every second of the job is in exactly one place.
    parts = sum(account[k] for k in goodput.CATEGORIES) + account["unrecorded_s"] + account["between_runs_s"]
    assert parts == pytest.approx(account["wall_s"])


def test_bertjax_goodput_prints_the_account_and_names_a_workdir_without_one(two_runs, tmp_path, capsys):
    assert bertjax_main(["goodput", str(two_runs)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == f"{two_runs}: 2 run(s), 203.0s wall, goodput 54.2% (110.0s of productive steps)"
    assert any(line.split() == ["between", "runs", "(launcher)", "13.0s", "6.4%"] for line in lines), lines
    assert any("steps 20 -> 50" in line and "lost 5 step(s) ~10.0s" in line for line in lines), lines
    assert bertjax_main(["goodput", str(two_runs), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["lost_steps"] == 5
    assert bertjax_main(["goodput", str(tmp_path / "nothing")]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and "no run accounts" in err and str(tmp_path / "nothing") in err


def test_the_cache_directory_setting():
    environ = {"HOME": "/home/u"}
    assert compile_cache.resolve("", environ) == "/home/u/.cache/bertjax/jax"
    assert compile_cache.resolve("", {**environ, "XDG_CACHE_HOME": "/x"}) == "/x/bertjax/jax"
    assert compile_cache.resolve("", {**environ, "JAX_COMPILATION_CACHE_DIR": "/shared"}) == "/shared"
    assert compile_cache.resolve("gs://bucket/cache", environ) == "gs://bucket/cache"
    assert compile_cache.resolve("off", environ) is None
    # JAX's own switch turns the default off (a whole test suite without the cache), not an explicit directory
    assert compile_cache.resolve("", {**environ, "JAX_ENABLE_COMPILATION_CACHE": "false"}) is None
    assert compile_cache.resolve("/x", {**environ, "JAX_ENABLE_COMPILATION_CACHE": "0"}) == "/x"


def test_an_unwritable_cache_directory_is_named_by_its_key(tmp_path):
    blocked = tmp_path / "file"
    blocked.write_text("")
    with pytest.raises(ValueError, match=r"train.compilation_cache_dir='.*file/jax': cannot create"):
        compile_cache.enable(str(blocked / "jax"))


def test_a_cut_run_account_is_named_and_the_account_called_incomplete(two_runs, capsys):
    """Two runs, one account cut mid-write: the other is shown, the cut one named, the command does not succeed."""
    path = two_runs / "goodput" / "b.json"
    path.write_text(path.read_text()[:40])
    assert bertjax_main(["goodput", str(two_runs)]) == 1
    shown = capsys.readouterr()
    assert shown.out.splitlines()[0].startswith(f"{two_runs}: 1 run(s), ")
    assert ("  incomplete: left out goodput/b.json: not valid JSON (cut short?): Expecting ',' delimiter (line 1, "
            "column 41); expected a run's goodput account (JSON) (cut or damaged)") in shown.out
    assert shown.err.strip().splitlines()[-1].startswith(
        f"bertjax goodput: error: the account of {two_runs} is incomplete: 1 run account(s) cannot be read "
        "(goodput/b.json: ")


CACHE_PROGRAM = """
import sys, warnings
import jax, jax.numpy as jnp
from bertjax.runtime import compile_cache
from bertjax.cli import main as bertjax_main
compile_cache.enable(sys.argv[1])
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    jax.jit(lambda x: jnp.sin(x) @ x.T + 1)(jnp.ones((64, 64))).block_until_ready()
print("WARNED" if any("Error reading persistent compilation cache" in str(w.message) for w in caught) else "CLEAN")
"""


def test_a_cache_entry_that_fails_to_read_is_written_again(tmp_path):
    """An entry cut short (a full disk): the next run warns and compiles once, and its compile replaces the entry
    (JAX alone never writes over an existing one: every later run warned and compiled again)."""
    def run():
        done = subprocess.run([sys.executable, "-c", CACHE_PROGRAM, str(tmp_path / "cache")], env=_env(1),
                              cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
        return done.stdout.split()[-1]

    assert run() == "CLEAN"
    [entry] = (tmp_path / "cache").glob("jit__lambda-*-cache")
    whole = entry.read_bytes()
    entry.write_bytes(whole[:len(whole) // 3])
    assert run() == "WARNED"
    assert len(entry.read_bytes()) >= len(whole) * 0.9  # written again, whole
    assert run() == "CLEAN"
