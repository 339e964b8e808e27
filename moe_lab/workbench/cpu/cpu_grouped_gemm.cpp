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

#include <ATen/ATen.h>
#include <ATen/cpu/vec/vec.h>

#include "cpu_bf16.h"

#include <cmath>
#include <type_traits>
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

// silu(gate) * up in the inputs' dtype, computed as `widen` says (ATen ops: the float64 path).
at::Tensor swiglu(const at::Tensor& gate, const at::Tensor& up) {
  return at::silu(widen(gate)).mul_(widen(up)).to(gate.scalar_type());
}

// The float32/bf16/fp16 path: one pass per row over the expert's pre-activation, in float32
// registers (ATen's vector types, the exp ATen's own silu uses), instead of the half-dozen
// ATen calls and temporaries of `swiglu` and its gradient for every expert.
using fVec = at::vec::Vectorized<float>;

inline bool vectorised_swiglu(at::ScalarType t) {
  return t == at::kFloat || t == at::kBFloat16 || t == at::kHalf;
}

template <typename T>
inline const float* as_float(const T* src, int64_t n, float* buf) {
  if constexpr (std::is_same_v<T, float>) {
    return src;
  } else {
    at::vec::convert(src, buf, n);
    return buf;
  }
}

template <typename T>
inline void store(const float* src, T* dst, int64_t n) {
  if constexpr (std::is_same_v<T, at::BFloat16>) {
    moe_lab_cpu::to_bf16(src, dst, n);
  } else {
    at::vec::convert(src, dst, n);
  }
}

inline float sigmoid(float g) { return 1.f / (1.f + std::exp(-g)); }

// a[j] = silu(g[j]) * u[j]
inline void swiglu_row(const float* g, const float* u, float* a, int64_t n) {
  const fVec one(1.f);
  int64_t j = 0;
  for (; j + fVec::size() <= n; j += fVec::size()) {
    const fVec gv = fVec::loadu(g + j);
    (gv / (one + gv.neg().exp_u20()) * fVec::loadu(u + j)).store(a + j);
  }
  for (; j < n; ++j) a[j] = g[j] * sigmoid(g[j]) * u[j];
}

// dg = da · u · silu'(g), du = da · silu(g), with silu'(g) = σ(g)(1 + g(1 − σ(g))); and, where
// `a` is given, the activation a = silu(g) · u again, computed exactly as `swiglu_row` does (the
// forward's values, bit for bit) — the backward needs it for dW2 and gets it from this pass.
inline void swiglu_grad_row(const float* g, const float* u, const float* da, float* dg, float* du,
                            float* a, int64_t n) {
  const fVec one(1.f);
  int64_t j = 0;
  for (; j + fVec::size() <= n; j += fVec::size()) {
    const fVec gv = fVec::loadu(g + j), uv = fVec::loadu(u + j), dav = fVec::loadu(da + j);
    const fVec denom = one + gv.neg().exp_u20();
    const fVec sig = one / denom, silu = gv / denom;
    if (a != nullptr) (silu * uv).store(a + j);
    (dav * silu).store(du + j);
    (dav * uv * sig * (one + gv * (one - sig))).store(dg + j);
  }
  for (; j < n; ++j) {
    const float sig = sigmoid(g[j]);
    if (a != nullptr) a[j] = g[j] * sig * u[j];
    du[j] = da[j] * g[j] * sig;
    dg[j] = da[j] * u[j] * sig * (1.f + g[j] * (1.f - sig));
  }
}

#ifdef MOE_LAB_NATIVE_BF16
using moe_lab_cpu::bf16_bits;
using moe_lab_cpu::load_bf16;
using moe_lab_cpu::load_f32;
using moe_lab_cpu::store_bf16;
using moe_lab_cpu::widen_bits;
#endif

// a[r] = swiglu(h[r, :f], h[r, f:]) for the rows of one expert (h rows contiguous, a contiguous).
template <typename T>
void swiglu_rows(const at::Tensor& h, at::Tensor& a, int64_t f) {
  std::vector<float> buf(3 * f);
  const T* hp = h.data_ptr<T>();
  T* ap = a.data_ptr<T>();
  for (int64_t r = 0; r < h.size(0); ++r) {
    const T* row = hp + r * h.stride(0);
    const float* g = as_float(row, f, buf.data());
    const float* u = as_float(row + f, f, buf.data() + f);
    float* out = buf.data() + 2 * f;
    swiglu_row(g, u, out, f);
    store(out, ap + r * f, f);
  }
}

// dh[r] = [d gate, d up] from h[r] and da[r], and a[r] = swiglu(h[r]) (all rows contiguous).
template <typename T>
void swiglu_grad_rows(const at::Tensor& h, const at::Tensor& da, at::Tensor& dh, at::Tensor& a,
                      int64_t f) {
  std::vector<float> buf(6 * f);
  const T *hp = h.data_ptr<T>(), *dap = da.data_ptr<T>();
  T *dhp = dh.data_ptr<T>(), *ap = a.data_ptr<T>();
  for (int64_t r = 0; r < h.size(0); ++r) {
    const T* row = hp + r * h.stride(0);
    const float* g = as_float(row, f, buf.data());
    const float* u = as_float(row + f, f, buf.data() + f);
    const float* d = as_float(dap + r * f, f, buf.data() + 2 * f);
    float *dg = buf.data() + 3 * f, *du = buf.data() + 4 * f, *act = buf.data() + 5 * f;
    swiglu_grad_row(g, u, d, dg, du, act, f);
    store(dg, dhp + r * 2 * f, f);
    store(du, dhp + r * 2 * f + f, f);
    store(act, ap + r * f, f);
  }
}

// The expert's activation a = swiglu(h) in h's dtype.
at::Tensor expert_swiglu(const at::Tensor& h_e, int64_t f) {
  if (!vectorised_swiglu(h_e.scalar_type())) return swiglu(h_e.narrow(1, 0, f), h_e.narrow(1, f, f));
  at::Tensor a = at::empty({h_e.size(0), f}, h_e.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, h_e.scalar_type(), "expert_swiglu",
                                  [&] { swiglu_rows<scalar_t>(h_e, a, f); });
  return a;
}

// ---- bfloat16: the expert's GEMMs on ATen's bf16 micro-kernel, in blocks of rows ----
//
// With bfloat16 operands (the model under BF16 autocast) each expert runs in blocks of rows
// through ATen's bf16 brgemm (moe_lab_cpu::gemm) instead of whole-expert ATen GEMMs:
// the weights are repacked once per expert into the pairs layout those GEMMs read, and
// everything a block makes (its pre-activation in float32, its activation, its gradients)
// stays in the core's cache between the GEMMs that use it. The weight gradients accumulate
// over the blocks in float32 and are rounded once. Needs even d, f and d_out (the pairs).
// Blocks are 32 rows in the forward (a block's [32, 2f] float32 pre-activation stays in a
// core's L1 beside its operands) and 64 in the backward, whose weight gradients reduce over a
// block's rows (there the longer reduction pays more than the smaller footprint).

using moe_lab_cpu::bf16;
using moe_lab_cpu::Scratch;
constexpr int64_t kRowsFwd = 32;
constexpr int64_t kRows = 64;

// bfloat16 tokens with bfloat16 weights, or with float32 (master) weights: those are rounded
// to bfloat16 as they are repacked, and their gradients come back in float32, never rounded.
inline bool bf16_blocks(const at::Tensor& x, const at::Tensor& w1, const at::Tensor& w2) {
  const auto wt = w1.scalar_type();
  return x.scalar_type() == at::kBFloat16 && (wt == at::kBFloat16 || wt == at::kFloat) &&
         w2.scalar_type() == wt && x.size(1) % 2 == 0 && w1.size(2) % 4 == 0 &&
         w2.size(2) % 2 == 0 && moe_lab_cpu::bf16_gemm_works();
}

// Contiguous, on a 32-bit boundary (pack_transposed reads pairs as words); else a fresh copy.
at::Tensor paired(const at::Tensor& t) {
  return (t.is_contiguous() && reinterpret_cast<uintptr_t>(t.data_ptr()) % 4 == 0)
             ? t : t.clone(at::MemoryFormat::Contiguous);
}

at::Tensor unit_stride_rows(const at::Tensor& t) { return t.stride(1) == 1 ? t : t.contiguous(); }

// A contiguous [rows, cols] weight of type T as the B operand of a GEMM with k = rows
// (pack_pairs) or, transposed, with k = cols (pack_transposed); float32 is rounded to bfloat16
// first, through `tmp` (rows · cols).
template <typename T>
inline void pack_weight(const T* w, int64_t rows, int64_t cols, bool transposed, bf16* out, bf16* tmp) {
  const bf16* src;
  if constexpr (std::is_same_v<T, bf16>) {
    src = w;
  } else {
    moe_lab_cpu::to_bf16(w, tmp, rows * cols);
    src = tmp;
  }
  if (transposed) {
    moe_lab_cpu::pack_transposed(src, rows, cols, cols, out);
  } else {
    moe_lab_cpu::pack_pairs(src, rows, cols, cols, out);
  }
}

// x, w1 and w2 share a dtype, or x is bfloat16 with float32 weights where bf16_blocks runs.
void check_dtypes(const at::Tensor& x, const at::Tensor& w1, const at::Tensor& w2, const char* who) {
  const bool same = x.scalar_type() == w1.scalar_type() && x.scalar_type() == w2.scalar_type();
  TORCH_CHECK(same || bf16_blocks(x, w1, w2), who, ": x, w1 and w2 must share a dtype (or x bfloat16 "
              "with float32 weights, where bf16 GEMMs run here and d, 2f / 2 and d_out are even), got ",
              x.scalar_type(), ", ", w1.scalar_type(), " and ", w2.scalar_type());
}

// One row of a block's first GEMM, [gate, up] in float32: h = its bfloat16 rounding (what the
// backward reads) and act = bfloat16(silu(gate) · up) of the rounded values, as swiglu_row
// computes it. With MOE_LAB_NATIVE_BF16 in one pass over the row, in registers.
inline void swiglu_block_row(const float* hf, bf16* h, bf16* act, int64_t f, float* buf) {
#ifdef MOE_LAB_NATIVE_BF16
  const fVec one(1.f);
  for (int64_t j = 0; j < f; j += fVec::size()) {
    const int64_t n = std::min<int64_t>(fVec::size(), f - j);
    const __m256i gb = bf16_bits(load_f32(hf + j, n)), ub = bf16_bits(load_f32(hf + f + j, n));
    store_bf16(gb, h + j, n);
    store_bf16(ub, h + f + j, n);
    const fVec g(widen_bits(gb)), u(widen_bits(ub));
    store_bf16(bf16_bits(g / (one + g.neg().exp_u20()) * u), act + j, n);
  }
#else
  moe_lab_cpu::to_bf16(hf, h, 2 * f);
  swiglu_row(as_float(h, f, buf), as_float(h + f, f, buf + f), buf + 2 * f, f);
  store(buf + 2 * f, act, f);
#endif
}

// The backward's row: dh = [d gate, d up] in bfloat16 from h (bfloat16) and da (float32), and
// act = the forward's activation again, bit for bit (the same formula on the same values).
inline void swiglu_grad_block_row(const bf16* h, const float* da, bf16* dh, bf16* act, int64_t f, float* buf) {
#ifdef MOE_LAB_NATIVE_BF16
  const fVec one(1.f);
  for (int64_t j = 0; j < f; j += fVec::size()) {
    const int64_t n = std::min<int64_t>(fVec::size(), f - j);
    const fVec g(load_bf16(h + j, n)), u(load_bf16(h + f + j, n)), d(load_f32(da + j, n));
    const fVec denom = one + g.neg().exp_u20();
    const fVec sig = one / denom, silu = g / denom;
    store_bf16(bf16_bits(silu * u), act + j, n);
    store_bf16(bf16_bits(d * silu), dh + f + j, n);
    store_bf16(bf16_bits(d * u * sig * (one + g * (one - sig))), dh + j, n);
  }
#else
  const float* g = as_float(h, f, buf);
  const float* u = as_float(h + f, f, buf + f);
  float *dg = buf + 2 * f, *du = buf + 3 * f, *a = buf + 4 * f;
  swiglu_grad_row(g, u, da, dg, du, a, f);
  store(dg, dh, f);
  store(du, dh + f, f);
  store(a, act, f);
#endif
}

template <typename W>
std::vector<at::Tensor> expert_mlp_bf16(const at::Tensor& x_in, const at::Tensor& w1_in, const at::Tensor& w2_in,
                                        const std::vector<int64_t>& ends) {
  const at::Tensor x = unit_stride_rows(x_in), w1 = paired(w1_in), w2 = paired(w2_in);
  const int64_t n_groups = w1.size(0), m = x.size(0), d = x.size(1), two_f = w1.size(2), f = two_f / 2,
                d_out = w2.size(2), ldx = x.stride(0);
  at::Tensor h = at::empty({m, two_f}, x.options());
  at::Tensor y = at::empty({m, d_out}, x.options());
  zero_tail(ends, {h, y});
  const bf16* X = x.data_ptr<bf16>();
  const W *W1 = w1.data_ptr<W>(), *W2 = w2.data_ptr<W>();
  bf16 *H = h.data_ptr<bf16>(), *Y = y.data_ptr<bf16>();
#pragma omp parallel
  {
    Scratch<bf16> w1p(d * two_f), w2p(f * d_out), act(kRowsFwd * f),
        tmp(std::is_same_v<W, bf16> ? 0 : std::max(d * two_f, f * d_out));
    Scratch<float> hf(kRowsFwd * two_f), yf(kRowsFwd * d_out), buf(3 * f);
#pragma omp for schedule(dynamic, 1)
    for (int64_t e = 0; e < n_groups; ++e) {
      const int64_t start = e ? ends[e - 1] : 0, end = ends[e];
      if (end == start) continue;
      pack_weight(W1 + e * d * two_f, d, two_f, false, w1p.data(), tmp.data());
      pack_weight(W2 + e * f * d_out, f, d_out, false, w2p.data(), tmp.data());
      for (int64_t r0 = start; r0 < end; r0 += kRowsFwd) {
        const int64_t rb = std::min(kRowsFwd, end - r0);
        moe_lab_cpu::gemm(rb, two_f, d, X + r0 * ldx, ldx, w1p.data(), two_f, hf.data(), two_f, false);
        for (int64_t r = 0; r < rb; ++r) {
          swiglu_block_row(hf.data() + r * two_f, H + (r0 + r) * two_f, act.data() + r * f, f, buf.data());
        }
        moe_lab_cpu::gemm(rb, d_out, f, act.data(), f, w2p.data(), d_out, yf.data(), d_out, false);
        moe_lab_cpu::to_bf16(yf.data(), Y + r0 * d_out, rb * d_out);
      }
    }
    at::native::cpublas::brgemm_release(true);
  }
  return {y, h};
}

template <typename W>
std::vector<at::Tensor> expert_mlp_backward_bf16(const at::Tensor& x_in, const at::Tensor& h, const at::Tensor& w1_in,
                                                 const at::Tensor& w2_in, const std::vector<int64_t>& ends,
                                                 const at::Tensor& dy_in) {
  const at::Tensor x = unit_stride_rows(x_in), dy = unit_stride_rows(dy_in), w1 = paired(w1_in), w2 = paired(w2_in);
  const int64_t n_groups = w1.size(0), m = x.size(0), d = x.size(1), two_f = w1.size(2), f = two_f / 2,
                d_out = w2.size(2), ldx = x.stride(0), ldy = dy.stride(0);
  at::Tensor dx = at::empty({m, d}, x.options());
  at::Tensor dw1 = at::empty(w1.sizes(), w1.options());  // in the weights' dtype
  at::Tensor dw2 = at::empty(w2.sizes(), w2.options());
  zero_tail(ends, {dx});
  const bf16 *X = x.data_ptr<bf16>(), *H = h.data_ptr<bf16>(), *DY = dy.data_ptr<bf16>();
  const W *W1 = w1.data_ptr<W>(), *W2 = w2.data_ptr<W>();
  bf16* DX = dx.data_ptr<bf16>();
  W *DW1 = dw1.data_ptr<W>(), *DW2 = dw2.data_ptr<W>();
  const int64_t rows2 = moe_lab_cpu::round_even(kRows);
  constexpr bool fp32_weights = std::is_same_v<W, float>;
#pragma omp parallel
  {
    Scratch<bf16> w1t(d * two_f), w2t(f * d_out), dh(kRows * two_f), act(kRows * f),
        tb(std::max(d, f) * rows2), pairs(rows2 * std::max(two_f, d_out)),
        tmp(fp32_weights ? std::max(d * two_f, f * d_out) : 0);
    // float32 weights accumulate their gradients in place; bfloat16 ones in float32 here
    Scratch<float> daf(kRows * f), dxf(kRows * d), dw1acc(fp32_weights ? 0 : d * two_f),
        dw2acc(fp32_weights ? 0 : f * d_out), buf(5 * f);
#pragma omp for schedule(dynamic, 1)
    for (int64_t e = 0; e < n_groups; ++e) {
      const int64_t start = e ? ends[e - 1] : 0, end = ends[e];
      W *dw1_e = DW1 + e * d * two_f, *dw2_e = DW2 + e * f * d_out;
      if (end == start) {
        std::fill(dw1_e, dw1_e + d * two_f, W(0.f));
        std::fill(dw2_e, dw2_e + f * d_out, W(0.f));
        continue;
      }
      pack_weight(W2 + e * f * d_out, f, d_out, true, w2t.data(), tmp.data());  // B of dy · W2ᵀ
      pack_weight(W1 + e * d * two_f, d, two_f, true, w1t.data(), tmp.data());  // B of dh · W1ᵀ
      float* acc1 = fp32_weights ? reinterpret_cast<float*>(dw1_e) : dw1acc.data();
      float* acc2 = fp32_weights ? reinterpret_cast<float*>(dw2_e) : dw2acc.data();
      for (int64_t r0 = start; r0 < end; r0 += kRows) {
        const bool more = r0 != start;  // accumulate after the expert's first block
        const int64_t rb = std::min(kRows, end - r0), rb2 = moe_lab_cpu::round_even(rb);
        moe_lab_cpu::gemm(rb, f, d_out, DY + r0 * ldy, ldy, w2t.data(), f, daf.data(), f, false);  // da
        for (int64_t r = 0; r < rb; ++r) {  // dh = [d gate, d up] and a, from h and da (float32)
          swiglu_grad_block_row(H + (r0 + r) * two_f, daf.data() + r * f, dh.data() + r * two_f,
                                act.data() + r * f, f, buf.data());
        }
        moe_lab_cpu::gemm(rb, d, two_f, dh.data(), two_f, w1t.data(), d, dxf.data(), d, false);  // dx
        moe_lab_cpu::to_bf16(dxf.data(), DX + r0 * d, rb * d);
        // dW2 += aᵀ dy and dW1 += xᵀ dh: A transposed into tb ([cols, rb2], a zero column when rb is odd)
        moe_lab_cpu::transpose_bf16(act.data(), rb, f, f, tb.data(), rb2);
        if (rb2 != rb) for (int64_t j = 0; j < f; ++j) tb[j * rb2 + rb] = bf16(0.f);
        moe_lab_cpu::pack_pairs(DY + r0 * ldy, rb, d_out, ldy, pairs.data());
        moe_lab_cpu::gemm(f, d_out, rb2, tb.data(), rb2, pairs.data(), d_out, acc2, d_out, more);
        moe_lab_cpu::transpose_bf16(X + r0 * ldx, rb, d, ldx, tb.data(), rb2);
        if (rb2 != rb) for (int64_t j = 0; j < d; ++j) tb[j * rb2 + rb] = bf16(0.f);
        moe_lab_cpu::pack_pairs(dh.data(), rb, two_f, two_f, pairs.data());
        moe_lab_cpu::gemm(d, two_f, rb2, tb.data(), rb2, pairs.data(), two_f, acc1, two_f, more);
      }
      if constexpr (!fp32_weights) {  // rounded once
        store(acc1, dw1_e, d * two_f);
        store(acc2, dw2_e, f * d_out);
      }
    }
    at::native::cpublas::brgemm_release(true);
  }
  return {dx, dw1, dw2};
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
  check_dtypes(x, w1, w2, "expert_mlp");
  const auto ends = row_ends(offs, n_groups, m, "expert_mlp");
  if (bf16_blocks(x, w1, w2)) {
    return w1.scalar_type() == at::kFloat ? expert_mlp_bf16<float>(x, w1, w2, ends)
                                          : expert_mlp_bf16<bf16>(x, w1, w2, ends);
  }
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
    at::mm_out(y_e, expert_swiglu(h_e, f), w2.select(0, e));
  }
  return {y, h};
}

// Backward of expert_mlp, again one expert per core: {dx, dw1, dw2}. The activation
// a = silu(gate) * up is recomputed from h per expert (cache-hot) rather than kept from the
// forward — in the same pass over h as the SwiGLU gradient, where the vectorised path runs.
std::vector<at::Tensor> expert_mlp_backward(const at::Tensor& x, const at::Tensor& h_in, const at::Tensor& w1,
                                            const at::Tensor& w2, const at::Tensor& offs,
                                            const at::Tensor& dy) {
  const at::Tensor h = h_in.contiguous();  // the row loops read h row by row
  const int64_t n_groups = w1.size(0), m = x.size(0), f = w1.size(2) / 2;
  TORCH_CHECK(h.dim() == 2 && h.size(0) == m && h.size(1) == 2 * f && dy.size(0) == m && dy.size(1) == w2.size(2),
              "expert_mlp_backward: shapes do not match: x ", x.sizes(), ", h ", h.sizes(), ", dy ",
              dy.sizes(), ", w2 ", w2.sizes());
  TORCH_CHECK(dy.scalar_type() == x.scalar_type(), "expert_mlp_backward: dy must have x's dtype ",
              x.scalar_type(), ", got ", dy.scalar_type());
  check_dtypes(x, w1, w2, "expert_mlp_backward");
  const auto ends = row_ends(offs, n_groups, m, "expert_mlp_backward");
  if (bf16_blocks(x, w1, w2)) {
    return w1.scalar_type() == at::kFloat ? expert_mlp_backward_bf16<float>(x, h, w1, w2, ends, dy)
                                          : expert_mlp_backward_bf16<bf16>(x, h, w1, w2, ends, dy);
  }
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
    const at::Tensor da = at::mm(dy_e, w2.select(0, e).t());      // da = dy · W2ᵀ
    at::Tensor dh = at::empty({end - start, 2 * f}, x.options());
    if (vectorised_swiglu(x.scalar_type())) {  // d gate = da · up · silu'(gate), d up = da · silu(gate)
      at::Tensor a = at::empty({end - start, f}, x.options());
      AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "expert_swiglu_grad",
                                      [&] { swiglu_grad_rows<scalar_t>(h_e, da, dh, a, f); });
      at::mm_out(dw2_e, a.t(), dy_e);                              // dW2 = aᵀ · dy (a recomputed)
    } else {
      at::mm_out(dw2_e, expert_swiglu(h_e, f).t(), dy_e);
      const at::Tensor g = widen(h_e.narrow(1, 0, f)), u = widen(h_e.narrow(1, f, f)), d = widen(da);
      dh.narrow(1, f, f).copy_(d * at::silu(g));
      dh.narrow(1, 0, f).copy_(at::silu_backward(d * u, g));
    }
    at::mm_out(dw1_e, x_e.t(), dh);                        // dW1 = xᵀ · dh
    at::Tensor dx_e = dx.slice(0, start, end);
    at::mm_out(dx_e, dh, w1.select(0, e).t());             // dx = dh · W1ᵀ
  }
  return {dx, dw1, dw2};
}
