#include <concerto/plan/memory.hpp>
#include <concerto/plan/verify.hpp>

#include <catch2/catch_test_macros.hpp>
#include <catch2/matchers/catch_matchers_string.hpp>

#include <algorithm>
#include <random>

using namespace concerto;
using Catch::Matchers::ContainsSubstring;

namespace {

std::string ref(const plan::plan& p, ir::task_id t) {
  return "task " + std::to_string(t) + " '" + p.graph.tasks[static_cast<std::size_t>(t)].name + "'";
}

bool mentions(const std::vector<std::string>& problems, const std::vector<std::string>& needles) {
  return std::any_of(problems.begin(), problems.end(), [&](const std::string& s) {
    return std::all_of(needles.begin(), needles.end(), [&](const std::string& n) { return s.find(n) != std::string::npos; });
  });
}

std::string joined(const std::vector<std::string>& problems) {
  std::string s;
  for (const auto& p : problems) s += p + "\n";
  return s;
}

/// Streams: compute, then comm:dp, comm:tp as `lanes` asks (1 to 3 streams in all).
ir::graph empty_graph(int lanes) {
  ir::graph g;
  g.cost_only = true; // planned, not run
  g.name = "random";
  g.axes = {{"dp", 4, ir::link_class::inter_node}, {"tp", 2, ir::link_class::intra_node}};
  g.streams = {{"compute", -1}};
  if (lanes >= 2) g.streams.push_back({"comm:dp", 0});
  if (lanes >= 3) g.streams.push_back({"comm:tp", 1});
  return g;
}

ir::task_id add_task(plan::plan& p, std::string name, ir::stream_id s, std::vector<ir::task_id> deps, double dur) {
  auto& g = p.graph;
  ir::task t;
  t.id = static_cast<ir::task_id>(g.tasks.size());
  t.name = std::move(name);
  t.stream = s;
  t.axis = g.streams[static_cast<std::size_t>(s)].axis;
  t.kind = t.axis < 0 ? ir::op_kind::matmul : ir::op_kind::all_reduce;
  t.bytes = 1024;
  t.deps = std::move(deps);
  g.tasks.push_back(std::move(t));
  p.duration_us.push_back(dur);
  return g.tasks.back().id;
}

/// Each stream's order is the id order (a topological order); starts are as soon as possible.
void schedule_asap(plan::plan& p) {
  const auto& g = p.graph;
  p.order.assign(g.streams.size(), {});
  p.start_us.assign(g.tasks.size(), 0.0);
  std::vector<double> stream_free(g.streams.size(), 0.0);
  for (const auto& t : g.tasks) {
    const auto s = static_cast<std::size_t>(t.stream);
    double start = stream_free[s];
    for (const auto d : t.deps)
      start = std::max(start, p.start_us[static_cast<std::size_t>(d)] + p.duration_us[static_cast<std::size_t>(d)]);
    p.start_us[static_cast<std::size_t>(t.id)] = start;
    stream_free[s] = start + p.duration_us[static_cast<std::size_t>(t.id)];
    p.order[s].push_back(t.id);
  }
}

plan::plan random_plan(std::uint32_t seed) {
  std::mt19937 rng(seed);
  const int lanes = 1 + static_cast<int>(rng() % 3);
  const int n = 10 + static_cast<int>(rng() % 191);
  plan::plan p;
  p.graph = empty_graph(lanes);
  p.policy = "test";
  for (int i = 0; i < n; ++i) {
    std::vector<ir::task_id> deps;
    for (int k = 0; k < 3 && i > 0; ++k) {
      // Mostly recent tasks, so that chains form on every stream.
      const auto back = 1 + rng() % std::min<unsigned>(static_cast<unsigned>(i), 8u);
      const auto d = static_cast<ir::task_id>(i - static_cast<int>(back));
      if (rng() % 3 && std::find(deps.begin(), deps.end(), d) == deps.end()) deps.push_back(d);
    }
    const double dur = rng() % 10 == 0 ? 0.0 : 0.5 + static_cast<double>(rng() % 100) / 10.0;
    add_task(p, std::string("t").append(std::to_string(i)), static_cast<ir::stream_id>(rng() % static_cast<unsigned>(lanes)), deps, dur);
  }
  schedule_asap(p);
  return p;
}

constexpr std::uint32_t seeds = 60;

} // namespace

TEST_CASE("random DAGs scheduled in topological order with ASAP starts pass", "[plan][verify][property]") {
  for (std::uint32_t seed = 1; seed <= seeds; ++seed) {
    const auto p = random_plan(seed);
    INFO("seed " << seed << "\n" << joined(plan::check(p)));
    CHECK(plan::check(p).empty());
    CHECK_NOTHROW(plan::verify(p));
  }
}

TEST_CASE("every mutation of a sound random plan is rejected naming the tasks", "[plan][verify][property]") {
  // Each section mutates every seed's plan; `found` counts the plans that offered a place
  // for the mutation, so that a section cannot pass by finding nothing to mutate.
  int found = 0;
  const auto each_plan = [&](auto&& mutate) {
    for (std::uint32_t seed = 1; seed <= seeds; ++seed) {
      INFO("seed " << seed);
      std::mt19937 rng(seed * 7919u);
      if (mutate(random_plan(seed), rng)) ++found;
    }
  };

  SECTION("swapping a task with its dependency on their stream deadlocks") {
    each_plan([](const plan::plan& base, std::mt19937&) {
      const auto& g = base.graph;
      for (const auto& t : g.tasks) {
        const auto same = std::find_if(t.deps.begin(), t.deps.end(), [&](auto d) { return g[d].stream == t.stream; });
        if (same == t.deps.end()) continue;
        auto p = base;
        auto& order = p.order[static_cast<std::size_t>(t.stream)];
        std::iter_swap(std::find(order.begin(), order.end(), t.id), std::find(order.begin(), order.end(), *same));
        const auto problems = plan::check(p);
        INFO(joined(problems));
        CHECK(mentions(problems, {ref(p, t.id) + " is at position", "before its predecessor " + ref(p, *same), "deadlock"}));
        return true;
      }
      return false;
    });
    CHECK(found > static_cast<int>(seeds) * 3 / 4);
  }
  SECTION("starting a task before its dependency ends") {
    each_plan([](const plan::plan& base, std::mt19937&) {
      for (const auto& t : base.graph.tasks) {
        if (t.deps.empty()) continue;
        const auto end = [&](ir::task_id d) {
          return base.start_us[static_cast<std::size_t>(d)] + base.duration_us[static_cast<std::size_t>(d)];
        };
        const auto d = *std::max_element(t.deps.begin(), t.deps.end(), [&](auto a, auto b) { return end(a) < end(b); });
        if (end(d) < 1) continue;
        auto p = base;
        p.start_us[static_cast<std::size_t>(t.id)] = end(d) - 1;
        const auto problems = plan::check(p);
        INFO(joined(problems));
        CHECK(mentions(problems, {ref(p, t.id) + " starts at ", "before its dependency " + ref(p, d).substr(5) + " ends at "}));
        return true;
      }
      return false;
    });
    CHECK(found == static_cast<int>(seeds));
  }
  SECTION("scheduling a task twice") {
    each_plan([](plan::plan p, std::mt19937& rng) {
      const auto t = static_cast<ir::task_id>(rng() % p.graph.tasks.size());
      p.order[static_cast<std::size_t>(p.graph[t].stream)].push_back(t);
      CHECK(mentions(plan::check(p), {ref(p, t) + " is scheduled 2 times"}));
      return true;
    });
    CHECK(found == static_cast<int>(seeds));
  }
  SECTION("dropping a task") {
    each_plan([](plan::plan p, std::mt19937& rng) {
      const auto t = static_cast<ir::task_id>(rng() % p.graph.tasks.size());
      auto& order = p.order[static_cast<std::size_t>(p.graph[t].stream)];
      order.erase(std::find(order.begin(), order.end(), t));
      CHECK(mentions(plan::check(p), {ref(p, t) + " is never scheduled"}));
      return true;
    });
    CHECK(found == static_cast<int>(seeds));
  }
  SECTION("overlapping two tasks on a stream") {
    each_plan([](const plan::plan& base, std::mt19937& rng) {
      const auto s = rng() % base.order.size();
      for (std::size_t i = 1; i < base.order[s].size(); ++i) {
        const auto a = base.order[s][i - 1], b = base.order[s][i];
        if (base.duration_us[static_cast<std::size_t>(a)] < 0.5) continue;
        auto p = base;
        p.start_us[static_cast<std::size_t>(b)] =
            p.start_us[static_cast<std::size_t>(a)] + p.duration_us[static_cast<std::size_t>(a)] / 2;
        const auto problems = plan::check(p);
        INFO(joined(problems));
        CHECK(mentions(problems, {ref(p, a) + " and " + ref(p, b) + " overlap on stream '" + p.graph.streams[s].name + "'"}));
        return true;
      }
      return false;
    });
    CHECK(found > static_cast<int>(seeds) * 3 / 4);
  }
  SECTION("a second, unchained lane for a mesh axis") {
    each_plan([](plan::plan p, std::mt19937&) {
      const auto new_lane = [&](std::string name) {
        p.graph.streams.push_back({std::move(name), 0});
        p.order.emplace_back();
        return static_cast<ir::stream_id>(p.graph.streams.size() - 1);
      };
      const auto lane2 = new_lane("comm:dp.2");
      const auto first = add_task(p, "early.ar", lane2, {}, 1.0);
      const auto second = add_task(p, "late.ar", lane2, {}, 1.0);
      const auto lane3 = new_lane("comm:dp.3");
      const auto other = add_task(p, "other.ar", lane3, {}, 1.0);
      p.order[static_cast<std::size_t>(lane2)] = {first, second};
      p.order[static_cast<std::size_t>(lane3)] = {other};
      p.start_us.insert(p.start_us.end(), {0.0, 1.0, 0.0});
      const auto problems = plan::check(p);
      INFO(joined(problems));
      CHECK(mentions(problems, {"mesh axis 'dp' are not ordered", ref(p, other)}));
      CHECK_FALSE(mentions(problems, {ref(p, first) + " on stream 'comm:dp.2' and " + ref(p, second)}));

      // The ok twin: chained by dependencies, the lanes are safe. Every dp collective of the
      // base plan precedes `other`, which precedes `first`.
      auto& other_deps = p.graph.tasks[static_cast<std::size_t>(other)].deps;
      for (const auto& t : p.graph.tasks)
        if (t.axis == 0 && t.id < first) other_deps.push_back(t.id);
      p.graph.tasks[static_cast<std::size_t>(first)].deps = {other};
      const double after = p.step_us();
      p.start_us[static_cast<std::size_t>(other)] = after;
      p.start_us[static_cast<std::size_t>(first)] = after + 1.0;
      p.start_us[static_cast<std::size_t>(second)] = after + 2.0;
      INFO(joined(plan::check(p)));
      CHECK(plan::check(p).empty());
      return true;
    });
    CHECK(found == static_cast<int>(seeds));
  }
}

TEST_CASE("hand-made plans get exact messages", "[plan][verify]") {
  plan::plan p;
  p.graph = empty_graph(2);
  p.graph.name = "hand";
  const auto fc2 = add_task(p, "fc2", 0, {}, 5.5);
  const auto ar = add_task(p, "fc2.ar", 1, {fc2}, 1.0);
  p.order = {{fc2}, {ar}};
  p.start_us = {0.0, 5.5};
  REQUIRE(plan::check(p).empty());

  SECTION("precedence, with times") {
    p.start_us[1] = 3.0;
    const auto problems = plan::check(p);
    REQUIRE(problems.size() == 1);
    CHECK(problems[0] == "task 1 'fc2.ar' starts at 3.0 us before its dependency 0 'fc2' ends at 5.5 us");
    CHECK_THROWS_WITH(plan::verify(p), ContainsSubstring("plan of graph 'hand' is invalid, 1 problem:") &&
                                           ContainsSubstring("task 1 'fc2.ar' starts at 3.0 us"));
  }
  SECTION("a tolerance absorbs rounding") {
    p.start_us[1] = 5.5 - 1e-9;
    CHECK(plan::check(p).empty());
  }
  SECTION("a task on the wrong stream's order") {
    p.order = {{fc2, ar}, {}};
    CHECK(mentions(plan::check(p), {"task 1 'fc2.ar' runs on stream 'comm:dp' but is in the order of stream 'compute'"}));
  }
  SECTION("sizes that do not match") {
    p.start_us.pop_back();
    p.order.pop_back();
    const auto problems = plan::check(p);
    CHECK(mentions(problems, {"1 start times for 2 tasks"}));
    CHECK(mentions(problems, {"1 stream orders for 2 streams"}));
  }
  SECTION("an invalid graph") {
    p.graph.tasks[0].deps = {1};
    CHECK(mentions(plan::check(p), {"cycle"}));
  }
  SECTION("a negative duration") {
    p.duration_us[0] = -1;
    CHECK(mentions(plan::check(p), {"task 0 'fc2' has duration -1.0 us"}));
  }
  SECTION("two tasks writing one buffer with no order between them race") {
    ir::buffer y;
    y.id = 0;
    y.name = "y";
    y.bytes = 64;
    p.graph.buffers = {y};
    p.graph.tasks[0].writes = {0};
    p.graph.tasks[1].reads = {0};
    p.graph.tasks[1].writes = {0};
    CHECK(plan::check(p).empty()); // fc2.ar depends on fc2: ordered
    p.graph.tasks[1].deps.clear();
    const auto problems = plan::check(p);
    INFO(joined(problems));
    CHECK(mentions(problems, {"task 0 'fc2' and task 1 'fc2.ar' both access buffer 'y', one writing, but no chain of "
                              "dependencies and stream orders runs from the first to the second (a data race"}));
  }
}

TEST_CASE("orders that wait on each other across streams deadlock", "[plan][verify]") {
  // compute runs a1 then a2; the lane runs b1 then b2; b1 needs a2 and a1 needs b2.
  plan::plan p;
  p.graph = empty_graph(2);
  const auto a1 = add_task(p, "a1", 0, {}, 1);
  const auto a2 = add_task(p, "a2", 0, {}, 1);
  const auto b1 = add_task(p, "b1", 1, {a2}, 1);
  const auto b2 = add_task(p, "b2", 1, {}, 1);
  p.graph.tasks[static_cast<std::size_t>(a1)].deps = {b2};
  p.order = {{a1, a2}, {b1, b2}};
  p.start_us = {1, 2, 3, 0};
  REQUIRE_NOTHROW(p.graph.validate()); // the dependencies alone are acyclic
  const auto problems = plan::check(p);
  INFO(joined(problems));
  CHECK(mentions(problems, {"cycle (deadlock)", ref(p, a1), ref(p, a2), ref(p, b1), ref(p, b2)}));
  CHECK_THROWS_AS(plan::collective_sequence(p), concerto::error);
}

TEST_CASE("peak memory of a hand-computed plan", "[plan][memory]") {
  plan::plan p;
  p.graph = empty_graph(1);
  auto& bufs = p.graph.buffers;
  const auto buf = [&](std::string name, std::int64_t bytes, ir::buffer_role role, ir::buffer_id view_of = -1,
                       std::int64_t offset = 0) {
    bufs.push_back({static_cast<ir::buffer_id>(bufs.size()), std::move(name), bytes, ir::dtype::f32, role, {}, view_of, offset});
    return bufs.back().id;
  };
  const auto w = buf("w", 100, ir::buffer_role::param);
  const auto x = buf("x", 10, ir::buffer_role::input);
  const auto a = buf("a", 1000, ir::buffer_role::activation);
  const auto b = buf("b", 2000, ir::buffer_role::activation);
  const auto ws = buf("ws", 300, ir::buffer_role::workspace);
  const auto c = buf("c", 500, ir::buffer_role::activation);
  const auto c_mid = buf("c.mid", 200, ir::buffer_role::activation, c, 100);
  buf("unused", 7000, ir::buffer_role::activation);
  const auto gw = buf("w.grad", 100, ir::buffer_role::gradient);
  const auto t0 = add_task(p, "t0", 0, {}, 2);      // [0, 2)  writes a
  const auto t1 = add_task(p, "t1", 0, {t0}, 3);    // [2, 5)  a -> b, scratch ws
  const auto t2 = add_task(p, "t2", 0, {t1}, 1);    // [5, 6)  b -> c (through a view)
  const auto t3 = add_task(p, "t3", 0, {t2}, 2);    // [6, 8)  reads c
  auto& tasks = p.graph.tasks;
  tasks[0].reads = {x, w}, tasks[0].writes = {a};
  tasks[1].reads = {a}, tasks[1].writes = {b, ws};
  tasks[2].reads = {b}, tasks[2].writes = {c_mid};
  tasks[3].reads = {c}, tasks[3].writes = {gw};
  schedule_asap(p);
  REQUIRE(p.start_us == std::vector<double>{0, 2, 5, 6});
  (void)t3;

  // Live: a [0,5), b [2,6), ws [2,5), c [5,8); persistent w + x + w.grad = 210.
  // At 2: 210 + 1000 + 2000 + 300 = 3510. At 5, a and ws are freed before c is allocated: 2710.
  const auto mem = plan::peak_memory(p);
  CHECK(mem.persistent_bytes == 210);
  CHECK(mem.peak_bytes == 3510);
  CHECK(mem.peak_at_us == 2.0);
  CHECK(mem.live_at_peak == std::vector<ir::buffer_id>{w, x, a, b, ws, gw});

  SECTION("the verifier enforces a cap, naming the largest live buffers") {
    CHECK(plan::check(p, {.memory_cap_bytes = 3510}).empty());
    const auto problems = plan::check(p, {.memory_cap_bytes = 3509});
    REQUIRE(problems.size() == 1);
    CHECK_THAT(problems[0], ContainsSubstring("peak memory 3510 bytes at 2.0 us exceeds the cap of 3509 bytes") &&
                                ContainsSubstring("'b' 2000, 'a' 1000, 'ws' 300"));
  }
  SECTION("running t2 later moves nothing but the release of b") {
    p.start_us[2] = 7, p.start_us[3] = 8;
    const auto later = plan::peak_memory(p);
    CHECK(later.peak_bytes == 3510);
    CHECK(later.peak_at_us == 2.0);
  }
  SECTION("a zero-length task still holds its buffers for an instant") {
    p.duration_us = {0, 0, 0, 0};
    p.start_us = {0, 0, 0, 0};
    const auto flat = plan::peak_memory(p);
    CHECK(flat.peak_bytes == 210 + 1000 + 2000 + 300 + 500);
    CHECK(flat.peak_at_us == 0.0);
  }
}

TEST_CASE("every rank must issue the same collectives in the same order", "[plan][verify][collectives]") {
  plan::plan p;
  p.graph = empty_graph(3);
  const auto fc = add_task(p, "fc", 0, {}, 1);
  const auto tp_ag = add_task(p, "tp.ag", 2, {fc}, 1);
  const auto dp_ar = add_task(p, "dp.ar", 1, {}, 1);
  const auto fc2 = add_task(p, "fc2", 0, {tp_ag}, 1);
  const auto tp_rs = add_task(p, "tp.rs", 2, {fc2}, 1);
  p.graph.tasks[static_cast<std::size_t>(tp_ag)].kind = ir::op_kind::all_gather;
  p.graph.tasks[static_cast<std::size_t>(tp_rs)].kind = ir::op_kind::reduce_scatter;
  schedule_asap(p);
  REQUIRE(plan::check(p).empty());

  const auto seq = plan::collective_sequence(p);
  REQUIRE(seq.size() == 3);
  // Topological order, ties to the smallest id: fc (0) and dp.ar (2) are ready at once; fc
  // runs first and releases tp.ag (1), which then precedes dp.ar.
  CHECK(seq[0].name == "tp.ag");
  CHECK(seq[0].kind == ir::op_kind::all_gather);
  CHECK(seq[0].axis == 1);
  CHECK(seq[1].name == "dp.ar");
  CHECK(seq[1].axis == 0);
  CHECK(seq[2].name == "tp.rs");
  CHECK(seq[2].bytes == 1024);
  (void)dp_ar;

  SECTION("identical sequences pass") { CHECK_NOTHROW(plan::verify_same_collectives({seq, seq, seq})); }
  SECTION("the first differing rank and position are named") {
    auto other = seq;
    other[0].kind = ir::op_kind::all_reduce;
    auto third = seq;
    third[2].bytes = 2048;
    CHECK_THROWS_WITH(plan::verify_same_collectives({seq, seq, other, third}),
                      ContainsSubstring("rank 2 differs from rank 0 at collective 0") &&
                          ContainsSubstring("rank 0 issues all_gather 'tp.ag' on mesh axis 1 (1024 bytes)") &&
                          ContainsSubstring("rank 2 issues all_reduce 'tp.ag'"));
  }
  SECTION("a shorter sequence is named too") {
    auto shorter = seq;
    shorter.pop_back();
    CHECK_THROWS_WITH(plan::verify_same_collectives({seq, shorter}),
                      ContainsSubstring("rank 1 differs from rank 0 at collective 2") &&
                          ContainsSubstring("rank 1 issues nothing (its sequence ends after 2 collectives)"));
  }
}
