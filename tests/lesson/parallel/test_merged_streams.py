"""The CUDA side-stream path of `MergedStep`, checked on the CPU with stand-in streams.

No GPU here: the test swaps ``torch.cuda.current_stream``, ``torch.cuda.stream`` and
``Tensor.record_stream`` for stand-ins that log every call, gives the step a stand-in side
stream, and runs a two-micro-batch 1F1B step (chunked) on a process group of one rank (gloo,
in this process). The log must show the ordering contract of the module docstring, for every
collective: the side stream waits for the compute stream before the collective is issued on
it, the tensor sent is recorded on the side stream, and before the consuming stage reads the
output the compute stream waits for the side stream and the output is recorded on it. Run
once with the work handles of a real group (a group of one rank has none: its copy runs on
the side stream, and nothing but the stream wait orders it) and once with stand-in handles.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from moe_lab.config import MoEConfig
from moe_lab.moe.layer import MoELayer
from moe_lab.parallel import merged
from moe_lab.parallel.ep import from_layer
from moe_lab.parallel.plan import plan, stage_graph

CFG = MoEConfig(d_model=16, n_experts=4, top_k=2, d_expert=24, n_shared_experts=1)
CONSUMER = {"dispatch": "experts_fwd", "combine": "unpermute", "combine⁻¹": "experts_dgrad",
            "dispatch⁻¹": "route_bwd"}
# the `ChunkStages` method of each compute stage; the consumers above read their collective's output
STAGE_METHODS = ("route", "shared_fwd", "experts_fwd", "unpermute", "unpermute_bwd", "shared_bwd",
                 "experts_dgrad", "experts_wgrad", "route_bwd")


class _Stream:
    def __init__(self, name: str, log: list) -> None:
        self.name, self.log = name, log

    def wait_stream(self, other: _Stream) -> None:
        self.log.append(("wait_stream", self.name, other.name))


class _Work:
    def __init__(self, out: torch.Tensor, log: list) -> None:
        self.out, self.log = out, log

    def wait(self) -> None:
        self.log.append(("work.wait", self.out))


def _run_logged(monkeypatch: pytest.MonkeyPatch, fake_work: bool) -> tuple[list, list[torch.Tensor]]:
    log: list = []
    compute, side = _Stream("compute", log), _Stream("side", log)
    current = [compute]

    @contextlib.contextmanager
    def stream(s: _Stream):
        log.append(("enter", s.name))
        current.append(s)
        yield
        current.pop()
        log.append(("exit", s.name))

    real_exchange = merged.exchange_rows

    def exchange(x, out_splits, in_splits, group, async_op=False):
        if not async_op:  # the blocking count exchange
            log.append(("counts", current[-1].name))
            return real_exchange(x, out_splits, in_splits, group)
        out, work = real_exchange(x, out_splits, in_splits, group, async_op=True)
        log.append(("issue", x, out, current[-1].name))
        return out, (_Work(out, log) if fake_work else work)

    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: current[-1])
    monkeypatch.setattr(torch.cuda, "stream", stream)
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda t, s: log.append(("record", t, s.name)),
                        raising=False)
    monkeypatch.setattr(merged, "exchange_rows", exchange)

    torch.manual_seed(0)
    ep = from_layer(MoELayer(CFG, "dropless", "torch"))
    step = merged.MergedStep(ep, 2)
    step.comm_stream = side  # what a CUDA layer gets (torch.cuda.Stream(priority=-1))

    def logged(method: str, fn):  # log a compute stage as it begins (with what it reads) and ends
        def call(*args):
            log.append(("call", method, args[1] if len(args) > 1 else None))
            result = fn(*args)
            log.append(("done", method))
            return result
        return call

    for method in STAGE_METHODS:
        setattr(step.ops, method, logged(method, getattr(step.ops, method)))
    xs = [torch.randn(12, CFG.d_model) for _ in range(2)]
    gs = [torch.randn(12, CFG.d_model) for _ in range(2)]
    mb0, mb1 = step.microbatch(xs[0], gs[0], "mb0"), step.microbatch(xs[1], gs[1], "mb1")
    collectives = []  # the names of the all-to-alls, in the order the plans start them
    for fwd, bwd in ((mb0, None), (mb1, mb0), (None, mb1)):
        order = plan("1f1b+chunked", 2, fwd is not None, bwd is not None)
        stages = stage_graph(2, fwd is not None, bwd is not None)
        collectives += [s for s in order if stages[s].lane == "comm" and stages[s].kind != "counts"]
        step.run(order, fwd=fwd, bwd=bwd)
    return log, collectives, [mb0.y, mb1.y, mb0.dx, mb1.dx]


def _where(log: list, start: int, pred) -> int:
    return next((i for i in range(start, len(log)) if pred(log[i])), -1)


@pytest.mark.parametrize("fake_work", [False, True], ids=["one-rank group", "work handles"])
def test_side_stream_waits_and_records_in_order(one_rank_group, monkeypatch, fake_work):
    log, collectives, results = _run_logged(monkeypatch, fake_work)
    issues = [i for i, e in enumerate(log) if e[0] == "issue"]
    assert len(issues) == len(collectives) == 16  # 2 micro-batches x 2 chunks x 4 all-to-alls
    assert [e for e in log if e[0] == "counts"] == [("counts", "compute")] * 2  # one per forward
    for i, name in zip(issues, collectives, strict=True):
        _, x, out, issued_on = log[i]
        kind = name.split(".")[1].split("[")[0]  # e.g. "F.dispatch[1]"
        assert issued_on == "side", name
        # 1. the side stream waited for the compute stream after the previous stage, before the issue
        began = max(j for j in range(i) if log[j][0] in ("done", "issue"))
        assert ("wait_stream", "side", "compute") in log[began:i], name
        # 2. the sent tensor is recorded on the side stream within its stage
        nxt = _where(log, i + 1, lambda e: e[0] in ("call", "issue"))
        assert any(e[0] == "record" and e[1] is x and e[2] == "side" for e in log[i:nxt]), name
        # 3. before the consumer reads the output: the work waited (if any), the compute stream
        #    waited for the side stream, and the output was recorded on the compute stream
        read = _where(log, i, lambda e, c=CONSUMER[kind], o=out: e[0] == "call" and e[1] == c and e[2] is o)
        assert read > i, name
        window = log[i:read]
        assert ("wait_stream", "compute", "side") in window, f"{name}: read before the stream wait"
        assert any(e[0] == "record" and e[1] is out and e[2] == "compute" for e in window), name
        if fake_work:
            assert any(e[0] == "work.wait" and e[1] is out for e in window), name
    # the stand-ins changed the order of calls only, not what is computed
    monkeypatch.undo()
    torch.manual_seed(0)
    ep = from_layer(MoELayer(CFG, "dropless", "torch"))
    xs = [torch.randn(12, CFG.d_model) for _ in range(2)]
    gs = [torch.randn(12, CFG.d_model) for _ in range(2)]
    ys, dxs, _ = merged.two_microbatch_step(merged.MergedStep(ep, 2), xs, gs, "1f1b+chunked")
    for got, want in zip(results, ys + dxs, strict=True):
        assert torch.equal(got, want)
