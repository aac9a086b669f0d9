#include <concerto/ir/builder.hpp>
#include <concerto/plan/hash.hpp>
#include <concerto/plan/json.hpp>

#include <catch2/catch_test_macros.hpp>
#include <catch2/matchers/catch_matchers_string.hpp>

using namespace concerto;
using Catch::Matchers::ContainsSubstring;
using nlohmann::json;

namespace {

/// fc (compute) -> fc.ar (dp lane) and fc (compute) -> act (compute), with hand-made times.
plan::plan small_plan() {
  ir::builder b("mlp");
  b.cost_only(); // planned, not run
  const int dp = b.axis("dp", 4, ir::link_class::inter_node);
  const auto x = b.buffer("x", {4, 8}, ir::buffer_role::input);
  const auto w = b.buffer("w", {8, 8}, ir::buffer_role::param);
  const auto y = b.buffer("y", {4, 8});
  const auto g = b.buffer("w.grad", {8, 8}, ir::buffer_role::gradient);
  const auto z = b.buffer("z", {4, 8});
  b.matmul("fc", x, w, y, 4, 8, 8);                                    // 0
  b.matmul("fc.dw", x, y, g, 8, 8, 4, 1, true);                        // 1
  b.collective(ir::op_kind::all_reduce, "w.grad.ar", dp, g, g);        // 2
  b.compute(ir::op_kind::elementwise, "act", {y}, {z}, {.fn = ir::op::gelu, .flops = 0}); // 3
  plan::plan p;
  p.graph = std::move(b).finish();
  p.order = {{0, 1, 3}, {2}};
  p.start_us = {0.0, 2.5, 4.0, 4.0};
  p.duration_us = {2.5, 1.5, 3.25, 1.0};
  p.policy = "program_order";
  p.preset = "a800x32";
  p.stats = {0.125, 6.5, 3, 2};
  return p;
}

} // namespace

TEST_CASE("a plan survives a JSON round trip unchanged", "[plan][json]") {
  const auto p = small_plan();
  const auto doc = plan::to_json(p);
  SECTION("through the JSON value and through text") {
    CHECK(plan::plan_from_json(doc) == p);
    CHECK(plan::plan_from_json_text(doc.dump(1)) == p);
  }
  SECTION("the summary is readable without the library") {
    CHECK(doc["schema"] == "concerto.plan/1");
    CHECK(doc["step_us"] == 7.25);
    CHECK(doc["policy"] == "program_order");
    CHECK(doc["stats"]["windows_optimal"] == 2);
    const auto& ar = doc["tasks"][2];
    CHECK(ar["id"] == 2);
    CHECK(ar["name"] == "w.grad.ar");
    CHECK(ar["kind"] == "all_reduce");
    CHECK(ar["stream"] == "comm:dp");
    CHECK(ar["start_us"] == 4.0);
    CHECK(ar["duration_us"] == 3.25);
    CHECK(ar["deps"] == json::array({1}));
    CHECK(doc["streams"][0]["name"] == "compute");
    CHECK(doc["streams"][0]["order"] == json::array({0, 1, 3}));
    CHECK(doc["graph"]["schema"] == "concerto.graph/1");
  }
  SECTION("streams may be listed in any order when named") {
    auto swapped = doc;
    std::swap(swapped["streams"][0], swapped["streams"][1]);
    CHECK(plan::plan_from_json(swapped) == p);
  }
}

TEST_CASE("malformed plan documents are rejected with a message", "[plan][json][errors]") {
  auto doc = plan::to_json(small_plan());
  SECTION("no graph") {
    doc.erase("graph");
    CHECK_THROWS_WITH(plan::plan_from_json(doc), ContainsSubstring("field 'graph' is required"));
  }
  SECTION("a bad graph inside names its task") {
    doc["graph"]["tasks"][3]["kind"] = "gelu";
    CHECK_THROWS_WITH(plan::plan_from_json(doc), ContainsSubstring("task 3 'act'") && ContainsSubstring("unknown kind"));
  }
  SECTION("a task without times") {
    doc["tasks"][1].erase("start_us");
    CHECK_THROWS_WITH(plan::plan_from_json(doc), ContainsSubstring("task 1 'fc.dw': field 'start_us' is required"));
    doc["tasks"][1]["start_us"] = "soon";
    CHECK_THROWS_WITH(plan::plan_from_json(doc), ContainsSubstring("task 1 'fc.dw': field 'start_us' must be a number"));
  }
  SECTION("a summary that disagrees with the graph") {
    doc["tasks"][3]["deps"] = json::array({1});
    CHECK_THROWS_WITH(plan::plan_from_json(doc), ContainsSubstring("task 3 'act'") && ContainsSubstring("'deps' differ"));
  }
  SECTION("a task listed twice in the summary") {
    doc["tasks"][3]["id"] = 2;
    CHECK_THROWS_WITH(plan::plan_from_json(doc), ContainsSubstring("task 2 is listed twice"));
  }
  SECTION("an order naming a task that does not exist") {
    doc["streams"][0]["order"] = json::array({0, 1, 9});
    CHECK_THROWS_WITH(plan::plan_from_json(doc), ContainsSubstring("stream 'compute'") && ContainsSubstring("task 9"));
  }
  SECTION("an unknown stream") {
    doc["streams"][1]["name"] = "comm:tp";
    CHECK_THROWS_WITH(plan::plan_from_json(doc), ContainsSubstring("stream 'comm:tp', which does not exist"));
  }
  SECTION("syntax errors") {
    CHECK_THROWS_WITH(plan::plan_from_json_text("{\"graph\": nul}"), ContainsSubstring("plan JSON: syntax error") &&
                                                                         ContainsSubstring("line 1"));
  }
}

TEST_CASE("the plan hash covers what executors act on, not predicted times", "[plan][hash]") {
  const auto p = small_plan();
  const auto hex = plan::hash_hex(p);
  REQUIRE(hex.size() == 16);

  SECTION("the same plan gives the same hash, also after a JSON round trip") {
    CHECK(plan::hash_hex(small_plan()) == hex);
    CHECK(plan::hash_hex(plan::plan_from_json_text(plan::to_json(p).dump())) == hex);
  }
  SECTION("the value is fixed across machines and builds") {
    // Recorded once; a change means every cached plan and every rank comparison changes too
    // (last changed when tasks' fns became op-table entries and graphs gained cost_only).
    CHECK(hex == "1ad2a556c004e6ac");
  }
  SECTION("times, stats, policy and preset do not change it") {
    auto q = p;
    q.start_us[3] += 1e-9;
    q.duration_us[2] *= 1.0000001;
    q.stats.plan_seconds = 99;
    q.policy = "concerto";
    q.preset = "h100x64";
    CHECK(plan::hash_hex(q) == hex);
  }
  SECTION("a reordered stream changes it") {
    auto q = p;
    std::swap(q.order[0][1], q.order[0][2]);
    CHECK(plan::hash_hex(q) != hex);
  }
  SECTION("any executed field of the graph changes it") {
    auto a = p, b = p, c = p, d = p;
    a.graph.tasks[2].bytes += 1;
    b.graph.tasks[0].attrs["m"] = 5;
    c.graph.buffers[1].offset = 0, c.graph.buffers[1].shape = {64};
    d.graph.axes[0].size = 8;
    for (const auto* q : {&a, &b, &c, &d}) CHECK(plan::hash_hex(*q) != hex);
    CHECK(plan::hash(a.graph) != plan::hash(p.graph));
    CHECK(plan::hash(p.graph) != plan::hash(p)); // plans and graphs live in separate hash domains
  }
}
