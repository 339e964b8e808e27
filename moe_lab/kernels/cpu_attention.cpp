// moe_lab's fused causal attention for the CPU, forward and backward, in float32.
//
// PyTorch's CPU flash attention splits every head into query blocks and calls a BLAS GEMM
// per block pair; at a small head dimension (32) and short sequences (128) each of those
// calls is a few microseconds of real work, and the per-call cost and the passes over
// memory between them dominate. Here one core takes a whole (batch, head) at a time and
// does everything for it while it sits in that core's cache:
//
//   forward, per block of kBlockQ query rows:  S = Q Kᵀ over the keys the block may see
//   (causal: blocks above the diagonal are never computed), softmax row by row (max, exp,
//   sum, normalise; the log-sum-exp kept for the backward), O = P V;
//   backward, per block: P recomputed from the log-sum-exp, dP = dO Vᵀ,
//   dS = P ∘ (dP − rowsum(dO ∘ O)), dQ = dS K, dK += dSᵀ Q, dV += Pᵀ dO.
//
// The small GEMMs run through ATen's batch-reduce GEMM micro-kernel (oneDNN's brgemm, which
// has almost no per-call cost) on that core; the elementwise passes use ATen's vector types
// (compiled for this CPU's vector width, see moe_lab/kernels/cpu_ext.py) and the exp ATen's
// own CPU flash attention uses. Masked scores inside a diagonal block are computed by the
// block's GEMM but never read: their probabilities and score gradients are set to zero, not
// multiplied by zero, so a NaN in a key a query may not see does not reach that query.
//
// Float32 inputs compute in float32. Bfloat16 inputs run the same blocks with bfloat16 GEMMs
// (float32 accumulation, where ATen's brgemm has them for this CPU): the softmax and its
// gradient stay in float32, P and dS are rounded to bfloat16 for the products that take them,
// dK and dV accumulate in float32 over the blocks. The bf16 forward rounds P unnormalised
// (exp(s − max), in the same pass as the exp) and scales P V's [rows, D] output by 1/sum
// instead of the [rows, keys] P, as a flash attention does: one pass over the scores fewer.
// Those GEMMs read B in pairs (rows 2p and 2p + 1 of the reduction dimension interleaved), so
// each head's Kᵀ, Vᵀ, K and V are repacked once, and each block's dO and Q; a reduction of
// odd length is padded with a zero row.

#include <torch/extension.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/native/CPUBlas.h>

#include "cpu_bf16.h"

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace {

using moe_lab_cpu::bf16;
using moe_lab_cpu::bf16_gemm_works;
using moe_lab_cpu::gemm;
using moe_lab_cpu::pack_pairs;
using moe_lab_cpu::pack_transposed;
using moe_lab_cpu::round_even;
using moe_lab_cpu::transpose;
using moe_lab_cpu::transpose_bf16;

constexpr int64_t kBlockQ = 32;

using Vec = at::vec::Vectorized<float>;
constexpr float kInf = std::numeric_limits<float>::infinity();

// exp of every lane: ATen's exp_u20 (the one its own CPU flash attention uses; about 20 ulp,
// 0 below ln(FLT_MIN)), with NaN kept NaN.
inline Vec vexp(const Vec& x) { return Vec::blendv(x.exp_u20(), x, x.isnan()); }

inline float max_nan(float a, float b) { return (std::isnan(a) || a > b) ? a : b; }

inline float lanes_sum(const Vec& v) {
  alignas(64) float lane[Vec::size()];
  v.store(lane);
  float sum = 0.f;
  for (int64_t l = 0; l < Vec::size(); ++l) sum += lane[l];
  return sum;
}

inline float lanes_max(const Vec& v) {
  alignas(64) float lane[Vec::size()];
  v.store(lane);
  float mx = -kInf;
  for (int64_t l = 0; l < Vec::size(); ++l) mx = max_nan(lane[l], mx);
  return mx;
}

// Every row loop below runs whole vectors and then one partial vector for the last n mod W
// lanes (masked loads and stores), so a row's tail is vectorised too: rows here are the keys
// a query sees, i + 1 of them, rarely a multiple of the vector width.

// row[0:n) *= scale, in place; returns the largest (NaN if any is NaN).
inline float scale_and_max(float* row, int64_t n, float scale) {
  const int64_t W = Vec::size();
  Vec vmax(-kInf);
  const Vec vs(scale);
  int64_t j = 0;
  for (; j + W <= n; j += W) {
    const Vec v = Vec::loadu(row + j) * vs;
    v.store(row + j);
    vmax = at::vec::maximum(vmax, v);
  }
  if (j < n) {
    const Vec v = Vec::loadu(row + j, n - j) * vs;
    v.store(row + j, n - j);
    vmax = at::vec::maximum(vmax, Vec::set(Vec(-kInf), v, n - j));
  }
  return lanes_max(vmax);
}

// row[0:n) = exp(row - shift), in place; returns their sum.
inline float exp_and_sum(float* row, int64_t n, float shift) {
  const Vec vshift(shift);
  Vec vsum(0.f);
  int64_t j = 0;
  for (; j + Vec::size() <= n; j += Vec::size()) {
    const Vec e = vexp(Vec::loadu(row + j) - vshift);
    e.store(row + j);
    vsum = vsum + e;
  }
  if (j < n) {
    const Vec e = vexp(Vec::loadu(row + j, n - j) - vshift);
    e.store(row + j, n - j);
    vsum = vsum + Vec::set(Vec(0.f), e, n - j);
  }
  return lanes_sum(vsum);
}

// max(row[0:n) · scale), NaN if any is NaN; the row is only read. For scale > 0 this is the
// largest of the scaled values exactly (rounding is monotone), without storing them.
inline float max_scaled(const float* row, int64_t n, float scale) {
  const int64_t W = Vec::size();
  Vec vmax(-kInf);
  int64_t j = 0;
  for (; j + W <= n; j += W) vmax = at::vec::maximum(vmax, Vec::loadu(row + j));
  if (j < n) vmax = at::vec::maximum(vmax, Vec::set(Vec(-kInf), Vec::loadu(row + j, n - j), n - j));
  return lanes_max(vmax * Vec(scale));
}

// v's first n lanes stored at p: float32 as they are, bfloat16 rounded to nearest even.
inline void store_lanes(const Vec& v, float* p, int64_t n) {
  if (n == Vec::size()) {
    v.store(p);
  } else {
    v.store(p, n);
  }
}

inline void store_lanes(const Vec& v, bf16* p, int64_t n) {
#ifdef MOE_LAB_NATIVE_BF16
  moe_lab_cpu::store_bf16(moe_lab_cpu::bf16_bits(v), p, n);
#else
  alignas(64) float lane[Vec::size()];
  v.store(lane);
  at::vec::convert(lane, p, n);
#endif
}

// out[0:n) = exp(row[0:n) · scale − shift) in out's dtype (one rounding); returns the sum of
// the unrounded values. One pass: the forward's P before its normalisation, which is applied
// to the [rows, D] output of P V instead of the [rows, keys] P (as a flash attention does).
template <typename T>
inline float exp_sum_to(const float* row, int64_t n, float scale, float shift, T* out) {
  const Vec vs(scale), vshift(shift);
  Vec vsum(0.f);
  for (int64_t j = 0; j < n; j += Vec::size()) {
    const int64_t w = std::min<int64_t>(Vec::size(), n - j);
    const bool full = w == Vec::size();
    const Vec e = vexp((full ? Vec::loadu(row + j) : Vec::loadu(row + j, w)) * vs - vshift);
    store_lanes(e, out + j, w);
    vsum = vsum + (full ? e : Vec::set(Vec(0.f), e, w));
  }
  return lanes_sum(vsum);
}

// out[0:n) = row[0:n) · a, in out's dtype (out may be row itself).
template <typename T>
inline void scale_row_to(const float* row, int64_t n, float a, T* out) {
  const Vec va(a);
  for (int64_t j = 0; j < n; j += Vec::size()) {
    const int64_t w = std::min<int64_t>(Vec::size(), n - j);
    store_lanes((w == Vec::size() ? Vec::loadu(row + j) : Vec::loadu(row + j, w)) * va, out + j, w);
  }
}

// The backward's row over [0, n): p = exp(s·scale − lse) and ds = p·(dp − delta)·scale, in
// the outputs' dtype (float32 outputs may be s and dp themselves).
template <typename T>
inline void grad_row(const float* s, const float* dp, T* p_out, T* ds_out, int64_t n, float scale, float lse,
                     float delta) {
  const Vec vscale(scale), vlse(lse), vdelta(delta);
  for (int64_t j = 0; j < n; j += Vec::size()) {
    const int64_t w = std::min<int64_t>(Vec::size(), n - j);
    const bool full = w == Vec::size();
    const Vec p = vexp((full ? Vec::loadu(s + j) : Vec::loadu(s + j, w)) * vscale - vlse);
    const Vec ds = p * ((full ? Vec::loadu(dp + j) : Vec::loadu(dp + j, w)) - vdelta) * vscale;
    store_lanes(p, p_out + j, w);
    store_lanes(ds, ds_out + j, w);
  }
}

inline float dot(const float* a, const float* b, int64_t n) {
  Vec acc(0.f);
  int64_t j = 0;
  for (; j + Vec::size() <= n; j += Vec::size()) acc = at::vec::fmadd(Vec::loadu(a + j), Vec::loadu(b + j), acc);
  float sum = lanes_sum(acc);
  for (; j < n; ++j) sum += a[j] * b[j];
  return sum;
}

void check_qkv(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const char* who) {
  for (const at::Tensor* t : {&q, &k, &v}) {
    TORCH_CHECK(t->device().is_cpu(), who, ": tensors must be on the CPU, got ", t->device());
    TORCH_CHECK(t->scalar_type() == q.scalar_type() &&
                    (q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16),
                who, ": q, k and v must all be float32 or all bfloat16, got ", q.scalar_type(), ", ",
                k.scalar_type(), " and ", v.scalar_type());
    TORCH_CHECK(t->dim() == 4, who, ": tensors must be [batch, heads, seq, head_dim], got ",
                t->sizes());
  }
  TORCH_CHECK(k.sizes() == v.sizes(), who, ": k and v must have the same shape, got ", k.sizes(),
              " and ", v.sizes());
  TORCH_CHECK(q.size(0) == k.size(0) && q.size(1) == k.size(1) && q.size(3) == k.size(3), who,
              ": q ", q.sizes(), " and k ", k.sizes(), " must agree in batch, heads and head_dim "
              "(expand grouped k/v heads first)");
  TORCH_CHECK(q.size(3) > 0, who, ": head_dim must be > 0 (the scores are scaled by 1/sqrt(head_dim))");
  TORCH_CHECK(q.scalar_type() == at::kFloat || q.size(3) % 2 == 0, who,
              ": bfloat16 needs an even head_dim (the GEMMs take pairs along it), got ", q.size(3));
  TORCH_CHECK(q.size(2) <= k.size(2), who, ": causal attention needs at most as many queries as "
              "keys (query i sees keys up to i + keys - queries), got ", q.size(2), " queries and ",
              k.size(2), " keys");
}

// A [B, H, S, D] tensor whose rows of D are contiguous and do not overlap (any strides above),
// as ATen may hand over a transposed view; anything else is made contiguous.
at::Tensor rows_contiguous(const at::Tensor& t) {
  return (t.stride(3) == 1 && t.stride(2) >= t.size(3)) ? t : t.contiguous();
}

struct Heads {
  const float* base;
  int64_t sb, sh, ss;  // strides of batch, head, seq (in elements)
  explicit Heads(const at::Tensor& t)
      : base(t.data_ptr<float>()), sb(t.stride(0)), sh(t.stride(1)), ss(t.stride(2)) {}
  const float* at(int64_t b, int64_t h) const { return base + b * sb + h * sh; }
};

struct BfHeads {
  const at::BFloat16* base;
  int64_t sb, sh, ss;
  explicit BfHeads(const at::Tensor& t)
      : base(t.data_ptr<at::BFloat16>()), sb(t.stride(0)), sh(t.stride(1)), ss(t.stride(2)) {}
  const at::BFloat16* at(int64_t b, int64_t h) const { return base + b * sb + h * sh; }
};

// bfloat16 tensors whose rows are contiguous and every stride, like the data, sits on a
// 32-bit boundary (pack_transposed reads pairs as words); anything else is copied first.
at::Tensor rows_paired(const at::Tensor& t) {
  const bool ok = t.stride(3) == 1 && t.stride(2) >= t.size(3) && t.stride(2) % 2 == 0 &&
                  t.stride(1) % 2 == 0 && t.stride(0) % 2 == 0 &&
                  reinterpret_cast<uintptr_t>(t.data_ptr()) % 4 == 0;
  return ok ? t : t.clone(at::MemoryFormat::Contiguous);
}


// bfloat16 forward: the GEMMs take bfloat16 operands and accumulate in float32, the softmax
// runs in float32 and P is rounded to bfloat16 for P V (as a GPU flash attention does).
std::vector<at::Tensor> forward_bf16(const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in) {
  const at::Tensor q = rows_paired(q_in), k = rows_paired(k_in), v = rows_contiguous(v_in);
  const int64_t B = q.size(0), H = q.size(1), Sq = q.size(2), Sk = k.size(2), D = q.size(3);
  at::Tensor out = at::empty({B, H, Sq, D}, q.options());
  at::Tensor lse = at::empty({B, H, Sq}, q.options().dtype(at::kFloat));
  if (out.numel() == 0) return {out, lse};
  const auto Q = BfHeads(q), K = BfHeads(k), V = BfHeads(v);
  bf16* O = out.data_ptr<bf16>();
  float* L = lse.data_ptr<float>();
  const int64_t offset = Sk - Sq;
  const float scale = 1.f / std::sqrt(static_cast<float>(D));

#pragma omp parallel
  {
    std::vector<bf16> kt(D * Sk), vp(round_even(Sk) * D), pb(kBlockQ * round_even(Sk));
    std::vector<float> s(kBlockQ * Sk), o(kBlockQ * D), inv_sum(kBlockQ);
#pragma omp for schedule(static)
    for (int64_t bh = 0; bh < B * H; ++bh) {
      const int64_t b = bh / H, h = bh % H;
      const bf16 *qp = Q.at(b, h), *kp = K.at(b, h), *vptr = V.at(b, h);
      bf16* op = O + bh * Sq * D;
      float* lp = L + bh * Sq;
      pack_transposed(kp, Sk, D, K.ss, kt.data());
      pack_pairs(vptr, Sk, D, V.ss, vp.data());
      for (int64_t i0 = 0; i0 < Sq; i0 += kBlockQ) {
        const int64_t m = std::min(kBlockQ, Sq - i0);
        const int64_t n = std::min(Sk, i0 + m + offset), n2 = round_even(n);
        gemm(m, n, D, qp + i0 * Q.ss, Q.ss, kt.data(), Sk, s.data(), n, false);
        for (int64_t r = 0; r < m; ++r) {
          const float* row = s.data() + r * n;
          const int64_t seen = i0 + r + offset + 1;
          const float mx = max_scaled(row, seen, scale);
          bf16* prow = pb.data() + r * n2;
          const float sum = exp_sum_to(row, seen, scale, mx, prow);  // e = exp(s·scale − max), bf16
          std::fill(prow + seen, prow + n2, bf16(0.f));
          inv_sum[r] = 1.f / sum;
          lp[i0 + r] = mx + std::log(sum);
        }
        gemm(m, D, n2, pb.data(), n2, vp.data(), D, o.data(), D, false);  // (Σ e v), unnormalised
        for (int64_t r = 0; r < m; ++r) scale_row_to(o.data() + r * D, D, inv_sum[r], op + (i0 + r) * D);
      }
    }
    at::native::cpublas::brgemm_release(true);
  }
  return {out, lse};
}

// bfloat16 backward: every GEMM in bfloat16 with float32 accumulation, P and dS rounded to
// bfloat16 for the products that take them; dK and dV accumulate in float32 over the blocks.
std::vector<at::Tensor> backward_bf16(const at::Tensor& dout_in, const at::Tensor& q_in, const at::Tensor& k_in,
                                      const at::Tensor& v_in, const at::Tensor& out_in, const at::Tensor& lse_in) {
  const at::Tensor q = rows_contiguous(q_in), k = rows_paired(k_in), v = rows_paired(v_in);
  const at::Tensor dout = rows_contiguous(dout_in), out = rows_contiguous(out_in);
  const at::Tensor lse = lse_in.contiguous();
  const int64_t B = q.size(0), H = q.size(1), Sq = q.size(2), Sk = k.size(2), D = q.size(3);
  at::Tensor dq = at::empty({B, H, Sq, D}, q.options());
  at::Tensor dk = at::empty({B, H, Sk, D}, q.options());
  at::Tensor dv = at::empty({B, H, Sk, D}, q.options());
  if (dq.numel() == 0 || dk.numel() == 0) {
    dq.zero_();
    dk.zero_();
    dv.zero_();
    return {dq, dk, dv};
  }
  const auto Q = BfHeads(q), K = BfHeads(k), V = BfHeads(v), dO = BfHeads(dout), O = BfHeads(out);
  const float* L = lse.data_ptr<float>();
  bf16 *dQ = dq.data_ptr<bf16>(), *dK = dk.data_ptr<bf16>(), *dV = dv.data_ptr<bf16>();
  const int64_t offset = Sk - Sq;
  const float scale = 1.f / std::sqrt(static_cast<float>(D));
  const int64_t m2max = round_even(kBlockQ), sk2 = round_even(Sk);

#pragma omp parallel
  {
    std::vector<bf16> kt(D * Sk), vt(D * Sk), kr(sk2 * D), pb(kBlockQ * sk2), dsb(kBlockQ * sk2),
        tb(Sk * m2max), pairs(m2max * D);
    std::vector<float> p(kBlockQ * Sk), dp(kBlockQ * Sk), dk_acc(Sk * D), dv_acc(Sk * D), dq_blk(kBlockQ * D),
        delta(kBlockQ), g_row(D), o_row(D);
#pragma omp for schedule(static)
    for (int64_t bh = 0; bh < B * H; ++bh) {
      const int64_t b = bh / H, h = bh % H;
      const bf16 *qp = Q.at(b, h), *kp = K.at(b, h), *vptr = V.at(b, h), *gp = dO.at(b, h), *op = O.at(b, h);
      const float* lp = L + bh * Sq;
      pack_transposed(kp, Sk, D, K.ss, kt.data());
      pack_transposed(vptr, Sk, D, V.ss, vt.data());
      pack_pairs(kp, Sk, D, K.ss, kr.data());
      std::fill(dk_acc.begin(), dk_acc.end(), 0.f);
      std::fill(dv_acc.begin(), dv_acc.end(), 0.f);
      for (int64_t i0 = 0; i0 < Sq; i0 += kBlockQ) {
        const int64_t m = std::min(kBlockQ, Sq - i0), m2 = round_even(m);
        const int64_t n = std::min(Sk, i0 + m + offset), n2 = round_even(n);
        const bf16* qb = qp + i0 * Q.ss;
        const bf16* gb = gp + i0 * dO.ss;
        for (int64_t r = 0; r < m; ++r) {
          at::vec::convert(gb + r * dO.ss, g_row.data(), D);
          at::vec::convert(op + (i0 + r) * O.ss, o_row.data(), D);
          delta[r] = dot(g_row.data(), o_row.data(), D);
        }
        gemm(m, n, D, qb, Q.ss, kt.data(), Sk, p.data(), n, false);   // S
        gemm(m, n, D, gb, dO.ss, vt.data(), Sk, dp.data(), n, false);  // dP
        for (int64_t r = 0; r < m; ++r) {
          float *prow = p.data() + r * n, *dsrow = dp.data() + r * n;
          const int64_t seen = i0 + r + offset + 1;
          bf16 *pbrow = pb.data() + r * n2, *dsbrow = dsb.data() + r * n2;
          grad_row(prow, dsrow, pbrow, dsbrow, seen, scale, lp[i0 + r], delta[r]);
          std::fill(pbrow + seen, pbrow + n2, bf16(0.f));
          std::fill(dsbrow + seen, dsbrow + n2, bf16(0.f));
        }
        gemm(m, D, n2, dsb.data(), n2, kr.data(), D, dq_blk.data(), D, false);  // dQ = dS K
        moe_lab_cpu::to_bf16(dq_blk.data(), dQ + bh * Sq * D + i0 * D, m * D);
        // dV += Pᵀ dO and dK += dSᵀ Q: Aᵀ is [n, m2] with a zero column when m is odd
        transpose_bf16(pb.data(), m, n, n2, tb.data(), m2);
        if (m2 != m) for (int64_t j = 0; j < n; ++j) tb[j * m2 + m] = bf16(0.f);
        pack_pairs(gb, m, D, dO.ss, pairs.data());
        gemm(n, D, m2, tb.data(), m2, pairs.data(), D, dv_acc.data(), D, true);
        transpose_bf16(dsb.data(), m, n, n2, tb.data(), m2);
        if (m2 != m) for (int64_t j = 0; j < n; ++j) tb[j * m2 + m] = bf16(0.f);
        pack_pairs(qb, m, D, Q.ss, pairs.data());
        gemm(n, D, m2, tb.data(), m2, pairs.data(), D, dk_acc.data(), D, true);
      }
      moe_lab_cpu::to_bf16(dk_acc.data(), dK + bh * Sk * D, Sk * D);
      moe_lab_cpu::to_bf16(dv_acc.data(), dV + bh * Sk * D, Sk * D);
    }
    at::native::cpublas::brgemm_release(true);
  }
  return {dq, dk, dv};
}

}  // namespace

// Returns (out [B, H, Sq, D] contiguous, lse [B, H, Sq] float32).
std::vector<at::Tensor> causal_attention_forward(const at::Tensor& q_in, const at::Tensor& k_in,
                                                 const at::Tensor& v_in) {
  check_qkv(q_in, k_in, v_in, "cpu causal attention");
  if (q_in.scalar_type() == at::kBFloat16) {
    if (bf16_gemm_works()) return forward_bf16(q_in, k_in, v_in);
    auto res = causal_attention_forward(q_in.to(at::kFloat), k_in.to(at::kFloat), v_in.to(at::kFloat));
    return {res[0].to(at::kBFloat16), res[1]};
  }
  const at::Tensor q = rows_contiguous(q_in), k = rows_contiguous(k_in), v = rows_contiguous(v_in);
  const int64_t B = q.size(0), H = q.size(1), Sq = q.size(2), Sk = k.size(2), D = q.size(3);
  at::Tensor out = at::empty({B, H, Sq, D}, q.options());
  at::Tensor lse = at::empty({B, H, Sq}, q.options());
  if (out.numel() == 0) return {out, lse};
  const Heads Q(q), K(k), V(v);
  float* O = out.data_ptr<float>();
  float* L = lse.data_ptr<float>();
  const int64_t offset = Sk - Sq;  // query i sees keys 0 .. i + offset
  const float scale = 1.f / std::sqrt(static_cast<float>(D));

#pragma omp parallel
  {
    std::vector<float> kt(D * Sk), s(kBlockQ * Sk);
#pragma omp for schedule(static)
    for (int64_t bh = 0; bh < B * H; ++bh) {
      const int64_t b = bh / H, h = bh % H;
      const float *qp = Q.at(b, h), *kp = K.at(b, h), *vp = V.at(b, h);
      float* op = O + bh * Sq * D;
      float* lp = L + bh * Sq;
      transpose(kp, Sk, D, K.ss, kt.data(), Sk);
      for (int64_t i0 = 0; i0 < Sq; i0 += kBlockQ) {
        const int64_t m = std::min(kBlockQ, Sq - i0);
        const int64_t n = std::min(Sk, i0 + m + offset);  // keys the block's last row sees
        gemm(m, n, D, qp + i0 * Q.ss, Q.ss, kt.data(), Sk, s.data(), n, false);
        for (int64_t r = 0; r < m; ++r) {
          float* row = s.data() + r * n;
          const int64_t seen = i0 + r + offset + 1;
          const float mx = scale_and_max(row, seen, scale);
          const float sum = exp_and_sum(row, seen, mx);
          scale_row_to(row, seen, 1.f / sum, row);
          std::fill(row + seen, row + n, 0.f);
          lp[i0 + r] = mx + std::log(sum);
        }
        gemm(m, D, n, s.data(), n, vp, V.ss, op + i0 * D, D, false);
      }
    }
    at::native::cpublas::brgemm_release(false);
  }
  return {out, lse};
}

// Returns (dq, dk, dv), each [B, H, S, D] contiguous float32.
std::vector<at::Tensor> causal_attention_backward(const at::Tensor& dout_in, const at::Tensor& q_in,
                                                  const at::Tensor& k_in, const at::Tensor& v_in,
                                                  const at::Tensor& out_in, const at::Tensor& lse_in) {
  check_qkv(q_in, k_in, v_in, "cpu causal attention backward");
  TORCH_CHECK(dout_in.sizes() == q_in.sizes() && out_in.sizes() == q_in.sizes(),
              "cpu causal attention backward: dout and out must have q's shape ", q_in.sizes(),
              ", got ", dout_in.sizes(), " and ", out_in.sizes());
  TORCH_CHECK(dout_in.scalar_type() == q_in.scalar_type() && out_in.scalar_type() == q_in.scalar_type() &&
              lse_in.scalar_type() == at::kFloat,
              "cpu causal attention backward: dout and out must have q's dtype ", q_in.scalar_type(),
              " and lse must be float32, got ", dout_in.scalar_type(), ", ", out_in.scalar_type(), " and ",
              lse_in.scalar_type());
  TORCH_CHECK(lse_in.dim() == 3 && lse_in.size(0) == q_in.size(0) && lse_in.size(1) == q_in.size(1) &&
              lse_in.size(2) == q_in.size(2),
              "cpu causal attention backward: lse must be [batch, heads, seq], got ", lse_in.sizes());
  if (q_in.scalar_type() == at::kBFloat16) {
    if (bf16_gemm_works()) return backward_bf16(dout_in, q_in, k_in, v_in, out_in, lse_in);
    const auto f = [](const at::Tensor& t) { return t.to(at::kFloat); };
    auto res = causal_attention_backward(f(dout_in), f(q_in), f(k_in), f(v_in), f(out_in), lse_in);
    return {res[0].to(at::kBFloat16), res[1].to(at::kBFloat16), res[2].to(at::kBFloat16)};
  }
  const at::Tensor q = rows_contiguous(q_in), k = rows_contiguous(k_in), v = rows_contiguous(v_in);
  const at::Tensor dout = rows_contiguous(dout_in), out = rows_contiguous(out_in);
  const at::Tensor lse = lse_in.contiguous();
  const int64_t B = q.size(0), H = q.size(1), Sq = q.size(2), Sk = k.size(2), D = q.size(3);
  at::Tensor dq = at::empty({B, H, Sq, D}, q.options());
  at::Tensor dk = at::zeros({B, H, Sk, D}, q.options());
  at::Tensor dv = at::zeros({B, H, Sk, D}, q.options());
  if (dq.numel() == 0 || dk.numel() == 0) {
    dq.zero_();
    return {dq, dk, dv};
  }
  const Heads Q(q), K(k), V(v), dO(dout), O(out);
  const float* L = lse.data_ptr<float>();
  float *dQ = dq.data_ptr<float>(), *dK = dk.data_ptr<float>(), *dV = dv.data_ptr<float>();
  const int64_t offset = Sk - Sq;
  const float scale = 1.f / std::sqrt(static_cast<float>(D));

#pragma omp parallel
  {
    std::vector<float> kt(D * Sk), vt(D * Sk), p(kBlockQ * Sk), dp(kBlockQ * Sk),
        pt(Sk * kBlockQ), delta(kBlockQ);
#pragma omp for schedule(static)
    for (int64_t bh = 0; bh < B * H; ++bh) {
      const int64_t b = bh / H, h = bh % H;
      const float *qp = Q.at(b, h), *kp = K.at(b, h), *vp = V.at(b, h), *gp = dO.at(b, h),
                  *op = O.at(b, h);
      const float* lp = L + bh * Sq;
      float *dqp = dQ + bh * Sq * D, *dkp = dK + bh * Sk * D, *dvp = dV + bh * Sk * D;
      transpose(kp, Sk, D, K.ss, kt.data(), Sk);
      transpose(vp, Sk, D, V.ss, vt.data(), Sk);
      for (int64_t i0 = 0; i0 < Sq; i0 += kBlockQ) {
        const int64_t m = std::min(kBlockQ, Sq - i0);
        const int64_t n = std::min(Sk, i0 + m + offset);
        const float* qb = qp + i0 * Q.ss;
        const float* gb = gp + i0 * dO.ss;
        for (int64_t r = 0; r < m; ++r) {
          delta[r] = dot(gb + r * dO.ss, op + (i0 + r) * O.ss, D);
        }
        gemm(m, n, D, qb, Q.ss, kt.data(), Sk, p.data(), n, false);   // S
        gemm(m, n, D, gb, dO.ss, vt.data(), Sk, dp.data(), n, false);  // dP
        for (int64_t r = 0; r < m; ++r) {
          float *prow = p.data() + r * n, *dsrow = dp.data() + r * n;
          const int64_t seen = i0 + r + offset + 1;
          grad_row(prow, dsrow, prow, dsrow, seen, scale, lp[i0 + r], delta[r]);
          std::fill(prow + seen, prow + n, 0.f);
          std::fill(dsrow + seen, dsrow + n, 0.f);
        }
        gemm(m, D, n, dp.data(), n, kp, K.ss, dqp + i0 * D, D, false);  // dQ = dS K
        transpose(p.data(), m, n, n, pt.data(), m);
        gemm(n, D, m, pt.data(), m, gb, dO.ss, dvp, D, true);  // dV += Pᵀ dO
        transpose(dp.data(), m, n, n, pt.data(), m);
        gemm(n, D, m, pt.data(), m, qb, Q.ss, dkp, D, true);  // dK += dSᵀ Q
      }
    }
    at::native::cpublas::brgemm_release(false);
  }
  return {dq, dk, dv};
}

// Whether ATen's bfloat16 GEMMs run here (else bfloat16 inputs are widened to float32).
bool bf16_gemms() { return moe_lab_cpu::bf16_gemm_works(); }
