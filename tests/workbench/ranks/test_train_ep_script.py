"""``scripts/train_ep.py`` run without torchrun says how to launch it, in one line (issue 47:
it ended in a traceback from ``init_process_group``)."""

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]


def test_train_ep_without_torchrun_says_how_to_launch_it(monkeypatch):
    spec = importlib.util.spec_from_file_location("train_ep", ROOT / "scripts" / "train_ep.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with pytest.raises(SystemExit) as stop:
        script.main(["--preset", "tiny", "--steps", "3"])
    message = str(stop.value.code)
    assert "\n" not in message
    assert message.startswith("error: scripts/train_ep.py runs one process per rank, started by "
                              "torchrun (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT not set)"), message
    assert message.endswith(": torchrun --standalone --nproc_per_node=2 scripts/train_ep.py "
                            "--preset tiny --steps 3"), message
