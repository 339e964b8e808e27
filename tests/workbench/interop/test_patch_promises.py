"""`patch_hf_model` promises the model's own logits: what would break that promise is refused
in one line, never computed differently without a word (issue 47)."""

import pytest
import torch

transformers = pytest.importorskip("transformers")

from moe_lab.workbench.interop import patch_hf_model  # noqa: E402


def tiny_mixtral():
    config = transformers.MixtralConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, attn_implementation="eager",
        intermediate_size=48, num_local_experts=8, num_experts_per_tok=2, router_jitter_noise=0.0)
    torch.manual_seed(0)
    return transformers.MixtralForCausalLM(config).eval()


def test_a_dispatcher_that_drops_tokens_is_refused_before_the_model_changes():
    """dispatcher="capacity" changed the logits by 7e-3, under a docstring promising the same."""
    model = tiny_mixtral()
    with pytest.raises(ValueError) as err:
        patch_hf_model(model, dispatcher="capacity")
    message = str(err.value)
    assert "\n" not in message
    assert "dispatcher='capacity' drops the tokens" in message and "'dropless'" in message, message
    assert type(model.model.layers[0].mlp).__name__ == "MixtralSparseMoeBlock"  # untouched


def test_router_logits_asked_for_by_the_config_after_the_patch_is_one_line():
    """Set on the config after the patch, it ended in an IndexError deep inside transformers."""
    model = tiny_mixtral()
    patch_hf_model(model)
    ids = torch.randint(0, 64, (1, 6))
    model.config.output_router_logits = True
    with pytest.raises(ValueError) as err:
        model(input_ids=ids)
    assert str(err.value).startswith("model.config.output_router_logits=True is not supported "
                                     "by a patched model"), err.value
    assert "\n" not in str(err.value)
    # The call's own False wins over the config, as in transformers.
    assert model(input_ids=ids, output_router_logits=False).logits.shape == (1, 6, 64)
    model.config.output_router_logits = False
    assert model(input_ids=ids).logits.shape == (1, 6, 64)
