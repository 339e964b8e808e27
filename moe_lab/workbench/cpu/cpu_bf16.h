// The brgemm wrapper and bfloat16 GEMM helpers shared by moe_lab's CPU kernels
// (cpu_attention.cpp and cpu_grouped_gemm.cpp; build.py hashes this header with the sources).
//
// ATen's batch-reduce GEMM micro-kernel (oneDNN's brgemm) takes bfloat16 A and B and
// accumulates in float32. It reads B in pairs: rows 2p and 2p + 1 of the reduction dimension
// interleaved, element (kk, j) at b[((kk / 2) · ldb + j) · 2 + kk % 2] (the "VNNI" layout of
// the bf16 dot-product instructions), so every B operand is repacked first:
//   pack_pairs       B is the rows of a matrix (X in Aᵀ X, V in P V);
//   pack_transposed  B is the transpose of a matrix with an even number of columns (W in
//                    X Wᵀ, K in Q Kᵀ): its pairs are already adjacent, and the pair layout is
//                    the plain transpose of the matrix read as 32-bit words.
// A reduction of odd length is padded with a zero row (pack_pairs does it; the caller zeroes
// A's matching column).
#pragma once

#include <ATen/ATen.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/native/CPUBlas.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <exception>
#include <memory>
#include <type_traits>

// With the AVX512_BF16 instructions (build.py compiles with -mavx512bf16 where the CPU has
// them), float32 -> bfloat16 rounding is one instruction per 16 or 32 values instead of
// ATen's integer emulation (about nine instructions per 16). Both round to nearest even and
// keep NaN a NaN; the instruction also flushes denormal float32 inputs (below 2^-126) to a
// zero of their sign, where ATen keeps them as bfloat16 denormals.
#if defined(CPU_CAPABILITY_AVX512) && defined(__AVX512BF16__)
#define MOE_LAB_NATIVE_BF16 1
#include <immintrin.h>
#endif

namespace moe_lab_cpu {

using bf16 = at::BFloat16;

#ifdef MOE_LAB_NATIVE_BF16
// The first n (<= 16) lanes.
inline __mmask16 lanes(int64_t n) { return n >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << n) - 1u); }

// 16 float32 values rounded to bfloat16 (nearest even), as raw 16-bit patterns.
inline __m256i bf16_bits(__m512 v) { return (__m256i)_mm512_cvtneps_pbh(v); }

// Those bit patterns widened back to float32 (exact).
inline __m512 widen_bits(__m256i bits) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}

// The first n lanes of bfloat16 at p as float32 (the rest zero).
inline __m512 load_bf16(const bf16* p, int64_t n) {
  return widen_bits(_mm256_maskz_loadu_epi16(lanes(n), p));
}

inline __m512 load_f32(const float* p, int64_t n) { return _mm512_maskz_loadu_ps(lanes(n), p); }

// The first n of 16 bfloat16 bit patterns (bf16_bits) stored at p.
inline void store_bf16(__m256i bits, bf16* p, int64_t n) { _mm256_mask_storeu_epi16(p, lanes(n), bits); }
#endif

// dst[0:n) = bfloat16(src[0:n)), round to nearest even (see MOE_LAB_NATIVE_BF16 above).
inline void to_bf16(const float* src, bf16* dst, int64_t n) {
#ifdef MOE_LAB_NATIVE_BF16
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    const __m512bh r = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(src + i + 16), _mm512_loadu_ps(src + i));
    _mm512_storeu_si512(dst + i, (__m512i)r);
  }
  for (; i < n; i += 16) store_bf16(bf16_bits(load_f32(src + i, n - i)), dst + i, n - i);
#else
  at::vec::convert(src, dst, n);
#endif
}

// C[m, n] = A[m, k] · B[k, n] (+ C when accumulate) through ATen's brgemm, C float32: float32
// operands row-major, or bfloat16 ones with A row-major and B in pairs. k = 0 makes C zero
// (or leaves it, accumulating).
template <typename T>
inline void gemm(int64_t m, int64_t n, int64_t k, const T* a, int64_t lda, const T* b, int64_t ldb,
                 float* c, int64_t ldc, bool accumulate) {
  static_assert(std::is_same_v<T, float> || std::is_same_v<T, bf16>, "gemm: float32 or bfloat16");
  if (m == 0 || n == 0) return;
  if (k == 0) {
    if (!accumulate) {
      for (int64_t i = 0; i < m; ++i) std::memset(c + i * ldc, 0, n * sizeof(float));
    }
    return;
  }
  at::native::cpublas::brgemm(m, n, k, lda, ldb, ldc, accumulate, a, b, c,
                              /*is_vnni=*/std::is_same_v<T, bf16>);
}

// Whether ATen's bfloat16 brgemm runs on this CPU (it needs oneDNN's micro-kernels for the
// CPU's instruction set); asked once per process, with a 2x2x2 product checked against its
// known result. Callers fall back to float32 or to ATen's GEMM where it does not.
inline bool bf16_gemm_works() {
  static const bool works = [] {
    try {
      const bf16 a[4] = {bf16(1.f), bf16(2.f), bf16(3.f), bf16(4.f)};
      const bf16 b[4] = {bf16(1.f), bf16(0.f), bf16(0.f), bf16(1.f)};  // identity, in pairs
      float c[4] = {0.f, 0.f, 0.f, 0.f};
      gemm(2, 2, 2, a, 2, b, 2, c, 2, false);
      at::native::cpublas::brgemm_release(true);
      return c[0] == 1.f && c[1] == 2.f && c[2] == 3.f && c[3] == 4.f;
    } catch (const std::exception&) {
      return false;
    }
  }();
  return works;
}

// Transpose a float32 [rows, cols] block (leading dim ld_in) into out[cols, rows] (leading
// dim ld_out): ATen's vectorised 16x16-tile transpose (plain loops without AVX-512).
inline void transpose(const float* in, int64_t rows, int64_t cols, int64_t ld_in, float* out,
                      int64_t ld_out) {
  at::vec::transpose_mxn<float>(in, ld_in, out, ld_out, static_cast<int>(rows), static_cast<int>(cols));
}

// The same for bfloat16, in 32x32 tiles.
inline void transpose_bf16(const bf16* in, int64_t rows, int64_t cols, int64_t ld_in, bf16* out,
                           int64_t ld_out) {
  for (int64_t r0 = 0; r0 < rows; r0 += 32) {
    for (int64_t c0 = 0; c0 < cols; c0 += 32) {
      at::vec::transpose_mxn<bf16>(in + r0 * ld_in + c0, ld_in, out + c0 * ld_out + r0, ld_out,
                                   static_cast<int>(std::min<int64_t>(32, rows - r0)),
                                   static_cast<int>(std::min<int64_t>(32, cols - c0)));
    }
  }
}

// Rows [0, rows) of a bfloat16 [rows, cols] matrix (leading dim ld) in pairs:
// out[(p · cols + j) · 2 + r % 2] for r = 2p, 2p + 1; an odd last row is paired with zeros.
inline void pack_pairs(const bf16* src, int64_t rows, int64_t cols, int64_t ld, bf16* out) {
  const uint16_t* s = reinterpret_cast<const uint16_t*>(src);
  uint32_t* o = reinterpret_cast<uint32_t*>(out);
  for (int64_t r = 0; r < rows; r += 2) {
    const uint16_t* r0 = s + r * ld;
    uint32_t* dst = o + (r / 2) * cols;
    if (r + 1 < rows) {
      const uint16_t* r1 = r0 + ld;
      for (int64_t j = 0; j < cols; ++j) dst[j] = uint32_t(r0[j]) | (uint32_t(r1[j]) << 16);
    } else {
      for (int64_t j = 0; j < cols; ++j) dst[j] = uint32_t(r0[j]);
    }
  }
}

// The transpose of a bfloat16 [rows, cols] matrix (cols even; ld even and src on a 32-bit
// boundary) in pairs: out is [cols / 2, rows] 32-bit words, B of a GEMM with k = cols, n = rows.
inline void pack_transposed(const bf16* src, int64_t rows, int64_t cols, int64_t ld, bf16* out) {
  transpose(reinterpret_cast<const float*>(src), rows, cols / 2, ld / 2, reinterpret_cast<float*>(out), rows);
}

inline int64_t round_even(int64_t n) { return n + (n & 1); }

// A per-thread scratch buffer left uninitialised: every element is written before it is
// read (std::vector would zero it first, on every call of a kernel).
template <typename T>
class Scratch {
 public:
  explicit Scratch(int64_t n) : data_(n > 0 ? new T[n] : nullptr) {}
  T* data() { return data_.get(); }
  T& operator[](int64_t i) { return data_[i]; }

 private:
  std::unique_ptr<T[]> data_;
};

}  // namespace moe_lab_cpu
