#pragma once
/// @file
/// @brief The memory cap and the ZeRO-3 prefetch depth: how many layers ahead a parameter
/// all-gather may be issued, as dependency edges that bound how early it starts.
///
/// A list scheduler issues a parameter all-gather as soon as its input (the rank's shard,
/// always ready) allows, i.e. at the start of the step, and each gathered copy then lives
/// until its last use: the peak grows with the depth of the model. `limit_prefetch(g, d)`
/// makes the all-gathers of the i-th group of parameter gathers (one layer in one phase)
/// wait for the tasks that free the gathered parameters of group i-1-d, so at most d+1 groups
/// are live at once. `limit_memory` picks the depth with the best simulated step whose plan
/// peak (plan::peak_memory) stays under a cap; plan::verify with `memory_cap_bytes` rejects
/// any plan above it. docs/decomposition.md explains the choice.
///
/// @code
/// auto model = cost::model::preset("h100x64");
/// auto limited = planner::limit_memory(g, model, 20LL << 30);   // 20 GiB per rank
/// plan::plan p = planner::list_plan(limited.graph, model);
/// plan::verify(p, {.memory_cap_bytes = 20LL << 30});
/// @endcode

#include <concerto/cost/model.hpp>
#include <concerto/ir/graph.hpp>
#include <concerto/plan/memory.hpp>
#include <concerto/planner/detail/evaluate.hpp>
#include <concerto/planner/detail/rewrite.hpp>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

namespace concerto::planner {

/// @brief One group of parameter all-gathers (consecutive in program order, same phase and
/// layer) and the tasks that free what they gathered (the last user of each gathered buffer).
struct prefetch_unit {
  std::vector<ir::task_id> gathers;
  std::vector<ir::task_id> frees;
};

/// @brief The parameter all-gathers of `g` grouped into prefetch units, in program order. A
/// parameter all-gather reads a parameter buffer and writes a buffer that is not persistent
/// (the gathered copy, freed after its last use).
/// @code
/// auto units = planner::prefetch_units(ir::make_workload("gpt-zero3", {.layers = 2}));
/// @endcode
[[nodiscard]] inline std::vector<prefetch_unit> prefetch_units(const ir::graph& g) {
  namespace rw = detail::rewrite;
  const rw::program prog(g);
  const auto& pos = prog.pos;
  const auto role = [&](ir::buffer_id b) { return g.buffers[static_cast<std::size_t>(g.root_of(b))].role; };
  std::vector<prefetch_unit> units;
  const ir::task* previous = nullptr;
  for (auto id : prog.order) {
    const auto& t = g[id];
    if (t.kind != ir::op_kind::all_gather || t.reads.size() != 1 || t.writes.size() != 1) continue;
    if (role(t.reads[0]) != ir::buffer_role::param || plan::is_persistent(role(t.writes[0]))) continue;
    if (!previous || previous->layer != t.layer || previous->step_phase != t.step_phase) units.emplace_back();
    units.back().gathers.push_back(id);
    previous = &t;
    const auto users = rw::touchers(g, prog, t.writes[0]);
    if (!users.empty() && users.back() != id) units.back().frees.push_back(users.back());
  }
  for (auto& u : units) {
    std::sort(u.frees.begin(), u.frees.end(), [&](auto x, auto y) { return pos[static_cast<std::size_t>(x)] < pos[static_cast<std::size_t>(y)]; });
    u.frees.erase(std::unique(u.frees.begin(), u.frees.end()), u.frees.end());
  }
  return units;
}

/// @brief `g` with prefetch depth `depth`: each all-gather of unit i depends on the frees of
/// unit i-1-depth (when they come before it in program order, so no cycle can form). A
/// negative depth, or one of at least units-1, adds nothing.
/// @code
/// ir::graph one_ahead = planner::limit_prefetch(g, 1); // gather layer l+1 while layer l runs
/// @endcode
[[nodiscard]] inline ir::graph limit_prefetch(const ir::graph& g, int depth) {
  ir::graph out = g;
  if (depth < 0) return out;
  const auto order = detail::rewrite::program_order(g);
  const auto pos = detail::rewrite::positions(order);
  const auto units = prefetch_units(g);
  for (std::size_t i = static_cast<std::size_t>(depth) + 1; i < units.size(); ++i)
    for (auto gather : units[i].gathers)
      for (auto free : units[i - 1 - static_cast<std::size_t>(depth)].frees) {
        if (pos[static_cast<std::size_t>(free)] >= pos[static_cast<std::size_t>(gather)]) continue;
        auto& deps = out.tasks[static_cast<std::size_t>(gather)].deps;
        if (std::find(deps.begin(), deps.end(), free) == deps.end()) deps.push_back(free);
      }
  return out;
}

/// @brief What limit_memory chose.
struct memory_limit_result {
  ir::graph graph;             ///< the input with the prefetch edges of `prefetch_depth`
  int prefetch_depth = -1;     ///< -1 when the graph has no parameter all-gathers to limit
  double step_us = 0;          ///< the judged step time of `graph`'s plan
  std::int64_t peak_bytes = 0; ///< its peak memory, <= the cap
};

/// @brief The prefetch depth with the smallest step time among those whose plan (made by
/// `make`) peaks at or under `cap_bytes`; ties go to the smaller depth (more headroom).
/// Throws concerto::error giving the cap and the smallest peak reached when no depth fits
/// (the activations alone, or depth 0, exceed the cap).
/// @code
/// auto r = planner::limit_memory(g, 16LL << 30, [&](const ir::graph& x) { return planner::list_plan(x, model); });
/// @endcode
[[nodiscard]] inline memory_limit_result limit_memory(const ir::graph& g, std::int64_t cap_bytes, const plan_fn& make) {
  if (cap_bytes <= 0) fail("memory cap for graph '" + g.name + "' is " + std::to_string(cap_bytes) + " bytes; it must be positive");
  const auto units = static_cast<int>(prefetch_units(g).size());
  memory_limit_result best;
  best.step_us = std::numeric_limits<double>::infinity();
  std::int64_t smallest_peak = std::numeric_limits<std::int64_t>::max();
  int smallest_at = -1;
  // Depth units-1 adds no edge: it stands for "unlimited".
  for (int depth = units > 0 ? 0 : -1; depth < std::max(units, 0); ++depth) {
    auto candidate = limit_prefetch(g, depth);
    const auto p = make(candidate);
    const auto peak = plan::peak_memory(p).peak_bytes;
    if (peak < smallest_peak) {
      smallest_peak = peak;
      smallest_at = depth;
    }
    if (peak <= cap_bytes && p.step_us() < best.step_us * (1 - 1e-12)) {
      best.graph = std::move(candidate);
      best.prefetch_depth = depth;
      best.step_us = p.step_us();
      best.peak_bytes = peak;
    }
    if (units == 0) break;
  }
  if (best.step_us == std::numeric_limits<double>::infinity())
    fail("memory cap of " + std::to_string(cap_bytes) + " bytes cannot be met for graph '" + g.name +
         "': the smallest peak is " + std::to_string(smallest_peak) + " bytes (prefetch depth " +
         std::to_string(smallest_at) + " of " + std::to_string(units) +
         " parameter-gather groups); raise the cap or shrink what is live at once (micro-batch, layers)");
  return best;
}

/// @brief limit_memory with the list schedule + simulator on `model` as the plan maker.
/// @code
/// auto r = planner::limit_memory(g, model, 16LL << 30);
/// @endcode
[[nodiscard]] inline memory_limit_result limit_memory(const ir::graph& g, const cost::model& model, std::int64_t cap_bytes) {
  return limit_memory(g, cap_bytes, [&model](const ir::graph& x) { return list_plan(x, model); });
}

} // namespace concerto::planner
