#pragma once
/// @file
/// @brief Embedding lookup on the CPU and its backward (scatter-add into the table gradient).
///
/// Layout: `table[rows, dim]` row-major (this rank's rows `[first_row, first_row + rows)` of
/// the vocabulary), `ids[n]` int32, `out[n, dim]`.

#include <concerto/runtime/cpu/detail/check.hpp>

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>

namespace concerto::runtime::cpu {

/// @brief What a lookup does with an id outside the rows this table holds.
enum class id_outside_table {
  reject,   ///< throw concerto::error naming the id (a whole, unsharded table)
  zero_row, ///< output zeros / skip in the backward (a vocabulary-sharded table: another rank
            ///< holds that row, and an all-reduce of the outputs completes the lookup)
};

namespace detail {
// Returns the local row of `id`, or -1 when another shard holds it.
inline std::int64_t embedding_row(const char* kernel, std::size_t position, std::int32_t id,
                                  std::int64_t first_row, std::size_t rows, id_outside_table policy) {
  const std::int64_t local = static_cast<std::int64_t>(id) - first_row;
  if (local >= 0 && local < static_cast<std::int64_t>(rows)) return local;
  CONCERTO_CHECK(policy == id_outside_table::zero_row,
                 std::string(kernel) + ": id " + std::to_string(id) + " at position " +
                     std::to_string(position) + " is outside the table rows [" +
                     std::to_string(first_row) + ", " +
                     std::to_string(first_row + static_cast<std::int64_t>(rows)) + ")");
  return -1;
}

inline std::size_t table_rows(const char* kernel, std::size_t table_floats, std::size_t dim) {
  CONCERTO_CHECK(dim > 0 && table_floats % dim == 0,
                 std::string(kernel) + ": `table` holds " + std::to_string(table_floats) +
                     " floats, not a whole number of rows of dim " + std::to_string(dim));
  return table_floats / dim;
}
} // namespace detail

/// @brief `out[i, :] = table[ids[i] - first_row, :]`.
/// @code
/// cpu::embedding(tokens, wte, x, hidden);  // whole table, ids checked
/// @endcode
inline void embedding(std::span<const std::int32_t> ids, std::span<const float> table,
                      std::span<float> out, std::size_t dim, std::int64_t first_row = 0,
                      id_outside_table policy = id_outside_table::reject) {
  const std::size_t rows = detail::table_rows("embedding", table.size(), dim);
  detail::require_size(out, ids.size() * dim, "embedding", "out");
  for (std::size_t i = 0; i < ids.size(); ++i) {
    const std::int64_t r = detail::embedding_row("embedding", i, ids[i], first_row, rows, policy);
    float* po = out.data() + i * dim;
    if (r < 0) {
      for (std::size_t c = 0; c < dim; ++c) po[c] = 0.0f;
      continue;
    }
    const float* pt = table.data() + static_cast<std::size_t>(r) * dim;
    for (std::size_t c = 0; c < dim; ++c) po[c] = pt[c];
  }
}

/// @brief Backward of `embedding`: `dtable[ids[i] - first_row, :] += dout[i, :]` for every i
/// (repeated ids add up).
///
/// Without `accumulate` the table gradient is zeroed first (a pass over the whole table); with
/// it, the rows are added to what dtable holds.
inline void embedding_grad(std::span<const std::int32_t> ids, std::span<const float> dout,
                           std::span<float> dtable, std::size_t dim, bool accumulate = false,
                           std::int64_t first_row = 0,
                           id_outside_table policy = id_outside_table::reject) {
  const std::size_t rows = detail::table_rows("embedding_grad", dtable.size(), dim);
  detail::require_size(dout, ids.size() * dim, "embedding_grad", "dout");
  // Check every id before touching dtable, so a bad id leaves the gradient as it was.
  for (std::size_t i = 0; i < ids.size(); ++i)
    detail::embedding_row("embedding_grad", i, ids[i], first_row, rows, policy);
  if (!accumulate) {
    float* pt = dtable.data();
    const std::size_t n = dtable.size();
    for (std::size_t j = 0; j < n; ++j) pt[j] = 0.0f;
  }
  for (std::size_t i = 0; i < ids.size(); ++i) {
    const std::int64_t r = static_cast<std::int64_t>(ids[i]) - first_row;
    if (r < 0 || r >= static_cast<std::int64_t>(rows)) continue;
    float* pt = dtable.data() + static_cast<std::size_t>(r) * dim;
    const float* pg = dout.data() + i * dim;
    for (std::size_t c = 0; c < dim; ++c) pt[c] += pg[c];
  }
}

} // namespace concerto::runtime::cpu
