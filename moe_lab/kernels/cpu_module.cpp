// The Python module of moe_lab's CPU kernels (built by moe_lab/kernels/cpu_ext.py).

#include <torch/extension.h>

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
bool bf16_gemms();

// cpu_permute.cpp: the dropless layout's token permutation.
std::vector<at::Tensor> row_id_map(const at::Tensor& topk_ids, int64_t n_experts, int64_t align);
at::Tensor permute(const at::Tensor& x, const at::Tensor& row_id_map, const c10::optional<at::Tensor>& weights,
                   int64_t n_rows);
at::Tensor unpermute(const at::Tensor& y, const at::Tensor& row_id_map, const c10::optional<at::Tensor>& weights);
at::Tensor unpermute_weight_grad(const at::Tensor& y, const at::Tensor& row_id_map, const at::Tensor& dout);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("expert_mlp", &expert_mlp, "every expert's SwiGLU MLP over its rows, experts spread over cores");
  m.def("expert_mlp_backward", &expert_mlp_backward, "backward of expert_mlp: {dx, dw1, dw2}");
  m.def("grouped_mm", &grouped_mm, "out[rows of e] = x[rows of e] @ w[e], experts spread over cores");
  m.def("grouped_mm_wgrad", &grouped_mm_wgrad, "dw[e] = x[rows of e]^T @ dy[rows of e]");
  m.def("causal_attention_forward", &causal_attention_forward,
        "causal softmax(q k^T / sqrt(d)) v per (batch, head), float32: {out, lse}");
  m.def("causal_attention_backward", &causal_attention_backward,
        "backward of causal_attention_forward: {dq, dk, dv}");
  m.def("bf16_gemms", &bf16_gemms, "whether ATen's bfloat16 GEMMs run on this CPU");
  m.def("row_id_map", &row_id_map, "counting sort of expert ids: {row_id_map [T, k] int32, offsets [E + 1] int32}");
  m.def("permute", &permute, "y[row_id_map[t, j]] = x[t] (* w[t, j]); unmapped rows zero");
  m.def("unpermute", &unpermute, "out[t] = sum_j w[t, j] * y[row_id_map[t, j]], in float32");
  m.def("unpermute_weight_grad", &unpermute_weight_grad, "dw[t, j] = <dout[t], y[row_id_map[t, j]]>");
}
