"""moe_lab.workbench.interop against Hugging Face transformers: each family's MoE block on random tiny
configs (forward and backward), and whole tiny random models before and after
`patch_hf_model`. Configs are built locally; nothing is downloaded."""

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import (  # noqa: E402
    DeepseekV3Config,
    GptOssConfig,
    MixtralConfig,
    OlmoeConfig,
    Qwen3MoeConfig,
)
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE  # noqa: E402
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP  # noqa: E402
from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock  # noqa: E402
from transformers.models.olmoe.modeling_olmoe import OlmoeSparseMoeBlock  # noqa: E402
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock  # noqa: E402

from moe_lab.workbench.interop.deepseek_v3 import from_hf_deepseek_v3  # noqa: E402
from moe_lab.workbench.interop.gpt_oss import from_hf_gpt_oss  # noqa: E402
from moe_lab.workbench.interop.hf_blocks import from_hf_mixtral, from_hf_qwen3_moe  # noqa: E402
from moe_lab.workbench.interop.patch import HFMoEAdapter, patch_hf_model  # noqa: E402

HIDDEN = 32
COMMON = dict(vocab_size=64, hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64, attn_implementation="eager")


def mixtral_config(experts=8, top_k=2):
    return MixtralConfig(**COMMON, intermediate_size=48, num_local_experts=experts,
                         num_experts_per_tok=top_k, router_jitter_noise=0.0)


def qwen3_config(experts=8, top_k=2, norm=True):
    return Qwen3MoeConfig(**COMMON, intermediate_size=64, moe_intermediate_size=24,
                          num_experts=experts, num_experts_per_tok=top_k, norm_topk_prob=norm,
                          head_dim=8)


def olmoe_config(experts=8, top_k=2, norm=False):
    return OlmoeConfig(**COMMON, intermediate_size=24, num_experts=experts,
                       num_experts_per_tok=top_k, norm_topk_prob=norm)


def deepseek_config(experts=8, top_k=2, groups=4, topk_groups=2, norm=True, scale=2.5):
    # MLA in transformers repeats no key/value heads: as many as query heads.
    return DeepseekV3Config(**{**COMMON, "num_key_value_heads": 4}, intermediate_size=64,
                            moe_intermediate_size=16, n_shared_experts=2, n_routed_experts=experts,
                            num_experts_per_tok=top_k, n_group=groups, topk_group=topk_groups,
                            norm_topk_prob=norm, routed_scaling_factor=scale, first_k_dense_replace=1,
                            kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=4, v_head_dim=8,
                            qk_nope_head_dim=8)


def gpt_oss_config(experts=8, top_k=2, limit=0.6):
    return GptOssConfig(**COMMON, intermediate_size=24, num_local_experts=experts,
                        num_experts_per_tok=top_k, head_dim=8, sliding_window=8,
                        swiglu_limit=limit)


# family -> (config builder, HF block class, moe_lab builder, HF model class name)
FAMILIES = {
    "mixtral": (mixtral_config, MixtralSparseMoeBlock, from_hf_mixtral, "MixtralForCausalLM"),
    "qwen3_moe": (qwen3_config, Qwen3MoeSparseMoeBlock, from_hf_qwen3_moe, "Qwen3MoeForCausalLM"),
    "olmoe": (olmoe_config, OlmoeSparseMoeBlock, from_hf_qwen3_moe, "OlmoeForCausalLM"),
    "deepseek_v3": (deepseek_config, DeepseekV3MoE, from_hf_deepseek_v3, "DeepseekV3ForCausalLM"),
    "gpt_oss": (gpt_oss_config, GptOssMLP, from_hf_gpt_oss, "GptOssForCausalLM"),
}


def randomize(module, std=0.2):
    """Random weights (and DeepSeek's correction bias) so routing and clamping are exercised."""
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * std)
        for name, b in module.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn(b.shape, generator=gen) * 0.1)
    return module


def hf_block(family, **kw):
    make_config, block_cls, _, _ = FAMILIES[family]
    return randomize(block_cls(make_config(**kw)))


def block_out(block, x):
    out = block(x)
    return out[0] if isinstance(out, tuple) else out


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("dispatcher, backend", [("dropless", "torch"), ("dropless", "loop"),
                                                 ("naive", "loop")])
def test_block_forward_matches_hf(family, dispatcher, backend):
    block = hf_block(family)
    layer = FAMILIES[family][2](block, dispatcher, backend)
    x = torch.randn(3, 11, HIDDEN)
    with torch.no_grad():
        want = block_out(block, x)
        got, stats = layer(x)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert int(stats.tokens_per_expert.sum()) == 33 * layer.cfg.top_k


@pytest.mark.parametrize("family", list(FAMILIES))
def test_block_gradients_match_hf(family):
    block = hf_block(family)
    layer = FAMILIES[family][2](block)
    x = torch.randn(2, 9, HIDDEN)
    g = torch.randn(2, 9, HIDDEN)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    block_out(block, xa).backward(g)
    layer(xb)[0].backward(g)
    close = dict(rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(xb.grad, xa.grad, **close)
    gate = block.router if family == "gpt_oss" else block.gate
    torch.testing.assert_close(layer.router.weight.grad, gate.weight.grad, **close)
    experts = block.experts
    if family == "gpt_oss":
        torch.testing.assert_close(layer.experts.w_down.grad, experts.down_proj.grad, **close)
        torch.testing.assert_close(layer.experts.b_down.grad, experts.down_proj_bias.grad, **close)
        torch.testing.assert_close(layer.router.bias.grad, block.router.bias.grad, **close)
        gate_up = experts.gate_up_proj.grad
        torch.testing.assert_close(layer.experts.w_gate_up.grad,
                                   torch.cat([gate_up[..., 0::2], gate_up[..., 1::2]], -1), **close)
    else:
        torch.testing.assert_close(layer.experts.w_down.grad, experts.down_proj.grad.transpose(1, 2),
                                   **close)
        torch.testing.assert_close(layer.experts.w_gate_up.grad,
                                   experts.gate_up_proj.grad.transpose(1, 2), **close)
    if family == "deepseek_v3":
        shared = block.shared_experts
        torch.testing.assert_close(layer.shared.down.weight.grad, shared.down_proj.weight.grad, **close)


@pytest.mark.parametrize("kw", [dict(experts=8, top_k=3, groups=4, topk_groups=2),
                                dict(experts=8, top_k=2, groups=1, topk_groups=1, norm=False),
                                dict(experts=16, top_k=4, groups=8, topk_groups=3, scale=1.0)])
def test_deepseek_routing_variants(kw):
    block = hf_block("deepseek_v3", **kw)
    layer = from_hf_deepseek_v3(block)
    x = torch.randn(4, 7, HIDDEN)
    _, want_w, want_ids = block.gate(x)
    routing = layer.router(x.reshape(-1, HIDDEN))
    assert torch.equal(routing.routing_map,
                       torch.zeros_like(routing.routing_map).scatter_(1, want_ids, True))
    order = want_ids.argsort(-1)
    torch.testing.assert_close(routing.topk_weights.gather(1, routing.topk_ids.argsort(-1)),
                               want_w.gather(1, order), rtol=1e-6, atol=1e-6)
    with torch.no_grad():
        torch.testing.assert_close(layer(x)[0], block(x), rtol=1e-5, atol=1e-5)


def test_qwen3_without_renormalisation():
    block = hf_block("qwen3_moe", norm=False)
    layer = from_hf_qwen3_moe(block)
    assert not layer.cfg.renormalize
    x = torch.randn(2, 5, HIDDEN)
    with torch.no_grad():
        torch.testing.assert_close(layer(x)[0], block(x), rtol=1e-5, atol=1e-5)


def test_gpt_oss_router_scores_and_compiled_router():
    block = hf_block("gpt_oss", top_k=4)
    layer = from_hf_gpt_oss(block, router_impl="compiled")
    x = torch.randn(2, 6, HIDDEN)
    with torch.no_grad():
        want, want_scores = block(x)
        got, stats = layer(x)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(stats.routing.topk_weights, want_scores, rtol=1e-5, atol=1e-6)


def test_refusals():
    block = hf_block("mixtral")
    block.jitter_noise = 0.1
    with pytest.raises(ValueError, match="jitter_noise"):
        from_hf_mixtral(block)
    for build in (from_hf_mixtral, from_hf_qwen3_moe, from_hf_deepseek_v3, from_hf_gpt_oss):
        with pytest.raises(ValueError, match="must be a transformers"):
            build(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="top_k=1"):
        from_hf_qwen3_moe(hf_block("qwen3_moe", top_k=1))
    with pytest.raises(ValueError, match="expert_backend for ClampedSwiGLUExperts"):
        from_hf_gpt_oss(hf_block("gpt_oss"), expert_backend="triton")
    with pytest.raises(ValueError, match="router_impl for a biased router"):
        from_hf_gpt_oss(hf_block("gpt_oss"), router_impl="triton")
    with pytest.raises(ValueError, match="no MoE block"):
        patch_hf_model(torch.nn.Sequential(torch.nn.Linear(2, 2)))
    model = tiny_model("mixtral")
    model.config.output_router_logits = True
    with pytest.raises(ValueError, match="output_router_logits"):
        patch_hf_model(model)


def test_a_patched_model_refuses_what_it_cannot_do():
    """Patched twice, it said it had no MoE block; asked for router logits at call time, it
    raised an IndexError from inside transformers."""
    model = tiny_model("mixtral")
    patch_hf_model(model)
    with pytest.raises(ValueError, match="already patched: its 2 MoE blocks are moe_lab adapters"):
        patch_hf_model(model)
    ids = torch.randint(0, 64, (1, 6))
    with pytest.raises(ValueError, match="output_router_logits=True is not supported by a patched model"):
        model(input_ids=ids, output_router_logits=True)
    assert model(input_ids=ids, output_router_logits=False).logits.shape == (1, 6, 64)


def tiny_model(family):
    make_config, _, _, model_name = FAMILIES[family]
    torch.manual_seed(0)
    model = getattr(transformers, model_name)(make_config())
    return randomize(model, std=0.1).eval()


def logits_and_grads(model, ids, g):
    model.zero_grad(set_to_none=True)
    logits = model(input_ids=ids).logits
    (logits * g).sum().backward()
    return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()
                             if p.grad is not None}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_patched_model_matches(family):
    model = tiny_model(family)
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(1))
    g = torch.randn(2, 12, 64, generator=torch.Generator().manual_seed(2))
    want, want_grads = logits_and_grads(model, ids, g)
    replaced = patch_hf_model(model, dispatcher="dropless", expert_backend="torch")
    block_cls = FAMILIES[family][1]
    assert replaced and all(isinstance(b, block_cls) for b in replaced.values())
    assert not any(isinstance(m, block_cls) for m in model.modules())
    for name in replaced:
        assert isinstance(model.get_submodule(name), HFMoEAdapter)
    got, got_grads = logits_and_grads(model, ids, g)
    scale = want.abs().max()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * scale)
    # Parameters outside the MoE blocks are the same objects: their gradients must agree.
    kept = [n for n in want_grads if n in got_grads]
    assert any("embed" in n for n in kept)
    for n in kept:
        ref = want_grads[n]
        torch.testing.assert_close(got_grads[n], ref, rtol=1e-4, atol=1e-5 * max(1.0, ref.abs().max()))
    # ... and the router gates' gradients, moved into the adapters.
    for name, block in replaced.items():
        gate = block.router if family == "gpt_oss" else block.gate
        want_gate = want_grads[f"{name}.{'router' if family == 'gpt_oss' else 'gate'}.weight"]
        got_gate = model.get_submodule(name).layer.router.weight.grad
        torch.testing.assert_close(got_gate, want_gate, rtol=1e-4,
                                   atol=1e-5 * max(1.0, want_gate.abs().max()))
        assert gate.weight.shape == got_gate.shape


def test_mixtral_with_one_expert_per_token_is_refused():
    """Mixtral always renormalises the chosen weights, so with num_experts_per_tok=1 each is
    1.0; moe_lab's router keeps the top-1 probability. It was computed anyway: logits 5e-2
    off, found by the property tests (test_interop_properties.py). Now refused in one line."""
    block = hf_block("mixtral", top_k=1)
    _, weights, _ = block.gate(torch.randn(5, HIDDEN))
    assert torch.equal(weights, torch.ones_like(weights))  # what moe_lab cannot express
    with pytest.raises(ValueError, match=r"^num_experts_per_tok=1 \(top_k=1\) with renormalised"):
        from_hf_mixtral(block)
    model = transformers.MixtralForCausalLM(mixtral_config(top_k=1))
    with pytest.raises(ValueError, match="num_experts_per_tok=1"):
        patch_hf_model(model)


def test_deepseek_without_shared_experts():
    """n_shared_experts=0 gives Hugging Face an empty shared MLP (output zero); moe_lab's
    layer has none. It raised AttributeError copying into the missing shared expert."""
    config = deepseek_config()
    config.n_shared_experts = 0
    block = randomize(DeepseekV3MoE(config))
    layer = from_hf_deepseek_v3(block)
    assert layer.shared is None
    x = torch.randn(2, 5, HIDDEN)
    with torch.no_grad():
        torch.testing.assert_close(layer(x)[0], block(x), rtol=1e-5, atol=1e-5)


def train_a_few_steps(model, steps=3):
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-2)
    gen = torch.Generator().manual_seed(3)
    for _ in range(steps):
        ids = torch.randint(0, 64, (2, 10), generator=gen)
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return model.eval()


@pytest.mark.parametrize("family", list(FAMILIES))
def test_save_pretrained_of_a_trained_patched_model_loads_in_stock_transformers(family, tmp_path):
    """The adapters' state_dict has the blocks' keys and layouts, so the checkpoint is a stock
    one: before, the MoE weights were reported missing and re-initialised on load."""
    model = tiny_model(family)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    patch_hf_model(model)
    train_a_few_steps(model)
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = model(input_ids=ids).logits
    state = model.state_dict()
    assert state.keys() == before.keys()
    moe_keys = [k for k in before if ".experts." in k]
    assert moe_keys and all(not torch.equal(state[k], before[k]) for k in moe_keys)  # trained
    model.save_pretrained(tmp_path)
    stock = getattr(transformers, FAMILIES[family][3]).from_pretrained(tmp_path).eval()
    assert not any(isinstance(m, HFMoEAdapter) for m in stock.modules())
    with torch.no_grad():
        got = stock(input_ids=ids).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max())
    for k, v in stock.state_dict().items():
        assert torch.equal(v, state[k]), k


@pytest.mark.parametrize("family", list(FAMILIES))
def test_unpatch_gives_a_stock_model_with_the_trained_weights(family):
    from moe_lab.workbench.interop.patch import unpatch_hf_model

    model = tiny_model(family)
    replaced = patch_hf_model(model)
    train_a_few_steps(model)
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = model(input_ids=ids).logits
    trained = {k: v.clone() for k, v in model.state_dict().items()}
    blocks = unpatch_hf_model(model)
    assert blocks.keys() == replaced.keys()
    for name, block in blocks.items():
        assert model.get_submodule(name) is block is replaced[name]
    assert not any(isinstance(m, HFMoEAdapter) for m in model.modules())
    with torch.no_grad():
        got = model(input_ids=ids).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max())
    for k, v in model.state_dict().items():
        assert torch.equal(v, trained[k]), k
    # Stock again: router logits can be asked for, and it can be patched anew.
    assert model(input_ids=ids, output_router_logits=True).logits.shape == (2, 12, 64)
    patch_hf_model(model)
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, want, rtol=1e-5,
                                   atol=1e-5 * want.abs().max())
    with pytest.raises(ValueError, match="is not patched"):
        unpatch_hf_model(tiny_model(family))


def test_a_patched_model_loads_a_state_dict_in_hugging_face_keys():
    stock = tiny_model("deepseek_v3")
    model = tiny_model("deepseek_v3")
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(-1)
    patch_hf_model(model)
    model.load_state_dict(stock.state_dict(), strict=True)
    ids = torch.randint(0, 64, (1, 8))
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, stock(input_ids=ids).logits,
                                   rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match=r"lacks the block.s key model\.layers\.1\.mlp\.experts\."):
        model.load_state_dict({k: v for k, v in stock.state_dict().items()
                               if k != "model.layers.1.mlp.experts.down_proj"})


def test_a_selection_bias_the_family_cannot_hold_is_refused_on_the_way_back(tmp_path):
    from moe_lab.workbench.interop.patch import unpatch_hf_model

    model = tiny_model("mixtral")
    patch_hf_model(model)
    adapter = model.get_submodule("model.layers.0.mlp")
    adapter.layer.router.expert_bias[0] = 0.5  # as aux-loss-free balancing would move it
    with pytest.raises(ValueError, match="router.expert_bias is nonzero but a MixtralSparseMoeBlock"):
        model.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="router.expert_bias is nonzero"):
        unpatch_hf_model(model)
    assert isinstance(model.get_submodule("model.layers.0.mlp"), HFMoEAdapter)  # nothing swapped
