#pragma once
/// @file
/// @brief The 16-bit float types of a working precision (ir::is_16bit_float: bf16, f16) to and
/// from f32, chosen by the buffer's ir::dtype: what the CPU dispatch stages for its kernels, the
/// named tensors read and write, and the MPI backend checks for non-finite values.
///
/// f16 spans convert with the CPU's own converters where it has them (x86's F16C: eight values an
/// instruction, checked once at run time, so a binary built for any x86-64 uses them): the
/// portable conversion of core/float16.hpp does not vectorise and doubled the compute of an fp16
/// step on CPU ranks. Both round to nearest even and give the same bits (tested on every f16
/// value and on random floats, NaNs included).

#include <concerto/core/bfloat16.hpp>
#include <concerto/core/float16.hpp>
#include <concerto/ir/graph.hpp>

#include <cstddef>
#include <cstdint>
#include <span>

#if defined(__x86_64__) && !defined(__CUDACC__)
#include <immintrin.h>
#define CONCERTO_F16C_CONVERSION 1
#endif

namespace concerto::runtime {

/// @brief One stored value of 16-bit float type `t`, exactly as f32.
[[nodiscard]] constexpr float widen_16bit(ir::dtype t, std::uint16_t v) noexcept {
  return t == ir::dtype::f16 ? from_f16(v) : from_bf16(v);
}
namespace detail {
#ifdef CONCERTO_F16C_CONVERSION
[[nodiscard]] inline bool has_f16c() noexcept {
  static const bool yes = __builtin_cpu_supports("f16c") && __builtin_cpu_supports("avx");
  return yes;
}
[[gnu::target("avx,f16c")]] inline void widen_f16_f16c(const std::uint16_t* from, float* to, std::size_t n) noexcept {
  std::size_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(to + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(from + i))));
  for (; i < n; ++i) to[i] = from_f16(from[i]);
}
[[gnu::target("avx,f16c")]] inline void round_to_f16_f16c(const float* from, std::uint16_t* to, std::size_t n) noexcept {
  std::size_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(to + i),
                     _mm256_cvtps_ph(_mm256_loadu_ps(from + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  for (; i < n; ++i) to[i] = to_f16(from[i]);
}
#endif
} // namespace detail

/// @brief Widens `from` (of 16-bit float type `t`) into `to` (same length).
inline void widen_16bit(ir::dtype t, std::span<const std::uint16_t> from, std::span<float> to) noexcept {
  if (t != ir::dtype::f16) return widen_bf16(from, to);
#ifdef CONCERTO_F16C_CONVERSION
  if (detail::has_f16c()) return detail::widen_f16_f16c(from.data(), to.data(), from.size());
#endif
  widen_f16(from, to);
}
/// @brief Rounds `from` into `to` (same length) of 16-bit float type `t`, to nearest even.
inline void round_to_16bit(ir::dtype t, std::span<const float> from, std::span<std::uint16_t> to) noexcept {
  if (t != ir::dtype::f16) return round_to_bf16(from, to);
#ifdef CONCERTO_F16C_CONVERSION
  if (detail::has_f16c()) return detail::round_to_f16_f16c(from.data(), to.data(), from.size());
#endif
  round_to_f16(from, to);
}

} // namespace concerto::runtime
