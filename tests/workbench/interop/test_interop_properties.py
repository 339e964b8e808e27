"""Property-based interop tests: tiny random Hugging Face models of each family, at configs
hypothesis draws over the knobs the family exposes, before and after `patch_hf_model`.

Each example builds a model (hidden 16 or 32, 2-6 experts, 1-2 layers, 2 sequences of
3-7 tokens) with random weights, patches a copy and checks, against the stock model at
the installed `transformers`:

- the logits and the gradient of every parameter (the MoE blocks' under their Hugging Face
  names and layouts) agree, or the patch is refused in one line naming the knob — exactly
  for the configs this file's own rule (`refusal`) says moe_lab cannot express;
- the patched model's ``state_dict`` is the stock model's (keys and values);
- `unpatch_hf_model` gives back the stock blocks with the same weights.

Knobs: top-k from 1 to the number of experts; ``norm_topk_prob`` both ways; groups and kept
groups; shared experts (0, 1, several); routed scaling; router and expert biases; sliding and
full attention layers; dense-first (and dense-between) layers; the dispatcher. Examples are
derandomized (the same ones every run) so that CI is reproducible; ``MOE_LAB_HYPOTHESIS_EXAMPLES``
raises the count for a longer local search.
"""

import copy
import os

import pytest
import torch

transformers = pytest.importorskip("transformers")
hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, event, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from moe_lab.workbench.interop.patch import HF_MOE_BLOCKS, HFMoEAdapter, patch_hf_model, unpatch_hf_model  # noqa: E402

EXAMPLES = int(os.environ.get("MOE_LAB_HYPOTHESIS_EXAMPLES", "200"))
SETTINGS = settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
VOCAB = 32
DISPATCH = st.sampled_from([("dropless", "torch"), ("dropless", "loop"), ("naive", "loop")])


def top_k(n):
    """1..n, with 1 (which the renormalised families refuse) one draw in ten: hypothesis
    favours the lower bound, and refused examples compute nothing."""
    return st.integers(0, 9).flatmap(lambda i: st.just(1) if i == 9 else st.integers(2, n))


def common(draw, layers=None):
    hidden = draw(st.sampled_from([16, 32]))
    heads = draw(st.sampled_from([2, 4]))
    return dict(vocab_size=VOCAB, hidden_size=hidden, num_attention_heads=heads,
                num_key_value_heads=draw(st.sampled_from([1, heads])),
                num_hidden_layers=layers or draw(st.integers(1, 2)),
                max_position_embeddings=32, attn_implementation="eager", tie_word_embeddings=False)


@st.composite
def mixtral(draw):
    experts = draw(st.integers(2, 6))
    cfg = transformers.MixtralConfig(
        **common(draw), intermediate_size=draw(st.sampled_from([8, 16])), num_local_experts=experts,
        num_experts_per_tok=draw(top_k(experts)), sliding_window=draw(st.sampled_from([None, 2, 4])),
        router_jitter_noise=draw(st.integers(0, 9).map(lambda i: 0.1 if i == 9 else 0.0)))
    return cfg, "MixtralForCausalLM"


@st.composite
def qwen3_moe(draw):
    experts = draw(st.integers(2, 6))
    base = common(draw)
    knobs = dict(intermediate_size=24, num_experts=experts, num_experts_per_tok=draw(top_k(experts)),
                 norm_topk_prob=draw(st.booleans()))
    if draw(st.booleans()):  # OLMoE: the same block
        return transformers.OlmoeConfig(**base, **knobs), "OlmoeForCausalLM"
    layers = base["num_hidden_layers"]
    window = draw(st.sampled_from([None, 2, 4]))
    cfg = transformers.Qwen3MoeConfig(
        **base, **knobs, moe_intermediate_size=draw(st.sampled_from([8, 16])), head_dim=8,
        decoder_sparse_step=draw(st.integers(1, layers)),
        mlp_only_layers=draw(st.sampled_from([[], [0]])) if layers > 1 else [],
        use_sliding_window=window is not None, sliding_window=window, max_window_layers=layers)
    return cfg, "Qwen3MoeForCausalLM"


@st.composite
def deepseek_v3(draw):
    per_group = draw(st.integers(2, 3))  # Hugging Face sums each group's best two
    groups = draw(st.integers(1, 3))
    kept = draw(st.integers(1, groups))
    experts = per_group * groups
    base = common(draw)
    base["num_key_value_heads"] = base["num_attention_heads"]  # MLA repeats no heads
    layers = base["num_hidden_layers"]
    cfg = transformers.DeepseekV3Config(
        **base, intermediate_size=24, moe_intermediate_size=draw(st.sampled_from([8, 16])),
        n_routed_experts=experts, num_experts_per_tok=draw(top_k(kept * per_group)),
        n_group=groups, topk_group=kept, norm_topk_prob=draw(st.booleans()),
        routed_scaling_factor=draw(st.sampled_from([1.0, 0.5, 2.5])),
        n_shared_experts=draw(st.integers(0, 3)), first_k_dense_replace=draw(st.integers(0, layers - 1)),
        kv_lora_rank=8, q_lora_rank=draw(st.sampled_from([None, 8])), qk_rope_head_dim=4,
        v_head_dim=4, qk_nope_head_dim=4)
    return cfg, "DeepseekV3ForCausalLM"


@st.composite
def gpt_oss(draw):
    experts = draw(st.integers(2, 6))
    base = common(draw)
    layers = base["num_hidden_layers"]
    cfg = transformers.GptOssConfig(
        **base, intermediate_size=draw(st.sampled_from([8, 16])), num_local_experts=experts,
        num_experts_per_tok=draw(top_k(experts)), head_dim=8,
        sliding_window=draw(st.sampled_from([2, 4])), swiglu_limit=draw(st.sampled_from([0.5, 7.0])),
        layer_types=draw(st.lists(st.sampled_from(["sliding_attention", "full_attention"]),
                                  min_size=layers, max_size=layers)))
    return cfg, "GptOssForCausalLM"


def refusal(cfg) -> str | None:
    """What moe_lab cannot express, by this file's rule (not the code under test's): the knob
    its refusal must name, or None."""
    if getattr(cfg, "router_jitter_noise", 0.0) > 0:
        return "jitter_noise"
    renormalised = getattr(cfg, "norm_topk_prob", True)  # Mixtral and GPT-OSS always
    if cfg.num_experts_per_tok == 1 and renormalised:
        return "num_experts_per_tok=1"
    return None


def build(cfg, model_name, seed, bias_std):
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(cfg)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            std = bias_std if name.endswith("bias") else 0.3
            p.copy_(torch.randn(p.shape, generator=gen) * std)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn(b.shape, generator=gen) * 0.1)
    return model.eval()


def hf_grads(model):
    """Every parameter's gradient under its Hugging Face name; an adapter's mapped back
    through its family's ``*_to_hf`` (zeros where the stock model has no gradient)."""
    grads = {n: p.grad for n, p in model.named_parameters()
             if p.grad is not None and ".layer." not in n}
    for name, adapter in model.named_modules():
        if isinstance(adapter, HFMoEAdapter):
            state = {k: torch.zeros_like(v) for k, v in adapter.layer.state_dict().items()}
            state.update({k: p.grad for k, p in adapter.layer.named_parameters()})
            grads.update({f"{name}.{k}": v for k, v in adapter._to_hf(state).items()})
    return grads


def logits_and_grads(model, ids, g):
    model.zero_grad(set_to_none=True)
    logits = model(input_ids=ids).logits
    (logits * g).sum().backward()
    return logits.detach(), hf_grads(model)


def check_family(cfg, model_name, seed, bias_std, dispatch):
    model = build(cfg, model_name, seed, bias_std)
    patched = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(seed + 1)
    ids = torch.randint(0, VOCAB, (2, int(torch.randint(3, 8, (1,), generator=gen))), generator=gen)
    g = torch.randn(*ids.shape, VOCAB, generator=gen)
    knob = refusal(cfg)
    event(f"refused: {knob}" if knob else "computed")
    if knob is not None:
        with pytest.raises(ValueError, match=knob) as err:
            patch_hf_model(patched, *dispatch)
        assert "\n" not in str(err.value)
        return
    want, want_grads = logits_and_grads(model, ids, g)
    replaced = patch_hf_model(patched, *dispatch)
    assert replaced and all(type(b).__name__ in HF_MOE_BLOCKS for b in replaced.values())
    got, got_grads = logits_and_grads(patched, ids, g)
    scale = want.abs().max()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * scale, msg="logits")
    assert want_grads.keys() <= got_grads.keys()
    for name, ref in want_grads.items():
        torch.testing.assert_close(got_grads[name], ref, rtol=1e-4,
                                   atol=1e-5 * max(1.0, float(ref.abs().max()) if ref.numel() else 0.0),
                                   msg=name)
    ours, stock = patched.state_dict(), model.state_dict()
    assert ours.keys() == stock.keys()
    for key, value in stock.items():
        assert torch.equal(ours[key], value), key
    unpatch_hf_model(patched)
    assert not any(isinstance(m, HFMoEAdapter) for m in patched.modules())
    for name, p in patched.named_parameters():
        assert torch.equal(p, model.get_parameter(name)), name


BIAS = st.sampled_from([0.0, 0.5])
SEED = st.integers(0, 2**16)


@SETTINGS
@given(mixtral(), SEED, DISPATCH)
def test_mixtral_config_space(case, seed, dispatch):
    check_family(*case, seed, 0.0, dispatch)


@SETTINGS
@given(qwen3_moe(), SEED, DISPATCH)
def test_qwen3_moe_and_olmoe_config_space(case, seed, dispatch):
    check_family(*case, seed, 0.0, dispatch)


@SETTINGS
@given(deepseek_v3(), SEED, DISPATCH)
def test_deepseek_v3_config_space(case, seed, dispatch):
    check_family(*case, seed, 0.0, dispatch)


@SETTINGS
@given(gpt_oss(), SEED, BIAS, DISPATCH)
def test_gpt_oss_config_space(case, seed, bias_std, dispatch):
    check_family(*case, seed, bias_std, dispatch)
