"""Capacity and dropless dispatchers, every expert backend, against the naive reference."""

import math

import pytest
import torch

from moe_lab import MoELayer
from moe_lab.config import MoEConfig
from moe_lab.moe import experts
from moe_lab.moe.dispatch import capacity_positions, expert_capacity, sort_by_expert
from moe_lab.moe.experts import check_no_hidden_sync
from moe_lab.training.sync import assert_sync_free, count_syncs

BACKENDS = ["loop", "torch", "openmp", "triton"]


def cfg(**kw):
    base = dict(d_model=32, n_experts=8, top_k=2, d_expert=32)
    base.update(kw)
    return MoEConfig(**base)


def pair(c, dispatcher, backend="loop", dtype=torch.float32):
    ref = MoELayer(c, "naive").to(dtype)
    fast = MoELayer(c, dispatcher, backend).to(dtype)
    fast.load_state_dict(ref.state_dict())
    return ref, fast


def skip_missing(backend):
    if backend == "openmp":
        import moe_lab.workbench.cpu

        # Skipped only where there is no compiler at all; a compiler that fails to build
        # the kernel fails the test.
        if moe_lab.workbench.cpu.build.compiler() is None:
            pytest.skip("no C++ compiler: the openmp backend cannot be built here")
        assert moe_lab.workbench.cpu.register(), moe_lab.workbench.cpu.unavailable_reason()
    if backend == "triton":
        pytest.importorskip("moe_lab.kernels.grouped_gemm")
        pytest.importorskip("moe_lab.kernels.permute")


CASES = {
    "default": (cfg(), 37),
    "zero tokens": (cfg(), 0),
    "one expert": (cfg(n_experts=1, top_k=1), 19),
    "top_k = n_experts": (cfg(n_experts=4, top_k=4), 23),
    "groups + sigmoid": (cfg(n_experts=16, n_groups=4, topk_groups=2, top_k=4,
                             score_func="sigmoid", scaling_factor=2.5), 29),
    "shared expert": (cfg(n_shared_experts=1), 16),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", list(CASES))
def test_dropless_equals_naive(case, backend):
    skip_missing(backend)
    c, tokens = CASES[case]
    ref, fast = pair(c, "dropless", backend)
    x = torch.randn(tokens, c.d_model)
    y_ref, s_ref = ref(x)
    y, s = fast(x)
    torch.testing.assert_close(y, y_ref, rtol=1e-4, atol=1e-5)
    assert torch.equal(s.tokens_per_expert, s_ref.tokens_per_expert)
    assert int(s.dropped_tokens) == 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_dropless_skewed_routing_and_noncontiguous(backend):
    skip_missing(backend)
    c = cfg(top_k=2)
    ref, fast = pair(c, "dropless", backend)
    with torch.no_grad():
        for layer in (ref, fast):
            layer.router.expert_bias[3] = 50.0  # every token's first choice is expert 3
    x = torch.randn(c.d_model, 40).t()  # non-contiguous
    y_ref, s_ref = ref(x)
    y, s = fast(x)
    assert int(s.tokens_per_expert[3]) == 40
    torch.testing.assert_close(y, y_ref, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_dropless_gradients_equal_naive(backend):
    skip_missing(backend)
    c = cfg(n_shared_experts=1)
    ref, fast = pair(c, "dropless", backend)
    x = torch.randn(24, c.d_model)
    grad = torch.randn(24, c.d_model)
    grads = []
    for layer in (ref, fast):
        xi = x.clone().requires_grad_()
        y, s = layer(xi)
        torch.autograd.backward([y, s.aux_loss], [grad, torch.ones(())])
        grads.append([xi.grad] + [p.grad for p in layer.parameters()])
    for g_ref, g in zip(*grads, strict=True):
        torch.testing.assert_close(g, g_ref, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_dropless_bf16_close_to_fp32(backend):
    skip_missing(backend)
    c = cfg()
    ref, fast = pair(c, "dropless", backend)
    fast = fast.to(torch.bfloat16)
    x = torch.randn(32, c.d_model)
    y_ref, _ = ref(x)
    y, _ = fast(x.bfloat16())
    err = (y.float() - y_ref).norm() / y_ref.norm()
    assert err < 2e-2, f"relative error {err:.3g}"


@pytest.mark.parametrize("dispatcher, backend",
                         [("dropless", b) for b in BACKENDS] + [("capacity", "loop")])
def test_sync_free_certificate_forward_and_backward(dispatcher, backend):
    skip_missing(backend)
    c = cfg()
    _, layer = pair(c, dispatcher, backend)
    x = torch.randn(64, c.d_model, requires_grad=True)
    assert_sync_free(layer, x)  # forward and backward, on fake tensors
    _, syncs = count_syncs(lambda: layer(x)[0].sum().backward())
    assert sum(syncs.values()) == 0, dict(syncs)


def test_capacity_formula():
    assert expert_capacity(100, 2, 8, 1.0) == 25
    assert expert_capacity(100, 2, 8, 1.25) == math.ceil(250 / 8)
    assert expert_capacity(100, 2, 8, 1.0, multiple=16) == 32
    with pytest.raises(ValueError, match="capacity_factor"):
        expert_capacity(10, 1, 2, 0.0)


def reference_keep(ids, weights, n_experts, capacity, policy):
    """The drop rule written as a plain Python loop."""
    tokens, k = ids.shape
    if policy == "position":
        order = [(t, j) for j in range(k) for t in range(tokens)]
    else:
        flat = [(t, j) for t in range(tokens) for j in range(k)]
        order = sorted(flat, key=lambda tj: -float(weights[tj]))  # stable: ties by token
    used = [0] * n_experts
    keep = torch.zeros(tokens, k, dtype=torch.bool)
    for t, j in order:
        e = int(ids[t, j])
        if used[e] < capacity:
            keep[t, j] = True
        used[e] += 1
    return keep


@pytest.mark.parametrize("policy", ["position", "probability"])
@pytest.mark.parametrize("capacity_factor", [0.5, 1.0, 1.25, 4.0])
def test_capacity_drops_exactly_the_reference_assignments(policy, capacity_factor):
    c = cfg(capacity_factor=capacity_factor, drop_policy=policy)
    ref, fast = pair(c, "capacity")
    with torch.no_grad():
        ref.router.expert_bias[:2] = 0.3  # skew: experts 0 and 1 over-subscribed
        fast.router.expert_bias[:2] = 0.3
    x = torch.randn(50, c.d_model)
    r = ref.router(x)
    capacity = expert_capacity(50, c.top_k, c.n_experts, capacity_factor)
    keep = reference_keep(r.topk_ids, r.topk_weights.detach(), c.n_experts, capacity, policy)
    rank = capacity_positions(r.topk_ids, r.topk_weights, c.n_experts, policy)
    assert torch.equal(rank < capacity, keep)
    y, s = fast(x)
    assert int(s.dropped_tokens) == int((~keep).sum())
    # what is kept equals the naive dispatcher with the dropped weights set to zero
    from moe_lab.moe.dispatch import naive_dispatch

    want, _ = naive_dispatch(x, r.topk_ids, r.topk_weights * keep, ref.experts)
    torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-5)


def test_capacity_with_room_for_everything_equals_naive():
    c = cfg(capacity_factor=float(cfg().n_experts))  # C >= tokens * top_k / ... always enough
    ref, fast = pair(c, "capacity")
    x = torch.randn(33, c.d_model)
    torch.testing.assert_close(fast(x)[0], ref(x)[0], rtol=1e-5, atol=1e-5)
    assert int(fast(x)[1].dropped_tokens) == 0


def test_sort_by_expert_is_a_stable_grouping():
    ids = torch.tensor([[2, 0], [0, 2], [1, 0]])
    order, offsets = sort_by_expert(ids, 4)
    assert order.tolist() == [1, 2, 5, 4, 0, 3]
    assert offsets.tolist() == [0, 3, 4, 6, 6]
    assert offsets.dtype == torch.int32


def test_bad_backend_is_refused():
    with pytest.raises(ValueError, match="expert_backend"):
        MoELayer(cfg(), "dropless", "cuda-magic")


def test_check_no_hidden_sync_refuses_torch_grouped_mm_off_bf16_on_cuda_only():
    """torch._grouped_mm on CUDA syncs inside the op in any dtype but bfloat16 (ATen's fallback
    copies the offsets to the host), where no fake tensor shows it."""
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    for dtype in (torch.float32, torch.float16):
        with pytest.raises(ValueError, match=rf"w: torch\._grouped_mm \(expert backend 'torch'\) in "
                           rf"{dtype} on CUDA .*; use \.bfloat16\(\) or expert_backend='triton'"):
            check_no_hidden_sync("torch", cuda, dtype, "w")
    check_no_hidden_sync("torch", cuda, torch.bfloat16, "w")
    check_no_hidden_sync("torch", cpu, torch.float32, "w")  # the CPU tests' configuration
    for backend in ("loop", "triton", "triton_tma"):
        check_no_hidden_sync(backend, cuda, torch.float32, "w")


def test_torch_backend_refuses_a_hidden_sync_at_forward(monkeypatch):
    c = cfg()
    layer = MoELayer(c, "dropless", "torch")
    x = torch.randn(16, c.d_model)
    layer(x)  # fp32 on a CPU runs
    monkeypatch.setattr(experts, "_on_cuda", lambda device: True)  # as if on a GPU (none here)
    with pytest.raises(ValueError, match=r"x: torch\._grouped_mm .* in torch\.float32 on CUDA"):
        layer(x)
    layer.bfloat16()(x.bfloat16())  # bfloat16 takes the sync-free kernel


def test_experts_take_their_backend_and_permutation_from_the_registry():
    from moe_lab.moe.experts import EXPERT_BACKENDS, torch_permute

    layer = MoELayer(cfg(), "dropless", "triton")
    assert layer.experts.backend == "triton" and layer.experts.impl is EXPERT_BACKENDS["triton"]
    assert layer.experts.impl.permute is not torch_permute  # the Triton kernels' moves
    layer = MoELayer(cfg(), "dropless", "torch")
    assert layer.experts.backend == "torch" and layer.experts.impl.permute is torch_permute
    with pytest.raises(ValueError, match="dispatcher must be one of"):
        MoELayer(cfg(), "teleport")
    assert layer.dispatcher == "dropless"


def test_pairing_rules_are_declared_and_checked_where_the_layer_is_built():
    from moe_lab.moe.dispatch import DISPATCHERS, EXPERT_PATHS
    from moe_lab.moe.experts import SwiGLUExperts

    assert {name: fn.runs_experts for name, fn in DISPATCHERS.items()}.items() >= {
        "naive": "methods", "capacity": "methods", "dropless": "backend", "fused": "kernels",
        "fused_atomic": "kernels"}.items()
    assert all(fn.runs_experts in EXPERT_PATHS for fn in DISPATCHERS.values())
    # The fused kernels compute plain SwiGLU: a variant with biases is refused, both named.
    with pytest.raises(ValueError, match="'fused' .* cannot run ClampedSwiGLUExperts"):
        MoELayer(cfg(), "fused", expert_kind="clamped_swiglu")
    # An expert class names the backends it runs on.
    with pytest.raises(ValueError, match="expert_backend for ClampedSwiGLUExperts .* got 'triton'"):
        MoELayer(cfg(), "dropless", "triton", expert_kind="clamped_swiglu")
    layer = MoELayer(cfg(), "naive", expert_kind="clamped_swiglu", limit=3.0)
    assert layer.experts.limit == 3.0 and SwiGLUExperts.BACKENDS is None
    with pytest.raises(ValueError, match="cannot run ClampedSwiGLUExperts"):
        MoELayer(cfg(), "fused_atomic", expert_kind="clamped_swiglu")
    # ... and unquantized: MXFP8 experts are refused as the layer is built, not at its first call.
    with pytest.raises(ValueError, match="'fused' .* without quantization.* quant='mxfp8'"):
        MoELayer(cfg(), "fused", quant="mxfp8")
    assert layer.dispatcher == "naive"
    with pytest.raises(ValueError, match="expert_kind must be one of"):
        MoELayer(cfg(), expert_kind="dense")


class _FilledBytes(torch.utils._python_dispatch.TorchDispatchMode):
    """Bytes of every tensor made by filling while active: zeros, fill_, and select_backward
    (the gradient of ``w[e]``: a zero-filled tensor of ``w``'s whole shape with one slice set)."""

    FILLS = ("aten::fill_", "aten::zero_", "aten::zeros", "aten::new_zeros", "aten::zeros_like",
             "aten::select_backward")

    def __init__(self):
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func._schema.name in self.FILLS and isinstance(out, torch.Tensor):
            self.bytes += out.numel() * out.element_size()
        return out


@pytest.mark.parametrize("dispatcher, backend", [("naive", "loop"), ("dropless", "loop")])
@pytest.mark.parametrize("kind", ["swiglu", "clamped_swiglu"])
def test_a_loop_over_experts_does_not_zero_fill_the_weight_stack_per_expert(dispatcher, backend, kind):
    """The naive loop (and the ``loop`` backend) take each expert's weights from the stacked
    ``[E, ...]`` parameters. Indexed as ``w[e]`` inside the loop, the backward zero-fills a
    gradient of the whole stack per expert (E × the weights' bytes: most of the naive
    layer's CPU time at 64 experts, and a baseline slower than any real naive layer); taken
    once with ``unbind`` it fills at most the stack once."""
    cfg = MoEConfig(n_experts=16, top_k=2, d_model=32, d_expert=48)
    layer = MoELayer(cfg, dispatcher=dispatcher, expert_backend=backend, expert_kind=kind)
    x = torch.randn(40, cfg.d_model, requires_grad=True)
    y, stats = layer(x)
    stack = sum(p.numel() * p.element_size() for p in layer.experts.parameters())
    with _FilledBytes() as filled:
        torch.autograd.backward([y, stats.aux_loss], [torch.randn_like(y), torch.ones_like(stats.aux_loss)])
    assert filled.bytes <= 2 * stack + x.numel() * x.element_size() * 16, (filled.bytes, stack)
