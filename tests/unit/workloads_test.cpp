#include "../../examples/llama/model.hpp"
#include "../../examples/vit/model.hpp"
#include "../../examples/wresnet/model.hpp"

#include <concerto/ir/task_attrs.hpp>
#include <concerto/ir/workloads.hpp>

#include <catch2/catch_test_macros.hpp>
#include <catch2/generators/catch_generators.hpp>
#include <catch2/generators/catch_generators_range.hpp>
#include <catch2/matchers/catch_matchers_floating_point.hpp>
#include <catch2/matchers/catch_matchers_string.hpp>

#include <map>
#include <set>
#include <tuple>

using namespace concerto;
using Catch::Matchers::ContainsSubstring;
using Catch::Matchers::WithinRel;

namespace {

// (kind, axis name, phase) -> count, for the tasks of one layer.
using census = std::map<std::tuple<ir::op_kind, std::string, ir::phase>, int>;

census collectives_of_layer(const ir::graph& g, int layer) {
  census c;
  for (const auto& t : g.tasks)
    if (t.layer == layer && ir::is_collective(t.kind))
      ++c[{t.kind, g.axes[static_cast<std::size_t>(t.axis)].name, t.step_phase}];
  return c;
}

// Each task of one layer as (phase, kind, fn, mesh axis): what a block of a workload and the
// DSL's lowering of the same block must share. Collectives on axes of size 1 move nothing and are
// left out (a DSL mesh may name an axis the workload does not have).
using block_signature = std::multiset<std::tuple<ir::phase, ir::op_kind, ir::op, std::string>>;
block_signature block(const ir::graph& g, int layer) {
  block_signature out;
  for (const auto& t : g.tasks)
    if (t.layer == layer && (t.axis < 0 || g.axes[static_cast<std::size_t>(t.axis)].size > 1))
      out.insert({t.step_phase, t.kind, t.fn, t.axis >= 0 ? g.axes[static_cast<std::size_t>(t.axis)].name : ""});
  return out;
}

double flops_of_layer(const ir::graph& g, int layer, ir::phase p) {
  double sum = 0;
  for (const auto& t : g.tasks)
    if (t.layer == layer && t.step_phase == p)
      sum += t.flops;
  return sum;
}

const ir::buffer& buf(const ir::graph& g, ir::buffer_id b) { return g.buffers[static_cast<std::size_t>(b)]; }

// The task of that name; fails the test (rather than checking nothing) when there is none.
const ir::task& task_named(const ir::graph& g, std::string_view name) {
  for (const auto& t : g.tasks)
    if (t.name == name)
      return t;
  FAIL("no task named " << name);
  throw std::logic_error("unreachable");
}

std::vector<std::string> dep_names(const ir::graph& g, const ir::task& t) {
  std::vector<std::string> out;
  for (auto d : t.deps)
    out.push_back(g[d].name);
  return out;
}

constexpr auto fwd = ir::phase::forward;
constexpr auto bwd = ir::phase::backward;
constexpr auto ag = ir::op_kind::all_gather;
constexpr auto rs = ir::op_kind::reduce_scatter;
constexpr auto ar = ir::op_kind::all_reduce;
constexpr auto a2a = ir::op_kind::all_to_all;

} // namespace

TEST_CASE("every workload is a valid, executable training step", "[ir][workloads]") {
  const auto name = GENERATE(from_range(ir::workload_names()));
  CAPTURE(name);
  const auto g = ir::make_workload(name, {.layers = 2});
  REQUIRE_NOTHROW(g.validate());
  REQUIRE(g.size() > 50);

  SECTION("tasks come in program order: forward, then backward, then the optimizer") {
    for (std::size_t i = 1; i < g.tasks.size(); ++i)
      CHECK(g.tasks[i - 1].step_phase <= g.tasks[i].step_phase);
    for (const auto& t : g.tasks)
      for (auto d : t.deps)
        CHECK(d < t.id);
    // The optimizer phase: the updates, and under ZeRO-2 the slices of the shards they update
    // and the gathers of the updated shards.
    for (const auto& t : g.tasks)
      CHECK((t.step_phase == ir::phase::optimizer) ==
            (t.kind == ir::op_kind::optimizer_update || (t.kind == ir::op_kind::all_gather && t.name.ends_with(".ag.update")) ||
             (t.fn == ir::op::shard_slice && t.name.ends_with(".shard"))));
  }
  SECTION("block tasks carry their layer, the others are embedding, head or loss") {
    // wresnet-dp's `layers` are blocks per stage: 2 in each of 4 stages, a stage's first strided
    // with a projection; the others' layers are blocks.
    const bool stages = name == "wresnet-dp";
    std::map<int, int> per_layer;
    for (const auto& t : g.tasks) {
      CHECK(t.layer >= -1);
      CHECK(t.layer < (stages ? 8 : 2));
      ++per_layer[t.layer];
      if (t.layer < 0) {
        CAPTURE(t.name);
        CHECK((t.name.starts_with("embed") || t.name.starts_with("head") || t.name.starts_with("loss")));
      } else {
        std::string prefix(1, 'L'); // appended: g++ 12 warns falsely on "L" + std::to_string(...)
        prefix += std::to_string(t.layer);
        CHECK(t.name.starts_with(prefix + '.'));
      }
    }
    CHECK(per_layer[0] == per_layer[stages ? 2 : 1]);
    CHECK(per_layer[0] > 20);
  }
  SECTION("every compute task names its function, every matmul and convolution its shape") {
    int matmuls = 0;
    for (const auto& t : g.tasks) {
      if (ir::is_collective(t.kind))
        continue;
      CAPTURE(t.name);
      CHECK(t.fn != ir::op::none);
      CHECK(!t.writes.empty());
      if (ir::info(t.fn).form == ir::task_form::convolution) {
        for (const auto key : ir::info(t.fn).attrs)
          if (!key.empty()) CHECK(t.attrs.contains(std::string(key)));
        const auto c = ir::conv_geometry::of(t);
        CHECK(t.flops == c.flops());
        const auto& out = buf(g, t.writes[0]);
        const auto values = t.fn == ir::op::conv2d ? c.y_values() : t.fn == ir::op::conv2d_grad_input ? c.x_values() : c.w_values();
        CHECK(out.bytes == values * static_cast<std::int64_t>(ir::size_of(out.type)));
        continue;
      }
      if (t.kind != ir::op_kind::matmul)
        continue;
      ++matmuls;
      for (const char* key : {"m", "n", "k", "batch", "trans_a", "trans_b"})
        CHECK(t.attrs.contains(key));
      CHECK(t.flops == 2.0 * static_cast<double>(t.attr("m") * t.attr("n")) * static_cast<double>(t.attr("k")));
      // The output buffer holds exactly m × n elements.
      const auto& out = buf(g, t.writes[0]);
      CHECK(out.bytes == t.attr("m") * t.attr("n") * static_cast<std::int64_t>(ir::size_of(out.type)));
    }
    CHECK(matmuls > 0);
  }
  SECTION("collective bytes follow the graph.hpp convention") {
    for (const auto& t : g.tasks) {
      if (!ir::is_collective(t.kind))
        continue;
      CAPTURE(t.name);
      const std::int64_t in = buf(g, t.reads.at(0)).bytes;
      const std::int64_t out = buf(g, t.writes.at(0)).bytes;
      const auto group = g.group_size(t);
      switch (t.kind) {
      case ir::op_kind::all_reduce:
        CHECK(in == out);
        CHECK(t.bytes == static_cast<double>(in));
        break;
      case ir::op_kind::all_gather:
        CHECK(out == group * in);
        CHECK(t.bytes == static_cast<double>(out));
        break;
      case ir::op_kind::reduce_scatter:
        CHECK(in == group * out);
        CHECK(t.bytes == static_cast<double>(in));
        break;
      case ir::op_kind::all_to_all:
        CHECK(in == out);
        CHECK(t.bytes == static_cast<double>(in));
        break;
      default:
        FAIL("unexpected collective " << ir::to_string(t.kind));
      }
    }
  }
  SECTION("the number of tasks grows linearly with the layers") {
    const auto n1 = ir::make_workload(name, {.layers = 1}).size();
    const auto n3 = ir::make_workload(name, {.layers = 3}).size();
    CHECK(g.size() - n1 == n3 - g.size());
    CHECK(n3 > g.size());
  }
}

TEST_CASE("gpt-dp all-reduces each parameter gradient over every rank", "[ir][workloads]") {
  const auto g = ir::make_workload("gpt-dp", {.layers = 3});
  REQUIRE(g.axes.size() == 1);
  CHECK(g.axes[0] == ir::mesh_axis{"dp", 32, ir::link_class::inter_node});
  // ln1, qkv, proj, ln2, fc1, fc2: six weights per block, one all-reduce each, in backward.
  for (int l = 0; l < 3; ++l)
    CHECK(collectives_of_layer(g, l) == census{{{ar, "dp", bwd}, 6}});
  // wte, wpe, final norm and the output head.
  CHECK(collectives_of_layer(g, -1) == census{{{ar, "dp", bwd}, 4}});

  SECTION("inside one node the data-parallel axis is intra-node") {
    const auto small = ir::make_workload("gpt-dp", {.layers = 1, .ranks = 8});
    CHECK(small.axes[0] == ir::mesh_axis{"dp", 8, ir::link_class::intra_node});
  }
  SECTION("a gradient's all-reduce directly follows the matmul that produces it") {
    CHECK(dep_names(g, task_named(g, "L1.mlp.down.w.grad.ar")) == std::vector<std::string>{"L1.mlp.down.wgrad"});
  }
}

TEST_CASE("gpt-zero3 gathers every parameter twice and reduce-scatters its gradient", "[ir][workloads]") {
  const auto g = ir::make_workload("gpt-zero3", {.layers = 3});
  for (int l = 0; l < 3; ++l)
    CHECK(collectives_of_layer(g, l) == census{{{ag, "dp", fwd}, 6}, {{ag, "dp", bwd}, 6}, {{rs, "dp", bwd}, 6}});

  SECTION("the optimizer updates the local shard only") {
    const auto& t = task_named(g, "L0.mlp.up.w.adamw");
    CHECK(t.attr("numel") == 2048 * 8192 / 32);
    REQUIRE(t.writes.size() == 2);
    CHECK(buf(g, t.writes[0]).bytes == 2048 * 8192 / 32 * 2);     // the bf16 shard
    CHECK(buf(g, t.writes[1]).bytes == 2048 * 8192 / 32 * 3 * 4); // master, m, v in f32
  }
  SECTION("a gather before each use: the first forward matmul waits for its weight's gather") {
    CHECK(dep_names(g, task_named(g, "L2.attn.qkv")) == std::vector<std::string>{"L2.ln1", "L2.attn.qkv.w.ag.fwd"});
    CHECK(dep_names(g, task_named(g, "L2.attn.qkv.dgrad")) ==
          std::vector<std::string>{"L2.attention.grad", "L2.attn.qkv.w.ag.bwd"});
  }
  SECTION("a parameter that does not split evenly is padded") {
    const auto odd = ir::make_workload("gpt-zero3", {.layers = 1, .ranks = 24});
    // 24 ranks: qkv's weight splits evenly, ln1's (2 × 2048 = 4096 elements) does not.
    const auto& gather = task_named(odd, "L0.attn.qkv.w.ag.fwd"); // 2048 × 6144 = 24 × 524288
    CHECK(buf(odd, gather.reads[0]).shape == std::vector<std::int64_t>{524288});
    const auto& ln = task_named(odd, "L0.ln1.w.ag.fwd"); // 4096 = 24 × 170 + 16: padded to 24 × 171
    CHECK(buf(odd, ln.reads[0]).shape == std::vector<std::int64_t>{171});
    CHECK(buf(odd, ln.writes[0]).shape == std::vector<std::int64_t>{24 * 171});
  }
}

TEST_CASE("vit-zero2 reduce-scatters every gradient and gathers every updated shard after the optimizer",
          "[ir][workloads]") {
  const auto g = ir::make_workload("vit-zero2", {.layers = 2});
  constexpr auto opt = ir::phase::optimizer;
  // q, k, v, proj, up, down and each layer norm's gain and shift.
  for (int l = 0; l < 2; ++l)
    CHECK(collectives_of_layer(g, l) == census{{{rs, "dp", bwd}, 10}, {{ag, "dp", opt}, 10}});
  SECTION("the kernels read whole parameters, the optimizer updates the rank's shard") {
    const auto& up = task_named(g, "L0.mlp.up");
    CHECK(buf(g, up.reads[1]).shape == std::vector<std::int64_t>{1280, 5120});
    const auto& step = task_named(g, "L0.mlp.up.w.adamw");
    CHECK(step.attr("numel") == 1280 * 5120 / 32);
    CHECK(buf(g, step.writes[0]).shape == std::vector<std::int64_t>{1280 * 5120 / 32});
    const auto& gather = task_named(g, "L0.mlp.up.w.ag.update");
    CHECK(gather.reads == std::vector<ir::buffer_id>{step.writes[0]});
    CHECK(buf(g, gather.writes[0]).shape == std::vector<std::int64_t>{1280, 5120});
    // The update may not overwrite the weights before the backward pass has read them.
    // (and the slice of this rank's shard out of it, as the DSL lowers ZeRO-2)
    CHECK(dep_names(g, gather) ==
          std::vector<std::string>{"L0.mlp.up", "L0.mlp.up.dgrad", "L0.mlp.up.w.shard", "L0.mlp.up.w.adamw"});
  }
  SECTION("a class token and 256 patches of 14 x 14 per image, embedded by a strided convolution; attention without a mask") {
    const auto& att = task_named(g, "L0.attention");
    CHECK(att.attr("seq") == 257);
    CHECK(att.attr("causal") == 0);
    const auto& embed = task_named(g, "embed");
    CHECK(embed.fn == ir::op::conv2d);
    CHECK(embed.attr("stride") == 14);
    CHECK(embed.attr("height") == 224);
    const auto& join = task_named(g, "embed.cls");
    CHECK(join.fn == ir::op::concat_dim);
    CHECK(join.attr("broadcast") == 1); // [1, 1280] repeated over the images
    CHECK(buf(g, join.reads[0]).shape == std::vector<std::int64_t>{1, 1280});
    CHECK(task_named(g, "embed.cls.grad").fn == ir::op::concat_dim_grad);
    CHECK(task_named(g, "head.cls").fn == ir::op::slice_dim);
    CHECK(task_named(g, "head.cls.grad").fn == ir::op::slice_dim_grad);
  }
}

TEST_CASE("vit-zero2 and the DSL's ViT under ZeRO-2 have the same tasks and collectives per block", "[ir][workloads][vit]") {
  // The workload mirrors examples/vit/model.hpp's lowering (tp = 1: ZeRO-2 over every rank, the
  // paper's ViT setting): compared per block as for Llama; the DSL's tp axis of size 1 left out.
  const auto workload = ir::make_workload("vit-zero2", {.layers = 2, .ranks = 8});
  const auto dsl = lower(vit_model::vit_tp, vit_model::shapes(8, 16, 64, 5), mesh::from_world(8, {{"dp", 8}, {"tp", 1}}),
                         {.heads = 4, .depth = {{"layers", 2}}});
  for (int layer = 0; layer < 2; ++layer) {
    CAPTURE(layer);
    const auto mine = block(workload, layer), theirs = block(dsl, layer);
    CHECK(mine.size() == theirs.size());
    CHECK(mine == theirs);
  }
}

TEST_CASE("llama-tp-sp follows Megatron's sequence-parallel pattern", "[ir][workloads]") {
  const auto g = ir::make_workload("llama-tp-sp", {.layers = 2});
  REQUIRE(g.axes.size() == 2);
  CHECK(g.axes[0] == ir::mesh_axis{"tp", 8, ir::link_class::intra_node});
  CHECK(g.axes[1] == ir::mesh_axis{"dp", 4, ir::link_class::inter_node});
  // Forward: gather before q, k, v and before gate, up; reduce-scatter after proj and down.
  // Backward (the DSL's form: the gathered inputs are kept, not gathered again): gather the
  // output gradients of proj and down, reduce-scatter the summed input gradients of q, k, v and
  // of gate, up, all-reduce the two norm gains' partial gradients over tp; and one data-parallel
  // all-reduce per weight (q, k, v, proj, gate, up, down and the two gains).
  for (int l = 0; l < 2; ++l)
    CHECK(collectives_of_layer(g, l) == census{{{ag, "tp", fwd}, 2},
                                               {{rs, "tp", fwd}, 2},
                                               {{ag, "tp", bwd}, 2},
                                               {{rs, "tp", bwd}, 2},
                                               {{ar, "tp", bwd}, 2},
                                               {{ar, "dp", bwd}, 9}});

  SECTION("local shapes are per rank") {
    const auto& q = task_named(g, "L0.attn.q"); // 64 heads × 128 / 8 columns per rank
    CHECK(q.attr("m") == 8192);
    CHECK(q.attr("n") == 1024);
    CHECK(q.attr("k") == 8192);
    CHECK(task_named(g, "L0.attn.k").attr("n") == 128); // 8 k/v heads: one per rank
    const auto& down = task_named(g, "L0.mlp.down");
    CHECK(down.attr("k") == 28672 / 8);
    CHECK(down.attr("n") == 8192);
    const auto& attention = task_named(g, "L0.attention");
    CHECK(attention.attr("heads") == 8);
    CHECK(attention.attr("kv_heads") == 1);
    CHECK(attention.attr("head_dim") == 128);
    CHECK(buf(g, task_named(g, "L0.resid1").writes[0]).shape == std::vector<std::int64_t>{1024, 8192});
  }
  SECTION("a reduce-scatter follows the row-parallel matmul and an all-gather precedes the column-parallel one") {
    CHECK(dep_names(g, task_named(g, "L1.attn.proj.out.rs")) == std::vector<std::string>{"L1.attn.proj"});
    CHECK(dep_names(g, task_named(g, "L1.mlp.up")) == std::vector<std::string>{"L1.ln2.out.ag"});
    // Backward: the summed data gradients of the column-parallel gate and up are reduce-scattered.
    CHECK(dep_names(g, task_named(g, "L1.mlp.in.grad.rs")) == std::vector<std::string>{"L1.mlp.gate.in.grad.sum"});
  }
}

TEST_CASE("gpt-ptd is tensor (sequence) parallel within a node and data parallel across", "[ir][workloads]") {
  const auto g = ir::make_workload("gpt-ptd", {.layers = 1, .ranks = 64});
  CHECK(g.axes[0] == ir::mesh_axis{"tp", 8, ir::link_class::intra_node});
  CHECK(g.axes[1] == ir::mesh_axis{"dp", 8, ir::link_class::inter_node});
  CHECK(collectives_of_layer(g, 0)[{ag, "tp", fwd}] == 2);
  CHECK(collectives_of_layer(g, 0)[{ar, "dp", bwd}] == 6);
}

TEST_CASE("moe-ep exchanges tokens with all-to-alls inside the node and reduces gradients by kind",
          "[ir][workloads][moe]") {
  const auto g = ir::make_workload("moe-ep", {.layers = 2});
  REQUIRE(g.axes.size() == 2);
  CHECK(g.axes[0] == ir::mesh_axis{"ep", 8, ir::link_class::intra_node});
  CHECK(g.axes[1] == ir::mesh_axis{"dp", 4, ir::link_class::inter_node});
  // Dispatch and combine in forward and backward; the seven non-expert weights (ln1, q, k, v,
  // proj, ln2, router) all-reduced in the node and then across nodes, the experts' three (w1, w3, w2) only across.
  for (int l = 0; l < 2; ++l)
    CHECK(collectives_of_layer(g, l) == census{{{a2a, "ep", fwd}, 2},
                                               {{a2a, "ep", bwd}, 2},
                                               {{ar, "ep", bwd}, 7},
                                               {{ar, "dp", bwd}, 10}});

  SECTION("each rank holds one expert and exchanges capacity-sized blocks") {
    // A sequence's 4096 tokens × top-2 over 8 experts: capacity 1024 slots per expert.
    const auto& dispatch = task_named(g, "L0.moe.dispatch.a2a");
    CHECK(buf(g, dispatch.reads[0]).shape == std::vector<std::int64_t>{8, 1024, 4096});
    CHECK(buf(g, dispatch.writes[0]).shape == std::vector<std::int64_t>{1, 8 * 1024, 4096});
    CHECK(dispatch.attr("from_dim") == 1);
    CHECK(dispatch.attr("to_dim") == 0);
    CHECK(dispatch.bytes == 8192.0 * 4096 * 2);
    const auto& up = task_named(g, "L0.moe.w1");
    CHECK(up.attr("batch") == 1);
    CHECK(up.attr("m") == 8192);
    CHECK(up.attr("n") == 14336);
    CHECK(up.attr("k") == 4096);
    CHECK(up.reads[0] == dispatch.writes[0]);
    CHECK(dep_names(g, task_named(g, "L0.moe.combine.a2a")) == std::vector<std::string>{"L0.moe.w2"});
    CHECK(dep_names(g, task_named(g, "L1.moe.dispatch.a2a.bwd")) == std::vector<std::string>{"L1.moe.experts.in.grad"});
  }
  SECTION("non-expert gradients are summed over both axes, expert gradients over dp only") {
    CHECK(dep_names(g, task_named(g, "L0.attn.q.w.grad.ar")) == std::vector<std::string>{"L0.attn.q.w.grad.ar.ep"});
    CHECK_NOTHROW(task_named(g, "L0.moe.router.w.grad.ar.ep"));
    for (const char* w : {"w1", "w2", "w3"}) {
      const auto& t = task_named(g, "L0.moe." + std::string(w) + ".grad.ar");
      CHECK(g.axes[static_cast<std::size_t>(t.axis)].name == "dp");
    }
  }
  SECTION("with two experts per rank, the expert matmuls are batched over them") {
    const auto g4 = ir::make_workload("moe-ep", {.layers = 1, .ranks = 16, .ranks_per_node = 4});
    CHECK(g4.axes[0] == ir::mesh_axis{"ep", 4, ir::link_class::intra_node});
    CHECK(task_named(g4, "L0.moe.w1").attr("batch") == 2);
    CHECK(task_named(g4, "L0.moe.w1").attr("m") == 4 * 1024);
    CHECK(buf(g4, task_named(g4, "L0.moe.dispatch.a2a").writes[0]).shape == std::vector<std::int64_t>{2, 4 * 1024, 4096});
    CHECK(collectives_of_layer(g4, 0)[{ar, "dp", bwd}] == 7 + 3);
  }
  SECTION("on one node there is no data-parallel axis, on one rank no all-to-all") {
    const auto one_node = ir::make_workload("moe-ep", {.layers = 1, .ranks = 8});
    CHECK(one_node.axes.size() == 1);
    CHECK(collectives_of_layer(one_node, 0)[{a2a, "ep", fwd}] == 2);
    const auto one_rank = ir::make_workload("moe-ep", {.layers = 1, .ranks = 1, .ranks_per_node = 1});
    CHECK(one_rank.axes.empty());
    CHECK(task_named(one_rank, "L0.moe.w2").attr("batch") == 8);
    CHECK(task_named(one_rank, "L0.moe.w2").attr("m") == 1024);
  }
}

TEST_CASE("moe-ep and the DSL's MoE block have the same tasks and collectives per block", "[ir][workloads][moe]") {
  // As for Llama below: the workload mirrors the lowering of examples/llama's make_moe (top-2 of
  // 8 experts over ep = 4, dp = 2). The DSL's mesh has a tp axis of size 1, whose collectives
  // move nothing and are left out of the comparison.
  const auto workload = ir::make_workload("moe-ep", {.layers = 2, .ranks = 8, .ranks_per_node = 4});
  static constexpr auto mixtral = llama_model::make_moe<llama_model::top2>();
  const auto dsl = lower(mixtral, llama_model::moe_shapes(8, 64, 80, 256, 4, 2, 8, 512),
                         mesh::from_world(8, {{"dp", 2}, {"ep", 4}, {"tp", 1}}), {.heads = 4, .depth = {{"layers", 2}}});
  for (int layer = 0; layer < 2; ++layer) {
    CAPTURE(layer);
    const auto mine = block(workload, layer), theirs = block(dsl, layer);
    CHECK(mine.size() == theirs.size());
    CHECK(mine == theirs);
  }
}

TEST_CASE("per-layer FLOPs match the analytic formula", "[ir][workloads][flops]") {
  // Attention is priced causal (half the 4·b·s²·h of a full square; its backward 2.5 times its
  // forward), as the op table prices the DSL's.
  SECTION("GPT: 24·b·s·h² + 2·b·s²·h forward; 48·b·s·h² + 5·b·s²·h backward") {
    const auto name = GENERATE(as<std::string>{}, "gpt-dp", "gpt-zero3");
    const int b = GENERATE(1, 2);
    CAPTURE(name, b);
    const auto g = ir::make_workload(name, {.layers = 2, .micro_batch = b});
    const double s = 2048, h = 2048;
    const double gemm = 24 * b * s * h * h, attention = 2 * b * s * s * h;
    for (int l = 0; l < 2; ++l) {
      CHECK_THAT(flops_of_layer(g, l, fwd), WithinRel(gemm + attention, 0.01));
      CHECK_THAT(flops_of_layer(g, l, bwd), WithinRel(2 * gemm + 2.5 * attention, 0.01));
    }
  }
  SECTION("Llama with GQA and SwiGLU on tp ranks: (2·b·s·h·(2h + 2·h_kv + 3f) + 2·b·s²·h) / tp") {
    const auto g = ir::make_workload("llama-tp-sp", {.layers = 1});
    const double s = 8192, h = 8192, h_kv = 8 * 128, f = 28672, tp = 8;
    const double gemm = 2 * s * h * (2 * h + 2 * h_kv + 3 * f) / tp, attention = 2 * s * s * h / tp;
    CHECK_THAT(flops_of_layer(g, 0, fwd), WithinRel(gemm + attention, 0.01));
    CHECK_THAT(flops_of_layer(g, 0, bwd), WithinRel(2 * gemm + 2.5 * attention, 0.01));
  }
  SECTION("MoE, top-k of E experts, per rank: 2·b·s·h·(2h + 2·h_kv + E + 3·k·f) + 2·b·s²·h") {
    const int b = GENERATE(1, 2);
    const auto g = ir::make_workload("moe-ep", {.layers = 1, .micro_batch = b});
    const double s = 4096, h = 4096, h_kv = 8 * 128, f = 14336, E = 8, k = 2;
    const double gemm = b * 2 * s * h * (2 * h + 2 * h_kv + E + 3 * k * f), attention = b * 2 * s * s * h;
    CHECK_THAT(flops_of_layer(g, 0, fwd), WithinRel(gemm + attention, 0.01));
    CHECK_THAT(flops_of_layer(g, 0, bwd), WithinRel(2 * gemm + 2.5 * attention, 0.01));
  }
}

TEST_CASE("full-depth workloads are generated whole", "[ir][workloads]") {
  const auto [name, depth] =
      GENERATE(table<std::string, int>({{"gpt-dp", 24}, {"gpt-zero3", 24}, {"llama-tp-sp", 80}, {"moe-ep", 32}}));
  CAPTURE(name);
  const auto g = ir::make_workload(name);
  int deepest = -1;
  for (const auto& t : g.tasks)
    deepest = std::max(deepest, t.layer);
  CHECK(deepest == depth - 1);
}

TEST_CASE("make_workload rejects what it cannot build, naming it", "[ir][workloads][errors]") {
  SECTION("an unknown name lists the known ones") {
    CHECK_THROWS_WITH(ir::make_workload("bert"), ContainsSubstring("'bert'") && ContainsSubstring("gpt-zero3") &&
                                                     ContainsSubstring("llama-tp-sp"));
  }
  SECTION("a bad option names the field") {
    CHECK_THROWS_WITH(ir::make_workload("gpt-dp", {.layers = -1}), ContainsSubstring("workload_options.layers"));
    CHECK_THROWS_WITH(ir::make_workload("gpt-dp", {.ranks = 0}), ContainsSubstring("workload_options.ranks"));
    CHECK_THROWS_WITH(ir::make_workload("gpt-dp", {.micro_batch = 0}),
                      ContainsSubstring("workload_options.micro_batch"));
    CHECK_THROWS_WITH(ir::make_workload("llama-tp-sp", {.ranks = 12}),
                      ContainsSubstring("workload_options.ranks") && ContainsSubstring("ranks_per_node"));
    CHECK_THROWS_WITH(ir::make_workload("llama-tp-sp", {.ranks = 48, .ranks_per_node = 16}),
                      ContainsSubstring("kv heads"));
    CHECK_THROWS_WITH(ir::make_workload("moe-ep", {.ranks = 36, .ranks_per_node = 3}),
                      ContainsSubstring("workload_options.ranks_per_node") && ContainsSubstring("8 experts"));
    CHECK_THROWS_WITH(ir::make_workload("moe-ep", {.ranks = 12}),
                      ContainsSubstring("workload_options.ranks") && ContainsSubstring("expert-parallel"));
  }
}

TEST_CASE("llama-tp-sp and the DSL's Llama have the same tasks and collectives per block", "[ir][workloads][llama]") {
  // What the planner benchmarks measure is what users run: the workload generator mirrors the
  // lowering of examples/llama/model.hpp (sequence parallel) block by block. Compared: each
  // task's phase, kind, fn and mesh axis (names and sizes differ: the workload is Llama-2-70B).
  const auto workload = ir::make_workload("llama-tp-sp", {.layers = 2, .ranks = 8, .ranks_per_node = 4});
  const auto dsl = lower(llama_model::llama_sp, llama_model::shapes(2, 64, 512, 256, 8, 4, 512),
                         mesh::from_world(8, {{"dp", 2}, {"tp", 4}}), {.heads = 8, .depth = {{"layers", 2}}});
  for (int layer = 0; layer < 2; ++layer) {
    CAPTURE(layer);
    const auto mine = block(workload, layer), theirs = block(dsl, layer);
    CHECK(mine.size() == theirs.size());
    CHECK(mine == theirs);
  }
}

TEST_CASE("evoformer-dap switches the pair split with all-to-alls and all-reduces replicated weights",
          "[ir][workloads][dap]") {
  const auto g = ir::make_workload("evoformer-dap", {.layers = 2});
  REQUIRE(g.axes.size() == 2);
  CHECK(g.axes[0] == ir::mesh_axis{"dap", 8, ir::link_class::intra_node});
  CHECK(g.axes[1] == ir::mesh_axis{"dp", 4, ir::link_class::inter_node});
  for (int l = 0; l < 2; ++l)
    CHECK(collectives_of_layer(g, l) == census{{{a2a, "dap", fwd}, 2}, {{a2a, "dap", bwd}, 2}, {{ar, "dap", bwd}, 18},
                                               {{ar, "dp", bwd}, 18}});
  // 384 residues over 8 ranks: each holds 48 rows of 384 positions of 128 channels.
  const auto& q = task_named(g, "L0.row.q");
  CHECK(q.attr("m") == 48 * 384);
  CHECK(q.attr("k") == 128);
  const auto& att = task_named(g, "L0.col.attention");
  CHECK(att.attr("causal") == 0);
  CHECK(att.attr("batch") == 48);
  CHECK(att.attr("seq") == 384);
  // Bidirectional attention is priced as the full square: 4·batch·seq²·heads·head_dim.
  CHECK(att.flops == 4.0 * 48 * 384 * 384 * 4 * 32);
  const auto& x = task_named(g, "L0.col.in.a2a");
  CHECK(x.attr("from_dim") == 1);
  CHECK(x.attr("to_dim") == 0);
  CHECK_THROWS_WITH(ir::make_workload("evoformer-dap", {.layers = 1, .ranks = 40, .ranks_per_node = 5}),
                    ContainsSubstring("the dap group must divide the ranks and the 384 residues"));
}

TEST_CASE("wresnet-dp is Alpa's 250M Wide-ResNet under data parallelism with synchronised batch norm", "[ir][workloads][wresnet]") {
  const auto g = ir::make_workload("wresnet-dp", {.micro_batch = 2});
  REQUIRE(g.axes.size() == 1);
  CHECK(g.axes[0] == ir::mesh_axis{"dp", 32, ir::link_class::inter_node});
  double params = 0, flops = 0;
  for (const auto& b : g.buffers)
    if (b.role == ir::buffer_role::param) params += static_cast<double>(b.bytes) / 2; // bf16
  for (const auto& t : g.tasks) flops += t.flops;
  // Alpa's suite: 50 layers, 160 channels, width factor 2 is its "250M" (254.0M by its flax
  // model's shapes: the kernels, the batch norms' gains and shifts, the head and its bias, which
  // this head has not: 1000 fewer).
  CHECK_THAT(params, WithinRel(254.0002e6 - 1000, 1e-6));
  // 41.8 GMACs a 224 × 224 image forward (the convolutions and the head), three times that with the backward.
  CHECK_THAT(flops, WithinRel(2 * 3 * 2 * 41.806e9, 0.03));
  int deepest = -1;
  for (const auto& t : g.tasks) deepest = std::max(deepest, t.layer);
  CHECK(deepest == 3 + 4 + 6 + 3 - 1);
  // Each batch norm all-reduces its sums forward and its gradient's backward (which are then
  // the gain's and the shift's gradients); each convolution's gradient is all-reduced.
  CHECK(collectives_of_layer(g, 1) == census{{{ar, "dp", fwd}, 3}, {{ar, "dp", bwd}, 3 + 3}});
  // A stage's first block adds its projection's convolution and batch norm.
  CHECK(collectives_of_layer(g, 0) == census{{{ar, "dp", fwd}, 4}, {{ar, "dp", bwd}, 4 + 4}});
  const auto& c = task_named(g, "L1.b");
  CHECK(c.fn == ir::op::conv2d);
  CHECK(c.attr("height") == 56);
  CHECK(c.attr("in_channels") == 160);
  CHECK(c.attr("out_channels") == 320);
  CHECK(c.attr("kernel_h") == 3);
  CHECK(task_named(g, "L1.nb").attr("count") == 2 * 56 * 56 * 32); // the whole batch's rows
  // The stem's max pooling halves 112 to 56, where stage 1 starts (its first block at stride 1).
  const auto& pool = task_named(g, "embed.pool");
  CHECK(pool.fn == ir::op::max_pool);
  CHECK(pool.attr("height") == 112);
  CHECK(pool.attr("kernel_h") == 3);
  CHECK(pool.attr("stride") == 2);
  CHECK(task_named(g, "embed.pool.grad").fn == ir::op::max_pool_grad);
  CHECK(task_named(g, "L0.a").attr("height") == 56);
  CHECK(task_named(g, "embed.stem.n").fn == ir::op::batchnorm); // the stem's and each projection's norm, as Alpa's model
  CHECK(task_named(g, "L0.ns").fn == ir::op::batchnorm);
  CHECK(task_named(g, "L0.b").attr("stride") == 1);
  CHECK(task_named(g, "L3.b").attr("stride") == 2); // stage 2's first block
}

TEST_CASE("wresnet-dp's blocks are the DSL's Wide-ResNet blocks, task for task", "[ir][workloads][wresnet]") {
  // The workload mirrors examples/wresnet/model.hpp's lowering: its stage-1 identity blocks
  // (layers 1 and 2 of the workload, 0 and 1 of the DSL's `stage1` repeat) hold the same tasks
  // and collectives. The DSL's mesh has a tp axis of size 1, left out as in the MoE comparison.
  const auto workload = ir::make_workload("wresnet-dp", {.layers = 3, .ranks = 4});
  const auto dsl = lower(wresnet_model::net, wresnet_model::shapes(8, 16, 1, 5), mesh::from_world(4, {{"dp", 4}, {"tp", 1}}),
                         {.depth = {{"stage1", 2}}});
  for (int layer = 0; layer < 2; ++layer) {
    CAPTURE(layer);
    const auto mine = block(workload, layer + 1), theirs = block(dsl, layer);
    CHECK(mine.size() == theirs.size());
    CHECK(mine == theirs);
  }
}

