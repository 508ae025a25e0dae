"""The tf.data pretraining pipeline: batch contract, multi-host file sharding, determinism, exact resume in a
fresh process, static vs dynamic masking, and per-host batches -> global jax.Arrays."""
from __future__ import annotations

import collections
import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from bertjax.data.data_config import PretrainingDataConfig
from bertjax.data.pipeline import (
    make_pretraining_dataset,
    restore_iterator,
    save_iterator,
)
from bertjax.data.tfrecord import ShardWriter, serialize_batch
from bertjax.data.tokenizers import WordPieceTokenizer

ROOT = Path(__file__).resolve().parents[1]
SEQ, PRED = 64, 10


@pytest.fixture(scope="module")
def setup(shared_data, tmp_path_factory):
    """Four small corpus files (consecutive WikiText-2 articles, original format) and the BERT vocab."""
    from bertjax.data.corpus import documents_from_files
    from bertjax.data.data_config import CorpusConfig

    raw = str(shared_data / "wikitext-2" / "wiki.valid.raw")
    docs = list(documents_from_files([raw], CorpusConfig(input=raw, corpus_format="wikitext")).as_numpy_iterator())
    root = tmp_path_factory.mktemp("corpus")
    files = []
    for i in range(4):
        path = root / f"part-{i}.txt"
        chosen = [[s.decode() for s in d["sentences"][:40]] for d in docs[3 * i:3 * i + 3]]
        path.write_text("\n\n".join("\n".join(d) for d in chosen) + "\n", encoding="utf-8")
        files.append(path)
    return {"files": files, "glob": str(root / "*.txt"),
            "vocab": str(shared_data / "bert" / "uncased_L-4_H-256_A-4" / "vocab.txt")}


def _config(setup, **overrides) -> PretrainingDataConfig:
    base = dict(input=(setup["glob"],), vocab=setup["vocab"], max_seq_length=SEQ,
                max_predictions_per_seq=PRED, doc_buffer_size=2, shuffle_buffer=50, seed=3)
    return PretrainingDataConfig(**{**base, **overrides})


def _take(ds, n) -> list[dict]:
    it = ds.as_numpy_iterator()
    return [next(it) for _ in range(n)]


def _same(a: list[dict], b: list[dict]) -> bool:
    return len(a) == len(b) and all(np.array_equal(x[k], y[k]) for x, y in zip(a, b) for k in x)


def test_batch_contract(setup):
    batch = _take(make_pretraining_dataset(_config(setup, whole_word_masking=True), 16), 1)[0]
    expected = {"input_ids": (np.int32, (16, SEQ)), "input_mask": (np.int32, (16, SEQ)),
                "segment_ids": (np.int32, (16, SEQ)), "masked_lm_positions": (np.int32, (16, PRED)),
                "masked_lm_ids": (np.int32, (16, PRED)), "masked_lm_weights": (np.float32, (16, PRED)),
                "next_sentence_labels": (np.int32, (16, 1))}
    assert {k: (v.dtype.type, v.shape) for k, v in batch.items()} == expected


def _instances_of(batches) -> list[bytes]:
    """Every instance's (masked) tokens, segments and NSP label, packed rows split at their packing ids."""
    out = []
    for b in batches:
        for r in range(len(b["input_ids"])):
            if "packing_ids" not in b:
                n = b["input_mask"][r].sum()
                out.append((b["input_ids"][r, :n].tobytes(), b["segment_ids"][r, :n].tobytes(),
                            int(b["next_sentence_labels"][r, 0])))
                continue
            for slot in np.flatnonzero(b["next_sentence_weights"][r]):
                where = b["packing_ids"][r] == slot + 1
                assert b["instance_cls_positions"][r, slot] == np.flatnonzero(where)[0]
                out.append((b["input_ids"][r, where].tobytes(), b["segment_ids"][r, where].tobytes(),
                            int(b["next_sentence_labels"][r, slot])))
    return sorted(out)


def test_packing_holds_the_same_instances_in_fewer_rows(setup):
    """Static masks: one epoch packed and unpacked hold the same masked instances; packed rows have the packed
    layout, fewer rows and less padding."""
    def epoch(**packing):
        config = _config(setup, masking="static", num_epochs=1, max_seq_length=128, max_predictions_per_seq=20,
                         doc_buffer_size=4, **packing)
        return list(make_pretraining_dataset(config, 16, drop_remainder=False).as_numpy_iterator())

    plain, packed = epoch(), epoch(packing=True, max_instances_per_row=3)
    shapes = {k: (v.dtype.type, v.shape[1:]) for k, v in packed[0].items()}
    assert shapes == {"input_ids": (np.int32, (128,)), "input_mask": (np.int32, (128,)),
                      "segment_ids": (np.int32, (128,)), "packing_ids": (np.int32, (128,)),
                      "position_ids": (np.int32, (128,)), "masked_lm_positions": (np.int32, (23,)),
                      "masked_lm_ids": (np.int32, (23,)), "masked_lm_weights": (np.float32, (23,)),
                      "next_sentence_labels": (np.int32, (3,)), "instance_cls_positions": (np.int32, (3,)),
                      "next_sentence_weights": (np.float32, (3,))}
    assert _instances_of(packed) == _instances_of(plain)
    rows = lambda batches: sum(len(b["input_ids"]) for b in batches)
    padding = lambda batches: 1 - sum(b["input_mask"].sum() for b in batches) / (128 * rows(batches))
    assert rows(packed) < rows(plain) and padding(packed) < padding(plain)


def _unmasked_segments_a(batches, vocab) -> list[np.ndarray]:
    out = []
    for b in batches:
        for i in range(len(b["input_ids"])):
            ids = b["input_ids"][i].copy()
            valid = b["masked_lm_weights"][i] > 0
            ids[b["masked_lm_positions"][i][valid]] = b["masked_lm_ids"][i][valid]
            first_sep = int(np.flatnonzero(ids == vocab.sep_id)[0])
            out.append(ids[1:first_sep].astype(np.int32))
    return out


def test_two_hosts_read_disjoint_files_that_cover_the_corpus(setup):
    """Each host's segments A are token spans of its own files only (files[i::2]), every file is used,
    and each host's stream is deterministic in (seed, process index)."""
    vocab = WordPieceTokenizer(setup["vocab"])
    file_tokens = [vocab.tokenize([" ".join(p.read_text(encoding="utf-8").split("\n"))]).flat_values.numpy()
                   .astype(np.int32).tobytes() for p in setup["files"]]
    used = collections.Counter()
    for host in range(2):
        stats = collections.Counter()
        config = _config(setup, num_epochs=1, shuffle_buffer=1000)
        batches = list(make_pretraining_dataset(config, 8, host, 2, stats=stats, drop_remainder=False)
                       .as_numpy_iterator())
        mine = [i for i in range(4) if i % 2 == host]
        for segment in _unmasked_segments_a(batches, vocab):
            # Sentences are tokenized separately but WordPiece never merges across whitespace, so a span
            # of sentences is a span of the file's tokens.
            homes = [i for i in range(4) if _contains(file_tokens[i], segment)]
            assert homes and set(homes) <= set(mine), f"host {host} produced a segment from files {homes}"
            if len(homes) == 1:
                used[homes[0]] += 1
        assert stats["documents_read"] == 6  # 3 documents per file, 2 files per host
        again = _take(make_pretraining_dataset(config, 8, host, 2), 3)
        assert _same(batches[:3], again)
    assert sorted(used) == [0, 1, 2, 3]


def _contains(haystack: bytes, needle: np.ndarray) -> bool:
    start = haystack.find(needle.tobytes())
    while start != -1 and start % 4:
        start = haystack.find(needle.tobytes(), start + 1)
    return start != -1


def test_tfrecord_input_is_sharded_by_file(tmp_path):
    """4 shards whose examples carry their own ids: 2 hosts see disjoint halves that cover them all."""
    n = 40
    with ShardWriter(str(tmp_path), 4) as writer:
        ids = np.arange(n)
        batch = {"input_ids": np.tile(ids[:, None], (1, SEQ)), "input_mask": np.ones((n, SEQ), np.int64),
                 "segment_ids": np.zeros((n, SEQ), np.int64), "masked_lm_positions": np.ones((n, PRED), np.int64),
                 "masked_lm_ids": np.ones((n, PRED), np.int64), "masked_lm_weights": np.ones((n, PRED), np.float32),
                 "next_sentence_labels": np.zeros((n, 1), np.int64)}
        writer.write(serialize_batch(batch).numpy())  # round-robin: shard k holds ids = k mod 4
    seen = []
    for host in range(2):
        config = PretrainingDataConfig(input=(str(tmp_path / "*.tfrecord"),), input_kind="tfrecord",
                                       max_seq_length=SEQ, max_predictions_per_seq=PRED, num_epochs=1)
        got = np.concatenate([b["input_ids"][:, 0] for b in
                              make_pretraining_dataset(config, 4, host, 2, drop_remainder=False).as_numpy_iterator()])
        assert set(got % 4) == {host, host + 2} and len(got) == n // 2
        seen.append(set(got.tolist()))
    assert not seen[0] & seen[1] and seen[0] | seen[1] == set(range(n))


def test_static_masks_repeat_every_dupe_factor_epochs_dynamic_never(setup):
    def epochs(masking, count):
        config = _config(setup, masking=masking, dupe_factor=2, shuffle_buffer=1, num_epochs=count)
        return [row for b in make_pretraining_dataset(config, 64, drop_remainder=False).as_numpy_iterator()
                for row in b["input_ids"]]

    static = np.stack(epochs("static", 3))
    # Epoch 2 replays copy 0 (same instances, masks and order); epoch 1 is a different copy.
    period = [k for k in range(1, len(static) // 2) if np.array_equal(static[:k], static[len(static) - k:])]
    assert period and period[-1] > 100
    one = period[-1]
    assert not np.array_equal(static[:one], static[one:2 * one])
    dynamic = epochs("dynamic", 2)
    assert len({row.tobytes() for row in dynamic}) > 0.99 * len(dynamic)  # no (instance, mask) seen twice


RESUME_SCRIPT = """
import json, sys
import numpy as np
from bertjax.data.data_config import PretrainingDataConfig
from bertjax.data.pipeline import make_pretraining_dataset, restore_iterator
spec = json.loads(sys.argv[1])
for case in spec:
    config = PretrainingDataConfig(**case["config"])
    it = iter(make_pretraining_dataset(config, case["batch"], case["process_index"], case["process_count"]))
    restore_iterator(it, case["checkpoint"])
    batches = [next(it) for _ in range(case["after"])]
    np.savez(case["out"], **{f"{i}/{k}": v.numpy() for i, b in enumerate(batches) for k, v in b.items()})
"""


def test_resume_in_a_fresh_process_gives_the_same_batches(setup, tmp_path):
    """10 batches, save, restore in a new process: the next 5 equal those of an uninterrupted run
    (text input with dynamic whole-word masking on host 1 of 2, static masking on one host, packed rows)."""
    cases = [
        dict(config=_config(setup, whole_word_masking=True), batch=16, process_index=1, process_count=2),
        dict(config=_config(setup, masking="static", dupe_factor=2, doc_buffer_size=3), batch=8,
             process_index=0, process_count=1),
        dict(config=_config(setup, packing=True, max_instances_per_row=3), batch=4, process_index=1,
             process_count=2),
    ]
    expected = []
    for n, case in enumerate(cases):
        it = iter(make_pretraining_dataset(case["config"], case["batch"], case["process_index"],
                                           case["process_count"]))
        for _ in range(10):
            next(it)
        case["checkpoint"] = save_iterator(it, str(tmp_path / f"ckpt{n}" / "it"))
        expected.append([{k: v.numpy() for k, v in next(it).items()} for _ in range(5)])
        case.update(config=dataclasses.asdict(case["config"]), after=5, out=str(tmp_path / f"out{n}.npz"))
    assert_fresh_process_resumes(cases, expected)


def assert_fresh_process_resumes(cases: list[dict], expected: list[list[dict]]) -> None:
    """Restores each case's iterator checkpoint in a new process (RESUME_SCRIPT) and checks its next batches
    against `expected`, those of the uninterrupted run."""
    subprocess.run([sys.executable, "-c", RESUME_SCRIPT, json.dumps(cases)], check=True, cwd=ROOT,
                   env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"})
    for case, want in zip(cases, expected):
        got = np.load(case["out"])
        for i, batch in enumerate(want):
            for k, v in batch.items():
                np.testing.assert_array_equal(got[f"{i}/{k}"], v, err_msg=f"{case['config']['input']} batch {i} {k}")


def test_endless_pipeline_over_empty_input_is_refused(setup, tmp_path):
    (tmp_path / "a.txt").write_bytes(b"")
    (tmp_path / "b.txt").write_bytes(b"")
    with pytest.raises(ValueError, match="all 1 input file.*of process 1 are empty"):
        make_pretraining_dataset(_config(setup, input=(str(tmp_path / "*.txt"),)), 8, 1, 2)


def test_restore_into_a_different_pipeline_fails_loudly(setup, tmp_path):
    it = iter(make_pretraining_dataset(_config(setup), 8))
    next(it)
    path = save_iterator(it, str(tmp_path / "it"))
    other = iter(make_pretraining_dataset(PretrainingDataConfig(
        input=(setup["glob"],), vocab=setup["vocab"], max_seq_length=SEQ, max_predictions_per_seq=PRED,
        input_kind="text", masking="static"), 8))
    with pytest.raises(ValueError, match="differs from the one that saved it"):
        restore_iterator(other, path)
    with pytest.raises(FileNotFoundError, match="no input pipeline checkpoint"):
        restore_iterator(other, str(tmp_path / "missing"))


def test_global_batch_from_host_batch(setup):
    jax = pytest.importorskip("jax")
    from bertjax import sharding

    batch = _take(make_pretraining_dataset(_config(setup), 16), 1)[0]
    mesh = sharding.make_mesh(data=4, fsdp=2, devices=jax.devices()[:8])
    arrays = sharding.global_batch(batch, mesh)
    assert set(arrays) == set(batch)
    for name, value in batch.items():
        assert arrays[name].shape == value.shape and arrays[name].dtype == value.dtype
        np.testing.assert_array_equal(np.asarray(arrays[name]), value)
        assert len(arrays[name].addressable_shards) == 8
        assert arrays[name].addressable_shards[0].data.shape[0] == 2  # 16 rows over 8 devices


MULTIPROCESS_SCRIPT = """
import json, os, sys
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
import numpy as np
import jax
from jax.experimental import multihost_utils
port, pid, config_json, out = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
jax.distributed.initialize(coordinator_address=f"localhost:{port}", num_processes=2, process_id=pid)
from bertjax import sharding
from bertjax.data.data_config import PretrainingDataConfig
from bertjax.data.pipeline import make_pretraining_dataset
config = PretrainingDataConfig(**json.loads(config_json))
batch = next(make_pretraining_dataset(config, 16, jax.process_index(), jax.process_count()).as_numpy_iterator())
arrays = sharding.global_batch(batch, sharding.make_mesh())
gathered = {k: multihost_utils.process_allgather(v, tiled=True) for k, v in arrays.items()}
np.savez(out, **{"local/" + k: v for k, v in batch.items()}, **{"global/" + k: v for k, v in gathered.items()},
         shape=np.array(arrays["input_ids"].shape), devices=np.array(len(jax.devices())))
jax.distributed.shutdown()
"""


@pytest.mark.slow
@pytest.mark.parametrize("packing", [False, True])
def test_two_jax_processes_assemble_the_global_batch(setup, tmp_path, packing):
    """Two real JAX processes (jax.distributed on CPU, 2 devices each): each feeds its own host batch and
    the global array is the two host batches stacked in process order."""
    import socket

    with socket.socket() as s:
        s.bind(("localhost", 0))
        port = s.getsockname()[1]
    config = json.dumps(dataclasses.asdict(_config(setup, packing=packing)))
    procs = [subprocess.Popen([sys.executable, "-c", MULTIPROCESS_SCRIPT, str(port), str(i), config,
                               str(tmp_path / f"p{i}.npz")], cwd=ROOT,
                              env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3", "XLA_FLAGS": ""}) for i in range(2)]
    assert [p.wait(timeout=300) for p in procs] == [0, 0]
    results = [np.load(tmp_path / f"p{i}.npz") for i in range(2)]
    assert int(results[0]["devices"]) == 4 and tuple(results[0]["shape"]) == (16, SEQ)
    names = ["input_ids", "masked_lm_positions", "masked_lm_weights", "next_sentence_labels"]
    for name in names + (["packing_ids", "position_ids", "instance_cls_positions"] if packing else []):
        expected = np.concatenate([results[0][f"local/{name}"], results[1][f"local/{name}"]])
        assert results[0][f"local/{name}"].shape[0] == 8
        for r in results:
            np.testing.assert_array_equal(r[f"global/{name}"], expected)
    assert not np.array_equal(results[0]["local/input_ids"], results[1]["local/input_ids"])
