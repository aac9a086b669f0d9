#include <concerto/concerto.hpp>
#include <concerto/runtime/kernel_call.hpp>

#include <catch2/catch_test_macros.hpp>
#include <catch2/matchers/catch_matchers_string.hpp>

#include <random>

using namespace concerto;
using Catch::Matchers::ContainsSubstring;

namespace {
inline constexpr axis<"dp"> dp;
inline constexpr axis<"tp"> tp;
constexpr auto act = spec(shard(dp), replicate);
constexpr auto x = input<"x">(act);
constexpr auto w1 = param<"w1">(spec(replicate, shard(tp)));
constexpr auto w2 = param<"w2">(spec(shard(tp), replicate));
constexpr auto loss = mse(matmul(gelu(matmul(x, w1)), w2), input<"target">(act));
constexpr auto step = program(loss, sgd{});

shape_map mlp_shapes(std::int64_t batch = 8, std::int64_t hidden = 16, std::int64_t ffn = 32) {
  return {{"x", {batch, hidden}}, {"target", {batch, hidden}}, {"w1", {hidden, ffn}}, {"w2", {ffn, hidden}}};
}
const ir::task& task_named(const ir::graph& g, const std::string& name) {
  for (const auto& t : g.tasks)
    if (t.name == name) return t;
  FAIL("no task " << name);
  return g.tasks.front();
}
const ir::buffer& buffer_named(const ir::graph& g, const std::string& name) {
  for (const auto& b : g.buffers)
    if (b.name == name) return b;
  FAIL("no buffer " << name);
  return g.buffers.front();
}
int count(const ir::graph& g, ir::op_kind k, int axis = -2) {
  int n = 0;
  for (const auto& t : g.tasks) n += t.kind == k && (axis == -2 || t.axis == axis);
  return n;
}
} // namespace

TEST_CASE("the DP x TP MLP lowers to the expected per-rank graph", "[dsl][lower]") {
  const auto m = mesh::from_world(4, {{"dp", 2, ir::link_class::inter_node}, {"tp", 2}});
  const auto g = lower(step, mlp_shapes(), m);
  SECTION("buffers have local shapes") {
    CHECK(buffer_named(g, "x").shape == std::vector<std::int64_t>{4, 16});
    CHECK(buffer_named(g, "w1").shape == std::vector<std::int64_t>{16, 16});
    CHECK(buffer_named(g, "w2").shape == std::vector<std::int64_t>{16, 16});
    CHECK(buffer_named(g, "w1").role == ir::buffer_role::param);
    CHECK(buffer_named(g, "w1.grad").role == ir::buffer_role::gradient);
    CHECK(buffer_named(g, "x").bytes == 4 * 16 * 4);
  }
  SECTION("forward matmuls carry m, n, k of the local operands") {
    const auto& fc1 = task_named(g, "matmul#2");
    CHECK(fc1.attr("m") == 4);
    CHECK(fc1.attr("n") == 16);
    CHECK(fc1.attr("k") == 16);
    CHECK(fc1.attr("trans_a") == 0);
    CHECK(fc1.flops == 2.0 * 4 * 16 * 16);
  }
  SECTION("the weight-gradient matmul reads the activation transposed") {
    const auto w2_grad_matmul = step.nodes[step.find("w2.grad")].in[0];
    const auto& t = task_named(g, step.name_of(w2_grad_matmul));
    CHECK(t.attr("trans_a") == 1);
    CHECK(t.attr("m") == 16); // ffn/tp rows of w2
    CHECK(t.attr("k") == 4);  // the local batch is contracted
    CHECK(t.attr("n") == 16);
    CHECK(t.step_phase == ir::phase::backward);
  }
  SECTION("collectives run on their axis's lane, as many as the program says") {
    CHECK(count(g, ir::op_kind::all_reduce, 1) == step.count(collective::all_reduce, tp));
    CHECK(count(g, ir::op_kind::all_reduce, 0) == step.count(collective::all_reduce, dp));
    for (const auto& t : g.tasks)
      if (ir::is_collective(t.kind)) CHECK(g.streams[static_cast<std::size_t>(t.stream)].axis == t.axis);
    const auto& fwd_ar = task_named(g, "all_reduce#7");
    CHECK(fwd_ar.axis == 1);
    CHECK(fwd_ar.bytes == 4 * 16 * 4);
    CHECK(fwd_ar.step_phase == ir::phase::forward);
  }
  SECTION("every op has its fn and the optimizer updates the parameters in place") {
    CHECK(task_named(g, "gelu#3").fn == ir::op::gelu);
    CHECK(task_named(g, "mse#8").fn == ir::op::mse);
    const auto& upd = task_named(g, "w1.update");
    CHECK(upd.fn == ir::op::sgd);
    CHECK(upd.kind == ir::op_kind::optimizer_update);
    CHECK(upd.step_phase == ir::phase::optimizer);
    CHECK(g.buffers[static_cast<std::size_t>(upd.writes.at(0))].name == "w1");
  }
  SECTION("the update of a weight waits for its gradient all-reduce") {
    const auto& upd = task_named(g, "w1.update");
    const auto ar = task_named(g, "w1.grad").id;
    CHECK(std::find(upd.deps.begin(), upd.deps.end(), ar) != upd.deps.end());
  }
}

TEST_CASE("lowering refuses shapes that do not fit", "[dsl][lower]") {
  const auto m = mesh::from_world(8, {{"dp", 4}, {"tp", 2}});
  SECTION("a dimension that does not divide names the tensor, dimension and axis") {
    auto shapes = mlp_shapes();
    shapes["x"] = {6, 16};
    shapes["target"] = {6, 16};
    CHECK_THROWS_WITH(lower(step, shapes, m),
                      ContainsSubstring("'x' dimension 0 (size 6)") && ContainsSubstring("'dp' (size 4)"));
    auto odd = mlp_shapes(8, 16, 33);
    CHECK_THROWS_WITH(lower(step, odd, m), ContainsSubstring("'w1' dimension 1") && ContainsSubstring("'tp'"));
  }
  SECTION("a mesh without an axis of the program names the axis and the leaf that uses it") {
    const auto dp_only = mesh::from_world(4, {{"dp", 4}});
    CHECK_THROWS_WITH(lower(step, mlp_shapes(), dp_only),
                      ContainsSubstring("mesh axis 'tp' (leaf 'w1' is split or summed over it), which the mesh does not have"));
  }
  SECTION("a missing shape names the leaf") {
    auto shapes = mlp_shapes();
    shapes.erase("w2");
    CHECK_THROWS_WITH(lower(step, shapes, m), ContainsSubstring("'w2'"));
  }
  SECTION("a shape of the wrong rank names the leaf and its spec") {
    auto shapes = mlp_shapes();
    shapes["w1"] = {16, 32, 2};
    CHECK_THROWS_WITH(lower(step, shapes, m), ContainsSubstring("'w1'") && ContainsSubstring("[R,tp]"));
  }
  SECTION("contracted sizes must agree") {
    auto shapes = mlp_shapes();
    shapes["w1"] = {24, 32};
    // The message shows the op as written, its operands by name.
    CHECK_THROWS_WITH(lower(step, shapes, m),
                      ContainsSubstring("matmul(x, w1): contracted sizes differ, 'x' [8,16] and 'w1' [24,32]"));
  }
  SECTION("a mesh without an axis the program uses is named") {
    CHECK_THROWS_WITH(lower(step, mlp_shapes(), mesh::from_world(4, {{"dp", 4}})), ContainsSubstring("'tp'"));
  }
}

TEST_CASE("ZeRO lowers to sharded storage and in-place updates", "[dsl][lower][zero]") {
  const auto m = mesh::from_world(4, {{"dp", 2}, {"tp", 2}});
  SECTION("ZeRO-3 stores a shard and gathers it") {
    constexpr auto z3 = program(loss, zero<3>(adamw{}, dp));
    const auto g = lower(z3, mlp_shapes(), m);
    CHECK(buffer_named(g, "w1").shape == std::vector<std::int64_t>{8, 16});
    CHECK(count(g, ir::op_kind::all_gather, 0) == 4);
    CHECK(count(g, ir::op_kind::reduce_scatter, 0) == 2);
    CHECK(buffer_named(g, "w1.m").role == ir::buffer_role::optimizer_state);
    CHECK(buffer_named(g, "w1.m").shape == std::vector<std::int64_t>{8, 16});
    const auto& upd = task_named(g, "w1.update");
    CHECK(upd.fn == ir::op::adamw);
    CHECK(upd.reads.size() == 4);
    CHECK(g.buffers[static_cast<std::size_t>(upd.writes.at(0))].name == "w1");
    // Each weight is split over dp along its first dimension not already split (w2 is [tp,dp]).
    for (const auto& t : g.tasks)
      if (t.kind == ir::op_kind::all_gather)
        CHECK(t.attr("dim", -1) == (g.buffers[static_cast<std::size_t>(t.reads[0])].name == "w1" ? 0 : 1));
  }
  SECTION("ZeRO-2 updates a shard and gathers it into the parameter") {
    constexpr auto z2 = program(loss, zero<2>(adamw{}, dp));
    const auto g = lower(z2, mlp_shapes(), m);
    CHECK(buffer_named(g, "w1").shape == std::vector<std::int64_t>{16, 16});
    CHECK(buffer_named(g, "w1.grad").shape == std::vector<std::int64_t>{8, 16});
    const auto& gather = task_named(g, "w1.new");
    CHECK(gather.kind == ir::op_kind::all_gather);
    CHECK(g.buffers[static_cast<std::size_t>(gather.writes.at(0))].name == "w1");
    CHECK(gather.step_phase == ir::phase::optimizer);
  }
}

namespace {
// The first task of `kind` that reads buffer `reads`.
const ir::task& task_reading(const ir::graph& g, ir::op_kind kind, const std::string& reads) {
  for (const auto& t : g.tasks)
    if (t.kind == kind && g.buffers[static_cast<std::size_t>(t.reads.at(0))].name == reads) return t;
  FAIL("no " << ir::to_string(kind) << " reads " << reads);
  return g.tasks.front();
}
const ir::buffer& buffer_of(const ir::graph& g, ir::buffer_id b) { return g.buffers[static_cast<std::size_t>(b)]; }
// The task that writes buffer b (exactly), or null.
const ir::task* writer_of(const ir::graph& g, ir::buffer_id b) {
  for (const auto& t : g.tasks)
    if (std::find(t.writes.begin(), t.writes.end(), b) != t.writes.end()) return &t;
  return nullptr;
}
using dims = std::vector<std::int64_t>;
} // namespace

TEST_CASE("ZeRO pads a parameter dimension that does not divide over its axis", "[dsl][lower][zero]") {
  // w1 [5, 32] is split by ZeRO on dimension 0 (5 rows over dp 2: 3 per rank, the last row of
  // rank 1 padding); w2 [32, 5] on dimension 1, after tp's split of dimension 0.
  const auto m = mesh::from_world(4, {{"dp", 2}, {"tp", 2}});
  const auto shapes = mlp_shapes(8, 5, 32);
  const auto decodes = [](const ir::graph& g) {
    for (const auto& t : g.tasks)
      if (!ir::is_collective(t.kind)) CHECK_NOTHROW(runtime::decode(g, t));
  };
  SECTION("ZeRO-3 stores ⌈n/P⌉ rows, gathers P·⌈n/P⌉ and reads the first n as the value") {
    constexpr auto z3 = program(loss, zero<3>(adamw{}, dp));
    const auto g = lower(z3, shapes, m);
    CHECK(buffer_named(g, "w1").shape == dims{3, 16});
    CHECK(buffer_named(g, "w1.m").shape == dims{3, 16});
    CHECK(buffer_named(g, "w1.grad").shape == dims{3, 16});
    CHECK(buffer_named(g, "w2").shape == dims{16, 3});
    // Dimension 0: the gathered rows' first 5 are a view, no copy.
    const auto& gathered = buffer_of(g, task_reading(g, ir::op_kind::all_gather, "w1").writes.at(0));
    CHECK(gathered.shape == dims{6, 16});
    int views = 0;
    for (const auto& b : g.buffers)
      if (b.view_of == gathered.id) views += b.shape == dims{5, 16} && b.offset == 0;
    CHECK(views == 1);
    const auto& scatter = *writer_of(g, buffer_named(g, "w1.grad").id);
    CHECK(scatter.kind == ir::op_kind::reduce_scatter);
    const auto& summed = buffer_of(g, scatter.reads.at(0));
    CHECK(summed.shape == dims{6, 16});
    CHECK(summed.view_of < 0);
    // Dimension 1, behind tp's rows: gathered whole and its first 5 columns copied out; the
    // gradient copied into a zeroed buffer of 6 columns before the reduce-scatter.
    const auto& gathered2 = buffer_of(g, task_reading(g, ir::op_kind::all_gather, "w2").writes.at(0));
    CHECK(gathered2.shape == dims{16, 6});
    const auto& unpad = task_reading(g, ir::op_kind::slice, gathered2.name);
    CHECK(buffer_of(g, unpad.writes.at(0)).shape == dims{16, 5});
    const auto& scatter2 = *writer_of(g, buffer_named(g, "w2.grad").id);
    CHECK(buffer_of(g, scatter2.reads.at(0)).shape == dims{16, 6});
    const auto* pad = writer_of(g, scatter2.reads.at(0));
    REQUIRE(pad != nullptr);
    CHECK(pad->fn == ir::op::concat);
    CHECK(pad->attr("extent") == 6);
    CHECK(buffer_of(g, pad->reads.at(0)).shape == dims{16, 5});
    decodes(g);
  }
  SECTION("ZeRO-1 keeps the parameter whole as the first rows of the buffer its shards are gathered into") {
    constexpr auto z1 = program(loss, zero<1>(adamw{}, dp));
    const auto g = lower(z1, shapes, m);
    const auto& w1 = buffer_named(g, "w1");
    CHECK(w1.shape == dims{5, 16});
    REQUIRE(w1.view_of >= 0);
    CHECK(buffer_of(g, w1.view_of).shape == dims{6, 16});
    CHECK(buffer_named(g, "w1.m").shape == dims{3, 16});
    const auto& gather = task_named(g, "w1.new");
    CHECK(gather.writes.at(0) == w1.view_of);
    // The shard of the parameter and of its gradient are this rank's 3 of the 6 rows.
    int slices = 0;
    for (const auto& t : g.tasks)
      if (t.fn == ir::op::shard_slice && t.reads.at(0) == w1.view_of) ++slices;
    CHECK(slices == 1);
    CHECK(buffer_named(g, "w2").shape == dims{16, 5});
    CHECK(task_reading(g, ir::op_kind::slice, "w2.new.padded").writes.at(0) == buffer_named(g, "w2").id);
    decodes(g);
  }
  SECTION("a split the user wrote must divide, and the message says what to change") {
    constexpr auto stored_split =
        program(mse(matmul(gelu(matmul(x, param<"w1">(spec(replicate, shard(tp)), stored(spec(shard(dp), shard(tp)))))), w2),
                    input<"target">(act)),
                zero<3>(adamw{}, dp));
    CHECK_THROWS_WITH(lower(stored_split, shapes, m),
                      ContainsSubstring("tensor 'w1' dimension 0 (size 5) does not divide over mesh axis 'dp' (size 2)") &&
                          ContainsSubstring("only a split that ZeRO adds is padded"));
  }
}

TEST_CASE("a GPT block lowers with attention attributes", "[dsl][lower][gpt]") {
  constexpr auto vec = spec(replicate);
  constexpr auto col = spec(replicate, shard(tp));
  constexpr auto row = spec(shard(tp), replicate);
  constexpr auto res = spec(shard(dp), shard(tp), replicate); // sequence parallel
  constexpr auto h = input<"x">(res);
  constexpr auto a = layernorm(h, param<"ln.g">(vec), param<"ln.b">(vec));
  constexpr auto att = causal_attention(matmul(a, param<"wq">(col)), matmul(a, param<"wk">(col)), matmul(a, param<"wv">(col)));
  constexpr auto blk = program(mse(h + matmul(att, param<"wo">(row)), data<"y">(res)), adamw{});
  const auto m = mesh::from_world(4, {{"dp", 2}, {"tp", 2}});
  const shape_map shapes{{"x", {4, 8, 32}}, {"y", {4, 8, 32}}, {"ln.g", {32}}, {"ln.b", {32}},
                         {"wq", {32, 32}}, {"wk", {32, 32}}, {"wv", {32, 32}}, {"wo", {32, 32}}};
  const auto g = lower(blk, shapes, m, {"gpt", 4});
  const auto& fwd = task_named(g, blk.name_of([&] {
    for (int i = 0; i < blk.size; ++i)
      if (blk.nodes[i].op == op_code::attention) return i;
    return -1;
  }()));
  CHECK(fwd.attr("batch") == 2);
  CHECK(fwd.attr("seq") == 8);   // gathered over tp before attention
  CHECK(fwd.attr("heads") == 2); // 4 heads split over tp = 2
  CHECK(fwd.attr("head_dim") == 8);
  CHECK(fwd.attr("causal") == 1);
  CHECK(count(g, ir::op_kind::all_gather, 1) == blk.count(collective::all_gather, tp));
  CHECK(count(g, ir::op_kind::reduce_scatter, 1) == blk.count(collective::reduce_scatter, tp));
  // dq, dk, dv are views of the packed attention gradient.
  int views = 0;
  for (const auto& b : g.buffers) views += b.view_of >= 0;
  CHECK(views == 3);
  CHECK(buffer_named(g, "x").shape == std::vector<std::int64_t>{2, 4, 32});
}

TEST_CASE("lowering keeps global sizes over random meshes", "[dsl][lower][property]") {
  std::mt19937 rng(7);
  for (int trial = 0; trial < 25; ++trial) {
    const int dps = 1 + static_cast<int>(rng() % 4), tps = 1 + static_cast<int>(rng() % 4);
    const auto m = mesh::from_world(dps * tps, {{"dp", dps}, {"tp", tps}});
    const std::int64_t batch = dps * (1 + rng() % 3), hidden = 4 * (1 + rng() % 3), ffn = tps * (1 + rng() % 5);
    const auto g = lower(step, mlp_shapes(batch, hidden, ffn), m);
    REQUIRE_NOTHROW(g.validate());
    // A leaf's local elements times the ranks that split it give its global size.
    CHECK(buffer_named(g, "x").bytes * dps == batch * hidden * 4);
    CHECK(buffer_named(g, "w1").bytes * tps == hidden * ffn * 4);
    CHECK(buffer_named(g, "w2.grad").bytes * tps == hidden * ffn * 4);
    CHECK(count(g, ir::op_kind::all_reduce) == 4);
    CHECK(g.tasks.size() == static_cast<std::size_t>(step.size - 4)); // leaves make no task
  }
}

TEST_CASE("Llama's ops lower to tasks the kernels decode: GQA extents, rope's head_dim, SwiGLU's packed gradient",
          "[dsl][lower][llama]") {
  constexpr auto col = spec(replicate, shard(tp));
  constexpr auto tokens = spec(shard(dp), replicate);
  constexpr auto h = input<"h">(spec(shard(dp), replicate, replicate));
  constexpr auto positions = data<"positions">(tokens);
  constexpr auto a = rmsnorm(h, param<"g">(spec(replicate)));
  constexpr auto att = causal_attention(rope(matmul(a, param<"wq">(col)), positions),
                                        rope(matmul(a, param<"wk">(col)), positions), matmul(a, param<"wv">(col)));
  constexpr auto row = spec(shard(tp), replicate);
  constexpr auto ff = swiglu(matmul(att, param<"w1">(row)), matmul(att, param<"w3">(row))); // pending sums made first
  constexpr auto llama = program(mse(ff, input<"target">(spec(shard(dp), replicate, replicate))), sgd{});
  // 8 query heads of 4 lanes, 2 k/v heads; tp = 2: 4 and 1 per rank.
  const shape_map shapes{{"h", {2, 6, 32}},  {"positions", {2, 6}}, {"g", {32}},  {"wq", {32, 32}},
                         {"wk", {32, 8}},    {"wv", {32, 8}},       {"w1", {32, 16}}, {"w3", {32, 16}},
                         {"target", {2, 6, 16}}};
  const auto m = mesh::from_world(4, {{"dp", 2}, {"tp", 2}});
  const auto g = lower(llama, shapes, m, {.heads = 8, .rope_theta = 500000});
  int ropes = 0, attentions = 0, packed = 0;
  for (const auto& t : g.tasks) {
    if (t.fn == ir::op::rope || t.fn == ir::op::rope_grad) {
      ++ropes;
      CHECK(t.attrs.at("head_dim") == 4);
      CHECK(t.attrs.at("theta") == 500000);
    }
    if (t.fn == ir::op::attention || t.fn == ir::op::attention_grad) {
      ++attentions;
      CHECK(t.attrs.at("heads") == 4);
      CHECK(t.attrs.at("kv_heads") == 1);
      CHECK(t.attrs.at("group") == 4);
    }
    if (t.fn == ir::op::attention_grad) // dq [1,6,16] then dk and dv [1,6,4] each
      CHECK(g.buffers[static_cast<std::size_t>(t.writes[0])].bytes == (96 + 2 * 24) * 4);
    if (t.fn == ir::op::swiglu_grad) {
      ++packed;
      CHECK(g.buffers[static_cast<std::size_t>(t.writes[0])].bytes == 2 * 96 * 4); // dgate, dup [1,6,16]
    }
  }
  CHECK(ropes == 4); // q and k, forward and backward
  CHECK(attentions == 2);
  CHECK(packed == 1);
  // Every task decodes (operand counts and sizes as the kernels need them).
  for (const auto& t : g.tasks)
    if (!ir::is_collective(t.kind)) CHECK_NOTHROW(runtime::decode(g, t));

  SECTION("k and v whose heads do not divide the query heads are refused, naming the ops") {
    auto bad = shapes;
    bad["wk"] = bad["wv"] = {32, 12}; // 3 heads of 4 lanes for 8 query heads
    CHECK_THROWS_WITH(lower(llama, bad, m, {.heads = 8}),
                      ContainsSubstring("attention(rope(matmul(…, wq), positions), rope(matmul(…, wk), positions)") &&
                          ContainsSubstring("divides the 8 query heads"));
  }
  SECTION("zero heads, or k and v narrower than one head, are refused instead of dividing by zero") {
    CHECK_THROWS_WITH(lower(llama, shapes, m, {.heads = 0}), ContainsSubstring("0 heads; attention needs at least one"));
    auto narrow = shapes;
    narrow["wk"] = narrow["wv"] = {32, 2}; // head_dim is 4 for 8 query heads of width 32
    CHECK_THROWS_WITH(lower(llama, narrow, m, {.heads = 8}), ContainsSubstring("divides the 8 query heads"));
  }
  SECTION("more k/v heads than the tensor-parallel ranks can split are refused") {
    CHECK_THROWS_WITH(lower(llama, shapes, mesh::from_world(4, {{"dp", 1}, {"tp", 4}}), {.heads = 8}),
                      ContainsSubstring("8 query heads and 2 k/v heads cannot be split over tp = 4 (4 ranks): every rank needs "
                                        "whole heads; make that number of ranks divide both head counts"));
  }
}

namespace {
inline constexpr axis<"ep"> ep;
template <moe_config Routing>
constexpr auto moe_layer() {
  constexpr auto h = input<"h">(spec(shard(dp, ep), replicate, replicate));
  constexpr auto gates = moe_route<Routing>(matmul(h, param<"router">(spec(replicate, replicate))));
  constexpr auto x = moe_dispatch(h, gates).to(spec(shard(ep), shard(dp), replicate));
  constexpr auto y = matmul(x, param<"w">(spec(shard(ep), replicate, replicate)));
  return program(mse(moe_combine(y, gates), input<"t">(spec(shard(dp, ep), replicate, replicate), no_grad)), sgd{});
}
constexpr auto moe_step = moe_layer<moe_config{.top_k = 2, .capacity_factor = 1.5}>();
shape_map moe_shapes(std::int64_t experts) {
  return {{"h", {8, 6, 4}}, {"router", {4, experts}}, {"w", {experts, 4, 4}}, {"t", {8, 6, 4}}};
}
} // namespace

TEST_CASE("an MoE layer lowers to routing, two all-to-alls on ep and the expert product", "[dsl][lower][moe]") {
  const auto m = mesh::from_world(4, {{"dp", 2}, {"ep", 2}});
  const auto g = lower(moe_step, moe_shapes(4), m);
  const int ep_axis = *m.index_of("ep");
  // Forward: dispatch out, combine back; backward: the same two, reversed.
  CHECK(count(g, ir::op_kind::all_to_all, ep_axis) == 4);
  CHECK(count(g, ir::op_kind::all_to_all) == 4);
  for (const auto& t : g.tasks) {
    if (t.fn != ir::op::moe_route && t.fn != ir::op::moe_dispatch && t.fn != ir::op::moe_combine) continue;
    CAPTURE(t.name);
    CHECK(t.attr("experts") == 4);
    CHECK(t.attr("group") == 6);
    CHECK(t.attr("capacity") == 5); // ⌈2 · 6 · 1.5 / 4⌉
  }
  // The dispatched slots: [experts, groups·capacity, h] with 2 of 8 groups per rank, and 2 of 4
  // experts per rank after the exchange (a batched product of 2).
  bool found = false;
  for (const auto& t : g.tasks)
    if (t.fn == ir::op::moe_dispatch) {
      found = true;
      CHECK(g.buffers[static_cast<std::size_t>(t.writes[0])].shape == std::vector<std::int64_t>{4, 10, 4});
    } else if (t.kind == ir::op_kind::matmul && t.step_phase == ir::phase::forward && t.attr("batch", 1) == 2) {
      CHECK(t.attr("m") == 20);
    }
  CHECK(found);
  // Every task decodes: the kernels accept what the lowering emits.
  for (const auto& t : g.tasks)
    if (!ir::is_collective(t.kind)) CHECK_NOTHROW(runtime::decode(g, t));
}

TEST_CASE("an MoE layer refuses top_k above its experts and experts that do not divide over ep", "[dsl][lower][moe]") {
  const auto m = mesh::from_world(4, {{"dp", 1}, {"ep", 4}});
  CHECK_THROWS_WITH(lower(moe_layer<moe_config{.top_k = 3}>(), moe_shapes(2), mesh::from_world(2, {{"dp", 1}, {"ep", 2}})),
                    ContainsSubstring("top_k 3 is more than the 2 experts"));
  // Said as experts, not as a generated tensor's dimension 0.
  CHECK_THROWS_WITH(lower(moe_step, moe_shapes(6), m),
                    ContainsSubstring("the 6 experts of ") &&
                        ContainsSubstring(" do not divide over mesh axis 'ep' (size 4); give the layer a multiple of 4 "
                                          "experts, or 'ep' a size that divides 6"));
}

TEST_CASE("a loss that is a sum of losses differentiates each term", "[dsl][lower][autodiff]") {
  constexpr auto xin = input<"x">(act);
  constexpr auto t = input<"t">(act, no_grad);
  constexpr auto two = program(mse(matmul(xin, param<"wa">(spec(replicate, replicate))), t) +
                                   mse(matmul(xin, param<"wb">(spec(replicate, replicate))), t),
                               sgd{});
  static_assert(two.find("wa.grad") >= 0 && two.find("wb.grad") >= 0);
  const auto g = lower(two, {{"x", {8, 4}}, {"t", {8, 4}}, {"wa", {4, 4}}, {"wb", {4, 4}}}, mesh::from_world(2, {{"dp", 2}, {"tp", 1}}));
  int loss_grads = 0;
  for (const auto& task : g.tasks) loss_grads += task.fn == ir::op::mse_grad;
  CHECK(loss_grads == 2);
  // Each term's gradient is the gradient of the sum: the kernels take dloss = 1.
  for (const auto& task : g.tasks)
    if (task.fn == ir::op::mse_grad) CHECK(task.attr("dloss_num", 1) == task.attr("dloss_den", 1));
}

TEST_CASE("the Evoformer pair stack over dap exchanges rows and columns by all-to-alls", "[dsl][lower][dap]") {
  // examples/evoformer's model: row attention on the row split, column attention after a
  // transpose and an all-to-all, and back.
  constexpr auto dap = axis<"dap">{};
  constexpr auto rows = spec(shard(dap), replicate, replicate);
  constexpr auto z = input<"z">(rows); // with a gradient: both exchanges run backward too
  constexpr auto w = param<"w">(spec(replicate, replicate));
  constexpr auto zt = transpose(z).to(rows);
  constexpr auto y = transpose(matmul(sigmoid(zt) * attention(matmul(zt, w), zt, zt), w)).to(rows);
  constexpr auto stack = program(mse(z + y, input<"t">(rows, no_grad)), sgd{});
  static_assert(stack.count(collective::all_to_all, dap) == 4); // there and back, forward and backward
  const auto m = mesh::from_world(4, {{"dap", 4}});
  const auto g = lower(stack, {{"z", {8, 8, 4}}, {"t", {8, 8, 4}}, {"w", {4, 4}}}, m, {.heads = 2});
  for (const auto& t : g.tasks) {
    if (t.fn == ir::op::attention || t.fn == ir::op::attention_grad) CHECK(t.attr("causal") == 0);
    if (t.kind == ir::op_kind::all_to_all) CHECK(t.axis == *m.index_of("dap"));
    if (!ir::is_collective(t.kind)) CHECK_NOTHROW(runtime::decode(g, t));
  }
  // A pair dimension that does not divide over dap names the tensor, the dimension and the axis.
  CHECK_THROWS_WITH(lower(stack, {{"z", {6, 6, 4}}, {"t", {6, 6, 4}}, {"w", {4, 4}}}, m, {.heads = 2}),
                    ContainsSubstring("'z' dimension 0 (size 6) does not divide over mesh axis 'dap' (size 4)"));
}

TEST_CASE("unflatten is a view whose parts must divide; transpose<d> swaps a pair inside the tensor", "[dsl][lower][reshape]") {
  // [rows·4, h] split over dp as [rows, 4, h], transposed to [rows, h, 4] and merged back.
  constexpr auto swapped = program(mse(flatten<1, 2>(transpose<1>(unflatten<0, 4>(input<"x">(spec(shard(dp), replicate), no_grad)))),
                                       input<"target">(spec(shard(dp), replicate))),
                                   sgd{}, on(dp));
  const auto m = mesh::from_world(2, {{"dp", 2}});
  const auto g = lower(swapped, {{"x", {16, 3}}, {"target", {4, 12}}}, m);
  int transposes = 0;
  for (const auto& t : g.tasks) {
    if (t.fn != ir::op::transpose) continue;
    ++transposes; // [2 rows of this rank, 4, 3] -> [2, 3, 4]
    CHECK(t.attr("outer") == 2);
    CHECK(t.attr("rows") == 4);
    CHECK(t.attr("cols") == 3);
    CHECK(t.attr("inner") == 1);
    CHECK_NOTHROW(runtime::decode(g, t));
  }
  CHECK(transposes == 1); // x has no gradient: the forward's alone
  // No task views: an unflatten is the operand's buffer in another shape.
  for (const auto& t : g.tasks) CHECK(t.fn != ir::op::unflatten);
  // Parts that do not divide the dim, and a first part whose split over dp does not divide.
  CHECK_THROWS_WITH(lower(swapped, {{"x", {18, 3}}, {"target", {4, 12}}}, m),
                    ContainsSubstring("does not divide into parts of 4") && ContainsSubstring("unflatten<Dim, Inner>"));
  CHECK_THROWS_WITH(lower(swapped, {{"x", {12, 3}}, {"target", {3, 12}}}, mesh::from_world(2, {{"dp", 2}})),
                    ContainsSubstring("does not divide over mesh axis 'dp'"));
}
