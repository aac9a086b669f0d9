// A small GPT (tests/mpi/gpt_program.hpp: vocab-parallel embedding and cross-entropy, a repeat of
// two blocks, AdamW) through train::compile: its single-rank gradient is the finite difference of
// its loss; on 2 and 4 ranks, with every mesh that divides (DP, TP, DP x TP, with and without
// sequence parallelism), the losses, gradients and parameters after a few steps match the
// single-rank run within train_testing::rel_tol (1e-5 relative); so do the three plan policies.
#include "gpt_program.hpp"
#include "train_testing.hpp"

#include <cmath>

using namespace concerto;
namespace tt = train_testing;
namespace gt = gpt_testing;

namespace {

constexpr std::int64_t batch = 4, seq = 8, vocab = 32, hidden = 16;
const auto shapes = gt::shapes(batch, seq, vocab, hidden);
const std::vector<std::string> params{"wte", "layers.0.wq", "layers.1.wo", "layers.1.fc1", "layers.0.fc2",
                                      "layers.0.ln1.g", "layers.1.ln2.b", "lnf.g", "head"};

train::batch data(std::int64_t rows = batch) {
  train::tensor ids{{rows, seq}}, labels{{rows, seq}};
  for (std::int64_t i = 0; i < rows * seq; ++i) {
    ids.i64.push_back((i * 7 + 3) % vocab);
    labels.i64.push_back((i * 7 + 10) % vocab); // the next id of the same sequence rule
  }
  return {{"ids", ids}, {"labels", labels}};
}

train::step_options options(planner::policy policy) {
  return {.policy = policy, .lower = {.name = "gpt", .heads = 4, .depth = {{"layers", 2}}},
          .solver = {.time_budget_s = 2, .progress = false}};
}

template <std::size_t N>
tt::run_result run(const graph::program<N>& p, MPI_Comm comm, int d, int t, planner::policy policy, int steps = 3) {
  return tt::run(p, shapes, comm, {{"dp", d}, {"tp", t}}, data(), steps, {.adamw = {.lr = 1e-2f}}, options(policy),
                 params);
}

} // namespace

TEST_CASE("the GPT's gradient on one rank is the finite difference of its loss", "[mpi][train][gpt][grad]") {
  auto step = train::compile(gt::gpt_tp, mesh::from_world(1, {{"dp", 1}, {"tp", 1}}), shapes, {.adamw = {.lr = 0.0f}},
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

TEST_CASE("the DSL GPT trains to the single-rank numbers on every mesh that divides", "[mpi][train][gpt]") {
  const auto reference = run(gt::gpt_tp, MPI_COMM_SELF, 1, 1, planner::policy::program_order);
  REQUIRE(reference.loss.back() < reference.loss.front());
  const int world = runtime::mpi::environment::world_size();
  for (int ranks : {2, 4}) {
    if (ranks > world) continue;
    tt::sub_world sub(ranks);
    if (!sub.member()) continue;
    for (auto [d, t] : std::vector<std::pair<int, int>>{{ranks, 1}, {1, ranks}, {2, 2}}) {
      if (d * t != ranks) continue;
      CAPTURE(ranks, d, t);
      // Plain loops, not SECTIONs: ranks outside the sub-world would discover fewer sections,
      // rerun the test case fewer times and leave the others waiting in MPI_Comm_split.
      tt::check_same(run(gt::gpt_tp, sub.get(), d, t, planner::policy::sync), reference);
      if (t > 1) {
        INFO("sequence parallel");
        tt::check_same(run(gt::gpt_sp, sub.get(), d, t, planner::policy::sync), reference);
      }
    }
  }
}

TEST_CASE("the sync, program_order and concerto plans of the DP x TP GPT give the same numbers", "[mpi][train][gpt]") {
  const int world = runtime::mpi::environment::world_size();
  const int t = 2, d = world / t;
  const auto reference = run(gt::gpt_tp, MPI_COMM_SELF, 1, 1, planner::policy::program_order);
  for (const auto policy : {planner::policy::sync, planner::policy::program_order, planner::policy::concerto}) {
    CAPTURE(policy);
    tt::check_same(run(gt::gpt_sp, MPI_COMM_WORLD, d, t, policy), reference);
  }
}

TEST_CASE("a decomposed sequence-parallel GPT gives the numbers of the undecomposed one", "[mpi][train][gpt][decompose]") {
  const int world = runtime::mpi::environment::world_size();
  const int t = 2, d = world / t;
  // One sequence per data-parallel rank, so that the sequence dimension the SP collectives gather
  // and scatter is the outermost one and the planner can split them (with their matmuls).
  const std::int64_t rows = d;
  const auto one_row_shapes = gt::shapes(rows, seq, vocab, hidden);
  auto split_options = options(planner::policy::program_order);
  split_options.rewrite = tt::split_everything;
  const auto plain = tt::run(gt::gpt_sp, one_row_shapes, MPI_COMM_WORLD, {{"dp", d}, {"tp", t}}, data(rows), 3,
                             {.adamw = {.lr = 1e-2f}}, options(planner::policy::program_order), params);
  const auto split = tt::run(gt::gpt_sp, one_row_shapes, MPI_COMM_WORLD, {{"dp", d}, {"tp", t}}, data(rows), 3,
                             {.adamw = {.lr = 1e-2f}}, split_options, params);
  REQUIRE(split.summary.rewritten);
  CHECK(split.summary.tasks > plain.summary.tasks);
  tt::check_same(split, plain);
}

CONCERTO_MPI_TEST_MAIN
