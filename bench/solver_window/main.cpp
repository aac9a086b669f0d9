// How the Z3 window solve time grows with the window size, for both search methods.
//
// Windows are random DAGs shaped like layer graphs: forward blocks (all-gather -> matmul ->
// elementwise -> matmul -> all-reduce that the next block waits for) and backward blocks (two
// matmuls, a reduce-scatter of the weight gradient nobody waits for), on a compute stream and
// one or two communication lanes. The incumbent is the program-order schedule (each stream runs
// its tasks in the order they were generated, as early as possible), as the planner's warm start
// would be. Prints a table (median and max solve time, windows proven optimal, improvement over
// the incumbent, gap to the window's lower bound) and writes it as JSON with --json.

#include <concerto/planner/z3_window.hpp>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <random>
#include <string>
#include <vector>

using namespace concerto;

namespace {

planner::window_problem layer_window(int n, int streams, unsigned seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<double> compute(1.0, 10.0), comm(1.0, 8.0), coin(0.0, 1.0);
  planner::window_problem p;
  const int lane_ag = 1, lane_ar = streams >= 3 ? 2 : 1;
  auto add = [&](int stream, double d, std::vector<int> preds) {
    std::erase(preds, -1);
    p.tasks.push_back({stream, d, 0.0, 0.0, std::move(preds)});
    return static_cast<int>(p.tasks.size()) - 1;
  };
  int carry = -1;  // the activation the next block consumes
  while (static_cast<int>(p.tasks.size()) < n) {
    if (coin(rng) < 0.5) {
      const int ag = add(lane_ag, comm(rng), {});
      const int mm1 = add(0, compute(rng), {ag, carry});
      const int ew = add(0, compute(rng) * 0.3, {mm1});
      const int mm2 = add(0, compute(rng), {ew});
      carry = add(lane_ar, comm(rng), {mm2});
    } else {
      const int dx = add(0, compute(rng), {carry});
      const int dw = add(0, compute(rng), {carry});
      add(lane_ag, comm(rng), {dw});
      carry = dx;
    }
  }
  p.tasks.resize(static_cast<std::size_t>(n));  // a cut block only loses successors
  p.stream_free.assign(static_cast<std::size_t>(streams), 0.0);
  // Program order: each stream in generation order, as early as possible.
  std::vector<double> end(p.tasks.size()), stream_end(p.stream_free);
  double mk = 0;
  for (std::size_t i = 0; i < p.tasks.size(); ++i) {
    const auto& t = p.tasks[i];
    double s = stream_end[static_cast<std::size_t>(t.stream)];
    for (int d : t.preds) s = std::max(s, end[static_cast<std::size_t>(d)]);
    p.hint_start.push_back(s);
    end[i] = s + t.duration;
    stream_end[static_cast<std::size_t>(t.stream)] = end[i];
    mk = std::max(mk, end[i]);
  }
  p.upper_bound = mk;
  // The cheap bound the planner passes in: the busiest stream's work.
  std::vector<double> work(static_cast<std::size_t>(streams), 0.0);
  for (const auto& t : p.tasks) work[static_cast<std::size_t>(t.stream)] += t.duration;
  p.lower_bound = *std::max_element(work.begin(), work.end());
  return p;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

} // namespace

int main(int argc, char** argv) {
  CLI::App app{"Z3 window solve time against window size"};
  std::vector<int> sizes{10, 20, 30, 40, 50, 60, 80, 100, 120};
  std::vector<int> stream_counts{2, 3};
  int seeds = 3;
  double limit = 5.0;
  std::string json_path;
  std::string methods = "both";
  double resolution = planner::window_options{}.resolution;
  app.add_option("--sizes", sizes, "window sizes");
  app.add_option("--streams", stream_counts, "stream counts (compute + lanes)");
  app.add_option("--seeds", seeds, "random windows per size");
  app.add_option("--limit", limit, "time limit per window, seconds");
  app.add_option("--method", methods, "binary, optimize or both");
  app.add_option("--resolution", resolution, "integer units per makespan per task");
  app.add_option("--json", json_path, "write the table as JSON");
  CLI11_PARSE(app, argc, argv);

  std::vector<planner::window_method> which;
  if (methods != "optimize") which.push_back(planner::window_method::binary_search);
  if (methods != "binary") which.push_back(planner::window_method::optimize);

  auto rows = nlohmann::json::array();
  std::printf("%6s %7s %-9s %10s %10s %7s %12s %10s\n", "tasks", "streams", "method", "median_s", "max_s",
              "proven", "improve_%", "gap_lb_%");
  for (int n : sizes)
    for (int streams : stream_counts)
      for (auto method : which) {
        std::vector<double> times;
        int proven = 0;
        double improve = 0, gap = 0;
        for (int s = 0; s < seeds; ++s) {
          const auto p = layer_window(n, streams, 1000u * static_cast<unsigned>(n) + static_cast<unsigned>(s));
          planner::window_options o;
          o.time_limit_s = limit;
          o.method = method;
          o.resolution = resolution;
          const auto sol = planner::solve_window(p, o);
          times.push_back(sol.solve_seconds);
          proven += sol.optimal ? 1 : 0;
          improve += 100.0 * (p.upper_bound - sol.makespan) / p.upper_bound / seeds;
          gap += 100.0 * (sol.makespan - p.lower_bound) / p.lower_bound / seeds;
        }
        const char* name = method == planner::window_method::optimize ? "optimize" : "binary";
        const double med = median(times), mx = *std::max_element(times.begin(), times.end());
        std::printf("%6d %7d %-9s %10.3f %10.3f %4d/%-2d %12.2f %10.2f\n", n, streams, name, med, mx, proven, seeds,
                    improve, gap);
        std::fflush(stdout);
        rows.push_back({{"tasks", n}, {"streams", streams}, {"method", name}, {"median_s", med}, {"max_s", mx},
                        {"proven", proven}, {"windows", seeds}, {"improve_pct", improve}, {"gap_lb_pct", gap}});
      }
  if (!json_path.empty()) std::ofstream(json_path) << rows.dump(2) << '\n';
}
