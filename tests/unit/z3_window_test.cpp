#include <concerto/planner/z3_window.hpp>

#include <catch2/catch_approx.hpp>
#include <catch2/catch_test_macros.hpp>
#include <catch2/generators/catch_generators.hpp>
#include <catch2/matchers/catch_matchers_string.hpp>

#include <algorithm>
#include <numeric>
#include <random>

using namespace concerto;
using planner::window_problem;
using planner::window_task;

namespace {

// Independent feasibility check: precedence, releases, stream free times, one task at a time
// per stream, and the makespan the solver reports.
void require_feasible(const window_problem& p, const planner::window_solution& s) {
  REQUIRE(s.start.size() == p.tasks.size());
  const double eps = 1e-9;
  double mk = 0;
  for (std::size_t i = 0; i < p.tasks.size(); ++i) {
    const auto& t = p.tasks[i];
    REQUIRE(s.start[i] >= t.release - eps);
    if (!p.stream_free.empty()) REQUIRE(s.start[i] >= p.stream_free[static_cast<std::size_t>(t.stream)] - eps);
    for (int d : t.preds) {
      const auto u = static_cast<std::size_t>(d);
      REQUIRE(s.start[i] >= s.start[u] + p.tasks[u].duration - eps);
    }
    for (std::size_t j = i + 1; j < p.tasks.size(); ++j) {
      if (p.tasks[j].stream != t.stream) continue;
      const bool i_first = s.start[i] + t.duration <= s.start[j] + eps;
      const bool j_first = s.start[j] + p.tasks[j].duration <= s.start[i] + eps;
      REQUIRE((i_first || j_first));
    }
    mk = std::max(mk, s.start[i] + t.duration + t.tail);
  }
  REQUIRE(s.makespan == Catch::Approx(mk).margin(1e-9));
}

// The classic case: a collective follows the first kernel, an independent kernel can hide it,
// and the incumbent (program order) runs the collective's consumer first, leaving it exposed.
window_problem overlap_case() {
  window_problem p;
  p.tasks = {
      {0, 3.0, 0, 0, {}},  // A: compute
      {1, 2.0, 0, 0, {0}}, // C: collective of A's output
      {0, 3.0, 0, 0, {}},  // B: independent compute
      {0, 1.0, 0, 0, {1}}, // D: consumes C
  };
  p.stream_free = {0, 0};
  p.hint_start = {0, 3, 6, 5};  // A, C, D waits for C (5), then B: 9
  p.upper_bound = 9;
  return p;
}

// Brute force over every precedence-respecting total order: each gives the semi-active
// schedule with the induced per-stream orders, and some total order induces the optimum's.
double brute_force(const window_problem& p) {
  const auto n = p.tasks.size();
  std::vector<int> perm(n);
  std::iota(perm.begin(), perm.end(), 0);
  double best = std::numeric_limits<double>::infinity();
  std::vector<double> end(n);
  std::vector<char> placed(n);
  do {
    std::fill(placed.begin(), placed.end(), 0);
    std::vector<double> stream_end(p.stream_free);
    double mk = 0;
    bool topological = true;
    for (int i : perm) {
      const auto& t = p.tasks[static_cast<std::size_t>(i)];
      double s = std::max(t.release, stream_end[static_cast<std::size_t>(t.stream)]);
      for (int d : t.preds) {
        if (!placed[static_cast<std::size_t>(d)]) { topological = false; break; }
        s = std::max(s, end[static_cast<std::size_t>(d)]);
      }
      if (!topological) break;
      placed[static_cast<std::size_t>(i)] = 1;
      end[static_cast<std::size_t>(i)] = s + t.duration;
      stream_end[static_cast<std::size_t>(t.stream)] = s + t.duration;
      mk = std::max(mk, s + t.duration + t.tail);
    }
    if (topological) best = std::min(best, mk);
  } while (std::next_permutation(perm.begin(), perm.end()));
  return best;
}

window_problem random_problem(std::mt19937& rng, int n, int streams) {
  std::uniform_real_distribution<double> dur(0.5, 10.0), rel(0.0, 8.0), coin(0.0, 1.0);
  window_problem p;
  p.stream_free.resize(static_cast<std::size_t>(streams));
  for (auto& f : p.stream_free) f = coin(rng) < 0.5 ? 0.0 : rel(rng);
  for (int i = 0; i < n; ++i) {
    window_task t;
    t.stream = static_cast<int>(rng() % static_cast<unsigned>(streams));
    t.duration = dur(rng);
    t.release = coin(rng) < 0.3 ? rel(rng) : 0.0;
    t.tail = coin(rng) < 0.3 ? dur(rng) : 0.0;
    for (int j = 0; j < i; ++j)
      if (coin(rng) < 0.25) t.preds.push_back(j);
    p.tasks.push_back(t);
  }
  return p;
}

} // namespace

TEST_CASE("a window with one hidable collective is solved to its optimum", "[planner][z3_window]") {
  const auto p = overlap_case();
  SECTION("the collective is overlapped with the independent kernel, giving the compute work 7") {
    const auto s = planner::solve_window(p, 5.0);
    require_feasible(p, s);
    CHECK(s.makespan == Catch::Approx(7.0));
    CHECK(s.optimal);
    CHECK(s.improved);
    CHECK(s.start[2] == Catch::Approx(3.0));  // B runs while C is in flight
  }
  SECTION("z3::optimize finds the same optimum") {
    planner::window_options o;
    o.method = planner::window_method::optimize;
    const auto s = planner::solve_window(p, o);
    require_feasible(p, s);
    CHECK(s.makespan == Catch::Approx(7.0));
    CHECK(s.optimal);
  }
  SECTION("a lower bound equal to the optimum does not cut it off") {
    auto q = p;
    q.lower_bound = 7.0;
    const auto s = planner::solve_window(q, 5.0);
    require_feasible(q, s);
    CHECK(s.makespan == Catch::Approx(7.0));
    CHECK(s.optimal);
  }
  SECTION("without an incumbent the solver still reaches the optimum") {
    auto q = p;
    q.hint_start.clear();
    q.upper_bound = 0;
    const auto s = planner::solve_window(q, 5.0);
    require_feasible(q, s);
    CHECK(s.makespan == Catch::Approx(7.0));
    CHECK(s.optimal);
  }
  SECTION("a caller's context can be reused across windows") {
    z3::context ctx;
    const auto a = planner::solve_window(p, 5.0, &ctx);
    const auto b = planner::solve_window(p, 5.0, &ctx);
    CHECK(a.makespan == Catch::Approx(7.0));
    CHECK(b.makespan == Catch::Approx(7.0));
  }
}

TEST_CASE("boundary state shapes the window's optimum", "[planner][z3_window]") {
  SECTION("a chain across streams takes the sum of its durations") {
    window_problem p;
    p.tasks = {{0, 1.0, 0, 0, {}}, {1, 2.0, 0, 0, {0}}, {0, 3.0, 0, 0, {1}}};
    p.stream_free = {0, 0};
    const auto s = planner::solve_window(p, 5.0);
    require_feasible(p, s);
    CHECK(s.makespan == Catch::Approx(6.0));
    CHECK(s.optimal);
    CHECK_FALSE(s.improved);  // the list schedule it starts from is already optimal
  }
  SECTION("a long tail goes first even if the stream idles until its release") {
    // t0: release 3, duration 2, tail 5; t1: release 0, duration 4.
    // t1 first: t0 ends at 6, + tail = 11. t0 first: 3..5 (+5 = 10), t1 5..9: makespan 10.
    window_problem p;
    p.tasks = {{0, 2.0, 3.0, 5.0, {}}, {0, 4.0, 0.0, 0.0, {}}};
    p.stream_free = {0};
    p.hint_start = {4, 0};
    const auto s = planner::solve_window(p, 5.0);
    require_feasible(p, s);
    CHECK(s.makespan == Catch::Approx(10.0));
    CHECK(s.start[0] == Catch::Approx(3.0));
    CHECK(s.optimal);
    CHECK(s.improved);
  }
  SECTION("a busy stream delays its first task") {
    window_problem p;
    p.tasks = {{0, 2.0, 0, 0, {}}, {1, 3.0, 0, 0, {0}}};
    p.stream_free = {5, 1};
    const auto s = planner::solve_window(p, 5.0);
    require_feasible(p, s);
    CHECK(s.start[0] == Catch::Approx(5.0));
    CHECK(s.makespan == Catch::Approx(10.0));
  }
  SECTION("an empty window is trivially optimal") {
    const auto s = planner::solve_window(window_problem{}, 1.0);
    CHECK(s.start.empty());
    CHECK(s.optimal);
  }
}

TEST_CASE("bad windows are rejected with a message naming the task", "[planner][z3_window]") {
  window_problem p;
  p.tasks = {{0, 1.0, 0, 0, {1}}, {0, 1.0, 0, 0, {0}}};
  CHECK_THROWS_WITH(planner::solve_window(p, 1.0), Catch::Matchers::ContainsSubstring("dependency cycle"));
  p.tasks = {{0, -1.0, 0, 0, {}}};
  CHECK_THROWS_WITH(planner::solve_window(p, 1.0), Catch::Matchers::ContainsSubstring("window task 0"));
  p.tasks = {{2, 1.0, 0, 0, {}}};
  p.stream_free = {0, 0};
  CHECK_THROWS_WITH(planner::solve_window(p, 1.0), Catch::Matchers::ContainsSubstring("stream 2"));
  p.tasks = {{0, 1.0, 0, 0, {7}}};
  CHECK_THROWS_WITH(planner::solve_window(p, 1.0), Catch::Matchers::ContainsSubstring("window task 7"));
}

TEST_CASE("random small windows match a brute-force enumeration", "[planner][z3_window][random]") {
  const auto method = GENERATE(planner::window_method::binary_search, planner::window_method::optimize);
  std::mt19937 rng(20240611u);
  for (int round = 0; round < 12; ++round) {
    const int n = 3 + round % 6;  // 3..8 tasks
    const int streams = 2 + round % 2;
    const auto p = random_problem(rng, n, streams);
    const double best = brute_force(p);
    planner::window_options o;
    o.method = method;
    o.time_limit_s = 10;
    const auto s = planner::solve_window(p, o);
    INFO("round " << round << ", " << n << " tasks");
    require_feasible(p, s);
    CHECK(s.optimal);
    CHECK(s.makespan >= best - 1e-9);               // nothing beats the enumeration
    CHECK(s.makespan <= best * (1 + 1e-3) + 1e-9);  // and rounding costs under 0.1%
  }
}

TEST_CASE("the time limit returns a feasible schedule", "[planner][z3_window]") {
  std::mt19937 rng(7u);
  auto p = random_problem(rng, 90, 3);
  for (auto& t : p.tasks) {  // a layer-like sparse DAG: few dependencies, mostly on recent tasks
    std::erase_if(t.preds, [&](int) { return rng() % 8 != 0; });
  }
  planner::window_options o;
  o.time_limit_s = 0.05;
  const auto s = planner::solve_window(p, o);
  require_feasible(p, s);
  SECTION("a work limit instead of time gives the same answer every time") {
    o.work_limit = 200'000;
    const auto a = planner::solve_window(p, o);
    const auto b = planner::solve_window(p, o);
    require_feasible(p, a);
    CHECK(a.start == b.start);
    CHECK(a.optimal == b.optimal);
    o.method = planner::window_method::optimize;
    CHECK_THROWS_WITH(planner::solve_window(p, o), Catch::Matchers::ContainsSubstring("needs the binary_search method"));
  }
  SECTION("with a zero budget the incumbent comes back unchanged") {
    o.time_limit_s = 0;
    p.hint_start = s.start;
    const auto z = planner::solve_window(p, o);
    require_feasible(p, z);
    CHECK(z.makespan <= s.makespan + 1e-9);
    CHECK_FALSE(z.improved);
  }
}
