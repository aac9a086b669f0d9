#pragma once
/// @file
/// @brief What a graph's buffer accesses imply: the order in which two tasks touching the same
/// bytes must run (read after write, write after write, write after read, views included).
///
/// A graph's meaning is its declared dependencies plus these, taken in program order (task ids
/// when they are topological, as the builder makes them, else the declared dependencies'
/// topological order). The builder derives them as it adds tasks; a graph written by another
/// tool may omit some. `planner::make_plan` plans every policy with `with_buffer_hazards(g)`,
/// and `plan::verify` refuses a plan whose graph leaves a hazard unordered (a data race).
/// docs/graph-schema.md says the same for users.

#include <concerto/ir/graph.hpp>

#include <algorithm>
#include <cstddef>
#include <string>
#include <vector>

namespace concerto::ir {

/// Ascending ids when they are topological (builder graphs), else the graph's topological order.
[[nodiscard]] inline std::vector<task_id> program_order(const graph& g) {
  bool ascending = true;
  for (const auto& t : g.tasks)
    for (auto d : t.deps)
      if (d >= t.id) ascending = false;
  if (!ascending) return g.topological_order();
  std::vector<task_id> order(g.tasks.size());
  for (std::size_t i = 0; i < order.size(); ++i) order[i] = static_cast<task_id>(i);
  return order;
}

/// Position of each task in `order`.
[[nodiscard]] inline std::vector<std::size_t> positions(const std::vector<task_id>& order) {
  std::vector<std::size_t> pos(order.size());
  for (std::size_t i = 0; i < order.size(); ++i) pos[static_cast<std::size_t>(order[i])] = i;
  return pos;
}

/// For each buffer, the buffers sharing at least one byte with it (itself included).
[[nodiscard]] inline std::vector<std::vector<buffer_id>> overlapping(const graph& g) {
  const auto nb = g.buffers.size();
  std::vector<std::vector<buffer_id>> by_root(nb);
  for (std::size_t b = 0; b < nb; ++b)
    by_root[static_cast<std::size_t>(g.root_of(static_cast<buffer_id>(b)))].push_back(static_cast<buffer_id>(b));
  std::vector<std::vector<buffer_id>> out(nb);
  for (std::size_t b = 0; b < nb; ++b)
    for (auto other : by_root[static_cast<std::size_t>(g.root_of(static_cast<buffer_id>(b)))])
      if (g.overlap(static_cast<buffer_id>(b), other)) out[b].push_back(other);
  return out;
}

/// The dependencies the builder derives from reads and writes (RAW, WAW, WAR, views included)
/// when the tasks of `g` are issued in `order`; indexed by task id, sorted.
[[nodiscard]] inline std::vector<std::vector<task_id>> derived_deps(const graph& g,
                                                                        const std::vector<task_id>& order) {
  const auto over = overlapping(g);
  std::vector<task_id> last_writer(g.buffers.size(), -1);
  std::vector<std::vector<task_id>> readers(g.buffers.size());
  std::vector<std::vector<task_id>> deps(g.tasks.size());
  std::vector<char> read_mark(g.buffers.size(), 0), write_mark(g.buffers.size(), 0);
  for (const auto id : order) {
    const auto& t = g.tasks[static_cast<std::size_t>(id)];
    std::vector<buffer_id> touched;
    for (auto r : t.reads)
      for (auto o : over[static_cast<std::size_t>(r)]) {
        if (!read_mark[static_cast<std::size_t>(o)] && !write_mark[static_cast<std::size_t>(o)]) touched.push_back(o);
        read_mark[static_cast<std::size_t>(o)] = 1;
      }
    for (auto w : t.writes)
      for (auto o : over[static_cast<std::size_t>(w)]) {
        if (!read_mark[static_cast<std::size_t>(o)] && !write_mark[static_cast<std::size_t>(o)]) touched.push_back(o);
        write_mark[static_cast<std::size_t>(o)] = 1;
      }
    auto& d = deps[static_cast<std::size_t>(id)];
    for (auto o : touched) {
      const auto ou = static_cast<std::size_t>(o);
      if (last_writer[ou] >= 0) d.push_back(last_writer[ou]);
      if (write_mark[ou]) d.insert(d.end(), readers[ou].begin(), readers[ou].end());
      read_mark[ou] = write_mark[ou] = 0;
    }
    for (auto r : t.reads) readers[static_cast<std::size_t>(r)].push_back(id);
    for (auto w : t.writes) {
      last_writer[static_cast<std::size_t>(w)] = id;
      readers[static_cast<std::size_t>(w)].clear();
    }
    std::sort(d.begin(), d.end());
    d.erase(std::unique(d.begin(), d.end()), d.end());
    d.erase(std::remove(d.begin(), d.end(), id), d.end());
  }
  return deps;
}

/// @brief Who produced what each task reads, indexed by task id: replaying the tasks in program
/// order, the last writer of every buffer that overlaps a read (a writer of a view counts for a
/// read of its root and the other way round), each writer once. Where the dependencies order
/// every pair of conflicting accesses, any order they allow finds the same writers.
[[nodiscard]] inline std::vector<std::vector<task_id>> data_producers(const graph& g) {
  const auto over = overlapping(g);
  std::vector<task_id> last_writer(g.buffers.size(), -1);
  std::vector<std::vector<task_id>> out(g.tasks.size());
  for (const auto id : program_order(g)) {
    const auto& t = g.tasks[static_cast<std::size_t>(id)];
    auto& from = out[static_cast<std::size_t>(id)];
    for (auto r : t.reads)
      for (auto b : over[static_cast<std::size_t>(r)])
        if (const auto w = last_writer[static_cast<std::size_t>(b)]; w >= 0 && std::find(from.begin(), from.end(), w) == from.end())
          from.push_back(w);
    for (auto w : t.writes) last_writer[static_cast<std::size_t>(w)] = id;
  }
  return out;
}

/// @brief `g` with every dependency its accesses imply added to the declared ones (only those not
/// declared directly; `added`, when given, counts them). Plans of the result cannot race.
[[nodiscard]] inline graph with_buffer_hazards(graph g, std::size_t* added = nullptr) {
  const auto implied = derived_deps(g, program_order(g));
  std::size_t count = 0;
  for (std::size_t i = 0; i < g.tasks.size(); ++i) {
    auto& deps = g.tasks[i].deps;
    for (const auto d : implied[i])
      if (std::find(deps.begin(), deps.end(), d) == deps.end()) {
        deps.push_back(d);
        ++count;
      }
  }
  if (added) *added = count;
  return g;
}

} // namespace concerto::ir
