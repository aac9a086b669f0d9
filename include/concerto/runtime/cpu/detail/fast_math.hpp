#pragma once
/// @file
/// @brief exp and tanh for the CPU kernels' inner loops, written so that the compiler
/// vectorises them: libm's expf/tanhf are opaque calls, which keep a GELU over a 64 × 4096
/// activation at ~9 ns per element (measured: 2.3 ms, a fifth of the MLP's forward), while
/// these run as a handful of SIMD multiply-adds per element.
///
/// Accuracy (checked against double precision by tests/unit/fast_math_test.cpp): exp within
/// 3e-7 relative on [-80, 87] (inputs beyond ±87 are clamped there, so e^-1000 and e^-inf give
/// 1.6e-38, not 0; the kernels only pass differences from a row's maximum), tanh within 2e-7
/// absolute everywhere.
/// Both need -O3 (or -ftree-vectorize) to vectorise with GCC 12; at -O2 they stay scalar but
/// are still faster than the libm calls. They keep their accuracy under -ffast-math (tested).

#include <bit>
#include <cstddef>
#include <cstdint>

/// A kernel whose loop must vectorise: compiled as a function of its own. Inlined into the CPU
/// dispatch's switch (runtime/dispatch.hpp, several thousand instructions), GCC 12 left GELU's
/// loop scalar: 2.8 ms a call in the GPT step against 0.73 ms alone (bench/cpu_kernels/gpt_vs_torch.py).
#define CONCERTO_VECTOR_KERNEL [[gnu::noinline]]

namespace concerto::runtime::cpu::detail {

/// Σ term(i) for i < n in eight interleaved partial sums (partial j takes i ≡ j mod 8), added
/// pairwise at the end, then the tail. A plain `sum += x[i]` is one chain the compiler may not
/// reorder (float addition is not associative), so it runs scalar, one add per latency; eight
/// independent partials go into vector registers. The order is fixed: every call on the same
/// values gives the same sum.
template <class Term>
inline float lane_sum(std::size_t n, Term&& term) {
  float part[8] = {};
  const std::size_t whole = n / 8 * 8;
  for (std::size_t i = 0; i < whole; i += 8)
    for (std::size_t j = 0; j < 8; ++j) part[j] += term(i + j);
  float tail = 0.0f;
  for (std::size_t i = whole; i < n; ++i) tail += term(i);
  return (((part[0] + part[4]) + (part[1] + part[5])) + ((part[2] + part[6]) + (part[3] + part[7]))) + tail;
}

/// x with its magnitude limited to `limit`, sign kept. Integer operations only: a float
/// comparison may trap (on NaN), so under the default -ftrapping-math GCC will not turn it into
/// a vector select, and one of them in a loop keeps the whole loop scalar.
inline float clamp_magnitude(float x, float limit) {
  const auto bits = std::bit_cast<std::int32_t>(x);
  const std::int32_t magnitude = bits & 0x7fffffff, most = std::bit_cast<std::int32_t>(limit);
  return std::bit_cast<float>((bits & std::int32_t(0x80000000u)) | (magnitude < most ? magnitude : most));
}

/// `result`, or a NaN when `input` is one (integer operations, as above), so that a diverged
/// training step still shows as NaN downstream.
inline float keep_nan(float result, float input) {
  const std::int32_t magnitude = std::bit_cast<std::int32_t>(input) & 0x7fffffff;
  return std::bit_cast<float>(std::bit_cast<std::int32_t>(result) | (magnitude > 0x7f800000 ? 0x7fc00000 : 0));
}

/// e^x for |x| <= 87, clamped beyond (e^±87 is still a normal float; ±inf clamps too); NaN stays NaN.
inline float exp_approx(float in) {
  const float x = clamp_magnitude(in, 87.0f);
  // n = round(x / ln 2) through the 1.5·2^23 shifter (round-to-nearest, no call), then
  // r = x - n·ln 2 in two parts (Cody-Waite) so that r keeps its precision.
  constexpr float shifter = 12582912.0f;
  const float shifted = x * 1.44269504088896341f + shifter;
  const std::int32_t ni = std::bit_cast<std::int32_t>(shifted) - std::bit_cast<std::int32_t>(shifter);
#if defined(__FAST_MATH__)
  // Reassociation would fold `shifted - shifter` back into x·log2(e) and leave r unreduced
  // (exp(1) came out 2): take n from the integer instead.
  const float n = static_cast<float>(ni);
#else
  // The same value without the conversion, which made the GPT example's step 16 % slower
  // (27 -> 31 ms on 4 ranks, bench/cpu_steps; why is not known).
  const float n = shifted - shifter;
#endif
  const float r = (x - n * 0.693145751953125f) - n * 1.428606765330187e-06f; // |r| <= ln2/2
  // e^r by its Taylor series to r^6 (the r^7 term is below 1.2e-7 on |r| <= 0.347).
  float p = 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  // 2^n from the exponent bits: n in [-126, 126] after the clamp, so always a normal float.
  return keep_nan(p * std::bit_cast<float>((ni + 127) << 23), in);
}

/// tanh(u) = sign(u)·(1 - 2/(e^{2|u|} + 1)); |u| >= 10 gives ±1 exactly in float. NaN stays NaN.
inline float tanh_approx(float u) {
  const auto sign = std::bit_cast<std::int32_t>(u) & std::int32_t(0x80000000u);
  const float a = std::bit_cast<float>(std::bit_cast<std::int32_t>(clamp_magnitude(u, 10.0f)) ^ sign);
  const float t = 1.0f - 2.0f / (exp_approx(2.0f * a) + 1.0f);
  return keep_nan(std::bit_cast<float>(std::bit_cast<std::int32_t>(t) | sign), u);
}

} // namespace concerto::runtime::cpu::detail
