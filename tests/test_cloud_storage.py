"""gs:// on a local Cloud Storage (the session's fake-gcs-server, conftest.gcs_standin): every storage client the
project uses reads what the others wrote, retries a bucket's transient 503/429s, and the workdir lock is atomic
by object generation."""
import json
import socket
import threading
import time

import pytest

from bertjax.runtime import cloud_storage
from bertjax.runtime.workdir_lock import LOCK_NAME, STALE_AFTER_S, WorkdirBusy, WorkdirLock


def _tf_gfile():
    import tensorflow as tf

    return tf.io.gfile


def _tensorstore(url, context=None):
    import tensorstore as ts

    bucket, name = cloud_storage.split(url)
    spec = {"driver": "gcs", "bucket": bucket, "path": name + "/"}
    return ts.KvStore.open(spec, context=ts.Context(context or {})).result()


def test_each_storage_client_reads_what_the_others_wrote(gcs_dir):
    from etils import epath
    from google.cloud import storage

    gfile = _tf_gfile()
    bucket, prefix = cloud_storage.split(gcs_dir)
    blobs = storage.Client().bucket(bucket)
    blobs.blob(f"{prefix}/by_gcs.txt").upload_from_string(b"from google-cloud-storage")
    with gfile.GFile(f"{gcs_dir}/by_tf.txt", "wb") as f:  # TensorFlow's GCS file system (tf.data, TensorBoard)
        f.write(b"from tf.io.gfile")
    _tensorstore(gcs_dir).write("by_tensorstore.bin", b"from tensorstore").result()  # Orbax's arrays
    (epath.Path(gcs_dir) / "by_epath.txt").write_text("from etils.epath")  # Orbax's metadata, our JSON files

    expected = {"by_gcs.txt": b"from google-cloud-storage", "by_tf.txt": b"from tf.io.gfile",
                "by_tensorstore.bin": b"from tensorstore", "by_epath.txt": b"from etils.epath"}
    assert sorted(gfile.listdir(gcs_dir)) == sorted(expected)
    for name, data in expected.items():
        assert blobs.blob(f"{prefix}/{name}").download_as_bytes() == data
        assert gfile.GFile(f"{gcs_dir}/{name}", "rb").read() == data
        assert _tensorstore(gcs_dir).read(name).result().value == data
        assert (epath.Path(gcs_dir) / name).read_bytes() == data


@pytest.mark.parametrize("status", [503, 429])
def test_transient_errors_on_reads_and_writes_are_retried_by_every_client(gcs_standin, gcs_dir, status):
    """Each client's own retry settings shorten its back-off (defaults: 1 s, doubling, so ~20 s of sleep here):
    google-cloud-storage's Retry per call, tensorstore's gcs_request_retries context, TensorFlow's
    GCS_RETRY_CONFIG_* variables (tests/conftest.py: read when TensorFlow registers its GCS file system)."""
    from google.cloud import storage
    from google.cloud.storage.retry import DEFAULT_RETRY

    retry = DEFAULT_RETRY.with_delay(initial=0.01, maximum=0.05)
    gfile = _tf_gfile()
    bucket, prefix = cloud_storage.split(gcs_dir)
    front = gcs_standin.front

    def after_two_failures(method, operation):
        """Runs `operation` with its next two `method` requests failing with `status`; checks both were met."""
        front.inject(status, times=2, method=method, path=bucket)  # uploads name the object in the body
        result = operation()
        assert front.faults[-1]["times"] == 0, (method, front.requests[-5:])
        return result

    blob = storage.Client().bucket(bucket).blob(f"{prefix}/a.txt")
    after_two_failures("POST", lambda: blob.upload_from_string(b"a", if_generation_match=0, retry=retry))
    assert after_two_failures("GET", lambda: blob.download_as_bytes(retry=retry)) == b"a"

    def tf_write():
        with gfile.GFile(f"{gcs_dir}/b.txt", "wb") as f:
            f.write(b"b")

    after_two_failures("POST", tf_write)
    assert after_two_failures("GET", lambda: gfile.GFile(f"{gcs_dir}/b.txt", "rb").read()) == b"b"

    store = _tensorstore(gcs_dir, {"gcs_request_retries": {"initial_delay": "10ms", "max_delay": "50ms"}})
    after_two_failures("POST", lambda: store.write("c.bin", b"c").result())
    assert after_two_failures("GET", lambda: store.read("c.bin").result().value) == b"c"


def test_a_denied_request_is_told_in_one_line_naming_bucket_and_object(gcs_standin, gcs_dir):
    gcs_standin.front.inject(403, times=100, path=cloud_storage.split(gcs_dir)[0])
    with pytest.raises(cloud_storage.StorageDenied) as caught:
        WorkdirLock(gcs_dir, log=lambda m: None).acquire()
    bucket, name = cloud_storage.split(f"{gcs_dir}/{LOCK_NAME}")
    line = str(caught.value)
    assert "\n" not in line and line.startswith(f"{gcs_dir}/{LOCK_NAME}: permission denied writing object "
                                                f"'{name}' in bucket '{bucket}' (403)")


def _race(n, target):
    """Runs `target` in n threads released at once; what each returned or raised."""
    barrier, results = threading.Barrier(n), [None] * n

    def run(i):
        barrier.wait()
        try:
            results[i] = target()
        except Exception as error:  # noqa: BLE001 - the result under test
            results[i] = error

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    return results


def test_jobs_starting_at_once_on_one_gs_workdir_one_holds_it(gcs_dir):
    for attempt in range(3):
        workdir = f"{gcs_dir}/run{attempt}"
        locks = [WorkdirLock(workdir, command=f"job {i}", log=lambda m: None) for i in range(6)]
        results = _race(len(locks), lambda: locks.pop().acquire() or "held")
        assert results.count("held") == 1, results
        assert all(isinstance(r, WorkdirBusy) for r in results if r != "held"), results


def test_a_dead_holders_gs_lock_is_taken_over_by_exactly_one(gcs_dir):
    from google.cloud import storage

    bucket, name = cloud_storage.split(f"{gcs_dir}/{LOCK_NAME}")
    old = time.time() - 10 * STALE_AFTER_S
    dead = {"host": "a-deleted-slice", "pid": 1, "token": "dead", "started": old, "heartbeat": old, "command": "x"}
    for attempt in range(3):
        storage.Client().bucket(bucket).blob(name).upload_from_string(json.dumps(dead))
        said = []
        locks = [WorkdirLock(gcs_dir, command=f"job {i}", log=said.append) for i in range(6)]
        held = _race(len(locks), lambda: (lock := locks.pop()).acquire() or lock)
        holders = [h for h in held if isinstance(h, WorkdirLock)]
        assert len(holders) == 1, held
        assert all(isinstance(r, WorkdirBusy) for r in held if r is not holders[0]), held
        assert any("taking over the lock of a job that is gone (pid 1 on a-deleted-slice" in line for line in said)
        assert holders[0].read()["token"] == holders[0].holder["token"]
        holders[0].release()
        assert holders[0].read() is None


def test_gs_heartbeat_and_release_never_touch_a_lock_taken_over(gcs_dir):
    from google.cloud import storage

    bucket, name = cloud_storage.split(f"{gcs_dir}/{LOCK_NAME}")
    lock = WorkdirLock(gcs_dir, log=lambda m: None)
    lock.acquire()
    blob = storage.Client().bucket(bucket).get_blob(name)
    assert json.loads(blob.download_as_bytes())["token"] == lock.holder["token"]
    first = blob.generation
    lock.refresh()  # a heartbeat: a new generation of our own lock
    assert lock.generation != first and json.loads(storage.Client().bucket(bucket).blob(name).download_as_bytes()
                                                   )["heartbeat"] >= lock.holder["started"]
    # Another host takes the workdir over (as after our heartbeats stopped): ours must not write or delete it.
    now = time.time()
    theirs = {"host": "other", "pid": 2, "token": "theirs", "started": now, "heartbeat": now, "command": "y"}
    storage.Client().bucket(bucket).blob(name).upload_from_string(json.dumps(theirs))
    lock.refresh()
    lock.release()
    assert json.loads(storage.Client().bucket(bucket).blob(name).download_as_bytes())["token"] == "theirs"
    assert socket.gethostname() != "other"


def _tfrecords(folder: str) -> list[list[bytes]]:
    import tensorflow as tf

    gfile = _tf_gfile()
    return [[r.numpy() for r in tf.data.TFRecordDataset(f"{folder}/{name}")]
            for name in sorted(gfile.listdir(folder)) if name.endswith(".tfrecord")]


def test_parquet_and_arrow_files_on_gs_read_as_the_local_copies(gcs_dir, tmp_path):
    """Record units of a Parquet file (row groups, from the cached ParquetFile) and of an Arrow stream on gs://
    are those of the local copies, also after the cached file's handle was closed under it."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from bertjax.data import file_readers

    gfile = _tf_gfile()
    texts = [f"document {i} " * (i % 7 + 1) for i in range(50)]
    pq.write_table(pa.table({"text": texts}), str(tmp_path / "docs.parquet"), row_group_size=20)
    with pa.ipc.new_stream(str(tmp_path / "docs.arrow"), pa.schema([("text", pa.string())])) as stream:
        stream.write_table(pa.table({"text": texts}), max_chunksize=20)
    for name in ("docs.parquet", "docs.arrow"):
        gfile.copy(str(tmp_path / name), f"{gcs_dir}/{name}")

    def units(path):
        file_readers.check_input_files([path], _corpus_config())
        found, k = [], 0
        while True:
            chunk, more = file_readers.record_unit(path.encode(), k, True, b"parquet", b"text", 20)
            if not more:
                return found
            found.append(list(chunk))
            k += 1

    for name in ("docs.parquet", "docs.arrow"):
        expected = units(str(tmp_path / name))
        assert sum(expected, []) == [t.encode() for t in texts]
        assert units(f"{gcs_dir}/{name}") == expected, name
    file_readers._parquet_file(f"{gcs_dir}/docs.parquet").close(force=True)  # as a reader torn down elsewhere
    assert units(f"{gcs_dir}/docs.parquet") == units(str(tmp_path / "docs.parquet"))


def _corpus_config():
    from bertjax.data.data_config import CorpusConfig

    return CorpusConfig(corpus_format="parquet", text_field="text")


@pytest.mark.parametrize("name", ["text.txt", "docs.jsonl.gz", "docs.parquet"])
def test_data_create_from_a_gs_corpus_to_gs_shards(gcs_dir, tmp_path, minilm_dir, name):
    """`data create` with corpus (text, JSON Lines .gz, Parquet), vocab and output all in the bucket writes the
    records, shard by shard, and the metadata that the same run on local copies of the files writes."""
    import gzip

    import pyarrow as pa
    import pyarrow.parquet as pq

    from bertjax.cli import main as bertjax_main
    from bertjax.data.demo_corpus import write_demo_corpus

    gfile = _tf_gfile()
    text_path, _ = write_demo_corpus(str(tmp_path))
    documents = [d for d in open(text_path, encoding="utf-8").read().split("\n\n") if d.strip()][:60]
    files = {"text.txt": "\n\n".join(documents).encode(),
             "docs.jsonl.gz": gzip.compress("".join(json.dumps({"text": d}) + "\n" for d in documents).encode())}
    for file_name, data in files.items():  # not `name`: the corpus under test
        (tmp_path / file_name).write_bytes(data)
    pq.write_table(pa.table({"text": documents}), str(tmp_path / "docs.parquet"), row_group_size=20)
    for file_name in [*files, "docs.parquet", "vocab.txt"]:
        gfile.copy(str(minilm_dir / file_name) if file_name == "vocab.txt" else str(tmp_path / file_name),
                   f"{gcs_dir}/in/{file_name}")

    def create(folder, name, out):
        extra = ("--format", "sentences") if name.endswith(".txt") else \
            ("--format", name.split(".")[1], "--text-field", "text")
        assert bertjax_main(["data", "create", "--input", f"{folder}/{name}", "--vocab", f"{folder}/vocab.txt",
                             "--out", out, "--max-seq-length", "64", "--max-predictions", "10", "--shards", "2",
                             "--dupe-factor", "1", *extra]) == 0
        return _tfrecords(out), json.loads(gfile.GFile(f"{out}/pretrain-metadata.json").read())

    (tmp_path / "vocab.txt").write_bytes((minilm_dir / "vocab.txt").read_bytes())
    expected, expected_metadata = create(str(tmp_path), name, str(tmp_path / "out"))
    assert len(expected) == 2 and sum(map(len, expected)) > 50
    assert expected_metadata["stats"]["documents_read"] == len(documents), expected_metadata["stats"]
    records, metadata = create(f"{gcs_dir}/in", name, f"{gcs_dir}/out")
    assert records == expected
    for key in ("input_formats", "num_instances"):
        assert metadata.get(key) == expected_metadata.get(key), key


def test_beam_data_create_reads_and_writes_gs(gcs_dir, tmp_path, minilm_dir):
    """`data create --runner beam` (DirectRunner) with the corpus and vocab in the bucket and its shards written
    there: the shards the same pipeline writes from and to local files."""
    pytest.importorskip("apache_beam")
    from bertjax.data.beam_create import create_with_beam
    from bertjax.data.data_config import PretrainingDataConfig
    from bertjax.data.demo_corpus import write_demo_corpus

    gfile = _tf_gfile()
    text_path, _ = write_demo_corpus(str(tmp_path))
    documents = [d for d in open(text_path, encoding="utf-8").read().split("\n\n") if d.strip()][:40]
    (tmp_path / "text.txt").write_text("\n\n".join(documents), encoding="utf-8")
    gfile.copy(str(tmp_path / "text.txt"), f"{gcs_dir}/in/text.txt")
    gfile.copy(str(minilm_dir / "vocab.txt"), f"{gcs_dir}/in/vocab.txt")

    def create(source, vocab, out):
        config = PretrainingDataConfig(input=source, vocab=vocab, max_seq_length=64, max_predictions_per_seq=10,
                                       doc_buffer_size=3, dupe_factor=1, masking="static", seed=3)
        create_with_beam(config, out, 2, log=lambda *_: None)
        return _tfrecords(out)

    expected = create(str(tmp_path / "text.txt"), str(minilm_dir / "vocab.txt"), str(tmp_path / "local"))
    assert len(expected) == 2 and sum(map(len, expected)) > 30
    assert create(f"{gcs_dir}/in/text.txt", f"{gcs_dir}/in/vocab.txt", f"{gcs_dir}/out") == expected


def test_finetune_classify_with_gs_data_init_workdir_and_export(gcs_dir, tmp_path, minilm_dir):
    """`finetune classify` with its train/dev/test files, the model it starts from, its workdir and its HF export
    all in the bucket: the metrics, predictions and exported weights of the same run on local files."""
    import random

    import safetensors.numpy

    from bertjax import cli
    from tests.conftest import save_tiny_hf

    gfile = _tf_gfile()
    rng = random.Random(0)
    filler = "the a movie film plot actor scene story music was very and".split()

    def rows(n):
        return "".join(f"{' '.join(rng.choices(filler, k=5))} {('awful', 'great')[i % 2]},{('sad', 'happy')[i % 2]}\n"
                       for i in range(n))

    local, remote = tmp_path / "in", f"{gcs_dir}/in"
    local.mkdir()
    for name, text in {"train.csv": "review,mood\n" + rows(48), "dev.csv": "review,mood\n" + rows(16),
                       "test.csv": "review\n" + "".join(r.split(",")[0] + "\n" for r in rows(4).splitlines())}.items():
        (local / name).write_text(text, encoding="utf-8")
    save_tiny_hf(local / "init", minilm_dir / "vocab.txt", seed=0)
    for path in sorted(local.rglob("*")):
        if path.is_file():
            gfile.makedirs(f"{remote}/{path.parent.relative_to(local)}".rstrip("/."))
            gfile.copy(str(path), f"{remote}/{path.relative_to(local)}")

    def classify(folder, workdir):
        assert cli.main(["finetune", "classify", "--train", f"{folder}/train.csv", "--dev", f"{folder}/dev.csv",
                         "--test", f"{folder}/test.csv", "--text-column", "review", "--label-column", "mood",
                         "--init", f"{folder}/init", "--workdir", workdir, "--max-seq-length", "16",
                         "--batch-size", "16", "--epochs", "2", "--seed", "1", "--export-hf"]) == 0
        read = lambda name: gfile.GFile(f"{workdir}/{name}", "rb").read()  # noqa: E731
        metrics = json.loads(read("metrics.json"))
        rows = {split: [json.loads(line) for line in read(f"{split}_predictions.jsonl").splitlines()]
                for split in ("dev", "test")}
        assert [r.pop("where") for r in rows["test"]] == [f"{folder}/test.csv:{i}" for i in range(2, 6)]
        for row in rows["dev"]:
            row.pop("where")
        return ({k: metrics[k] for k in ("labels", "metrics")}, rows["dev"], rows["test"],
                safetensors.numpy.load(read("hf/model.safetensors")), json.loads(read("hf/config.json")))

    expected = classify(str(local), str(tmp_path / "work"))
    found = classify(remote, f"{gcs_dir}/work")
    assert expected[0]["labels"] == ["happy", "sad"] and len(expected[1]) == 16
    assert found[:3] == expected[:3]
    assert found[3].keys() == expected[3].keys()
    for name, value in expected[3].items():
        assert (found[3][name] == value).all(), name
    assert found[4] == expected[4]


def test_a_gs_step_without_orbaxs_commit_marker_is_never_taken_for_a_checkpoint(gcs_dir, minilm_dir):
    """On gs:// Orbax writes a step in place and finishes it with commit_success.txt (no rename there). A save cut
    before its marker (step 12: the marker deleted) and one cut earlier (step 15: some params objects, nothing
    else) are not listed for a resume, not what a run directory stands for, and not loaded when named."""
    from google.cloud import storage

    from bertjax import cli
    from bertjax.checkpoint import CheckpointConfig, TrainCheckpointer, complete_steps, load_model, \
        resolve_checkpoint
    from tests.conftest import save_tiny_checkpoint

    run = f"{gcs_dir}/run"
    for step, seed in ((5, 0), (12, 1)):
        save_tiny_checkpoint(f"{run}/checkpoints/{step}", minilm_dir / "vocab.txt", seed)
    bucket_name, prefix = cloud_storage.split(f"{run}/checkpoints")
    bucket = storage.Client().bucket(bucket_name)
    assert bucket.blob(f"{prefix}/12/commit_success.txt").exists()
    assert complete_steps(run) == [5, 12]

    # Cut through TensorFlow's file system, which epath (Orbax's listing) reads: its stat cache would otherwise
    # keep the marker for seconds in this process (a resumed job is a new process, with an empty cache).
    _tf_gfile().remove(f"{run}/checkpoints/12/commit_success.txt")
    for blob in list(bucket.list_blobs(prefix=f"{prefix}/5/params/"))[:2]:
        bucket.copy_blob(blob, bucket, blob.name.replace(f"{prefix}/5/", f"{prefix}/15/", 1))
    assert complete_steps(run) == [5]
    assert resolve_checkpoint(run) == f"{run}/checkpoints/5"
    checkpointer = TrainCheckpointer(run, CheckpointConfig())
    try:
        assert checkpointer.steps() == [5] and checkpointer.latest_step() == 5  # what a resume tries, newest first
    finally:
        checkpointer.close()
    with pytest.raises(ValueError, match=r"checkpoints/12: cannot read the checkpoint .*incomplete"):
        load_model(f"{run}/checkpoints/12")
    assert cli.main(["info", run]) == 0


GS_CACHE_PROGRAM = """
import sys
import jax, jax.numpy as jnp
from bertjax.runtime import compile_cache
assert compile_cache.enable(sys.argv[1]) == sys.argv[1]
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)  # this program compiles in well under 0.5 s
stats = compile_cache.CacheStats().start()
jax.jit(lambda x: jnp.tanh(x @ x.T) @ x + 1)(jnp.ones((96, 96))).block_until_ready()
print(stats.hits, stats.misses)
"""


def test_the_compilation_cache_on_gs_is_read_back_by_a_restart(gcs_dir):
    """A job's first run writes its compiled programs to a gs:// cache (JAX's cache goes through etils.epath);
    the restarted process reads every one of them back from the bucket instead of compiling."""
    import subprocess
    import sys

    from tests.conftest import REPO_ROOT
    from tests.test_pretrain import _env

    cache = f"{gcs_dir}/jax-cache"

    def run():
        done = subprocess.run([sys.executable, "-c", GS_CACHE_PROGRAM, cache], env=_env(1), cwd=REPO_ROOT,
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        return tuple(int(n) for n in done.stdout.split()[-2:])

    hits, misses = run()
    assert hits == 0 and misses >= 1
    entries = [name for name in _tf_gfile().listdir(cache) if name.endswith("-cache")]
    assert len(entries) >= 1, _tf_gfile().listdir(cache)
    assert run() == (misses, 0)


@pytest.mark.parametrize("job", [["glue", "--task", "sst2", "--data", "glue"],
                                 ["features", "--task", "sst2", "--data", "glue"],
                                 ["ner", "--data", "conll"], ["squad", "--train", "train.json", "--version", "1.1"],
                                 ["multiple-choice", "--data", "swag"], ["embedding", "--train", "pairs.csv"]])
def test_fine_tunes_that_write_locally_refuse_a_gs_workdir_in_one_line(gcs_dir, tmp_path, monkeypatch, capsys,
                                                                       job):
    """Only `finetune classify` writes its workdir through epath; another fine-tune given a gs:// workdir wrote
    it under ./gs:/ on the local disk and said nothing. It is refused, before anything is read or written."""
    from bertjax import cli

    monkeypatch.chdir(tmp_path)
    code = cli.main(["finetune", *job, "--init", str(tmp_path / "no-model"), "--workdir", f"{gcs_dir}/work"])
    assert code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"bertjax finetune: error: --workdir {gcs_dir}/work: finetune {job[0]} writes its outputs to a local "
        "directory only (finetune classify takes a gs:// workdir); give a local directory and copy it to the bucket "
        "after")
    assert list(tmp_path.iterdir()) == [] and not _tf_gfile().exists(f"{gcs_dir}/work")
