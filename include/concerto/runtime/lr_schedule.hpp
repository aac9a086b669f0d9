#pragma once
/// @file
/// @brief The learning rate of each optimizer step: linear warmup, then constant, linear or
/// cosine decay to a floor (the schedules of nanoGPT, llm.c and torchtitan).
///
/// With base rate `lr`, step t counting from 1, warmup W and decay ending at step T:
///
///     t ≤ W:        lr · t / W
///     W < t < T:    floor + (lr - floor) · s(p),  p = (t - W) / (T - W),
///                   s = 1 (constant), 1 - p (linear), (1 + cos(π·p)) / 2 (cosine)
///     t ≥ T:        floor = lr · min_ratio   (constant: lr)
///
/// The rate is a function of the step count alone, which the executor passes to the optimizer
/// kernels and a checkpoint restores, so a resumed run continues the schedule exactly. Decoupled
/// weight decay (AdamW) and SGD's coupled decay scale with the scheduled rate, as in PyTorch.
///
/// @code
/// runtime::lr_schedule s{.decay = runtime::lr_decay::cosine, .warmup_steps = 100, .decay_steps = 5000,
///                        .min_ratio = 0.1f};
/// const float lr = runtime::lr_at(s, 3e-4f, step);
/// @endcode

#include <concerto/core/error.hpp>

#include <array>
#include <cmath>
#include <cstdint>
#include <string>
#include <string_view>

// lr_at runs in the CUDA optimizer kernels too: they read the step from device memory, so a
// captured CUDA graph replays with the current step's rate.
#if defined(__CUDACC__)
#define CONCERTO_HOST_DEVICE __host__ __device__
#else
#define CONCERTO_HOST_DEVICE
#endif

namespace concerto::runtime {

/// @brief How the rate falls after the warmup.
enum class lr_decay : std::uint8_t { constant, linear, cosine };

inline constexpr std::array<std::string_view, 3> lr_decay_names{"constant", "linear", "cosine"};

[[nodiscard]] constexpr std::string_view to_string(lr_decay d) noexcept { return lr_decay_names[static_cast<int>(d)]; }

/// @brief The decay of a name (flags, the agreement record); throws naming the known ones.
[[nodiscard]] inline lr_decay parse_lr_decay(std::string_view name) {
  for (std::size_t i = 0; i < lr_decay_names.size(); ++i)
    if (lr_decay_names[i] == name) return static_cast<lr_decay>(i);
  fail("learning-rate schedule '" + std::string(name) + "' is not one of constant, linear, cosine");
}

/// @brief A schedule; the default keeps the optimizer's rate at every step.
struct lr_schedule {
  lr_decay decay = lr_decay::constant;
  std::int64_t warmup_steps = 0; ///< steps of linear warmup from lr/W to lr
  std::int64_t decay_steps = 0;  ///< the step at which the decay reaches the floor (linear, cosine)
  float min_ratio = 0.0f;        ///< the floor as a share of the base rate

  /// Throws concerto::error naming the field that cannot make a schedule.
  void check() const {
    if (warmup_steps < 0) fail("lr_schedule: warmup_steps " + std::to_string(warmup_steps) + " is negative");
    if (!(min_ratio >= 0.0f && min_ratio <= 1.0f))
      fail("lr_schedule: min_ratio " + std::to_string(min_ratio) + " must lie in [0, 1] (the floor as a share of the rate)");
    if (decay != lr_decay::constant && decay_steps <= warmup_steps)
      fail("lr_schedule: " + std::string(to_string(decay)) + " decay ends at step " + std::to_string(decay_steps) +
           ", not after the " + std::to_string(warmup_steps) +
           " warmup steps; set decay_steps to the run's length (e.g. --steps)");
  }
};

/// @brief The rate of step `step` (from 1) for base rate `lr`; see the file comment.
[[nodiscard]] CONCERTO_HOST_DEVICE inline float lr_at(const lr_schedule& s, float lr, std::int64_t step) {
  if (s.warmup_steps > 0 && step <= s.warmup_steps)
    return static_cast<float>(static_cast<double>(lr) * static_cast<double>(step) / static_cast<double>(s.warmup_steps));
  if (s.decay == lr_decay::constant) return lr;
  const double floor = static_cast<double>(lr) * static_cast<double>(s.min_ratio);
  if (step >= s.decay_steps) return static_cast<float>(floor);
  const double p = static_cast<double>(step - s.warmup_steps) / static_cast<double>(s.decay_steps - s.warmup_steps);
  const double share = s.decay == lr_decay::linear ? 1.0 - p : 0.5 * (1.0 + ::cos(3.14159265358979323846 * p));
  return static_cast<float>(floor + (static_cast<double>(lr) - floor) * share);
}

} // namespace concerto::runtime
