// A small Llama-family decoder (tests/mpi/llama_program.hpp: RMSNorm, RoPE, grouped-query
// attention with half as many k/v heads, SwiGLU, untied head, AdamW) through train::compile: its
// single-rank gradient is the finite difference of its loss; on 2 and 4 ranks, with every mesh
// that divides (DP, TP, DP x TP, with and without sequence parallelism), the losses, gradients
// and parameters after a few steps match the single-rank run within train_testing::rel_tol
// (1e-5 relative); so do the three plan policies.
#include "llama_program.hpp"
#include "train_testing.hpp"

#include <cmath>

using namespace concerto;
namespace tt = train_testing;
namespace lt = llama_testing;

namespace {

// 8 query heads and 4 k/v heads of 4 lanes: on tp = 4 each rank holds 2 query heads and 1 k/v head.
constexpr std::int64_t batch = 4, seq = 8, vocab = 32, hidden = 32, heads = 8, kv_heads = 4, ffn = 48;
const auto shapes = lt::shapes(batch, seq, vocab, hidden, heads, kv_heads, ffn);
const std::vector<std::string> params{"wte", "layers.0.wq", "layers.1.wk", "layers.0.wv", "layers.1.wo",
                                      "layers.0.w1", "layers.1.w3", "layers.0.w2", "layers.0.attn_norm.g",
                                      "layers.1.ffn_norm.g", "norm.g", "head"};

train::batch data(std::int64_t rows = batch) {
  train::tensor ids{{rows, seq}}, labels{{rows, seq}}, positions{{rows, seq}};
  for (std::int64_t i = 0; i < rows * seq; ++i) {
    ids.i64.push_back((i * 7 + 3) % vocab);
    labels.i64.push_back((i * 7 + 10) % vocab); // the next id of the same sequence rule
    positions.i64.push_back(i % seq);
  }
  return {{"ids", ids}, {"labels", labels}, {"positions", positions}};
}

train::step_options options(planner::policy policy) {
  return {.policy = policy, .lower = {.name = "llama", .heads = heads, .depth = {{"layers", 2}}},
          .solver = {.time_budget_s = 2, .progress = false}};
}

// lr 1e-3, not the GPT test's 1e-2: AdamW's first steps move every element by about lr whatever
// its gradient's size, so elements whose gradient is at float-rounding level (many of SwiGLU's
// w3 at this initialisation) turn summation-order noise into parameter differences of order
// lr·noise/eps. At 1e-2 the meshes then differ by 1.2e-5 to 2.4e-5 (measured), at 1e-4 by less
// than 1e-5: the differences follow the step size, not the mesh.
template <std::size_t N>
tt::run_result run(const graph::program<N>& p, MPI_Comm comm, int d, int t, planner::policy policy, int steps = 3) {
  return tt::run(p, shapes, comm, {{"dp", d}, {"tp", t}}, data(), steps, {.adamw = {.lr = 1e-3f}}, options(policy),
                 params);
}

} // namespace

TEST_CASE("the Llama's gradient on one rank is the finite difference of its loss", "[mpi][train][llama][grad]") {
  auto step = train::compile(lt::llama_tp, mesh::from_world(1, {{"dp", 1}, {"tp", 1}}), shapes, {.adamw = {.lr = 0.0f}},
                             [] {
                               auto o = options(planner::policy::program_order);
                               o.world = MPI_COMM_SELF;
                               o.use_cache = false;
                               return o;
                             }());
  const auto b = data();
  const double loss = step(b).loss;
  CHECK(std::abs(loss - std::log(static_cast<double>(vocab))) < 1.0); // small initial weights: near uniform
  tt::check_gradients_by_differences(step, b, params, {});
}

TEST_CASE("the DSL Llama trains to the single-rank numbers on every mesh that divides", "[mpi][train][llama]") {
  const auto reference = run(lt::llama_tp, MPI_COMM_SELF, 1, 1, planner::policy::program_order);
  REQUIRE(reference.loss.back() < reference.loss.front());
  const int world = runtime::mpi::environment::world_size();
  for (int ranks : {2, 4}) {
    if (ranks > world) continue;
    tt::sub_world sub(ranks);
    if (!sub.member()) continue;
    for (auto [d, t] : std::vector<std::pair<int, int>>{{ranks, 1}, {1, ranks}, {2, 2}}) {
      if (d * t != ranks) continue;
      CAPTURE(ranks, d, t);
      // Plain loops, not SECTIONs: ranks outside the sub-world would discover fewer sections.
      tt::check_same(run(lt::llama_tp, sub.get(), d, t, planner::policy::sync), reference);
      if (t > 1) {
        INFO("sequence parallel");
        tt::check_same(run(lt::llama_sp, sub.get(), d, t, planner::policy::sync), reference);
      }
    }
  }
}

TEST_CASE("the sync, program_order and concerto plans of the DP x TP Llama give the same numbers", "[mpi][train][llama]") {
  const int world = runtime::mpi::environment::world_size();
  const int t = 2, d = world / t;
  const auto reference = run(lt::llama_tp, MPI_COMM_SELF, 1, 1, planner::policy::program_order);
  for (const auto policy : {planner::policy::sync, planner::policy::program_order, planner::policy::concerto}) {
    CAPTURE(policy);
    tt::check_same(run(lt::llama_sp, MPI_COMM_WORLD, d, t, policy), reference);
  }
}

CONCERTO_MPI_TEST_MAIN
