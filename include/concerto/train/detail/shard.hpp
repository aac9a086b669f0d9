#pragma once
/// @file
/// @brief Internals of train/: where a rank's shard sits in a global tensor, copies between the
/// two, and the counter-based random numbers that make initial values independent of the mesh.

#include <concerto/core/error.hpp>
#include <concerto/core/hash.hpp>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

namespace concerto::train::detail {

/// One rank's block of a global tensor: per dimension its offset and extent.
struct block {
  std::vector<std::int64_t> global, offset, local;
};

inline std::int64_t count(const std::vector<std::int64_t>& shape) {
  std::int64_t n = 1;
  for (auto d : shape) n *= d;
  return n;
}

/// Copies between a global row-major tensor and a block of it, `elem` bytes per value;
/// to_block: global -> block, else block -> global.
inline void copy_block(const block& b, std::size_t elem, std::byte* global, std::byte* local, bool to_block) {
  const auto rank = b.global.size();
  if (rank == 0) {
    if (to_block) std::memcpy(local, global, elem);
    else std::memcpy(global, local, elem);
    return;
  }
  // Walk every block row (all dimensions but the last), copy the last one whole.
  const auto row = static_cast<std::size_t>(b.local.back()) * elem;
  std::vector<std::int64_t> at(rank, 0);
  const auto rows = count(b.local) / std::max<std::int64_t>(b.local.back(), 1);
  for (std::int64_t r = 0; r < rows; ++r) {
    std::int64_t g = 0;
    for (std::size_t d = 0; d < rank; ++d) g = g * b.global[d] + b.offset[d] + (d + 1 < rank ? at[d] : 0);
    auto* gp = global + static_cast<std::size_t>(g) * elem;
    auto* lp = local + static_cast<std::size_t>(r) * row;
    if (to_block) std::memcpy(lp, gp, row);
    else std::memcpy(gp, lp, row);
    for (std::size_t d = rank - 1; d-- > 0;) { // next block row
      if (++at[d] < b.local[d]) break;
      at[d] = 0;
    }
  }
}

/// splitmix64: a counter-based generator, so value i of a tensor depends on (seed, name, i) only.
inline std::uint64_t mix(std::uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

/// Uniform in [-1, 1) for element i of the tensor `name`.
inline float uniform(std::uint64_t seed, const std::string& name, std::uint64_t i) {
  const auto h = mix(seed ^ hasher{}.add(std::string_view(name)).value()) ^ mix(i);
  return static_cast<float>(static_cast<double>(mix(h) >> 11) * 0x1.0p-53 * 2.0 - 1.0);
}

} // namespace concerto::train::detail
