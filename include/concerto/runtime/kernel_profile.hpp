#pragma once
/// @file
/// @brief Times a graph's compute tasks on this machine's CPU kernels, and turns the times into
/// the cost model's per-kernel factors (cost::hardware::kernel_scale).
///
/// The roofline prices a task from its flops and bytes; how close a kernel comes to that depends
/// on how it is written (a GELU built on libm calls ran 35× its roofline time, an AdamW update
/// 2×). Rather than describe each kernel, the runtime runs the graph's own tasks, at the graph's
/// own shapes, once before planning: every compute task in topological order on a zeroed arena
/// laid out like the executor's (zeros are valid ids, and the CPU kernels' time does not depend
/// on the values), a warm-up run and then the mean of `repeats`. The mean, not the best: where
/// ranks outnumber cores they time-slice, a step meets that on average, and the best run is the
/// one that happened to have a core to itself (on 4 ranks over 2 cores the best-of times made
/// every step look about 1.6x faster than it ran). A kernel's factor is its tasks' total measured time
/// over their total roofline time, so the large tasks, which matter to a schedule, dominate it.
///
/// @code
/// auto times = runtime::time_kernels(g, settings);
/// auto hw = model.hw();
/// hw.kernel_scale = runtime::kernel_scales(times, g, model);
/// cost::model measured(hw);
/// @endcode

#include <concerto/cost/model.hpp>
#include <concerto/ir/graph.hpp>
#include <concerto/runtime/buffers.hpp>
#include <concerto/runtime/dispatch.hpp>

#include <algorithm>
#include <chrono>
#include <map>
#include <set>
#include <string>
#include <vector>

namespace concerto::runtime {

/// @brief Measured time of each compute task of a graph, by task id (0 for collectives and
/// for tasks of kernels that were not asked for).
struct kernel_times {
  std::vector<double> task_us;
};

/// @brief Runs every compute task of `g` whose kernel is in `only` (all when empty) on the CPU
/// kernels and records its mean time over `repeats` runs after a warm-up. Allocates one arena
/// the size of the executor's for the duration of the call.
[[nodiscard]] inline kernel_times time_kernels(const ir::graph& g, const kernel_settings& settings,
                                               const std::set<std::string, std::less<>>& only = {}, int repeats = 3) {
  CONCERTO_CHECK(repeats >= 1, "time_kernels: repeats must be at least 1");
  host_arena mem(g, make_layout(g, workspace_bytes(g)));
  kernel_times out;
  out.task_us.assign(g.tasks.size(), 0.0);
  for (const auto id : g.topological_order()) {
    const auto& t = g.tasks[static_cast<std::size_t>(id)];
    if (ir::is_collective(t.kind)) continue;
    if (!only.empty() && !only.contains(cost::model::kernel_name(t))) continue;
    const auto call = decode(g, t, settings.coords);
    run_kernel(call, mem, settings); // warm: caches, page faults of the first touch
    const auto t0 = std::chrono::steady_clock::now();
    for (int r = 0; r < repeats; ++r) run_kernel(call, mem, settings);
    out.task_us[static_cast<std::size_t>(id)] =
        std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count() / repeats;
  }
  return out;
}

/// @brief Per kernel of the timed tasks: Σ measured / Σ roofline time under `m` (its
/// launch_us excluded on both sides, and any kernel_scale `m` already has ignored). A kernel
/// whose tasks all ran within launch_us gets no factor: its time is the launch, already priced.
[[nodiscard]] inline std::map<std::string, double, std::less<>> kernel_scales(const kernel_times& times, const ir::graph& g,
                                                                            const cost::model& m) {
  CONCERTO_CHECK(times.task_us.size() == g.tasks.size(),
                 "kernel_scales: the times cover " + std::to_string(times.task_us.size()) + " tasks, graph '" + g.name +
                     "' has " + std::to_string(g.tasks.size()));
  auto hw = m.hw();
  hw.kernel_scale.clear();
  const cost::model roofline(hw);
  std::map<std::string, std::pair<double, double>, std::less<>> sums; // kernel -> (measured, priced)
  for (const auto& t : g.tasks) {
    const double measured = times.task_us[static_cast<std::size_t>(t.id)];
    if (ir::is_collective(t.kind) || measured <= 0) continue;
    auto& [meas, priced] = sums[std::string(cost::model::kernel_name(t))];
    meas += std::max(0.0, measured - hw.launch_us);
    priced += roofline.compute_us(t) - hw.launch_us;
  }
  std::map<std::string, double, std::less<>> out;
  for (const auto& [kernel, s] : sums)
    if (s.second > 0 && s.first > 0) out[kernel] = s.first / s.second; // a kernel priced at nothing keeps factor 1
  return out;
}

} // namespace concerto::runtime
