"""Bridges to Hugging Face ``transformers`` MoE blocks.

Each ``from_hf_<family>(block)`` (in the family's module; Mixtral's and Qwen3-MoE's in
``hf_blocks``) builds a moe_lab ``MoELayer`` that
computes the same function as the Hugging Face block — same router, same experts, same weights
(copied) — but with moe_lab's dispatchers (by default the dropless, sync-free one) and expert
backends. `moe_lab.workbench.interop.patch.patch_hf_model` (imported here too) swaps every MoE
block of a Hugging Face model for such a layer, in place, so a user can train or benchmark a
real model architecture on moe_lab's kernels, and `unpatch_hf_model` (or saving the patched
model) takes the trained weights back to it.

Families: Mixtral (softmax top-k, renormalised), Qwen3-MoE (softmax top-k, optionally
renormalised), DeepSeek-V3 (group-limited sigmoid routing with a selection-only correction
bias, routed scaling factor, shared experts) and GPT-OSS (router bias, expert biases and a
clamped SwiGLU: `moe_lab.moe.experts.ClampedSwiGLUExperts`). OLMoE's block is Qwen3-MoE's.

``transformers`` is a test extra, not a dependency: nothing here imports it; the blocks are
read through their attributes and recognised by their class names.
"""

from moe_lab.workbench.interop.patch import patch_hf_model as patch_hf_model  # notebook 04's import
