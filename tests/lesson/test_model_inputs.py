"""What the model refuses at its door, each in one line naming the argument."""

import pytest
import torch

from moe_lab import preset
from moe_lab.model import MoETransformer


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return MoETransformer(preset("tiny"))


@pytest.mark.parametrize("bad", ["vocab", -1])
def test_token_ids_outside_the_vocabulary(model, bad):
    vocab = model.cfg.vocab_size
    idx = torch.randint(0, vocab, (2, 8))
    idx[1, 3] = vocab if bad == "vocab" else bad
    with pytest.raises(ValueError, match=rf"idx holds token ids outside \[0, vocab_size={vocab}\)"):
        model(idx)


def test_last_id_of_the_vocabulary_is_fine(model):
    idx = torch.full((1, 4), model.cfg.vocab_size - 1)
    assert model(idx).logits.shape == (1, 4, model.cfg.vocab_size)


@pytest.mark.parametrize("idx, message", [
    (torch.zeros(2, 8, dtype=torch.int32), "idx must be"),
    (torch.zeros(8, dtype=torch.int64), "idx must be"),
])
def test_shape_and_dtype(model, idx, message):
    with pytest.raises(ValueError, match=message):
        model(idx)


def test_sequence_longer_than_the_config(model):
    with pytest.raises(ValueError, match="exceeds cfg.seq_len"):
        model(torch.zeros(1, model.cfg.seq_len + 1, dtype=torch.int64))
