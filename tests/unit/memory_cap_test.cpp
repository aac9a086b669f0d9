#include <concerto/ir/builder.hpp>
#include <concerto/ir/workloads.hpp>
#include <concerto/plan/verify.hpp>
#include <concerto/planner/memory_cap.hpp>

#include <catch2/catch_approx.hpp>
#include <catch2/catch_test_macros.hpp>
#include <catch2/matchers/catch_matchers_string.hpp>

#include <algorithm>
#include <string>
#include <vector>

using namespace concerto;
using Catch::Matchers::ContainsSubstring;

namespace {

ir::graph zero3() { return ir::make_workload("gpt-zero3", {.layers = 3, .ranks = 8, .ranks_per_node = 8}); }

bool depends(const ir::graph& g, ir::task_id after, ir::task_id before) {
  const auto& d = g[after].deps;
  return std::find(d.begin(), d.end(), before) != d.end();
}

} // namespace

TEST_CASE("prefetch units group the parameter all-gathers of one layer and phase", "[memory_cap][prefetch]") {
  const auto g = zero3();
  const auto units = planner::prefetch_units(g);
  // Forward: embedding, 3 blocks, head; backward: head, 3 blocks.
  REQUIRE(units.size() == 9);
  for (const auto& u : units) {
    REQUIRE(!u.gathers.empty());
    REQUIRE(!u.frees.empty());
    for (auto id : u.gathers) {
      CHECK(g[id].kind == ir::op_kind::all_gather);
      CHECK(g[id].layer == g[u.gathers.front()].layer);
      CHECK(g[id].step_phase == g[u.gathers.front()].step_phase);
    }
  }
  CHECK(g[units[1].gathers.front()].layer == 0);
  CHECK(g[units[1].gathers.front()].step_phase == ir::phase::forward);
  CHECK(g[units[8].gathers.front()].layer == 0);
  CHECK(g[units[8].gathers.front()].step_phase == ir::phase::backward);
}

TEST_CASE("limit_prefetch makes a gather wait for the frees of the unit depth+1 before it", "[memory_cap][prefetch]") {
  const auto g = zero3();
  const auto units = planner::prefetch_units(g);

  SECTION("depth 1: unit i waits for unit i-2's last users, not unit i-1's") {
    const auto limited = planner::limit_prefetch(g, 1);
    REQUIRE_NOTHROW(limited.validate());
    for (std::size_t i = 2; i < units.size(); ++i)
      for (auto gather : units[i].gathers) {
        for (auto free : units[i - 2].frees) CHECK(depends(limited, gather, free));
        for (auto free : units[i - 1].frees) CHECK(!depends(limited, gather, free));
      }
    for (auto gather : units[1].gathers) CHECK(limited[gather].deps == g[gather].deps);
  }
  SECTION("a negative depth or one past the last unit adds no edge") {
    CHECK(planner::limit_prefetch(g, -1) == g);
    CHECK(planner::limit_prefetch(g, static_cast<int>(units.size()) - 1) == g);
  }
}

TEST_CASE("limit_memory keeps the plan's peak under the cap at the best step it can", "[memory_cap][limit]") {
  const auto g = zero3();
  const auto model = cost::model::preset("h100x64");
  const auto free_plan = planner::list_plan(g, model);
  const auto free_peak = plan::peak_memory(free_plan).peak_bytes;
  const auto tightest = planner::list_plan(planner::limit_prefetch(g, 0), model);
  const auto tight_peak = plan::peak_memory(tightest).peak_bytes;
  REQUIRE(tight_peak < free_peak); // unlimited prefetch costs memory on this workload

  SECTION("a cap at the unlimited peak changes nothing of the step") {
    const auto r = planner::limit_memory(g, model, free_peak);
    CHECK(r.step_us == Catch::Approx(free_plan.step_us()).epsilon(1e-12));
    CHECK(r.peak_bytes <= free_peak);
  }
  SECTION("a cap between the two gives a plan under it, verified against it") {
    const auto cap = (tight_peak + free_peak) / 2;
    const auto r = planner::limit_memory(g, model, cap);
    CHECK(r.peak_bytes <= cap);
    CHECK(r.prefetch_depth >= 0);
    const auto p = planner::list_plan(r.graph, model);
    CHECK(p.step_us() == r.step_us);
    REQUIRE_NOTHROW(plan::verify(p, {.memory_cap_bytes = cap}));
    CHECK(!plan::check(free_plan, {.memory_cap_bytes = cap}).empty()); // the unlimited plan is rejected
  }
  SECTION("the tightest feasible cap gives less overlap, a longer step, and still a valid plan") {
    const auto loose = planner::limit_memory(g, model, free_peak);
    const auto tight = planner::limit_memory(g, model, tight_peak);
    CHECK(tight.peak_bytes <= tight_peak);
    CHECK(tight.prefetch_depth == 0);
    CHECK(tight.step_us > loose.step_us);
    REQUIRE_NOTHROW(plan::verify(planner::list_plan(tight.graph, model), {.memory_cap_bytes = tight_peak}));
  }
  SECTION("a cap below every depth's peak is an error that names the cap and the best peak") {
    CHECK_THROWS_WITH(planner::limit_memory(g, model, tight_peak - 1),
                      ContainsSubstring(std::to_string(tight_peak - 1)) &&
                          ContainsSubstring(std::to_string(tight_peak)) && ContainsSubstring("gpt-zero3"));
  }
}
