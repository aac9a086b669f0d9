#include <concerto/ir/builder.hpp>
#include <concerto/ir/dead_tasks.hpp>

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

TEST_CASE("dead tasks go, with their collectives and buffers, and no ordering between kept tasks is lost", "[ir][dead_tasks]") {
  ir::builder b("dead");
  const int dp = b.axis("dp", 2);
  const auto x = b.buffer("x", {4}, ir::buffer_role::input);
  const auto w = b.buffer("w", {4}, ir::buffer_role::param);
  const auto s = b.buffer("s", {4});
  const auto loss = b.buffer("loss", {1});
  const auto unused = b.buffer("unused", {4});      // no task touches it: not the pass's business
  const auto dx = b.buffer("dx", {4}, ir::buffer_role::gradient);
  const auto dx_sum = b.buffer("dx.sum", {4}, ir::buffer_role::gradient);
  const auto x_grad = b.buffer("x.grad", {4}, ir::buffer_role::gradient);
  const auto k = b.compute(ir::op_kind::elementwise, "k", {x}, {s}, {.fn = "relu"});
  const auto r = b.compute(ir::op_kind::loss, "r", {s}, {loss}, {.fn = "mse"});
  // Overwrites s, which nobody reads afterwards, then a gradient nobody reads, summed over dp.
  const auto d = b.compute(ir::op_kind::elementwise, "d", {w}, {s}, {.fn = "relu"});
  const auto dead_grad = b.compute(ir::op_kind::elementwise, "dead.grad", {loss, w}, {dx}, {.fn = "add"});
  const auto dead_sum = b.collective(ir::op_kind::all_reduce, "dead.grad.ar", dp, dx, dx_sum);
  // Written again after d: must still wait for r, which read k's value (through d until now).
  const auto l = b.compute(ir::op_kind::elementwise, "l", {x}, {s}, {.fn = "gelu"});
  const auto upd = b.compute(ir::op_kind::optimizer_update, "w.update", {s, w}, {w}, {.fn = "sgd"});
  const auto kept_grad = b.compute(ir::op_kind::elementwise, "x.grad", {loss}, {x_grad}, {.fn = "relu"});
  const auto g = std::move(b).finish();
  REQUIRE(g[l].deps == std::vector<ir::task_id>{d}); // only through the task that goes

  const auto lean = ir::remove_dead_tasks(g, {loss, x_grad});
  std::vector<std::string> names;
  for (const auto& t : lean.tasks) names.push_back(t.name);
  CHECK(names == std::vector<std::string>{"k", "r", "l", "w.update", "x.grad"});
  const auto id = [&](const std::string& name) {
    return static_cast<ir::task_id>(std::find(names.begin(), names.end(), name) - names.begin());
  };
  SECTION("a kept task waits for what the removed ones it waited for waited for") {
    CHECK(lean[id("l")].deps == std::vector<ir::task_id>{id("k"), id("r")});
    // d and dead.grad read w before the update overwrote it: it inherits their (here redundant) waits.
    CHECK(lean[id("w.update")].deps == std::vector<ir::task_id>{id("k"), id("r"), id("l")});
  }
  SECTION("buffers only removed tasks used go; the others keep their names, in order") {
    std::vector<std::string> buffers;
    for (const auto& buf : lean.buffers) buffers.push_back(buf.name);
    CHECK(buffers == std::vector<std::string>{"x", "w", "s", "loss", "unused", "x.grad"});
    CHECK(lean.buffers[static_cast<std::size_t>(lean[id("x.grad")].writes.at(0))].name == "x.grad");
  }
  SECTION("without an observed gradient, its task goes too; a graph without dead tasks is returned as is") {
    CHECK(ir::remove_dead_tasks(g, {loss}).tasks.size() == 4);
    CHECK(ir::remove_dead_tasks(lean, {lean.tasks[static_cast<std::size_t>(id("r"))].writes.at(0),
                                       lean.tasks[static_cast<std::size_t>(id("x.grad"))].writes.at(0)}) == lean);
  }
  (void)k, (void)r, (void)dead_grad, (void)dead_sum, (void)upd, (void)kept_grad, (void)unused;
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
