// The framework baselines (planner/frameworks.hpp): their buckets, which collectives block the
// compute stream, and how far parameter all-gathers run ahead, on hand-built graphs whose answer
// can be read off; then both as make_plan policies on the benchmark workloads.
#include <concerto/ir/builder.hpp>
#include <concerto/ir/workloads.hpp>
#include <concerto/planner/frameworks.hpp>
#include <concerto/planner/make_plan.hpp>
#include <concerto/sim/simulate.hpp>

#include <catch2/catch_test_macros.hpp>
#include <catch2/matchers/catch_matchers_string.hpp>

#include <algorithm>
#include <string>
#include <vector>

using namespace concerto;
using Catch::Matchers::ContainsSubstring;

namespace {

const cost::model& model() {
  static const auto m = cost::model::preset("a800x32");
  return m;
}

// Appended, not "w" + std::to_string(i): g++ 12 warns falsely (-Wrestrict) on the latter.
std::string numbered(std::string prefix, std::size_t i) { return prefix.append(std::to_string(i)); }

bool depends(const ir::graph& g, const std::string& task, const std::string& on) {
  const auto find = [&](const std::string& name) {
    for (const auto& t : g.tasks)
      if (t.name == name) return t.id;
    FAIL("no task '" << name << "'");
    return ir::task_id{-1};
  };
  const auto& deps = g[find(task)].deps;
  return std::find(deps.begin(), deps.end(), find(on)) != deps.end();
}

std::size_t count_named(const ir::graph& g, const std::string& part) {
  return static_cast<std::size_t>(std::count_if(g.tasks.begin(), g.tasks.end(), [&](const ir::task& t) {
    return t.name.find(part) != std::string::npos;
  }));
}

/// Forward: x -> fc1 (tp all-reduce of its output) -> fc2; backward: four gradients of
/// 1000, 1000, 3000 and 1000 floats, each all-reduced over dp as it is ready, with a compute
/// task between them; then a compute task that reads no gradient ("tail").
ir::graph data_and_tensor_parallel() {
  ir::builder b("dp-tp");
  b.cost_only();
  const int dp = b.axis("dp", 4, ir::link_class::inter_node);
  const int tp = b.axis("tp", 2, ir::link_class::intra_node);
  const auto x = b.buffer("x", {1000}, ir::buffer_role::input);
  const auto h = b.buffer("h", {1000});
  const auto y = b.buffer("y", {1000});
  b.compute(ir::op::gelu, "fc1", {x}, {h});
  b.collective(ir::op_kind::all_reduce, "h.ar.tp", tp, h, h);
  b.compute(ir::op::gelu, "fc2", {h}, {y});
  b.at(ir::phase::backward);
  const std::vector<std::int64_t> sizes{1000, 1000, 3000, 1000};
  for (std::size_t i = 0; i < sizes.size(); ++i) {
    const auto name = numbered("w", static_cast<std::size_t>(i));
    const auto grad = b.buffer(name + ".grad", {sizes[i]}, ir::buffer_role::gradient);
    b.compute(ir::op::gelu, name + ".dw", {y}, {grad});
    b.collective(ir::op_kind::all_reduce, name + ".grad.ar", dp, grad, grad);
  }
  const auto z = b.buffer("z", {1000});
  b.compute(ir::op::gelu, "tail", {y}, {z});
  return std::move(b).finish();
}

/// ZeRO-3 style: four parameters of 100 floats, each gathered over dp right before its use.
ir::graph gathered_parameters() {
  ir::builder b("zero3");
  b.cost_only();
  const int dp = b.axis("dp", 4, ir::link_class::inter_node);
  auto act = b.buffer("x", {100}, ir::buffer_role::input);
  for (int i = 0; i < 4; ++i) {
    const auto name = numbered("w", static_cast<std::size_t>(i));
    const auto shard = b.buffer(name, {25}, ir::buffer_role::param);
    const auto full = b.buffer(name + ".full", {100});
    const auto out = b.buffer(numbered("a", static_cast<std::size_t>(i)), {100});
    b.collective(ir::op_kind::all_gather, name + ".ag", dp, shard, full);
    b.compute(ir::op_kind::elementwise, numbered("layer", static_cast<std::size_t>(i)), {act, full}, {out}, {.fn = ir::op::add});
    act = out;
  }
  return std::move(b).finish();
}

} // namespace

TEST_CASE("a framework's gradient buckets have its size, per mesh axis", "[frameworks]") {
  const auto g = data_and_tensor_parallel();
  SECTION("buckets of 2000 elements: w0+w1, then w2 alone (3000), w3 alone") {
    const auto s = planner::framework_schedule({.name = "test", .bucket_min_elements = 2000}, g, model());
    CHECK(count_named(s.graph, "grad.bucket") == 1); // w0 and w1
    CHECK(count_named(s.graph, ".grad.ar") == 2);
    CHECK(count_named(s.graph, "w2.grad.ar") == 1);
    CHECK(count_named(s.graph, "w3.grad.ar") == 1);
  }
  SECTION("Megatron's 40M-parameter buckets hold every gradient of this small graph") {
    const auto s = planner::framework_schedule(planner::megatron(), g, model());
    CHECK(count_named(s.graph, "grad.bucket") == 1);
    CHECK(count_named(s.graph, ".grad.ar") == 0);
  }
  SECTION("the size per rank grows with the axis: max(min, per rank x ranks)") {
    // dp has 4 ranks: 4 x 500 = 2000 elements, as in the first section.
    const auto s = planner::framework_schedule({.name = "test", .bucket_min_elements = 10, .bucket_elements_per_rank = 500}, g, model());
    CHECK(count_named(s.graph, "grad.bucket") == 1);
    CHECK(count_named(s.graph, ".grad.ar") == 2);
  }
}

TEST_CASE("collectives a framework does not overlap block the compute stream", "[frameworks]") {
  const auto g = data_and_tensor_parallel();
  SECTION("the tensor-parallel all-reduce: after fc1, and fc2 waits for it") {
    const auto s = planner::framework_schedule(planner::megatron(), g, model());
    CHECK(depends(s.graph, "h.ar.tp", "fc1"));
    CHECK(depends(s.graph, "fc2", "h.ar.tp"));
  }
  SECTION("overlapped gradient reductions hold no compute task back") {
    const auto s = planner::framework_schedule({.name = "test", .bucket_min_elements = 1}, g, model());
    CHECK_FALSE(depends(s.graph, "w1.dw", "w0.grad.ar"));
    CHECK_FALSE(depends(s.graph, "tail", "w3.grad.ar"));
  }
  SECTION("gradient reductions that do not overlap: the next compute waits for each") {
    const auto s = planner::framework_schedule({.name = "test", .bucket_min_elements = 1, .gradients_overlap = false}, g, model());
    CHECK(depends(s.graph, "w1.dw", "w0.grad.ar"));
    CHECK(depends(s.graph, "tail", "w3.grad.ar"));
  }
  SECTION("DeepSpeed overlaps gradient reductions at stage 3 only (overlap_comm's default), read from the graph") {
    const auto below3 = planner::framework_schedule(planner::policy::deepspeed, g, model()); // no parameter all-gathers
    REQUIRE(count_named(below3.graph, ".grad.ar") == 0);             // 5e8 elements: one bucket of all four
    CHECK(depends(below3.graph, "tail", "grad.bucket0.ar"));
    const auto megatron = planner::framework_schedule(planner::policy::megatron, g, model());
    CHECK_FALSE(depends(megatron.graph, "tail", "grad.bucket0.ar"));
    CHECK(planner::deepspeed(true).gradients_overlap);
  }
  SECTION("ZeRO-2's gathers of the updated shards do not make it stage 3; ZeRO-3's gathers for use do") {
    CHECK_FALSE(planner::framework_of(planner::policy::deepspeed, ir::make_workload("vit-zero2", {.layers = 1})).gradients_overlap);
    CHECK(planner::framework_of(planner::policy::deepspeed, ir::make_workload("gpt-zero3", {.layers = 1})).gradients_overlap);
  }
}

TEST_CASE("parameter all-gathers run ahead of their use by the framework's prefetch", "[frameworks]") {
  const auto g = gathered_parameters();
  SECTION("Megatron: one ahead - gather k+1 waits until the compute reaches layer k") {
    const auto s = planner::framework_schedule(planner::megatron(), g, model());
    CHECK(depends(s.graph, "w2.ag", "layer0"));
    CHECK(depends(s.graph, "w3.ag", "layer1"));
    CHECK_FALSE(depends(s.graph, "w1.ag", "layer0")); // layer0 is w0's use: nothing runs before it
  }
  SECTION("a prefetch of 200 elements lets two gathers run ahead") {
    const auto s = planner::framework_schedule({.name = "test", .prefetch_elements = 200}, g, model());
    CHECK(depends(s.graph, "w3.ag", "layer0"));
    CHECK_FALSE(depends(s.graph, "w3.ag", "layer1"));
    CHECK_FALSE(depends(s.graph, "w2.ag", "layer0"));
  }
  SECTION("the gathers' edges keep the graph acyclic and the plan valid") {
    const auto p = planner::make_plan(g, cost::model::preset("a800x32"), {.policy = planner::policy::megatron});
    CHECK(p.policy == "megatron");
  }
}

TEST_CASE("megatron_tp_overlap splits each tensor-parallel collective into one chunk per rank, and overlaps the chunks", "[frameworks]") {
  const auto g = ir::make_workload("llama-tp-sp", {.layers = 1, .ranks = 32, .ranks_per_node = 8});
  const auto chunked = [](const ir::graph& graph) {
    std::size_t n = 0;
    for (const auto& t : graph.tasks) n += ir::is_collective(t.kind) && t.attr("chunks") == 8;
    return n;
  };
  const auto plain = planner::framework_schedule(planner::policy::megatron, g, model());
  const auto split = planner::framework_schedule(planner::policy::megatron_tp_overlap, g, model());
  CHECK(chunked(plain.graph) == 0);
  CHECK(chunked(split.graph) >= 8); // at least one collective of the layer, in 8 chunks
  const auto m = cost::model::preset("a800x32");
  const auto plain_plan = planner::make_plan(g, m, {.policy = planner::policy::megatron});
  const auto split_plan = planner::make_plan(g, m, {.policy = planner::policy::megatron_tp_overlap});
  CHECK(split_plan.policy == "megatron_tp_overlap");
  CHECK(split_plan.step_us() != plain_plan.step_us());
}

TEST_CASE("megatron and deepspeed plan every benchmark workload; concerto is never slower in simulation", "[frameworks][workloads]") {
  const auto model = cost::model::preset("a800x32");
  for (const auto& name : ir::workload_names()) {
    const auto g = ir::make_workload(name, {.layers = 1, .ranks = 32, .ranks_per_node = 8});
    planner::plan_options concerto;
    concerto.solver.time_budget_s = 5;
    concerto.solver.progress = false;
    const auto ours = planner::make_plan(g, model, concerto);
    for (const auto policy : planner::policies_of(planner::policy_family::framework)) {
      const auto theirs = planner::make_plan(g, model, {.policy = policy});
      CAPTURE(name, planner::to_string(policy), theirs.step_us(), ours.step_us());
      CHECK(theirs.policy == planner::to_string(policy));
      CHECK(ours.step_us() <= theirs.step_us() * (1 + 1e-9));
    }
  }
}

TEST_CASE("a policy that is not a framework's is refused by name", "[frameworks]") {
  CHECK_THROWS_WITH(planner::framework_schedule(planner::policy::xla_lhs, data_and_tensor_parallel(), model()),
                    ContainsSubstring("'xla_lhs' is not a framework policy"));
}
