#include <concerto/plan/lower_bound.hpp>
#include <concerto/planner/windowed.hpp>

#include <catch2/catch_approx.hpp>
#include <catch2/catch_test_macros.hpp>
#include <catch2/matchers/catch_matchers_string.hpp>

#include <algorithm>
#include <random>

using namespace concerto;

namespace {

// A graph with a compute stream and one lane per axis ("a", and "b" when lanes == 2).
struct graph_maker {
  ir::graph g;
  std::vector<double> d;
  explicit graph_maker(int lanes) {
    g.cost_only = true; // planned, not run
    g.name = "t";
    for (int a = 0; a < lanes; ++a) {
      g.axes.push_back({a == 0 ? "a" : "b", 4});
      g.streams.push_back({a == 0 ? "comm:a" : "comm:b", a});
    }
  }
  ir::task_id add(std::string name, int lane, double dur, std::vector<ir::task_id> deps) {
    ir::task t;
    t.id = static_cast<ir::task_id>(g.tasks.size());
    t.name = std::move(name);
    if (lane > 0) {
      t.kind = ir::op_kind::all_reduce;
      t.axis = lane - 1;
      t.stream = lane;
    } else {
      t.kind = ir::op_kind::matmul;
    }
    std::erase(deps, -1);
    t.deps = std::move(deps);
    g.tasks.push_back(std::move(t));
    d.push_back(dur);
    return g.tasks.back().id;
  }
};

// Program order issues the big gradient reduction X before the all-gather G that the next
// kernel needs, so M waits for both: step 20. Issuing G first hides everything: step 12, the
// compute stream's work.
graph_maker late_collective() {
  graph_maker m(1);
  const auto a = m.add("A", 0, 4, {});
  m.add("X", 1, 5, {a});
  const auto gather = m.add("G", 1, 3, {});
  m.add("M", 0, 4, {gather});
  m.add("B", 0, 4, {});
  return m;
}

graph_maker random_layers(std::mt19937& rng, int tasks, int lanes) {
  std::uniform_real_distribution<double> compute(1.0, 10.0), comm(1.0, 8.0), coin(0.0, 1.0);
  graph_maker m(lanes);
  ir::task_id carry = -1;
  int k = 0;
  while (static_cast<int>(m.g.tasks.size()) < tasks) {
    const auto n = std::to_string(k++);
    if (coin(rng) < 0.5) {  // forward: gather the weight, two matmuls, a blocking reduction
      const auto ag = m.add("ag" + n, 1, comm(rng), {});
      const auto mm1 = m.add("mm1." + n, 0, compute(rng), {ag, carry});
      const auto mm2 = m.add("mm2." + n, 0, compute(rng), {mm1});
      carry = m.add("ar" + n, lanes, comm(rng), {mm2});
    } else {  // backward: input and weight gradients, the weight gradient reduced off the path
      const auto dx = m.add("dx" + n, 0, compute(rng), {carry});
      const auto dw = m.add("dw" + n, 0, compute(rng), {carry});
      m.add("rs" + n, 1, comm(rng), {dw});
      carry = dx;
    }
  }
  m.g.validate();
  return m;
}

// Each stream's order holds exactly that stream's tasks, once each.
void require_complete_orders(const ir::graph& g, const std::vector<std::vector<ir::task_id>>& order) {
  std::vector<int> seen(g.tasks.size(), 0);
  for (std::size_t s = 0; s < order.size(); ++s)
    for (auto t : order[s]) {
      REQUIRE(g.tasks[static_cast<std::size_t>(t)].stream == static_cast<ir::stream_id>(s));
      ++seen[static_cast<std::size_t>(t)];
    }
  for (int c : seen) REQUIRE(c == 1);
}

planner::windowed_options quick(int window) {
  planner::windowed_options o;
  o.window = window;
  o.rounds = 4;
  o.window_time_limit_s = 0.5;
  o.time_budget_s = 5;
  o.progress = false;
  return o;
}

} // namespace

TEST_CASE("a collective issued late by program order is moved forward", "[planner][windowed]") {
  const auto m = late_collective();
  const auto start = planner::list_schedule(planner::policy::program_order, m.g, m.d);
  REQUIRE(sim::simulate(m.g, start.order, m.d).step_us == Catch::Approx(20.0));
  SECTION("one window holding the whole graph reaches the compute work") {
    planner::windowed_report rep;
    const auto best = planner::improve_schedule(m.g, start, m.d, 1.0, quick(8), &rep);
    require_complete_orders(best.graph, best.order);
    const auto r = sim::simulate(best.graph, best.order, m.d);
    CHECK(r.step_us == Catch::Approx(12.0));
    CHECK(r.start_us[2] == Catch::Approx(0.0));  // G is issued first on the lane
    CHECK(rep.start_step_us == Catch::Approx(20.0));
    CHECK(rep.final_step_us == Catch::Approx(12.0));
    CHECK(rep.lower_bound_us == Catch::Approx(12.0));
    CHECK(rep.windows_total >= 1);
    CHECK(rep.windows_optimal >= 1);
  }
  SECTION("with contention the result is still never slower than the start") {
    const double slow = 1.5;
    planner::windowed_report rep;
    const auto best = planner::improve_schedule(m.g, start, m.d, slow, quick(8), &rep);
    const auto before = sim::simulate(m.g, start.order, m.d, slow).step_us;
    const auto after = sim::simulate(best.graph, best.order, m.d, slow).step_us;
    CHECK(after <= before);
    CHECK(after < before);  // hiding G is worth it even when overlap slows compute
    CHECK(rep.final_step_us == Catch::Approx(after));
  }
}

TEST_CASE("a warm start's own edges never constrain the solver", "[planner][windowed][warm]") {
  // sync chains every task (step 20 on this graph): started from it, the solver still finds the
  // optimum of the user's graph (12), and the plan carries the user's dependencies only.
  const auto m = late_collective();
  const auto start = planner::list_schedule(planner::policy::sync, m.g, m.d);
  const auto chained = sim::simulate(start.graph, start.order, m.d).step_us;
  REQUIRE(chained == Catch::Approx(20.0));
  REQUIRE(plan::compute_lower_bound(start.graph, m.d).value == Catch::Approx(chained)); // no window could help
  planner::windowed_report rep;
  const auto best = planner::improve_schedule(m.g, start, m.d, 1.0, quick(8), &rep);
  require_complete_orders(best.graph, best.order);
  CHECK(sim::simulate(best.graph, best.order, m.d).step_us == Catch::Approx(12.0));
  CHECK(rep.start_step_us == Catch::Approx(20.0));
  CHECK(rep.final_step_us == Catch::Approx(12.0));
  CHECK(rep.lower_bound_us == Catch::Approx(12.0));
  for (std::size_t i = 0; i < m.g.tasks.size(); ++i) CHECK(best.graph.tasks[i].deps == m.g.tasks[i].deps);
}

TEST_CASE("a start that is faster with its own edges than any order found is kept as it is", "[planner][windowed][warm]") {
  // No window: the solver cannot move; the start's chained graph is returned unchanged.
  const auto m = late_collective();
  auto start = planner::list_schedule(planner::policy::sync, m.g, m.d);
  auto o = quick(8);
  o.rounds = 0;
  planner::windowed_report rep;
  const auto best = planner::improve_schedule(m.g, start, m.d, 1.0, o, &rep);
  CHECK(rep.final_step_us <= rep.start_step_us);
  CHECK(sim::simulate(best.graph, best.order, m.d).step_us == Catch::Approx(rep.final_step_us));
}

TEST_CASE("window boundaries carry the frozen plan's state", "[planner][windowed]") {
  // A(4) -> X(lane, 5); G(lane, 3) -> M(4); B(4). Program order: A 0-4, X 4-9, G 9-12, M 12-16, B 16-20.
  const auto m = late_collective();
  const auto start = planner::list_schedule(planner::policy::program_order, m.g, m.d);
  const auto r = sim::simulate(m.g, start.order, m.d);
  std::vector<int> rank{0, 1, 2, 3, 4};
  const auto list = planner::detail::by_start(r, rank);
  const auto after = planner::detail::work_after(m.g, m.d);
  SECTION("a window after A and X sees the lane busy until 9 and the compute stream until 4") {
    // list by start: A(0), X(4), G(9), M(12), B(16); the window is {G, M}.
    const auto cut = planner::detail::cut_window(m.g, m.d, r, list, 2, 4, after);
    REQUIRE(cut.tasks == std::vector<ir::task_id>{2, 3});
    CHECK(cut.problem.stream_free[0] == Catch::Approx(4.0));
    CHECK(cut.problem.stream_free[1] == Catch::Approx(9.0));
    CHECK(cut.problem.tasks[1].preds == std::vector<int>{0});  // M depends on G inside the window
    CHECK(cut.problem.tasks[0].release == Catch::Approx(0.0));
  }
  SECTION("a dependency leaving the window becomes a release, one entering it a tail") {
    // The window {X, G}: X's dependency A lies before it (release 4); M after it follows G (tail 4).
    const auto cut = planner::detail::cut_window(m.g, m.d, r, list, 1, 3, after);
    REQUIRE(cut.tasks == std::vector<ir::task_id>{1, 2});
    CHECK(cut.problem.tasks[0].release == Catch::Approx(4.0));
    CHECK(cut.problem.tasks[1].tail == Catch::Approx(4.0));
    CHECK(cut.problem.tasks[0].tail == Catch::Approx(0.0));
  }
  SECTION("windows of two tasks still improve the plan, and every dependency holds across them") {
    planner::windowed_report rep;
    const auto best = planner::improve_schedule(m.g, start, m.d, 1.0, quick(2), &rep);
    require_complete_orders(best.graph, best.order);
    const auto fin = sim::simulate(best.graph, best.order, m.d);
    for (const auto& t : m.g.tasks)
      for (auto dep : t.deps)
        CHECK(fin.start_us[static_cast<std::size_t>(t.id)] >= fin.end_us[static_cast<std::size_t>(dep)] - 1e-9);
    CHECK(fin.step_us < 20.0);
    CHECK(rep.windows_total >= 4);
  }
}

TEST_CASE("the windowed solver is never worse than its start on random graphs", "[planner][windowed][random]") {
  std::mt19937 rng(4242u);
  int improved = 0;
  for (int trial = 0; trial < 6; ++trial) {
    const int lanes = 1 + trial % 2;
    const auto m = random_layers(rng, 30 + 6 * trial, lanes);
    const double slow = trial % 3 == 0 ? 1.0 : 1.3;
    const auto policy = trial % 2 == 0 ? planner::policy::program_order : planner::policy::xla_lhs;
    const auto start = planner::list_schedule(policy, m.g, m.d);
    planner::windowed_report rep;
    auto o = quick(10 + 2 * trial);
    o.window_time_limit_s = 0.2;
    o.time_budget_s = 1.5;
    const auto best = planner::improve_schedule(m.g, start, m.d, slow, o, &rep);
    INFO("trial " << trial << ", " << m.g.tasks.size() << " tasks, " << planner::to_string(policy));
    require_complete_orders(best.graph, best.order);
    const double before = sim::simulate(m.g, start.order, m.d, slow).step_us;
    const double after = sim::simulate(best.graph, best.order, m.d, slow).step_us;
    CHECK(after <= before);
    CHECK(rep.final_step_us == Catch::Approx(after));
    CHECK(rep.start_step_us == Catch::Approx(before));
    CHECK(after >= rep.lower_bound_us * (1 - 1e-9));
    CHECK(rep.windows_total > 0);
    improved += after < before * (1 - 1e-6) ? 1 : 0;
  }
  CHECK(improved >= 3);  // the search does something, not only nothing harmful
}

TEST_CASE("the time budget bounds the search", "[planner][windowed]") {
  std::mt19937 rng(99u);
  const auto m = random_layers(rng, 150, 2);
  const auto start = planner::list_schedule(planner::policy::program_order, m.g, m.d);
  auto o = quick(40);
  o.rounds = 100;
  o.time_budget_s = 0.5;
  planner::windowed_report rep;
  const auto best = planner::improve_schedule(m.g, start, m.d, 1.0, o, &rep);
  require_complete_orders(best.graph, best.order);
  CHECK(rep.final_step_us <= rep.start_step_us);
  SECTION("a spent budget solves no window and returns the start") {
    o.time_budget_s = 0;
    planner::windowed_report none;
    const auto same = planner::improve_schedule(m.g, start, m.d, 1.0, o, &none);
    CHECK(none.windows_total == 0);
    CHECK(same.order == start.order);
  }
  SECTION("in the deterministic mode the budget is not read, and the same plan comes out every time") {
    o.time_budget_s = 0;
    o.rounds = 4;
    o.window_work_limit = 50'000;
    planner::windowed_report first_rep, again_rep;
    const auto first = planner::improve_schedule(m.g, start, m.d, 1.0, o, &first_rep);
    const auto again = planner::improve_schedule(m.g, start, m.d, 1.0, o, &again_rep);
    CHECK(first_rep.windows_total > 0);
    CHECK(first.order == again.order);
    CHECK(first_rep.windows_total == again_rep.windows_total);
    CHECK(first_rep.windows_optimal == again_rep.windows_optimal);
  }
}

TEST_CASE("bad arguments are reported", "[planner][windowed]") {
  const auto m = late_collective();
  const auto start = planner::list_schedule(planner::policy::program_order, m.g, m.d);
  std::vector<double> short_d{1.0, 2.0};
  CHECK_THROWS_WITH(planner::improve_schedule(m.g, start, short_d, 1.0, quick(8)),
                    Catch::Matchers::ContainsSubstring("2 durations for 5 tasks"));
  CHECK_THROWS_WITH(planner::improve_schedule(m.g, start, m.d, 1.0, quick(1)),
                    Catch::Matchers::ContainsSubstring("window must be at least 2"));
  auto none_at_once = quick(8);
  none_at_once.parallel_windows = 0;
  CHECK_THROWS_WITH(planner::improve_schedule(m.g, start, m.d, 1.0, none_at_once),
                    Catch::Matchers::ContainsSubstring("parallel_windows must be at least 1"));
}
