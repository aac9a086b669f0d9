#pragma once
/// @file
/// @brief Max and average pooling over NHWC images and their gradients. The geometry is a
/// convolution's (ir::conv_geometry) whose kernel is the window (kernel_h = kernel_w) and whose
/// channels stay (in_channels = out_channels). Each output position walks the window's pixels
/// that lie inside the image, a channel row at a time, so the inner loops run over contiguous
/// channels. The maximum ignores the padding and sends its gradient to the first pixel (in
/// row-major window order) that holds the maximum; the average counts the padding as zeros and
/// divides by window² (a framework's count_include_pad).
///
/// @code
/// const ir::conv_geometry g{.batch = 8, .height = 16, .width = 16, .in_channels = 32, .out_channels = 32,
///                           .kernel_h = 3, .kernel_w = 3, .stride = 2, .padding = 1};
/// cpu::max_pool(x, y, g);
/// cpu::max_pool_grad(x, dy, dx, g);
/// @endcode

#include <concerto/ir/task_attrs.hpp>
#include <concerto/runtime/cpu/detail/check.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <span>

namespace concerto::runtime::cpu {

namespace detail {

// Calls visit(y_offset, x_offset) for every output position and every pixel of its window inside
// the image; each offset is the first channel's. first(y_offset) comes before a position's pixels.
template <class First, class Visit>
inline void for_each_window(const ir::conv_geometry& g, First first, Visit visit) {
  const auto c = static_cast<std::size_t>(g.in_channels);
  const auto oh = g.out_h(), ow = g.out_w();
  for (std::int64_t n = 0; n < g.batch; ++n)
    for (std::int64_t p = 0; p < oh; ++p)
      for (std::int64_t q = 0; q < ow; ++q) {
        const auto y_at = static_cast<std::size_t>((n * oh + p) * ow + q) * c;
        first(y_at);
        const auto top = p * g.stride - g.padding, left = q * g.stride - g.padding;
        for (auto i = std::max<std::int64_t>(top, 0); i < std::min(top + g.kernel_h, g.height); ++i)
          for (auto j = std::max<std::int64_t>(left, 0); j < std::min(left + g.kernel_w, g.width); ++j)
            visit(y_at, static_cast<std::size_t>((n * g.height + i) * g.width + j) * c);
      }
}

inline void check_pooling(std::span<const float> x, std::span<const float> y, const ir::conv_geometry& g, const char* kernel,
                          const char* x_name, const char* y_name) {
  CONCERTO_CHECK(g.in_channels == g.out_channels && g.kernel_h == g.kernel_w && g.out_h() >= 1 && g.out_w() >= 1 &&
                     2 * g.padding <= g.kernel_h,
                 std::string(kernel) + ": pools a square window that fits the image, padding at most half of it, over the "
                                       "channels it keeps");
  require_size(x, static_cast<std::size_t>(g.x_values()), kernel, x_name);
  require_size(y, static_cast<std::size_t>(g.y_values()), kernel, y_name);
}

} // namespace detail

/// @brief y[n, p, q, c] = the maximum of x over the window at (p, q), padding excluded.
inline void max_pool(std::span<const float> x, std::span<float> y, const ir::conv_geometry& g) {
  detail::check_pooling(x, y, g, "max_pool", "x", "y");
  const auto c = static_cast<std::size_t>(g.in_channels);
  detail::for_each_window(
      g, [&](std::size_t at) { std::fill_n(y.begin() + static_cast<std::ptrdiff_t>(at), c, -std::numeric_limits<float>::infinity()); },
      [&](std::size_t y_at, std::size_t x_at) {
        for (std::size_t k = 0; k < c; ++k) y[y_at + k] = std::max(y[y_at + k], x[x_at + k]);
      });
}

/// @brief dx = dy at the first maximum of each window (recomputed from x), summed where windows
/// overlap; zero elsewhere.
inline void max_pool_grad(std::span<const float> x, std::span<const float> dy, std::span<float> dx, const ir::conv_geometry& g) {
  detail::check_pooling(x, dy, g, "max_pool_grad", "x", "dy");
  detail::require_size(dx, x.size(), "max_pool_grad", "dx");
  std::fill(dx.begin(), dx.end(), 0.0f);
  const auto c = static_cast<std::size_t>(g.in_channels);
  const auto oh = g.out_h(), ow = g.out_w();
  for (std::int64_t n = 0; n < g.batch; ++n)
    for (std::int64_t p = 0; p < oh; ++p)
      for (std::int64_t q = 0; q < ow; ++q) {
        const auto y_at = static_cast<std::size_t>((n * oh + p) * ow + q) * c;
        const auto top = p * g.stride - g.padding, left = q * g.stride - g.padding;
        for (std::size_t k = 0; k < c; ++k) {
          float best = -std::numeric_limits<float>::infinity();
          std::size_t where = 0;
          for (auto i = std::max<std::int64_t>(top, 0); i < std::min(top + g.kernel_h, g.height); ++i)
            for (auto j = std::max<std::int64_t>(left, 0); j < std::min(left + g.kernel_w, g.width); ++j) {
              const auto at = static_cast<std::size_t>((n * g.height + i) * g.width + j) * c + k;
              if (x[at] > best) best = x[at], where = at;
            }
          dx[where] += dy[y_at + k];
        }
      }
}

/// @brief y[n, p, q, c] = the sum of x over the window at (p, q) divided by window².
inline void avg_pool(std::span<const float> x, std::span<float> y, const ir::conv_geometry& g) {
  detail::check_pooling(x, y, g, "avg_pool", "x", "y");
  const auto c = static_cast<std::size_t>(g.in_channels);
  const float scale = 1.0f / static_cast<float>(g.kernel_h * g.kernel_w);
  detail::for_each_window(
      g, [&](std::size_t at) { std::fill_n(y.begin() + static_cast<std::ptrdiff_t>(at), c, 0.0f); },
      [&](std::size_t y_at, std::size_t x_at) {
        for (std::size_t k = 0; k < c; ++k) y[y_at + k] += scale * x[x_at + k];
      });
}

/// @brief dx = dy / window² added to every pixel of each window it came from.
inline void avg_pool_grad(std::span<const float> dy, std::span<float> dx, const ir::conv_geometry& g) {
  detail::check_pooling(dx, dy, g, "avg_pool_grad", "dx", "dy");
  std::fill(dx.begin(), dx.end(), 0.0f);
  const auto c = static_cast<std::size_t>(g.in_channels);
  const float scale = 1.0f / static_cast<float>(g.kernel_h * g.kernel_w);
  detail::for_each_window(g, [](std::size_t) {}, [&](std::size_t y_at, std::size_t x_at) {
    for (std::size_t k = 0; k < c; ++k) dx[x_at + k] += scale * dy[y_at + k];
  });
}

} // namespace concerto::runtime::cpu
