"""A checkpoint save is durable (the file and its folder are flushed to the disk) and a save
that fails on a full disk says so in one error that names what survived."""

import os
import signal

import pytest
import torch
from support import mounted_tmpfs

from moe_lab.workbench.training import checkpoint
from moe_lab.workbench.training.checkpoint import load_checkpoint, save_checkpoint


@pytest.fixture
def ctrl_c_raises():
    """Ctrl-C raises KeyboardInterrupt here, as in a terminal: a suite started in the background
    (`make test &`) runs with SIGINT ignored, which these tests must not depend on."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


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


def test_ctrl_c_mid_write_is_an_interrupt_not_a_write_error(tmp_path, monkeypatch):
    """torch's zip writer turns a Ctrl-C inside one of its writes into a ``RuntimeError``
    ("unexpected pos"); the save must still raise ``KeyboardInterrupt``, leave the earlier
    checkpoint and no temporary file."""
    path = tmp_path / "ck.pt"
    save_checkpoint(path, {"step": 1, "w": torch.ones(1000)})
    real_fdopen = os.fdopen

    class InterruptedFile:
        def __init__(self, f):
            self._f, self.writes = f, 0

        def write(self, data):
            self.writes += 1
            if self.writes == 3:
                raise KeyboardInterrupt
            return self._f.write(data)

        def __getattr__(self, name):
            return getattr(self._f, name)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return self._f.__exit__(*exc)

    monkeypatch.setattr(checkpoint.os, "fdopen", lambda fd, mode: InterruptedFile(real_fdopen(fd, mode)))
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(path, {"step": 2, "w": torch.ones(1000), "v": torch.ones(1000)})
    assert load_checkpoint(path)["step"] == 1
    assert [p.name for p in tmp_path.iterdir()] == ["ck.pt"]


def test_ctrl_c_after_the_rename_waits_for_the_callers_note(tmp_path, ctrl_c_raises):
    """A Ctrl-C between the rename and ``on_saved`` would leave the caller naming the older
    checkpoint; it is held until ``on_saved`` has run, then raised."""
    path = tmp_path / "ck.pt"
    noted = []

    def on_saved():
        os.kill(os.getpid(), signal.SIGINT)  # delivered at once were it not held
        noted.append(load_checkpoint(path)["step"])

    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(path, {"step": 7}, on_saved)
    assert noted == [7] and load_checkpoint(path)["step"] == 7
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_where_ctrl_c_is_ignored_the_save_leaves_it_ignored(tmp_path):
    """A run started in the background (`moe_lab train ... &`) ignores SIGINT: the save neither
    raises on one nor installs a handler of its own."""
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        save_checkpoint(tmp_path / "ck.pt", {"step": 2}, lambda: os.kill(os.getpid(), signal.SIGINT))
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, previous)
    assert load_checkpoint(tmp_path / "ck.pt")["step"] == 2


def test_a_checkpoint_into_a_folder_not_made_yet_makes_it(tmp_path):
    """``--checkpoint runs/today/model.pt`` works before ``runs/today`` exists."""
    path = tmp_path / "runs" / "today" / "model.pt"
    save_checkpoint(path, {"step": 3})
    assert torch.load(path)["step"] == 3
