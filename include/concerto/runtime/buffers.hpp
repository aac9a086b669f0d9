#pragma once
/// @file
/// @brief The memory layout of a plan's buffers and the host arena that holds them.
///
/// Every root buffer of the graph gets its own aligned region of one arena; a view is an
/// offset into its root, so views alias exactly the bytes the graph says they do. After the
/// regions comes one scratch region, sized for the largest kernel workspace (attention), so
/// that no kernel allocates. Regions are not reused across buffer lifetimes: collectives run
/// asynchronously, and a layout that never aliases two live roots cannot be broken by a
/// schedule that differs from the predicted times.

#include <concerto/core/error.hpp>
#include <concerto/ir/graph.hpp>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <new>
#include <span>
#include <string>
#include <vector>

namespace concerto::runtime {

/// @brief Where each buffer lives inside one arena of `total_bytes`.
struct memory_layout {
  std::size_t alignment = 64;          ///< every root region starts at a multiple of it
  std::vector<std::int64_t> offset;    ///< per buffer id: byte offset in the arena (views included)
  std::int64_t scratch_offset = 0;     ///< the kernels' workspace region
  std::int64_t scratch_bytes = 0;
  std::int64_t total_bytes = 0;
  friend bool operator==(const memory_layout&, const memory_layout&) = default;
};

/// @brief Lays the graph's root buffers one after the other (aligned) and resolves views.
///
/// `scratch_bytes` is the workspace the kernels need (dispatch::workspace_bytes(graph)).
/// @code
/// auto layout = runtime::make_layout(p.graph, runtime::workspace_bytes(p.graph));
/// runtime::host_arena arena(p.graph, layout);
/// @endcode
[[nodiscard]] inline memory_layout make_layout(const ir::graph& g, std::int64_t scratch_bytes = 0,
                                               std::size_t alignment = 64) {
  CONCERTO_CHECK(alignment > 0 && (alignment & (alignment - 1)) == 0,
                 "memory layout of graph '" + g.name + "': alignment " + std::to_string(alignment) +
                     " is not a power of two");
  CONCERTO_CHECK(scratch_bytes >= 0, "memory layout of graph '" + g.name + "': negative scratch size");
  memory_layout out;
  out.alignment = alignment;
  out.offset.assign(g.buffers.size(), 0);
  const auto align = [&](std::int64_t v) {
    const auto a = static_cast<std::int64_t>(alignment);
    return (v + a - 1) / a * a;
  };
  std::int64_t at = 0;
  for (const auto& b : g.buffers) {
    if (b.view_of >= 0) continue;
    if (b.bytes < 0) fail("memory layout of graph '" + g.name + "': buffer '" + b.name + "' has a negative size");
    out.offset[static_cast<std::size_t>(b.id)] = at;
    at = align(at + b.bytes);
  }
  for (const auto& b : g.buffers)
    if (b.view_of >= 0)
      out.offset[static_cast<std::size_t>(b.id)] =
          out.offset[static_cast<std::size_t>(g.root_of(b.id))] + g.root_offset(b.id);
  out.scratch_offset = at;
  out.scratch_bytes = scratch_bytes;
  out.total_bytes = align(at + scratch_bytes);
  return out;
}

/// @brief One zero-initialised, aligned host allocation holding every buffer of a graph.
///
/// Made once before the first step; lookups afterwards only index precomputed tables.
/// @code
/// runtime::host_arena mem(g, runtime::make_layout(g));
/// auto w = mem.f32(w_id);           // std::span<float> over buffer w
/// std::fill(w.begin(), w.end(), 0.5f);
/// @endcode
class host_arena {
public:
  host_arena() = default;
  host_arena(const ir::graph& g, memory_layout layout) : host_arena(g, std::move(layout), host_arena()) {}
  /// As above, in `recycled`'s memory where it is large enough and as aligned: a backend that
  /// prepares another plan of the same model (the plan choice) touches no new page.
  host_arena(const ir::graph& g, memory_layout layout, host_arena&& recycled) : layout_(std::move(layout)) {
    CONCERTO_CHECK(layout_.offset.size() == g.buffers.size(),
                   "host arena of graph '" + g.name + "': the layout covers " + std::to_string(layout_.offset.size()) +
                       " buffers, the graph has " + std::to_string(g.buffers.size()));
    const auto total = static_cast<std::size_t>(std::max<std::int64_t>(layout_.total_bytes, 1));
    if (recycled.storage_ && recycled.capacity_ >= total && recycled.storage_.get_deleter().alignment == layout_.alignment) {
      storage_ = std::move(recycled.storage_);
      capacity_ = recycled.capacity_;
    } else {
      recycled.storage_.reset(); // freed before the new one is touched
      storage_ = {static_cast<std::byte*>(::operator new[](total, std::align_val_t(layout_.alignment))),
                  aligned_delete{layout_.alignment}};
      capacity_ = total;
    }
    std::memset(storage_.get(), 0, total);
    for (const auto& b : g.buffers) {
      const auto off = layout_.offset[static_cast<std::size_t>(b.id)];
      if (off < 0 || off + b.bytes > layout_.total_bytes)
        fail("host arena of graph '" + g.name + "': buffer '" + b.name + "' lies outside the arena");
      infos_.push_back({b.name, b.bytes, b.type});
    }
  }

  /// Number of buffers the arena holds.
  [[nodiscard]] std::size_t size() const noexcept { return infos_.size(); }
  [[nodiscard]] const memory_layout& layout() const noexcept { return layout_; }
  /// Start of the whole arena (stable for the arena's life).
  [[nodiscard]] std::byte* data() noexcept { return storage_.get(); }
  [[nodiscard]] std::int64_t total_bytes() const noexcept { return layout_.total_bytes; }

  /// The bytes of a buffer.
  [[nodiscard]] std::span<std::byte> bytes(ir::buffer_id b) {
    const auto& info = at(b);
    return {storage_.get() + layout_.offset[static_cast<std::size_t>(b)], static_cast<std::size_t>(info.bytes)};
  }
  /// A buffer as fp32 values; throws naming the buffer if it holds another type.
  [[nodiscard]] std::span<float> f32(ir::buffer_id b) { return typed<float>(b, ir::dtype::f32); }
  /// A buffer as int32 values (token ids, targets); throws naming the buffer if it holds another type.
  [[nodiscard]] std::span<std::int32_t> i32(ir::buffer_id b) { return typed<std::int32_t>(b, ir::dtype::i32); }
  /// The kernels' workspace region, as floats.
  [[nodiscard]] std::span<float> scratch_f32() {
    return {reinterpret_cast<float*>(storage_.get() + layout_.scratch_offset),
            static_cast<std::size_t>(layout_.scratch_bytes) / sizeof(float)};
  }
  [[nodiscard]] ir::dtype type(ir::buffer_id b) const { return at(b).type; }
  [[nodiscard]] const std::string& name(ir::buffer_id b) const { return at(b).name; }

private:
  struct info {
    std::string name;
    std::int64_t bytes;
    ir::dtype type;
  };
  struct aligned_delete {
    std::size_t alignment = 64;
    void operator()(std::byte* p) const noexcept { ::operator delete[](p, std::align_val_t(alignment)); }
  };

  const info& at(ir::buffer_id b) const {
    if (b < 0 || static_cast<std::size_t>(b) >= infos_.size())
      fail("host arena: buffer " + std::to_string(b) + " does not exist (the arena holds " +
           std::to_string(infos_.size()) + ")");
    return infos_[static_cast<std::size_t>(b)];
  }
  template <class T>
  std::span<T> typed(ir::buffer_id b, ir::dtype want) {
    const auto& info = at(b);
    if (info.type != want)
      fail("buffer '" + info.name + "' holds " + std::string(ir::to_string(info.type)) + ", not " +
           std::string(ir::to_string(want)));
    return {reinterpret_cast<T*>(storage_.get() + layout_.offset[static_cast<std::size_t>(b)]),
            static_cast<std::size_t>(info.bytes) / sizeof(T)};
  }

  memory_layout layout_;
  std::unique_ptr<std::byte, aligned_delete> storage_{nullptr, aligned_delete{}};
  std::size_t capacity_ = 0; ///< bytes allocated (at least the layout's total)
  std::vector<info> infos_;
};

} // namespace concerto::runtime
