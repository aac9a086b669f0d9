#pragma once
/// @file
/// @brief What a collective task moves, whichever library moves it: the operand checks, the
/// in-place forms, the restride of a split along an inner dimension and the element count per
/// call, shared by runtime::mpi::backend and runtime::nccl::backend.
///
/// Both backends resolve each collective once, in prepare. This is the part of that resolution
/// that does not depend on MPI or NCCL, kept in one place so that the two backends accept the
/// same operand layouts and refuse the others with the same messages. What stays in a backend is
/// what only it knows: its datatypes and reduction ops, how it spells "in place" (MPI_IN_PLACE,
/// or NCCL's equal pointers), where its staging buffers live and what packs them. No mpi.h, no
/// CUDA header: the MPI backend is compiled by g++, the NCCL one by nvcc.

#include <concerto/core/error.hpp>
#include <concerto/ir/graph.hpp>

#include <cstddef>
#include <cstdint>
#include <string>
#include <type_traits>

namespace concerto::runtime {

/// @brief A tensor split into `parts` along one dimension: each of `outer` rows holds the parts
/// side by side, `len` bytes each, while a collective wants part k's rows contiguous. The
/// backends move between the two layouts (on the host for MPI, with cuda::restride for NCCL).
struct split_layout {
  std::size_t outer = 0; ///< 0: the parts are already contiguous, nothing to stage
  std::size_t parts = 1, len = 0;
  [[nodiscard]] std::size_t bytes() const noexcept { return outer * parts * len; }
};

/// @brief How a collective's output sits relative to its input, when they are not disjoint.
enum class placement : std::uint8_t {
  separate,    ///< disjoint buffers (or the overlapping side is staged)
  same,        ///< all_reduce or broadcast over the very same bytes
  own_slice,   ///< all_gather's input is this rank's slice of the output, or reduce_scatter's
               ///< output is this rank's slice of the input
  first_shard, ///< reduce_scatter's output is the input's first shard (MPI_IN_PLACE's convention)
};

/// @brief The reduction of an all_reduce or reduce_scatter (task fn "sum", "max" or "min").
enum class reduction : std::uint8_t { sum, max, min };

/// @brief What a backend accepts beyond the rules both share; it names the backend in messages.
struct collective_rules {
  const char* backend = "";                 ///< "MPI", "NCCL"
  bool (*reducible)(ir::dtype) = nullptr;   ///< the dtypes its reductions take; null: all
  std::int64_t max_count = INT64_MAX;       ///< the largest element count one call takes
  const char* bad_count = "";               ///< the end of "<what> of N bytes ..." when a count is refused
  bool scatter_to_own_slice = false;        ///< reduce_scatter may write this rank's slice of its input
};

/// @brief One collective task, resolved: operands, placement, restrides and count.
struct collective_layout {
  std::string who;                        ///< "all_gather 'x' (task 3)", the start of every message
  ir::buffer_id in = -1, out = -1;
  int group = 1;                          ///< ranks of the task's lane
  bool reduces = false;                   ///< all_reduce or reduce_scatter: counts are in elements
  reduction op = reduction::sum;
  placement place = placement::separate;
  split_layout pack;                      ///< the input, packed into blocks before the call
  split_layout unpack;                    ///< the received blocks, unpacked into the output after it
  std::int64_t count = 0;                 ///< elements per call (bytes when it does not reduce)
  int peer = 0;                           ///< broadcast root or send/recv partner, as a lane rank
  int tag = 0;                            ///< send/recv tag
};

namespace detail {

// The split of buffer b into `parts` along `dim`; outer = 0 when the parts are already
// contiguous (dim 0, or only extent-1 dimensions before it), so the call needs no staging.
[[nodiscard]] inline split_layout split_of(const ir::buffer& b, std::int64_t dim, int parts, const std::string& who) {
  split_layout r;
  if (dim <= 0 || b.shape.empty()) return r;
  if (static_cast<std::size_t>(dim) >= b.shape.size())
    fail(who + ": attr dim = " + std::to_string(dim) + " but '" + b.name + "' has rank " + std::to_string(b.shape.size()));
  std::size_t outer = 1, inner = ir::size_of(b.type);
  for (std::int64_t d = 0; d < dim; ++d) outer *= static_cast<std::size_t>(b.shape[static_cast<std::size_t>(d)]);
  for (auto d = static_cast<std::size_t>(dim) + 1; d < b.shape.size(); ++d) inner *= static_cast<std::size_t>(b.shape[d]);
  const auto extent = static_cast<std::size_t>(b.shape[static_cast<std::size_t>(dim)]);
  if (parts <= 0 || extent % static_cast<std::size_t>(parts) != 0)
    fail(who + ": dimension " + std::to_string(dim) + " of '" + b.name + "' (" + std::to_string(extent) +
         ") does not split into " + std::to_string(parts) + " parts");
  if (outer == 1) return r;
  r.outer = outer;
  r.parts = static_cast<std::size_t>(parts);
  r.len = extent / static_cast<std::size_t>(parts) * inner;
  return r;
}

} // namespace detail

/// @brief Checks collective task t's operands and resolves its layout (graph.hpp's conventions;
/// runtime::mpi::backend's file comment lists the in-place forms). `coord` is this rank's
/// coordinate on the task's axis; `address_of(buffer)` gives a buffer's address, host or
/// device, which is only compared (asked for once the operands are known to exist). Throws
/// concerto::error naming the task.
/// @code
/// const auto l = runtime::describe_collective(g, t, coords[t.axis], [&](ir::buffer_id b) { return arena.ptr(b); },
///                                             {.backend = "NCCL", .bad_count = "is not a whole number of elements"});
/// if (l.place == runtime::placement::same) send = recv;
/// @endcode
template <class AddressOf>
  requires std::is_convertible_v<std::invoke_result_t<AddressOf&, ir::buffer_id>, const std::byte*>
[[nodiscard]] collective_layout describe_collective(const ir::graph& g, const ir::task& t, int coord,
                                                    AddressOf&& address_of, const collective_rules& rules) {
  collective_layout l;
  l.who = std::string(ir::to_string(t.kind)) + " '" + t.name + "' (task " + std::to_string(t.id) + ")";
  const auto& who = l.who;
  if (t.reads.size() != 1 || t.writes.size() != 1)
    fail(who + " must read one buffer and write one; it reads " + std::to_string(t.reads.size()) + " and writes " +
         std::to_string(t.writes.size()));
  const auto in = l.in = t.reads[0];
  const auto out = l.out = t.writes[0];
  const auto& bin = g.buffers[static_cast<std::size_t>(in)];
  const auto& bout = g.buffers[static_cast<std::size_t>(out)];
  const int group = l.group = g.group_size(t);
  const bool same = in == out || (g.root_of(in) == g.root_of(out) && g.root_offset(in) == g.root_offset(out) &&
                                  bin.bytes == bout.bytes);
  l.reduces = t.kind == ir::op_kind::all_reduce || t.kind == ir::op_kind::reduce_scatter;
  std::int64_t elem = 1;
  if (l.reduces) {
    if (rules.reducible != nullptr && !rules.reducible(bin.type))
      fail(who + ": reductions of " + std::string(ir::to_string(bin.type)) + " buffers are not supported on " +
           rules.backend);
    elem = static_cast<std::int64_t>(ir::size_of(bin.type));
    if (t.fn == ir::op::sum) l.op = reduction::sum;
    else if (t.fn == ir::op::max) l.op = reduction::max;
    else if (t.fn == ir::op::min) l.op = reduction::min;
    else fail(who + " has fn '" + std::string(ir::to_string(t.fn)) + "'; the " + rules.backend + " backend reduces with sum, max or min");
  }
  const auto count = [&](std::int64_t bytes, const char* what) {
    if (bytes % elem != 0 || bytes / elem > rules.max_count)
      fail(who + ": " + what + " of " + std::to_string(bytes) + " bytes " + rules.bad_count);
    return bytes / elem;
  };
  const auto need_disjoint = [&] {
    if (g.overlap(in, out)) fail(who + ": input '" + bin.name + "' and output '" + bout.name + "' overlap");
  };
  // A gather's output, a scatter's input: `group` shards.
  const auto need_shards = [&](const ir::buffer& whole, const char* whole_is, const ir::buffer& shard, const char* shard_is) {
    if (whole.bytes != shard.bytes * group)
      fail(who + ": " + whole_is + " '" + whole.name + "' holds " + std::to_string(whole.bytes) + " bytes, expected " +
           std::to_string(group) + " x " + shard_is + " '" + shard.name + "' (" + std::to_string(shard.bytes) + ")");
  };
  switch (t.kind) {
  case ir::op_kind::all_reduce:
    if (bin.bytes != bout.bytes) fail(who + ": input and output sizes differ");
    if (same) l.place = placement::same;
    else need_disjoint();
    l.count = count(bin.bytes, "the buffer");
    break;
  case ir::op_kind::all_gather:
    need_shards(bout, "output", bin, "the shard");
    l.unpack = detail::split_of(bout, t.attr("dim", 0), group, who);
    if (l.unpack.outer > 0) { // gathered along an inner dimension: receive blocks, then interleave
      need_disjoint();
    } else if (g.overlap(in, out)) {
      const std::byte* in_addr = address_of(in);
      const std::byte* out_addr = address_of(out);
      if (in_addr != out_addr + static_cast<std::ptrdiff_t>(bin.bytes) * coord)
        fail(who + ": input '" + bin.name + "' overlaps the output but is not this rank's slice of it");
      l.place = placement::own_slice;
    }
    l.count = count(bin.bytes, "the shard");
    break;
  case ir::op_kind::reduce_scatter:
    need_shards(bin, "input", bout, "the output shard");
    l.pack = detail::split_of(bin, t.attr("dim", 0), group, who);
    if (l.pack.outer > 0) { // scattered along an inner dimension: make each rank's part contiguous first
      need_disjoint();
    } else if (g.overlap(in, out)) {
      const std::byte* in_addr = address_of(in);
      const std::byte* out_addr = address_of(out);
      const auto* mine = in_addr + static_cast<std::ptrdiff_t>(bout.bytes) * coord;
      if (rules.scatter_to_own_slice && out_addr == mine) l.place = placement::own_slice;
      else if (out_addr == in_addr) l.place = placement::first_shard;
      else if (rules.scatter_to_own_slice)
        fail(who + ": output '" + bout.name + "' overlaps the input but is neither its first shard nor this rank's");
      else fail(who + ": output '" + bout.name + "' overlaps the input but is not its first shard");
    }
    l.count = count(bout.bytes, "the shard");
    break;
  case ir::op_kind::all_to_all:
    if (bin.bytes != bout.bytes) fail(who + ": input and output sizes differ");
    if (bin.bytes % group != 0) fail(who + ": the buffer does not split into " + std::to_string(group) + " blocks");
    need_disjoint();
    // Block k of the input is part k along to_dim; the block from coordinate j is part j of the
    // output along from_dim.
    l.pack = detail::split_of(bin, t.attr("to_dim", 0), group, who);
    l.unpack = detail::split_of(bout, t.attr("from_dim", 0), group, who);
    l.count = count(bin.bytes / group, "a block");
    break;
  case ir::op_kind::broadcast:
    if (bin.bytes != bout.bytes) fail(who + ": input and output sizes differ");
    l.peer = static_cast<int>(t.attr("root", 0));
    if (l.peer < 0 || l.peer >= group) fail(who + ": root " + std::to_string(l.peer) + " is outside the group");
    if (same) l.place = placement::same;
    else need_disjoint();
    l.count = count(bout.bytes, "the buffer");
    break;
  case ir::op_kind::send:
  case ir::op_kind::recv: {
    const auto peer = t.attrs.count("peer") ? t.attr("peer") : ((coord + t.attr("shift", 1)) % group + group) % group;
    if (peer < 0 || peer >= group) fail(who + ": peer " + std::to_string(peer) + " is outside the group");
    l.peer = static_cast<int>(peer);
    l.tag = static_cast<int>(t.attr("tag", 0));
    l.count = count(t.kind == ir::op_kind::send ? bin.bytes : bout.bytes, "the message");
    break;
  }
  default: fail(who + " is not a collective");
  }
  return l;
}

} // namespace concerto::runtime
