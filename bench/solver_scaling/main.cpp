// solver_scaling: how planning time, proven windows and the gap to the lower bound of the
// `concerto` policy grow as a model grows from one layer to its full depth; and how long a
// plan-cache hit of the full-depth plan takes; and the anytime profile of each plan (the best
// step found against the time spent), so a user sees what a longer budget buys.
#include <concerto/cache/plan_cache.hpp>
#include <concerto/ir/workloads.hpp>
#include <concerto/planner/make_plan.hpp>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>

using namespace concerto;

namespace {
double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}
} // namespace

int main(int argc, char** argv) {
  CLI::App app{"Planning time, proven windows and optimality gap as a model grows; plan-cache hit time."};
  std::vector<std::string> workloads = {"gpt-zero3", "llama-tp-sp"};
  std::string preset = "h100x64", json_path;
  std::vector<int> depths;
  double budget = 60;
  int cache_repeats = 5;
  std::vector<double> checkpoints = {0.25, 0.5, 1, 2, 5, 10, 20, 30, 60};
  app.add_option("--workloads", workloads, "workloads")->capture_default_str();
  app.add_option("--preset", preset, "cost-model preset")->capture_default_str();
  app.add_option("--layers", depths, "depths to plan (default: 1, 2, 4, ... up to the full depth)");
  app.add_option("--time-budget", budget, "solver time budget per plan, seconds")->capture_default_str();
  app.add_option("--cache-repeats", cache_repeats, "cache loads timed per workload (median)")->capture_default_str();
  app.add_option("--json", json_path, "write the records here");
  app.add_option("--anytime-at", checkpoints, "seconds at which the anytime profile is printed")->capture_default_str();
  CLI11_PARSE(app, argc, argv);

  try {
    const auto model = cost::model::preset(preset);
    nlohmann::json records = nlohmann::json::array();
    const auto cache_dir = std::filesystem::temp_directory_path() / "concerto-solver-scaling-cache";
    std::printf("%-12s %6s %6s %9s %10s %10s %8s %9s\n", "workload", "layers", "tasks", "plan_s", "windows",
                "proven", "gap_%", "start_gap");
    for (const auto& workload : workloads) {
      ir::workload_options wopt;
      wopt.ranks = model.hw().nodes * model.hw().ranks_per_node;
      wopt.ranks_per_node = model.hw().ranks_per_node;
      int full = 0;
      for (const auto& t : ir::make_workload(workload, wopt).tasks) full = std::max(full, t.layer + 1);
      std::vector<int> plan_depths = depths;
      if (plan_depths.empty()) {
        for (int l = 1; l < full; l *= 2) plan_depths.push_back(l);
        plan_depths.push_back(full);
      }
      planner::plan_options popt;
      popt.policy = planner::policy::concerto;
      popt.solver.time_budget_s = budget;
      popt.solver.progress = false;
      ir::graph last_graph;
      plan::plan last_plan;
      for (int layers : plan_depths) {
        wopt.layers = layers;
        auto graph = ir::make_workload(workload, wopt);
        const auto durations = model.durations_us(graph);
        const auto start = planner::best_list_schedule(graph, durations, model.overlap_slowdown());
        const double start_step = sim::simulate(start.graph, start.order, durations, model.overlap_slowdown()).step_us;
        std::vector<std::pair<double, double>> trace; // seconds, best step so far (us)
        auto p = planner::make_plan(graph, model, popt, [&](double seconds, double step_us) {
          if (trace.empty() || step_us < trace.back().second) trace.emplace_back(seconds, step_us);
        });
        const double bound = p.stats.lower_bound_us;
        const double gap = 100.0 * (p.step_us() / bound - 1.0);
        const double start_gap = 100.0 * (start_step / bound - 1.0);
        std::printf("%-12s %6d %6zu %9.2f %10d %10d %8.2f %8.2f%%\n", workload.c_str(), layers, graph.size(),
                    p.stats.plan_seconds, p.stats.windows_total, p.stats.windows_optimal, gap, start_gap);
        // Gap to the bound of the best plan found by each checkpoint (the list start before any).
        std::string anytime;
        for (double at : checkpoints) {
          if (at > p.stats.plan_seconds && !anytime.empty() && at > budget) break;
          double best = start_step;
          for (const auto& [seconds, step] : trace)
            if (seconds <= at) best = std::min(best, step);
          char cell[48];
          std::snprintf(cell, sizeof cell, "%s%g s %.2f%%", anytime.empty() ? "" : " | ", at, 100.0 * (best / bound - 1.0));
          anytime += cell;
        }
        std::printf("%-12s %6s anytime (gap to bound by then): %s\n", "", "", anytime.c_str());
        std::fflush(stdout);
        nlohmann::json profile = nlohmann::json::array();
        for (const auto& [seconds, step] : trace) profile.push_back({seconds, step / 1e3});
        records.push_back({{"workload", workload}, {"preset", preset}, {"layers", layers}, {"tasks", graph.size()},
                           {"anytime_s_step_ms", profile},
                           {"plan_s", p.stats.plan_seconds}, {"windows_total", p.stats.windows_total},
                           {"windows_optimal", p.stats.windows_optimal}, {"step_ms", p.step_us() / 1e3},
                           {"lower_bound_ms", bound / 1e3}, {"gap_percent", gap},
                           {"best_baseline_gap_percent", start_gap}});
        last_graph = std::move(graph);
        last_plan = std::move(p);
      }
      // Cache hit time of the deepest plan: store once, then time loads.
      cache::plan_cache cache(cache_dir);
      cache.silence();
      const auto key = cache::make_key(last_graph, model, "sim", "concerto", planner::hash(popt));
      cache.store(key, last_plan);
      std::vector<double> load_ms;
      for (int i = 0; i < cache_repeats; ++i) {
        const auto t0 = std::chrono::steady_clock::now();
        const auto loaded = cache.load(key);
        load_ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
        if (!loaded || !(*loaded == last_plan)) fail("the cached plan did not load back equal");
      }
      std::printf("%-12s cache hit of the %zu-task plan: median %.1f ms over %d loads\n", workload.c_str(),
                  last_graph.size(), median(load_ms), cache_repeats);
      records.push_back({{"workload", workload}, {"preset", preset}, {"cache_hit_ms", median(load_ms)},
                         {"tasks", last_graph.size()}});
    }
    std::filesystem::remove_all(cache_dir);
    if (!json_path.empty()) write_file_atomically(json_path, records.dump(1));
  } catch (const std::exception& e) {
    std::fprintf(stderr, "solver_scaling: %s\n", e.what());
    return 2;
  }
  return 0;
}
