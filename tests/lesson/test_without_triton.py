"""Where Triton cannot be installed (macOS, Windows: Triton publishes Linux wheels only),
moe_lab imports and everything that needs no Triton kernel runs; each name that needs one is
refused at the door, saying what it needs and where to get it.

Triton is hidden from a child process (`support.without_triton`), which runs the checks below
and prints what it found; this process stays as it is."""

import json
import subprocess
import sys

from support import without_triton

CHECKS = r"""
import importlib.util, json, sys
import torch

out = {"triton_spec": importlib.util.find_spec("triton") is not None}
try:
    import triton
    out["import_triton"] = "imported"
except ImportError as e:
    out["import_triton"] = type(e).__name__

import moe_lab
from moe_lab import MoELayer, MoETransformer, preset
from moe_lab.registry import TRITON_MISSING
from moe_lab.moe.router import route
from moe_lab.quant import mx

out["missing"] = TRITON_MISSING
cfg = preset("tiny")
torch.manual_seed(0)

# The dropless layer on the torch backend equals the naive loop, forward and backward.
x = torch.randn(48, cfg.moe.d_model)
layers = {name: MoELayer(cfg.moe, dispatcher=d, expert_backend=b)
          for name, (d, b) in {"dropless": ("dropless", "torch"), "naive": ("naive", "loop")}.items()}
layers["naive"].load_state_dict(layers["dropless"].state_dict())
grads, outs = {}, {}
for name, layer in layers.items():
    xi = x.clone().requires_grad_()
    outs[name] = layer(xi)[0]
    outs[name].square().sum().backward()
    grads[name] = xi.grad
torch.testing.assert_close(outs["dropless"], outs["naive"], rtol=1e-5, atol=1e-5)
torch.testing.assert_close(grads["dropless"], grads["naive"], rtol=1e-5, atol=1e-5)
out["layer"] = list(outs["dropless"].shape)

# The reference router: k distinct experts per token, weights renormalized.
routed = route(x, layers["dropless"].router.weight, cfg.moe)
ids = routed.topk_ids
out["router_distinct"] = bool((ids.sort(-1).values.diff(dim=-1) != 0).all())
out["router_weights_sum"] = routed.topk_weights.sum(-1).sub(1).abs().max().item()

# The MX reference: a round trip within MXFP8's half-step of each block's scale.
v = torch.randn(4, 64)
back = mx.quantize(v).dequantize()
out["mx_rel_err"] = ((back - v).norm() / v.norm()).item()

# A whole model, forward and backward, on the portable stack.
model = MoETransformer(cfg, dispatcher="dropless", expert_backend="torch")
tokens = torch.randint(0, cfg.vocab_size, (2, 16))
loss = model(tokens, targets=tokens).loss
loss.backward()
out["model_loss_finite"] = bool(torch.isfinite(loss))

# Each name that needs Triton is refused at the door, with the reason.
refused = {}
for what, make in {
    "expert_backend": lambda: MoELayer(cfg.moe, dispatcher="dropless", expert_backend="triton"),
    "dispatcher": lambda: MoELayer(cfg.moe, dispatcher="fused"),
    "router_impl": lambda: MoELayer(cfg.moe, router_impl="triton"),
    "attention_impl": lambda: MoETransformer(cfg, attention_impl="mxfp8_triton"),
}.items():
    try:
        make()
        refused[what] = None
    except ValueError as e:
        refused[what] = str(e)
out["refused"] = refused
# The machine says so, and the router benchmark leaves the fused router out, saying why.
from moe_lab.perf.capabilities import capabilities
from moe_lab.workbench.benchmarks.router import build_providers

out["triton_mode"] = capabilities().triton_mode
providers, notes = build_providers(cfg.moe)
out["bench_providers"], out["bench_notes"] = sorted(providers), notes
out["triton_in_modules"] = sys.modules.get("triton", "absent") is None
print(json.dumps(out))
"""


def test_moe_lab_runs_without_triton_and_refuses_only_what_needs_it(tmp_path):
    env = without_triton(tmp_path / "hide")
    done = subprocess.run([sys.executable, "-c", CHECKS], env=env, cwd=tmp_path, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["triton_spec"] is False and out["import_triton"] == "ModuleNotFoundError"
    assert "needs Triton, which installs on Linux only" in out["missing"]
    assert "Where to run it" in out["missing"]
    assert out["layer"] == [48, 64]
    assert out["router_distinct"] and out["router_weights_sum"] < 1e-5
    assert 0 < out["mx_rel_err"] < 0.05
    assert out["model_loss_finite"]
    for what, message in out["refused"].items():
        assert message is not None, f"{what} that needs Triton was accepted"
        assert message.startswith(f"{what} must be one of"), message
        assert "is not available here: it needs Triton" in message, message
    assert out["triton_mode"] == "absent"
    assert not any("triton" in name for name in out["bench_providers"]), out["bench_providers"]
    assert any("Triton is not installed here" in note for note in out["bench_notes"]), out["bench_notes"]
    assert out["triton_in_modules"], "something replaced the hidden Triton"
