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

// Calls at(y_offset, window) for every output position: its first channel's offset in y and
// its window's pixels inside the image (rows [top, bottom), columns [left, right) of image n).
struct window_pixels {
  std::int64_t n, top, bottom, left, right;
};
template <class At>
inline void for_each_position(const ir::conv_geometry& g, At at) {
  const auto c = static_cast<std::size_t>(g.in_channels);
  const auto oh = g.out_h(), ow = g.out_w();
  for (std::int64_t n = 0; n < g.batch; ++n)
    for (std::int64_t p = 0; p < oh; ++p)
      for (std::int64_t q = 0; q < ow; ++q) {
        const auto top = p * g.stride - g.padding, left = q * g.stride - g.padding;
        at(static_cast<std::size_t>((n * oh + p) * ow + q) * c,
           window_pixels{n, std::max<std::int64_t>(top, 0), std::min(top + g.kernel_h, g.height), std::max<std::int64_t>(left, 0),
                         std::min(left + g.kernel_w, g.width)});
      }
}

// Calls visit(x_offset) for each pixel of a window (its first channel's offset in x).
template <class Visit>
inline void for_each_pixel(const ir::conv_geometry& g, const window_pixels& w, Visit visit) {
  for (auto i = w.top; i < w.bottom; ++i)
    for (auto j = w.left; j < w.right; ++j) visit(static_cast<std::size_t>((w.n * g.height + i) * g.width + j) * static_cast<std::size_t>(g.in_channels));
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
  detail::for_each_position(g, [&](std::size_t y_at, const detail::window_pixels& w) {
    std::fill_n(y.begin() + static_cast<std::ptrdiff_t>(y_at), c, -std::numeric_limits<float>::infinity());
    detail::for_each_pixel(g, w, [&](std::size_t x_at) {
      for (std::size_t k = 0; k < c; ++k) y[y_at + k] = std::max(y[y_at + k], x[x_at + k]);
    });
  });
}

/// @brief dx = dy at the first maximum of each window (recomputed from x), summed where windows
/// overlap; zero elsewhere.
inline void max_pool_grad(std::span<const float> x, std::span<const float> dy, std::span<float> dx, const ir::conv_geometry& g) {
  detail::check_pooling(x, dy, g, "max_pool_grad", "x", "dy");
  detail::require_size(dx, x.size(), "max_pool_grad", "dx");
  std::fill(dx.begin(), dx.end(), 0.0f);
  const auto c = static_cast<std::size_t>(g.in_channels);
  detail::for_each_position(g, [&](std::size_t y_at, const detail::window_pixels& w) {
    for (std::size_t k = 0; k < c; ++k) {
      float best = -std::numeric_limits<float>::infinity();
      std::size_t where = 0;
      detail::for_each_pixel(g, w, [&](std::size_t x_at) {
        if (x[x_at + k] > best) best = x[x_at + k], where = x_at + k;
      });
      dx[where] += dy[y_at + k];
    }
  });
}

/// @brief y[n, p, q, c] = the sum of x over the window at (p, q) divided by window².
inline void avg_pool(std::span<const float> x, std::span<float> y, const ir::conv_geometry& g) {
  detail::check_pooling(x, y, g, "avg_pool", "x", "y");
  const auto c = static_cast<std::size_t>(g.in_channels);
  const float scale = 1.0f / static_cast<float>(g.kernel_h * g.kernel_w);
  detail::for_each_position(g, [&](std::size_t y_at, const detail::window_pixels& w) {
    std::fill_n(y.begin() + static_cast<std::ptrdiff_t>(y_at), c, 0.0f);
    detail::for_each_pixel(g, w, [&](std::size_t x_at) {
      for (std::size_t k = 0; k < c; ++k) y[y_at + k] += scale * x[x_at + k];
    });
  });
}

/// @brief dx = dy / window² added to every pixel of each window it came from.
inline void avg_pool_grad(std::span<const float> dy, std::span<float> dx, const ir::conv_geometry& g) {
  detail::check_pooling(dx, dy, g, "avg_pool_grad", "dx", "dy");
  std::fill(dx.begin(), dx.end(), 0.0f);
  const auto c = static_cast<std::size_t>(g.in_channels);
  const float scale = 1.0f / static_cast<float>(g.kernel_h * g.kernel_w);
  detail::for_each_position(g, [&](std::size_t y_at, const detail::window_pixels& w) {
    detail::for_each_pixel(g, w, [&](std::size_t x_at) {
      for (std::size_t k = 0; k < c; ++k) dx[x_at + k] += scale * dy[y_at + k];
    });
  });
}

} // namespace concerto::runtime::cpu
