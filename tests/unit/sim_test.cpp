#include <concerto/sim/simulate.hpp>

#include <catch2/catch_approx.hpp>
#include <catch2/catch_test_macros.hpp>
#include <catch2/matchers/catch_matchers_string.hpp>

#include <algorithm>
#include <numeric>
#include <random>

using namespace concerto;
using Catch::Approx;
using Catch::Matchers::ContainsSubstring;

namespace {

/// A graph with explicit dependencies: the cases below are about scheduling, not buffers.
struct mini {
  ir::graph g;
  explicit mini(int lanes) {
    g.cost_only = true; // planned, not run
    g.name = "mini";
    for (int a = 0; a < lanes; ++a) {
      g.axes.push_back({"ax" + std::to_string(a), 2, ir::link_class::intra_node});
      g.streams.push_back({"comm:ax" + std::to_string(a), a});
    }
  }
  ir::task_id add(std::string name, ir::op_kind kind, ir::stream_id stream, int axis, std::vector<ir::task_id> deps) {
    ir::task t;
    t.id = static_cast<ir::task_id>(g.tasks.size());
    t.name = std::move(name);
    t.kind = kind;
    t.stream = stream;
    t.axis = axis;
    t.deps = std::move(deps);
    g.tasks.push_back(std::move(t));
    return g.tasks.back().id;
  }
  ir::task_id compute(std::string name, std::vector<ir::task_id> deps = {}) {
    return add(std::move(name), ir::op_kind::matmul, ir::compute_stream, -1, std::move(deps));
  }
  ir::task_id collective(std::string name, int lane, std::vector<ir::task_id> deps = {}) {
    return add(std::move(name), ir::op_kind::all_reduce, lane + 1, lane, std::move(deps));
  }
};

using order_t = std::vector<std::vector<ir::task_id>>;

/// Measure of a sorted-or-not list of spans after merging.
double measure(std::vector<std::pair<double, double>> spans) {
  std::sort(spans.begin(), spans.end());
  double total = 0, reach = -1e300;
  for (auto [a, b] : spans) {
    a = std::max(a, reach);
    if (b > a) total += b - a;
    reach = std::max(reach, b);
  }
  return total;
}

/// Measure of (union of a) minus (union of b), by inclusion: |A ∪ B| - |B|.
double measure_minus(const std::vector<std::pair<double, double>>& a, const std::vector<std::pair<double, double>>& b) {
  auto both = a;
  both.insert(both.end(), b.begin(), b.end());
  return measure(both) - measure(b);
}

} // namespace

TEST_CASE("a chain on one stream runs back to back", "[sim]") {
  mini m(0);
  const auto a = m.compute("a");
  const auto b = m.compute("b", {a});
  const auto c = m.compute("c", {b});
  const std::vector<double> d{1, 2, 3};
  const auto r = sim::simulate(m.g, {{a, b, c}}, d);

  CHECK(r.start_us == std::vector<double>{0, 1, 3});
  CHECK(r.end_us == std::vector<double>{1, 3, 6});
  CHECK(r.step_us == 6);
  CHECK(r.busy_us == std::vector<double>{6});
  CHECK(r.exposed_us == std::vector<double>{0});
  CHECK(r.exposed_comm_us == 0);
  REQUIRE(r.timeline.size() == 3);
  CHECK(r.timeline[1] == sim::interval{b, 0, 1, 3});
}

TEST_CASE("compute and a collective overlap, slowed by contention", "[sim][contention]") {
  SECTION("without contention both run at full speed from t=0") {
    mini m(1);
    const auto c = m.compute("gemm");
    const auto ar = m.collective("ar", 0);
    const auto r = sim::simulate(m.g, {{c}, {ar}}, std::vector<double>{10, 6});
    CHECK(r.end_us[0] == 10);
    CHECK(r.end_us[1] == 6);
    CHECK(r.step_us == 10);
    CHECK(r.exposed_comm_us == 0);
    CHECK(r.busy_us == std::vector<double>{10, 6});
  }
  SECTION("slowdown 1.5: 4 us of work in the first 6 us, the other 6 us alone, so compute ends at 12") {
    mini m(1);
    const auto c = m.compute("gemm");
    const auto ar = m.collective("ar", 0);
    const auto r = sim::simulate(m.g, {{c}, {ar}}, std::vector<double>{10, 6}, 1.5);
    CHECK(r.end_us[c] == Approx(12.0));
    CHECK(r.end_us[ar] == 6); // a plain number slows compute only
    CHECK(r.step_us == Approx(12.0));
    CHECK(r.busy_us[0] == Approx(12.0));
  }
  SECTION("a collective that starts mid-task slows only the overlapped part") {
    // a: 0-2. ar (after a) and b both start at 2; b does 6/1.5 = 4 us of its 10 by t=8, when
    // ar ends, then its last 6 us alone: ends at 14.
    mini m(1);
    const auto a = m.compute("a");
    const auto ar = m.collective("ar", 0, {a});
    const auto b = m.compute("b");
    const auto r = sim::simulate(m.g, {{a, b}, {ar}}, std::vector<double>{2, 6, 10}, 1.5);
    CHECK(r.start_us[b] == 2);
    CHECK(r.start_us[ar] == 2);
    CHECK(r.end_us[ar] == 8);
    CHECK(r.end_us[b] == Approx(14.0));
    CHECK(r.exposed_comm_us == 0);
  }
  SECTION("slowdowns on both sides: 1.5 for compute, 2 for the collective") {
    // Both run from 0: the all-reduce's 6 us take 12 at half rate; by then compute has done
    // 12/1.5 = 8 of its 10 us and ends alone at 14.
    mini m(1);
    const auto c = m.compute("gemm");
    const auto ar = m.collective("ar", 0);
    const auto r = sim::simulate(m.g, {{c}, {ar}}, std::vector<double>{10, 6}, sim::contention{1.5, 2.0});
    CHECK(r.end_us[ar] == Approx(12.0));
    CHECK(r.end_us[c] == Approx(14.0));
    CHECK(r.exposed_comm_us == 0);
    // A collective alone is not slowed: after the compute ends, it runs at full rate.
    mini m2(1);
    const auto c2 = m2.compute("gemm");
    const auto ar2 = m2.collective("ar", 0);
    const auto r2 = sim::simulate(m2.g, {{c2}, {ar2}}, std::vector<double>{3, 6}, sim::contention{1.5, 2.0});
    // compute ends at 4.5 (3 us at 1/1.5); the all-reduce did 4.5/2 = 2.25 us by then, 3.75 alone: ends at 8.25.
    CHECK(r2.end_us[c2] == Approx(4.5));
    CHECK(r2.end_us[ar2] == Approx(8.25));
    CHECK_THROWS_WITH(sim::simulate(m2.g, {{c2}, {ar2}}, std::vector<double>{3, 6}, sim::contention{1.0, 0.5}),
                      Catch::Matchers::ContainsSubstring("collectives' overlap slowdown"));
  }
  SECTION("a collective that outlasts the compute is exposed for the rest") {
    // compute 4 us at rate 1/2 ends at 8; the all-reduce runs until 10: 2 us exposed.
    mini m(1);
    const auto c = m.compute("gemm");
    const auto ar = m.collective("ar", 0);
    const auto r = sim::simulate(m.g, {{c}, {ar}}, std::vector<double>{4, 10}, 2.0);
    CHECK(r.end_us[c] == Approx(8.0));
    CHECK(r.end_us[ar] == 10);
    CHECK(r.exposed_comm_us == Approx(2.0));
    CHECK(r.exposed_us[1] == Approx(2.0));
    CHECK(r.exposed_us[0] == 0);
  }
}

TEST_CASE("exposed communication is comm time while compute is idle", "[sim][exposed]") {
  // c1 0-4, then ar 4-10 with nothing to overlap, then c2 10-13.
  mini m(1);
  const auto c1 = m.compute("c1");
  const auto ar = m.collective("ar", 0, {c1});
  const auto c2 = m.compute("c2", {ar});
  const auto r = sim::simulate(m.g, {{c1, c2}, {ar}}, std::vector<double>{4, 6, 3}, 1.5);
  CHECK(r.start_us == std::vector<double>{0, 4, 10});
  CHECK(r.end_us == std::vector<double>{4, 10, 13});
  CHECK(r.step_us == 13);
  CHECK(r.exposed_comm_us == 6);
  CHECK(r.exposed_us == std::vector<double>{0, 6});
  CHECK(r.busy_us == std::vector<double>{7, 6});
}

TEST_CASE("two lanes run in parallel and exposure is their union", "[sim][exposed]") {
  // dp 0-5 and tp 0-7 run at once; compute (2 us of work) runs at rate 1/2 throughout: 0-4.
  // Exposed: dp 4-5 (1 us), tp 4-7 (3 us), their union 4-7 (3 us, not 4).
  mini m(2);
  const auto c = m.compute("gemm");
  const auto dp = m.collective("dp.ar", 0);
  const auto tp = m.collective("tp.ag", 1);
  const auto r = sim::simulate(m.g, {{c}, {dp}, {tp}}, std::vector<double>{2, 5, 7}, 2.0);
  CHECK(r.start_us == std::vector<double>{0, 0, 0});
  CHECK(r.end_us[c] == Approx(4.0));
  CHECK(r.end_us[dp] == 5);
  CHECK(r.end_us[tp] == 7);
  CHECK(r.step_us == 7);
  CHECK(r.exposed_us[1] == Approx(1.0));
  CHECK(r.exposed_us[2] == Approx(3.0));
  CHECK(r.exposed_comm_us == Approx(3.0));
}

TEST_CASE("each stream follows its given order, not program order", "[sim]") {
  mini m(1);
  const auto a = m.compute("a");
  const auto b = m.compute("b");
  const auto ar = m.collective("ar", 0, {b});
  const std::vector<double> d{1, 2, 5};

  SECTION("b first lets the all-reduce start at 2") {
    const auto r = sim::simulate(m.g, {{b, a}, {ar}}, d);
    CHECK(r.start_us[b] == 0);
    CHECK(r.start_us[a] == 2);
    CHECK(r.start_us[ar] == 2);
    CHECK(r.step_us == 7);
    CHECK(r.exposed_comm_us == 4);
    REQUIRE(r.timeline.size() == 3);
    CHECK(r.timeline[0].task == b); // sorted by start, then stream
    CHECK(r.timeline[1].task == a);
    CHECK(r.timeline[2].task == ar);
  }
  SECTION("program order delays it by a") {
    const auto r = sim::simulate(m.g, {{a, b}, {ar}}, d);
    CHECK(r.start_us[ar] == 3);
    CHECK(r.step_us == 8);
    CHECK(r.exposed_comm_us == 5);
  }
}

TEST_CASE("zero-duration tasks take no time and still order their successors", "[sim]") {
  mini m(1);
  const auto a = m.compute("a");
  const auto z = m.collective("zero", 0, {a});
  const auto b = m.compute("b", {z});
  const auto r = sim::simulate(m.g, {{a, b}, {z}}, std::vector<double>{3, 0, 2}, 2.0);
  CHECK(r.start_us[z] == 3);
  CHECK(r.end_us[z] == 3);
  CHECK(r.start_us[b] == 3);
  CHECK(r.end_us[b] == 5); // a zero-length collective causes no contention
  CHECK(r.exposed_comm_us == 0);
  CHECK(r.busy_us[1] == 0);
}

TEST_CASE("a deadlock names each blocked stream's next task and what it waits for", "[sim][errors]") {
  // x needs the all-reduce, which needs y, which the compute order puts after x.
  mini m(1);
  const auto x = m.compute("x", {2});
  const auto y = m.compute("y");
  const auto ar = m.collective("ar", 0, {y});
  REQUIRE(ar == 2);
  const std::vector<double> d{1, 1, 1};
  CHECK_THROWS_WITH(sim::simulate(m.g, {{x, y}, {ar}}, d),
                    ContainsSubstring("deadlock") && ContainsSubstring("stream 'compute' waits at task 0 'x' for task 2 'ar'") &&
                        ContainsSubstring("stream 'comm:ax0' waits at task 2 'ar' for task 1 'y'"));
  CHECK_NOTHROW(sim::simulate(m.g, {{y, x}, {ar}}, d));

  SECTION("a dependency cycle is reported the same way, after what could run has run") {
    m.g.tasks[static_cast<std::size_t>(y)].deps = {x};
    CHECK_THROWS_WITH(sim::simulate(m.g, {{y, x}, {ar}}, d),
                      ContainsSubstring("deadlock") && ContainsSubstring("task 1 'y' for task 0 'x'"));
  }
}

TEST_CASE("malformed schedules are rejected with the task named", "[sim][errors]") {
  mini m(1);
  const auto a = m.compute("a");
  const auto b = m.compute("b", {a});
  const auto ar = m.collective("ar", 0, {b});
  const std::vector<double> d{1, 1, 1};

  SECTION("a task missing from its stream's order") {
    CHECK_THROWS_WITH(sim::simulate(m.g, {{a}, {ar}}, d),
                      ContainsSubstring("task 1 'b'") && ContainsSubstring("missing"));
  }
  SECTION("a missing stream counts as an empty order") {
    CHECK_THROWS_WITH(sim::simulate(m.g, {{a, b}}, d), ContainsSubstring("task 2 'ar'") && ContainsSubstring("missing"));
  }
  SECTION("a task listed twice") {
    CHECK_THROWS_WITH(sim::simulate(m.g, {{a, b, a}, {ar}}, d),
                      ContainsSubstring("task 0 'a'") && ContainsSubstring("twice"));
  }
  SECTION("a task in the order of a stream it does not run on") {
    CHECK_THROWS_WITH(sim::simulate(m.g, {{a, b, ar}, {}}, d),
                      ContainsSubstring("task 2 'ar' runs on stream 'comm:ax0'") &&
                          ContainsSubstring("order of stream 'compute'"));
  }
  SECTION("an id that is no task") {
    CHECK_THROWS_WITH(sim::simulate(m.g, {{a, b, 7}, {ar}}, d), ContainsSubstring("task id 7"));
  }
  SECTION("more orders than streams") {
    CHECK_THROWS_WITH(sim::simulate(m.g, {{a, b}, {ar}, {}}, d), ContainsSubstring("3 streams"));
  }
  SECTION("durations of the wrong count or sign") {
    CHECK_THROWS_WITH(sim::simulate(m.g, {{a, b}, {ar}}, std::vector<double>{1, 1}), ContainsSubstring("2 durations"));
    CHECK_THROWS_WITH(sim::simulate(m.g, {{a, b}, {ar}}, std::vector<double>{1, -1, 1}),
                      ContainsSubstring("task 1 'b'") && ContainsSubstring("duration"));
  }
  SECTION("a slowdown below 1") {
    CHECK_THROWS_WITH(sim::simulate(m.g, {{a, b}, {ar}}, d, 0.5), ContainsSubstring("overlap_slowdown"));
  }
}

TEST_CASE("to_plan records the simulated start and contended duration of every task", "[sim][plan]") {
  mini m(2); // the second lane has no task: its order may be left out
  const auto c = m.compute("gemm");
  const auto ar = m.collective("ar", 0);
  const auto c2 = m.compute("after", {ar});
  const std::vector<double> d{10, 6, 1};
  const order_t order{{c, c2}, {ar}};
  const auto p = sim::to_plan(m.g, order, d, 1.5, "program_order", "cpu");
  CHECK(p.policy == "program_order");
  CHECK(p.preset == "cpu");
  REQUIRE(p.order.size() == 3); // one order per stream, the empty lane padded
  CHECK(p.order[0] == order[0]);
  CHECK(p.order[1] == order[1]);
  CHECK(p.order[2].empty());
  CHECK(p.graph == m.g);
  CHECK(p.start_us == std::vector<double>{0, 0, 12});
  CHECK(p.duration_us[c] == Approx(12.0)); // contended, not the 10 given
  CHECK(p.duration_us[ar] == 6);
  const auto r = sim::simulate(p, d, 1.5);
  for (std::size_t i = 0; i < d.size(); ++i) {
    CHECK(p.start_us[i] == r.start_us[i]);
    CHECK(p.start_us[i] + p.duration_us[i] == Approx(r.end_us[i]));
  }
  CHECK(p.step_us() == Approx(r.step_us));
  CHECK(r.step_us == Approx(13.0));
  CHECK_THROWS_WITH(sim::to_plan(m.g, order, std::vector<double>{10, 6}, 1.5, "x", "y"), ContainsSubstring("durations"));
}

namespace {

struct random_case {
  ir::graph g;
  order_t order;
  std::vector<double> d;
};

/// A random DAG over `lanes` comm lanes, deps only to earlier ids, and per-stream orders taken
/// from a random topological order (so they never deadlock).
random_case make_random(std::mt19937& rng, int n, int lanes) {
  mini m(lanes);
  std::uniform_real_distribution<double> u(0, 1);
  for (int i = 0; i < n; ++i) {
    std::vector<ir::task_id> deps;
    for (int k = 0; k < 3 && i > 0; ++k)
      if (u(rng) < 0.6) {
        const auto lo = std::max(0, i - 12);
        const auto dep = static_cast<ir::task_id>(lo + static_cast<int>(u(rng) * (i - lo)));
        if (std::find(deps.begin(), deps.end(), dep) == deps.end()) deps.push_back(dep);
      }
    const int lane = static_cast<int>(u(rng) * (lanes + 2)) - 2; // about half compute
    std::string name = "t"; // appended: g++ 12 warns falsely (-Wrestrict) on "t" + std::to_string(i) here
    name += std::to_string(i);
    if (lane < 0) m.compute(name, deps);
    else m.collective(name, lane, deps);
  }
  random_case rc;
  rc.g = std::move(m.g);
  // Kahn's algorithm with a random pick among the ready tasks.
  const auto succ = rc.g.successors();
  std::vector<int> indeg(static_cast<std::size_t>(n));
  std::vector<ir::task_id> ready;
  for (const auto& t : rc.g.tasks) {
    indeg[static_cast<std::size_t>(t.id)] = static_cast<int>(t.deps.size());
    if (t.deps.empty()) ready.push_back(t.id);
  }
  rc.order.assign(rc.g.streams.size(), {});
  while (!ready.empty()) {
    const auto k = static_cast<std::size_t>(u(rng) * static_cast<double>(ready.size()));
    const auto t = ready[k];
    ready.erase(ready.begin() + static_cast<std::ptrdiff_t>(k));
    rc.order[static_cast<std::size_t>(rc.g.tasks[static_cast<std::size_t>(t)].stream)].push_back(t);
    for (auto s : succ[static_cast<std::size_t>(t)])
      if (--indeg[static_cast<std::size_t>(s)] == 0) ready.push_back(s);
  }
  for (int i = 0; i < n; ++i) rc.d.push_back(u(rng) < 0.1 ? 0.0 : std::floor(1 + u(rng) * 40));
  return rc;
}

} // namespace

TEST_CASE("random schedules: every task starts as soon as it can and does exactly its work", "[sim][property]") {
  std::mt19937 rng(20250301);
  for (int trial = 0; trial < 40; ++trial) {
    const int lanes = 1 + trial % 3;
    const double slowdown = trial % 2 ? 1.0 : 1.0 + 0.25 * (trial % 7);
    const auto rc = make_random(rng, 150, lanes);
    const auto& g = rc.g;
    const auto r = sim::simulate(g, rc.order, rc.d, slowdown);
    INFO("trial " << trial << " slowdown " << slowdown);

    std::vector<std::pair<double, double>> compute_spans, comm_spans;
    std::vector<std::vector<std::pair<double, double>>> lane_spans(g.streams.size());
    for (const auto& t : g.tasks) {
      const auto i = static_cast<std::size_t>(t.id);
      (g.streams[static_cast<std::size_t>(t.stream)].is_compute() ? compute_spans : comm_spans)
          .emplace_back(r.start_us[i], r.end_us[i]);
      lane_spans[static_cast<std::size_t>(t.stream)].emplace_back(r.start_us[i], r.end_us[i]);
    }

    double step = 0;
    for (std::size_t s = 0; s < rc.order.size(); ++s) {
      double busy = 0;
      for (std::size_t k = 0; k < rc.order[s].size(); ++k) {
        const auto id = static_cast<std::size_t>(rc.order[s][k]);
        const auto& t = g.tasks[id];
        // As soon as it can: exactly when its last blocker (stream predecessor or dep) ended.
        double ready = k > 0 ? r.end_us[static_cast<std::size_t>(rc.order[s][k - 1])] : 0.0;
        for (auto dep : t.deps) ready = std::max(ready, r.end_us[static_cast<std::size_t>(dep)]);
        REQUIRE(r.start_us[id] == ready);
        // Exactly its work: the overlap with running collectives costs (1 - 1/slowdown) of itself.
        const double ran = r.end_us[id] - r.start_us[id];
        if (g.streams[s].is_compute()) {
          std::vector<std::pair<double, double>> clipped;
          for (auto [a, b] : comm_spans)
            if (std::min(b, r.end_us[id]) > std::max(a, r.start_us[id]))
              clipped.emplace_back(std::max(a, r.start_us[id]), std::min(b, r.end_us[id]));
          const double overlapped = measure(clipped);
          REQUIRE(ran - overlapped + overlapped / slowdown == Approx(rc.d[id]).margin(1e-9));
        } else {
          REQUIRE(ran == Approx(rc.d[id]).margin(1e-9));
        }
        busy += ran;
        step = std::max(step, r.end_us[id]);
      }
      CHECK(r.busy_us[s] == Approx(busy).margin(1e-9));
      if (!g.streams[s].is_compute())
        CHECK(r.exposed_us[s] == Approx(measure_minus(lane_spans[s], compute_spans)).margin(1e-6));
      else
        CHECK(r.exposed_us[s] == 0);
    }
    CHECK(r.step_us == step);
    CHECK(r.exposed_comm_us == Approx(measure_minus(comm_spans, compute_spans)).margin(1e-6));

    REQUIRE(r.timeline.size() == g.size());
    for (std::size_t k = 0; k < r.timeline.size(); ++k) {
      const auto& iv = r.timeline[k];
      CHECK(iv.start_us == r.start_us[static_cast<std::size_t>(iv.task)]);
      CHECK(iv.end_us == r.end_us[static_cast<std::size_t>(iv.task)]);
      CHECK(iv.stream == g.tasks[static_cast<std::size_t>(iv.task)].stream);
      if (k > 0) CHECK(r.timeline[k - 1].start_us <= iv.start_us);
    }
  }
}

TEST_CASE("a 5000-task graph replays in one call and respects the lower bounds", "[sim][property]") {
  std::mt19937 rng(7);
  const auto rc = make_random(rng, 5000, 2);
  const auto r = sim::simulate(rc.g, rc.order, rc.d, 1.0);
  // Without contention the step is at least each stream's work and the critical path.
  std::vector<double> work(rc.g.streams.size(), 0.0), path(rc.g.size(), 0.0);
  for (const auto& t : rc.g.tasks) {
    const auto i = static_cast<std::size_t>(t.id);
    work[static_cast<std::size_t>(t.stream)] += rc.d[i];
    for (auto dep : t.deps) path[i] = std::max(path[i], path[static_cast<std::size_t>(dep)]);
    path[i] += rc.d[i];
  }
  const double bound = std::max(*std::max_element(work.begin(), work.end()), *std::max_element(path.begin(), path.end()));
  CHECK(r.step_us >= bound - 1e-9);
  CHECK(r.step_us <= std::accumulate(rc.d.begin(), rc.d.end(), 0.0) + 1e-9);
  CHECK(r.busy_us[0] == Approx(work[0]));
}
