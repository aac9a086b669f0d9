#pragma once
/// @file
/// @brief The 16-bit float types of a working precision (ir::is_16bit_float: bf16, f16) to and
/// from f32, chosen by the buffer's ir::dtype: what the CPU dispatch stages for its kernels, the
/// named tensors read and write, and the MPI backend checks for non-finite values.

#include <concerto/core/bfloat16.hpp>
#include <concerto/core/float16.hpp>
#include <concerto/ir/graph.hpp>

#include <cstdint>
#include <span>

namespace concerto::runtime {

/// @brief One stored value of 16-bit float type `t`, exactly as f32.
[[nodiscard]] constexpr float widen_16bit(ir::dtype t, std::uint16_t v) noexcept {
  return t == ir::dtype::f16 ? from_f16(v) : from_bf16(v);
}
/// @brief Widens `from` (of 16-bit float type `t`) into `to` (same length).
inline void widen_16bit(ir::dtype t, std::span<const std::uint16_t> from, std::span<float> to) noexcept {
  if (t == ir::dtype::f16) widen_f16(from, to);
  else widen_bf16(from, to);
}
/// @brief Rounds `from` into `to` (same length) of 16-bit float type `t`, to nearest even.
inline void round_to_16bit(ir::dtype t, std::span<const float> from, std::span<std::uint16_t> to) noexcept {
  if (t == ir::dtype::f16) round_to_f16(from, to);
  else round_to_bf16(from, to);
}

} // namespace concerto::runtime
