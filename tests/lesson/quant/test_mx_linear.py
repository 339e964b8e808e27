"""MXFP8 linear layers (moe_lab.quant.linear): the three GEMMs of the recipe, the
drop-in contract, a model built with MXFP8 parts and the Transformer Engine gate."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from moe_lab.quant.linear import (
    MXLinear,
    TritonMXLinear,
    make_mxfp8_linear,
    te_mxfp8_status,
)
from moe_lab.quant.mx import quantize


def fq(x: torch.Tensor, dim: int, pad: bool = False) -> torch.Tensor:
    return quantize(x, dim=dim, scale_mode="rceil", pad=pad).dequantize()


def test_forward_and_all_three_gemms_follow_the_recipe():
    gen = torch.Generator().manual_seed(21)
    lin = MXLinear(64, 96)
    with torch.no_grad():
        # Output rows of different magnitudes (as real weights have): a block along the
        # rows and a block along the columns then see different neighbours.
        lin.weight.copy_(torch.randn(96, 64, generator=gen)
                         * torch.randn(96, 1, generator=gen).mul(2).exp2() * 0.1)
        lin.bias.copy_(torch.randn(96, generator=gen))
    x = torch.randn(3, 7, 64, generator=gen, requires_grad=True)  # 21 tokens: not 32
    y = lin(x)
    g = torch.randn(3, 7, 96, generator=gen)
    y.backward(g)
    x2, g2, w = x.detach().reshape(21, 64), g.reshape(21, 96), lin.weight.detach()
    assert torch.equal(y.detach(), (fq(x2, -1) @ fq(w, -1).t() + lin.bias.detach())
                       .reshape(3, 7, 96))
    # dgrad reduces over the outputs: dY row-wise, W column-wise.
    assert torch.equal(x.grad, (fq(g2, -1) @ fq(w, 0)).reshape(3, 7, 64))
    # wgrad reduces over the tokens: dY and X column-wise, zero tokens padding to 32.
    assert torch.equal(lin.weight.grad, fq(g2, 0, pad=True).t() @ fq(x2, 0, pad=True))
    assert torch.equal(lin.bias.grad, g2.sum(0))
    # Reusing W's forward (row-wise) copy for dgrad would give a different gradient.
    assert not torch.equal(x.grad, (fq(g2, -1) @ fq(w, -1)).reshape(3, 7, 64))


def test_close_to_high_precision_linear_and_keeps_dtype():
    gen = torch.Generator().manual_seed(22)
    ref = nn.Linear(128, 64)
    mx = MXLinear.from_linear(ref)
    x = torch.randn(256, 128, generator=gen)
    rel = ((mx(x) - ref(x)).norm() / ref(x).norm()).item()
    assert 1e-3 < rel < 0.05  # quantized (not equal), yet close
    bf = MXLinear(64, 32, dtype=torch.bfloat16)
    xb = torch.randn(4, 64, dtype=torch.bfloat16, requires_grad=True)
    out = bf(xb)
    out.sum().backward()
    assert out.dtype == torch.bfloat16 and xb.grad.dtype == torch.bfloat16
    assert bf.weight.grad.dtype == torch.bfloat16


def test_from_linear_shares_parameters_and_state_dict():
    ref = nn.Linear(64, 32, bias=False)
    mx = MXLinear.from_linear(ref)
    assert mx.weight is ref.weight and mx.bias is None
    assert set(mx.state_dict()) == set(ref.state_dict()) == {"weight"}
    fresh = MXLinear(64, 32, bias=False)
    fresh.load_state_dict(ref.state_dict())
    x = torch.randn(5, 64)
    assert torch.equal(fresh(x), mx(x))
    assert isinstance(mx, nn.Linear) and "mxfp8=emulated" in repr(mx)


def test_feature_dims_must_be_multiples_of_32():
    with pytest.raises(ValueError, match=r"in_features must be a multiple of 32 \(an MX block\), got 48"):
        MXLinear(48, 64)
    with pytest.raises(ValueError, match=r"out_features must be a multiple of 32 \(an MX block\), got 10"):
        MXLinear.from_linear(nn.Linear(64, 10))
    with pytest.raises(ValueError, match="x's last dim must be in_features=64"):
        MXLinear(64, 32)(torch.randn(2, 32))


def test_empty_batch():
    lin = MXLinear(32, 32)
    x = torch.randn(0, 32, requires_grad=True)
    y = lin(x)
    y.sum().backward()
    assert y.shape == (0, 32) and torch.equal(lin.weight.grad, torch.zeros(32, 32))


# ------------------------------------------------------------------------- a model in MXFP8


def _tiny_model(**names):
    from moe_lab.config import preset
    from moe_lab.model import MoETransformer

    torch.manual_seed(0)
    return MoETransformer(preset("tiny"), **names)


@pytest.mark.parametrize("targets", [("attention",), ("experts",), ("attention", "experts")])
def test_mxfp8_impls_switch_only_the_targets(targets):
    model = _tiny_model(mxfp8=targets)
    in_attention = "attention" in targets
    for block in model.blocks:
        assert isinstance(block.attn.qkv, MXLinear) == in_attention
        assert isinstance(block.attn.out, MXLinear) == in_attention
        assert block.attn.attention_impl == ("mxfp8" if in_attention else "sdpa")
        assert block.ffn.experts.quant == ("mxfp8" if "experts" in targets else None)
    assert type(model.lm_head) is nn.Linear  # outside attention: untouched


def test_mxfp8_impls_reject_what_they_cannot_do():
    from moe_lab.config import ModelImpls

    with pytest.raises(ValueError, match="ModelImpls.mxfp8 must be one of"):
        ModelImpls(mxfp8=("router",))
    assert ModelImpls(mxfp8="experts").mxfp8 == ("experts",)
    with pytest.raises(ValueError, match="backend must be one of"):
        make_mxfp8_linear(nn.Linear(64, 64), backend="cutlass")


def test_transformer_engine_gate_says_why():
    ok, why = te_mxfp8_status()
    if ok:
        pytest.skip("Transformer Engine MXFP8 is available here; the emulation gate is moot")
    assert why  # a reason, e.g. "transformer_engine is not installed"
    with pytest.raises(RuntimeError, match="Transformer Engine MXFP8 backend unavailable: "):
        make_mxfp8_linear(nn.Linear(64, 64), backend="te")
    auto = make_mxfp8_linear(nn.Linear(64, 64), backend="auto")
    assert isinstance(auto, MXLinear) and auto.backend == "emulated"


def test_mxfp8_on_the_model():
    idx = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        before = _tiny_model()(idx, idx)
    base, base_logits = before.lm_loss.item(), before.logits
    model = _tiny_model(mxfp8=("attention", "experts"))  # the same weights, seeded alike
    attn = [m for m in model.modules() if type(m).__name__ == "Attention"]
    assert attn and all(isinstance(m.qkv, MXLinear) and m.attention_impl == "mxfp8"
                        for m in attn)
    out = model(idx, idx)
    out.loss.backward()
    assert out.lm_loss.item() != base
    # The logits, not the loss (about log(vocab) at initialisation whatever the MoE does):
    # E4M3 keeps 3 mantissa bits, and attention and experts both round, so the error is
    # large, yet a model whose MoE outputs are zeroed lies well outside the bound.
    rms = lambda t: t.pow(2).mean().sqrt()  # noqa: E731
    bound = 0.5 * rms(base_logits)
    assert rms(out.logits.detach() - base_logits) <= bound
    hooks = [m.register_forward_hook(lambda mod, args, result: (result[0] * 0, *result[1:]))
             for m in model.modules() if type(m).__name__ == "MoELayer"]
    with torch.no_grad():
        wrong = model(idx, idx).logits
    for hook in hooks:
        hook.remove()
    assert hooks and rms(wrong - base_logits) > 2 * bound
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)


def test_per_layer_error_stats_on_the_model():
    model_mod = pytest.importorskip("moe_lab.model")
    from moe_lab.attention import ATTENTION_IMPLS
    from moe_lab.config import preset
    from moe_lab.quant.linear import mx_layer_error_stats

    torch.manual_seed(0)
    cfg = preset("tiny")
    model = model_mod.MoETransformer(cfg)
    idx = torch.randint(0, 256, (2, 32))
    with torch.no_grad():
        before = model(idx).logits
    impls = dict(ATTENTION_IMPLS)
    rows = mx_layer_error_stats(model, idx)
    seen = {(r["layer"], r["tensor"]) for r in rows}
    for i in range(cfg.n_layers):
        for tensor in ("q", "k", "v", "p", "output"):
            assert (f"attention{i}.core", tensor) in seen
        assert (f"attention{i}.qkv", "input") in seen and (f"attention{i}.out", "weight") in seen
    assert ("experts0", "w_gate_up") in seen
    assert all(0 < r["rel_error"] < 0.1 for r in rows)
    assert all(r["saturated"] == 0 for r in rows)  # rceil never saturates finite values
    assert ATTENTION_IMPLS == impls
    assert all(m.attention_impl == "sdpa" for m in model.modules()
               if type(m).__name__ == "Attention")
    with torch.no_grad():
        assert torch.equal(model(idx).logits, before)


# ------------------------------------------------------------------ Triton (tl.dot_scaled)


def _pair(in_f: int, out_f: int, dtype: torch.dtype, device, gen: torch.Generator):
    ref = MXLinear(in_f, out_f, dtype=dtype, device=device)
    with torch.no_grad():
        ref.weight.copy_((torch.randn(out_f, in_f, generator=gen)
                          * torch.randn(out_f, 1, generator=gen).mul(2).exp2() * 0.1).to(dtype))
        ref.bias.copy_(torch.randn(out_f, generator=gen).to(dtype))
    tri = TritonMXLinear(in_f, out_f, dtype=dtype, device=device)
    tri.load_state_dict(ref.state_dict())
    return ref, tri


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [21, 64, 1])
def test_triton_backend_equals_the_emulated_recipe(dtype, tokens, device):
    # Same quantizer bits (the kernel is bit-identical to the reference), same exact
    # products: the three GEMMs agree up to float32 summation order.
    gen = torch.Generator().manual_seed(tokens)
    ref, tri = _pair(64, 96, dtype, device, gen)
    x = torch.randn(tokens, 64, generator=gen).to(device, dtype)
    g = torch.randn(tokens, 96, generator=gen).to(device, dtype)
    outs = []
    for lin in (ref, tri):
        xi = x.clone().requires_grad_()
        y = lin(xi)
        y.backward(g)
        outs.append((y.detach(), xi.grad, lin.weight.grad, lin.bias.grad))
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 1e-2, "atol": 1e-2}
    for name, want, got in zip(("y", "dx", "dw", "db"), *outs, strict=True):
        assert got.dtype == want.dtype, name
        torch.testing.assert_close(got, want, **tol, msg=lambda m, n=name: f"{n}: {m}")


def test_triton_backend_edge_cases(device):
    gen = torch.Generator().manual_seed(5)
    ref, tri = _pair(32, 64, torch.float32, device, gen)
    # Non-contiguous and batched input.
    x = torch.randn(2, 64, 5, generator=gen).to(device).transpose(1, 2)[..., :32]
    torch.testing.assert_close(tri(x), ref(x), rtol=1e-5, atol=1e-5)
    # No tokens: an empty output, a zero weight gradient.
    empty = torch.randn(0, 32, device=device, requires_grad=True)
    out = tri(empty)
    out.sum().backward()
    assert out.shape == (0, 64) and torch.equal(tri.weight.grad, torch.zeros_like(tri.weight))
    # A NaN input stays in its token's row.
    x = torch.randn(4, 32, generator=gen).to(device)
    x[2, 7] = float("nan")
    y = tri(x)
    assert torch.isnan(y[2]).all() and not torch.isnan(y[[0, 1, 3]]).any()
    with pytest.raises(ValueError, match="last dim must be in_features=32"):
        tri(torch.randn(4, 48, device=device))
    with pytest.raises(ValueError, match="x.dtype must be"):
        tri(torch.randn(4, 32, device=device, dtype=torch.float64))
    assert make_mxfp8_linear(nn.Linear(32, 32), backend="triton").backend == "triton"


def test_triton_backend_bias_only_gradient(device):
    # Only the bias needs a gradient: dY is quantized neither way, and the bias gradient is
    # the emulation's.
    gen = torch.Generator().manual_seed(6)
    ref, tri = _pair(32, 64, torch.float32, device, gen)
    x = torch.randn(7, 32, generator=gen).to(device)
    g = torch.randn(7, 64, generator=gen).to(device)
    for lin in (ref, tri):
        lin.weight.requires_grad_(False)
        lin(x).backward(g)
    assert tri.weight.grad is None
    assert torch.equal(tri.bias.grad, ref.bias.grad)


def _caps(**fields):
    from moe_lab.perf.capabilities import Capabilities

    base = dict(device="cuda", device_name="NVIDIA B200", n_threads=16, cuda_capability=(10, 0),
                n_devices=1, triton_mode="compiled", transformer_engine=False, native_mxfp8=True,
                has_grouped_mm=True)
    return Capabilities(**{**base, **fields})


@pytest.mark.parametrize("fields, native, backend, targets", [
    ({}, True, "triton", ("attention",)),  # Blackwell, compiled Triton, no TE
    ({"cuda_capability": (9, 0), "native_mxfp8": False, "device_name": "NVIDIA H200"}, False,
     "emulated", ()),  # Hopper: tl.dot_scaled would upcast, MXFP8 stays off
    ({"device": "cpu", "cuda_capability": None, "triton_mode": "interpreted", "native_mxfp8": False},
     False, "emulated", ()),
])
def test_auto_picks_the_triton_gemm_only_where_it_is_native(monkeypatch, fields, native, backend, targets):
    from moe_lab.quant import linear
    from moe_lab.workbench.benchmarks.ttt import stacks

    caps = _caps(**fields)
    monkeypatch.setattr(linear, "capabilities", lambda: caps)
    monkeypatch.setattr(stacks, "capabilities", lambda: caps)
    ok, why = linear.triton_mxfp8_status()
    assert ok == native and why
    assert make_mxfp8_linear(nn.Linear(32, 32), backend="auto").backend == backend
    chosen, note = stacks._mxfp8_targets(torch.device(caps.device))
    assert chosen == targets and ("tl.dot_scaled" in note) == native
