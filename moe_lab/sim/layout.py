"""Pipeline layouts: which layers each pipeline stage holds, written as Megatron strings.

Pipeline parallelism cuts the model's layers into *stages*, one per group of GPUs (a
*rank* of the pipeline). Layouts are written the way Megatron-Core's
``--pipeline-model-parallel-layout`` writes them. The grammar (a superset of Megatron's:
groups may nest, ``*`` may follow any item)::

    layout := item*                 # whitespace and ',' are cosmetic and ignored
    item   := atom ('*' count)?     # count >= 1: repeat the atom count times
    atom   := 'E' | 't' | 'm' | 'L' | '|' | '(' item+ ')'

``E`` is the embedding, ``t`` a transformer layer (the first ``n_dense_layers`` are dense,
the rest MoE), ``m`` a multi-token-prediction layer, ``L`` the loss with its logits GEMM,
``|`` ends a stage. After expansion the string splits at ``|`` into ``p * v`` virtual
stages in pipeline order; virtual stage ``k`` lives on rank ``k % p`` as its chunk
``k // p`` (Megatron's convention). ``"Et*3|(tt|)*29,m|L"`` is DeepSeek-V3 on 16 ranks
with 2 chunks each: ``Ettt``, 29 stages of ``tt``, then ``m`` and ``L`` on their own.

What each stage costs and how to find a balanced layout is :mod:`moe_lab.sim.layout_search`;
how the stages take turns on micro-batches is :mod:`moe_lab.sim.schedule`.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NoReturn

from moe_lab.checks import positive_int
from moe_lab.config import ModelConfig

LAYER_CHARS = {"E": "embedding", "t": "transformer", "m": "mtp", "L": "logits"}
LAYER_KINDS = ("embedding", "dense", "moe", "mtp", "logits")
MAX_LAYOUT_ITEMS = 100_000  # a typo like "t*99999999" fails fast instead of eating memory


_TOKEN = re.compile(r"\*(\d*)|.", re.DOTALL)  # a repeat '*count', or any one character


def _expand(text: str) -> list[str]:
    """The layer characters and '|' of ``text`` with every group and repeat expanded: one pass
    over the grammar in the module docstring, a stack of open groups; positions are 0-based."""

    def fail(pos: int, problem: str) -> NoReturn:
        shown = text[:pos] + " <here> " + text[pos:]
        raise ValueError(f"layout {text!r}: {problem} at position {pos} ({shown!r})")

    groups: list[tuple[int, list[str]]] = [(-1, [])]  # per open '(': its position, its items so far
    atom, start = None, 0  # what a '*' would repeat (None: nothing), and where it starts
    for token in _TOKEN.finditer(text):
        pos, ch = token.start(), token.group()
        items = groups[-1][1]
        if ch in LAYER_CHARS or ch == "|":
            atom, start = [ch], pos
            items.append(ch)
        elif ch == "(":
            groups.append((pos, []))
            atom = None
        elif ch == ")":
            if len(groups) == 1:
                fail(pos, "')' without a matching '('")
            start, atom = groups.pop()
            if not atom:
                fail(pos, "empty group '()'")
            groups[-1][1].extend(atom)
        elif ch[0] == "*":
            if atom is None:
                fail(pos, "'*' must follow a layer, '|' or a ')'")
            if not token.group(1):
                fail(pos + 1, "expected a repeat count (digits) after '*'")
            count = int(token.group(1))
            if count < 1:
                fail(pos, f"repeat count must be >= 1, got {count}")
            items.extend(atom * (count - 1))
            atom = None
        elif ch in ", \t\n":  # cosmetic
            atom = None
        else:
            fail(pos, f"unknown character {ch!r} (expected one of E t m L | ( ) * digits ,)")
        if len(groups[-1][1]) > MAX_LAYOUT_ITEMS:
            fail(start, f"the layout expands to more than {MAX_LAYOUT_ITEMS} items")
    if len(groups) > 1:
        fail(groups[-1][0], "'(' is never closed")
    return groups[0][1]


@dataclass(frozen=True)
class Layout:
    """Layers cut into pipeline stages.

    ``stages[k]`` is virtual stage ``k`` in pipeline order, written as its layer characters
    (``"Ettt"``); it lives on rank ``k % n_ranks`` as that rank's chunk ``k // n_ranks``.
    """

    stages: tuple[str, ...]
    n_ranks: int

    @property
    def n_chunks(self) -> int:
        """Virtual stages per rank (Megatron's VPP size)."""
        return len(self.stages) // self.n_ranks

    def rank_stages(self, rank: int) -> list[int]:
        """The virtual stages of ``rank``, chunk 0 first."""
        return [c * self.n_ranks + rank for c in range(self.n_chunks)]


def parse_layout(text: str, n_ranks: int | None = None) -> Layout:
    """Parse a Megatron-style layout string (grammar in the module docstring).

    ``n_ranks`` is the pipeline size; the number of virtual stages must be a multiple of
    it. Default: one chunk per rank (``n_ranks`` = number of stages).

    Raises:
        ValueError: naming the position of a syntax error, or a stage count that
            ``n_ranks`` does not divide.
    """
    tokens = _expand(text)
    if not tokens:
        raise ValueError(f"layout {text!r} holds no layers")
    stages = tuple("".join(tokens).split("|"))
    if n_ranks is None:
        n_ranks = len(stages)
    positive_int(n_ranks, "n_ranks")
    if len(stages) % n_ranks:
        raise ValueError(f"layout {text!r} has {len(stages)} stages, which n_ranks={n_ranks} does not "
                         f"divide (expected a multiple of {n_ranks}: n_ranks x virtual stages per rank)")
    return Layout(stages, n_ranks)


def _format_stage(stage: str) -> str:
    """Each run of one layer as ``t*4`` where that is shorter than the run written out."""
    out = []
    for char, group in itertools.groupby(stage):
        run = len(list(group))
        out.append(f"{char}*{run}" if len(f"{char}*{run}") < run else char * run)
    return "".join(out)


def format_layout(layout: Layout | Sequence[str]) -> str:
    """The compact layout string: ``parse_layout(format_layout(x)).stages == x.stages``.

    Runs of a layer become ``t*4`` where that is shorter; runs of identical stages
    become ``(tt|)*29`` followed by a cosmetic comma, as in Megatron's documentation.
    """
    stages = list(layout.stages if isinstance(layout, Layout) else layout)
    runs = [(stage, len(list(group))) for stage, group in itertools.groupby(stages)]
    out = ""
    for index, (stage, n) in enumerate(runs):
        text = _format_stage(stage)
        last = index == len(runs) - 1
        # n copies, each followed by '|' except after the very last stage of the layout.
        n_sep = n if not last else n - 1
        plain = "|".join([text] * n) + ("|" if not last else "")
        grouped = f"({text}|)*{n_sep}" + ((f",{text}" if text else "") if last else ",")
        out += grouped if n_sep >= 2 and len(grouped) < len(plain) else plain
    return out


def model_layer_kinds(cfg: ModelConfig) -> list[str]:
    """The layer kinds of ``cfg`` in pipeline order: embedding, dense…, moe…, mtp…, logits."""
    return (["embedding"] + ["dense"] * cfg.n_dense_layers + ["moe"] * cfg.n_moe_layers
            + ["mtp"] * cfg.mtp_layers + ["logits"])


def model_layer_chars(cfg: ModelConfig) -> str:
    """``cfg``'s layers as layout characters: ``"E" + "t" * n_layers + "m" * mtp + "L"``."""
    return "E" + "t" * cfg.n_layers + "m" * cfg.mtp_layers + "L"


def check_layout(layout: Layout, cfg: ModelConfig) -> None:
    """Raise ``ValueError`` unless ``layout`` places every layer of ``cfg`` exactly once.

    Expected: ``E`` first, ``L`` last, ``n_layers`` transformer layers, ``mtp_layers``
    MTP layers after the last transformer layer.
    """
    layers = "".join(layout.stages)  # every layer character in pipeline order
    expected = model_layer_chars(cfg)
    problems = [f"{layers.count(c)} × {c!r} ({name}), expected {expected.count(c)}"
                for c, name in LAYER_CHARS.items() if layers.count(c) != expected.count(c)]
    if problems:
        raise ValueError(f"layout {format_layout(layout)!r} does not cover the layers of "
                         f"{cfg.name!r}: " + "; ".join(problems))
    if layers != expected:
        raise ValueError(f"layout {format_layout(layout)!r} has the right layers in the wrong order: "
                         f"expected 'E' first, then the transformer layers, then 'm', then 'L' last")
