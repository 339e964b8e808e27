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
  const int64_t last = n_groups ? ends[n_groups - 1] : 0;
  if (last < m) out.slice(0, last, m).zero_();
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

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("grouped_mm", &grouped_mm, "out[rows of e] = x[rows of e] @ w[e], experts spread over cores");
  m.def("grouped_mm_wgrad", &grouped_mm_wgrad, "dw[e] = x[rows of e]^T @ dy[rows of e]");
}
