#include "stderr_of.hpp"

#include <concerto/ir/builder.hpp>
#include <concerto/ir/workloads.hpp>
#include <concerto/plan/verify.hpp>
#include <concerto/planner/decompose.hpp>

#include <catch2/catch_approx.hpp>
#include <catch2/catch_test_macros.hpp>
#include <catch2/generators/catch_generators.hpp>
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

constexpr std::int64_t tok = 16384, hid = 4096, out_n = 4096;

ir::task_id find(const ir::graph& g, const std::string& name) {
  for (const auto& t : g.tasks)
    if (t.name == name) return t.id;
  FAIL("no task named " << name);
  return -1;
}

std::vector<const ir::task*> named_prefix(const ir::graph& g, const std::string& prefix) {
  std::vector<const ir::task*> out;
  for (const auto& t : g.tasks)
    if (t.name.rfind(prefix, 0) == 0) out.push_back(&t);
  return out;
}

// all_gather of a sequence-parallel activation feeding a column-parallel matmul (Megatron-SP).
// With `hidden`, an independent matmul comes first, so the gather runs under it.
ir::graph gather_graph(bool hidden) {
  ir::builder b("tp-gather");
  b.cost_only(); // planned, not run
  const int tp = b.axis("tp", 8);
  const auto x = b.buffer("x.sp", {tok / 8, hid}, ir::buffer_role::input, ir::dtype::bf16);
  const auto w = b.buffer("w", {hid, out_n}, ir::buffer_role::param, ir::dtype::bf16);
  if (hidden) {
    const auto u = b.buffer("u", {tok, hid}, ir::buffer_role::input, ir::dtype::bf16);
    const auto z = b.buffer("z", {tok, out_n}, ir::buffer_role::activation, ir::dtype::bf16);
    b.matmul("independent", u, w, z, tok, out_n, hid);
  }
  const auto xf = b.buffer("x.full", {tok, hid}, ir::buffer_role::activation, ir::dtype::bf16);
  b.collective(ir::op_kind::all_gather, "x.ag", tp, x, xf);
  const auto y = b.buffer("y", {tok, out_n}, ir::buffer_role::activation, ir::dtype::bf16);
  b.matmul("fc", xf, w, y, tok, out_n, hid);
  const auto o = b.buffer("o", {tok, out_n}, ir::buffer_role::activation, ir::dtype::bf16);
  b.compute(ir::op_kind::elementwise, "gelu", {y}, {o}, {ir::op::gelu, double(tok * out_n), -1, {}});
  return std::move(b).finish();
}

// A row-parallel matmul whose partial sums are reduce-scattered, and a weight gradient
// (A stored transposed) that is all-reduced.
ir::graph scatter_and_reduce_graph() {
  ir::builder b("tp-scatter");
  b.cost_only(); // planned, not run
  const int tp = b.axis("tp", 4);
  const int dp = b.axis("dp", 2, ir::link_class::inter_node);
  const auto a = b.buffer("a", {tok, hid}, ir::buffer_role::input, ir::dtype::bf16);
  const auto w = b.buffer("w", {hid, out_n}, ir::buffer_role::param, ir::dtype::bf16);
  const auto y = b.buffer("y.partial", {tok, out_n}, ir::buffer_role::activation, ir::dtype::bf16);
  b.matmul("proj", a, w, y, tok, out_n, hid);
  const auto z = b.buffer("y", {tok / 4, out_n}, ir::buffer_role::activation, ir::dtype::bf16);
  b.collective(ir::op_kind::reduce_scatter, "y.rs", tp, y, z);
  const auto dy = b.buffer("dy", {tok, out_n}, ir::buffer_role::input, ir::dtype::bf16);
  const auto gw = b.buffer("w.grad", {hid, out_n}, ir::buffer_role::gradient, ir::dtype::bf16);
  b.at(ir::phase::backward);
  b.matmul("proj.wgrad", a, dy, gw, hid, out_n, tok, 1, /*trans_a=*/true);
  b.collective(ir::op_kind::all_reduce, "w.grad.ar", dp, gw, gw);
  return std::move(b).finish();
}

// Expert parallel MoE on `ep` ranks: dispatch all_to_all -> expert up matmul -> act -> down
// matmul -> combine all_to_all; the backward's weight gradient reads the exchanged tokens
// again, and the gradient's all_reduce over dp is followed by the optimizer.
ir::graph exchange_graph(int ep = 4) {
  ir::builder b("moe");
  b.cost_only(); // planned, not run
  const int e = b.axis("ep", ep);
  const int dp = b.axis("dp", 2, ir::link_class::inter_node);
  const auto bf = ir::dtype::bf16;
  const auto send = b.buffer("send", {tok, hid}, ir::buffer_role::input, bf);
  const auto recv = b.buffer("recv", {tok, hid}, ir::buffer_role::activation, bf);
  b.collective(ir::op_kind::all_to_all, "dispatch.a2a", e, send, recv);
  const auto w1 = b.buffer("w1", {hid, out_n}, ir::buffer_role::param, bf);
  const auto u = b.buffer("u", {tok, out_n}, ir::buffer_role::activation, bf);
  b.matmul("up", recv, w1, u, tok, out_n, hid);
  const auto a = b.buffer("a", {tok, out_n}, ir::buffer_role::activation, bf);
  b.compute(ir::op_kind::elementwise, "act", {u}, {a}, {ir::op::gelu, double(tok * out_n), -1, {}});
  const auto w2 = b.buffer("w2", {out_n, hid}, ir::buffer_role::param, bf);
  const auto y = b.buffer("y", {tok, hid}, ir::buffer_role::activation, bf);
  b.matmul("down", a, w2, y, tok, hid, out_n);
  const auto back = b.buffer("back", {tok, hid}, ir::buffer_role::activation, bf);
  b.collective(ir::op_kind::all_to_all, "combine.a2a", e, y, back);
  const auto o = b.buffer("o", {tok, hid}, ir::buffer_role::activation, bf);
  b.compute(ir::op_kind::elementwise, "combine", {back}, {o}, {ir::op::scale, double(tok * hid), -1, {}});
  b.at(ir::phase::backward);
  const auto du = b.buffer("du", {tok, out_n}, ir::buffer_role::input, bf);
  const auto g1 = b.buffer("w1.grad", {hid, out_n}, ir::buffer_role::gradient, bf);
  b.matmul("up.wgrad", recv, du, g1, hid, out_n, tok, 1, /*trans_a=*/true);
  b.collective(ir::op_kind::all_reduce, "w1.grad.ar", dp, g1, g1);
  const auto other = b.buffer("other", {tok, hid}, ir::buffer_role::activation, bf);
  b.matmul("other.dgrad", du, w1, other, tok, hid, out_n, 1, false, /*trans_b=*/true);
  b.at(ir::phase::optimizer);
  b.compute(ir::op_kind::optimizer_update, "w1.adamw", {g1, w1}, {w1}, {ir::op::adamw, double(hid * out_n), -1, {}});
  return std::move(b).finish();
}

double sum_of(const std::vector<const ir::task*>& tasks, double ir::task::*field) {
  double s = 0;
  for (const auto* t : tasks) s += t->*field;
  return s;
}

} // namespace

TEST_CASE("find_candidates reports exposed collectives next to a matmul", "[decompose][candidates]") {
  const auto model = cost::model::preset("h100x64");

  SECTION("an all_gather feeding a matmul at the start of the step is a candidate for every k") {
    const auto g = gather_graph(false);
    const auto c = planner::find_candidates(g, model);
    REQUIRE(c.size() == 3);
    for (std::size_t i = 0; i < c.size(); ++i) {
      CHECK(c[i].collective == find(g, "x.ag"));
      CHECK(c[i].compute == find(g, "fc"));
    }
    CHECK(c[0].chunks == 2);
    CHECK(c[1].chunks == 4);
    CHECK(c[2].chunks == 8);
  }
  SECTION("the same all_gather hidden under an independent matmul is no candidate") {
    CHECK(planner::find_candidates(gather_graph(true), model).empty());
  }
}

TEST_CASE("apply splits an all_gather and its matmul into chunks over views", "[decompose][apply]") {
  const auto g = gather_graph(false);
  const auto ag = find(g, "x.ag"), fc = find(g, "fc");
  {
    const int k = GENERATE(2, 4, 8);
    const std::vector<planner::decomposition> d{{ag, fc, k}};
    const auto split = planner::apply(g, std::span<const planner::decomposition>(d));
    INFO("k = " << k);
    REQUIRE_NOTHROW(split.validate());
    const auto gathers = named_prefix(split, "x.ag.chunk");
    const auto matmuls = named_prefix(split, "fc.chunk");
    REQUIRE(gathers.size() == static_cast<std::size_t>(k));
    REQUIRE(matmuls.size() == static_cast<std::size_t>(k));
    CHECK(sum_of(gathers, &ir::task::bytes) == Catch::Approx(g[ag].bytes));
    CHECK(sum_of(matmuls, &ir::task::flops) == Catch::Approx(g[fc].flops));
    CHECK(sum_of(matmuls, &ir::task::bytes) == Catch::Approx(g[fc].bytes));
    for (const auto* t : gathers) CHECK(t->kind == ir::op_kind::all_gather);
    for (const auto* t : matmuls) CHECK(t->attr("m") == tok / k);

    SECTION("chunk i's matmul waits for chunk i's gather only, so later gathers overlap it") {
      for (int j = 0; j < k; ++j) {
        const auto& deps = matmuls[static_cast<std::size_t>(j)]->deps;
        for (int i = 0; i < k; ++i) {
          const bool has = std::find(deps.begin(), deps.end(), gathers[static_cast<std::size_t>(i)]->id) != deps.end();
          CHECK(has == (i == j));
        }
      }
    }
    SECTION("each chunk gathers a contiguous row range of the shard, as a view") {
      for (int j = 0; j < k; ++j) {
        const auto& in = split.buffers[static_cast<std::size_t>(gathers[static_cast<std::size_t>(j)]->reads[0])];
        CHECK(split.buffers[static_cast<std::size_t>(in.view_of)].name == "x.sp");
        CHECK(in.offset == j * in.bytes);
        CHECK(in.bytes * k == g.buffers[static_cast<std::size_t>(g[ag].reads[0])].bytes);
      }
    }
    SECTION("one concat restores the output's row order across the 8 ranks, before its consumer") {
      const auto concat = named_prefix(split, "fc.concat");
      REQUIRE(concat.size() == 1);
      CHECK(concat[0]->kind == ir::op_kind::concat);
      CHECK(concat[0]->attr("outer") == 8);
      CHECK(concat[0]->attr("length") == tok / 8 / k);
      CHECK(concat[0]->reads.size() == static_cast<std::size_t>(k));
      const auto& gelu_deps = split[find(split, "gelu")].deps;
      CHECK(gelu_deps == std::vector<ir::task_id>{concat[0]->id});
    }
    SECTION("the split graph plans and verifies") {
      REQUIRE_NOTHROW(plan::verify(planner::list_plan(split, cost::model::preset("h100x64"))));
    }
  }
}

TEST_CASE("apply splits matmuls feeding a reduce_scatter or an all_reduce", "[decompose][apply]") {
  const auto g = scatter_and_reduce_graph();
  const auto model = cost::model::preset("a800x32");

  SECTION("a reduce_scatter's chunks write contiguous row ranges of its output, fed by row slices") {
    const std::vector<planner::decomposition> d{{find(g, "y.rs"), find(g, "proj"), 4}};
    const auto split = planner::apply(g, std::span<const planner::decomposition>(d));
    const auto scatters = named_prefix(split, "y.rs.chunk");
    const auto slices = named_prefix(split, "proj.slice");
    REQUIRE(scatters.size() == 4);
    REQUIRE(slices.size() == 4);
    CHECK(sum_of(scatters, &ir::task::bytes) == Catch::Approx(g[find(g, "y.rs")].bytes));
    CHECK(sum_of(named_prefix(split, "proj.chunk"), &ir::task::flops) == Catch::Approx(g[find(g, "proj")].flops));
    for (std::size_t j = 0; j < 4; ++j) {
      const auto& out = split.buffers[static_cast<std::size_t>(scatters[j]->writes[0])];
      CHECK(split.buffers[static_cast<std::size_t>(out.view_of)].name == "y");
      CHECK(out.offset == static_cast<std::int64_t>(j) * out.bytes);
      CHECK(slices[j]->attr("outer") == 4);              // one block per rank of the group
      CHECK(slices[j]->attr("extent") == tok / 4);
      CHECK(slices[j]->attr("offset") == static_cast<std::int64_t>(j) * (tok / 16));
    }
    REQUIRE_NOTHROW(plan::verify(planner::list_plan(split, model)));
  }
  SECTION("an all_reduce of a transposed-A weight gradient splits into column slices and in-place views") {
    const std::vector<planner::decomposition> d{{find(g, "w.grad.ar"), find(g, "proj.wgrad"), 2}};
    const auto split = planner::apply(g, std::span<const planner::decomposition>(d));
    const auto reduces = named_prefix(split, "w.grad.ar.chunk");
    REQUIRE(reduces.size() == 2);
    for (std::size_t j = 0; j < 2; ++j) {
      const auto& buf = split.buffers[static_cast<std::size_t>(reduces[j]->reads[0])];
      CHECK(reduces[j]->reads == reduces[j]->writes);
      CHECK(split.buffers[static_cast<std::size_t>(buf.view_of)].name == "w.grad");
      CHECK(buf.role == ir::buffer_role::gradient);
    }
    const auto slices = named_prefix(split, "proj.wgrad.slice");
    REQUIRE(slices.size() == 2);
    CHECK(slices[1]->attr("outer") == tok); // columns of the [tok, hid] input
    CHECK(slices[1]->attr("inner") == 1);
    CHECK(slices[1]->attr("offset") == hid / 2);
    REQUIRE_NOTHROW(plan::verify(planner::list_plan(split, model)));
  }
  SECTION("two decompositions apply together and leave the other tasks untouched") {
    const std::vector<planner::decomposition> d{{find(g, "y.rs"), find(g, "proj"), 2},
                                                {find(g, "w.grad.ar"), find(g, "proj.wgrad"), 4}};
    const auto split = planner::apply(g, std::span<const planner::decomposition>(d));
    CHECK(named_prefix(split, "y.rs.chunk").size() == 2);
    CHECK(named_prefix(split, "w.grad.ar.chunk").size() == 4);
  }
}

TEST_CASE("apply rejects decompositions that do not fit, naming the tasks", "[decompose][errors]") {
  const auto g = gather_graph(false);
  const auto ag = find(g, "x.ag");
  const auto apply1 = [&](planner::decomposition d) {
    const std::vector<planner::decomposition> v{d};
    return planner::apply(g, std::span<const planner::decomposition>(v));
  };
  SECTION("a compute task that is not a matmul") {
    CHECK_THROWS_WITH(apply1({ag, find(g, "gelu"), 2}),
                      ContainsSubstring("'x.ag'") && ContainsSubstring("'gelu'") && ContainsSubstring("not a matmul"));
  }
  SECTION("a chunk count that does not divide the rows of a rank's shard") {
    CHECK_THROWS_WITH(apply1({ag, find(g, "fc"), 3}), ContainsSubstring("3 chunks") && ContainsSubstring("'fc'"));
  }
  SECTION("the same task in two decompositions") {
    const std::vector<planner::decomposition> v{{ag, find(g, "fc"), 2}, {ag, find(g, "fc"), 4}};
    CHECK_THROWS_WITH(planner::apply(g, std::span<const planner::decomposition>(v)),
                      ContainsSubstring("already part of another decomposition"));
  }
}

TEST_CASE("apply splits all_to_alls around expert matmuls along the tokens", "[decompose][apply][moe]") {
  const auto g = exchange_graph();
  const std::int64_t k = 4, c = tok / 4 / k; // rows per rank block and chunk

  SECTION("dispatch -> up: chunk j exchanges rows [j·c, (j+1)·c) of each rank's block") {
    const std::vector<planner::decomposition> d{{find(g, "dispatch.a2a"), find(g, "up"), 4}};
    const auto split = planner::apply(g, std::span<const planner::decomposition>(d));
    const auto slices = named_prefix(split, "dispatch.a2a.slice");
    const auto chunks = named_prefix(split, "dispatch.a2a.chunk");
    const auto mms = named_prefix(split, "up.chunk");
    REQUIRE(slices.size() == 4);
    REQUIRE(chunks.size() == 4);
    REQUIRE(mms.size() == 4);
    for (std::int64_t j = 0; j < k; ++j) {
      const auto& sl = *slices[static_cast<std::size_t>(j)];
      CHECK(sl.attrs == std::map<std::string, std::int64_t>{
                            {"outer", 4}, {"extent", tok / 4}, {"inner", hid}, {"offset", j * c}, {"length", c}});
      const auto& a2a = *chunks[static_cast<std::size_t>(j)];
      CHECK(a2a.kind == ir::op_kind::all_to_all);
      CHECK(a2a.reads == sl.writes);
      CHECK(a2a.bytes == g[find(g, "dispatch.a2a")].bytes / 4);
      CHECK(mms[static_cast<std::size_t>(j)]->reads[0] == a2a.writes[0]);
      CHECK(mms[static_cast<std::size_t>(j)]->attr("m") == 4 * c);
      // Chunk j's matmul waits for its own exchange only.
      CHECK(mms[static_cast<std::size_t>(j)]->deps == std::vector<ir::task_id>{a2a.id});
    }
    CHECK(sum_of(mms, &ir::task::flops) == Catch::Approx(g[find(g, "up")].flops));
    // One concat interleaves the chunk outputs back into u; the weight gradient reads the
    // exchanged tokens again, so a second concat rebuilds them, before it.
    const auto& out = split[find(split, "up.concat")];
    CHECK(split.buffers[static_cast<std::size_t>(out.writes[0])].name == "u");
    const auto& restore = split[find(split, "dispatch.a2a.concat")];
    CHECK(split.buffers[static_cast<std::size_t>(restore.writes[0])].name == "recv");
    CHECK(restore.attrs == std::map<std::string, std::int64_t>{{"outer", 4}, {"inner", hid}, {"length", c}, {"parts", 4}});
    const auto& wgrad = split[find(split, "up.wgrad")];
    CHECK(std::find(wgrad.deps.begin(), wgrad.deps.end(), restore.id) != wgrad.deps.end());
    REQUIRE_NOTHROW(plan::verify(planner::list_plan(split, cost::model::preset("h100x64"))));
  }
  SECTION("down -> combine: chunk j computes the rows it sends, and a concat restores the received order") {
    const std::vector<planner::decomposition> d{{find(g, "combine.a2a"), find(g, "down"), 2}};
    const auto split = planner::apply(g, std::span<const planner::decomposition>(d));
    const auto mms = named_prefix(split, "down.chunk");
    const auto chunks = named_prefix(split, "combine.a2a.chunk");
    REQUIRE(mms.size() == 2);
    REQUIRE(chunks.size() == 2);
    CHECK(named_prefix(split, "down.slice").size() == 2);
    for (std::size_t j = 0; j < 2; ++j) {
      CHECK(chunks[j]->reads == mms[j]->writes);
      CHECK(chunks[j]->deps == std::vector<ir::task_id>{mms[j]->id});
    }
    const auto& join = split[find(split, "combine.a2a.concat")];
    CHECK(join.reads == std::vector<ir::buffer_id>{chunks[0]->writes[0], chunks[1]->writes[0]});
    CHECK(split.buffers[static_cast<std::size_t>(join.writes[0])].name == "back");
    CHECK(split[find(split, "combine")].deps == std::vector<ir::task_id>{join.id});
  }
  SECTION("an exchange whose buffer is used between it and the matmul is refused") {
    const std::vector<planner::decomposition> d{{find(g, "dispatch.a2a"), find(g, "up.wgrad"), 2}};
    CHECK_THROWS_WITH(planner::apply(g, std::span<const planner::decomposition>(d)),
                      ContainsSubstring("'dispatch.a2a'") && ContainsSubstring("transposed"));
  }
}

TEST_CASE("apply turns an all_reduce into a reduce_scatter and an all_gather before the next use",
          "[decompose][apply][all_reduce]") {
  const auto g = exchange_graph();
  const planner::decomposition split_ar{find(g, "w1.grad.ar"), -1, 1, planner::split_kind::reduce_scatter_all_gather};
  const std::vector<planner::decomposition> d{split_ar};
  const auto split = planner::apply(g, std::span<const planner::decomposition>(d));
  REQUIRE(split.tasks.size() == g.tasks.size() + 1);
  const auto& rs = split[find(split, "w1.grad.ar.rs")];
  const auto& ag = split[find(split, "w1.grad.ar.ag")];
  const auto& adamw = split[find(split, "w1.adamw")];
  CHECK(rs.kind == ir::op_kind::reduce_scatter);
  CHECK(ag.kind == ir::op_kind::all_gather);
  const auto& shard = split.buffers[static_cast<std::size_t>(rs.writes[0])];
  CHECK(shard.bytes == hid * out_n * 2 / 2);
  CHECK(ag.reads == rs.writes);
  CHECK(rs.bytes == g[find(g, "w1.grad.ar")].bytes);
  CHECK(ag.bytes == g[find(g, "w1.grad.ar")].bytes);
  // The gather waits for the scatter and runs just before the optimizer, after the rest of the
  // backward, which the scatter no longer holds up.
  CHECK(std::find(ag.deps.begin(), ag.deps.end(), rs.id) != ag.deps.end());
  CHECK(std::all_of(ag.deps.begin(), ag.deps.end(), [&](ir::task_id d) { return d <= rs.id; }));
  CHECK(ag.id == adamw.id - 1);
  CHECK(ag.id > find(split, "other.dgrad"));
  CHECK(ag.step_phase == ir::phase::optimizer);
  CHECK(std::find(adamw.deps.begin(), adamw.deps.end(), ag.id) != adamw.deps.end());

  SECTION("one that does not split evenly over the group is refused, naming it") {
    ir::builder b("odd");
    b.cost_only(); // planned, not run
    const int dp = b.axis("dp", 3);
    const auto gr = b.buffer("g", {7}, ir::buffer_role::gradient);
    b.compute(ir::op_kind::elementwise, "make", {}, {gr}, {ir::op::zero, 0, -1, {}});
    const auto ar = b.collective(ir::op_kind::all_reduce, "g.ar", dp, gr, gr);
    const auto odd = std::move(b).finish();
    const std::vector<planner::decomposition> bad{{ar, -1, 1, planner::split_kind::reduce_scatter_all_gather}};
    CHECK_THROWS_WITH(planner::apply(odd, std::span<const planner::decomposition>(bad)),
                      ContainsSubstring("'g.ar'") && ContainsSubstring("7 elements"));
  }
}

TEST_CASE("decompose keeps only splits that shorten the simulated step", "[decompose][search]") {
  const auto model = cost::model::preset("h100x64");
  const auto judge = planner::simulated_step(model);

  SECTION("an exposed all_gather is split and the step gets shorter") {
    const auto g = gather_graph(false);
    const auto r = planner::decompose(g, model);
    REQUIRE(r.chosen.size() == 1);
    CHECK(r.step_us_after < r.step_us_before);
    CHECK(r.step_us_before == Catch::Approx(judge(g)));
    CHECK(r.step_us_after == Catch::Approx(judge(r.graph)));
    CHECK(r.graph == planner::apply(g, std::span<const planner::decomposition>(r.chosen)));
  }
  SECTION("a graph whose communication is hidden comes back unchanged") {
    const auto g = gather_graph(true);
    const auto r = planner::decompose(g, model);
    CHECK(r.chosen.empty());
    CHECK(r.graph == g);
    CHECK(r.step_us_after == r.step_us_before);
  }
  SECTION("on a tensor-parallel transformer every candidate applies and the result is never slower") {
    const auto g = ir::make_workload("llama-tp-sp", {.layers = 1, .ranks = 16});
    const auto candidates = planner::find_candidates(g, model);
    REQUIRE(!candidates.empty());
    double matmul_flops = 0;
    for (const auto& t : g.tasks) matmul_flops += t.kind == ir::op_kind::matmul ? t.flops : 0;
    for (const auto& c : candidates) {
      const std::vector<planner::decomposition> one{c};
      const auto split = planner::apply(g, std::span<const planner::decomposition>(one));
      double flops = 0;
      for (const auto& t : split.tasks) flops += t.kind == ir::op_kind::matmul ? t.flops : 0;
      CHECK(flops == Catch::Approx(matmul_flops));
    }
    const auto r = planner::decompose(g, model);
    CHECK(r.step_us_after <= r.step_us_before);
    CHECK(!r.chosen.empty());
    REQUIRE_NOTHROW(plan::verify(planner::list_plan(r.graph, model)));
  }
}

TEST_CASE("an MoE layer's exchanges split chunk-major: contiguous views, no copies", "[decompose][apply][moe]") {
  const auto g = ir::make_workload("moe-ep", {.layers = 1});
  const auto dispatch = find(g, "L0.moe.dispatch");
  const std::int64_t k = 4;
  const std::vector<planner::decomposition> d{{-1, dispatch, static_cast<int>(k), planner::split_kind::expert_exchanges}};
  const auto split = planner::apply(g, std::span<const planner::decomposition>(d));
  // The four MoE kernels read and write their slots chunk-major.
  for (const char* name : {"L0.moe.dispatch", "L0.moe.combine", "L0.moe.combine.grad", "L0.moe.dispatch.grad"})
    CHECK(split[find(split, name)].attr("slot_chunks") == k);
  CHECK(named_prefix(split, "L0.moe.dispatch.a2a.slice").empty());
  for (const auto& t : split.tasks) CHECK((t.fn != ir::op::slice && t.fn != ir::op::concat));
  // Each exchange: k chunks over views of its two buffers, rows [j·R/k, (j+1)·R/k).
  for (const char* x : {"L0.moe.dispatch.a2a", "L0.moe.combine.a2a", "L0.moe.combine.a2a.bwd", "L0.moe.dispatch.a2a.bwd"}) {
    CAPTURE(x);
    const auto& whole = g[find(g, x)];
    const auto chunks = named_prefix(split, std::string(x) + ".chunk");
    REQUIRE(chunks.size() == static_cast<std::size_t>(k));
    for (std::int64_t j = 0; j < k; ++j) {
      const auto& c = *chunks[static_cast<std::size_t>(j)];
      CHECK(c.bytes == whole.bytes / static_cast<double>(k));
      for (auto [mine, theirs] : {std::pair{c.reads[0], whole.reads[0]}, std::pair{c.writes[0], whole.writes[0]}}) {
        const auto& v = split.buffers[static_cast<std::size_t>(mine)];
        CHECK(v.view_of == theirs);
        CHECK(v.offset == j * v.bytes);
        CHECK(v.bytes * k == g.buffers[static_cast<std::size_t>(theirs)].bytes);
      }
    }
  }
  // The expert matmuls next to the exchanges run per chunk, each after its own exchange only.
  const auto ups = named_prefix(split, "L0.moe.w1.chunk");
  const auto received = named_prefix(split, "L0.moe.dispatch.a2a.chunk");
  REQUIRE(ups.size() == static_cast<std::size_t>(k));
  for (std::size_t j = 0; j < ups.size(); ++j) {
    CHECK(ups[j]->reads[0] == received[j]->writes[0]);
    CHECK(ups[j]->deps == std::vector<ir::task_id>{received[j]->id});
    CHECK(ups[j]->attr("m") == g[find(g, "L0.moe.w1")].attr("m") / k);
  }
  CHECK(named_prefix(split, "L0.moe.w3.chunk").size() == static_cast<std::size_t>(k));
  CHECK(named_prefix(split, "L0.moe.w2.chunk").size() == static_cast<std::size_t>(k));      // before combine
  CHECK(named_prefix(split, "L0.moe.w2.dgrad.chunk").size() == static_cast<std::size_t>(k)); // after its gradient's
  double before = 0, after = 0;
  for (const auto& t : g.tasks) before += t.flops;
  for (const auto& t : split.tasks) after += t.flops;
  CHECK(after == Catch::Approx(before));
  REQUIRE_NOTHROW(plan::verify(planner::list_plan(split, cost::model::preset("h100x64"))));

  SECTION("refused, naming why, with two experts per rank or slots that do not divide") {
    const auto g4 = ir::make_workload("moe-ep", {.layers = 1, .ranks = 16, .ranks_per_node = 4});
    const std::vector<planner::decomposition> two{{-1, find(g4, "L0.moe.dispatch"), 2, planner::split_kind::expert_exchanges}};
    CHECK_THROWS_WITH(planner::apply(g4, std::span<const planner::decomposition>(two)),
                      ContainsSubstring("L0.moe.dispatch") && ContainsSubstring("not one per rank"));
    const std::vector<planner::decomposition> odd{{-1, dispatch, 3, planner::split_kind::expert_exchanges}};
    CHECK_THROWS_WITH(planner::apply(g, std::span<const planner::decomposition>(odd)),
                      ContainsSubstring("1024 slots per expert do not divide into 3 chunks"));
  }
}

TEST_CASE("decompose finds the all_to_all and all_reduce splits of an MoE step", "[decompose][search][moe]") {
  const auto model = cost::model::preset("h100x64");
  const auto g = ir::make_workload("moe-ep", {.layers = 1});
  const auto candidates = planner::find_candidates(g, model, {.min_exposed_fraction = 0});
  const auto count = [&](ir::op_kind kind, planner::split_kind how) {
    return std::count_if(candidates.begin(), candidates.end(), [&](const planner::decomposition& d) {
      return g[d.collective].kind == kind && d.kind == how;
    });
  };
  // The layer's four exchanges are offered together, chunk-major, once per k (and not one by one).
  CHECK(count(ir::op_kind::all_to_all, planner::split_kind::expert_exchanges) == 3);
  CHECK(count(ir::op_kind::all_to_all, planner::split_kind::chunks) == 0);
  CHECK(count(ir::op_kind::all_reduce, planner::split_kind::reduce_scatter_all_gather) > 0);
  double matmul_flops = 0;
  for (const auto& t : g.tasks) matmul_flops += t.kind == ir::op_kind::matmul ? t.flops : 0;
  for (const auto& c : candidates) {
    const std::vector<planner::decomposition> one{c};
    const auto split = planner::apply(g, std::span<const planner::decomposition>(one));
    double flops = 0, bytes = 0;
    for (const auto& t : split.tasks) {
      flops += t.kind == ir::op_kind::matmul ? t.flops : 0;
      bytes += t.name.rfind(g[c.collective].name + ".chunk", 0) == 0 ? t.bytes : 0;
    }
    CAPTURE(g[c.collective].name, c.chunks);
    CHECK(flops == Catch::Approx(matmul_flops));
    if (c.kind != planner::split_kind::reduce_scatter_all_gather) CHECK(bytes == Catch::Approx(g[c.collective].bytes));
  }
  const auto r = planner::decompose(g, model, {}, {.progress = false});
  CHECK(r.step_us_after <= r.step_us_before);
  REQUIRE_NOTHROW(plan::verify(planner::list_plan(r.graph, model)));
}

using unit_testing::stderr_of;

TEST_CASE("decompose reports progress on stderr once it runs long, unless silenced", "[decompose][progress]") {
  const auto model = cost::model::preset("h100x64");
  const auto g = exchange_graph();
  SECTION("past the quiet time it prints what it tried and the step") {
    const auto err = stderr_of([&] { (void)planner::decompose(g, model, {}, {.progress_after_s = 0}); });
    CHECK_THAT(err, ContainsSubstring("concerto: decomposing 'moe'") && ContainsSubstring("collectives tried") &&
                        ContainsSubstring("done:"));
  }
  SECTION("with progress off it prints nothing") {
    CHECK(stderr_of([&] { (void)planner::decompose(g, model, {}, {.progress = false, .progress_after_s = 0}); }).empty());
  }
  SECTION("within the quiet time it prints nothing") {
    CHECK(stderr_of([&] { (void)planner::decompose(g, model, {}, {.progress_after_s = 1e6}); }).empty());
  }
}

TEST_CASE("decompose stops at its deadline with the splits chosen so far", "[decompose][budget]") {
  const auto model = cost::model::preset("h100x64");
  const auto g = gather_graph(false); // one exposed all_gather, split when there is time
  const auto passed = std::chrono::steady_clock::now();
  const auto none = planner::decompose(g, model, {}, {.deadline = passed, .progress = false});
  CHECK(none.chosen.empty());
  CHECK(none.graph.tasks.size() == g.tasks.size());
  const auto unbounded = planner::decompose(g, model, {}, {.progress = false});
  REQUIRE_FALSE(unbounded.chosen.empty()); // so that the deadline above is what stopped it
  const auto far = planner::decompose(g, model, {}, {.deadline = passed + std::chrono::hours(1), .progress = false});
  CHECK(far.chosen == unbounded.chosen);
}
