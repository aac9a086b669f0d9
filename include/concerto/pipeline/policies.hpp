#pragma once
/// @file
/// @brief The baseline pipeline schedules, each from its paper's definition (docs/pipeline.md),
/// and `policy_table`, the one list of the schedule policies and the layouts each accepts.
///
/// - `gpipe` (GPipe, Huang et al. 2019): every micro-batch's forward, then every backward; with
///   several chunks per stage, the forwards chunk by chunk in model order, then the backwards
///   chunk by chunk in reverse.
/// - `1f1b` (PipeDream-flush, Narayanan et al. 2021; Megatron-LM's default): stage s runs
///   `stages - s - 1` warm-up forwards, then alternates one forward and one backward, then
///   drains the remaining backwards; at most `stages - s` micro-batches in flight.
/// - `interleaved_1f1b` (Megatron-LM's virtual pipeline, Narayanan et al. 2021): each stage
///   holds `virtual_stages` chunks; 1F1B over virtual micro-batch steps, chunk chosen by the
///   step, `(stages - s - 1) × 2 + (virtual_stages - 1) × stages` warm-up steps; needs the
///   micro-batches to be a multiple of the stages.
/// - `zb_h1` (ZB-H1 of "Zero Bubble Pipeline Parallelism", Qi et al. 2024): 1F1B with the
///   backward split into B and W and stage s's W passes deferred by s micro-batches, so that
///   every stage holds as many micro-batches in flight as 1F1B's first.

#include <concerto/pipeline/schedule.hpp>

#include <algorithm>
#include <array>
#include <cstdint>
#include <numeric>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace concerto::pipeline {

/// @brief How many chunks per stage (`virtual_stages`) a policy runs.
enum class chunks_per_stage : std::uint8_t {
  one,     ///< exactly one
  several, ///< two or more (interleaved)
  any      ///< one or more
};

[[nodiscard]] inline schedule gpipe(const problem& p);
[[nodiscard]] inline schedule one_f_one_b(const problem& p);
[[nodiscard]] inline schedule interleaved_one_f_one_b(const problem& p);
[[nodiscard]] inline schedule zb_h1(const problem& p);

/// @brief A schedule policy and the layouts it accepts.
struct policy_info {
  std::string_view name;
  chunks_per_stage chunks;
  bool microbatches_multiple_of_stages; ///< the micro-batches must be a multiple of the stages
  bool split_backward;                  ///< runs W apart from B (the zero-bubble schedules)
  schedule (*baseline)(const problem&); ///< the definition; null for `concerto`, the search (search.hpp)
};

/// @brief The schedule policies, in the order reports list them. The one list: the baselines'
/// dispatch (`baseline`), the layout check (`refusal`, which the training step applies to its
/// options) and docs/pipeline.md's table (tests/unit/pipeline_schedule_test.cpp compares it)
/// follow it. Why a policy refuses a layout is its paper's definition: 1F1B and ZB-H1 are
/// defined on one chunk per stage, Megatron-LM's interleaved schedule on several with
/// micro-batches in groups of the stages; GPipe's order and the search take any layout.
inline constexpr std::array<policy_info, 5> policy_table{{
    {"gpipe", chunks_per_stage::any, false, false, &gpipe},
    {"1f1b", chunks_per_stage::one, false, false, &one_f_one_b},
    {"interleaved_1f1b", chunks_per_stage::several, true, false, &interleaved_one_f_one_b},
    {"zb_h1", chunks_per_stage::one, false, true, &zb_h1},
    {"concerto", chunks_per_stage::any, false, true, nullptr},
}};

/// @brief The policy of that name, or null.
[[nodiscard]] constexpr const policy_info* find_policy(std::string_view name) noexcept {
  for (const auto& p : policy_table)
    if (p.name == name) return &p;
  return nullptr;
}

/// @brief Every policy's name, comma-separated, for messages.
[[nodiscard]] inline std::string policy_list() {
  std::string out;
  for (const auto& p : policy_table) out.append(out.empty() ? "" : ", ").append(p.name);
  return out;
}

/// @brief Whether `p` orders a pipeline of `stages` stages (at least 1) with `virtual_stages`
/// chunks each and `microbatches` micro-batches; `refusal` says why not.
[[nodiscard]] constexpr bool accepts(const policy_info& p, int stages, int virtual_stages, int microbatches) noexcept {
  if (stages < 1 || virtual_stages < 1 || microbatches < 1) return false;
  const bool chunks = p.chunks == chunks_per_stage::any || (p.chunks == chunks_per_stage::one) == (virtual_stages == 1);
  return chunks && (!p.microbatches_multiple_of_stages || microbatches % stages == 0);
}

/// @brief Why `p` cannot order a pipeline of `stages` stages with `virtual_stages` chunks each
/// and `microbatches` micro-batches, naming the fix (the setting to change, or the policies that
/// take the layout); empty when it can.
///
/// @code
/// pipeline::refusal(*pipeline::find_policy("1f1b"), 2, 2, 4);
/// // "pipeline schedule '1f1b' runs one chunk per stage (virtual_stages = 2): set virtual_stages = 1,
/// //  or use gpipe, interleaved_1f1b or concerto, which take 2 chunks per stage"
/// @endcode
[[nodiscard]] inline std::string refusal(const policy_info& p, int stages, int virtual_stages, int microbatches) {
  const auto name = "pipeline schedule '" + std::string(p.name) + "' ";
  const auto v = std::to_string(virtual_stages), m = std::to_string(microbatches);
  if (stages < 1 || virtual_stages < 1 || microbatches < 1)
    return name + "needs at least 1 stage, 1 chunk per stage and 1 micro-batch (got " + std::to_string(stages) + ", " + v +
           ", " + m + ")";
  if (accepts(p, stages, virtual_stages, microbatches)) return {};
  // The policies that take this very layout, as "a, b or c".
  std::vector<std::string_view> others;
  for (const auto& q : policy_table)
    if (accepts(q, stages, virtual_stages, microbatches)) others.push_back(q.name);
  std::string use;
  for (std::size_t i = 0; i < others.size(); ++i)
    use.append(i == 0 ? "" : i + 1 == others.size() ? " or " : ", ").append(others[i]);
  if (p.chunks == chunks_per_stage::one && virtual_stages != 1)
    return name + "runs one chunk per stage (virtual_stages = " + v + "): set virtual_stages = 1, or use " + use +
           ", which take " + v + " chunks per stage";
  if (p.chunks == chunks_per_stage::several && virtual_stages == 1)
    return name + "interleaves several chunks per stage (virtual_stages = 1): set virtual_stages = 2 or more, or use " +
           use + ", which run one chunk per stage";
  const int below = microbatches / stages * stages;
  return name + "needs the micro-batches (" + m + ") to be a multiple of the stages (" + std::to_string(stages) +
         "): use " + (below > 0 ? std::to_string(below) + " or " : "") + std::to_string(below + stages) +
         " micro-batches, or " + use + ", which take " + m + (microbatches == 1 ? " micro-batch" : " micro-batches");
}

namespace detail {

// An empty schedule named `name` of a problem that the policy `rules` accepts; its refusal otherwise.
inline schedule empty_schedule(const problem& p, std::string_view rules, std::string name) {
  p.check();
  const auto& info = *find_policy(rules);
  if (const auto why = refusal(info, p.stages, p.virtual_stages, p.microbatches); !why.empty())
    fail("pipeline problem '" + p.name + "': " + why);
  return schedule{std::move(name), info.split_backward, std::vector<std::vector<block>>(static_cast<std::size_t>(p.stages))};
}

} // namespace detail

/// @brief GPipe: all forwards, then all backwards (micro-batch order, backward fused). With
/// several chunks per stage, a stage runs its chunks' forwards in model order, then their
/// backwards in reverse: the order of one chunk per stage, each stage's chunks one after another.
[[nodiscard]] inline schedule gpipe(const problem& p) {
  auto s = detail::empty_schedule(p, "gpipe", "gpipe");
  for (int st = 0; st < p.stages; ++st) {
    auto& o = s.order[static_cast<std::size_t>(st)];
    for (int v = 0; v < p.virtual_stages; ++v)
      for (int m = 0; m < p.microbatches; ++m) o.push_back({v * p.stages + st, m, pass::forward});
    for (int v = p.virtual_stages; v-- > 0;)
      for (int m = 0; m < p.microbatches; ++m) o.push_back({v * p.stages + st, m, pass::input_grad});
  }
  return s;
}

/// @brief 1F1B (PipeDream-flush): warm-up forwards, one forward one backward, cool-down.
[[nodiscard]] inline schedule one_f_one_b(const problem& p) {
  auto s = detail::empty_schedule(p, "1f1b", "1f1b");
  for (int st = 0; st < p.stages; ++st) {
    auto& o = s.order[static_cast<std::size_t>(st)];
    const int M = p.microbatches, warm = std::min(p.stages - st - 1, M);
    for (int m = 0; m < warm; ++m) o.push_back({st, m, pass::forward});
    for (int i = 0; i < M - warm; ++i) {
      o.push_back({st, warm + i, pass::forward});
      o.push_back({st, i, pass::input_grad});
    }
    for (int m = M - warm; m < M; ++m) o.push_back({st, m, pass::input_grad});
  }
  return s;
}

/// @brief Megatron-LM's interleaved 1F1B over `virtual_stages` chunks per stage.
[[nodiscard]] inline schedule interleaved_one_f_one_b(const problem& p) {
  auto s = detail::empty_schedule(p, "interleaved_1f1b", "interleaved_1f1b");
  const int P = p.stages, V = p.virtual_stages, M = p.microbatches;
  const int steps = M * V;
  for (int st = 0; st < P; ++st) {
    const auto at = [&](int k, bool forward) {
      const int group = k / P;
      const int local = forward ? group % V : V - 1 - group % V;
      return block{local * P + st, (group / V) * P + k % P, forward ? pass::forward : pass::input_grad};
    };
    auto& o = s.order[static_cast<std::size_t>(st)];
    const int warm = std::min((P - st - 1) * 2 + (V - 1) * P, steps);
    for (int k = 0; k < warm; ++k) o.push_back(at(k, true));
    for (int i = 0; i < steps - warm; ++i) {
      o.push_back(at(warm + i, true));
      o.push_back(at(i, false));
    }
    for (int k = steps - warm; k < steps; ++k) o.push_back(at(k, false));
  }
  return s;
}

/// @brief 1F1B's order of F and B with the backward split and stage s's W passes deferred by
/// `deferral[s]` B passes: W(m) right after B(m + deferral[s]), the rest after the last B.
[[nodiscard]] inline schedule deferred_weight_grads(const problem& p, std::span<const int> deferral, std::string policy) {
  auto s = detail::empty_schedule(p, "zb_h1", std::move(policy)); // ZB-H1's layouts: 1F1B's, the backward split
  if (deferral.size() != static_cast<std::size_t>(p.stages))
    fail(s.policy + ": " + std::to_string(deferral.size()) + " deferrals for " + std::to_string(p.stages) + " stages");
  const auto base = one_f_one_b(p);
  for (int st = 0; st < p.stages; ++st) {
    auto& o = s.order[static_cast<std::size_t>(st)];
    int next_w = 0;
    for (const auto& b : base.order[static_cast<std::size_t>(st)]) {
      o.push_back(b);
      if (b.kind == pass::input_grad && b.microbatch - next_w >= deferral[static_cast<std::size_t>(st)])
        o.push_back({st, next_w++, pass::weight_grad});
    }
    while (next_w < p.microbatches) o.push_back({st, next_w++, pass::weight_grad});
  }
  return s;
}

/// @brief ZB-H1: 1F1B's order of F and B with the backward split, each stage s deferring its W
/// passes by s B passes (W(m) right after B(m + s), the rest after the last B). As the paper
/// puts it, W's start is delayed by the warm-up count so that every stage holds as many
/// micro-batches in flight (F's start to W's end) as 1F1B's first stage, and the deferred W's
/// fill the cool-down's bubbles: with equal F, B and W the bubble is a third of 1F1B's.
[[nodiscard]] inline schedule zb_h1(const problem& p) {
  std::vector<int> deferral(static_cast<std::size_t>(std::max(p.stages, 0)));
  std::iota(deferral.begin(), deferral.end(), 0);
  return deferred_weight_grads(p, deferral, "zb_h1");
}

/// @brief The pipeline baselines' names (the policies but the search), in the order reports list them.
[[nodiscard]] inline std::vector<std::string> baseline_names() {
  std::vector<std::string> out;
  for (const auto& p : policy_table)
    if (p.baseline) out.emplace_back(p.name);
  return out;
}

/// @brief A baseline by name. Throws concerto::error for an unknown name (listing the known
/// ones), for `concerto` (the search: `plan_concerto`), or a problem the policy cannot schedule
/// (saying why and what would).
[[nodiscard]] inline schedule baseline(std::string_view name, const problem& p) {
  const auto* info = find_policy(name);
  if (!info) fail("unknown pipeline policy '" + std::string(name) + "' (known: " + policy_list() + ")");
  if (!info->baseline) fail("pipeline policy '" + std::string(name) + "' is the search, not a baseline: call plan_concerto");
  return info->baseline(p);
}

/// @brief The same schedule with the backward split: each W right after its B (never slower:
/// the input gradient leaves W's time earlier, and memory is freed no later).
[[nodiscard]] inline schedule split_backward(const schedule& s) {
  if (s.split_backward) return s;
  schedule out{s.policy, true, {}};
  for (const auto& order : s.order) {
    auto& o = out.order.emplace_back();
    for (const auto& b : order) {
      o.push_back(b);
      if (b.kind == pass::input_grad) o.push_back({b.chunk, b.microbatch, pass::weight_grad});
    }
  }
  return out;
}

} // namespace concerto::pipeline
