"""`bertjax data create --runner beam`: Beam's DirectRunner (multi-processing, 2 workers) on real WikiText-2 text
gives records that pass the local path's checks (the original format, 15% / 80-10-10 masks, NSP 50% on the
coin-flipped instances, layout), the same multiset on 1 and 2 workers and across runs, metadata that the
pretraining reader follows, and no shard under a final name from a killed job."""
from __future__ import annotations

import collections
import hashlib
import io
import json
import os
import runpy
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf

pytest.importorskip("apache_beam")

from bertjax.cli import main as bertjax_main  # noqa: E402
from bertjax.data import beam_create  # noqa: E402
from bertjax.data.data_config import PretrainingDataConfig  # noqa: E402
from bertjax.data.pipeline import make_pretraining_dataset  # noqa: E402
from bertjax.data.tfrecord import find_shards  # noqa: E402
from bertjax.data.tokenizers import load_tokenizer  # noqa: E402
from bertjax.runtime.errors import OutputWriteError  # noqa: E402
from bertjax.runtime.workdir_lock import WorkdirBusy, WorkdirLock  # noqa: E402
from tests.conftest import fill_disk  # noqa: E402
from tests.record_checks import check_nsp_balance, check_nsp_layout, check_static_masks  # noqa: E402
from tests.test_data_tfrecord import ORIGINAL_SPEC, PRED, SEQ  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
MULTI_PROCESSING = ["direct_running_mode=multi_processing", "direct_num_workers=2"]
FLAGS = ["--format", "wikitext", "--max-seq-length", str(SEQ), "--max-predictions", str(PRED), "--dupe-factor", "2",
         "--doc-buffer", "4"]


@pytest.fixture(scope="module")
def corpus(shared_data, tmp_path_factory) -> tuple[str, str]:
    """Three files of real WikiText-2 text (a few articles each), so that both workers read; the third has two
    lines with invalid UTF-8 (counted, not fatal)."""
    directory = tmp_path_factory.mktemp("beam-corpus")
    valid = (shared_data / "wikitext-2" / "wiki.valid.raw").read_text(encoding="utf-8").splitlines(keepends=True)
    test = (shared_data / "wikitext-2" / "wiki.test.raw").read_text(encoding="utf-8").splitlines(keepends=True)
    for name, lines in (("a", valid[:300]), ("b", valid[300:600])):
        (directory / f"wiki-{name}.txt").write_text("".join(lines), encoding="utf-8")
    bad = [b" The caf\xe9 opened in 1921 and closed in 1950 . \n", b" Its sign read \xff\xfe in gold letters . \n"]
    encoded = [line.encode("utf-8") for line in test[:300]]
    (directory / "wiki-c.txt").write_bytes(b"".join(encoded[:20] + bad + encoded[20:]))
    return str(directory / "wiki-*.txt"), str(shared_data / "bert" / "uncased_L-4_H-256_A-4" / "vocab.txt")


def _config(corpus, **changes) -> PretrainingDataConfig:
    pattern, vocab = corpus
    return PretrainingDataConfig(input=pattern, vocab=vocab, corpus_format="wikitext", max_seq_length=SEQ,
                                 max_predictions_per_seq=PRED, dupe_factor=2, doc_buffer_size=4, masking="static",
                                 **changes)


@pytest.fixture(scope="module")
def two_workers_run(corpus, tmp_path_factory):
    """DirectRunner, multi-processing, 2 workers; the summary carries the runner's committed counters. Also what
    reached stderr (file descriptor 2, which the worker processes inherit) while it ran."""
    out = tmp_path_factory.mktemp("beam-2")
    # This process's own first device query (cuInit's line) comes before, as the CLI's quiet start makes it.
    tf.config.list_logical_devices()
    with tempfile.TemporaryFile() as stderr:
        # As in a terminal: sys.stderr writes to file descriptor 2 (pytest's capture replaces it otherwise).
        captured_stderr, sys.stderr = sys.stderr, io.TextIOWrapper(io.FileIO(2, "w", closefd=False),
                                                                   line_buffering=True)
        terminal = os.dup(2)
        os.dup2(stderr.fileno(), 2)
        try:
            summary = beam_create.create_with_beam(_config(corpus), str(out), 3, beam_options=MULTI_PROCESSING)
        finally:
            sys.stderr.flush()
            os.dup2(terminal, 2)
            os.close(terminal)
            sys.stderr = captured_stderr
        stderr.seek(0)
        return out, summary, stderr.read().decode(errors="replace")


@pytest.fixture(scope="module")
def two_workers(two_workers_run):
    return two_workers_run[:2]


def test_beam_workers_write_no_native_start_up_lines(two_workers_run):
    """The 2 worker processes each import TensorFlow, whose start-up lines (and Beam's echo of its options) they
    would write to the terminal: none reaches it."""
    from tests.test_pretrain import NATIVE_LOG_LINE

    stderr = two_workers_run[2]
    assert not [line for line in stderr.splitlines() if NATIVE_LOG_LINE.search(line)], stderr[:3000]
    assert "semi_persistent_directory" not in stderr and "unparseable args" not in stderr, stderr[:3000]


def _records(out: Path) -> list[bytes]:
    return [r.numpy() for r in tf.data.TFRecordDataset(sorted(str(p) for p in out.glob("*.tfrecord")))]


def _multiset(out: Path) -> collections.Counter:
    return collections.Counter(_records(out))


def test_records_pass_the_original_formats_checks(two_workers, corpus):
    out, summary = two_workers
    records = _records(out)
    assert len(records) == summary["examples"] > 1500
    for raw in records[:20]:  # Python protobuf: independent of the in-graph encoder
        features = tf.train.Example.FromString(raw).features.feature
        assert {k: len(getattr(f, f.WhichOneof("kind")).value) for k, f in features.items()} == \
            {k: spec.shape[0] for k, spec in ORIGINAL_SPEC.items()}
    parsed = tf.io.parse_example(records, ORIGINAL_SPEC)
    m = {k: v.numpy().astype(np.float32 if k == "masked_lm_weights" else np.int64) for k, v in parsed.items()}
    # Undo the masking: the instances as made, before masks.
    original = {k: m[k].copy() for k in ("input_ids", "input_mask", "segment_ids")}
    rows = np.repeat(np.arange(len(records)), PRED).reshape(-1, PRED)
    valid = m["masked_lm_weights"] > 0
    original["input_ids"][rows[valid], m["masked_lm_positions"][valid]] = m["masked_lm_ids"][valid]

    tokenizer = load_tokenizer(corpus[1], None)
    check_nsp_layout(original, SEQ, tokenizer.cls_id, tokenizer.sep_id, tokenizer.pad_id)
    check_static_masks(original, m, PRED, tokenizer.special_ids, tokenizer.mask_id, rate_tolerance=0.01,
                       split_tolerance=0.015, rate_of="tokens")
    check_nsp_balance(m["next_sentence_labels"][:, 0], summary["stats"]["forced_random_next"], 0.04)


def test_same_multiset_on_one_and_two_workers(two_workers, corpus, tmp_path):
    """Two runs (2 worker processes, then 1 in-memory worker through the CLI) give the same multiset. Also the
    --overwrite path: the second run replaces a copy of the first one's output, with 2 shards instead of 3."""
    out, _ = two_workers
    reference = _multiset(out)
    one = tmp_path / "one"
    shutil.copytree(out, one)
    (one / "beam-temp-killed").mkdir()  # what a killed run leaves: --overwrite removes it too
    (one / "beam-temp-killed" / "documents-000000-0.bin").write_bytes(b"x")
    pattern, vocab = corpus
    assert bertjax_main(["data", "create", "--runner", "beam", "--input", pattern, "--vocab", vocab, "--out",
                         str(one), "--shards", "2", "--overwrite", *FLAGS]) == 0
    assert sorted(os.listdir(one)) == ["pretrain-00000-of-00002.tfrecord", "pretrain-00001-of-00002.tfrecord",
                                       "pretrain-metadata.json"]
    assert _multiset(one) == reference


@pytest.mark.slow
def test_same_multiset_on_threads_on_a_second_run_and_not_for_another_seed(two_workers, corpus, tmp_path):
    out, _ = two_workers
    reference = _multiset(out)
    again = tmp_path / "again"
    beam_create.create_with_beam(_config(corpus), str(again), 4, beam_options=MULTI_PROCESSING)
    assert _multiset(again) == reference
    threads = tmp_path / "threads"
    beam_create.create_with_beam(_config(corpus), str(threads), 3, beam_options=[
        "direct_running_mode=multi_threading", "direct_num_workers=2"])
    assert _multiset(threads) == reference
    # The multiset is a function of the seed, not a constant of the input.
    other = tmp_path / "other"
    beam_create.create_with_beam(_config(corpus, seed=7), str(other), 1)
    assert not set(_multiset(other)) & set(reference)


def test_metadata_counters_and_the_pretraining_reader(two_workers, corpus):
    out, summary = two_workers
    assert sorted(os.listdir(out)) == ["pretrain-00000-of-00003.tfrecord", "pretrain-00001-of-00003.tfrecord",
                                       "pretrain-00002-of-00003.tfrecord", "pretrain-metadata.json"]
    meta = json.loads((out / "pretrain-metadata.json").read_text())
    per_shard = [sum(1 for _ in tf.data.TFRecordDataset(str(out / n))) for n in meta["shards"]]
    assert meta["examples_per_shard"] == per_shard and sum(per_shard) == meta["examples"] == meta["stats"]["instances"]
    assert meta["bytes_per_shard"] == [(out / n).stat().st_size for n in meta["shards"]]
    stats, metrics = meta["stats"], summary["beam_metrics"]
    assert stats["invalid_utf8_lines"] == 2 and stats["truncated_lines"] == 0 and metrics["invalid_utf8_lines"] == 2
    assert stats["input_files"] == 3 and stats["document_passes"] == 2 * (stats["documents_read"] -
                                                                          stats["empty_documents"])
    # Each corpus file's size and SHA-256, hashed by the worker that read it (a model card lists them).
    files = sorted(str(p) for p in Path(corpus[0]).parent.glob("wiki-*.txt"))
    assert meta["corpus_files"] == {
        f: f"{os.path.getsize(f)} bytes, sha256 {hashlib.sha256(Path(f).read_bytes()).hexdigest()[:16]}" for f in files}
    # Buckets of more than --doc-buffer documents (chunks of 1 document here), fewer than 2 * (4 + 1) + 1.
    low, high = meta["documents_per_bucket"]
    assert 4 < low <= high < 11 and stats["buckets"] == meta["buckets"] > 1
    # The same counters as Beam metrics (the runner's, summed over workers).
    assert {k: metrics.get(k, 0) for k in ("documents_read", "instances", "buckets", "forced_random_next")} == \
        {k: stats[k] for k in ("documents_read", "instances", "buckets", "forced_random_next")}

    assert find_shards([str(out)]) == [str(out / n) for n in meta["shards"]]
    config = PretrainingDataConfig(input=(str(out),), input_kind="tfrecord", max_seq_length=SEQ,
                                   max_predictions_per_seq=PRED, num_epochs=1, shuffle_buffer=64)
    batches = list(make_pretraining_dataset(config, 64, drop_remainder=False).as_numpy_iterator())
    assert sum(len(b["input_ids"]) for b in batches) == meta["examples"]


def test_bucket_assignment_is_a_seeded_balanced_permutation():
    for n in (1, 2, 3, 17, 64, 1000):
        assert sorted(beam_create.permute_index(i, n, 5) for i in range(n)) == list(range(n))
    perm = [beam_create.permute_index(i, 1000, 5) for i in range(1000)]
    assert perm != [beam_create.permute_index(i, 1000, 6) for i in range(1000)]
    assert abs(np.corrcoef(np.arange(1000), perm)[0, 1]) < 0.15  # neighbours do not stay together
    # Two files in chunks of at most 6 documents (each file's last chunk shorter), doc buffer 100.
    chunks = [(f, i, 6 if i < count // 6 else count % 6) for f, count in ((0, 500), (2, 523))
              for i in range(-(-count // 6))]
    plan = beam_create.plan_buckets(chunks, 100, 1)
    assert plan["documents"] == 1023 and plan["buckets"] == 1023 // 106 == 9
    members = sorted(i for m in plan["members"] for i in m)
    assert members == list(range(len(chunks)))  # every chunk in exactly one bucket
    sizes = [sum(chunks[i][2] for i in m) for m in plan["members"]]
    assert plan["documents_per_bucket"] == [min(sizes), max(sizes)] and min(sizes) > 100 and max(sizes) < 2 * 106 + 6
    files = [{chunks[i][0] for i in m} for m in plan["members"]]
    assert all(f == {0, 2} for f in files)  # a bucket draws from all over the corpus
    assert plan != beam_create.plan_buckets(chunks, 100, 2)
    assert beam_create.plan_buckets([(0, 0, 3)], 100, 1)["members"] == [[0]]  # a small corpus: one bucket with all
    # Every shard gets a bucket's records, with fewer or more buckets than shards.
    for buckets, shards in ((1, 3), (2, 3), (3, 3), (9, 4), (100, 7)):
        covered = [list(beam_create.bucket_shards(b, buckets, shards)) for b in range(buckets)]
        assert sorted(s for c in covered for s in c) == list(range(shards)) if buckets <= shards else \
            sorted({s for c in covered for s in c}) == list(range(shards))
        assert all(len(c) == 1 for c in covered) or buckets < shards


def test_spilled_chunks_round_trip():
    documents = [(np.array([5, 6, 7, 8], np.int32), np.array([3, 1], np.int32)),
                 (np.array([9], np.int64), np.array([1], np.int64))]
    back = beam_create.decode_chunk(beam_create.encode_chunk(documents))
    assert [(list(i), list(s)) for i, s in back] == [([5, 6, 7, 8], [3, 1]), ([9], [1])]
    with pytest.raises(ValueError, match="does not hold 2 documents"):
        beam_create.decode_chunk(beam_create.encode_chunk(documents)[:-4])


def test_bad_arguments_are_clear_errors(corpus, tmp_path, capsys):
    pattern, vocab = corpus
    out = tmp_path / "out"
    base = ["data", "create", "--input", pattern, "--vocab", vocab, "--out", str(out), *FLAGS]
    for extra, message in ((["--runner", "beam", "--num-workers", "2"], "drop --worker-index/--num-workers"),
                           (["--beam-option", "direct_num_workers=2"], "need --runner beam"),
                           (["--runner", "beam", "--beam-option", "=2"], "expected KEY=VALUE")):
        assert bertjax_main([*base, *extra]) == 2
        assert message in capsys.readouterr().err
    assert not out.exists()


def test_an_earlier_run_is_refused(two_workers, corpus, tmp_path, capsys):
    out, _ = two_workers
    copy = tmp_path / "copy"
    shutil.copytree(out, copy)
    pattern, vocab = corpus
    assert bertjax_main(["data", "create", "--runner", "beam", "--input", pattern, "--vocab", vocab, "--out",
                         str(copy), *FLAGS]) == 2
    assert "already holds 4 file(s) of an earlier `data create` run" in capsys.readouterr().err
    assert sorted(os.listdir(copy)) == sorted(os.listdir(out))


def test_an_out_another_run_holds_is_refused_naming_it(corpus, tmp_path):
    """Beam's run holds OUT/LOCK like the local one (its launching process, while the pipeline runs): into an --out
    another live run holds it starts nothing and touches nothing."""
    out = tmp_path / "out"
    with WorkdirLock(str(out), command="bertjax data create --runner beam (the other run)", log=lambda _: None):
        with pytest.raises(WorkdirBusy, match=rf"{out} is in use by another job \(pid {os.getpid()} on .*: bertjax "
                                              r"data create --runner beam \(the other run\)\); .* another --out"):
            beam_create.create_with_beam(_config(corpus), str(out), 2)
        assert os.listdir(out) == ["LOCK"]


def test_a_full_disk_is_one_line_and_leaves_nothing(corpus, small_disk):
    """A disk that fills while the workers write (spills, fragments, shards): one line naming the --out and
    ENOSPC (the runner's error wraps the worker's, traceback and all), no beam-temp-* and no --out left."""
    out = small_disk / "out"
    fill_disk(small_disk / "filler", leave=300_000)
    with pytest.raises(OutputWriteError) as raised:
        beam_create.create_with_beam(_config(corpus), str(out), 3, log=lambda _: None)
    assert str(raised.value) == f"cannot write shards to {out}: no space left on device"
    assert sorted(os.listdir(small_disk)) == ["filler"]


@pytest.mark.slow
def test_killed_job_leaves_no_shard_and_a_rerun_completes(two_workers, corpus, tmp_path):
    """The job is killed (SIGKILL to the runner and its workers) while it writes: no file carries a shard name,
    readers find nothing; a rerun into the same --out completes with the reference multiset."""
    reference = _multiset(two_workers[0])
    pattern, vocab = corpus
    out = tmp_path / "out"
    command = [sys.executable, str(ROOT / "pipelines" / "beam_create.py"), "--input", pattern, "--vocab", vocab,
               "--out", str(out), "--shards", "3", *FLAGS,
               *[a for option in MULTI_PROCESSING for a in ("--beam-option", option)]]
    proc = subprocess.Popen(command, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.time() + 240
        # Beam's sink writes under out/beam-temp-*/ before it renames: kill as soon as a temporary shard exists.
        while time.time() < deadline and proc.poll() is None:
            if any(p.is_file() for p in out.glob("beam-temp-*/*")):
                break
            time.sleep(0.05)
        assert proc.poll() is None, "the job ended before it could be killed"
        os.killpg(proc.pid, signal.SIGKILL)
    finally:
        proc.wait(timeout=60)
    assert not list(out.glob("*.tfrecord")) and not (out / "pretrain-metadata.json").exists()
    stale = list(out.glob("beam-temp-*"))
    assert len(stale) == 1
    with pytest.raises(FileNotFoundError):
        find_shards([str(out)])
    wrapper = runpy.run_path(str(ROOT / "pipelines" / "beam_create.py"))
    assert wrapper["main"](["--input", pattern, "--vocab", vocab, "--out", str(out), "--shards", "3", *FLAGS,
                            *[a for option in MULTI_PROCESSING for a in ("--beam-option", option)]]) == 0
    assert _multiset(out) == reference
    assert list(out.glob("beam-temp-*")) == stale  # named, not removed without --overwrite


@pytest.mark.slow
def test_worker_memory_stays_flat_on_a_corpus_of_several_hundred_mb(shared_data, tmp_path):
    """WikiText-2 valid+test repeated (BERTJAX_BEAM_MEMORY_COPIES, default 125: ~300 MB, one file per copy, titles
    renamed per copy) on 2 worker processes: every worker's sampled RSS stays within 512 MiB of its peak on one
    copy. (The DirectRunner's own process holds the shuffle, as Dataflow's shuffle service would: not a worker.)"""
    bench = runpy.run_path(str(ROOT / "bench" / "beam_create.py"))
    copies = int(os.environ.get("BERTJAX_BEAM_MEMORY_COPIES", "125"))
    flags = ["--max-seq-length", "128", "--max-predictions", "20", "--dupe-factor", "1", "--shards", "8",
             "--doc-buffer", "100"]
    peaks = {}
    for scale in (1, copies):
        files = bench["write_corpus"](tmp_path / f"corpus-{scale}", scale)
        if scale == copies:
            assert sum(p.stat().st_size for p in files) > (200e6 if copies >= 100 else 0)
        result = bench["measure"](str(tmp_path / f"corpus-{scale}" / "*.txt"), tmp_path / f"out-{scale}", "beam", 2,
                                  flags)
        peaks[scale] = result["peak_rss_mib"]["worker"]
        for pattern in (f"corpus-{scale}",):
            shutil.rmtree(tmp_path / pattern)
    small, large = max(peaks[1]), max(peaks[copies])
    print(f"worker peak RSS MiB: 1x {peaks[1]}, {copies}x {peaks[copies]}")
    assert large <= small + 512, f"worker peak RSS {large} MiB at {copies}x vs {small} MiB at 1x"
