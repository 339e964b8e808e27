"""Aux-loss-free load balancing: a per-expert bias, nudged after every step (DeepSeek-V3).

An auxiliary loss balances experts by pushing the router's *probabilities* towards uniform,
and so fights the language-model loss for the same parameters. DeepSeek-V3 balances with
a bias instead: each router keeps ``expert_bias: [E]``, added to the scores for choosing
the top-k only (the weights that multiply the experts' outputs stay the unbiased scores),
and after every optimizer step each expert's bias moves by a fixed amount towards balance:

    bias_e += rate · sign(mean_load − load_e)

An overloaded expert becomes a little less attractive, an idle one a little more. Nothing
is differentiated and nothing is read back to the host: the loads are the routers' own
``tokens_per_expert`` counts, on the device. (Megatron-Core:
``--moe-router-enable-expert-bias`` with ``--moe-router-bias-update-rate``.)

`update_expert_bias` is the update. `ExpertBiasBalancer` applies it inside
`moe_lab.workbench.training.loop.train` through its ``callback``
(`moe_lab.workbench.demos.balancing.compare_balancing` trains the same model three ways — no
balancing, an auxiliary loss, the bias — and returns what each did).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
import torch.nn as nn

from moe_lab.checks import positive_number
from moe_lab.moe.layer import MoELayer

Tensor = torch.Tensor


def update_expert_bias(model_or_layers: nn.Module | Iterable[nn.Module],
                       tokens_per_expert: Tensor | Sequence[Tensor] | Sequence[Sequence[int]],
                       rate: float) -> None:
    """``bias_e += rate · sign(mean_load − load_e)`` for every router, in place.

    ``model_or_layers``: a model with ``moe_layers`` (an ``MoETransformer``), or an iterable
    of MoE layers or of routers. ``tokens_per_expert``: one ``[E]`` load per router, as a
    ``[n_routers, E]`` tensor or a sequence (of tensors, or of lists of ints). Device tensors
    (``MoEStats.tokens_per_expert``) keep the update free of host syncs. Call it after the
    optimizer step, with the loads of the step just taken.
    """
    positive_number(rate, "rate")
    layers = getattr(model_or_layers, "moe_layers", model_or_layers)
    routers = [getattr(layer, "router", layer) for layer in layers]
    if len(tokens_per_expert) != len(routers):
        raise ValueError(f"tokens_per_expert must hold one load per router ({len(routers)}), "
                         f"got {len(tokens_per_expert)}")
    with torch.no_grad():
        for router, load in zip(routers, tokens_per_expert, strict=True):
            bias = router.expert_bias
            load = torch.as_tensor(load, device=bias.device).to(bias.dtype)
            if load.shape != bias.shape:
                raise ValueError(f"each load must be [n_experts={bias.shape[0]}], got "
                                 f"{tuple(load.shape)}")
            bias.add_(torch.sign(load.mean() - load), alpha=rate)


def load_imbalance(tokens_per_expert: Tensor) -> Tensor:
    """``max load / mean load`` over the last dim (1.0 is perfect balance)."""
    load = tokens_per_expert.float()
    return load.amax(dim=-1) / load.mean(dim=-1).clamp_min(1e-9)


class ExpertBiasBalancer:
    """Aux-loss-free balancing for `moe_lab.workbench.training.loop.train`, as its ``callback``::

        with ExpertBiasBalancer(rate=1e-3) as balancer:
            result = train(model_cfg, cfg, callback=balancer)

    While the ``with`` block is open, a global forward hook notes every ``MoELayer`` that
    runs in training mode and sums its ``tokens_per_expert`` (on the device; the hook reads
    nothing back). ``train`` calls the balancer after each optimizer step, which updates
    every noted layer's bias with the loads summed since the last step. Evaluation
    forwards (``model.eval()``) are not counted.
    """

    def __init__(self, rate: float) -> None:
        self.rate = positive_number(rate, "rate")
        self._loads: dict[MoELayer, Tensor] = {}  # keyed by the module itself (by identity)
        self.updates = 0

    def _hook(self, module: nn.Module, inputs: tuple, output: tuple) -> None:
        if isinstance(module, MoELayer) and module.training:
            self._loads[module] = self._loads.get(module, 0) + output[1].tokens_per_expert.detach()

    def __enter__(self) -> ExpertBiasBalancer:
        self._handle = nn.modules.module.register_module_forward_hook(self._hook)
        return self

    def __exit__(self, *exc: object) -> None:
        self._handle.remove()

    def __call__(self, step: int, record: dict | None = None) -> None:
        if self._loads:
            update_expert_bias(list(self._loads), list(self._loads.values()), self.rate)
            self.updates += 1
        self._loads.clear()
