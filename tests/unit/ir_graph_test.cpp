#include <concerto/ir/builder.hpp>

#include <catch2/catch_test_macros.hpp>
#include <catch2/matchers/catch_matchers_string.hpp>

using namespace concerto;
using Catch::Matchers::ContainsSubstring;

TEST_CASE("the builder derives dependencies from buffer accesses", "[ir][builder]") {
  ir::builder b("tiny");
  const int dp = b.axis("dp", 2);
  const auto x = b.buffer("x", {4, 8}, ir::buffer_role::input);
  const auto w = b.buffer("w", {8, 8}, ir::buffer_role::param);
  const auto y = b.buffer("y", {4, 8});
  const auto g = b.buffer("w.grad", {8, 8}, ir::buffer_role::gradient);
  const auto mm = b.matmul("fc", x, w, y, 4, 8, 8);
  const auto grad = b.matmul("fc.dw", x, y, g, 8, 8, 4, 1, true);
  const auto ar = b.collective(ir::op_kind::all_reduce, "w.grad.ar", dp, g, g);
  const auto upd = b.compute(ir::op_kind::optimizer_update, "sgd", {g, w}, {w}, {.fn = "sgd"});
  const auto graph = std::move(b).finish();

  SECTION("read after write") { CHECK(graph[grad].deps == std::vector<ir::task_id>{mm}); }
  SECTION("collectives go to the lane of their axis") {
    CHECK(graph[ar].deps == std::vector<ir::task_id>{grad});
    CHECK(graph.streams[static_cast<std::size_t>(graph[ar].stream)].name == "comm:dp");
    CHECK(graph[ar].bytes == 8 * 8 * 4);
  }
  SECTION("write after read orders the update after every reader of w") {
    CHECK(graph[upd].deps == std::vector<ir::task_id>{mm, ar});
  }
  SECTION("matmul flops") { CHECK(graph[mm].flops == 2.0 * 4 * 8 * 8); }
}

TEST_CASE("views conflict only where their bytes overlap", "[ir][builder]") {
  ir::builder b("views");
  const auto buf = b.buffer("buf", {16});
  const auto lo = b.view("lo", buf, 0, 32);
  const auto hi = b.view("hi", buf, 32, 32);
  const auto w_lo = b.compute(ir::op_kind::elementwise, "fill.lo", {}, {lo}, {.fn = "fill"});
  const auto w_hi = b.compute(ir::op_kind::elementwise, "fill.hi", {}, {hi}, {.fn = "fill"});
  const auto all = b.compute(ir::op_kind::copy, "read.all", {buf}, {}, {.fn = "copy"});
  const auto graph = std::move(b).finish();
  CHECK(graph[w_hi].deps.empty());
  CHECK(graph[all].deps == std::vector<ir::task_id>{w_lo, w_hi});
}

TEST_CASE("validate names the offending task", "[ir][validate]") {
  ir::builder b("bad");
  const auto x = b.buffer("x", {4});
  b.compute(ir::op_kind::elementwise, "first", {}, {x});
  b.compute(ir::op_kind::elementwise, "second", {x}, {x});
  auto graph = b.peek();

  SECTION("a cycle") {
    graph.tasks[0].deps.push_back(1);
    CHECK_THROWS_WITH(graph.validate(), ContainsSubstring("cycle") && ContainsSubstring("'first'"));
  }
  SECTION("a dangling dependency") {
    graph.tasks[1].deps.push_back(7);
    CHECK_THROWS_WITH(graph.validate(), ContainsSubstring("'second'") && ContainsSubstring("task 7"));
  }
  SECTION("a negative size") {
    graph.tasks[1].flops = -1;
    CHECK_THROWS_WITH(graph.validate(), ContainsSubstring("'second'") && ContainsSubstring("negative"));
  }
  SECTION("a collective without an axis") {
    graph.tasks[1].kind = ir::op_kind::all_reduce;
    CHECK_THROWS_WITH(graph.validate(), ContainsSubstring("'second'") && ContainsSubstring("mesh axis"));
  }
  SECTION("a valid graph passes") { CHECK_NOTHROW(graph.validate()); }
}
