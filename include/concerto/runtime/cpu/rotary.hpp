#pragma once
/// @file
/// @brief Rotary position embedding (RoPE) on the CPU, forward and backward.
///
/// x is a row-major `[rows, heads·head_dim]` block (a row is a token), positions holds one
/// position per row. Within every head, lane i and lane i + head_dim/2 form a pair rotated by
/// the angle `position·theta^(-2i/head_dim)` (the "rotate half" layout of GPT-NeoX and Llama's
/// reference code, so that the halves are contiguous). The backward is the rotation by the
/// opposite angle: a rotation's transpose is its inverse.

#include <concerto/runtime/cpu/detail/check.hpp>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>

namespace concerto::runtime::cpu {

namespace detail {
// One pass for both directions: direction +1 rotates (forward), -1 rotates back (gradient).
inline void rotate_pairs(std::span<const float> x, std::span<const std::int32_t> positions, std::span<float> out,
                         std::size_t rows, std::size_t width, std::size_t head_dim, double theta, double direction,
                         const char* what) {
  require_size(x, rows * width, what, "x");
  require_size(positions, rows, what, "positions");
  require_size(out, rows * width, what, "out");
  CONCERTO_CHECK(head_dim > 0 && head_dim % 2 == 0, std::string(what) + ": head_dim must be even and positive, got " +
                                                        std::to_string(head_dim));
  CONCERTO_CHECK(width % head_dim == 0, std::string(what) + ": the row width " + std::to_string(width) +
                                            " is not a multiple of head_dim " + std::to_string(head_dim));
  const std::size_t half = head_dim / 2, heads = width / head_dim;
  for (std::size_t r = 0; r < rows; ++r) {
    const double p = static_cast<double>(positions[r]);
    const float* px = x.data() + r * width;
    float* po = out.data() + r * width;
    for (std::size_t i = 0; i < half; ++i) {
      // The angle in double: positions reach thousands, and float would lose the low bits.
      const double angle = p * std::pow(theta, -2.0 * static_cast<double>(i) / static_cast<double>(head_dim));
      const float c = static_cast<float>(std::cos(angle)), s = static_cast<float>(direction * std::sin(angle));
      for (std::size_t h = 0; h < heads; ++h) {
        const float a = px[h * head_dim + i], b = px[h * head_dim + i + half];
        po[h * head_dim + i] = a * c - b * s;
        po[h * head_dim + i + half] = b * c + a * s;
      }
    }
  }
}
} // namespace detail

/// @brief RoPE: every head's lane pairs rotated by their position's angles. out may alias x.
/// @code
/// cpu::rope(q, positions, q, tokens, heads * head_dim, head_dim, 10000.0);
/// @endcode
inline void rope(std::span<const float> x, std::span<const std::int32_t> positions, std::span<float> out,
                 std::size_t rows, std::size_t width, std::size_t head_dim, double theta = 10000.0) {
  detail::rotate_pairs(x, positions, out, rows, width, head_dim, theta, 1.0, "rope");
}

/// @brief Backward of `rope`: dout rotated back by the same angles. dx may alias dout.
inline void rope_grad(std::span<const float> dout, std::span<const std::int32_t> positions, std::span<float> dx,
                      std::size_t rows, std::size_t width, std::size_t head_dim, double theta = 10000.0) {
  detail::rotate_pairs(dout, positions, dx, rows, width, head_dim, theta, -1.0, "rope_grad");
}

} // namespace concerto::runtime::cpu
