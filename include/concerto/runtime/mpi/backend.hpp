#pragma once
/// @file
/// @brief The CPU backend: MPI ranks, one communicator per communication lane, CPU kernels.
///
/// Every collective is non-blocking (MPI_Iallreduce, MPI_Iallgather,
/// MPI_Ireduce_scatter_block, MPI_Ialltoall, MPI_Ibcast, MPI_Isend/MPI_Irecv) on its lane's
/// own communicator; the executor tests the requests between kernels, which is what makes
/// Open MPI progress them. A lane's communicator holds the ranks that share every mesh
/// coordinate except the lane's axis (ranks are laid out row-major over the graph's axes,
/// see concerto::mesh), ordered by their coordinate on that axis, so rank i of the lane is
/// coordinate i. Each lane gets its own MPI_Comm_split, so no two lanes share a communicator
/// even when they run over the same axis.
///
/// Collective operands (graph.hpp's conventions): all_reduce and broadcast work in place when
/// the input and output are the same buffer; all_gather's input is this rank's shard and may
/// be the matching slice of the output (in place); reduce_scatter's output is this rank's
/// shard and may be the first shard of the input only when it is that very slice; all_to_all
/// needs disjoint buffers. all_gather and reduce_scatter along a dimension other than the
/// leading one (attr `dim`, the DSL's sequence parallelism), and all_to_all between dimensions
/// (attrs `from_dim`, `to_dim`), go through a staging buffer made in prepare: the parts are packed
/// into MPI's contiguous blocks before the call and unpacked when the request is seen complete.
/// fn "sum" (default), "max" or "min" picks the reduction. Attrs:
/// broadcast "root" (coordinate on the axis, default 0); send/recv "peer" (coordinate) or
/// "shift" (peer = coordinate + shift mod size) and "tag" (default 0).

#include <concerto/core/error.hpp>
#include <concerto/ir/graph.hpp>
#include <concerto/mesh/mesh.hpp>
#include <concerto/plan/plan.hpp>
#include <concerto/runtime/backend.hpp>
#include <concerto/runtime/buffers.hpp>
#include <concerto/runtime/dispatch.hpp>
#include <concerto/runtime/mpi/environment.hpp>

#include <mpi.h>

#include <climits>
#include <cstdint>
#include <cstring>
#include <optional>
#include <span>
#include <string>
#include <thread>
#include <vector>

namespace concerto::runtime::mpi {

/// @brief How the MPI backend runs.
struct backend_options {
  kernel_settings kernels{};         ///< optimizer hyperparameters and the like
  int blas_threads = 1;              ///< per rank: the ranks already fill the cores
  MPI_Comm world = MPI_COMM_WORLD;   ///< the ranks the plan's mesh covers
};

/// @brief MPI + CPU kernels behind the runtime::backend concept.
/// @code
/// runtime::mpi::environment env(argc, argv);
/// runtime::mpi::backend be;
/// runtime::executor ex(plan, be);        // calls be.prepare(plan)
/// auto w = be.buffers().f32(w_id);       // fill parameters and inputs
/// ex.run_step();
/// @endcode
class backend {
public:
  /// An in-flight collective: the MPI request and the task, whose staged output (if any) is
  /// unpacked when `test` or `wait_any` sees the request complete.
  struct handle {
    MPI_Request request = MPI_REQUEST_NULL;
    ir::task_id task = -1;
  };
  static constexpr bool stream_ordered = false;

  explicit backend(backend_options options = {}) : options_(options) {
    check(MPI_Comm_rank(options_.world, &rank_), "MPI_Comm_rank");
    check(MPI_Comm_size(options_.world, &size_), "MPI_Comm_size");
  }
  backend(const backend&) = delete;
  backend& operator=(const backend&) = delete;

  [[nodiscard]] int rank() const noexcept { return rank_; }
  [[nodiscard]] int world_size() const noexcept { return size_; }
  /// The plan's mesh (valid after prepare).
  [[nodiscard]] const concerto::mesh& mesh() const noexcept { return mesh_; }
  /// This rank's coordinate on each mesh axis.
  [[nodiscard]] const std::vector<int>& coords() const noexcept { return coords_; }
  /// The buffers of the plan (valid after prepare): fill inputs and parameters, read results.
  [[nodiscard]] host_arena& buffers() noexcept { return arena_; }
  /// @brief Copies host bytes into buffer b (valid after prepare, between steps). The same
  /// pair exists on runtime::nccl::backend, so code that fills parameters and inputs and reads
  /// the loss is written once; it allocates nothing, so a step's steady state stays allocation-free.
  /// @code
  /// be.write(x_id, std::as_bytes(std::span(x)));
  /// @endcode
  void write(ir::buffer_id b, std::span<const std::byte> bytes) {
    const auto dst = arena_.bytes(b);
    CONCERTO_CHECK(dst.size() == bytes.size(), "write into buffer '" + arena_.name(b) + "': it holds " +
                                                   std::to_string(dst.size()) + " bytes, " +
                                                   std::to_string(bytes.size()) + " given");
    if (!bytes.empty()) std::memcpy(dst.data(), bytes.data(), bytes.size());
  }
  /// @brief Copies buffer b into host bytes (`out` must be exactly its size); allocates nothing.
  /// @code
  /// float loss = 0;
  /// be.read(loss_id, std::as_writable_bytes(std::span(&loss, 1)));
  /// @endcode
  void read(ir::buffer_id b, std::span<std::byte> out) {
    const auto src = arena_.bytes(b);
    CONCERTO_CHECK(src.size() == out.size(), "read of buffer '" + arena_.name(b) + "': it holds " +
                                                 std::to_string(src.size()) + " bytes, " + std::to_string(out.size()) +
                                                 " asked for");
    if (!out.empty()) std::memcpy(out.data(), src.data(), out.size());
  }
  [[nodiscard]] kernel_settings& settings() noexcept { return options_.kernels; }
  /// The communicator of a lane (stream id), for tests and tools.
  [[nodiscard]] MPI_Comm lane_communicator(ir::stream_id s) const { return lanes_.at(static_cast<std::size_t>(s)).get(); }

  /// Builds the mesh, the lane communicators and the arena; resolves every task. Collective
  /// over the world: every rank calls it (the executor's constructor does).
  void prepare(const plan::plan& p) {
    graph_ = &p.graph;
    const auto& g = p.graph;
    mesh_ = concerto::mesh(g.axes);
    if (mesh_.rank_count() != size_) {
      std::string dims;
      for (const auto& a : g.axes) dims += (dims.empty() ? "" : "x") + a.name + "=" + std::to_string(a.size);
      fail("the plan of graph '" + g.name + "' is for a mesh of " + std::to_string(mesh_.rank_count()) + " ranks (" +
           (dims.empty() ? "no axes" : dims) + ") but the MPI world has " + std::to_string(size_));
    }
    coords_ = mesh_.coords(rank_);
    options_.kernels.coords = coords_;
    runtime::cpu::init_blas_threads(options_.blas_threads);
    lanes_.clear();
    lanes_.resize(g.streams.size());
    for (std::size_t s = 1; s < g.streams.size(); ++s) {
      const auto& axis = g.axes.at(static_cast<std::size_t>(g.streams[s].axis));
      lanes_[s] = communicator::split(options_.world, mesh_.group_index(axis.name, rank_),
                                      coords_[static_cast<std::size_t>(g.streams[s].axis)]);
      if (lanes_[s].size() != axis.size)
        fail("lane '" + g.streams[s].name + "' has " + std::to_string(lanes_[s].size()) + " ranks, mesh axis '" +
             axis.name + "' has size " + std::to_string(axis.size));
    }
    arena_ = host_arena(g, make_layout(g, workspace_bytes(g)));
    kernels_.assign(g.tasks.size(), kernel::copy);
    calls_.assign(g.tasks.size(), {});
    for (const auto& t : g.tasks) {
      if (ir::is_collective(t.kind))
        calls_[static_cast<std::size_t>(t.id)] = describe_call(t);
      else
        kernels_[static_cast<std::size_t>(t.id)] = resolve(t);
    }
  }

  void begin_step(std::int64_t step) { options_.kernels.step = step; }
  void end_step() {}

  void run_compute(const ir::task& t) {
    run_kernel(*graph_, t, kernels_[static_cast<std::size_t>(t.id)], arena_, options_.kernels);
  }

  handle start_collective(const ir::task& t) {
    auto& c = calls_[static_cast<std::size_t>(t.id)];
    if (c.pack.outer > 0) c.pack.apply(static_cast<const std::byte*>(c.pack_from), c.stage_send.data(), true);
    MPI_Request r = MPI_REQUEST_NULL;
    int rc = MPI_SUCCESS;
    switch (t.kind) {
    case ir::op_kind::all_reduce: rc = MPI_Iallreduce(c.send, c.recv, c.count, c.type, c.op, c.comm, &r); break;
    case ir::op_kind::all_gather: rc = MPI_Iallgather(c.send, c.count, c.type, c.recv, c.count, c.type, c.comm, &r); break;
    case ir::op_kind::reduce_scatter: rc = MPI_Ireduce_scatter_block(c.send, c.recv, c.count, c.type, c.op, c.comm, &r); break;
    case ir::op_kind::all_to_all: rc = MPI_Ialltoall(c.send, c.count, c.type, c.recv, c.count, c.type, c.comm, &r); break;
    case ir::op_kind::broadcast:
      if (c.send != nullptr && c.peer == coord_on(t)) std::memcpy(c.recv, c.send, c.copy_bytes);
      rc = MPI_Ibcast(c.recv, c.count, c.type, c.peer, c.comm, &r);
      break;
    case ir::op_kind::send: rc = MPI_Isend(c.send, c.count, c.type, c.peer, c.tag, c.comm, &r); break;
    case ir::op_kind::recv: rc = MPI_Irecv(c.recv, c.count, c.type, c.peer, c.tag, c.comm, &r); break;
    default: fail("task '" + t.name + "' is not a collective");
    }
    if (rc != MPI_SUCCESS) check(rc, ("starting " + std::string(ir::to_string(t.kind)) + " '" + t.name + "'").c_str());
    return {r, t.id};
  }

  bool test(handle& h) {
    int flag = 0;
    check(MPI_Test(&h.request, &flag, MPI_STATUS_IGNORE), "MPI_Test");
    if (flag != 0) finish(h);
    return flag != 0;
  }

  /// Polls the requests until one completes or the deadline passes, yielding the core between
  /// polls (ranks may outnumber cores).
  std::optional<std::size_t> wait_any(std::span<handle> in_flight, clock::time_point deadline) {
    if (in_flight.empty()) return std::nullopt;
    for (std::uint64_t polls = 0;; ++polls) {
      for (std::size_t i = 0; i < in_flight.size(); ++i)
        if (test(in_flight[i])) return i;
      if ((polls & 63) == 0 && clock::now() >= deadline) return std::nullopt;
      if (polls > 1000) std::this_thread::sleep_for(std::chrono::microseconds(20));
      else std::this_thread::yield();
    }
  }

  void record(const ir::task&) {}
  void stream_wait(ir::stream_id, const ir::task&) {}

  void broadcast(std::string& bytes, int root) {
    auto n = static_cast<long long>(bytes.size());
    check(MPI_Bcast(&n, 1, MPI_LONG_LONG, root, options_.world), "MPI_Bcast");
    CONCERTO_CHECK(n <= INT_MAX, "broadcast of " + std::to_string(n) + " bytes exceeds MPI's int count");
    bytes.resize(static_cast<std::size_t>(n));
    if (n > 0) check(MPI_Bcast(bytes.data(), static_cast<int>(n), MPI_CHAR, root, options_.world), "MPI_Bcast");
  }
  std::int64_t min_all(std::int64_t v) {
    std::int64_t out = 0;
    check(MPI_Allreduce(&v, &out, 1, MPI_INT64_T, MPI_MIN, options_.world), "MPI_Allreduce");
    return out;
  }
  void barrier() { check(MPI_Barrier(options_.world), "MPI_Barrier"); }

private:
  // Moves `parts` blocks between a tensor laid out whole along one dimension (each of `outer`
  // rows holds the parts side by side, `len` bytes each) and MPI's layout (part k's rows contiguous).
  struct restride {
    std::size_t outer = 0; ///< 0: no staging
    std::size_t parts = 1, len = 0;
    void apply(const std::byte* from, std::byte* to, bool to_blocks) const {
      for (std::size_t k = 0; k < parts; ++k)
        for (std::size_t o = 0; o < outer; ++o) {
          const auto whole = (o * parts + k) * len, block = (k * outer + o) * len;
          std::memcpy(to + (to_blocks ? block : whole), from + (to_blocks ? whole : block), len);
        }
    }
  };

  // Everything an MPI call needs, resolved once in prepare so a step only switches on it.
  struct call {
    restride pack, unpack;            ///< before the call (input -> stage_send), after (stage_recv -> output)
    const void* pack_from = nullptr;
    void* unpack_to = nullptr;
    std::vector<std::byte> stage_send, stage_recv;
    const void* send = nullptr;
    void* recv = nullptr;
    int count = 0;
    MPI_Datatype type = MPI_BYTE;
    MPI_Op op = MPI_SUM;
    MPI_Comm comm = MPI_COMM_NULL;
    int peer = 0; ///< broadcast root or send/recv partner, as a lane rank
    int tag = 0;
    std::size_t copy_bytes = 0; ///< broadcast from a separate input: bytes copied on the root
  };

  int coord_on(const ir::task& t) const { return coords_[static_cast<std::size_t>(t.axis)]; }

  void finish(const handle& h) {
    if (h.task < 0) return;
    auto& c = calls_[static_cast<std::size_t>(h.task)];
    if (c.unpack.outer > 0) c.unpack.apply(c.stage_recv.data(), static_cast<std::byte*>(c.unpack_to), false);
  }

  // The restride of buffer b split into `parts` along `dim`; outer = 0 when the parts are
  // already contiguous (dim 0, or every dimension before it has extent 1).
  static restride split_of(const ir::buffer& b, std::int64_t dim, int parts, const std::string& who) {
    restride r;
    if (dim <= 0 || b.shape.empty()) return r;
    if (static_cast<std::size_t>(dim) >= b.shape.size())
      fail(who + ": attr dim = " + std::to_string(dim) + " but '" + b.name + "' has rank " + std::to_string(b.shape.size()));
    std::size_t outer = 1, inner = ir::size_of(b.type);
    for (std::int64_t d = 0; d < dim; ++d) outer *= static_cast<std::size_t>(b.shape[static_cast<std::size_t>(d)]);
    for (auto d = static_cast<std::size_t>(dim) + 1; d < b.shape.size(); ++d) inner *= static_cast<std::size_t>(b.shape[d]);
    const auto extent = static_cast<std::size_t>(b.shape[static_cast<std::size_t>(dim)]);
    if (extent % static_cast<std::size_t>(parts) != 0)
      fail(who + ": dimension " + std::to_string(dim) + " of '" + b.name + "' (" + std::to_string(extent) +
           ") does not split into " + std::to_string(parts) + " parts");
    if (outer == 1) return r;
    r.outer = outer;
    r.parts = static_cast<std::size_t>(parts);
    r.len = extent / static_cast<std::size_t>(parts) * inner;
    return r;
  }

  call describe_call(const ir::task& t) {
    const auto& g = *graph_;
    const auto who = std::string(ir::to_string(t.kind)) + " '" + t.name + "' (task " + std::to_string(t.id) + ")";
    if (t.reads.size() != 1 || t.writes.size() != 1)
      fail(who + " must read one buffer and write one; it reads " + std::to_string(t.reads.size()) + " and writes " +
           std::to_string(t.writes.size()));
    const auto in = t.reads[0], out = t.writes[0];
    const auto& bin = g.buffers[static_cast<std::size_t>(in)];
    const auto& bout = g.buffers[static_cast<std::size_t>(out)];
    const int group = g.group_size(t);
    call c;
    c.comm = lanes_.at(static_cast<std::size_t>(t.stream)).get();
    const bool same = in == out || (g.root_of(in) == g.root_of(out) && g.root_offset(in) == g.root_offset(out) &&
                                    bin.bytes == bout.bytes);
    const bool reduces = t.kind == ir::op_kind::all_reduce || t.kind == ir::op_kind::reduce_scatter;
    std::size_t elem = 1;
    if (reduces) {
      switch (bin.type) {
      case ir::dtype::f32: c.type = MPI_FLOAT; break;
      case ir::dtype::i32: c.type = MPI_INT32_T; break;
      case ir::dtype::i64: c.type = MPI_INT64_T; break;
      default: fail(who + ": reductions of " + std::string(ir::to_string(bin.type)) + " buffers are not supported on MPI");
      }
      elem = ir::size_of(bin.type);
      if (t.fn.empty() || t.fn == "sum") c.op = MPI_SUM;
      else if (t.fn == "max") c.op = MPI_MAX;
      else if (t.fn == "min") c.op = MPI_MIN;
      else fail(who + " has fn '" + t.fn + "'; the MPI backend reduces with sum, max or min");
    }
    const auto count = [&](std::int64_t bytes, const char* what) {
      if (bytes % static_cast<std::int64_t>(elem) != 0 || bytes / static_cast<std::int64_t>(elem) > INT_MAX)
        fail(who + ": " + what + " of " + std::to_string(bytes) + " bytes is not a count MPI can take");
      return static_cast<int>(bytes / static_cast<std::int64_t>(elem));
    };
    const auto need_disjoint = [&] {
      if (g.overlap(in, out)) fail(who + ": input '" + bin.name + "' and output '" + bout.name + "' overlap");
    };
    auto* pin = arena_.bytes(in).data();
    auto* pout = arena_.bytes(out).data();
    c.send = pin;
    c.recv = pout;
    switch (t.kind) {
    case ir::op_kind::all_reduce:
      if (bin.bytes != bout.bytes) fail(who + ": input and output sizes differ");
      if (same) c.send = MPI_IN_PLACE;
      else need_disjoint();
      c.count = count(bin.bytes, "the buffer");
      break;
    case ir::op_kind::all_gather:
      if (bout.bytes != bin.bytes * group)
        fail(who + ": output '" + bout.name + "' holds " + std::to_string(bout.bytes) + " bytes, expected " +
             std::to_string(group) + " x the shard '" + bin.name + "' (" + std::to_string(bin.bytes) + ")");
      c.unpack = split_of(bout, t.attr("dim", 0), group, who);
      if (c.unpack.outer > 0) { // gathered along an inner dimension: receive blocks, then interleave
        need_disjoint();
        c.stage_recv.resize(static_cast<std::size_t>(bout.bytes));
        c.recv = c.stage_recv.data();
        c.unpack_to = pout;
      } else if (g.overlap(in, out)) {
        if (pin != pout + static_cast<std::ptrdiff_t>(bin.bytes) * coord_on(t))
          fail(who + ": input '" + bin.name + "' overlaps the output but is not this rank's slice of it");
        c.send = MPI_IN_PLACE;
      }
      c.count = count(bin.bytes, "the shard");
      break;
    case ir::op_kind::reduce_scatter:
      if (bin.bytes != bout.bytes * group)
        fail(who + ": input '" + bin.name + "' holds " + std::to_string(bin.bytes) + " bytes, expected " +
             std::to_string(group) + " x the output shard '" + bout.name + "' (" + std::to_string(bout.bytes) + ")");
      c.pack = split_of(bin, t.attr("dim", 0), group, who);
      if (c.pack.outer > 0) { // scattered along an inner dimension: make each rank's part contiguous first
        need_disjoint();
        c.stage_send.resize(static_cast<std::size_t>(bin.bytes));
        c.send = c.stage_send.data();
        c.pack_from = pin;
      } else if (g.overlap(in, out)) {
        // MPI_IN_PLACE reads the whole input from the receive buffer and leaves the result at its start.
        if (pin != pout) fail(who + ": output '" + bout.name + "' overlaps the input but is not its first shard");
        c.send = MPI_IN_PLACE;
        c.recv = pin;
      }
      c.count = count(bout.bytes, "the shard");
      break;
    case ir::op_kind::all_to_all:
      if (bin.bytes != bout.bytes) fail(who + ": input and output sizes differ");
      if (bin.bytes % group != 0) fail(who + ": the buffer does not split into " + std::to_string(group) + " blocks");
      need_disjoint();
      // Block k of the input is part k along to_dim; the block from coordinate j is part j of the
      // output along from_dim.
      c.pack = split_of(bin, t.attr("to_dim", 0), group, who);
      c.unpack = split_of(bout, t.attr("from_dim", 0), group, who);
      if (c.pack.outer > 0) {
        c.stage_send.resize(static_cast<std::size_t>(bin.bytes));
        c.send = c.stage_send.data();
        c.pack_from = pin;
      }
      if (c.unpack.outer > 0) {
        c.stage_recv.resize(static_cast<std::size_t>(bout.bytes));
        c.recv = c.stage_recv.data();
        c.unpack_to = pout;
      }
      c.count = count(bin.bytes / group, "a block");
      break;
    case ir::op_kind::broadcast:
      if (bin.bytes != bout.bytes) fail(who + ": input and output sizes differ");
      c.peer = static_cast<int>(t.attr("root", 0));
      if (c.peer < 0 || c.peer >= group) fail(who + ": root " + std::to_string(c.peer) + " is outside the group");
      if (same) c.send = nullptr;
      else {
        need_disjoint();
        c.copy_bytes = static_cast<std::size_t>(bin.bytes);
      }
      c.count = count(bout.bytes, "the buffer");
      break;
    case ir::op_kind::send:
    case ir::op_kind::recv: {
      const auto peer = t.attrs.count("peer") ? t.attr("peer")
                                              : ((coord_on(t) + t.attr("shift", 1)) % group + group) % group;
      if (peer < 0 || peer >= group) fail(who + ": peer " + std::to_string(peer) + " is outside the group");
      c.peer = static_cast<int>(peer);
      c.tag = static_cast<int>(t.attr("tag", 0));
      c.count = count(t.kind == ir::op_kind::send ? bin.bytes : bout.bytes, "the message");
      break;
    }
    default: fail(who + " is not a collective");
    }
    return c;
  }

  backend_options options_;
  int rank_ = 0, size_ = 1;
  const ir::graph* graph_ = nullptr;
  concerto::mesh mesh_;
  std::vector<int> coords_;
  std::vector<communicator> lanes_;
  host_arena arena_;
  std::vector<kernel> kernels_;
  std::vector<call> calls_;
};

static_assert(runtime::backend<backend>);

} // namespace concerto::runtime::mpi
