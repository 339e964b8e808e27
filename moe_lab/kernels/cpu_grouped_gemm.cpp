// moe_lab's CPU grouped GEMM: every core takes whole experts.
//
// torch._grouped_mm on a CPU runs one GEMM per expert, one after another, and each of
// those GEMMs is split across all the cores. An MoE expert's GEMM is small (a few hundred
// rows), so every core waits for the others at the end of every expert, and each core's
// share of a small GEMM is too thin to keep its vector units busy. Here an OpenMP loop
// hands out whole experts instead (dynamic schedule, because the experts' row counts differ):
// each core runs its experts' GEMMs single-threaded (ATen's GEMM does not fork again
// inside a parallel region) and no core waits until the last expert is done.
//
// Offsets are the ends of each expert's rows, as torch._grouped_mm takes them. On a CPU
// reading them costs nothing (the tensor is already in host memory), so they are checked:
// a bad offset raises instead of reading or writing out of bounds.

#include <torch/extension.h>

#include <vector>

namespace {

std::vector<int64_t> row_ends(const at::Tensor& offs, int64_t n_groups, int64_t m, const char* who) {
  TORCH_CHECK(offs.device().is_cpu(), who, ": offs must be on the CPU, got ", offs.device());
  TORCH_CHECK(offs.dim() == 1 && offs.size(0) == n_groups, who, ": offs must have shape [",
              n_groups, "] (one end per expert), got ", offs.sizes());
  TORCH_CHECK(offs.scalar_type() == at::kInt || offs.scalar_type() == at::kLong, who,
              ": offs must be int32 or int64, got ", offs.scalar_type());
  auto o = offs.to(at::kLong).contiguous();
  const int64_t* p = o.data_ptr<int64_t>();
  std::vector<int64_t> ends(p, p + n_groups);
  int64_t prev = 0;
  for (int64_t e = 0; e < n_groups; ++e) {
    TORCH_CHECK(ends[e] >= prev && ends[e] <= m, who,
                ": offs must be non-decreasing ends of row groups within [0, ", m, "], got offs[",
                e, "] = ", ends[e], " after ", prev);
    prev = ends[e];
  }
  return ends;
}

// Zero the rows of each tensor past the last group's end (rows that belong to no expert).
void zero_tail(const std::vector<int64_t>& ends, std::initializer_list<at::Tensor> tensors) {
  const int64_t end = ends.empty() ? 0 : ends.back();
  for (const at::Tensor& t : tensors) {
    if (end < t.size(0)) t.slice(0, end, t.size(0)).zero_();
  }
}

// Elementwise math in float32 for 16-bit inputs (one rounding at the end, as a fused GPU
// epilogue or Inductor's generated code does); float32 and float64 as they are.
at::Tensor widen(const at::Tensor& t) {
  return at::isReducedFloatingType(t.scalar_type()) ? t.to(at::kFloat) : t;
}

// silu(gate) * up in the inputs' dtype, computed as `widen` says.
at::Tensor swiglu(const at::Tensor& gate, const at::Tensor& up) {
  return at::silu(widen(gate)).mul_(widen(up)).to(gate.scalar_type());
}

}  // namespace

// out[rows of e] = x[rows of e] @ w[e]; rows past the last end are zero.
at::Tensor grouped_mm(const at::Tensor& x, const at::Tensor& w, const at::Tensor& offs) {
  TORCH_CHECK(x.device().is_cpu() && w.device().is_cpu(), "grouped_mm: x and w must be on the CPU");
  TORCH_CHECK(x.dim() == 2 && w.dim() == 3, "grouped_mm: x must be [M, K] and w [E, K, N], got ",
              x.sizes(), " and ", w.sizes());
  TORCH_CHECK(x.size(1) == w.size(1), "grouped_mm: x's K (", x.size(1), ") != w's K (", w.size(1), ")");
  TORCH_CHECK(x.scalar_type() == w.scalar_type(), "grouped_mm: x and w must share a dtype, got ",
              x.scalar_type(), " and ", w.scalar_type());
  const int64_t n_groups = w.size(0), m = x.size(0);
  const auto ends = row_ends(offs, n_groups, m, "grouped_mm");
  at::Tensor out = at::empty({m, w.size(2)}, x.options());
  zero_tail(ends, {out});
#pragma omp parallel for schedule(dynamic, 1)
  for (int64_t e = 0; e < n_groups; ++e) {
    at::AutoDispatchBelowADInplaceOrView guard;
    const int64_t start = e ? ends[e - 1] : 0, end = ends[e];
    if (end > start) {
      at::Tensor out_e = out.slice(0, start, end);
      at::mm_out(out_e, x.slice(0, start, end), w.select(0, e));
    }
  }
  return out;
}

// dw[e] = x[rows of e]^T @ dy[rows of e]; zero for an expert with no rows.
at::Tensor grouped_mm_wgrad(const at::Tensor& x, const at::Tensor& dy, const at::Tensor& offs) {
  TORCH_CHECK(x.device().is_cpu() && dy.device().is_cpu(),
              "grouped_mm_wgrad: x and dy must be on the CPU");
  TORCH_CHECK(x.dim() == 2 && dy.dim() == 2 && x.size(0) == dy.size(0),
              "grouped_mm_wgrad: x must be [M, K] and dy [M, N], got ", x.sizes(), " and ", dy.sizes());
  TORCH_CHECK(x.scalar_type() == dy.scalar_type(), "grouped_mm_wgrad: x and dy must share a dtype, got ",
              x.scalar_type(), " and ", dy.scalar_type());
  TORCH_CHECK(offs.dim() == 1, "grouped_mm_wgrad: offs must be 1-D (one end per expert), got ",
              offs.sizes());
  const int64_t n_groups = offs.size(0);
  const auto ends = row_ends(offs, n_groups, x.size(0), "grouped_mm_wgrad");
  at::Tensor dw = at::empty({n_groups, x.size(1), dy.size(1)}, x.options());
#pragma omp parallel for schedule(dynamic, 1)
  for (int64_t e = 0; e < n_groups; ++e) {
    at::AutoDispatchBelowADInplaceOrView guard;
    const int64_t start = e ? ends[e - 1] : 0, end = ends[e];
    at::Tensor dw_e = dw.select(0, e);
    if (end > start) {
      at::mm_out(dw_e, x.slice(0, start, end).t(), dy.slice(0, start, end));
    } else {
      dw_e.zero_();
    }
  }
  return dw;
}

// The whole expert MLP, y[rows of e] = swiglu(x[rows of e] @ w1[e]) @ w2[e], one expert per
// core at a time: the pre-activation h of an expert is still in that core's cache when its
// SwiGLU and second GEMM read it. Returns {y, h}; h (the pre-activation, [M, 2f]) is what the
// backward needs besides x. Rows past the last end are zero in both.
std::vector<at::Tensor> expert_mlp(const at::Tensor& x, const at::Tensor& w1, const at::Tensor& w2,
                                   const at::Tensor& offs) {
  TORCH_CHECK(x.device().is_cpu() && w1.device().is_cpu() && w2.device().is_cpu(),
              "expert_mlp: x, w1 and w2 must be on the CPU");
  TORCH_CHECK(x.dim() == 2 && w1.dim() == 3 && w2.dim() == 3, "expert_mlp: x must be [M, d], w1 [E, d, 2f] "
              "and w2 [E, f, d_out], got ", x.sizes(), ", ", w1.sizes(), " and ", w2.sizes());
  const int64_t n_groups = w1.size(0), m = x.size(0), two_f = w1.size(2), f = two_f / 2;
  TORCH_CHECK(x.size(1) == w1.size(1) && two_f % 2 == 0 && w2.size(0) == n_groups && w2.size(1) == f,
              "expert_mlp: shapes do not chain: x ", x.sizes(), ", w1 ", w1.sizes(), ", w2 ", w2.sizes());
  TORCH_CHECK(x.scalar_type() == w1.scalar_type() && x.scalar_type() == w2.scalar_type(),
              "expert_mlp: x, w1 and w2 must share a dtype, got ", x.scalar_type(), ", ",
              w1.scalar_type(), " and ", w2.scalar_type());
  const auto ends = row_ends(offs, n_groups, m, "expert_mlp");
  at::Tensor h = at::empty({m, two_f}, x.options());
  at::Tensor y = at::empty({m, w2.size(2)}, x.options());
  zero_tail(ends, {h, y});
#pragma omp parallel for schedule(dynamic, 1)
  for (int64_t e = 0; e < n_groups; ++e) {
    at::AutoDispatchBelowADInplaceOrView guard;
    const int64_t start = e ? ends[e - 1] : 0, end = ends[e];
    if (end == start) continue;
    at::Tensor h_e = h.slice(0, start, end), y_e = y.slice(0, start, end);
    at::mm_out(h_e, x.slice(0, start, end), w1.select(0, e));
    const at::Tensor a = swiglu(h_e.narrow(1, 0, f), h_e.narrow(1, f, f));
    at::mm_out(y_e, a, w2.select(0, e));
  }
  return {y, h};
}

// Backward of expert_mlp, again one expert per core: {dx, dw1, dw2}. The activation
// a = silu(gate) * up is recomputed from h per expert (cheap, and cache-hot) rather than kept
// from the forward.
std::vector<at::Tensor> expert_mlp_backward(const at::Tensor& x, const at::Tensor& h, const at::Tensor& w1,
                                            const at::Tensor& w2, const at::Tensor& offs,
                                            const at::Tensor& dy) {
  const int64_t n_groups = w1.size(0), m = x.size(0), f = w1.size(2) / 2;
  TORCH_CHECK(h.size(0) == m && dy.size(0) == m && dy.size(1) == w2.size(2),
              "expert_mlp_backward: shapes do not match: x ", x.sizes(), ", h ", h.sizes(), ", dy ",
              dy.sizes(), ", w2 ", w2.sizes());
  TORCH_CHECK(dy.scalar_type() == x.scalar_type(), "expert_mlp_backward: dy must have x's dtype ",
              x.scalar_type(), ", got ", dy.scalar_type());
  const auto ends = row_ends(offs, n_groups, m, "expert_mlp_backward");
  at::Tensor dx = at::empty({m, x.size(1)}, x.options());
  at::Tensor dw1 = at::empty(w1.sizes(), x.options());
  at::Tensor dw2 = at::empty(w2.sizes(), x.options());
  zero_tail(ends, {dx});
#pragma omp parallel for schedule(dynamic, 1)
  for (int64_t e = 0; e < n_groups; ++e) {
    at::AutoDispatchBelowADInplaceOrView guard;
    const int64_t start = e ? ends[e - 1] : 0, end = ends[e];
    at::Tensor dw1_e = dw1.select(0, e), dw2_e = dw2.select(0, e);
    if (end == start) {
      dw1_e.zero_();
      dw2_e.zero_();
      continue;
    }
    at::Tensor x_e = x.slice(0, start, end), h_e = h.slice(0, start, end), dy_e = dy.slice(0, start, end);
    at::Tensor gate = h_e.narrow(1, 0, f), up = h_e.narrow(1, f, f);
    const at::Tensor g = widen(gate), u = widen(up);
    const at::Tensor s = at::silu(g);
    at::mm_out(dw2_e, (s * u).to(x.scalar_type()).t(), dy_e);  // dW2 = aᵀ · dy
    const at::Tensor da = widen(at::mm(dy_e, w2.select(0, e).t()));  // da = dy · W2ᵀ
    at::Tensor dh = at::empty({end - start, 2 * f}, x.options());
    dh.narrow(1, f, f).copy_(da * s);                              // d up   = da · silu(gate)
    dh.narrow(1, 0, f).copy_(at::silu_backward(da * u, g));        // d gate = da · up · silu'(gate)
    at::mm_out(dw1_e, x_e.t(), dh);                        // dW1 = xᵀ · dh
    at::Tensor dx_e = dx.slice(0, start, end);
    at::mm_out(dx_e, dh, w1.select(0, e).t());             // dx = dh · W1ᵀ
  }
  return {dx, dw1, dw2};
}
