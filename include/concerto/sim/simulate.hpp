#pragma once
/// @file
/// @brief Discrete-event replay of a schedule: per-stream orders plus the graph's dependencies,
/// with compute slowed while collectives run. Gives the step time, the exposed communication
/// and a timeline.
///
/// The planner judges thousands of candidate schedules with it, so it allocates only vectors
/// sized once per call and spends O(S) per event (S streams: compute plus one lane per mesh
/// axis, a handful), i.e. O(n·S + e) for n tasks and e dependency edges.
///
/// Semantics (docs/simulator.md has the long form):
/// - each stream runs its tasks one at a time, strictly in its order; a task starts as soon as
///   the previous task of its stream and all its dependencies have ended;
/// - while at least one collective runs (on any lane), compute tasks progress at rate
///   1/overlap_slowdown; their remaining work is tracked, so a task that overlaps a collective
///   for part of its run is slowed only for that part. Collectives are never slowed;
/// - exposed communication is time when a collective runs and the compute stream is idle.

#include <concerto/core/error.hpp>
#include <concerto/ir/graph.hpp>
#include <concerto/plan/plan.hpp>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <limits>
#include <span>
#include <string>
#include <utility>
#include <vector>

namespace concerto::sim {

/// @brief One task's run on its stream.
struct interval {
  ir::task_id task = -1;
  ir::stream_id stream = 0;
  double start_us = 0;
  double end_us = 0;
  friend bool operator==(const interval&, const interval&) = default;
};

/// @brief What a replay predicts.
struct result {
  double step_us = 0;                   ///< end of the last task
  std::vector<double> start_us, end_us; ///< per task id
  std::vector<double> busy_us;          ///< per stream: total time the stream runs a task
  std::vector<double> exposed_us;       ///< per stream (0 for compute): time the lane runs a task while
                                        ///< the compute stream is idle
  double exposed_comm_us = 0;           ///< time when some collective runs and compute is idle (union
                                        ///< over lanes, so at most the sum of exposed_us)
  std::vector<interval> timeline;       ///< one per task, sorted by start (ties: by stream)
};

/// @brief How much overlapped work slows down: compute while any collective is in flight, and a
/// collective while a compute task runs (on a CPU cluster the network stack needs the cores the
/// kernels use; on a GPU the collective's kernels share the SMs). Both >= 1; a plain number
/// converts to compute-only contention.
struct contention {
  double compute = 1.0;
  double comm = 1.0;
  contention(double compute_slowdown = 1.0, double comm_slowdown = 1.0) noexcept // NOLINT: implicit on purpose
      : compute(compute_slowdown), comm(comm_slowdown) {}
  friend bool operator==(const contention&, const contention&) = default;
};

namespace detail {

inline std::string task_label(const ir::graph& g, ir::task_id id) {
  return "task " + std::to_string(id) + " '" + g.tasks[static_cast<std::size_t>(id)].name + "'";
}

inline std::string stream_label(const ir::graph& g, std::size_t s) {
  return "stream '" + (s < g.streams.size() ? g.streams[s].name : std::to_string(s)) + "'";
}

/// Every task of a stream exactly once in that stream's order, nothing foreign.
inline void check_orders(const ir::graph& g, const std::vector<std::vector<ir::task_id>>& order) {
  const auto n = g.tasks.size();
  if (order.size() > g.streams.size())
    fail("simulate: the schedule has orders for " + std::to_string(order.size()) + " streams, graph '" + g.name +
         "' has " + std::to_string(g.streams.size()));
  std::vector<char> seen(n, 0);
  for (std::size_t s = 0; s < order.size(); ++s) {
    for (const auto id : order[s]) {
      if (id < 0 || static_cast<std::size_t>(id) >= n)
        fail("simulate: the order of " + stream_label(g, s) + " holds task id " + std::to_string(id) +
             ", which does not exist (graph '" + g.name + "' has " + std::to_string(n) + " tasks)");
      const auto& t = g.tasks[static_cast<std::size_t>(id)];
      if (static_cast<std::size_t>(t.stream) != s)
        fail("simulate: " + task_label(g, id) + " runs on " + stream_label(g, static_cast<std::size_t>(t.stream)) +
             " but is placed in the order of " + stream_label(g, s));
      if (seen[static_cast<std::size_t>(id)]++)
        fail("simulate: " + task_label(g, id) + " appears twice in the order of " + stream_label(g, s));
    }
  }
  for (std::size_t i = 0; i < n; ++i)
    if (!seen[i])
      fail("simulate: " + task_label(g, static_cast<ir::task_id>(i)) + " (" +
           stream_label(g, static_cast<std::size_t>(g.tasks[i].stream)) + ") is missing from the order");
}

/// The graph is not validated as a whole (that costs a topological sort per call); only what
/// would make the replay read out of bounds is checked. A cycle shows up as a deadlock.
inline void check_inputs(const ir::graph& g, std::span<const double> durations_us, const contention& slowdown,
                         std::span<const std::pair<ir::task_id, ir::task_id>> extra_deps) {
  const auto check_factor = [](double v, std::string what) {
    if (v >= 1.0 && std::isfinite(v)) return;
    what += " is ";
    what += std::to_string(v); // appended, not `"..." + to_string`: g++ 12 warns falsely (-Wrestrict) there
    fail("simulate: " + what + "; it must be finite and >= 1");
  };
  check_factor(slowdown.compute, "overlap_slowdown");
  check_factor(slowdown.comm, "the collectives' overlap slowdown");
  if (durations_us.size() != g.tasks.size())
    fail("simulate: " + std::to_string(durations_us.size()) + " durations given for graph '" + g.name + "' with " +
         std::to_string(g.tasks.size()) + " tasks");
  const auto n = static_cast<ir::task_id>(g.tasks.size());
  for (std::size_t i = 0; i < g.tasks.size(); ++i) {
    const auto& t = g.tasks[i];
    const auto id = static_cast<ir::task_id>(i);
    if (t.stream < 0 || static_cast<std::size_t>(t.stream) >= g.streams.size())
      fail("simulate: " + task_label(g, id) + " runs on stream " + std::to_string(t.stream) + ", which does not exist");
    for (const auto d : t.deps)
      if (d < 0 || d >= n)
        fail("simulate: " + task_label(g, id) + " depends on task " + std::to_string(d) + ", which does not exist");
    if (!(durations_us[i] >= 0) || !std::isfinite(durations_us[i]))
      fail("simulate: " + task_label(g, id) + " has duration " + std::to_string(durations_us[i]) +
           " us; durations must be finite and >= 0");
  }
  for (const auto& [earlier, later] : extra_deps)
    if (earlier < 0 || later < 0 || earlier >= n || later >= n)
      fail("simulate: an added dependency names task " + std::to_string(std::max(earlier, later)) + " of graph '" + g.name +
           "', which has " + std::to_string(n) + " tasks");
}

// Cold and out of line: built inline into simulate, its message makes g++ 12 warn falsely
// (-Wrestrict) about the strings.
[[noreturn, gnu::cold, gnu::noinline]] inline void report_deadlock(const ir::graph& g, const std::vector<std::vector<ir::task_id>>& order,
                                         const std::vector<std::size_t>& pos, const std::vector<char>& done,
                                         double now) {
  std::string msg = "simulate: deadlock at t=" + std::to_string(now) +
                    " us: the per-stream orders and the dependencies leave no stream able to start its next task;";
  for (std::size_t s = 0; s < order.size(); ++s) {
    if (pos[s] >= order[s].size()) continue;
    const auto head = order[s][pos[s]];
    msg += " " + stream_label(g, s) + " waits at " + task_label(g, head) + " for";
    int listed = 0, unlisted = 0;
    for (const auto d : g.tasks[static_cast<std::size_t>(head)].deps) {
      if (done[static_cast<std::size_t>(d)]) continue;
      if (listed == 4) {
        ++unlisted;
        continue;
      }
      msg += (listed++ ? ", " : " ") + task_label(g, d) + " (" +
             stream_label(g, static_cast<std::size_t>(g.tasks[static_cast<std::size_t>(d)].stream)) +
             ", not started)";
    }
    if (unlisted) msg += " and " + std::to_string(unlisted) + " more";
    msg += ";";
  }
  msg.pop_back();
  fail(msg);
}

} // namespace detail

/// @brief Replays a schedule: `order[s]` is the execution order of stream s (a missing trailing
/// entry means an empty stream), `durations_us[i]` the uncontended duration of task i.
///
/// Throws concerto::error naming the task when an order misses a task, repeats one, or holds
/// a task of another stream; when a duration is negative; and on a deadlock (naming each
/// blocked stream's next task and what it waits for).
///
/// @code
/// std::vector<double> d{10.0, 6.0};                     // a compute task and an all-reduce
/// auto r = sim::simulate(g, {{0}, {1}}, d, 1.5);        // both start at t=0
/// // compute runs 6 us at rate 1/1.5 (4 us of work), then 6 us alone: r.end_us[0] == 12
/// @endcode
/// `extra_deps` are (earlier, later) edges a schedule adds to the graph's (planner::xla_lhs_orders'
/// cap on collectives in flight), replayed without copying the graph.
[[nodiscard]] inline result simulate(const ir::graph& g, const std::vector<std::vector<ir::task_id>>& order,
                                     std::span<const double> durations_us, contention overlap_slowdown = {},
                                     std::span<const std::pair<ir::task_id, ir::task_id>> extra_deps = {}) {
  detail::check_inputs(g, durations_us, overlap_slowdown, extra_deps);
  detail::check_orders(g, order);

  const std::size_t n = g.tasks.size();
  const std::size_t streams = g.streams.size();

  // Successors as one flat array (CSR): no per-task vectors.
  std::vector<std::size_t> succ_begin(n + 1, 0);
  std::vector<int> pending(n, 0);
  for (const auto& t : g.tasks) {
    pending[static_cast<std::size_t>(t.id)] = static_cast<int>(t.deps.size());
    for (const auto d : t.deps) ++succ_begin[static_cast<std::size_t>(d) + 1];
  }
  for (const auto& [earlier, later] : extra_deps) {
    ++pending[static_cast<std::size_t>(later)];
    ++succ_begin[static_cast<std::size_t>(earlier) + 1];
  }
  for (std::size_t i = 0; i < n; ++i) succ_begin[i + 1] += succ_begin[i];
  std::vector<ir::task_id> succ(succ_begin[n]);
  {
    std::vector<std::size_t> fill(succ_begin.begin(), succ_begin.end() - 1);
    for (const auto& t : g.tasks)
      for (const auto d : t.deps) succ[fill[static_cast<std::size_t>(d)]++] = t.id;
    for (const auto& [earlier, later] : extra_deps) succ[fill[static_cast<std::size_t>(earlier)]++] = later;
  }

  std::vector<char> is_comm(streams, 0);
  for (std::size_t s = 0; s < streams; ++s) is_comm[s] = g.streams[s].is_compute() ? 0 : 1;

  result r;
  r.start_us.assign(n, 0.0);
  r.end_us.assign(n, 0.0);
  r.busy_us.assign(streams, 0.0);
  r.exposed_us.assign(streams, 0.0);
  r.timeline.reserve(n);

  std::vector<std::size_t> pos(streams, 0);
  std::vector<ir::task_id> running(streams, -1);
  std::vector<double> remaining(streams, 0.0); // uncontended work left of the running task
  std::vector<std::size_t> slot(streams, 0);   // its index in r.timeline
  std::vector<char> done(n, 0);
  std::size_t finished = 0;
  double now = 0;
  const std::size_t active_streams = order.size();

  for (;;) {
    int comm_running = 0, compute_running = 0;
    for (std::size_t s = 0; s < active_streams; ++s) {
      if (running[s] < 0 && pos[s] < order[s].size()) {
        const auto head = order[s][pos[s]];
        if (pending[static_cast<std::size_t>(head)] == 0) {
          running[s] = head;
          remaining[s] = durations_us[static_cast<std::size_t>(head)];
          r.start_us[static_cast<std::size_t>(head)] = now;
          slot[s] = r.timeline.size();
          r.timeline.push_back({head, static_cast<ir::stream_id>(s), now, now});
        }
      }
      if (running[s] >= 0) ++(is_comm[s] ? comm_running : compute_running);
    }
    if (comm_running + compute_running == 0) {
      if (finished == n) break;
      detail::report_deadlock(g, order, pos, done, now);
    }

    // Rates are constant until the next completion, so the next event is the earliest finish.
    const double slowdown = comm_running > 0 ? overlap_slowdown.compute : 1.0;
    const double comm_slowdown = compute_running > 0 ? overlap_slowdown.comm : 1.0;
    const auto time_to_finish = [&](std::size_t s) { return remaining[s] * (is_comm[s] ? comm_slowdown : slowdown); };
    double step = std::numeric_limits<double>::infinity();
    for (std::size_t s = 0; s < active_streams; ++s)
      if (running[s] >= 0) step = std::min(step, time_to_finish(s));

    if (comm_running > 0 && compute_running == 0) {
      r.exposed_comm_us += step;
      for (std::size_t s = 0; s < active_streams; ++s)
        if (running[s] >= 0) r.exposed_us[s] += step;
    }
    const double next = now + step;
    for (std::size_t s = 0; s < active_streams; ++s) {
      if (running[s] < 0) continue;
      if (time_to_finish(s) <= step) {
        const auto id = static_cast<std::size_t>(running[s]);
        r.end_us[id] = next;
        r.timeline[slot[s]].end_us = next;
        r.busy_us[s] += next - r.start_us[id];
        done[id] = 1;
        ++finished;
        for (std::size_t k = succ_begin[id]; k < succ_begin[id + 1]; ++k) --pending[static_cast<std::size_t>(succ[k])];
        running[s] = -1;
        ++pos[s];
      } else {
        remaining[s] = std::max(0.0, remaining[s] - step / (is_comm[s] ? comm_slowdown : slowdown));
      }
    }
    now = next;
  }
  r.step_us = now;
  return r;
}

/// @brief Replays a plan's orders with the given durations (the plan's own start times and
/// durations are ignored: they are what this recomputes).
/// @code
/// auto r = sim::simulate(p, cost_model_durations, 1.2);
/// @endcode
[[nodiscard]] inline result simulate(const plan::plan& p, std::span<const double> durations_us,
                                     contention overlap_slowdown = {}) {
  return simulate(p.graph, p.order, durations_us, overlap_slowdown);
}

/// @brief Makes a plan from a schedule: replays it and records each task's simulated start and
/// its simulated duration (end - start, contention included). The order gets one entry per stream.
/// @code
/// auto p = sim::to_plan(g, {{0, 2}, {1}}, durations, 1.2, "program_order", "h100x64");
/// // p.start_us[i] + p.duration_us[i] == sim::simulate(p, durations, 1.2).end_us[i]
/// @endcode
[[nodiscard]] inline plan::plan to_plan(ir::graph g, std::vector<std::vector<ir::task_id>> order,
                                        std::span<const double> durations_us, contention overlap_slowdown,
                                        std::string policy, std::string preset) {
  auto replay = simulate(g, order, durations_us, overlap_slowdown);
  order.resize(g.streams.size());
  plan::plan p;
  p.graph = std::move(g);
  p.order = std::move(order);
  p.duration_us.resize(replay.start_us.size());
  for (std::size_t i = 0; i < replay.start_us.size(); ++i) p.duration_us[i] = replay.end_us[i] - replay.start_us[i];
  p.start_us = std::move(replay.start_us);
  p.policy = std::move(policy);
  p.preset = std::move(preset);
  return p;
}

} // namespace concerto::sim
