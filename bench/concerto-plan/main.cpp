// concerto-plan: plans a task graph (JSON, or a built-in workload) with a policy and a cost-model
// preset, writes the plan JSON and prints a summary; optionally the timeline as a Chrome trace or SVG.
#include <concerto/core/file.hpp>
#include <concerto/ir/json.hpp>
#include <concerto/ir/workloads.hpp>
#include <concerto/plan/hash.hpp>
#include <concerto/plan/json.hpp>
#include <concerto/planner/make_plan.hpp>
#include <concerto/trace/chrome_trace.hpp>
#include <concerto/trace/svg_gantt.hpp>

#include <CLI/CLI.hpp>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <sstream>

using namespace concerto;

namespace {

std::string read_file(const std::string& path) {
  // A folder opens as a stream of nothing on Linux, which would read as a JSON syntax error.
  if (std::filesystem::is_directory(path)) fail("'" + path + "' is a folder, not a graph JSON file");
  std::ifstream in(path, std::ios::binary);
  if (!in) fail("cannot read '" + path + "'");
  std::ostringstream text;
  text << in.rdbuf();
  return text.str();
}

std::string join(const std::vector<std::string>& names) {
  std::string out;
  for (const auto& n : names) out += (out.empty() ? "" : ", ") + n;
  return out;
}

} // namespace

int main(int argc, char** argv) {
  CLI::App app{"Plans a training step's task graph: orders compute and communication on their streams."};
  std::string graph_path, workload, policy = "concerto", preset = "h100x64", out_path, chrome_path, svg_path,
                                    graph_out_path;
  ir::workload_options wopt;
  planner::plan_options popt;
  bool quiet = false;
  app.add_option("graph", graph_path, "graph JSON to plan (schema: docs/graph-schema.md)");
  app.add_option("-w,--workload", workload, "plan a built-in workload instead: " + join(ir::workload_names()));
  app.add_option("--layers", wopt.layers, "layers of the workload (0: full depth)");
  app.add_option("--ranks", wopt.ranks, "ranks of the workload's mesh");
  app.add_option("--ranks-per-node", wopt.ranks_per_node, "ranks per node");
  app.add_option("--micro-batch", wopt.micro_batch, "sequences per rank per step")->capture_default_str();
  app.add_option("-p,--policy", policy, "policy: " + planner::policy_list())->capture_default_str();
  app.add_option("--preset", preset, "cost-model preset: " + join(cost::preset_names()))->capture_default_str();
  app.add_option("--time-budget", popt.solver.time_budget_s, "planning time budget in seconds: rewrites and solver (concerto policy)")
      ->capture_default_str();
  app.add_option("--window", popt.solver.window, "largest solver window, in tasks")->capture_default_str();
  app.add_option("--rounds", popt.solver.rounds, "solver passes over the task list")->capture_default_str();
  app.add_option("--window-work", popt.solver.window_work_limit,
                 "deterministic mode: Z3 work (rlimit) per window instead of time; the plan is then the same on any machine");
  app.add_option("--window-time", popt.solver.window_time_limit_s, "solver time per window in seconds")
      ->capture_default_str();
  app.add_option("-o,--out", out_path, "write the plan JSON here");
  app.add_option("--export-graph", graph_out_path, "write the input graph JSON here");
  app.add_option("--chrome", chrome_path, "write the timeline as a Chrome trace (chrome://tracing, Perfetto)");
  app.add_option("--svg", svg_path, "write the timeline as an SVG Gantt chart");
  app.add_flag("-q,--quiet", quiet, "no solver progress on stderr");
  CLI11_PARSE(app, argc, argv);

  try {
    if (graph_path.empty() == workload.empty()) fail("give either a graph JSON file or --workload NAME");
    const ir::graph graph =
        workload.empty() ? ir::graph_from_json_text(read_file(graph_path)) : ir::make_workload(workload, wopt);
    const auto model = cost::model::preset(preset);
    popt.policy = planner::parse_policy(policy, "--policy");
    popt.solver.progress = !quiet;

    const auto p = planner::make_plan(graph, model, popt);
    const auto durations = model.durations_us(p.graph);
    const auto replay = sim::simulate(p, durations, model.overlap_slowdown());

    if (!out_path.empty()) write_file_atomically(out_path, plan::to_json(p).dump(1));
    if (!graph_out_path.empty()) write_file_atomically(graph_out_path, ir::to_json(graph).dump(1));
    if (!chrome_path.empty()) write_file_atomically(chrome_path, trace::chrome_trace(p.graph, replay));
    if (!svg_path.empty()) write_file_atomically(svg_path, trace::svg_gantt(p.graph, replay));

    std::printf("graph          %s: %zu tasks, %zu streams\n", graph.name.c_str(), graph.size(), graph.streams.size());
    std::printf("policy         %s on %s\n", policy.c_str(), preset.c_str());
    std::printf("step time      %.3f ms\n", replay.step_us / 1e3);
    std::printf("exposed comm   %.3f ms\n", replay.exposed_comm_us / 1e3);
    std::printf("lower bound    %.3f ms (step / bound = %.3f)\n", p.stats.lower_bound_us / 1e3,
                p.stats.lower_bound_us > 0 ? replay.step_us / p.stats.lower_bound_us : 1.0);
    std::printf("planning time  %.3f s", p.stats.plan_seconds);
    if (p.stats.windows_total > 0)
      std::printf(" (%d of %d windows proven optimal)", p.stats.windows_optimal, p.stats.windows_total);
    std::printf("\nplan hash      %s\n", plan::hash_hex(p).c_str());
  } catch (const std::exception& e) {
    std::fprintf(stderr, "concerto-plan: %s\n", e.what());
    return 2;
  }
  return 0;
}
