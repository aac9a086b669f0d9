#pragma once
/// @file
/// @brief The parts of one dim: concat_dim joins two tensors along it, slice_dim takes positions
/// [offset, offset + length) of it, and their gradients the reverse. The whole is viewed as
/// [lead, outer, extent, inner] (ir::dim_part); a part is [lead, outer, length, inner], or, when
/// it is repeated (a table of the whole's last dims: a ViT's class token), [outer, length, inner]
/// copied into every lead and its gradient summed over lead. Each row of a part is one contiguous
/// copy of length·inner values.
///
/// @code
/// // cls [1, 8] before patches [4, 16, 8]: out [4, 17, 8]
/// const ir::dim_part g{.lead = 4, .outer = 1, .extent = 17, .inner = 8, .offset = 0, .length = 1, .broadcast = 1};
/// cpu::concat_dim(cls, patches, out, g);
/// @endcode

#include <concerto/ir/task_attrs.hpp>
#include <concerto/runtime/cpu/detail/check.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <span>

namespace concerto::runtime::cpu {

namespace detail {

struct part_rows {
  std::size_t lead, outer, extent, inner, offset, length;
  bool repeated;
  [[nodiscard]] std::size_t row() const noexcept { return length * inner; }
  [[nodiscard]] std::size_t whole_at(std::size_t l, std::size_t o) const noexcept {
    return ((l * outer + o) * extent + offset) * inner;
  }
  [[nodiscard]] std::size_t part_at(std::size_t l, std::size_t o) const noexcept { return ((repeated ? 0 : l * outer) + o) * row(); }
};

inline part_rows rows_of(const ir::dim_part& g, std::int64_t offset, std::int64_t length, bool repeated) {
  return {static_cast<std::size_t>(g.lead),  static_cast<std::size_t>(g.outer),  static_cast<std::size_t>(g.extent),
          static_cast<std::size_t>(g.inner), static_cast<std::size_t>(offset), static_cast<std::size_t>(length), repeated};
}

// The part's rows into the whole (a repeated part into every lead).
inline void put_part(std::span<const float> part, std::span<float> whole, const part_rows& p) {
  for (std::size_t l = 0; l < p.lead; ++l)
    for (std::size_t o = 0; o < p.outer; ++o)
      std::copy_n(part.begin() + static_cast<std::ptrdiff_t>(p.part_at(l, o)), p.row(),
                  whole.begin() + static_cast<std::ptrdiff_t>(p.whole_at(l, o)));
}

// The whole's rows of the part out (a repeated part summed over lead).
inline void take_part(std::span<const float> whole, std::span<float> part, const part_rows& p) {
  if (p.repeated) std::fill(part.begin(), part.end(), 0.0f);
  for (std::size_t l = 0; l < p.lead; ++l)
    for (std::size_t o = 0; o < p.outer; ++o) {
      const float* from = whole.data() + p.whole_at(l, o);
      float* to = part.data() + p.part_at(l, o);
      if (p.repeated)
        for (std::size_t k = 0; k < p.row(); ++k) to[k] += from[k];
      else
        std::copy_n(from, p.row(), to);
    }
}

inline void check_parts(const ir::dim_part& g, const char* kernel) {
  CONCERTO_CHECK(g.lead >= 1 && g.outer >= 1 && g.inner >= 1 && g.offset >= 0 && g.length >= 1 && g.offset + g.length <= g.extent,
                 std::string(kernel) + ": part [" + std::to_string(g.offset) + ", " + std::to_string(g.offset + g.length) +
                     ") does not lie in an extent of " + std::to_string(g.extent));
}

} // namespace detail

/// @brief out = a then b along the dim: a holds `length` positions, b the rest (bit k of
/// g.broadcast: operand k is repeated over lead).
inline void concat_dim(std::span<const float> a, std::span<const float> b, std::span<float> out, const ir::dim_part& g) {
  detail::check_parts(g, "concat_dim");
  CONCERTO_CHECK(g.length < g.extent, "concat_dim: the first part's length " + std::to_string(g.length) +
                                          " leaves nothing of an extent of " + std::to_string(g.extent) + " to the second");
  detail::require_size(a, static_cast<std::size_t>(g.part_values(g.length, 0)), "concat_dim", "a");
  detail::require_size(b, static_cast<std::size_t>(g.part_values(g.extent - g.length, 1)), "concat_dim", "b");
  detail::require_size(out, static_cast<std::size_t>(g.whole_values()), "concat_dim", "out");
  detail::put_part(a, out, detail::rows_of(g, 0, g.length, g.repeated(0)));
  detail::put_part(b, out, detail::rows_of(g, g.length, g.extent - g.length, g.repeated(1)));
}

/// @brief part = x's positions [offset, offset + length) of the dim.
inline void slice_dim(std::span<const float> x, std::span<float> part, const ir::dim_part& g) {
  detail::check_parts(g, "slice_dim");
  detail::require_size(x, static_cast<std::size_t>(g.whole_values()), "slice_dim", "x");
  detail::require_size(part, static_cast<std::size_t>(g.part_values(g.length, 0)), "slice_dim", "part");
  detail::take_part(x, part, detail::rows_of(g, g.offset, g.length, false));
}

/// @brief One operand's gradient of concat_dim: its part of dy (summed over lead if repeated).
inline void concat_dim_grad(std::span<const float> dy, std::span<float> dpart, const ir::dim_part& g) {
  detail::check_parts(g, "concat_dim_grad");
  detail::require_size(dy, static_cast<std::size_t>(g.whole_values()), "concat_dim_grad", "dy");
  detail::require_size(dpart, static_cast<std::size_t>(g.part_values(g.length, 0)), "concat_dim_grad", "dpart");
  detail::take_part(dy, dpart, detail::rows_of(g, g.offset, g.length, g.repeated(0)));
}

/// @brief slice_dim's gradient: dx = dpart at the part's positions, zero elsewhere.
inline void slice_dim_grad(std::span<const float> dpart, std::span<float> dx, const ir::dim_part& g) {
  detail::check_parts(g, "slice_dim_grad");
  detail::require_size(dpart, static_cast<std::size_t>(g.part_values(g.length, 0)), "slice_dim_grad", "dpart");
  detail::require_size(dx, static_cast<std::size_t>(g.whole_values()), "slice_dim_grad", "dx");
  std::fill(dx.begin(), dx.end(), 0.0f);
  detail::put_part(dpart, dx, detail::rows_of(g, g.offset, g.length, false));
}

} // namespace concerto::runtime::cpu
