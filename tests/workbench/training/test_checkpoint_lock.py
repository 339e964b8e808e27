"""One writer per checkpoint: a run holds its checkpoint path for its lifetime, a save removes
only the temporaries of processes no longer running, and a path that cannot take a file is
refused before anything is trained."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from moe_lab import preset
from moe_lab.workbench.training.checkpoint import check_checkpoint_path, load_checkpoint, save_checkpoint
from moe_lab.workbench.training.loop import TrainConfig, train

TINY = preset("tiny", n_layers=1, seq_len=32)


def cfg(**kw):
    base = dict(steps=3, batch_size=2, warmup_steps=0, eval_every=0, progress=False)
    return TrainConfig(**{**base, **kw})


def _dead_pid() -> int:
    """The id of a process that has ended."""
    child = subprocess.Popen([sys.executable, "-c", ""])
    child.wait()
    return child.pid


def test_a_second_run_on_a_held_checkpoint_is_refused_naming_the_first(tmp_path):
    """Two runs on one checkpoint each deleted the other's temporary and the file ended up
    holding the other run. The second is now refused at its start, naming the holder."""
    path = tmp_path / "ck.pt"
    refusals = []

    def second_run(step, record):
        if step == 0:
            with pytest.raises(OSError, match=rf"'{path}' is in use by another run \(process "
                                              rf"{os.getpid()}\)") as refused:
                train(TINY, cfg(checkpoint_path=str(path), seed=9))
            refusals.append(refused.value)

    first = train(TINY, cfg(checkpoint_path=str(path), checkpoint_every=1), callback=second_run)
    assert len(refusals) == 1
    assert load_checkpoint(path)["history"] == first.history  # the first run's, whole
    assert [p.name for p in tmp_path.iterdir()] == ["ck.pt"]  # the lock went with the run
    train(TINY, cfg(checkpoint_path=str(path), steps=4), resume=True, override=True)  # free again


def test_without_overwrite_a_run_refuses_an_existing_file_once_it_holds_the_path(tmp_path):
    """The command line's "exists" check is made under the lock (a run that finished between
    the check and the lock would otherwise be replaced unasked)."""
    path = tmp_path / "ck.pt"
    path.write_text("my notes")
    with pytest.raises(ValueError, match=f"--checkpoint {path} exists; pass --resume"):
        train(TINY, cfg(checkpoint_path=str(path)), overwrite=False)
    assert path.read_text() == "my notes"
    assert [p.name for p in tmp_path.iterdir()] == ["ck.pt"]


def test_a_save_removes_only_the_temporaries_of_processes_no_longer_running(tmp_path):
    """The cleanup removed every ``.{name}.*.tmp``: a user's file, and another run's save in
    progress (which then failed, or renamed the wrong state over the checkpoint)."""
    path = tmp_path / "ck.pt"
    users = tmp_path / ".ck.pt.backup.tmp"
    in_progress = tmp_path / f".ck.pt.moe_lab-{os.getppid()}-abcd1234.tmp"  # a running process
    dead = _dead_pid()
    killed = tmp_path / f".ck.pt.moe_lab-{dead}-x1y2z3w4.tmp"  # what a run killed mid-save leaves
    others = tmp_path / f".other.pt.moe_lab-{dead}-x1y2z3w4.tmp"  # another checkpoint's
    for temporary in (users, in_progress, killed, others):
        temporary.write_bytes(b"half a checkpoint")
    save_checkpoint(path, {"step": 1})
    kept = sorted([users.name, in_progress.name, others.name, "ck.pt"])
    assert sorted(p.name for p in tmp_path.iterdir()) == kept
    assert load_checkpoint(path)["step"] == 1


@pytest.mark.parametrize("name", ["newdir/sub/", "newdir/.."])
def test_a_path_naming_a_directory_is_refused(tmp_path, name):
    """``--checkpoint newdir/sub/`` wrote a file named ``sub``."""
    with pytest.raises(ValueError, match="names a directory; expected a file name"):
        check_checkpoint_path(f"{tmp_path}/{name}")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs /proc")
def test_a_folder_that_takes_no_file_is_refused_at_the_door(tmp_path):
    """``--checkpoint /proc/c.pt`` passed the permission check (root may write anywhere) and
    failed only after training, naming a hidden temporary."""
    with pytest.raises(ValueError, match=r"'/proc/c.pt': no file can be written in the folder '/proc'"):
        check_checkpoint_path("/proc/c.pt")
    with pytest.raises(ValueError, match="no file can be written"):
        train(TINY, cfg(checkpoint_path="/proc/c.pt"))


def test_a_folder_without_write_permission_is_named_not_writable(tmp_path, monkeypatch):
    """The probe file is the permission check (root may write anywhere, so it is faked)."""
    def refused(**kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr("tempfile.mkstemp", refused)
    with pytest.raises(ValueError, match=f"the folder '{tmp_path}': it is not writable "
                                         r"\(Permission denied\)"):
        check_checkpoint_path(tmp_path / "c.pt")
