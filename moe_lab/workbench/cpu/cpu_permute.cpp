// moe_lab's CPU token permutation: the row-id map, permute and unpermute, each one pass.
//
// The dropless layer in plain PyTorch moves every token row through half a dozen ATen ops
// between the router and the experts and back: a stable argsort of the expert ids, a
// gather into expert order, a copy into the padded layout, a gather back out of it, a
// multiply by the router weights and a scatter-add into the tokens — and the backward runs
// each of them again, transposed. On a CPU each of those is a pass over the whole
// [tokens·k, d] buffer, and the scatter-adds run on one core. Here (the CPU form of the
// Triton kernels in moe_lab/kernels/permute.py, same semantics, same references):
//
//   row_id_map:  a counting sort of the expert ids — a histogram, each expert's first row
//                (padded to `align`), then every (token, slot) in order takes the next row
//                of its expert. Stable: by expert, then token, then slot.
//   permute:     x[t] copied to its k rows (optionally scaled by w[t, j]); rows no (token,
//                slot) maps to are zero.
//   unpermute:   out[t] = Σ_j w[t, j] · y[row_id_map[t, j]], summed in float32, one rounding.
//   weight grad: dw[t, j] = <dout[t], y[row_id_map[t, j]]>, in float32.
//   top-k:       the router's choice before all of this: per token the k highest scores,
//                highest first, ties to the lower expert index (one pass over each row).
//
// Every loop over tokens gathers (each token reads its own k rows), so no two cores write
// the same row and the results do not depend on the number of cores. Indices are checked
// (on a CPU reading them is free): a bad map raises instead of touching memory it should not.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace {

using fVec = at::vec::Vectorized<float>;

// Tokens per task of at::parallel_for: a few hundred KB of rows.
int64_t grain(int64_t k, int64_t d) { return std::max<int64_t>(1, 16384 / std::max<int64_t>(1, k * d)); }

bool row_dtype(at::ScalarType t) {
  return t == at::kFloat || t == at::kBFloat16 || t == at::kHalf;
}

// A 2-D tensor whose rows are contiguous (stride(1) == 1); anything else is copied.
at::Tensor rows_contiguous(const at::Tensor& t) {
  return (t.size(1) <= 1 || t.stride(1) == 1) ? t : t.contiguous();
}

void check_rows(const at::Tensor& t, const char* name, const char* who) {
  TORCH_CHECK(t.device().is_cpu(), who, ": ", name, " must be on the CPU, got ", t.device());
  TORCH_CHECK(t.dim() == 2, who, ": ", name, " must be 2-D [rows, d], got shape ", t.sizes());
  TORCH_CHECK(row_dtype(t.scalar_type()), who, ": ", name,
              " must be float32, bfloat16 or float16, got ", t.scalar_type());
}

// The map as a contiguous int32 [T, k], each entry checked to lie in [0, n_rows).
at::Tensor checked_map(const at::Tensor& map, int64_t tokens, int64_t n_rows, const char* who) {
  TORCH_CHECK(map.device().is_cpu(), who, ": row_id_map must be on the CPU, got ", map.device());
  TORCH_CHECK(map.dim() == 2 && map.scalar_type() == at::kInt && (tokens < 0 || map.size(0) == tokens),
              who, ": row_id_map must be [", (tokens < 0 ? std::string("T") : std::to_string(tokens)),
              ", k] int32, got shape ", map.sizes(), " ", map.scalar_type());
  TORCH_CHECK(n_rows >= map.numel(), who, ": n_rows must be at least T·k = ", map.numel(),
              " (one row per token and slot), got ", n_rows);
  at::Tensor m = map.contiguous();
  const int32_t* p = m.data_ptr<int32_t>();
  for (int64_t i = 0; i < m.numel(); ++i) {
    TORCH_CHECK(p[i] >= 0 && p[i] < n_rows, who, ": row_id_map holds row ", p[i], " at entry ", i,
                ", outside the ", n_rows, " rows of the permuted buffer");
  }
  return m;
}

// w as a contiguous float32 [T, k] (or an undefined tensor when there are none).
at::Tensor checked_weights(const c10::optional<at::Tensor>& w, const at::Tensor& map, const char* who) {
  if (!w.has_value() || !w->defined()) return at::Tensor();
  TORCH_CHECK(w->device().is_cpu(), who, ": weights must be on the CPU, got ", w->device());
  TORCH_CHECK(w->is_floating_point(), who, ": weights must be floating point, got ", w->scalar_type());
  TORCH_CHECK(w->sizes() == map.sizes(), who, ": weights must be [T, k] = ", map.sizes(),
              " like row_id_map, got ", w->sizes());
  return w->to(at::kFloat).contiguous();
}

// acc[0:n) += a · x[0:n)
inline void axpy(float* acc, const float* x, float a, int64_t n) {
  const fVec va(a);
  int64_t j = 0;
  for (; j + fVec::size() <= n; j += fVec::size()) {
    at::vec::fmadd(fVec::loadu(x + j), va, fVec::loadu(acc + j)).store(acc + j);
  }
  for (; j < n; ++j) acc[j] += a * x[j];
}

// dst[0:n) = a · x[0:n)
inline void scale(float* dst, const float* x, float a, int64_t n) {
  const fVec va(a);
  int64_t j = 0;
  for (; j + fVec::size() <= n; j += fVec::size()) (fVec::loadu(x + j) * va).store(dst + j);
  for (; j < n; ++j) dst[j] = a * x[j];
}

inline float dot(const float* a, const float* b, int64_t n) {
  fVec acc(0.f);
  int64_t j = 0;
  for (; j + fVec::size() <= n; j += fVec::size()) acc = at::vec::fmadd(fVec::loadu(a + j), fVec::loadu(b + j), acc);
  float sum = at::vec::vec_reduce_all<float>([](fVec& x, fVec& y) { return x + y; }, acc);
  for (; j < n; ++j) sum += a[j] * b[j];
  return sum;
}

}  // namespace

// {row_id_map [T, k] int32, offsets [E + 1] int32}: expert e's rows are offsets[e]:offsets[e+1]
// (its entries first, then zero padding up to a multiple of align).
std::vector<at::Tensor> row_id_map(const at::Tensor& topk_ids, int64_t n_experts, int64_t align) {
  const char* who = "cpu row_id_map";
  TORCH_CHECK(topk_ids.device().is_cpu(), who, ": topk_ids must be on the CPU, got ", topk_ids.device());
  TORCH_CHECK(topk_ids.dim() == 2 && (topk_ids.scalar_type() == at::kLong || topk_ids.scalar_type() == at::kInt),
              who, ": topk_ids must be [T, k] int64 or int32, got shape ", topk_ids.sizes(), " ",
              topk_ids.scalar_type());
  TORCH_CHECK(n_experts >= 1, who, ": n_experts must be >= 1, got ", n_experts);
  TORCH_CHECK(align >= 1, who, ": align must be >= 1, got ", align);
  const at::Tensor ids = topk_ids.to(at::kLong).contiguous();
  const int64_t* id = ids.data_ptr<int64_t>();
  const int64_t n = ids.numel();
  TORCH_CHECK(n + n_experts * (align - 1) <= std::numeric_limits<int32_t>::max(), who,
              ": the permuted buffer (", n, " entries + padding) does not fit int32 row ids");
  std::vector<int64_t> next(n_experts, 0);
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK(id[i] >= 0 && id[i] < n_experts, who, ": topk_ids must hold expert ids in [0, ",
                n_experts, "), got ", id[i], " at entry ", i);
    ++next[id[i]];
  }
  at::Tensor offsets = at::empty({n_experts + 1}, ids.options().dtype(at::kInt));
  int32_t* off = offsets.data_ptr<int32_t>();
  off[0] = 0;
  for (int64_t e = 0; e < n_experts; ++e) {
    const int64_t padded = (next[e] + align - 1) / align * align;
    next[e] = off[e];  // from here on: the next free row of expert e
    off[e + 1] = static_cast<int32_t>(off[e] + padded);
  }
  at::Tensor map = at::empty(topk_ids.sizes(), ids.options().dtype(at::kInt));
  int32_t* m = map.data_ptr<int32_t>();
  for (int64_t i = 0; i < n; ++i) m[i] = static_cast<int32_t>(next[id[i]]++);
  return {map, offsets};
}

// y [n_rows, d]: y[row_id_map[t, j]] = x[t] (· w[t, j] if given, in float32); other rows zero.
at::Tensor permute(const at::Tensor& x_in, const at::Tensor& map_in, const c10::optional<at::Tensor>& weights,
                   int64_t n_rows) {
  const char* who = "cpu permute";
  check_rows(x_in, "x", who);
  const at::Tensor map = checked_map(map_in, x_in.size(0), n_rows, who);
  const at::Tensor w = checked_weights(weights, map, who);
  const at::Tensor x = rows_contiguous(x_in);
  const int64_t tokens = x.size(0), d = x.size(1), k = map.size(1);
  at::Tensor y = at::empty({n_rows, d}, x.options());
  const int32_t* m = map.data_ptr<int32_t>();
  {  // zero the rows no (token, slot) maps to; a row mapped twice is a broken map
    std::vector<uint8_t> used(n_rows, 0);
    for (int64_t i = 0; i < map.numel(); ++i) {
      TORCH_CHECK(!used[m[i]], who, ": row_id_map sends two (token, slot) pairs to row ", m[i]);
      used[m[i]] = 1;
    }
    const int64_t row_bytes = d * y.element_size();
    char* base = static_cast<char*>(y.data_ptr());
    for (int64_t r = 0; r < n_rows; ++r) {
      if (!used[r]) std::memset(base + r * row_bytes, 0, row_bytes);
    }
  }
  if (tokens == 0 || d == 0 || k == 0) return y;
  const float* wp = w.defined() ? w.data_ptr<float>() : nullptr;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "cpu_permute", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    scalar_t* yp = y.data_ptr<scalar_t>();
    const int64_t sx = x.stride(0);
    at::parallel_for(0, tokens, grain(k, d), [&](int64_t begin, int64_t end) {
      std::vector<float> row(wp ? d : 0), scaled(wp ? d : 0);
      for (int64_t t = begin; t < end; ++t) {
        const scalar_t* src = xp + t * sx;
        if (wp == nullptr) {  // a copy, bit for bit
          for (int64_t j = 0; j < k; ++j) std::memcpy(yp + m[t * k + j] * d, src, d * sizeof(scalar_t));
          continue;
        }
        at::vec::convert(src, row.data(), d);
        for (int64_t j = 0; j < k; ++j) {
          scale(scaled.data(), row.data(), wp[t * k + j], d);
          at::vec::convert(scaled.data(), yp + m[t * k + j] * d, d);
        }
      }
    });
  });
  return y;
}

// out [T, d] = Σ_j w[t, j] · y[row_id_map[t, j]] (or the plain sum), in float32, in y's dtype.
at::Tensor unpermute(const at::Tensor& y_in, const at::Tensor& map_in, const c10::optional<at::Tensor>& weights) {
  const char* who = "cpu unpermute";
  check_rows(y_in, "y", who);
  const at::Tensor map = checked_map(map_in, -1, y_in.size(0), who);
  const at::Tensor w = checked_weights(weights, map, who);
  const at::Tensor y = rows_contiguous(y_in);
  const int64_t tokens = map.size(0), k = map.size(1), d = y.size(1);
  at::Tensor out = at::empty({tokens, d}, y.options());
  if (tokens == 0 || d == 0) return out;
  const int32_t* m = map.data_ptr<int32_t>();
  const float* wp = w.defined() ? w.data_ptr<float>() : nullptr;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, y.scalar_type(), "cpu_unpermute", [&] {
    const scalar_t* yp = y.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    const int64_t sy = y.stride(0);
    at::parallel_for(0, tokens, grain(k, d), [&](int64_t begin, int64_t end) {
      std::vector<float> acc(d), row(d);
      for (int64_t t = begin; t < end; ++t) {
        std::fill(acc.begin(), acc.end(), 0.f);
        for (int64_t j = 0; j < k; ++j) {
          at::vec::convert(yp + m[t * k + j] * sy, row.data(), d);
          axpy(acc.data(), row.data(), wp ? wp[t * k + j] : 1.f, d);
        }
        at::vec::convert(acc.data(), op + t * d, d);
      }
    });
  });
  return out;
}

// dw [T, k] float32: dw[t, j] = <dout[t], y[row_id_map[t, j]]>, summed in float32.
at::Tensor unpermute_weight_grad(const at::Tensor& y_in, const at::Tensor& map_in, const at::Tensor& dout_in) {
  const char* who = "cpu unpermute_weight_grad";
  check_rows(y_in, "y", who);
  check_rows(dout_in, "dout", who);
  const at::Tensor map = checked_map(map_in, dout_in.size(0), y_in.size(0), who);
  TORCH_CHECK(dout_in.scalar_type() == y_in.scalar_type() && dout_in.size(1) == y_in.size(1), who,
              ": dout must be [T, d] in y's dtype, got ", dout_in.sizes(), " ", dout_in.scalar_type(),
              " for y ", y_in.sizes(), " ", y_in.scalar_type());
  const at::Tensor y = rows_contiguous(y_in), dout = rows_contiguous(dout_in);
  const int64_t tokens = map.size(0), k = map.size(1), d = y.size(1);
  at::Tensor dw = at::empty({tokens, k}, y.options().dtype(at::kFloat));
  if (dw.numel() == 0) return dw;
  const int32_t* m = map.data_ptr<int32_t>();
  float* dwp = dw.data_ptr<float>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, y.scalar_type(), "cpu_unpermute_weight_grad", [&] {
    const scalar_t *yp = y.data_ptr<scalar_t>(), *gp = dout.data_ptr<scalar_t>();
    const int64_t sy = y.stride(0), sg = dout.stride(0);
    at::parallel_for(0, tokens, grain(k, d), [&](int64_t begin, int64_t end) {
      std::vector<float> g(d), row(d);
      for (int64_t t = begin; t < end; ++t) {
        at::vec::convert(gp + t * sg, g.data(), d);
        for (int64_t j = 0; j < k; ++j) {
          at::vec::convert(yp + m[t * k + j] * sy, row.data(), d);
          dwp[t * k + j] = dot(g.data(), row.data(), d);
        }
      }
    });
  });
  return dw;
}

namespace {

// A float32's order as a signed integer, the order of moe_lab.moe.router.topk_lowest_index:
// -0.0 counts as +0.0, a larger float is a larger integer (a negative float's magnitude bits
// flipped), a NaN with the sign bit clear ranks above +inf and one with it set below -inf.
inline int32_t monotone(float x) {
  x = x + 0.0f;  // -0.0 + 0.0 = +0.0 (no -ffast-math here, so this is not folded away)
  int32_t bits;
  std::memcpy(&bits, &x, sizeof(bits));
  return bits < 0 ? (bits ^ 0x7FFFFFFF) : bits;
}

}  // namespace

// [T, k] int64: each row's k highest values' indices, highest first, equal values to the lower
// index. A running top-k per row (insertion into k slots), rows spread over the cores.
at::Tensor topk_lowest_index(const at::Tensor& values_in, int64_t k) {
  const char* who = "cpu topk_lowest_index";
  TORCH_CHECK(values_in.device().is_cpu(), who, ": values must be on the CPU, got ", values_in.device());
  TORCH_CHECK(values_in.dim() == 2 && values_in.scalar_type() == at::kFloat, who,
              ": values must be [T, n] float32, got shape ", values_in.sizes(), " ", values_in.scalar_type());
  const int64_t rows = values_in.size(0), n = values_in.size(1);
  TORCH_CHECK(k >= 0 && k <= n, who, ": k must be in [0, n = ", n, "], got ", k);
  const at::Tensor values = values_in.contiguous();
  at::Tensor out = at::empty({rows, k}, values.options().dtype(at::kLong));
  if (rows == 0 || k == 0) return out;
  const float* v = values.data_ptr<float>();
  int64_t* o = out.data_ptr<int64_t>();
  at::parallel_for(0, rows, std::max<int64_t>(1, 16384 / n), [&](int64_t begin, int64_t end) {
    std::vector<int32_t> key(k);
    std::vector<int64_t> idx(k);
    for (int64_t r = begin; r < end; ++r) {
      const float* row = v + r * n;
      int64_t filled = 0;
      for (int64_t j = 0; j < n; ++j) {
        const int32_t kj = monotone(row[j]);
        if (filled == k && kj <= key[k - 1]) continue;  // an equal value came from a lower index
        int64_t p = filled < k ? filled++ : k - 1;
        for (; p > 0 && key[p - 1] < kj; --p) {  // strictly smaller moves down: ties keep order
          key[p] = key[p - 1];
          idx[p] = idx[p - 1];
        }
        key[p] = kj;
        idx[p] = j;
      }
      std::copy(idx.begin(), idx.end(), o + r * k);
    }
  });
  return out;
}
