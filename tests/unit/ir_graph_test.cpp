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
  const auto upd = b.compute(ir::op_kind::optimizer_update, "sgd", {g, w}, {w}, {.fn = ir::op::sgd, .flops = 0});
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
  b.cost_only(); // planned, not run
  const auto buf = b.buffer("buf", {16});
  const auto lo = b.view("lo", buf, 0, 32);
  const auto hi = b.view("hi", buf, 32, 32);
  const auto w_lo = b.compute(ir::op_kind::elementwise, "fill.lo", {}, {lo}, {.fn = ir::op::zero, .flops = 0});
  const auto w_hi = b.compute(ir::op_kind::elementwise, "fill.hi", {}, {hi}, {.fn = ir::op::zero, .flops = 0});
  const auto all = b.compute(ir::op_kind::copy, "read.all", {buf}, {}, {.fn = ir::op::copy, .flops = 0});
  const auto graph = std::move(b).finish();
  CHECK(graph[w_hi].deps.empty());
  CHECK(graph[all].deps == std::vector<ir::task_id>{w_lo, w_hi});
}

TEST_CASE("dead tasks go, with their collectives and buffers, and no ordering between kept tasks is lost", "[ir][dead_tasks]") {
  ir::builder b("dead");
  b.cost_only(); // operand counts are not the point here
  const int dp = b.axis("dp", 2);
  const auto x = b.buffer("x", {4}, ir::buffer_role::input);
  const auto w = b.buffer("w", {4}, ir::buffer_role::param);
  const auto s = b.buffer("s", {4});
  const auto loss = b.buffer("loss", {1});
  const auto unused = b.buffer("unused", {4});      // no task touches it: not the pass's business
  const auto dx = b.buffer("dx", {4}, ir::buffer_role::gradient);
  const auto dx_sum = b.buffer("dx.sum", {4}, ir::buffer_role::gradient);
  const auto x_grad = b.buffer("x.grad", {4}, ir::buffer_role::gradient);
  const auto k = b.compute(ir::op_kind::elementwise, "k", {x}, {s}, {.fn = ir::op::relu, .flops = 0});
  const auto r = b.compute(ir::op_kind::loss, "r", {s}, {loss}, {.fn = ir::op::mse, .flops = 0});
  // Overwrites s, which nobody reads afterwards, then a gradient nobody reads, summed over dp.
  const auto d = b.compute(ir::op_kind::elementwise, "d", {w}, {s}, {.fn = ir::op::relu, .flops = 0});
  const auto dead_grad = b.compute(ir::op_kind::elementwise, "dead.grad", {loss, w}, {dx}, {.fn = ir::op::add, .flops = 0});
  const auto dead_sum = b.collective(ir::op_kind::all_reduce, "dead.grad.ar", dp, dx, dx_sum);
  // Written again after d: must still wait for r, which read k's value (through d until now).
  const auto l = b.compute(ir::op_kind::elementwise, "l", {x}, {s}, {.fn = ir::op::gelu, .flops = 0});
  const auto upd = b.compute(ir::op_kind::optimizer_update, "w.update", {s, w}, {w}, {.fn = ir::op::sgd, .flops = 0});
  const auto kept_grad = b.compute(ir::op_kind::elementwise, "x.grad", {loss}, {x_grad}, {.fn = ir::op::relu, .flops = 0});
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
  b.compute(ir::op::zero, "first", {}, {x});
  b.compute(ir::op::gelu, "second", {x}, {x});
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

TEST_CASE("validate checks each task's fn against the op table", "[ir][validate][ops]") {
  ir::builder b("fns");
  const int dp = b.axis("dp", 2);
  const auto x = b.buffer("x", {4, 8}), y = b.buffer("y", {4, 8}), gamma = b.buffer("gamma", {8});
  b.compute(ir::op::layernorm, "ln", {x, gamma, gamma}, {y});
  b.collective(ir::op_kind::all_reduce, "y.ar", dp, y, y);
  const auto g = std::move(b).finish();
  REQUIRE_NOTHROW(g.validate());

  SECTION("a compute task without fn is refused unless the graph is cost-only") {
    auto h = g;
    h.tasks[0].fn = ir::op::none;
    CHECK_THROWS_WITH(h.validate(), ContainsSubstring("task 0 'ln'") && ContainsSubstring("names no fn"));
    h.cost_only = true;
    CHECK_NOTHROW(h.validate());
  }
  SECTION("an op no executor runs is refused unless the graph is cost-only, naming the task and the fn") {
    auto h = g;
    h.tasks[0].fn = ir::op::add_position;
    h.tasks[0].kind = ir::op_kind::elementwise;
    CHECK_THROWS_WITH(h.validate(), ContainsSubstring("'ln'") && ContainsSubstring("fn 'add_position'") &&
                                        ContainsSubstring("no executor runs"));
    h.cost_only = true;
    CHECK_NOTHROW(h.validate());
  }
  SECTION("the kind must be the op's") {
    auto h = g;
    h.tasks[0].kind = ir::op_kind::elementwise;
    CHECK_THROWS_WITH(h.validate(), ContainsSubstring("'ln'") && ContainsSubstring("fn 'layernorm'") &&
                                        ContainsSubstring("whose tasks are norm"));
  }
  SECTION("the operands must be as many as the op takes") {
    auto h = g;
    h.tasks[0].reads.pop_back();
    CHECK_THROWS_WITH(h.validate(), ContainsSubstring("'ln'") && ContainsSubstring("reads 2 buffer(s)") &&
                                        ContainsSubstring("x, gamma, beta"));
  }
  SECTION("the attrs the op needs must be there") {
    auto h = g;
    h.tasks[0].fn = ir::op::softmax_grad;
    h.tasks[0].kind = ir::op_kind::softmax;
    h.tasks[0].reads = {x, y};
    CHECK_NOTHROW(h.validate());
    h.tasks[0].fn = ir::op::rope_grad; // needs head_dim and theta
    h.tasks[0].kind = ir::op_kind::elementwise;
    h.cost_only = false;
    CHECK_THROWS_WITH(h.validate(), ContainsSubstring("'ln'") && ContainsSubstring("rope_grad"));
  }
  SECTION("a collective's fn is its reduction") {
    auto h = g;
    h.tasks[1].fn = ir::op::gelu;
    CHECK_THROWS_WITH(h.validate(), ContainsSubstring("'y.ar'") && ContainsSubstring("fn 'gelu'") &&
                                        ContainsSubstring("sum, max or min"));
  }
}

TEST_CASE("builder prices every op by the table's rule", "[ir][builder][ops]") {
  ir::builder b("flops");
  const auto x = b.buffer("x", {4, 8}), y = b.buffer("y", {4, 8}), v = b.buffer("v", {8});
  const auto gelu = b.compute(ir::op::gelu, "gelu", {x}, {y});
  const auto grad = b.compute(ir::op::gelu_grad, "gelu.grad", {x, y}, {x});
  const auto bias = b.compute(ir::op::bias_grad, "bias.grad", {y}, {v});
  const auto g = std::move(b).finish();
  CHECK(g[gelu].flops == ir::info(ir::op::gelu).flops_per_element * 32);
  CHECK(g[grad].flops == ir::info(ir::op::gelu_grad).flops_per_element * 32);
  CHECK(g[bias].flops == ir::info(ir::op::bias_grad).flops_per_element * 32); // per element read
  CHECK(g[gelu].kind == ir::op_kind::elementwise);
}
