#pragma once
/// @file
/// @brief Dynamic loss scaling: the host side of fp16 training (ir::precision_policy::fp16()).
///
/// f16 holds magnitudes from 6.1e-5 (smallest normal; 6e-8 subnormal) to 65504, and gradients
/// are often smaller than that range's bottom. So the step multiplies the loss's gradient by a
/// scale S (the loss gradients read it from `ir::loss_scale_buffer`, which the step writes before
/// each run), every gradient is then S times the true one, and each update divides by S
/// (runtime::gradient_factor). When S is too large some gradient overflows: the squared global
/// norm, summed over every rank, is then infinite or NaN on *every* rank, so every rank's updates
/// skip together (runtime::overflowed) without a separate vote, the scaler halves S, and the step
/// count does not advance (the learning-rate schedule and AdamW's bias correction count applied
/// updates, as Megatron-LM's). After `growth_interval` steps without overflow S doubles. The
/// rule and defaults are those of torch.cuda.amp.GradScaler and Megatron-LM's
/// DynamicGradScaler (2^16 to start, ×2 every 2000 good steps, ×0.5 on overflow), with
/// Megatron's floor on S.
///
/// @code
/// o.precision = ir::precision_policy::fp16();
/// o.loss_scaling.initial_scale = 1 << 12;   // the other settings as GradScaler's
/// const auto r = step(batch);
/// if (r.skipped) std::printf("overflow: loss scale now %g\n", r.loss_scale / 2);
/// @endcode

#include <concerto/core/error.hpp>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>

namespace concerto::train {

/// @brief How the loss scale moves (see the file comment).
struct loss_scaling_settings {
  float initial_scale = 65536.0f;      ///< S of the first step (2^16)
  float growth_factor = 2.0f;          ///< S multiplied by it after growth_interval good steps
  float backoff_factor = 0.5f;         ///< S multiplied by it after an overflow
  std::int64_t growth_interval = 2000; ///< consecutive steps without overflow before S grows
  float min_scale = 1.0f;              ///< S never falls below it
  float max_scale = 16777216.0f;       ///< nor grows above it (2^24)

  /// Throws concerto::error naming the first setting that cannot be.
  void check() const {
    const auto bad = [](const std::string& what) { fail("train step: loss_scaling." + what); };
    if (!(min_scale > 0) || !std::isfinite(min_scale)) bad("min_scale must be a finite scale above 0");
    if (!(max_scale >= min_scale) || !std::isfinite(max_scale)) bad("max_scale must be finite and at least min_scale");
    if (!(initial_scale >= min_scale && initial_scale <= max_scale))
      bad("initial_scale " + std::to_string(initial_scale) + " must lie in [min_scale, max_scale] = [" +
          std::to_string(min_scale) + ", " + std::to_string(max_scale) + "]");
    if (!(growth_factor >= 1) || !std::isfinite(growth_factor)) bad("growth_factor must be finite and at least 1");
    if (!(backoff_factor > 0 && backoff_factor < 1)) bad("backoff_factor must lie in (0, 1)");
    if (growth_interval < 1) bad("growth_interval must be at least one step");
  }
  friend bool operator==(const loss_scaling_settings&, const loss_scaling_settings&) = default;
};

/// @brief The loss scale and the count of good steps since it last changed.
class loss_scaler {
public:
  explicit loss_scaler(loss_scaling_settings s = {}) : s_(s), scale_(s.initial_scale) {}

  /// The scale the next step multiplies its loss gradient by.
  [[nodiscard]] float scale() const noexcept { return scale_; }
  /// Steps without overflow since the scale last changed.
  [[nodiscard]] std::int64_t good_steps() const noexcept { return good_; }

  /// After a step: backs off on an overflow, grows after growth_interval good steps.
  void after_step(bool overflowed) {
    if (overflowed) {
      scale_ = std::max(scale_ * s_.backoff_factor, s_.min_scale);
      good_ = 0;
    } else if (++good_ >= s_.growth_interval) {
      scale_ = std::min(scale_ * s_.growth_factor, s_.max_scale);
      good_ = 0;
    }
  }

  /// The state a checkpoint keeps, so that a resumed run scales as the uninterrupted one would.
  [[nodiscard]] nlohmann::json state() const { return {{"scale", scale_}, {"good_steps", good_}}; }
  /// Sets the state from a checkpoint's (state()); throws naming `where` when it cannot be one.
  void restore(const nlohmann::json& j, const std::string& where) {
    if (!j.is_object() || !j.contains("scale") || !j["scale"].is_number() || !j.contains("good_steps") ||
        !j["good_steps"].is_number_integer())
      fail(where + ": its loss scaling state is not {\"scale\": number, \"good_steps\": integer}");
    const auto scale = j["scale"].get<float>();
    const auto good = j["good_steps"].get<std::int64_t>();
    if (!(scale > 0) || !std::isfinite(scale) || good < 0)
      fail(where + ": its loss scale " + std::to_string(scale) + " or good step count " + std::to_string(good) +
           " cannot be (a finite scale above 0, a count of at least 0)");
    scale_ = scale;
    good_ = good;
  }

private:
  loss_scaling_settings s_;
  float scale_ = 1;
  std::int64_t good_ = 0;
};

} // namespace concerto::train
