// moe_lab's clipped AdamW step for the CPU: the gradients' global norm, the clip factor and the
// update of every parameter, in one call.
//
// The sync-free step (moe_lab/step.py) clips and steps in three stages: the global norm (one
// norm per tensor, then the norm of those norms), the factor max(1, (norm + 1e-6) / max_norm),
// and torch's fused AdamW, which divides each gradient by that factor as it reads it — one
// call per parameter group, each a parallel loop per tensor, with Python between them. On a
// CPU those stages cost more than the memory they move. Here the tensors are cut into chunks
// once, one OpenMP loop over all chunks sums the squares of the gradients (in float64), and a
// second one updates every chunk: p ← p·(1 − lr·wd), then m ← m + (1 − β1)(g − m),
// v ← β2·v + (1 − β2)·g², p ← p − (lr / (1 − β1ᵗ)) · m / (√v / √(1 − β2ᵗ) + ε), with
// g = grad / factor and t the parameter's step count after its increment — torch's AdamW
// (decoupled weight decay, the moments in float32). A nonzero `skip` (a paged-stash overflow)
// leaves every parameter, moment and step count as it was. Gradients are only read.

#include <ATen/ATen.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t kChunk = 1 << 15;

struct Chunk {
  int64_t tensor, begin, end;
};

void check_list(const std::vector<at::Tensor>& list, const std::vector<at::Tensor>& params, const char* name) {
  TORCH_CHECK(list.size() == params.size(), "clip_adamw_: ", name, " must have one tensor per parameter (",
              params.size(), "), got ", list.size());
  for (size_t i = 0; i < list.size(); ++i) {
    const at::Tensor& t = list[i];
    TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat && t.is_contiguous() &&
                    t.numel() == params[i].numel(),
                "clip_adamw_: ", name, "[", i, "] must be a contiguous float32 CPU tensor of ", params[i].numel(),
                " elements like its parameter, got ", t.scalar_type(), " ", t.sizes(), " on ", t.device(),
                t.is_contiguous() ? "" : " (not contiguous)");
  }
}

float scalar_of(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.numel() == 1 && t.scalar_type() == at::kFloat, "clip_adamw_: ", name,
              " must be a one-element float32 CPU tensor, got ", t.scalar_type(), " ", t.sizes(), " on ",
              t.device());
  return t.data_ptr<float>()[0];
}

}  // namespace

// Returns the global gradient norm (a 0-dim float32 tensor); writes the clip factor into grad_scale.
at::Tensor clip_adamw_(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads,
                       const std::vector<at::Tensor>& exp_avgs, const std::vector<at::Tensor>& exp_avg_sqs,
                       const std::vector<at::Tensor>& steps, const std::vector<double>& weight_decays,
                       const at::Tensor& lr_t, double beta1, double beta2, double eps, double max_norm,
                       const at::Tensor& skip_t, const at::Tensor& grad_scale) {
  check_list(params, params, "params");
  check_list(grads, params, "grads");
  check_list(exp_avgs, params, "exp_avgs");
  check_list(exp_avg_sqs, params, "exp_avg_sqs");
  TORCH_CHECK(steps.size() == params.size() && weight_decays.size() == params.size(),
              "clip_adamw_: steps and weight_decays must have one entry per parameter (", params.size(),
              "), got ", steps.size(), " and ", weight_decays.size());
  for (size_t i = 0; i < steps.size(); ++i) scalar_of(steps[i], "steps[i]");
  TORCH_CHECK(max_norm > 0, "clip_adamw_: max_norm must be > 0, got ", max_norm);
  TORCH_CHECK(beta1 >= 0 && beta1 < 1 && beta2 >= 0 && beta2 < 1 && eps >= 0,
              "clip_adamw_: betas must be in [0, 1) and eps >= 0, got ", beta1, ", ", beta2, ", ", eps);
  const float lr = scalar_of(lr_t, "lr");
  const bool skip = scalar_of(skip_t, "skip") != 0.f;
  scalar_of(grad_scale, "grad_scale");

  std::vector<Chunk> chunks;
  for (int64_t i = 0; i < static_cast<int64_t>(params.size()); ++i) {
    for (int64_t b = 0; b < params[i].numel(); b += kChunk) chunks.push_back({i, b, std::min(params[i].numel(), b + kChunk)});
  }
  const int64_t n_chunks = static_cast<int64_t>(chunks.size());

  double sum_sq = 0.0;
#pragma omp parallel for schedule(static) reduction(+ : sum_sq)
  for (int64_t c = 0; c < n_chunks; ++c) {
    const float* g = grads[chunks[c].tensor].data_ptr<float>();
    Vec acc(0.f);
    int64_t j = chunks[c].begin;
    for (; j + Vec::size() <= chunks[c].end; j += Vec::size()) {
      const Vec v = Vec::loadu(g + j);
      acc = at::vec::fmadd(v, v, acc);
    }
    alignas(64) float lane[Vec::size()];
    acc.store(lane);
    double s = 0.0;
    for (int64_t l = 0; l < Vec::size(); ++l) s += lane[l];
    for (; j < chunks[c].end; ++j) s += double(g[j]) * g[j];
    sum_sq += s;
  }
  const float norm = static_cast<float>(std::sqrt(sum_sq));
  const float factor = std::max(1.f, (norm + 1e-6f) / static_cast<float>(max_norm));
  grad_scale.fill_(factor);
  at::Tensor out = at::full({}, norm, lr_t.options());
  if (skip || chunks.empty()) return out;

  // per parameter: its step count after the increment, and what the update needs of it
  const int64_t n = static_cast<int64_t>(params.size());
  std::vector<float> step_size(n), bias2_sqrt(n), decay(n);
  for (int64_t i = 0; i < n; ++i) {
    float* step = steps[i].data_ptr<float>();
    step[0] += 1.f;
    const double t = step[0];
    step_size[i] = static_cast<float>(lr / (1.0 - std::pow(beta1, t)));
    bias2_sqrt[i] = static_cast<float>(std::sqrt(1.0 - std::pow(beta2, t)));
    decay[i] = static_cast<float>(1.0 - lr * weight_decays[i]);
  }
  const float b1 = static_cast<float>(beta1), b2 = static_cast<float>(beta2), e = static_cast<float>(eps);
  const float inv_factor = 1.f / factor;
#pragma omp parallel for schedule(static)
  for (int64_t c = 0; c < n_chunks; ++c) {
    const int64_t i = chunks[c].tensor;
    float* p = params[i].data_ptr<float>();
    const float* g = grads[i].data_ptr<float>();
    float *m = exp_avgs[i].data_ptr<float>(), *v = exp_avg_sqs[i].data_ptr<float>();
    const Vec vdecay(decay[i]), vstep(step_size[i]), vbias2(bias2_sqrt[i]), vb1(1.f - b1), vb2(b2),
        vb2c(1.f - b2), veps(e), vinv(inv_factor);
    for (int64_t j = chunks[c].begin; j < chunks[c].end; j += Vec::size()) {
      const int64_t w = std::min<int64_t>(Vec::size(), chunks[c].end - j);
      const bool full = w == Vec::size();
      const Vec gv = (full ? Vec::loadu(g + j) : Vec::loadu(g + j, w)) * vinv;
      Vec mv = full ? Vec::loadu(m + j) : Vec::loadu(m + j, w);
      Vec vv = full ? Vec::loadu(v + j) : Vec::loadu(v + j, w);
      const Vec pv = full ? Vec::loadu(p + j) : Vec::loadu(p + j, w);
      mv = at::vec::fmadd(vb1, gv - mv, mv);
      vv = at::vec::fmadd(vb2, vv, vb2c * gv * gv);
      const Vec denom = vv.sqrt() / vbias2 + veps;
      const Vec pn = pv * vdecay - vstep * mv / denom;
      if (full) {
        mv.store(m + j);
        vv.store(v + j);
        pn.store(p + j);
      } else {
        mv.store(m + j, w);
        vv.store(v + j, w);
        pn.store(p + j, w);
      }
    }
  }
  return out;
}
