// The CPU kernels' exp and tanh against libm in double. This file is built twice
// (tests/CMakeLists.txt): with the project's flags, and with -ffast-math as a user may compile
// the headers (reassociation once folded the range reduction away and made exp(1) = 2).
#include <concerto/runtime/cpu/detail/fast_math.hpp>
#include <concerto/runtime/cpu/elementwise.hpp>

#include <catch2/catch_test_macros.hpp>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace cpu = concerto::runtime::cpu;

#if defined(__FAST_MATH__)
// The two-part range reduction may be merged into one: ~4e-6 at |x| near 87.
constexpr double exp_tolerance = 1e-5;
#else
constexpr double exp_tolerance = 3e-7;
#endif

TEST_CASE("the vectorisable exp and tanh match libm in double", "[cpu][fast_math]") {
  // A dense sweep, not random points: the worst case of a polynomial sits at the ends of the
  // reduced range, which a sweep of every 1/1000 crosses hundreds of times.
  double worst_exp = 0, worst_tanh = 0;
  for (int i = -80000; i < 87000; ++i) { // below -80 e^x nears the subnormals, which keep fewer bits
    const float x = static_cast<float>(i) * 1e-3f;
    const double want = std::exp(static_cast<double>(x));
    worst_exp = std::max(worst_exp, std::abs(cpu::detail::exp_approx(x) - want) / want);
  }
  for (int i = -20000; i <= 20000; ++i) {
    const float u = static_cast<float>(i) * 1e-3f;
    worst_tanh = std::max(worst_tanh, std::abs(cpu::detail::tanh_approx(u) - std::tanh(static_cast<double>(u))));
  }
  CHECK(worst_exp < exp_tolerance);
  CHECK(worst_tanh < 2e-7);
  const std::vector<float> x{1.0f, -2.0f};
  std::vector<float> y(2);
  cpu::gelu(x, y);
  CHECK(std::abs(y[0] - 0.8411920f) < 1e-6f); // 0.5·(1 + tanh(0.7978845608·1.044715))
  CHECK(std::abs(y[1] + 0.0454023f) < 1e-6f);
}

#if !defined(__FAST_MATH__) // -ffast-math assumes no NaN or infinity exists
TEST_CASE("out of range inputs clamp, NaN stays NaN", "[cpu][fast_math]") {
  CHECK(std::abs(cpu::detail::exp_approx(-1000.0f) / std::exp(-87.0) - 1) < 1e-6);
  CHECK(std::abs(cpu::detail::exp_approx(1000.0f) / std::exp(87.0) - 1) < 1e-6);
  CHECK(cpu::detail::tanh_approx(50.0f) == 1.0f);
  CHECK(cpu::detail::tanh_approx(-50.0f) == -1.0f);
  CHECK(std::isnan(cpu::detail::exp_approx(std::numeric_limits<float>::quiet_NaN())));
  CHECK(std::isnan(cpu::detail::tanh_approx(std::numeric_limits<float>::quiet_NaN())));
  std::vector<float> x{1.0f, std::numeric_limits<float>::quiet_NaN()}, y(2);
  cpu::gelu(x, y);
  CHECK(std::isnan(y[1]));
}
#endif
