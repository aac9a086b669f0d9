#pragma once
/// @file
/// @brief The windowed solver: improves a whole schedule one Z3 window at a time.
///
/// Z3 proves optimal schedules only for tens of tasks, so the planner walks the task list
/// (ordered by start time in the current best schedule) in windows of consecutive tasks. The
/// windows grow over the rounds, doubling every two up to `window` (20 then 40 by default):
/// small windows are proven in milliseconds and settle most of the plan, the large ones then
/// look for moves across their boundaries; odd rounds shift the boundaries by half a window so
/// that none stays fixed. Each window is solved with the rest of the plan frozen and its
/// boundary carried in (stream free times, releases from dependencies outside the window,
/// tails of the work after it); `parallel_windows` windows are solved at once, on as many
/// cores. A window's solution is turned back into per-stream orders and the WHOLE plan is
/// re-simulated, contention included; it is kept only if the step time does not get worse, so
/// the result is never slower than the start schedule. A window met again unchanged, once
/// proven or searched to its limit, is not solved again. The search stops at the time budget
/// with the best plan so far, or, in the deterministic mode, runs every round with a fixed
/// amount of Z3 work per window and never reads the clock.

#include <concerto/core/error.hpp>
#include <concerto/core/hash.hpp>
#include <concerto/ir/graph.hpp>
#include <concerto/plan/lower_bound.hpp>
#include <concerto/planner/detail/parallel.hpp>
#include <concerto/planner/list.hpp>
#include <concerto/planner/z3_window.hpp>
#include <concerto/sim/simulate.hpp>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <limits>
#include <memory>
#include <numeric>
#include <optional>
#include <span>
#include <unordered_set>
#include <utility>
#include <vector>

namespace concerto::planner {

/// @brief Tuning of improve_schedule.
struct windowed_options {
  /// The largest window, in tasks: the rounds grow to it (see improve_schedule). 40 is where Z3
  /// still proves most layer-graph windows in a fraction of a second on the 2-core machine;
  /// beyond it proofs stall (docs/planner.md has the table).
  int window = 40;
  int rounds = 4;                    ///< passes over the task list, alternating boundaries
  /// Z3 time for a window of `window` tasks; smaller windows get their share. 0.15 s is where
  /// the measured workloads reach the quality that 1 s per window gave (docs/performance.md §2).
  double window_time_limit_s = 0.15;
  double time_budget_s = 30;         ///< the whole search; the best plan so far is returned
  /// Windows solved at once (on as many cores as there are), each against the plan as it
  /// stood before the batch; the result depends on this number, never on the core count.
  int parallel_windows = 2;
  /// Deterministic mode when positive: each window gets this much Z3 work (its resource
  /// counter, "rlimit") instead of window_time_limit_s, and neither the solver nor the rewrites
  /// read the clock (time_budget_s is ignored), so the same graph gives the same plan on any
  /// machine under any load. 0, the default, bounds the search by time.
  std::uint64_t window_work_limit = 0;
  bool progress = true;              ///< progress on stderr once planning takes over a second
};

/// @brief What improve_schedule did.
struct windowed_report {
  double solve_seconds = 0;
  int windows_total = 0;
  int windows_optimal = 0;  ///< windows whose schedule Z3 proved optimal
  double start_step_us = 0;
  double final_step_us = 0;
  double lower_bound_us = 0;  ///< plan::compute_lower_bound of the graph
};

namespace detail {

// Longest path of durations from each task's end to the end of the step, ignoring resources.
inline std::vector<double> work_after(const ir::graph& g, std::span<const double> d) {
  std::vector<double> after(g.tasks.size(), 0.0);
  const auto succ = g.successors();
  const auto topo = g.topological_order();
  for (auto it = topo.rbegin(); it != topo.rend(); ++it) {
    const auto u = static_cast<std::size_t>(*it);
    for (auto s : succ[u]) {
      const auto v = static_cast<std::size_t>(s);
      after[u] = std::max(after[u], d[v] + after[v]);
    }
  }
  return after;
}

// Tasks by simulated start; ties (zero-length tasks) by topological rank, so that a
// dependency never points from a later position to an earlier one.
inline std::vector<ir::task_id> by_start(const sim::result& r, const std::vector<int>& topo_rank) {
  std::vector<ir::task_id> list(r.start_us.size());
  std::iota(list.begin(), list.end(), 0);
  std::sort(list.begin(), list.end(), [&](ir::task_id a, ir::task_id b) {
    const auto ua = static_cast<std::size_t>(a), ub = static_cast<std::size_t>(b);
    if (r.start_us[ua] != r.start_us[ub]) return r.start_us[ua] < r.start_us[ub];
    return topo_rank[ua] < topo_rank[ub];
  });
  return list;
}

struct window_cut {
  window_problem problem;
  std::vector<ir::task_id> tasks;  // window index -> task id
};

// The window list[begin, end) with the rest of the plan frozen around it.
inline window_cut cut_window(const ir::graph& g, std::span<const double> d, const sim::result& r,
                             const std::vector<ir::task_id>& list, std::size_t begin, std::size_t end,
                             const std::vector<double>& after) {
  window_cut cut;
  std::vector<int> index(g.tasks.size(), -1);
  for (std::size_t k = begin; k < end; ++k) {
    index[static_cast<std::size_t>(list[k])] = static_cast<int>(k - begin);
    cut.tasks.push_back(list[k]);
  }
  auto& p = cut.problem;
  p.stream_free.assign(g.streams.size(), 0.0);
  for (std::size_t k = 0; k < begin; ++k) {
    const auto u = static_cast<std::size_t>(list[k]);
    auto& f = p.stream_free[static_cast<std::size_t>(g.tasks[u].stream)];
    f = std::max(f, r.end_us[u]);
  }
  const auto succ = g.successors();
  for (auto id : cut.tasks) {
    const auto u = static_cast<std::size_t>(id);
    const auto& t = g.tasks[u];
    window_task w;
    w.stream = t.stream;
    w.duration = d[u];
    for (auto dep : t.deps) {
      const auto v = static_cast<std::size_t>(dep);
      if (index[v] >= 0) w.preds.push_back(index[v]);
      else w.release = std::max(w.release, r.end_us[v]);
    }
    for (auto s : succ[u]) {
      const auto v = static_cast<std::size_t>(s);
      if (index[v] < 0) w.tail = std::max(w.tail, d[v] + after[v]);
    }
    p.tasks.push_back(std::move(w));
    p.hint_start.push_back(r.start_us[u]);
  }
  return cut;
}

// The window's tasks take the window's positions in each stream's order, sorted by their
// solved start; every other task keeps its place.
inline std::vector<std::vector<ir::task_id>> splice(const ir::graph& g, const std::vector<std::vector<ir::task_id>>& order,
                                                   const window_cut& cut, const window_solution& sol,
                                                   const std::vector<int>& topo_rank) {
  std::vector<int> index(g.tasks.size(), -1);
  for (std::size_t k = 0; k < cut.tasks.size(); ++k) index[static_cast<std::size_t>(cut.tasks[k])] = static_cast<int>(k);
  auto out = order;
  for (auto& stream_order : out) {
    std::vector<std::size_t> slots;
    std::vector<ir::task_id> mine;
    for (std::size_t k = 0; k < stream_order.size(); ++k)
      if (index[static_cast<std::size_t>(stream_order[k])] >= 0) {
        slots.push_back(k);
        mine.push_back(stream_order[k]);
      }
    std::sort(mine.begin(), mine.end(), [&](ir::task_id a, ir::task_id b) {
      const double sa = sol.start[static_cast<std::size_t>(index[static_cast<std::size_t>(a)])];
      const double sb = sol.start[static_cast<std::size_t>(index[static_cast<std::size_t>(b)])];
      return sa != sb ? sa < sb : topo_rank[static_cast<std::size_t>(a)] < topo_rank[static_cast<std::size_t>(b)];
    });
    for (std::size_t k = 0; k < slots.size(); ++k) stream_order[slots[k]] = mine[k];
  }
  return out;
}

// What identifies a window's problem (its tasks and boundary, not the warm start): a window
// met again unchanged in a later round, already proven or already searched with the same
// limit, is not solved again.
inline std::uint64_t problem_key(const window_cut& cut) {
  hasher h;
  for (auto id : cut.tasks) h.add(id);
  for (const auto& t : cut.problem.tasks) {
    h.add(t.stream).add(t.duration).add(t.release).add(t.tail).add(t.preds.size());
    for (auto p : t.preds) h.add(p);
  }
  for (auto f : cut.problem.stream_free) h.add(f);
  return h.value();
}

// The inputs improve_schedule refuses, with what to change.
inline void check_improvable(const ir::graph& g, const ordering& start, std::span<const double> durations,
                             const windowed_options& options) {
  if (start.graph.tasks.size() != g.tasks.size())
    fail("improve_schedule of graph '" + g.name + "': the start schedule has " + std::to_string(start.graph.tasks.size()) +
         " tasks, the graph " + std::to_string(g.tasks.size()));
  if (durations.size() != g.tasks.size())
    fail("improve_schedule of graph '" + g.name + "': " + std::to_string(durations.size()) + " durations for " +
         std::to_string(g.tasks.size()) + " tasks");
  if (options.window < 2) fail("windowed_options.window must be at least 2, not " + std::to_string(options.window));
  if (options.rounds < 0) fail("windowed_options.rounds must not be negative");
  if (options.parallel_windows < 1)
    fail("windowed_options.parallel_windows must be at least 1, not " + std::to_string(options.parallel_windows));
}

// The windows of a round over n tasks in start order: w tasks each, the first one `shift` long
// when the round shifts the boundaries.
inline std::vector<std::pair<std::size_t, std::size_t>> window_ranges(std::size_t n, std::size_t w, std::size_t shift) {
  std::vector<std::pair<std::size_t, std::size_t>> ranges;
  for (std::size_t begin = 0; begin < n;) {
    const std::size_t end = std::min(n, begin == 0 && shift > 0 ? shift : begin + w);
    ranges.emplace_back(begin, end);
    begin = end;
  }
  return ranges;
}

inline void print_progress(const std::string& graph, int round, int rounds, const windowed_report& rep, double step_us) {
  std::fprintf(stderr, "concerto: planning '%s': round %d/%d, %d windows (%d proven), step %.1f us (start %.1f), gap to bound %.1f%%\n",
               graph.c_str(), round + 1, rounds, rep.windows_total, rep.windows_optimal, step_us, rep.start_step_us,
               rep.lower_bound_us > 0 ? 100.0 * (step_us / rep.lower_bound_us - 1) : 0.0);
}

} // namespace detail

/// @brief Improves `start` window by window with Z3; the result is never slower than `start`.
///
/// The solver schedules `g`, the user's graph. `start` is only a warm start: its per-stream
/// orders seed the search, and the edges its own graph may add (`sync` chains every task,
/// `xla_lhs` caps collectives in flight) never constrain it, so a window proven optimal is
/// optimal for `g`. If no order found on `g` beats `start` as it stands, with its edges, `start`
/// is returned unchanged. `start.graph` must hold `g`'s tasks (it may be empty: `g`);
/// `durations[i]` is task i's uncontended duration and `overlap_slowdown` the simulator's
/// contention factors. The step time of a candidate is always the simulator's, so the guarantee
/// holds with contention even though each window is solved without it.
///
/// @code
/// auto start = planner::list_schedule(planner::policy::xla_lhs, g, durations);
/// planner::windowed_report rep;
/// auto best = planner::improve_schedule(g, start, durations, 1.2, {.time_budget_s = 10}, &rep);
/// std::printf("%.1f -> %.1f us (bound %.1f)\n", rep.start_step_us, rep.final_step_us, rep.lower_bound_us);
/// @endcode
inline ordering improve_schedule(const ir::graph& g, ordering start, std::span<const double> durations,
                                 sim::contention overlap_slowdown, const windowed_options& options,
                                 windowed_report* report = nullptr,
                                 const std::function<void(double step_us)>& on_improvement = {}) {
  const auto t0 = std::chrono::steady_clock::now();
  const auto elapsed = [&] { return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(); };
  if (start.graph.tasks.empty()) start.graph = g;
  const ir::graph& graph = g;
  detail::check_improvable(g, start, durations, options);

  // The start as it stands (with any edges of its own), and its orders on the user's graph.
  const double start_step = sim::simulate(start.graph, start.order, durations, overlap_slowdown).step_us;
  auto best_sim = sim::simulate(graph, start.order, durations, overlap_slowdown);
  ordering best{graph, start.order};
  windowed_report rep;
  rep.start_step_us = start_step;
  rep.lower_bound_us = plan::compute_lower_bound(graph, durations).value;

  const auto topo = graph.topological_order();
  std::vector<int> topo_rank(graph.tasks.size());
  for (std::size_t k = 0; k < topo.size(); ++k) topo_rank[static_cast<std::size_t>(topo[k])] = static_cast<int>(k);
  const auto after = detail::work_after(graph, durations);
  const auto n = graph.tasks.size();
  const auto largest = static_cast<std::size_t>(options.window);
  const bool deterministic = options.window_work_limit > 0;
  const auto batch = static_cast<std::size_t>(options.parallel_windows);
  std::vector<std::unique_ptr<z3::context>> contexts; // one per window of a batch: Z3 contexts are not shared across threads
  for (std::size_t k = 0; k < batch; ++k) contexts.push_back(std::make_unique<z3::context>());
  std::unordered_set<std::uint64_t> settled; // problems proven, or searched to their full limit
  double last_progress = 0;
  bool out_of_time = false;

  for (int round = 0; round < options.rounds && !out_of_time; ++round) {
    if (best_sim.step_us <= rep.lower_bound_us * (1 + 1e-9)) break;  // nothing left to gain
    // Windows grow to `window` over the rounds, doubling every two: small windows are proven
    // in milliseconds and settle most of the plan; the large ones of the last rounds then look
    // for moves across their boundaries. Odd rounds shift the boundaries by half a window (the
    // first window is then a half one).
    const std::size_t w = std::max<std::size_t>(2, largest >> std::min(16, (options.rounds - 1 - round) / 2));
    // A window's allowance scales with its size, so the small early windows stay cheap.
    const double size_share = static_cast<double>(w) / static_cast<double>(std::max(largest, w));
    const double full_limit = options.window_time_limit_s * size_share;
    window_options limits;
    limits.work_limit = static_cast<std::uint64_t>(static_cast<double>(options.window_work_limit) * size_share);
    const auto ranges = detail::window_ranges(n, w, round % 2 == 0 ? 0 : w / 2);
    auto list = detail::by_start(best_sim, topo_rank);
    for (std::size_t first = 0; first < ranges.size(); first += batch) {
      const double left = options.time_budget_s - elapsed();
      if (!deterministic && left <= 0) {
        out_of_time = true;
        break;
      }
      // Cut the batch's windows from the current plan; solve those not settled, at once.
      std::vector<detail::window_cut> cuts;
      std::vector<std::uint64_t> keys;
      for (std::size_t k = first; k < std::min(ranges.size(), first + batch); ++k) {
        auto cut = detail::cut_window(graph, durations, best_sim, list, ranges[k].first, ranges[k].second, after);
        const auto key = detail::problem_key(cut);
        if (settled.count(key)) continue;
        cuts.push_back(std::move(cut));
        keys.push_back(key);
      }
      std::vector<window_solution> sols(cuts.size());
      limits.time_limit_s = deterministic ? full_limit : std::min(full_limit, left);
      detail::for_each_index(cuts.size(), [&](std::size_t k) { sols[k] = solve_window(cuts[k].problem, limits, contexts[k].get()); });
      // Keep each window's order if the whole plan, re-simulated, is not slower.
      for (std::size_t k = 0; k < cuts.size(); ++k) {
        const auto& sol = sols[k];
        ++rep.windows_total;
        rep.windows_optimal += sol.optimal ? 1 : 0;
        // Proven, or searched to its full limit: the same problem met again would get the same
        // answer (kept or refused below as now), so it is not solved again.
        if (sol.optimal || deterministic || limits.time_limit_s >= full_limit) settled.insert(keys[k]);
        if (!sol.improved) continue;
        auto order = detail::splice(graph, best.order, cuts[k], sol, topo_rank);
        std::optional<sim::result> candidate;
        try {
          candidate = sim::simulate(graph, order, durations, overlap_slowdown);
        } catch (const concerto::error&) {
          // A splice that deadlocks the plan (zero-length ties) is a rejected candidate.
        }
        if (candidate && candidate->step_us <= best_sim.step_us) {
          const bool faster = candidate->step_us < best_sim.step_us;
          best.order = std::move(order);
          best_sim = std::move(*candidate);
          list = detail::by_start(best_sim, topo_rank);
          if (faster && on_improvement) on_improvement(best_sim.step_us);
        }
      }
      if (!options.progress || deterministic) continue;
      const double now = elapsed();
      if (now > 1.0 && now - last_progress >= 1.0) {
        last_progress = now;
        detail::print_progress(graph.name, round, options.rounds, rep, best_sim.step_us);
      }
    }
  }
  rep.solve_seconds = elapsed();
  // Never worse than the start as given: its own edges may have made its orders faster than the
  // same orders on the user's graph (a list-scheduling anomaly), and the solver may not have
  // recovered that.
  const bool keep_start = start_step < best_sim.step_us;
  rep.final_step_us = keep_start ? start_step : best_sim.step_us;
  if (report) *report = rep;
  return keep_start ? std::move(start) : std::move(best);
}

} // namespace concerto::planner
