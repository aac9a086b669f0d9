// Plan agreement before the first step: a plan whose collective order differs across ranks is
// refused on every rank (before any collective of the step could hang), with the first
// differing collective named; rank 0's planning failure reaches every rank.
#include "mpi_testing.hpp"

#include <concerto/ir/builder.hpp>
#include <concerto/runtime/executor.hpp>
#include <concerto/runtime/mpi/backend.hpp>

#include <catch2/catch_test_macros.hpp>
#include <catch2/matchers/catch_matchers_string.hpp>

#include <algorithm>

using namespace concerto;
namespace rt = concerto::runtime;
using Catch::Matchers::ContainsSubstring;

namespace {

// Two independent gradient all-reduces on the dp lane: either order is a valid plan.
planner::ordering two_reductions(int ranks) {
  ir::builder b("agree");
  const int dp = b.axis("dp", ranks);
  const auto a = b.buffer("a.grad", {32}, ir::buffer_role::gradient);
  const auto c = b.buffer("b.grad", {64}, ir::buffer_role::gradient);
  b.compute(ir::op_kind::elementwise, "make", {}, {a, c}, {ir::op::zero});
  b.collective(ir::op_kind::all_reduce, "a.grad.ar", dp, a, a);
  b.collective(ir::op_kind::all_reduce, "b.grad.ar", dp, c, c);
  return planner::program_order_schedule(std::move(b).finish());
}

} // namespace

TEST_CASE("ranks holding the same plan agree and run it", "[mpi][agreement]") {
  rt::mpi::backend be;
  const auto p = mpi_testing::unit_plan(two_reductions(be.world_size()), "program_order");
  CHECK_NOTHROW(rt::check_plan_agreement(be, p));
  rt::executor ex(p, be);
  CHECK(ex.run_step().measured.timeline.size() == p.graph.tasks.size());
}

TEST_CASE("a plan whose collective order differs across ranks is refused on every rank", "[mpi][agreement]") {
  rt::mpi::backend be;
  auto s = two_reductions(be.world_size());
  if (be.rank() % 2 == 1) std::reverse(s.order[1].begin(), s.order[1].end()); // odd ranks reduce b first
  const auto p = mpi_testing::unit_plan(s, be.rank() % 2 ? "reversed" : "program_order");
  CHECK_THROWS_WITH(rt::check_plan_agreement(be, p),
                    ContainsSubstring("rank 1 differs from rank 0 at collective 0") &&
                        ContainsSubstring("rank 0 issues all_reduce 'a.grad.ar' on mesh axis 'dp' (128 bytes)") &&
                        ContainsSubstring("rank 1 issues all_reduce 'b.grad.ar'"));
}

TEST_CASE("plans that differ only in compute are refused by their hash", "[mpi][agreement]") {
  rt::mpi::backend be;
  auto s = two_reductions(be.world_size());
  if (be.rank() == be.world_size() - 1) s.graph.tasks[0].name = "make.renamed";
  const auto p = mpi_testing::unit_plan(s, "program_order");
  CHECK_THROWS_WITH(rt::check_plan_agreement(be, p),
                    ContainsSubstring("rank " + std::to_string(be.world_size() - 1) + "'s plan (hash") &&
                        ContainsSubstring("collective sequences agree"));
}

TEST_CASE("distribute_plan gives every rank rank 0's plan, or rank 0's error", "[mpi][agreement]") {
  rt::mpi::backend be;
  SECTION("rank 0's plan arrives intact") {
    const auto mine = mpi_testing::unit_plan(two_reductions(be.world_size()), "program_order");
    const auto got = rt::distribute_plan(be, [&] { return mine; });
    CHECK(plan::hash(got) == plan::hash(mine));
  }
  SECTION("rank 0's failure to plan is rethrown everywhere") {
    CHECK_THROWS_WITH(rt::distribute_plan(be, []() -> plan::plan { fail("no solver today"); }),
                      ContainsSubstring("rank 0 could not make the plan: no solver today"));
  }
}

CONCERTO_MPI_TEST_MAIN
