#pragma once
/// @file
/// @brief 2-D convolution over NHWC images (conv2d and its two gradients) as BLAS products over
/// patches. A chunk of output positions gathers its patches into a [rows, patch] block of the
/// workspace (im2col, patch = kernel_h·kernel_w·in in (i, j, c) order), and one product multiplies
/// it by the HWIO kernel, which is already the [patch, out] matrix. The input's gradient is
/// dy·wᵀ per chunk added back into the image at the pixels each patch came from (col2im); the
/// weight's sums patchesᵀ·dy over the chunks. A 1×1 kernel at stride 1 without padding reads the
/// image as its patches: one product, no workspace.
///
/// @code
/// const ir::conv_geometry g{.batch = 8, .height = 16, .width = 16, .in_channels = 32, .out_channels = 64,
///                           .kernel_h = 3, .kernel_w = 3, .stride = 1, .padding = 1};
/// std::vector<float> ws(cpu::conv2d_workspace_floats(g));
/// cpu::conv2d(x, w, y, g, ws);
/// @endcode

#include <concerto/ir/task_attrs.hpp>
#include <concerto/runtime/cpu/detail/check.hpp>
#include <concerto/runtime/cpu/matmul.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>

namespace concerto::runtime::cpu {

/// @brief Floats of patches one chunk gathers at most (1 MiB: the block stays in L2 while the
/// product streams the kernel's rows past it); a chunk holds at least one position.
inline constexpr std::size_t conv2d_block_floats = std::size_t{1} << 18;

/// @brief Output positions per chunk.
[[nodiscard]] inline std::size_t conv2d_chunk_rows(const ir::conv_geometry& g) {
  const auto patch = static_cast<std::size_t>(std::max<std::int64_t>(g.patch(), 1));
  const auto positions = static_cast<std::size_t>(std::max<std::int64_t>(g.positions(), 1));
  return std::clamp<std::size_t>(conv2d_block_floats / patch, 1, positions);
}

/// @brief Workspace floats each of the three kernels takes: one chunk's patches (none for a
/// pointwise kernel).
[[nodiscard]] inline std::size_t conv2d_workspace_floats(const ir::conv_geometry& g) {
  return g.pointwise() ? 0 : conv2d_chunk_rows(g) * static_cast<std::size_t>(g.patch());
}

namespace detail {

inline void require_conv(const ir::conv_geometry& g, std::span<const float> x, std::span<const float> w,
                         std::span<const float> y, std::span<const float> workspace, const char* kernel,
                         const char* x_name, const char* w_name, const char* y_name) {
  CONCERTO_CHECK(g.batch >= 0 && g.height >= 1 && g.width >= 1 && g.in_channels >= 1 && g.out_channels >= 1 &&
                     g.kernel_h >= 1 && g.kernel_w >= 1 && g.stride >= 1 && g.padding >= 0 && g.out_h() >= 1 &&
                     g.out_w() >= 1,
                 std::string(kernel) + ": a kernel of " + std::to_string(g.kernel_h) + "x" + std::to_string(g.kernel_w) +
                     " at stride " + std::to_string(g.stride) + " with padding " + std::to_string(g.padding) +
                     " does not fit an image of " + std::to_string(g.height) + "x" + std::to_string(g.width));
  require_size(x, static_cast<std::size_t>(g.x_values()), kernel, x_name);
  require_size(w, static_cast<std::size_t>(g.w_values()), kernel, w_name);
  require_size(y, static_cast<std::size_t>(g.y_values()), kernel, y_name);
  CONCERTO_CHECK(workspace.size() >= conv2d_workspace_floats(g),
                 std::string(kernel) + ": the workspace holds " + std::to_string(workspace.size()) + " floats, it needs " +
                     std::to_string(conv2d_workspace_floats(g)) + " (cpu::conv2d_workspace_floats)");
}

// Visits the kernel's rows of output positions [first, first + rows): f(row, offset, pixel,
// values) for each run of taps the patch and the image both hold contiguously -- the
// kernel_w·in values of kernel row i where the whole row lies inside the image (adjacent
// pixels of an image row, NHWC, and adjacent taps of a patch row, (i, j, c)), else one tap of
// `in` values at a time; offset is the run's place in the patch, pixel its place in x, or -1
// outside the image (the padding).
template <class F>
inline void each_run(const ir::conv_geometry& g, std::size_t first, std::size_t rows, F&& f) {
  const auto out_w = g.out_w(), out_h = g.out_h();
  const auto tap_values = static_cast<std::size_t>(g.in_channels);
  // The first position's coordinates by division, the others by counting (a division per
  // position costs as much as a stem's copies).
  const auto start = static_cast<std::int64_t>(first);
  std::int64_t ow = start % out_w, oh = (start / out_w) % out_h, n = start / (out_w * out_h);
  for (std::size_t r = 0; r < rows; ++r, ++ow) {
    if (ow == out_w) {
      ow = 0;
      if (++oh == out_h) {
        oh = 0;
        ++n;
      }
    }
    const auto w0 = ow * g.stride - g.padding;
    const bool row_inside = w0 >= 0 && w0 + g.kernel_w <= g.width;
    for (std::int64_t i = 0; i < g.kernel_h; ++i) {
      const auto h = oh * g.stride - g.padding + i;
      const auto offset = static_cast<std::size_t>(i * g.kernel_w * g.in_channels);
      const auto pixel = [&](std::int64_t w) { return ((n * g.height + h) * g.width + w) * g.in_channels; };
      if (h < 0 || h >= g.height) {
        f(r, offset, std::int64_t{-1}, tap_values * static_cast<std::size_t>(g.kernel_w));
      } else if (row_inside) {
        f(r, offset, pixel(w0), tap_values * static_cast<std::size_t>(g.kernel_w));
      } else {
        for (std::int64_t j = 0; j < g.kernel_w; ++j) {
          const auto w = w0 + j;
          f(r, offset + static_cast<std::size_t>(j) * tap_values, w >= 0 && w < g.width ? pixel(w) : std::int64_t{-1},
            tap_values);
        }
      }
    }
  }
}

// `values` floats from src to dst (not overlapping) in blocks of 8 of a fixed size, the last one
// overlapping the one before, which the compiler turns into vector moves: a kernel row of a
// three-channel image is 9 floats, and a call to memcpy per row costs more than the copy.
inline void copy_run(const float* src, float* dst, std::size_t values) {
  constexpr std::size_t block = 8;
  if (values < block) {
    for (std::size_t c = 0; c < values; ++c) dst[c] = src[c];
    return;
  }
  for (std::size_t c = 0; c + block < values; c += block) std::memcpy(dst + c, src + c, block * sizeof(float));
  std::memcpy(dst + values - block, src + values - block, block * sizeof(float));
}

// The patches of positions [first, first + rows) into cols [rows, patch].
inline void gather_patches(const float* x, float* cols, const ir::conv_geometry& g, std::size_t first, std::size_t rows) {
  const auto patch = static_cast<std::size_t>(g.patch());
  each_run(g, first, rows, [&](std::size_t r, std::size_t offset, std::int64_t pixel, std::size_t values) {
    float* dst = cols + r * patch + offset;
    if (pixel < 0) std::fill(dst, dst + values, 0.0f);
    else copy_run(x + pixel, dst, values);
  });
}

// cols [rows, patch] added into dx at the pixels its patches came from.
inline void scatter_patches(const float* cols, float* dx, const ir::conv_geometry& g, std::size_t first, std::size_t rows) {
  const auto patch = static_cast<std::size_t>(g.patch());
  each_run(g, first, rows, [&](std::size_t r, std::size_t offset, std::int64_t pixel, std::size_t values) {
    if (pixel < 0) return;
    const float* src = cols + r * patch + offset;
    float* dst = dx + pixel;
    for (std::size_t c = 0; c < values; ++c) dst[c] += src[c];
  });
}

} // namespace detail

/// @brief y [batch, out_h, out_w, out] = the convolution of x [batch, height, width, in] by w
/// [kernel_h, kernel_w, in, out]: per chunk of positions, its patches times w.
inline void conv2d(std::span<const float> x, std::span<const float> w, std::span<float> y, const ir::conv_geometry& g,
                   std::span<float> workspace) {
  detail::require_conv(g, x, w, y, workspace, "conv2d", "x", "w", "y");
  const auto positions = static_cast<std::size_t>(g.positions()), out = static_cast<std::size_t>(g.out_channels);
  const auto patch = static_cast<std::size_t>(g.patch());
  if (g.pointwise()) {
    detail::gemm(false, false, positions, out, patch, 1.0f, x.data(), patch, w.data(), out, 0.0f, y.data(), out);
    return;
  }
  const auto chunk = conv2d_chunk_rows(g);
  for (std::size_t first = 0; first < positions; first += chunk) {
    const auto rows = std::min(chunk, positions - first);
    detail::gather_patches(x.data(), workspace.data(), g, first, rows);
    detail::gemm(false, false, rows, out, patch, 1.0f, workspace.data(), patch, w.data(), out, 0.0f,
                 y.data() + first * out, out);
  }
}

/// @brief dx = the gradient of conv2d's image: per chunk, dy·wᵀ added back at its patches' pixels.
inline void conv2d_grad_input(std::span<const float> dy, std::span<const float> w, std::span<float> dx,
                              const ir::conv_geometry& g, std::span<float> workspace) {
  detail::require_conv(g, dx, w, dy, workspace, "conv2d_grad_input", "dx", "w", "dy");
  const auto positions = static_cast<std::size_t>(g.positions()), out = static_cast<std::size_t>(g.out_channels);
  const auto patch = static_cast<std::size_t>(g.patch());
  if (g.pointwise()) {
    detail::gemm(false, true, positions, patch, out, 1.0f, dy.data(), out, w.data(), out, 0.0f, dx.data(), patch);
    return;
  }
  std::fill(dx.begin(), dx.end(), 0.0f);
  const auto chunk = conv2d_chunk_rows(g);
  for (std::size_t first = 0; first < positions; first += chunk) {
    const auto rows = std::min(chunk, positions - first);
    detail::gemm(false, true, rows, patch, out, 1.0f, dy.data() + first * out, out, w.data(), out, 0.0f,
                 workspace.data(), patch);
    detail::scatter_patches(workspace.data(), dx.data(), g, first, rows);
  }
}

/// @brief dw = the gradient of conv2d's kernel: Σ over chunks of patchesᵀ·dy (added to dw when `accumulate`).
inline void conv2d_grad_weight(std::span<const float> x, std::span<const float> dy, std::span<float> dw,
                               const ir::conv_geometry& g, bool accumulate, std::span<float> workspace) {
  detail::require_conv(g, x, dw, dy, workspace, "conv2d_grad_weight", "x", "dw", "dy");
  const auto positions = static_cast<std::size_t>(g.positions()), out = static_cast<std::size_t>(g.out_channels);
  const auto patch = static_cast<std::size_t>(g.patch());
  if (!accumulate) std::fill(dw.begin(), dw.end(), 0.0f);
  if (g.pointwise()) {
    detail::gemm(true, false, patch, out, positions, 1.0f, x.data(), patch, dy.data(), out, 1.0f, dw.data(), out);
    return;
  }
  const auto chunk = conv2d_chunk_rows(g);
  for (std::size_t first = 0; first < positions; first += chunk) {
    const auto rows = std::min(chunk, positions - first);
    detail::gather_patches(x.data(), workspace.data(), g, first, rows);
    detail::gemm(true, false, patch, out, rows, 1.0f, workspace.data(), patch, dy.data() + first * out, out, 1.0f,
                 dw.data(), out);
  }
}

} // namespace concerto::runtime::cpu
