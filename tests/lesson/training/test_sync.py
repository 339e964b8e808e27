"""Tests for moe_lab.training.sync: which operators count as host syncs, and the fake-tensor check."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from moe_lab.training.sync import SYNC_OPS, SyncError, assert_sync_free, count_syncs

ITEM = "aten._local_scalar_dense.default"


def _total(counts) -> int:
    return sum(counts.values())


# ---------------------------------------------------------------------------------------
# Functions that sync, one per kind
# ---------------------------------------------------------------------------------------


def reads_item(x: torch.Tensor) -> float:
    return x.sum().item()  # the item line


def branches_on_tensor(x: torch.Tensor) -> torch.Tensor:
    if x.sum() > 0:
        return x
    return -x


def calls_nonzero(x: torch.Tensor) -> torch.Tensor:
    return torch.nonzero(x > 0)


def bool_mask_index(x: torch.Tensor) -> torch.Tensor:
    return x[x > 0]


def bincount_with_minlength(ids: torch.Tensor) -> torch.Tensor:
    return torch.bincount(ids, minlength=8)


def repeat_with_tensor(x: torch.Tensor) -> torch.Tensor:
    return torch.repeat_interleave(x, torch.full((x.shape[0],), 2))


def unique_values(ids: torch.Tensor) -> torch.Tensor:
    return torch.unique(ids)


def to_list(x: torch.Tensor) -> list:
    return x.tolist()


SYNCING = [
    (reads_item, "float", {ITEM: 1}),
    (branches_on_tensor, "float", {ITEM: 1}),
    (calls_nonzero, "float", {"aten.nonzero.default": 1}),
    (bool_mask_index, "float", {"aten.index.Tensor (bool mask)": 1}),
    (bincount_with_minlength, "ids", {"aten.bincount.default": 1}),
    (repeat_with_tensor, "float", {"aten.repeat_interleave.Tensor": 1}),
    (unique_values, "ids", {"aten._unique2.default": 1}),
    (to_list, "float", {"Tensor.tolist": 1}),
]


def _input(kind: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    if kind == "ids":
        return torch.randint(0, 8, (32,), generator=g)
    return torch.randn(8, generator=g)


@pytest.mark.parametrize("fn,kind,expected", SYNCING, ids=[f.__name__ for f, _, _ in SYNCING])
def test_syncing_function_is_counted_and_rejected(fn, kind, expected):
    x = _input(kind)
    result, counts = count_syncs(fn, x)
    assert dict(counts) == expected
    # The real result comes back unchanged.
    if isinstance(result, torch.Tensor):
        torch.testing.assert_close(result, fn(x))
    else:
        assert result == fn(x)
    with pytest.raises(SyncError) as info:
        assert_sync_free(fn, x)
    (op,) = expected
    if op == "Tensor.tolist":
        # A fake tensor's tolist reads element by element: the first read is reported.
        assert info.value.op in (op, ITEM)
    else:
        assert info.value.op == op
    assert info.value.phase == "fn"


def test_sync_error_names_op_and_user_line():
    with pytest.raises(SyncError) as info:
        assert_sync_free(reads_item, torch.randn(4))
    err = info.value
    assert isinstance(err, RuntimeError)
    assert "_local_scalar_dense" in err.op
    assert err.where is not None
    assert __file__ in err.where and "the item line" in err.where and "reads_item" in err.where
    assert "_local_scalar_dense" in str(err) and "the item line" in str(err)


def test_tolist_of_many_values_is_one_sync():
    _, counts = count_syncs(to_list, torch.arange(8.0))
    assert _total(counts) == 1
    # A copy to the host followed by a read is still one sync.
    _, counts = count_syncs(lambda t: t.cpu().tolist(), torch.arange(8.0))
    assert _total(counts) == 1


def test_loop_of_n_syncing_calls_counts_n():
    x = torch.randn(5)

    def loop(n: int) -> float:
        total = 0.0
        for _ in range(n):
            total += x.max().item()
        return total

    for n in (1, 3, 7):
        _, counts = count_syncs(loop, n)
        assert counts == {ITEM: n}


def test_bincount_syncs_even_with_minlength_and_histc_only_without_range():
    ids = _input("ids")
    _, counts = count_syncs(torch.bincount, ids)
    assert counts == {"aten.bincount.default": 1}
    x = torch.rand(64)
    _, counts = count_syncs(torch.histc, x, bins=4)
    assert counts == {"aten.histc.default (range from data)": 1}
    _, counts = count_syncs(torch.histc, x, bins=4, min=0.0, max=1.0)
    assert _total(counts) == 0
    assert_sync_free(torch.histc, x, bins=4, min=0.0, max=1.0)


def test_repeat_interleave_with_output_size_does_not_sync():
    x = torch.randn(6)
    reps = torch.tensor([1, 0, 2, 1, 3, 1])
    out, counts = count_syncs(torch.repeat_interleave, x, reps, output_size=8)
    assert _total(counts) == 0
    assert out.shape == (8,)
    assert_sync_free(torch.repeat_interleave, x, reps, output_size=8)


def test_bool_mask_assignment_syncs_unless_value_is_one_host_scalar():
    mask = torch.tensor([True, False, True, True])

    def fill_scalar(x):
        y = x.clone()
        y[mask] = 0.0  # ATen turns this into masked_fill_: no sync
        return y

    def fill_tensor(x):
        y = x.clone()
        y[mask] = torch.ones(3)
        return y

    _, counts = count_syncs(fill_scalar, torch.randn(4))
    assert _total(counts) == 0
    assert_sync_free(fill_scalar, torch.randn(4))
    _, counts = count_syncs(fill_tensor, torch.randn(4))
    assert counts == {"aten.index_put_.default (bool mask)": 1}
    with pytest.raises(SyncError):
        assert_sync_free(fill_tensor, torch.randn(4))


def test_one_hot_counts_as_on_a_gpu():
    ids = _input("ids")
    _, counts = count_syncs(F.one_hot, ids, 8)
    assert _total(counts) == 0  # the CPU kernel's range checks are device asserts on CUDA
    _, counts = count_syncs(F.one_hot, ids)
    assert counts == {"F.one_hot without num_classes": 1}
    _, counts = count_syncs(lambda: F.one_hot(input=ids, num_classes=8))  # by keyword, as on a GPU
    assert not counts
    with pytest.raises(SyncError, match="one_hot"):
        assert_sync_free(F.one_hot, ids)


def test_printing_a_tensor_is_one_sync():
    _, counts = count_syncs(lambda t: f"{t.sum():.3f} {t}", torch.randn(6))
    assert _total(counts) == 2


# ---------------------------------------------------------------------------------------
# Sync-free code
# ---------------------------------------------------------------------------------------


def sync_free_routing(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    logits = x @ w
    probs = torch.softmax(logits, dim=-1)
    weights, experts = torch.topk(probs, k=2, dim=-1)
    flat = experts.flatten()
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(w.shape[1], dtype=torch.long).scatter_add_(0, flat, torch.ones_like(flat))
    permuted = x.index_select(0, order // 2)
    one_hot = F.one_hot(flat, num_classes=w.shape[1])
    return permuted.sum() + counts.sum() + one_hot.sum() + weights.sum()


def test_pure_function_has_no_syncs():
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(16, 8, generator=g), torch.randn(8, 4, generator=g)
    out, counts = count_syncs(sync_free_routing, x, w)
    assert _total(counts) == 0
    torch.testing.assert_close(out, sync_free_routing(x, w))
    fake = assert_sync_free(sync_free_routing, x, w)
    assert fake.shape == out.shape and fake.dtype == out.dtype


class MLP(nn.Module):
    def __init__(self, d: int = 8, hidden: int = 16) -> None:
        super().__init__()
        self.up = nn.Linear(d, hidden)
        self.down = nn.Linear(hidden, d)
        self.register_buffer("scale", torch.full((d,), 0.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x))) * self.scale


def _snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _assert_untouched(model: nn.Module, before: dict[str, torch.Tensor]) -> None:
    after = model.state_dict()
    assert after.keys() == before.keys()
    for name, value in before.items():
        assert type(after[name]) is torch.Tensor, name  # real, not fake
        torch.testing.assert_close(after[name], value, rtol=0, atol=0)
    for name, p in model.named_parameters():
        assert type(p) is nn.Parameter, name
        assert p.grad is None, name


def test_module_forward_and_backward_is_sync_free_and_untouched():
    torch.manual_seed(0)
    model = MLP()
    before = _snapshot(model)
    x = torch.randn(4, 8, requires_grad=True)

    out = assert_sync_free(lambda m, t: m(t).square().mean(), model, x)
    assert out.shape == () and out.requires_grad
    _assert_untouched(model, before)
    assert x.grad is None

    # The module as fn, and the module reached through a closure.
    assert assert_sync_free(model, x).shape == (4, 8)
    _assert_untouched(model, before)

    def loss_of(t):
        return model(t).sum()

    assert_sync_free(loss_of, x)
    _assert_untouched(model, before)
    # The real model still computes with its real weights.
    torch.testing.assert_close(model(x), MLP.forward(model, x))


def test_training_step_with_in_place_update_leaves_real_module_untouched():
    torch.manual_seed(0)
    model = MLP()
    before = _snapshot(model)

    def train_step(x):
        loss = model(x).square().mean()
        loss.backward()
        with torch.no_grad():
            for p in model.parameters():
                p -= 0.1 * p.grad
        return loss.detach()

    assert_sync_free(train_step, torch.randn(4, 8), backward=False)
    _assert_untouched(model, before)
    # The same step run for real does change the model: the check above can fail.
    train_step(torch.randn(4, 8))
    assert not torch.equal(model.up.weight, before["up.weight"])


def test_tied_parameters_are_restored():
    emb = nn.Embedding(10, 4)
    head = nn.Linear(4, 10, bias=False)
    head.weight = emb.weight
    model = nn.Sequential(emb, head)
    before = _snapshot(model)
    assert_sync_free(lambda ids: model(ids).logsumexp(-1).mean(), torch.tensor([[1, 2, 3]]))
    _assert_untouched(model, before)
    assert model[1].weight is model[0].weight


class Gate(nn.Module):
    """A naive router step: the forward picks tokens with nonzero (a sync)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        chosen = (self.proj(x)[:, 0] > 0).nonzero().squeeze(1)  # the nonzero line
        return x[chosen]


def test_module_whose_forward_syncs_fails_in_forward():
    model = Gate()
    before = _snapshot(model)
    with pytest.raises(SyncError) as info:
        assert_sync_free(model, torch.randn(5, 8))
    assert info.value.op == "aten.nonzero.default"
    assert info.value.phase == "fn"
    assert "the nonzero line" in info.value.where
    _assert_untouched(model, before)
    _, counts = count_syncs(model, torch.randn(5, 8))
    assert counts == {"aten.nonzero.default": 1}


class ScaleByNorm(torch.autograd.Function):
    """Forward is sync-free; backward reads a norm on the host."""

    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        norm = grad.norm().item()  # the backward item line
        return grad * (2.0 / max(norm, 1.0))


def test_sync_in_backward_is_caught_only_with_backward():
    x = torch.randn(6, requires_grad=True)

    def fn(t):
        return ScaleByNorm.apply(t).sum()

    with pytest.raises(SyncError) as info:
        assert_sync_free(fn, x)
    assert info.value.phase == "backward"
    assert info.value.op == ITEM
    assert "the backward item line" in info.value.where
    assert_sync_free(fn, x, backward=False)
    assert x.grad is None

    # count_syncs sees backward too, when fn runs it.
    def step(t):
        loss = fn(t)
        loss.backward()
        return loss.detach()

    _, counts = count_syncs(step, x)
    assert counts == {ITEM: 1}
    assert x.grad is not None


def test_first_tensor_that_requires_grad_drives_backward():
    x = torch.randn(6, requires_grad=True)

    def fn(t):
        return {"ids": torch.argsort(t.detach()), "loss": ScaleByNorm.apply(t).sum()}

    with pytest.raises(SyncError) as info:
        assert_sync_free(fn, x)
    assert info.value.phase == "backward"


def test_sync_error_message_gives_the_reason():
    reported = {
        ITEM: "aten._local_scalar_dense",
        "aten.nonzero.default": "aten.nonzero",
        "aten.index.Tensor (bool mask)": "aten.index",
        "aten.bincount.default": "aten.bincount",
        "aten.repeat_interleave.Tensor": "aten.repeat_interleave",
        "aten._unique2.default": "aten._unique2",
        "aten.histc.default (range from data)": "aten.histc",
        "Tensor.tolist": "Tensor.tolist",
        "F.one_hot without num_classes": "F.one_hot without num_classes",
    }
    for name, key in reported.items():
        assert SYNC_OPS[key] in str(SyncError(name)), name
    assert "aten.nonzero_static" not in SYNC_OPS


def test_bad_fn_is_rejected():
    with pytest.raises(ValueError, match="fn must be callable"):
        count_syncs(42)
    with pytest.raises(ValueError, match="fn must be callable"):
        assert_sync_free("not a function")
