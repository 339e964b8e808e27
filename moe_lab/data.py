"""Data: a synthetic multi-domain corpus, and a byte-level loader for any text file.

A Mixture-of-Experts router earns its keep when the data has *kinds*: tokens that want
different computation. Natural text has them (code, prose, numbers, names) but mixed
and unlabelled, so you cannot see what a router learned. This module makes the kinds
explicit. ``SyntheticCorpus`` generates seven small "domains", each with its own
structure and each line opening with a short tag:

============  ======  ===========================================================
domain        tag     one example line
============  ======  ===========================================================
sort          sort:   ``sort:37 5 12=5 12 37`` (the numbers, then sorted)
reverse       rev:    ``rev:kqdmu=umdqk`` (letters, then reversed)
modadd        mod:    ``mod:17+25%7=0`` ((a + b) mod m)
brackets      brk:    ``brk:([)]=no`` (is the bracket string balanced?)
repeat        rep:    ``rep:3*ab=ababab`` (a unit repeated k times)
markov_a      mka:    ``mka:tanesei toali ta`` (a Markov chain over its letters)
markov_b      mkb:    ``mkb:ckwdhckybyhpu gcyb`` (another chain, other letters)
============  ======  ===========================================================

Every sequence holds lines of a single domain and is labelled with that domain's id,
so a notebook can ask "which experts does the sorting domain use?" and plot per-domain
loss. Tokens are bytes (vocabulary 256): the same model trains, unchanged, on any
UTF-8 file through ``TextFileCorpus``.

Train and eval are disjoint by construction: each example line belongs to exactly one
split, decided by a hash of its text (one line in ten goes to eval), so no problem the
model trains on ever appears in its eval set. Sampling is deterministic given the seed
(or a ``torch.Generator``), and cheap Python: sampling a batch costs far less than a
training step on it.
"""

from __future__ import annotations

import bisect
import functools
import os
import random
import string
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import torch

from moe_lab.checks import integer, one_of, positive_int
from moe_lab.memory import check_fits

VOCAB_SIZE = 256
SPLITS = ("train", "eval")
EVAL_ONE_IN = 10  # one example line in ten belongs to the eval split


class Batch(NamedTuple):
    """A batch of byte sequences.

    ``x: [B, T] int64`` input bytes; ``y: [B, T] int64`` next-byte targets
    (``y[:, t] == x[:, t + 1]``, and ``y[:, -1]`` is the byte after the window);
    ``domain: [B] int64`` the domain id of each row (an index into ``corpus.domains``).
    """

    x: torch.Tensor
    y: torch.Tensor
    domain: torch.Tensor


# --------------------------------------------------------------------------------------
# The domains: each a function rng -> one example line (no tag, no newline)
# --------------------------------------------------------------------------------------

_LOWER = string.ascii_lowercase


def _sort(rng: random.Random) -> str:
    nums = [rng.randrange(100) for _ in range(rng.randint(2, 8))]
    return f"{' '.join(map(str, nums))}={' '.join(map(str, sorted(nums)))}"


def _reverse(rng: random.Random) -> str:
    s = "".join(rng.choice(_LOWER) for _ in range(rng.randint(3, 10)))
    return f"{s}={s[::-1]}"


def _modadd(rng: random.Random) -> str:
    a, b, m = rng.randrange(100), rng.randrange(100), rng.randint(2, 13)
    return f"{a}+{b}%{m}={(a + b) % m}"


def is_balanced(s: str) -> bool:
    """Whether a string of ``()[]`` brackets is balanced (every opener closed in order): it is
    exactly when deleting adjacent matched pairs, ``()`` and ``[]``, until none is left empties it."""
    while "()" in s or "[]" in s:
        s = s.replace("()", "").replace("[]", "")
    return not s


def _balanced_brackets(rng: random.Random, pairs: int) -> str:
    if pairs == 0:
        return ""
    inner = rng.randint(0, pairs - 1)
    o, c = rng.choice(("()", "[]"))
    return o + _balanced_brackets(rng, inner) + c + _balanced_brackets(rng, pairs - 1 - inner)


def _brackets(rng: random.Random) -> str:
    pairs = rng.randint(1, 6)
    if rng.random() < 0.5:
        s = _balanced_brackets(rng, pairs)
    else:  # a random string: sometimes balanced by chance, the label says which
        s = "".join(rng.choice("()[]") for _ in range(2 * pairs))
    return f"{s}={'yes' if is_balanced(s) else 'no'}"


def _repeat(rng: random.Random) -> str:
    unit = "".join(rng.choice(_LOWER) for _ in range(rng.randint(1, 3)))
    k = rng.randint(2, 5)
    return f"{k}*{unit}={unit * k}"


def markov_chain(alphabet: str, seed: int) -> dict[str, tuple[str, str, str]]:
    """A first-order Markov chain over ``alphabet``: each symbol's three possible successors,
    the next symbol of a fixed cycle through the whole alphabet (probability 0.5) and two
    other symbols (0.3 and 0.2), never itself. The chain is fixed by ``seed``: it is part of
    the language, not of the corpus seed."""
    rng = random.Random(seed)
    cycle = rng.sample(alphabet, len(alphabet))
    successors = dict.fromkeys(alphabet)  # keyed in the alphabet's order
    for i, c in enumerate(cycle):
        following = cycle[(i + 1) % len(cycle)]
        others = rng.sample([o for o in alphabet if o not in (c, following)], 2)
        successors[c] = (following, *others)
    return successors


#: name -> the chain of a Markov domain (`markov_chain`); its keys, in order, are the alphabet.
MARKOV = {
    "markov_a": markov_chain("aeilnorst ", seed=101),
    "markov_b": markov_chain("bcdghkpuwy ", seed=202),
}


def _markov(successors: dict[str, tuple[str, str, str]], rng: random.Random) -> str:
    """12 to 30 symbols of the chain, from a uniformly chosen first symbol; each next one is the
    first, second or third successor of the last as ``rng.random()`` falls below 0.5, below 0.8,
    or above."""
    length = rng.randint(12, 30)
    out = [rng.choice("".join(successors))]
    for _ in range(length - 1):
        out.append(successors[out[-1]][bisect.bisect((0.5, 0.8), rng.random())])
    return "".join(out)


#: name -> (tag, example generator). The order is the default domain order.
DOMAINS: dict[str, tuple[str, Callable[[random.Random], str]]] = {
    "sort": ("sort:", _sort),
    "reverse": ("rev:", _reverse),
    "modadd": ("mod:", _modadd),
    "brackets": ("brk:", _brackets),
    "repeat": ("rep:", _repeat),
    "markov_a": ("mka:", functools.partial(_markov, MARKOV["markov_a"])),
    "markov_b": ("mkb:", functools.partial(_markov, MARKOV["markov_b"])),
}


def split_of(line: str) -> str:
    """The split an example line belongs to: ``"eval"`` for one line in ten, by hash."""
    return "eval" if zlib.crc32(line.encode("ascii")) % EVAL_ONE_IN == 0 else "train"


# --------------------------------------------------------------------------------------
# What both corpora share
# --------------------------------------------------------------------------------------


def _rows_to_batch(rows: torch.Tensor, domain: torch.Tensor) -> Batch:
    """``rows: [B, T + 1]`` int64 → inputs, next-byte targets and each row's domain id."""
    return Batch(x=rows[:, :-1].contiguous(), y=rows[:, 1:].contiguous(), domain=domain)


class _Corpus:
    """What both corpora share: their public sampling methods, which check the arguments once
    and leave the drawing to ``_sample`` and ``_fixed_eval_set``."""

    seq_len: int

    def sample(self, batch_size: int, generator: torch.Generator | None = None,
               split: str = "train") -> Batch:
        """``batch_size`` rows of ``split`` (see the class). A ``batch_size`` whose rows would
        not fit in memory (two int64 tensors of ``batch_size × seq_len`` tokens) is refused
        before any row is drawn, so a typo does not reach the allocator."""
        owner = f"{type(self).__name__}.sample"
        positive_int(batch_size, f"{owner} batch_size")
        check_fits(f"{owner} batch_size={batch_size} (x seq_len {self.seq_len})",
                   16 * batch_size * self.seq_len, "use a smaller batch_size")
        one_of(split, f"{owner} split", SPLITS)
        if generator is not None and not isinstance(generator, torch.Generator):
            raise ValueError(
                f"{owner} generator must be a torch.Generator or None, got {type(generator).__name__}")
        return self._sample(batch_size, generator, split)

    def fixed_eval_set(self, n_per_domain: int) -> Batch:
        """``n_per_domain`` rows of every domain of the eval split, the same on every call."""
        positive_int(n_per_domain, f"{type(self).__name__}.fixed_eval_set n_per_domain")
        return self._fixed_eval_set(n_per_domain)


# --------------------------------------------------------------------------------------
# The synthetic corpus
# --------------------------------------------------------------------------------------


class SyntheticCorpus(_Corpus):
    """The seven synthetic domains of ``DOMAINS``, in that order, as byte sequences of length
    ``seq_len``.

    Each row is one domain's example lines, ``\\n``-separated, starting at a line
    boundary (so the row opens with the domain's tag), cut to ``seq_len + 1`` bytes.

    ``seed`` fixes the streams that ``sample`` draws from when no generator is given
    (one stream per split).
    """

    def __init__(self, seq_len: int, seed: int = 0) -> None:
        self.seq_len = positive_int(seq_len, "SyntheticCorpus seq_len")
        self.seed = integer(seed, "SyntheticCorpus seed")
        self.domains: list[str] = list(DOMAINS)
        self._streams = {split: random.Random(seed * len(SPLITS) + i) for i, split in enumerate(SPLITS)}

    def _rows(self, domains: list[int], rng: random.Random, split: str) -> Batch:
        """A row of ``split`` for each domain id in ``domains``, in order, drawn from ``rng``:
        whole tagged lines of that domain's ``split`` until ``seq_len + 1`` bytes are filled."""
        need = self.seq_len + 1
        rows = []
        for domain in domains:
            tag, generate = DOMAINS[self.domains[domain]]
            lines, length = [], 0
            while length < need:
                line = tag + generate(rng)
                if split_of(line) == split:
                    lines.append(line)
                    length += len(line) + 1
            rows.append(("\n".join(lines) + "\n").encode("ascii")[:need])
        flat = torch.frombuffer(bytearray(b"".join(rows)), dtype=torch.uint8)
        return _rows_to_batch(flat.view(len(rows), need).long(), torch.tensor(domains, dtype=torch.long))

    def _sample(self, batch_size: int, generator: torch.Generator | None, split: str) -> Batch:
        """``batch_size`` rows, each from a uniformly chosen domain.

        With ``generator`` the batch depends only on the generator's state (one draw is
        taken from it); without, on the corpus seed and how many batches of this split
        were drawn before.
        """
        if generator is None:
            seed = self._streams[split].getrandbits(63)
        else:
            seed = int(torch.randint(0, 2**62, (1,), generator=generator, device=generator.device))
        rng = random.Random(seed)
        return self._rows([rng.randrange(len(self.domains)) for _ in range(batch_size)], rng, split)

    def _fixed_eval_set(self, n_per_domain: int) -> Batch:
        """``n_per_domain`` rows of every domain, grouped by domain in ``self.domains``
        order; the same rows on every call (they depend on the corpus seed only)."""
        domains = [d for d in range(len(self.domains)) for _ in range(n_per_domain)]
        return self._rows(domains, random.Random(f"fixed/{self.seed}/eval"), "eval")


# --------------------------------------------------------------------------------------
# Any text file
# --------------------------------------------------------------------------------------


class TextFileCorpus(_Corpus):
    """Random ``seq_len``-byte windows of a UTF-8 text file, with the same API as
    ``SyntheticCorpus`` (one domain, ``"text"``, id 0).

    The file's last ``val_fraction`` of bytes is the eval split, the rest is train; a
    window never crosses from one to the other.
    """

    def __init__(self, path: str | os.PathLike[str], seq_len: int, val_fraction: float = 0.1,
                 seed: int = 0) -> None:
        self.path = Path(path)
        self.seq_len = positive_int(seq_len, "TextFileCorpus seq_len")
        if not isinstance(val_fraction, (int, float)) or not 0.0 < val_fraction < 1.0:
            raise ValueError(f"TextFileCorpus val_fraction must be a number in (0, 1), got {val_fraction!r}")
        if self.path.exists() and not self.path.is_file():  # reading a FIFO would never end
            kind = "a directory" if self.path.is_dir() else "not a regular file (a FIFO, a device?)"
            raise ValueError(f"TextFileCorpus path must be a regular text file; '{self.path}' is {kind}")
        raw = self.path.read_bytes()  # a missing file: FileNotFoundError, naming the path
        try:
            raw.decode("utf-8")
        except UnicodeDecodeError as err:
            raise ValueError(f"TextFileCorpus: '{self.path}' is not UTF-8 text (invalid byte at offset "
                             f"{err.start})") from err
        n_eval = round(len(raw) * val_fraction)
        need = seq_len + 1
        if min(n_eval, len(raw) - n_eval) < need:  # a file shorter than one window included
            raise ValueError(f"TextFileCorpus: '{self.path}' has {len(raw)} bytes; with "
                             f"val_fraction={val_fraction} its splits have {len(raw) - n_eval} (train) and "
                             f"{n_eval} (eval) bytes, and each needs seq_len + 1 = {need}: use a shorter "
                             "seq_len, another val_fraction, or a longer file")
        data = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
        self._splits = {"train": data[: len(raw) - n_eval], "eval": data[len(raw) - n_eval :]}
        self.domains: list[str] = ["text"]
        self._generators = {split: torch.Generator().manual_seed(seed * len(SPLITS) + i)
                            for i, split in enumerate(SPLITS)}

    def _windows(self, split: str, starts: torch.Tensor) -> Batch:
        rows = self._splits[split][starts[:, None] + torch.arange(self.seq_len + 1)].long()
        return _rows_to_batch(rows, torch.zeros(len(starts), dtype=torch.long))

    def _sample(self, batch_size: int, generator: torch.Generator | None, split: str) -> Batch:
        """``batch_size`` windows at uniformly random offsets within ``split``."""
        g = self._generators[split] if generator is None else generator
        high = len(self._splits[split]) - self.seq_len  # starts in [0, high)
        starts = torch.randint(0, high, (batch_size,), generator=g, device=g.device).cpu()
        return self._windows(split, starts)

    def _fixed_eval_set(self, n_per_domain: int) -> Batch:
        """``n_per_domain`` windows evenly spaced over the eval split; the same on every call."""
        last = len(self._splits["eval"]) - self.seq_len - 1  # integers: float32 is inexact past 2**24
        starts = torch.arange(n_per_domain) * last // max(n_per_domain - 1, 1)
        return self._windows("eval", starts)


def load_corpus(name_or_path: str | os.PathLike[str], seq_len: int,
                seed: int = 0) -> SyntheticCorpus | TextFileCorpus:
    """``"synthetic"`` gives a ``SyntheticCorpus``; anything else is read as the path of
    a UTF-8 text file (``TextFileCorpus``)."""
    if name_or_path == "synthetic":
        return SyntheticCorpus(seq_len, seed=seed)
    return TextFileCorpus(name_or_path, seq_len, seed=seed)
