"""The known-harmless third-party messages (`moe_lab.workbench.quiet`): silenced while the import
that triggers them runs, and nothing else."""

from __future__ import annotations

import logging

from moe_lab.workbench import quiet

SO_NOTE = ("Failed to load /venv/site-packages/torchao/_C_mxfp8.cpython-310-x86_64-linux-gnu.so: "
           "Could not load this library")
ENUM_NOTE = ("<enum 'KernelPreference'> is an Enum subclass and is now natively supported by "
             "torch.compile as an opaque value type. Calling register_constant() on Enum "
             "subclasses is deprecated and will be an error in a future release.")


def test_the_known_records_are_dropped_inside_the_block_only(caplog):
    with caplog.at_level(logging.WARNING):
        with quiet.library_notes_silenced():
            logging.getLogger("torchao").warning(SO_NOTE)
            logging.getLogger("torch.utils._pytree").warning(ENUM_NOTE)
            logging.getLogger("torchao").warning("torchao: something else")
        assert [r.getMessage() for r in caplog.records] == ["torchao: something else"]
        logging.getLogger("torchao").warning(SO_NOTE)  # outside the block it shows again
    assert caplog.records[-1].getMessage() == SO_NOTE
    assert not logging.getLogger("torchao").filters
    assert not logging.getLogger("torch.utils._pytree").filters


def test_only_the_known_lines_are_taken_out_of_text():
    text = (f"{SO_NOTE}\nW1202 torch/utils/_pytree.py:630] {ENUM_NOTE}\n"
            "[W1202 socket.cpp:207] [c10d] The hostname of the client socket cannot be retrieved. err=-3\n"
            "moe_lab: a warning of our own\n")
    assert quiet.without_known_lines(text) == "moe_lab: a warning of our own\n"
    assert quiet.without_known_lines("Failed to load /x/mylib.so\n") == "Failed to load /x/mylib.so\n"
    marks = ("USDT:2026-12-06 07:51:07 3394:3394 SyncActivityProfilerHandler.cpp:52] profiler_start\n"
             "USDT:2026-12-06 07:51:07 3394:3394 SyncActivityProfilerHandler.cpp:59] profiler_stop\n")
    assert quiet.without_known_lines(marks) == ""
    other = "USDT:2026-12-06 07:51:07 3394:3394 Other.cpp:1] profiler_start failed\n"
    assert quiet.without_known_lines(marks + other) == other
