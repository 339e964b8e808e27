"""Simulators for what one machine cannot run: pipeline schedules and the network fabric.

A training step of DeepSeek-V3 on thousands of GPUs depends on two things a laptop can
only *model*: how the layers are cut into pipeline stages (and how the stages take turns
on micro-batches), and how the expert-parallel all-to-all traffic crosses a leaf-spine
network. Both are simulated here, in plain Python and numpy, and both are checked against
closed forms before they are trusted with anything else:

- :mod:`moe_lab.sim.pipeline` — Megatron-style layout strings, GPipe / 1F1B / interleaved
  1F1B schedules as a discrete-event simulation, delayed weight gradients, and a layout
  search that balances the stages (notebook 08).
- :mod:`moe_lab.sim.fabric` — a two-tier leaf-spine fabric, per-flow ECMP vs per-packet
  adaptive routing, max-min fair rates, flow completion times and incast with and without
  sender pacing (notebook 09).

Every figure these modules produce is a projection, not a measurement: record it as
``kind="simulated"`` in the ledger and draw it as such.
"""

from __future__ import annotations

__all__ = ["pipeline", "fabric"]
