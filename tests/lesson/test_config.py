import pytest

from moe_lab.config import PRESETS, ModelConfig, MoEConfig, preset


def moe(**kw):
    base = dict(d_model=64, n_experts=8, top_k=2, d_expert=32)
    base.update(kw)
    return MoEConfig(**base)


@pytest.mark.parametrize(
    "changes, field",
    [
        ({"top_k": 9}, "top_k"),
        ({"top_k": 0}, "top_k"),
        ({"n_experts": 0}, "n_experts"),
        ({"d_model": -4}, "d_model"),
        ({"d_expert": 0}, "d_expert"),
        ({"score_func": "relu"}, "score_func"),
        ({"capacity_factor": 0.0}, "capacity_factor"),
        ({"capacity_factor": -1.0}, "capacity_factor"),
        ({"router_dtype": "fp16"}, "router_dtype"),
        ({"n_groups": 3}, "n_groups"),
        ({"n_groups": 2, "topk_groups": 3}, "topk_groups"),
        ({"n_groups": 4, "topk_groups": 1, "top_k": 3}, "top_k"),
        ({"n_shared_experts": -1}, "n_shared_experts"),
        ({"aux_loss_coef": -0.1}, "aux_loss_coef"),
        ({"top_k": 2.0}, "top_k"),
        ({"drop_policy": "random"}, "drop_policy"),
        # Values a hostile user tried: each accepted before, and inf/nan trained silently.
        ({"capacity_factor": float("inf")}, "capacity_factor"),
        ({"capacity_factor": "1.5"}, "capacity_factor"),
        ({"scaling_factor": float("inf")}, "scaling_factor"),
        ({"aux_loss_coef": float("nan")}, "aux_loss_coef"),
        ({"aux_loss_coef": float("inf")}, "aux_loss_coef"),
        ({"aux_loss_coef": "0.01"}, "aux_loss_coef"),
        ({"z_loss_coef": float("nan")}, "z_loss_coef"),
        ({"renormalize": "no"}, "renormalize"),
        ({"renormalize": 1}, "renormalize"),
    ],
)
def test_bad_moe_config_names_the_field(changes, field):
    with pytest.raises(ValueError, match=field):
        moe(**changes)


@pytest.mark.parametrize(
    "changes, field",
    [
        ({"n_heads": 5}, "n_heads"),  # 64 not divisible by 5
        ({"n_layers": 0}, "n_layers"),
        ({"vocab_size": 0}, "vocab_size"),
        ({"seq_len": -1}, "seq_len"),
        ({"n_dense_layers": 3}, "n_dense_layers"),
        ({"n_kv_heads": 3}, "n_kv_heads"),
        ({"attention": "linear"}, "attention"),
        ({"d_ff": 0}, "d_ff"),
        ({"tie_embeddings": "yes"}, "tie_embeddings"),
    ],
)
def test_bad_model_config_names_the_field(changes, field):
    base = dict(vocab_size=256, d_model=64, n_layers=2, n_heads=4, d_ff=128, moe=moe())
    base.update(changes)
    with pytest.raises(ValueError, match=field):
        ModelConfig(**base)


def test_moe_d_model_must_match():
    with pytest.raises(ValueError, match="moe.d_model"):
        ModelConfig(vocab_size=256, d_model=128, n_layers=2, n_heads=4, d_ff=128, moe=moe())


def test_presets_are_valid_and_named():
    for name in PRESETS:
        cfg = preset(name)
        assert cfg.name == name
        assert cfg.moe.top_k <= cfg.moe.n_experts
    ds = preset("deepseek_v3")
    assert (ds.n_layers, ds.n_dense_layers, ds.moe.n_experts, ds.moe.top_k) == (61, 3, 256, 8)
    assert (ds.moe.n_groups, ds.moe.topk_groups, ds.moe.score_func) == (8, 4, "sigmoid")
    oss = preset("gpt_oss_20b")
    assert (oss.n_layers, oss.d_model, oss.moe.n_experts, oss.moe.top_k) == (24, 2880, 32, 4)


def test_unknown_preset():
    with pytest.raises(ValueError, match="preset name"):
        preset("huge")


def test_replace_revalidates_and_propagates_d_model():
    cfg = preset("tiny")
    wider = cfg.replace(d_model=128)
    assert wider.moe.d_model == 128
    assert cfg.replace(moe={"top_k": 4}).moe.top_k == 4
    with pytest.raises(ValueError, match="top_k"):
        cfg.replace(moe={"top_k": 99})


def test_holds_builds_and_reads_a_held_config_field_by_field():
    import dataclasses

    from moe_lab.config import holds

    @dataclasses.dataclass(frozen=True)
    class Part:
        a: int = 1
        b: int = 2

        def __post_init__(self):
            if self.a < 0:
                raise ValueError("Part.a must be >= 0")

    @holds(part=Part)
    @dataclasses.dataclass(frozen=True)
    class Whole:
        part: Part = dataclasses.field(default_factory=lambda: Part(b=20))
        c: int = 3

    w = Whole(a=5, c=4)
    assert w.part == Part(5, 20) and (w.a, w.b, w.c) == (5, 20, 4)  # the holder's default part
    assert Whole(part=Part(7), b=8).part == Part(7, 8)  # fields change the part given
    assert dataclasses.replace(w, b=9).part == Part(5, 9)
    assert Whole.held_fields == {"a": "part", "b": "part"}
    with pytest.raises(ValueError, match="Part.a"):  # validated once, in the part
        Whole(a=-1)
