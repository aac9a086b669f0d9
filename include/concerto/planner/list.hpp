#pragma once
/// @file
/// @brief The baseline list schedulers of BENCHMARKS.md: `sync`, `program_order`, `xla_lhs`.
///
/// Each returns an `ordering`: the graph (with ordering edges added where the policy needs them)
/// and one task order per stream. Every order respects the dependencies, and all the orders
/// of one are consistent with one global topological order, so any executor that runs
/// each stream's order and waits on cross-stream dependencies replays it without deadlock.
///
/// @code
/// auto g = ir::make_workload("gpt-zero3", {.layers = 2});
/// std::vector<double> us = model.durations_us(g);
/// planner::ordering s = planner::list_schedule(planner::policy::xla_lhs, g, us);
/// for (auto id : s.order[ir::compute_stream]) std::cout << s.graph[id].name << '\n';
/// @endcode

#include <concerto/ir/graph.hpp>
#include <concerto/ir/hazards.hpp>
#include <concerto/planner/policy.hpp>

#include <algorithm>
#include <functional>
#include <queue>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace concerto::planner {

/// @brief A graph and, per stream, the order its tasks run in: what the planner's schedulers
/// produce and improve (a plan adds each task's times; a *schedule* is the pipeline's order of
/// blocks per stage, pipeline::schedule).
struct ordering {
  ir::graph graph;
  std::vector<std::vector<ir::task_id>> order;
};

namespace detail {

using ir::program_order;

[[nodiscard]] inline std::vector<std::vector<ir::task_id>> split_by_stream(const ir::graph& g,
                                                                           const std::vector<ir::task_id>& order) {
  std::vector<std::vector<ir::task_id>> out(g.streams.size());
  for (auto id : order)
    out[static_cast<std::size_t>(g[id].stream)].push_back(id);
  return out;
}

inline void check_durations(const ir::graph& g, std::span<const double> durations_us, std::string_view policy) {
  if (durations_us.size() != g.tasks.size())
    fail(std::string(policy) + " schedule of graph '" + g.name + "': " + std::to_string(durations_us.size()) +
         " durations for " + std::to_string(g.tasks.size()) + " tasks");
  for (const auto& t : g.tasks) {
    const double d = durations_us[static_cast<std::size_t>(t.id)];
    if (!(d >= 0))
      fail(std::string(policy) + " schedule of graph '" + g.name + "': task " + std::to_string(t.id) + " '" + t.name +
           "' has duration " + std::to_string(d) + " us");
  }
}

// Longest path from the start of each task to the end of the graph, its own duration included.
[[nodiscard]] inline std::vector<double> bottom_levels(const ir::graph& g, std::span<const double> durations_us) {
  const auto order = g.topological_order();
  const auto succ = g.successors();
  std::vector<double> level(g.tasks.size(), 0);
  for (auto it = order.rbegin(); it != order.rend(); ++it) {
    const auto i = static_cast<std::size_t>(*it);
    double tail = 0;
    for (auto s : succ[i])
      tail = std::max(tail, level[static_cast<std::size_t>(s)]);
    level[i] = durations_us[i] + tail;
  }
  return level;
}

} // namespace detail

/// @brief No overlap at all: every task, collectives included, waits for the one before it.
///
/// The returned graph chains all tasks in program order with extra dependency edges, so the
/// schedule stays synchronous whatever executes or simulates it.
[[nodiscard]] inline ordering sync_schedule(const ir::graph& g) {
  ordering s{g, {}};
  const auto order = detail::program_order(g);
  for (std::size_t i = 1; i < order.size(); ++i) {
    auto& deps = s.graph.tasks[static_cast<std::size_t>(order[i])].deps;
    if (std::find(deps.begin(), deps.end(), order[i - 1]) == deps.end())
      deps.push_back(order[i - 1]);
  }
  s.order = detail::split_by_stream(s.graph, order);
  return s;
}

/// @brief Eager PyTorch / DDP without buckets: each stream runs its tasks in program order;
/// a collective is asynchronous and waited on only by the tasks that consume it.
[[nodiscard]] inline ordering program_order_schedule(const ir::graph& g) {
  ordering s{g, {}};
  s.order = detail::split_by_stream(g, detail::program_order(g));
  return s;
}

/// @brief A schedule of xla_lhs_orders: each stream's order, and the edges that hold the cap on
/// collectives in flight, (earlier, later) between collectives of two lanes.
struct lhs_schedule {
  std::vector<std::vector<ir::task_id>> order;
  std::vector<std::pair<ir::task_id, ir::task_id>> cap_edges;
};

/// @brief XLA's latency-hiding scheduler as a greedy list schedule on a simulated clock.
///
/// Whenever a stream is free, it starts its ready task of highest priority: a collective as
/// soon as its inputs are ready (program order among collectives), compute by longest remaining
/// path. At most `max_in_flight` collectives run at once across all lanes; the returned cap
/// edges hold it (a collective waits for the one whose slot it takes), so a replay
/// with other durations keeps it too.
/// @code
/// auto s = planner::xla_lhs_orders(g, durations, /*max_in_flight=*/2);
/// @endcode
[[nodiscard]] inline lhs_schedule xla_lhs_orders(const ir::graph& g, std::span<const double> durations_us,
                                                 int max_in_flight = 2) {
  detail::check_durations(g, durations_us, "xla_lhs");
  if (max_in_flight < 1)
    fail("xla_lhs schedule of graph '" + g.name + "': max_in_flight = " + std::to_string(max_in_flight) +
         " must be at least 1");
  const auto n = g.tasks.size();
  const auto level = detail::bottom_levels(g, durations_us);
  const auto succ = g.successors();
  std::vector<std::size_t> rank(n); // position in program order: the collectives' priority
  {
    const auto order = detail::program_order(g);
    for (std::size_t i = 0; i < order.size(); ++i)
      rank[static_cast<std::size_t>(order[i])] = i;
  }
  // A task's priority never changes (program position for collectives, bottom level then
  // program position for compute), so each stream's ready tasks wait in a heap: the backward
  // pass can leave hundreds of gradient all-reduces ready behind the in-flight cap.
  const auto better = [&](ir::task_id a, ir::task_id b) {
    const auto ia = static_cast<std::size_t>(a), ib = static_cast<std::size_t>(b);
    if (ir::is_collective(g[a].kind))
      return rank[ia] < rank[ib];
    if (level[ia] != level[ib])
      return level[ia] > level[ib];
    return rank[ia] < rank[ib];
  };
  const auto worse = [&](ir::task_id a, ir::task_id b) { return better(b, a); };
  using ready_heap = std::priority_queue<ir::task_id, std::vector<ir::task_id>, decltype(worse)>;
  std::vector<ready_heap> ready(g.streams.size(), ready_heap(worse));
  std::vector<int> missing(n, 0);
  for (const auto& t : g.tasks) {
    missing[static_cast<std::size_t>(t.id)] = static_cast<int>(t.deps.size());
    if (t.deps.empty())
      ready[static_cast<std::size_t>(t.stream)].push(t.id);
  }
  const auto pop_best = [&](ready_heap& heap) {
    const auto id = heap.top();
    heap.pop();
    return id;
  };

  lhs_schedule s{std::vector<std::vector<ir::task_id>>(g.streams.size()), {}};
  using event = std::pair<double, ir::task_id>; // finish time, task
  std::priority_queue<event, std::vector<event>, std::greater<>> running;
  std::vector<char> busy(g.streams.size(), 0);
  std::vector<char> slot_busy(static_cast<std::size_t>(max_in_flight), 0);
  std::vector<ir::task_id> slot_last(static_cast<std::size_t>(max_in_flight), -1);
  std::vector<int> slot_of(n, -1);
  int in_flight = 0;
  std::size_t done = 0;
  double now = 0;

  const auto start = [&](ir::task_id id) {
    const auto& t = g[id];
    busy[static_cast<std::size_t>(t.stream)] = 1;
    s.order[static_cast<std::size_t>(t.stream)].push_back(id);
    running.emplace(now + durations_us[static_cast<std::size_t>(id)], id);
  };
  while (done < n) {
    // Collectives first: the cap is shared, so the lowest program position across lanes wins.
    while (in_flight < max_in_flight) {
      int lane = -1;
      for (std::size_t st = 1; st < g.streams.size(); ++st)
        if (!busy[st] && !ready[st].empty() &&
            (lane < 0 || better(ready[st].top(), ready[static_cast<std::size_t>(lane)].top())))
          lane = static_cast<int>(st);
      if (lane < 0)
        break;
      const auto id = pop_best(ready[static_cast<std::size_t>(lane)]);
      const auto slot = static_cast<std::size_t>(std::find(slot_busy.begin(), slot_busy.end(), 0) - slot_busy.begin());
      // The slot's previous collective finished before this one starts: make that an edge,
      // unless the lane's own order already implies it.
      if (const auto prev = slot_last[slot]; prev >= 0 && g[prev].stream != g[id].stream) {
        const auto& deps = g[id].deps;
        if (std::find(deps.begin(), deps.end(), prev) == deps.end())
          s.cap_edges.emplace_back(prev, id);
      }
      slot_busy[slot] = 1;
      slot_last[slot] = id;
      slot_of[static_cast<std::size_t>(id)] = static_cast<int>(slot);
      ++in_flight;
      start(id);
    }
    if (!busy[ir::compute_stream] && !ready[ir::compute_stream].empty())
      start(pop_best(ready[ir::compute_stream]));
    if (running.empty())
      fail("xla_lhs schedule of graph '" + g.name + "': no task can start (is the graph valid?)");
    now = running.top().first;
    while (!running.empty() && running.top().first <= now) {
      const auto id = running.top().second;
      running.pop();
      ++done;
      const auto& t = g[id];
      busy[static_cast<std::size_t>(t.stream)] = 0;
      if (ir::is_collective(t.kind)) {
        slot_busy[static_cast<std::size_t>(slot_of[static_cast<std::size_t>(id)])] = 0;
        --in_flight;
      }
      for (auto nx : succ[static_cast<std::size_t>(id)])
        if (--missing[static_cast<std::size_t>(nx)] == 0)
          ready[static_cast<std::size_t>(g[nx].stream)].push(nx);
    }
  }
  return s;
}

/// @brief xla_lhs_orders with its cap edges added to a copy of the graph.
/// @code
/// auto s = planner::xla_lhs_schedule(g, durations, /*max_in_flight=*/2);
/// @endcode
[[nodiscard]] inline ordering xla_lhs_schedule(const ir::graph& g, std::span<const double> durations_us,
                                               int max_in_flight = 2) {
  auto lhs = xla_lhs_orders(g, durations_us, max_in_flight);
  ordering s{g, std::move(lhs.order)};
  for (const auto& [earlier, later] : lhs.cap_edges) s.graph.tasks[static_cast<std::size_t>(later)].deps.push_back(earlier);
  return s;
}

/// @brief Runs the list policy `p` (policy_family::list); durations are used by xla_lhs only.
/// Throws concerto::error naming the policy when it is not a list policy.
[[nodiscard]] inline ordering list_schedule(policy p, const ir::graph& g, std::span<const double> durations_us) {
  switch (p) {
  case policy::sync: return sync_schedule(g);
  case policy::program_order: return program_order_schedule(g);
  case policy::xla_lhs: return xla_lhs_schedule(g, durations_us);
  case policy::megatron:
  case policy::megatron_tp_overlap:
  case policy::deepspeed:
  case policy::concerto: break;
  }
  fail("'" + std::string(to_string(p)) + "' is not a list scheduling policy");
}

} // namespace concerto::planner
