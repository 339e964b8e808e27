"""What the hardware can do, and what a model asks of it: the capability probe, the GPUs'
datasheet figures, their architectures' features and the roofline, training FLOPs and MFU,
and the bytes and launches that fusing moves out of an MoE layer.

- `capabilities` — this machine, probed on first use (``moe_lab.perf.capabilities``);
- ``hardware`` — datasheet figures of A100/L4/H200/B200/GB300, what each GPU
  architecture a learner may have (sm_75 … sm_100) offers the kernels, the roofline;
- ``flops`` — training FLOPs per token, TFLOPS per GPU, MFU;
- ``fusion`` — bytes and launches per MoE layer, unfused and fused.

Measuring (timers, the ledger, ceilings, profiles) is the workbench's:
`moe_lab.workbench.measure`.
"""

from __future__ import annotations

# The function `capabilities` shares its name with its submodule; binding it here, after the
# submodule's import, keeps ``moe_lab.perf.capabilities`` meaning the function however the
# submodule is imported later. Importing it probes nothing: the probe runs on first call.
from moe_lab.perf.capabilities import capabilities as capabilities
