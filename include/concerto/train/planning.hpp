#pragma once
/// @file
/// @brief How a training step gets its plan: rank 0 plans (or the plan cache, or an earlier
/// run's pick answers), every rank gets the plan and its summary; a pipelined step's rank 0
/// chooses the schedule and each rank makes its own stage's plan from it.
///
/// @code
/// auto first = detail::plan_first(options, lowered, model, backend, store, chooses);   // collective
/// auto stage = detail::plan_stage(options.pipeline, lowered, split, mesh, model, backend, control);
/// @endcode

#include <concerto/cache/key.hpp>
#include <concerto/cache/plan_cache.hpp>
#include <concerto/cost/model.hpp>
#include <concerto/ir/graph.hpp>
#include <concerto/mesh/mesh.hpp>
#include <concerto/pipeline/stages.hpp>
#include <concerto/plan/plan.hpp>
#include <concerto/planner/make_plan.hpp>
#include <concerto/runtime/decide.hpp>
#include <concerto/runtime/executor.hpp>
#include <concerto/runtime/mpi/channel.hpp>
#include <concerto/runtime/mpi/control.hpp>
#include <concerto/train/backend_select.hpp>
#include <concerto/train/choice.hpp>
#include <concerto/train/choice_store.hpp>
#include <concerto/train/options.hpp>
#include <concerto/train/pipeline.hpp>

#include <nlohmann/json.hpp>

#include <chrono>
#include <cstdio>
#include <optional>
#include <string>
#include <vector>

namespace concerto::train::detail {

/// What the step asks of the planner.
[[nodiscard]] inline planner::plan_options planning_options(const step_options& o) {
  return {.policy = o.policy, .solver = o.solver, .decompose = o.decompose, .bucket = o.bucket,
          .memory_cap_bytes = o.memory_cap_bytes};
}

/// The graph the planner is given: the lowered one, or the options' rewrite of it.
[[nodiscard]] inline ir::graph planner_input(const step_options& o, const ir::graph& lowered) {
  return o.rewrite ? o.rewrite(lowered) : lowered;
}

/// The collectives of a graph that move data: those over an axis of one rank are copies at most.
[[nodiscard]] inline std::size_t communicating_collectives(const ir::graph& g) {
  std::size_t n = 0;
  for (const auto& t : g.tasks)
    n += ir::is_collective(t.kind) && t.axis >= 0 && g.axes[static_cast<std::size_t>(t.axis)].size > 1;
  return n;
}

/// @brief What a step starts from.
struct first_plan {
  plan::plan plan;
  plan_summary summary;
  /// An earlier run's pick (the plan above): its record; with rivals to measure it against
  /// again ("confirm" not empty) the choice starts by confirming it.
  std::optional<nlohmann::json> earlier;
  std::vector<plan::plan> rivals; ///< rank 0: the rivals' plans
};

/// Rank 0 plans `lowered` (through the plan cache, or an earlier run's pick when `chooses`);
/// every rank gets the plan, verified and agreed (runtime::distribute_plan), and its summary.
/// Collective.
template <class Backend>
[[nodiscard]] first_plan plan_first(const step_options& options, const ir::graph& lowered, const cost::model& model,
                                    Backend& backend, const choice_store& store, bool chooses) {
  first_plan out;
  nlohmann::json summary; // rank 0's, made as it plans
  out.plan = runtime::distribute_plan(backend, [&] {
    const runtime::mpi::channel::busy announced(runtime::mpi::channel::get(), "planning the step");
    plan_summary s;
    s.policy = planner::to_string(options.policy);
    const auto started = std::chrono::steady_clock::now();
    const ir::graph g = planner_input(options, lowered);
    const auto planning = planning_options(options);
    plan::plan made;
    // The model both predictions below are made with: an earlier run's pick is priced, as is
    // sync beside it, by the model refitted to what that run measured.
    cost::model priced = model;
    std::string record;
    if (auto kept = chooses && options.use_cache ? store.load(g, model) : std::nullopt) {
      made = std::move(kept->winner);
      s.cache_hit = true;
      priced = cost::model(kept->record.at("refitted_model").get<cost::hardware>());
      record = kept->record.dump();
      out.rivals = std::move(kept->rivals);
    } else if (options.use_cache) {
      const auto key = cache::make_key(g, model, default_backend_name, planner::to_string(options.policy), planner::hash(planning));
      // Not silenced: a damaged or unwritable entry is said once (this runs on rank 0 only).
      made = cache::plan_cache(options.cache_dir).get_or_plan(key, [&] { return planner::make_plan(g, model, planning); },
                                                              &s.cache_hit);
    } else {
      made = planner::make_plan(g, model, planning);
    }
    s.rewritten = !(made.graph.tasks.size() == lowered.tasks.size() && made.graph.buffers == lowered.buffers);
    s.solver_seconds = s.cache_hit ? 0.0 : std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
    s.predicted_us = s.cache_hit && !record.empty() ? replayed_us(made, priced) : made.step_us();
    s.sync_predicted_us = options.policy == planner::policy::sync
                              ? s.predicted_us
                              : planner::make_plan(g, priced, {.policy = planner::policy::sync}).step_us();
    s.tasks = made.graph.tasks.size();
    s.collectives = communicating_collectives(made.graph);
    summary = nlohmann::json{{"policy", s.policy}, {"solver", s.solver_seconds}, {"predicted", s.predicted_us},
                             {"sync", s.sync_predicted_us}, {"hit", s.cache_hit}, {"rewritten", s.rewritten},
                             {"tasks", s.tasks}, {"collectives", s.collectives}, {"choice", record}};
    return made;
  });
  const auto j = runtime::decide_on_rank_0(backend, "the plan summary from rank 0", "train step: rank 0 could not describe its plan",
                                           [&] { return summary; });
  out.summary = {j.at("policy"), j.at("solver"), j.at("predicted"), j.at("sync"), j.at("hit"), j.at("rewritten"),
                 j.at("tasks"), j.at("collectives")};
  if (const auto& kept = j.at("choice").template get_ref<const std::string&>(); !kept.empty()) out.earlier = nlohmann::json::parse(kept);
  return out;
}

/// @brief A pipelined step's plan on this rank.
struct stage_plan_result {
  plan::plan plan;
  plan_summary summary;
  std::vector<pipeline::task_origin> origins; ///< each task of the plan, in the split graph
};

/// Rank 0 chooses the schedule of the whole pipeline and sends it; every rank builds the plan of
/// its own stage from it (deterministic, no cache), and the stages check that their plans agree
/// on every message before any is sent. Collective.
template <class Backend>
[[nodiscard]] stage_plan_result plan_stage(const pipeline_options& o, const ir::graph& lowered, const pipeline::stage_split& split,
                                           const mesh& m, const cost::model& model, Backend& backend,
                                           const runtime::mpi::control& control) {
  const auto problem = pipeline::problem_of(split, lowered, model);
  const auto started = std::chrono::steady_clock::now();
  const auto schedule = schedule_from_json(runtime::decide_on_rank_0(
      backend, "the pipeline schedule from rank 0", "train step: choosing the pipeline schedule failed on rank 0", [&] {
        const runtime::mpi::channel::busy busy(runtime::mpi::channel::get(), "choosing the pipeline schedule");
        return to_json(choose_schedule(o, problem));
      }));
  const auto timing = pipeline::verify(problem, schedule);
  const int stage = m.coords(control.rank())[static_cast<std::size_t>(split.axis)];
  stage_plan_result out;
  out.plan = pipeline::stage_plan(pipeline::stage_graph(lowered, split, stage, schedule, &out.origins), model,
                                  "pipeline:" + o.schedule);
  auto& p = out.plan;
  check_stage_agreement(p, split.axis, m, control);
  auto& s = out.summary;
  s.policy = "pipeline:" + o.schedule;
  s.solver_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
  s.predicted_us = timing.step_us;
  s.baseline = "gpipe";
  s.sync_predicted_us = pipeline::simulate(problem, pipeline::gpipe(problem)).step_us;
  s.rewritten = true;
  s.tasks = p.graph.tasks.size();
  s.collectives = communicating_collectives(p.graph);
  p.stats.lower_bound_us = pipeline::lower_bound(problem); // of the whole pipelined step
  char line[160];
  std::snprintf(line, sizeof line, "%d stages x %d micro-batches (%d chunk%s per stage), lower bound %.0f us", split.stages,
                split.microbatches, split.virtual_stages, split.virtual_stages == 1 ? "" : "s", p.stats.lower_bound_us);
  s.pipeline = line;
  return out;
}

} // namespace concerto::train::detail
