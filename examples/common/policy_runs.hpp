#pragma once
// What the training examples share: a comma-separated --policy compiles one step per policy on
// the same ranks, the examples run them in turn, and each plan ends with one "result {json}"
// line (median measured step, the simulator's prediction, the plan's lower bound), which
// bench/cluster/run reads.
#include <concerto/core/error.hpp>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstdio>
#include <sstream>
#include <string>
#include <vector>

namespace examples {

inline std::vector<std::string> split_policies(const std::string& list) {
  std::vector<std::string> out;
  std::stringstream in(list);
  for (std::string p; std::getline(in, p, ',');)
    if (!p.empty()) out.push_back(p);
  if (out.empty()) concerto::fail("option '--policy' needs at least one policy name");
  return out;
}

inline double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v.size() % 2 ? v[v.size() / 2] : 0.5 * (v[v.size() / 2 - 1] + v[v.size() / 2]);
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

/// The "result {json}" line of one plan: the example's own fields, then the measured, predicted
/// and bound times. Returns the same fields with every step's time (`step_us`), which the line
/// leaves out to stay short (the examples' --json FILE writes them).
template <class Step>
nlohmann::json print_result(Step& run, nlohmann::json fields, const std::vector<double>& step_us,
                  const std::vector<double>& exposed_us) {
  const auto& sm = run.summary();
  fields["policy"] = sm.policy;
  fields["steps"] = step_us.size();
  fields["median_step_us"] = median(step_us);
  fields["median_exposed_comm_us"] = median(exposed_us);
  fields["predicted_us"] = sm.predicted_us;
  fields["sync_predicted_us"] = sm.sync_predicted_us;
  fields["lower_bound_us"] = run.plan().stats.lower_bound_us;
  std::printf("result %s\n", fields.dump().c_str());
  fields["step_us"] = step_us;
  return fields;
}

} // namespace examples
