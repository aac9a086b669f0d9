#pragma once
/// @file
/// @brief What an update scales its gradient by: global-norm clipping's factor
/// (torch.nn.utils.clip_grad_norm_'s rule) and, under dynamic loss scaling, the loss scale.
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

#include <bit>
#include <cmath>
#include <cstdint>

namespace concerto::runtime {

/// @brief The factor an update scales its gradient by, given the global squared norm; 1 when
/// `max_norm` is 0 (no clipping) or the norm is within it.
[[nodiscard]] CONCERTO_HOST_DEVICE inline float clip_factor(float max_norm, float norm_sq) {
  if (!(max_norm > 0.0f)) return 1.0f;
  const double coef = static_cast<double>(max_norm) / (::sqrt(static_cast<double>(norm_sq)) + 1e-6);
  return coef < 1.0 ? static_cast<float>(coef) : 1.0f;
}

/// @brief Under dynamic loss scaling (train/loss_scaling.hpp) the gradients an update reads are
/// `loss_scale` times the true ones, and `norm_sq` is their squared norm: the factor is the true
/// norm's clipping factor over the scale. An update with loss scaling first asks `overflowed`.
[[nodiscard]] CONCERTO_HOST_DEVICE inline float gradient_factor(float max_norm, float norm_sq, float loss_scale) {
  const double unscaled = static_cast<double>(norm_sq) / (static_cast<double>(loss_scale) * static_cast<double>(loss_scale));
  return static_cast<float>(static_cast<double>(clip_factor(max_norm, static_cast<float>(unscaled))) / static_cast<double>(loss_scale));
}

/// @brief Under dynamic loss scaling: some gradient of the step overflowed (the squared global
/// norm, summed over every rank, is infinite or NaN), so every update on every rank leaves its
/// parameter and optimizer state as they were.
/// (A bit test: it holds under any floating-point flags.)
[[nodiscard]] CONCERTO_HOST_DEVICE inline bool overflowed(float norm_sq) {
  return (std::bit_cast<std::uint32_t>(norm_sq) & 0x7f800000u) == 0x7f800000u;
}

/// @brief The factor an update scales its gradient by, from the step's global squared norm and
/// loss scale as they lie in memory (either null when the update does not read it): 1 without
/// the norm, the clipping factor with it, and under loss scaling the clipping factor of the
/// unscaled norm over the scale. false when the loss-scaled step overflowed: the update then
/// writes nothing. One rule for the CPU dispatch and the GPU kernels.
[[nodiscard]] CONCERTO_HOST_DEVICE inline bool update_factor(const float* norm_sq, const float* loss_scale, float max_norm,
                                                             float& factor) {
  factor = 1.0f;
  if (norm_sq == nullptr) return true;
  if (loss_scale == nullptr) {
    factor = clip_factor(max_norm, *norm_sq);
    return true;
  }
  if (overflowed(*norm_sq)) return false;
  factor = gradient_factor(max_norm, *norm_sq, *loss_scale);
  return true;
}

/// @brief A loss gradient's factor: its share of the mean times, under dynamic loss scaling
/// (`loss_scale` not null), the step's loss scale as it lies in memory.
[[nodiscard]] CONCERTO_HOST_DEVICE inline float loss_gradient_factor(float share, const float* loss_scale) {
  return loss_scale == nullptr ? share : share * *loss_scale;
}

} // namespace concerto::runtime
