// schedule_quality: for each workload x preset x policy, the simulated step time, the exposed
// communication and the ratio to the lower bound of the plan each policy makes of the same graph;
// then the pipelined workloads: for each layout, every pipeline policy at the same activation
// memory (1F1B's peak), its step, peak and ratio to the pipeline lower bound. Each row ends with
// the plan's hash (plan::hash; a pipeline schedule's: its blocks in order): with --window-work N
// (Z3 work per window instead of time, nothing reads the clock) the same build prints the same
// plans on any machine, so two builds can be compared plan for plan.
#include <concerto/core/file.hpp>
#include <concerto/core/hash.hpp>
#include <concerto/plan/hash.hpp>
#include <concerto/ir/json.hpp>
#include <concerto/ir/workloads.hpp>
#include <concerto/plan/json.hpp>
#include <concerto/pipeline/search.hpp>
#include <concerto/pipeline/workloads.hpp>
#include <concerto/planner/make_plan.hpp>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <cstdio>
#include <filesystem>
#include <iostream>

using namespace concerto;

namespace {

// The layouts (docs/workloads.md says why): gpt-ptd keeps tp = 8 inside a node and puts 4
// stages across nodes, the rest of the preset's nodes in dp; llama-ptd is Llama 3 405B's
// pp 16 × tp 8 (dp 1: the cost model prices links, not the job's width).
pipeline::workload_layout layout_of(const std::string& workload, const cost::model& model, int microbatches) {
  pipeline::workload_layout l;
  l.microbatches = microbatches;
  l.tensor_parallel = model.hw().ranks_per_node;
  if (workload == "llama-ptd") {
    l.stages = 16;
  } else {
    l.stages = 4;
    l.data_parallel = std::max(1, model.hw().nodes * model.hw().ranks_per_node / (4 * l.tensor_parallel));
  }
  return l;
}

// A pipeline schedule's identity: its policy's blocks, stage by stage, in order.
std::string schedule_hash(const pipeline::schedule& s) {
  hasher h;
  h.add(std::int64_t{s.split_backward});
  for (const auto& stage : s.order) {
    h.add(static_cast<std::int64_t>(stage.size()));
    for (const auto& b : stage) h.add(std::int64_t{b.chunk}).add(std::int64_t{b.microbatch}).add(static_cast<std::int64_t>(b.kind));
  }
  return hasher::to_hex(h.value());
}

void pipeline_rows(const std::string& workload, const std::string& preset, int microbatches, double budget,
                   std::uint64_t window_work, nlohmann::json& records) {
  const auto model = cost::model::preset(preset);
  auto layout = layout_of(workload, model, microbatches);
  std::vector<pipeline::problem> layouts{pipeline::make_problem(workload, model, layout)};
  layout.virtual_stages = 2;
  if (microbatches % layout.stages == 0) layouts.push_back(pipeline::make_problem(workload, model, layout));
  pipeline::search_options o;
  o.time_budget_s = budget;
  o.window_work_limit = window_work;
  const auto r = pipeline::plan_concerto(layouts, o);
  const double cap = r.layout.memory_cap_bytes;
  const auto row = [&](const std::string& policy, int virtual_stages, double step_us, double peak, bool fits,
                       double bound_us, double seconds, const std::string& hash) {
    std::printf("%-10s %-8s pp%-2d v%d m%-3d %-17s %10.1f %9.2f %5s %10.1f %7.3f %7.2f %s\n", workload.c_str(),
                preset.c_str(), layout.stages, virtual_stages, microbatches, policy.c_str(), step_us / 1e3,
                peak / 1073741824.0, fits ? "yes" : "no", bound_us / 1e3, step_us / bound_us, seconds, hash.c_str());
    records.push_back({{"workload", workload}, {"preset", preset}, {"stages", layout.stages},
                       {"virtual_stages", virtual_stages}, {"tensor_parallel", layout.tensor_parallel},
                       {"data_parallel", layout.data_parallel}, {"microbatches", microbatches}, {"policy", policy},
                       {"step_ms", step_us / 1e3}, {"peak_activation_gib", peak / 1073741824.0},
                       {"memory_cap_gib", cap / 1073741824.0}, {"fits", fits}, {"lower_bound_ms", bound_us / 1e3},
                       {"ratio_to_bound", step_us / bound_us}, {"plan_s", seconds}, {"schedule_hash", hash}});
  };
  std::printf("\n%-10s %-8s %-17s %-17s %10s %9s %5s %10s %7s %7s %s\n", "pipelined", "preset", "layout", "policy",
              "step_ms", "peak_GiB", "fits", "bound_ms", "ratio", "plan_s", "schedule");
  for (const auto& c : r.candidates) {
    if (c.step_us <= 0) continue; // the policy does not apply to this layout
    auto p = layouts[c.virtual_stages == 1 ? 0 : 1];
    p.memory_cap_bytes = cap; // the bound at the cap: a policy over it ("fits" no) may beat it
    row(c.policy, c.virtual_stages, c.step_us, c.peak_memory_bytes, c.fits, pipeline::lower_bound(p), 0,
        schedule_hash(pipeline::baseline(c.policy, p)));
  }
  row("concerto", r.layout.virtual_stages, r.time.step_us, pipeline::peak_memory(r.time), true, r.lower_bound_us,
      r.seconds, schedule_hash(r.best));
  std::printf("%-10s %-8s cap %.2f GiB (1F1B's peak); concerto started from %s (%.1f ms)%s\n", workload.c_str(),
              preset.c_str(), cap / 1073741824.0, r.warm_start.c_str(), r.warm_start_us / 1e3,
              r.proven_optimal ? "; proven optimal among in-order schedules" : "");
  std::fflush(stdout);
}

} // namespace

int main(int argc, char** argv) {
  CLI::App app{"Simulated schedule quality of every policy on the benchmark workloads."};
  std::vector<std::string> workloads = ir::workload_names();
  std::vector<std::string> presets = {"a800x32", "h100x64"};
  std::vector<std::string> policies;
  for (const auto& p : planner::policy_table) policies.emplace_back(p.name);
  std::string json_path, export_dir;
  int layers = 0;
  int micro_batch = 1;
  double budget = 20;
  std::uint64_t window_work = 0;
  app.add_option("--workloads", workloads, "workloads to plan")->capture_default_str();
  app.add_option("--presets", presets, "cost-model presets")->capture_default_str();
  app.add_option("--policies", policies, "policies")->capture_default_str();

  app.add_option("--micro-batch", micro_batch, "sequences per rank per step")->capture_default_str();
  app.add_option("--time-budget", budget, "solver time budget per plan, seconds")->capture_default_str();
  app.add_option("--window-work", window_work,
                 "Z3 work per window instead of time (deterministic: the same plans on any machine; 0: time)")
      ->capture_default_str();
  app.add_option("--layers", layers, "layers of each workload (0: its default)")->capture_default_str();
  std::vector<std::string> pipelined = pipeline::workload_names();
  std::vector<int> microbatches = {8, 16};
  app.add_option("--pipeline-workloads", pipelined, "pipelined workloads (none: skip them)")->capture_default_str();
  bool pipeline_only = false;
  app.add_flag("--pipeline-only", pipeline_only, "only the pipelined workloads' rows");
  app.add_option("--microbatches", microbatches, "micro-batches per step of the pipelined workloads")->capture_default_str();
  app.add_option("--json", json_path, "write one record per (workload, preset, policy) here");
  app.add_option("--export-dir", export_dir, "write every graph and plan as JSON into this folder");
  CLI11_PARSE(app, argc, argv);

  try {
    nlohmann::json records = nlohmann::json::array();
    if (!export_dir.empty()) std::filesystem::create_directories(export_dir);
    if (pipeline_only) workloads.clear();
    if (pipelined == std::vector<std::string>{"none"}) pipelined.clear();
    if (!workloads.empty())
      std::printf("%-12s %-8s %-14s %10s %10s %10s %8s %8s %s\n", "workload", "preset", "policy", "step_ms", "exposed_ms",
                  "bound_ms", "ratio", "plan_s", "plan");
    for (const auto& preset : presets) {
      const auto model = cost::model::preset(preset);
      for (const auto& workload : workloads) {
        ir::workload_options wopt;
        wopt.layers = layers;
        wopt.micro_batch = micro_batch;
        wopt.ranks = model.hw().nodes * model.hw().ranks_per_node;
        wopt.ranks_per_node = model.hw().ranks_per_node;
        const auto graph = ir::make_workload(workload, wopt);
        if (!export_dir.empty())
          write_file_atomically(std::filesystem::path(export_dir) / (workload + "." + preset + ".graph.json"),
                                ir::to_json(graph).dump(1));
        for (const auto& policy : policies) {
          planner::plan_options popt;
          popt.policy = planner::parse_policy(policy, "--policies");
          popt.solver.time_budget_s = budget;
          popt.solver.window_work_limit = window_work;
          popt.solver.progress = false;
          const auto p = planner::make_plan(graph, model, popt);
          const auto replay = sim::simulate(p, model.durations_us(p.graph), model.overlap_slowdown());
          const double bound = p.stats.lower_bound_us;
          const auto hash = hasher::to_hex(plan::hash(p));
          std::printf("%-12s %-8s %-14s %10.3f %10.3f %10.3f %8.3f %8.2f %s\n", workload.c_str(), preset.c_str(),
                      policy.c_str(), replay.step_us / 1e3, replay.exposed_comm_us / 1e3, bound / 1e3,
                      replay.step_us / bound, p.stats.plan_seconds, hash.c_str());
          std::fflush(stdout);
          records.push_back({{"workload", workload},
                             {"preset", preset},
                             {"policy", policy},
                             {"layers", layers},
                             {"micro_batch", micro_batch},
                             {"tasks", p.graph.size()},
                             {"step_ms", replay.step_us / 1e3},
                             {"exposed_comm_ms", replay.exposed_comm_us / 1e3},
                             {"lower_bound_ms", bound / 1e3},
                             {"ratio_to_bound", replay.step_us / bound},
                             {"plan_s", p.stats.plan_seconds},
                             {"windows_total", p.stats.windows_total},
                             {"windows_optimal", p.stats.windows_optimal},
                             {"plan_hash", hash}});
          if (!export_dir.empty())
            write_file_atomically(std::filesystem::path(export_dir) / (workload + "." + preset + "." + policy + ".plan.json"),
                                  plan::to_json(p).dump(1));
        }
      }
    }
    for (const auto& workload : pipelined)
      for (const auto& preset : presets)
        for (const int m : microbatches)
          pipeline_rows(workload, preset, m, budget, window_work, records);
    if (!json_path.empty()) write_file_atomically(json_path, records.dump(1));
  } catch (const std::exception& e) {
    std::fprintf(stderr, "schedule_quality: %s\n", e.what());
    return 2;
  }
  return 0;
}
