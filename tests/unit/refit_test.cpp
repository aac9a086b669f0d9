// Profile-guided refit (planner/refit.hpp). The "machine" is the simulator under a true model
// that the planner's prior mis-prices on purpose (slow matmuls, a slower inter-node link with a
// longer latency, stronger contention): its replays are the measured steps. After the refit,
// the model must predict the true step of every plan within 5%, and re-planning with it must
// find the plan the true costs make best.
#include <concerto/core/statistics.hpp>
#include <concerto/ir/workloads.hpp>
#include <concerto/planner/make_plan.hpp>
#include <concerto/planner/refit.hpp>
#include <concerto/sim/simulate.hpp>

#include <catch2/catch_test_macros.hpp>
#include <catch2/matchers/catch_matchers_floating_point.hpp>
#include <catch2/matchers/catch_matchers_string.hpp>

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

using namespace concerto;
using Catch::Matchers::ContainsSubstring;
using Catch::Matchers::WithinRel;

namespace {

cost::model prior() { return cost::model::preset("a800x32"); }

cost::model truth() {
  auto hw = prior().hw();
  hw.name = "the machine";
  hw.kernel_scale["matmul"] = 0.5;
  hw.kernel_scale["attention"] = 1.5;
  hw.kernel_scale["rmsnorm"] = 3.0;
  hw.kernel_scale["swiglu"] = 2.5;
  hw.intra_node.bandwidth_gbps /= 3;
  hw.intra_node.alpha_us *= 3;
  hw.overlap_slowdown = 1.3;
  hw.comm_overlap_slowdown = 1.15;
  return cost::model(hw);
}

sim::contention contention_of(const cost::model& m) { return {m.overlap_slowdown(), m.comm_overlap_slowdown()}; }

/// The plan's step on the machine: a replay with the true durations and contention.
sim::result run_on_machine(const plan::plan& p) {
  const auto t = truth();
  return sim::simulate(p, t.durations_us(p.graph), contention_of(t));
}

double predicted(const plan::plan& p, const cost::model& m) {
  return sim::simulate(p, m.durations_us(p.graph), contention_of(m)).step_us;
}

const planner::plan_options deterministic{
    .policy = planner::policy::concerto, .solver = {.window_work_limit = 20000, .progress = false}};

ir::graph workload() { return ir::make_workload("llama-tp-sp", {.layers = 2, .ranks = 8}); }

} // namespace

TEST_CASE("refit: the refitted model predicts every plan's measured step within 5%") {
  const auto g = workload();
  const auto profiled = planner::make_plan(g, prior(), {.policy = planner::policy::program_order});
  const std::vector<sim::result> steps{run_on_machine(profiled), run_on_machine(profiled)};
  const auto seen = planner::observe(profiled.graph, steps);
  REQUIRE(seen.steps == 2);
  REQUIRE_THAT(seen.step_us, WithinRel(steps[0].step_us, 1e-12));

  const auto fit = planner::refit(profiled, prior(), seen);
  // The prior is far off (the test means something), the refit is not.
  CHECK(std::abs(fit.predicted_before_us / seen.step_us - 1) > 0.1);
  CHECK_THAT(fit.predicted_after_us, WithinRel(seen.step_us, 0.05));
  CHECK(fit.links_refitted == 1);
  CHECK_THAT(fit.text(), ContainsSubstring("measured"));
  CHECK_THAT(fit.model.hw().kernel_scale.at("matmul"), WithinRel(0.5, 0.05));
  CHECK_THAT(fit.model.hw().intra_node.bandwidth_gbps, WithinRel(truth().hw().intra_node.bandwidth_gbps, 0.1));
  CHECK_THAT(fit.model.overlap_slowdown(), WithinRel(1.3, 0.1));

  // Plans never measured: other orders, other rewrites.
  for (const auto policy : {planner::policy::sync, planner::policy::xla_lhs, planner::policy::megatron}) {
    const auto other = planner::make_plan(g, prior(), {.policy = policy});
    INFO("policy " << planner::to_string(policy));
    CHECK_THAT(predicted(other, fit.model), WithinRel(run_on_machine(other).step_us, 0.05));
  }
}

TEST_CASE("refit: re-planning with the refitted model finds the plan the true costs make best") {
  const auto g = workload();
  const auto first = planner::make_plan(g, prior(), deterministic);
  const std::vector<sim::result> steps{run_on_machine(first)};
  const auto fit = planner::refit(first, prior(), planner::observe(first.graph, steps));
  const auto replanned = planner::make_plan(g, fit.model, deterministic);
  const auto best = planner::make_plan(g, truth(), deterministic);
  const double on_machine_first = run_on_machine(first).step_us;
  const double on_machine_replanned = run_on_machine(replanned).step_us;
  const double on_machine_best = run_on_machine(best).step_us;
  INFO("first " << on_machine_first << " us, replanned " << on_machine_replanned << " us, best " << on_machine_best << " us");
  CHECK(on_machine_replanned <= 1.01 * on_machine_best);
  CHECK(on_machine_replanned < 0.98 * on_machine_first);
}

TEST_CASE("refit: nothing measured changes nothing; a foreign observation is refused") {
  const auto g = workload();
  const auto p = planner::make_plan(g, prior(), {.policy = planner::policy::program_order});
  const auto fit = planner::refit(p, prior(), planner::observe(p.graph, {}));
  CHECK(fit.model.hw().kernel_scale == prior().hw().kernel_scale);
  CHECK(fit.predicted_after_us == fit.predicted_before_us);
  planner::observation wrong;
  wrong.tasks.resize(3);
  wrong.steps = 1;
  try {
    (void)planner::refit(p, prior(), wrong);
    FAIL("refit accepted an observation of another graph");
  } catch (const error& e) {
    CHECK_THAT(e.what(), ContainsSubstring("the observation has 3 tasks"));
  }
}

TEST_CASE("refit: only the kernels measured are reported as refitted; a factor for another kernel is kept") {
  const auto g = workload();
  auto hw = prior().hw();
  hw.kernel_scale["conv2d"] = 2.0; // no task of the graph runs it
  const cost::model with_other(hw);
  const auto p = planner::make_plan(g, with_other, {.policy = planner::policy::program_order});
  const std::vector<sim::result> steps{run_on_machine(p)};
  const auto fit = planner::refit(p, with_other, planner::observe(p.graph, steps));
  CHECK(fit.kernel_factor_change.contains("matmul"));
  CHECK_FALSE(fit.kernel_factor_change.contains("conv2d"));
  CHECK(fit.model.hw().kernel_scale.at("conv2d") == 2.0);
  for (const auto& [kernel, change] : fit.kernel_factor_change) {
    INFO("kernel " << kernel);
    CHECK(std::any_of(g.tasks.begin(), g.tasks.end(), [&](const ir::task& t) {
      return !ir::is_collective(t.kind) && cost::model::kernel_name(t) == kernel;
    }));
  }
}

TEST_CASE("median: the middle value, the mean of the two middle ones for an even count, 0 for none") {
  CHECK(median({}) == 0);
  CHECK(median({7}) == 7);
  CHECK(median({9, 1, 5}) == 5);
  CHECK(median({4, 1, 3, 2}) == 2.5);
  CHECK(median({2, 2, 8, 8}) == 5);
}
