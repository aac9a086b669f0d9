#pragma once
/// @file
/// @brief bfloat16 values: the top half of an f32 (same exponent, 8 bits of mantissa), stored as
/// std::uint16_t. Kernels of a bf16 working precision widen to f32, compute, and round back
/// (runtime/dispatch.hpp); safetensors files hold them; the MPI backend sums them.
///
/// @code
/// std::uint16_t h = to_bf16(3.14159f);  // 3.140625: the nearest bf16, ties to even
/// float x = from_bf16(h);               // exact
/// @endcode

#include <bit>
#include <cstddef>
#include <cstdint>
#include <span>

namespace concerto {

/// @brief f32 to bf16, rounding to nearest even; NaN stays a (quiet) NaN, and a value past bf16's
/// largest rounds to infinity. constexpr, so that CUDA kernels call it too (--expt-relaxed-constexpr).
[[nodiscard]] constexpr std::uint16_t to_bf16(float x) noexcept {
  const auto bits = std::bit_cast<std::uint32_t>(x);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<std::uint16_t>((bits >> 16) | 0x0040u);
  return static_cast<std::uint16_t>((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}
/// @brief bf16 to f32, exactly.
[[nodiscard]] constexpr float from_bf16(std::uint16_t b) noexcept { return std::bit_cast<float>(static_cast<std::uint32_t>(b) << 16); }

/// @brief Widens `from` into `to` (same length).
inline void widen_bf16(std::span<const std::uint16_t> from, std::span<float> to) noexcept {
  const std::size_t n = from.size();
  const std::uint16_t* __restrict src = from.data();
  float* __restrict dst = to.data();
  for (std::size_t i = 0; i < n; ++i) dst[i] = std::bit_cast<float>(static_cast<std::uint32_t>(src[i]) << 16);
}
/// @brief Rounds `from` into `to` (same length), to nearest even.
inline void round_to_bf16(std::span<const float> from, std::span<std::uint16_t> to) noexcept {
  const std::size_t n = from.size();
  const float* __restrict src = from.data();
  std::uint16_t* __restrict dst = to.data();
  for (std::size_t i = 0; i < n; ++i) dst[i] = to_bf16(src[i]);
}

} // namespace concerto
