"""`make test`'s workers of different device counts: which file goes where (tests/device_schedule.py), and that a
worker's count reaches JAX."""
import os
import re
import shlex
import subprocess
import sys

from tests.conftest import REPO_ROOT, host_devices, suite_xla_flags, xla_flags
from tests.device_schedule import FILE_DEVICES, devices_needed, next_file

PINNED, ALSO_PINNED, FREE, ALSO_FREE = ("tests/test_pretrain.py", "tests/test_train_step.py",
                                        "tests/test_tpu_compile.py", "tests/test_glue_job.py")


def test_files_need_what_the_list_says():
    assert devices_needed("tests/test_pretrain.py::test_two_processes_match_one_process") == 8
    assert devices_needed("tests/test_dropout_attention.py::test_x[1]") == 4
    assert devices_needed("tests/test_glue_job.py::test_x") == 1
    assert all((REPO_ROOT / "tests" / name).is_file() for name in FILE_DEVICES)


def test_the_many_device_worker_takes_only_the_files_only_it_can_run_while_a_one_device_worker_is_live():
    assert next_file([FREE, PINNED, ALSO_FREE, ALSO_PINNED], devices=8, fewest=1, most=8) == PINNED
    assert next_file([FREE, ALSO_FREE], devices=8, fewest=1, most=8) is None
    # Once the 1-device workers are gone, the queue's order alone.
    assert next_file([FREE, PINNED], devices=8, fewest=8, most=8) == FREE


def test_the_one_device_worker_takes_the_rest_and_nothing_when_only_pinned_files_are_left():
    assert next_file([PINNED, FREE, ALSO_PINNED, ALSO_FREE], devices=1, fewest=1, most=8) == FREE
    assert next_file([PINNED, ALSO_PINNED], devices=1, fewest=1, most=8) is None
    assert next_file([], devices=8, fewest=1, most=8) is None
    # Workers of 1, 4 and 8 devices: the 4-device one runs the 4-device file, not the 8-device ones.
    assert next_file([PINNED, "tests/test_dropout_attention.py", FREE], devices=4, fewest=1, most=8) == \
        "tests/test_dropout_attention.py"


def test_a_file_no_worker_can_run_goes_to_whoever_asks():
    """To fail there (conftest's pytest_runtest_setup) rather than be left in the queue."""
    assert next_file([PINNED], devices=1, fewest=1, most=1) == PINNED


def test_a_workers_own_count_wins_over_the_flags_it_inherits():
    inherited = {"XLA_FLAGS": xla_flags(8)}
    assert host_devices(suite_xla_flags({**inherited, "BERTJAX_TEST_DEVICES": "1"})) == 1
    assert host_devices(suite_xla_flags(inherited)) == 8
    assert host_devices(suite_xla_flags({"XLA_FLAGS": "--xla_dump_to=/tmp/x"})) == 1  # the user's flags as given
    assert host_devices(suite_xla_flags({})) == 8


def make_test_workers() -> list[str]:
    """The Makefile's TEST_WORKERS (pytest-xdist's --tx arguments), continuation lines joined."""
    makefile = (REPO_ROOT / "Makefile").read_text(encoding="utf-8").replace("\\\n", " ")
    [value] = re.findall(r"^TEST_WORKERS \?= (.*)$", makefile, re.MULTILINE)
    return shlex.split(value)


def test_make_tests_workers_run_each_file_where_it_can_and_end():
    """Workers as `make test` starts them (8, 1 and 1 devices): the pinned files run on the 8-device worker (on the
    others, conftest would fail them), the free file on a 1-device one, a worker's count is what JAX sees there,
    and a 1-device worker with only pinned files left for it is shut down instead of waiting for work."""
    # Three tests of one pinned file keep the 8-device worker busy (xdist tops a worker up below 3 pending tests)
    # while the others, done with their tests, find only the second pinned file in the queue.
    pinned = ["tests/test_dropout.py::test_threshold_rounds_the_keep_probability_to_sixteen_bits",
              "tests/test_dropout.py::test_same_key_same_mask_other_key_other_mask",
              "tests/test_dropout.py::test_dropout_is_unbiased_and_zeroes_the_dropped",
              "tests/test_dropout_attention.py::test_rate_zero_is_attention_without_dropout"]
    free = "tests/test_device_schedule.py::test_jax_has_the_devices_of_its_flags"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "BERTJAX_TEST_DEVICES"))}
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider", "--dist", "loadfile",
         *make_test_workers(), free, *pinned],
        cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    ran_on = {test: worker for worker, test in
              re.findall(r"^\[(gw\d)\] \[ *\d+%\] PASSED (\S+) *$", result.stdout, re.MULTILINE)}
    assert {test: worker for test, worker in ran_on.items() if test in pinned} == dict.fromkeys(pinned, "gw0")
    assert ran_on[free] != "gw0" and len(ran_on) == len(pinned) + 1, result.stdout


def test_jax_has_the_devices_of_its_flags():
    import jax

    assert jax.device_count() == host_devices(os.environ["XLA_FLAGS"])
