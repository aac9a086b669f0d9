#pragma once
// Helpers shared by the CPU kernel tests: seeded random data, a comparison that reports the
// worst element, and central finite differences of a float forward pass.

#include <catch2/catch_test_macros.hpp>

#include <cmath>
#include <cstddef>
#include <random>
#include <span>
#include <sstream>
#include <string>
#include <vector>

namespace kernels_testing {

inline std::vector<float> random_floats(std::mt19937& rng, std::size_t n, float lo = -1.0f, float hi = 1.0f) {
  std::uniform_real_distribution<float> d(lo, hi);
  std::vector<float> v(n);
  for (auto& x : v) x = d(rng);
  return v;
}

inline std::vector<double> to_double(std::span<const float> v) { return {v.begin(), v.end()}; }

struct comparison {
  double worst = 0.0;      // largest |got - want| / (atol + rtol·|want|); pass when <= 1
  std::size_t at = 0;
  double got = 0.0, want = 0.0;
};

inline comparison compare(std::span<const float> got, std::span<const double> want, double rtol, double atol) {
  REQUIRE(got.size() == want.size());
  comparison c;
  for (std::size_t i = 0; i < got.size(); ++i) {
    const double err = std::abs(static_cast<double>(got[i]) - want[i]) / (atol + rtol * std::abs(want[i]));
    if (!(err <= c.worst)) { // also catches NaN
      c = {std::isnan(err) ? INFINITY : err, i, got[i], want[i]};
    }
  }
  return c;
}

// One assertion per array (not per element), with the worst element in the message.
#define REQUIRE_CLOSE(GOT_, WANT_, RTOL_, ATOL_)                                                    \
  do {                                                                                              \
    const auto cmp_ = ::kernels_testing::compare((GOT_), (WANT_), (RTOL_), (ATOL_));                \
    INFO(#GOT_ << " vs " << #WANT_ << ": worst at [" << cmp_.at << "] got " << cmp_.got             \
               << " want " << cmp_.want << " (error " << cmp_.worst << " x tolerance)");            \
    REQUIRE(cmp_.worst <= 1.0);                                                                     \
  } while (false)

inline double max_abs(std::span<const float> v) {
  double m = 0.0;
  for (float x : v) m = std::max(m, static_cast<double>(std::abs(x)));
  return m;
}

// dL/dx_i by central differences, where `loss()` runs the float forward on the current x and
// returns a double. The step actually taken is what float rounding of x ± h gives.
template <class Loss>
double central_difference_at(std::vector<float>& x, std::size_t i, Loss&& loss, float h = 1e-2f) {
  const float xi = x[i];
  x[i] = xi + h;
  const double up_x = x[i];
  const double up = loss();
  x[i] = xi - h;
  const double down_x = x[i];
  const double down = loss();
  x[i] = xi;
  return (up - down) / (up_x - down_x);
}

// The same for every element (small shapes).
template <class Loss>
std::vector<double> central_difference(std::vector<float>& x, Loss&& loss, float h = 1e-2f) {
  std::vector<double> g(x.size());
  for (std::size_t i = 0; i < x.size(); ++i) g[i] = central_difference_at(x, i, loss, h);
  return g;
}

// Σ w·out in double: the scalar whose gradient wrt out is w, so a backward called with dout = w
// must give its gradient.
inline double project(std::span<const float> w, std::span<const float> out) {
  double s = 0.0;
  for (std::size_t i = 0; i < out.size(); ++i) s += static_cast<double>(w[i]) * out[i];
  return s;
}

} // namespace kernels_testing
