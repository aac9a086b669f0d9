// The executor on one GPU with the NCCL backend (one rank) runs the same plan as the CPU
// backend and gives the same losses and parameters, eagerly and replaying a captured CUDA graph.
// Skips (exit code 4) where no GPU is visible.
#include "gpu_testing.hpp"

#include <concerto/core/float16.hpp>
#include <concerto/ir/builder.hpp>
#include <concerto/plan/verify.hpp>
#include <concerto/planner/list.hpp>
#include <concerto/runtime/executor.hpp>
#include <concerto/runtime/mpi/backend.hpp>
#include <concerto/runtime/mpi/environment.hpp>
#include <concerto/runtime/nccl/backend.hpp>
#include <concerto/sim/simulate.hpp>

#include <catch2/catch_session.hpp>
#include <catch2/catch_test_macros.hpp>

#include <cmath>
#include <vector>

using namespace concerto;
namespace rt = concerto::runtime;

namespace {

constexpr std::int64_t B = 16, K = 24, H = 32, O = 8;

struct ids {
  ir::buffer_id x, w1, b1, w2, t, loss;
};

// y = gelu(x·W1 + b1)·W2ᵀ, mse loss, all-reduced gradients on a dp axis of one rank, SGD.
ir::graph mlp(ids& id) {
  ir::builder b("gpu-mlp");
  const int ad = b.axis("dp", 1);
  id.x = b.buffer("x", {B, K}, ir::buffer_role::input);
  id.t = b.buffer("t", {B, O}, ir::buffer_role::input);
  id.w1 = b.buffer("w1", {K, H}, ir::buffer_role::param);
  id.b1 = b.buffer("b1", {H}, ir::buffer_role::param);
  id.w2 = b.buffer("w2", {O, H}, ir::buffer_role::param);
  const auto h = b.buffer("h", {B, H}), hb = b.buffer("hb", {B, H}), a = b.buffer("a", {B, H}), y = b.buffer("y", {B, O});
  id.loss = b.buffer("loss", {1});
  const auto dy = b.buffer("dy", {B, O}), da = b.buffer("da", {B, H}), dh = b.buffer("dh", {B, H});
  const auto dw1 = b.buffer("w1.grad", {K, H}, ir::buffer_role::gradient);
  const auto db1 = b.buffer("b1.grad", {H}, ir::buffer_role::gradient);
  const auto dw2 = b.buffer("w2.grad", {O, H}, ir::buffer_role::gradient);
  b.matmul("fc1", id.x, id.w1, h, B, H, K);
  b.compute(ir::op_kind::elementwise, "bias", {h, id.b1}, {hb}, {ir::op::bias_add});
  b.compute(ir::op_kind::elementwise, "act", {hb}, {a}, {ir::op::gelu});
  b.matmul("fc2", a, id.w2, y, B, O, H, 1, false, true);
  b.at(ir::phase::backward);
  b.compute(ir::op_kind::loss, "loss", {y, id.t}, {id.loss}, {ir::op::mse});
  b.compute(ir::op_kind::loss, "loss.grad", {y, id.t}, {dy}, {ir::op::mse_grad});
  b.matmul("fc2.wgrad", dy, a, dw2, O, H, B, 1, true, false);
  b.collective(ir::op_kind::all_reduce, "w2.grad.ar", ad, dw2, dw2);
  b.matmul("fc2.dgrad", dy, id.w2, da, B, H, O);
  b.compute(ir::op_kind::elementwise, "act.grad", {hb, da}, {dh}, {ir::op::gelu_grad});
  b.compute(ir::op_kind::elementwise, "bias.grad", {dh}, {db1}, {ir::op::bias_grad});
  b.collective(ir::op_kind::all_reduce, "b1.grad.ar", ad, db1, db1);
  b.matmul("fc1.wgrad", id.x, dh, dw1, K, H, B, 1, true, false);
  b.collective(ir::op_kind::all_reduce, "w1.grad.ar", ad, dw1, dw1);
  b.at(ir::phase::optimizer);
  b.compute(ir::op_kind::optimizer_update, "w2.sgd", {id.w2, dw2}, {id.w2}, {ir::op::sgd});
  b.compute(ir::op_kind::optimizer_update, "b1.sgd", {id.b1, db1}, {id.b1}, {ir::op::sgd});
  b.compute(ir::op_kind::optimizer_update, "w1.sgd", {id.w1, dw1}, {id.w1}, {ir::op::sgd});
  return std::move(b).finish();
}

plan::plan unit_plan(const planner::ordering& s, const char* policy) {
  std::vector<double> d(s.graph.tasks.size(), 1.0);
  auto p = sim::to_plan(s.graph, s.order, d, 1.0, policy, "test");
  plan::verify(p);
  return p;
}

std::vector<float> values(std::size_t n, float f) {
  std::vector<float> v(n);
  for (std::size_t i = 0; i < n; ++i) v[i] = 0.3f * std::sin(f * static_cast<float>(i) + 0.2f);
  return v;
}

struct inputs {
  std::vector<float> x = values(B * K, 0.37f), t = values(B * O, 0.71f), w1 = values(K * H, 1.13f), b1 = values(H, 0.53f),
                     w2 = values(O * H, 0.91f);
};

} // namespace

TEST_CASE("one GPU with the NCCL backend runs a plan as the CPU backend does", "[gpu][backend][executor]") {
  CONCERTO_REQUIRE_GPU();
  constexpr int steps = 4;
  ids id{};
  const auto g = mlp(id);
  const inputs in;
  // Both plans: program order (collectives right after their producer) and the sync baseline.
  for (const char* policy : {"program_order", "sync"}) {
    const auto p = unit_plan(std::string(policy) == "sync" ? planner::sync_schedule(g) : planner::program_order_schedule(g),
                             policy);
    rt::mpi::backend cpu_be({.world = MPI_COMM_SELF});
    rt::executor cpu_ex(p, cpu_be);
    cpu_be.settings().sgd.lr = 0.05f;
    auto& mem = cpu_be.buffers();
    std::copy(in.x.begin(), in.x.end(), mem.f32(id.x).begin());
    std::copy(in.t.begin(), in.t.end(), mem.f32(id.t).begin());
    std::copy(in.w1.begin(), in.w1.end(), mem.f32(id.w1).begin());
    std::copy(in.b1.begin(), in.b1.end(), mem.f32(id.b1).begin());
    std::copy(in.w2.begin(), in.w2.end(), mem.f32(id.w2).begin());
    std::vector<float> cpu_loss;
    for (int s = 0; s < steps; ++s) {
      cpu_ex.run_step();
      cpu_loss.push_back(mem.f32(id.loss)[0]);
    }
    REQUIRE(cpu_loss.back() < cpu_loss.front()); // it trains: the comparison is not of constants

    for (const bool capture : {false, true}) {
      DYNAMIC_SECTION("plan " << policy << (capture ? ", replaying a captured CUDA graph" : ", eagerly")) {
        rt::nccl::backend gpu_be({.world = MPI_COMM_SELF, .capture_graph = capture});
        rt::executor gpu_ex(p, gpu_be);
        gpu_be.settings().sgd.lr = 0.05f;
        auto& dm = gpu_be.buffers();
        dm.upload(id.x, in.x);
        dm.upload(id.t, in.t);
        dm.upload(id.w1, in.w1);
        dm.upload(id.b1, in.b1);
        dm.upload(id.w2, in.w2);
        std::vector<float> gpu_loss;
        for (int s = 0; s < steps; ++s) {
          gpu_ex.run_step();
          gpu_loss.push_back(dm.download<float>(id.loss)[0]);
          CHECK(gpu_be.last_step_device_ms() > 0.0f);
        }
        CHECK(gpu_be.graph_ready() == capture);
        if (capture) CHECK(gpu_be.graph_nodes() > g.tasks.size() / 2);
        gpu_testing::check_close(gpu_loss, cpu_loss, 1e-4f, 1e-6f);
        gpu_testing::check_close(dm.download<float>(id.w1), std::vector<float>(mem.f32(id.w1).begin(), mem.f32(id.w1).end()),
                                 1e-4f, 1e-6f);
        gpu_testing::check_close(dm.download<float>(id.w2), std::vector<float>(mem.f32(id.w2).begin(), mem.f32(id.w2).end()),
                                 1e-4f, 1e-6f);
        CHECK(gpu_ex.cross_stream_dependencies() > 0); // the lane really waited on the compute stream
      }
    }
  }
}

TEST_CASE("the NCCL backend names a task whose operands do not fit before the first step", "[gpu][backend]") {
  CONCERTO_REQUIRE_GPU();
  ir::builder b("bad-matmul");
  const auto x = b.buffer("x", {4, 8}), w = b.buffer("w", {8, 8}), y = b.buffer("y", {4, 8});
  b.matmul("fc", x, w, y, 4, 8, 16); // k = 16, but x holds 4 x 8
  const auto p = unit_plan(planner::program_order_schedule(std::move(b).finish()), "program_order");
  rt::nccl::backend be({.world = MPI_COMM_SELF});
  try {
    rt::executor ex(p, be);
    FAIL("the executor accepted a matmul whose operand is too small");
  } catch (const concerto::error& e) {
    CHECK(std::string(e.what()).find("'fc'") != std::string::npos);
    CHECK(std::string(e.what()).find("'x'") != std::string::npos);
  }
}

TEST_CASE("collectives along an inner dimension and max reductions run through the NCCL backend as on MPI",
          "[gpu][backend][collectives]") {
  CONCERTO_REQUIRE_GPU();
  // One rank: the lane's group has one member, so the staging restrides are identities; this
  // checks the path (staging buffers, pack and unpack on the lane, fn "max"), not the
  // interleaving, which kernels_test checks against the MPI backend's layout.
  ir::builder b("inner-dim-collectives");
  const int sp = b.axis("sp", 1);
  const auto x = b.buffer("x", {4, 6, 3}, ir::buffer_role::input), y = b.buffer("y", {4, 6, 3});
  const auto gathered = b.buffer("gathered", {4, 6, 3}), scattered = b.buffer("scattered", {4, 6, 3});
  const auto mx = b.buffer("max", {4, 6, 3}), out = b.buffer("out", {4, 6, 3});
  b.compute(ir::op_kind::elementwise, "double", {x}, {y}, {ir::op::scale, 0, -1, {{"num", 2}, {"den", 1}}});
  const auto ag = b.collective(ir::op_kind::all_gather, "gather.dim1", sp, y, gathered);
  const auto rs = b.collective(ir::op_kind::reduce_scatter, "scatter.dim1", sp, gathered, scattered);
  b.collective(ir::op_kind::all_reduce, "max", sp, scattered, mx, -1, ir::op::max);
  b.compute(ir::op_kind::elementwise, "add", {mx, x}, {out}, {ir::op::add});
  auto g = std::move(b).finish();
  g.tasks[static_cast<std::size_t>(ag)].attrs["dim"] = 1;
  g.tasks[static_cast<std::size_t>(rs)].attrs["dim"] = 1;
  const auto p = unit_plan(planner::program_order_schedule(g), "program_order");
  const auto in = values(4 * 6 * 3, 0.61f);
  rt::mpi::backend cpu_be({.world = MPI_COMM_SELF});
  rt::executor cpu_ex(p, cpu_be);
  std::copy(in.begin(), in.end(), cpu_be.buffers().f32(x).begin());
  cpu_ex.run_step();
  const auto want = cpu_be.buffers().f32(out);
  rt::nccl::backend gpu_be({.world = MPI_COMM_SELF});
  rt::executor gpu_ex(p, gpu_be);
  gpu_be.buffers().upload(x, in);
  gpu_ex.run_step();
  gpu_testing::check_close(gpu_be.buffers().download<float>(out), std::vector<float>(want.begin(), want.end()), 0.0f, 0.0f);
}

TEST_CASE("an f16 all-reduce runs through the NCCL backend as ncclFloat16", "[gpu][backend][collectives][f16]") {
  CONCERTO_REQUIRE_GPU();
  // One rank: the sum is the value itself, so this checks the type's path (ncclFloat16, the
  // casts around it), not the arithmetic of a sum, which NCCL does in fp32 as for bf16.
  ir::builder b("f16-all-reduce");
  const int dp = b.axis("dp", 1);
  const auto x = b.buffer("x", {5, 7}, ir::buffer_role::input), out = b.buffer("out", {5, 7});
  const auto h = b.buffer("h", {5, 7}, ir::buffer_role::activation, ir::dtype::f16);
  const auto sum = b.buffer("sum", {5, 7}, ir::buffer_role::activation, ir::dtype::f16);
  b.compute(ir::op::cast, "narrow", {x}, {h});
  b.collective(ir::op_kind::all_reduce, "sum", dp, h, sum);
  b.compute(ir::op::cast, "widen", {sum}, {out});
  const auto p = unit_plan(planner::program_order_schedule(std::move(b).finish()), "program_order");
  auto in = values(5 * 7, 0.83f);
  in[3] = 70000.0f; // past f16's range: infinity
  std::vector<float> want(in.size());
  for (std::size_t i = 0; i < in.size(); ++i) want[i] = concerto::from_f16(concerto::to_f16(in[i]));
  rt::nccl::backend be({.world = MPI_COMM_SELF});
  rt::executor ex(p, be);
  be.buffers().upload(x, in);
  ex.run_step();
  auto got = be.buffers().download<float>(out);
  CHECK(std::isinf(got[3]));
  got[3] = want[3] = 0.0f;
  gpu_testing::check_close(got, want, 0.0f, 0.0f);
}

int main(int argc, char** argv) {
  concerto::runtime::mpi::environment env(argc, argv);
  return Catch::Session().run(argc, argv);
}
