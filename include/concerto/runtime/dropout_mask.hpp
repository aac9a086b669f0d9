#pragma once
/// @file
/// @brief The mask of a dropout: whether value `index` of the whole tensor (its global,
/// row-major index) is kept at a step, drawn by a counter-based hash of (key, step, index). Every
/// rank and either executor draw the same bit for the same value, so a split tensor is masked as
/// the whole would be, replicas alike, and the gradient redraws the forward's mask instead of
/// storing it.


#include <concerto/ir/task_attrs.hpp>

#include <cstdint>

#if !defined(CONCERTO_HOST_DEVICE)
#if defined(__CUDACC__)
#define CONCERTO_HOST_DEVICE __host__ __device__
#else
#define CONCERTO_HOST_DEVICE
#endif
#endif

namespace concerto::runtime {

/// @brief splitmix64's finaliser: a bijection of 64-bit words whose outputs pass as independent.
[[nodiscard]] CONCERTO_HOST_DEVICE constexpr std::uint64_t mix64(std::uint64_t z) noexcept {
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

/// @brief Where a dropout task's values lie in the whole tensor, and how it draws: this rank's
/// block (its extents and offsets per dim) of a tensor of `global_stride`s; a value is dropped
/// when the top 24 bits of its draw fall below `threshold` (rate · 2²⁴), and kept ones are scaled by 1 / (1 − rate).
struct dropout_layout {
  static constexpr int max_dims = 6;
  int rank = 0;
  std::int64_t local[max_dims]{}, offset[max_dims]{}, global_stride[max_dims]{};
  std::uint64_t key = 0; ///< the seed, the node and layer, the micro-batch: what the step's draws differ by
  std::uint32_t threshold = 0;
  float scale = 1.0f;

  /// The whole tensor's index of this block's value `i` (row-major in the block).
  [[nodiscard]] CONCERTO_HOST_DEVICE constexpr std::uint64_t global_index(std::uint64_t i) const noexcept {
    std::uint64_t out = 0;
    for (int d = rank - 1; d >= 0; --d) {
      const auto extent = static_cast<std::uint64_t>(local[d]);
      out += (i % extent + static_cast<std::uint64_t>(offset[d])) * static_cast<std::uint64_t>(global_stride[d]);
      i /= extent;
    }
    return out;
  }
  /// Value i's factor at `step`: 0 (dropped) or the scale.
  [[nodiscard]] CONCERTO_HOST_DEVICE constexpr float factor(std::uint64_t i, std::int64_t step) const noexcept {
    const auto draw = mix64(mix64(key ^ mix64(static_cast<std::uint64_t>(step))) + global_index(i) * 0x9e3779b97f4a7c15ULL);
    return static_cast<std::uint32_t>(draw >> 40) < threshold ? 0.0f : scale;
  }
};

} // namespace concerto::runtime
