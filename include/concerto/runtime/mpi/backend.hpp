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
#include <concerto/runtime/collective_layout.hpp>
#include <concerto/runtime/dispatch.hpp>
#include <concerto/runtime/mpi/control.hpp>
#include <concerto/runtime/mpi/channel.hpp>
#include <concerto/runtime/mpi/communicator.hpp>
#include <concerto/runtime/mpi/environment.hpp>
#include <concerto/runtime/mpi/float16_reduce.hpp>

#include <mpi.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <map>
#include <optional>
#include <span>
#include <string>
#include <vector>

namespace concerto::runtime::mpi {

/// @brief How the MPI backend runs.
struct backend_options {
  kernel_settings kernels{};         ///< optimizer hyperparameters and the like
  int blas_threads = 1;              ///< per rank: the ranks already fill the cores
  MPI_Comm world = MPI_COMM_WORLD;   ///< the ranks the plan's mesh covers
  /// Longest wait of the plan broadcast and agreement checks (the executor bounds the step's
  /// collectives with its own executor_options::timeout_s, by default the same).
  double timeout_s = default_timeout_s;
  bool timeout_from_env = true;      ///< CONCERTO_TIMEOUT_S (seconds), when set, overrides timeout_s
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

  explicit backend(backend_options options = {})
      : options_(options),
        control_(options_.world, detail::resolve_timeout_s(options_.timeout_s, options_.timeout_from_env, "mpi::backend")) {
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
    mesh_ = mesh_of_plan(g, size_);
    coords_ = mesh_.coords(rank_);
    options_.kernels.coords = coords_;
    runtime::cpu::init_blas_threads(options_.blas_threads);
    // A plan with the lanes of the last one prepared (the plan choice switches between plans of
    // one mesh) keeps their communicators: every rank prepares the same plans in the same order,
    // so all keep them or all split.
    if (auto lanes = lane_signature(g); lanes != lane_signature_ || lanes_.empty()) {
      lanes_.clear();
      lanes_.resize(g.streams.size());
      for (std::size_t s = 1; s < g.streams.size(); ++s) {
        const auto a = static_cast<std::size_t>(g.streams[s].axis);
        const auto& axis = g.axes.at(a);
        // Each lane is a copy of its axis's group, made without blocking; the group itself is
        // split once per axis (a blocking call, under control::split's deadline and watchdog).
        std::string key = axis.name + " of";
        for (const auto& m : g.axes) key += " " + m.name + "=" + std::to_string(m.size);
        auto group = axis_groups_.find(key);
        if (group == axis_groups_.end())
          group = axis_groups_.emplace(key, control_.split(mesh_.group_index(axis.name, rank_), coords_[a],
                                                            "the communicators of mesh axis '" + axis.name + "' (its lanes)")).first;
        lanes_[s] = control_.duplicate(group->second, "the communicator of lane '" + g.streams[s].name + "'");
        if (lanes_[s].size() != axis.size)
          fail("lane '" + g.streams[s].name + "' has " + std::to_string(lanes_[s].size()) + " ranks, mesh axis '" +
               axis.name + "' has size " + std::to_string(axis.size));
      }
      lane_signature_ = std::move(lanes);
    }
    arena_ = host_arena(g, make_layout(g, workspace_bytes(g)), std::move(arena_)); // another plan reuses the memory
    kernels_.assign(g.tasks.size(), {});
    calls_.assign(g.tasks.size(), {});
    for (const auto& t : g.tasks) {
      if (ir::is_collective(t.kind))
        calls_[static_cast<std::size_t>(t.id)] = describe_call(t);
      else
        kernels_[static_cast<std::size_t>(t.id)] = decode(g, t, coords_);
    }
  }

  /// The first NaN or infinity among the f32 values task `t` wrote (its workspace aside).
  [[nodiscard]] std::optional<runtime::non_finite_output> first_non_finite(const ir::task& t) {
    for (const auto b : t.writes) {
      const auto type = arena_.type(b);
      if ((type != ir::dtype::f32 && !ir::is_16bit_float(type)) ||
          graph_->buffers[static_cast<std::size_t>(b)].role == ir::buffer_role::workspace)
        continue;
      if (ir::is_16bit_float(type)) {
        const auto raw = arena_.bytes(b);
        const std::span<const std::uint16_t> values(reinterpret_cast<const std::uint16_t*>(raw.data()), raw.size() / 2);
        const auto bad = std::ranges::find_if(values, [&](std::uint16_t v) { return !std::isfinite(widen_16bit(type, v)); });
        if (bad != values.end())
          return runtime::non_finite_output{.buffer = b, .element = bad - values.begin(), .value = widen_16bit(type, *bad)};
        continue;
      }
      const auto values = arena_.f32(b);
      const auto bad = std::ranges::find_if(values, [](float v) { return !std::isfinite(v); });
      if (bad != values.end())
        return runtime::non_finite_output{.buffer = b, .element = bad - values.begin(), .value = *bad};
    }
    return std::nullopt;
  }

  void begin_step(std::int64_t step) { options_.kernels.step = step; }
  void end_step() {}

  void run_compute(const ir::task& t) {
    run_kernel(kernels_[static_cast<std::size_t>(t.id)], arena_, options_.kernels);
  }

  handle start_collective(const ir::task& t) {
    auto& c = calls_[static_cast<std::size_t>(t.id)];
    if (c.pack.outer > 0) restride(c.pack, static_cast<const std::byte*>(c.pack_from), c.stage_send.data(), true);
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
    std::optional<std::size_t> done;
    auto& ch = channel::get();
    channel::waiting here(ch, detail::step_wait_text(options_.kernels.step));
    std::uint64_t polls = 0;
    detail::poll_until(deadline, [&] {
      if ((++polls & 63) == 0) ch.serve(); // other ranks' questions, rank 0: their failures
      for (std::size_t i = 0; i < in_flight.size() && !done; ++i)
        if (test(in_flight[i])) done = i;
      return done.has_value() || in_flight.empty();
    });
    return done;
  }

  void record(const ir::task&) {}
  void stream_wait(ir::stream_id, const ir::task&) {}

  /// Where the other ranks of task `t`'s lane are (runtime/mpi/channel.hpp), for a timeout's
  /// message; `waiting` is what this rank waits for.
  [[nodiscard]] std::string whereabouts(const ir::task& t, std::string_view waiting) {
    const auto ranks = world_ranks_of(lanes_.at(static_cast<std::size_t>(t.stream)).get());
    return channel::get().whereabouts(ranks, std::min(1.0, control_.timeout_s()), waiting);
  }

  void broadcast(std::string& bytes, int root, std::string_view what) { control_.broadcast(bytes, root, what); }
  std::int64_t min_all(std::int64_t v, std::string_view what) { return control_.min_all(v, what); }
  void barrier(std::string_view what) { control_.barrier(what); }

private:
  // Moves the parts of a split between the tensor's own layout and MPI's contiguous blocks,
  // on the host: MPI has no strided collectives (the NCCL backend does this with a kernel).
  static void restride(const split_layout& r, const std::byte* from, std::byte* to, bool to_blocks) {
    for (std::size_t k = 0; k < r.parts; ++k)
      for (std::size_t o = 0; o < r.outer; ++o) {
        const auto whole = (o * r.parts + k) * r.len, block = (k * r.outer + o) * r.len;
        std::memcpy(to + (to_blocks ? block : whole), from + (to_blocks ? whole : block), r.len);
      }
  }

  // Everything an MPI call needs, resolved once in prepare so a step only switches on it.
  struct call {
    split_layout pack, unpack;        ///< before the call (input -> stage_send), after (stage_recv -> output)
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
    if (c.unpack.outer > 0) restride(c.unpack, c.stage_recv.data(), static_cast<std::byte*>(c.unpack_to), false);
  }

  // The MPI type of a reduction's elements; MPI_DATATYPE_NULL for the dtypes MPI does not reduce
  // here. bf16 and f16 travel as 16-bit words that float16_op combines.
  static MPI_Datatype reduce_type(ir::dtype d) noexcept {
    switch (d) {
    case ir::dtype::f32: return MPI_FLOAT;
    case ir::dtype::bf16:
    case ir::dtype::f16: return MPI_UINT16_T;
    case ir::dtype::i32: return MPI_INT32_T;
    case ir::dtype::i64: return MPI_INT64_T;
    default: return MPI_DATATYPE_NULL;
    }
  }

  // The checks and the layout are runtime::describe_collective's; what is left is MPI's own:
  // its types and ops, MPI_IN_PLACE, and staging in host vectors owned by the call.
  call describe_call(const ir::task& t) {
    const auto& g = *graph_;
    const auto address_of = [&](ir::buffer_id b) { return arena_.bytes(b).data(); };
    const auto l = describe_collective(g, t, coord_on(t), address_of,
                                       {.backend = "MPI",
                                        .reducible = [](ir::dtype d) { return reduce_type(d) != MPI_DATATYPE_NULL; },
                                        .max_count = INT_MAX,
                                        .bad_count = "is not a count MPI can take"});
    const auto& bin = g.buffers[static_cast<std::size_t>(l.in)];
    const auto& bout = g.buffers[static_cast<std::size_t>(l.out)];
    auto* pin = address_of(l.in);
    auto* pout = address_of(l.out);
    call c;
    c.comm = lanes_.at(static_cast<std::size_t>(t.stream)).get();
    if (l.reduces) {
      c.type = reduce_type(bin.type);
      c.op = ir::is_16bit_float(bin.type) ? float16_op(bin.type, l.op)
             : l.op == reduction::max     ? MPI_MAX
             : l.op == reduction::min     ? MPI_MIN
                                          : MPI_SUM;
    }
    c.count = static_cast<int>(l.count);
    c.peer = l.peer;
    c.tag = l.tag;
    c.send = pin;
    c.recv = pout;
    c.pack = l.pack;
    c.unpack = l.unpack;
    if (l.pack.outer > 0) { // each rank's part made contiguous before the call
      c.stage_send.resize(static_cast<std::size_t>(bin.bytes));
      c.send = c.stage_send.data();
      c.pack_from = pin;
    }
    if (l.unpack.outer > 0) { // blocks received, then interleaved along the inner dimension
      c.stage_recv.resize(static_cast<std::size_t>(bout.bytes));
      c.recv = c.stage_recv.data();
      c.unpack_to = pout;
    }
    switch (l.place) {
    case placement::separate:
      if (t.kind == ir::op_kind::broadcast) c.copy_bytes = static_cast<std::size_t>(bin.bytes); // copied on the root
      break;
    case placement::same:
      c.send = t.kind == ir::op_kind::broadcast ? nullptr : MPI_IN_PLACE;
      break;
    case placement::own_slice: c.send = MPI_IN_PLACE; break; // all_gather: MPI finds the slice by rank
    case placement::first_shard:
      // MPI_IN_PLACE reads the whole input from the receive buffer and leaves the result at its start.
      c.send = MPI_IN_PLACE;
      c.recv = pin;
      break;
    }
    return c;
  }

  backend_options options_;
  control control_;
  int rank_ = 0, size_ = 1;
  const ir::graph* graph_ = nullptr;
  concerto::mesh mesh_;
  std::vector<int> coords_;
  std::map<std::string, communicator> axis_groups_; ///< per mesh axis of a mesh: the ranks of this rank's group
  std::vector<communicator> lanes_;
  std::string lane_signature_; ///< the lanes lanes_ were made for (runtime::lane_signature)
  host_arena arena_;
  std::vector<kernel_call> kernels_;
  std::vector<call> calls_;
};

static_assert(runtime::backend<backend>);

} // namespace concerto::runtime::mpi
