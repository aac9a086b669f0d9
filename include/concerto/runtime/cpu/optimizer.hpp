#pragma once
/// @file
/// @brief Optimizer updates on the CPU: SGD (momentum, weight decay) and AdamW, in place.
///
/// Each update is elementwise over a contiguous range, so a rank that owns a shard of the
/// parameters (ZeRO) passes the matching subspans of parameters, gradients and state.

#include <concerto/runtime/cpu/detail/check.hpp>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

namespace concerto::runtime::cpu {

/// @brief SGD hyperparameters (the semantics of torch.optim.SGD with dampening 0, no Nesterov).
struct sgd_config {
  float lr = 0.01f;
  float momentum = 0.0f;     ///< 0: plain SGD, no buffer needed
  float weight_decay = 0.0f; ///< L2 term added to the gradient (coupled, unlike AdamW)
};

/// @brief `g = grad + wd·p; buf = momentum·buf + g; p -= lr·buf` (without momentum: `p -= lr·g`).
///
/// `momentum_buf` starts zeroed (so the first step sets it to g) and may be empty when
/// `momentum == 0`. `grad_scale` multiplies the gradient first (global-norm clipping's factor,
/// runtime/grad_clip.hpp).
/// @code
/// cpu::sgd_update(w, dw, w_momentum, {.lr = 0.1f, .momentum = 0.9f});
/// @endcode
inline void sgd_update(std::span<float> params, std::span<const float> grads,
                       std::span<float> momentum_buf, const sgd_config& cfg, float grad_scale = 1.0f) {
  detail::require_size(grads, params.size(), "sgd_update", "grads");
  if (cfg.momentum != 0.0f) detail::require_size(momentum_buf, params.size(), "sgd_update", "momentum_buf");
  float* p = params.data();
  const float* g = grads.data();
  const std::size_t n = params.size();
  const float lr = cfg.lr;
  const float wd = cfg.weight_decay;
  if (cfg.momentum == 0.0f) {
    for (std::size_t i = 0; i < n; ++i) p[i] -= lr * (g[i] * grad_scale + wd * p[i]);
    return;
  }
  float* buf = momentum_buf.data();
  const float mu = cfg.momentum;
  for (std::size_t i = 0; i < n; ++i) {
    buf[i] = mu * buf[i] + (g[i] * grad_scale + wd * p[i]);
    p[i] -= lr * buf[i];
  }
}

/// @brief AdamW hyperparameters (the semantics of torch.optim.AdamW, amsgrad off).
struct adamw_config {
  float lr = 1e-3f;
  float beta1 = 0.9f;
  float beta2 = 0.999f;
  float eps = 1e-8f;
  float weight_decay = 0.01f; ///< decoupled: p *= 1 - lr·wd before the Adam step
};

/// @brief One AdamW step, `step` counting from 1 (bias correction uses it):
/// `p *= 1 - lr·wd; m = β1·m + (1-β1)·g; v = β2·v + (1-β2)·g²;`
/// `p -= lr·(m/(1-β1^step)) / (√(v/(1-β2^step)) + eps)`.
///
/// m and v start zeroed and are updated in place; `grad_scale` multiplies the gradient first
/// (global-norm clipping's factor, runtime/grad_clip.hpp).
/// @code
/// for (std::int64_t t = 1; t <= steps; ++t) cpu::adamw_update(w, dw, m, v, {.lr = 3e-4f}, t);
/// @endcode
inline void adamw_update(std::span<float> params, std::span<const float> grads, std::span<float> m,
                         std::span<float> v, const adamw_config& cfg, std::int64_t step, float grad_scale = 1.0f) {
  detail::require_size(grads, params.size(), "adamw_update", "grads");
  detail::require_size(m, params.size(), "adamw_update", "m");
  detail::require_size(v, params.size(), "adamw_update", "v");
  CONCERTO_CHECK(step >= 1, "adamw_update: step counts from 1, got " + std::to_string(step));
  // Bias corrections in double: 1 - β2^t is tiny for small t and would lose digits in float.
  const double bc1 = 1.0 - std::pow(static_cast<double>(cfg.beta1), static_cast<double>(step));
  const double bc2 = 1.0 - std::pow(static_cast<double>(cfg.beta2), static_cast<double>(step));
  const float step_size = static_cast<float>(static_cast<double>(cfg.lr) / bc1);
  const float inv_sqrt_bc2 = static_cast<float>(1.0 / std::sqrt(bc2));
  const float decay = 1.0f - cfg.lr * cfg.weight_decay;
  const float b1 = cfg.beta1;
  const float b2 = cfg.beta2;
  const float eps = cfg.eps;
  float* p = params.data();
  const float* g = grads.data();
  float* pm = m.data();
  float* pv = v.data();
  const std::size_t n = params.size();
  std::size_t i = 0;
#if defined(__SSE2__)
  // Four at a time with SSE's exact square root: a loop over std::sqrt stays scalar, since the
  // compiler must keep errno for negative inputs (4.1 ms a step of the GPT example; GCC's
  // optimize("no-math-errno") attribute does not change it). Each operation is the scalar one's,
  // in the same order, so the lanes give the tail's values bit for bit (where no FMA contracts them).
  const __m128 b1v = _mm_set1_ps(b1), b2v = _mm_set1_ps(b2), one_minus_b1 = _mm_set1_ps(1.0f - b1),
               one_minus_b2 = _mm_set1_ps(1.0f - b2), scale_v = _mm_set1_ps(grad_scale), decay_v = _mm_set1_ps(decay),
               step_v = _mm_set1_ps(step_size), bc2_v = _mm_set1_ps(inv_sqrt_bc2), eps_v = _mm_set1_ps(eps);
  for (; i + 4 <= n; i += 4) {
    const __m128 gi = _mm_mul_ps(_mm_loadu_ps(g + i), scale_v);
    const __m128 mi = _mm_add_ps(_mm_mul_ps(b1v, _mm_loadu_ps(pm + i)), _mm_mul_ps(one_minus_b1, gi));
    const __m128 vi = _mm_add_ps(_mm_mul_ps(b2v, _mm_loadu_ps(pv + i)), _mm_mul_ps(_mm_mul_ps(one_minus_b2, gi), gi));
    _mm_storeu_ps(pm + i, mi);
    _mm_storeu_ps(pv + i, vi);
    const __m128 denominator = _mm_add_ps(_mm_mul_ps(_mm_sqrt_ps(vi), bc2_v), eps_v);
    _mm_storeu_ps(p + i, _mm_sub_ps(_mm_mul_ps(_mm_loadu_ps(p + i), decay_v), _mm_div_ps(_mm_mul_ps(step_v, mi), denominator)));
  }
#endif
  for (; i < n; ++i) {
    const float gi = g[i] * grad_scale;
    pm[i] = b1 * pm[i] + (1.0f - b1) * gi;
    pv[i] = b2 * pv[i] + (1.0f - b2) * gi * gi;
    p[i] = p[i] * decay - step_size * pm[i] / (std::sqrt(pv[i]) * inv_sqrt_bc2 + eps);
  }
}

/// @brief Σ x² / replicas in double (a rank's share of the squared global gradient norm, when
/// `replicas` ranks hold the same values), rounded once to float.
[[nodiscard]] inline float sum_of_squares(std::span<const float> x, std::int64_t replicas = 1) {
  CONCERTO_CHECK(replicas >= 1, "sum_of_squares: replicas " + std::to_string(replicas) + " must be at least 1");
  double sum = 0;
  for (const float v : x) sum += static_cast<double>(v) * static_cast<double>(v);
  return static_cast<float>(sum / static_cast<double>(replicas));
}

} // namespace concerto::runtime::cpu
