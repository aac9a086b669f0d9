#pragma once
// The text-trained examples' optimizer (AdamW and its learning-rate schedule) and step options
// from the shared command line (common/settings.hpp).
#include "settings.hpp"

#include <concerto/runtime/lr_schedule.hpp>
#include <concerto/train/options.hpp>

namespace examples {

/// AdamW at --lr and --weight-decay with the schedule of --lr-schedule, --warmup and --min-lr-ratio over --steps (a
/// decay with no steps after the warmup is refused by train::compile, naming the fields), and
/// global-norm clipping at --clip.
inline concerto::train::optimizer_settings optimizer_of(const text_model_settings& s) {
  return {.adamw = {.lr = s.lr, .weight_decay = s.weight_decay},
          .schedule = {.decay = concerto::runtime::parse_lr_decay(s.lr_schedule),
                       .warmup_steps = s.warmup,
                       .decay_steps = s.steps,
                       .min_ratio = s.min_lr_ratio},
          .clip_norm = s.clip};
}

/// The step options of every run: the policy, lowering and cost preset the example gives, with
/// --precision, --memory-cap-mib and, for a model written with auto_ (--auto), --explain.
inline concerto::train::step_options step_options_of(const text_model_settings& s, concerto::planner::policy policy,
                                                     concerto::lower_options lower) {
  concerto::train::step_options o{.policy = policy, .lower = std::move(lower), .cost_preset = s.cost_preset};
  o.precision = o.lower.precision;
  if (s.memory_cap_mib > 0) o.memory_cap_bytes = std::int64_t{s.memory_cap_mib} << 20;
  o.sharding.explain = s.explain;
  return o;
}

} // namespace examples
