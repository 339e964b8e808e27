"""TextFileCorpus at its edges: an eval split over 2**24 bytes (a sparse file, nothing large
on disk), a split of exactly one window, and the last window of every split."""

from __future__ import annotations

from pathlib import Path

import torch

from moe_lab.data import TextFileCorpus


def test_fixed_eval_set_reaches_the_end_of_an_eval_split_over_2_24_bytes(tmp_path):
    # float32 holds only even integers in (2**24, 2**25): an offset of 4m + 3 rounded up
    # past the split's last window start, and the window ran off the end (an IndexError).
    seq_len = 8
    last = 2**24 + 3  # the last window start of the eval split
    n_eval = last + seq_len + 1
    head, tail = b"the train split opens here\n", b"and the eval split ends here\n"
    path = tmp_path / "sparse.txt"
    with path.open("wb") as f:  # zeros between head and tail: a hole, valid UTF-8
        f.write(head)
        f.truncate(2 * n_eval - len(tail))
        f.seek(0, 2)
        f.write(tail)
    corpus = TextFileCorpus(path, seq_len, val_fraction=0.5)
    assert len(corpus._splits["eval"]) == n_eval > 2**24
    fixed = corpus.fixed_eval_set(3)
    rows = torch.cat([fixed.x, fixed.y[:, -1:]], 1)
    assert bytes(rows[-1].tolist()) == tail[-(seq_len + 1):]  # the very last window
    assert bytes(rows[0].tolist()) == bytes(seq_len + 1)  # the split's first window: the hole
    middle = corpus._splits["eval"][last // 2: last // 2 + seq_len + 1]
    assert torch.equal(rows[1], middle.long())


def _distinct(tmp_path: Path, n: int) -> Path:
    """A file of ``n`` distinct ASCII bytes (at most 94): a window's first byte tells where it starts."""
    path = tmp_path / "distinct.txt"
    path.write_bytes(bytes(range(33, 33 + n)))
    return path


def test_a_split_of_exactly_one_window_samples_it(tmp_path):
    corpus = TextFileCorpus(_distinct(tmp_path, 90), seq_len=8, val_fraction=0.1)
    assert len(corpus._splits["eval"]) == 9  # seq_len + 1: one window
    batch = corpus.sample(4, split="eval")
    window = corpus._splits["eval"].long()
    assert all(torch.equal(torch.cat([x, y[-1:]]), window) for x, y in zip(batch.x, batch.y))


def test_every_window_of_a_split_can_be_drawn_the_last_included(tmp_path):
    corpus = TextFileCorpus(_distinct(tmp_path, 30), seq_len=12, val_fraction=0.5)
    g = torch.Generator().manual_seed(0)
    for split in ("train", "eval"):
        data = corpus._splits[split]
        assert len(data) == 15  # three windows: starts 0, 1, 2
        batch = corpus.sample(64, generator=g, split=split)  # a miss has odds (2/3)**64
        starts = {int((data == x[0]).nonzero()) for x in batch.x}
        assert starts == {0, 1, 2}, split
