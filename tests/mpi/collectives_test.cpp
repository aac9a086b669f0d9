// Every collective of the MPI backend over each axis of a dp x tp mesh (2x2 on 4 ranks, 2x1 on
// 2), driven by the executor, against values computed by hand from the ranks' coordinates.
#include "mpi_testing.hpp"

#include <concerto/ir/builder.hpp>
#include <concerto/mesh/mesh.hpp>
#include <concerto/runtime/executor.hpp>
#include <concerto/runtime/mpi/backend.hpp>

#include <catch2/catch_test_macros.hpp>

#include <string>
#include <vector>

using namespace concerto;
namespace rt = concerto::runtime;

namespace {

constexpr std::int64_t S = 6; // floats per shard

struct axis_buffers {
  ir::buffer_id ar, mx, shard_src, shard, gathered, rs_in, rs_out, a2a_in, a2a_out, bc, send, recv;
};

// x_global[j] = 0.5·j + axis: the same on every rank, so all_gather(shard(x)) == x is checkable.
float global_value(std::int64_t j, int axis) { return 0.5f * static_cast<float>(j) + static_cast<float>(axis); }

} // namespace

TEST_CASE("every collective gives the hand-computed values over each mesh axis", "[mpi][collectives]") {
  rt::mpi::backend be;
  const int n = be.world_size();
  const int tp_size = n % 2 == 0 && n >= 4 ? 2 : 1;
  const auto m = mesh::from_world(n, {{"dp", -1}, {"tp", tp_size}});
  ir::builder b("collectives");
  std::vector<axis_buffers> bufs;
  for (int a = 0; a < 2; ++a) {
    const auto& ax = m.axes()[static_cast<std::size_t>(a)];
    const int axis = b.axis(ax.name, ax.size);
    const auto G = static_cast<std::int64_t>(ax.size);
    const auto p = ax.name + ".";
    axis_buffers x{};
    x.ar = b.buffer(p + "ar", {S});
    x.mx = b.buffer(p + "max", {S});
    x.shard_src = b.buffer(p + "x", {G * S}, ir::buffer_role::input);
    x.shard = b.buffer(p + "x.shard", {S});
    x.gathered = b.buffer(p + "x.gathered", {G * S});
    x.rs_in = b.buffer(p + "rs.in", {G * S});
    x.rs_out = b.buffer(p + "rs.out", {S});
    x.a2a_in = b.buffer(p + "a2a.in", {G * S});
    x.a2a_out = b.buffer(p + "a2a.out", {G * S});
    x.bc = b.buffer(p + "bc", {S});
    x.send = b.buffer(p + "send", {S});
    x.recv = b.buffer(p + "recv", {S});
    b.collective(ir::op_kind::all_reduce, p + "ar", axis, x.ar, x.ar);
    b.collective(ir::op_kind::all_reduce, p + "max", axis, x.mx, x.mx, -1, ir::op::max);
    // The shard is cut by a compute task, so the gather also exercises a cross-stream dependency.
    const auto coord = m.coords(be.rank())[static_cast<std::size_t>(a)];
    b.slice(p + "shard", x.shard_src, x.shard, {G * S}, 0, coord * S, S);
    b.collective(ir::op_kind::all_gather, p + "ag", axis, x.shard, x.gathered);
    b.collective(ir::op_kind::reduce_scatter, p + "rs", axis, x.rs_in, x.rs_out);
    b.collective(ir::op_kind::all_to_all, p + "a2a", axis, x.a2a_in, x.a2a_out);
    const auto bc = b.collective(ir::op_kind::broadcast, p + "bc", axis, x.bc, x.bc);
    (void)bc;
    b.collective(ir::op_kind::send, p + "send", axis, x.send, x.send);
    b.collective(ir::op_kind::recv, p + "recv", axis, x.recv, x.recv);
    bufs.push_back(x);
  }
  auto g = std::move(b).finish();
  // Broadcast from the last coordinate; the ring sends right and receives from the left.
  for (auto& t : g.tasks) {
    const auto G = g.axes[static_cast<std::size_t>(std::max(t.axis, 0))].size;
    if (t.kind == ir::op_kind::broadcast) t.attrs["root"] = G - 1;
    if (t.kind == ir::op_kind::send) t.attrs["shift"] = 1;
    if (t.kind == ir::op_kind::recv) t.attrs["shift"] = -1;
  }
  // The slice offset differs per rank, so each rank plans its own graph; collectives agree.
  rt::executor ex(mpi_testing::unit_plan(planner::program_order_schedule(g), "program_order"), be);
  auto& mem = be.buffers();
  const int me = be.rank();
  for (int a = 0; a < 2; ++a) {
    const auto& x = bufs[static_cast<std::size_t>(a)];
    const auto G = m.axes()[static_cast<std::size_t>(a)].size;
    for (std::int64_t i = 0; i < S; ++i) {
      mem.f32(x.ar)[i] = static_cast<float>(me * 100 + i);
      mem.f32(x.mx)[i] = static_cast<float>((me * 7 + i) % 5);
      mem.f32(x.bc)[i] = static_cast<float>(me * 10 + i);
      mem.f32(x.send)[i] = static_cast<float>(me * 1000 + i);
    }
    for (std::int64_t j = 0; j < G * S; ++j) {
      mem.f32(x.shard_src)[j] = global_value(j, a);
      mem.f32(x.rs_in)[j] = static_cast<float>(me * 1000 + j);
      mem.f32(x.a2a_in)[j] = static_cast<float>(me * 1000 + j);
    }
  }
  ex.run_step();

  for (int a = 0; a < 2; ++a) {
    const auto& ax = m.axes()[static_cast<std::size_t>(a)];
    const auto& x = bufs[static_cast<std::size_t>(a)];
    const auto group = m.group(ax.name, me);
    const auto G = static_cast<std::int64_t>(group.size());
    const auto c = static_cast<std::int64_t>(m.coords(me)[static_cast<std::size_t>(a)]);
    CAPTURE(ax.name, me, c);
    SECTION("all_reduce sums the group's buffers; fn max takes their maximum: " + ax.name) {
      for (std::int64_t i = 0; i < S; ++i) {
        float sum = 0, mx = -1;
        for (const int r : group) {
          sum += static_cast<float>(r * 100 + i);
          mx = std::max(mx, static_cast<float>((r * 7 + i) % 5));
        }
        CHECK(mem.f32(x.ar)[i] == sum);
        CHECK(mem.f32(x.mx)[i] == mx);
      }
    }
    SECTION("all_gather of each rank's shard rebuilds the whole buffer: " + ax.name) {
      for (std::int64_t j = 0; j < G * S; ++j) CHECK(mem.f32(x.gathered)[j] == global_value(j, a));
    }
    SECTION("reduce_scatter leaves coordinate c the sum of block c: " + ax.name) {
      for (std::int64_t i = 0; i < S; ++i) {
        float sum = 0;
        for (const int r : group) sum += static_cast<float>(r * 1000 + c * S + i);
        CHECK(mem.f32(x.rs_out)[i] == sum);
      }
    }
    SECTION("all_to_all gives coordinate c block c of every member, in coordinate order: " + ax.name) {
      for (std::int64_t k = 0; k < G; ++k)
        for (std::int64_t i = 0; i < S; ++i)
          CHECK(mem.f32(x.a2a_out)[k * S + i] == static_cast<float>(group[static_cast<std::size_t>(k)] * 1000 + c * S + i));
    }
    SECTION("broadcast copies the root coordinate's buffer to the group: " + ax.name) {
      const int root = group.back();
      for (std::int64_t i = 0; i < S; ++i) CHECK(mem.f32(x.bc)[i] == static_cast<float>(root * 10 + i));
    }
    SECTION("send and recv pass a message one coordinate to the right: " + ax.name) {
      const int left = group[static_cast<std::size_t>((c + G - 1) % G)];
      for (std::int64_t i = 0; i < S; ++i) CHECK(mem.f32(x.recv)[i] == static_cast<float>(left * 1000 + i));
    }
  }
}

TEST_CASE("lane communicators group the ranks that share every other coordinate", "[mpi][mesh]") {
  rt::mpi::backend be;
  const int n = be.world_size();
  ir::builder b("lanes");
  b.axis("dp", n >= 4 ? n / 2 : n);
  b.axis("tp", n >= 4 ? 2 : 1);
  const auto x = b.buffer("x", {1});
  b.compute(ir::op_kind::elementwise, "z", {}, {x}, {ir::op::zero});
  rt::executor ex(mpi_testing::unit_plan(planner::program_order_schedule(std::move(b).finish()), "program_order"), be);
  for (ir::stream_id s = 1; s <= 2; ++s) {
    const auto& name = ex.plan().graph.axes[static_cast<std::size_t>(s - 1)].name;
    const auto members = be.mesh().group(name, be.rank());
    MPI_Group world_group, lane_group;
    MPI_Comm_group(MPI_COMM_WORLD, &world_group);
    MPI_Comm_group(be.lane_communicator(s), &lane_group);
    std::vector<int> lane_ranks(members.size()), world_ranks(members.size());
    for (std::size_t i = 0; i < members.size(); ++i) lane_ranks[i] = static_cast<int>(i);
    MPI_Group_translate_ranks(lane_group, static_cast<int>(members.size()), lane_ranks.data(), world_group, world_ranks.data());
    MPI_Group_free(&lane_group);
    MPI_Group_free(&world_group);
    CAPTURE(name, be.rank());
    CHECK(world_ranks == members);
    CHECK(be.lane_communicator(s) != MPI_COMM_WORLD);
  }
  CHECK(be.lane_communicator(1) != be.lane_communicator(2));
}

CONCERTO_MPI_TEST_MAIN
