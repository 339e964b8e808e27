"""moe_lab: build a Mixture-of-Experts transformer step by step and measure every gain.

The lesson — config, model, attention, data, ``moe/``, ``kernels/``, ``quant/``,
``training/``, ``parallel/``, ``sim/``, ``perf/`` — is what this package holds; the
machinery that runs, times and shows it, and the bridge to Hugging Face models
(`moe_lab.workbench.interop`), is `moe_lab.workbench`, which the lesson never imports.

Importing moe_lab changes nothing in the caller's process: it starts no subprocess, sets no
environment variable and imports neither torch nor Triton. Whether moe_lab's own Triton
kernels run compiled or under Triton's interpreter (no CUDA device) is decided where they
are defined (`moe_lab.kernels`), for them alone.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # what an editor or a type checker sees; at run time each name loads on first use
    from moe_lab.config import ModelConfig, MoEConfig, preset
    from moe_lab.model import MoETransformer
    from moe_lab.moe.layer import MoELayer

__all__ = ["MoEConfig", "ModelConfig", "preset", "MoELayer", "MoETransformer"]
__version__ = "0.1.0"


# Where each top-level name lives, imported on first use: `import moe_lab` stays cheap (no
# torch) until a layer or a model is asked for.
_LAZY = {"MoEConfig": "moe_lab.config", "ModelConfig": "moe_lab.config", "preset": "moe_lab.config",
         "MoELayer": "moe_lab.moe.layer", "MoETransformer": "moe_lab.model"}


def __getattr__(name: str) -> object:
    if name not in _LAZY:
        raise AttributeError(f"module 'moe_lab' has no attribute {name!r}")
    return getattr(importlib.import_module(_LAZY[name]), name)
