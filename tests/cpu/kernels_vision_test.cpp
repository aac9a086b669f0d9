// CPU kernels of vision models -- conv2d over NHWC images and its two gradients, max and
// average pooling, the sum and mean over a dim, batch normalisation -- against
// double-precision loops written here (strides, padding, 1×1 kernels read in place, shapes that
// split into several chunks of patches), the gradients also against central differences of the
// float forward kernel (tolerances as in kernels_test.cpp: h = 1e-2, rtol = atol = 2e-3).

#include "kernels_testing.hpp"

#include <concerto/runtime/cpu/kernels.hpp>

#include <catch2/catch_test_macros.hpp>
#include <catch2/generators/catch_generators.hpp>
#include <catch2/matchers/catch_matchers_string.hpp>

#include <cmath>
#include <algorithm>
#include <cstdint>
#include <limits>
#include <tuple>
#include <vector>

namespace cpu = concerto::runtime::cpu;
namespace ir = concerto::ir;
using namespace kernels_testing;
using Catch::Matchers::ContainsSubstring;

namespace {

constexpr double fd_tol = 2e-3;

// Calls f(x index, w index, y index) for every product term of the convolution.
template <class F>
void each_term(const ir::conv_geometry& g, F&& f) {
  for (std::int64_t n = 0; n < g.batch; ++n)
    for (std::int64_t oh = 0; oh < g.out_h(); ++oh)
      for (std::int64_t ow = 0; ow < g.out_w(); ++ow)
        for (std::int64_t i = 0; i < g.kernel_h; ++i)
          for (std::int64_t j = 0; j < g.kernel_w; ++j) {
            const auto h = oh * g.stride - g.padding + i, w = ow * g.stride - g.padding + j;
            if (h < 0 || h >= g.height || w < 0 || w >= g.width) continue;
            for (std::int64_t c = 0; c < g.in_channels; ++c)
              for (std::int64_t o = 0; o < g.out_channels; ++o)
                f(static_cast<std::size_t>(((n * g.height + h) * g.width + w) * g.in_channels + c),
                  static_cast<std::size_t>(((i * g.kernel_w + j) * g.in_channels + c) * g.out_channels + o),
                  static_cast<std::size_t>(((n * g.out_h() + oh) * g.out_w() + ow) * g.out_channels + o));
          }
}

struct reference {
  std::vector<double> y, dx, dw;
};
reference in_double(const ir::conv_geometry& g, const std::vector<float>& x, const std::vector<float>& w,
                    const std::vector<float>& dy) {
  reference r{std::vector<double>(static_cast<std::size_t>(g.y_values())),
              std::vector<double>(static_cast<std::size_t>(g.x_values())),
              std::vector<double>(static_cast<std::size_t>(g.w_values()))};
  each_term(g, [&](std::size_t xi, std::size_t wi, std::size_t yi) {
    r.y[yi] += double(x[xi]) * w[wi];
    r.dx[xi] += double(dy[yi]) * w[wi];
    r.dw[wi] += double(x[xi]) * dy[yi];
  });
  return r;
}

} // namespace

TEST_CASE("conv2d and its gradients match double loops; the gradients are the finite differences",
          "[cpu][kernels][conv2d]") {
  // batch, height, width, in, out, kernel_h, kernel_w, stride, padding
  const auto g = GENERATE(ir::conv_geometry{1, 5, 5, 1, 1, 3, 3, 1, 1},  // one channel, same size
                          ir::conv_geometry{2, 7, 6, 3, 4, 3, 3, 2, 1},  // stride 2, odd width
                          ir::conv_geometry{2, 4, 4, 5, 3, 1, 1, 1, 0},  // pointwise: the image read in place
                          ir::conv_geometry{3, 5, 5, 2, 2, 1, 1, 2, 0},  // 1×1 at stride 2: gathered
                          ir::conv_geometry{1, 6, 5, 2, 3, 3, 2, 2, 0},  // rectangular kernel, no padding
                          ir::conv_geometry{1, 9, 8, 2, 3, 5, 5, 1, 2}); // 5×5, padding 2
  CAPTURE(g.batch, g.height, g.width, g.in_channels, g.out_channels, g.kernel_h, g.kernel_w, g.stride, g.padding);
  std::mt19937 rng(static_cast<unsigned>(g.x_values() * 7 + g.w_values()));
  auto x = random_floats(rng, static_cast<std::size_t>(g.x_values()));
  auto w = random_floats(rng, static_cast<std::size_t>(g.w_values()));
  const auto dy = random_floats(rng, static_cast<std::size_t>(g.y_values()));
  std::vector<float> ws(cpu::conv2d_workspace_floats(g)), y(dy.size()), dx(x.size()), dw(w.size());
  CHECK(ws.empty() == g.pointwise());
  cpu::conv2d(x, w, y, g, ws);
  cpu::conv2d_grad_input(dy, w, dx, g, ws);
  cpu::conv2d_grad_weight(x, dy, dw, g, false, ws);
  const auto want = in_double(g, x, w, dy);
  REQUIRE_CLOSE(y, want.y, 1e-5, 1e-6);
  REQUIRE_CLOSE(dx, want.dx, 1e-5, 1e-6);
  REQUIRE_CLOSE(dw, want.dw, 1e-5, 1e-6);
  REQUIRE(max_abs(dw) > 1e-2);

  // Accumulating adds this batch's gradient to what dw held.
  auto twice = dw;
  cpu::conv2d_grad_weight(x, dy, twice, g, true, ws);
  std::vector<double> doubled(want.dw.size());
  for (std::size_t i = 0; i < doubled.size(); ++i) doubled[i] = 2 * want.dw[i];
  REQUIRE_CLOSE(twice, doubled, 1e-5, 1e-6);

  std::vector<float> scratch_y(y.size());
  const auto loss = [&] {
    cpu::conv2d(x, w, scratch_y, g, ws);
    return project(dy, scratch_y);
  };
  REQUIRE_CLOSE(dx, central_difference(x, loss), fd_tol, fd_tol);
  REQUIRE_CLOSE(dw, central_difference(w, loss), fd_tol, fd_tol);
}

TEST_CASE("a convolution whose patches exceed one block runs in chunks with the same result", "[cpu][kernels][conv2d]") {
  // patch = 5·5·128 = 3200 floats: a block holds 81 of the 2·10·10 = 200 positions, so 3 chunks.
  const ir::conv_geometry g{2, 10, 10, 128, 4, 5, 5, 1, 2};
  REQUIRE(cpu::conv2d_chunk_rows(g) < static_cast<std::size_t>(g.positions()) / 2);
  std::mt19937 rng(11);
  const auto x = random_floats(rng, static_cast<std::size_t>(g.x_values()));
  const auto w = random_floats(rng, static_cast<std::size_t>(g.w_values()));
  const auto dy = random_floats(rng, static_cast<std::size_t>(g.y_values()));
  std::vector<float> ws(cpu::conv2d_workspace_floats(g)), y(dy.size()), dx(x.size()), dw(w.size());
  cpu::conv2d(x, w, y, g, ws);
  cpu::conv2d_grad_input(dy, w, dx, g, ws);
  cpu::conv2d_grad_weight(x, dy, dw, g, false, ws);
  const auto want = in_double(g, x, w, dy);
  REQUIRE_CLOSE(y, want.y, 1e-4, 1e-5);
  REQUIRE_CLOSE(dx, want.dx, 1e-4, 1e-5);
  REQUIRE_CLOSE(dw, want.dw, 1e-4, 1e-5);
}

TEST_CASE("conv2d refuses a kernel larger than the padded image and a short workspace", "[cpu][kernels][conv2d]") {
  const ir::conv_geometry g{1, 2, 2, 1, 1, 3, 3, 1, 0};
  std::vector<float> x(4), w(9), y(1), ws(9);
  REQUIRE_THROWS_WITH(cpu::conv2d(x, w, y, g, ws), ContainsSubstring("does not fit an image of 2x2"));
  const ir::conv_geometry ok{1, 4, 4, 1, 1, 3, 3, 1, 1};
  std::vector<float> x4(16), y4(16), short_ws(3);
  REQUIRE_THROWS_WITH(cpu::conv2d(x4, w, y4, ok, short_ws), ContainsSubstring("cpu::conv2d_workspace_floats"));
}

TEST_CASE("max and average pooling match double loops; their gradients are the finite differences",
          "[cpu][kernels][pooling]") {
  // batch, height, width, channels (in = out), window (kernel_h = kernel_w), stride, padding
  const auto g = GENERATE(ir::conv_geometry{2, 6, 6, 3, 3, 2, 2, 2, 0},  // 2×2 windows side by side
                          ir::conv_geometry{1, 7, 5, 4, 4, 3, 3, 2, 1},  // a ResNet stem's: overlapping, padded
                          ir::conv_geometry{2, 5, 5, 2, 2, 3, 3, 1, 1},  // stride 1: every pixel in 9 windows
                          ir::conv_geometry{1, 4, 7, 3, 3, 3, 3, 3, 0}); // windows that leave a column out
  CAPTURE(g.batch, g.height, g.width, g.in_channels, g.kernel_h, g.stride, g.padding);
  // Distinct values 0.05 apart: a difference step of 0.01 never changes which one is a window's maximum.
  std::mt19937 rng(static_cast<unsigned>(g.x_values()));
  std::vector<float> x(static_cast<std::size_t>(g.x_values()));
  for (std::size_t i = 0; i < x.size(); ++i) x[i] = 0.05f * static_cast<float>(i) - 1.0f;
  std::shuffle(x.begin(), x.end(), rng);
  const auto dy = random_floats(rng, static_cast<std::size_t>(g.y_values()));
  std::vector<double> max_y(dy.size(), -std::numeric_limits<double>::infinity()), avg_y(dy.size()), max_dx(x.size()),
      avg_dx(x.size());
  const auto c = g.in_channels;
  for (std::int64_t n = 0; n < g.batch; ++n)
    for (std::int64_t p = 0; p < g.out_h(); ++p)
      for (std::int64_t q = 0; q < g.out_w(); ++q)
        for (std::int64_t k = 0; k < c; ++k) {
          const auto yi = static_cast<std::size_t>(((n * g.out_h() + p) * g.out_w() + q) * c + k);
          std::size_t arg = 0;
          for (std::int64_t i = 0; i < g.kernel_h; ++i)
            for (std::int64_t j = 0; j < g.kernel_w; ++j) {
              const auto h = p * g.stride - g.padding + i, w = q * g.stride - g.padding + j;
              if (h < 0 || h >= g.height || w < 0 || w >= g.width) continue;
              const auto xi = static_cast<std::size_t>(((n * g.height + h) * g.width + w) * c + k);
              if (x[xi] > max_y[yi]) max_y[yi] = x[xi], arg = xi;
              avg_y[yi] += double(x[xi]) / double(g.kernel_h * g.kernel_w);
              avg_dx[xi] += double(dy[yi]) / double(g.kernel_h * g.kernel_w);
            }
          max_dx[arg] += dy[yi];
        }
  std::vector<float> y(dy.size()), dx(x.size());
  cpu::max_pool(x, y, g);
  REQUIRE_CLOSE(y, max_y, 1e-7, 1e-9); // the maximum is one of the values: exact
  cpu::max_pool_grad(x, dy, dx, g);
  REQUIRE_CLOSE(dx, max_dx, 1e-6, 1e-7);
  std::vector<float> scratch(y.size());
  REQUIRE_CLOSE(dx, central_difference(x, [&] {
                  cpu::max_pool(x, scratch, g);
                  return project(dy, scratch);
                }),
                fd_tol, fd_tol);
  cpu::avg_pool(x, y, g);
  REQUIRE_CLOSE(y, avg_y, 1e-6, 1e-7);
  cpu::avg_pool_grad(dy, dx, g);
  REQUIRE_CLOSE(dx, avg_dx, 1e-6, 1e-7);
  REQUIRE_CLOSE(dx, central_difference(x, [&] {
                  cpu::avg_pool(x, scratch, g);
                  return project(dy, scratch);
                }),
                fd_tol, fd_tol);
}

TEST_CASE("pooling refuses a window larger than the padded image and padding beyond half the window",
          "[cpu][kernels][pooling]") {
  std::vector<float> x(4), y(1);
  REQUIRE_THROWS_WITH(cpu::max_pool(x, y, ir::conv_geometry{1, 2, 2, 1, 1, 3, 3, 1, 0}), ContainsSubstring("max_pool: pools"));
  std::vector<float> x9(9), y9(9);
  REQUIRE_THROWS_WITH(cpu::avg_pool(x9, y9, ir::conv_geometry{1, 3, 3, 1, 1, 2, 2, 1, 2}), ContainsSubstring("padding at most half"));
  std::vector<float> short_y(3);
  REQUIRE_THROWS_WITH(cpu::max_pool(x9, short_y, ir::conv_geometry{1, 3, 3, 1, 1, 1, 1, 1, 0}),
                      ContainsSubstring("max_pool: `y` holds 3 elements"));
}

TEST_CASE("the sum and the mean over one dim match double loops; their gradient repeats dout", "[cpu][kernels][sum_dim]") {
  const std::size_t outer = 3, extent = 5, inner = 4;
  const float scale = GENERATE(1.0f, 1.0f / 10.0f); // a sum; a mean over a dim of 10 split in two
  std::mt19937 rng(5);
  auto x = random_floats(rng, outer * extent * inner);
  const auto w = random_floats(rng, outer * inner);
  std::vector<float> out(outer * inner), dx(x.size());
  cpu::sum_dim(x, out, outer, extent, inner, scale);
  std::vector<double> want(out.size());
  for (std::size_t o = 0; o < outer; ++o)
    for (std::size_t e = 0; e < extent; ++e)
      for (std::size_t i = 0; i < inner; ++i) want[o * inner + i] += double(scale) * x[(o * extent + e) * inner + i];
  REQUIRE_CLOSE(out, want, 1e-6, 1e-7);
  cpu::sum_dim_grad(w, dx, outer, extent, inner, scale);
  std::vector<float> y(out.size());
  REQUIRE_CLOSE(dx, central_difference(x, [&] {
                  cpu::sum_dim(x, y, outer, extent, inner, scale);
                  return project(w, y);
                }),
                fd_tol, fd_tol);
  REQUIRE_THROWS_WITH(cpu::sum_dim(x, std::span<float>(out).first(3), outer, extent, inner, scale),
                      ContainsSubstring("sum_dim: `out` holds 3 elements"));
}

TEST_CASE("batch normalisation's kernels match double loops; dx, dgamma and dbeta are the finite differences",
          "[cpu][kernels][batchnorm]") {
  const auto [rows, cols] = GENERATE(std::tuple{6u, 1u}, std::tuple{8u, 5u}, std::tuple{40u, 300u}); // 300: two blocks of channels
  CAPTURE(rows, cols);
  std::mt19937 rng(rows * 13 + cols);
  auto x = random_floats(rng, rows * cols, -1.0f, 3.0f); // a mean away from 0
  auto gamma = random_floats(rng, cols, 0.5f, 1.5f), beta = random_floats(rng, cols);
  const auto w = random_floats(rng, rows * cols);
  const float eps = 1e-5f;
  std::vector<float> sums(2 * cols), scale(3 * cols), y(rows * cols);
  const auto forward = [&](std::span<float> out) {
    cpu::batchnorm_stats(x, sums, rows, cols);
    cpu::batchnorm_scale(sums, gamma, scale, cols, rows, eps);
    cpu::batchnorm(x, scale, beta, out, rows, cols);
  };
  forward(y);
  std::vector<double> want(rows * cols);
  for (std::size_t c = 0; c < cols; ++c) {
    double mean = 0, var = 0;
    for (std::size_t r = 0; r < rows; ++r) mean += x[r * cols + c];
    mean /= rows;
    for (std::size_t r = 0; r < rows; ++r) var += (x[r * cols + c] - mean) * (x[r * cols + c] - mean);
    var /= rows;
    for (std::size_t r = 0; r < rows; ++r) want[r * cols + c] = (x[r * cols + c] - mean) / std::sqrt(var + eps) * gamma[c] + beta[c];
  }
  REQUIRE_CLOSE(y, want, 1e-4, 1e-5);

  // The running statistics move towards the batch's mean and unbiased variance by the momentum;
  // evaluation's scale from them normalises by them.
  std::vector<float> running(2 * cols), from_running(3 * cols);
  for (std::size_t c = 0; c < cols; ++c) running[c] = 0.5f, running[cols + c] = 2.0f;
  cpu::batchnorm_track(sums, running, cols, rows, 0.25f);
  std::vector<double> want_running(2 * cols), want_scale(3 * cols);
  for (std::size_t c = 0; c < cols; ++c) {
    double mean = 0, var = 0;
    for (std::size_t r = 0; r < rows; ++r) mean += x[r * cols + c];
    mean /= rows;
    for (std::size_t r = 0; r < rows; ++r) var += (x[r * cols + c] - mean) * (x[r * cols + c] - mean);
    var /= rows - 1;
    want_running[c] = 0.75 * 0.5 + 0.25 * mean;
    want_running[cols + c] = 0.75 * 2.0 + 0.25 * var;
    const double rstd = 1.0 / std::sqrt(want_running[cols + c] + eps);
    want_scale[c] = want_running[c];
    want_scale[cols + c] = rstd;
    want_scale[2 * cols + c] = rstd * gamma[c];
  }
  REQUIRE_CLOSE(running, want_running, 1e-4, 1e-5);
  cpu::batchnorm_scale_running(running, gamma, from_running, cols, eps);
  REQUIRE_CLOSE(from_running, want_scale, 1e-5, 1e-6);

  std::vector<float> grad_sums(2 * cols), dx(rows * cols);
  cpu::batchnorm_grad_stats(x, scale, w, grad_sums, rows, cols);
  cpu::batchnorm_grad(x, scale, grad_sums, w, dx, rows, cols, rows);
  const std::span<const float> dbeta(grad_sums.data(), cols), dgamma(grad_sums.data() + cols, cols);
  std::vector<float> probe(rows * cols);
  const auto loss = [&] {
    forward(probe);
    return project(w, probe);
  };
  if (cols > 300 / 2) { // large: a few entries of each
    for (const std::size_t i : {std::size_t{0}, std::size_t{rows * cols / 2 + 7}, std::size_t{rows * cols - 1}}) {
      const double fd = central_difference_at(x, i, loss);
      CHECK(std::abs(dx[i] - fd) <= fd_tol * (1 + std::abs(fd)));
    }
  } else {
    REQUIRE_CLOSE(dx, central_difference(x, loss), fd_tol, fd_tol);
    REQUIRE_CLOSE(dgamma, central_difference(gamma, loss), fd_tol, fd_tol);
    REQUIRE_CLOSE(dbeta, central_difference(beta, loss), fd_tol, fd_tol);
  }
}
