// The Evoformer pair stack of examples/evoformer (row and column gated self-attention, the
// transition; dynamic axial parallelism over `dap`) through train::compile: its single-rank
// gradient is the finite difference of its loss; on 2 and 4 ranks, split over dap, the losses,
// gradients and parameters after a few steps match the single-rank run within
// train_testing::rel_tol (1e-5 relative); so do the three plan policies.
#include "../../examples/evoformer/model.hpp"
#include "train_testing.hpp"

#include <cmath>

using namespace concerto;
namespace tt = train_testing;
namespace em = evoformer_model;

namespace {

constexpr std::int64_t residues = 8, channels = 8, heads = 2;
const auto shapes = em::shapes(residues, channels);
const std::vector<std::string> params{"blocks.0.row.wq", "blocks.1.row.wg", "blocks.0.col.wk", "blocks.1.col.wo",
                                      "blocks.0.col.ln.g", "blocks.1.tr.w1", "blocks.0.tr.w2", "blocks.1.tr.ln.b"};

// Pair features and a target that depends on them (a smooth function of both residues).
train::batch data() {
  train::tensor z{{residues, residues, channels}}, target{{residues, residues, channels}};
  for (std::int64_t i = 0; i < residues; ++i)
    for (std::int64_t j = 0; j < residues; ++j)
      for (std::int64_t c = 0; c < channels; ++c) {
        z.f32.push_back(static_cast<float>(std::sin(0.7 * static_cast<double>(i) + 0.3 * static_cast<double>(c)) -
                                           std::cos(0.5 * static_cast<double>(j * (c + 1)))));
        target.f32.push_back(static_cast<float>(std::tanh(0.2 * static_cast<double>(i - j) + 0.1 * static_cast<double>(c))));
      }
  return {{"z", z}, {"target", target}};
}

train::step_options options(planner::policy policy) {
  return {.policy = policy, .lower = {.name = "evoformer", .heads = heads, .depth = {{"blocks", 2}}},
          .solver = {.time_budget_s = 2, .progress = false}};
}

tt::run_result run(MPI_Comm comm, int d, planner::policy policy) {
  return tt::run(em::pair_stack, shapes, comm, {{"dap", d}}, data(), 3, {.adamw = {.lr = 1e-3f}}, options(policy), params);
}

} // namespace

TEST_CASE("the Evoformer pair stack's gradient on one rank is the finite difference of its loss", "[mpi][train][evoformer]") {
  auto step = train::compile(em::pair_stack, mesh::from_world(1, {{"dap", 1}}), shapes, {.adamw = {.lr = 0.0f}}, [] {
    auto o = options(planner::policy::program_order);
    o.world = MPI_COMM_SELF;
    o.use_cache = false;
    return o;
  }());
  const auto b = data();
  (void)step(b);
  // A small eps: ReLU kinks are near.
  tt::check_gradients_by_differences(step, b, params, {.eps = 1e-3f, .min_largest_gradient = 1e-5});
}

TEST_CASE("the Evoformer pair stack over dap trains to the single-rank numbers", "[mpi][train][evoformer]") {
  const auto reference = run(MPI_COMM_SELF, 1, planner::policy::program_order);
  REQUIRE(reference.loss.back() < reference.loss.front());
  tt::on_sub_worlds({2, 4}, [&](MPI_Comm comm, int ranks) { tt::check_same(run(comm, ranks, planner::policy::sync), reference); });
}

TEST_CASE("the sync, program_order and concerto plans of the DAP pair stack give the same numbers", "[mpi][train][evoformer]") {
  const int world = runtime::mpi::environment::world_size();
  const auto reference = run(MPI_COMM_SELF, 1, planner::policy::program_order);
  for (const auto policy : {planner::policy::sync, planner::policy::program_order, planner::policy::concerto}) {
    CAPTURE(policy);
    tt::check_same(run(MPI_COMM_WORLD, world, policy), reference);
  }
}

CONCERTO_MPI_TEST_MAIN
