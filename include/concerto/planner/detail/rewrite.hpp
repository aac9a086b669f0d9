#pragma once
/// @file
/// @brief Internals shared by the graph rewrites of the planner (decomposition, bucketing,
/// prefetch limits): program order, dependencies implied by buffer accesses, and rebuilding a
/// graph after tasks were replaced, so every rewrite yields a graph as executable as a
/// builder-made one. Not part of the public API.

#include <concerto/ir/graph.hpp>
#include <concerto/ir/hazards.hpp>

#include <algorithm>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace concerto::planner::detail::rewrite {

// What the accesses of a graph imply lives with the graph (ir/hazards.hpp): every policy plans
// with it, and the verifier checks it.
using ir::derived_deps;
using ir::overlapping;
using ir::positions;
using ir::program_order;

/// A graph being rewritten: final buffers, and the new tasks in program order, each with the
/// tasks of the old graph it stands for (its origins).
struct draft {
  ir::graph graph;                            ///< name, axes, streams, buffers; tasks are filled by finish
  std::vector<ir::task> tasks;                ///< program order; ids and deps are assigned by finish
  std::vector<std::vector<ir::task_id>> origins;

  void add(ir::task t, std::vector<ir::task_id> from) {
    tasks.push_back(std::move(t));
    origins.push_back(std::move(from));
  }
};

/// Ids, then dependencies: the ones the accesses imply in the new program order, plus every
/// edge of `old` that its accesses did not imply (ordering a scheduler or a memory limit
/// added), carried to all the tasks that replace its two ends. Validates the result.
/// `old_derived` is derived_deps(old, old_order): a search that rewrites one graph many ways
/// computes it once.
[[nodiscard]] inline ir::graph finish(const ir::graph& old, const std::vector<std::vector<ir::task_id>>& old_derived,
                                      draft d) {
  std::vector<std::vector<ir::task_id>> replaced_by(old.tasks.size());
  for (std::size_t i = 0; i < d.origins.size(); ++i)
    for (auto o : d.origins[i]) replaced_by[static_cast<std::size_t>(o)].push_back(static_cast<ir::task_id>(i));

  auto& g = d.graph;
  g.tasks = std::move(d.tasks);
  std::vector<ir::task_id> order(g.tasks.size());
  for (std::size_t i = 0; i < g.tasks.size(); ++i) {
    g.tasks[i].id = static_cast<ir::task_id>(i);
    g.tasks[i].deps.clear();
    order[i] = static_cast<ir::task_id>(i);
  }
  auto deps = derived_deps(g, order);
  for (std::size_t i = 0; i < g.tasks.size(); ++i) {
    auto& out = deps[i];
    for (auto o : d.origins[i]) {
      const auto& implied = old_derived[static_cast<std::size_t>(o)];
      for (auto dep : old.tasks[static_cast<std::size_t>(o)].deps) {
        if (std::binary_search(implied.begin(), implied.end(), dep)) continue;
        for (auto r : replaced_by[static_cast<std::size_t>(dep)])
          if (r != static_cast<ir::task_id>(i)) out.push_back(r);
      }
    }
    std::sort(out.begin(), out.end());
    out.erase(std::unique(out.begin(), out.end()), out.end());
    g.tasks[i].deps = std::move(out);
  }
  g.validate();
  return std::move(g);
}

[[nodiscard]] inline ir::graph finish(const ir::graph& old, const std::vector<ir::task_id>& old_order, draft d) {
  return finish(old, derived_deps(old, old_order), std::move(d));
}

/// A graph's program order, each task's position in it and, per root buffer, the tasks that
/// touch it (in program order): built once per graph, so that finding a buffer's users costs
/// the users of its root, not a scan of the graph. Rewrites ask this for every candidate.
struct program {
  std::vector<ir::task_id> order;
  std::vector<std::size_t> pos;
  std::vector<std::vector<ir::task_id>> by_root;

  explicit program(const ir::graph& g) : order(program_order(g)), pos(positions(order)), by_root(g.buffers.size()) {
    for (auto id : order) {
      const auto& t = g.tasks[static_cast<std::size_t>(id)];
      for (const auto* list : {&t.reads, &t.writes})
        for (auto b : *list) {
          auto& users = by_root[static_cast<std::size_t>(g.root_of(b))];
          if (users.empty() || users.back() != id) users.push_back(id);
        }
    }
  }
  [[nodiscard]] std::size_t at(ir::task_id id) const { return pos[static_cast<std::size_t>(id)]; }
};

/// Every task that reads or writes a byte of buffer `b`, in program order.
[[nodiscard]] inline std::vector<ir::task_id> touchers(const ir::graph& g, const program& prog, ir::buffer_id b) {
  std::vector<ir::task_id> out;
  for (auto id : prog.by_root[static_cast<std::size_t>(g.root_of(b))]) {
    const auto& t = g.tasks[static_cast<std::size_t>(id)];
    const auto hits = [&](const std::vector<ir::buffer_id>& list) {
      return std::any_of(list.begin(), list.end(), [&](auto x) { return g.overlap(x, b); });
    };
    if (hits(t.reads) || hits(t.writes)) out.push_back(id);
  }
  return out;
}

/// "prefix<i>" by appending (g++ 12 warns falsely with -Wrestrict on literal + to_string).
[[nodiscard]] inline std::string indexed(std::string prefix, std::int64_t i) {
  prefix += std::to_string(i);
  return prefix;
}

} // namespace concerto::planner::detail::rewrite
