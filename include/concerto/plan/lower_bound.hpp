#pragma once
/// @file
/// @brief Lower bounds on the step time of any schedule of a graph, given task durations.
///
/// Each stream runs one task at a time, and a task starts after its dependencies end. Three
/// bounds follow, each cheap:
/// - stream work: a stream is busy for at least the sum of its tasks' durations;
/// - critical path: the longest chain of dependencies;
/// - one machine: per stream, the optimal *preemptive* schedule of its tasks with release
///   times (head: longest path from the graph's start to the task) and tails (longest path
///   after it). Jackson's preemptive rule (run the released task with the largest tail)
///   is optimal for that relaxation, so its makespan-plus-tail bounds every real schedule.
///   It is never below the other two, and exceeds them when a stream's tasks are released
///   late or must leave long tails behind them.

#include <concerto/ir/graph.hpp>

#include <algorithm>
#include <array>
#include <cmath>
#include <limits>
#include <queue>
#include <span>
#include <string>
#include <utility>
#include <vector>

namespace concerto::plan {

/// @brief The bounds, in microseconds; `value` is the largest.
struct lower_bound {
  double stream_work_us = 0;
  double critical_path_us = 0;
  double one_machine_us = 0;
  double value = 0;
};

namespace detail {

/// Jackson's preemptive schedule on one machine: max over jobs of completion + tail.
/// Jobs are (head, duration, tail). Preemption only happens at release times, so the loop
/// runs O(n) steps with a heap: O(n log n).
inline double jackson_preemptive(std::vector<std::array<double, 3>> jobs) {
  std::sort(jobs.begin(), jobs.end(), [](const auto& a, const auto& b) { return a[0] < b[0]; });
  using entry = std::pair<double, double>; // (tail, remaining duration); the largest tail first
  std::priority_queue<entry> ready;
  double now = 0, best = 0;
  std::size_t next = 0;
  while (next < jobs.size() || !ready.empty()) {
    if (ready.empty()) now = std::max(now, jobs[next][0]);
    while (next < jobs.size() && jobs[next][0] <= now) {
      ready.push({jobs[next][2], jobs[next][1]});
      ++next;
    }
    auto [tail, remaining] = ready.top();
    ready.pop();
    const double next_release = next < jobs.size() ? jobs[next][0] : std::numeric_limits<double>::infinity();
    if (now + remaining <= next_release) {
      now += remaining;
      best = std::max(best, now + tail);
    } else { // a new release may have a larger tail: run until it, then choose again
      remaining -= next_release - now;
      now = next_release;
      ready.push({tail, remaining});
    }
  }
  return best;
}

} // namespace detail

/// @brief Bounds on the step time of any schedule of `g` with the given per-task durations.
/// @code
/// auto lb = plan::compute_lower_bound(graph, durations);
/// std::printf("%.1f us is at least %.2fx the bound\n", p.step_us(), p.step_us() / lb.value);
/// @endcode
[[nodiscard]] inline lower_bound compute_lower_bound(const ir::graph& g, std::span<const double> durations_us) {
  const auto n = g.tasks.size();
  if (durations_us.size() != n)
    fail("lower bound of graph '" + g.name + "': " + std::to_string(durations_us.size()) +
         " durations given for " + std::to_string(n) + " tasks");
  for (std::size_t i = 0; i < n; ++i)
    if (!(durations_us[i] >= 0) || !std::isfinite(durations_us[i]))
      fail("lower bound of graph '" + g.name + "': task " + std::to_string(i) + " '" + g.tasks[i].name +
           "' has duration " + std::to_string(durations_us[i]) + " us");
  g.validate(); // the bounds walk deps and streams by index
  const auto order = g.topological_order();
  std::vector<double> head(n, 0), tail(n, 0);
  for (const auto t : order)
    for (const auto d : g.tasks[static_cast<std::size_t>(t)].deps) {
      const auto di = static_cast<std::size_t>(d);
      head[static_cast<std::size_t>(t)] = std::max(head[static_cast<std::size_t>(t)], head[di] + durations_us[di]);
    }
  for (auto it = order.rbegin(); it != order.rend(); ++it) {
    const auto ti = static_cast<std::size_t>(*it);
    for (const auto d : g.tasks[ti].deps) {
      const auto di = static_cast<std::size_t>(d);
      tail[di] = std::max(tail[di], durations_us[ti] + tail[ti]);
    }
  }

  lower_bound lb;
  std::vector<double> work(g.streams.size(), 0);
  std::vector<std::vector<std::array<double, 3>>> jobs(g.streams.size());
  for (std::size_t i = 0; i < n; ++i) {
    lb.critical_path_us = std::max(lb.critical_path_us, head[i] + durations_us[i]);
    const auto s = static_cast<std::size_t>(g.tasks[i].stream);
    work[s] += durations_us[i];
    jobs[s].push_back({head[i], durations_us[i], tail[i]});
  }
  for (std::size_t s = 0; s < g.streams.size(); ++s) {
    lb.stream_work_us = std::max(lb.stream_work_us, work[s]);
    lb.one_machine_us = std::max(lb.one_machine_us, detail::jackson_preemptive(std::move(jobs[s])));
  }
  lb.value = std::max({lb.stream_work_us, lb.critical_path_us, lb.one_machine_us});
  return lb;
}

} // namespace concerto::plan
