#pragma once
/// @file
/// @brief Which backward work of a pipelined step is W (a weight gradient's), by data flow: the
/// one classification the stage split (pipeline/stages.hpp) and the benchmark workloads
/// (pipeline/workloads.hpp) share, as they share the pricing of each kind of work (charge).
///
/// A backward task is W when only weight gradients need what it writes: every task reading it
/// runs once per step (the gradient reduction, the optimizer) or is W itself and runs in the same
/// pass. Everything else of the backward is B, the input gradients the previous stage waits for;
/// a zero-bubble schedule may run W later to fill the bubbles, because nothing B needs waits on it.
/// A tensor-parallel collective summing a weight's gradient (sequence parallelism's norm gains) is
/// therefore W, and one summing an input gradient is B.

#include <concerto/ir/graph.hpp>

#include <cstddef>
#include <vector>

namespace concerto::pipeline {

/// @brief Per task of `g`, whether it is W. `consumers[t]`: the tasks reading what t writes;
/// `backward(t)`: t is backward work of a micro-batch (the candidates); `once_per_step(u)`: u runs
/// once per step; `together(t, u)`: u, itself W, runs in t's pass (the split: the same chunk).
template <class Backward, class OncePerStep, class Together>
[[nodiscard]] std::vector<char> weight_grad_tasks(const ir::graph& g, const std::vector<std::vector<ir::task_id>>& consumers,
                                                  Backward backward, OncePerStep once_per_step, Together together) {
  std::vector<char> w(g.tasks.size(), 0);
  // Readers come later in the step, so one pass from the last task decides each from its readers.
  for (auto t = static_cast<ir::task_id>(g.tasks.size()); t-- > 0;) {
    if (!backward(t)) continue;
    bool weight_only = true;
    for (const auto u : consumers[static_cast<std::size_t>(t)])
      if (!once_per_step(u) && !(w[static_cast<std::size_t>(u)] && together(t, u))) weight_only = false;
    w[static_cast<std::size_t>(t)] = weight_only;
  }
  return w;
}

/// @brief The readers of each task's writes, from the producers ir::data_producers gives.
[[nodiscard]] inline std::vector<std::vector<ir::task_id>> consumers_of(const std::vector<std::vector<ir::task_id>>& producers) {
  std::vector<std::vector<ir::task_id>> consumers(producers.size());
  for (std::size_t t = 0; t < producers.size(); ++t)
    for (const auto p : producers[t]) consumers[static_cast<std::size_t>(p)].push_back(static_cast<ir::task_id>(t));
  return consumers;
}

} // namespace concerto::pipeline
