// schedule_quality: for each workload x preset x policy, the simulated step time, the exposed
// communication and the ratio to the lower bound of the plan each policy makes of the same graph.
#include <concerto/core/file.hpp>
#include <concerto/ir/json.hpp>
#include <concerto/ir/workloads.hpp>
#include <concerto/plan/json.hpp>
#include <concerto/planner/pipeline.hpp>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <cstdio>
#include <filesystem>
#include <iostream>

using namespace concerto;

int main(int argc, char** argv) {
  CLI::App app{"Simulated schedule quality of every policy on the benchmark workloads."};
  std::vector<std::string> workloads = ir::workload_names();
  std::vector<std::string> presets = {"a800x32", "h100x64"};
  std::vector<std::string> policies = planner::policy_names();
  std::string json_path, export_dir;
  int layers = 0;
  int micro_batch = 1;
  double budget = 20;
  app.add_option("--workloads", workloads, "workloads to plan")->capture_default_str();
  app.add_option("--presets", presets, "cost-model presets")->capture_default_str();
  app.add_option("--policies", policies, "policies")->capture_default_str();

  app.add_option("--micro-batch", micro_batch, "sequences per rank per step")->capture_default_str();
  app.add_option("--time-budget", budget, "solver time budget per plan, seconds")->capture_default_str();
  app.add_option("--json", json_path, "write one record per (workload, preset, policy) here");
  app.add_option("--export-dir", export_dir, "write every graph and plan as JSON into this folder");
  CLI11_PARSE(app, argc, argv);

  try {
    nlohmann::json records = nlohmann::json::array();
    if (!export_dir.empty()) std::filesystem::create_directories(export_dir);
    std::printf("%-12s %-8s %-14s %10s %10s %10s %8s %8s\n", "workload", "preset", "policy", "step_ms", "exposed_ms",
                "bound_ms", "ratio", "plan_s");
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
          popt.policy = policy;
          popt.solver.time_budget_s = budget;
          popt.solver.progress = false;
          const auto p = planner::make_plan(graph, model, popt);
          const auto replay = sim::simulate(p, model.durations_us(p.graph), model.overlap_slowdown());
          const double bound = p.stats.lower_bound_us;
          std::printf("%-12s %-8s %-14s %10.3f %10.3f %10.3f %8.3f %8.2f\n", workload.c_str(), preset.c_str(),
                      policy.c_str(), replay.step_us / 1e3, replay.exposed_comm_us / 1e3, bound / 1e3,
                      replay.step_us / bound, p.stats.plan_seconds);
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
                             {"windows_optimal", p.stats.windows_optimal}});
          if (!export_dir.empty())
            write_file_atomically(std::filesystem::path(export_dir) / (workload + "." + preset + "." + policy + ".plan.json"),
                                  plan::to_json(p).dump(1));
        }
      }
    }
    if (!json_path.empty()) write_file_atomically(json_path, records.dump(1));
  } catch (const std::exception& e) {
    std::fprintf(stderr, "schedule_quality: %s\n", e.what());
    return 2;
  }
  return 0;
}
