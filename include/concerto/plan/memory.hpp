#pragma once
/// @file
/// @brief Peak per-rank memory of a plan, from its predicted start times.
///
/// Only root buffers occupy memory; a view is bytes of its root, so an access through a view
/// keeps the root alive. Inputs, parameters, gradients and optimizer state live for the whole
/// step (they outlive it). Activations and workspaces live from the start of the first task
/// that writes them (or, if none does, the first that touches them) to the end of the last
/// task that touches them.

#include <concerto/ir/graph.hpp>
#include <concerto/plan/plan.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <tuple>
#include <vector>

namespace concerto::plan {

/// @brief Peak memory and what is live at the peak (persistent buffers included, so the bytes
/// of `live_at_peak` add up to `peak_bytes`).
struct memory_report {
  std::int64_t peak_bytes = 0;
  std::int64_t persistent_bytes = 0;         ///< inputs, params, gradients, optimizer state
  double peak_at_us = 0;                     ///< when the peak is first reached
  std::vector<ir::buffer_id> live_at_peak;   ///< root buffers, by id
};

/// @brief Whether buffers of a role live for the whole step (and beyond it).
[[nodiscard]] constexpr bool is_persistent(ir::buffer_role r) noexcept {
  return r == ir::buffer_role::input || r == ir::buffer_role::param || r == ir::buffer_role::gradient ||
         r == ir::buffer_role::optimizer_state;
}

/// @brief Peak memory of a plan; throws concerto::error if its times do not cover every task.
/// @code
/// auto mem = plan::peak_memory(p);
/// std::printf("peak %.1f MiB at %.1f us\n", mem.peak_bytes / 1048576.0, mem.peak_at_us);
/// @endcode
[[nodiscard]] inline memory_report peak_memory(const plan& p) {
  const auto& g = p.graph;
  g.validate(); // view chains must end at a root
  const auto n = g.tasks.size();
  if (p.start_us.size() != n || p.duration_us.size() != n)
    fail("peak memory of plan '" + g.name + "': start and duration times are given for " +
         std::to_string(std::min(p.start_us.size(), p.duration_us.size())) + " of " + std::to_string(n) + " tasks");
  const auto nb = g.buffers.size();
  constexpr double none = std::numeric_limits<double>::infinity();
  std::vector<double> first_write(nb, none), first_use(nb, none), last_use(nb, -none);
  for (std::size_t i = 0; i < n; ++i) {
    const auto& t = g.tasks[i];
    const double start = p.start_us[i], end = start + p.duration_us[i];
    if (!std::isfinite(start) || !std::isfinite(end) || p.duration_us[i] < 0)
      fail("peak memory of plan '" + g.name + "': task " + std::to_string(i) + " '" + t.name +
           "' has no valid start time and duration");
    const auto touch = [&](ir::buffer_id b, bool write) {
      if (b < 0 || static_cast<std::size_t>(b) >= nb)
        fail("peak memory of plan '" + g.name + "': task " + std::to_string(i) + " '" + t.name + "' uses buffer " +
             std::to_string(b) + ", which does not exist");
      const auto r = static_cast<std::size_t>(g.root_of(b));
      if (write) first_write[r] = std::min(first_write[r], start);
      first_use[r] = std::min(first_use[r], start);
      last_use[r] = std::max(last_use[r], end);
    };
    for (const auto b : t.reads) touch(b, false);
    for (const auto b : t.writes) touch(b, true);
  }

  memory_report report;
  struct interval {
    double begin, end;
    ir::buffer_id id;
  };
  std::vector<interval> transient;
  for (std::size_t b = 0; b < nb; ++b) {
    const auto& buf = g.buffers[b];
    if (buf.view_of >= 0) continue;
    if (is_persistent(buf.role)) {
      report.persistent_bytes += buf.bytes;
    } else if (first_use[b] < none) {
      const double begin = first_write[b] < none ? first_write[b] : first_use[b];
      transient.push_back({begin, std::max(begin, last_use[b]), static_cast<ir::buffer_id>(b)});
    }
  }

  // Sweep: at one instant, buffers whose last user ended are freed before new ones are
  // allocated (a task may reuse memory released by the task before it); a buffer used only
  // by zero-length tasks is counted at its instant, then freed.
  enum : int { free_first = 0, allocate = 1, free_last = 2 };
  std::vector<std::tuple<double, int, std::size_t>> events;
  events.reserve(2 * transient.size());
  for (std::size_t k = 0; k < transient.size(); ++k) {
    const auto& iv = transient[k];
    events.emplace_back(iv.begin, allocate, k);
    events.emplace_back(iv.end, iv.end > iv.begin ? free_first : free_last, k);
  }
  std::sort(events.begin(), events.end());
  std::int64_t live = report.persistent_bytes;
  report.peak_bytes = live;
  for (const auto& [time, kind, k] : events) {
    const auto bytes = g.buffers[static_cast<std::size_t>(transient[k].id)].bytes;
    if (kind == allocate) {
      live += bytes;
      if (live > report.peak_bytes) {
        report.peak_bytes = live;
        report.peak_at_us = time;
      }
    } else {
      live -= bytes;
    }
  }

  const double at = report.peak_at_us;
  for (std::size_t b = 0; b < nb; ++b)
    if (g.buffers[b].view_of < 0 && is_persistent(g.buffers[b].role)) report.live_at_peak.push_back(static_cast<ir::buffer_id>(b));
  for (const auto& iv : transient)
    if ((iv.begin <= at && at < iv.end) || (iv.begin == at && iv.end == at)) report.live_at_peak.push_back(iv.id);
  std::sort(report.live_at_peak.begin(), report.live_at_peak.end());
  return report;
}

} // namespace concerto::plan
