"""Simulators for what one machine cannot run: pipeline schedules and the network fabric.

A training step of DeepSeek-V3 on thousands of GPUs depends on two things a laptop can
only *model*: how the layers are cut into pipeline stages (and how the stages take turns
on micro-batches), and how the expert-parallel all-to-all traffic crosses a leaf-spine
network. Both are simulated here, in plain Python and numpy, and both are checked against
closed forms before they are trusted with anything else.

The pipeline (notebook 10):

- :mod:`moe_lab.sim.layout` — Megatron-style layout strings: parsing, formatting, checking
  that a layout places every layer of a model once.
- :mod:`moe_lab.sim.schedule` — GPipe / 1F1B / interleaved 1F1B schedules as a
  discrete-event simulation, delayed weight gradients, bubbles.
- :mod:`moe_lab.sim.layout_search` — per-layer costs from the FLOPs model, stage and rank
  loads, and a layout search that balances the stages.

The network (notebook 11):

- :mod:`moe_lab.sim.traffic` — GPU × GPU traffic matrices: uniform, MoE dispatch, incast.
- :mod:`moe_lab.sim.fair_share` — max-min fair rates and fluid flow completion times.
- :mod:`moe_lab.sim.fabric` — a two-tier leaf-spine fabric, per-flow ECMP vs per-packet
  adaptive routing, incast with and without sender pacing, balls-into-bins closed forms.

Every figure these modules produce is a projection, not a measurement: record it as
``kind="simulated"`` in the ledger and draw it as such.
"""
