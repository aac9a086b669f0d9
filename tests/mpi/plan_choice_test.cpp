// The plan choice of the first steps (train/plan_choice.hpp): a run that measures candidates and
// switches plans trains as one that keeps its first plan; every rank switches to rank 0's pick
// even when the ranks measured differently; the winner is kept in the plan cache and the next run
// starts from it, measuring it again against the rivals that came close; a damaged record is
// said and the choice made again.
#include "gpt_program.hpp"
#include "train_testing.hpp"

#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>
#include <string_view>
#include <vector>

using namespace concerto;
namespace tt = train_testing;
namespace gt = gpt_testing;

namespace {

// Built against the NCCL backend too (tests/gpu: its host emulation), where the executor sees
// issue times only: no refit.
constexpr bool gpu = train::default_backend::stream_ordered;

const std::vector<std::string> params{"wte", "layers.0.wq", "layers.1.fc1", "layers.0.ln1.g", "lnf.g", "head"};
constexpr int steps = 14; // 1 profiled + up to 6 candidates x 2 rounds, then the winner

train::step_options options(bool choose) {
  train::step_options o{.policy = planner::policy::concerto,
                        .lower = {.name = "gpt", .heads = 4, .depth = {{"layers", 2}}},
                        .solver = {.time_budget_s = 0.5, .progress = false}};
  // Every list baseline is a candidate ('sync' among them, which no cost model would pick).
  o.choice = {.enabled = choose, .warmup_steps = 0, .profile_steps = 1, .trial_steps = 1, .rounds = 2};
  return o;
}

int world_rank() {
  int r = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &r);
  return r;
}

// Every rank's text, checked equal to rank 0's.
bool same_on_every_rank(std::string text) {
  std::string root = text;
  const auto n = static_cast<long long>(root.size());
  long long size = n;
  MPI_Bcast(&size, 1, MPI_LONG_LONG, 0, MPI_COMM_WORLD);
  root.resize(static_cast<std::size_t>(size));
  MPI_Bcast(root.data(), static_cast<int>(size), MPI_CHAR, 0, MPI_COMM_WORLD);
  int same = root == text ? 1 : 0, all = 0;
  MPI_Allreduce(&same, &all, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
  return all == 1;
}

// A directory every rank agrees on (rank 0's pid), removed by rank 0 at the end.
std::filesystem::path shared_temp_dir() {
  long pid = ::getpid();
  MPI_Bcast(&pid, 1, MPI_LONG, 0, MPI_COMM_WORLD);
  return std::filesystem::temp_directory_path() / ("concerto-choice-test-" + std::to_string(pid));
}

auto compile(train::step_options o) {
  return train::compile(gt::gpt_sp, mesh::from_world(runtime::mpi::environment::world_size(), {{"dp", -1}, {"tp", 2}}),
                        gt::test_shapes(), {.adamw = {.lr = 1e-2f}}, std::move(o));
}

} // namespace

// The final layernorm's output: an activation, which no plan carries from step to step.
std::string final_layernorm(const ir::graph& g) {
  for (const auto& b : g.buffers)
    if (b.name.starts_with("layernorm#")) return b.name;
  FAIL("the GPT has no final layernorm");
  return {};
}

TEST_CASE("a run that switches plans while choosing trains as one that keeps its first plan", "[mpi][choice]") {
  auto o = options(true);
  // The measured times are made to favour 'sync' (which no cost model would pick), so that the
  // run really ends on another plan than it began with.
  o.choice.adjust_measured = [](int, std::string_view candidate, double us) { return candidate == "sync" ? 1.0 : us + 1e6; };
  o.use_cache = false;
  auto choosing = compile(o);
  // Run beside it, step for step: after every step, an activation gathered from either is the
  // value that step computed, whichever candidate plan ran it (the switch waits for the next step).
  auto beside = compile(options(false));
  const auto activation = final_layernorm(choosing.graph());
  tt::run_result switched;
  for (int s = 0; s < steps; ++s) {
    const auto b = gt::token_batch(s, gt::test_batch, gt::test_seq, gt::test_vocab);
    switched.loss.push_back(choosing(b).loss);
    (void)beside(b);
    CAPTURE(s, activation);
    CHECK(tt::worst_relative(choosing.gather(activation), beside.gather(activation)) <= tt::rel_tol);
    if (!choosing.choice().decided()) CHECK(s < steps - 1);
  }
  const auto& report = choosing.choice();
  REQUIRE(report.decided());
  CHECK_FALSE(report.from_cache);
  REQUIRE(report.candidates.size() >= 2);
  CHECK(report.candidates.front().name == "concerto");
  CHECK(report.candidates[static_cast<std::size_t>(report.winner)].name == "sync");
  CHECK(choosing.plan().policy == "sync");
  CHECK(report.candidates[static_cast<std::size_t>(report.winner)].plan_hash == hasher::to_hex(plan::hash(choosing.plan())));
  CHECK(report.decided_at_step == 1 + 2 * static_cast<std::int64_t>(report.candidates.size()));
  CHECK(report.refit.empty() == gpu);
  if (gpu)
    for (const auto& c : report.candidates) CHECK(c.name != "concerto (re-planned)");
  CHECK(report.text().find("kept 'sync'") != std::string::npos);
  for (const auto& name : params) {
    switched.grads[name] = choosing.gradient(name);
    switched.params[name] = choosing.parameter(name);
  }
  CHECK(same_on_every_rank(report.text()));

  auto keeping = compile(options(false));
  tt::run_result kept;
  for (int s = 0; s < steps; ++s) kept.loss.push_back(keeping(gt::token_batch(s, gt::test_batch, gt::test_seq, gt::test_vocab)).loss);
  CHECK_FALSE(keeping.choice().decided());
  CHECK(keeping.plan().policy == "concerto");
  for (const auto& name : params) {
    kept.grads[name] = keeping.gradient(name);
    kept.params[name] = keeping.parameter(name);
  }
  tt::check_same(switched, kept);
}

TEST_CASE("ranks that measure different times all switch to rank 0's pick", "[mpi][choice]") {
  auto o = options(true);
  o.use_cache = false;
  // Each rank prefers another candidate; rank 0 decides from the slowest rank of each step.
  o.choice.adjust_measured = [](int rank, std::string_view candidate, double us) {
    return us + (candidate == (rank % 2 == 0 ? "sync" : "concerto") ? 0.0 : 1e5 * (rank + 1));
  };
  auto step = compile(o);
  for (int s = 0; s < steps; ++s) (void)step(gt::token_batch(s, gt::test_batch, gt::test_seq, gt::test_vocab));
  REQUIRE(step.choice().decided());
  CHECK(same_on_every_rank(hasher::to_hex(plan::hash(step.plan()))));
  CHECK(same_on_every_rank(step.choice().text()));
}

TEST_CASE("the winner is kept in the plan cache; the next run starts from it; a damaged record is chosen again",
          "[mpi][choice]") {
  const auto dir = shared_temp_dir();
  auto o = options(true);
  o.cache_dir = dir;
  o.choice.adjust_measured = [](int, std::string_view candidate, double us) { return candidate == "sync" ? 1.0 : us + 1e6; };
  std::string winner_hash;
  {
    auto first = compile(o);
    for (int s = 0; s < steps; ++s) (void)first(gt::token_batch(s, gt::test_batch, gt::test_seq, gt::test_vocab));
    REQUIRE(first.choice().decided());
    winner_hash = hasher::to_hex(plan::hash(first.plan()));
  }
  {
    auto second = compile(o);
    second.prepare();
    REQUIRE(second.choice().decided());
    CHECK(second.choice().from_cache);
    CHECK(second.choice().candidates.front().name == "sync");
    CHECK(hasher::to_hex(plan::hash(second.plan())) == winner_hash);
    CHECK(second.choice().text().find("from the plan cache") != std::string::npos);
    CHECK(second.summary().cache_hit);
    // The summary prices the kept plan and sync by one model (the refitted one): the kept plan
    // is sync's own, so the two predictions agree.
    CHECK(second.summary().predicted_us == Catch::Approx(second.summary().sync_predicted_us).epsilon(1e-9));
  }
  // A record whose winner was renamed no longer names the plan it holds: refused, chosen again.
  MPI_Barrier(MPI_COMM_WORLD);
  if (world_rank() == 0)
    for (const auto& f : std::filesystem::directory_iterator(dir))
      if (f.path().filename().string().starts_with("choice-")) {
        nlohmann::json record;
        std::ifstream(f.path()) >> record;
        record["winner"] = "bogus";
        std::ofstream(f.path()) << record.dump();
      }
  MPI_Barrier(MPI_COMM_WORLD);
  {
    auto renamed = compile(o);
    renamed.prepare();
    CHECK_FALSE(renamed.choice().decided());
  }
  MPI_Barrier(MPI_COMM_WORLD);
  if (world_rank() == 0)
    for (const auto& f : std::filesystem::directory_iterator(dir))
      if (f.path().filename().string().starts_with("choice-")) std::ofstream(f.path()) << "{\"winner\": ";
  MPI_Barrier(MPI_COMM_WORLD);
  {
    auto third = compile(o);
    third.prepare();
    CHECK_FALSE(third.choice().decided()); // choosing again
    CHECK(third.plan().policy == "concerto");
  }
  MPI_Barrier(MPI_COMM_WORLD);
  if (world_rank() == 0) std::filesystem::remove_all(dir);
}

TEST_CASE("an earlier run's pick is measured again against the rival that came close; this run's faster one is kept",
          "[mpi][choice]") {
  const auto dir = shared_temp_dir();
  auto o = options(true);
  o.cache_dir = dir;
  // Steps of a plan cost what the run says it measured, whatever else they took.
  const auto measuring = [](double sync_us, double concerto_us) {
    return [=](int, std::string_view candidate, double us) {
      return candidate == "sync" ? sync_us : candidate == "concerto" ? concerto_us : us + 1e6;
    };
  };
  const auto run_until_decided = [](auto& step) {
    for (int s = 0; s < steps && !step.choice().decided(); ++s)
      (void)step(gt::token_batch(s, gt::test_batch, gt::test_seq, gt::test_vocab));
    REQUIRE(step.choice().decided());
    CHECK(same_on_every_rank(step.choice().text()));
    CHECK(same_on_every_rank(hasher::to_hex(plan::hash(step.plan()))));
  };
  const auto winner = [](const train::plan_choice_report& r) { return r.candidates[static_cast<std::size_t>(r.winner)].name; };
  o.choice.adjust_measured = measuring(1000, 1100); // the first plan within 1.25x of 'sync'
  {
    auto first = compile(o);
    run_until_decided(first);
    CHECK(winner(first.choice()) == "sync");
  }
  o.choice.adjust_measured = measuring(1000, 900); // ... and faster in the next run
  {
    auto second = compile(o);
    second.prepare();
    CHECK_FALSE(second.choice().decided()); // measuring again
    CHECK(second.plan().policy == "sync");  // starting from the earlier pick
    run_until_decided(second);
    const auto& r = second.choice();
    CHECK(r.confirmed);
    CHECK_FALSE(r.from_cache);
    REQUIRE(r.candidates.size() == 2); // the others measured 1e6 us slower: not measured again
    CHECK(r.candidates[0].name == "sync");
    CHECK(r.candidates[1].name == "concerto");
    CHECK(winner(r) == "concerto");
    CHECK(second.plan().policy == "concerto");
    CHECK(r.decided_at_step == 1 + 2 * 2); // a first step of the pick, then 2 rounds of 2 candidates
    CHECK(r.text().find("an earlier run's pick, measured again") != std::string::npos);
  }
  o.choice.confirm_within = 1; // trust the earlier run
  {
    auto third = compile(o);
    third.prepare();
    REQUIRE(third.choice().decided());
    CHECK(third.choice().from_cache);
    CHECK(winner(third.choice()) == "concerto");
    CHECK(third.plan().policy == "concerto");
  }
  MPI_Barrier(MPI_COMM_WORLD);
  if (world_rank() == 0) std::filesystem::remove_all(dir);
}

CONCERTO_MPI_TEST_MAIN
