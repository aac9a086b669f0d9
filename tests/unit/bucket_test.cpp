#include "stderr_of.hpp"

#include <concerto/ir/builder.hpp>
#include <concerto/ir/workloads.hpp>
#include <concerto/plan/verify.hpp>
#include <concerto/planner/bucket.hpp>

#include <catch2/catch_approx.hpp>
#include <catch2/catch_test_macros.hpp>
#include <catch2/matchers/catch_matchers_string.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <unistd.h>
#include <string>
#include <vector>

using namespace concerto;
using Catch::Matchers::ContainsSubstring;

namespace {

ir::task_id find(const ir::graph& g, const std::string& name) {
  for (const auto& t : g.tasks)
    if (t.name == name) return t.id;
  FAIL("no task named " << name);
  return -1;
}

std::string named(std::string prefix, int i) {
  prefix += std::to_string(i);
  return prefix;
}

// Backward of a data-parallel step: one large gradient early (its all-reduce can hide under
// the long compute that follows), then six tiny ones at the very end, each all-reduced as it
// is ready; the optimizer reads all of them.
ir::graph dp_graph() {
  ir::builder b("dp-backward");
  b.cost_only(); // planned, not run
  const int dp = b.axis("dp", 4);
  constexpr std::int64_t n = 4096;
  b.at(ir::phase::backward);
  const auto x = b.buffer("x", {n, n}, ir::buffer_role::input, ir::dtype::bf16);
  const auto dy = b.buffer("dy", {n, n}, ir::buffer_role::input, ir::dtype::bf16);
  const auto big = b.buffer("big.grad", {n, n}, ir::buffer_role::gradient, ir::dtype::bf16);
  b.matmul("big.wgrad", x, dy, big, n, n, n, 1, true);
  b.collective(ir::op_kind::all_reduce, "big.grad.ar", dp, big, big);
  auto h = dy;
  for (int i = 0; i < 3; ++i) {
    const auto next = b.buffer(named("h", i), {n, n}, ir::buffer_role::activation, ir::dtype::bf16);
    b.matmul(named("chain", i), h, x, next, n, n, n);
    h = next;
  }
  std::vector<ir::buffer_id> grads{big};
  for (int i = 0; i < 6; ++i) {
    const auto gi = b.buffer(named("small.grad", i), {256}, ir::buffer_role::gradient, ir::dtype::bf16);
    b.compute(ir::op_kind::elementwise, named("small.wgrad", i), {h}, {gi}, {ir::op::bias_grad, 256.0 * 4096, -1, {}});
    b.collective(ir::op_kind::all_reduce, named("small.grad.ar", i), dp, gi, gi);
    grads.push_back(gi);
  }
  b.at(ir::phase::optimizer);
  for (std::size_t i = 0; i < grads.size(); ++i)
    b.compute(ir::op_kind::optimizer_update, named("sgd", static_cast<int>(i)), {grads[i]}, {}, {ir::op::sgd, 1, -1, {}});
  return std::move(b).finish();
}

} // namespace

TEST_CASE("apply_buckets fuses all-reduces over a flat buffer whose views are the gradients", "[bucket][apply]") {
  const auto g = dp_graph();
  std::vector<ir::task_id> smalls;
  for (int i = 0; i < 6; ++i) smalls.push_back(find(g, named("small.grad.ar", i)));
  const auto fused = planner::apply_buckets(g, {{{smalls[2], smalls[0], smalls[1]}, {smalls[4], smalls[5]}}});
  REQUIRE_NOTHROW(fused.validate());

  SECTION("each bucket is one all-reduce over a new root, placed where its last member was") {
    CHECK(fused.tasks.size() == g.tasks.size() - 3);
    const auto& b0 = fused[find(fused, "grad.bucket0.ar")];
    CHECK(b0.bytes == Catch::Approx(3 * g[smalls[0]].bytes));
    CHECK(b0.reads == std::vector<ir::buffer_id>{0});
    CHECK(b0.writes == b0.reads);
    CHECK(fused.buffers[0].role == ir::buffer_role::gradient);
    CHECK(fused.buffers[0].bytes == 3 * 256 * 2);
    CHECK(fused.buffers[1].bytes == 2 * 256 * 2);
    // small.grad.ar3 is untouched and between the two buckets.
    CHECK(find(fused, "grad.bucket0.ar") < find(fused, "small.grad.ar3"));
    CHECK(find(fused, "small.grad.ar3") < find(fused, "grad.bucket1.ar"));
  }
  SECTION("members become back-to-back views in program order, so the kernels write into the bucket") {
    for (int i = 0; i < 3; ++i) {
      const auto& v = fused.buffers[static_cast<std::size_t>(fused[find(fused, named("small.wgrad", i))].writes[0])];
      CHECK(v.name == named("small.grad", i));
      CHECK(v.view_of == 0);
      CHECK(v.offset == i * 512);
    }
  }
  SECTION("the fused all-reduce waits for every member's producer and the optimizer waits for it") {
    const auto ar = find(fused, "grad.bucket0.ar");
    const auto& deps = fused[ar].deps;
    for (int i = 0; i < 3; ++i)
      CHECK(std::find(deps.begin(), deps.end(), find(fused, named("small.wgrad", i))) != deps.end());
    const auto& sgd1 = fused[find(fused, "sgd2")].deps; // reads small.grad1
    CHECK(std::find(sgd1.begin(), sgd1.end(), ar) != sgd1.end());
  }
  SECTION("persistent memory is unchanged: a bucket costs no copy") {
    const auto model = cost::model::preset("a800x32");
    CHECK(plan::peak_memory(planner::list_plan(fused, model)).persistent_bytes ==
          plan::peak_memory(planner::list_plan(g, model)).persistent_bytes);
  }
}

TEST_CASE("apply_buckets rejects buckets that would change the program", "[bucket][errors]") {
  const auto g = dp_graph();
  SECTION("a task that is not a gradient all-reduce") {
    CHECK_THROWS_WITH(planner::apply_buckets(g, {{{find(g, "small.grad.ar0"), find(g, "chain0")}}}),
                      ContainsSubstring("'chain0'") && ContainsSubstring("not a backward all_reduce"));
  }
  SECTION("a gradient read before the bucket's all-reduce would run") {
    ir::builder b("reader");
    b.cost_only(); // planned, not run
    const int dp = b.axis("dp", 4);
    b.at(ir::phase::backward);
    const auto g0 = b.buffer("g0", {64}, ir::buffer_role::gradient);
    const auto g1 = b.buffer("g1", {64}, ir::buffer_role::gradient);
    const auto tmp = b.buffer("tmp", {64});
    b.compute(ir::op_kind::elementwise, "w0", {}, {g0}, {ir::op::zero, 64, -1, {}});
    b.collective(ir::op_kind::all_reduce, "g0.ar", dp, g0, g0);
    b.compute(ir::op_kind::elementwise, "peek", {g0}, {tmp}, {ir::op::scale, 64, -1, {}});
    b.compute(ir::op_kind::elementwise, "w1", {}, {g1}, {ir::op::zero, 64, -1, {}});
    b.collective(ir::op_kind::all_reduce, "g1.ar", dp, g1, g1);
    const auto h = std::move(b).finish();
    CHECK_THROWS_WITH(planner::apply_buckets(h, {{{find(h, "g0.ar"), find(h, "g1.ar")}}}),
                      ContainsSubstring("'peek'") && ContainsSubstring("'g0'"));
  }
}

TEST_CASE("choose_buckets fuses small gradients and keeps a large hidden one alone", "[bucket][search]") {
  const auto g = dp_graph();
  const auto model = cost::model::preset("a800x32");
  const auto judge = planner::simulated_step(model);
  const auto b = planner::choose_buckets(g, model);

  SECTION("the six tiny all-reduces, latency-bound at the end of the step, become one bucket") {
    REQUIRE(b.buckets.size() == 1);
    std::vector<ir::task_id> smalls;
    for (int i = 0; i < 6; ++i) smalls.push_back(find(g, named("small.grad.ar", i)));
    CHECK(b.buckets[0] == smalls);
  }
  SECTION("the bucketed step is shorter than the unbucketed one") {
    CHECK(judge(planner::apply_buckets(g, b)) < judge(g));
  }
  SECTION("fusing the large gradient too would be slower") {
    auto with_big = b;
    with_big.buckets[0].insert(with_big.buckets[0].begin(), find(g, "big.grad.ar"));
    CHECK(judge(planner::apply_buckets(g, with_big)) > judge(planner::apply_buckets(g, b)));
  }
  SECTION("under a memory cap at the unbucketed peak, the same buckets are chosen and fit") {
    const auto cap = plan::peak_memory(planner::list_plan(g, model)).peak_bytes;
    const auto capped = planner::choose_buckets(g, model, planner::simulated_step(model, cap));
    CHECK(capped == b);
    const auto p = planner::list_plan(planner::apply_buckets(g, capped), model);
    REQUIRE_NOTHROW(plan::verify(p, {.memory_cap_bytes = cap}));
  }
  SECTION("on a data-parallel transformer the chosen buckets give a valid, faster plan") {
    const auto w = ir::make_workload("gpt-dp", {.layers = 2});
    const auto wb = planner::choose_buckets(w, model);
    REQUIRE(!wb.buckets.empty());
    const auto fused = planner::apply_buckets(w, wb);
    CHECK(judge(fused) < judge(w));
    REQUIRE_NOTHROW(plan::verify(planner::list_plan(fused, model)));
  }
}

using unit_testing::stderr_of;

TEST_CASE("choose_buckets reports progress on stderr once it runs long, unless silenced", "[bucket][progress]") {
  const auto model = cost::model::preset("h100x64");
  const auto g = ir::make_workload("gpt-dp", {.layers = 2, .ranks = 8});
  const auto judge = planner::simulated_step(model);
  const auto quiet = planner::choose_buckets(g, model, judge, {.progress = false});
  SECTION("past the quiet time it prints how many bucketings were judged, and the same buckets come out") {
    planner::bucketing loud;
    const auto err = stderr_of([&] { loud = planner::choose_buckets(g, model, judge, {.progress_after_s = 0}); });
    CHECK_THAT(err, ContainsSubstring("concerto: bucketing 'gpt-dp'") && ContainsSubstring("bucketings judged") &&
                        ContainsSubstring("done:"));
    CHECK(loud == quiet);
  }
  SECTION("with progress off, or within the quiet time, it prints nothing") {
    CHECK(stderr_of([&] { (void)planner::choose_buckets(g, model, judge, {.progress = false, .progress_after_s = 0}); })
              .empty());
    CHECK(stderr_of([&] { (void)planner::choose_buckets(g, model, judge); }).empty());
  }
}

TEST_CASE("choose_buckets stops at its deadline with the best found so far", "[bucket][budget]") {
  const auto g = dp_graph();
  const auto model = cost::model::preset("a800x32");
  const auto passed = std::chrono::steady_clock::now();
  CHECK(planner::choose_buckets(g, model, {}, {.deadline = passed}).buckets.empty());
  const auto far = passed + std::chrono::hours(1);
  CHECK(planner::choose_buckets(g, model, {}, {.deadline = far}) == planner::choose_buckets(g, model));
}

TEST_CASE("candidates judged on every core: each index once, the first error passed on", "[bucket][parallel]") {
  std::vector<int> seen(100, 0);
  planner::detail::for_each_index(seen.size(), [&](std::size_t i) { ++seen[i]; });
  CHECK(std::all_of(seen.begin(), seen.end(), [](int n) { return n == 1; }));
  CHECK_THROWS_WITH(planner::detail::for_each_index(8,
                                                    [](std::size_t i) {
                                                      if (i == 3) concerto::fail("candidate 3 is broken");
                                                    }),
                    ContainsSubstring("candidate 3 is broken"));
}
