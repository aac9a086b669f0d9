#pragma once
/// @file
/// @brief IEEE half-precision values (f16: 5 exponent bits, 10 mantissa bits, largest 65504),
/// stored as std::uint16_t: the fp16 working precision (ir/precision.hpp) keeps activations and
/// gradients in it and computes in f32, as with bf16 (core/bfloat16.hpp); safetensors files hold
/// them; the MPI backend sums them. Its narrow range is why fp16 training scales the loss
/// (train/loss_scaling.hpp).
///
/// @code
/// std::uint16_t h = to_f16(3.14159f);  // 3.140625: the nearest f16, ties to even
/// float x = from_f16(h);               // exact
/// to_f16(70000.0f);                    // infinity: past 65504 (65520 and up round away)
/// @endcode

#include <bit>
#include <cstddef>
#include <cstdint>
#include <span>

namespace concerto {

/// @brief f32 to f16, rounding to nearest even (subnormals included); NaN stays a quiet NaN and
/// a value that rounds past 65504 becomes infinity. constexpr, so that CUDA kernels call it too.
[[nodiscard]] constexpr std::uint16_t to_f16(float x) noexcept {
  const auto bits = std::bit_cast<std::uint32_t>(x);
  const auto sign = static_cast<std::uint16_t>((bits >> 16) & 0x8000u);
  const std::uint32_t a = bits & 0x7fffffffu;
  if (a > 0x7f800000u) return static_cast<std::uint16_t>(sign | 0x7e00u | ((a >> 13) & 0x3ffu));
  if (a >= 0x477ff000u) return static_cast<std::uint16_t>(sign | 0x7c00u); // 65520 and up: infinity
  if (a >= 0x38800000u) // normal in f16 (2^-14 and up): rebias the exponent, round the 13 dropped bits
    return static_cast<std::uint16_t>(sign | ((a - 0x38000000u + 0xfffu + ((a >> 13) & 1u)) >> 13));
  if (a <= 0x33000000u) return sign; // 2^-25 and below: zero (2^-25 itself ties to even, to zero)
  // Subnormal: the value in units of 2^-24, rounded to nearest even.
  const std::uint32_t mantissa = (a & 0x7fffffu) | 0x800000u;
  const std::uint32_t shift = 126u - (a >> 23); // 14..24
  std::uint32_t q = mantissa >> shift;
  const std::uint32_t rest = mantissa & ((1u << shift) - 1u), half = 1u << (shift - 1u);
  if (rest > half || (rest == half && (q & 1u) != 0)) ++q;
  return static_cast<std::uint16_t>(sign | q);
}

/// @brief f16 to f32, exactly (subnormals and infinities included); a NaN comes out quiet, as
/// the CPU's and GPU's own converters give it.
[[nodiscard]] constexpr float from_f16(std::uint16_t h) noexcept {
  const std::uint32_t sign = static_cast<std::uint32_t>(h & 0x8000u) << 16;
  const std::uint32_t exponent = (h >> 10) & 0x1fu, mantissa = h & 0x3ffu;
  if (exponent == 0x1f) return std::bit_cast<float>(sign | 0x7f800000u | (mantissa != 0 ? 0x400000u : 0u) | (mantissa << 13));
  if (exponent == 0) { // zero or subnormal: mantissa · 2^-24
    const float magnitude = static_cast<float>(mantissa) * 0x1p-24f;
    return sign != 0 ? -magnitude : magnitude;
  }
  return std::bit_cast<float>(sign | ((exponent + 112u) << 23) | (mantissa << 13));
}

/// @brief Widens `from` into `to` (same length).
inline void widen_f16(std::span<const std::uint16_t> from, std::span<float> to) noexcept {
  const std::size_t n = from.size();
  for (std::size_t i = 0; i < n; ++i) to[i] = from_f16(from[i]);
}
/// @brief Rounds `from` into `to` (same length), to nearest even.
inline void round_to_f16(std::span<const float> from, std::span<std::uint16_t> to) noexcept {
  const std::size_t n = from.size();
  for (std::size_t i = 0; i < n; ++i) to[i] = to_f16(from[i]);
}

} // namespace concerto
