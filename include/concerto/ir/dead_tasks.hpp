#pragma once
/// @file
/// @brief Dead-task elimination: removes the tasks whose results nothing the step exposes
/// depends on (a repeat's layer-0 input gradient when the stack's input has no gradient, with the
/// collectives that were inserted for it), and the buffers only they used.
///
/// A task is kept when it writes a buffer that outlives the step or that the caller observes, or
/// when a kept task reads what it wrote; everything else is removed, transitively. Parameters and
/// optimizer state (`buffer_role::param`, `optimizer_state`) always outlive the step; the caller
/// names the rest (the loss, the gradients a user may read). Every rank removes the same tasks,
/// so collectives stay matched across ranks.
///
/// @code
/// ir::graph lean = ir::remove_dead_tasks(g, {loss_buffer, x_grad_buffer});
/// @endcode

#include <concerto/ir/graph.hpp>
#include <concerto/ir/hazards.hpp>

#include <algorithm>
#include <vector>

namespace concerto::ir {

/// @brief The graph without the tasks nothing observable depends on; see the file comment.
/// Orderings between kept tasks that went through a removed one are kept (the kept task inherits
/// the removed one's dependencies), so the result runs wherever the input did. Buffers that only
/// removed tasks used are removed too (ids renumbered, views kept after their roots); a buffer no
/// task used before stays. Returns the graph unchanged when nothing is dead.
[[nodiscard]] inline graph remove_dead_tasks(const graph& g, const std::vector<buffer_id>& observed) {
  const auto n_tasks = g.tasks.size(), n_buffers = g.buffers.size();
  // Buffers that can share bytes: those with one root.
  std::vector<std::vector<buffer_id>> family(n_buffers);
  for (std::size_t b = 0; b < n_buffers; ++b)
    family[static_cast<std::size_t>(g.root_of(static_cast<buffer_id>(b)))].push_back(static_cast<buffer_id>(b));
  const auto relatives = [&](buffer_id b) -> const std::vector<buffer_id>& {
    return family[static_cast<std::size_t>(g.root_of(b))];
  };

  std::vector<char> is_observed(n_buffers, 0);
  for (const auto& b : g.buffers)
    is_observed[static_cast<std::size_t>(b.id)] = b.role == buffer_role::param || b.role == buffer_role::optimizer_state;
  for (auto b : observed) {
    CONCERTO_CHECK(b >= 0 && static_cast<std::size_t>(b) < n_buffers,
                   "remove_dead_tasks: graph '" + g.name + "' has no buffer " + std::to_string(b));
    is_observed[static_cast<std::size_t>(b)] = 1;
  }

  // Who produced what each task reads (as ir::builder derives read-after-write edges).
  const auto producers = data_producers(g);

  // Live: what writes an observed buffer (or writes nothing, which this pass cannot judge), and
  // what a live task reads from.
  std::vector<char> live(n_tasks, 0);
  std::vector<task_id> work;
  const auto mark = [&](task_id t) {
    if (!live[static_cast<std::size_t>(t)]) {
      live[static_cast<std::size_t>(t)] = 1;
      work.push_back(t);
    }
  };
  for (const auto& t : g.tasks) {
    bool root = t.writes.empty();
    for (auto w : t.writes)
      for (auto b : relatives(w)) root = root || (is_observed[static_cast<std::size_t>(b)] && g.overlap(w, b));
    if (root) mark(t.id);
  }
  while (!work.empty()) {
    const auto t = work.back();
    work.pop_back();
    for (auto p : producers[static_cast<std::size_t>(t)]) mark(p);
  }
  if (std::all_of(live.begin(), live.end(), [](char l) { return l != 0; })) return g;

  // Buffers: those kept tasks use (with the roots of their views), the observed ones, and those no
  // task used in the first place (not this pass's business).
  std::vector<char> used_before(n_buffers, 0), keep_buffer(n_buffers, 0);
  for (const auto& t : g.tasks)
    for (const auto* list : {&t.reads, &t.writes})
      for (auto b : *list) {
        used_before[static_cast<std::size_t>(b)] = 1;
        if (live[static_cast<std::size_t>(t.id)]) keep_buffer[static_cast<std::size_t>(b)] = 1;
      }
  for (std::size_t b = n_buffers; b-- > 0;) { // down: a view is reached before its (earlier) root
    if (!used_before[b] || is_observed[b]) keep_buffer[b] = 1;
    if (keep_buffer[b] && g.buffers[b].view_of >= 0) keep_buffer[static_cast<std::size_t>(g.buffers[b].view_of)] = 1;
  }
  std::vector<buffer_id> new_buffer(n_buffers, -1);
  auto out = g.empty_like();
  for (std::size_t b = 0; b < n_buffers; ++b) {
    if (!keep_buffer[b]) continue;
    auto buf = g.buffers[b];
    buf.id = new_buffer[b] = static_cast<buffer_id>(out.buffers.size());
    if (buf.view_of >= 0) buf.view_of = new_buffer[static_cast<std::size_t>(buf.view_of)];
    out.buffers.push_back(std::move(buf));
  }

  // Tasks: a kept task waits for what the removed tasks it waited for waited for, so that no
  // ordering between kept tasks is lost (one may have been implied only through a removed task).
  std::vector<task_id> new_task(n_tasks, -1);
  for (std::size_t t = 0, next = 0; t < n_tasks; ++t)
    if (live[t]) new_task[t] = static_cast<task_id>(next++);
  std::vector<std::vector<task_id>> kept_deps(n_tasks); // in new ids
  for (const auto id : g.topological_order()) {
    const auto& t = g.tasks[static_cast<std::size_t>(id)];
    auto& deps = kept_deps[static_cast<std::size_t>(id)];
    for (auto d : t.deps) {
      if (live[static_cast<std::size_t>(d)]) deps.push_back(new_task[static_cast<std::size_t>(d)]);
      else deps.insert(deps.end(), kept_deps[static_cast<std::size_t>(d)].begin(), kept_deps[static_cast<std::size_t>(d)].end());
    }
    std::sort(deps.begin(), deps.end());
    deps.erase(std::unique(deps.begin(), deps.end()), deps.end());
  }
  const auto remap = [&](std::vector<buffer_id>& list) {
    for (auto& b : list) b = new_buffer[static_cast<std::size_t>(b)];
  };
  for (std::size_t t = 0; t < n_tasks; ++t) {
    if (!live[t]) continue;
    auto task = g.tasks[t];
    task.id = new_task[t];
    task.deps = std::move(kept_deps[t]);
    remap(task.reads);
    remap(task.writes);
    out.tasks.push_back(std::move(task));
  }
  out.validate();
  return out;
}

} // namespace concerto::ir
