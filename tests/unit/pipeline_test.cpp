#include <concerto/ir/workloads.hpp>
#include <concerto/plan/hash.hpp>
#include <concerto/plan/memory.hpp>
#include <concerto/planner/make_plan.hpp>

#include <catch2/catch_test_macros.hpp>
#include <catch2/matchers/catch_matchers_string.hpp>

#include <algorithm>

using namespace concerto;
using Catch::Matchers::ContainsSubstring;

namespace {
planner::plan_options quick(planner::policy policy) {
  planner::plan_options o;
  o.policy = policy;
  o.solver.time_budget_s = 1;
  o.solver.progress = false;
  return o;
}
} // namespace

TEST_CASE("the concerto policy is never slower than any baseline", "[planner][pipeline]") {
  const auto model = cost::model::preset("h100x64");
  for (const char* workload : {"gpt-dp", "gpt-zero3", "llama-tp-sp"}) {
    CAPTURE(workload);
    const auto graph = ir::make_workload(workload, {.layers = 2, .ranks = 64, .ranks_per_node = 8});
    const auto best = planner::make_plan(graph, model, quick(planner::policy::concerto));
    CHECK(best.policy == "concerto");
    CHECK(best.step_us() <= best.stats.lower_bound_us * 1.5);
    CHECK(best.step_us() >= best.stats.lower_bound_us * (1 - 1e-9));
    for (const auto& info : planner::policy_table) { // the list schedules and the frameworks
      const auto baseline = info.id;
      if (baseline == planner::policy::concerto) continue;
      CAPTURE(info.name);
      const auto p = planner::make_plan(graph, model, quick(baseline));
      CHECK(plan::check(p).empty());
      CHECK(best.step_us() <= p.step_us() * (1 + 1e-9));
    }
  }
}

TEST_CASE("every policy plans the dependencies a graph's buffer accesses imply", "[planner][pipeline][hazards]") {
  // The author declared no dependencies: the all-reduce of x must still follow the matmul that
  // writes x, and the matmul that reads the reduced x must follow the all-reduce.
  ir::graph g;
  g.name = "undeclared";
  g.cost_only = true;
  g.axes = {{"dp", 8, ir::link_class::inter_node}};
  g.streams = {{"compute", -1}, {"comm:dp", 0}};
  for (const char* name : {"x", "w", "y"}) {
    ir::buffer b;
    b.id = static_cast<ir::buffer_id>(g.buffers.size());
    b.name = name;
    b.bytes = 64 << 20;
    g.buffers.push_back(b);
  }
  const auto add = [&](std::string name, ir::op_kind kind, std::vector<ir::buffer_id> reads, std::vector<ir::buffer_id> writes) {
    ir::task t;
    t.id = static_cast<ir::task_id>(g.tasks.size());
    t.name = std::move(name);
    t.kind = kind;
    t.reads = std::move(reads);
    t.writes = std::move(writes);
    if (ir::is_collective(kind)) {
      t.axis = 0;
      t.stream = 1;
      t.bytes = 64 << 20;
    } else {
      t.flops = 4e12;
    }
    g.tasks.push_back(std::move(t));
  };
  add("produce", ir::op_kind::matmul, {1}, {0});
  add("reduce", ir::op_kind::all_reduce, {0}, {0});
  add("consume", ir::op_kind::matmul, {0, 1}, {2});
  add("other", ir::op_kind::matmul, {1}, {1});
  const auto model = cost::model::preset("h100x64");
  std::vector<double> steps;
  for (const auto& info : planner::policy_table) {
    CAPTURE(info.name);
    const auto p = planner::make_plan(g, model, quick(info.id));
    CHECK(plan::check(p).empty());
    const auto deps = [&](std::size_t t) { return p.graph.tasks[t].deps; };
    CHECK(std::find(deps(1).begin(), deps(1).end(), 0) != deps(1).end());
    CHECK(std::find(deps(2).begin(), deps(2).end(), 1) != deps(2).end());
    CHECK(p.start_us[1] >= p.start_us[0] + p.duration_us[0] - 1e-6);
    steps.push_back(p.step_us());
  }
  // concerto (last) is never slower than a baseline once all plan the same graph.
  for (std::size_t i = 0; i + 1 < steps.size(); ++i) CHECK(steps.back() <= steps[i] * (1 + 1e-9));
}

TEST_CASE("the pipeline rewrites only under the concerto policy", "[planner][pipeline]") {
  const auto model = cost::model::preset("h100x64");
  const auto graph = ir::make_workload("llama-tp-sp", {.layers = 1, .ranks = 64, .ranks_per_node = 8});
  SECTION("baselines plan the graph as given") {
    const auto p = planner::make_plan(graph, model, quick(planner::policy::program_order));
    CHECK(p.graph.tasks.size() == graph.tasks.size());
  }
  SECTION("concerto splits exposed tensor-parallel collectives") {
    const auto p = planner::make_plan(graph, model, quick(planner::policy::concerto));
    CHECK(p.graph.tasks.size() > graph.tasks.size());
  }
  SECTION("and plans the graph as given when rewrites are off") {
    auto o = quick(planner::policy::concerto);
    o.decompose = false;
    o.bucket = false;
    const auto p = planner::make_plan(graph, model, o);
    CHECK(p.graph.tasks.size() == graph.tasks.size());
  }
}

TEST_CASE("a memory cap is respected or refused", "[planner][pipeline][memory]") {
  const auto model = cost::model::preset("h100x64");
  const auto graph = ir::make_workload("gpt-zero3", {.layers = 3, .ranks = 8, .ranks_per_node = 8});
  // The better list plan prefetches parameters without a limit: the memory-hungry reference.
  const auto eager_plan = planner::list_plan(graph, model);
  const auto uncapped_peak = plan::peak_memory(eager_plan).peak_bytes;
  SECTION("a cap below the uncapped peak gives a plan within it") {
    auto o = quick(planner::policy::concerto);
    const auto smallest_peak =
        plan::peak_memory(planner::list_plan(planner::limit_prefetch(graph, 0), model)).peak_bytes;
    REQUIRE(smallest_peak < uncapped_peak);
    o.memory_cap_bytes = (smallest_peak + uncapped_peak) / 2;
    const auto p = planner::make_plan(graph, model, o);
    CHECK(plan::peak_memory(p).peak_bytes <= *o.memory_cap_bytes);
    SECTION("and the eager baseline above it is refused by the verifier") {
      auto eager = quick(planner::parse_policy(eager_plan.policy, "the eager plan"));
      eager.memory_cap_bytes = o.memory_cap_bytes;
      CHECK_THROWS_WITH(planner::make_plan(graph, model, eager), ContainsSubstring("memory"));
    }
  }
  SECTION("an impossible cap is an error that names it") {
    auto o = quick(planner::policy::concerto);
    o.memory_cap_bytes = 1024;
    CHECK_THROWS_WITH(planner::make_plan(graph, model, o), ContainsSubstring("1024"));
  }
}

TEST_CASE("unknown policy names are refused with the known ones listed", "[planner][pipeline]") {
  CHECK_THROWS_WITH(planner::parse_policy("fastest", "--policy"),
                    ContainsSubstring("'fastest'") && ContainsSubstring("xla_lhs") && ContainsSubstring("concerto"));
  for (const auto& info : planner::policy_table) CHECK(planner::parse_policy(info.name, "--policy") == info.id);
}

TEST_CASE("the options hash covers what changes the plan", "[planner][pipeline][cache]") {
  const auto base = quick(planner::policy::concerto);
  auto other = base;
  CHECK(planner::hash(base) == planner::hash(other));
  other.solver.progress = true;
  CHECK(planner::hash(base) == planner::hash(other));
  other.decompose = false;
  CHECK(planner::hash(base) != planner::hash(other));
  other = base;
  other.memory_cap_bytes = 1 << 30;
  CHECK(planner::hash(base) != planner::hash(other));
  other = base;
  other.solver.window = 20;
  CHECK(planner::hash(base) != planner::hash(other));
  other = base;
  other.solver.parallel_windows = 3;
  CHECK(planner::hash(base) != planner::hash(other));
  other = base;
  other.solver.window_work_limit = 1'000'000;
  CHECK(planner::hash(base) != planner::hash(other));
}

TEST_CASE("the deterministic mode gives the same plan every time", "[planner][pipeline][deterministic]") {
  // A graph whose windows are not all proven within a small limit: under a time limit, where
  // each search stops depends on the machine's load; under a work limit it does not.
  const auto model = cost::model::preset("h100x64");
  const auto graph = ir::make_workload("llama-tp-sp", {.layers = 1});
  auto o = quick(planner::policy::concerto);
  o.solver.window_work_limit = 200'000;
  const auto first = planner::make_plan(graph, model, o);
  CHECK(plan::check(first).empty());
  for (int again = 0; again < 2; ++again) {
    const auto p = planner::make_plan(graph, model, o);
    CHECK(plan::hash(p) == plan::hash(first));
    CHECK(p.stats.windows_total == first.stats.windows_total);
    CHECK(p.stats.windows_optimal == first.stats.windows_optimal);
  }
  SECTION("and is never slower than the baselines") {
    for (const auto baseline : planner::policies_of(planner::policy_family::list))
      CHECK(first.step_us() <= planner::make_plan(graph, model, quick(baseline)).step_us() * (1 + 1e-9));
  }
}

TEST_CASE("an exhausted budget still gives a verified plan, never slower than the baselines",
          "[planner][pipeline][budget]") {
  // A budget too small for any rewrite candidate or window: the rewrites stop at once and the
  // solver returns its warm start.
  const auto model = cost::model::preset("h100x64");
  const auto graph = ir::make_workload("llama-tp-sp", {.layers = 2});
  auto o = quick(planner::policy::concerto);
  o.solver.time_budget_s = 1e-6;
  const auto p = planner::make_plan(graph, model, o);
  CHECK(plan::check(p).empty());
  for (const auto baseline : planner::policies_of(planner::policy_family::list))
    CHECK(p.step_us() <= planner::make_plan(graph, model, quick(baseline)).step_us() * (1 + 1e-9));
}
