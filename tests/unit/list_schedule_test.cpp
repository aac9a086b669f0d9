#include <concerto/ir/builder.hpp>
#include <concerto/ir/workloads.hpp>
#include <concerto/planner/list.hpp>
#include <concerto/sim/simulate.hpp>

#include <catch2/catch_approx.hpp>
#include <catch2/catch_test_macros.hpp>
#include <catch2/generators/catch_generators.hpp>
#include <catch2/generators/catch_generators_range.hpp>
#include <catch2/matchers/catch_matchers_string.hpp>

#include <algorithm>
#include <numeric>
#include <optional>
#include <random>

using namespace concerto;
using Catch::Matchers::ContainsSubstring;

namespace {

// prefix + i, appended: g++ 12 warns falsely (-Wrestrict) on a literal + std::to_string(i).
std::string named(std::string prefix, std::uint64_t i) {
  prefix += std::to_string(i);
  return prefix;
}

struct replay_result {
  std::vector<double> start, finish;
  [[nodiscard]] double makespan() const { return finish.empty() ? 0 : *std::max_element(finish.begin(), finish.end()); }
};

// Runs each stream's order as soon as the stream is free and the dependencies have finished;
// nullopt when the heads of all streams wait on each other (a deadlock).
std::optional<replay_result> replay(const planner::ordering& s, const std::vector<double>& durations) {
  const auto n = s.graph.tasks.size();
  replay_result r{std::vector<double>(n, -1), std::vector<double>(n, -1)};
  std::vector<std::size_t> head(s.order.size(), 0);
  std::vector<double> free_at(s.order.size(), 0);
  std::size_t done = 0;
  for (bool progress = true; progress;) {
    progress = false;
    for (std::size_t st = 0; st < s.order.size(); ++st)
      while (head[st] < s.order[st].size()) {
        const auto id = static_cast<std::size_t>(s.order[st][head[st]]);
        double ready = free_at[st];
        bool waiting = false;
        for (auto d : s.graph.tasks[id].deps) {
          if (r.finish[static_cast<std::size_t>(d)] < 0)
            waiting = true;
          ready = std::max(ready, r.finish[static_cast<std::size_t>(d)]);
        }
        if (waiting)
          break;
        r.start[id] = ready;
        r.finish[id] = free_at[st] = ready + durations[id];
        ++head[st];
        ++done;
        progress = true;
      }
  }
  if (done != n)
    return std::nullopt;
  return r;
}

// The properties every list schedule has, whatever the policy.
void check_schedule(const planner::ordering& s, const ir::graph& original) {
  REQUIRE(s.graph.tasks.size() == original.tasks.size());
  REQUIRE(s.order.size() == original.streams.size());
  std::vector<int> seen(original.tasks.size(), 0);
  for (std::size_t st = 0; st < s.order.size(); ++st)
    for (auto id : s.order[st]) {
      ++seen.at(static_cast<std::size_t>(id));
      CHECK(original[id].stream == static_cast<ir::stream_id>(st));
    }
  CHECK(std::all_of(seen.begin(), seen.end(), [](int k) { return k == 1; }));
  // Only ordering edges may be added: kinds, streams and the original edges stay.
  for (std::size_t i = 0; i < original.tasks.size(); ++i) {
    const auto& before = original.tasks[i];
    const auto& after = s.graph.tasks[i];
    CHECK(after.kind == before.kind);
    CHECK(after.stream == before.stream);
    for (auto d : before.deps)
      CHECK(std::find(after.deps.begin(), after.deps.end(), d) != after.deps.end());
  }
  // No stream waits on a task that it runs later itself.
  std::vector<std::size_t> position(original.tasks.size());
  for (const auto& order : s.order)
    for (std::size_t p = 0; p < order.size(); ++p)
      position[static_cast<std::size_t>(order[p])] = p;
  for (const auto& t : s.graph.tasks)
    for (auto d : t.deps)
      if (s.graph[d].stream == t.stream)
        CHECK(position[static_cast<std::size_t>(d)] < position[static_cast<std::size_t>(t.id)]);
  CHECK_NOTHROW(s.graph.validate());
  CHECK(replay(s, std::vector<double>(original.tasks.size(), 1.0)).has_value());
}

// A random DAG on compute and two comm lanes whose ids are not always topological.
ir::graph random_dag(std::uint32_t seed) {
  std::mt19937 rng(seed);
  const int n = std::uniform_int_distribution<int>(1, 30)(rng);
  ir::graph g;
  g.cost_only = true; // planned, not run
  g.name = named("random-", seed);
  g.axes = {{"tp", 4, ir::link_class::intra_node}, {"dp", 2, ir::link_class::inter_node}};
  g.streams = {{"compute", -1}, {"comm:tp", 0}, {"comm:dp", 1}};
  // Node k of the DAG (edges only from lower k) gets id perm[k].
  std::vector<ir::task_id> perm(static_cast<std::size_t>(n));
  std::iota(perm.begin(), perm.end(), 0);
  if (seed % 2 == 1)
    std::shuffle(perm.begin(), perm.end(), rng);
  g.tasks.resize(static_cast<std::size_t>(n));
  std::bernoulli_distribution edge(0.15);
  for (int k = 0; k < n; ++k) {
    auto& t = g.tasks[static_cast<std::size_t>(perm[static_cast<std::size_t>(k)])];
    t.id = perm[static_cast<std::size_t>(k)];
    t.name = named("t", k);
    const int lane = std::uniform_int_distribution<int>(0, 2)(rng);
    t.stream = lane;
    t.kind = lane == 0 ? ir::op_kind::matmul : ir::op_kind::all_reduce;
    t.axis = lane - 1;
    for (int j = 0; j < k; ++j)
      if (edge(rng))
        t.deps.push_back(perm[static_cast<std::size_t>(j)]);
  }
  g.validate();
  return g;
}

std::vector<double> random_durations(std::size_t n, std::uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<double> us(0.5, 20);
  std::vector<double> d(n);
  for (auto& x : d)
    x = us(rng);
  return d;
}

std::vector<planner::ordering> all_policies(const ir::graph& g, const std::vector<double>& durations) {
  std::vector<planner::ordering> out;
  for (const auto p : planner::policies_of(planner::policy_family::list))
    out.push_back(planner::list_schedule(p, g, durations));
  return out;
}

int max_collectives_in_flight(const ir::graph& g, const replay_result& r) {
  int most = 0;
  for (const auto& t : g.tasks) {
    if (!ir::is_collective(t.kind))
      continue;
    // Intervals are half-open, so count those running at the instant t starts.
    int running = 0;
    const auto at = r.start[static_cast<std::size_t>(t.id)];
    for (const auto& u : g.tasks)
      if (ir::is_collective(u.kind) && r.start[static_cast<std::size_t>(u.id)] <= at &&
          at < r.finish[static_cast<std::size_t>(u.id)])
        ++running;
    most = std::max(most, running);
  }
  return most;
}

} // namespace

TEST_CASE("every policy schedules each task once, in dependency order, without deadlock", "[planner][list]") {
  SECTION("on random small DAGs") {
    for (std::uint32_t seed = 1; seed <= 300; ++seed) {
      CAPTURE(seed);
      const auto g = random_dag(seed);
      const auto durations = random_durations(g.size(), seed);
      for (const auto& s : all_policies(g, durations)) {
        check_schedule(s, g);
        // Deadlock-free for other durations too: the orders, not the timing, guarantee it.
        CHECK(replay(s, random_durations(g.size(), seed + 1000)).has_value());
      }
    }
  }
  SECTION("on the workloads") {
    const auto name = GENERATE(from_range(ir::workload_names()));
    CAPTURE(name);
    const auto g = ir::make_workload(name, {.layers = 2});
    std::vector<double> durations(g.size());
    for (const auto& t : g.tasks)
      durations[static_cast<std::size_t>(t.id)] = t.flops / 4e8 + t.bytes / 2e5;
    for (const auto& s : all_policies(g, durations))
      check_schedule(s, g);
  }
}

TEST_CASE("sync chains every task in program order", "[planner][list][sync]") {
  for (std::uint32_t seed = 1; seed <= 50; ++seed) {
    CAPTURE(seed);
    const auto g = random_dag(seed);
    const auto s = planner::sync_schedule(g);
    const auto program = planner::detail::program_order(g);
    for (std::size_t i = 1; i < program.size(); ++i) {
      const auto& deps = s.graph[program[i]].deps;
      CHECK(std::find(deps.begin(), deps.end(), program[i - 1]) != deps.end());
    }
    // Hence nothing overlaps: the step takes the sum of all durations.
    const auto durations = random_durations(g.size(), seed);
    const auto r = replay(s, durations);
    REQUIRE(r);
    CHECK(r->makespan() == Catch::Approx(std::accumulate(durations.begin(), durations.end(), 0.0)));
  }
}

TEST_CASE("program_order keeps the graph and runs each stream in program order", "[planner][list]") {
  SECTION("builder graphs: ascending ids") {
    const auto g = ir::make_workload("gpt-zero3", {.layers = 1});
    const auto s = planner::program_order_schedule(g);
    CHECK(s.graph == g);
    for (const auto& order : s.order)
      CHECK(std::is_sorted(order.begin(), order.end()));
    CHECK(s.graph[s.order[0].front()].name == "embed");
    CHECK(s.graph[s.order[1].front()].name == "embed.wte.ag.fwd");
  }
  SECTION("ids that are not topological: the graph's topological order") {
    const auto g = random_dag(7);
    REQUIRE(planner::detail::program_order(g) == g.topological_order());
    const auto s = planner::program_order_schedule(g);
    CHECK(s.graph == g);
    const auto topo = g.topological_order();
    for (const auto& order : s.order) {
      std::vector<ir::task_id> expected;
      for (auto id : topo)
        if (!order.empty() && g[id].stream == g[order[0]].stream)
          expected.push_back(id);
      CHECK(order == expected);
    }
  }
}

TEST_CASE("xla_lhs starts a collective on the critical path before independent compute", "[planner][list][xla]") {
  // big (100 us) is first in program order and independent; a → all-reduce (200 us) → use is
  // the long chain. Program order: big, a, then the all-reduce: 100 + 1 + 200 + 1 = 302 us.
  // xla_lhs runs a first so that the all-reduce hides big: 1 + 200 + 1 = 202 us.
  ir::builder b("critical");
  b.cost_only(); // planned, not run
  const int dp = b.axis("dp", 8, ir::link_class::inter_node);
  const auto x = b.buffer("x", {1024});
  const auto y = b.buffer("y", {1024});
  const auto big = b.compute(ir::op_kind::matmul, "big", {}, {y}, {.fn = ir::op::matmul, .flops = 0});
  const auto a = b.compute(ir::op_kind::elementwise, "a", {}, {x}, {.fn = ir::op::zero, .flops = 0});
  const auto ar = b.collective(ir::op_kind::all_reduce, "ar", dp, x, x);
  const auto use = b.compute(ir::op_kind::elementwise, "use", {x, y}, {x}, {.fn = ir::op::add, .flops = 0});
  const auto g = std::move(b).finish();
  const std::vector<double> durations{100, 1, 200, 1};

  const auto lhs = planner::xla_lhs_schedule(g, durations);
  check_schedule(lhs, g);
  CHECK(lhs.order[0] == std::vector<ir::task_id>{a, big, use});
  const auto r = replay(lhs, durations);
  REQUIRE(r);
  CHECK(r->start[static_cast<std::size_t>(ar)] == 1);
  CHECK(r->start[static_cast<std::size_t>(big)] == 1);
  CHECK(r->makespan() == 202);

  const auto eager = replay(planner::program_order_schedule(g), durations);
  REQUIRE(eager);
  CHECK(eager->makespan() == 302);
}

TEST_CASE("xla_lhs orders compute by the longest remaining path", "[planner][list][xla]") {
  ir::builder b("levels");
  b.cost_only(); // planned, not run
  const auto x = b.buffer("x", {8});
  const auto y = b.buffer("y", {8});
  const auto p = b.compute(ir::op_kind::elementwise, "p", {}, {y}, {.fn = ir::op::zero, .flops = 0});   // 5 us, nothing after it
  const auto q = b.compute(ir::op_kind::elementwise, "q", {}, {x}, {.fn = ir::op::zero, .flops = 0});   // 1 us, then r
  const auto r = b.compute(ir::op_kind::elementwise, "r", {x}, {x}, {.fn = ir::op::scale, .flops = 0}); // 10 us
  const auto g = std::move(b).finish();
  const auto s = planner::xla_lhs_schedule(g, std::vector<double>{5, 1, 10});
  CHECK(s.order[0] == std::vector<ir::task_id>{q, r, p}); // levels: q 11, r 10, p 5
}

TEST_CASE("xla_lhs keeps at most max_in_flight collectives running", "[planner][list][xla]") {
  // Six independent collectives on each of two lanes, each read by a compute task.
  ir::builder b("many");
  b.cost_only(); // planned, not run
  const int tp = b.axis("tp", 8);
  const int dp = b.axis("dp", 4, ir::link_class::inter_node);
  for (int i = 0; i < 12; ++i) {
    const auto buf = b.buffer(named("g", i), {256});
    b.compute(ir::op_kind::elementwise, named("make", i), {}, {buf}, {.fn = ir::op::zero, .flops = 0});
    b.collective(ir::op_kind::all_reduce, named("ar", i), i % 2 == 0 ? tp : dp, buf, buf);
  }
  const auto g = std::move(b).finish();
  std::vector<double> durations(g.size());
  for (const auto& t : g.tasks)
    durations[static_cast<std::size_t>(t.id)] = ir::is_collective(t.kind) ? 10 : 1;

  const int cap = GENERATE(1, 2, 3);
  CAPTURE(cap);
  const auto s = planner::xla_lhs_schedule(g, durations, cap);
  check_schedule(s, g);
  const auto r = replay(s, durations);
  REQUIRE(r);
  // Two lanes can run at most two collectives at once, whatever the cap.
  CHECK(max_collectives_in_flight(g, *r) == std::min(cap, 2));
  // The cap is carried by the graph's edges, so it holds with other durations too.
  for (std::uint32_t seed = 1; seed <= 20; ++seed) {
    const auto other = replay(s, random_durations(g.size(), seed));
    REQUIRE(other);
    CHECK(max_collectives_in_flight(g, *other) <= cap);
  }
}

TEST_CASE("xla_lhs's cap edges replay beside the graph as they do inside its copy", "[planner][list][xla]") {
  const auto g = ir::make_workload("llama-tp-sp", {.layers = 2});
  std::vector<double> durations(g.size());
  for (const auto& t : g.tasks) durations[static_cast<std::size_t>(t.id)] = ir::is_collective(t.kind) ? 7.0 + t.id % 5 : 3.0 + t.id % 3;
  const auto orders = planner::xla_lhs_orders(g, durations);
  const auto copy = planner::xla_lhs_schedule(g, durations);
  REQUIRE_FALSE(orders.cap_edges.empty()); // the two-collective cap binds on this graph
  CHECK(orders.order == copy.order);
  std::size_t added = 0;
  for (std::size_t i = 0; i < g.tasks.size(); ++i) added += copy.graph.tasks[i].deps.size() - g.tasks[i].deps.size();
  CHECK(added == orders.cap_edges.size());
  const sim::contention slowdown{1.3, 1.1};
  for (std::uint32_t seed = 0; seed <= 5; ++seed) {
    const auto d = seed == 0 ? durations : random_durations(g.size(), seed);
    CAPTURE(seed);
    CHECK(sim::simulate(g, orders.order, d, slowdown, orders.cap_edges).step_us ==
          sim::simulate(copy.graph, copy.order, d, slowdown).step_us);
  }
  const std::vector<std::pair<ir::task_id, ir::task_id>> outside{{0, static_cast<ir::task_id>(g.size())}};
  CHECK_THROWS_WITH(sim::simulate(g, orders.order, durations, slowdown, outside), ContainsSubstring("an added dependency names task"));
}

TEST_CASE("list schedulers reject what they cannot schedule, naming it", "[planner][list][errors]") {
  ir::builder b("two");
  b.cost_only(); // planned, not run
  const auto x = b.buffer("x", {8});
  b.compute(ir::op_kind::elementwise, "first", {}, {x}, {.fn = ir::op::zero, .flops = 0});
  b.compute(ir::op_kind::elementwise, "second", {x}, {x}, {.fn = ir::op::scale, .flops = 0});
  const auto g = std::move(b).finish();
  CHECK_THROWS_WITH(planner::list_schedule(planner::policy::megatron, g, std::vector<double>{1, 1}),
                    ContainsSubstring("'megatron' is not a list scheduling policy"));
  CHECK_THROWS_WITH(planner::parse_policy("fifo", "--policy"),
                    ContainsSubstring("--policy: 'fifo' is not a plan policy (sync, program_order, xla_lhs, megatron"));
  CHECK_THROWS_WITH(planner::xla_lhs_schedule(g, std::vector<double>{1}), ContainsSubstring("1 durations for 2 tasks"));
  CHECK_THROWS_WITH(planner::xla_lhs_schedule(g, std::vector<double>{1, -2}),
                    ContainsSubstring("'second'") && ContainsSubstring("duration"));
  CHECK_THROWS_WITH(planner::xla_lhs_schedule(g, std::vector<double>{1, 1}, 0), ContainsSubstring("max_in_flight"));
  CHECK(planner::policies_of(planner::policy_family::list) ==
        std::vector<planner::policy>{planner::policy::sync, planner::policy::program_order, planner::policy::xla_lhs});
}
