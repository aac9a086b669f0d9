#pragma once
/// @file
/// @brief Choosing the plan by measurement during the first steps of a job (never worse,
/// measured): the options, the report, and the arithmetic train::step uses to run it.
///
/// A plan is only as good as the cost model it was made with. So a `concerto` step, by default:
///
/// 1. runs its first plan for `warmup_steps` unmeasured and `profile_steps` measured steps;
/// 2. refits the cost model to what every rank measured (planner/refit.hpp: per-kernel factors,
///    alpha and bandwidth per link class, overlap slowdowns; each task's duration the mean over
///    ranks) and re-plans with it;
/// 3. runs the candidates (the first plan, the re-planned one, the best baseline under the
///    refitted model, every list baseline, and any `also_try` policies; duplicates dropped) for
///    `trial_steps` steps each, `rounds` times, interleaved so that a drift of the machine
///    falls on all of them;
/// 4. rank 0 takes each trial step's time as its slowest rank's, the median per candidate, and
///    broadcasts the fastest; every rank switches to it at the same step, before any collective
///    of the new plan. The plans compute the same sums (chunked ones in another order), and the
///    parameters and optimizer state move over by name, so training goes on as it would have,
///    up to rounding;
/// 5. with the plan cache on, the winner is stored with what was measured, the refitted model
///    and the plans it beat, and the next run of the same job starts from it. Where some plans
///    it beat measured within `confirm_within` of it, that run measures them again, the same
///    way, after its warm-up steps (a ranking of plans within 10-30% of each other did
///    not carry from one launch to the next on the emulated cluster); otherwise it chooses
///    nothing.
///
/// The list baselines (sync, program_order, xla_lhs) are always candidates: the promise is to
/// be no slower than any of them, and a model that mispriced the first plan may misrank them.
/// On a stream-ordered backend (GPU) the executor sees when tasks were issued, not when they
/// ran, so nothing is refitted there: the candidates are the first plan and the baselines,
/// judged by their measured steps (the step's end is synchronised).

#include <concerto/core/error.hpp>
#include <concerto/core/statistics.hpp>
#include <concerto/ir/graph.hpp>
#include <concerto/planner/policy.hpp>
#include <concerto/planner/refit.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <limits>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace concerto::train {

/// @brief How the first steps choose the plan the job keeps (file comment). Only the
/// `concerto` policy chooses: a step given another policy runs that policy's plan.
struct plan_choice_options {
  /// CONCERTO_CHOOSE_PLAN=0 or 1, when set, overrides it.
  bool enabled = true;
  int warmup_steps = 1;  ///< steps not measured (first use of the buffers, the communicators)
  int profile_steps = 3; ///< measured steps of the first plan that the refit reads
  int trial_steps = 2;   ///< measured steps per candidate per round
  int rounds = 3;        ///< interleaved rounds over the candidates
  std::vector<planner::policy> also_try; ///< more policies to measure
  /// A run starting from an earlier run's winner measures it again against the plans it beat
  /// by less than this factor (their medians then); 1 trusts the earlier run.
  double confirm_within = 1.25;
  /// Experiments and tests: the step time this rank reports for a trial step of a candidate.
  std::function<double(int rank, std::string_view candidate, double step_us)> adjust_measured;
};

/// @brief What the choice measured and decided (the same on every rank).
struct plan_choice_report {
  struct candidate {
    std::string name;          ///< "concerto", "concerto (re-planned)", "program_order", ...
    std::string plan_hash;     ///< plan::hash, hex
    double predicted_us = 0;   ///< under the refitted model (the first model where nothing was refitted)
    double measured_us = 0;    ///< median over its trial steps of the slowest rank's step
    int steps = 0;             ///< trial steps measured
  };
  std::vector<candidate> candidates;
  int winner = -1;                  ///< index into candidates; -1 while nothing is decided
  std::int64_t decided_at_step = 0; ///< the last step of the choice; later steps run the winner
  bool from_cache = false;          ///< the winner of an earlier run of this job, read from the plan cache
  bool confirmed = false;           ///< an earlier run's winner measured again against its closest rivals
  std::string refit;                ///< planner::refit_result::text(), empty when nothing was refitted
  double planning_seconds = 0;      ///< refit, re-planning, and sending the plans (slowest rank)
  double switching_seconds = 0;     ///< rebuilding executors between candidates (slowest rank)
  /// Time the trial steps of the other candidates cost over the winner's median.
  double trial_cost_us = 0;

  [[nodiscard]] bool decided() const noexcept { return winner >= 0; }

  /// "plan choice at step 22: kept 'concerto (re-planned)' 812 us, vs 'concerto' 850 us, ...".
  [[nodiscard]] std::string text() const {
    if (!decided()) return "plan choice: nothing decided";
    const auto& w = candidates[static_cast<std::size_t>(winner)];
    char buf[160];
    std::string out;
    if (from_cache) {
      std::snprintf(buf, sizeof buf, "plan choice: '%s' from the plan cache (measured %.0f us when it was chosen)",
                    w.name.c_str(), w.measured_us);
      return buf;
    }
    std::snprintf(buf, sizeof buf, "plan choice at step %lld%s: kept '%s' %.0f us", static_cast<long long>(decided_at_step),
                  confirmed ? " (an earlier run's pick, measured again)" : "", w.name.c_str(), w.measured_us);
    out = buf;
    for (std::size_t i = 0; i < candidates.size(); ++i) {
      if (static_cast<int>(i) == winner) continue;
      std::snprintf(buf, sizeof buf, "%s'%s' %.0f us (%.2fx)", out.find(" vs ") == std::string::npos ? ", vs " : ", ",
                    candidates[i].name.c_str(), candidates[i].measured_us,
                    w.measured_us > 0 ? candidates[i].measured_us / w.measured_us : 0.0);
      out += buf;
    }
    std::snprintf(buf, sizeof buf, " (medians of %d steps); overhead %.2f s planning, %.2f s switching, %.2f s trying",
                  w.steps, planning_seconds, switching_seconds, trial_cost_us * 1e-6);
    out += buf;
    if (!refit.empty()) out.append("; ").append(refit);
    return out;
  }
};

namespace detail {

/// The candidate each trial step runs: `rounds` rounds, each over every candidate for
/// `trial_steps` steps, round r starting at candidate r (mod the count), so that no candidate
/// always runs first or right after the same other one.
[[nodiscard]] inline std::vector<int> trial_order(int candidates, int rounds, int trial_steps) {
  std::vector<int> order;
  for (int r = 0; r < rounds; ++r)
    for (int i = 0; i < candidates; ++i)
      for (int s = 0; s < trial_steps; ++s) order.push_back((i + r) % candidates);
  return order;
}

/// The decision of rank 0: `times` holds every rank's trial step times (rank-major, one per
/// entry of `order`); a step took what its slowest rank took; the candidate with the lowest
/// median wins, the earlier one on a tie (the first plan before the others). Returns the
/// median per candidate (NaN for one never run), the winner, and what the other candidates'
/// steps took beyond the winner's median.
struct trial_verdict {
  std::vector<double> median_us;
  std::vector<int> steps;
  int winner = -1;
  double excess_us = 0;
};
[[nodiscard]] inline trial_verdict judge_trials(std::span<const int> order, std::span<const double> times, int ranks,
                                                int candidates) {
  if (ranks < 1 || times.size() != order.size() * static_cast<std::size_t>(ranks))
    fail("plan choice: " + std::to_string(times.size()) + " trial times for " + std::to_string(order.size()) +
         " steps on " + std::to_string(ranks) + " ranks");
  std::vector<std::vector<double>> per(static_cast<std::size_t>(candidates));
  std::vector<double> slowest(order.size(), 0.0);
  for (std::size_t s = 0; s < order.size(); ++s) {
    for (int r = 0; r < ranks; ++r) slowest[s] = std::max(slowest[s], times[static_cast<std::size_t>(r) * order.size() + s]);
    per.at(static_cast<std::size_t>(order[s])).push_back(slowest[s]);
  }
  trial_verdict v;
  for (int c = 0; c < candidates; ++c) {
    auto& t = per[static_cast<std::size_t>(c)];
    v.steps.push_back(static_cast<int>(t.size()));
    v.median_us.push_back(t.empty() ? std::numeric_limits<double>::quiet_NaN() : concerto::median(t));
    if (!t.empty() && (v.winner < 0 || v.median_us.back() < v.median_us[static_cast<std::size_t>(v.winner)])) v.winner = c;
  }
  for (std::size_t s = 0; s < order.size(); ++s)
    if (order[s] != v.winner) v.excess_us += slowest[s] - v.median_us[static_cast<std::size_t>(v.winner)];
  return v;
}

/// Which candidates of an earlier choice its winner is measured against again: those whose
/// median was below `within` times the winner's (never run: NaN or 0, not close), fastest first.
[[nodiscard]] inline std::vector<std::size_t> close_rivals(std::span<const double> median_us, std::size_t winner,
                                                           double within) {
  std::vector<std::size_t> out;
  for (std::size_t i = 0; i < median_us.size(); ++i)
    if (i != winner && median_us[i] > 0 && median_us[i] < within * median_us[winner]) out.push_back(i);
  std::stable_sort(out.begin(), out.end(), [&](std::size_t a, std::size_t b) { return median_us[a] < median_us[b]; });
  return out;
}

/// One rank's observation packed for an all-gather: durations, overlapped shares, step.
[[nodiscard]] inline std::vector<double> pack(const planner::observation& o) {
  std::vector<double> out;
  out.reserve(2 * o.tasks.size() + 1);
  for (const auto& t : o.tasks) out.push_back(t.duration_us);
  for (const auto& t : o.tasks) out.push_back(t.overlapped);
  out.push_back(o.step_us);
  return out;
}

/// Every rank's packed observation (rank-major) as one: each task's duration and overlapped
/// share are the means over ranks, and the step is the slowest rank's. A collective's duration
/// on a rank includes its wait for the ranks that arrived later: the step pays those waits and
/// the simulator replays one rank for all, so the mean is what makes it predict the step. (The
/// least waiting rank's durations, the collectives' own speed, predicted the GPT example's step
/// 30-35% short on 4 ranks; the means 10-16% long.)
[[nodiscard]] inline planner::observation combine(const ir::graph& g, std::span<const double> all, int ranks, int steps) {
  const auto n = g.tasks.size();
  const auto width = 2 * n + 1;
  if (ranks < 1 || all.size() != width * static_cast<std::size_t>(ranks))
    fail("plan choice: " + std::to_string(all.size()) + " measured values from " + std::to_string(ranks) +
         " ranks for graph '" + g.name + "' of " + std::to_string(n) + " tasks");
  const auto at = [&](int r, std::size_t i) { return all[static_cast<std::size_t>(r) * width + i]; };
  planner::observation o;
  o.steps = steps;
  o.tasks.resize(n);
  for (std::size_t i = 0; i < n; ++i)
    for (int r = 0; r < ranks; ++r) o.tasks[i].duration_us += at(r, i) / ranks, o.tasks[i].overlapped += at(r, n + i) / ranks;
  for (int r = 0; r < ranks; ++r) o.step_us = std::max(o.step_us, at(r, 2 * n));
  return o;
}

} // namespace detail
} // namespace concerto::train
