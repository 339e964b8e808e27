"""A checkpoint save is durable (the file and its folder are flushed to the disk) and a save
that fails on a full disk says so in one error that names what survived."""

import os

import pytest
import torch
from support import mounted_tmpfs

from moe_lab.training import checkpoint
from moe_lab.training.checkpoint import load_checkpoint, save_checkpoint


def test_the_file_and_its_folder_are_flushed(tmp_path, monkeypatch):
    flushed = []
    real_fsync = os.fsync

    def fsync(fd):
        flushed.append(os.readlink(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    if not os.path.isdir("/proc/self/fd"):
        pytest.skip("needs /proc to name the flushed file descriptors")
    monkeypatch.setattr(checkpoint.os, "fsync", fsync)
    path = tmp_path / "ck.pt"
    save_checkpoint(path, {"step": 1})
    # The temporary file (later renamed to ck.pt), then the folder that holds the new name.
    assert len(flushed) == 2
    assert os.path.dirname(flushed[0]) == str(tmp_path) and ".tmp" in flushed[0]
    assert flushed[1] == str(tmp_path)
    assert load_checkpoint(path)["step"] == 1


@pytest.fixture
def tiny_disk():
    """A 256 KiB tmpfs: a real full disk (root only)."""
    with mounted_tmpfs("size=256k") as folder:
        yield folder


def test_a_full_disk_names_the_checkpoint_that_survived(tiny_disk):
    path = tiny_disk / "ck.pt"
    save_checkpoint(path, {"step": 1, "w": torch.ones(1000)})
    with pytest.raises(OSError, match=f"checkpoint {path} could not be written .*bytes free on its "
                                      f"disk\\); {path} still holds the checkpoint saved before"):
        save_checkpoint(path, {"step": 2, "w": torch.ones(200_000)})  # 800 KB: does not fit
    assert load_checkpoint(path)["step"] == 1
    assert [p.name for p in tiny_disk.iterdir()] == ["ck.pt"]  # no temporary left behind
    fresh = tiny_disk / "first.pt"
    with pytest.raises(OSError, match=f"there is no earlier checkpoint at {fresh}"):
        save_checkpoint(fresh, {"w": torch.ones(200_000)})
    assert not fresh.exists()
