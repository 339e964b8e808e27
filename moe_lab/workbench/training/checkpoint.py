"""Checkpoints: one writer each, written atomically, read without unpickling code.

A training checkpoint (`moe_lab.workbench.training.loop.Trainer.state`) holds the model, the optimizer,
the step's own device state where it has one, the data generator's state, torch's RNG and
the history, so a resumed run continues the uninterrupted loss curve exactly. A run holds
its checkpoint for its lifetime (`checkpoint_lock`: an exclusive lock on a file beside it),
so a second run on the same path is refused at its start, naming the first. A save writes a
temporary file in the same folder, named after the checkpoint and the writing process, and
renames it over the old one (``os.replace``), so a crash mid-write leaves the previous
checkpoint intact; the next save of that checkpoint removes the temporaries that processes
no longer running left behind, and nothing else. It is read with ``weights_only=True``: a
file that is not a checkpoint (empty, truncated, anything else) is refused with a
``ValueError`` saying so.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import tempfile
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from moe_lab.workbench.filelock import file_lock


class CheckpointInUse(OSError):
    """Another run holds this checkpoint (`checkpoint_lock`)."""


def _temp_prefix(path: Path) -> str:
    """The start of the name of a temporary file this process writes for ``path``."""
    return f".{path.name}.moe_lab-{os.getpid()}-"


_TEMP_SUFFIX = ".tmp"


def process_running(pid: int) -> bool:
    """Whether process ``pid`` exists (where that cannot be asked safely: assumed so)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def check_checkpoint_path(path: str | os.PathLike) -> Path:
    """``path`` as a `Path` if a checkpoint can be written there; else a ``ValueError``
    naming it (a directory, a name ending in a separator, a folder that is a file, a folder
    in which no file can be made: the check makes and removes one).

    Called before a run starts, so that a bad path costs nothing rather than the training
    done before the first save."""
    raw = os.fspath(path)
    path = Path(path)
    if path.is_dir() or os.path.basename(raw) in ("", ".", ".."):  # "sub/", "sub/.": no file name
        what = "is" if path.is_dir() else "names"
        raise ValueError(f"checkpoint path '{raw}' {what} a directory; expected a file name "
                         f"such as '{path / 'checkpoint.pt'}'")
    folder = next((p for p in (path.parent, *path.parent.parents) if p.exists()), Path("."))
    if not folder.is_dir():
        raise ValueError(f"checkpoint path '{path}': '{folder}' is a file, not a folder")
    try:  # its permissions, or a folder the system refuses files in whatever they say (/proc)
        fd, probe = tempfile.mkstemp(dir=folder, prefix=_temp_prefix(path), suffix=_TEMP_SUFFIX)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise ValueError(f"checkpoint path '{path}': no file can be written in the folder "
                         f"'{folder}': it is not writable ({exc.strerror or type(exc).__name__})"
                         ) from None
    return path


def checkpoint_lock(path: str | os.PathLike) -> contextlib.AbstractContextManager:
    """Hold the checkpoint ``path`` for one run: an exclusive lock on ``.{name}.moe_lab.lock`` beside
    it (`moe_lab.workbench.filelock`; its folder made if missing), which holds this process's id
    and is removed when the block ends. A checkpoint another run holds raises `CheckpointInUse`
    naming that run's process; the lock ends with the process that held it, however it ends."""
    path = Path(path)

    def refuse(holder: str) -> CheckpointInUse:
        return CheckpointInUse(f"checkpoint '{path}' is in use by another run ({holder}); "
                               "wait for it to end, or give this run another checkpoint path")

    return file_lock(path.parent / f".{path.name}.moe_lab.lock", refuse)


def _remove_stale_temporaries(path: Path) -> None:
    """Remove the temporary files that saves of ``path`` by processes no longer running left
    in its folder; another process's save in progress and the user's own files stay."""
    # A temporary file of ``path`` (`_temp_prefix`), its writer's process id in group 1.
    pattern = re.escape(f".{path.name}.moe_lab-") + r"(\d+)-[a-z0-9_]{8}" + re.escape(_TEMP_SUFFIX)
    for stale in path.parent.iterdir():
        match = re.fullmatch(pattern, stale.name)  # a user's file does not match
        if match and int(match[1]) != os.getpid() and not process_running(int(match[1])):
            with contextlib.suppress(FileNotFoundError):
                stale.unlink()


def _interrupted(exc: BaseException) -> bool:
    """Whether ``exc`` is, or was raised while handling, a Ctrl-C. torch's zip writer turns
    a ``KeyboardInterrupt`` raised mid-write into a ``RuntimeError`` when it closes the
    half-written archive; the interrupt survives only as its ``__context__``."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, KeyboardInterrupt):
            return True
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return False


@contextlib.contextmanager
def _ctrl_c_deferred() -> Iterator[None]:
    """Hold a Ctrl-C (SIGINT) that arrives inside the block until the block is done, then
    raise it. Only the main thread can install a signal handler; elsewhere (and where the
    handler is not Python's default one) the block runs as it is."""
    if (threading.current_thread() is not threading.main_thread()
            or signal.getsignal(signal.SIGINT) is not signal.default_int_handler):
        yield
        return
    caught: list[int] = []
    signal.signal(signal.SIGINT, lambda signum, frame: caught.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if caught:
        raise KeyboardInterrupt


def save_checkpoint(path: str | os.PathLike, state: dict,
                    on_saved: Callable[[], None] | None = None) -> None:
    """Write ``state`` to ``path`` (its folder made if missing) atomically and durably: a
    temporary file beside it, flushed to the disk (``fsync``), renamed over ``path``, and the
    folder's entry flushed too, so a power cut leaves either the old checkpoint or the new one.

    The temporary files that saves of ``path`` by processes no longer running left (a
    killed run) are removed first; another process's save in progress and the user's own
    files stay. One run at a time saves ``path``: `train` holds it (`checkpoint_lock`). A
    save that fails (a full disk: torch then raises a bare ``RuntimeError``) raises
    ``OSError`` saying why and whether ``path`` still holds the checkpoint saved before,
    which it does whenever there was one. Ctrl-C while the file is written raises
    ``KeyboardInterrupt`` (never a write error), the temporary file removed and ``path`` as
    it was; from the rename on, through ``on_saved()`` (the caller's note of what ``path``
    now holds), a Ctrl-C waits until they are done, so the caller never believes ``path``
    holds an older checkpoint than it does."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_temporaries(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=_temp_prefix(path), suffix=_TEMP_SUFFIX)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        with _ctrl_c_deferred():
            os.replace(tmp, path)
            _fsync_folder(path.parent)
            if on_saved is not None:
                on_saved()
    except BaseException as exc:
        if os.path.exists(tmp):
            os.unlink(tmp)
        if not isinstance(exc, (OSError, RuntimeError)):
            raise
        if _interrupted(exc):
            raise KeyboardInterrupt from None
        free = shutil.disk_usage(path.parent).free
        kept = (f"{path} still holds the checkpoint saved before" if path.is_file() else
                f"there is no earlier checkpoint at {path}")
        raise OSError(f"checkpoint {path} could not be written ({type(exc).__name__}: "
                      f"{str(exc).strip().splitlines()[0] if str(exc).strip() else 'no reason given'}; "
                      f"{free} bytes free on its disk); {kept}") from exc


def _fsync_folder(folder: Path) -> None:
    """Flush ``folder``'s entries (the rename) to the disk, where the system allows it (Windows
    cannot open a folder)."""
    with contextlib.suppress(OSError):
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def load_checkpoint(path: str | os.PathLike) -> dict:
    """The state written by `save_checkpoint` (tensors on the CPU).

    A missing file raises ``FileNotFoundError``; a file that torch cannot read as a
    checkpoint of plain tensors and containers (empty, truncated, another format, or
    pickled code) raises ``ValueError`` naming the file and its size."""
    path = Path(path)
    if not path.is_file():  # a directory is refused before (`check_checkpoint_path`)
        raise FileNotFoundError(f"checkpoint not found: {path}")
    size = path.stat().st_size
    if size == 0:
        raise ValueError(f"checkpoint '{path}' is empty (0 bytes); expected a file written "
                         "by moe_lab's save_checkpoint")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # torch reports each kind of bad file differently
        # torch's own message for a pickle it refuses advises weights_only=False, i.e.
        # running code from the file: not advice to pass on about an unknown file.
        raise ValueError(f"checkpoint '{path}' ({size} bytes) is not a readable checkpoint: "
                         "truncated, or not written by moe_lab's save_checkpoint "
                         f"({type(exc).__name__})") from None
    if not isinstance(state, dict):
        raise ValueError(f"checkpoint '{path}' holds a {type(state).__name__}, expected the "
                         "dict written by save_checkpoint")
    return state
