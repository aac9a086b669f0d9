#pragma once
/// @file
/// @brief Summaries of measured samples: the median the plan choice, the refit and the
/// examples report (a noisy shared machine makes means follow outliers).

#include <algorithm>
#include <cstddef>
#include <vector>

namespace concerto {

/// @brief The median of `v` (the mean of the two middle values for an even count); 0 when empty.
[[nodiscard]] inline double median(std::vector<double> v) {
  if (v.empty()) return 0;
  const auto mid = v.begin() + static_cast<std::ptrdiff_t>(v.size() / 2);
  std::nth_element(v.begin(), mid, v.end());
  if (v.size() % 2 == 1) return *mid;
  return (*mid + *std::max_element(v.begin(), mid)) / 2;
}

} // namespace concerto
