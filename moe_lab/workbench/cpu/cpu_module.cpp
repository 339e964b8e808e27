// The Python module of moe_lab's CPU kernels (built by build.py).

// The one file that binds to Python: pybind11 and its at::Tensor casters (torch/python.h), not
// torch/extension.h, whose C++ frontend headers take most of a file's compile time. The kernel
// files include ATen alone.
#include <torch/python.h>

#include "cpu_bf16.h"

#include <vector>

// cpu_grouped_gemm.cpp: the openmp expert backend.
at::Tensor grouped_mm(const at::Tensor& x, const at::Tensor& w, const at::Tensor& offs);
at::Tensor grouped_mm_wgrad(const at::Tensor& x, const at::Tensor& dy, const at::Tensor& offs);
std::vector<at::Tensor> expert_mlp(const at::Tensor& x, const at::Tensor& w1, const at::Tensor& w2,
                                   const at::Tensor& offs);
std::vector<at::Tensor> expert_mlp_backward(const at::Tensor& x, const at::Tensor& h, const at::Tensor& w1,
                                            const at::Tensor& w2, const at::Tensor& offs,
                                            const at::Tensor& dy);

// cpu_attention.cpp: fused causal attention.
std::vector<at::Tensor> causal_attention_forward(const at::Tensor& q, const at::Tensor& k,
                                                 const at::Tensor& v);
std::vector<at::Tensor> causal_attention_backward(const at::Tensor& dout, const at::Tensor& q,
                                                  const at::Tensor& k, const at::Tensor& v,
                                                  const at::Tensor& out, const at::Tensor& lse);
std::vector<at::Tensor> rope_attention_forward(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                                               int64_t heads, bool fused);
at::Tensor rope_attention_backward(const at::Tensor& dout, const at::Tensor& qkv, const at::Tensor& cos,
                                   const at::Tensor& sin, const at::Tensor& out, const at::Tensor& lse, int64_t heads,
                                   bool fused);
bool bf16_gemms();

// cpu_permute.cpp: the dropless layout's token permutation.
std::vector<at::Tensor> row_id_map(const at::Tensor& topk_ids, int64_t n_experts, int64_t align);
at::Tensor permute(const at::Tensor& x, const at::Tensor& row_id_map, const c10::optional<at::Tensor>& weights,
                   int64_t n_rows);
at::Tensor unpermute(const at::Tensor& y, const at::Tensor& row_id_map, const c10::optional<at::Tensor>& weights);
at::Tensor unpermute_weight_grad(const at::Tensor& y, const at::Tensor& row_id_map, const at::Tensor& dout);
at::Tensor topk_lowest_index(const at::Tensor& values, int64_t k);

// cpu_optim.cpp: the global gradient norm, the clip factor and AdamW in one call.
at::Tensor clip_adamw_(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads,
                       const std::vector<at::Tensor>& exp_avgs, const std::vector<at::Tensor>& exp_avg_sqs,
                       const std::vector<at::Tensor>& steps, const std::vector<double>& weight_decays,
                       const at::Tensor& lr, double beta1, double beta2, double eps, double max_norm,
                       const at::Tensor& skip, const at::Tensor& grad_scale);

// cpu_bf16.h's float32 -> bfloat16 rounding over a tensor (what the kernels round with), and
// whether it runs on the AVX512_BF16 instructions in this build; for the tests.
at::Tensor round_bf16(const at::Tensor& x) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat, "round_bf16: x must be a float32 CPU tensor, got ",
              x.scalar_type(), " on ", x.device());
  const at::Tensor src = x.contiguous();
  at::Tensor out = at::empty(src.sizes(), src.options().dtype(at::kBFloat16));
  moe_lab_cpu::to_bf16(src.data_ptr<float>(), out.data_ptr<at::BFloat16>(), src.numel());
  return out;
}

bool native_bf16() {
#ifdef MOE_LAB_NATIVE_BF16
  return true;
#else
  return false;
#endif
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("expert_mlp", &expert_mlp, "every expert's SwiGLU MLP over its rows, experts spread over cores");
  m.def("expert_mlp_backward", &expert_mlp_backward, "backward of expert_mlp: {dx, dw1, dw2}");
  m.def("grouped_mm", &grouped_mm, "out[rows of e] = x[rows of e] @ w[e], experts spread over cores");
  m.def("grouped_mm_wgrad", &grouped_mm_wgrad, "dw[e] = x[rows of e]^T @ dy[rows of e]");
  m.def("causal_attention_forward", &causal_attention_forward,
        "causal softmax(q k^T / sqrt(d)) v per (batch, head), float32: {out, lse}");
  m.def("causal_attention_backward", &causal_attention_backward,
        "backward of causal_attention_forward: {dq, dk, dv}");
  m.def("rope_attention_forward", &rope_attention_forward,
        "causal attention of a packed [B, S, 3HD] bfloat16 QKV with RoPE on q and k: {out [B, S, HD], lse}");
  m.def("rope_attention_backward", &rope_attention_backward,
        "backward of rope_attention_forward: dqkv [B, S, 3HD]");
  m.def("bf16_gemms", &bf16_gemms, "whether ATen's bfloat16 GEMMs run on this CPU");
  m.def("clip_adamw_", &clip_adamw_, "global gradient norm, clip factor and AdamW step over all tensors");
  m.def("round_bf16", &round_bf16, "float32 -> bfloat16 as the kernels round (nearest even)");
  m.def("native_bf16", &native_bf16, "whether the kernels round on the AVX512_BF16 instructions");
  m.def("row_id_map", &row_id_map, "counting sort of expert ids: {row_id_map [T, k] int32, offsets [E + 1] int32}");
  m.def("permute", &permute, "y[row_id_map[t, j]] = x[t] (* w[t, j]); unmapped rows zero");
  m.def("unpermute", &unpermute, "out[t] = sum_j w[t, j] * y[row_id_map[t, j]], in float32");
  m.def("unpermute_weight_grad", &unpermute_weight_grad, "dw[t, j] = <dout[t], y[row_id_map[t, j]]>");
  m.def("topk_lowest_index", &topk_lowest_index, "[T, k] int64: each row's top k, highest first, ties to the lower index");
}
