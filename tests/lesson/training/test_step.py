"""The sync-free training step: the certificate (tiny and small), the schedule on the device,
the capturable optimizer, statistics read every N steps, agreement with the naive trainer,
the ladder of fixes, host-overhead accounting and the step benchmark."""

from __future__ import annotations

import argparse
import importlib.util
from dataclasses import replace

import pytest
import torch

from moe_lab import preset
from moe_lab.model import MoETransformer
from moe_lab.moe import experts
from moe_lab.training.build import build_model, build_sync_free, random_batch
from moe_lab.training.optim import lr_schedule, make_optimizer
from moe_lab.training.steps import StepConfig, SyncFreeStep
from moe_lab.training.sync import SyncError, count_syncs
from moe_lab.workbench.demos.ladder import LADDER, ladder_step
from moe_lab.workbench.measure.host_overhead import count_ops, overhead_sweep, shrunk_config
from moe_lab.workbench.training.loop import TrainConfig, train

TINY = preset("tiny")
SMALL = preset("small")


# ------------------------------------------------------------------------------ the certificate


@pytest.mark.parametrize("model_cfg", [TINY, SMALL], ids=["tiny", "small"])
def test_whole_step_is_certified_sync_free(model_cfg):
    step = build_sync_free(model_cfg, 2)
    step.certify()  # forward, backward, clip, schedule, optimizer, statistics


def test_gpu_configuration_is_certified_on_the_cpu():
    pytest.importorskip("moe_lab.kernels.fused_router")
    step = build_sync_free(SMALL, 2, expert_backend="triton", router_impl="triton")
    step.certify()  # fake tensors: the Triton kernels never launch here


def test_certificate_touches_nothing_real():
    step = build_sync_free(TINY, 2)
    before = [p.detach().clone() for p in step.model.parameters()]
    step.certify()
    assert all(torch.equal(a, b) for a, b in zip(before, step.model.parameters(), strict=True))
    assert all(p.grad is None for p in step.model.parameters())
    assert len(step.optimizer.state) == 0
    assert float(step.state.step) == 0 and float(step.state.sums.abs().sum()) == 0
    step(random_batch(TINY, 2))  # and the real step still runs on real tensors
    assert len(step.optimizer.state) == len(list(step.model.parameters()))
    step.certify()  # with optimizer state present too
    assert float(step.state.step) == 1


def test_certificate_covers_the_optimizer():
    """A sync inside optimizer.step is found (the optimizer is pointed at the fake params)."""
    step = build_sync_free(TINY, 2)

    def syncing_step_hook(optimizer, args, kwargs):
        optimizer.param_groups[0]["params"][0].sum().item()

    step.optimizer.register_step_pre_hook(syncing_step_hook)
    with pytest.raises(SyncError, match="_local_scalar_dense"):
        step.certify()


def test_certificate_refuses_the_naive_dispatcher():
    torch.manual_seed(0)
    model = MoETransformer(TINY, dispatcher="naive")
    step = SyncFreeStep(model, make_optimizer(model), random_batch(TINY, 2))
    with pytest.raises(SyncError) as err:
        step.certify()
    assert err.value.op == "aten.nonzero.default"
    assert "dispatch.py" in err.value.where


def test_refuses_experts_that_sync_inside_an_op_on_cuda(monkeypatch):
    """torch._grouped_mm on CUDA syncs inside the op in any dtype but bfloat16, where the
    certificate cannot look: the step refuses it when built. No GPU here: the experts'
    device check is mocked."""
    batch = random_batch(TINY, 2)
    model, optimizer = build_model(TINY, expert_backend="torch")
    SyncFreeStep(model, optimizer, batch)  # fp32 on a CPU is fine
    monkeypatch.setattr(experts, "_on_cuda", lambda device: True)
    with pytest.raises(ValueError, match=r"model: torch\._grouped_mm \(expert backend 'torch'\) "
                       r"in torch\.float32 on CUDA") as err:
        SyncFreeStep(model, optimizer, batch)
    assert "model.bfloat16() or expert_backend='triton'" in str(err.value)
    model.bfloat16()
    SyncFreeStep(model, make_optimizer(model), batch)  # bfloat16 takes the sync-free kernel
    loop, loop_optimizer = build_model(TINY, expert_backend="loop")
    SyncFreeStep(loop, loop_optimizer, batch)  # fp32 with no hidden sync


def test_a_real_step_has_no_sync_and_a_read_is_one():
    step = build_sync_free(TINY, 2, cfg=StepConfig(read_every=3))
    batch = random_batch(TINY, 2)
    results, counts = [], []
    for _ in range(3):
        result, c = count_syncs(step, batch)
        results.append(result)
        counts.append(sum(c.values()))
    assert counts == [0, 0, 1]
    assert results[:2] == [None, None]
    stats = results[2]
    assert stats["steps"] == 3 and stats["step"] == 3 and stats["skipped"] == 0
    assert len(stats["tokens_per_expert"]) == TINY.n_moe_layers
    assert all(sum(c) == 3 * 2 * TINY.seq_len * TINY.moe.top_k for c in stats["tokens_per_expert"])
    assert all(i >= 1.0 for i in stats["imbalance"])
    assert stats["grad_norm_max"] >= stats["grad_norm"] > 0
    schedule = StepConfig(steps=200, warmup_steps=20).schedule
    assert stats["lr"] == pytest.approx(schedule.lr_at(2), rel=1e-6)


# ------------------------------------------------------------------------------ the pieces


@pytest.mark.parametrize("warmup,total,ratio", [(20, 200, 0.1), (0, 50, 0.0), (5, 5, 0.5), (3, 40, 1.0)])
def test_lr_schedule_on_the_device_is_lr_at(warmup, total, ratio):
    cfg = StepConfig(lr=3e-3, warmup_steps=warmup, steps=total, min_lr_ratio=ratio)
    for s in range(total + 3):
        got = float(lr_schedule(torch.tensor(float(s)), cfg.schedule))
        assert got == pytest.approx(cfg.schedule.lr_at(s), rel=1e-6, abs=1e-12), s


def test_optimizer_is_capturable_with_a_shared_device_lr():
    model, optimizer = build_model(TINY)
    groups = optimizer.param_groups
    assert all(g["fused"] and g["capturable"] for g in groups)
    assert isinstance(groups[0]["lr"], torch.Tensor) and groups[0]["lr"] is groups[1]["lr"]
    decay = {id(p) for p in groups[0]["params"]}
    for name, p in model.named_parameters():
        assert (id(p) in decay) == (p.dim() >= 2 and "embed" not in name), name


def test_found_inf_skips_the_whole_update():
    model, optimizer = build_model(TINY)
    step = SyncFreeStep(model, optimizer, random_batch(TINY, 2))
    step.state.skip.fill_(1.0)
    optimizer.found_inf = step.state.skip
    before = [p.detach().clone() for p in model.parameters()]
    step.load(random_batch(TINY, 2))
    step.run()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


def test_refuses_a_host_lr_and_a_wrong_batch():
    model = MoETransformer(TINY, dispatcher="dropless")
    batch = random_batch(TINY, 2)
    with pytest.raises(ValueError, match="lr must be a device tensor"):
        SyncFreeStep(model, torch.optim.AdamW(model.parameters(), lr=1e-3), batch)
    step = SyncFreeStep(model, make_optimizer(model), batch)
    with pytest.raises(ValueError, match=r"\(2, 64\)"):
        step(random_batch(TINY, 3))
    with pytest.raises(ValueError, match="read_every"):
        StepConfig(read_every=0)
    with pytest.raises(ValueError, match="overflow_policy"):
        StepConfig(overflow_policy="ignore")


def test_matches_the_naive_trainer():
    """The same loop with the eager and the sync-free step (same seeds, batches and
    schedule): the same losses and grad norms (fused vs single-tensor AdamW agree to
    rounding)."""
    model_cfg = preset("tiny", n_layers=1, seq_len=32)
    tcfg = TrainConfig(steps=4, batch_size=2, warmup_steps=2, eval_every=0, progress=False,
                       dispatcher="dropless", expert_backend="torch")
    naive = train(model_cfg, tcfg).history
    fast = train(model_cfg, replace(tcfg, step="sync_free", read_every=1)).history
    assert [r["step"] for r in fast] == [1, 2, 3, 4]
    for a, b in zip(naive, fast, strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-4)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-3)
        assert b["lr"] == pytest.approx(a["lr"], rel=1e-6)
        assert b["tokens_per_expert"] == a["tokens_per_expert"]


@pytest.mark.parametrize("grad_clip", [1e-3, 1e3], ids=["clipping", "not clipping"])
def test_clip_folded_into_the_fused_adamw_equals_clip_grad_norm(grad_clip):
    """The fused optimizer divides the gradients by ``grad_scale = max(1, norm / max_norm)``
    as it reads them; the same steps with clip_grad_norm_'s in-place multiply end at the
    same parameters, and report the same (unclipped) gradient norm."""
    cfg = StepConfig(grad_clip=grad_clip, read_every=1)
    steps = [build_sync_free(TINY, 2, cfg=cfg) for _ in range(2)]
    assert steps[0].fused_clip and steps[0].optimizer.grad_scale is steps[0].state.grad_scale
    steps[1].fused_clip = False
    del steps[1].optimizer.grad_scale
    gen = torch.Generator().manual_seed(3)
    batches = [random_batch(TINY, 2, generator=gen) for _ in range(3)]
    stats = [[step(b) for b in batches] for step in steps]
    expected_scale = max(1.0, (stats[0][-1]["grad_norm"] + 1e-6) / grad_clip)
    assert float(steps[0].state.grad_scale) == pytest.approx(expected_scale, rel=1e-5)
    assert float(steps[1].state.grad_scale) == 1.0  # never used by the unfused path
    for a, b in zip(stats[0], stats[1], strict=True):
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4)
    for p, q in zip(steps[0].model.parameters(), steps[1].model.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-6)


def test_expert_bias_balancing_matches_the_naive_trainer_and_stays_sync_free():
    model_cfg = preset("tiny", n_layers=1, seq_len=32)
    tcfg = TrainConfig(steps=3, batch_size=2, warmup_steps=1, eval_every=0, progress=False,
                       dispatcher="dropless", expert_backend="torch", expert_bias_rate=1e-2)
    naive = train(model_cfg, tcfg)
    fast = train(model_cfg, replace(tcfg, step="sync_free", read_every=1)).history
    for a, b in zip(naive.history, fast, strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-4)
        assert b["tokens_per_expert"] == a["tokens_per_expert"]
    build_sync_free(TINY, 2, cfg=StepConfig(expert_bias_rate=1e-2)).certify()


def test_graphed_training_loop_runs_on_the_cpu():
    model_cfg = preset("tiny", n_layers=1, seq_len=32)
    tcfg = TrainConfig(steps=4, batch_size=2, warmup_steps=2, eval_every=0, progress=False,
                       dispatcher="dropless", expert_backend="torch", read_every=3)
    eager = train(model_cfg, replace(tcfg, step="sync_free")).history
    graphed = train(model_cfg, replace(tcfg, step="graphed")).history
    assert [r["loss"] for r in graphed] == [r["loss"] for r in eager]
    assert [r["steps"] for r in eager] == [3, 1]  # the last, shorter window is read too


# ------------------------------------------------------------------------------ the ladder


def test_ladder_counts_syncs_down_to_zero():
    batch = random_batch(TINY, 2)
    totals = []
    for n in range(len(LADDER) + 1):
        step = ladder_step(TINY, batch, n)
        step()  # optimizer state exists, as in a running loop
        _, counts = count_syncs(step)
        totals.append((sum(counts.values()), counts))
    syncs = [t for t, _ in totals]
    assert syncs[0] > syncs[1] > syncs[2] > syncs[3] == 0
    assert totals[0][1]["aten.nonzero.default"] >= TINY.moe.n_experts * TINY.n_moe_layers
    assert "aten.nonzero.default" not in totals[1][1]
    assert set(totals[2][1]) == {"aten._local_scalar_dense.default"}  # the optimizer's step count
    n_params = len(list(MoETransformer(TINY).parameters()))
    assert totals[2][0] == n_params


# ------------------------------------------------------------------------------ host overhead


def test_count_ops_counts_forward_backward_and_views():
    x = torch.randn(4, 3, requires_grad=True)

    def fn():
        y = (x * 2).t().sum()
        y.backward()

    _, summary = count_ops(fn)
    assert summary["ops"] >= 4 and summary["views"] >= 1
    assert summary["compute"] == summary["ops"] - summary["views"]
    assert summary["by_op"]["aten.mul"] >= 1


def test_overhead_sweep_keeps_the_ops_and_shrinks_the_work():
    rows = overhead_sweep((64, 16), batch_size=1, min_time_s=0.02, per_op_s=5e-6)
    assert rows[0]["ops"] == rows[1]["ops"] > 100
    assert rows[0]["params"] > rows[1]["params"]
    assert all(r["floor_ms"] == pytest.approx(r["ops"] * 5e-3) for r in rows)
    assert shrunk_config("small", 64).moe.d_expert == 64


# ------------------------------------------------------------------------------ the benchmark


def test_bench_step_records_syncs_ops_and_memory(monkeypatch):
    from moe_lab.workbench.benchmarks import step as bench_step
    from moe_lab.workbench.measure import ledger

    args = argparse.Namespace(preset="tiny", batch_size=2, profile="smoke", no_compile=True,
                              notebook="test:bench-step")
    monkeypatch.setitem(bench_step.MIN_TIME, "smoke", 0.05)
    result = bench_step.run(args)
    rows = {r["provider"]: r for r in result["rows"]}
    assert rows["eager"]["syncs_per_iter"] == 0 and rows["naive"]["syncs_per_iter"] > 0
    assert rows["naive"]["ops_per_iter"] > rows["eager"]["ops_per_iter"] > 0
    assert ("graphed" in rows) == torch.cuda.is_available()
    assert result["memory"]["pool_mb"] < result["memory"]["worst_case_mb"]
    records = [r for r in ledger.read() if r["notebook"] == "test:bench-step"]
    assert {r["metric"] for r in records} >= {"iteration_ms", "syncs_per_step", "ops_per_step",
                                              "stash_saving_vs_worst_case"}


@pytest.mark.skipif(importlib.util.find_spec("moe_lab.workbench.benchmarks") is None,
                    reason="no bench package")
def test_bench_step_module_follows_the_contract():
    from moe_lab.workbench.benchmarks import step as bench_step

    assert bench_step.DESCRIPTION
    parser = argparse.ArgumentParser()
    bench_step.add_arguments(parser)
    args = parser.parse_args(["--preset", "tiny", "--no-compile"])
    assert args.preset == "tiny" and args.no_compile


# ------------------------------------------------------------------------------ the clip-step registry


def test_a_registered_clip_step_replaces_torchs_path(monkeypatch):
    from moe_lab.training.optim import CLIP_STEPS

    calls = []

    def factory(optimizer):
        def step(max_norm, grad_scale, skip):
            calls.append(max_norm)
            if len(calls) > 1:
                return None  # does not apply at this step: torch's path runs instead
            norm = torch.nn.utils.get_total_norm(
                [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None])
            grad_scale.copy_(((norm + 1e-6) / max_norm).clamp(min=1.0))
            optimizer.step()
            return norm

        return step

    monkeypatch.setitem(CLIP_STEPS, "test_clip", factory)
    cfg = StepConfig(read_every=1, grad_clip=0.5)
    ours = build_sync_free(TINY, 2, cfg=cfg)
    ours.clip = factory(ours.optimizer)
    theirs = build_sync_free(TINY, 2, cfg=cfg)
    assert theirs.clip is None  # torch's path: nothing to replace
    gen = torch.Generator().manual_seed(5)
    for batch in [random_batch(TINY, 2, generator=gen) for _ in range(2)]:
        a, b = ours(batch), theirs(batch)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-5)
    assert calls == [0.5, 0.5]
    for p, q in zip(ours.model.parameters(), theirs.model.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-7)
    model, optimizer = build_model(TINY)
    step = SyncFreeStep(model, optimizer, random_batch(TINY, 2), clip_step="test_clip")
    assert step.clip is not None
    with pytest.raises(ValueError, match="clip_step must be one of"):
        SyncFreeStep(model, optimizer, random_batch(TINY, 2), clip_step="teleport")
