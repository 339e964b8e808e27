"""Tests for moe_lab.data: the synthetic multi-domain corpus and the text-file loader."""

from __future__ import annotations

import itertools
import os
import random
import re
from pathlib import Path

import pytest
import torch

from moe_lab.data import (
    DOMAINS,
    MARKOV,
    VOCAB_SIZE,
    Batch,
    SyntheticCorpus,
    TextFileCorpus,
    is_balanced,
    load_corpus,
    split_of,
)

SAMPLE = Path(__file__).resolve().parents[2] / "data" / "sample.txt"


def _text(tokens: torch.Tensor) -> str:
    return bytes(tokens.tolist()).decode("utf-8", errors="replace")


def _rows(batch: Batch) -> list[str]:
    return [_text(torch.cat([x, y[-1:]])) for x, y in zip(batch.x, batch.y, strict=True)]


def _complete_lines(row: str) -> list[str]:
    # The last line of a row is usually cut by the window: only lines ending in \n count.
    return row.split("\n")[:-1]


# ---------------------------------------------------------------------------------------
# SyntheticCorpus
# ---------------------------------------------------------------------------------------


def test_at_least_six_domains_with_distinct_tags():
    corpus = SyntheticCorpus(64)
    assert len(corpus.domains) >= 6
    assert corpus.domains == list(DOMAINS)
    tags = [tag for tag, _ in DOMAINS.values()]
    assert len(set(tags)) == len(tags)
    # No tag is a prefix of another: the first bytes identify the domain.
    for a in tags:
        for b in tags:
            assert a == b or not b.startswith(a)


def test_shapes_dtypes_and_next_token_targets():
    corpus = SyntheticCorpus(96, seed=3)
    batch = corpus.sample(16)
    assert isinstance(batch, Batch)
    assert batch.x.shape == (16, 96) and batch.y.shape == (16, 96) and batch.domain.shape == (16,)
    assert batch.x.dtype == batch.y.dtype == batch.domain.dtype == torch.long
    assert torch.equal(batch.y[:, :-1], batch.x[:, 1:])
    assert int(batch.x.min()) >= 0 and int(batch.x.max()) < VOCAB_SIZE
    assert ((batch.domain >= 0) & (batch.domain < len(corpus.domains))).all()


def test_same_seed_same_batches_and_different_seed_differs():
    a, b, c = SyntheticCorpus(64, seed=0), SyntheticCorpus(64, seed=0), SyntheticCorpus(64, seed=1)
    for _ in range(3):
        ba, bb, bc = a.sample(8), b.sample(8), c.sample(8)
        for ta, tb in zip(ba, bb, strict=True):
            assert torch.equal(ta, tb)
        assert not torch.equal(ba.x, bc.x)
    # Successive batches of one stream differ.
    assert not torch.equal(a.sample(8).x, a.sample(8).x)


def test_generator_determines_the_batch():
    corpus = SyntheticCorpus(64, seed=0)
    b1 = corpus.sample(8, generator=torch.Generator().manual_seed(42))
    corpus.sample(8)  # advancing the corpus's own stream changes nothing for a generator
    b2 = SyntheticCorpus(64, seed=99).sample(8, generator=torch.Generator().manual_seed(42))
    b3 = corpus.sample(8, generator=torch.Generator().manual_seed(43))
    assert torch.equal(b1.x, b2.x) and torch.equal(b1.domain, b2.domain)
    assert not torch.equal(b1.x, b3.x)


def test_domain_labels_match_tags_and_all_domains_appear():
    corpus = SyntheticCorpus(64, seed=5)
    batch = corpus.sample(256)
    assert set(batch.domain.tolist()) == set(range(len(corpus.domains)))
    for row, d in zip(_rows(batch), batch.domain.tolist(), strict=True):
        tag = DOMAINS[corpus.domains[d]][0]
        assert row.startswith(tag)
        for line in _complete_lines(row):
            assert line.startswith(tag), (line, tag)


def _check_line(domain: str, line: str) -> None:
    tag = DOMAINS[domain][0]
    body = line[len(tag) :]
    if domain == "sort":
        question, answer = body.split("=")
        nums = [int(v) for v in question.split(" ")]
        assert [int(v) for v in answer.split(" ")] == sorted(nums)
        assert 2 <= len(nums) <= 8
    elif domain == "reverse":
        question, answer = body.split("=")
        assert answer == question[::-1] and question.isalpha() and question.islower()
    elif domain == "modadd":
        m = re.fullmatch(r"(\d+)\+(\d+)%(\d+)=(\d+)", body)
        assert m, body
        a, b, mod, result = map(int, m.groups())
        assert result == (a + b) % mod
    elif domain == "brackets":
        question, answer = body.split("=")
        assert set(question) <= set("()[]") and question
        assert answer == ("yes" if is_balanced(question) else "no")
    elif domain == "repeat":
        m = re.fullmatch(r"(\d)\*([a-z]+)=([a-z]+)", body)
        assert m, body
        assert m.group(3) == m.group(2) * int(m.group(1))
    else:
        successors = MARKOV[domain]
        assert set(body) <= set(successors)
        for a, b in itertools.pairwise(body):
            assert b in successors[a], (a, b)
    assert len(line) + 1 <= 64  # a whole line fits in the shortest window we promise


@pytest.mark.parametrize("domain", list(DOMAINS))
def test_each_domain_has_its_stated_structure(domain):
    corpus = SyntheticCorpus(128, seed=2)
    batch = corpus.sample(32 * len(DOMAINS), generator=torch.Generator().manual_seed(2))
    lines = [line for row, d in zip(_rows(batch), batch.domain.tolist(), strict=True)
             if corpus.domains[d] == domain for line in _complete_lines(row)]
    assert len(lines) >= 32
    for line in lines:
        _check_line(domain, line)


def test_brackets_have_both_labels_and_checker_is_right():
    assert is_balanced("([])[]") and is_balanced("")
    assert not is_balanced("([)]") and not is_balanced("((") and not is_balanced(")(")
    rng = random.Random(0)
    answers = {DOMAINS["brackets"][1](rng).rsplit("=", 1)[1] for _ in range(200)}
    assert answers == {"yes", "no"}


def test_markov_languages_use_disjoint_letters():
    a, b = MARKOV["markov_a"], MARKOV["markov_b"]
    assert set(a) & set(b) == {" "}
    for chain in (a, b):
        for symbol, successors in chain.items():
            assert symbol not in successors and len(set(successors)) == 3


def test_train_and_eval_are_disjoint():
    corpus = SyntheticCorpus(64, seed=0)
    train = corpus.sample(2000)
    evals = corpus.sample(1000, split="eval")
    train_rows = {tuple(r) for r in torch.cat([train.x, train.y[:, -1:]], 1).tolist()}
    eval_rows = {tuple(r) for r in torch.cat([evals.x, evals.y[:, -1:]], 1).tolist()}
    assert len(train_rows) > 1900 and len(eval_rows) > 900
    assert not train_rows & eval_rows
    # Stronger: no complete example line of one split appears in the other.
    train_lines = {line for row in _rows(train) for line in _complete_lines(row)}
    eval_lines = {line for row in _rows(evals) for line in _complete_lines(row)}
    assert not train_lines & eval_lines
    assert all(split_of(line) == "eval" for line in eval_lines)
    assert all(split_of(line) == "train" for line in train_lines)


def test_fixed_eval_set_is_fixed_and_grouped_by_domain():
    corpus = SyntheticCorpus(64, seed=4)
    a = corpus.fixed_eval_set(3)
    corpus.sample(5, split="eval")
    b = corpus.fixed_eval_set(3)
    assert torch.equal(a.x, b.x) and torch.equal(a.y, b.y)
    n = len(corpus.domains)
    assert a.domain.tolist() == [d for d in range(n) for _ in range(3)]
    for row, d in zip(_rows(a), a.domain.tolist(), strict=True):
        assert row.startswith(DOMAINS[corpus.domains[d]][0])
        assert all(split_of(line) == "eval" for line in _complete_lines(row))
    a.x.zero_()  # callers may not corrupt the cache
    assert not torch.equal(corpus.fixed_eval_set(3).x, a.x)
    other_seed = SyntheticCorpus(64, seed=5).fixed_eval_set(3)
    assert not torch.equal(other_seed.x, b.x)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"seq_len": 0}, "seq_len must be a positive integer"),
        ({"seq_len": 12.5}, "seq_len must be a positive integer"),
        ({"seq_len": 32, "seed": "zero"}, "seed must be an integer"),
    ],
)
def test_bad_corpus_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SyntheticCorpus(**kwargs)


def test_bad_sample_arguments():
    corpus = SyntheticCorpus(32)
    with pytest.raises(ValueError, match="batch_size must be a positive integer, got 0"):
        corpus.sample(0)
    with pytest.raises(ValueError, match="split must be one of"):
        corpus.sample(2, split="test")
    with pytest.raises(ValueError, match="generator must be a torch.Generator"):
        corpus.sample(2, generator=7)
    with pytest.raises(ValueError, match="n_per_domain must be a positive integer"):
        corpus.fixed_eval_set(-1)


# ---------------------------------------------------------------------------------------
# TextFileCorpus, load_corpus
# ---------------------------------------------------------------------------------------


def _write(tmp_path: Path, text: str, name: str = "t.txt") -> Path:
    path = tmp_path / name
    path.write_bytes(text.encode())
    return path


def test_text_corpus_windows_come_from_the_file(tmp_path):
    text = "".join(f"line {i:04d}: the quick brown fox ✓\n" for i in range(200))
    path = _write(tmp_path, text)
    corpus = TextFileCorpus(path, seq_len=48, val_fraction=0.2)
    assert corpus.domains == ["text"]
    raw = text.encode()
    n_eval = round(len(raw) * 0.2)
    assert len(corpus._splits["train"]) + len(corpus._splits["eval"]) == len(raw)
    for split, part in (("train", raw[: len(raw) - n_eval]), ("eval", raw[len(raw) - n_eval :])):
        batch = corpus.sample(32, split=split)
        assert batch.x.shape == (32, 48) and batch.x.dtype == torch.long
        assert torch.equal(batch.y[:, :-1], batch.x[:, 1:])
        assert torch.equal(batch.domain, torch.zeros(32, dtype=torch.long))
        for x, y in zip(batch.x, batch.y, strict=True):
            window = bytes(torch.cat([x, y[-1:]]).tolist())
            assert window in part, split


def test_text_corpus_is_deterministic(tmp_path):
    path = _write(tmp_path, "abcdefghij" * 50)
    a, b = TextFileCorpus(path, 16), TextFileCorpus(path, 16)
    assert torch.equal(a.sample(8).x, b.sample(8).x)
    g1, g2 = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    assert torch.equal(a.sample(8, generator=g1).x, b.sample(8, generator=g2).x)
    assert not torch.equal(TextFileCorpus(path, 16, seed=1).sample(8).x, a.sample(8).x)
    assert torch.equal(a.fixed_eval_set(4).x, b.fixed_eval_set(4).x)


def test_text_corpus_on_the_sample_file():
    corpus = load_corpus(SAMPLE, seq_len=128)
    assert isinstance(corpus, TextFileCorpus)
    text = SAMPLE.read_text(encoding="utf-8")
    batch = corpus.sample(4)
    for x in batch.x:
        assert _text(x) in text
    fixed = corpus.fixed_eval_set(5)
    assert fixed.x.shape == (5, 128)
    assert _text(fixed.x[-1]) in text[-len(text) // 10 - 1 :]


def test_text_corpus_errors(tmp_path):
    missing = tmp_path / "nope.txt"
    with pytest.raises(FileNotFoundError, match="nope.txt"):
        TextFileCorpus(missing, 16)
    with pytest.raises(FileNotFoundError, match="nope.txt"):
        load_corpus(str(missing), 16)
    short = _write(tmp_path, "tiny", "short.txt")
    with pytest.raises(ValueError, match=r"short.txt' has 4 bytes; .* each needs seq_len \+ 1 = 17"):
        TextFileCorpus(short, 16)
    binary = tmp_path / "blob.bin"
    binary.write_bytes(b"hello \xff\xfe world" * 10)
    with pytest.raises(ValueError, match=r"blob.bin' is not UTF-8"):
        TextFileCorpus(binary, 8)
    lopsided = _write(tmp_path, "x" * 100, "lopsided.txt")
    with pytest.raises(ValueError, match="val_fraction=0.1"):
        TextFileCorpus(lopsided, 32)  # 10 eval bytes cannot hold a 33-byte window
    with pytest.raises(ValueError, match="val_fraction must be a number in"):
        TextFileCorpus(lopsided, 8, val_fraction=1.0)
    with pytest.raises(ValueError, match="must be a regular text file; .* is a directory"):
        TextFileCorpus(tmp_path, 8)
    os.mkfifo(tmp_path / "pipe")  # named for what it is, not "the directory"
    with pytest.raises(ValueError, match="'.*pipe' is not a regular file"):
        TextFileCorpus(tmp_path / "pipe", 8)


def test_load_corpus_synthetic():
    corpus = load_corpus("synthetic", 32, seed=7)
    assert isinstance(corpus, SyntheticCorpus)
    assert corpus.seq_len == 32 and corpus.seed == 7
    assert torch.equal(corpus.sample(4).x, SyntheticCorpus(32, seed=7).sample(4).x)


def test_a_batch_too_large_for_memory_is_refused_before_any_row_is_drawn():
    corpus = SyntheticCorpus(seq_len=64)
    with pytest.raises(ValueError, match=r"SyntheticCorpus.sample batch_size=1000000000000 .* GiB"):
        corpus.sample(10**12)
