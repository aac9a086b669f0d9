#pragma once
/// @file
/// @brief Internal: the check the trace writers share. Not for direct inclusion.

#include <concerto/core/error.hpp>
#include <concerto/ir/graph.hpp>
#include <concerto/sim/simulate.hpp>

#include <string>
#include <string_view>

namespace concerto::trace {

namespace detail {
/// A result made for another graph would index out of range or label the wrong tasks.
inline void check_matches(const ir::graph& g, const sim::result& r, std::string_view writer) {
  const auto n = g.tasks.size();
  if (r.start_us.size() != n || r.end_us.size() != n || r.timeline.size() != n)
    fail(std::string(writer) + ": the result has " + std::to_string(r.timeline.size()) +
         " timeline entries for graph '" + g.name + "' with " + std::to_string(n) + " tasks");
  for (const auto& iv : r.timeline)
    if (iv.task < 0 || static_cast<std::size_t>(iv.task) >= n || iv.stream < 0 ||
        static_cast<std::size_t>(iv.stream) >= g.streams.size())
      fail(std::string(writer) + ": the result names task " + std::to_string(iv.task) + " on stream " +
           std::to_string(iv.stream) + ", which graph '" + g.name + "' does not have");
}
} // namespace detail

} // namespace concerto::trace
