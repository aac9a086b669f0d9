#pragma once
/// @file
/// @brief The plan choice of the first steps, as a state machine the step drives one step at a
/// time (the arithmetic is train/plan_choice.hpp's, the record train/choice_store.hpp's).
///
/// After `warmup_steps`, the running (first) plan is measured for `profile_steps`; on a host
/// backend every rank's measurements refit the cost model on rank 0, which re-plans and makes
/// the candidates (the first plan, the re-planned one, the best baseline, every list baseline,
/// `also_try`; duplicates dropped) and sends them; the candidates run in turn for `rounds` ×
/// `trial_steps` steps; rank 0 judges the slowest rank's steps and every rank switches to the
/// winner. Starting from an earlier run's pick, the trials measure it against the rivals that
/// came close instead, without planning. A switch never happens inside a step: the chooser
/// names the plan the next step runs (`take_switch`), the step changes executors before it.
///
/// @code
/// detail::plan_chooser<Backend> chooser;
/// chooser.begin({.prior = model, ...});
/// chooser.advance(report, control, backend, executor.plan(), planner_input);   // after every step
/// if (auto next = chooser.take_switch()) switch_executor(std::move(*next));
/// @endcode

#include <concerto/core/hash.hpp>
#include <concerto/core/statistics.hpp>
#include <concerto/cost/model.hpp>
#include <concerto/plan/hash.hpp>
#include <concerto/planner/make_plan.hpp>
#include <concerto/planner/refit.hpp>
#include <concerto/runtime/decide.hpp>
#include <concerto/runtime/executor.hpp>
#include <concerto/runtime/mpi/channel.hpp>
#include <concerto/runtime/mpi/control.hpp>
#include <concerto/sim/simulate.hpp>
#include <concerto/train/choice_store.hpp>
#include <concerto/train/plan_choice.hpp>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <functional>
#include <optional>
#include <set>
#include <span>
#include <string>
#include <utility>
#include <vector>

namespace concerto::train::detail {

using planner::replayed_us;

/// @brief What the plan choice plans and measures with.
struct choice_setup {
  cost::model prior;                            ///< the model the first plan was made with
  plan_choice_options options;
  planner::plan_options planning;               ///< the step's
  choice_store store;                           ///< where the winner goes (rank 0, with the plan cache on)
  bool keeps_choice = false;                    ///< the plan cache is on: the winner is stored
  /// Confirming an earlier run's pick: its record (with "confirm") and, on rank 0, the rivals.
  std::optional<nlohmann::json> earlier;
  std::vector<plan::plan> rivals;
};

template <class Backend>
class plan_chooser {
public:
  void begin(choice_setup setup) { state_.emplace(std::move(setup)); }
  [[nodiscard]] bool active() const noexcept { return state_.has_value(); }
  [[nodiscard]] const plan_choice_report& report() const noexcept { return report_; }
  /// Takes the report of an earlier run's pick kept as it is.
  void decided(plan_choice_report r) { report_ = std::move(r); }

  /// The plan the next step runs instead of the running one, once (the step switches to it).
  [[nodiscard]] std::optional<plan::plan> take_switch() { return std::exchange(next_plan_, std::nullopt); }
  [[nodiscard]] const plan::plan* pending_switch() const noexcept { return next_plan_ ? &*next_plan_ : nullptr; }
  /// The seconds the step took to switch executors (reported with the choice).
  void switched(double seconds) {
    if (state_) state_->switching_s += seconds;
  }

  /// One step more of the choice, after step `rep` ran `running` on every rank; `planner_input`
  /// gives the graph the step plans (called on rank 0). Collective.
  void advance(const runtime::step_report& rep, const runtime::mpi::control& control, Backend& backend,
               const plan::plan& running, const std::function<ir::graph()>& planner_input) {
    auto& c = *state_;
    const auto& o = c.setup.options;
    ++c.seen;
    if (c.order.empty()) { // measuring the first plan
      if (c.seen <= o.warmup_steps) return;
      if (c.setup.earlier) {
        start_confirmation(backend, running);
        return;
      }
      c.profile.push_back(rep.measured);
      if (static_cast<int>(c.profile.size()) == o.profile_steps)
        start_trials(rep.step, control, backend, running, planner_input);
      return;
    }
    const int ran = c.order[c.position];
    double t = rep.measured.step_us;
    if (o.adjust_measured) t = o.adjust_measured(control.rank(), c.names[static_cast<std::size_t>(ran)], t);
    c.times.push_back(t);
    if (++c.position < c.order.size()) {
      switch_to(c.order[c.position]);
      return;
    }
    finish(rep.step, control, planner_input);
  }

private:
  struct state {
    explicit state(choice_setup s) : setup(std::move(s)) {}
    choice_setup setup;
    std::optional<cost::model> refitted; ///< rank 0: the prior refitted to the measured steps
    int seen = 0;                        ///< steps since the first
    std::vector<sim::result> profile;    ///< measured steps of the first plan
    std::vector<plan::plan> plans;       ///< the candidates; 0 is the first plan
    std::vector<std::string> names;
    std::vector<double> predicted_us;
    std::vector<int> order;              ///< candidate of each trial step
    std::size_t position = 0;            ///< next trial step
    int next = 0;                        ///< the candidate the next step runs
    std::vector<double> times;           ///< this rank's trial step times
    std::string refit;
    double planning_s = 0, switching_s = 0;
  };

  // Rank 0: the candidates beside the running one, as [name, predicted us] (the running one's
  // first), their plans in `made`, duplicates of an earlier candidate dropped.
  nlohmann::json make_candidates(const plan::plan& first, const cost::model& refitted, bool refit, const ir::graph& g,
                                 std::vector<plan::plan>& made) {
    auto& c = *state_;
    const runtime::mpi::channel::busy busy(runtime::mpi::channel::get(), "planning the plan choice's candidates");
    auto planning = c.setup.planning;
    std::vector<std::string> names{"concerto"};
    if (refit) {
      names.emplace_back("concerto (re-planned)");
      made.push_back(planner::make_plan(g, refitted, planning));
    }
    std::optional<plan::plan> best;
    std::string best_name;
    for (const auto& policy : planner::policy_table) {
      if (policy.family == planner::policy_family::search ||
          (planning.memory_cap_bytes && policy.family == planner::policy_family::framework))
        continue; // frameworks ignore caps
      planning.policy = policy.id;
      auto p = planner::make_plan(g, refitted, planning);
      if (!best || p.step_us() < best->step_us()) best = std::move(p), best_name = policy.name;
    }
    names.push_back(best_name);
    made.push_back(std::move(*best));
    // Each list baseline runs too, as does every policy the options add: the model's ranking
    // of them is not to be trusted where it mispriced the first plan. On one H200 (no refit:
    // the executor sees when tasks were issued, not how long they ran) the model put xla_lhs
    // first for a small GPT that ran 1.2x slower under it than under sync; on the emulated
    // cluster, a refitted model still ranked plans within 10-30% of each other wrongly.
    auto more = planner::policies_of(planner::policy_family::list);
    more.insert(more.end(), c.setup.options.also_try.begin(), c.setup.options.also_try.end());
    for (const auto policy : more) {
      planning.policy = policy;
      names.emplace_back(planner::to_string(policy));
      made.push_back(planner::make_plan(g, refitted, planning));
    }
    nlohmann::json candidates = nlohmann::json::array();
    candidates.push_back({names[0], replayed_us(first, refitted)});
    std::set<std::uint64_t> seen{plan::hash(first)};
    std::vector<plan::plan> kept;
    for (std::size_t i = 0; i < made.size(); ++i) {
      if (!seen.insert(plan::hash(made[i])).second) continue;
      candidates.push_back({names[i + 1], replayed_us(made[i], refitted)});
      kept.push_back(std::move(made[i]));
    }
    made = std::move(kept);
    return candidates;
  }

  // Refit (host backends), re-plan and make the candidates on rank 0, send them to every rank.
  void start_trials(std::int64_t step, const runtime::mpi::control& control, Backend& backend, const plan::plan& first,
                    const std::function<ir::graph()>& planner_input) {
    auto& c = *state_;
    const auto started = std::chrono::steady_clock::now();
    const int rank = control.rank(), size = control.size();
    cost::model refitted = c.setup.prior;
    bool refit = false;
    if constexpr (!Backend::stream_ordered) {
      const auto mine = pack(planner::observe(first.graph, c.profile));
      std::vector<double> all(mine.size() * static_cast<std::size_t>(size));
      control.all_gather(std::span<const double>(mine), std::span(all), "the measured steps of the first plan");
      if (rank == 0) {
        const auto fit = planner::refit(first, c.setup.prior, combine(first.graph, all, size, static_cast<int>(c.profile.size())));
        refitted = fit.model;
        c.refitted = fit.model;
        c.refit = fit.text();
      }
      refit = true;
    }
    std::vector<double> profiled;
    for (const auto& r : c.profile) profiled.push_back(r.step_us);
    const double profile_median = concerto::median(std::move(profiled));
    c.profile.clear();
    // Rank 0 makes the candidates and says which there are; a failure there stops every rank.
    std::vector<plan::plan> made;
    const auto h = runtime::decide_on_rank_0(control, "the candidate plans from rank 0",
                                             "train step: planning the candidates of the plan choice failed on rank 0", [&] {
                                               return nlohmann::json{
                                                   {"candidates", make_candidates(first, refitted, refit, planner_input(), made)},
                                                   {"refit", c.refit}};
                                             });
    c.refit = h.at("refit");
    for (std::size_t i = 0; i < h.at("candidates").size(); ++i) {
      const auto& candidate = h.at("candidates")[i];
      c.names.push_back(candidate.at(0));
      c.predicted_us.push_back(candidate.at(1));
      c.plans.push_back(i == 0 ? first : runtime::distribute_plan(backend, [&] { return made[i - 1]; }));
    }
    c.planning_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
    if (c.plans.size() == 1) { // nothing else to try
      c.times.assign(1, profile_median);
      finish(step, control, planner_input);
      return;
    }
    c.order = trial_order(static_cast<int>(c.plans.size()), c.setup.options.rounds, c.setup.options.trial_steps);
    switch_to(c.order.front());
  }

  // An earlier run's winner (the plan running) against the rivals rank 0 loaded with it, by
  // the same trials; no refit, no planning.
  void start_confirmation(Backend& backend, const plan::plan& running) {
    auto& c = *state_;
    const auto started = std::chrono::steady_clock::now();
    const nlohmann::json& earlier = *c.setup.earlier;
    c.names = {earlier.at("winner").get<std::string>()};
    c.predicted_us = {earlier.at("predicted_us").get<double>()};
    c.plans = {running};
    const auto& rivals = earlier.at("confirm");
    for (std::size_t i = 0; i < rivals.size(); ++i) {
      c.names.push_back(rivals[i].at(0));
      c.predicted_us.push_back(rivals[i].at(1));
      c.plans.push_back(runtime::distribute_plan(backend, [&] { return c.setup.rivals.at(i); }));
    }
    c.setup.rivals.clear();
    c.refit = earlier.at("refit");
    c.planning_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
    c.order = trial_order(static_cast<int>(c.plans.size()), c.setup.options.rounds, c.setup.options.trial_steps);
    switch_to(c.order.front());
  }

  // Rank 0 judges the trials; every rank switches to the winner; the report; the cache.
  void finish(std::int64_t step, const runtime::mpi::control& control, const std::function<ir::graph()>& planner_input) {
    auto& c = *state_;
    const int size = control.size();
    const auto k = static_cast<int>(c.plans.size());
    // Each rank's trial step times, then its planning and switching seconds: one all-gather.
    auto mine = c.times;
    mine.push_back(c.planning_s);
    mine.push_back(c.switching_s);
    std::vector<double> all(mine.size() * static_cast<std::size_t>(size));
    control.all_gather(std::span<const double>(mine), std::span(all), "the plan choice's measured steps");
    const auto d = runtime::decide_on_rank_0(control, "the plan choice from rank 0",
                                             "train step: judging the plan choice's trials failed on rank 0", [&] {
                                               const auto order = c.order.empty() ? std::vector<int>{0} : c.order;
                                               std::vector<double> times;
                                               for (int r = 0; r < size; ++r) {
                                                 const auto from = all.begin() + static_cast<std::ptrdiff_t>(
                                                                                     static_cast<std::size_t>(r) * mine.size());
                                                 times.insert(times.end(), from,
                                                              from + static_cast<std::ptrdiff_t>(c.times.size()));
                                               }
                                               const auto v = judge_trials(order, times, size, k);
                                               return nlohmann::json{{"winner", v.winner},
                                                                     {"median_us", v.median_us},
                                                                     {"steps", v.steps},
                                                                     {"trying_us", v.excess_us}};
                                             });
    plan_choice_report r;
    r.winner = d.at("winner");
    r.decided_at_step = step;
    r.refit = c.refit;
    r.trial_cost_us = d.at("trying_us");
    for (int i = 0; i < size; ++i) {
      const auto spent = static_cast<std::size_t>(i + 1) * mine.size();
      r.planning_seconds = std::max(r.planning_seconds, all[spent - 2]);
      r.switching_seconds = std::max(r.switching_seconds, all[spent - 1]);
    }
    for (int i = 0; i < k; ++i) {
      const auto at = static_cast<std::size_t>(i);
      // One candidate only: its "trial" is the first plan's measured profile, which has no time here.
      const auto& median = d.at("median_us")[at];
      r.candidates.push_back({c.names[at], hasher::to_hex(plan::hash(c.plans[at])), c.predicted_us[at],
                              median.is_number() ? median.template get<double>() : 0.0, d.at("steps")[at].template get<int>()});
    }
    r.confirmed = c.setup.earlier.has_value();
    report_ = r;
    if (control.rank() == 0 && c.setup.keeps_choice)
      c.setup.store.store(r, c.plans,
                          c.setup.earlier ? c.setup.earlier->at("refitted_model")
                                          : nlohmann::json(c.refitted.value_or(c.setup.prior).hw()),
                          planner_input(), c.setup.prior);
    switch_to(r.winner);
    state_.reset();
  }

  // Candidate `index` runs from the next step on (take_switch), unless it runs already.
  void switch_to(int index) {
    auto& c = *state_;
    if (c.next == index) return;
    c.next = index;
    next_plan_ = c.plans[static_cast<std::size_t>(index)];
  }

  std::optional<state> state_;
  std::optional<plan::plan> next_plan_;
  plan_choice_report report_;
};

} // namespace concerto::train::detail
