#pragma once
/// @file
/// @brief Profile-guided refit of the cost model: from the measured steps of a plan, the
/// model's numbers for this job (per-kernel factors, each link class's alpha and bandwidth,
/// the two overlap slowdowns), so that the planner re-plans with costs the machine showed.
///
/// Where the model is wrong the plan is wrong: a roofline that prices a kernel at half its time,
/// or a link twice as fast as it is, makes the planner hide the wrong collectives. The executor
/// measures every task of every step (runtime/executor.hpp); `observe` condenses the steps into
/// one duration per task and the share of it that ran overlapped with the other kind of work,
/// and `refit` solves for the model's parameters:
///
/// - A compute task that ran a fraction f of its time next to a collective took
///   d = w / (1 - f + f/s) for work w and compute slowdown s (the simulator's semantics: work
///   progresses at 1/s while overlapped). Each kernel's factor is Σ w / Σ roofline over its
///   tasks; s is the median over overlapped tasks of the s that explains them. Alternated until
///   both settle.
/// - Collectives are linear in their link's parameters (cost::model::collective_terms):
///   d = steps × alpha + bytes / bandwidth. Per link class, least squares over the collectives
///   that ran while compute was idle (all of them where fewer than two did); a link whose
///   collectives all have one size keeps its alpha and gets the bandwidth that explains them.
///   What slowed the overlapped ones (kernels on the cores the network needs, late ranks, MPI
///   progressing only between kernels) is the collectives' overlap slowdown, found by bisection
///   so that the replay of the measured plan takes the measured step.
///
/// A parameter nothing measured keeps its value. Steps measured with `step_us` of the plan
/// replayed under the refitted model give `predicted_us`, so a caller can say how close the
/// refitted model comes to the measured step.
///
/// @code
/// std::vector<sim::result> steps = ...;                     // executor reports, after warm-up
/// auto seen = planner::observe(p.graph, steps);
/// auto fit = planner::refit(p, model, seen);
/// auto better = planner::make_plan(g, fit.model, {.policy = planner::policy::concerto});
/// @endcode

#include <concerto/core/error.hpp>
#include <concerto/core/intervals.hpp>
#include <concerto/core/statistics.hpp>
#include <concerto/cost/model.hpp>
#include <concerto/ir/graph.hpp>
#include <concerto/plan/plan.hpp>
#include <concerto/sim/simulate.hpp>

#include <algorithm>
#include <cmath>
#include <map>
#include <set>
#include <span>
#include <string>
#include <vector>

namespace concerto::planner {

/// @brief One task as measured: how long it ran and which share of that time the other kind of
/// stream was busy (a collective in flight for a compute task, a kernel running for a collective).
struct task_observation {
  double duration_us = 0;
  double overlapped = 0; ///< in [0, 1]
};

/// @brief What measured steps of one plan showed, per task id of its graph.
struct observation {
  std::vector<task_observation> tasks;
  double step_us = 0; ///< median measured step
  int steps = 0;      ///< how many steps it summarises
};

/// @brief A plan's step time under `model`: its orders replayed with the model's durations and
/// contention (its own start times may come from another model).
[[nodiscard]] inline double replayed_us(const plan::plan& p, const cost::model& model) {
  return sim::simulate(p, model.durations_us(p.graph), {model.overlap_slowdown(), model.comm_overlap_slowdown()}).step_us;
}

namespace detail::refitting {

/// The compute slowdown that makes a task of work `w` that was overlapped a share `f` of its
/// measured duration `d` take `d`: d = w / (1 - f + f/s).
inline double slowdown_explaining(double w, double d, double f) {
  const double inv = (w / d - 1 + f) / f; // 1/s
  return inv > 0 ? 1 / inv : 100.0;
}

/// The work that took `d` at slowdown `s` for a share `f`.
inline double work_of(double d, double f, double s) { return d * (1 - f + f / s); }

} // namespace detail::refitting

/// @brief Condenses measured steps of one plan (the executor's `step_report::measured`, or a
/// replay) into one observation per task: the median over the steps of the time it was served
/// (from its start, or from the end of the task before it on its stream if that was later) and
/// of the share of it spent next to the other kind of work. Throws concerto::error when a step's size
/// does not match the graph.
[[nodiscard]] inline observation observe(const ir::graph& g, std::span<const sim::result> steps) {
  using namespace detail::refitting;
  const auto n = g.tasks.size();
  observation out;
  out.tasks.resize(n);
  out.steps = static_cast<int>(steps.size());
  if (steps.empty()) return out;
  std::vector<std::vector<double>> durations(n), shares(n);
  std::vector<double> step_times;
  for (const auto& r : steps) {
    if (r.start_us.size() != n || r.end_us.size() != n)
      fail("observe: a measured step of graph '" + g.name + "' has " + std::to_string(r.start_us.size()) +
           " tasks, the graph " + std::to_string(n));
    // A task is served from when it was issued, or from when the task before it on its stream
    // ended if that was later: an executor may issue a lane's next collective before the last
    // one finished, and it then waits behind it, which the simulator's one-at-a-time streams
    // already count. (Compute streams run one task at a time: nothing changes there.)
    std::vector<double> served(r.start_us);
    std::vector<std::vector<std::size_t>> by_stream(g.streams.size());
    for (std::size_t i = 0; i < n; ++i) by_stream.at(static_cast<std::size_t>(g.tasks[i].stream)).push_back(i);
    for (auto& ids : by_stream) {
      std::sort(ids.begin(), ids.end(), [&](std::size_t a, std::size_t b) { return r.start_us[a] < r.start_us[b]; });
      for (std::size_t k = 1; k < ids.size(); ++k)
        served[ids[k]] = std::clamp(r.end_us[ids[k - 1]], r.start_us[ids[k]], r.end_us[ids[k]]);
    }
    intervals::span_list compute, comm;
    for (std::size_t i = 0; i < n; ++i)
      (ir::is_collective(g.tasks[i].kind) ? comm : compute).emplace_back(served[i], r.end_us[i]);
    const auto compute_busy = intervals::merged(std::move(compute)), comm_busy = intervals::merged(std::move(comm));
    for (std::size_t i = 0; i < n; ++i) {
      const double d = r.end_us[i] - served[i];
      durations[i].push_back(d);
      const auto& other = ir::is_collective(g.tasks[i].kind) ? compute_busy : comm_busy;
      shares[i].push_back(d > 0 ? std::clamp(intervals::covered(other, served[i], r.end_us[i]) / d, 0.0, 1.0) : 0.0);
    }
    step_times.push_back(r.step_us);
  }
  for (std::size_t i = 0; i < n; ++i) out.tasks[i] = {median(std::move(durations[i])), median(std::move(shares[i]))};
  out.step_us = median(std::move(step_times));
  return out;
}

/// @brief A refitted model and what it changed.
struct refit_result {
  cost::model model;
  double measured_us = 0;         ///< the observation's median step
  double predicted_before_us = 0; ///< the plan replayed under the model given
  double predicted_after_us = 0;  ///< the plan replayed under the refitted model
  std::map<std::string, double, std::less<>> kernel_factor_change; ///< new over old factor, per kernel refitted
  int links_refitted = 0;         ///< link classes whose alpha or bandwidth was fitted

  /// "refit: predicted 120 us -> 141 us, measured 143 us (2 links, 9 kernels)".
  [[nodiscard]] std::string text() const {
    char buf[200];
    std::snprintf(buf, sizeof buf, "refit: predicted %.0f us -> %.0f us, measured %.0f us (%d link classes, %zu kernels)",
                  predicted_before_us, predicted_after_us, measured_us, links_refitted, kernel_factor_change.size());
    return buf;
  }
};

namespace detail::refitting {

constexpr double overlapped_enough = 0.25; // a task overlapped this much tells about contention

// Compute: kernel factors and the compute slowdown, alternated until they settle. Returns each
// fitted kernel's factor over its prior one.
inline std::map<std::string, double, std::less<>> fit_compute(const ir::graph& g, const observation& seen, cost::hardware& hw) {
  std::map<std::string, double, std::less<>> changes;
  std::map<std::string, std::vector<std::size_t>, std::less<>> by_kernel;
  for (const auto& t : g.tasks)
    if (!ir::is_collective(t.kind) && seen.tasks[static_cast<std::size_t>(t.id)].duration_us > 0)
      by_kernel[std::string(cost::model::kernel_name(t))].push_back(static_cast<std::size_t>(t.id));
  const auto old_scale = hw.kernel_scale;
  std::set<std::string, std::less<>> fitted; // kernels with measured work: the others keep their factor
  for (int round = 0; round < 4; ++round) {
    cost::model current(hw);
    for (const auto& [kernel, ids] : by_kernel) {
      double work = 0, roofline = 0;
      const auto it = hw.kernel_scale.find(kernel);
      const double scale = it == hw.kernel_scale.end() ? 1.0 : it->second;
      for (const auto i : ids) {
        const auto& o = seen.tasks[i];
        work += std::max(work_of(o.duration_us, o.overlapped, hw.overlap_slowdown) - hw.launch_us, 0.0);
        roofline += (current.compute_us(g.tasks[i]) - hw.launch_us) / scale;
      }
      if (work > 0 && roofline > 0) {
        hw.kernel_scale[kernel] = work / roofline;
        fitted.insert(kernel);
      }
    }
    cost::model scaled(hw);
    std::vector<double> explained;
    for (const auto& [kernel, ids] : by_kernel)
      for (const auto i : ids)
        if (const auto& o = seen.tasks[i]; o.overlapped >= overlapped_enough)
          explained.push_back(slowdown_explaining(scaled.compute_us(g.tasks[i]), o.duration_us, o.overlapped));
    if (!explained.empty()) hw.overlap_slowdown = std::clamp(median(std::move(explained)), 1.0, 4.0);
  }
  for (const auto& kernel : fitted) {
    const auto it = old_scale.find(kernel);
    changes[kernel] = hw.kernel_scale.at(kernel) / (it == old_scale.end() ? 1.0 : it->second);
  }
  return changes;
}

// Collectives. A measured duration mixes the link's speed with what slowed the collective down
// (kernels on the cores the network stack needs, a rank that arrived late, a CPU executor that
// progresses MPI only between kernels). So each link class is fitted on the collectives that
// ran mostly while compute was idle (all of them where fewer than two did), by least squares of
// d = steps × alpha + bytes / bandwidth (fit_link, which says whether it refitted the class); and
// the collectives' overlap slowdown is then the one that makes the replay of the measured plan
// take the measured step (fit_comm_slowdown).
// `linkless` is the model before any link is refitted (it picks each collective's algorithm).
inline bool fit_link(const ir::graph& g, const observation& seen, const cost::model& linkless, cost::hardware& hw,
                     ir::link_class link) {
  struct sample {
    double latency_steps, bytes, duration;
  };
  std::vector<sample> alone, all;
  for (const auto& t : g.tasks) {
    if (!ir::is_collective(t.kind) || t.axis < 0) continue;
    const auto& axis = g.axes[static_cast<std::size_t>(t.axis)];
    const auto& o = seen.tasks[static_cast<std::size_t>(t.id)];
    if (axis.link != link || axis.size <= 1 || o.duration_us <= 0) continue;
    const auto terms = cost::model::collective_terms(t.kind, t.bytes, axis.size,
                                                     linkless.algorithm_for(t.kind, t.bytes, axis.size, link));
    const sample x{terms.latency_steps, terms.bytes_sent, o.duration_us};
    all.push_back(x);
    if (o.overlapped < overlapped_enough) alone.push_back(x);
  }
  const auto& used = alone.size() >= 2 ? alone : all;
  if (used.empty()) return false;
  double saa = 0, sab = 0, sbb = 0, sad = 0, sbd = 0, sd = 0, latency_steps = 0, bytes = 0;
  for (const auto& [a, b, d] : used) {
    saa += a * a, sab += a * b, sbb += b * b, sad += a * d, sbd += b * d, sd += d;
    latency_steps += a, bytes += b;
  }
  auto& l = link == ir::link_class::intra_node ? hw.intra_node : hw.inter_node;
  const double det = saa * sbb - sab * sab;
  double alpha = -1, per_byte = -1;
  if (det > 1e-9 * saa * sbb) {
    alpha = (sad * sbb - sbd * sab) / det;
    per_byte = (saa * sbd - sab * sad) / det;
  }
  if (alpha < 0 || per_byte <= 0) {
    // One size, or a fit that would make a parameter negative: keep the alpha, and take the
    // bandwidth that makes these collectives last what they lasted in total.
    alpha = l.alpha_us;
    if (bytes <= 0 || sd <= latency_steps * alpha) return false; // nothing to say about the bandwidth
    per_byte = (sd - latency_steps * alpha) / bytes;
  }
  l.alpha_us = alpha;
  l.bandwidth_gbps = 1 / (per_byte * 1e3);
  return true;
}

// The collectives' overlap slowdown that makes `replay` of the measured plan take `step_us`.
template <class Replay>
double fit_comm_slowdown(const cost::hardware& hw, double step_us, const Replay& replay) {
  // The replayed step grows with the slowdown: bisection between none and 20 times.
  const auto step_at = [&](double slowdown) {
    auto trial = hw;
    trial.comm_overlap_slowdown = slowdown;
    return replay(cost::model(std::move(trial)));
  };
  double low = 1, high = 20;
  if (step_at(low) >= step_us) {
    high = low;
  } else if (step_at(high) <= step_us) {
    low = high;
  } else {
    for (int i = 0; i < 40 && high - low > 1e-4; ++i) (step_at((low + high) / 2) < step_us ? low : high) = (low + high) / 2;
  }
  return (low + high) / 2;
}

} // namespace detail::refitting

/// @brief The model's parameters refitted to what plan `p` measured (see the file comment).
/// Throws concerto::error when the observation is not of `p`'s graph.
[[nodiscard]] inline refit_result refit(const plan::plan& p, const cost::model& prior, const observation& seen) {
  using namespace detail::refitting;
  const auto& g = p.graph;
  if (seen.tasks.size() != g.tasks.size())
    fail("refit: the observation has " + std::to_string(seen.tasks.size()) + " tasks, graph '" + g.name + "' has " +
         std::to_string(g.tasks.size()));
  auto hw = prior.hw();
  const auto replay = [&](const cost::model& m) { return replayed_us(p, m); };
  refit_result out{prior, seen.step_us, replay(prior), 0, {}, 0};
  if (seen.steps == 0) {
    out.predicted_after_us = out.predicted_before_us;
    return out;
  }
  out.kernel_factor_change = fit_compute(g, seen, hw);
  const cost::model linkless(hw);
  for (const auto link : {ir::link_class::intra_node, ir::link_class::inter_node})
    out.links_refitted += fit_link(g, seen, linkless, hw, link) ? 1 : 0;
  if (seen.step_us > 0) hw.comm_overlap_slowdown = fit_comm_slowdown(hw, seen.step_us, replay);
  if (!hw.name.ends_with(" (refit)")) hw.name += " (refit)";
  out.model = cost::model(hw);
  out.predicted_after_us = replay(out.model);
  return out;
}

} // namespace concerto::planner
