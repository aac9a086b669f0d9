// Automatic sharding's exact formulation (autoshard/formulation.hpp): its strategies are the
// shardings the compiler builds (every solution respecifies, and reads back as itself); the
// solvers' optimum is the best of every leaf choice, enumerated; the IOPDDL export evaluates a
// solution to its objective; a layout without collectives costs what the schedule says; the
// memory cap binds; a node with too many strategies is formulated with its operands aligned (a
// restriction whose optimum is no better, and compiles); a problem too large is refused by name.
#include "../mpi/auto_lm_program.hpp"

#include <concerto/autoshard/search.hpp>
#include <concerto/concerto.hpp>

#include <catch2/catch_approx.hpp>
#include <catch2/catch_test_macros.hpp>
#include <catch2/matchers/catch_matchers_string.hpp>

#include <algorithm>
#include <limits>
#include <string>
#include <vector>

using namespace concerto;
using Catch::Matchers::ContainsSubstring;

namespace {
using auto_lm::auto_mlp; // every dimension decided, on(dp, tp)
using auto_lm::eight;    // dp 2 x tp 4
using auto_lm::mlp_shapes;
const cost::model h100 = cost::model::preset("h100x64");

// Every combination of the decided leaves' strategies, as shardings; the cheapest that the
// formulation reads back and that fits, by its own objective.
double enumerated_optimum(const autoshard::problem& f, long& combinations) {
  std::vector<std::size_t> at(f.leaves.size(), 0);
  double best = std::numeric_limits<double>::infinity();
  combinations = 0;
  for (bool more = true; more;) {
    graph::sharding_choice c;
    for (std::size_t l = 0; l < f.leaves.size(); ++l) {
      const auto& node = f.nodes[static_cast<std::size_t>(f.leaves[l].first)];
      c.leaves.push_back({f.leaves[l].second, to_value(node.strategies[at[l]].out, f.axes)});
    }
    ++combinations;
    if (const auto pick = f.pick_of(c); pick && (!f.usage_limit || f.peak_bytes(*pick) <= static_cast<double>(*f.usage_limit)))
      best = std::min(best, f.cost_us(*pick));
    std::size_t i = 0;
    while (i < at.size() && ++at[i] == f.nodes[static_cast<std::size_t>(f.leaves[i].first)].strategies.size()) at[i++] = 0;
    more = i < at.size();
  }
  return best;
}

std::int64_t rounded_objective(const autoshard::problem& f, const std::vector<int>& pick) {
  std::int64_t total = 0;
  for (std::size_t v = 0; v < f.nodes.size(); ++v)
    total += autoshard::detail::to_ns(f.nodes[v].strategies[static_cast<std::size_t>(pick[v])].cost_us);
  return total;
}

autoshard::formulation_options lm_options(int zero_stage = 0) {
  autoshard::formulation_options o;
  o.lower.depth = {{"layers", 3}};
  o.zero_stage = zero_stage;
  o.zero_axis = zero_stage > 0 ? "dp" : "";
  return o;
}
} // namespace

TEST_CASE("the exact formulation's optimum is the best of every leaf choice, enumerated", "[autoshard][exact]") {
  for (const auto& [batch, hidden] : {std::pair<std::int64_t, std::int64_t>{4096, 256}, {64, 4096}, {512, 1024}})
    for (const int stage : {0, 3}) {
      CAPTURE(batch, hidden, stage);
      const auto f = autoshard::formulate(auto_mlp, eight, mlp_shapes(batch, hidden), h100,
                                          {.zero_stage = stage, .zero_axis = stage > 0 ? "dp" : ""});
      REQUIRE(f.leaves.size() == 4);
      long combinations = 0;
      const double best = enumerated_optimum(f, combinations);
      CHECK(combinations > 10000); // 11 specs per leaf: replicated, one axis or both on either dim
      const auto cbc = autoshard::solve(f);
      REQUIRE(cbc.solutions.size() == 1);
      CHECK(cbc.solutions[0].proved);
      CHECK(cbc.solutions[0].cost_us == Catch::Approx(best).epsilon(1e-9));
      const auto z3 = autoshard::solve(f, {.solver = autoshard::mip_solver::z3});
      REQUIRE(z3.solutions.size() == 1);
      CHECK(z3.solutions[0].cost_us == Catch::Approx(best).epsilon(1e-6)); // its weights are whole nanoseconds
    }
}

TEST_CASE("every solution of the formulation is a sharding the compiler builds, and reads back as itself", "[autoshard][exact]") {
  for (const int stage : {0, 1, 3}) {
    CAPTURE(stage);
    const auto shapes = auto_lm::shapes(8, 16, 512, 64);
    const auto f = autoshard::formulate(auto_lm::lm, eight, shapes, h100, lm_options(stage));
    const auto solved = autoshard::solve(f, {.solutions = 3});
    REQUIRE(solved.solutions.size() == 3);
    double previous = 0;
    for (const auto& s : solved.solutions) {
      CHECK(s.proved);
      CHECK(s.cost_us >= previous); // each the optimum once the ones before are excluded
      previous = s.cost_us;
      const auto choice = f.choice(s.pick);
      CHECK(choice.zero_stage == stage);
      const auto compiled = graph::respecify(auto_lm::lm, choice);
      CAPTURE(autoshard::detail::key_of(choice), compiled.where);
      REQUIRE(compiled.program);
      CHECK_NOTHROW(lower(*compiled.program, shapes, eight, {.depth = {{"layers", 3}}}));
      const auto back = f.pick_of(choice);
      REQUIRE(back);
      CHECK(*back == s.pick);
    }
    CHECK(autoshard::detail::key_of(f.choice(solved.solutions[0].pick)) != autoshard::detail::key_of(f.choice(solved.solutions[1].pick)));
  }
}

TEST_CASE("the IOPDDL export evaluates a solution to its objective", "[autoshard][exact]") {
  auto o = lm_options();
  const auto shapes = auto_lm::shapes(8, 16, 512, 64);
  const auto unbounded = autoshard::formulate(auto_lm::lm, eight, shapes, h100, o);
  const auto free_best = autoshard::solve(unbounded).solutions.at(0);
  o.memory_cap_bytes = static_cast<std::int64_t>(unbounded.peak_bytes(free_best.pick) * 0.8);
  const auto f = autoshard::formulate(auto_lm::lm, eight, shapes, h100, o);
  const auto best = autoshard::solve(f).solutions.at(0);
  // Through text, as another solver would read it.
  const auto instance = nlohmann::json::parse(autoshard::to_iopddl(f, "lm").dump());
  CHECK(instance.at("problem").at("nodes").at("costs").size() == f.nodes.size());
  CHECK(instance.at("problem").at("usage_limit").get<std::int64_t>() == *o.memory_cap_bytes / 1024);
  const auto value = autoshard::evaluate_iopddl(instance, best.pick);
  REQUIRE(value);
  CHECK(*value == rounded_objective(f, best.pick));
  CHECK(static_cast<double>(*value) / 1000.0 == Catch::Approx(best.cost_us).margin(0.001 * static_cast<double>(f.nodes.size())));
  // The unbounded optimum uses more than the cap: the instance says it does not fit.
  CHECK(unbounded.peak_bytes(free_best.pick) > static_cast<double>(*o.memory_cap_bytes));
  CHECK_FALSE(autoshard::evaluate_iopddl(instance, free_best.pick));
  CHECK(f.peak_bytes(best.pick) <= static_cast<double>(*o.memory_cap_bytes) + 1024.0 * static_cast<double>(f.nodes.size()));
  // An operand read in a layout its producer does not make costs the inconsistency's price.
  auto wrong = best.pick;
  const auto& ids = f.nodes[0];
  REQUIRE(ids.strategies.size() > 1);
  wrong[0] = (wrong[0] + 1) % static_cast<int>(ids.strategies.size());
  auto without_cap = instance;
  without_cap["problem"].erase("usage_limit");
  CHECK(*autoshard::evaluate_iopddl(without_cap, wrong) >= autoshard::iopddl_inconsistent_ns);
  CHECK_THROWS_WITH(autoshard::evaluate_iopddl(instance, {0}), ContainsSubstring("1 choices for"));
}

TEST_CASE("a sharding without collectives costs in the formulation what the list schedule says", "[autoshard][exact]") {
  // Every leaf replicated: no collective, no overlap, so the additive objective is the serial sum
  // of the step's tasks, which is the list schedule's step.
  const auto shapes = mlp_shapes(4096, 256);
  const auto f = autoshard::formulate(auto_mlp, eight, shapes, h100, {});
  graph::sharding_choice replicated;
  for (const auto& [v, name] : f.leaves) replicated.leaves.push_back({name, to_value(spec(replicate, replicate))});
  const auto pick = f.pick_of(replicated);
  REQUIRE(pick);
  const auto priced = autoshard::price(auto_mlp, eight, shapes, h100, {}, {"replicated", replicated});
  REQUIRE(priced.valid);
  CHECK(priced.collectives.empty());
  CHECK(f.cost_us(*pick) == Catch::Approx(priced.list_step_us).epsilon(0.005));
}

TEST_CASE("a node over the strategy limit is formulated with its operands aligned: a restriction that still compiles",
          "[autoshard][exact]") {
  const auto shapes = auto_lm::shapes(8, 16, 512, 64);
  const auto full = autoshard::formulate(auto_lm::lm, eight, shapes, h100, lm_options());
  REQUIRE(full.aligned.empty());
  // The largest node whose operands include two of one rank, and the largest of the others.
  const auto alignable = [&](const autoshard::problem_node& v) {
    for (int a = 0; a < v.n_in; ++a)
      for (int b = a + 1; b < v.n_in; ++b)
        if (v.strategies.front().in[a].rank == v.strategies.front().in[b].rank && v.operands[a] != v.operands[b]) return true;
    return false;
  };
  std::size_t largest = 0, others = 0;
  std::string name;
  for (const auto& v : full.nodes) {
    if (!alignable(v)) others = std::max(others, v.strategies.size());
    else if (v.strategies.size() > largest) largest = v.strategies.size(), name = v.name;
  }
  REQUIRE(largest > others + 1);
  auto o = lm_options();
  o.limits.max_strategies = largest - 1;
  const auto aligned = autoshard::formulate(auto_lm::lm, eight, shapes, h100, o);
  CAPTURE(name, largest, aligned.aligned);
  REQUIRE(std::find(aligned.aligned.begin(), aligned.aligned.end(), name) != aligned.aligned.end());
  for (const auto& v : aligned.nodes) {
    if (std::find(aligned.aligned.begin(), aligned.aligned.end(), v.name) == aligned.aligned.end()) continue;
    CHECK(v.strategies.size() < largest);
    for (const auto& st : v.strategies) // operands of one rank alike
      for (int a = 0; a < v.n_in; ++a)
        for (int b = a + 1; b < v.n_in; ++b)
          if (st.in[a].rank == st.in[b].rank) CHECK(st.in[a] == st.in[b]);
  }
  const auto best_full = autoshard::solve(full), best_aligned = autoshard::solve(aligned);
  REQUIRE(best_full.solutions.size() == 1);
  REQUIRE(best_aligned.solutions.size() == 1);
  CHECK(best_aligned.solutions[0].cost_us >= best_full.solutions[0].cost_us - 1e-6); // a restriction's optimum
  const auto compiled = graph::respecify(auto_lm::lm, aligned.choice(best_aligned.solutions[0].pick));
  REQUIRE(compiled.program);
  CHECK_NOTHROW(lower(*compiled.program, shapes, eight, {.depth = {{"layers", 3}}}));
  o.limits.align_large_nodes = false;
  CHECK_THROWS_WITH(autoshard::formulate(auto_lm::lm, eight, shapes, h100, o), ContainsSubstring("strategies the rules accept"));
}

TEST_CASE("the formulation's errors name the problem", "[autoshard][exact]") {
  const auto shapes = auto_lm::shapes(8, 16, 512, 64);
  auto o = lm_options();
  o.limits.max_strategies = 10;
  CHECK_THROWS_WITH(autoshard::formulate(auto_lm::lm, eight, shapes, h100, o), ContainsSubstring("strategies the rules accept, over 10"));
  o = lm_options();
  o.limits.max_combinations = 10;
  CHECK_THROWS_WITH(autoshard::formulate(auto_lm::lm, eight, shapes, h100, o), ContainsSubstring("combinations of operand layouts, over 10"));
  o = lm_options(2);
  o.zero_axis = "pp";
  CHECK_THROWS_WITH(autoshard::formulate(auto_lm::lm, eight, shapes, h100, o), ContainsSubstring("ZeRO over 'pp'"));
  o = lm_options();
  o.lower.depth.clear();
  CHECK_THROWS_WITH(autoshard::formulate(auto_lm::lm, eight, shapes, h100, o), ContainsSubstring("no depth given for repeat 'layers'"));
  o = lm_options();
  o.memory_cap_bytes = 1024;
  const auto f = autoshard::formulate(auto_lm::lm, eight, shapes, h100, o);
  const auto none = autoshard::solve(f);
  CHECK(none.infeasible);
  CHECK(none.solutions.empty());
}

TEST_CASE("automatic sharding seeds its search with the formulation's solutions and says so", "[autoshard][exact]") {
  autoshard::options o;
  o.lower.depth = {{"layers", 2}};
  const auto r = autoshard::choose(auto_lm::lm, eight, auto_lm::shapes(8, 16, 512, 64), h100, o);
  REQUIRE(r.exact.size() == 7); // no ZeRO, then stages 1-3 over dp and over tp
  for (const auto& e : r.exact) {
    CAPTURE(e.zero_stage, e.zero_axis, e.refused);
    CHECK(e.refused.empty());
    REQUIRE(e.solutions.size() == 2);
    CHECK(e.solutions[0].proved);
    CHECK(e.strategies > e.nodes);
  }
  bool seeded = false;
  for (const auto& s : r.seeds) seeded = seeded || (s.origin.starts_with("exact formulation") && s.valid);
  CHECK(seeded);
  CHECK_THAT(r.explain(), ContainsSubstring("exact formulation (additive"));
  o.exact.enabled = false;
  CHECK(autoshard::choose(auto_lm::lm, eight, auto_lm::shapes(8, 16, 512, 64), h100, o).exact.empty());
}
