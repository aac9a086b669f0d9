// repeat lowering, vocab-parallel cross-entropy, batched matmul, and the GPT snippet end to end.
#define CONCERTO_SNIPPET_NO_MAIN
#include "../../examples/dsl_snippets/07_gpt.cpp"

#include <concerto/plan/verify.hpp>
#include <concerto/planner/make_plan.hpp>

#include <catch2/catch_test_macros.hpp>
#include <catch2/matchers/catch_matchers_string.hpp>

#include <algorithm>
#include <set>

using Catch::Matchers::ContainsSubstring;

namespace {
constexpr auto act = spec(shard(dp), replicate);
constexpr auto mlp_block = [](auto h) {
  return h + matmul(gelu(matmul(h, param<"fc1">(col))), param<"fc2">(row));
};
constexpr auto mlp_stack = program(mse(repeat<"layers">(mlp_block, input<"x">(act)), data<"y">(act)), sgd{});
const shape_map mlp_shapes{{"x", {8, 16}}, {"y", {8, 16}}, {"fc1", {16, 32}}, {"fc2", {32, 16}}};

const ir::task& task_named(const ir::graph& g, const std::string& name) {
  for (const auto& t : g.tasks)
    if (t.name == name) return t;
  FAIL("no task " << name);
  return g.tasks.front();
}
const ir::buffer* buffer_named(const ir::graph& g, const std::string& name) {
  for (const auto& b : g.buffers)
    if (b.name == name) return &b;
  return nullptr;
}
int count(const ir::graph& g, ir::op_kind k, int axis = -2, int layer = -2) {
  int n = 0;
  for (const auto& t : g.tasks) n += t.kind == k && (axis == -2 || t.axis == axis) && (layer == -2 || t.layer == layer);
  return n;
}
std::string read_name(const ir::graph& g, const ir::task& t, std::size_t i) {
  return g.buffers[static_cast<std::size_t>(t.reads.at(i))].name;
}
shape_map gpt_shapes(std::int64_t vocab = 64, std::int64_t hidden = 16) {
  return {{"ids", {2, 8}},           {"labels", {2, 8}},           {"wte", {vocab, hidden}},  {"ln1.g", {hidden}},
          {"ln1.b", {hidden}},       {"wq", {hidden, hidden}},     {"wk", {hidden, hidden}},  {"wv", {hidden, hidden}},
          {"wo", {hidden, hidden}},  {"ln2.g", {hidden}},          {"ln2.b", {hidden}},       {"fc1", {hidden, 4 * hidden}},
          {"fc2", {4 * hidden, hidden}}, {"lnf.g", {hidden}},      {"lnf.b", {hidden}},       {"head", {hidden, vocab}}};
}
} // namespace

TEST_CASE("a repeated block lowers to one copy per layer", "[dsl][repeat][lower]") {
  const auto m = mesh::from_world(4, {{"dp", 2}, {"tp", 2}});
  const int depth = 3;
  const auto g = lower(mlp_stack, mlp_shapes, m, {.depth = {{"layers", depth}}});
  SECTION("every task of layer i is stamped with layer i, forward, backward and optimizer alike") {
    const int per_layer = static_cast<int>(std::count_if(g.tasks.begin(), g.tasks.end(), [](auto& t) { return t.layer == 0; }));
    CHECK(per_layer == 5 + 9 + 2); // forward: 2 matmuls, gelu, all-reduce, add; backward 9; two updates
    for (int l = 0; l < depth; ++l) {
      CHECK(std::count_if(g.tasks.begin(), g.tasks.end(), [&](auto& t) { return t.layer == l; }) == per_layer);
      for (auto ph : {ir::phase::forward, ir::phase::backward, ir::phase::optimizer})
        CHECK(std::any_of(g.tasks.begin(), g.tasks.end(), [&](auto& t) { return t.layer == l && t.step_phase == ph; }));
    }
    for (const auto& t : g.tasks) {
      CHECK(t.layer >= -1);
      CHECK(t.layer < depth);
      // Layer 0's input gradient is also the stack input's gradient, and keeps its name.
      if (t.layer >= 0 && t.name != "x.grad") CHECK(t.name.starts_with("layers." + std::to_string(t.layer) + "."));
      else CHECK_FALSE(t.name.starts_with("layers."));
    }
  }
  SECTION("forward runs the layers up, backward down") {
    int last_fwd = -1, last_bwd = depth;
    for (const auto& t : g.tasks) {
      if (t.layer < 0) continue;
      if (t.step_phase == ir::phase::forward) {
        CHECK(t.layer >= last_fwd);
        last_fwd = t.layer;
      } else if (t.step_phase == ir::phase::backward) {
        CHECK(t.layer <= last_bwd);
        last_bwd = t.layer;
      }
    }
    CHECK(last_fwd == depth - 1);
    CHECK(last_bwd == 0);
  }
  SECTION("layer 0 reads the stack's input, layer i the output of layer i-1, and the loss the last layer's") {
    const auto add = mlp_stack.name_of(mlp_stack.repeats[0].out);
    const auto first = mlp_stack.name_of(mlp_stack.nodes[mlp_stack.repeats[0].out].in[1] - 4); // the block's first matmul
    CHECK(read_name(g, task_named(g, "layers.0." + first), 0) == "x");
    CHECK(read_name(g, task_named(g, "layers.1." + first), 0) == "layers.0." + add);
    CHECK(read_name(g, task_named(g, "layers.2." + first), 0) == "layers.1." + add);
    const auto& loss = *std::find_if(g.tasks.begin(), g.tasks.end(), [](auto& t) { return t.fn == ir::op::mse; });
    CHECK(read_name(g, loss, 0) == "layers.2." + add);
  }
  SECTION("parameters, gradients and updates are per layer; the stack's input has one gradient") {
    for (int l = 0; l < depth; ++l) {
      const auto prefix = "layers." + std::to_string(l) + ".";
      REQUIRE(buffer_named(g, prefix + "fc1") != nullptr);
      CHECK(buffer_named(g, prefix + "fc1")->shape == std::vector<std::int64_t>{16, 16});
      CHECK(buffer_named(g, prefix + "fc1")->role == ir::buffer_role::param);
      CHECK(buffer_named(g, prefix + "fc2.grad") != nullptr);
      const auto& upd = task_named(g, prefix + "fc1.update");
      CHECK(g.buffers[static_cast<std::size_t>(upd.writes.at(0))].name == prefix + "fc1");
      CHECK(read_name(g, upd, 1) == prefix + "fc1.grad");
    }
    CHECK(buffer_named(g, "fc1") == nullptr);
    CHECK(buffer_named(g, "x.grad") != nullptr);
    CHECK(buffer_named(g, "layers.1.x.grad") == nullptr);
  }
  SECTION("the last layer's backward starts from the loss gradient, the others from the next layer's input gradient") {
    const int grad_in = mlp_stack.repeats[0].grad_in;
    CHECK(mlp_stack.name_of(grad_in) == "x.grad"); // layer 0's
    const auto gi = std::string(to_string(mlp_stack.nodes[grad_in].op)) + "#" + std::to_string(grad_in);
    const auto go = mlp_stack.name_of(mlp_stack.repeats[0].grad_out);
    CHECK(go == "mse_grad#11");
    const auto reads_of = [&](int layer) {
      std::set<std::string> names;
      for (const auto& t : g.tasks)
        if (t.layer == layer && t.step_phase == ir::phase::backward)
          for (std::size_t i = 0; i < t.reads.size(); ++i) names.insert(read_name(g, t, i));
      return names;
    };
    CHECK(reads_of(2).count(go) == 1);
    CHECK(reads_of(1).count(go) == 0);
    CHECK(reads_of(1).count("layers.2." + gi) == 1);
    CHECK(reads_of(0).count("layers.1." + gi) == 1);
  }
  SECTION("the collectives are the block's times the depth") {
    CHECK(count(g, ir::op_kind::all_reduce, 1) == mlp_stack.count_unrolled({depth}, collective::all_reduce, tp));
    CHECK(count(g, ir::op_kind::all_reduce, 1) == depth * mlp_stack.count_in("layers", collective::all_reduce, tp));
    CHECK(count(g, ir::op_kind::all_reduce, 0) == depth * 2);
    for (int l = 0; l < depth; ++l) CHECK(count(g, ir::op_kind::all_reduce, 1, l) == 2);
  }
}

TEST_CASE("lowering a repeat needs a sensible depth", "[dsl][repeat][lower]") {
  const auto m = mesh::from_world(4, {{"dp", 2}, {"tp", 2}});
  CHECK_THROWS_WITH(lower(mlp_stack, mlp_shapes, m), ContainsSubstring("no depth given for repeat 'layers'"));
  CHECK_THROWS_WITH(lower(mlp_stack, mlp_shapes, m, {.depth = {{"layers", 0}}}), ContainsSubstring("depth 0"));
  CHECK_THROWS_WITH(lower(mlp_stack, mlp_shapes, m, {.depth = {{"layers", 2}, {"layer", 2}}}),
                    ContainsSubstring("repeat 'layer', which the program does not have"));
  // A block whose spec is kept but whose shape is not cannot be stacked.
  constexpr auto widen = [](auto h) { return relu(matmul(h, param<"w">(spec(replicate, replicate)))); };
  constexpr auto widening = program(mse(repeat<"layers">(widen, input<"x">(act)), data<"y">(act)), sgd{});
  CHECK_NOTHROW(lower(widening, {{"x", {8, 16}}, {"y", {8, 16}}, {"w", {16, 16}}}, m, {.depth = {{"layers", 2}}}));
  CHECK_THROWS_WITH(lower(widening, {{"x", {8, 16}}, {"y", {8, 32}}, {"w", {16, 32}}}, m, {.depth = {{"layers", 2}}}),
                    ContainsSubstring("repeat 'layers': the block returns shape [8,32] but takes [8,16]"));
}

TEST_CASE("a GPT's collectives grow linearly with its depth", "[dsl][repeat][gpt]") {
  const auto m = mesh::from_world(4, {{"dp", 2}, {"tp", 2}});
  std::vector<int> tp_all_reduces, dp_all_reduces, tasks;
  for (int depth = 1; depth <= 4; ++depth) {
    const auto g = lower(gpt, gpt_shapes(), m, {.heads = 2, .depth = {{"layers", depth}}});
    tp_all_reduces.push_back(count(g, ir::op_kind::all_reduce, 1));
    dp_all_reduces.push_back(count(g, ir::op_kind::all_reduce, 0));
    tasks.push_back(static_cast<int>(g.tasks.size()));
    CHECK(tp_all_reduces.back() == gpt.count_unrolled({depth}, collective::all_reduce, tp));
  }
  for (std::size_t d = 1; d < tasks.size(); ++d) {
    CHECK(tp_all_reduces[d] - tp_all_reduces[d - 1] == gpt.count_in("layers", collective::all_reduce, tp));
    CHECK(dp_all_reduces[d] - dp_all_reduces[d - 1] == 10); // one per block parameter
    CHECK(tasks[d] - tasks[d - 1] == tasks[1] - tasks[0]);
  }
  CHECK(tp_all_reduces[0] == 4 + 1 + 3 + 1); // the block's, the embedding's, the cross-entropy's, the head's dx
}

TEST_CASE("the small GPT lowers to a graph the planner and the verifier accept", "[dsl][repeat][gpt][planner]") {
  const auto m = mesh::from_world(4, {{"dp", 2}, {"tp", 2}});
  const auto g = lower(gpt, gpt_shapes(), m, {.name = "gpt", .heads = 2, .depth = {{"layers", 2}}});
  SECTION("buffer names are unique and every layer has its parameters") {
    std::set<std::string> names;
    for (const auto& b : g.buffers) CHECK(names.insert(b.name).second);
    for (const char* p : {"wq", "wo", "fc1", "ln2.b"})
      for (int l = 0; l < 2; ++l) CHECK(names.count("layers." + std::to_string(l) + "." + p) == 1);
    CHECK(names.count("wte") == 1);
    CHECK(names.count("head") == 1);
  }
  SECTION("program_order plans it and plan::verify accepts the plan") {
    const auto p = planner::make_plan(g, cost::model::preset("h100x64"), {.policy = planner::policy::program_order});
    CHECK_NOTHROW(plan::verify(p));
    CHECK(p.graph.tasks.size() == g.tasks.size());
  }
}

TEST_CASE("vocab-parallel cross-entropy lowers to Megatron-LM's three all-reduces", "[dsl][cross_entropy][lower]") {
  const auto m = mesh::from_world(4, {{"dp", 2}, {"tp", 2}});
  const auto g = lower(gpt, gpt_shapes(64, 16), m, {.heads = 2, .depth = {{"layers", 1}}});
  const auto by_fn = [&](const std::string& fn) -> const ir::task& {
    const auto it = std::find_if(g.tasks.begin(), g.tasks.end(), [&](auto& t) { return ir::to_string(t.fn) == fn; });
    REQUIRE(it != g.tasks.end());
    return *it;
  };
  const auto writer_of = [&](ir::buffer_id b) -> const ir::task& {
    return *std::find_if(g.tasks.begin(), g.tasks.end(), [&](auto& t) { return t.writes.at(0) == b; });
  };
  SECTION("the row max is reduced with max, the target logit and sum of exponentials with sums") {
    const auto& mx = by_fn("vocab_ce_max");
    CHECK(mx.attr("rows") == 8);  // 2·8 tokens over dp=2
    CHECK(mx.attr("cols") == 32); // 64 vocabulary entries over tp=2
    const auto& target = by_fn("vocab_ce_target");
    const auto& max_reduce = writer_of(target.reads.at(2));
    CHECK(max_reduce.kind == ir::op_kind::all_reduce);
    CHECK(max_reduce.fn == ir::op::max);
    CHECK(max_reduce.axis == 1);
    CHECK(target.attr("vocab_axis") == 1);
    const auto& loss = by_fn("vocab_ce_loss");
    CHECK(loss.attr("global_rows") == 16);
    for (std::size_t i = 0; i < 2; ++i) {
      const auto& sum = writer_of(loss.reads.at(i));
      CHECK(sum.kind == ir::op_kind::all_reduce);
      CHECK(sum.fn == ir::op::sum);
      CHECK(sum.axis == 1);
      CHECK(sum.bytes == 8 * 4); // one float per local row
    }
  }
  SECTION("the gradient is local: the logits' shard, no collective") {
    const auto& grad = by_fn("vocab_ce_grad");
    CHECK(grad.step_phase == ir::phase::backward);
    CHECK(grad.reads.size() == 4);
    CHECK(g.buffers[static_cast<std::size_t>(grad.writes.at(0))].shape == std::vector<std::int64_t>{1, 8, 32});
    CHECK(grad.attr("vocab_axis") == 1);
    CHECK(count(g, ir::op_kind::all_gather) == 0);
  }
}

TEST_CASE("batched matmuls lower with their batch and shard it", "[dsl][matmul][lower]") {
  constexpr auto q = input<"q">(spec(shard(dp), replicate, replicate));
  constexpr auto k = input<"k">(spec(replicate, replicate, replicate));
  constexpr auto step = program(mse(matmul(q, k), data<"t">(spec(shard(dp), replicate, replicate))), sgd{},
                                on(dp));
  static_assert(step.count(op_code::shard_slice) == 1);           // k is sliced to q's batch
  static_assert(step.count(collective::all_gather, dp) == 1);     // k's gradient is gathered back
  static_assert(step.spec_of("k.grad") == spec(replicate, replicate, replicate));
  const auto g = lower(step, {{"q", {6, 4, 8}}, {"k", {6, 8, 5}}, {"t", {6, 4, 5}}}, mesh::from_world(3, {{"dp", 3}}));
  std::vector<const ir::task*> mm;
  for (const auto& t : g.tasks)
    if (t.kind == ir::op_kind::matmul) mm.push_back(&t);
  REQUIRE(mm.size() == 3);
  SECTION("forward: batch 2 (6 over dp=3), m=4, n=5, k=8") {
    CHECK(mm[0]->attr("batch") == 2);
    CHECK(mm[0]->attr("m") == 4);
    CHECK(mm[0]->attr("n") == 5);
    CHECK(mm[0]->attr("k") == 8);
    CHECK(mm[0]->flops == 2.0 * 2 * 4 * 5 * 8);
  }
  SECTION("backward: dq = g·kᵀ and dk = qᵀ·g, batch by batch") {
    const auto dq = std::find_if(mm.begin(), mm.end(), [](auto* t) { return t->attr("trans_b") == 1; });
    const auto dk = std::find_if(mm.begin(), mm.end(), [](auto* t) { return t->attr("trans_a") == 1; });
    REQUIRE(dq != mm.end());
    REQUIRE(dk != mm.end());
    CHECK((*dq)->attr("batch") == 2);
    CHECK((*dq)->attr("m") == 4);
    CHECK((*dq)->attr("n") == 8);
    CHECK((*dq)->attr("k") == 5);
    CHECK((*dk)->attr("batch") == 2);
    CHECK((*dk)->attr("m") == 8);
    CHECK((*dk)->attr("n") == 5);
    CHECK((*dk)->attr("k") == 4);
  }
  SECTION("the sliced operand and the gathered gradient have the local and global batch") {
    const auto& slice = *std::find_if(g.tasks.begin(), g.tasks.end(), [](auto& t) { return t.fn == ir::op::shard_slice; });
    CHECK(g.buffers[static_cast<std::size_t>(slice.writes.at(0))].shape == std::vector<std::int64_t>{2, 8, 5});
    CHECK(buffer_named(g, "k.grad")->shape == std::vector<std::int64_t>{6, 8, 5});
  }
}

namespace {
// The mlp stack on features without gradient, and the same under ZeRO-3 (whose weights are
// gathered again for backward: also for the matmul that makes the stack input's gradient).
constexpr auto frozen_stack =
    program(mse(repeat<"layers">(mlp_block, input<"x">(act, no_grad)), data<"y">(act)), sgd{});
constexpr auto zero3_stack =
    program(mse(repeat<"layers">(mlp_block, input<"x">(act)), data<"y">(act)), zero<3>(sgd{}, dp));
constexpr auto frozen_zero3_stack =
    program(mse(repeat<"layers">(mlp_block, input<"x">(act, no_grad)), data<"y">(act)), zero<3>(sgd{}, dp));

int backward_count(const ir::graph& g, ir::op_kind k, int axis, int layer) {
  return static_cast<int>(std::count_if(g.tasks.begin(), g.tasks.end(), [&](auto& t) {
    return t.step_phase == ir::phase::backward && t.kind == k && (axis == -2 || t.axis == axis) && t.layer == layer;
  }));
}
// Tasks whose result no task reads and the step does not expose (the loss, a ".grad", a parameter
// or optimizer state): work done for nothing.
std::vector<std::string> unread_results(const ir::graph& g) {
  std::vector<char> read(g.buffers.size(), 0);
  for (const auto& t : g.tasks)
    for (auto r : t.reads)
      for (const auto& b : g.buffers) read[static_cast<std::size_t>(b.id)] |= g.overlap(r, b.id);
  std::vector<std::string> out;
  for (const auto& t : g.tasks) {
    bool needed = t.kind == ir::op_kind::loss && t.step_phase == ir::phase::forward;
    for (auto w : t.writes) {
      const auto& b = g.buffers[static_cast<std::size_t>(w)];
      needed = needed || read[static_cast<std::size_t>(w)] || b.name.ends_with(".grad") ||
               b.role == ir::buffer_role::param || b.role == ir::buffer_role::optimizer_state;
    }
    if (!needed) out.push_back(t.name);
  }
  return out;
}
} // namespace

TEST_CASE("a stack whose input has no gradient does not compute layer 0's input gradient", "[dsl][repeat][lower][no_grad]") {
  const auto m = mesh::from_world(4, {{"dp", 2}, {"tp", 2}});
  const int depth = 3;
  const auto with = lower(mlp_stack, mlp_shapes, m, {.depth = {{"layers", depth}}});
  const auto without = lower(frozen_stack, mlp_shapes, m, {.depth = {{"layers", depth}}});
  SECTION("layer 0 has neither the matmul nor the tp all-reduce nor the residual add of the input gradient") {
    // Backward per layer with gradient: 4 matmuls (dA, dB of both), tp all-reduce of dA of fc1, the residual add.
    CHECK(backward_count(with, ir::op_kind::matmul, -2, 0) == 4);
    CHECK(backward_count(with, ir::op_kind::all_reduce, 1, 0) == 1);
    CHECK(backward_count(without, ir::op_kind::matmul, -2, 0) == 3);
    CHECK(backward_count(without, ir::op_kind::all_reduce, 1, 0) == 0);
    CHECK(backward_count(without, ir::op_kind::elementwise, -2, 0) == backward_count(with, ir::op_kind::elementwise, -2, 0) - 1);
    CHECK(with.tasks.size() - without.tasks.size() == 3);
    CHECK(buffer_named(with, "x.grad") != nullptr);
    CHECK(buffer_named(without, "x.grad") == nullptr);
  }
  SECTION("the other layers, which feed the layer below, keep it; so do the weight gradients of layer 0") {
    for (int l = 1; l < depth; ++l) {
      CHECK(backward_count(without, ir::op_kind::matmul, -2, l) == 4);
      CHECK(backward_count(without, ir::op_kind::all_reduce, 1, l) == 1);
    }
    CHECK(backward_count(without, ir::op_kind::all_reduce, 0, 0) == 2); // fc1.grad, fc2.grad over dp
    for (const char* p : {"fc1", "fc2"}) {
      const auto& upd = task_named(without, std::string("layers.0.") + p + ".update");
      CHECK(read_name(without, upd, 1) == std::string("layers.0.") + p + ".grad");
    }
  }
  SECTION("every task's result is read or exposed, with the input's gradient or without") {
    CHECK(unread_results(with).empty());
    CHECK(unread_results(without).empty());
    CHECK(unread_results(lower(gpt, gpt_shapes(), m, {.heads = 2, .depth = {{"layers", 2}}})).empty());
  }
  SECTION("the pruned graph is planned and verified; no buffer is left that no task uses") {
    const auto p = planner::make_plan(without, cost::model::preset("h100x64"), {.policy = planner::policy::program_order});
    CHECK_NOTHROW(plan::verify(p));
    for (const auto& b : without.buffers) {
      CAPTURE(b.name);
      CHECK(std::any_of(without.tasks.begin(), without.tasks.end(), [&](auto& t) {
        return std::any_of(t.reads.begin(), t.reads.end(), [&](auto r) { return without.overlap(r, b.id); }) ||
               std::any_of(t.writes.begin(), t.writes.end(), [&](auto w) { return without.overlap(w, b.id); });
      }));
    }
  }
  SECTION("under ZeRO-3, the weight gathered again for that matmul is not gathered") {
    const auto z = lower(zero3_stack, mlp_shapes, m, {.depth = {{"layers", depth}}});
    const auto frozen = lower(frozen_zero3_stack, mlp_shapes, m, {.depth = {{"layers", depth}}});
    CHECK(backward_count(z, ir::op_kind::all_gather, 0, 0) == 2); // fc2 for its dA, fc1 for its dA
    CHECK(backward_count(frozen, ir::op_kind::all_gather, 0, 0) == 1);
    CHECK(backward_count(frozen, ir::op_kind::all_gather, 0, 1) == 2);
    CHECK(unread_results(frozen).empty());
  }
}
