"""The CPU plug-in's build folder: a build that was killed must not make every later load
wait forever, and a live build in another process is waited for with a word, then given up."""

import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from moe_lab.workbench.cpu import build


def test_stale_torch_lock_is_removed(tmp_path, capsys):
    baton = tmp_path / "lock"
    baton.write_text("")
    with build.build_guard(tmp_path):
        assert not baton.exists()
    assert "killed" in capsys.readouterr().err


def test_no_lock_no_word(tmp_path, capsys):
    with build.build_guard(tmp_path):
        pass
    assert capsys.readouterr().err == ""


def test_live_builder_is_waited_for_then_given_up(tmp_path, capsys, monkeypatch):
    """Another process holds the folder: its ``lock`` file is left alone, the wait is reported
    on stdout with the holder's PID, and it ends in an error naming the lock; once the holder is killed
    with SIGKILL, the next load proceeds."""
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import fcntl, os, sys, time
        handle = open({str(tmp_path / "moe_lab.lock")!r}, "a")
        fcntl.flock(handle, fcntl.LOCK_EX)
        handle.write(str(os.getpid())); handle.flush()
        open({str(tmp_path / "lock")!r}, "w").close()
        print("holding", flush=True)
        time.sleep(60)
    """)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "holding"
        start = time.monotonic()
        monkeypatch.setattr(build, "WAIT_LIMIT_S", 3)
        with pytest.raises(TimeoutError, match=f"process {holder.pid} .*{tmp_path}"):
            with build.build_guard(tmp_path):
                pytest.fail("entered the guard while another process held it")
        assert time.monotonic() - start < 15
        assert (tmp_path / "lock").exists()
        said = capsys.readouterr()  # a wait is progress: stdout, and nothing on stderr
        assert f"waiting for process {holder.pid}" in said.out and said.err == ""
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    # The holder died: the operating system dropped its lock, so its file is stale now.
    monkeypatch.setattr(build, "WAIT_LIMIT_S", 5)
    with build.build_guard(tmp_path):
        assert not (tmp_path / "lock").exists()


def test_load_after_a_killed_build_does_not_hang(tmp_path):
    """The built extension copied to a fresh folder with torch's ``lock`` file beside it, as a
    build killed by a timeout leaves it: building ahead must finish, not wait forever."""
    if build.unavailable_reason() is not None:
        pytest.skip("the CPU kernels cannot be built here")
    name, built = build._name_and_dir()
    copy = tmp_path / name
    shutil.copytree(built, copy, ignore=shutil.ignore_patterns("lock", "moe_lab.lock"))
    (copy / "lock").write_text("")
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path)}
    env.pop("MOE_LAB_NO_CPU_EXTENSION", None)
    try:
        done = subprocess.run([sys.executable, "-m", "moe_lab.workbench.cpu"], env=env,
                              capture_output=True, text=True, timeout=240)
    except subprocess.TimeoutExpired:
        pytest.fail("building ahead waited on the stale lock file")
    assert done.returncode == 0, done.stderr
    assert "CPU kernels ready" in done.stdout, done.stdout + done.stderr
    assert not (copy / "lock").exists()


def test_each_torch_installation_builds_in_its_own_folder(monkeypatch):
    """Two environments with the same torch version once shared a folder, and torch rebuilt
    the kernels for each in turn (their build commands differ), holding the lock for minutes."""
    import torch

    name, folder = build._name_and_dir()
    monkeypatch.setattr(torch, "__file__", "/another/env/site-packages/torch/__init__.py")
    other_name, other_folder = build._name_and_dir()
    assert other_name != name and other_folder != folder
    assert other_folder.parent == folder.parent


def test_each_checkout_of_the_sources_builds_in_its_own_folder(monkeypatch, tmp_path):
    """Two checkouts of the same sources (a git worktree, mutate.py's scratch copy) once
    shared a folder: ninja saw other source paths and rebuilt the kernels for each in turn."""
    import shutil

    name, folder = build._name_and_dir()
    copies = []
    for source in (*build.SOURCES, *build.HEADERS):
        copy = tmp_path / source.name
        shutil.copy2(source, copy)
        copies.append(copy)
    monkeypatch.setattr(build, "SOURCES", tuple(copies[:len(build.SOURCES)]))
    monkeypatch.setattr(build, "HEADERS", tuple(copies[len(build.SOURCES):]))
    other_name, other_folder = build._name_and_dir()
    assert other_name != name and other_folder.parent == folder.parent
