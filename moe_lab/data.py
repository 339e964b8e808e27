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

import os
import random
import string
import zlib
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import NamedTuple

import torch

from moe_lab.checks import integer, positive_int
from moe_lab.memory import check_fits

__all__ = [
    "DOMAINS",
    "MARKOV",
    "VOCAB_SIZE",
    "Batch",
    "MarkovLanguage",
    "SyntheticCorpus",
    "TextFileCorpus",
    "decode",
    "is_balanced",
    "load_corpus",
    "make_example",
    "split_of",
]

VOCAB_SIZE = 256
SPLITS = ("train", "eval")
EVAL_ONE_IN = 10  # one example line in ten belongs to the eval split
_MAX_REJECTED = 10_000


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
# The domains: each a function rng -> one example line (tag included, no newline)
# --------------------------------------------------------------------------------------

_LOWER = string.ascii_lowercase


def _sort(rng: random.Random) -> str:
    nums = [rng.randrange(100) for _ in range(rng.randint(2, 8))]
    return f"sort:{' '.join(map(str, nums))}={' '.join(map(str, sorted(nums)))}"


def _reverse(rng: random.Random) -> str:
    s = "".join(rng.choice(_LOWER) for _ in range(rng.randint(3, 10)))
    return f"rev:{s}={s[::-1]}"


def _modadd(rng: random.Random) -> str:
    a, b, m = rng.randrange(100), rng.randrange(100), rng.randint(2, 13)
    return f"mod:{a}+{b}%{m}={(a + b) % m}"


def is_balanced(s: str) -> bool:
    """Whether a string of ``()[]`` brackets is balanced (every opener closed in order)."""
    pairs = {")": "(", "]": "["}
    stack: list[str] = []
    for c in s:
        if c in "([":
            stack.append(c)
        elif not stack or stack.pop() != pairs[c]:
            return False
    return not stack


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
    return f"brk:{s}={'yes' if is_balanced(s) else 'no'}"


def _repeat(rng: random.Random) -> str:
    unit = "".join(rng.choice(_LOWER) for _ in range(rng.randint(1, 3)))
    k = rng.randint(2, 5)
    return f"rep:{k}*{unit}={unit * k}"


class MarkovLanguage:
    """A first-order Markov chain over its own alphabet. Each symbol has three possible
    successors: the next symbol of a fixed cycle through the whole alphabet (probability
    0.5) and two other symbols (0.3 and 0.2), never itself. The chain is fixed by
    ``seed``: it is part of the language, not of the corpus seed."""

    WEIGHTS = (0.5, 0.3, 0.2)

    def __init__(self, alphabet: str, seed: int) -> None:
        rng = random.Random(seed)
        cycle = rng.sample(alphabet, len(alphabet))
        self.alphabet = alphabet
        self.successors: dict[str, tuple[str, ...]] = {}
        for i, c in enumerate(cycle):
            following = cycle[(i + 1) % len(cycle)]
            others = rng.sample([o for o in alphabet if o not in (c, following)], 2)
            self.successors[c] = (following, *others)

    def allows(self, a: str, b: str) -> bool:
        """Whether ``b`` may follow ``a``."""
        return b in self.successors.get(a, ())

    def generate(self, rng: random.Random, length: int) -> str:
        """``length`` symbols of the chain, from a uniformly chosen first symbol."""
        c = rng.choice(self.alphabet)
        out = [c]
        for _ in range(length - 1):
            r = rng.random()
            nxt = self.successors[c]
            c = nxt[0] if r < 0.5 else nxt[1] if r < 0.8 else nxt[2]
            out.append(c)
        return "".join(out)


MARKOV = {
    "markov_a": MarkovLanguage("aeilnorst ", seed=101),
    "markov_b": MarkovLanguage("bcdghkpuwy ", seed=202),
}


def _markov(name: str, tag: str) -> Callable[[random.Random], str]:
    language = MARKOV[name]

    def generate(rng: random.Random) -> str:
        return tag + language.generate(rng, rng.randint(12, 30))

    return generate


#: name -> (tag, example generator). The order is the default domain order.
DOMAINS: dict[str, tuple[str, Callable[[random.Random], str]]] = {
    "sort": ("sort:", _sort),
    "reverse": ("rev:", _reverse),
    "modadd": ("mod:", _modadd),
    "brackets": ("brk:", _brackets),
    "repeat": ("rep:", _repeat),
    "markov_a": ("mka:", _markov("markov_a", "mka:")),
    "markov_b": ("mkb:", _markov("markov_b", "mkb:")),
}


def make_example(domain: str, rng: random.Random) -> str:
    """One example line of ``domain`` (tag included, no newline), from ``rng``."""
    if domain not in DOMAINS:
        raise ValueError(f"domain must be one of {list(DOMAINS)}, got {domain!r}")
    return DOMAINS[domain][1](rng)


def split_of(line: str) -> str:
    """The split an example line belongs to: ``"eval"`` for one line in ten, by hash."""
    return "eval" if zlib.crc32(line.encode("ascii")) % EVAL_ONE_IN == 0 else "train"


# --------------------------------------------------------------------------------------
# What both corpora share
# --------------------------------------------------------------------------------------


def _check_split(owner: str, split: object) -> str:
    if split not in SPLITS:
        raise ValueError(f"{owner} split must be one of {SPLITS}, got {split!r}")
    return split  # type: ignore[return-value]


def _rows_to_batch(rows: torch.Tensor, domain: torch.Tensor) -> Batch:
    """``rows: [B, T + 1]`` int64 → inputs, next-byte targets and each row's domain id."""
    return Batch(x=rows[:, :-1].contiguous(), y=rows[:, 1:].contiguous(), domain=domain)


class _Corpus:
    """What both corpora share: their public sampling methods, which check the arguments once
    and leave the drawing to ``_sample`` and ``_fixed_eval_set``."""

    vocab_size = VOCAB_SIZE
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
        _check_split(owner, split)
        if generator is not None and not isinstance(generator, torch.Generator):
            raise ValueError(
                f"{owner} generator must be a torch.Generator or None, got {type(generator).__name__}")
        return self._sample(batch_size, generator, split)

    def fixed_eval_set(self, n_per_domain: int, split: str = "eval") -> Batch:
        """``n_per_domain`` rows of every domain of ``split``, the same on every call."""
        owner = f"{type(self).__name__}.fixed_eval_set"
        positive_int(n_per_domain, f"{owner} n_per_domain")
        return self._fixed_eval_set(n_per_domain, _check_split(owner, split))


# --------------------------------------------------------------------------------------
# The synthetic corpus
# --------------------------------------------------------------------------------------


class SyntheticCorpus(_Corpus):
    """Seven (or the chosen) synthetic domains as byte sequences of length ``seq_len``.

    Each row is one domain's example lines, ``\\n``-separated, starting at a line
    boundary (so the row opens with the domain's tag), cut to ``seq_len + 1`` bytes.

    ``seed`` fixes the streams that ``sample`` draws from when no generator is given
    (one stream per split); ``domains`` picks and orders a subset of ``DOMAINS``.
    """

    def __init__(self, seq_len: int, seed: int = 0, domains: Sequence[str] | None = None) -> None:
        self.seq_len = positive_int(seq_len, "SyntheticCorpus seq_len")
        self.seed = integer(seed, "SyntheticCorpus seed")
        names = list(DOMAINS) if domains is None else list(domains)
        if not names:
            raise ValueError("SyntheticCorpus domains must name at least one domain, got []")
        for name in names:
            if name not in DOMAINS:
                raise ValueError(
                    f"SyntheticCorpus domains: unknown domain {name!r}, expected names from "
                    f"{list(DOMAINS)}"
                )
        if len(set(names)) != len(names):
            raise ValueError(f"SyntheticCorpus domains must not repeat, got {names}")
        self.domains: list[str] = names
        self.tags: list[str] = [DOMAINS[n][0] for n in names]
        self._generators = [DOMAINS[n][1] for n in names]
        self._streams = {
            split: random.Random(seed * len(SPLITS) + i) for i, split in enumerate(SPLITS)
        }
        self._fixed: dict[tuple[int, str], Batch] = {}

    def __repr__(self) -> str:
        return f"SyntheticCorpus(seq_len={self.seq_len}, seed={self.seed}, domains={self.domains})"

    def _to_batch(self, rows: list[bytes], domains: list[int]) -> Batch:
        flat = torch.frombuffer(bytearray(b"".join(rows)), dtype=torch.uint8)
        return _rows_to_batch(flat.view(len(rows), self.seq_len + 1).long(),
                              torch.tensor(domains, dtype=torch.long))

    def _row(self, domain: int, rng: random.Random, split: str) -> bytes:
        generate = self._generators[domain]
        need = self.seq_len + 1
        lines: list[str] = []
        length = 0
        rejected = 0
        while length < need:
            line = generate(rng)
            if split_of(line) != split:
                rejected += 1
                if rejected > _MAX_REJECTED:  # a generator whose lines all hash elsewhere
                    raise RuntimeError(
                        f"domain {self.domains[domain]!r} produced {rejected} lines in a row "
                        f"outside the {split!r} split"
                    )
                continue
            rejected = 0
            lines.append(line)
            length += len(line) + 1
        return ("\n".join(lines) + "\n").encode("ascii")[:need]

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
        domains = [rng.randrange(len(self.domains)) for _ in range(batch_size)]
        return self._to_batch([self._row(d, rng, split) for d in domains], domains)

    def _fixed_eval_set(self, n_per_domain: int, split: str) -> Batch:
        """``n_per_domain`` rows of every domain, grouped by domain in ``self.domains``
        order; the same rows on every call (they depend on the corpus seed only)."""
        key = (n_per_domain, split)
        if key not in self._fixed:
            rng = random.Random(f"fixed/{self.seed}/{split}")
            domains = [d for d in range(len(self.domains)) for _ in range(n_per_domain)]
            rows = [self._row(d, rng, split) for d in domains]
            self._fixed[key] = self._to_batch(rows, domains)
        batch = self._fixed[key]
        return Batch(batch.x.clone(), batch.y.clone(), batch.domain.clone())


# --------------------------------------------------------------------------------------
# Any text file
# --------------------------------------------------------------------------------------


class TextFileCorpus(_Corpus):
    """Random ``seq_len``-byte windows of a UTF-8 text file, with the same API as
    ``SyntheticCorpus`` (one domain, ``"text"``, id 0).

    The file's last ``val_fraction`` of bytes is the eval split, the rest is train; a
    window never crosses from one to the other.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        seq_len: int,
        val_fraction: float = 0.1,
        seed: int = 0,
    ) -> None:
        self.path = Path(path)
        self.seq_len = positive_int(seq_len, "TextFileCorpus seq_len")
        if not isinstance(val_fraction, (int, float)) or not 0.0 < val_fraction < 1.0:
            raise ValueError(f"TextFileCorpus val_fraction must be a number in (0, 1), got {val_fraction!r}")
        if not self.path.exists():
            raise FileNotFoundError(f"TextFileCorpus: no such file: '{self.path}'")
        if not self.path.is_file():
            kind = "a directory" if self.path.is_dir() else "not a regular file (a FIFO, a device?)"
            raise ValueError(f"TextFileCorpus path must be a regular text file; '{self.path}' is {kind}")
        raw = self.path.read_bytes()
        try:
            raw.decode("utf-8")
        except UnicodeDecodeError as err:
            raise ValueError(
                f"TextFileCorpus: '{self.path}' is not UTF-8 text (invalid byte at offset "
                f"{err.start})"
            ) from err
        need = seq_len + 1
        if len(raw) < need:
            raise ValueError(
                f"TextFileCorpus: '{self.path}' has {len(raw)} bytes, but seq_len={seq_len} "
                f"needs at least {need}"
            )
        n_eval = round(len(raw) * val_fraction)
        if n_eval < need or len(raw) - n_eval < need:
            raise ValueError(
                f"TextFileCorpus: '{self.path}' has {len(raw)} bytes; with "
                f"val_fraction={val_fraction} its splits have {len(raw) - n_eval} (train) and "
                f"{n_eval} (eval) bytes, and each needs seq_len + 1 = {need}: use a shorter "
                "seq_len, another val_fraction, or a longer file"
            )
        data = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
        self._splits = {"train": data[: len(raw) - n_eval], "eval": data[len(raw) - n_eval :]}
        self.domains: list[str] = ["text"]
        self.tags: list[str] = [""]
        self.seed = seed
        self._generators = {
            split: torch.Generator().manual_seed(seed * len(SPLITS) + i)
            for i, split in enumerate(SPLITS)
        }

    def __repr__(self) -> str:
        return f"TextFileCorpus('{self.path.name}', seq_len={self.seq_len})"

    def split_bytes(self, split: str) -> int:
        """The number of bytes in ``split``."""
        return len(self._splits[_check_split("TextFileCorpus", split)])

    def _windows(self, split: str, starts: torch.Tensor) -> Batch:
        rows = self._splits[split][starts[:, None] + torch.arange(self.seq_len + 1)].long()
        return _rows_to_batch(rows, torch.zeros(len(starts), dtype=torch.long))

    def _sample(self, batch_size: int, generator: torch.Generator | None, split: str) -> Batch:
        """``batch_size`` windows at uniformly random offsets within ``split``."""
        g = self._generators[split] if generator is None else generator
        high = len(self._splits[split]) - self.seq_len  # starts in [0, high)
        starts = torch.randint(0, high, (batch_size,), generator=g, device=g.device).cpu()
        return self._windows(split, starts)

    def _fixed_eval_set(self, n_per_domain: int, split: str) -> Batch:
        """``n_per_domain`` windows evenly spaced over ``split``; the same on every call."""
        last = len(self._splits[split]) - self.seq_len - 1  # integers: float32 is inexact past 2**24
        starts = torch.arange(n_per_domain) * last // max(n_per_domain - 1, 1)
        return self._windows(split, starts)


# --------------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------------


def decode(tokens: torch.Tensor | Sequence[int]) -> str:
    """Bytes back to text: ``tokens`` is a 1-D tensor or sequence of ints in [0, 255];
    invalid UTF-8 (a window may cut a character in half) becomes U+FFFD."""
    if isinstance(tokens, torch.Tensor):
        if tokens.dim() != 1:
            raise ValueError(f"decode tokens must be 1-D, got shape {tuple(tokens.shape)}")
        values = tokens.tolist()
    else:
        values = list(tokens)
    bad = [v for v in values if not isinstance(v, int) or not 0 <= v < VOCAB_SIZE]
    if bad:
        raise ValueError(f"decode tokens must be ints in [0, 255], got {bad[0]!r}")
    return bytes(values).decode("utf-8", errors="replace")


def load_corpus(
    name_or_path: str | os.PathLike[str], seq_len: int, seed: int = 0
) -> SyntheticCorpus | TextFileCorpus:
    """``"synthetic"`` gives a ``SyntheticCorpus``; anything else is read as the path of
    a UTF-8 text file (``TextFileCorpus``)."""
    if isinstance(name_or_path, str) and name_or_path == "synthetic":
        return SyntheticCorpus(seq_len, seed=seed)
    if isinstance(name_or_path, str) and not Path(name_or_path).exists():
        raise FileNotFoundError(
            f"corpus '{name_or_path}' is neither \"synthetic\" nor an existing file"
        )
    return TextFileCorpus(name_or_path, seq_len, seed=seed)
