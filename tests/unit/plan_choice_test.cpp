// The arithmetic of the plan choice (train/plan_choice.hpp): the interleaved trial order, rank
// 0's verdict from every rank's times, how the ranks' measurements become one observation, and
// which plans an earlier run's winner is measured against again.
#include <concerto/ir/builder.hpp>
#include <concerto/train/plan_choice.hpp>

#include <catch2/catch_test_macros.hpp>
#include <catch2/matchers/catch_matchers_string.hpp>

#include <cmath>
#include <string>
#include <vector>

using namespace concerto;
using Catch::Matchers::ContainsSubstring;

TEST_CASE("plan choice: the trials interleave the candidates, each round starting at another") {
  CHECK(train::detail::trial_order(3, 2, 2) == std::vector<int>{0, 0, 1, 1, 2, 2, 1, 1, 2, 2, 0, 0});
  CHECK(train::detail::trial_order(2, 3, 1) == std::vector<int>{0, 1, 1, 0, 0, 1});
  CHECK(train::detail::trial_order(1, 2, 2) == std::vector<int>{0, 0, 0, 0});
}

TEST_CASE("plan choice: a step takes its slowest rank's time; the lowest median wins, the earlier on a tie") {
  const std::vector<int> order{0, 1, 0, 1, 0, 1};
  // Rank 0 alone would pick candidate 0; rank 1's slow steps of candidate 0 decide for 1.
  const std::vector<double> times{10, 20, 10, 20, 10, 20, // rank 0
                                  30, 15, 30, 15, 12, 15}; // rank 1
  const auto v = train::detail::judge_trials(order, times, 2, 2);
  CHECK(v.winner == 1);
  CHECK(v.median_us == std::vector<double>{30, 20});
  CHECK(v.steps == std::vector<int>{3, 3});
  CHECK(v.excess_us == 12); // candidate 0's steps (slowest ranks: 30, 30, 12) less the winner's median, 20, each
  CHECK(train::detail::judge_trials(std::vector<int>{0, 1}, std::vector<double>{5, 5}, 1, 2).winner == 0);
  // A candidate never run has no median and cannot win.
  const auto partial = train::detail::judge_trials(std::vector<int>{1, 1}, std::vector<double>{7, 9}, 1, 3);
  CHECK(partial.winner == 1);
  CHECK(std::isnan(partial.median_us[0]));
  try {
    (void)train::detail::judge_trials(order, std::vector<double>{1, 2}, 2, 2);
    FAIL("a wrong number of times was accepted");
  } catch (const error& e) {
    CHECK_THAT(e.what(), ContainsSubstring("2 trial times for 6 steps on 2 ranks"));
  }
}

TEST_CASE("plan choice: the ranks' observations become their mean, the step the slowest rank's") {
  ir::builder b("two");
  b.cost_only();
  const int dp = b.axis("dp", 2, ir::link_class::inter_node);
  const auto x = b.buffer("x", {100}, ir::buffer_role::input);
  const auto y = b.buffer("y", {100});
  b.compute(ir::op::gelu, "f", {x}, {y});
  b.collective(ir::op_kind::all_reduce, "y.ar", dp, y, y);
  const auto g = std::move(b).finish();
  planner::observation r0, r1;
  r0.tasks = {{10, 0.0}, {40, 0.5}};
  r0.step_us = 50;
  r1.tasks = {{20, 0.2}, {20, 0.0}};
  r1.step_us = 45;
  auto all = train::detail::pack(r0);
  const auto second = train::detail::pack(r1);
  all.insert(all.end(), second.begin(), second.end());
  const auto o = train::detail::combine(g, all, 2, 3);
  CHECK(o.steps == 3);
  CHECK(o.step_us == 50);
  CHECK(o.tasks[0].duration_us == 15);
  CHECK(o.tasks[0].overlapped == 0.1);
  CHECK(o.tasks[1].duration_us == 30);
  CHECK(o.tasks[1].overlapped == 0.25);
  CHECK_THROWS_WITH(train::detail::combine(g, second, 2, 3), ContainsSubstring("measured values from 2 ranks"));
}

TEST_CASE("plan choice: the report says what was kept, against what, and what choosing cost") {
  train::plan_choice_report r;
  CHECK(r.text() == "plan choice: nothing decided");
  r.candidates = {{"concerto", "aa", 100, 850, 6}, {"concerto (re-planned)", "bb", 90, 800, 6}, {"xla_lhs", "cc", 120, 900, 6}};
  r.winner = 1;
  r.decided_at_step = 22;
  r.planning_seconds = 0.5;
  r.refit = "refit: predicted 700 us -> 790 us, measured 850 us (1 link classes, 9 kernels)";
  const auto text = r.text();
  CHECK_THAT(text, ContainsSubstring("plan choice at step 22: kept 'concerto (re-planned)' 800 us, vs 'concerto' 850 us (1.06x), "
                                     "'xla_lhs' 900 us (1.12x) (medians of 6 steps)"));
  CHECK_THAT(text, ContainsSubstring("0.50 s planning"));
  CHECK_THAT(text, ContainsSubstring("refit: predicted 700 us"));
  r.confirmed = true;
  CHECK_THAT(r.text(), ContainsSubstring("plan choice at step 22 (an earlier run's pick, measured again): kept 'concerto (re-planned)'"));
  r.confirmed = false;
  r.from_cache = true;
  r.candidates = {r.candidates[1]};
  r.winner = 0;
  CHECK(r.text() == "plan choice: 'concerto (re-planned)' from the plan cache (measured 800 us when it was chosen)");
}

TEST_CASE("plan choice: an earlier winner is measured again against the rivals that came within the factor") {
  using train::detail::close_rivals;
  const double never_run = std::nan("");
  const std::vector<double> medians{100, 130, 110, never_run, 0, 124.9};
  // Fastest first; the winner itself, the ones never run and the slower ones left out.
  CHECK(close_rivals(medians, 0, 1.25) == std::vector<std::size_t>{2, 5});
  CHECK(close_rivals(medians, 0, 1.5) == std::vector<std::size_t>{2, 5, 1});
  CHECK(close_rivals(medians, 0, 1.0).empty()); // 1 trusts the earlier run
  CHECK(close_rivals(medians, 2, 1.25) == std::vector<std::size_t>{0, 5, 1});
}
