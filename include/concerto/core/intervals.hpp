#pragma once
/// @file
/// @brief Sets of time intervals: the busy periods of streams, as the Gantt chart draws them
/// (trace/svg_gantt.hpp) and the refit measures overlap with them (planner/refit.hpp).

#include <algorithm>
#include <utility>
#include <vector>

namespace concerto::intervals {

/// Half-open [start, end) intervals.
using span_list = std::vector<std::pair<double, double>>;

/// The union of `spans`, sorted, disjoint, empty intervals dropped.
[[nodiscard]] inline span_list merged(span_list spans) {
  std::sort(spans.begin(), spans.end());
  span_list out;
  for (const auto& [a, b] : spans) {
    if (b <= a) continue;
    if (!out.empty() && a <= out.back().second) out.back().second = std::max(out.back().second, b);
    else out.emplace_back(a, b);
  }
  return out;
}

/// a \ b, both merged.
[[nodiscard]] inline span_list minus(const span_list& a, const span_list& b) {
  span_list out;
  std::size_t j = 0;
  for (auto [lo, hi] : a) {
    while (j < b.size() && b[j].second <= lo) ++j;
    for (std::size_t k = j; k < b.size() && b[k].first < hi; ++k) {
      if (b[k].first > lo) out.emplace_back(lo, b[k].first);
      lo = std::max(lo, b[k].second);
    }
    if (lo < hi) out.emplace_back(lo, hi);
  }
  return out;
}

/// How much of [lo, hi) the merged `spans` cover.
[[nodiscard]] inline double covered(const span_list& spans, double lo, double hi) {
  double c = 0;
  auto it = std::lower_bound(spans.begin(), spans.end(), lo, [](const auto& s, double at) { return s.second <= at; });
  for (; it != spans.end() && it->first < hi; ++it) c += std::max(0.0, std::min(hi, it->second) - std::max(lo, it->first));
  return c;
}

} // namespace concerto::intervals
