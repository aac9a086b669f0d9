#pragma once
/// @file
/// @brief Lower bounds on the step time of any schedule of a graph, given task durations.
///
/// Each stream runs one task at a time, and a task starts after its dependencies end. Three
/// bounds follow, each cheap:
/// - stream work: a stream is busy for at least the sum of its tasks' durations;
/// - critical path: the longest chain of dependencies;
/// - one machine: per stream, the optimal *preemptive* schedule of its tasks with release
///   times (head) and tails. A task's head is the longest path from the graph's start to it,
///   or, when larger, the work of its ancestors on any one stream (they all end before it
///   starts and run one at a time); its tail likewise, after it, with its descendants.
///   Jackson's preemptive rule (run the released task with the largest tail) is optimal for
///   that relaxation, so its makespan-plus-tail bounds every real schedule. It is never below
///   the other two, and exceeds them when a stream's tasks are released late or must leave
///   long tails behind them (a gradient lane: its first reduction waits for the whole forward
///   on the compute stream, however parallel the graph's branches).

#include <concerto/ir/graph.hpp>

#include <algorithm>
#include <array>
#include <bit>
#include <cstdint>
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

// For each task, the largest total duration on one stream of its ancestors (`after` false) or
// descendants (`after` true), from ancestor sets as bitsets: n²/8 bytes, so large graphs
// (above `max_tasks`) get zeros and keep the path bounds alone.
inline std::vector<double> stream_work_around(const ir::graph& g, std::span<const double> durations_us,
                                              const std::vector<ir::task_id>& order, bool after,
                                              std::size_t max_tasks = 24000) {
  const auto n = g.tasks.size();
  std::vector<double> out(n, 0);
  if (n == 0 || n > max_tasks) return out;
  const std::size_t words = (n + 63) / 64;
  std::vector<std::uint64_t> sets(n * words, 0);
  const auto row = [&](std::size_t t) { return sets.data() + t * words; };
  // Predecessor lists in the direction of the walk: deps for ancestors, users for descendants.
  std::vector<std::vector<std::size_t>> from(n);
  for (std::size_t t = 0; t < n; ++t)
    for (const auto d : g.tasks[t].deps) {
      const auto di = static_cast<std::size_t>(d);
      if (after) from[di].push_back(t);
      else from[t].push_back(di);
    }
  std::vector<double> per_stream(g.streams.size());
  const auto visit = [&](std::size_t t) {
    auto* mine = row(t);
    for (const auto p : from[t]) {
      const auto* theirs = row(p);
      for (std::size_t w = 0; w < words; ++w) mine[w] |= theirs[w];
      mine[p / 64] |= std::uint64_t{1} << (p % 64);
    }
    std::fill(per_stream.begin(), per_stream.end(), 0.0);
    for (std::size_t w = 0; w < words; ++w)
      for (auto bits = mine[w]; bits != 0; bits &= bits - 1) {
        const auto a = w * 64 + static_cast<std::size_t>(std::countr_zero(bits));
        per_stream[static_cast<std::size_t>(g.tasks[a].stream)] += durations_us[a];
      }
    out[t] = *std::max_element(per_stream.begin(), per_stream.end());
  };
  if (after)
    for (auto it = order.rbegin(); it != order.rend(); ++it) visit(static_cast<std::size_t>(*it));
  else
    for (const auto t : order) visit(static_cast<std::size_t>(t));
  return out;
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
  for (std::size_t i = 0; i < n; ++i) lb.critical_path_us = std::max(lb.critical_path_us, head[i] + durations_us[i]);
  if (!g.streams.empty()) {
    const auto before = detail::stream_work_around(g, durations_us, order, false);
    const auto after = detail::stream_work_around(g, durations_us, order, true);
    for (std::size_t i = 0; i < n; ++i) {
      head[i] = std::max(head[i], before[i]);
      tail[i] = std::max(tail[i], after[i]);
    }
  }
  std::vector<double> work(g.streams.size(), 0);
  std::vector<std::vector<std::array<double, 3>>> jobs(g.streams.size());
  for (std::size_t i = 0; i < n; ++i) {
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
