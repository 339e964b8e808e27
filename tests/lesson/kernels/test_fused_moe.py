"""The fused grouped GEMMs (moe_lab.kernels.fused_moe, fused_mxfp8) against the unfused chains they replace:
gather prologue, weighted-scatter epilogue (both schemes), MXFP8-quantize epilogue and the
whole fused expert MLP, forward and backward, and the fused dispatchers against the naive layer.

Every kernel output is allocated NaN-filled (`moe_lab.kernels.common.poison_outputs`), so an
element a kernel forgot to write fails. Routing is fresh random per test: mixed, experts left empty, one
expert taking every token, E=256 top-8, and segments padded to an alignment (rows no
token maps to). Under ``TRITON_INTERPRET=1`` shapes are small. Tolerances: float32 within
1e-4 (relative to the reference's scale: only the order of the sums differs); bfloat16
within 3e-2 of the float32 chain on the same bfloat16 inputs (the fused kernels round once
per output, the unfused chain once per intermediate tensor).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import triton
import triton.language as tl
from support import poison_outputs

from moe_lab.kernels import fused_moe as fm
from moe_lab.kernels import fused_mxfp8 as fmx
from moe_lab.kernels.common import row_source
from moe_lab.kernels.fusions import FUSIONS
from moe_lab.kernels.permute import make_row_id_map, permuted_rows
from moe_lab.quant.mx import quantize
from moe_lab.training.sync import assert_sync_free

DTYPES = [torch.float32, torch.bfloat16]
# name -> (tokens, d_model, d_expert, n_experts, top_k, how the ids are drawn, align)
ROUTINGS = {
    "mixed": (37, 32, 32, 4, 2, "random", 1),
    "empty_experts": (29, 32, 32, 6, 2, "first_two", 1),
    "one_expert_all_tokens": (33, 32, 32, 4, 1, "all_to_2", 1),
    "aligned_segments": (21, 32, 32, 4, 2, "random", 8),
    "e256_top8": (24, 16, 32, 256, 8, "random", 1),
    # d_expert above the interpreter's widest tile (128): two N tiles, whose partial sums of
    # the routing weights' gradient must land in their own slots
    "two_n_tiles": (17, 32, 160, 4, 2, "random", 1),
}


@pytest.fixture(autouse=True)
def poisoned_outputs() -> Iterator[None]:
    with poison_outputs():  # floats NaN, MXFP8 codes 0xAB: a value never right
        yield


def routing(name: str, device: torch.device):
    tokens, d, f, n_experts, top_k, how, align = ROUTINGS[name]
    if how == "random":
        ids = torch.stack([torch.randperm(n_experts)[:top_k] for _ in range(tokens)]) if tokens else \
            torch.zeros(0, top_k, dtype=torch.long)
    elif how == "first_two":
        ids = torch.stack([torch.randperm(2)[:top_k] for _ in range(tokens)])
    else:
        ids = torch.full((tokens, top_k), 2, dtype=torch.long)
    weights = torch.rand(tokens, top_k).softmax(-1).to(device)
    row_id_map, offsets = make_row_id_map(ids.to(device), n_experts, align=align)
    n_rows = permuted_rows(tokens, top_k, n_experts, align)
    return (tokens, d, f, n_experts, top_k), row_id_map, offsets, weights, n_rows


def operands(dims, dtype, device):
    tokens, d, f, n_experts, _ = dims
    x = torch.randn(tokens, d).to(device, dtype)
    w1 = (torch.randn(n_experts, d, 2 * f) / d**0.5).to(device, dtype)
    w2 = (torch.randn(n_experts, f, d) / f**0.5).to(device, dtype)
    return x, w1, w2


def close(mine: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, what: str) -> None:
    assert not torch.isnan(mine).any(), f"{what}: NaN (an element was never written)"
    scale = max(1.0, ref.abs().max().item())
    tol = (1e-4 if dtype == torch.float32 else 3e-2) * scale
    torch.testing.assert_close(mine.double(), ref.double(), rtol=0, atol=tol, msg=lambda m: f"{what}: {m}")


def run_both(fused, unfused, inputs, kwargs, dtype, grads: bool = True):
    """``fused`` on ``inputs`` (in ``dtype``) and ``unfused`` on float32 copies of the same
    values; outputs and, with ``grads``, the gradients of every floating input."""
    mine = [t.detach().clone().requires_grad_(grads and t.is_floating_point()) for t in inputs]
    ref = [t.detach().clone().float().requires_grad_(grads and t.is_floating_point()) for t in inputs]
    y = fused(*mine, **kwargs)
    r = unfused(*ref, **kwargs)
    if not grads:
        return y, r, [], []
    g = torch.randn_like(r)
    mine_grads = torch.autograd.grad(y, [t for t in mine if t.requires_grad], g.to(y.dtype))
    ref_grads = torch.autograd.grad(r, [t for t in ref if t.requires_grad], g)
    return y, r, mine_grads, ref_grads


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", list(ROUTINGS))
def test_fused_mlp_equals_unfused_chain(name, dtype, device):
    dims, row_id_map, offsets, weights, n_rows = routing(name, device)
    x, w1, w2 = operands(dims, dtype, device)
    for scatter in fm.SCATTER_MODES:
        def fused(x, w1, w2, wt, scatter=scatter):
            return fm.fused_moe_mlp(x, w1, w2, row_id_map, offsets, wt, n_rows=n_rows, scatter=scatter)

        def unfused(x, w1, w2, wt):
            return fm.fused_moe_mlp_unfused(x, w1, w2, row_id_map, offsets, wt, n_rows=n_rows)

        y, r, g, rg = run_both(fused, unfused, (x, w1, w2, weights), {}, dtype)
        close(y, r, dtype, f"{scatter} out")
        for what, a, b in zip(("dx", "dw_gate_up", "dw_down", "dweights"), g, rg, strict=True):
            close(a, b, dtype, f"{scatter} {what}")


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", ["mixed", "empty_experts", "one_expert_all_tokens", "aligned_segments",
                                  "two_n_tiles"])
@pytest.mark.parametrize("fusion", ["gather_prologue", "scatter_epilogue", "scatter_epilogue_atomic"])
def test_each_fusion_equals_its_chain(fusion, name, dtype, device):
    dims, row_id_map, offsets, weights, n_rows = routing(name, device)
    x, w1, w2 = operands(dims, dtype, device)
    entry = FUSIONS.lookup(fusion, "fusion")
    if fusion == "gather_prologue":
        inputs = (x, w1)

        def call(fn, x, w1):
            return fn(x, w1, row_id_map, offsets, n_rows=n_rows)
    else:
        # h rows no (token, slot) maps to (aligned segments) reach no output: both chains
        # give them a zero gradient.
        inputs = (torch.randn(n_rows, dims[2]).to(device, dtype), w2, weights)

        def call(fn, h, w2, wt):
            return fn(h, w2, row_id_map, offsets, wt)

    y, r, g, rg = run_both(lambda *t: call(entry.fused, *t), lambda *t: call(entry.unfused, *t),
                           inputs, {}, dtype)
    close(y, r, dtype, f"{fusion} forward")
    for i, (a, b) in enumerate(zip(g, rg, strict=True)):
        close(a, b, dtype, f"{fusion} grad {i}")


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", ["mixed", "empty_experts", "aligned_segments"])
def test_mxfp8_epilogue_is_the_quantizer_of_the_fused_output(name, dtype, device):
    # Bit for bit: the epilogue's codes and scales are moe_lab.quant.mx.quantize (rceil) of
    # what the same GEMM writes without the epilogue; and their values are within one MXFP8
    # rounding of the whole unfused chain's.
    dims, row_id_map, offsets, _, n_rows = routing(name, device)
    x, w1, _ = operands(dims, dtype, device)
    codes, scales = fmx.gather_swiglu_mxfp8(x, w1, row_id_map, offsets, n_rows=n_rows)
    h = fm.gather_swiglu(x, w1, row_id_map, offsets, n_rows=n_rows)
    q = quantize(h, dim=-1, scale_mode="rceil")
    assert torch.equal(codes.view(torch.uint8), q.data.view(torch.uint8))
    assert torch.equal(scales.view(torch.uint8), q.scale.view(torch.uint8))
    ref_codes, ref_scales = fmx.gather_swiglu_mxfp8_unfused(x.float(), w1.float(), row_id_map, offsets,
                                                           n_rows=n_rows)

    def value(c, s):
        return c.float() * s.float().repeat_interleave(32, dim=-1)

    # Within one E4M3 step (1/8 relative for normals, 2^-9 of the block scale for
    # subnormals): the bf16 epilogue and the float32 chain may round across a code boundary.
    ref, mine = value(ref_codes, ref_scales), value(codes, scales)
    step = torch.maximum(mine.abs(), ref.abs()) / 8 + ref_scales.float().repeat_interleave(32, dim=-1) * 2**-9
    assert ((mine - ref).abs() <= step * 1.0001).all()


def test_mxfp8_epilogue_needs_f_multiple_of_32(device):
    dims, row_id_map, offsets, _, _ = routing("mixed", device)
    x = torch.randn(dims[0], dims[1], device=device)
    with pytest.raises(ValueError, match="multiple of 32"):
        fmx.gather_swiglu_mxfp8(x, torch.randn(dims[3], dims[1], 48, device=device), row_id_map, offsets)


def test_deterministic_scatter_repeats_bit_for_bit(device):
    dims, row_id_map, offsets, weights, n_rows = routing("e256_top8", device)
    x, w1, w2 = operands(dims, torch.float32, device)
    runs = [fm.fused_moe_mlp(x, w1, w2, row_id_map, offsets, weights) for _ in range(2)]
    assert torch.equal(runs[0], runs[1])


def test_row_source_inverts_the_map(device):
    _, row_id_map, _, _, n_rows = routing("aligned_segments", device)
    src = row_source(row_id_map, n_rows)
    flat = row_id_map.reshape(-1).long()
    assert torch.equal(src[flat].long(), torch.arange(flat.numel(), device=device))
    assert (src >= 0).sum().item() == flat.numel()  # the padding rows keep -1


@pytest.mark.parametrize("dispatcher", ["fused", "fused_atomic"])
def test_fused_dispatchers_equal_naive(dispatcher):
    from moe_lab import MoELayer
    from moe_lab.config import MoEConfig

    c = MoEConfig(d_model=32, n_experts=8, top_k=2, d_expert=32)
    ref, fast = MoELayer(c, "naive"), MoELayer(c, dispatcher)
    fast.load_state_dict(ref.state_dict())
    x = torch.randn(37, 32)
    xr, xf = x.clone().requires_grad_(), x.clone().requires_grad_()
    (yr, _), (yf, _) = ref(xr), fast(xf)
    torch.testing.assert_close(yf, yr, rtol=1e-4, atol=1e-5)
    g = torch.randn_like(yr)
    yr.backward(g)
    yf.backward(g)
    torch.testing.assert_close(xf.grad, xr.grad, rtol=1e-4, atol=1e-5)
    for (name, a), b in zip(fast.named_parameters(), ref.parameters(), strict=True):
        if b.grad is not None:
            torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-5,
                                       msg=lambda m, n=name: f"{n}: {m}")


def test_fused_dispatcher_refuses_quantized_experts():
    from moe_lab import MoELayer
    from moe_lab.config import MoEConfig

    with pytest.raises(ValueError, match="without quantization"):  # refused as the layer is built
        MoELayer(MoEConfig(d_model=32, n_experts=4, top_k=2, d_expert=32), "fused", quant="mxfp8")


def test_fused_mlp_is_sync_free(device):
    dims, row_id_map, offsets, weights, _ = routing("mixed", device)
    x, w1, w2 = operands(dims, torch.float32, device)
    x.requires_grad_()

    def step():
        fm.fused_moe_mlp(x, w1, w2, row_id_map, offsets, weights).sum().backward()

    assert_sync_free(step)


def test_gpu_stack_uses_the_fused_dispatcher_where_triton_compiles(monkeypatch):
    import dataclasses

    from moe_lab.perf.capabilities import capabilities
    from moe_lab.workbench.benchmarks.ttt import stacks

    compiled = dataclasses.replace(capabilities(), triton_mode="compiled")
    monkeypatch.setattr(stacks, "capabilities", lambda: compiled)
    best = stacks.optimised_stack("cuda")
    assert best.impls.dispatcher == "fused" and "gather prologue" in best.describe()
    labels = [label for label, _ in stacks.ladder("cuda")]
    assert "+ permute/combine fused into the grouped GEMMs" in labels
    interpreted = dataclasses.replace(capabilities(), triton_mode="interpreted")
    monkeypatch.setattr(stacks, "capabilities", lambda: interpreted)
    assert stacks.optimised_stack("cuda").impls.dispatcher == "dropless"


def test_cpu_stack_keeps_the_unfused_chain_and_says_why():
    from moe_lab.workbench.benchmarks.ttt import stacks

    best = stacks.optimised_stack("cpu", compile=False)
    assert best.impls.dispatcher == "dropless"
    assert any("fused grouped GEMMs" in note for note in best.notes)


def test_fusion_accounting_counts_what_each_fusion_removes():
    from moe_lab.perf import fusion

    s = fusion.Shape(tokens=100, top_k=4, n_experts=8, d=64, f=32, b=2)
    by = {v: fusion.summary(v, s) for v in fusion.VARIANTS + fusion.MX_VARIANTS}
    r, t, d, f, b = 400, 100, 64, 32, 2
    # The SwiGLU epilogue: the [R, 2F] pre-activation is neither written by GEMM1 nor read
    # by a SwiGLU pass, whose [R, F] output GEMM1 now writes itself.
    fwd = by["unfused"]["bytes_fwd"] - by["swiglu_epilogue"]["bytes_fwd"]
    assert fwd == 2 * r * 2 * f * b
    # The gather prologue: no permute (T·d·b read, R·d·b written, map read) in the forward;
    # the row source is built instead (written twice: fill and scatter; the map read once).
    fwd = by["swiglu_epilogue"]["bytes_fwd"] - by["gather_prologue"]["bytes_fwd"]
    assert fwd == (t * d * b + r * d * b + t * 4 * 4) - (r * 4 + t * 4 * 4 + r * 4) - r * 4
    for v in ("gather_prologue", "scatter_epilogue", "scatter_atomic"):
        assert by[v]["activation_bytes"] < by["swiglu_epilogue"]["activation_bytes"]
    assert by["mxfp8_epilogue"]["bytes"] < by["mxfp8_unfused"]["bytes"]
    assert by["mxfp8_epilogue"]["launches"] == by["mxfp8_unfused"]["launches"] - 1
    table = fusion.fusion_table()
    assert {row["preset"] for row in table} == {"deepseek_v3", "gpt_oss_20b"}
    for row in table:
        assert row["projected_ms_GB300"] < row["projected_ms_H200"]
    with pytest.raises(ValueError, match="variant"):
        fusion.launches("teleport", s)


def test_chain_stage_timing_and_fusion_report_into_the_ledger():
    from moe_lab.workbench.benchmarks.moe_layer import chain_stage_timing, fusion_report
    from moe_lab.workbench.measure.ledger import read

    r = chain_stage_timing("fine", tokens=32, min_time_s=0.01)
    assert [row["stage"] for row in r["stages"]] == ["permute", "GEMM1", "SwiGLU", "GEMM2",
                                                     "weighted unpermute"]
    assert 0 < r["removable_share"] < 1
    report = fusion_report(tokens=32, min_time_s=0.01, notebook="test_fused_moe")
    assert report["table"] and "projection" in report["note"]
    steps = {rec["step"] for rec in read() if rec["notebook"] == "test_fused_moe"}
    assert "fusion:deepseek_v3:gather_prologue" in steps and "fusion:fine:chain" in steps


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", ["mixed", "empty_experts", "aligned_segments"])
def test_mxfp8_forward_feeds_the_second_gemm(name, dtype, device):
    # The MXFP8 epilogue's codes read by the second GEMM (decoded in registers) and combined:
    # in float32 the whole unfused chain (quantize → dequantize between the GEMMs); in
    # bfloat16 the chain from the epilogue's own codes (bit-exact to the quantizer, tested
    # above), so that only the second GEMM's rounding differs.
    dims, row_id_map, offsets, weights, n_rows = routing(name, device)
    tokens, d, f, n_experts, top_k = dims
    x, w1, _ = operands(dims, dtype, device)
    w2 = (torch.randn(n_experts, f, d) / f**0.5).to(device, dtype)
    y = fmx.fused_moe_mlp_mxfp8(x, w1, w2, row_id_map, offsets, weights, n_rows=n_rows)
    if dtype == torch.float32:
        ref = fmx.fused_moe_mlp_mxfp8_unfused(x, w1, w2, row_id_map, offsets, weights, n_rows=n_rows)
    else:
        codes, scales = fmx.gather_swiglu_mxfp8(x, w1, row_id_map, offsets, n_rows=n_rows)
        h = codes.float() * scales.float().repeat_interleave(32, dim=-1)
        ref = fm.gemm_scatter_unfused(h, w2.float(), row_id_map, offsets, weights)
    close(y, ref.float(), dtype, "mxfp8 forward")


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", ["mixed", "empty_experts", "one_expert_all_tokens", "aligned_segments"])
def test_mxfp8_forward_on_the_grouped_block_scaled_gemm(name, dtype, device):
    # Both operands of the second GEMM in MXFP8 (the epilogue's codes, W2 quantized along F),
    # multiplied by the grouped tl.dot_scaled GEMM: against the same quantize → dequantize chain
    # in PyTorch (in bfloat16 from the epilogue's own codes, as above).
    from moe_lab.quant.mx import quantize

    dims, row_id_map, offsets, weights, n_rows = routing(name, device)
    tokens, d, f, n_experts, top_k = dims
    x, w1, _ = operands(dims, dtype, device)
    w2 = (torch.randn(n_experts, f, d) / f**0.5).to(device, dtype)
    entry = FUSIONS.lookup("mxfp8_mlp_forward_native", "fusion")
    y = entry.fused(x, w1, w2, row_id_map, offsets, weights, n_rows=n_rows)
    assert y.dtype == dtype and y.shape == (tokens, d)
    if dtype == torch.float32:
        ref = entry.unfused(x, w1, w2, row_id_map, offsets, weights, n_rows=n_rows)
    else:
        codes, scales = fmx.gather_swiglu_mxfp8(x, w1, row_id_map, offsets, n_rows=n_rows)
        h = codes.float() * scales.float().repeat_interleave(32, dim=-1)
        w2q = quantize(w2, dim=1, scale_mode="rceil").dequantize(torch.float32)
        ref = fm.gemm_scatter_unfused(h, w2q, row_id_map, offsets, weights)
    close(y, ref.float(), dtype, "native mxfp8 forward")


@triton.jit
def _stub_gather_tile(x_ptr, src_ptr, rows, row_end, ks, K, TOP_K):
    tl.static_assert(False, "exercise not solved yet")


def test_exercise_stubs_are_not_done():
    """The references passing and the wrong answers failing:
    tests/workbench/exercises/test_wrong_answers.py."""
    from moe_lab.workbench.exercises import NotDoneError, not_done
    from moe_lab.workbench.exercises import nb07_fused_grouped_gemm as ex
    from moe_lab.workbench.exercises import nb07_fused_grouped_gemm_triton as ex_triton

    with pytest.raises(NotDoneError):
        ex_triton.check_gather_tile(_stub_gather_tile)
    with pytest.raises(NotDoneError):
        ex.check_permute_combine_bytes(lambda *a: not_done())
