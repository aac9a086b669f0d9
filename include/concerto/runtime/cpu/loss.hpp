#pragma once
/// @file
/// @brief Loss kernels on the CPU: cross-entropy with logits and mean squared error, with gradients.

#include <concerto/runtime/cpu/detail/check.hpp>
#include <concerto/runtime/cpu/detail/fast_math.hpp>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>

namespace concerto::runtime::cpu {

namespace detail {
inline void check_targets(const char* kernel, std::span<const std::int32_t> targets, std::size_t classes) {
  for (std::size_t r = 0; r < targets.size(); ++r)
    CONCERTO_CHECK(targets[r] >= 0 && static_cast<std::size_t>(targets[r]) < classes,
                   std::string(kernel) + ": target of row " + std::to_string(r) + " is " +
                       std::to_string(targets[r]) + ", outside the " + std::to_string(classes) +
                       " classes");
}
} // namespace detail

/// @brief Mean cross-entropy of `logits[rows, classes]` against integer `targets[rows]`:
/// `(1/rows)·Σ_r (lse_r - logits[r, targets[r]])`.
///
/// Saves the per-row log-sum-exp `lse[rows]` for `cross_entropy_grad` (rows floats, not a
/// softmax). The sum runs in double so that the loss of a large batch keeps its digits.
/// @code
/// const float loss = cpu::cross_entropy(logits, targets, lse, tokens, vocab);
/// cpu::cross_entropy_grad(logits, targets, lse, dlogits, tokens, vocab);
/// @endcode
inline float cross_entropy(std::span<const float> logits, std::span<const std::int32_t> targets,
                           std::span<float> lse, std::size_t rows, std::size_t classes) {
  detail::require_size(logits, rows * classes, "cross_entropy", "logits");
  detail::require_size(targets, rows, "cross_entropy", "targets");
  detail::require_size(lse, rows, "cross_entropy", "lse");
  CONCERTO_CHECK(rows > 0, "cross_entropy: the mean over rows needs at least one row");
  detail::check_targets("cross_entropy", targets, classes);
  double total = 0.0;
  for (std::size_t r = 0; r < rows; ++r) {
    const float* pl = logits.data() + r * classes;
    float m = -INFINITY;
    for (std::size_t c = 0; c < classes; ++c) m = pl[c] > m ? pl[c] : m;
    float sum = 0.0f;
    for (std::size_t c = 0; c < classes; ++c) sum += std::exp(pl[c] - m);
    lse[r] = m + std::log(sum);
    total += static_cast<double>(lse[r]) - static_cast<double>(pl[targets[r]]);
  }
  return static_cast<float>(total / static_cast<double>(rows));
}

/// @brief Gradient of `dloss·cross_entropy(...)`: `dlogits = dloss·(softmax(logits) - onehot)/rows`.
///
/// `dloss` is the upstream gradient of the loss (1 for the loss itself; a data-parallel step may
/// pass 1/ranks instead of scaling afterwards). dlogits may alias logits.
inline void cross_entropy_grad(std::span<const float> logits, std::span<const std::int32_t> targets,
                               std::span<const float> lse, std::span<float> dlogits, std::size_t rows,
                               std::size_t classes, float dloss = 1.0f) {
  detail::require_size(logits, rows * classes, "cross_entropy_grad", "logits");
  detail::require_size(targets, rows, "cross_entropy_grad", "targets");
  detail::require_size(lse, rows, "cross_entropy_grad", "lse");
  detail::require_size(dlogits, rows * classes, "cross_entropy_grad", "dlogits");
  CONCERTO_CHECK(rows > 0, "cross_entropy_grad: the mean over rows needs at least one row");
  detail::check_targets("cross_entropy_grad", targets, classes);
  const float s = dloss / static_cast<float>(rows);
  for (std::size_t r = 0; r < rows; ++r) {
    const float* pl = logits.data() + r * classes;
    float* pd = dlogits.data() + r * classes;
    const float l = lse[r];
    for (std::size_t c = 0; c < classes; ++c) pd[c] = s * detail::exp_approx(pl[c] - l);
    pd[targets[r]] -= s;
  }
}

/// @brief Mean squared error `(1/n)·Σ (pred - target)²` over n = pred.size() values (sum in double).
inline float mse(std::span<const float> pred, std::span<const float> target) {
  detail::require_size(target, pred.size(), "mse", "target");
  CONCERTO_CHECK(!pred.empty(), "mse: the mean needs at least one value");
  double total = 0.0;
  for (std::size_t i = 0; i < pred.size(); ++i) {
    const double d = static_cast<double>(pred[i]) - static_cast<double>(target[i]);
    total += d * d;
  }
  return static_cast<float>(total / static_cast<double>(pred.size()));
}

/// @brief Gradient of `dloss·mse(pred, target)`: `dpred = dloss·2·(pred - target)/n`. dpred may alias pred.
inline void mse_grad(std::span<const float> pred, std::span<const float> target, std::span<float> dpred,
                     float dloss = 1.0f) {
  detail::require_size(target, pred.size(), "mse_grad", "target");
  detail::require_size(dpred, pred.size(), "mse_grad", "dpred");
  CONCERTO_CHECK(!pred.empty(), "mse_grad: the mean needs at least one value");
  const float s = 2.0f * dloss / static_cast<float>(pred.size());
  const float* pp = pred.data();
  const float* pt = target.data();
  float* pd = dpred.data();
  const std::size_t n = pred.size();
  for (std::size_t i = 0; i < n; ++i) pd[i] = s * (pp[i] - pt[i]);
}

} // namespace concerto::runtime::cpu
