"""moe_lab's one-call clip + AdamW for the CPU against torch's norm, clip and fused AdamW."""

import pytest
import torch

import moe_lab.workbench.cpu
from moe_lab.training.build import random_batch
from moe_lab.training.optim import make_optimizer
from moe_lab.training.steps import SyncFreeStep
from moe_lab.training.sync import SyncError
from moe_lab.workbench.cpu import build as cpu_ext
from moe_lab.workbench.cpu import optim as cpu_optim

pytestmark = [pytest.mark.skipif(cpu_ext.compiler() is None,
                                reason="no C++ compiler: the CPU kernels cannot be built"),
              pytest.mark.usefixtures("cpu_plugin")]

# sizes with vector tails, a tensor larger than one chunk (2^15), a scalar
SHAPES = [(300, 7), (3, 128, 129), (5,), (1,), (64, 64)]


def params_and_optimizer(seed=0, shapes=SHAPES):
    g = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(*s, generator=g)) for s in shapes]
    groups = [{"params": params[:2] + params[4:], "weight_decay": 0.1},
              {"params": params[2:4], "weight_decay": 0.0}]
    return params, torch.optim.AdamW(groups, lr=torch.tensor(3e-3), betas=(0.9, 0.95), fused=True,
                                     capturable=True)


def torch_clip_adamw(optimizer, params, max_norm, grad_scale):
    norm = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])
    grad_scale.copy_(((norm + 1e-6) / max_norm).clamp(min=1.0))
    optimizer.grad_scale = grad_scale
    optimizer.step()
    return norm


@pytest.mark.parametrize("max_norm", [0.5, 1e4], ids=["clipping", "not clipping"])
def test_matches_torch_norm_clip_and_fused_adamw(max_norm):
    ours, opt_ours = params_and_optimizer()
    theirs, opt_theirs = params_and_optimizer()
    scale_ours, scale_theirs, skip = torch.ones(()), torch.ones(()), torch.zeros(())
    g = torch.Generator().manual_seed(1)
    for step in range(4):
        for p, q in zip(ours, theirs, strict=True):
            grad = torch.randn(p.shape, generator=g) * (10.0 if step == 1 else 0.1)
            p.grad, q.grad = grad.clone(), grad.clone()
        keep = [p.grad.clone() for p in ours]
        norm = cpu_optim.clip_adamw_(opt_ours, max_norm, scale_ours, skip)
        ref = torch_clip_adamw(opt_theirs, theirs, max_norm, scale_theirs)
        assert norm.shape == () and float(norm) == pytest.approx(float(ref), rel=1e-5)
        assert float(scale_ours) == pytest.approx(float(scale_theirs), rel=1e-5)
        assert all(torch.equal(p.grad, k) for p, k in zip(ours, keep, strict=True))  # only read
        for p, q in zip(ours, theirs, strict=True):
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
            for key in ("exp_avg", "exp_avg_sq", "step"):
                torch.testing.assert_close(opt_ours.state[p][key], opt_theirs.state[q][key],
                                           rtol=1e-5, atol=1e-7)
    if max_norm < 1:
        assert float(scale_ours) > 1  # the clip was really applied


def test_skip_changes_nothing_but_reports_the_norm():
    params, opt = params_and_optimizer()
    for p in params:
        p.grad = torch.ones_like(p)
    cpu_optim.clip_adamw_(opt, 1.0, torch.ones(()), torch.zeros(()))  # state exists
    before = {id(p): (p.detach().clone(), {k: v.clone() for k, v in opt.state[p].items()}) for p in params}
    scale = torch.ones(())
    norm = cpu_optim.clip_adamw_(opt, 1.0, scale, torch.ones(()))
    assert float(norm) == pytest.approx(sum(p.numel() for p in params) ** 0.5, rel=1e-6)
    assert float(scale) == pytest.approx(float(norm) + 1e-6, rel=1e-6)
    for p in params:
        value, state = before[id(p)]
        assert torch.equal(p, value)
        assert all(torch.equal(opt.state[p][k], v) for k, v in state.items())


def test_parameters_without_gradients_are_left_alone():
    params, opt = params_and_optimizer()
    for p in params[1:]:
        p.grad = torch.randn_like(p)
    value = params[0].detach().clone()
    cpu_optim.clip_adamw_(opt, 1.0, torch.ones(()), torch.zeros(()))
    assert torch.equal(params[0], value) and params[0] not in opt.state
    assert all(float(opt.state[p]["step"]) == 1 for p in params[1:])


def test_non_finite_gradients_give_a_non_finite_norm():
    params, opt = params_and_optimizer()
    for p in params:
        p.grad = torch.zeros_like(p)
    params[2].grad[1] = float("nan")
    assert torch.isnan(cpu_optim.clip_adamw_(opt, 1.0, torch.ones(()), torch.zeros(())))


def test_supports_and_refusals():
    params, opt = params_and_optimizer()
    assert cpu_optim.supports(opt) == (cpu_ext.unavailable_reason() is None)
    plain = torch.optim.AdamW(params, lr=1e-3)  # not fused
    assert not cpu_optim.supports(plain)
    assert not cpu_optim.supports(torch.optim.AdamW(params, lr=1e-3, fused=True, amsgrad=True))
    assert not cpu_optim.supports(torch.optim.SGD(params, lr=1e-3))
    two_lrs = torch.optim.AdamW([{"params": params[:2]}, {"params": params[2:], "lr": 1e-2}], lr=1e-3,
                                fused=True)
    assert not cpu_optim.supports(two_lrs)
    transposed = torch.nn.Parameter(torch.randn(4, 6).t())
    assert not cpu_optim.supports(torch.optim.AdamW([transposed], lr=1e-3, fused=True))
    with pytest.raises(RuntimeError, match="max_norm must be > 0"):
        cpu_optim.clip_adamw_(opt, 0.0, torch.ones(()), torch.zeros(()))
    for p in params:
        p.grad = torch.zeros_like(p)
    params[0].grad = torch.zeros(7, 300).t()  # not contiguous
    with pytest.raises(RuntimeError, match=r"grads\[0\] must be a contiguous float32 CPU tensor"):
        cpu_optim.clip_adamw_(opt, 1.0, torch.ones(()), torch.zeros(()))


def test_step_hooks_keep_torchs_step():
    params, opt = params_and_optimizer()
    for p in params:
        p.grad = torch.zeros_like(p)
    step = cpu_optim.one_call_step(opt)
    handle = opt.register_step_pre_hook(lambda *args: None)
    assert step(1.0, torch.ones(()), torch.zeros(())) is None  # torch's path while a hook is registered
    handle.remove()
    assert step(1.0, torch.ones(()), torch.zeros(())) is not None


def test_sync_free_step_uses_it_and_stays_certified():
    from moe_lab.config import preset
    from moe_lab.model import MoETransformer

    cfg = preset("tiny", n_layers=1, seq_len=32)
    runs = []
    assert moe_lab.workbench.cpu.register()
    for clip_step in ("cpu_one_call", "torch"):
        torch.manual_seed(0)
        model = MoETransformer(cfg, dispatcher="dropless", expert_backend="torch")
        step = SyncFreeStep(model, make_optimizer(model), random_batch(cfg, 2), clip_step=clip_step)
        assert (step.clip is not None) == (clip_step == "cpu_one_call")
        gen = torch.Generator().manual_seed(4)
        for _ in range(3):
            step(random_batch(cfg, 2, generator=gen))
        runs.append(step)
    for p, q in zip(runs[0].model.parameters(), runs[1].model.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-6)
    runs[0].certify()
    # a sync inside the op's Python would be found: the certificate runs it on fake tensors
    original = cpu_optim._clip_adamw

    def syncing(*args, **kwargs):
        args[0][0].sum().item()
        return original(*args, **kwargs)

    cpu_optim._clip_adamw = syncing
    try:
        with pytest.raises(SyncError, match="_local_scalar_dense"):
            runs[0].certify()
    finally:
        cpu_optim._clip_adamw = original
