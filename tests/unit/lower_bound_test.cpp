#include <concerto/plan/lower_bound.hpp>

#include <catch2/catch_test_macros.hpp>
#include <catch2/matchers/catch_matchers_string.hpp>

#include <random>

using namespace concerto;
using Catch::Matchers::ContainsSubstring;

namespace {

/// A graph made by hand: streams compute, comm:dp, comm:tp; tasks added with their deps.
struct small_graph {
  ir::graph g;
  std::vector<double> dur;
  small_graph() {
    g.cost_only = true; // planned, not run
    g.name = "lb";
    g.axes = {{"dp", 2, ir::link_class::inter_node}, {"tp", 2, ir::link_class::intra_node}};
    g.streams = {{"compute", -1}, {"comm:dp", 0}, {"comm:tp", 1}};
  }
  ir::task_id add(std::string name, int stream, double d, std::vector<ir::task_id> deps = {}) {
    ir::task t;
    t.id = static_cast<ir::task_id>(g.tasks.size());
    t.name = std::move(name);
    t.stream = stream;
    t.kind = stream == 0 ? ir::op_kind::matmul : ir::op_kind::all_reduce;
    t.axis = stream - 1;
    t.deps = std::move(deps);
    g.tasks.push_back(std::move(t));
    dur.push_back(d);
    return g.tasks.back().id;
  }
  [[nodiscard]] plan::lower_bound bound() const { return plan::compute_lower_bound(g, dur); }
};

} // namespace

TEST_CASE("lower bounds of hand-computed graphs", "[plan][lower_bound]") {
  small_graph s;
  SECTION("a chain: every bound is the chain's length") {
    const auto a = s.add("a", 0, 1);
    const auto b = s.add("b", 0, 2, {a});
    s.add("c", 0, 3, {b});
    const auto lb = s.bound();
    CHECK(lb.stream_work_us == 6);
    CHECK(lb.critical_path_us == 6);
    CHECK(lb.one_machine_us == 6);
    CHECK(lb.value == 6);
  }
  SECTION("a reduction after two parallel branches waits for both on the one compute stream") {
    // The longest path to the reduction is 10, but its two producers share the compute stream:
    // it cannot start before 20, and the step cannot end before 25.
    const auto a = s.add("a", 0, 10);
    const auto b = s.add("b", 0, 10);
    const auto r = s.add("r", 1, 5, {a, b});
    s.add("opt", 0, 1, {r});
    const auto lb = s.bound();
    CHECK(lb.critical_path_us == 16);
    CHECK(lb.stream_work_us == 21);
    CHECK(lb.one_machine_us == 26);
    CHECK(lb.value == 26);
  }
  SECTION("independent work on two streams: the busiest stream") {
    s.add("a", 0, 4);
    s.add("b", 0, 4);
    s.add("c", 1, 3);
    const auto lb = s.bound();
    CHECK(lb.stream_work_us == 8);
    CHECK(lb.critical_path_us == 4);
    CHECK(lb.value == 8);
  }
  SECTION("two compute tasks released late by one collective: the one-machine bound beats both others") {
    const auto c = s.add("c", 1, 10);
    s.add("a", 0, 5, {c});
    s.add("b", 0, 5, {c});
    const auto lb = s.bound();
    CHECK(lb.stream_work_us == 10);
    CHECK(lb.critical_path_us == 15);
    CHECK(lb.one_machine_us == 20); // neither can start before 10, and they cannot share the stream
    CHECK(lb.value == 20);
  }
  SECTION("two compute tasks each leaving a long collective behind: tails count too") {
    const auto a = s.add("a", 0, 1);
    const auto b = s.add("b", 0, 1);
    s.add("a.ar", 1, 10, {a});
    s.add("b.ar", 2, 10, {b});
    const auto lb = s.bound();
    CHECK(lb.stream_work_us == 10);
    CHECK(lb.critical_path_us == 11);
    CHECK(lb.one_machine_us == 12); // whichever compute task runs second ends at 2, its collective at 12
    CHECK(lb.value == 12);
  }
  SECTION("an empty graph is bounded by zero") { CHECK(s.bound().value == 0); }
}

TEST_CASE("the one-machine bound preempts at releases with a larger tail", "[plan][lower_bound]") {
  // Job 1 (release 0, 10 long, tail 0) is interrupted at 1 by job 2 (1 long, tail 20): 2 + 20.
  // Without preemption (Schrage's rule) the bound would be 10 + 1 + 20 = 31, which no
  // relaxation may claim.
  CHECK(plan::detail::jackson_preemptive({{0, 10, 0}, {1, 1, 20}}) == 22);
  // Release order differs from tail order; idle time before a late release is skipped.
  CHECK(plan::detail::jackson_preemptive({{5, 2, 1}, {0, 1, 0}, {5, 1, 4}}) == 10);
}

TEST_CASE("lower bounds never exceed a feasible schedule, and one-machine dominates", "[plan][lower_bound][property]") {
  for (std::uint32_t seed = 1; seed <= 40; ++seed) {
    std::mt19937 rng(seed);
    small_graph s;
    const int n = 5 + static_cast<int>(rng() % 60);
    for (int i = 0; i < n; ++i) {
      std::vector<ir::task_id> deps;
      for (int k = 0; k < 3 && i > 0; ++k)
        if (rng() % 2) {
          const auto d = static_cast<ir::task_id>(rng() % static_cast<unsigned>(i));
          if (std::find(deps.begin(), deps.end(), d) == deps.end()) deps.push_back(d);
        }
      s.add(std::string("t").append(std::to_string(i)), static_cast<int>(rng() % 3), static_cast<double>(rng() % 100) / 10.0, deps);
    }
    // A list schedule in id order (a topological order): each task starts when its stream is
    // free and its dependencies have ended.
    std::vector<double> end(static_cast<std::size_t>(n)), stream_free(3, 0.0);
    double makespan = 0;
    for (const auto& t : s.g.tasks) {
      double start = stream_free[static_cast<std::size_t>(t.stream)];
      for (const auto d : t.deps) start = std::max(start, end[static_cast<std::size_t>(d)]);
      end[static_cast<std::size_t>(t.id)] = start + s.dur[static_cast<std::size_t>(t.id)];
      stream_free[static_cast<std::size_t>(t.stream)] = end[static_cast<std::size_t>(t.id)];
      makespan = std::max(makespan, end[static_cast<std::size_t>(t.id)]);
    }
    const auto lb = s.bound();
    INFO("seed " << seed);
    CHECK(lb.value <= makespan + 1e-9);
    CHECK(lb.one_machine_us >= lb.stream_work_us - 1e-9);
    CHECK(lb.one_machine_us >= lb.critical_path_us - 1e-9);
    CHECK(lb.value == std::max({lb.stream_work_us, lb.critical_path_us, lb.one_machine_us}));
    CHECK(lb.value > 0);
  }
}

TEST_CASE("bad durations are rejected with the task's name", "[plan][lower_bound][errors]") {
  small_graph s;
  s.add("a", 0, 1);
  s.add("fc2", 0, 1);
  SECTION("a negative duration") {
    s.dur[1] = -1;
    CHECK_THROWS_WITH(s.bound(), ContainsSubstring("task 1 'fc2'"));
  }
  SECTION("too few durations") {
    s.dur.pop_back();
    CHECK_THROWS_WITH(s.bound(), ContainsSubstring("1 durations given for 2 tasks"));
  }
}
