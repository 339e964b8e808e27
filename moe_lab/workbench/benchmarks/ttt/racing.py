"""The race: stacks trained to the target in lockstep, each on its own clock.

The clock starts at the first training step. What happens before — building the model,
compiling it, capturing a CUDA graph, all on random tokens, never on training data — is
*initialisation*, reported beside the time to target as ``init_s`` (MLPerf also keeps
initialisation out of the timed region, within a cap). Evaluation time is inside the clock.

Each stack runs in a *lane* holding its `moe_lab.workbench.training.loop.Trainer`: the race advances
the lanes one step each in turn (`race`), each lane's clock adding up only its own steps
and evaluations, so a burst of load from another process on a shared machine slows every
stack alike instead of whichever ran at that moment. `compare_stacks` races every seed;
`ladder_throughput` and `step_breakdowns` time single steps of the same trainers.
"""

from __future__ import annotations

import contextlib
import itertools
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace
from functools import partial

import torch
import torch.utils.deterministic as det

from moe_lab.data import Batch
from moe_lab.perf.capabilities import capabilities
from moe_lab.workbench.benchmarks.ttt.contest import TTTConfig, TTTRun, load_contest_corpus, make_trainer
from moe_lab.workbench.benchmarks.ttt.stacks import Stack, device_of
from moe_lab.workbench.measure.breakdown import step_breakdown
from moe_lab.workbench.measure.timing import compare
from moe_lab.workbench.training.loop import Trainer


def race(stacks: Sequence[Stack], cfg: TTTConfig, *, device: torch.device | str | None = None,
         max_seconds: float | None = None, progress: bool = False) -> list[TTTRun]:
    """Train every stack in ``stacks`` to the target (or for ``cfg.steps``, or until
    ``max_seconds`` of its timed region), *in lockstep*: one step of each in turn (the order
    flipping every step), each stack's clock adding up only its own steps and evaluations.
    With one stack this is a plain run against the wall clock.

    Each stack runs in a *lane*: its trainer (own model, data stream) and its `TTTRun`, whose
    ``elapsed_s`` is the lane's clock while the race runs. At an evaluation that reaches the
    target, a compiled evaluation is confirmed by the plain FP32 one (the naive stack's),
    which has the last word.

    Interleaving needs each step finished before the next lane's begins: on a CPU steps are
    synchronous; on CUDA the sync-free step must not be made to wait after every step, so
    several stacks on CUDA are refused (`compare_stacks` races each alone there).
    """
    device = device_of(device)
    if len(stacks) > 1 and device.type != "cpu":
        raise ValueError(f"race: interleaving several stacks needs a CPU (got {device}); on "
                         "CUDA each stack runs alone so that nothing syncs its steps")
    corpus = load_contest_corpus(cfg)
    hardware = capabilities().hardware_label()
    lanes: list[tuple[Trainer, TTTRun]] = []
    for stack in stacks:
        t0 = time.perf_counter()
        trainer = make_trainer(stack, cfg, device, corpus=corpus, warm_eval=True)
        run = TTTRun(stack=stack.name, description=stack.describe(), seed=cfg.seed, hardware=hardware,
                     target_loss=cfg.target_loss, init_s=time.perf_counter() - t0,
                     tokens_per_step=cfg.tokens_per_step)
        lanes.append((trainer, run))
    solo = len(lanes) == 1
    done: set[int] = set()  # the lanes that reached the target or gave up
    start = time.perf_counter()
    for step in range(cfg.steps):
        active = [i for i in range(len(lanes)) if i not in done]
        if not active:
            break
        for i in active if step % 2 == 0 else active[::-1]:
            trainer, run = lanes[i]
            t0 = time.perf_counter()
            trainer.advance()
            steps = trainer.steps_done
            if steps % cfg.eval_every == 0 or steps == cfg.steps:
                trainer.sync()
                t_eval = time.perf_counter()
                point = {"step": steps}
                loss = trainer.evaluate()["all"]
                if loss <= cfg.target_loss and trainer.eval_forward is not None:
                    point["compiled_eval_loss"] = loss
                    loss = trainer.evaluate(compiled=False)["all"]
                now = time.perf_counter()
                run.eval_s += now - t_eval
                run.elapsed_s = now - start if solo else run.elapsed_s + now - t0
                run.curve.append({**point, "eval_loss": loss, "time_s": run.elapsed_s})
                if progress:
                    print(f"{run.stack:>10} step {steps:4d}  {run.elapsed_s:7.1f} s  "
                          f"eval loss {loss:.3f}", flush=True)
                if loss <= cfg.target_loss:
                    run.time_to_target_s, run.reached = run.elapsed_s, True
                if run.reached or (max_seconds is not None and run.elapsed_s > max_seconds):
                    done.add(i)
            elif not solo:
                run.elapsed_s += time.perf_counter() - t0
    for trainer, run in lanes:
        trainer.sync()
        if solo:
            run.elapsed_s = time.perf_counter() - start
        run.steps = trainer.steps_done
        run.train_s = max(run.elapsed_s - run.eval_s, 1e-9)
        run.tokens_per_s = run.steps * cfg.tokens_per_step / run.train_s
        if run.curve:
            run.final_eval_loss = run.curve[-1]["eval_loss"]
    return [run for _, run in lanes]


@contextlib.contextmanager
def deterministic_algorithms() -> Iterator[None]:
    """Run the enclosed training bit for bit the same every time (on a CPU, for a fixed
    thread count).

    Without it, a compiled stack is not wherever Inductor generates a scatter (the combine's
    ``index_add`` without the CPU plug-in, the embedding's gradient without its
    ``opaque_grad``): Inductor's CPU code adds scattered values with atomic adds, in whatever
    order the threads get there, so two runs of one seed part at the last bits after a few
    steps and, at a target on the flat part of the loss curve, can reach it tens of steps
    apart. The optimised CPU stack with the CPU plug-in has no such scatter left.
    ``torch.use_deterministic_algorithms(True)`` (warnings only) makes Inductor call ATen's
    ordered kernels there instead; it must be on when the model compiles and while it runs
    (Dynamo recompiles when it changes). Uninitialised memory is left as it is (PyTorch
    would otherwise fill every new buffer, at a cost). Restores the previous settings on exit.
    """
    before = (torch.are_deterministic_algorithms_enabled(),
              torch.is_deterministic_algorithms_warn_only_enabled(), det.fill_uninitialized_memory)
    torch.use_deterministic_algorithms(True, warn_only=True)
    det.fill_uninitialized_memory = False
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])
        det.fill_uninitialized_memory = before[2]


def compare_stacks(stacks: Sequence[Stack], cfg: TTTConfig, seeds: Sequence[int] = (0,), *,
                   device: torch.device | str | None = None, max_seconds: float | None = None,
                   progress: bool = False) -> list[TTTRun]:
    """Every stack on every seed. On a CPU the stacks of a seed race in lockstep (`race`);
    elsewhere each races alone, one after the other; their order alternates from seed to
    seed. Either way a slow spell of a shared machine does not land on one stack only."""
    device = device_of(device)
    runs: list[TTTRun] = []
    for i, seed in enumerate(seeds):
        order = list(stacks) if i % 2 == 0 else list(reversed(stacks))
        for group in [order] if device.type == "cpu" else [[stack] for stack in order]:
            runs += race(group, replace(cfg, seed=int(seed)), device=device, max_seconds=max_seconds,
                         progress=progress)
    return runs


def ladder_throughput(rungs: Sequence[tuple[str, Stack]], cfg: TTTConfig, *,
                      device: torch.device | str | None = None, min_time_s: float = 2.0) -> list[dict]:
    """Training tokens/s of one step of every rung, on the same batches, timed interleaved
    (`moe_lab.workbench.measure.timing.compare`: round by round, so noise lands on all rungs alike).
    Returns one
    row per rung: label, stack, median step time, spread, tokens/s, ratio to the first."""
    providers, init_s = _steppers(dict(rungs), cfg, device)
    timings = compare(providers, warmup=2, min_time_s=min_time_s)
    first = next(iter(timings.values())).median_s
    rows = []
    for i, (label, stack) in enumerate(rungs):
        t = timings[label]
        rows.append({"rung": i, "label": label, "stack": stack.describe(),
                     "median_ms": t.median_s * 1e3, "min_ms": t.min_s * 1e3,
                     "max_ms": t.max_s * 1e3, "iqr_ms": t.iqr_s * 1e3, "n": t.n,
                     "tokens_per_s": cfg.tokens_per_step / t.median_s,
                     "vs_first": first / t.median_s, "init_s": init_s[label]})
    return rows


def step_breakdowns(stacks: Sequence[Stack], cfg: TTTConfig, *, steps: int = 5, warmup: int = 3,
                    device: torch.device | str | None = None) -> dict[str, dict]:
    """Where a training step of each stack spends its time, ``{stack.name: breakdown}``
    (`moe_lab.workbench.measure.breakdown.step_breakdown`: ms per step by phase and by kind, under the
    profiler). Each stack's trainer is built as for the race and steps on the contest's
    training batches, ``warmup`` steps first (compiling happens when the trainer is built)."""
    steppers, _ = _steppers({stack.name: stack for stack in stacks}, cfg, device)
    return {name: step_breakdown(fn, steps=steps, warmup=warmup) for name, fn in steppers.items()}


def _steppers(stacks: dict[str, Stack], cfg: TTTConfig, device: torch.device | str | None,
              n_batches: int = 4) -> tuple[dict[str, Callable[[], None]], dict[str, float]]:
    """For each ``label -> stack``: a function doing one finished training step of the stack's
    trainer per call, cycling through the contest's first ``n_batches`` training batches; and
    the seconds building each trainer took."""
    device = device_of(device)
    corpus = load_contest_corpus(cfg)
    gen = torch.Generator().manual_seed(cfg.seed + 1)
    batches = [Batch(*(t.to(device) for t in corpus.sample(cfg.batch_size, generator=gen, split="train")))
               for _ in range(n_batches)]
    steppers, init_s = {}, {}
    for label, stack in stacks.items():
        t0 = time.perf_counter()
        trainer = make_trainer(stack, cfg, device, corpus=corpus)
        init_s[label] = time.perf_counter() - t0
        steppers[label] = partial(_one_step, trainer, itertools.cycle(batches))
    return steppers, init_s


def _one_step(trainer: Trainer, batches: Iterator[Batch]) -> None:
    trainer.train_on(next(batches))
    trainer.sync()
