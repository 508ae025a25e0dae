"""A command that creates its workdir and fails before saving anything to resume from leaves no workdir behind;
one that existed before, holds a complete checkpoint, or another job holds, is kept."""
import pytest

from bertjax.cli import main
from bertjax.runtime.new_workdir import removed_if_failed_before_saving
from bertjax.runtime.workdir_lock import LOCK_NAME, WorkdirBusy, WorkdirLock


def _pretrain_missing_input(workdir, vocab):
    return main(["pretrain", "--config", "bert-tiny", "--workdir", str(workdir), "--set", f"data.vocab={vocab}",
                 "--set", f"data.input={workdir.parent}/no-such-*.txt", "--set", "train.steps=10",
                 "--set", "optimizer.warmup_steps=1"])


def test_a_pretrain_that_fails_on_its_input_removes_the_workdir_it_created(tmp_path, minilm_dir, capsys):
    assert _pretrain_missing_input(tmp_path / "run", minilm_dir / "vocab.txt") == 2
    assert "matches no files" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_a_workdir_that_existed_before_is_kept(tmp_path, minilm_dir, capsys):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "notes.txt").write_text("mine")
    assert _pretrain_missing_input(tmp_path / "run", minilm_dir / "vocab.txt") == 2
    assert "matches no files" in capsys.readouterr().err
    assert (tmp_path / "run" / "notes.txt").read_text() == "mine"


def test_a_workdir_holding_a_saved_state_is_kept(tmp_path):
    workdir = tmp_path / "run"
    with pytest.raises(RuntimeError, match="step 5000"):
        with removed_if_failed_before_saving(str(workdir), lambda: True, WorkdirLock(str(workdir))):
            workdir.mkdir()
            raise RuntimeError("failed at step 5000")
    assert workdir.is_dir()
    with pytest.raises(RuntimeError):
        with removed_if_failed_before_saving(str(tmp_path / "other"), lambda: False,
                                            WorkdirLock(str(tmp_path / "other"))):
            (tmp_path / "other" / "checkpoints").mkdir(parents=True)
            raise RuntimeError("bad input")
    assert not (tmp_path / "other").exists()


def test_a_job_refused_on_a_new_workdir_leaves_the_holders_work_alone(tmp_path):
    """Two jobs started at once on a workdir neither found: the one refused the lock must not remove what the
    holder has begun to write (it did: a gs:// pretrain lost its checkpoints to the refused job's cleanup)."""
    workdir = tmp_path / "run"
    holder, refused = WorkdirLock(str(workdir), log=lambda m: None), WorkdirLock(str(workdir), log=lambda m: None)
    with pytest.raises(WorkdirBusy):
        with removed_if_failed_before_saving(str(workdir), lambda: False, refused):
            holder.acquire()  # the other job wins the race
            (workdir / "config.json").write_text("{}")
            refused.acquire()
    assert (workdir / "config.json").exists() and (workdir / LOCK_NAME).exists()
    holder.release()


def test_a_pretrain_refused_after_writing_the_init_vocabulary_removes_the_workdir(tmp_path, minilm_dir, capsys):
    """`--config init` writes the --init checkpoint's vocabulary into the workdir before the config is validated:
    refused there (no data.input), it left the new workdir behind holding only that file."""
    from tests.conftest import save_tiny_checkpoint

    init = save_tiny_checkpoint(tmp_path / "ckpt", minilm_dir / "vocab.txt", seed=0)
    assert main(["pretrain", "--config", "init", "--init", init, "--workdir", str(tmp_path / "run")]) == 2
    assert "data.input is empty" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()
