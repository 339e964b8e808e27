"""MXFP8 linear layers: every GEMM of a linear layer fed MX operands blocked along its own
reduction dimension — emulated anywhere, on MX tensor cores through Transformer Engine or Triton.

A linear layer ``Y = X Wᵀ + b`` (``X: [M, K]`` tokens × features, ``W: [N, K]``) runs three
GEMMs per training step, each reducing over a different dimension, and MXFP8 blocks must
run along the reduced one:

==========  ===============  ==================================================
GEMM        reduces over     MX operands
==========  ===============  ==================================================
forward     K (features)     X blocked along K (row-wise), W along K (row-wise)
dgrad       N (outputs)      dY along N (row-wise), W along N (column-wise)
wgrad       M (tokens)       dY along M (column-wise), X along M (column-wise)
==========  ===============  ==================================================

So X, W and dY are each needed in *two* MX copies, row-wise and column-wise — not one
copy and its transpose (`moe_lab.kernels.mx_quantize` makes both in one pass). `MXLinear`
emulates this recipe exactly: each GEMM's operands are quantized to MXFP8 (E4M3,
``rceil`` scales, as Transformer Engine's ``MXFP8BlockScaling``) along that GEMM's
reduction dimension, dequantized, and multiplied in float32 (tensor cores accumulate in
float32 too); the result is cast to the input's dtype. The bias and its gradient stay in
high precision, and so does the weight gradient that leaves the wgrad GEMM. Token counts
that are not a multiple of 32 are padded with zero tokens for the wgrad GEMM (they add
nothing to the sum); the feature dims must be multiples of 32.

Where Transformer Engine is importable and the GPU has MX tensor cores (SM 10.0+,
Blackwell), `make_mxfp8_linear` with ``backend="auto"`` (or ``"te"``) builds a ``te.Linear``
run under the ``MXFP8BlockScaling`` recipe instead: real MXFP8 GEMMs. Without Transformer
Engine, ``"auto"`` takes `TritonMXLinear` where Triton compiles ``tl.dot_scaled`` natively.
Elsewhere ``"auto"`` falls back to the emulation and says so in the module's ``backend``
attribute and repr, and ``"te"`` raises with the reason. Nothing pretends. A model takes MXFP8
where it is built: ``ModelImpls(mxfp8=("attention", "experts"))``
(`moe_lab.config.ModelImpls`).
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
from torch.autograd.function import FunctionCtx

from moe_lab.attention import ATTENTION_IMPLS, causal_softmax, expand_kv, mxfp8_reference_attention
from moe_lab.checks import one_of
from moe_lab.perf.capabilities import capabilities
from moe_lab.quant.mx import BLOCK_SIZE, E4M3, mx_error_stats, quantize

Tensor = torch.Tensor
BACKENDS = ("auto", "emulated", "triton", "te")


def _fq(x: Tensor, dim: int, pad: bool = False) -> Tensor:
    """quantize (``rceil`` scales) → dequantize along ``dim`` (no autograd: inside `_MXLinearFunction`)."""
    return quantize(x, E4M3, BLOCK_SIZE, dim, "rceil", pad=pad).dequantize(torch.float32)


class _MXLinearFunction(torch.autograd.Function):
    """``Y = q(X) q(W)ᵀ + b`` with MXFP8 operands in all three GEMMs (see the module doc)."""

    @staticmethod
    def forward(ctx: FunctionCtx, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        x2 = x.reshape(-1, x.shape[-1])
        ctx.save_for_backward(x2, weight)
        ctx.x_shape = x.shape
        y = _fq(x2, -1) @ _fq(weight, -1).t()
        if bias is not None:
            y = y + bias.float()
        return y.to(x.dtype).reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx: FunctionCtx, grad_out: Tensor) -> tuple[Tensor | None, ...]:
        x2, weight = ctx.saved_tensors
        g2 = grad_out.reshape(-1, weight.shape[0])
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            # dgrad: reduce over N — dY row-wise, W column-wise (along its dim 0).
            grad_x = (_fq(g2, -1) @ _fq(weight, 0)).to(x2.dtype).reshape(ctx.x_shape)
        if ctx.needs_input_grad[1]:
            # wgrad: reduce over the tokens — dY and X column-wise (zero tokens pad to 32).
            grad_w = (_fq(g2, 0, pad=True).t() @ _fq(x2, 0, pad=True)).to(weight.dtype)
        if ctx.needs_input_grad[2]:  # False where there is no bias
            grad_b = g2.float().sum(0).to(weight.dtype)
        return grad_x, grad_w, grad_b


class MXLinear(nn.Linear):
    """An ``nn.Linear`` whose three GEMMs use MXFP8 operands (emulated: quantize with ``rceil``
    scales → dequantize → float32 matmul). Same parameters, init and state dict as ``nn.Linear``.

    ``x: [..., in_features]`` → ``[..., out_features]`` in ``x.dtype``. ``in_features`` and
    ``out_features`` must be multiples of 32. ``backend`` is always ``"emulated"`` here;
    the native paths are `TEMXFP8Linear` and `TritonMXLinear` (see `make_mxfp8_linear`).
    """

    backend = "emulated"
    function = _MXLinearFunction

    def __init__(self, in_features: int, out_features: int, bias: bool = True,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> None:
        for name, value in (("in_features", in_features), ("out_features", out_features)):
            if value % BLOCK_SIZE:
                raise ValueError(f"MXLinear.{name} must be a multiple of {BLOCK_SIZE} (an MX block), "
                                 f"got {value}")
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> MXLinear:
        """An MXLinear (``rceil`` scales) sharing ``linear``'s weight and bias Parameters (no copy)."""
        new = cls(linear.in_features, linear.out_features, linear.bias is not None, device="meta")
        new.weight, new.bias = linear.weight, linear.bias
        return new

    def forward(self, x: Tensor) -> Tensor:
        if x.shape[-1] != self.in_features:
            raise ValueError(f"x's last dim must be in_features={self.in_features}, "
                             f"got shape {tuple(x.shape)}")
        return self.function.apply(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, mxfp8={self.backend}, scale_mode=rceil"


# ------------------------------------------------------------------ Triton: tl.dot_scaled


class _TritonMXLinearFunction(torch.autograd.Function):
    """`_MXLinearFunction`'s recipe with Triton kernels: every operand quantized by
    `moe_lab.kernels.mx_quantize.mx_quantize` (row- and column-wise copies from one read), every GEMM
    an `moe_lab.kernels.mx_gemm.mx_gemm` accumulating in float32. Saves the FP8 column-wise copies
    of X and W for the backward, not X and W."""

    @staticmethod
    def forward(ctx: FunctionCtx, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        # Triton is imported only where this backend runs: the lesson works without it.
        from moe_lab.kernels.mx_gemm import mx_gemm
        from moe_lab.kernels.mx_quantize import mx_quantize

        x2 = x.reshape(-1, x.shape[-1])
        x_row, x_col = mx_quantize(x2, pad=True)  # rceil scales: mx_quantize's default
        w_row, w_col = mx_quantize(weight, pad=True)
        # mx_gemm takes operands blocked along their last dim: the column-wise copies as stored,
        # transposed ([K, M32], zero tokens padded to 32).
        ctx.save_for_backward(x_col.data.mT, x_col.scale.mT, w_col.data.mT, w_col.scale.mT)
        ctx.x_shape, ctx.w_dtype = x.shape, weight.dtype
        y = mx_gemm(x_row.data, x_row.scale, w_row.data, w_row.scale)  # [M, K]·[N, K]ᵀ: both along K
        if bias is not None:
            y = y + bias.float()
        return y.to(x.dtype).reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx: FunctionCtx, grad_out: Tensor) -> tuple[Tensor | None, ...]:
        from moe_lab.kernels.mx_gemm import mx_gemm
        from moe_lab.kernels.mx_quantize import mx_quantize

        x_codes, x_scale, w_codes, w_scale = ctx.saved_tensors  # both column-wise, transposed
        g2 = grad_out.reshape(-1, grad_out.shape[-1])
        # dY row-wise for dgrad, column-wise for wgrad (rceil, mx_quantize's default); neither
        # when only the bias needs a gradient.
        g_row, g_col = mx_quantize(g2, rowwise=ctx.needs_input_grad[0], colwise=ctx.needs_input_grad[1],
                                   pad=True)
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            # dgrad [M, K] = dY [M, N] · W [N, K]: reduces over N — dY row-wise, W column-wise.
            grad_x = mx_gemm(g_row.data, g_row.scale, w_codes, w_scale).to(g2.dtype).reshape(ctx.x_shape)
        if ctx.needs_input_grad[1]:
            # wgrad [N, K] = dYᵀ · X: reduces over the tokens — both column-wise.
            if x_codes.shape[1]:
                grad_w = mx_gemm(g_col.data.mT, g_col.scale.mT, x_codes, x_scale).to(ctx.w_dtype)
            else:  # no tokens: nothing to reduce
                grad_w = torch.zeros(g2.shape[1], x_codes.shape[0], dtype=ctx.w_dtype, device=g2.device)
        if ctx.needs_input_grad[2]:
            grad_b = g2.float().sum(0).to(ctx.w_dtype)
        return grad_x, grad_w, grad_b


class TritonMXLinear(MXLinear):
    """`MXLinear` on FP8 tensor cores: the Triton quantizer and MXFP8 GEMM (`moe_lab.kernels.mx_gemm.mx_dot`:
    block-scaled ``tl.dot_scaled`` on Blackwell, one FP8 ``wgmma`` per 32-wide K block scaled in fp32 on
    Hopper, decoded exactly under Triton's interpreter). Same recipe, same parameters; its products
    differ from the emulation's only in summation order. Its quantizer takes float32 or bfloat16
    ``x`` (and says so)."""

    backend = "triton"
    function = _TritonMXLinearFunction


def triton_mxfp8_status() -> tuple[bool, str]:
    """Whether the Triton MXFP8 GEMM runs natively here (compiled Triton on an SM 10.0+ GPU),
    and why not if not."""
    caps = capabilities()
    if caps.device != "cuda" or caps.triton_mode != "compiled":
        return False, "Triton does not compile for a GPU here"
    if not caps.native_mxfp8:
        major, minor = caps.cuda_capability
        return False, (f"{caps.device_name} is SM {major}.{minor}: no block-scaled MMA below SM 10.0 "
                       "(the Triton GEMM runs FP8 wgmma per 32-wide K block, scales applied in fp32)")
    return True, "compiled Triton on an SM 10.0+ GPU: tl.dot_scaled is block-scaled tcgen05.mma"


# ------------------------------------------------------------------ Transformer Engine


def te_mxfp8_status() -> tuple[bool, str]:
    """Whether Transformer Engine can run MXFP8 GEMMs here, and why not if not (from the
    machine's capabilities, detected once by `moe_lab.perf.capabilities`)."""
    caps = capabilities()
    if not caps.transformer_engine:
        return False, "transformer_engine is not installed"
    if caps.device != "cuda":
        return False, "no CUDA device"
    if not caps.native_mxfp8:
        major, minor = caps.cuda_capability
        return False, f"{caps.device_name} is SM {major}.{minor}; MXFP8 tensor cores need SM 10.0+"
    return True, "transformer_engine with an SM 10.0+ GPU"


class TEMXFP8Linear(nn.Module):
    """A ``transformer_engine.pytorch.Linear`` run under the ``MXFP8BlockScaling`` recipe:
    real MXFP8 GEMMs on Blackwell. Built by `make_mxfp8_linear`; holds its own (copied)
    parameters as ``self.te_linear.weight`` / ``.bias``."""

    backend = "transformer_engine"

    def __init__(self, linear: nn.Linear) -> None:
        ok, why = te_mxfp8_status()
        if not ok:
            raise RuntimeError(f"Transformer Engine MXFP8 backend unavailable: {why}")
        # Transformer Engine is optional (the [gpu] extra): imported only when used.
        import transformer_engine.pytorch as te
        from transformer_engine.common.recipe import MXFP8BlockScaling

        super().__init__()
        self.te_linear = te.Linear(linear.in_features, linear.out_features,
                                   bias=linear.bias is not None,
                                   params_dtype=linear.weight.dtype, device="cuda")
        with torch.no_grad():
            self.te_linear.weight.copy_(linear.weight)
            if linear.bias is not None:
                self.te_linear.bias.copy_(linear.bias)
        self.recipe = MXFP8BlockScaling()
        self._autocast = te.autocast  # the [gpu] extra pins transformer-engine >= 2.8, which has it

    def forward(self, x: Tensor) -> Tensor:
        with self._autocast(enabled=True, recipe=self.recipe):
            return self.te_linear(x)

    def extra_repr(self) -> str:
        return "mxfp8=transformer_engine MXFP8BlockScaling"  # the features: te_linear's repr


def make_mxfp8_linear(linear: nn.Linear, backend: str = "auto") -> nn.Module:
    """The MXFP8 version of ``linear``: `TEMXFP8Linear` (``"te"``, or ``"auto"`` where
    `te_mxfp8_status` says yes), `TritonMXLinear` (``"triton"``, or ``"auto"`` where
    Transformer Engine cannot run but `triton_mxfp8_status` says the Triton GEMM is native)
    or the emulating `MXLinear` (``"emulated"``, or ``"auto"`` elsewhere). ``backend="te"``
    where TE cannot run raises ``RuntimeError`` with why."""
    one_of(backend, "backend", BACKENDS)
    if backend == "te" or (backend == "auto" and te_mxfp8_status()[0]):
        return TEMXFP8Linear(linear)
    if backend == "triton" or (backend == "auto" and triton_mxfp8_status()[0]):
        return TritonMXLinear.from_linear(linear)
    return MXLinear.from_linear(linear)


# ------------------------------------------------------------------ per-layer error statistics


def _stats_row(layer: str, tensor: str, x: Tensor, dim: int) -> dict:
    return {"layer": layer, "tensor": tensor, **mx_error_stats(x.float(), dim=dim, pad=True)}


@torch.no_grad()
def mx_layer_error_stats(model: nn.Module, *inputs: Tensor) -> list[dict]:
    """What MXFP8 would cost, layer by layer, on one forward of ``model(*inputs)``.

    Returns one dict per (layer, tensor) with `moe_lab.quant.mx.mx_error_stats`'s figures
    (``rel_error``, ``saturated``, ``underflow``, ...) plus ``layer`` and ``tensor``:

    * ``attention{i}.{name}`` ``input`` / ``weight`` for each linear inside the ``i``-th
      ``Attention`` module (blocked along the reduction dim, as the forward GEMM sees them);
    * ``attention{i}.core`` ``q``, ``k`` (along head_dim), ``v`` (along the keys), ``p``
      (the softmax probabilities, along the keys) and ``output`` (the MXFP8 emulation's
      relative error against float32 attention; its counts are zero);
    * ``experts{j}`` ``w_gate_up`` / ``w_down`` for each ``SwiGLUExperts`` module (along
      the reduction dim, ``d_model`` and ``d_expert``).

    The model runs as configured (its own attention implementation); nothing is changed.
    """
    rows: list[dict] = []
    handles, swapped = [], []
    try:
        # by class name: moe_lab.model imports this module
        for i, block in enumerate(m for m in model.modules() if type(m).__name__ == "Attention"):
            for name, lin in block.named_modules():
                if isinstance(lin, nn.Linear):
                    def hook(mod: nn.Linear, args: tuple, layer: str = f"attention{i}.{name}") -> None:
                        rows.append(_stats_row(layer, "input", args[0], -1))
                        rows.append(_stats_row(layer, "weight", mod.weight, -1))

                    handles.append(lin.register_forward_pre_hook(hook))

            def recording(q: Tensor, k: Tensor, v: Tensor, layer: str = f"attention{i}.core",
                          original: str = block.attention_impl) -> Tensor:
                # the core's rows: q, k, v, the softmax p, and the MXFP8 emulation's output error
                ke, ve = expand_kv(q, k, v)
                probs = causal_softmax(q, ke)
                for name, x, dim in (("q", q, -1), ("k", k, -1), ("v", v, -2), ("p", probs, -1)):
                    rows.append(_stats_row(layer, name, x, dim))
                exact = probs @ ve.float()
                diff = mxfp8_reference_attention(q, k, v).float() - exact
                # The same fields as the other rows, every count zero.
                rows.append({**dict.fromkeys(rows[-1], 0), "layer": layer, "tensor": "output",
                             "rel_error": (diff.norm() / exact.norm()).item(), "mean_rel_error": math.nan,
                             "max_abs_error": diff.abs().max().item(), "numel": exact.numel(),
                             "bits_per_value": 8.25})
                return ATTENTION_IMPLS[original](q, k, v)

            # The core under a name of its own for this call (no packed variant: q, k, v pass through).
            swapped.append((block, block.attention_impl))
            block.attention_impl = f"_mx_layer_error_stats_{id(block)}"
            ATTENTION_IMPLS[block.attention_impl] = recording
        for j, experts in enumerate(m for m in model.modules() if type(m).__name__ == "SwiGLUExperts"):
            for name in ("w_gate_up", "w_down"):
                rows.append(_stats_row(f"experts{j}", name, getattr(experts, name), -2))
        model(*inputs)
    finally:
        for handle in handles:
            handle.remove()
        for block, original in swapped:
            ATTENTION_IMPLS.pop(block.attention_impl, None)
            block.attention_impl = original
    return rows
