"""A `TrainConfig` checks each field as it is built, naming it; a resume notices a corpus
whose contents changed and knows the same corpus however its path is spelled."""

import math
from pathlib import Path

import pytest

from moe_lab import preset
from moe_lab.workbench.training.checkpoint import load_checkpoint
from moe_lab.workbench.training.loop import TrainConfig, TrainingInterrupted, train

TINY = preset("tiny", n_layers=1, seq_len=32)


def cfg(**kw):
    base = dict(steps=4, batch_size=2, warmup_steps=0, eval_every=0, progress=False)
    return TrainConfig(**{**base, **kw})


@pytest.mark.parametrize("field, value, words", [
    ("weight_decay", -1000, "finite number >= 0"),  # trained, the weights growing each step
    ("weight_decay", math.nan, "finite number >= 0"),  # was blamed on the learning rate
    ("weight_decay", math.inf, "finite number >= 0"),
    ("weight_decay", "0.1", "finite number >= 0"),
    ("corpus", 123, '"synthetic" or the path of a UTF-8 text file'),  # was a traceback
    ("corpus", "", '"synthetic" or the path of a UTF-8 text file'),
    ("checkpoint_path", 5, "None or a file path"),
    ("checkpoint_path", "", "None or a file path"),
    ("progress", "no", "True or False"),
])
def test_each_field_is_checked_as_the_config_is_built(field, value, words):
    with pytest.raises(ValueError, match=f"{field}.*{words}"):
        cfg(**{field: value})


def test_a_path_object_is_kept_as_its_string(tmp_path):
    c = cfg(corpus=tmp_path / "notes.txt", checkpoint_path=tmp_path / "ck.pt")
    assert (c.corpus, c.checkpoint_path) == (str(tmp_path / "notes.txt"), str(tmp_path / "ck.pt"))


def _checkpointed_run(tmp_path: Path, corpus: str) -> Path:
    """A run on ``corpus`` checkpointed at step 2 of 4, then stopped (Ctrl-C at step 3)."""
    def ctrl_c(step, record):
        if step == 2:
            raise KeyboardInterrupt

    path = tmp_path / "ck.pt"
    with pytest.raises(TrainingInterrupted):
        train(TINY, cfg(corpus=corpus, checkpoint_path=str(path), checkpoint_every=2), callback=ctrl_c)
    assert load_checkpoint(path)["step"] == 2
    return path


def test_a_resume_refuses_a_corpus_whose_contents_changed(tmp_path):
    text = tmp_path / "notes.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 40)
    path = _checkpointed_run(tmp_path, str(text))
    resumed = cfg(corpus=str(text), checkpoint_path=str(path))
    text.write_text("the quick brown cat jumps over the lazy dog. " * 40)  # same size
    with pytest.raises(ValueError, match=f"corpus '{text}' has changed since checkpoint '{path}' "
                                         r"was written \(same size, other bytes\).*--override"):
        train(TINY, resumed, resume=True)
    text.write_text("the quick brown fox jumps over the lazy dog. " * 41)
    with pytest.raises(ValueError, match=r"\(1800 bytes then, 1845 now\)"):
        train(TINY, resumed, resume=True)
    assert train(TINY, resumed, resume=True, override=True).steps == 4  # asked for


def test_the_same_corpus_spelled_relative_or_absolute_resumes(tmp_path, monkeypatch):
    """Resuming with ``--corpus /abs/notes.txt`` a run started with ``--corpus notes.txt`` was
    refused as "other settings"."""
    monkeypatch.chdir(tmp_path)
    Path("notes.txt").write_text("the quick brown fox jumps over the lazy dog. " * 40)
    path = _checkpointed_run(tmp_path, "notes.txt")
    other = tmp_path / "other.txt"
    other.write_text("the quick brown fox jumps over the lazy dog. " * 40)
    folder = tmp_path.resolve()  # the settings record a corpus by its absolute path
    with pytest.raises(ValueError, match=f"other settings: corpus '{folder / 'notes.txt'}' "
                                         f"\\(now '{folder / 'other.txt'}'\\)"):
        train(TINY, cfg(corpus=str(other), checkpoint_path=str(path)), resume=True)
    resumed = train(TINY, cfg(corpus=str(tmp_path / "notes.txt"), checkpoint_path=str(path)),
                    resume=True)
    assert resumed.steps == 4
