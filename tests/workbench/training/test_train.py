import json

import pytest
import torch

from moe_lab import preset
from moe_lab.data import SyntheticCorpus
from moe_lab.workbench.training.checkpoint import load_checkpoint, save_checkpoint
from moe_lab.workbench.training.loop import TrainConfig, TrainingInterrupted, train

TINY = preset("tiny", n_layers=1, seq_len=32)


def cfg(**kw):
    base = dict(steps=12, batch_size=4, warmup_steps=3, eval_every=6, eval_per_domain=2,
                progress=False)
    base.update(kw)
    return TrainConfig(**base)


def crash(cfg: TrainConfig, at: int) -> None:
    """Run ``cfg`` and press Ctrl-C once ``at`` steps are done: an interrupted run."""
    def ctrl_c(step, record):
        if step + 1 == at:
            raise KeyboardInterrupt

    with pytest.raises(TrainingInterrupted):
        train(TINY, cfg, callback=ctrl_c)


def test_deterministic_under_a_seed_and_loss_falls():
    a = train(TINY, cfg(seed=3))
    b = train(TINY, cfg(seed=3))
    c = train(TINY, cfg(seed=4))
    assert a.losses() == b.losses()
    assert a.losses() != c.losses()
    assert a.losses()[-1] < a.losses()[0]
    h = a.history[-1]
    assert len(h["tokens_per_expert"]) == 1 and sum(h["tokens_per_expert"][0]) == 4 * 32 * 2
    assert h["imbalance"][0] >= 1.0 and h["dropped_tokens"] == 0
    assert [e["step"] for e in a.evals] == [6, 12]
    assert {"all", *SyntheticCorpus(seq_len=32).domains} <= set(a.evals[-1])


def test_resume_reproduces_the_uninterrupted_run(tmp_path):
    path = tmp_path / "ck.pt"
    full = train(TINY, cfg(seed=1))
    interrupted = cfg(seed=1, checkpoint_path=str(path), checkpoint_every=5)
    crash(interrupted, at=7)  # checkpoint at step 5, then "crash" at 7
    assert load_checkpoint(path)["step"] == 5
    resumed = train(TINY, interrupted, resume=True)
    assert resumed.losses() == full.losses()
    assert resumed.evals == full.evals
    for p, q in zip(resumed.model.parameters(), full.model.parameters(), strict=True):
        assert torch.equal(p, q)


def test_checkpoint_write_is_atomic(tmp_path, monkeypatch):
    path = tmp_path / "ck.pt"
    save_checkpoint(path, {"step": 1, "w": torch.ones(3)})

    def broken_save(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", broken_save)
    with pytest.raises(OSError, match="disk full"):
        save_checkpoint(path, {"step": 2})
    assert load_checkpoint(path)["step"] == 1  # the old checkpoint survives
    assert [p.name for p in tmp_path.iterdir()] == ["ck.pt"]  # no temporary left behind


def test_resume_refuses_other_config(tmp_path):
    path = tmp_path / "ck.pt"
    crash(cfg(checkpoint_path=str(path), checkpoint_every=4), at=5)  # checkpoint at step 4
    with pytest.raises(ValueError, match="different model config"):
        train(TINY.replace(d_ff=128), cfg(checkpoint_path=str(path)), resume=True)
    with pytest.raises(FileNotFoundError, match="checkpoint not found"):
        train(TINY, cfg(checkpoint_path=str(tmp_path / "none.pt")), resume=True)


def test_lr_schedule():
    c = cfg(steps=100, warmup_steps=10, lr=1.0, min_lr_ratio=0.1)
    assert c.schedule.lr_at(0) == pytest.approx(0.1)
    assert c.schedule.lr_at(9) == pytest.approx(1.0)
    assert c.schedule.lr_at(10) == pytest.approx(1.0)
    assert c.schedule.lr_at(55) == pytest.approx(0.55)
    assert c.schedule.lr_at(100) == pytest.approx(0.1)
    assert all(c.schedule.lr_at(s) >= c.schedule.lr_at(s + 1) for s in range(10, 100))


@pytest.mark.parametrize("field, value", [("steps", 0), ("batch_size", -1), ("lr", 0.0),
                                          ("grad_clip", 0.0), ("min_lr_ratio", 2.0),
                                          ("warmup_steps", -1)])
def test_bad_train_config(field, value):
    with pytest.raises(ValueError, match=field):
        cfg(**{field: value})


def test_trains_on_a_user_text_file(tmp_path):
    text = tmp_path / "notes.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 40, encoding="utf-8")
    r = train(TINY, cfg(corpus=str(text), steps=6, eval_every=3))
    assert set(r.evals[-1]) == {"step", "all", "text"} and len(r.history) == 6


def test_cli_train_json(capsys):
    from moe_lab.__main__ import main

    assert main(["train", "--preset", "tiny", "--steps", "3", "--batch-size", "2", "--json",
                 "--eval-every", "0"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["steps"] == 3 and out["dispatcher"] == "naive"


def test_expert_bias_rate_balances_through_the_trainer():
    plain = train(TINY, cfg(seed=2, steps=10))
    biased = train(TINY, cfg(seed=2, steps=10, expert_bias_rate=0.05))
    bias = biased.model.moe_layers[0].router.expert_bias
    assert bias.abs().sum() > 0  # the update ran
    assert plain.model.moe_layers[0].router.expert_bias.abs().sum() == 0
    with pytest.raises(ValueError, match="expert_bias_rate"):
        cfg(expert_bias_rate=-1.0)


def test_evaluate_builds_no_autograd_graph():
    from moe_lab.workbench.training.loop import Trainer

    trainer = Trainer(preset("tiny"), cfg(eval_per_domain=1))
    model = trainer.model
    seen = []
    handle = model.lm_head.register_forward_hook(lambda m, i, o: seen.append(o.requires_grad))
    result = trainer.evaluate()
    handle.remove()
    assert seen == [False] and model.training  # no graph; the mode is restored
    assert "all" in result and all(v == v and abs(v) < float("inf") for v in result.values())


def test_resume_with_the_sync_free_step_reproduces_the_run(tmp_path):
    path = tmp_path / "ck.pt"
    kw = dict(seed=5, dispatcher="dropless", expert_backend="torch", step="sync_free",
              read_every=2, eval_every=6)
    full = train(TINY, cfg(**kw))
    assert [h["step"] for h in full.history] == [2, 4, 6, 8, 10, 12] and full.steps == 12
    interrupted = cfg(**kw, checkpoint_path=str(path), checkpoint_every=4)
    crash(interrupted, at=6)
    resumed = train(TINY, interrupted, resume=True)
    assert resumed.losses() == full.losses() and resumed.evals == full.evals
    for p, q in zip(resumed.model.parameters(), full.model.parameters(), strict=True):
        assert torch.equal(p, q)


def test_the_trainer_advances_one_step_at_a_time():
    from moe_lab.workbench.training.loop import Trainer

    c = cfg(seed=3, steps=4)
    trainer = Trainer(TINY, c)
    records = [trainer.advance() for _ in range(4)]
    assert trainer.steps_done == 4 and len(trainer.step_times) == 4
    assert [r["loss"] for r in records] == train(TINY, c).losses()  # the loop is this
    assert set(trainer.evaluate()) >= {"all", *trainer.corpus.domains}
    with pytest.raises(ValueError, match="step"):
        cfg(step="teleport")
    with pytest.raises(ValueError, match="compiled_eval"):
        cfg(compiled_eval=True)


def test_a_non_finite_loss_stops_the_run_naming_the_step_and_checkpoint(tmp_path):
    from moe_lab.workbench.training.loop import TrainingDiverged

    path = tmp_path / "ck.pt"
    with pytest.raises(TrainingDiverged, match=r"at step 2 .*ck.pt' \(step 1\)"):
        train(TINY, cfg(lr=1e30, warmup_steps=0, checkpoint_path=str(path), checkpoint_every=1))
    assert load_checkpoint(path)["step"] == 1  # the NaN weights were never saved


def test_the_checkpoint_records_the_run_settings_and_resume_compares_them(tmp_path):
    path = tmp_path / "ck.pt"
    crash(cfg(checkpoint_path=str(path), checkpoint_every=4), at=5)  # checkpoint at step 4
    assert load_checkpoint(path)["settings"]["lr"] == cfg().lr
    with pytest.raises(ValueError, match=r"other settings: batch_size 4 \(now 2\)"):
        train(TINY, cfg(checkpoint_path=str(path), batch_size=2), resume=True)
    resumed = train(TINY, cfg(checkpoint_path=str(path), batch_size=2), resume=True, override=True)
    assert resumed.steps == 12
    with pytest.raises(ValueError, match="override=True"):
        train(TINY, cfg(), override=True)


@pytest.mark.parametrize("field, value", [("lr", float("inf")), ("lr", float("nan")),
                                          ("seed", 2**70), ("seed", -1)])
def test_non_finite_lr_and_out_of_range_seeds_are_refused(field, value):
    with pytest.raises(ValueError, match=field):
        cfg(**{field: value})


def test_a_batch_too_large_for_memory_is_refused_before_anything_is_built():
    from moe_lab.workbench.training.loop import Trainer

    with pytest.raises(ValueError, match="batch_size=1000000000000 .* GiB"):
        Trainer(TINY, cfg(batch_size=10**12))


def test_the_training_configs_hold_their_shared_fields_once():
    import dataclasses

    from moe_lab.training.build import BuildConfig
    from moe_lab.training.optim import Schedule
    from moe_lab.training.steps import StepConfig
    from moe_lab.workbench.training.loop import DataConfig

    c = cfg(lr=1e-3, read_every=4, dispatcher="dropless", expert_backend="torch")
    assert c.step_config == StepConfig(Schedule(1e-3, 3, 12), read_every=4)
    assert c.data == DataConfig(batch_size=4, eval_every=6, eval_per_domain=2)
    assert c.build.impls.dispatcher == "dropless" and c.impls == c.build.impls
    assert (c.lr, c.steps, c.read_every, c.batch_size, c.expert_backend) == (1e-3, 12, 4, 4, "torch")
    assert dataclasses.replace(c, steps=20).schedule == Schedule(1e-3, 3, 20)
    held = set(TrainConfig.held_fields)
    own = {f.name for f in dataclasses.fields(TrainConfig)}
    assert not held & own  # no field written twice
    assert {"lr", "warmup_steps", "min_lr_ratio", "grad_clip", "read_every", "seed"} <= held
    with pytest.raises(ValueError, match="fp32_logits"):
        BuildConfig(fp32_logits=True)


@pytest.mark.parametrize("step", ["sync_free", "graphed"])
def test_a_sync_free_step_refuses_a_dispatcher_that_syncs(step):
    """The naive dispatcher reads each expert's token count back to the host: a sync-free
    step over it ran, and was reported as sync-free, although its certificate fails."""
    from moe_lab.model import ModelImpls
    from moe_lab.moe.dispatch import DISPATCHERS
    from moe_lab.training.build import BuildConfig

    with pytest.raises(ValueError, match=f"BuildConfig.step='{step}' .*'naive' syncs the host"):
        BuildConfig(impls=ModelImpls(dispatcher="naive"), step=step)
    assert [name for name, fn in DISPATCHERS.items() if fn.syncs_host] == ["naive"]
    for name in sorted(DISPATCHERS):
        BuildConfig(impls=ModelImpls(dispatcher=name), step="eager")
    BuildConfig(impls=ModelImpls(dispatcher="capacity"), step=step)


class CopyRecorder:
    """``Tensor.to`` and ``Tensor.pin_memory`` patched so that no CUDA is needed: a copy to
    CUDA is recorded (was its source pinned? was it non-blocking?) and the tensor stays on
    the CPU, so the step after it runs for real."""

    def __init__(self, monkeypatch):
        self.copies: list[tuple[bool, bool]] = []
        self._pinned: list[torch.Tensor] = []
        real_to = torch.Tensor.to

        def pin_memory(t, *args, **kwargs):
            out = t.clone()
            self._pinned.append(out)
            return out

        def to(t, *args, **kwargs):
            target = kwargs.get("device", args[0] if args else None)
            if isinstance(target, (str, torch.device)) and torch.device(target).type == "cuda":
                pinned = any(t is p for p in self._pinned)
                self.copies.append((pinned, bool(kwargs.get("non_blocking", False))))
                return t
            return real_to(t, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, "pin_memory", pin_memory)
        monkeypatch.setattr(torch.Tensor, "to", to)

    def blocking(self) -> list[tuple[bool, bool]]:
        return [c for c in self.copies if c != (True, True)]


def test_the_step_path_moves_batches_to_the_gpu_without_a_blocking_copy(monkeypatch):
    """On CUDA a batch goes to the device from pinned memory with ``non_blocking=True``, one
    step ahead; and the step on it syncs nowhere but at the end of a window (count_syncs)."""
    from moe_lab.data import load_corpus
    from moe_lab.training.sync import count_syncs
    from moe_lab.workbench.training.loop import _to

    cuda = torch.device("cuda")
    batch = load_corpus("synthetic", seq_len=32, seed=0).sample(2, generator=torch.Generator())
    recorder = CopyRecorder(monkeypatch)
    moved = _to(batch, cuda)
    assert len(recorder.copies) == 3 and not recorder.blocking(), recorder.copies
    assert all(torch.equal(a, b) for a, b in zip(moved, batch, strict=True))

    from moe_lab.workbench.training.loop import BatchStream, Trainer

    trainer = Trainer(TINY, cfg(seed=3, steps=8, step="sync_free", read_every=4, eval_every=0,
                                dispatcher="dropless", expert_backend="torch"))
    trainer.batches = BatchStream(trainer.corpus, 4, trainer.batches.generator, cuda)  # the stream on "CUDA"
    recorder.copies.clear()
    syncs_per_step, step_on = [], trainer.train_on

    def counted_step(batch):  # the step itself, its syncs counted
        record, syncs = count_syncs(step_on, batch)
        syncs_per_step.append(sum(syncs.values()))
        return record

    trainer.train_on = counted_step
    records = [trainer.advance() for _ in range(8)]
    assert [r is not None for r in records] == [False, False, False, True] * 2
    assert syncs_per_step == [0, 0, 0, 1] * 2  # the window's one read
    assert len(recorder.copies) == 3 * 9 and not recorder.blocking()  # 8 batches and the next


def test_a_prefetched_batch_leaves_the_stream_and_its_checkpoint_unchanged():
    from moe_lab.data import load_corpus
    from moe_lab.workbench.training.loop import BatchStream

    corpus = load_corpus("synthetic", seq_len=16, seed=0)
    plain = BatchStream(corpus, 3, torch.Generator().manual_seed(5), torch.device("cpu"))
    ahead = BatchStream(corpus, 3, torch.Generator().manual_seed(5), torch.device("cpu"))
    want = [plain.take() for _ in range(4)]
    got = [ahead.take()]
    ahead.prefetch()
    state = ahead.state()  # before the prefetched batch
    got.append(ahead.take())
    ahead.prefetch()
    ahead.prefetch()  # a second prefetch keeps the batch already drawn
    got += [ahead.take(), ahead.take()]
    assert all(torch.equal(a.x, b.x) for a, b in zip(got, want, strict=True))
    resumed = BatchStream(corpus, 3, torch.Generator().set_state(state), torch.device("cpu"))
    assert all(torch.equal(resumed.take().x, b.x) for b in want[1:])


def test_step_times_come_from_cuda_events_read_without_a_wait_per_step(monkeypatch):
    """On CUDA the trainer records an event pair per step and never waits while steps run,
    only when ``step_times`` is asked for."""
    from moe_lab.workbench.training.loop import Trainer

    class Event:
        made: list["Event"] = []

        def __init__(self, enable_timing=False):
            assert enable_timing
            self.waited, self.t = False, len(Event.made)
            Event.made.append(self)

        def record(self):
            pass

        def synchronize(self):
            self.waited = True

        def elapsed_time(self, end):
            return 1000.0 * (end.t - self.t)

    monkeypatch.setattr(torch.cuda, "Event", Event)
    trainer = Trainer(TINY, cfg(seed=3, steps=4))
    trainer.device = torch.device("cuda")  # what the clock reads; the batches stay on the CPU
    for _ in range(4):
        trainer.advance()
    assert len(Event.made) == 8 and not any(e.waited for e in Event.made)  # nothing waited for
    assert trainer.step_times == [1.0] * 4


def test_train_runs_where_tqdm_is_not_installed(monkeypatch):
    import moe_lab.workbench.training.loop as loop

    c = cfg(seed=3, steps=3, progress=True)
    want = train(TINY, c).losses()
    monkeypatch.setattr(loop, "tqdm", None)  # what the guarded import leaves without tqdm
    assert loop.train(TINY, c).losses() == want


def test_a_headless_run_draws_a_text_bar_on_stdout(monkeypatch, capsys):
    """With no front end (``MOE_LAB_HEADLESS=1``) the bar is text on stdout that ends at the last
    step — a widget there would be saved at 0, and stderr would render as an error."""
    monkeypatch.setenv("MOE_LAB_HEADLESS", "1")
    train(TINY, cfg(seed=3, steps=3, progress=True))
    out, err = capsys.readouterr()
    assert err == ""
    assert out.rstrip().splitlines()[-1].startswith("train ") and "3/3" in out.split("\r")[-1]
