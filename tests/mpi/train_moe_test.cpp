// The mixture-of-experts form of the Llama example's decoder (tests/mpi/llama_program.hpp,
// make_moe: 4 SwiGLU experts behind a top-2 router, capacity factor 1.25, the balance loss)
// through train::compile: its single-rank gradient is the finite difference of its loss (balance loss
// off: its value is not in the loss); on 2 and 4 ranks, with every dp × ep mesh that divides,
// the losses, gradients and parameters after a few steps match the single-rank run within
// train_testing::rel_tol (1e-5 relative), with the balance loss on, experts split over ep and,
// on 4 ranks, over tp inside each expert; so do the three plan policies, and the layout automatic
// sharding decides.
#include "llama_program.hpp"
#include "train_testing.hpp"

#include <cmath>
#include <span>
#include <stdexcept>
#include <tuple>

using namespace concerto;
namespace tt = train_testing;
namespace lt = llama_testing;

namespace {

using namespace small_moe;
const std::vector<std::string> params{"wte", "layers.0.wq", "layers.1.wo", "layers.0.router", "layers.1.router",
                                      "layers.0.w1", "layers.1.w3", "layers.0.w2", "layers.1.ffn_norm.g", "head"};
constexpr auto no_balance_loss = lt::make_moe<moe_config{.top_k = 2, .capacity_factor = 1.25, .aux_weight = 0}>();
constexpr auto moe_top2 = lt::make_moe<lt::top2>();
constexpr auto moe_decided = lt::make_moe<lt::top2, adamw{}, lt::moe_decided>(); // every spec and .to written auto_

train::step_options options(planner::policy policy) {
  return {.policy = policy, .lower = {.name = "moe", .heads = heads, .depth = {{"layers", 2}}},
          .solver = {.time_budget_s = 2, .progress = false}};
}

template <std::size_t N>
tt::run_result run(const graph::program<N>& p, MPI_Comm comm, int d, int e, planner::policy policy, int t = 1) {
  return tt::run(p, shapes, comm, {{"dp", d}, {"ep", e}, {"tp", t}}, data(), 3, {.adamw = {.lr = 1e-3f}}, options(policy),
                 params);
}

} // namespace

TEST_CASE("the MoE decoder's gradient on one rank is the finite difference of its loss", "[mpi][train][moe][grad]") {
  auto step = train::compile(no_balance_loss, mesh::from_world(1, {{"dp", 1}, {"ep", 1}, {"tp", 1}}), shapes, {.adamw = {.lr = 0.0f}},
                             [] {
                               auto o = options(planner::policy::program_order);
                               o.world = MPI_COMM_SELF;
                               o.use_cache = false;
                               return o;
                             }());
  const auto b = data();
  const double loss = step(b).loss;
  CHECK(std::abs(loss - std::log(static_cast<double>(vocab))) < 1.0);
  // The routing is piecewise smooth: a step that moves a token across a top-k or capacity
  // boundary jumps the loss; such entries are passed over. The router takes part through the gates.
  tt::check_gradients_by_differences(step, b, params, {.eps = 1e-3f, .min_largest_gradient = 1e-5, .kinks_around = loss});
}

TEST_CASE("the MoE decoder trains to the single-rank numbers on every dp x ep mesh", "[mpi][train][moe]") {
  const auto reference = run(moe_top2, MPI_COMM_SELF, 1, 1, planner::policy::program_order);
  REQUIRE(reference.loss.back() < reference.loss.front());
  const int world = runtime::mpi::environment::world_size();
  for (int ranks : {2, 4}) {
    if (ranks > world) continue;
    tt::sub_world sub(ranks);
    if (!sub.member()) continue;
    for (auto [d, e, t] : std::vector<std::tuple<int, int, int>>{{ranks, 1, 1}, {1, ranks, 1}, {2, 2, 1}, {1, 2, 2}}) {
      if (d * e * t != ranks) continue;
      CAPTURE(ranks, d, e, t);
      // Plain loops, not SECTIONs: ranks outside the sub-world would discover fewer sections.
      tt::check_same(run(moe_top2, sub.get(), d, e, planner::policy::sync, t), reference);
    }
  }
}

TEST_CASE("the MoE decoder with its layout decided trains to the single-rank numbers", "[mpi][train][moe][autoshard]") {
  // train::compile chooses where the experts live, the tokens' and the dispatched tokens'
  // layouts and the ZeRO stage (rank 0, sent to the others), then trains: any sharding is exact.
  const auto reference = run(moe_top2, MPI_COMM_SELF, 1, 1, planner::policy::program_order);
  tt::on_sub_worlds({2, 4}, [&](MPI_Comm comm, int ranks) {
    tt::check_same(run(moe_decided, comm, ranks / 2, 2, planner::policy::sync), reference); // dp 1 x ep 2, dp 2 x ep 2
  });
}

// The balance loss of each layer, read back after a step: on every mesh the value one rank
// computes (the value itself is checked against the routing's gradient in tests/cpu).
TEST_CASE("each MoE layer's balance loss is readable after a step, the same on every mesh", "[mpi][train][moe]") {
  const auto balance_after_one_step = [](MPI_Comm comm, int d, int e) {
    int n = 0;
    MPI_Comm_size(comm, &n);
    auto o = options(planner::policy::program_order);
    o.world = comm;
    o.use_cache = false;
    auto step = train::compile(moe_top2, mesh::from_world(n, {{"dp", d}, {"ep", e}, {"tp", 1}}), shapes,
                               {.adamw = {.lr = 1e-3f}}, o);
    (void)step(data());
    return step.moe_balance_losses();
  };
  const auto reference = balance_after_one_step(MPI_COMM_SELF, 1, 1);
  REQUIRE(reference.size() == 2); // one per layer, in layer order
  CHECK(reference[0].router.starts_with("layers.0."));
  CHECK(reference[1].router.starts_with("layers.1."));
  for (const auto& layer : reference) {
    CAPTURE(layer.router, layer.balance);
    CHECK(layer.weight == Catch::Approx(lt::top2.aux_weight));
    CHECK(layer.loss == Catch::Approx(layer.weight * layer.balance));
    CHECK(layer.balance > 0.5); // about 1 for a router that starts near uniform
    CHECK(layer.balance <= static_cast<double>(experts));
  }
  const int world = runtime::mpi::environment::world_size();
  const int e = 2, d = world / e;
  const auto split = balance_after_one_step(MPI_COMM_WORLD, d, e);
  REQUIRE(split.size() == reference.size());
  for (std::size_t l = 0; l < split.size(); ++l) {
    CAPTURE(l);
    CHECK(split[l].router == reference[l].router);
    CHECK(std::abs(split[l].balance - reference[l].balance) <= 1e-5 * reference[l].balance);
  }
}

TEST_CASE("the sync, program_order and concerto plans of the dp x ep MoE give the same numbers", "[mpi][train][moe]") {
  const int world = runtime::mpi::environment::world_size();
  const int e = 2, d = world / e;
  const auto reference = run(moe_top2, MPI_COMM_SELF, 1, 1, planner::policy::program_order);
  for (const auto policy : {planner::policy::sync, planner::policy::program_order, planner::policy::concerto}) {
    CAPTURE(policy);
    tt::check_same(run(moe_top2, MPI_COMM_WORLD, d, e, policy), reference);
  }
}

// The planner's copy-free split of a layer's four exchanges (planner::split_kind::expert_exchanges):
// the MoE kernels lay their slots out chunk-major and every exchange moves k contiguous chunks.
// Forced here (the cost model would not split at these sizes); one expert per rank (ep = 4).
TEST_CASE("the MoE exchanges split chunk-major give the single-rank numbers", "[mpi][train][moe][decompose]") {
  const int world = runtime::mpi::environment::world_size();
  if (world < experts) {
    SUCCEED("one expert per rank needs 4 ranks");
    return;
  }
  tt::sub_world sub(experts);
  if (!sub.member()) {
    SUCCEED("outside the 4 ranks");
    return;
  }
  const auto reference = run(moe_top2, MPI_COMM_SELF, 1, 1, planner::policy::program_order);
  for (int k : {2, 4}) {
    CAPTURE(k);
    auto o = options(planner::policy::program_order);
    o.rewrite = [k](const ir::graph& g) {
      std::vector<planner::decomposition> layers;
      for (const auto& t : g.tasks)
        if (t.fn == ir::op::moe_dispatch) layers.push_back({-1, t.id, k, planner::split_kind::expert_exchanges});
      if (layers.size() != 2) throw std::runtime_error("expected the two layers' moe_dispatch");
      return planner::apply(g, std::span<const planner::decomposition>(layers));
    };
    tt::check_same(tt::run(moe_top2, shapes, sub.get(), {{"dp", 1}, {"ep", experts}, {"tp", 1}}, data(), 3,
                           {.adamw = {.lr = 1e-3f}}, o, params),
                   reference);
  }
}

CONCERTO_MPI_TEST_MAIN
