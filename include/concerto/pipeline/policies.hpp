#pragma once
/// @file
/// @brief The baseline pipeline schedules, each from its paper's definition (docs/pipeline.md).
///
/// - `gpipe` (GPipe, Huang et al. 2019): every micro-batch's forward, then every backward.
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
#include <numeric>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace concerto::pipeline {

namespace detail {

// An empty schedule of a policy that runs one chunk per stage.
inline schedule one_chunk_per_stage(const problem& p, std::string policy, bool split) {
  p.check();
  if (p.virtual_stages != 1)
    fail(policy + " runs one chunk per stage; problem '" + p.name + "' has " + std::to_string(p.virtual_stages));
  return schedule{std::move(policy), split, std::vector<std::vector<block>>(static_cast<std::size_t>(p.stages))};
}

} // namespace detail

/// @brief GPipe: all forwards, then all backwards (micro-batch order, backward fused).
[[nodiscard]] inline schedule gpipe(const problem& p) {
  auto s = detail::one_chunk_per_stage(p, "gpipe", false);
  for (int st = 0; st < p.stages; ++st) {
    auto& o = s.order[static_cast<std::size_t>(st)];
    for (int m = 0; m < p.microbatches; ++m) o.push_back({st, m, pass::forward});
    for (int m = 0; m < p.microbatches; ++m) o.push_back({st, m, pass::input_grad});
  }
  return s;
}

/// @brief 1F1B (PipeDream-flush): warm-up forwards, one forward one backward, cool-down.
[[nodiscard]] inline schedule one_f_one_b(const problem& p) {
  auto s = detail::one_chunk_per_stage(p, "1f1b", false);
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
  p.check();
  const int P = p.stages, V = p.virtual_stages, M = p.microbatches;
  if (V < 2) fail("interleaved_1f1b needs at least 2 chunks per stage; problem '" + p.name + "' has 1");
  if (M % P != 0)
    fail("interleaved_1f1b needs the micro-batches (" + std::to_string(M) + ") to be a multiple of the stages (" +
         std::to_string(P) + ")");
  schedule s{"interleaved_1f1b", false, std::vector<std::vector<block>>(static_cast<std::size_t>(P))};
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
  auto s = detail::one_chunk_per_stage(p, std::move(policy), true);
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

/// @brief The pipeline baselines' names, in the order reports list them.
[[nodiscard]] inline std::vector<std::string> baseline_names() { return {"gpipe", "1f1b", "interleaved_1f1b", "zb_h1"}; }

/// @brief A baseline by name. Throws concerto::error for an unknown name (listing the known
/// ones) or a problem the policy cannot schedule (saying why).
[[nodiscard]] inline schedule baseline(std::string_view name, const problem& p) {
  if (name == "gpipe") return gpipe(p);
  if (name == "1f1b") return one_f_one_b(p);
  if (name == "interleaved_1f1b") return interleaved_one_f_one_b(p);
  if (name == "zb_h1") return zb_h1(p);
  std::string known;
  for (const auto& n : baseline_names()) known += (known.empty() ? "" : ", ") + n;
  fail("unknown pipeline policy '" + std::string(name) + "' (known: " + known + ", concerto)");
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
