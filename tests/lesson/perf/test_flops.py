"""The FLOPs model: DeepSeek-V3 against the seed's figures, hand counts for the tiny
presets, and torch's own FLOP counter on bare computations of the same shapes."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from moe_lab.config import preset
from moe_lab.perf import flops
from moe_lab.workbench import mlperf
from moe_lab.workbench.cli import env as cli

G = 1e9


def counted_training_flops(fn, *tensors: torch.Tensor) -> int:
    """FLOPs torch counts for ``fn(*tensors).sum().backward()``."""
    with FlopCounterMode(display=False) as counter:
        fn(*tensors).float().sum().backward()
    return counter.get_total_flops()


# ------------------------------------------------------------------- DeepSeek-V3 / seed


def test_deepseek_v3_seed_tflops_per_gpu_within_5_percent():
    # Seed: 1,648 TFLOPS/GPU at 6,338 tokens/s/GPU on GB300 (MLPerf Training v6.0).
    cfg = preset("deepseek_v3")
    seed = mlperf.DEEPSEEK_V3_GB300
    got = flops.tflops_per_gpu(cfg, 4096, seed["tokens_per_s_per_gpu"])
    assert got == pytest.approx(seed["tflops_per_gpu"], rel=0.05)


def test_deepseek_v3_breakdown_matches_megatron_style_count():
    # A Megatron-style count: MLP ~147, attention projections ~70, core ~31, logits ~11 (with MTP);
    # ~260 total, ~250 without MTP.
    b = flops.flops_breakdown(preset("deepseek_v3"), 4096)
    assert b["mlp"] / G == pytest.approx(147, rel=0.01)
    assert b["attention_proj"] / G == pytest.approx(70, rel=0.01)
    assert b["attention_core"] / G == pytest.approx(31, rel=0.02)
    assert b["logits"] / G == pytest.approx(11, rel=0.02)
    total = flops.training_flops_per_token(preset("deepseek_v3"), 4096)
    assert total == pytest.approx(sum(b.values()))
    assert total / G == pytest.approx(260, rel=0.01)
    no_mtp = flops.training_flops_per_token(preset("deepseek_v3"), 4096, include_mtp=False)
    assert no_mtp / G == pytest.approx(250, rel=0.01)


def test_deepseek_v3_parts_by_hand():
    cfg = preset("deepseek_v3")
    b = flops.flops_breakdown(cfg, 4096)
    moe_layer = (8 + 1) * 3 * 7168 * 2048 * 6
    dense_layer = 3 * 7168 * 18432 * 6
    assert b["mlp"] == pytest.approx((58 + 1) * moe_layer + 3 * dense_layer, rel=1e-12)
    mla = 7168 * 1536 + 1536 * 128 * 192 + 7168 * 576 + 512 * 128 * 256 + 128 * 128 * 7168
    assert b["attention_proj"] == pytest.approx(mla * 6 * 62, rel=1e-12)
    core = 2 * (128 * 192 + 128 * 128) * 4096 / 2 * 3
    assert b["attention_core"] == pytest.approx(core * 62, rel=1e-12)
    assert b["logits"] == pytest.approx(7168 * 129280 * 6 * 2, rel=1e-12)
    assert b["router"] == pytest.approx(7168 * 256 * 6 * 59, rel=1e-12)
    assert b["mtp"] == pytest.approx(2 * 7168 * 7168 * 6, rel=1e-12)


def test_core_attention_grows_with_seq_len_and_projections_do_not():
    cfg = preset("deepseek_v3")
    short, long = flops.flops_breakdown(cfg, 2048), flops.flops_breakdown(cfg, 8192)
    assert long["attention_core"] == pytest.approx(4 * short["attention_core"])
    assert long["attention_proj"] == short["attention_proj"]
    assert long["mlp"] == short["mlp"]


# ------------------------------------------------------------------- tiny presets by hand


def test_tiny_preset_hand_count():
    # tiny: d 64, 2 MoE layers, 4 heads of 16, 8 experts top-2 of width 64, vocab 256, seq 64
    d, s, v = 64, 64, 256
    per_layer = (
        4 * d * d  # q, k, v, o
        + (s / 2) * 4 * (16 + 16)  # causal core: QK^T and PV over s/2 keys
        + 2 * 3 * d * 64  # two SwiGLU experts
        + d * 8  # router
    )
    want = 6 * (2 * per_layer + d * v)
    assert flops.training_flops_per_token(preset("tiny")) == pytest.approx(want, rel=1e-12)
    assert want == 645_120


def test_small_preset_hand_count_dense_and_shared():
    # small: d 128, 4 layers (1 dense d_ff 512), 4 heads of 32, 16 experts top-4 + 1 shared
    cfg = preset("small")
    d, s = 128, 128
    attn = 4 * d * d + (s / 2) * 4 * (32 + 32)
    dense = attn + 3 * d * 512
    moe = attn + (4 + 1) * 3 * d * 128 + d * 16
    want = 6 * (dense + 3 * moe + d * 256)
    assert flops.training_flops_per_token(cfg) == pytest.approx(want, rel=1e-12)
    layers = flops.layer_flops_per_token(cfg)
    assert layers["dense"] == pytest.approx(6 * dense)
    assert layers["moe"] == pytest.approx(6 * moe)
    assert layers["mtp"] == 0.0 and layers["embedding"] == 0.0


def test_sliding_window_layers_attend_fewer_keys():
    cfg = preset("gpt_oss_20b")
    full = dataclasses.replace(cfg, sliding_window=0)
    # Every other layer is windowed (128 keys): only their attention cores differ.
    core_full = 6 * 2048 * 64 * (64 + 64)
    core_window = 6 * (128 - 128**2 / (2 * 4096)) * 64 * (64 + 64)
    saved = flops.training_flops_per_token(full, 4096) - flops.training_flops_per_token(cfg, 4096)
    assert saved == pytest.approx(cfg.n_layers // 2 * (core_full - core_window))
    assert flops.attended_keys(4096, 0) == 2048
    assert flops.attended_keys(100, 100) == flops.attended_keys(100, 0) == 50
    # The band formula agrees with counting keys row by row (continuous approximation).
    w, n = 16, 256
    exact = sum(min(i + 1, w) for i in range(n)) / n
    assert flops.attended_keys(n, w) == pytest.approx(exact, rel=0.05)


@pytest.mark.parametrize("name", ["tiny", "small", "gpt_oss_20b", "deepseek_v3"])
def test_layer_flops_add_up_to_total(name):
    cfg = preset(name)
    layers = flops.layer_flops_per_token(cfg)
    total = (
        layers["embedding"]
        + layers["dense"] * cfg.n_dense_layers
        + layers["moe"] * cfg.n_moe_layers
        + layers["mtp"] * cfg.mtp_layers
        + layers["logits"]
    )
    assert total == pytest.approx(flops.training_flops_per_token(cfg), rel=1e-12)


# ------------------------------------------------------------------- torch's FLOP counter


def test_moe_experts_agree_with_flop_counter():
    """Route tokens to top_k experts (+ shared) and let torch count the matmuls."""
    cfg = preset("small")  # has a shared expert
    d, de, k, e = cfg.d_model, cfg.moe.d_expert, cfg.moe.top_k, cfg.moe.n_experts
    tokens = 64
    x = torch.randn(tokens, d, requires_grad=True)
    n_all = e + cfg.moe.n_shared_experts
    w_gate = torch.randn(n_all, d, de, requires_grad=True)
    w_up = torch.randn(n_all, d, de, requires_grad=True)
    w_down = torch.randn(n_all, de, d, requires_grad=True)
    router = torch.randn(d, e, requires_grad=True)

    def moe(x):
        logits = x @ router
        chosen = logits.topk(k, dim=-1).indices  # [tokens, k]
        out = torch.zeros_like(x)
        for j in range(n_all):
            rows = (
                torch.arange(tokens) if j >= e else (chosen == j).any(-1).nonzero().squeeze(-1)
            )
            h = x[rows]
            y = (F.silu(h @ w_gate[j]) * (h @ w_up[j])) @ w_down[j]
            out = out.index_add(0, rows, y)
        return out + 0 * logits.sum()

    counted = counted_training_flops(moe, x) / tokens
    b = flops.flops_breakdown(cfg.replace(n_layers=1, n_dense_layers=0))
    assert counted == pytest.approx(b["mlp"] + b["router"], rel=1e-12)


def test_dense_swiglu_agrees_with_flop_counter():
    cfg = preset("small")
    d, ff, tokens = cfg.d_model, cfg.d_ff, 32
    x = torch.randn(tokens, d, requires_grad=True)
    w1, w3 = torch.randn(d, ff, requires_grad=True), torch.randn(d, ff, requires_grad=True)
    w2 = torch.randn(ff, d, requires_grad=True)
    counted = counted_training_flops(lambda x: (F.silu(x @ w1) * (x @ w3)) @ w2, x) / tokens
    assert counted == pytest.approx(6 * flops.dense_mlp_macs(cfg), rel=1e-12)


@pytest.mark.parametrize("name", ["tiny", "gpt_oss_20b"])
def test_attention_agrees_with_flop_counter(name):
    """GQA projections counted exactly; the core counted in full by torch, half by us."""
    cfg = preset(name)
    if name == "gpt_oss_20b":  # same head layout at a size a CPU test can afford
        cfg = cfg.replace(d_model=256, moe={"d_expert": 64}, d_ff=64, n_heads=8, n_kv_heads=2,
                          head_dim=32, sliding_window=0)
    s, d, h, kv, hd = 32, cfg.d_model, cfg.n_heads, cfg.kv_heads, cfg.dim_head
    x = torch.randn(1, s, d, requires_grad=True)
    wq, wo = (torch.randn(*shape, requires_grad=True) for shape in ((d, h * hd), (h * hd, d)))
    wk, wv = (torch.randn(d, kv * hd, requires_grad=True) for _ in range(2))

    def heads(t, n):
        return t.view(1, s, n, hd).transpose(1, 2).repeat_interleave(h // n, dim=1)

    def attention(x):
        q, kk, vv = heads(x @ wq, h), heads(x @ wk, kv), heads(x @ wv, kv)
        mask = torch.ones(s, s, dtype=torch.bool).tril()
        scores = (q @ kk.transpose(-1, -2)).masked_fill(~mask, float("-inf"))
        o = scores.softmax(-1) @ vv
        return o.transpose(1, 2).reshape(1, s, h * hd) @ wo

    total = counted_training_flops(attention, x) / s
    full_core = 6 * s * h * (hd + hd)  # torch counts every query against every key
    proj = flops.flops_breakdown(cfg.replace(n_layers=1, n_dense_layers=0), s)
    assert total - full_core == pytest.approx(proj["attention_proj"], rel=1e-12)
    assert full_core / 2 == pytest.approx(proj["attention_core"], rel=1e-12)


def test_router_and_logits_agree_with_flop_counter():
    cfg = preset("tiny")
    tokens = 16
    x = torch.randn(tokens, cfg.d_model, requires_grad=True)
    wg = torch.randn(cfg.d_model, cfg.moe.n_experts, requires_grad=True)
    wl = torch.randn(cfg.d_model, cfg.vocab_size, requires_grad=True)
    assert counted_training_flops(lambda x: x @ wg, x) / tokens == 6 * flops.router_macs(cfg)
    assert counted_training_flops(lambda x: x @ wl, x) / tokens == 6 * flops.logits_macs(cfg)


# ------------------------------------------------------------------- MFU, validation, CLI


def test_tflops_and_mfu():
    cfg = preset("tiny")
    per_token = flops.training_flops_per_token(cfg)
    assert flops.tflops_per_gpu(cfg, None, 1e6) == pytest.approx(per_token * 1e6 / 1e12)
    assert flops.mfu(500e12, 2000e12) == pytest.approx(0.25)
    with pytest.raises(ValueError, match="peak_flops"):
        flops.mfu(1.0, 0.0)
    with pytest.raises(ValueError, match="achieved_flops"):
        flops.mfu(-1.0, 1.0)
    with pytest.raises(ValueError, match="tokens_per_s"):
        flops.tflops_per_gpu(cfg, 64, -5)


def test_validation_names_the_argument():
    with pytest.raises(ValueError, match="seq_len"):
        flops.training_flops_per_token(preset("tiny"), 0)


def test_include_mtp_only_matters_with_mtp_layers():
    tiny = preset("tiny")
    assert flops.training_flops_per_token(tiny, include_mtp=False) == \
        flops.training_flops_per_token(tiny)
    ds = preset("deepseek_v3")
    diff = flops.training_flops_per_token(ds) - flops.training_flops_per_token(
        ds, include_mtp=False)
    assert diff == pytest.approx(flops.layer_flops_per_token(ds)["mtp"], rel=1e-12)


def _run_cli(argv: list[str]) -> int:
    import argparse

    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="command", required=True)
    cli.register(sub)
    args = parser.parse_args(argv)
    return args.func(args)


def test_cli_flops_json_acceptance(capsys):
    rc = _run_cli(["flops", "--preset", "deepseek_v3", "--seq-len", "4096",
                   "--tokens-per-s", "6338", "--json"])
    assert rc == 0
    report = json.loads(capsys.readouterr().out)
    assert report["tflops_per_gpu"] == pytest.approx(1648, rel=0.05)
    assert report["gflop_per_token"] == pytest.approx(sum(
        report["breakdown_gflop_per_token"].values()))


def test_cli_flops_text_and_env_json(capsys):
    assert _run_cli(["flops", "--preset", "tiny"]) == 0
    out = capsys.readouterr().out
    assert "GFLOP/token" in out and "mlp" in out and "TFLOPS" not in out
    assert _run_cli(["env", "--json"]) == 0
    env = json.loads(capsys.readouterr().out)
    assert env["device"] in ("cpu", "cuda")
    assert env["triton_mode"] in ("compiled", "interpreted")
    with pytest.raises(SystemExit):
        _run_cli(["flops", "--preset", "no_such_model"])
