"""``python -m moe_lab train`` facing a hostile but fair user, round two: a checkpoint another
run holds, paths that name no file, hand-made checkpoints, corpora that are no text file, and
messages that name the real cause — one line each, no traceback, nothing trained first."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from support import cli, one_line

from moe_lab import preset
from moe_lab.__main__ import main
from moe_lab.workbench.training import loop

TRAIN = ["train", "--steps", "2", "--batch-size", "2", "--eval-every", "0", "--json"]




@pytest.fixture
def nothing_trained(monkeypatch):
    """Fails the test if a training step is taken."""
    def advance(self):
        pytest.fail("trained before refusing")

    monkeypatch.setattr(loop.Trainer, "advance", advance)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """A two-step training checkpoint of the eager step."""
    path = tmp_path_factory.mktemp("ck") / "run.pt"
    assert main([*TRAIN, "--checkpoint", str(path)]) == 0
    return path


def test_a_run_on_a_checkpoint_another_run_holds_is_refused(capsys, tmp_path):
    path = tmp_path / "run.pt"
    codes = []

    def second_run(step, record):
        if step == 0:
            codes.append(main([*TRAIN, "--checkpoint", str(path), "--seed", "5"]))

    small = preset("tiny", n_layers=1, seq_len=32)
    first = loop.train(small, loop.TrainConfig(steps=2, batch_size=2, eval_every=0, progress=False,
                                               checkpoint_path=str(path)), callback=second_run)
    assert codes == [2]
    one_line(capsys.readouterr().err.strip().splitlines(), f"'{path}' is in use by another run",
              f"(process {os.getpid()})")
    assert torch.load(path)["history"] == first.history


@pytest.mark.parametrize("name", ["newdir/sub/", "newdir/sub/."])
def test_a_checkpoint_path_naming_a_directory_is_refused(capsys, tmp_path, nothing_trained, name):
    """``--checkpoint newdir/sub/`` trained, then wrote a file named ``sub``."""
    code, err = cli(capsys, *TRAIN, "--checkpoint", f"{tmp_path}/{name}")
    assert code == 2
    one_line(err, "names a directory", "expected a file name")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs /proc")
def test_a_checkpoint_folder_that_takes_no_file_is_refused_before_training(capsys, nothing_trained):
    """``--checkpoint /proc/c.pt`` trained, then failed naming a hidden temporary."""
    code, err = cli(capsys, *TRAIN, "--checkpoint", "/proc/c.pt")
    assert code == 2
    line = one_line(err, "/proc/c.pt", "no file can be written in the folder '/proc'")
    assert ".tmp" not in line


def _resave(checkpoint: Path, folder: Path, **changes) -> Path:
    state = torch.load(checkpoint, weights_only=True)
    target = folder / "hand-made.pt"
    torch.save({**state, **changes}, target)
    return target


def _wrong_shapes(state: dict) -> dict:
    name = next(iter(state))
    return {**state, name: torch.zeros(3, 3, 3)}


def _wrong_moment(optimizer: dict) -> dict:
    state = {k: dict(v) for k, v in optimizer["state"].items()}
    first = next(iter(state))
    state[first]["exp_avg"] = torch.zeros(7)
    return {**optimizer, "state": state}


@pytest.mark.parametrize("key, value, words", [
    ("step", "2", ["its step is not a number of steps"]),
    ("step", -1, ["its step is not a number of steps"]),
    ("history", "x", ["its history is not a list of step records"]),
    ("history", [{"loss": 1.0}], ["its history is not a list of step records"]),
    ("evals", None, ["its evals is not a list of eval records"]),
    ("model", [], ["its model is not a dict of tensors"]),
    ("model", {}, ["its model (the model's weights) does not fit this run"]),
    ("model", _wrong_shapes, ["its model (the model's weights) does not fit this run"]),
    ("optimizer", {}, ["its optimizer is not an optimizer state_dict"]),
    ("optimizer", _wrong_moment, ["its optimizer (the optimizer's state) does not fit",
                                  "exp_avg has shape [7]"]),
    ("data_gen", torch.zeros(3), ["its data_gen is not a generator state"]),
    ("data_gen", torch.zeros(3, dtype=torch.uint8), ["its data_gen (the data generator's state)"]),
    ("torch_rng", torch.zeros(5, dtype=torch.uint8), ["its torch_rng (torch's RNG state)"]),
    ("model_cfg", "tiny", ["its model_cfg is not a model config dict"]),
    ("settings", [], ["its settings is not a dict of run settings"]),
])
def test_a_hand_made_checkpoint_with_wrong_values_is_one_line(capsys, tmp_path, checkpoint, key,
                                                              value, words):
    """Right keys, wrong values: each was a traceback (RuntimeError, KeyError, TypeError)."""
    if callable(value):
        value = value(torch.load(checkpoint, weights_only=True)[key])
    bad = _resave(checkpoint, tmp_path, **{key: value})
    code, err = cli(capsys, *TRAIN, "--checkpoint", str(bad), "--resume", "--steps", "3",
                     "--override")
    assert code == 2
    one_line(err, f"checkpoint '{bad}'", *words)


def test_a_sync_free_resume_of_an_eager_checkpoint_says_what_to_type(capsys, tmp_path, checkpoint):
    """It said "Use moe_lab.training.optim.make_optimizer": advice for Python, not the shell."""
    bad = _resave(checkpoint, tmp_path)
    code, err = cli(capsys, *TRAIN, "--checkpoint", str(bad), "--resume", "--steps", "3",
                     "--dispatcher", "dropless", "--step", "sync_free", "--override")
    assert code == 2
    line = one_line(err, "written by the eager step", "the sync_free step", "--step eager")
    assert "make_optimizer" not in line


@pytest.mark.parametrize("make, words", [
    (lambda folder: os.mkfifo(folder / "pipe") or str(folder / "pipe"), ["a named pipe (FIFO)"]),
    (lambda folder: "/dev/zero", ["'/dev/zero' is a character device"]),
    (lambda folder: "", ["--corpus '' is empty"]),
    (lambda folder: str(folder), ["is a directory"]),
])
def test_a_corpus_that_is_no_regular_file_is_named_for_what_it_is(capsys, tmp_path, make, words):
    """A FIFO, /dev/zero and '' were each called "the directory"."""
    if not hasattr(os, "mkfifo") and "FIFO" in words[0]:
        pytest.skip("needs os.mkfifo")
    if words[0].startswith("'/dev/zero'") and not Path("/dev/zero").exists():
        pytest.skip("needs /dev/zero")
    code, err = cli(capsys, *TRAIN, "--corpus", make(tmp_path))
    assert code == 2
    line = one_line(err, "--corpus", *words)
    assert "directory" not in line or words == ["is a directory"]


def test_overwrite_without_a_checkpoint_asks_for_one(capsys):
    code, err = cli(capsys, *TRAIN, "--overwrite")
    assert code == 2
    line = one_line(err, "--overwrite", "needs --checkpoint PATH")
    assert "--resume" not in line


@pytest.mark.skipif(torch.cuda.is_available(), reason="the graphed step runs eagerly without CUDA")
def test_json_reports_the_step_that_ran(capsys):
    """``--step graphed`` on a CPU runs the sync-free step eagerly; --json said "graphed"."""
    assert main([*TRAIN, "--step", "graphed", "--dispatcher", "dropless"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert (out["step"], out["step_requested"]) == ("sync_free", "graphed")


def test_ctrl_c_during_start_up_is_one_line(capsys, monkeypatch):
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(loop, "load_corpus", interrupted)
    code, err = cli(capsys, *TRAIN)
    assert code == 130
    one_line(err, "interrupted before the first step")
