// A data-parallel x tensor-parallel MLP training step over MPI gives the single-rank result,
// and the plan comes from rank 0 through distribute_plan.
#include "mpi_testing.hpp"

#include <concerto/ir/builder.hpp>
#include <concerto/mesh/mesh.hpp>
#include <concerto/runtime/executor.hpp>
#include <concerto/runtime/mpi/backend.hpp>

#include <catch2/catch_test_macros.hpp>

#include <chrono>
#include <cmath>
#include <limits>
#include <vector>

using namespace concerto;
namespace rt = concerto::runtime;

namespace {

constexpr std::int64_t B = 8, K = 12, H = 16, O = 4; // global batch, input, hidden, output

struct ids {
  ir::buffer_id x, w1, w2, t, loss;
};

// Megatron MLP: W1 split by columns and W2 by rows over tp, the batch split over dp.
// y = gelu(x·W1)·W2 is partial over tp (all-reduced); loss = mean squared error; the
// gradient of each rank's loss is scaled by 1/dp so that the dp all-reduce sums to the mean.
ir::graph mlp(int dp, int tp, ids& id) {
  ir::builder b("mlp-dp" + std::to_string(dp) + "-tp" + std::to_string(tp));
  const int ad = b.axis("dp", dp), at = b.axis("tp", tp);
  const auto bl = B / dp, hl = H / tp;
  id.x = b.buffer("x", {bl, K}, ir::buffer_role::input);
  id.t = b.buffer("t", {bl, O}, ir::buffer_role::input);
  id.w1 = b.buffer("w1", {K, hl}, ir::buffer_role::param);
  id.w2 = b.buffer("w2", {hl, O}, ir::buffer_role::param);
  const auto h = b.buffer("h", {bl, hl}), a = b.buffer("a", {bl, hl}), y = b.buffer("y", {bl, O});
  id.loss = b.buffer("loss", {1});
  const auto dy = b.buffer("dy", {bl, O}), da = b.buffer("da", {bl, hl}), dh = b.buffer("dh", {bl, hl});
  const auto dw1 = b.buffer("w1.grad", {K, hl}, ir::buffer_role::gradient);
  const auto dw2 = b.buffer("w2.grad", {hl, O}, ir::buffer_role::gradient);
  b.matmul("fc1", id.x, id.w1, h, bl, hl, K);
  b.compute(ir::op_kind::elementwise, "act", {h}, {a}, {ir::op::gelu});
  b.matmul("fc2", a, id.w2, y, bl, O, hl);
  b.collective(ir::op_kind::all_reduce, "y.ar", at, y, y);
  b.at(ir::phase::backward);
  b.compute(ir::op_kind::loss, "loss", {y, id.t}, {id.loss}, {ir::op::mse});
  b.collective(ir::op_kind::all_reduce, "loss.ar", ad, id.loss, id.loss);
  b.compute(ir::op_kind::loss, "loss.grad", {y, id.t}, {dy}, {ir::op::mse_grad, 0, -1, {{"dloss_num", 1}, {"dloss_den", dp}}});
  b.matmul("fc2.wgrad", a, dy, dw2, hl, O, bl, 1, true, false);
  b.collective(ir::op_kind::all_reduce, "w2.grad.ar", ad, dw2, dw2);
  b.matmul("fc2.dgrad", dy, id.w2, da, bl, hl, O, 1, false, true);
  b.compute(ir::op_kind::elementwise, "act.grad", {h, da}, {dh}, {ir::op::gelu_grad});
  b.matmul("fc1.wgrad", id.x, dh, dw1, K, hl, bl, 1, true, false);
  b.collective(ir::op_kind::all_reduce, "w1.grad.ar", ad, dw1, dw1);
  b.at(ir::phase::optimizer);
  b.compute(ir::op_kind::optimizer_update, "w2.sgd", {id.w2, dw2}, {id.w2}, {ir::op::sgd});
  b.compute(ir::op_kind::optimizer_update, "w1.sgd", {id.w1, dw1}, {id.w1}, {ir::op::sgd});
  return std::move(b).finish();
}

float init_x(std::int64_t r, std::int64_t c) { return std::sin(0.3f * static_cast<float>(r * K + c)); }
float init_t(std::int64_t r, std::int64_t c) { return std::cos(0.7f * static_cast<float>(r * O + c)); }
float init_w1(std::int64_t r, std::int64_t c) { return 0.2f * std::sin(1.1f * static_cast<float>(r * H + c) + 0.5f); }
float init_w2(std::int64_t r, std::int64_t c) { return 0.2f * std::cos(0.9f * static_cast<float>(r * O + c)); }

// Fills this rank's shards from the global initial values: rows [dc·bl, ...) of x and t,
// columns [tc·hl, ...) of W1, rows [tc·hl, ...) of W2.
void fill(rt::host_arena& mem, const ids& id, int dp, int tp, int dc, int tc) {
  const auto bl = B / dp, hl = H / tp;
  for (std::int64_t r = 0; r < bl; ++r) {
    for (std::int64_t c = 0; c < K; ++c) mem.f32(id.x)[r * K + c] = init_x(dc * bl + r, c);
    for (std::int64_t c = 0; c < O; ++c) mem.f32(id.t)[r * O + c] = init_t(dc * bl + r, c);
  }
  for (std::int64_t r = 0; r < K; ++r)
    for (std::int64_t c = 0; c < hl; ++c) mem.f32(id.w1)[r * hl + c] = init_w1(r, tc * hl + c);
  for (std::int64_t r = 0; r < hl; ++r)
    for (std::int64_t c = 0; c < O; ++c) mem.f32(id.w2)[r * O + c] = init_w2(tc * hl + r, c);
}

} // namespace

TEST_CASE("a dp x tp MLP step on every rank matches the same step on one rank", "[mpi][training]") {
  const int n = rt::mpi::environment::world_size();
  const int tp = n >= 4 ? 2 : 1, dp = n / tp;
  constexpr int steps = 3;

  // The reference: the unsharded graph on this rank alone.
  ids rid{};
  rt::mpi::backend solo({.world = MPI_COMM_SELF});
  rt::executor ref(mpi_testing::unit_plan(planner::program_order_schedule(mlp(1, 1, rid)), "program_order"), solo);
  solo.settings().sgd.lr = 0.1f;
  fill(solo.buffers(), rid, 1, 1, 0, 0);
  std::vector<float> ref_loss;
  for (int s = 0; s < steps; ++s) {
    ref.run_step();
    ref_loss.push_back(solo.buffers().f32(rid.loss)[0]);
  }

  ids id{};
  const auto g = mlp(dp, tp, id);
  rt::mpi::backend be;
  const auto p = rt::distribute_plan(be, [&] { return mpi_testing::unit_plan(planner::program_order_schedule(g), "program_order"); });
  rt::executor ex(p, be);
  be.settings().sgd.lr = 0.1f;
  const auto coords = be.coords();
  fill(be.buffers(), id, dp, tp, coords[0], coords[1]);
  std::vector<float> loss;
  const auto* arena = be.buffers().data();
  const auto arena_bytes = be.buffers().total_bytes();
  for (int s = 0; s < steps; ++s) {
    ex.run_step();
    CHECK(be.buffers().data() == arena); // allocated once, before the first step
    CHECK(be.buffers().total_bytes() == arena_bytes);
    loss.push_back(be.buffers().f32(id.loss)[0] / static_cast<float>(dp)); // dp all-reduce summed the means
  }
  CAPTURE(be.rank(), dp, tp);
  SECTION("the loss of every step matches") {
    for (int s = 0; s < steps; ++s) CHECK(std::abs(loss[static_cast<std::size_t>(s)] - ref_loss[static_cast<std::size_t>(s)]) <= 1e-5f * std::abs(ref_loss[static_cast<std::size_t>(s)]) + 1e-6f);
    CHECK(ref_loss.back() < ref_loss.front()); // it trains, so the comparison is not of constants
  }
  SECTION("each rank's parameter shards match the reference's slices") {
    const auto hl = H / tp;
    const auto w1 = be.buffers().f32(id.w1), w2 = be.buffers().f32(id.w2);
    const auto rw1 = solo.buffers().f32(rid.w1), rw2 = solo.buffers().f32(rid.w2);
    double worst = 0;
    for (std::int64_t r = 0; r < K; ++r)
      for (std::int64_t c = 0; c < hl; ++c)
        worst = std::max(worst, std::abs(static_cast<double>(w1[r * hl + c]) - rw1[r * H + coords[1] * hl + c]));
    for (std::int64_t r = 0; r < hl; ++r)
      for (std::int64_t c = 0; c < O; ++c)
        worst = std::max(worst, std::abs(static_cast<double>(w2[r * O + c]) - rw2[(coords[1] * hl + r) * O + c]));
    CHECK(worst < 1e-5);
    CHECK(std::abs(static_cast<double>(rw1[0]) - init_w1(0, 0)) > 1e-4); // the parameters did move
  }
}

CONCERTO_MPI_TEST_MAIN

TEST_CASE("a timeout past the clock's range means no deadline, not one already passed", "[mpi][timeout]") {
  const auto year_from_now = rt::clock::now() + std::chrono::hours(24 * 365);
  CHECK(rt::detail::deadline_after(9.3e9) > year_from_now);
  CHECK(rt::detail::deadline_after(1e300) == rt::clock::time_point::max());
  CHECK(rt::detail::deadline_after(std::numeric_limits<double>::infinity()) == rt::clock::time_point::max());
  CHECK(rt::detail::deadline_after(1.0) < year_from_now);
  CHECK(rt::detail::deadline_after(1.0) > rt::clock::now());
}
