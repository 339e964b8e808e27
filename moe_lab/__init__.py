"""moe_lab: build a Mixture-of-Experts transformer step by step and measure every gain.

Importing moe_lab on a machine without CUDA sets ``TRITON_INTERPRET=1`` (unless the user
set it) before Triton is imported anywhere, so every Triton kernel runs on the CPU under
Triton's interpreter. That is a fallback and it is labelled as one wherever it is used
(``moe_lab.perf.capabilities()``).
"""

from __future__ import annotations

import os
import shutil
import subprocess


def _cuda_present() -> bool:
    # Decided before torch is imported: torch may import triton, which reads the flag once.
    if os.environ.get("CUDA_VISIBLE_DEVICES", None) == "":
        return False
    if shutil.which("nvidia-smi") is None:
        return False
    try:
        return subprocess.run(["nvidia-smi", "-L"], capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


if "TRITON_INTERPRET" not in os.environ and not _cuda_present():
    os.environ["TRITON_INTERPRET"] = "1"

from moe_lab.config import ModelConfig, MoEConfig, preset  # noqa: E402

__all__ = ["MoEConfig", "ModelConfig", "preset", "MoELayer", "MoETransformer"]
__version__ = "0.1.0"


def __getattr__(name: str):
    # Lazy: `import moe_lab` stays cheap and never imports torch before the flag is set.
    if name == "MoELayer":
        from moe_lab.moe.layer import MoELayer

        return MoELayer
    if name == "MoETransformer":
        from moe_lab.model import MoETransformer

        return MoETransformer
    raise AttributeError(f"module 'moe_lab' has no attribute {name!r}")
