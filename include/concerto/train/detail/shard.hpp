#pragma once
/// @file
/// @brief Internals of train/: where a rank's shard sits in a global tensor, copies between the
/// two, and the counter-based random numbers that make initial values independent of the mesh.

#include <concerto/core/error.hpp>
#include <concerto/core/hash.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

namespace concerto::train::detail {

/// One rank's block of a global tensor: per dimension its offset and extent in the global tensor
/// (`held`), and the shape of the buffer that holds it (`local`). The two differ where a ZeRO
/// split left a dimension uneven (graph/lower.hpp, local_shapes): there every rank's buffer has
/// ⌈n/P⌉ rows, of which the last ranks hold fewer values (or none), the rest being padding.
/// An empty `held` is `local`.
struct block {
  std::vector<std::int64_t> global, offset, local, held{};
};

inline std::int64_t count(const std::vector<std::int64_t>& shape) {
  std::int64_t n = 1;
  for (auto d : shape) n *= d;
  return n;
}

/// How one mesh axis splits a dimension: its size and a rank's coordinate on it.
struct axis_part {
  int size = 1, index = 0;
};

/// The block a rank holds of a tensor whose dimension d is split over `splits[d]` (major axis
/// first), in a buffer of shape `local`. Each split gives the rank part `index` of ⌈e/size⌉
/// along the extent e the splits before it left (all of e when it divides; when it does not, the
/// last parts end at e or are empty, the rest of their ⌈e/size⌉ being padding). The global extent
/// of dimension d is `global[d]`, the program's, when the buffer holds this rank's part of it
/// (`local[d]` is that ⌈…⌉); else the buffer holds something else, such as a pipelined step's
/// whole batch of a micro-batch input or a gradient packed with others, and it is `local[d]` times
/// the parts, as if it divided.
/// @code
/// // 5 rows over 4 ranks: rows [0,2), [2,4), [4,5) and none, each in a buffer of 2 rows.
/// block b = block_of({5, 16}, {{{4, 2}}, {}}, {2, 16}); // b.offset = {4, 0}, b.held = {1, 16}
/// @endcode
inline block block_of(const std::vector<std::int64_t>& global, const std::vector<std::vector<axis_part>>& splits,
                      const std::vector<std::int64_t>& local) {
  block b{local, std::vector<std::int64_t>(local.size(), 0), local, local};
  for (std::size_t d = 0; d < local.size(); ++d) {
    const auto& axes = d < splits.size() ? splits[d] : std::vector<axis_part>{};
    std::int64_t part = global.size() == local.size() ? global[d] : -1, parts = 1;
    for (const auto& a : axes) {
      part = (part + a.size - 1) / a.size;
      parts *= a.size;
    }
    b.global[d] = b.held[d] = global.size() == local.size() && part == local[d] ? global[d] : local[d] * parts;
    for (const auto& a : axes) {
      const auto size = (b.held[d] + a.size - 1) / a.size;
      b.offset[d] += size * a.index;
      b.held[d] = std::clamp<std::int64_t>(b.held[d] - size * a.index, 0, size);
    }
  }
  return b;
}

/// Copies between a global row-major tensor and a block of it, `elem` bytes per value;
/// to_block: global -> block, else block -> global. The buffer's padding is not touched.
inline void copy_block(const block& b, std::size_t elem, std::byte* global, std::byte* local, bool to_block) {
  const auto rank = b.global.size();
  if (rank == 0) {
    if (to_block) std::memcpy(local, global, elem);
    else std::memcpy(global, local, elem);
    return;
  }
  const auto& held = b.held.empty() ? b.local : b.held;
  if (count(held) == 0) return; // only padding here
  // Walk every block row (all dimensions but the last), copy the last one's values whole.
  const auto row = static_cast<std::size_t>(held.back()) * elem;
  std::vector<std::int64_t> at(rank, 0);
  const auto rows = count(held) / held.back();
  for (std::int64_t r = 0; r < rows; ++r) {
    std::int64_t g = 0, l = 0;
    for (std::size_t d = 0; d < rank; ++d) {
      const auto i = d + 1 < rank ? at[d] : 0;
      g = g * b.global[d] + b.offset[d] + i;
      l = l * b.local[d] + i;
    }
    auto* gp = global + static_cast<std::size_t>(g) * elem;
    auto* lp = local + static_cast<std::size_t>(l) * elem;
    if (to_block) std::memcpy(lp, gp, row);
    else std::memcpy(gp, lp, row);
    for (std::size_t d = rank - 1; d-- > 0;) { // next block row
      if (++at[d] < held[d]) break;
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
