// ZeRO over parameters whose dimensions do not divide over the data-parallel axis: a 5-row
// position table, a [5, 6] and a [6, 5] weight and a bias of 5, on dp 2 and 4 (4 ranks hold 2, 2,
// 1 and 0 of the 5 rows), alone or beside tp. ZeRO-1, -2 and -3 train to the losses, gradients
// and parameters of the single-rank run without ZeRO within train_testing::rel_tol, also through
// the plan choice's switches between plans; a checkpoint saved under ZeRO-3 holds the true
// shapes and continues on one rank without ZeRO, and one saved on one rank continues under
// ZeRO-1, each like an uninterrupted run; ZeRO-1 and -3 with pipeline stages give the
// single-rank numbers too.
#include "train_testing.hpp"

#include <concerto/concerto.hpp>
#include <concerto/train/checkpoint.hpp>

#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <string>
#include <string_view>

using namespace concerto;
namespace tt = train_testing;

namespace {

inline constexpr axis<"dp"> dp;
inline constexpr axis<"tp"> tp;
constexpr auto act = spec(shard(dp), replicate);
constexpr auto h = input<"x">(act) + embedding(data<"pos">(spec(shard(dp))), param<"pos_table">(spec(replicate, replicate)));
constexpr auto loss = mse(bias(matmul(gelu(matmul(h, param<"w1">(spec(replicate, shard(tp))))), param<"w2">(spec(shard(tp), replicate))),
                               param<"b2">(spec(replicate))),
                          input<"target">(act));
constexpr auto plain = program(loss, adamw{});
constexpr auto zero1 = program(loss, zero<1>(adamw{}, dp));
constexpr auto zero2 = program(loss, zero<2>(adamw{}, dp));
constexpr auto zero3 = program(loss, zero<3>(adamw{}, dp));

// 5 positions (and features): ZeRO splits pos_table, w1 and b2 on their 5 rows, w2 on its 5
// columns (its rows are tp's).
constexpr std::int64_t B = 8, K = 5, H = 6;
const shape_map shapes{{"x", {B, K}},   {"pos", {B}},   {"pos_table", {K, K}}, {"w1", {K, H}},
                       {"w2", {H, K}},  {"b2", {K}},    {"target", {B, K}}};
const std::vector<std::string> params{"pos_table", "w1", "w2", "b2"};

train::batch data() {
  train::tensor x{{B, K}}, pos{{B}}, t{{B, K}};
  for (std::int64_t i = 0; i < B * K; ++i) {
    x.f32.push_back(std::sin(0.37f * static_cast<float>(i)));
    t.f32.push_back(0.5f * std::cos(0.23f * static_cast<float>(i)));
  }
  for (std::int64_t i = 0; i < B; ++i) pos.i64.push_back(i % K);
  return {{"x", x}, {"pos", pos}, {"target", t}};
}

const train::optimizer_settings adam{.adamw = {.lr = 2e-2f}};

train::step_options options(MPI_Comm comm) {
  return {.policy = planner::policy::program_order, .use_cache = false, .world = comm};
}

template <std::size_t N>
tt::run_result run(const graph::program<N>& p, MPI_Comm comm, int d, int t) {
  return tt::run(p, shapes, comm, {{"dp", d}, {"tp", t}}, data(), 3, adam, {.policy = planner::policy::sync}, params);
}

template <std::size_t N>
train::step<N> compile_on(const graph::program<N>& p, MPI_Comm comm, int d, int t) {
  return train::compile(p, mesh::from_world(d * t, {{"dp", d}, {"tp", t}}), shapes, adam, options(comm));
}

// A pipelined model (its inputs are data leaves, its layers a repeat): an embedding of 7 rows,
// a stack of two blocks and a head, all with a dimension of 5 or 7 that ZeRO splits.
constexpr auto rows = spec(shard(dp));
constexpr auto block = [](auto x) {
  return x + matmul(gelu(matmul(x, param<"w1">(spec(replicate, shard(tp))))), param<"w2">(spec(shard(tp), replicate)));
};
template <class Opt>
constexpr auto stacked(Opt o) {
  return program(cross_entropy(matmul(repeat<"layers">(block, embedding(data<"ids">(rows), param<"wte">(spec(replicate, replicate)))),
                                      param<"head">(spec(replicate, replicate))),
                               data<"labels">(rows)),
                 o);
}
constexpr auto stacked_plain = stacked(adamw{});
constexpr auto stacked_zero1 = stacked(zero<1>(adamw{}, dp));
constexpr auto stacked_zero3 = stacked(zero<3>(adamw{}, dp));
constexpr std::int64_t V = 7;
const shape_map stacked_shapes{{"ids", {B}},    {"labels", {B}}, {"wte", {V, K}},
                               {"head", {K, V}}, {"w1", {K, H}},  {"w2", {H, K}}};

template <std::size_t N>
tt::run_result run_stacked(const graph::program<N>& p, MPI_Comm comm, int pp, int d, int microbatches) {
  train::batch b{{"ids", {{B}}}, {"labels", {{B}}}};
  for (std::int64_t i = 0; i < B; ++i) {
    b["ids"].i64.push_back((i * 3 + 1) % V);
    b["labels"].i64.push_back((i * 3 + 2) % V);
  }
  train::step_options o{.policy = planner::policy::program_order, .lower = {.depth = {{"layers", 2}}}};
  o.pipeline = {.microbatches = microbatches, .schedule = "1f1b", .search_budget_s = 1};
  return tt::run(p, stacked_shapes, comm, {{"pp", pp}, {"dp", d}, {"tp", 1}}, b, 3, adam, o,
                 {"wte", "layers.0.w1", "layers.1.w2", "head"});
}

// A directory every rank agrees on (rank 0's pid), removed by rank 0 at the end.
std::filesystem::path shared_temp_dir() {
  long pid = ::getpid();
  MPI_Bcast(&pid, 1, MPI_LONG, 0, MPI_COMM_WORLD);
  return std::filesystem::temp_directory_path() / ("concerto-zero-test-" + std::to_string(pid));
}

// Step 3's loss and the parameters after it of a step that ran steps 1 and 2 elsewhere.
template <class Step>
void check_third_step(Step& s, const tt::run_result& reference) {
  CHECK(s.completed_steps() == 2);
  const auto loss = s(data()).loss;
  CAPTURE(loss, reference.loss[2]);
  CHECK(std::abs(loss - reference.loss[2]) <= tt::rel_tol * std::abs(reference.loss[2]) + tt::abs_tol);
  for (const auto& name : params) {
    CAPTURE(name);
    CHECK(tt::worst_relative(s.parameter(name), reference.params.at(name)) <= tt::rel_tol);
  }
}

} // namespace

TEST_CASE("ZeRO trains parameters whose rows do not divide over dp to the single-rank numbers", "[mpi][train][zero]") {
  const auto reference = run(plain, MPI_COMM_SELF, 1, 1);
  REQUIRE(reference.loss.back() < reference.loss.front()); // it learns, so equal numbers mean something
  const int world = runtime::mpi::environment::world_size();
  for (int ranks : {2, 4}) {
    if (ranks > world) continue;
    tt::sub_world sub(ranks);
    if (!sub.member()) continue;
    for (auto [d, t] : std::vector<std::pair<int, int>>{{ranks, 1}, {2, 2}}) {
      if (d * t != ranks) continue;
      CAPTURE(ranks, d, t);
      {
        INFO("ZeRO-1");
        tt::check_same(run(zero1, sub.get(), d, t), reference);
      }
      {
        INFO("ZeRO-2");
        tt::check_same(run(zero2, sub.get(), d, t), reference);
      }
      {
        INFO("ZeRO-3");
        tt::check_same(run(zero3, sub.get(), d, t), reference);
      }
    }
  }
}

TEST_CASE("uneven ZeRO shards keep their numbers through the plan choice's switches", "[mpi][train][zero][choice]") {
  // The concerto plan's rewrites, then candidates measured in turn: every switch carries the
  // parameters and states to the next plan by name (the views, not the padded buffers under them).
  // The measured times favour 'sync', so the run really ends on another plan than it began with.
  constexpr int steps = 14; // 1 profiled + up to 6 candidates x 2 rounds, then the winner
  const int world = runtime::mpi::environment::world_size();
  const int t = world >= 4 ? 2 : 1;
  const auto reference = tt::run(plain, shapes, MPI_COMM_SELF, {{"dp", 1}, {"tp", 1}}, data(), steps, adam,
                                 {.policy = planner::policy::sync}, params);
  auto o = options(MPI_COMM_WORLD);
  o.policy = planner::policy::concerto;
  o.solver = {.time_budget_s = 0.5, .progress = false};
  o.choice = {.enabled = true, .warmup_steps = 0, .profile_steps = 1, .trial_steps = 1, .rounds = 2};
  o.choice.adjust_measured = [](int, std::string_view candidate, double us) { return candidate == "sync" ? 1.0 : us + 1e6; };
  auto s = train::compile(zero3, mesh::from_world(world, {{"dp", world / t}, {"tp", t}}), shapes, adam, o);
  tt::run_result r;
  for (int i = 0; i < steps; ++i) r.loss.push_back(s(data()).loss);
  REQUIRE(s.choice().decided());
  CHECK(s.plan().policy == "sync");
  for (const auto& name : params) {
    r.grads[name] = s.gradient(name);
    r.params[name] = s.parameter(name);
  }
  tt::check_same(r, reference);
}

TEST_CASE("uneven ZeRO shards train to the single-rank numbers with pipeline stages", "[mpi][train][zero][pipeline]") {
  // 2 stages of dp 2 on 4 ranks (dp 1 on 2), 2 micro-batches: the stages' gradients accumulate
  // over the micro-batches into the padded buffers the reduce-scatters read.
  const int world = runtime::mpi::environment::world_size();
  const auto reference = run_stacked(stacked_plain, MPI_COMM_SELF, 1, 1, 1);
  REQUIRE(reference.loss.back() < reference.loss.front());
  {
    INFO("ZeRO-1");
    tt::check_same(run_stacked(stacked_zero1, MPI_COMM_WORLD, 2, world / 2, 2), reference);
  }
  {
    INFO("ZeRO-3");
    tt::check_same(run_stacked(stacked_zero3, MPI_COMM_WORLD, 2, world / 2, 2), reference);
  }
}

TEST_CASE("a ZeRO checkpoint of uneven shards holds the true shapes and continues on another mesh", "[mpi][train][zero][checkpoint]") {
  const int world = runtime::mpi::environment::world_size();
  const bool root = runtime::mpi::environment::world_rank() == 0;
  const auto dir = shared_temp_dir();
  const auto reference = run(plain, MPI_COMM_SELF, 1, 1);
  SECTION("saved under ZeRO-3 on dp = the world, continued on one rank without ZeRO") {
    {
      auto s = compile_on(zero3, MPI_COMM_WORLD, world, 1);
      for (int i = 0; i < 2; ++i) s(data());
      s.save(dir / "zero3.ckpt");
      CHECK(s.completed_steps() == 2);
    }
    if (root) {
      const auto file = train::checkpoint::read(dir / "zero3.ckpt");
      for (const char* name : {"pos_table", "pos_table.m", "w2", "w2.v"}) {
        CAPTURE(name);
        CHECK(file.tensors.at(name).shape == (std::string_view(name).starts_with("w2") ? std::vector<std::int64_t>{H, K}
                                                                                         : std::vector<std::int64_t>{K, K}));
      }
      CHECK(file.tensors.at("b2.v").shape == std::vector<std::int64_t>{K});
      auto s = compile_on(plain, MPI_COMM_SELF, 1, 1);
      s.load(dir / "zero3.ckpt");
      check_third_step(s, reference);
    }
  }
  SECTION("saved on one rank without ZeRO, continued under ZeRO-1 on dp x tp") {
    if (root) {
      auto s = compile_on(plain, MPI_COMM_SELF, 1, 1);
      for (int i = 0; i < 2; ++i) s(data());
      s.save(dir / "plain.ckpt");
    }
    MPI_Barrier(MPI_COMM_WORLD);
    const int t = world >= 4 ? 2 : 1;
    auto s = compile_on(zero1, MPI_COMM_WORLD, world / t, t);
    s.load(dir / "plain.ckpt");
    check_third_step(s, reference);
  }
  MPI_Barrier(MPI_COMM_WORLD);
  if (root) std::filesystem::remove_all(dir);
}

CONCERTO_MPI_TEST_MAIN
