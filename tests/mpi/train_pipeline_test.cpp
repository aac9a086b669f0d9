// The GPT example's model with pipeline stages (a `pp` mesh axis): on 2 and 4 stages, alone and
// with data or tensor parallelism, with 1, 2 and 4 micro-batches and every pipeline schedule,
// the losses, gradients and parameters after 3 AdamW steps match the single-rank run without
// a pipeline within train_testing::rel_tol, and with 2 chunks per stage under interleaved_1f1b,
// gpipe and concerto; with chunks interleaved, concerto's schedule (however short its search)
// gives stages that agree on every link's messages; a checkpoint saved with stages loads without them;
// bad pipeline settings are refused with a message that names them. Built also against the
// NCCL backend (tests/gpu: its emulation), where the stages' sends and receives are NCCL's.
#include "gpt_program.hpp"
#include "llama_program.hpp"
#include "train_testing.hpp"

#include <catch2/matchers/catch_matchers_string.hpp>

#include <array>
#include <filesystem>
#include <map>

using namespace concerto;
namespace tt = train_testing;
namespace gt = gpt_testing;

namespace {

constexpr std::int64_t batch = 4, seq = 8, vocab = 32, hidden = 16;
constexpr int depth = 4;
const auto shapes = gt::shapes(batch, seq, vocab, hidden);
const std::vector<std::string> params{"wte",          "layers.0.wq",    "layers.1.wo", "layers.2.fc1", "layers.3.fc2",
                                      "layers.0.ln1.g", "layers.3.ln2.b", "lnf.g",       "head"};

train::batch data() {
  train::tensor ids{{batch, seq}}, labels{{batch, seq}};
  for (std::int64_t i = 0; i < batch * seq; ++i) {
    ids.i64.push_back((i * 7 + 3) % vocab);
    labels.i64.push_back((i * 7 + 10) % vocab);
  }
  return {{"ids", ids}, {"labels", labels}};
}

train::step_options options(const std::string& schedule, int microbatches, int virtual_stages = 1) {
  train::step_options o{.policy = planner::policy::program_order, .lower = {.name = "gpt", .heads = 4, .depth = {{"layers", depth}}}};
  o.pipeline = {.microbatches = microbatches, .schedule = schedule, .virtual_stages = virtual_stages, .search_budget_s = 2};
  return o;
}

tt::run_result reference() {
  return tt::run(gt::gpt_tp, shapes, MPI_COMM_SELF, {{"dp", 1}, {"tp", 1}}, data(), 3, {.adamw = {.lr = 1e-2f}},
                 options("1f1b", 1), params);
}

tt::run_result pipelined(MPI_Comm comm, int p, int d, int t, const std::string& schedule, int microbatches,
                         int virtual_stages = 1) {
  return tt::run(gt::gpt_tp, shapes, comm, {{"pp", p}, {"dp", d}, {"tp", t}}, data(), 3, {.adamw = {.lr = 1e-2f}},
                 options(schedule, microbatches, virtual_stages), params);
}

} // namespace

TEST_CASE("micro-batches alone accumulate the gradient of the whole batch", "[mpi][train][pipeline]") {
  const auto want = reference();
  REQUIRE(want.loss.back() < want.loss.front());
  for (int m : {2, 4}) {
    CAPTURE(m);
    tt::check_same(pipelined(MPI_COMM_SELF, 1, 1, 1, "1f1b", m), want);
  }
}

TEST_CASE("pipeline stages train the GPT to the single-rank numbers with every schedule", "[mpi][train][pipeline]") {
  const auto want = reference();
  const int world = runtime::mpi::environment::world_size();
  for (int ranks : {2, 4, 8}) {
    if (ranks > world) continue;
    tt::sub_world sub(ranks);
    if (!sub.member()) continue;
    for (auto [p, d, t] : std::vector<std::array<int, 3>>{{std::min(ranks, 4), ranks / std::min(ranks, 4), 1},
                                                          {2, 2, 1}, {2, 1, 2}, {4, 1, 2}}) {
      if (p * d * t != ranks) continue;
      for (const char* schedule : {"gpipe", "1f1b", "zb_h1", "concerto"})
        for (int m : {1, 2, 4}) {
          if (batch / m % d != 0) continue; // a micro-batch's rows must split over dp
          CAPTURE(ranks, p, d, t, schedule, m);
          const auto got = pipelined(sub.get(), p, d, t, schedule, m);
          CHECK(got.summary.policy == std::string("pipeline:") + schedule);
          tt::check_same(got, want);
        }
    }
    if (ranks == 2)
      for (const char* schedule : {"interleaved_1f1b", "gpipe", "concerto"}) {
        // 2 chunks per stage; concerto's cap is interleaved 1F1B's memory, gpipe the baseline of
        // the plan's line; 1 micro-batch is not a multiple of the stages, which interleaved 1F1B
        // does not take.
        for (int m : {1, 2, 4}) {
          if (m % 2 != 0 && std::string(schedule) == "interleaved_1f1b") continue;
          INFO("interleaved: 2 chunks per stage");
          CAPTURE(schedule, m);
#if CONCERTO_BACKEND_NCCL
          // The last stage sends the values of its first chunk back to stage 0: not one way.
          CHECK_THROWS_WITH(pipelined(sub.get(), 2, 1, 1, schedule, m, 2),
                            Catch::Matchers::ContainsSubstring("keep a lane's messages one way along its axis"));
          break;
#else
          const auto got = pipelined(sub.get(), 2, 1, 1, schedule, m, 2);
          CHECK(got.summary.policy == std::string("pipeline:") + schedule);
          CHECK(got.summary.sync_predicted_us > 0); // gpipe's step on the same chunks
          tt::check_same(got, want);
#endif
        }
      }
  }
}

TEST_CASE("the Llama trains to the single-rank numbers on pipeline stages", "[mpi][train][pipeline][llama]") {
  // RMSNorm, rotary embeddings whose positions (an input every stage reads) are split into
  // micro-batches like the tokens, grouped-query attention and SwiGLU, over 2 stages.
  constexpr std::int64_t heads = 8, kv_heads = 4;
  const auto llama_shapes = llama_testing::shapes(batch, seq, vocab, 32, heads, kv_heads, 48);
  const std::vector<std::string> llama_params{"wte", "layers.0.wq", "layers.1.wk", "layers.0.w1", "layers.1.w3",
                                              "layers.1.ffn_norm.g", "norm.g", "head"};
  train::batch b = data();
  train::tensor positions{{batch, seq}};
  for (std::int64_t i = 0; i < batch * seq; ++i) positions.i64.push_back(i % seq);
  b["positions"] = positions;
  const auto run = [&](MPI_Comm comm, std::vector<axis_request> axes, train::pipeline_options pp) {
    train::step_options o{.policy = planner::policy::program_order, .lower = {.name = "llama", .heads = heads, .depth = {{"layers", 2}}}};
    o.pipeline = pp;
    return tt::run(llama_testing::llama_tp, llama_shapes, comm, std::move(axes), b, 3, {.adamw = {.lr = 1e-3f}}, o,
                   llama_params);
  };
  const auto want = run(MPI_COMM_SELF, {{"dp", 1}, {"tp", 1}}, {});
  REQUIRE(want.loss.back() < want.loss.front());
  const int world = runtime::mpi::environment::world_size();
  tt::sub_world sub(std::min(world, 4));
  if (!sub.member()) return;
  const int rest = std::min(world, 4) / 2;
  for (const char* schedule : {"1f1b", "zb_h1"}) {
    CAPTURE(schedule, rest);
    tt::check_same(run(sub.get(), {{"pp", 2}, {"dp", rest}, {"tp", 1}}, {.microbatches = 2, .schedule = schedule}), want);
    if (rest > 1) tt::check_same(run(sub.get(), {{"pp", 2}, {"dp", 1}, {"tp", rest}}, {.microbatches = 2, .schedule = schedule}), want);
  }
}

// What the program says a stage exchanges per micro-batch, at compile time.
static_assert(gt::gpt_tp.pipeline_messages("layers", 0, 2).sends == 1 && gt::gpt_tp.pipeline_messages("layers", 0, 2).recvs == 1);
static_assert(gt::gpt_tp.pipeline_messages("layers", 1, 4).sends == 2 && gt::gpt_tp.pipeline_messages("layers", 1, 4).recvs == 2);
static_assert(gt::gpt_tp.pipeline_messages("layers", 3, 4).sends == 1);
static_assert(gt::gpt_tp.pipeline_messages("blocks", 0, 2).sends == -1);

TEST_CASE("every stage's plan sends and receives what the program says, once per micro-batch", "[mpi][train][pipeline]") {
  const int world = runtime::mpi::environment::world_size();
  constexpr int m = 4;
  auto o = options("zb_h1", m);
  o.use_cache = false;
  o.world = MPI_COMM_WORLD;
  const int stages = std::min(world, depth);
  auto step = train::compile(gt::gpt_tp, mesh::from_world(world, {{"pp", stages}, {"dp", 1}, {"tp", -1}}), shapes,
                             {.adamw = {.lr = 1e-2f}}, o);
  int sends = 0, recvs = 0;
  for (const auto& t : step.plan().graph.tasks) {
    sends += t.kind == ir::op_kind::send;
    recvs += t.kind == ir::op_kind::recv;
  }
  const int stage = mesh::from_world(world, {{"pp", stages}, {"dp", 1}, {"tp", -1}}).coords(step.rank())[0];
  const auto want = gt::gpt_tp.pipeline_messages("layers", stage, stages);
  CAPTURE(step.rank(), stage, stages);
  CHECK(sends == m * want.sends);
  CHECK(recvs == m * want.recvs);
  CHECK_THAT(step.summary().text(), Catch::Matchers::ContainsSubstring(std::to_string(stages) + " stages x 4 micro-batches"));
}

TEST_CASE("stages whose plans disagree on their messages are refused on every rank before the first", "[mpi][train][pipeline]") {
  const int world = runtime::mpi::environment::world_size();
  const auto m = mesh::from_world(world, {{"pp", 2}, {"dp", -1}, {"tp", 1}});
  const auto g = lower(gt::gpt_tp, gpt_model::shapes(batch / 4 * (world / 2), seq, vocab, hidden), m,
                       {.heads = 4, .depth = {{"layers", depth}}});
  const auto split = pipeline::split(g, {.microbatches = 4});
  const auto model = cost::model::preset("cpu");
  const auto problem = pipeline::problem_of(split, g, model);
  const int stage = m.coords(runtime::mpi::environment::world_rank())[static_cast<std::size_t>(split.axis)];
  const runtime::mpi::control control(MPI_COMM_WORLD, 30);
  const auto plan_of = [&](const pipeline::schedule& s) {
    return pipeline::stage_plan(pipeline::stage_graph(g, split, stage, s), model, s.policy);
  };
  const auto good = pipeline::one_f_one_b(problem);
  CHECK_NOTHROW(train::detail::check_stage_agreement(plan_of(good), split.axis, m, control));
  // A seeded mutation: stage 1 runs micro-batches 1 and 2 in each other's places.
  auto mutated = good;
  for (auto& b : mutated.order[1])
    if (b.microbatch == 1 || b.microbatch == 2) b.microbatch = 3 - b.microbatch;
  std::string message;
  try {
    train::detail::check_stage_agreement(plan_of(stage == 1 ? mutated : good), split.axis, m, control);
  } catch (const collective_error& e) {
    message = e.what();
  }
  CHECK_THAT(message, Catch::Matchers::ContainsSubstring("pipeline stages 0 and 1 disagree on their messages"));
  CHECK_THAT(message, Catch::Matchers::ContainsSubstring("in another order or with other sizes"));
}

TEST_CASE("with chunks interleaved, concerto's schedule gives stages that agree on every link's messages",
          "[mpi][train][pipeline]") {
  // Two stages of two chunks: two chunk boundaries share each link. The GPT's embedding priced
  // at 8 times its roofline (what a loaded machine can measure) makes a greedy seed the search's
  // start, and that seed used to take a link's gradients in another order than their sender sent
  // them: the stages' message check then stopped the run, with any search budget.
  const int world = runtime::mpi::environment::world_size();
  const auto m = mesh::from_world(world, {{"pp", 2}, {"dp", -1}, {"tp", 1}});
  const auto g = lower(gt::gpt_tp, gpt_model::shapes(batch / 4 * (world / 2), seq, vocab, hidden), m,
                       {.heads = 4, .depth = {{"layers", depth}}});
  const auto split = pipeline::split(g, {.microbatches = 4, .virtual_stages = 2});
  auto hw = cost::presets::cpu_defaults(); // not this machine's calibration: the same problem anywhere
  hw.kernel_scale["embedding"] = 8;
  const cost::model model(hw);
  const auto problem = pipeline::problem_of(split, g, model);
  const int stage = m.coords(runtime::mpi::environment::world_rank())[static_cast<std::size_t>(split.axis)];
  const runtime::mpi::control control(MPI_COMM_WORLD, 30);
  // No search (its start), and a search bounded by work: each rank derives the schedule itself
  // here (a step has rank 0 choose it and send it), which with no clock read is the same on all.
  for (const std::uint64_t work : {std::uint64_t{0}, std::uint64_t{200'000}}) {
    CAPTURE(work);
    const train::pipeline_options o{
        .microbatches = 4, .schedule = "concerto", .virtual_stages = 2, .search_budget_s = 0, .search_work_limit = work};
    const auto s = train::detail::choose_schedule(o, problem);
    const auto json = train::detail::to_json(s).dump();
    const auto mine = static_cast<long long>(hasher{}.add(std::string_view(json)).value() >> 1);
    long long low = 0, high = 0;
    MPI_Allreduce(&mine, &low, 1, MPI_LONG_LONG, MPI_MIN, MPI_COMM_WORLD);
    MPI_Allreduce(&mine, &high, 1, MPI_LONG_LONG, MPI_MAX, MPI_COMM_WORLD);
    REQUIRE(low == high);
    CHECK_NOTHROW(pipeline::verify(problem, s));
    const auto plan = pipeline::stage_plan(pipeline::stage_graph(g, split, stage, s), model, s.policy);
    CHECK_NOTHROW(train::detail::check_stage_agreement(plan, split.axis, m, control));
  }
}

TEST_CASE("a checkpoint saved with pipeline stages loads without them", "[mpi][train][pipeline][checkpoint]") {
  const int world = runtime::mpi::environment::world_size();
  const auto file = std::filesystem::temp_directory_path() / "concerto_pipeline_checkpoint.bin";
  auto o = options("1f1b", 2);
  o.use_cache = false;
  o.world = MPI_COMM_WORLD;
  auto staged = train::compile(gt::gpt_tp, mesh::from_world(world, {{"pp", 2}, {"dp", std::min(world / 2, 2)}, {"tp", -1}}), shapes,
                               {.adamw = {.lr = 1e-2f}}, o);
  for (int s = 0; s < 2; ++s) (void)staged(data());
  staged.save(file);
  std::map<std::string, std::vector<float>> saved;
  for (const auto& name : params) saved[name] = staged.parameter(name);
  auto flat_options = options("1f1b", 1);
  flat_options.use_cache = false;
  flat_options.world = MPI_COMM_SELF;
  auto flat = train::compile(gt::gpt_tp, mesh::from_world(1, {{"dp", 1}, {"tp", 1}}), shapes, {.adamw = {.lr = 1e-2f}},
                             flat_options);
  const auto holds = [&](auto& step, std::int64_t steps, const std::map<std::string, std::vector<float>>& want) {
    CHECK(step.completed_steps() == steps);
    for (const auto& name : params) {
      CAPTURE(name);
      CHECK(step.parameter(name) == want.at(name));
    }
    MPI_Barrier(MPI_COMM_WORLD);
  };
  flat.load(file);
  holds(flat, 2, saved);
  // And back: a checkpoint saved without stages loads on them (another layout: pp 2 x tp).
  (void)flat(data());
  if (runtime::mpi::environment::world_rank() == 0) flat.save(file);
  MPI_Barrier(MPI_COMM_WORLD);
  auto other = train::compile(gt::gpt_tp, mesh::from_world(world, {{"pp", 2}, {"dp", 1}, {"tp", -1}}), shapes,
                              {.adamw = {.lr = 1e-2f}}, o);
  for (const auto& name : params) saved[name] = flat.parameter(name);
  other.load(file);
  holds(other, 3, saved);
  if (runtime::mpi::environment::world_rank() == 0) std::filesystem::remove(file);
}

TEST_CASE("bad pipeline settings are refused naming them", "[mpi][train][pipeline]") {
  const auto refused = [](const mesh& m, train::step_options o, MPI_Comm world = MPI_COMM_SELF) -> std::string {
    o.use_cache = false;
    o.world = world;
    try {
      (void)train::compile(gt::gpt_tp, m, shapes, {}, o);
    } catch (const error& e) {
      return e.what();
    }
    return "accepted";
  };
  const auto one = mesh::from_world(1, {{"pp", 1}, {"dp", 1}, {"tp", 1}});
  CHECK_THAT(refused(one, options("1f1b", 3)),
             Catch::Matchers::ContainsSubstring("input 'ids' has 4 rows (its first dimension), which 3 micro-batches do not divide"));
  CHECK_THAT(refused(one, options("round_robin", 2)),
             Catch::Matchers::ContainsSubstring("pipeline schedule 'round_robin' is not one of"));
  CHECK_THAT(refused(mesh::from_world(1, {{"dp", 1}, {"tp", 1}}), options("1f1b", 2)),
             Catch::Matchers::ContainsSubstring("2 micro-batches need the mesh axis 'pp'"));
  CHECK_THAT(refused(one, options("gpipe", 1, 8)), Catch::Matchers::ContainsSubstring("4 layers cannot be split into 8 chunks"));
  // A schedule that does not take the layout, refused with the options, naming the fix.
  CHECK_THAT(refused(one, options("1f1b", 2, 2)),
             Catch::Matchers::ContainsSubstring("train step: pipeline schedule '1f1b' runs one chunk per stage "
                                                "(virtual_stages = 2): set virtual_stages = 1, or use gpipe, "
                                                "interleaved_1f1b or concerto, which take 2 chunks per stage"));
  CHECK_THAT(refused(one, options("zb_h1", 2, 2)),
             Catch::Matchers::ContainsSubstring("pipeline schedule 'zb_h1' runs one chunk per stage"));
  CHECK_THAT(refused(one, options("interleaved_1f1b", 2, 1)),
             Catch::Matchers::ContainsSubstring("interleaves several chunks per stage (virtual_stages = 1): set "
                                                "virtual_stages = 2 or more"));
  tt::sub_world two(2);
  if (two.member())
    CHECK_THAT(refused(mesh::from_world(2, {{"pp", 2}, {"dp", 1}, {"tp", 1}}), options("interleaved_1f1b", 1, 2), two.get()),
               Catch::Matchers::ContainsSubstring("needs the micro-batches (1) to be a multiple of the stages (2): use 2 "
                                                  "micro-batches, or gpipe or concerto, which take 1 micro-batch"));
}

CONCERTO_MPI_TEST_MAIN
