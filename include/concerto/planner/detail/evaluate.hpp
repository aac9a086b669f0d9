#pragma once
/// @file
/// @brief How the graph rewrites of the planner (decompose.hpp, bucket.hpp, memory_cap.hpp)
/// judge a candidate graph: a function from a graph to its simulated step time, +infinity when
/// the candidate is not acceptable (its plan breaks the memory cap). Included by those headers;
/// the pipeline may pass its own judge (the windowed solver) instead of the list one here.

#include <concerto/cost/model.hpp>
#include <concerto/plan/memory.hpp>
#include <concerto/plan/plan.hpp>
#include <concerto/planner/list.hpp>
#include <concerto/sim/simulate.hpp>

#include <chrono>
#include <cstdint>
#include <functional>
#include <limits>
#include <optional>

namespace concerto::planner {

/// @brief When a planning step stops trying candidates; none: it tries them all (the
/// deterministic mode, whose plan does not depend on the machine's speed).
using deadline = std::optional<std::chrono::steady_clock::time_point>;

/// @brief Whether `d` is set and has passed.
[[nodiscard]] inline bool expired(const deadline& d) { return d && std::chrono::steady_clock::now() >= *d; }

/// @brief Judges a candidate graph: its simulated step time in µs, or +infinity to reject it.
/// The rewrites call it from several threads at once (detail/parallel.hpp), so it must not
/// change shared state.
using step_fn = std::function<double(const ir::graph&)>;

/// @brief Makes a plan of a graph (a scheduler followed by the simulator).
using plan_fn = std::function<plan::plan(const ir::graph&)>;

/// @brief The better of the program_order and xla_lhs list schedules of `g`, simulated on the
/// cost model: cheap enough to judge hundreds of rewrites of a graph.
/// @code
/// plan::plan p = planner::list_plan(g, cost::model::preset("h100x64"));
/// @endcode
[[nodiscard]] inline plan::plan list_plan(const ir::graph& g, const cost::model& model) {
  const auto durations = model.durations_us(g);
  const sim::contention slowdown{model.overlap_slowdown(), model.comm_overlap_slowdown()};
  ordering best;
  double best_step = std::numeric_limits<double>::infinity();
  policy best_policy = policy::program_order;
  for (const auto candidate : {policy::program_order, policy::xla_lhs}) {
    auto s = list_schedule(candidate, g, durations);
    const double step = sim::simulate(s.graph, s.order, durations, slowdown).step_us;
    if (step < best_step) {
      best_step = step;
      best = std::move(s);
      best_policy = candidate;
    }
  }
  return sim::to_plan(std::move(best.graph), std::move(best.order), durations, slowdown, std::string(to_string(best_policy)),
                      model.hw().name);
}

/// @brief The step time of list_plan(g, model) without building the plan: the judge of a
/// rewrite runs it on every candidate, and a plan costs a copy of the graph and a third replay.
[[nodiscard]] inline double list_step(const ir::graph& g, const cost::model& model) {
  const auto durations = model.durations_us(g);
  const sim::contention slowdown{model.overlap_slowdown(), model.comm_overlap_slowdown()};
  const double in_program_order =
      sim::simulate(g, detail::split_by_stream(g, detail::program_order(g)), durations, slowdown).step_us;
  const auto lhs = xla_lhs_orders(g, durations);
  return std::min(in_program_order, sim::simulate(g, lhs.order, durations, slowdown, lhs.cap_edges).step_us);
}

/// @brief A judge from a plan maker: the plan's step time, or +infinity when a memory cap is
/// given and the plan's peak (plan::peak_memory) exceeds it.
/// @code
/// auto judge = planner::simulated_step([&](const ir::graph& g) { return planner::list_plan(g, model); },
///                                      40LL << 30);
/// @endcode
[[nodiscard]] inline step_fn simulated_step(plan_fn make, std::optional<std::int64_t> memory_cap_bytes = std::nullopt) {
  return [make = std::move(make), memory_cap_bytes](const ir::graph& g) {
    const auto p = make(g);
    if (memory_cap_bytes && plan::peak_memory(p).peak_bytes > *memory_cap_bytes)
      return std::numeric_limits<double>::infinity();
    return p.step_us();
  };
}

/// @brief The list-schedule judge on a cost model (see list_plan), optionally under a memory cap.
/// @code
/// auto result = planner::decompose(g, model, planner::simulated_step(model));
/// @endcode
[[nodiscard]] inline step_fn simulated_step(const cost::model& model,
                                            std::optional<std::int64_t> memory_cap_bytes = std::nullopt) {
  if (memory_cap_bytes) return simulated_step([model](const ir::graph& g) { return list_plan(g, model); }, memory_cap_bytes);
  return [model](const ir::graph& g) { return list_step(g, model); };
}

} // namespace concerto::planner
