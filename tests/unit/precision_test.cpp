// The precision pass (ir/precision.hpp) on lowered graphs: what is bf16, what stays f32, where the
// casts go, and the bytes the collectives move (the CPU dispatch's bf16 operands:
// tests/cpu/kernels_bf16_test.cpp).
#include <concerto/concerto.hpp>
#include <concerto/cost/model.hpp>
#include <concerto/planner/list.hpp>
#include <concerto/sim/simulate.hpp>
#include <concerto/ir/hazards.hpp>
#include <concerto/plan/verify.hpp>
#include <concerto/runtime/kernel_call.hpp>

#include <catch2/catch_test_macros.hpp>
#include <catch2/matchers/catch_matchers_string.hpp>

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

using namespace concerto;

namespace {
inline constexpr axis<"dp"> dp;
inline constexpr axis<"tp"> tp;
constexpr auto x = input<"x">(spec(shard(dp), replicate), no_grad);
constexpr auto hidden = gelu(bias(matmul(x, param<"w1">(spec(replicate, shard(tp)))), param<"b1">(spec(shard(tp)))));
constexpr auto mlp_loss = mse(matmul(hidden, param<"w2">(spec(shard(tp), replicate))), input<"t">(spec(shard(dp), replicate), no_grad));
constexpr auto plain = program(mlp_loss, adamw{});
constexpr auto zero1 = program(mlp_loss, zero<1>(adamw{}, dp));
constexpr auto zero3 = program(mlp_loss, zero<3>(adamw{}, dp));

const shape_map shapes{{"x", {8, 16}}, {"t", {8, 16}}, {"w1", {16, 32}}, {"b1", {32}}, {"w2", {32, 16}}};

const ir::buffer& buffer_named(const ir::graph& g, const std::string& name) {
  for (const auto& b : g.buffers)
    if (b.name == name) return b;
  FAIL("no buffer " << name);
  return g.buffers.front();
}
const ir::task& task_named(const ir::graph& g, const std::string& name) {
  for (const auto& t : g.tasks)
    if (t.name == name) return t;
  FAIL("no task " << name);
  return g.tasks.front();
}
double collective_bytes(const ir::graph& g, int axis) {
  double sum = 0;
  for (const auto& t : g.tasks)
    if (ir::is_collective(t.kind) && t.axis == axis) sum += t.bytes;
  return sum;
}
template <std::size_t N>
ir::graph lowered(const graph::program<N>& p, ir::precision_policy precision, int dp_size = 2, int tp_size = 1, bool clip = false) {
  lower_options o{.name = "mlp"};
  o.precision = precision;
  o.clip_gradients = clip;
  return lower(p, shapes, mesh::from_world(dp_size * tp_size, {{"dp", dp_size}, {"tp", tp_size}}), o);
}
} // namespace

TEST_CASE("fp32 leaves the lowered graph as it is", "[precision]") {
  const auto g = lowered(plain, ir::precision_policy::fp32());
  for (const auto& b : g.buffers) CHECK((b.type == ir::dtype::f32 || b.type == ir::dtype::i64));
  for (const auto& t : g.tasks) CHECK(t.fn != ir::op::cast);
}

TEST_CASE("bf16: f32 masters, bf16 working copies and activations, the loss in f32", "[precision]") {
  const auto g = lowered(plain, ir::precision_policy::bf16(), 2, 2);
  for (const auto& b : g.buffers) {
    CAPTURE(b.name, ir::to_string(b.role));
    if (b.role == ir::buffer_role::optimizer_state || b.role == ir::buffer_role::input) CHECK(b.type == ir::dtype::f32);
    if (b.role == ir::buffer_role::param) CHECK(b.type == ir::dtype::bf16); // the working copy the forward reads
    if (b.role == ir::buffer_role::activation && b.name.find("mse") == std::string::npos) CHECK(b.type == ir::dtype::bf16);
  }
  // Each parameter's f32 master is kept between steps; its update reads and writes the master and
  // writes the parameter, the master rounded, so no step casts a parameter.
  for (const auto* name : {"w1", "b1", "w2"}) {
    CAPTURE(name);
    const auto& param = buffer_named(g, name);
    const auto& master = buffer_named(g, ir::master_name(std::string(name) + ".update"));
    CHECK(master.type == ir::dtype::f32);
    CHECK(master.role == ir::buffer_role::optimizer_state);
    CHECK(master.bytes == 2 * param.bytes);
    const auto& update = task_named(g, std::string(name) + ".update");
    CHECK(update.reads[0] == master.id);
    CHECK(update.writes.front() == master.id);
    CHECK(g.root_of(update.writes.back()) == g.root_of(param.id));
    const auto c = runtime::decode(g, update, std::vector<int>{0});
    CHECK(c.working == update.writes.back());
    CHECK(c.staged == static_cast<std::size_t>(g.buffer_at(update.reads[1]).bytes / 2)); // the gradient alone is widened
  }
  for (const auto& t : g.tasks) {
    CAPTURE(t.name);
    if (t.fn == ir::op::cast) CHECK(g.buffer_at(t.writes[0]).role == ir::buffer_role::gradient); // only before reductions
  }
  // The loss (and what sums it) stays f32.
  for (const auto& t : g.tasks)
    if (t.fn == ir::op::mse)
      for (const auto b : t.writes) CHECK(g.buffers[static_cast<std::size_t>(b)].type == ir::dtype::f32);
  // The graph is well formed: ids topological, no hazard left undeclared.
  std::size_t missing = 0;
  (void)ir::with_buffer_hazards(g, &missing);
  CHECK(missing == 0);
  CHECK_NOTHROW(g.validate());
}

TEST_CASE("bf16: weight gradients are summed in f32 and reduced in bf16, half the bytes", "[precision]") {
  const auto f32 = lowered(plain, ir::precision_policy::fp32(), 2, 2);
  const auto b16 = lowered(plain, ir::precision_policy::bf16(), 2, 2);
  const int axis_dp = *b16.axis_index("dp"), axis_tp = *b16.axis_index("tp");
  CHECK(collective_bytes(b16, axis_dp) * 2 == collective_bytes(f32, axis_dp));
  CHECK(collective_bytes(b16, axis_tp) * 2 == collective_bytes(f32, axis_tp));
  int reduced = 0;
  for (const auto& t : b16.tasks) {
    if (t.kind != ir::op_kind::optimizer_update) continue;
    const auto& grad = b16.buffers[static_cast<std::size_t>(t.reads[1])];
    CAPTURE(t.name, grad.name);
    CHECK(grad.type == ir::dtype::bf16); // reduced over dp in bf16
    // Where it was made: an f32 buffer, cast just before the reduction.
    for (const auto& c : b16.tasks)
      if (c.fn == ir::op::cast && c.step_phase == ir::phase::backward && b16.buffers[static_cast<std::size_t>(c.writes[0])].role == ir::buffer_role::gradient) {
        CHECK(b16.buffers[static_cast<std::size_t>(c.reads[0])].type == ir::dtype::f32);
        ++reduced;
      }
  }
  CHECK(reduced > 0);

  auto f32_reduce = ir::precision_policy::bf16();
  f32_reduce.reduce_gradients_in_f32 = true;
  const auto wide = lowered(plain, f32_reduce, 2, 2);
  for (const auto& t : wide.tasks)
    if (t.kind == ir::op_kind::optimizer_update) CHECK(wide.buffers[static_cast<std::size_t>(t.reads[1])].type == ir::dtype::f32);
  // The activations' collectives (tp) stay bf16; the gradients' (dp) are f32 again.
  CHECK(collective_bytes(wide, axis_tp) == collective_bytes(b16, axis_tp));
  CHECK(collective_bytes(wide, axis_dp) == collective_bytes(f32, axis_dp));

  auto narrow = ir::precision_policy::bf16();
  narrow.accumulate_gradients_in_f32 = false;
  for (const auto& t : lowered(plain, narrow, 2, 2).tasks)
    CHECK(!(t.fn == ir::op::cast && t.step_phase == ir::phase::backward)); // made in bf16: nothing to cast
}

TEST_CASE("bf16 under ZeRO: ZeRO-3 gathers the working copies, ZeRO-1 updates f32 shards", "[precision]") {
  const auto z3 = lowered(zero3, ir::precision_policy::bf16(), 2, 1, true);
  int gathers = 0;
  for (const auto& t : z3.tasks)
    if (t.kind == ir::op_kind::all_gather) {
      ++gathers;
      CHECK(z3.buffers[static_cast<std::size_t>(t.reads[0])].type == ir::dtype::bf16);
    }
  CHECK(gathers >= 3);
  // Clipping's norm stays f32 whatever the gradients' type.
  CHECK(buffer_named(z3, std::string(ir::grad_norm_sq_buffer)).type == ir::dtype::f32);

  const auto z1 = lowered(zero1, ir::precision_policy::bf16(), 2, 1);
  int updates = 0;
  for (const auto& t : z1.tasks)
    if (t.kind == ir::op_kind::optimizer_update) {
      ++updates;
      const auto& master = z1.buffer_at(t.reads[0]);
      CHECK(master.type == ir::dtype::f32); // the shard's master, kept between steps
      CHECK(master.role == ir::buffer_role::optimizer_state);
      CHECK(z1.buffer_at(t.reads[1]).type == ir::dtype::bf16); // the reduced gradient
      CHECK(z1.buffer_at(t.writes.back()).type == ir::dtype::bf16); // the rounded shard the gather moves
    }
  CHECK(updates == 3);
  // No shard is sliced out of a parameter any more: the master is the shard.
  for (const auto& t : z1.tasks)
    if (t.fn == ir::op::shard_slice) CHECK(z1.buffer_at(t.reads[0]).role != ir::buffer_role::param);

  // ZeRO-1's gathers after the update move bf16 shards: half the bytes of the f32 run's.
  const auto z1_f32 = lowered(zero1, ir::precision_policy::fp32(), 2, 1);
  const auto gathered = [](const ir::graph& g) {
    double bytes = 0;
    for (const auto& t : g.tasks)
      if (t.kind == ir::op_kind::all_gather && t.step_phase == ir::phase::optimizer) bytes += t.bytes;
    return bytes;
  };
  CHECK(gathered(z1_f32) > 0);
  CHECK(gathered(z1) * 2 == gathered(z1_f32));
  std::size_t missing = 0;
  (void)ir::with_buffer_hazards(z1, &missing);
  CHECK(missing == 0);
  CHECK_NOTHROW(z1.validate());
}

TEST_CASE("bf16 planning: the plan of a bf16 graph verifies and prices its halved collectives", "[precision]") {
  const auto f32 = lowered(plain, ir::precision_policy::fp32(), 2, 2);
  const auto b16 = lowered(plain, ir::precision_policy::bf16(), 2, 2);
  const auto model = cost::model::preset("a800x32");
  double f32_comm = 0, b16_comm = 0;
  const auto d32 = model.durations_us(f32), d16 = model.durations_us(b16);
  for (const auto& t : f32.tasks)
    if (ir::is_collective(t.kind)) f32_comm += d32[static_cast<std::size_t>(t.id)];
  for (const auto& t : b16.tasks)
    if (ir::is_collective(t.kind)) b16_comm += d16[static_cast<std::size_t>(t.id)];
  CHECK(b16_comm < f32_comm);
  const auto orders = planner::list_schedule(planner::policy::program_order, b16, d16);
  const auto p = sim::to_plan(orders.graph, orders.order, d16, model.overlap_slowdown(), "program_order", model.hw().name);
  CHECK_NOTHROW(plan::verify(p));
}

TEST_CASE("fp16: f16 activations, and the loss scale every loss gradient and update reads", "[precision]") {
  const auto g = lowered(zero1, ir::precision_policy::fp16(), 2, 1);
  const auto& scale = buffer_named(g, std::string(ir::loss_scale_buffer));
  CHECK(scale.type == ir::dtype::f32);
  CHECK(scale.role == ir::buffer_role::optimizer_state); // kept between steps, never aliased
  CHECK(scale.bytes == 4);
  const auto norm = buffer_named(g, std::string(ir::grad_norm_sq_buffer)).id; // made for loss scaling, no clipping asked
  int loss_grads = 0, updates = 0;
  for (const auto& t : g.tasks) {
    CAPTURE(t.name);
    const bool reads_scale = std::find(t.reads.begin(), t.reads.end(), scale.id) != t.reads.end();
    CHECK(reads_scale == ir::reads_loss_scale(t.fn));
    if (t.fn == ir::op::mse_grad) {
      ++loss_grads;
      CHECK(g.buffer_at(t.writes[0]).type == ir::dtype::f16); // the scaled gradient is stored in f16
    }
    if (ir::info(t.fn).form == ir::task_form::update) {
      ++updates;
      REQUIRE(t.reads.size() >= 2);
      CHECK(t.reads[t.reads.size() - 2] == norm); // the norm, then the scale: the order the decode takes them in
      CHECK(t.reads.back() == scale.id);
    }
  }
  CHECK(loss_grads == 1);
  CHECK(updates == 3);
  // Every task decodes: the scale is taken off the operands the kernels see.
  for (const auto& t : g.tasks)
    if (!ir::is_collective(t.kind) && ir::info(t.fn).executable) {
      CAPTURE(t.name);
      const auto c = runtime::decode(g, t, std::vector<int>{0});
      CHECK((c.loss_scale == scale.id) == ir::reads_loss_scale(t.fn));
      if (ir::info(t.fn).form == ir::task_form::update) CHECK(c.grad_norm_sq == norm);
    }
  // Evaluation's forward pass has no loss gradient: no loss scale.
  lower_options forward{.name = "mlp"};
  forward.precision = ir::precision_policy::fp16();
  forward.forward_only = true;
  const auto f = lower(zero1, shapes, mesh::from_world(2, {{"dp", 2}, {"tp", 1}}), forward);
  for (const auto& b : f.buffers) CHECK(b.name != ir::loss_scale_buffer);
}
