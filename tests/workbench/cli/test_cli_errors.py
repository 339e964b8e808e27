"""The command line facing a hostile but reasonable user: every bad value or file gives one
clear line on stderr naming it, and a nonzero exit — no traceback, no work done first.

Most probes call ``python -m moe_lab``'s ``main`` in this process (an uncaught exception
fails the test, as a traceback would); Ctrl-C needs a real process and a real signal.
"""

from __future__ import annotations

import importlib.util
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from support import cli, one_line

from moe_lab.__main__ import main
from moe_lab.workbench.jsonout import dumps
from moe_lab.workbench.lab.profiles import check_parameters

ROOT = Path(__file__).resolve().parents[3]
TRAIN = ["train", "--steps", "2", "--batch-size", "2", "--eval-every", "0", "--json"]




@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """A two-step training checkpoint, written at the end of the run (no --checkpoint-every)."""
    path = tmp_path_factory.mktemp("ck") / "run.pt"
    assert main([*TRAIN, "--checkpoint", str(path)]) == 0
    return path


def _copy(checkpoint: Path, folder: Path, data: bytes | None = None) -> Path:
    target = folder / "copy.pt"
    target.write_bytes(checkpoint.read_bytes() if data is None else data)
    return target


@pytest.mark.parametrize("argv, words", [
    (["--batch-size", "1000000000000"], ["batch_size=1000000000000", "GiB", "--batch-size"]),
    (["--corpus", "/no/such/corpus.txt"], ["/no/such/corpus.txt", "synthetic"]),
    (["--lr", "inf"], ["lr", "inf", "finite"]),
    (["--lr", "nan"], ["lr", "nan", "finite"]),
    (["--seed", str(2**70)], ["seed", str(2**70), "[0, 4294967295]"]),
    (["--steps", "0"], ["steps", "positive"]),
    (["--override"], ["--override", "--resume"]),
    (["--checkpoint-every", "5"], ["--checkpoint-every", "--checkpoint"]),
    (["--resume"], ["--resume", "--checkpoint"]),
    # Ran and reported "step: sync_free" although the naive dispatcher syncs every expert.
    (["--dispatcher", "naive", "--step", "sync_free"], ["sync-free step", "'naive' syncs the host"]),
    (["--dispatcher", "naive", "--step", "graphed"], ["'naive' syncs the host"]),
])
def test_train_refuses_bad_values_in_one_line(capsys, argv, words):
    code, err = cli(capsys, *TRAIN, *argv)
    assert code == 2
    one_line(err, "error:", *words)


def test_train_refuses_missing_and_unreadable_checkpoints(capsys, tmp_path, checkpoint):
    code, err = cli(capsys, *TRAIN, "--checkpoint", str(tmp_path / "none.pt"), "--resume")
    assert code == 2
    one_line(err, "checkpoint not found", "none.pt")
    size = checkpoint.stat().st_size
    for data, words in [(b"", ["empty"]), (b"garbage\n", ["not a readable checkpoint"]),
                        (checkpoint.read_bytes()[: size // 2], ["not a readable checkpoint"])]:
        bad = _copy(checkpoint, tmp_path, data)
        code, err = cli(capsys, *TRAIN, "--checkpoint", str(bad), "--resume")
        assert code == 2
        line = one_line(err, str(bad), *words)
        assert "weights_only" not in line  # never advise running code from an unknown file
    torch.save(torch.ones(2), tmp_path / "tensor.pt")
    code, err = cli(capsys, *TRAIN, "--checkpoint", str(tmp_path / "tensor.pt"), "--resume")
    one_line(err, "holds a Tensor")


def test_an_existing_file_is_never_overwritten_unasked(capsys, tmp_path, checkpoint):
    """``train --checkpoint PATH`` without --resume replaced whatever was at PATH: an earlier
    run's checkpoint, a text file, the --corpus file itself (exit status 0 each time)."""
    notes = tmp_path / "notes.txt"
    notes.write_text("my notes\n" * 50)
    earlier = _copy(checkpoint, tmp_path)
    for path in (notes, earlier):
        before = path.read_bytes()
        code, err = cli(capsys, *TRAIN, "--checkpoint", str(path))
        assert code == 2
        one_line(err, f"--checkpoint {path} exists", "--resume", "--overwrite")
        assert path.read_bytes() == before
    code, err = cli(capsys, *TRAIN, "--corpus", str(notes), "--checkpoint", str(notes), "--overwrite")
    assert code == 2
    one_line(err, "is the --corpus file")
    assert notes.read_text() == "my notes\n" * 50
    code, err = cli(capsys, *TRAIN, "--checkpoint", str(earlier), "--resume", "--overwrite")
    assert code == 2
    one_line(err, "--overwrite", "--resume")
    assert main([*TRAIN, "--checkpoint", str(notes), "--overwrite"]) == 0  # asked for: replaced
    assert not notes.read_bytes().startswith(b"my notes")
    assert main([*TRAIN, "--checkpoint", str(notes), "--resume", "--steps", "3", "--override"]) == 0


def test_a_directory_as_checkpoint_is_refused_before_training(capsys, tmp_path):
    code, err = cli(capsys, *TRAIN, "--checkpoint", str(tmp_path), "--checkpoint-every", "1")
    assert code == 2
    one_line(err, str(tmp_path), "is a directory")
    assert list(tmp_path.iterdir()) == []  # nothing trained, nothing written


def test_a_diverging_run_stops_naming_the_step_and_the_last_checkpoint(capsys, tmp_path):
    path = tmp_path / "run.pt"
    code, err = cli(capsys, *TRAIN, "--steps", "6", "--lr", "1e30", "--checkpoint", str(path),
                     "--checkpoint-every", "1")
    assert code == 1
    line = one_line(err, "diverged", "at step 2", str(path), "(step 1)")
    assert "nan" in line or "inf" in line
    code, err = cli(capsys, *TRAIN, "--lr", "1e30")
    one_line(err, "at step 2", "no checkpoint was written")


def test_resume_refuses_other_settings_unless_overridden(capsys, tmp_path, checkpoint):
    path = _copy(checkpoint, tmp_path)
    code, err = cli(capsys, *TRAIN, "--checkpoint", str(path), "--resume", "--steps", "4",
                     "--lr", "0.01", "--seed", "3", "--dispatcher", "dropless")
    assert code == 2
    one_line(err, "other settings", "lr 0.003 (now 0.01)", "seed 0 (now 3)",
              "dispatcher 'naive' (now 'dropless')", "--override")
    code = main([*TRAIN, "--checkpoint", str(path), "--resume", "--steps", "4", "--lr", "0.01",
                 "--override"])
    assert code == 0
    out = capsys.readouterr().out.strip().splitlines()[-1]
    assert '"steps": 4' in out


def test_resume_with_nothing_left_to_train_is_an_error(capsys, tmp_path, checkpoint):
    path = _copy(checkpoint, tmp_path)
    for steps in ("1", "2"):
        code, err = cli(capsys, *TRAIN, "--checkpoint", str(path), "--resume", "--steps", steps)
        assert code == 2
        one_line(err, "at step 2", f"steps={steps}", "nothing left to train")


def test_checkpoint_without_every_saves_at_the_end(checkpoint):
    from moe_lab.workbench.training.checkpoint import load_checkpoint

    assert load_checkpoint(checkpoint)["step"] == 2


def test_bench_refuses_bad_values_in_one_line(capsys, tmp_path):
    code, err = cli(capsys, "bench", "time-to-train", "--corpus", str(tmp_path / "missing.txt"),
                     "--target", "1")
    assert code == 2
    one_line(err, "--corpus", "missing.txt", "not a file")
    for argv in (["moe-layer", "--tokens", "0"], ["ep", "--chunks", "0"], ["ep", "--rate-mbit", "0"],
                 ["time-to-train", "--seeds", "0"]):
        with pytest.raises(SystemExit) as stop:  # argparse's refusal: its usage, then one error line
            main(["bench", *argv])
        assert stop.value.code == 2
        err = capsys.readouterr().err
        assert f"argument {argv[1]}: must be a " in err and "got 0" in err and "Traceback" not in err


def test_bench_ep_refuses_fewer_tokens_than_chunks_before_launching_ranks(capsys):
    """``bench ep --tokens 1`` failed on every rank, naming the internal n_chunks."""
    code, err = cli(capsys, "bench", "ep", "--tokens", "1", "--no-link")
    assert code == 2
    one_line(err, "--tokens (1 per rank and micro-batch) must be at least --chunks (4)")
    code, err = cli(capsys, "bench", "ep", "--tokens", "3", "--chunks", "4", "--no-link")
    one_line(err, "--tokens (3", "--chunks (4)")


def test_bench_refuses_an_unknown_provider_before_the_slow_part(capsys, monkeypatch):
    """``--only bogus`` was refused only after the CPU plug-in's build and the ceiling's timing."""
    from moe_lab.workbench.benchmarks import moe_layer

    def slow(*args, **kwargs):
        pytest.fail("timed the ceiling before checking --only")

    monkeypatch.setattr(moe_layer.ceilings, "matmul_peak", slow)
    code, err = cli(capsys, "bench", "moe-layer", "--only", "dropless torch", "bogus")
    assert code == 2
    one_line(err, "--only", "'bogus'", "dropless torch")


def test_bench_keeps_its_result_when_the_ledger_cannot_be_written(capsys, tmp_path, monkeypatch):
    """With a ledger it cannot write, ``bench ... --json`` measured, then threw the JSON away
    in a traceback. Now the JSON is printed, one line says what was not written, status 1."""
    import json

    blocker = tmp_path / "a_file"
    blocker.write_text("")
    monkeypatch.setenv("MOE_LAB_RESULTS_DIR", str(blocker / "results"))  # cannot be created
    code = main(["bench", "router", "--shape", "small", "--tokens", "64", "--min-time", "0", "--json"])
    out, err = capsys.readouterr()
    assert code == 1
    result = json.loads(out)
    assert result["rows"] and all("median_ms" in row for row in result["rows"])
    one_line(err.strip().splitlines(), "error: the ledger", str(blocker / "results"),
              "records are not in it")


def test_train_ep_refuses_bad_values_before_any_process_group(monkeypatch):
    spec = importlib.util.spec_from_file_location("train_ep", ROOT / "scripts" / "train_ep.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    for argv, words in [(["--steps", "0"], ["--steps", "got 0"]),
                        (["--lr", "inf"], ["--lr", "finite"]),
                        (["--seed", str(2**70)], ["--seed"])]:
        with pytest.raises(SystemExit) as stop:
            script.parse_args(argv)
        message = str(stop.value.code)
        assert message.startswith("error:") and "\n" not in message
        assert all(w in message for w in words), message
    # --ep-size 4 on 2 ranks ended in a traceback on every rank, inside the group building.
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(SystemExit) as stop:
        script.parse_args(["--ep-size", "4"])
    assert str(stop.value.code) == ("error: --ep-size must divide the world size 2 (torchrun's "
                                    "--nnodes x --nproc-per-node), got 4")
    script.parse_args(["--ep-size", "2"])


def test_json_output_is_finite():
    text = dumps({"loss": math.nan, "rows": [{"x": math.inf}, (1.5, -math.inf)], "ok": 2})
    assert text == '{"loss": null, "rows": [{"x": null}, [1.5, null]], "ok": 2}'


def test_check_profile():
    check_parameters("smoke", 0, True)
    check_parameters("full", 0, True)
    with pytest.raises(ValueError, match=r"PROFILE must be one of 'smoke', 'full', got 'bogus'"):
        check_parameters("bogus", 0, True)


@pytest.mark.slow
def test_ctrl_c_says_where_the_last_checkpoint_is(tmp_path):
    path = tmp_path / "run.pt"
    env = {**os.environ, "PYTHONHASHSEED": "0"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "moe_lab", *TRAIN, "--steps", "100000", "--checkpoint", str(path),
         "--checkpoint-every", "2"],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        # Ctrl-C reaches it as in a terminal: a suite started in the background (`make test &`)
        # runs with SIGINT ignored, and a child would inherit that.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        deadline = time.monotonic() + 120
        while not path.exists() and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.2)
        assert path.exists(), proc.communicate()[1] if proc.poll() is not None else "no checkpoint"
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130
    one_line(err.strip().splitlines(), "interrupted after step", str(path), "(step ")


@pytest.mark.parametrize("value", ["inf", "nan", "-1", "lots"])
def test_flops_refuses_a_non_finite_or_negative_rate(capsys, value):
    with pytest.raises(SystemExit) as exit_info:
        main(["flops", "--preset", "deepseek_v3", "--tokens-per-s", value, "--json"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "--tokens-per-s: must be a finite number >= 0" in err and "Traceback" not in err


def test_flops_json_is_finite_json(capsys):
    import json

    assert main(["flops", "--preset", "deepseek_v3", "--tokens-per-s", "6338", "--json"]) == 0
    report = json.loads(capsys.readouterr().out, parse_constant=lambda c: pytest.fail(f"not JSON: {c}"))
    assert report["tokens_per_s"] == 6338


@pytest.mark.parametrize("flag, value", [("--link-gbps", "inf"), ("--oversubscription", "nan"),
                                         ("--mb-per-pair", "inf")])
def test_sim_fabric_refuses_a_non_finite_rate(capsys, flag, value):
    """``--link-gbps inf`` ended in a ZeroDivisionError traceback."""
    with pytest.raises(SystemExit) as exit_info:
        main(["sim", "fabric", flag, value])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert f"{flag}: must be a finite number > 0" in err and "Traceback" not in err


def test_sim_fabric_refuses_a_fabric_too_large_to_hold_before_allocating(capsys):
    """``--hosts-per-leaf 100000 --leaves 1000`` tried to allocate petabytes; sizes in between
    really allocated. Refused at once, naming the two flags' product and the limit."""
    import time

    start = time.monotonic()
    code, err = cli(capsys, "sim", "fabric", "--hosts-per-leaf", "100000", "--leaves", "1000")
    assert code == 2 and time.monotonic() - start < 5
    one_line(err, "error:", "100000 x 1000", "4,096 GPUs")
    code, err = cli(capsys, "sim", "fabric", "--hosts-per-leaf", "8", "--leaves", "513")
    assert code == 2
    one_line(err, "8 x 513 = 4104 GPUs")


def test_compile_prints_its_report_when_it_cannot_save_it(capsys, tmp_path, monkeypatch):
    """A read-only (here: impossible) --out and ledger raised after all the compiling was done."""
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    monkeypatch.setenv("MOE_LAB_RESULTS_DIR", str(blocker / "results"))
    code = main(["compile", "--arch", "sm_90", "--modules", "permute", "--out", str(blocker / "out"),
                 "--json"])
    out, err = capsys.readouterr()
    assert code == 1
    import json

    rows = json.loads(out)["rows"]
    assert rows and all(not row.get("error") for row in rows)
    assert f"the report could not be written into {blocker / 'out'}" in err
    assert "error: the ledger" in err and "Traceback" not in err


def test_the_workbook_without_the_notebook_tooling_says_what_to_install(capsys, monkeypatch, tmp_path):
    """moe_lab installs without its notebook tooling (the notebooks extra): the workbook command
    then names what is missing and the install line, and runs nothing."""
    monkeypatch.setitem(sys.modules, "papermill", None)  # as if not installed: find_spec -> None
    code, lines = cli(capsys, "workbook", "--only", "01", "--no-html", "--out", str(tmp_path))
    assert code == 2
    one_line(lines, "workbook: running the notebooks needs papermill", "pip install -e '.[lab]'")
    assert list(tmp_path.iterdir()) == []
