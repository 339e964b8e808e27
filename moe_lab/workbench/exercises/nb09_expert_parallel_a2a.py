"""Exercises of notebook 09 (expert parallelism): the all-to-all's split sizes from a routing
map, the exposed communication a chunked pipeline leaves, predicted from chunk timings, and
the order of the stages of a 1F1B-merged step, checked on its event log."""

from __future__ import annotations

import random
from collections.abc import Callable

import torch

from moe_lab.parallel.ep import traffic_matrix
from moe_lab.parallel.plan import (
    MODEL_COSTS,
    PlanError,
    Stage,
    check_plan,
    plan,
    simulate_plan,
    stage_graph,
)
from moe_lab.workbench.exercises import ExerciseError, call_answer, close, exercise


def a2a_splits(topk_ids_per_rank: list[torch.Tensor], n_experts: int,
               rank: int) -> tuple[list[int], list[int]]:
    """The split sizes rank ``rank`` passes to ``all_to_all_single`` for the dispatch.

    ``topk_ids_per_rank[r]: [T_r, k]`` is rank ``r``'s routing; with ``W`` ranks, rank ``j``
    owns experts ``j·E/W … (j+1)·E/W − 1``. Returns ``(input_splits, output_splits)``:
    how many rows rank ``rank`` sends to each rank, and receives from each rank.
    """
    matrix = traffic_matrix(topk_ids_per_rank, n_experts)  # [source, destination]
    return matrix[rank].tolist(), matrix[:, rank].tolist()


def predict_exposed(comm_s: list[float], compute_s: list[float]) -> float:
    """Exposed communication of a two-stage pipeline over chunks.

    Chunk ``i`` must be received (``comm_s[i]`` seconds on the link) before it is computed
    (``compute_s[i]`` seconds on the processor). The link sends the chunks one after the
    other from time 0; the processor computes them in order, each as soon as it has arrived
    and the previous one is done. Returns ``step time − Σ compute_s``.
    """
    link_free = cpu_free = 0.0
    for a, c in zip(comm_s, compute_s, strict=True):
        link_free += a  # chunk i has arrived
        cpu_free = max(cpu_free, link_free) + c
    return cpu_free - sum(compute_s)


@exercise(a2a_splits)
def check_a2a_splits(fn: Callable[[list[torch.Tensor], int, int], tuple[list[int], list[int]]]) -> None:
    """Raises ExerciseError unless ``fn`` gives every rank's input and output splits,
    including ranks that receive nothing."""
    g = torch.Generator().manual_seed(7)
    cases = [
        ([torch.randint(0, 8, (12, 2), generator=g) for _ in range(2)], 8),
        ([torch.randint(0, 8, (9, 2), generator=g) for _ in range(4)], 8),
        ([torch.randint(0, 4, (10, 1), generator=g) for _ in range(4)], 16),  # ranks 2, 3 get nothing
    ]
    for routing, n_experts in cases:
        world = len(routing)
        for rank in range(world):
            got = call_answer(fn, [r.clone() for r in routing], n_experts, rank)
            want = a2a_splits(routing, n_experts, rank)
            try:
                got = tuple([int(v) for v in part] for part in got)
            except (TypeError, ValueError):
                raise ExerciseError(f"return two lists of {world} ints (input_splits, "
                                    f"output_splits), got {got!r}") from None
            if got != want:
                hint = ""
                if got == (want[1], want[0]):
                    hint = (" (input and output swapped: input_splits is what this rank sends, "
                            "row [rank] of the traffic matrix; output_splits what it receives, "
                            "column [rank])")
                raise ExerciseError(
                    f"{world} ranks, {n_experts} experts, rank {rank}: got input_splits="
                    f"{got[0]}, output_splits={got[1]}; expected {want[0]} and {want[1]}{hint}. "
                    "Rank j owns a contiguous block of n_experts / world experts; input_splits "
                    "counts what this rank sends, output_splits what it receives.")
    print("✓ a2a_splits gives every rank's input and output splits")


@exercise(predict_exposed)
def check_predict_exposed(fn: Callable[[list[float], list[float]], float]) -> None:
    """Raises ExerciseError unless ``fn`` predicts the pipeline's exposed time, on hand-made
    and random chunk timings."""
    cases = [
        ([0.1], [0.3]),  # one chunk: nothing to overlap with
        ([0.1, 0.1, 0.1, 0.1], [0.3, 0.3, 0.3, 0.3]),  # compute-bound: only the first transfer shows
        ([0.3, 0.3, 0.3], [0.1, 0.1, 0.1]),  # link-bound: the link sets the pace
        ([0.0, 0.0], [0.2, 0.2]),
    ]
    rng = random.Random(3)
    for _ in range(20):
        n = rng.randint(1, 8)
        cases.append(([rng.uniform(0, 0.05) for _ in range(n)], [rng.uniform(0, 0.05) for _ in range(n)]))
    for comm, compute in cases:
        got = call_answer(fn, list(comm), list(compute))
        want = predict_exposed(comm, compute)
        if not (isinstance(got, (int, float)) and close(got, want, abs_tol=1e-9)):
            hint = ""
            if close(got, sum(comm)):
                hint = (" (that is every transfer exposed: the link sends chunk i + 1 while chunk i "
                        "computes, so only what compute does not cover shows)")
            elif comm and close(got, comm[0]):
                hint = (" (that counts only the first transfer: when the link is slower than the "
                        "compute, later chunks arrive late too and the processor waits for each)")
            raise ExerciseError(
                f"comm_s={[round(a, 4) for a in comm]}, compute_s={[round(c, 4) for c in compute]}: "
                f"got {got!r}, expected {want:.6g} s{hint}. Chunk i can start computing only when it has "
                "arrived (the link sends one chunk after another from t=0) and the previous chunk "
                "is computed; exposed = step time − total compute.")
    print("✓ predict_exposed models the pipeline")


def merged_order(stages: dict[str, Stage]) -> list[str]:
    """An order of the stages of one merged 1F1B unit (one chunk: micro-batch ``F``'s forward
    and micro-batch ``B``'s backward of one MoE layer) in which no collective is waited on
    before it can have finished: every all-to-all is started early and has compute of the
    *other* micro-batch (or work nothing waits for) between its start and its use.
    ``stages``: `moe_lab.parallel.plan.stage_graph(1)`, names to `Stage` (``lane``, ``deps``)."""
    return plan("1f1b", 1)


@exercise(merged_order)
def check_merged_order(fn: Callable[[dict[str, Stage]], list[str]]) -> None:
    """Raises ExerciseError unless ``fn(stages)`` returns an order of every stage of
    ``stage_graph(1)``, each after its dependencies, whose event log on the model machine
    (`moe_lab.parallel.plan.simulate_plan`: one processor, one link carrying the collectives
    one after another, costs `MODEL_COSTS`) has no wait on a collective that had not
    finished."""
    stages = stage_graph(1)
    order = call_answer(fn, dict(stages))
    try:
        order = [str(name) for name in order]
    except TypeError:
        raise ExerciseError(f"return a list of stage names, got {order!r}") from None
    try:
        check_plan(order, stages)
    except PlanError as exc:
        described = "; ".join(f"{name} ({s.lane}, after {', '.join(s.deps) or 'nothing'})"
                              for name, s in stages.items())
        raise ExerciseError(f"{exc}. The stages: {described}") from None
    log, _ = simulate_plan(order, stages)
    early = [e for e in log if e["op"] == "wait" and e["idle"] > 1e-9 and e["stage"] != "F.counts"]
    if early:
        e = early[0]
        raise ExerciseError(
            f"{e['stage']} is waited on at t={e['t']:g} but cannot finish before t={e['finish']:g} "
            f"(costs: {', '.join(f'{k} {v:g}' for k, v in MODEL_COSTS.items())}; the link carries "
            "one collective at a time, in the order they were started). Start each all-to-all "
            "as soon as its input exists, and put compute of the other micro-batch, or work "
            "nothing waits for (shared experts, weight gradients), between it and its use.")
    print("✓ merged_order: every collective has finished by the time it is used "
          f"({sum(1 for e in log if e['op'] == 'wait') - 1} waits, no idle time)")
