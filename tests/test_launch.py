"""`bertjax launch tpu|gke --dry-run`: the queued-resource request, built from google-cloud-tpu's own message types,
the gcloud commands and the xpk command, against golden files written by hand from the documented gcloud and xpk
syntax. No network."""
import pathlib

import pytest

from bertjax.cli import main as bertjax_main

GOLDEN = pathlib.Path(__file__).parent / "golden"
pytest.importorskip("google.cloud.tpu_v2alpha1", reason="launch tpu needs google-cloud-tpu (the test extras)")


@pytest.mark.parametrize("golden, args", [
    ("launch_tpu_spot_v5litepod16.txt",
     ["--name", "bert-p1", "--tpu-type", "v5litepod-16", "--zone", "us-west4-a", "--project", "my-project", "--spot",
      "--dry-run", "--", "pretrain", "--config", "bert-base-phase1", "--workdir", "gs://my-bucket/bert-base",
      "--set", "data.vocab=gs://my-bucket/vocab.txt"]),
    ("launch_tpu_reserved_v4_32.txt",
     ["--name", "bert-v4", "--tpu-type", "v4-32", "--zone", "us-central2-b", "--project", "team-tpus", "--reserved",
      "--wheel", "dist/bertjax-0.1.0-py3-none-any.whl", "--dry-run", "--", "pretrain", "--config", "bert-tiny",
      "--workdir", "gs://team-bucket/tiny"]),
])
def test_dry_run_matches_the_golden_file(golden, args, capsys):
    assert bertjax_main(["launch", "tpu", *args]) == 0
    assert capsys.readouterr().out == (GOLDEN / golden).read_text()


def test_gke_dry_run_matches_the_golden_xpk_command(capsys):
    assert bertjax_main(["launch", "gke", "--cluster", "tpu-cluster", "--name", "bert-ms", "--tpu-type",
                         "v5litepod-16", "--num-slices", "2", "--zone", "us-west4-a", "--project", "my-project",
                         "--dry-run", "--", "pretrain", "--config", "bert-base-phase1", "--workdir",
                         "gs://my-bucket/bert-ms"]) == 0
    assert capsys.readouterr().out == (GOLDEN / "launch_gke_v5litepod16_2slices.txt").read_text()


def test_the_request_is_a_real_queued_resource_message():
    from google.cloud import tpu_v2alpha1 as tpu

    from bertjax.cloud.tpu import SliceSpec, queued_resource_request

    request = queued_resource_request(SliceSpec("n", "v6e-16", "us-east5-b", "p", "spot"))
    assert isinstance(request, tpu.CreateQueuedResourceRequest)
    node_spec = request.queued_resource.tpu.node_spec[0]
    assert (node_spec.node_id, node_spec.node.accelerator_type, node_spec.node.runtime_version) == \
        ("n", "v6e-16", "v2-alpha-tpuv6e")
    assert "spot" in request.queued_resource and "guaranteed" not in request.queued_resource
    # Round trip through the wire format the API takes.
    assert tpu.CreateQueuedResourceRequest.deserialize(tpu.CreateQueuedResourceRequest.serialize(request)) == request


@pytest.mark.parametrize("args, message", [
    (["--tpu-type", "v5e:4x4"], "give the gcloud accelerator type ('v5litepod-16')"),
    (["--tpu-type", "v5litepod-16", "--", "pretrain", "--config", "bert-tiny"], "with its --workdir"),
])
def test_bad_requests_are_clear_errors(args, message, capsys):
    base = ["launch", "tpu", "--name", "n", "--zone", "z", "--project", "p", "--dry-run"]
    command = args if "--" in args else [*args, "--", "pretrain", "--workdir", "gs://b/w"]
    assert bertjax_main(base + command) == 2
    assert message in capsys.readouterr().err


def test_launch_local_needs_the_command_and_the_workdir_to_babysit(capsys):
    with pytest.raises(SystemExit) as exit_info:
        bertjax_main(["launch", "local", "--processes", "2"])
    assert exit_info.value.code == 2 and "give the bertjax command after --" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        bertjax_main(["launch", "local", "--max-restarts", "2", "--", "pretrain", "--config", "bert-tiny"])
    assert exit_info.value.code == 2 and "needs the command's --workdir" in capsys.readouterr().err
