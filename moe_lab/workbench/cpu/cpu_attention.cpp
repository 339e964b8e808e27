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
// (compiled for this CPU's vector width, see build.py) and the exp ATen's
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
//
// rope_attention_forward / _backward take the packed [B, S, 3·H·D] output of the QKV
// projection instead: each head's q and k rows are rotated (RoPE, in float32, rounded once to
// bfloat16) into the thread's scratch, v is read in place, the output is written as [B, S, H·D]
// and the gradient as the packed [B, S, 3·H·D], the rotary gradient applied to dq and dk on
// their float32 values.

#include <ATen/ATen.h>
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


// ---- bfloat16: one (batch, head) at a time ----
//
// The per-head passes below take each operand as rows of D values with a row stride (ld), so
// that [B, H, S, D] tensors and the rows of a packed [B, S, 3·H·D] QKV projection output are
// read in place. Each thread owns one scratch set, sized once per call.

struct FwdScratch {
  moe_lab_cpu::Scratch<bf16> kt, vp, pb;
  moe_lab_cpu::Scratch<float> s, o, inv_sum;
  FwdScratch(int64_t Sk, int64_t D)
      : kt(D * Sk), vp(round_even(Sk) * D), pb(kBlockQ * round_even(Sk)), s(kBlockQ * Sk), o(kBlockQ * D),
        inv_sum(kBlockQ) {}
};

// One head's forward: out rows (ld ldo) and lse[0:Sq) from Q, K and V rows (K: ld even and
// 32-bit aligned rows, as pack_transposed reads them). The GEMMs take bfloat16 operands and
// accumulate in float32, the softmax runs in float32 and P is rounded to bfloat16 for P V (as
// a GPU flash attention does).
void head_forward_bf16(const bf16* qp, int64_t ldq, const bf16* kp, int64_t ldk, const bf16* vptr, int64_t ldv,
                       int64_t Sq, int64_t Sk, int64_t D, bf16* op, int64_t ldo, float* lp, FwdScratch& w) {
  const int64_t offset = Sk - Sq;
  const float scale = 1.f / std::sqrt(static_cast<float>(D));
  pack_transposed(kp, Sk, D, ldk, w.kt.data());
  pack_pairs(vptr, Sk, D, ldv, w.vp.data());
  for (int64_t i0 = 0; i0 < Sq; i0 += kBlockQ) {
    const int64_t m = std::min(kBlockQ, Sq - i0);
    const int64_t n = std::min(Sk, i0 + m + offset), n2 = round_even(n);
    gemm(m, n, D, qp + i0 * ldq, ldq, w.kt.data(), Sk, w.s.data(), n, false);
    for (int64_t r = 0; r < m; ++r) {
      const float* row = w.s.data() + r * n;
      const int64_t seen = i0 + r + offset + 1;
      const float mx = max_scaled(row, seen, scale);
      bf16* prow = w.pb.data() + r * n2;
      const float sum = exp_sum_to(row, seen, scale, mx, prow);  // e = exp(s·scale − max), bf16
      std::fill(prow + seen, prow + n2, bf16(0.f));
      w.inv_sum[r] = 1.f / sum;
      lp[i0 + r] = mx + std::log(sum);
    }
    gemm(m, D, n2, w.pb.data(), n2, w.vp.data(), D, w.o.data(), D, false);  // (Σ e v), unnormalised
    for (int64_t r = 0; r < m; ++r) scale_row_to(w.o.data() + r * D, D, w.inv_sum[r], op + (i0 + r) * ldo);
  }
}

struct BwdScratch {
  moe_lab_cpu::Scratch<bf16> kt, vt, kr, pb, dsb, tb, pairs;
  moe_lab_cpu::Scratch<float> p, dp, delta, g_row, o_row;
  BwdScratch(int64_t Sk, int64_t D)
      : kt(D * Sk), vt(D * Sk), kr(round_even(Sk) * D), pb(kBlockQ * round_even(Sk)),
        dsb(kBlockQ * round_even(Sk)), tb(Sk * round_even(kBlockQ)), pairs(round_even(kBlockQ) * D),
        p(kBlockQ * Sk), dp(kBlockQ * Sk), delta(kBlockQ), g_row(D), o_row(D) {}
};

// One head's backward into float32: dq_acc [Sq, D] (every row written), dk_acc and dv_acc
// [Sk, D] (overwritten). Every GEMM in bfloat16 with float32 accumulation, P and dS rounded
// to bfloat16 for the products that take them; dK and dV accumulate over the query blocks.
// K and V rows: ld even and 32-bit aligned (pack_transposed).
void head_backward_bf16(const bf16* qp, int64_t ldq, const bf16* kp, int64_t ldk, const bf16* vptr, int64_t ldv,
                        const bf16* gp, int64_t ldg, const bf16* op, int64_t ldo, const float* lp, int64_t Sq,
                        int64_t Sk, int64_t D, float* dq_acc, float* dk_acc, float* dv_acc, BwdScratch& w) {
  const int64_t offset = Sk - Sq;
  const float scale = 1.f / std::sqrt(static_cast<float>(D));
  pack_transposed(kp, Sk, D, ldk, w.kt.data());
  pack_transposed(vptr, Sk, D, ldv, w.vt.data());
  pack_pairs(kp, Sk, D, ldk, w.kr.data());
  std::fill(dk_acc, dk_acc + Sk * D, 0.f);
  std::fill(dv_acc, dv_acc + Sk * D, 0.f);
  for (int64_t i0 = 0; i0 < Sq; i0 += kBlockQ) {
    const int64_t m = std::min(kBlockQ, Sq - i0), m2 = round_even(m);
    const int64_t n = std::min(Sk, i0 + m + offset), n2 = round_even(n);
    const bf16* qb = qp + i0 * ldq;
    const bf16* gb = gp + i0 * ldg;
    for (int64_t r = 0; r < m; ++r) {
      at::vec::convert(gb + r * ldg, w.g_row.data(), D);
      at::vec::convert(op + (i0 + r) * ldo, w.o_row.data(), D);
      w.delta[r] = dot(w.g_row.data(), w.o_row.data(), D);
    }
    gemm(m, n, D, qb, ldq, w.kt.data(), Sk, w.p.data(), n, false);   // S
    gemm(m, n, D, gb, ldg, w.vt.data(), Sk, w.dp.data(), n, false);  // dP
    for (int64_t r = 0; r < m; ++r) {
      float *prow = w.p.data() + r * n, *dsrow = w.dp.data() + r * n;
      const int64_t seen = i0 + r + offset + 1;
      bf16 *pbrow = w.pb.data() + r * n2, *dsbrow = w.dsb.data() + r * n2;
      grad_row(prow, dsrow, pbrow, dsbrow, seen, scale, lp[i0 + r], w.delta[r]);
      std::fill(pbrow + seen, pbrow + n2, bf16(0.f));
      std::fill(dsbrow + seen, dsbrow + n2, bf16(0.f));
    }
    gemm(m, D, n2, w.dsb.data(), n2, w.kr.data(), D, dq_acc + i0 * D, D, false);  // dQ = dS K
    // dV += Pᵀ dO and dK += dSᵀ Q: Aᵀ is [n, m2] with a zero column when m is odd
    transpose_bf16(w.pb.data(), m, n, n2, w.tb.data(), m2);
    if (m2 != m) for (int64_t j = 0; j < n; ++j) w.tb[j * m2 + m] = bf16(0.f);
    pack_pairs(gb, m, D, ldg, w.pairs.data());
    gemm(n, D, m2, w.tb.data(), m2, w.pairs.data(), D, dv_acc, D, true);
    transpose_bf16(w.dsb.data(), m, n, n2, w.tb.data(), m2);
    if (m2 != m) for (int64_t j = 0; j < n; ++j) w.tb[j * m2 + m] = bf16(0.f);
    pack_pairs(qb, m, D, ldq, w.pairs.data());
    gemm(n, D, m2, w.tb.data(), m2, w.pairs.data(), D, dk_acc, D, true);
  }
}

// bfloat16 forward over [B, H, S, D] tensors.
std::vector<at::Tensor> forward_bf16(const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in) {
  const at::Tensor q = rows_paired(q_in), k = rows_paired(k_in), v = rows_contiguous(v_in);
  const int64_t B = q.size(0), H = q.size(1), Sq = q.size(2), Sk = k.size(2), D = q.size(3);
  at::Tensor out = at::empty({B, H, Sq, D}, q.options());
  at::Tensor lse = at::empty({B, H, Sq}, q.options().dtype(at::kFloat));
  if (out.numel() == 0) return {out, lse};
  const auto Q = BfHeads(q), K = BfHeads(k), V = BfHeads(v);
  bf16* O = out.data_ptr<bf16>();
  float* L = lse.data_ptr<float>();
#pragma omp parallel
  {
    FwdScratch w(Sk, D);
#pragma omp for schedule(static)
    for (int64_t bh = 0; bh < B * H; ++bh) {
      const int64_t b = bh / H, h = bh % H;
      head_forward_bf16(Q.at(b, h), Q.ss, K.at(b, h), K.ss, V.at(b, h), V.ss, Sq, Sk, D, O + bh * Sq * D, D,
                        L + bh * Sq, w);
    }
    at::native::cpublas::brgemm_release(true);
  }
  return {out, lse};
}

// bfloat16 backward over [B, H, S, D] tensors.
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
#pragma omp parallel
  {
    BwdScratch w(Sk, D);
    moe_lab_cpu::Scratch<float> dq_acc(Sq * D), dk_acc(Sk * D), dv_acc(Sk * D);
#pragma omp for schedule(static)
    for (int64_t bh = 0; bh < B * H; ++bh) {
      const int64_t b = bh / H, h = bh % H;
      head_backward_bf16(Q.at(b, h), Q.ss, K.at(b, h), K.ss, V.at(b, h), V.ss, dO.at(b, h), dO.ss, O.at(b, h), O.ss,
                         L + bh * Sq, Sq, Sk, D, dq_acc.data(), dk_acc.data(), dv_acc.data(), w);
      moe_lab_cpu::to_bf16(dq_acc.data(), dQ + bh * Sq * D, Sq * D);
      moe_lab_cpu::to_bf16(dk_acc.data(), dK + bh * Sk * D, Sk * D);
      moe_lab_cpu::to_bf16(dv_acc.data(), dV + bh * Sk * D, Sk * D);
    }
    at::native::cpublas::brgemm_release(true);
  }
  return {dq, dk, dv};
}

// ---- rotary embeddings fused in: the packed QKV projection output in, its gradient out ----
//
// RoPE "rotate half" on a row x of D = 2·half values, in float32 from bfloat16 and rounded
// once (what moe_lab.model.apply_rope computes): y[j] = x[j]·c[j] − x[j+half]·s[j],
// y[j+half] = x[j]·s[j] + x[j+half]·c[j]. Both products are rounded to float32 before the
// sum, as eager PyTorch and Inductor compute them: left alone, the compiler fuses one of them
// into a multiply-add (GCC contracts by default), which rounds once fewer and now and then
// moves a bfloat16 bit. With AVX-512 the products are multiplies with an explicit rounding
// mode, which the compiler never fuses; elsewhere they pass through memory.
#ifdef MOE_LAB_NATIVE_BF16
inline __m512 mul_rn(__m512 a, __m512 b) { return _mm512_mul_round_ps(a, b, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }

inline void rope_row(const bf16* x, const float* c, const float* s, int64_t half, bf16* y, float*) {
  for (int64_t j = 0; j < half; j += 16) {
    const int64_t w = std::min<int64_t>(16, half - j);
    const __m512 x1 = moe_lab_cpu::load_bf16(x + j, w), x2 = moe_lab_cpu::load_bf16(x + half + j, w);
    const __m512 cv = moe_lab_cpu::load_f32(c + j, w), sv = moe_lab_cpu::load_f32(s + j, w);
    moe_lab_cpu::store_bf16(moe_lab_cpu::bf16_bits(_mm512_sub_ps(mul_rn(x1, cv), mul_rn(x2, sv))), y + j, w);
    moe_lab_cpu::store_bf16(moe_lab_cpu::bf16_bits(_mm512_add_ps(mul_rn(x1, sv), mul_rn(x2, cv))), y + half + j, w);
  }
}

// The gradient through rope_row, float32 in, bfloat16 out:
// dx[j] = dy[j]·c[j] + dy[j+half]·s[j], dx[j+half] = dy[j+half]·c[j] − dy[j]·s[j].
inline void rope_grad_row(const float* dy, const float* c, const float* s, int64_t half, bf16* dx) {
  for (int64_t j = 0; j < half; j += 16) {
    const int64_t w = std::min<int64_t>(16, half - j);
    const __m512 d1 = moe_lab_cpu::load_f32(dy + j, w), d2 = moe_lab_cpu::load_f32(dy + half + j, w);
    const __m512 cv = moe_lab_cpu::load_f32(c + j, w), sv = moe_lab_cpu::load_f32(s + j, w);
    moe_lab_cpu::store_bf16(moe_lab_cpu::bf16_bits(_mm512_add_ps(mul_rn(d1, cv), mul_rn(d2, sv))), dx + j, w);
    moe_lab_cpu::store_bf16(moe_lab_cpu::bf16_bits(_mm512_sub_ps(mul_rn(d2, cv), mul_rn(d1, sv))), dx + half + j, w);
  }
}
#else
inline Vec rounded(Vec v) {
  asm volatile("" : "+m"(v));  // the product leaves the register: no contraction across this
  return v;
}

inline void rope_row(const bf16* x, const float* c, const float* s, int64_t half, bf16* y, float* xf) {
  at::vec::convert(x, xf, 2 * half);
  for (int64_t j = 0; j < half; j += Vec::size()) {
    const int64_t w = std::min<int64_t>(Vec::size(), half - j);
    const Vec x1 = Vec::loadu(xf + j, w), x2 = Vec::loadu(xf + half + j, w);
    const Vec cv = Vec::loadu(c + j, w), sv = Vec::loadu(s + j, w);
    store_lanes(rounded(x1 * cv) - rounded(x2 * sv), y + j, w);
    store_lanes(rounded(x1 * sv) + rounded(x2 * cv), y + half + j, w);
  }
}

inline void rope_grad_row(const float* dy, const float* c, const float* s, int64_t half, bf16* dx) {
  for (int64_t j = 0; j < half; j += Vec::size()) {
    const int64_t w = std::min<int64_t>(Vec::size(), half - j);
    const Vec d1 = Vec::loadu(dy + j, w), d2 = Vec::loadu(dy + half + j, w);
    const Vec cv = Vec::loadu(c + j, w), sv = Vec::loadu(s + j, w);
    store_lanes(rounded(d1 * cv) + rounded(d2 * sv), dx + j, w);
    store_lanes(rounded(d2 * cv) - rounded(d1 * sv), dx + half + j, w);
  }
}
#endif

struct Packed {  // the shape of a [B, S, 3·H·D] QKV tensor: rows of 3·H·D, heads of D within
  int64_t B, S, H, D;
};

Packed check_packed(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, int64_t H, const char* who) {
  TORCH_CHECK(qkv.device().is_cpu() && cos.device().is_cpu() && sin.device().is_cpu(), who,
              ": tensors must be on the CPU");
  TORCH_CHECK(qkv.scalar_type() == at::kBFloat16 && qkv.dim() == 3, who,
              ": qkv must be a bfloat16 [batch, seq, 3 * heads * head_dim] tensor, got ", qkv.scalar_type(), " ",
              qkv.sizes());
  TORCH_CHECK(H > 0 && qkv.size(2) % (3 * H) == 0, who, ": qkv's last dimension (", qkv.size(2),
              ") must be 3 * heads * head_dim for heads = ", H);
  const int64_t D = qkv.size(2) / (3 * H);
  TORCH_CHECK(D > 0 && D % 2 == 0, who, ": head_dim must be even and > 0 (rotary halves, bfloat16 pairs), got ", D);
  for (const at::Tensor* t : {&cos, &sin}) {
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->dim() == 2 && t->size(0) >= qkv.size(1) && t->size(1) == D / 2,
                who, ": cos and sin must be float32 [>= seq, head_dim / 2] = [>= ", qkv.size(1), ", ", D / 2,
                "], got ", t->scalar_type(), " ", t->sizes());
  }
  return {qkv.size(0), qkv.size(1), H, D};
}

// Head h's q and k rows of one sequence (rows of the packed QKV from row0, row stride ss),
// rotated into qr and kr ([S, D] each): the forward and the backward both call this, so the
// backward recomputes the forward's rotated values bit for bit.
void rotate_head(const bf16* row0, int64_t ss, int64_t h, const Packed& P, const float* cos, const float* sin,
                 bf16* qr, bf16* kr, float* xf) {
  const int64_t half = P.D / 2;
  for (int64_t t = 0; t < P.S; ++t) {
    rope_row(row0 + t * ss + h * P.D, cos + t * half, sin + t * half, half, qr + t * P.D, xf);
    rope_row(row0 + t * ss + (P.H + h) * P.D, cos + t * half, sin + t * half, half, kr + t * P.D, xf);
  }
}

// Rows contiguous, row and batch strides even and the data on a 32-bit boundary (pack_transposed
// reads V's pairs as words); anything else is copied first.
at::Tensor packed_rows(const at::Tensor& t) {
  const bool ok = t.stride(2) == 1 && t.stride(1) >= t.size(2) && t.stride(1) % 2 == 0 && t.stride(0) % 2 == 0 &&
                  reinterpret_cast<uintptr_t>(t.data_ptr()) % 4 == 0;
  return ok ? t : t.clone(at::MemoryFormat::Contiguous);
}

// Without bfloat16 GEMMs (or when a test asks): the same computation from ATen ops and the
// [B, H, S, D] kernels, which widen bfloat16 to float32. q, k, v as [B, H, S, D] views of qkv.
std::vector<at::Tensor> split_heads(const at::Tensor& qkv, int64_t H, int64_t D) {
  const int64_t B = qkv.size(0), S = qkv.size(1);
  std::vector<at::Tensor> parts;
  for (int64_t i = 0; i < 3; ++i) {
    parts.push_back(qkv.narrow(2, i * H * D, H * D).view({B, S, H, D}).transpose(1, 2));
  }
  return parts;
}

// apply_rope in ATen ops: float32 math, rounded once to bfloat16.
at::Tensor rope_aten(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  const int64_t S = x.size(2), half = x.size(3) / 2;
  const at::Tensor xf = x.to(at::kFloat), c = cos.narrow(0, 0, S), s = sin.narrow(0, 0, S);
  const at::Tensor x1 = xf.narrow(3, 0, half), x2 = xf.narrow(3, half, half);
  return at::cat({x1 * c - x2 * s, x1 * s + x2 * c}, 3).to(at::kBFloat16);
}

at::Tensor rope_grad_aten(const at::Tensor& dy, const at::Tensor& cos, const at::Tensor& sin) {
  const int64_t S = dy.size(2), half = dy.size(3) / 2;
  const at::Tensor df = dy.to(at::kFloat), c = cos.narrow(0, 0, S), s = sin.narrow(0, 0, S);
  const at::Tensor d1 = df.narrow(3, 0, half), d2 = df.narrow(3, half, half);
  return at::cat({d1 * c + d2 * s, d2 * c - d1 * s}, 3).to(at::kBFloat16);
}

at::Tensor merge_heads(const at::Tensor& x) {  // [B, H, S, D] -> [B, S, H·D]
  return x.transpose(1, 2).reshape({x.size(0), x.size(2), x.size(1) * x.size(3)});
}

}  // namespace

std::vector<at::Tensor> causal_attention_forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v);
std::vector<at::Tensor> causal_attention_backward(const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k,
                                                  const at::Tensor& v, const at::Tensor& out, const at::Tensor& lse);

// Causal attention of the packed QKV projection output with RoPE applied to q and k here:
// qkv [B, S, 3·H·D] bfloat16 (q, k, v heads in that order), cos / sin [>= S, D/2] float32.
// Returns (out [B, S, H·D] bfloat16 — the heads side by side, as the output projection takes
// them — and lse [B, H, S] float32).
// ``fused`` false (for tests) or a CPU without bfloat16 GEMMs takes the ATen path above.
std::vector<at::Tensor> rope_attention_forward(const at::Tensor& qkv_in, const at::Tensor& cos_in,
                                               const at::Tensor& sin_in, int64_t heads, bool fused) {
  const Packed P = check_packed(qkv_in, cos_in, sin_in, heads, "cpu rope attention");
  if (!fused || !bf16_gemm_works()) {
    const auto qkv = split_heads(qkv_in, P.H, P.D);
    auto res = causal_attention_forward(rope_aten(qkv[0], cos_in, sin_in), rope_aten(qkv[1], cos_in, sin_in), qkv[2]);
    return {merge_heads(res[0]), res[1]};
  }
  const at::Tensor qkv = packed_rows(qkv_in), cos = cos_in.contiguous(), sin = sin_in.contiguous();
  const int64_t B = P.B, S = P.S, H = P.H, D = P.D, ss = qkv.stride(1), sb = qkv.stride(0);
  at::Tensor out = at::empty({B, S, H * D}, qkv.options());
  at::Tensor lse = at::empty({B, H, S}, qkv.options().dtype(at::kFloat));
  if (out.numel() == 0) return {out, lse};
  const bf16* X = qkv.data_ptr<bf16>();
  const float *C = cos.data_ptr<float>(), *Sn = sin.data_ptr<float>();
  bf16* O = out.data_ptr<bf16>();
  float* L = lse.data_ptr<float>();
#pragma omp parallel
  {
    FwdScratch w(S, D);
    moe_lab_cpu::Scratch<bf16> qr(S * D), kr(S * D);
    moe_lab_cpu::Scratch<float> xf(D);
#pragma omp for schedule(static)
    for (int64_t bh = 0; bh < B * H; ++bh) {
      const int64_t b = bh / H, h = bh % H;
      const bf16* row0 = X + b * sb;
      rotate_head(row0, ss, h, P, C, Sn, qr.data(), kr.data(), xf.data());
      head_forward_bf16(qr.data(), D, kr.data(), D, row0 + (2 * H + h) * D, ss, S, S, D, O + b * S * H * D + h * D,
                        H * D, L + bh * S, w);
    }
    at::native::cpublas::brgemm_release(true);
  }
  return {out, lse};
}

// Backward of rope_attention_forward: dqkv [B, S, 3·H·D] bfloat16, the gradient of the packed
// projection output (the RoPE's gradient applied to dq and dk in float32, one rounding each).
at::Tensor rope_attention_backward(const at::Tensor& dout_in, const at::Tensor& qkv_in, const at::Tensor& cos_in,
                                   const at::Tensor& sin_in, const at::Tensor& out_in, const at::Tensor& lse_in,
                                   int64_t heads, bool fused) {
  const Packed P = check_packed(qkv_in, cos_in, sin_in, heads, "cpu rope attention backward");
  const int64_t B = P.B, S = P.S, H = P.H, D = P.D, half = D / 2;
  for (const at::Tensor* t : {&dout_in, &out_in}) {
    TORCH_CHECK(t->scalar_type() == at::kBFloat16 && t->dim() == 3 && t->size(0) == B && t->size(1) == S &&
                    t->size(2) == H * D,
                "cpu rope attention backward: dout and out must be bfloat16 [", B, ", ", S, ", ", H * D, "], got ",
                t->scalar_type(), " ", t->sizes());
  }
  TORCH_CHECK(lse_in.scalar_type() == at::kFloat && lse_in.dim() == 3 && lse_in.size(0) == B && lse_in.size(1) == H &&
                  lse_in.size(2) == S,
              "cpu rope attention backward: lse must be float32 [", B, ", ", H, ", ", S, "], got ", lse_in.sizes());
  if (!fused || !bf16_gemm_works()) {
    const auto qkv = split_heads(qkv_in, H, D);
    const auto heads4 = [&](const at::Tensor& t) { return t.view({B, S, H, D}).transpose(1, 2); };
    const at::Tensor q = rope_aten(qkv[0], cos_in, sin_in), k = rope_aten(qkv[1], cos_in, sin_in);
    auto g = causal_attention_backward(heads4(dout_in.contiguous()), q, k, qkv[2], heads4(out_in.contiguous()), lse_in);
    return at::cat({merge_heads(rope_grad_aten(g[0], cos_in, sin_in)), merge_heads(rope_grad_aten(g[1], cos_in, sin_in)),
                    merge_heads(g[2])}, 2);
  }
  const at::Tensor qkv = packed_rows(qkv_in), cos = cos_in.contiguous(), sin = sin_in.contiguous();
  const at::Tensor dout = dout_in.stride(2) == 1 ? dout_in : dout_in.contiguous();
  const at::Tensor out = out_in.stride(2) == 1 ? out_in : out_in.contiguous();
  const at::Tensor lse = lse_in.contiguous();
  at::Tensor dqkv = at::empty({B, S, 3 * H * D}, qkv.options());
  if (dqkv.numel() == 0) return dqkv;
  const int64_t ss = qkv.stride(1), sb = qkv.stride(0), gs = dout.stride(1), gb = dout.stride(0),
                os = out.stride(1), ob = out.stride(0);
  const bf16 *X = qkv.data_ptr<bf16>(), *G = dout.data_ptr<bf16>(), *Ot = out.data_ptr<bf16>();
  const float *C = cos.data_ptr<float>(), *Sn = sin.data_ptr<float>(), *L = lse.data_ptr<float>();
  bf16* DX = dqkv.data_ptr<bf16>();
  const int64_t ld = 3 * H * D;
#pragma omp parallel
  {
    BwdScratch w(S, D);
    moe_lab_cpu::Scratch<bf16> qr(S * D), kr(S * D);
    moe_lab_cpu::Scratch<float> xf(D), dq_acc(S * D), dk_acc(S * D), dv_acc(S * D);
#pragma omp for schedule(static)
    for (int64_t bh = 0; bh < B * H; ++bh) {
      const int64_t b = bh / H, h = bh % H;
      const bf16* row0 = X + b * sb;
      rotate_head(row0, ss, h, P, C, Sn, qr.data(), kr.data(), xf.data());  // the forward's, bit for bit
      head_backward_bf16(qr.data(), D, kr.data(), D, row0 + (2 * H + h) * D, ss, G + b * gb + h * D, gs,
                         Ot + b * ob + h * D, os, L + bh * S, S, S, D, dq_acc.data(), dk_acc.data(), dv_acc.data(), w);
      bf16* dst = DX + b * S * ld;
      for (int64_t t = 0; t < S; ++t) {
        rope_grad_row(dq_acc.data() + t * D, C + t * half, Sn + t * half, half, dst + t * ld + h * D);
        rope_grad_row(dk_acc.data() + t * D, C + t * half, Sn + t * half, half, dst + t * ld + (H + h) * D);
        moe_lab_cpu::to_bf16(dv_acc.data() + t * D, dst + t * ld + (2 * H + h) * D, D);
      }
    }
    at::native::cpublas::brgemm_release(true);
  }
  return dqkv;
}

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
