// What a trainer needs beside the step, on the Llama example's model.
//
// Global-norm gradient clipping as tasks of the step graph (optimizer_settings::clip_norm,
// graph/lower.hpp): on one rank the norm the step reports is the norm of the gradients it
// exposes, and an SGD step moves each parameter by lr · factor · gradient; with a threshold
// the gradients exceed, the model trains on dp × tp, with sequence parallelism, under ZeRO-1
// and ZeRO-3, and on pipeline stages to the single-rank clipped numbers within
// train_testing::rel_tol after 3 steps; a bad threshold is refused.
//
// Evaluation (basic_step::evaluate): the forward-only plan's loss is the loss the next training
// step reports on the same batch, on every mesh (ZeRO-3 and pipeline stages included), it
// changes neither the parameters nor the step count, and it sees every change of the parameters.
#include "llama_program.hpp"
#include "train_testing.hpp"

#include <concerto/concerto.hpp>
#include <concerto/runtime/grad_clip.hpp>

#include <catch2/matchers/catch_matchers_string.hpp>

#include <cmath>
#include <string>
#include <vector>

using namespace concerto;
namespace tt = train_testing;
namespace lm = llama_testing;

namespace {

using namespace small_llama;
constexpr float clip = 0.05f; // well below the gradients' norm (about 1 at these sizes): every step clips

train::step_options options(MPI_Comm comm, train::pipeline_options pp = {}) {
  train::step_options o{.policy = planner::policy::concerto,
                        .lower = {.name = "llama", .heads = heads, .depth = {{"layers", 2}}},
                        .use_cache = false,
                        .world = comm};
  o.choice.enabled = false;
  o.pipeline = pp;
  return o;
}

const train::optimizer_settings clipped{.adamw = {.lr = 1e-2f}, .clip_norm = clip};

template <std::size_t N>
tt::run_result run(const graph::program<N>& p, MPI_Comm comm, std::vector<axis_request> axes, train::pipeline_options pp = {},
                   train::optimizer_settings opt = clipped) {
  return tt::run(p, shapes, comm, std::move(axes), data(), 3, opt, options(comm, pp), params);
}

constexpr auto zero1 = lm::make<lm::replicated_residual, zero<1>(adamw{}, lm::dp)>();
constexpr auto zero3 = lm::make<lm::replicated_residual, zero<3>(adamw{}, lm::dp)>();

} // namespace

TEST_CASE("on one rank the clipped step's norm is the gradients' and SGD moves by lr · factor · gradient",
          "[mpi][train][clip]") {
  const train::optimizer_settings settings{.sgd = {.lr = 0.1f}, .clip_norm = clip};
  static constexpr auto model = lm::make<lm::replicated_residual, concerto::sgd{}>();
  auto step = train::compile(model, mesh::from_world(1, {{"dp", 1}, {"tp", 1}}), shapes, settings, options(MPI_COMM_SELF));
  std::map<std::string, std::vector<float>> before;
  for (const auto& name : step.parameter_names()) before[name] = step.parameter(name);
  const auto r = step(data());
  double sq = 0;
  for (const auto& name : step.parameter_names())
    for (const float g : step.gradient(name)) sq += static_cast<double>(g) * g;
  CAPTURE(r.grad_norm, std::sqrt(sq));
  REQUIRE(std::sqrt(sq) > 2 * clip); // the threshold is active
  CHECK(std::abs(r.grad_norm - std::sqrt(sq)) <= 1e-5 * std::sqrt(sq));
  const float factor = runtime::clip_factor(clip, static_cast<float>(sq));
  for (const auto& name : step.parameter_names()) {
    CAPTURE(name);
    const auto g = step.gradient(name);
    const auto now = step.parameter(name);
    const auto& was = before.at(name);
    double worst = 0;
    for (std::size_t i = 0; i < g.size(); ++i)
      worst = std::max(worst, std::abs(static_cast<double>(was[i] - now[i]) - 0.1 * factor * g[i]));
    CHECK(worst <= 1e-6);
  }
  // Without a threshold the step computes no norm.
  auto plain = train::compile(model, mesh::from_world(1, {{"dp", 1}, {"tp", 1}}), shapes, {.sgd = {.lr = 0.1f}},
                              options(MPI_COMM_SELF));
  CHECK(std::isnan(plain(data()).grad_norm));
  for (const auto& t : plain.graph().tasks) CHECK(t.fn != ir::op::grad_sq_norm);
}

TEST_CASE("clipped training gives the single-rank numbers on every mesh, with ZeRO and pipeline stages",
          "[mpi][train][clip]") {
  const auto want = run(lm::llama_tp, MPI_COMM_SELF, {{"dp", 1}, {"tp", 1}});
  const auto unclipped = run(lm::llama_tp, MPI_COMM_SELF, {{"dp", 1}, {"tp", 1}}, {}, {.adamw = {.lr = 1e-2f}});
  REQUIRE(want.loss.back() < want.loss.front());
  REQUIRE(std::abs(want.loss.back() - unclipped.loss.back()) > 1e-3); // clipping changed the training
  const int world = runtime::mpi::environment::world_size();
  tt::sub_world sub(std::min(world, 4));
  if (!sub.member()) return;
  const int n = std::min(world, 4), half = n / 2;
  SECTION("data and tensor parallel, sequence parallel") {
    tt::check_same(run(lm::llama_tp, sub.get(), {{"dp", half}, {"tp", 2}}), want);
    tt::check_same(run(lm::llama_sp, sub.get(), {{"dp", half}, {"tp", 2}}), want);
    tt::check_same(run(lm::llama_tp, sub.get(), {{"dp", n}, {"tp", 1}}), want);
  }
  SECTION("ZeRO-1 and ZeRO-3 over dp") {
    tt::check_same(run(zero1, sub.get(), {{"dp", n}, {"tp", 1}}), want);
    tt::check_same(run(zero3, sub.get(), {{"dp", half}, {"tp", 2}}), want);
  }
  SECTION("pipeline stages") {
    tt::check_same(run(lm::llama_tp, sub.get(), {{"pp", 2}, {"dp", half}, {"tp", 1}}, {.microbatches = 2, .schedule = "1f1b"}),
                   want);
    if (half > 1)
      tt::check_same(run(lm::llama_tp, sub.get(), {{"pp", 2}, {"dp", 1}, {"tp", half}}, {.microbatches = 2, .schedule = "zb_h1"}),
                     want);
  }
}

namespace {

train::batch other_data() {
  auto b = data();
  for (auto& v : b.at("ids").i64) v = (v * 5 + 1) % vocab;
  return b;
}

// Trains a step, evaluates a second batch, then trains on it: the evaluation is the loss that
// step reports (before its update), and evaluating changed nothing.
template <std::size_t N>
double evaluated(const graph::program<N>& p, MPI_Comm comm, std::vector<axis_request> axes, train::pipeline_options pp = {}) {
  int n = 0;
  MPI_Comm_size(comm, &n);
  auto step = train::compile(p, mesh::from_world(n, axes), shapes, {.adamw = {.lr = 1e-2f}}, options(comm, pp));
  (void)step(data());
  const auto before = step.parameter("layers.1.wq");
  const double loss = step.evaluate(other_data());
  CHECK(step.completed_steps() == 1);
  CHECK(step.parameter("layers.1.wq") == before);
  CHECK(step.evaluation_summary().tasks < step.summary().tasks); // forward only
  const double trained = step(other_data()).loss;
  CAPTURE(loss, trained);
  CHECK(std::abs(loss - trained) <= 1e-6 * std::abs(trained));
  const double after_step = step.evaluate(other_data());
  CHECK(after_step < loss); // after a step on that batch
  CHECK(step.evaluate(other_data()) == after_step); // nothing changed: the same parameters, not copied again
  step.set_parameter("layers.1.wq", before);        // one tensor as before the step: evaluate sees it
  CHECK(step.evaluate(other_data()) != after_step);
  return loss;
}

} // namespace

TEST_CASE("evaluation's forward-only plan gives the training step's loss on every mesh", "[mpi][train][evaluate]") {
  const double want = evaluated(lm::llama_tp, MPI_COMM_SELF, {{"dp", 1}, {"tp", 1}});
  const int world = runtime::mpi::environment::world_size();
  tt::sub_world sub(std::min(world, 4));
  if (!sub.member()) return;
  const int n = std::min(world, 4), half = n / 2;
  const auto same = [&](double got) { CHECK(std::abs(got - want) <= tt::rel_tol * std::abs(want)); };
  same(evaluated(lm::llama_tp, sub.get(), {{"dp", half}, {"tp", 2}}));
  same(evaluated(lm::llama_sp, sub.get(), {{"dp", half}, {"tp", 2}}));
  same(evaluated(zero3, sub.get(), {{"dp", n}, {"tp", 1}}));
  same(evaluated(lm::llama_tp, sub.get(), {{"pp", 2}, {"dp", half}, {"tp", 1}}, {.microbatches = 2, .schedule = "1f1b"}));
}

TEST_CASE("a clipping threshold that is no norm is refused naming the field", "[mpi][train][clip]") {
  for (const float bad : {-1.0f, std::nanf("")})
    CHECK_THROWS_WITH(train::compile(lm::llama_tp, mesh::from_world(1, {{"dp", 1}, {"tp", 1}}), shapes,
                                     {.adamw = {.lr = 1e-2f}, .clip_norm = bad}, options(MPI_COMM_SELF)),
                      Catch::Matchers::ContainsSubstring("optimizer_settings::clip_norm"));
}

CONCERTO_MPI_TEST_MAIN
