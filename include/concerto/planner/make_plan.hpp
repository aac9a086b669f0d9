#pragma once
/// @file
/// @brief From a task graph and a cost model to a verified plan, with any policy (make_plan).
///
/// make_plan is the one entry point the tools, the benchmarks and the runtime call:
/// durations come from the cost model; a list scheduler (the baselines) or the solver
/// (`concerto`, warm-started from the best baseline) orders every stream; the simulator
/// turns the orders into start times with contention; the verifier checks the result.
///
/// @code
/// auto graph = ir::make_workload("gpt-zero3", {.layers = 4});
/// auto model = cost::model::preset("h100x64");
/// plan::plan p = planner::make_plan(graph, model, {.policy = planner::policy::concerto});
/// std::cout << p.step_us() << " us\n";
/// @endcode

#include <concerto/core/hash.hpp>
#include <concerto/cost/model.hpp>
#include <concerto/ir/hazards.hpp>
#include <concerto/plan/lower_bound.hpp>
#include <concerto/plan/plan.hpp>
#include <concerto/plan/verify.hpp>
#include <concerto/planner/bucket.hpp>
#include <concerto/planner/decompose.hpp>
#include <concerto/planner/frameworks.hpp>
#include <concerto/planner/list.hpp>
#include <concerto/planner/memory_cap.hpp>
#include <concerto/planner/windowed.hpp>
#include <concerto/sim/simulate.hpp>

#include <chrono>
#include <functional>
#include <limits>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace concerto::planner {

/// @brief How to plan.
struct plan_options {
  planner::policy policy = planner::policy::concerto; ///< planner/policy.hpp: a list policy, a framework's, or concerto
  windowed_options solver{};       ///< window size, rounds; time_budget_s bounds the whole plan
  bool decompose = true;           ///< concerto: split exposed collectives with their matmuls
  bool bucket = true;              ///< concerto: fuse small gradient collectives into buckets
  std::optional<std::int64_t> memory_cap_bytes; ///< peak memory per rank the plan must respect
};

/// @brief The anytime profile of make_plan: called with the seconds since planning began and
/// the step time whenever the plan found so far gets faster (after each rewrite that gains, and
/// each window the solver keeps).
using improvement_fn = std::function<void(double seconds, double step_us)>;

/// @brief Hash of the options that change the plan make_plan returns (for the plan cache key);
/// `progress` only changes what is printed, so it is left out.
inline std::uint64_t hash(const plan_options& o) {
  hasher h;
  h.add(to_string(o.policy)).add(o.solver.window).add(o.solver.rounds).add(o.solver.window_time_limit_s).add(o.solver.time_budget_s);
  h.add(o.solver.parallel_windows).add(o.solver.window_work_limit);
  h.add(o.decompose).add(o.bucket).add(o.memory_cap_bytes.value_or(-1));
  return h.value();
}

/// @brief The list schedule with the smallest simulated step time: the solver's warm start.
inline ordering best_list_schedule(const ir::graph& g, std::span<const double> durations, sim::contention slowdown) {
  ordering best;
  double best_step = std::numeric_limits<double>::infinity();
  for (const auto p : policies_of(policy_family::list)) {
    auto candidate = list_schedule(p, g, durations);
    const double step = sim::simulate(candidate.graph, candidate.order, durations, slowdown).step_us;
    if (step < best_step) {
      best_step = step;
      best = std::move(candidate);
    }
  }
  return best;
}

/// @brief Plans `g` with `options.policy`; the plan is verified before it is returned.
inline plan::plan make_plan(const ir::graph& given, const cost::model& model, const plan_options& options = {},
                            const improvement_fn& on_improvement = {}) {
  const auto started = std::chrono::steady_clock::now();
  const sim::contention slowdown{model.overlap_slowdown(), model.comm_overlap_slowdown()};
  // Every policy plans the graph with the orders its buffer accesses imply (ir/hazards.hpp): a
  // dependency the graph's author left out would otherwise be a race under the baselines and a
  // constraint only under concerto's rewrites.
  const ir::graph g = ir::with_buffer_hazards(given);
  ordering chosen;
  windowed_report report{};
  switch (family(options.policy)) {
  case policy_family::search: {
    // Rewrites first (each judged by simulated step time, so none makes the step slower),
    // then the solver orders the rewritten graph, warm-started from the best baseline.
    const auto judge = simulated_step(model, options.memory_cap_bytes);
    const bool progress = options.solver.progress;
    // One budget for the whole plan: each rewrite stops trying candidates at its share
    // (decomposition the first half, bucketing up to nine tenths), the solver gets the rest: on
    // large graphs the rewrites gain more than the solver (the bucket walk alone 5% of the
    // full-depth llama-tp-sp step, the solver 0.04%), and small graphs finish them early.
    // In the deterministic mode (a work limit per window) no step reads the clock.
    const auto by = [&](double share) -> deadline {
      if (options.solver.window_work_limit > 0) return std::nullopt;
      return started + std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                           std::chrono::duration<double>(share * options.solver.time_budget_s));
    };
    const auto seconds = [&] { return std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count(); };
    const auto report_step = [&](double step_us) {
      if (on_improvement) on_improvement(seconds(), step_us);
    };
    if (on_improvement) report_step(judge(g));
    ir::graph rewritten = g;
    if (options.decompose) {
      auto split = decompose(g, model, judge, {.deadline = by(0.5), .progress = progress});
      if (!split.chosen.empty()) report_step(split.step_us_after);
      rewritten = std::move(split.graph);
    }
    if (options.bucket) {
      const auto buckets = choose_buckets(rewritten, model, judge, {.deadline = by(0.9), .progress = progress});
      if (!buckets.buckets.empty()) {
        rewritten = apply_buckets(rewritten, buckets);
        if (on_improvement) report_step(judge(rewritten));
      }
    }
    if (options.memory_cap_bytes && !prefetch_units(rewritten).empty())
      rewritten = limit_memory(rewritten, model, *options.memory_cap_bytes).graph;
    // One budget for the whole plan: the solver gets what the rewrites left (they stop by nine
    // tenths of it), less what finishing the plan costs after it (a replay, the bounds and the
    // verifier: about three times the warm start's three list schedules and replays, timed here).
    auto durations = model.durations_us(rewritten);
    const auto warm_started = std::chrono::steady_clock::now();
    auto warm = best_list_schedule(rewritten, durations, slowdown);
    const double finishing = 3 * std::chrono::duration<double>(std::chrono::steady_clock::now() - warm_started).count();
    // The frameworks' recipes are starting points too: where one's rewrites and order beat the
    // best list schedule of ours, the solver starts from its graph (without the edges that make
    // its collectives synchronous) and its orders, so concerto is never slower than a framework
    // either. They ignore memory caps, so under a cap they are not tried.
    if (!options.memory_cap_bytes) {
      double warm_step = sim::simulate(warm.graph, warm.order, durations, slowdown).step_us;
      for (const auto framework : policies_of(policy_family::framework)) {
        const auto recipe = framework_of(framework, g);
        auto their_graph = framework_rewrite(recipe, g, model);
        auto theirs = framework_edges(recipe, their_graph);
        auto their_durations = model.durations_us(theirs.graph);
        const double step = sim::simulate(theirs.graph, theirs.order, their_durations, slowdown).step_us;
        if (!(step < warm_step)) continue;
        warm_step = step;
        rewritten = std::move(their_graph);
        durations = std::move(their_durations);
        warm = std::move(theirs);
        if (on_improvement) report_step(step);
      }
    }
    auto solver = options.solver;
    solver.time_budget_s = std::max(options.solver.time_budget_s - seconds() - finishing, 0.0);
    chosen = improve_schedule(rewritten, std::move(warm), durations, slowdown, solver, &report, report_step);
    break;
  }
  case policy_family::framework: chosen = framework_schedule(options.policy, g, model); break;
  case policy_family::list: chosen = list_schedule(options.policy, g, model.durations_us(g)); break;
  }
  const auto final_durations = model.durations_us(chosen.graph);
  auto p = sim::to_plan(std::move(chosen.graph), std::move(chosen.order), final_durations, slowdown,
                        std::string(to_string(options.policy)), model.hw().name);
  // The bound of the graph as given, or of the rewritten one where bucketing made the
  // communication cheaper than any schedule of the original could be.
  p.stats.lower_bound_us = std::min(plan::compute_lower_bound(g, model.durations_us(g)).value,
                                    plan::compute_lower_bound(p.graph, final_durations).value);
  p.stats.windows_total = report.windows_total;
  p.stats.windows_optimal = report.windows_optimal;
  p.stats.plan_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
  plan::verify(p, {.memory_cap_bytes = options.memory_cap_bytes});
  return p;
}

} // namespace concerto::planner
