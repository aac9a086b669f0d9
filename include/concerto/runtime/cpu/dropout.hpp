#pragma once
/// @file
/// @brief Dropout and its gradient: y = x · factor, dx = dy · factor, the factor (0 or
/// 1 / (1 − rate)) of each value drawn by runtime::dropout_layout from its index in the whole
/// tensor and the step, so the gradient redraws the forward's mask.
///
/// @code
/// runtime::dropout_layout l{.rank = 1, .local = {n}, .offset = {0}, .global_stride = {1}, .key = 7,
///                           .threshold = ir::fraction_num(0.1), .scale = 1 / 0.9f};
/// cpu::dropout(x, y, l, step);
/// @endcode

#include <concerto/runtime/cpu/detail/check.hpp>
#include <concerto/runtime/dropout_mask.hpp>

#include <cstddef>
#include <cstdint>
#include <span>

namespace concerto::runtime::cpu {

/// @brief y = x · the step's mask (also the gradient: dy in, dx out).
inline void dropout(std::span<const float> x, std::span<float> y, const dropout_layout& l, std::int64_t step) {
  std::size_t n = 1;
  for (int d = 0; d < l.rank; ++d) n *= static_cast<std::size_t>(l.local[d]);
  detail::require_size(x, n, "dropout", "x");
  detail::require_size(y, n, "dropout", "y");
  for (std::size_t i = 0; i < n; ++i) y[i] = x[i] * l.factor(i, step);
}

} // namespace concerto::runtime::cpu
