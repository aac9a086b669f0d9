#pragma once
/// @file
/// @brief Global-norm gradient clipping's factor (torch.nn.utils.clip_grad_norm_'s rule).
///
/// The step's tasks sum the squared gradient norm over every parameter and every rank
/// (graph/lower.hpp); each update then scales its gradient by
///
///     min(1, max_norm / (‖g‖ + 1e-6))
///
/// so that the global norm of the gradients it applies is at most `max_norm`. The factor is
/// computed where the update runs (on the GPU inside the kernel, from the norm in device memory),
/// so no value crosses to the host.

#include <concerto/runtime/lr_schedule.hpp> // CONCERTO_HOST_DEVICE

#include <cmath>

namespace concerto::runtime {

/// @brief The factor an update scales its gradient by, given the global squared norm; 1 when
/// `max_norm` is 0 (no clipping) or the norm is within it.
[[nodiscard]] CONCERTO_HOST_DEVICE inline float clip_factor(float max_norm, float norm_sq) {
  if (!(max_norm > 0.0f)) return 1.0f;
  const double coef = static_cast<double>(max_norm) / (::sqrt(static_cast<double>(norm_sq)) + 1e-6);
  return coef < 1.0 ? static_cast<float>(coef) : 1.0f;
}

} // namespace concerto::runtime
