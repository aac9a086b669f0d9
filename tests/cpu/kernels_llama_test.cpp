// CPU kernels of Llama-family blocks: RMSNorm, SiLU, the elementwise product, SwiGLU and rotary
// position embedding; the pointwise sigmoid and tanh. Forward kernels against double-precision loops written here, backward
// kernels against central differences of the float forward kernel (tolerances as in
// kernels_test.cpp: h = 1e-2, rtol = atol = 2e-3).

#include "kernels_testing.hpp"

#include <concerto/runtime/cpu/kernels.hpp>

#include <catch2/catch_test_macros.hpp>
#include <catch2/generators/catch_generators.hpp>
#include <catch2/matchers/catch_matchers_string.hpp>

#include <cmath>
#include <cstdint>
#include <tuple>

namespace cpu = concerto::runtime::cpu;
using namespace kernels_testing;
using Catch::Matchers::ContainsSubstring;

namespace {

constexpr double fd_tol = 2e-3;

double sigmoid(double x) { return 1.0 / (1.0 + std::exp(-x)); }

} // namespace

TEST_CASE("rmsnorm matches a double reference and its gradients are the finite differences",
          "[cpu][kernels][rmsnorm]") {
  const auto [rows, cols] = GENERATE(std::tuple{1u, 1u}, std::tuple{3u, 8u}, std::tuple{17u, 65u});
  CAPTURE(rows, cols);
  std::mt19937 rng(rows * 31 + cols);
  auto x = random_floats(rng, rows * cols);
  auto gain = random_floats(rng, cols, 0.5f, 1.5f);
  const auto w = random_floats(rng, rows * cols);
  std::vector<float> out(rows * cols), rstd(rows);
  const float eps = 1e-5f;

  cpu::rmsnorm(x, gain, out, rstd, rows, cols, eps);
  std::vector<double> want(rows * cols);
  for (std::size_t r = 0; r < rows; ++r) {
    double sq = 0;
    for (std::size_t c = 0; c < cols; ++c) sq += double(x[r * cols + c]) * x[r * cols + c];
    const double rs = 1.0 / std::sqrt(sq / double(cols) + eps);
    for (std::size_t c = 0; c < cols; ++c) want[r * cols + c] = x[r * cols + c] * rs * gain[c];
    CHECK(std::abs(rstd[r] - rs) <= 1e-5 * rs);
  }
  REQUIRE_CLOSE(out, want, 1e-5, 1e-6);

  std::vector<float> y(rows * cols), scratch(rows);
  auto loss = [&] {
    cpu::rmsnorm(x, gain, y, scratch, rows, cols, eps);
    return project(w, y);
  };
  std::vector<float> dx(rows * cols), dgain(cols);
  cpu::rmsnorm_grad(w, x, gain, rstd, dx, rows, cols);
  cpu::rmsnorm_grad_gain(w, x, rstd, dgain, rows, cols);
  if (cols > 1) REQUIRE(max_abs(dx) > 1e-2); // one column normalises to ±gain: no gradient through x
  REQUIRE_CLOSE(dx, central_difference(x, loss), fd_tol, fd_tol);
  REQUIRE_CLOSE(dgain, central_difference(gain, loss), fd_tol, fd_tol);

  SECTION("accumulate adds the gain gradient to what is there") {
    std::vector<float> acc(cols, 1.0f);
    cpu::rmsnorm_grad_gain(w, x, rstd, acc, rows, cols, /*accumulate=*/true);
    std::vector<double> want_acc(cols);
    for (std::size_t c = 0; c < cols; ++c) want_acc[c] = 1.0 + dgain[c];
    REQUIRE_CLOSE(acc, want_acc, 1e-6, 1e-6);
  }
  SECTION("rmsnorm_stats gives the forward's rstd") {
    std::vector<float> again(rows);
    cpu::rmsnorm_stats(x, again, rows, cols, eps);
    CHECK(again == rstd);
  }
}

TEST_CASE("silu, mul and swiglu match their definitions and their gradients the finite differences",
          "[cpu][kernels][elementwise][grad]") {
  std::mt19937 rng(23);
  const std::size_t n = 57;
  auto a = random_floats(rng, n, -4.0f, 4.0f);
  auto b = random_floats(rng, n, -2.0f, 2.0f);
  const auto w = random_floats(rng, n);
  std::vector<float> y(n);

  SECTION("silu") {
    cpu::silu(a, y);
    std::vector<double> want(n);
    for (std::size_t i = 0; i < n; ++i) want[i] = a[i] * sigmoid(a[i]);
    REQUIRE_CLOSE(y, want, 1e-5, 1e-6);
    std::vector<float> dx(n);
    cpu::silu_grad(a, w, dx);
    REQUIRE(max_abs(dx) > 0.1);
    REQUIRE_CLOSE(dx, central_difference(a, [&] {
                    cpu::silu(a, y);
                    return project(w, y);
                  }),
                  fd_tol, fd_tol);
  }
  SECTION("mul, whose gradients are products") {
    cpu::mul(a, b, y);
    std::vector<double> want(n);
    for (std::size_t i = 0; i < n; ++i) want[i] = double(a[i]) * b[i];
    REQUIRE_CLOSE(y, want, 1e-6, 0);
    std::vector<float> da(n), db(n);
    cpu::mul(w, b, da);
    cpu::mul(w, a, db);
    const auto loss = [&] {
      cpu::mul(a, b, y);
      return project(w, y);
    };
    REQUIRE_CLOSE(da, central_difference(a, loss), fd_tol, fd_tol);
    REQUIRE_CLOSE(db, central_difference(b, loss), fd_tol, fd_tol);
  }
  SECTION("swiglu is silu(gate)·up, and swiglu_grad gives both gradients") {
    cpu::swiglu(a, b, y);
    std::vector<double> want(n);
    for (std::size_t i = 0; i < n; ++i) want[i] = a[i] * sigmoid(a[i]) * b[i];
    REQUIRE_CLOSE(y, want, 1e-5, 1e-6);
    std::vector<float> dgate(n), dup(n);
    cpu::swiglu_grad(a, b, w, dgate, dup);
    REQUIRE(max_abs(dgate) > 0.1);
    REQUIRE(max_abs(dup) > 0.1);
    const auto loss = [&] {
      cpu::swiglu(a, b, y);
      return project(w, y);
    };
    REQUIRE_CLOSE(dgate, central_difference(a, loss), fd_tol, fd_tol);
    REQUIRE_CLOSE(dup, central_difference(b, loss), fd_tol, fd_tol);
  }
}

TEST_CASE("rope rotates each head's lane pairs by position and its gradient rotates back", "[cpu][kernels][rope]") {
  const std::size_t rows = 7, heads = 3, head_dim = 8, width = heads * head_dim;
  const double theta = 10000.0;
  std::mt19937 rng(5);
  auto x = random_floats(rng, rows * width);
  const auto w = random_floats(rng, rows * width);
  std::vector<std::int32_t> pos(rows);
  for (std::size_t r = 0; r < rows; ++r) pos[r] = static_cast<std::int32_t>(r * 3 + 1);
  std::vector<float> y(rows * width);
  cpu::rope(x, pos, y, rows, width, head_dim, theta);

  std::vector<double> want(rows * width);
  const std::size_t half = head_dim / 2;
  for (std::size_t r = 0; r < rows; ++r)
    for (std::size_t h = 0; h < heads; ++h)
      for (std::size_t i = 0; i < half; ++i) {
        const double angle = pos[r] * std::pow(theta, -2.0 * double(i) / double(head_dim));
        const double a = x[r * width + h * head_dim + i], b = x[r * width + h * head_dim + i + half];
        want[r * width + h * head_dim + i] = a * std::cos(angle) - b * std::sin(angle);
        want[r * width + h * head_dim + i + half] = b * std::cos(angle) + a * std::sin(angle);
      }
  REQUIRE_CLOSE(y, want, 1e-5, 1e-6);

  SECTION("position 0 is the identity; the dot product of two rotated vectors depends on the offset only") {
    std::vector<std::int32_t> zero(rows, 0);
    std::vector<float> same(rows * width);
    cpu::rope(x, zero, same, rows, width, head_dim, theta);
    CHECK(same == x);
    // q at position p and k at position p - d: the score is that of positions (d, 0).
    const std::vector<float> q(x.begin(), x.begin() + head_dim), k(x.begin() + width, x.begin() + width + head_dim);
    const auto score = [&](std::int32_t pq, std::int32_t pk) {
      std::vector<float> rq(head_dim), rk(head_dim);
      const std::vector<std::int32_t> a{pq}, b{pk};
      cpu::rope(q, a, rq, 1, head_dim, head_dim, theta);
      cpu::rope(k, b, rk, 1, head_dim, head_dim, theta);
      double s = 0;
      for (std::size_t i = 0; i < head_dim; ++i) s += double(rq[i]) * rk[i];
      return s;
    };
    CHECK(std::abs(score(9, 4) - score(5, 0)) < 1e-5);
  }
  SECTION("rope_grad is the gradient (and undoes the rotation)") {
    std::vector<float> dx(rows * width), back(rows * width);
    cpu::rope_grad(w, pos, dx, rows, width, head_dim, theta);
    REQUIRE_CLOSE(dx, central_difference(x, [&] {
                    cpu::rope(x, pos, y, rows, width, head_dim, theta);
                    return project(w, y);
                  }),
                  fd_tol, fd_tol);
    cpu::rope(x, pos, y, rows, width, head_dim, theta); // the differences left y at a shifted x
    cpu::rope_grad(y, pos, back, rows, width, head_dim, theta);
    REQUIRE_CLOSE(back, to_double(x), 1e-5, 1e-6);
  }
  SECTION("a head_dim that does not divide the row, or is odd, is refused") {
    CHECK_THROWS_WITH(cpu::rope(x, pos, y, rows, width, 5, theta), ContainsSubstring("rope: head_dim must be even"));
    CHECK_THROWS_WITH(cpu::rope(x, pos, y, rows, width, 16, theta), ContainsSubstring("not a multiple of head_dim 16"));
  }
}

TEST_CASE("tanh and its gradient from the output", "[cpu][kernels][tanh]") {
  std::mt19937 rng(59);
  auto x = random_floats(rng, 41, -6.0f, 6.0f);
  x.push_back(0.0f);
  x.push_back(12.0f); // past the approximation's clamp: exactly 1
  std::vector<float> y(x.size());
  cpu::tanh(x, y);
  for (std::size_t i = 0; i < x.size(); ++i) CHECK(std::abs(y[i] - std::tanh(double(x[i]))) <= 1e-6);
  CHECK(y.back() == 1.0f);
  const auto w = random_floats(rng, x.size());
  std::vector<float> dx(x.size());
  cpu::tanh_grad(y, w, dx);
  REQUIRE_CLOSE(dx, central_difference(x, [&] {
                  cpu::tanh(x, y);
                  return project(w, y);
                }),
                fd_tol, fd_tol);
}

TEST_CASE("sigmoid and its gradient from the output; a transpose of two dims and its inverse", "[cpu][kernels][dap]") {
  std::mt19937 rng(53);
  auto x = random_floats(rng, 37, -4.0f, 4.0f);
  std::vector<float> y(x.size());
  cpu::sigmoid(x, y);
  for (std::size_t i = 0; i < x.size(); ++i) CHECK(std::abs(y[i] - 1.0 / (1.0 + std::exp(-double(x[i])))) <= 1e-6);
  const auto w = random_floats(rng, x.size());
  std::vector<float> dx(x.size());
  cpu::sigmoid_grad(y, w, dx);
  REQUIRE_CLOSE(dx, central_difference(x, [&] {
                  cpu::sigmoid(x, y);
                  return project(w, y);
                }),
                fd_tol, fd_tol);
  // [3, 4, 2] -> [4, 3, 2] and back: out[c, r, :] = x[r, c, :].
  const std::size_t rows = 3, cols = 4, inner = 2;
  const auto z = random_floats(rng, rows * cols * inner);
  std::vector<float> t(z.size()), back(z.size());
  cpu::swap_dims(z, t, 1, rows, cols, inner);
  for (std::size_t r = 0; r < rows; ++r)
    for (std::size_t c = 0; c < cols; ++c)
      for (std::size_t e = 0; e < inner; ++e) CHECK(t[(c * rows + r) * inner + e] == z[(r * cols + c) * inner + e]);
  cpu::swap_dims(t, back, 1, cols, rows, inner);
  CHECK(back == z);
  // A pair inside: [2, 3, 4, 2] -> [2, 4, 3, 2] (transpose<1>; an image's patches gathered).
  const std::size_t outer = 2, block = rows * cols * inner;
  const auto u = random_floats(rng, outer * block);
  std::vector<float> ut(u.size()), uback(u.size());
  cpu::swap_dims(u, ut, outer, rows, cols, inner);
  for (std::size_t o = 0; o < outer; ++o)
    for (std::size_t r = 0; r < rows; ++r)
      for (std::size_t c = 0; c < cols; ++c)
        for (std::size_t e = 0; e < inner; ++e)
          CHECK(ut[o * block + (c * rows + r) * inner + e] == u[o * block + (r * cols + c) * inner + e]);
  cpu::swap_dims(ut, uback, outer, cols, rows, inner);
  CHECK(uback == u);
}
