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

#include <concerto/core/error.hpp>
#include <concerto/runtime/mpi/control.hpp>

#include <nlohmann/json.hpp>

#include <algorithm>
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
inline void check_agreement(const settings_record& mine, const runtime::mpi::control& c) {
  const int rank = c.rank(), size = c.size();
  const std::string what = "the settings agreement check before step 1";
  std::string theirs;
  if (rank == 0) theirs = nlohmann::json(mine).dump();
  c.broadcast(theirs, 0, what);
  const auto reference = nlohmann::json::parse(theirs).get<settings_record>();

  // The index of this rank's first field that differs from rank 0's (a missing field counts).
  constexpr auto agrees = std::numeric_limits<std::int64_t>::max();
  std::int64_t first = agrees;
  for (std::size_t i = 0; i < std::max(mine.size(), reference.size()); ++i)
    if (i >= mine.size() || i >= reference.size() || mine[i] != reference[i]) {
      first = static_cast<std::int64_t>(i);
      break;
    }
  std::vector<std::int64_t> firsts(static_cast<std::size_t>(size));
  c.all_gather(std::span<const std::int64_t>(&first, 1), std::span<std::int64_t>(firsts), what);
  const auto field = *std::min_element(firsts.begin(), firsts.end());
  if (field == agrees) return;

  std::vector<int> differing;
  for (int r = 0; r < size; ++r)
    if (firsts[static_cast<std::size_t>(r)] != agrees) differing.push_back(r);
  int shown = size;
  for (int r = 0; r < size; ++r)
    if (firsts[static_cast<std::size_t>(r)] == field) {
      shown = r;
      break;
    }
  const auto value_of = [&](const settings_record& rec) {
    const auto i = static_cast<std::size_t>(field);
    if (i >= rec.size()) return std::string("nothing");
    std::string quoted(1, '\'');
    quoted += rec[i].second;
    quoted += '\'';
    return quoted;
  };
  std::string shown_value = rank == shown ? value_of(mine) : std::string();
  c.broadcast(shown_value, shown, what);
  const auto i = static_cast<std::size_t>(field);
  const auto name = i < reference.size() ? reference[i].first : (i < mine.size() ? mine[i].first : "?");
  std::string ranks;
  for (std::size_t k = 0; k < differing.size() && k < 16; ++k) ranks += (k ? ", " : "") + std::to_string(differing[k]);
  if (differing.size() > 16) ranks += ", ...";
  fail_on_every_rank("train step: the ranks disagree on '" + name + "': rank 0 has " + value_of(reference) + ", rank " +
       std::to_string(shown) + " has " + shown_value + " (ranks that differ from rank 0: " + ranks +
       "); every rank must compile the step with the same program, shapes, mesh, optimizer, options and MPI settings");
}

} // namespace concerto::train
