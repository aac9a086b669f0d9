// The CPU kernels' exp and tanh keep their accuracy when a user compiles the headers with
// -ffast-math: this file is built with it (tests/CMakeLists.txt). Reassociation once folded the
// range reduction away and made exp(1) = 2. tests/cpu/kernels_test.cpp checks the default flags.
#include <concerto/runtime/cpu/detail/fast_math.hpp>
#include <concerto/runtime/cpu/elementwise.hpp>

#include <catch2/catch_test_macros.hpp>

#include <algorithm>
#include <cmath>
#include <vector>

namespace cpu = concerto::runtime::cpu;

TEST_CASE("exp and tanh stay accurate under -ffast-math", "[cpu][fast_math]") {
#ifndef __FAST_MATH__
  FAIL("this file must be compiled with -ffast-math (see tests/CMakeLists.txt)");
#endif
  double worst_exp = 0, worst_tanh = 0;
  for (int i = -80000; i < 87000; ++i) {
    const float x = static_cast<float>(i) * 1e-3f;
    const double want = std::exp(static_cast<double>(x));
    worst_exp = std::max(worst_exp, std::abs(cpu::detail::exp_approx(x) - want) / want);
  }
  for (int i = -20000; i <= 20000; ++i) {
    const float u = static_cast<float>(i) * 1e-3f;
    worst_tanh = std::max(worst_tanh, std::abs(cpu::detail::tanh_approx(u) - std::tanh(static_cast<double>(u))));
  }
  CHECK(worst_exp < 1e-5); // the two-part reduction may be merged into one: ~4e-6 at |x| near 87
  CHECK(worst_tanh < 2e-7);
  const std::vector<float> x{1.0f, -2.0f};
  std::vector<float> y(2);
  cpu::gelu(x, y);
  CHECK(std::abs(y[0] - 0.8411920f) < 1e-6f); // 0.5·(1 + tanh(0.7978845608·1.044715))
  CHECK(std::abs(y[1] + 0.0454023f) < 1e-6f);
}
