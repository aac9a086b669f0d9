#pragma once
// What the training examples share: a comma-separated --policy compiles one step per policy on
// the same ranks, the examples run them in turn, and each plan's result (median measured step,
// the simulator's prediction, the plan's lower bound) goes to the examples' --json FILE (a JSON
// array), which bench/cluster/run reads; the terminal gets the human lines only.
#include <concerto/core/error.hpp>
#include <concerto/core/statistics.hpp>
#include <concerto/ir/graph.hpp>
#include <concerto/planner/policy.hpp>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <sstream>
#include <string>
#include <vector>

namespace examples {

/// The names of a comma-separated list given to `option` (--policy, or the GPT example's --schedule).
inline std::vector<std::string> split_policies(const std::string& list, const std::string& option = "--policy") {
  std::vector<std::string> out;
  std::stringstream in(list);
  for (std::string p; std::getline(in, p, ',');)
    if (!p.empty()) out.push_back(p);
  if (out.empty()) concerto::fail("option '" + option + "' needs at least one name");
  return out;
}

/// The plan policies of --policy's comma-separated list, each checked by name.
inline std::vector<concerto::planner::policy> plan_policies(const std::string& list) {
  std::vector<concerto::planner::policy> out;
  for (const auto& name : split_policies(list)) out.push_back(concerto::planner::parse_policy(name, "--policy"));
  return out;
}

/// Plans every step (collective): rank 0 prints each plan's summary and lower bound.
template <class Step>
void announce_plans(std::vector<Step>& runs, bool root) {
  for (auto& r : runs) {
    if (!root) {
      r.prepare();
      continue;
    }
    std::printf("%s\n", r.summary().text().c_str());
    std::printf("lower bound %.0f us (%s plan)\n", r.plan().stats.lower_bound_us, r.summary().policy.c_str());
  }
  if (root) std::fflush(stdout);
}

/// The result of one plan, for the examples' --json FILE: the example's own fields, then the
/// measured, predicted and bound times, and every step's time (`step_us`; `step_us[0]` is step 2,
/// the first warms caches). Prints the plan choice's line, when the step chose by measuring. Where the step chose its plan by measuring (train/plan_choice.hpp),
/// `median_step_us` is over the steps after the choice, the plan the job keeps, and
/// `median_step_us_choosing` over those before; `choice` says what was measured.
template <class Step>
nlohmann::json result_of(Step& run, nlohmann::json fields, const std::vector<double>& step_us,
                         const std::vector<double>& exposed_us) {
  constexpr std::int64_t first_measured_step = 2;
  const auto& sm = run.summary();
  fields["policy"] = sm.policy;
  fields["steps"] = step_us.size();
  fields["median_step_us"] = concerto::median(step_us);
  if (const auto& choice = run.choice(); choice.decided()) {
    fields["choice"] = choice.text();
    const auto& winner = choice.candidates[static_cast<std::size_t>(choice.winner)];
    fields["chosen"] = winner.name;
    fields["chosen_from_cache"] = choice.from_cache;
    fields["refit_predicted_us"] = winner.predicted_us; // the winner under the refitted model
    fields["choice_overhead_s"] = choice.planning_seconds + choice.switching_seconds + choice.trial_cost_us * 1e-6;
    const auto split = static_cast<std::size_t>(
        std::clamp<std::int64_t>(choice.decided_at_step + 1 - first_measured_step, 0, static_cast<std::int64_t>(step_us.size())));
    const std::vector<double> choosing(step_us.begin(), step_us.begin() + static_cast<std::ptrdiff_t>(split));
    const std::vector<double> kept(step_us.begin() + static_cast<std::ptrdiff_t>(split), step_us.end());
    fields["median_step_us_choosing"] = concerto::median(choosing);
    fields["steps_after_choice"] = kept.size();
    if (!kept.empty()) fields["median_step_us"] = concerto::median(kept);
    std::printf("%s\n", choice.text().c_str());
  }
  fields["median_exposed_comm_us"] = concerto::median(exposed_us);
  fields["predicted_us"] = sm.predicted_us;
  fields["sync_predicted_us"] = sm.sync_predicted_us;
  fields["lower_bound_us"] = run.plan().stats.lower_bound_us;
  // What the plan's collectives move per rank and step (a bf16 step: half of fp32's), over the
  // mesh axes that have more than one rank.
  const auto& g = run.plan().graph;
  double collective_bytes = 0;
  for (const auto& t : g.tasks)
    if (concerto::ir::is_collective(t.kind) && t.axis >= 0 && g.axes[static_cast<std::size_t>(t.axis)].size > 1)
      collective_bytes += t.bytes;
  fields["collective_bytes"] = collective_bytes;
  fields["step_us"] = step_us;
  return fields;
}

} // namespace examples
