#pragma once
/// @file
/// @brief Where the plan choice keeps what it decided, for the next run of the same job: the
/// winner in the plan cache under its own key (the first plan's, policy "concerto+measured"),
/// the plans it beat under theirs ("concerto+measured:<name>"), and beside them a record of
/// what was measured, which names each plan by hash. A record and its plans must be whole and
/// agree, or the choice is made again (train/plan_choice.hpp; docs/training.md).
///
/// @code
/// detail::choice_store store(options.cache_dir, "concerto", planner::hash(planning), options.choice.confirm_within);
/// if (auto kept = store.load(g, model)) plan = std::move(kept->winner);   // rank 0
/// @endcode

#include <concerto/cache/key.hpp>
#include <concerto/cache/plan_cache.hpp>
#include <concerto/core/error.hpp>
#include <concerto/core/file.hpp>
#include <concerto/core/hash.hpp>
#include <concerto/cost/model.hpp>
#include <concerto/plan/hash.hpp>
#include <concerto/plan/plan.hpp>
#include <concerto/train/backend_select.hpp>
#include <concerto/train/plan_choice.hpp>

#include <nlohmann/json.hpp>

#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

namespace concerto::train::detail {

/// @brief An earlier run's pick, as rank 0 loaded it.
struct earlier_choice {
  plan::plan winner;
  /// The record, with "confirm" added: the rivals the winner is measured against again
  /// ([name, predicted us] each, in the order of `rivals`).
  nlohmann::json record;
  std::vector<plan::plan> rivals;
};

class choice_store {
public:
  /// `policy` is the step's; `options_hash` planner::hash of its planning options; rivals that
  /// measured within `confirm_within` of the winner are measured again by the next run.
  choice_store(std::filesystem::path dir, std::string policy, std::uint64_t options_hash, double confirm_within)
      : dir_(std::move(dir)), policy_(std::move(policy)), options_hash_(options_hash), confirm_within_(confirm_within) {}

  /// Rank 0: the pick an earlier run kept for graph `g` planned with `model`, or nullopt (none,
  /// or a damaged or inconsistent one, which is said on stderr: the choice is then made again).
  [[nodiscard]] std::optional<earlier_choice> load(const ir::graph& g, const cost::model& model) const {
    const auto key = winner_key(g, model);
    const auto path = record_path(key);
    if (!std::filesystem::exists(path)) return std::nullopt;
    try {
      std::ifstream in(path);
      earlier_choice out;
      out.record = nlohmann::json::parse(in);
      auto& record = out.record;
      std::string why;
      cache::plan_cache cache(dir_);
      auto kept = cache.load(key, &why);
      if (!kept) fail("its plan is missing from the plan cache" + (why.empty() ? std::string() : " (" + why + ")"));
      if (hasher::to_hex(plan::hash(*kept)) != record.at("plan_hash").get<std::string>())
        fail("it names another plan than the one the plan cache holds");
      (void)report_of(record); // every field readable
      const auto& candidates = record.at("candidates");
      std::vector<double> medians;
      std::size_t winner = candidates.size();
      for (std::size_t i = 0; i < candidates.size(); ++i) {
        medians.push_back(candidates[i].at("measured_us").get<double>());
        if (candidates[i].at("plan_hash") == record.at("plan_hash") && candidates[i].at("name") == record.at("winner"))
          winner = i;
      }
      if (winner == candidates.size())
        fail("its winner '" + record.at("winner").get<std::string>() + "' (plan " + record.at("plan_hash").get<std::string>() +
             ") is not among its candidates");
      auto confirm = nlohmann::json::array();
      for (const auto i : close_rivals(medians, winner, confirm_within_)) {
        const auto& rival = candidates[i];
        const auto name = rival.at("name").get<std::string>();
        why.clear();
        auto p = cache.load(rival_key(g, model, name), &why);
        if (!p || hasher::to_hex(plan::hash(*p)) != rival.at("plan_hash").get<std::string>()) {
          std::fprintf(stderr, "concerto: the plan '%s' that an earlier run measured is not in the plan cache%s; its winner is "
                       "measured again without it\n", name.c_str(), why.empty() ? "" : (" (" + why + ")").c_str());
          continue;
        }
        confirm.push_back({name, rival.at("predicted_us").get<double>()});
        out.rivals.push_back(std::move(*p));
      }
      record["confirm"] = std::move(confirm);
      out.winner = std::move(*kept);
      return out;
    } catch (const std::exception& e) {
      std::fprintf(stderr, "concerto: ignoring the plan chosen by an earlier run ('%s': %s); choosing again\n",
                   path.c_str(), e.what());
      return std::nullopt;
    }
  }

  /// The report of a record whose pick is taken as it is (no rival to measure again).
  [[nodiscard]] static plan_choice_report report_of(const nlohmann::json& record) {
    plan_choice_report r;
    r.from_cache = true;
    r.winner = 0;
    r.decided_at_step = record.at("decided_at_step").get<std::int64_t>();
    r.refit = record.at("refit").get<std::string>();
    r.candidates.push_back({record.at("winner").get<std::string>(), record.at("plan_hash").get<std::string>(),
                            record.at("predicted_us").get<double>(), record.at("measured_us").get<double>(),
                            record.at("steps").get<int>()});
    return r;
  }

  /// Rank 0: keeps the winner of `r` and the plans it beat (`plans`, by candidate), with what was
  /// measured and the model the trials were priced by; a failure is said, not thrown.
  void store(const plan_choice_report& r, std::span<const plan::plan> plans, const nlohmann::json& refitted_model,
             const ir::graph& g, const cost::model& prior) const {
    try {
      cache::plan_cache cache(dir_);
      const auto key = winner_key(g, prior);
      nlohmann::json candidates = nlohmann::json::array();
      for (std::size_t i = 0; i < r.candidates.size(); ++i) {
        const auto& c = r.candidates[i];
        if (static_cast<int>(i) != r.winner) cache.store(rival_key(g, prior, c.name), plans[i]);
        candidates.push_back(
            {{"name", c.name}, {"plan_hash", c.plan_hash}, {"predicted_us", c.predicted_us}, {"measured_us", c.measured_us}});
      }
      cache.store(key, plans[static_cast<std::size_t>(r.winner)]);
      const auto& w = r.candidates[static_cast<std::size_t>(r.winner)];
      const nlohmann::json record{{"winner", w.name},          {"plan_hash", w.plan_hash},      {"predicted_us", w.predicted_us},
                                  {"measured_us", w.measured_us}, {"steps", w.steps},           {"decided_at_step", r.decided_at_step},
                                  {"candidates", candidates}, {"refit", r.refit}, {"refitted_model", refitted_model}};
      write_file_atomically(record_path(key), record.dump(2) + "\n");
    } catch (const std::exception& e) {
      std::fprintf(stderr, "concerto: could not keep the chosen plan for the next run (%s)\n", e.what());
    }
  }

private:
  [[nodiscard]] cache::cache_key winner_key(const ir::graph& g, const cost::model& model) const {
    return cache::make_key(g, model, default_backend_name, policy_ + "+measured", options_hash_);
  }
  [[nodiscard]] cache::cache_key rival_key(const ir::graph& g, const cost::model& model, const std::string& name) const {
    return cache::make_key(g, model, default_backend_name, policy_ + "+measured:" + name, options_hash_);
  }
  [[nodiscard]] std::filesystem::path record_path(const cache::cache_key& key) const {
    return dir_ / ("choice-" + key.hex() + ".json");
  }

  std::filesystem::path dir_;
  std::string policy_;
  std::uint64_t options_hash_ = 0;
  double confirm_within_ = 1;
};

} // namespace concerto::train::detail
