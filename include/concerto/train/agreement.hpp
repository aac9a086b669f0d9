#pragma once
/// @file
/// @brief Before step 1, every rank checks that it compiled the same step as rank 0.
///
/// Rank 0's plan runs everywhere, so a rank that was given other settings (another learning
/// rate, seed, model size or policy, another MPI algorithm choice) would otherwise run rank 0's
/// graph with its own numbers: replicas drift apart, or a collective waits for ever. Each rank
/// describes what must agree as named fields (train::step builds the list); the check names the
/// first field that differs, rank 0's value, the value of the lowest rank that differs, and every
/// rank that differs, and throws that message on every rank.
///
/// @code
/// train::settings_record mine{{"adamw.lr", "0.001"}, {"seed", "1"}};
/// train::check_agreement(mine, control); // collective over control's ranks
/// @endcode

#include <concerto/cache/key.hpp>
#include <concerto/core/error.hpp>
#include <concerto/core/hash.hpp>
#include <concerto/plan/hash.hpp>
#include <concerto/runtime/mpi/control.hpp>
#include <concerto/runtime/mpi/settings.hpp>
#include <concerto/train/options.hpp>
#include <concerto/train/planning.hpp>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <charconv>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <span>
#include <string>
#include <utility>
#include <vector>

namespace concerto::train {

/// @brief Named values that must be equal on every rank, in the order they are compared.
using settings_record = std::vector<std::pair<std::string, std::string>>;

/// @brief Throws on every rank when some rank's record differs from rank 0's. Collective.
///
/// Point-to-point messages carry it, never a collective: a rank whose MPI collectives use
/// other algorithms (a difference this check exists to find) would deadlock a broadcast or
/// truncate a gather made of them. Rank 0 sends its record to every rank; each answers with the
/// index of its first field that differs (and that field's value); rank 0 sends the verdict.
inline void check_agreement(const settings_record& mine, const runtime::mpi::control& c) {
  const std::string what = "the settings agreement check before step 1";
  std::string theirs;
  if (c.rank() == 0) theirs = nlohmann::json(mine).dump();
  c.broadcast_point_to_point(theirs, what);
  const auto reference = nlohmann::json::parse(theirs).get<settings_record>();

  // This rank's first field that differs from rank 0's (a missing field counts), with its value.
  nlohmann::json answer = nullptr;
  for (std::size_t i = 0; i < std::max(mine.size(), reference.size()); ++i)
    if (i >= mine.size() || i >= reference.size() || mine[i] != reference[i]) {
      answer = {i, i < mine.size() ? nlohmann::json(mine[i].second) : nlohmann::json(nullptr)};
      break;
    }
  const auto answers = c.gather_point_to_point(answer.dump(), what);

  std::string verdict;
  if (c.rank() == 0) {
    std::size_t field = std::numeric_limits<std::size_t>::max();
    std::vector<int> differing;
    for (std::size_t r = 0; r < answers.size(); ++r) {
      const auto a = nlohmann::json::parse(answers[r]);
      if (a.is_null()) continue;
      differing.push_back(static_cast<int>(r));
      field = std::min(field, a.at(0).get<std::size_t>());
    }
    if (!differing.empty()) {
      int shown = 0;
      std::string shown_value = "nothing";
      for (const int r : differing)
        if (const auto a = nlohmann::json::parse(answers[static_cast<std::size_t>(r)]); a.at(0).get<std::size_t>() == field) {
          shown = r;
          if (!a.at(1).is_null()) shown_value = "'" + a.at(1).get<std::string>() + "'";
          break;
        }
      const auto name = field < reference.size() ? reference[field].first : "?";
      const auto ours = field < reference.size() ? "'" + reference[field].second + "'" : std::string("nothing");
      std::string ranks;
      for (std::size_t k = 0; k < differing.size() && k < 16; ++k) ranks += (k ? ", " : "") + std::to_string(differing[k]);
      if (differing.size() > 16) ranks += ", ...";
      verdict = "train step: the ranks disagree on '" + name + "': rank 0 has " + ours + ", rank " + std::to_string(shown) +
                " has " + shown_value + " (ranks that differ from rank 0: " + ranks +
                "); every rank must compile the step with the same program, shapes, mesh, optimizer, options and MPI settings";
    }
  }
  c.broadcast_point_to_point(verdict, what);
  if (!verdict.empty()) fail_on_every_rank(verdict);
}

/// @brief Everything about a step that must be identical on every rank, in the order it is
/// compared: the step's settings, then the lowered graph they make, then the MPI library's
/// collective settings.
[[nodiscard]] inline settings_record settings_record_of(const step_options& options, const runtime::kernel_settings& settings,
                                                       const shape_map& shapes, const ir::graph& lowered) {
  const auto number = [](float v) { // the shortest text that reads back as the same float
    char buf[32];
    const auto [end, ec] = std::to_chars(buf, buf + sizeof buf, v);
    return std::string(buf, ec == std::errc() ? end : buf);
  };
  const auto flag = [](bool b) { return std::string(b ? "true" : "false"); };
  settings_record record{{"library version", std::string(cache::library_version)},
                         {"shapes", nlohmann::json(shapes).dump()},
                         {"lower.heads", std::to_string(options.lower.heads)},
                         {"lower.rope_theta", std::to_string(options.lower.rope_theta)},
                         {"lower.depth", nlohmann::json(options.lower.depth).dump()},
                         {"precision", ir::to_string(options.precision)},
                         {"policy", std::string(planner::to_string(options.policy))},
                         {"cost_preset", options.cost_preset},
                         {"measure_kernels", options.measure_kernels ? flag(*options.measure_kernels) : "default"},
                         {"use_cache", flag(options.use_cache)},
                         {"planner options", hasher::to_hex(planner::hash(detail::planning_options(options)))},
                         {"seed", std::to_string(options.seed)},
                         {"sgd.lr", number(settings.sgd.lr)},
                         {"sgd.momentum", number(settings.sgd.momentum)},
                         {"sgd.weight_decay", number(settings.sgd.weight_decay)},
                         {"adamw.lr", number(settings.adamw.lr)},
                         {"adamw.beta1", number(settings.adamw.beta1)},
                         {"adamw.beta2", number(settings.adamw.beta2)},
                         {"adamw.eps", number(settings.adamw.eps)},
                         {"adamw.weight_decay", number(settings.adamw.weight_decay)},
                         {"lr_schedule", std::string(runtime::to_string(settings.schedule.decay)) + " warmup " +
                                             std::to_string(settings.schedule.warmup_steps) + " decay_steps " +
                                             std::to_string(settings.schedule.decay_steps) + " min_ratio " +
                                             number(settings.schedule.min_ratio)},
                         {"clip_norm", number(settings.clip_norm)},
                         {"loss_scaling", !options.precision.loss_scaling
                                              ? std::string("off")
                                              : "initial " + number(options.loss_scaling.initial_scale) + " growth " +
                                                    number(options.loss_scaling.growth_factor) + " backoff " +
                                                    number(options.loss_scaling.backoff_factor) + " every " +
                                                    std::to_string(options.loss_scaling.growth_interval) + " within [" +
                                                    number(options.loss_scaling.min_scale) + ", " +
                                                    number(options.loss_scaling.max_scale) + "]"},
                         {"stop_on_non_finite_loss", flag(options.stop_on_non_finite_loss)},
                         {"check_replicas_every", std::to_string(options.check_replicas_every)},
                         {"allow_tf32", flag(options.allow_tf32)},
                         {"pipeline", nlohmann::json{options.pipeline.microbatches, options.pipeline.schedule,
                                                     options.pipeline.virtual_stages, options.pipeline.axis,
                                                     options.pipeline.search_budget_s,
                                                     options.pipeline.search_work_limit}
                                          .dump()},
                         {"plan choice", nlohmann::json{options.choice.enabled, options.choice.warmup_steps,
                                                        options.choice.profile_steps, options.choice.trial_steps,
                                                        options.choice.rounds, [&] {
                                                          std::vector<std::string> names;
                                                          for (const auto p : options.choice.also_try)
                                                            names.emplace_back(planner::to_string(p));
                                                          return names;
                                                        }()}
                                             .dump()},
                         // Last of the step's own: what the settings above make of the program,
                         // so that a difference in them is named before the graph it changes.
                         {"lowered graph (program, mesh, shapes)", hasher::to_hex(plan::hash(lowered))}};
  // The MPI library's collective algorithms: ranks that differ deadlock or truncate in them.
  for (auto& [name, value] : runtime::mpi::collective_settings()) record.emplace_back("MPI " + name, std::move(value));
  return record;
}

} // namespace concerto::train
