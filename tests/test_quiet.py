"""The quiet console: commands write no native start-up lines (TensorFlow's, CUDA's), and holding those back never
holds back anything else (a worker's real error reaches the terminal)."""
import json
import subprocess
import sys

from tests import stall_watch
from tests.conftest import REPO_ROOT
from tests.test_pretrain import NATIVE_LOG_LINE


def test_eval_squad_writes_the_official_numbers_and_no_native_line(shared_data, tmp_path):
    """`eval squad` scores JSON against JSON: no TensorFlow starts, so none of its lines reach the terminal. Every
    question answered with "": the 6 unanswerable ones of the sample are right, the 8 answerable ones wrong."""
    data = shared_data / "squad" / "sample-dev-v2.0.json"
    questions = [qa for article in json.loads(data.read_text())["data"] for paragraph in article["paragraphs"]
                 for qa in paragraph["qas"]]
    unanswerable = sum(bool(qa.get("is_impossible")) for qa in questions)
    predictions = tmp_path / "predictions.json"
    predictions.write_text(json.dumps({qa["id"]: "" for qa in questions}))
    result = stall_watch.run([sys.executable, "-m", "bertjax.cli", "eval", "squad", "--data", str(data),
                             "--predictions", str(predictions)], cwd=REPO_ROOT)
    assert result.returncode == 0, result.stderr
    assert result.stderr == "", result.stderr
    scores = json.loads(result.stdout)
    assert (scores["total"], scores["NoAns_total"]) == (len(questions), unanswerable) == (14, 6)
    assert scores["exact"] == scores["f1"] == 100 * unanswerable / len(questions)
    assert (scores["HasAns_exact"], scores["NoAns_exact"]) == (0.0, 100.0)


def test_dropped_start_up_lines_leave_a_childs_other_lines_as_they_come():
    """A child started inside `native_lines_dropped` (as Beam's local workers are) writes TensorFlow's start-up
    lines and a real error to its inherited stderr: the error arrives, in order with the parent's own lines."""
    child = ("import sys; sys.stderr.write('WARNING: All log messages before absl::InitializeLog() is called are "
             "written to STDERR\\nI0000 00:00:1795639609.634380    6707 cudart_stub.cc:31] Could not find cuda "
             "drivers on your machine, GPU will not be used.\\nE0000 00:00:1795639618.977835    6644 "
             "cuda_platform.cc:52] failed call to cuInit: INTERNAL: CUDA error: Failed call to cuInit: UNKNOWN ERROR "
             "(303)\\nValueError: the worker own error\\n')")
    parent = ("import subprocess, sys\nfrom bertjax.runtime import quiet\n"
              "with quiet.native_lines_dropped():\n"
              "    print('parent before', file=sys.stderr)\n"
              f"    subprocess.run([sys.executable, '-c', {child!r}], check=True)\n"
              "    print('parent after', file=sys.stderr)\n"
              "print('parent outside', file=sys.stderr)\n")
    result = stall_watch.run([sys.executable, "-c", parent], cwd=REPO_ROOT)
    assert result.returncode == 0, result.stderr
    assert result.stderr.splitlines() == ["parent before", "ValueError: the worker own error", "parent after",
                                          "parent outside"]
    shown = stall_watch.run([sys.executable, "-c", parent.replace("native_lines_dropped()",
                                                                  "native_lines_dropped(verbose=True)")],
                            cwd=REPO_ROOT)
    assert len([line for line in shown.stderr.splitlines() if NATIVE_LOG_LINE.search(line)]) == 3, shown.stderr


def test_gloos_lines_are_dropped_also_when_two_land_in_one_another():
    from bertjax.runtime.quiet import START_UP_LINE

    lines = [b"[Gloo] Rank 0 is connected to 1 peer ranks. Expected number of connected peer ranks is : 1",
             b"[Gloo] Rank 1[Gloo] Rank 1 is connected to 1 peer ranks. Expected number of connected peer ranks is : 1",
             b" is connected to 1 peer ranks. Expected number of connected peer ranks is : 1", b"[Gloo] Rank 1",
             b"[Gloo] Rank [Gloo] Rank 1 is connected to 1 peer ranks. Expected number of connected peer ranks is : 1",
             b"1 is connected to 1 peer ranks. Expected number of connected peer ranks is : 1"]
    assert all(START_UP_LINE.search(line) for line in lines)
    assert not START_UP_LINE.search(b"step 1/20 loss=10.3 [Gloo] Rank 1 is connected")
    assert not START_UP_LINE.search(b"Traceback (most recent call last):")
