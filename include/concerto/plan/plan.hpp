#pragma once
/// @file
/// @brief A plan: the (possibly rewritten) task graph, one total order per stream, and the
/// start time and duration of every task as the planner predicted them.
///
/// The simulator, the MPI executor and the NCCL executor all consume this object; its JSON
/// (plan/json.hpp) is readable without the library.

#include <concerto/ir/graph.hpp>

#include <string>
#include <vector>

namespace concerto::plan {

/// @brief What a planner reports about how it made a plan.
struct plan_stats {
  double plan_seconds = 0;      ///< wall time spent planning
  double lower_bound_us = 0;    ///< the lower bound the plan is compared with
  int windows_total = 0;        ///< solver windows attempted (0 for list schedulers)
  int windows_optimal = 0;      ///< windows solved to proven optimality
  friend bool operator==(const plan_stats&, const plan_stats&) = default;
};

/// @brief A schedule of one training step.
struct plan {
  ir::graph graph;
  std::vector<std::vector<ir::task_id>> order; ///< per stream, the tasks in execution order
  std::vector<double> start_us;                ///< per task, predicted start time
  std::vector<double> duration_us;             ///< per task, predicted duration (contention included)
  std::string policy;                          ///< sync, program_order, xla_lhs, concerto, ...
  std::string preset;                          ///< cost-model preset the durations come from
  plan_stats stats;
  friend bool operator==(const plan&, const plan&) = default;

  /// Predicted step time: the end of the last task.
  [[nodiscard]] double step_us() const noexcept {
    double end = 0;
    for (std::size_t i = 0; i < start_us.size() && i < duration_us.size(); ++i)
      end = std::max(end, start_us[i] + duration_us[i]);
    return end;
  }
};

} // namespace concerto::plan
