#pragma once
/// @file
/// @brief How a compute task's operands and attrs are read, shared by the CPU dispatch
/// (runtime/dispatch.hpp) and the GPU dispatch (runtime/cuda/dispatch.cuh).
///
/// The two dispatches must accept exactly the same tasks (docs/runtime.md lists the operand
/// conventions), so the reading of a task is written once: which read or write is which
/// operand, integer operands found by dtype, attrs that must be non-negative, this rank's
/// coordinate on a named mesh axis, the order of a backward task's operands, and the row
/// geometry of slice, concat and shard_slice. Messages name the task, its fn and the operand.
/// What stays in a dispatch is how it touches the bytes (spans on the host, device pointers and
/// launches on the GPU). No CBLAS or CUDA header: this compiles under g++ and nvcc alike.

#include <concerto/core/error.hpp>
#include <concerto/ir/graph.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

namespace concerto::runtime::detail {

inline std::string task_ref(const ir::task& t) { return "task " + std::to_string(t.id) + " '" + t.name + "'"; }

/// Operand access for one task on an arena (runtime::host_arena or cuda::device_arena, whose
/// `type`, `name` and `bytes` it reads), with messages naming the task and the operand. Each
/// dispatch derives from it to add its own view of the bytes.
template <class Arena>
class task_operands {
public:
  task_operands(const ir::task& t, Arena& mem) : t_(t), mem_(mem) {}

  ir::buffer_id read(std::size_t i, const char* what) const { return pick(t_.reads, i, what, "reads"); }
  ir::buffer_id write(std::size_t i, const char* what) const { return pick(t_.writes, i, what, "writes"); }
  bool is_int(ir::buffer_id b) const { return mem_.type(b) == ir::dtype::i32 || mem_.type(b) == ir::dtype::i64; }
  /// The one integer operand (i32 or i64) among the reads (ids, targets), wherever it is listed.
  ir::buffer_id int_read(const char* what) const {
    for (const auto b : t_.reads)
      if (is_int(b)) return b;
    fail(ref() + " needs an i32 or i64 buffer among its reads for `" + what + "`");
  }
  /// The i-th fp32 read, skipping integer operands.
  ir::buffer_id float_read(std::size_t i, const char* what) const {
    std::size_t seen = 0;
    for (const auto b : t_.reads)
      if (!is_int(b) && seen++ == i) return b;
    fail(ref() + " has no fp32 read #" + std::to_string(i) + " for `" + what + "`");
  }
  std::size_t float_reads() const {
    std::size_t n = 0;
    for (const auto b : t_.reads) n += !is_int(b);
    return n;
  }
  /// The first read that is not also written (an update's gradient).
  ir::buffer_id read_not_written(const char* what) const {
    for (const auto b : t_.reads)
      if (std::find(t_.writes.begin(), t_.writes.end(), b) == t_.writes.end()) return b;
    fail(ref() + " has no read besides the buffers it writes, for `" + what + "`");
  }
  /// The last read other than `acc`: add_inplace's addend, wherever the producer listed `acc`.
  ir::buffer_id addend(ir::buffer_id acc) const {
    ir::buffer_id x = -1;
    for (const auto b : t_.reads)
      if (b != acc) x = b;
    if (x < 0) fail(ref() + " reads nothing to add into its output");
    return x;
  }
  std::size_t at(const char* key, std::int64_t fallback = -1) const {
    const auto v = t_.attr(key, fallback);
    if (v < 0) fail(ref() + " needs a non-negative attr '" + key + "'");
    return static_cast<std::size_t>(v);
  }
  std::size_t divide(std::size_t total, std::size_t by, const char* what) const {
    if (by == 0 || total % by != 0)
      fail(ref() + ": " + std::to_string(total) + " values are not a whole number of " + what + " of " +
           std::to_string(by));
    return total / by;
  }
  /// This rank's coordinate on the mesh axis named by attr `key` (0 when the attr is absent or
  /// -1, or when `coords`, kernel_settings::coords, is empty).
  std::int64_t coord(std::span<const int> coords, const char* key) const {
    const auto a = t_.attr(key, -1);
    if (a < 0 || coords.empty()) return 0;
    if (static_cast<std::size_t>(a) >= coords.size())
      fail(ref() + ": attr " + key + " = " + std::to_string(a) + " but the mesh has " + std::to_string(coords.size()) +
           " axes");
    return coords[static_cast<std::size_t>(a)];
  }
  /// A buffer's size in bytes (the host arena gives a span, the device arena a count).
  std::size_t bytes(ir::buffer_id b) const {
    if constexpr (requires { mem_.bytes(b).size(); }) return mem_.bytes(b).size();
    else return static_cast<std::size_t>(mem_.bytes(b));
  }
  const ir::task& task() const noexcept { return t_; }
  Arena& mem() const noexcept { return mem_; }

protected:
  /// "task 3 'ln' (fn 'layernorm')", the start of most messages.
  std::string ref() const { return task_ref(t_) + " (fn '" + t_.fn + "')"; }

  const ir::task& t_;
  Arena& mem_;

private:
  ir::buffer_id pick(const std::vector<ir::buffer_id>& list, std::size_t i, const char* what, const char* field) const {
    if (i >= list.size())
      fail(ref() + " lists " + std::to_string(list.size()) + " " + field + " but the kernel needs `" + what +
           "` at position " + std::to_string(i));
    return list[i];
  }
};

// The operand written by a backward-phase task is the incoming gradient: ir::builder graphs list
// (dout, x), the DSL lowering (x, dout). When neither or both are, the DSL's order holds.
inline bool dout_first(const ir::graph& g, const ir::task& t) {
  if (t.reads.size() < 2) return false;
  const auto backward_written = [&](ir::buffer_id b) {
    for (const auto& u : g.tasks)
      if (u.step_phase == ir::phase::backward && std::find(u.writes.begin(), u.writes.end(), b) != u.writes.end())
        return true;
    return false;
  };
  return backward_written(t.reads[0]) && !backward_written(t.reads[1]);
}

inline float ratio(const ir::task& t, const char* num, const char* den) {
  const auto d = t.attr(den, 1);
  if (d == 0) fail(task_ref(t) + ": attr '" + den + "' is 0");
  return static_cast<float>(static_cast<double>(t.attr(num, 1)) / static_cast<double>(d));
}

/// Where a part's rows lie in a whole buffer, in bytes: `outer` rows, a whole row of
/// `whole_row` bytes holding the part's `part_row` bytes at `offset`.
struct rows_in_whole {
  std::size_t outer = 1, whole_row = 0, part_row = 0, offset = 0;
};

/// Calls `copy(whole, part, rows)` for slice's one part or for each of concat's parts, in order;
/// `whole` is the sliced source or the concatenated destination. Both forms walk the whole
/// buffer's shape around a dimension: the planner's explicit one (attrs outer, extent, inner,
/// length, offset, parts; docs/decomposition.md) and the DSL's (attr `dim`, the buffer's shape,
/// each part's size giving its length; an opaque buffer is one dimension of elements).
template <class Arena, class Copy>
void for_each_part(const ir::graph& g, const task_operands<Arena>& op, bool slicing, Copy&& copy) {
  const auto& t = op.task();
  const auto whole = slicing ? op.read(0, "src") : op.write(0, "dst");
  const auto& wb = g.buffers.at(static_cast<std::size_t>(whole));
  const auto elem = ir::size_of(wb.type);
  if (t.attrs.contains("outer")) {
    // The whole buffer seen as [outer, extent, inner] elements; a part is [outer, length, inner].
    const auto outer = op.at("outer", 1), inner = op.at("inner", 1) * elem, length = op.at("length", 0) * inner;
    if (slicing) {
      const auto part = op.write(0, "dst");
      copy(whole, part, rows_in_whole{outer, op.at("extent", 0) * inner, length, op.at("offset", 0) * inner});
      return;
    }
    const auto parts = op.at("parts", static_cast<std::int64_t>(t.reads.size()));
    if (parts != t.reads.size())
      fail(task_ref(t) + ": attr parts = " + std::to_string(parts) + " but the task reads " +
           std::to_string(t.reads.size()) + " buffer(s)");
    for (std::size_t j = 0; j < parts; ++j) copy(whole, t.reads[j], rows_in_whole{outer, parts * length, length, j * length});
    return;
  }
  const auto dim = op.at("dim", 0);
  const auto dims = std::max<std::size_t>(wb.shape.size(), 1);
  if (dim >= dims)
    fail(task_ref(t) + ": attr dim = " + std::to_string(dim) + " but buffer '" + wb.name + "' has " +
         std::to_string(dims) + " dimension(s)");
  const auto extent_of = [&](std::size_t d) {
    return wb.shape.empty() ? static_cast<std::size_t>(wb.bytes) / elem : static_cast<std::size_t>(wb.shape[d]);
  };
  std::size_t outer = 1, inner = elem;
  for (std::size_t d = 0; d < dim; ++d) outer *= extent_of(d);
  for (std::size_t d = dim + 1; d < dims; ++d) inner *= extent_of(d);
  const auto whole_row = extent_of(dim) * inner;
  if (slicing) {
    const auto part = op.write(0, "dst");
    const auto len = op.divide(op.bytes(part), outer, "rows");
    copy(whole, part, rows_in_whole{outer, whole_row, len, op.at("offset", 0) * inner});
    return;
  }
  std::size_t at = 0;
  for (const auto b : t.reads) {
    const auto len = op.divide(op.bytes(b), outer, "rows");
    copy(whole, b, rows_in_whole{outer, whole_row, len, at});
    at += len;
  }
}

/// shard_slice's part of `src`: the one of attr `parts` parts along attr `dim` that this rank's
/// coordinate on attr `mesh_axis` selects.
template <class Arena>
rows_in_whole shard_rows(const ir::graph& g, const task_operands<Arena>& op, ir::buffer_id src,
                         std::span<const int> coords) {
  const auto& t = op.task();
  const auto& sb = g.buffers.at(static_cast<std::size_t>(src));
  const auto dim = op.at("dim", 0), parts = op.at("parts", 1);
  if (dim >= std::max<std::size_t>(sb.shape.size(), 1))
    fail(task_ref(t) + ": attr dim = " + std::to_string(dim) + " but '" + sb.name + "' has rank " +
         std::to_string(sb.shape.size()));
  const auto elem = ir::size_of(sb.type);
  std::size_t outer = 1, inner = elem;
  for (std::size_t d = 0; d < dim; ++d) outer *= static_cast<std::size_t>(sb.shape[d]);
  for (std::size_t d = dim + 1; d < sb.shape.size(); ++d) inner *= static_cast<std::size_t>(sb.shape[d]);
  const auto extent = sb.shape.empty() ? static_cast<std::size_t>(sb.bytes) / elem : static_cast<std::size_t>(sb.shape[dim]);
  const auto len = op.divide(extent, parts, "parts") * inner;
  const auto part = static_cast<std::size_t>(op.coord(coords, "mesh_axis"));
  return {outer, extent * inner, len, part * len};
}

} // namespace concerto::runtime::detail
