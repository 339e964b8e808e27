"""The MoE layer and the model under ``torch.autocast("cpu", dtype=torch.bfloat16)``.

Under autocast the router computes in its own dtype (fp32 here), the dispatcher and the
experts run on bf16 tokens against fp32 master weights, the shared expert runs under
autocast, and the aux / z losses stay float32. Every check compares against the fp32 layer
(or model) with the same weights and input.
"""

import pytest
import torch

from moe_lab.attention import causal_attention
from moe_lab.config import MoEConfig, preset
from moe_lab.model import MoETransformer
from moe_lab.moe.layer import MoELayer

BF16 = torch.bfloat16
HAS_GROUPED_MM = hasattr(torch, "_grouped_mm")

# (dispatcher, expert_backend); "triton" is left out: it runs interpreted on a CPU.
CASES = [
    ("naive", "loop"),
    ("capacity", "loop"),
    ("dropless", "loop"),
    pytest.param("dropless", "torch", marks=pytest.mark.skipif(
        not HAS_GROUPED_MM, reason="torch._grouped_mm is not available")),
]


def cfg(**kw):
    # capacity_factor = n_experts / top_k: every expert has a slot for every token.
    base = dict(n_experts=8, top_k=2, d_model=32, d_expert=16, n_shared_experts=1,
                capacity_factor=4.0)
    base.update(kw)
    return MoEConfig(**base)


def autocast():
    return torch.autocast("cpu", dtype=BF16)


def rel_err(a, b):
    a, b = a.detach().float(), b.detach().float()
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


@pytest.mark.parametrize("dispatcher,backend", CASES)
def test_forward_matches_fp32(dispatcher, backend):
    layer = MoELayer(cfg(), dispatcher, backend)
    x = torch.randn(24, 32)
    y32, s32 = layer(x)
    with autocast():
        y, s = layer(x)
    assert y32.dtype == torch.float32
    assert y.dtype == BF16 and y.shape == x.shape
    assert torch.equal(s.routing.topk_ids, s32.routing.topk_ids)  # the router stays fp32
    assert s.routing.logits.dtype == torch.float32
    assert torch.equal(s.routing.logits, s32.routing.logits)
    assert int(s.dropped_tokens) == 0 == int(s32.dropped_tokens)
    assert rel_err(y, y32) < 2e-2


@pytest.mark.parametrize("dispatcher,backend", CASES)
def test_bf16_input_under_autocast(dispatcher, backend):
    """bf16 tokens are accepted under autocast; the router sees them upcast to fp32."""
    layer = MoELayer(cfg(), dispatcher, backend)
    x = torch.randn(24, 32).to(BF16)
    y32, s32 = layer(x.float())
    with autocast():
        y, s = layer(x)
    assert y.dtype == BF16
    assert torch.equal(s.routing.topk_ids, s32.routing.topk_ids)
    assert rel_err(y, y32) < 2e-2


@pytest.mark.parametrize("dispatcher,backend", CASES)
def test_backward_matches_fp32(dispatcher, backend):
    layer = MoELayer(cfg(), dispatcher, backend)
    x = torch.randn(24, 32)
    dy = torch.randn(24, 32)
    y32, _ = layer(x)
    y32.backward(dy)
    ref = {n: p.grad.clone() for n, p in layer.named_parameters()}
    layer.zero_grad(set_to_none=True)
    with autocast():
        y, _ = layer(x)
    # An explicit gradient, not y.float().sum() (the CPU grouped GEMM refuses stride-0 grads).
    y.backward(dy.to(y.dtype))
    assert set(ref) == {n for n, p in layer.named_parameters() if p.grad is not None}
    for name, p in layer.named_parameters():
        assert p.grad.dtype == torch.float32, name
        assert torch.isfinite(p.grad).all(), name
        assert rel_err(p.grad, ref[name]) < 5e-2, (name, rel_err(p.grad, ref[name]))


@pytest.mark.parametrize("dispatcher,backend", CASES)
def test_input_grad_under_autocast(dispatcher, backend):
    layer = MoELayer(cfg(), dispatcher, backend)
    x = torch.randn(24, 32, requires_grad=True)
    dy = torch.randn(24, 32)
    layer(x)[0].backward(dy)
    ref = x.grad.clone()
    x.grad = None
    with autocast():
        y, _ = layer(x)
    y.backward(dy.to(y.dtype))
    assert x.grad.dtype == torch.float32 and torch.isfinite(x.grad).all()
    assert rel_err(x.grad, ref) < 5e-2


@pytest.mark.parametrize("dispatcher,backend", CASES)
def test_losses_stay_fp32(dispatcher, backend):
    layer = MoELayer(cfg(z_loss_coef=1e-3), dispatcher, backend)
    x = torch.randn(24, 32)
    _, s32 = layer(x)
    with autocast():
        _, s = layer(x)
    assert s.aux_loss.dtype == torch.float32 and s.z_loss.dtype == torch.float32
    assert torch.equal(s.aux_loss, s32.aux_loss) and torch.equal(s.z_loss, s32.z_loss)


def test_fp16_input_under_bf16_autocast_raises():
    layer = MoELayer(cfg(), "dropless")
    with autocast(), pytest.raises(ValueError, match=r"float16.*float32.*bfloat16"):
        layer(torch.randn(8, 32, dtype=torch.float16))


def test_fp64_input_to_fp32_layer_raises():
    layer = MoELayer(cfg(), "dropless")
    with pytest.raises(ValueError, match=r"float64.*float32"):
        layer(torch.randn(8, 32, dtype=torch.float64))


@pytest.mark.parametrize("dispatcher,backend", CASES)
def test_noncontiguous_input_under_autocast(dispatcher, backend):
    layer = MoELayer(cfg(), dispatcher, backend)
    xt = torch.randn(32, 24).t()  # [24, 32], non-contiguous
    x3 = torch.randn(6, 4, 32).transpose(0, 1)  # [4, 6, 32], non-contiguous
    assert not xt.is_contiguous() and not x3.is_contiguous()
    with autocast():
        for x in (xt, x3, xt.to(BF16)):
            y, s = layer(x)
            y_ref, s_ref = layer(x.contiguous())
            assert y.shape == x.shape and y.dtype == BF16
            assert torch.equal(s.routing.topk_ids, s_ref.routing.topk_ids)
            torch.testing.assert_close(y, y_ref)


def test_model_forward_backward_under_autocast():
    cfg_model = preset("tiny")
    model = MoETransformer(cfg_model, dispatcher="dropless", expert_backend="torch"
                           if HAS_GROUPED_MM else "loop", attention_impl="sdpa_fp32")
    idx = torch.randint(cfg_model.vocab_size, (2, 16))
    tgt = torch.randint(cfg_model.vocab_size, (2, 16))
    out32 = model(idx, tgt)
    with autocast():
        out = model(idx, tgt)
    assert out.loss.dtype == torch.float32
    assert torch.isfinite(out.loss)
    # The logits, not the loss (at initialisation the loss is about log(vocab) whatever the
    # MoE computes): within 8 bfloat16 ulps of the largest FP32 logit (bf16 keeps 8 bits;
    # a few roundings compound through the layers).
    bound = 2.0**-5 * out32.logits.abs().max()
    assert (out.logits.float() - out32.logits).abs().max() <= bound
    # The bound tells right from wrong: the model with its MoE outputs zeroed is outside it.
    hooks = [m.register_forward_hook(lambda mod, args, result: (result[0] * 0, *result[1:]))
             for m in model.modules() if isinstance(m, MoELayer)]
    with torch.no_grad(), autocast():
        wrong = model(idx, tgt).logits.float()
    for hook in hooks:
        hook.remove()
    assert hooks and (wrong - out32.logits).abs().max() > 4 * bound
    out.loss.backward()
    for name, p in model.named_parameters():
        assert p.grad is not None, name
        assert p.grad.dtype == torch.float32 and torch.isfinite(p.grad).all(), name


def test_fp32_logits_under_autocast():
    cfg_model = preset("tiny")
    torch.manual_seed(0)
    model = MoETransformer(cfg_model, dispatcher="dropless", attention_impl="sdpa_fp32")
    idx = torch.randint(cfg_model.vocab_size, (2, 16))
    tgt = torch.randint(cfg_model.vocab_size, (2, 16))
    # the same weights, with the logits kept in FP32 under autocast (ModelImpls.fp32_logits)
    kept_model = MoETransformer(cfg_model, dispatcher="dropless", attention_impl="sdpa_fp32",
                                fp32_logits=True)
    kept_model.load_state_dict(model.state_dict())
    plain = model(idx, tgt)
    same = kept_model(idx, tgt)  # without autocast the flag changes nothing, bit for bit
    assert torch.equal(same.logits, plain.logits) and torch.equal(same.loss, plain.loss)

    def run(m):
        m.zero_grad(set_to_none=True)
        with autocast():
            out = m(idx, tgt)
        out.loss.backward()
        return out, m.lm_head.weight.grad.clone()

    rounded, _ = run(model)
    kept, grad_kept = run(kept_model)
    assert rounded.logits.dtype == BF16 and kept.logits.dtype == torch.float32
    assert grad_kept.dtype == torch.float32 and torch.isfinite(grad_kept).all()
    # The logits are F.linear of the same FP32 hidden state: recompute the head from the
    # block outputs in FP32 and compare (the blocks themselves still ran in BF16).
    with autocast():
        x = kept_model.embed(idx)
        for block in kept_model.blocks:
            x, _ = block(x)
        hidden = kept_model.norm(x)
    assert hidden.dtype == torch.float32
    exact = hidden.detach() @ kept_model.lm_head.weight.detach().t()
    assert rel_err(kept.logits, exact) < 1e-5
    assert rel_err(rounded.logits, exact) > 1e-4  # BF16 rounding, which fp32_logits removes
    # a replaced head (e.g. a quantized module) is left to itself
    kept_model.lm_head = torch.nn.Identity()
    with autocast():
        assert torch.equal(kept_model(idx).logits, hidden)


def test_sdpa_fp32_attention_bf16():
    q = torch.randn(2, 4, 16, 8).to(BF16)
    k = torch.randn(2, 2, 16, 8).to(BF16)  # grouped-query: 2 kv heads for 4 q heads
    v = torch.randn(2, 2, 16, 8).to(BF16)
    out = causal_attention(q, k, v, impl="sdpa_fp32")
    ref = causal_attention(q, k, v, impl="reference")
    assert out.dtype == BF16 and ref.dtype == BF16 and out.shape == q.shape
    torch.testing.assert_close(out, ref)  # bf16 tolerances
    with autocast():  # autocast changes nothing: the core is fp32 either way
        torch.testing.assert_close(causal_attention(q, k, v, impl="sdpa_fp32"), out, rtol=0, atol=0)


def test_layer_on_the_meta_device_needs_no_autocast_support():
    # autocast does not know the meta device; the layer must not ask it (shape-only runs,
    # as notebook 04 certifies a DeepSeek-V3-sized layer)
    layer = MoELayer(MoEConfig(n_experts=8, top_k=2, d_model=32, d_expert=16), "dropless", "torch").to("meta")
    y, _ = layer(torch.empty(24, 32, device="meta"))
    assert y.shape == (24, 32) and y.device.type == "meta"
