#pragma once
/// @file
/// @brief The GPU backend: one CUDA device per MPI rank, a compute stream, one stream and one
/// NCCL communicator per communication lane, CUDA kernels and cuBLASLt products. Needs nvcc.
///
/// It satisfies runtime::backend with `stream_ordered = true`: `run_compute` and
/// `start_collective` only enqueue, the executor issues every stream's tasks in the plan's
/// order and calls `record` / `stream_wait` (cudaEventRecord / cudaStreamWaitEvent) only for
/// the plan's cross-stream dependencies, and `end_step` waits for the device. MPI stays the
/// bootstrap: it carries the NCCL unique ids, the plan agreement and the lane groups (the
/// ranks that share every mesh coordinate but the lane's axis, as in runtime::mpi::backend).
///
/// The constructor mirrors runtime::mpi::backend's (`backend(backend_options = {})`), so a
/// training layer picks one by the CMake target it is built with: concerto::nccl defines
/// CONCERTO_BACKEND_NCCL=1. Buffers live on the device: `write(id, bytes)` / `read(id, bytes)`
/// copy between host bytes and a buffer, with the same signatures as runtime::mpi::backend's
/// (train/backend_select.hpp relies on it); `buffers().upload(...)` / `buffers().download<T>(...)`
/// are the typed conveniences.
///
/// Collective operands follow runtime::mpi::backend's conventions (in place when input and
/// output coincide; all_gather's input may be this rank's slice of the output; reduce_scatter's
/// output may be this rank's slice of the input, or its first shard as MPI_IN_PLACE leaves it).
/// all_gather and reduce_scatter along a dimension other than the leading one (attr `dim`, the
/// DSL's sequence parallelism), and all_to_all between dimensions (`from_dim`, `to_dim`), go
/// through the lane's staging buffers: a restride kernel on the lane's stream packs each rank's
/// part contiguously before the NCCL call and another unpacks after it, as the MPI backend does
/// on the host. fn "sum" (default), "max" or "min" picks the reduction.
/// A send immediately followed on its lane by a recv (or the reverse) is issued as one NCCL
/// group, so that a ring shift cannot deadlock; `prepare` refuses a send or recv without such a
/// neighbour (NCCL has no tags: two ranks that both send first would wait on each other).
///
/// `end_step` waits for the device with a deadline (`backend_options::timeout_s`, by default
/// CONCERTO_TIMEOUT_S as for the executor's waits on MPI) while polling every lane's NCCL error
/// state: on an error, a device fault or the deadline it aborts every communicator and throws
/// naming the lanes and the last collective issued on each; the backend then runs no further
/// step until `prepare` makes new communicators. A rank that fails mid-step (or unwinds) aborts
/// its communicators in the destructor instead of waiting for the device and its peers, so it
/// reaches MPI_Abort.
///
/// With `capture_graph`, step 1 runs eagerly (NCCL and cuBLASLt initialise lazily, which
/// capture forbids), step 2 is captured into one CUDA graph across all streams and every later
/// step replays it: the host then only launches the graph. Kernel settings are baked into the
/// graph except the optimizer step (read from device memory); after changing `settings()`, call
/// `invalidate_graph()`. What the kernels read from buffers is read at run time, so a value the
/// host writes between steps (`write`: dynamic loss scaling's scale) needs no new capture. A step that threw while being captured leaves the streams capturing:
/// the next `begin_step` (or `write` / `read`) ends that capture and drops the partial graph,
/// so the backend captures again.
///
/// @code
/// runtime::mpi::environment env(argc, argv);
/// runtime::nccl::backend be({.capture_graph = true});
/// runtime::executor ex(plan, be);
/// be.buffers().upload(w_id, host_w);
/// for (int s = 0; s < 100; ++s) ex.run_step();
/// auto loss = be.buffers().download<float>(loss_id);
/// @endcode

#if !defined(__CUDACC__) && !defined(CONCERTO_CUDA_EMULATION)
#error "concerto/runtime/nccl/backend.hpp holds CUDA kernels: compile this source with nvcc (concerto_cuda_sources(target) in CMake)"
#endif

#include <concerto/core/error.hpp>
#include <concerto/ir/graph.hpp>
#include <concerto/mesh/mesh.hpp>
#include <concerto/plan/plan.hpp>
#include <concerto/runtime/backend.hpp>
#include <concerto/runtime/collective_layout.hpp>
#include <concerto/runtime/cuda/blas.hpp>
#include <concerto/runtime/cuda/dispatch.cuh>
#include <concerto/runtime/cuda/memory.hpp>
#include <concerto/runtime/cuda/stream.hpp>
#include <concerto/runtime/dispatch.hpp>
#include <concerto/runtime/executor.hpp>
#include <concerto/runtime/mpi/control.hpp>
#include <concerto/runtime/mpi/environment.hpp>
#include <concerto/runtime/nccl/communicator.hpp>
#include <concerto/runtime/nccl/options.hpp>

#include <cuda_runtime.h>
#include <mpi.h>
#include <nccl.h>

#include <algorithm>
#include <chrono>
#include <climits>
#include <cstdint>
#include <exception>
#include <optional>
#include <span>
#include <string>
#include <thread>
#include <vector>

namespace concerto::runtime::nccl {

/// @brief NCCL + CUDA behind the runtime::backend concept.
class backend {
public:
  /// An in-flight collective: the task whose completion event `test` queries.
  using handle = task_handle;
  static constexpr bool stream_ordered = true;

  explicit backend(backend_options options = {})
      : options_(std::move(options)),
        control_(options_.world,
                 runtime::detail::resolve_timeout_s(options_.timeout_s, options_.timeout_from_env, "nccl::backend")) {
    options_.timeout_s = control_.timeout_s();
    mpi::check(MPI_Comm_rank(options_.world, &rank_), "MPI_Comm_rank");
    mpi::check(MPI_Comm_size(options_.world, &size_), "MPI_Comm_size");
    const int devices = cuda::device_count();
    if (devices == 0) fail("nccl::backend on rank " + std::to_string(rank_) + ": no CUDA device is visible");
    device_ = options_.device;
    if (device_ < 0) {
      // The rank's index among the ranks of its node picks the device: one GPU per rank.
      device_ = control_.split_by_node(rank_, "the ranks of this node, to pick a device").rank() % devices;
    }
    if (device_ >= devices)
      fail("nccl::backend on rank " + std::to_string(rank_) + ": device " + std::to_string(device_) + " requested, " +
           std::to_string(devices) + " visible");
    cuda::check(cudaSetDevice(device_), "cudaSetDevice");
    const auto range = cuda::stream_priorities();
    compute_.emplace(range.least);
    blas_.emplace();
    if (options_.use_cudnn) dnn_.emplace();
    if (dnn_ && cuda::cudnn_attention_available) attention_.emplace(dnn_->get());
    words_ = cuda::device_buffer(2 * sizeof(std::int64_t));
    cuda::check(cudaMallocHost(reinterpret_cast<void**>(&host_step_), sizeof(std::int64_t)), "cudaMallocHost");
  }
  backend(const backend&) = delete;
  backend& operator=(const backend&) = delete;
  ~backend() {
    if (compute_) cuda::captured_graph::abandon(compute_->get());
    if (unfinished_ || std::uncaught_exceptions() > 0) {
      // A step that did not finish (or a rank unwinding on its way to MPI_Abort) may have
      // collectives in flight that a dead or diverged peer never joins: waiting for the device,
      // or ncclCommFinalize, would hang. Aborting makes NCCL's kernels exit, and must come
      // before the members free device memory (cudaFree waits for the device).
      for (auto& comm : comms_) comm.abort();
    } else {
      (void)cudaDeviceSynchronize();
    }
    if (host_step_ != nullptr) (void)cudaFreeHost(host_step_);
  }

  [[nodiscard]] int rank() const noexcept { return rank_; }
  [[nodiscard]] int world_size() const noexcept { return size_; }
  [[nodiscard]] int device() const noexcept { return device_; }
  /// The plan's mesh (valid after prepare).
  [[nodiscard]] const concerto::mesh& mesh() const noexcept { return mesh_; }
  /// This rank's coordinate on each mesh axis.
  [[nodiscard]] const std::vector<int>& coords() const noexcept { return coords_; }
  /// The plan's buffers on the device (valid after prepare).
  [[nodiscard]] cuda::device_arena& buffers() noexcept { return arena_; }
  /// @brief Copies host bytes into buffer b on the device (valid after prepare, between steps);
  /// the same pair as runtime::mpi::backend's, so a training layer fills parameters and inputs
  /// and reads the loss in one way on both backends. Ordered on the compute stream (every lane
  /// joins it at the end of a step) and waited for, so the next step, eager or a replayed graph
  /// (which reads the buffers at the same addresses), sees the new values.
  /// @code
  /// be.write(x_id, std::as_bytes(std::span(x)));
  /// @endcode
  void write(ir::buffer_id b, std::span<const std::byte> bytes) {
    CONCERTO_CHECK(static_cast<std::int64_t>(bytes.size()) == arena_.bytes(b),
                   "write into buffer '" + arena_.name(b) + "': it holds " + std::to_string(arena_.bytes(b)) +
                       " bytes, " + std::to_string(bytes.size()) + " given");
    if (bytes.empty()) return;
    end_abandoned_capture();
    const auto c = compute_->get();
    cuda::check(cudaMemcpyAsync(arena_.ptr(b), bytes.data(), bytes.size(), cudaMemcpyHostToDevice, c), "cudaMemcpyAsync");
    cuda::check(cudaStreamSynchronize(c), "cudaStreamSynchronize");
  }
  /// @brief Copies buffer b from the device into host bytes (`out` must be exactly its size),
  /// after the work enqueued so far on the compute stream (hence after the last step).
  /// @code
  /// float loss = 0;
  /// be.read(loss_id, std::as_writable_bytes(std::span(&loss, 1)));
  /// @endcode
  void read(ir::buffer_id b, std::span<std::byte> out) {
    CONCERTO_CHECK(static_cast<std::int64_t>(out.size()) == arena_.bytes(b),
                   "read of buffer '" + arena_.name(b) + "': it holds " + std::to_string(arena_.bytes(b)) + " bytes, " +
                       std::to_string(out.size()) + " asked for");
    if (out.empty()) return;
    end_abandoned_capture();
    const auto c = compute_->get();
    cuda::check(cudaMemcpyAsync(out.data(), arena_.ptr(b), out.size(), cudaMemcpyDeviceToHost, c), "cudaMemcpyAsync");
    cuda::check(cudaStreamSynchronize(c), "cudaStreamSynchronize");
  }
  /// Kernel settings; with a captured graph, call invalidate_graph() after changing them.
  [[nodiscard]] kernel_settings& settings() noexcept { return options_.kernels; }
  [[nodiscard]] const backend_options& options() const noexcept { return options_; }
  [[nodiscard]] cudaStream_t compute_stream() const noexcept { return compute_->get(); }
  /// The CUDA stream of a lane (stream id >= 1) or the compute stream (0).
  [[nodiscard]] cudaStream_t stream_of(ir::stream_id s) const {
    return s == ir::compute_stream ? compute_->get() : lanes_.at(static_cast<std::size_t>(s)).get();
  }
  /// The NCCL communicator of a lane (stream id >= 1).
  [[nodiscard]] const communicator& lane_communicator(ir::stream_id s) const { return comms_.at(static_cast<std::size_t>(s)); }
  /// True once a step has been captured (the following steps replay it).
  [[nodiscard]] bool graph_ready() const noexcept { return graph_.ready(); }
  /// Nodes of the captured step (0 before capture).
  [[nodiscard]] std::size_t graph_nodes() const { return graph_.nodes(); }
  /// Drops the captured step: the next step runs eagerly and is captured again.
  void invalidate_graph() noexcept {
    graph_.reset();
    eager_steps_ = 0;
  }
  /// Device time of the last step in milliseconds, from the first enqueue to the last stream's end.
  [[nodiscard]] float last_step_device_ms() const { return last_ms_; }

  /// Selects the device's streams, builds the mesh, the lane communicators (one per lane, from
  /// an MPI split of the world) and the device arena; describes every product. Collective over
  /// the world (the executor's constructor calls it on every rank).
  void prepare(const plan::plan& p) {
    // The communicators of a step that did not finish may never finish: abort rather than
    // finalize them (which waits) when they are replaced below.
    if (unfinished_)
      for (auto& comm : comms_) comm.abort();
    unfinished_ = true; // communicators half made on some ranks: a throw must not wait for them
    cuda::check(cudaSetDevice(device_), "cudaSetDevice");
    end_abandoned_capture();
    graph_.reset();
    aborted_.clear(); // new communicators below
    eager_steps_ = 0;
    graph_ptr_ = &p.graph;
    const auto& g = p.graph;
    mesh_ = mesh_of_plan(g, size_);
    coords_ = mesh_.coords(rank_);
    options_.kernels.coords = coords_; // as on MPI: kernels that take the rank's shard read it here
    // A plan with the lanes of the last one prepared (the plan choice switches between plans of
    // one mesh) keeps their streams and communicators: every rank prepares the same plans in the
    // same order, so all keep them or all make new ones.
    if (auto lanes = lane_signature(g); lanes != lane_signature_ || comms_.empty()) {
      make_lanes(g);
      lane_signature_ = std::move(lanes);
    }
    // Scratch: the library workspace (cuBLASLt's, cuDNN's, large enough for the fused attention's
    // graphs), then (256-byte aligned) the kernels' workspace.
    const auto library_bytes = std::max(options_.blas_workspace_bytes, fused_attention_bytes(g));
    const auto blas_bytes = (library_bytes + cuda::device_alignment - 1) / cuda::device_alignment * cuda::device_alignment;
    const auto kernel_bytes = cuda::device_workspace_bytes(g);
    arena_ = cuda::device_arena(g, make_layout(g, static_cast<std::int64_t>(blas_bytes) + kernel_bytes, cuda::device_alignment));
    kernels_.assign(g.tasks.size(), {});
    products_.clear();
    products_.resize(g.tasks.size());
    convs_.clear();
    convs_.resize(g.tasks.size());
    calls_.assign(g.tasks.size(), {});
    events_.clear();
    events_.reserve(g.tasks.size());
    for (std::size_t i = 0; i < g.tasks.size(); ++i) events_.emplace_back();
    joins_.clear();
    for (std::size_t s = 0; s < g.streams.size(); ++s) joins_.emplace_back();
    for (const auto& t : g.tasks) {
      const auto i = static_cast<std::size_t>(t.id);
      if (ir::is_collective(t.kind)) {
        calls_[i] = describe_call(t);
        continue;
      }
      kernels_[i] = decode(g, t, coords_);
      if (t.fn == ir::op::matmul)
        products_[i] = cuda::describe_gemm(kernels_[i], arena_, *blas_, options_.blas_workspace_bytes, options_.allow_tf32);
      if (dnn_ && cuda::conv_pass_of(t.fn))
        convs_[i] = cuda::describe_conv(kernels_[i], arena_, *dnn_, options_.blas_workspace_bytes, options_.allow_tf32);
    }
    make_staging(g);
    // A send next to a recv on the same lane becomes one NCCL group (see the file comment),
    // except on a one-way lane, where each is issued alone.
    one_way_.assign(g.streams.size(), 0);
    for (std::size_t s = 1; s < p.order.size(); ++s) {
      bool up = false, down = false, any = false;
      for (const auto id : p.order[s]) {
        const auto& t = g.tasks[static_cast<std::size_t>(id)];
        if (t.kind != ir::op_kind::send && t.kind != ir::op_kind::recv) continue;
        any = true;
        const bool higher = calls_[static_cast<std::size_t>(id)].peer > coord_on(t);
        (t.kind == ir::op_kind::send ? (higher ? up : down) : (higher ? down : up)) = true;
      }
      one_way_[s] = any && !(up && down);
    }
    partner_.assign(g.tasks.size(), -1);
    for (std::size_t s = 1; s < p.order.size(); ++s) {
      if (one_way_[s]) continue;
      const auto& order = p.order[s];
      for (std::size_t i = 0; i + 1 < order.size(); ++i) {
        const auto& a = g.tasks[static_cast<std::size_t>(order[i])];
        const auto& b = g.tasks[static_cast<std::size_t>(order[i + 1])];
        const bool pair = (a.kind == ir::op_kind::send && b.kind == ir::op_kind::recv) ||
                          (a.kind == ir::op_kind::recv && b.kind == ir::op_kind::send);
        if (pair && partner_[static_cast<std::size_t>(a.id)] < 0) {
          partner_[static_cast<std::size_t>(a.id)] = b.id;
          partner_[static_cast<std::size_t>(b.id)] = a.id;
          ++i;
        }
      }
    }
    refuse_unpaired_point_to_point(p);
    enqueued_.assign(g.tasks.size(), 0);
    record_pending_.assign(g.tasks.size(), 0);
    last_issued_.assign(g.streams.size(), -1);
    ctx_ = {compute_->get(),
            &*blas_,
            dnn_ ? &*dnn_ : nullptr,
            arena_.scratch(),
            library_bytes,
            reinterpret_cast<float*>(arena_.scratch() + blas_bytes),
            words_.as<int>(),
            reinterpret_cast<const std::int64_t*>(words_.data() + sizeof(std::int64_t)),
            static_cast<std::size_t>(kernel_bytes) / sizeof(float),
            attention_ ? &*attention_ : nullptr};
    start_.emplace(true);
    stop_.emplace(true);
    fork_.emplace();
    cuda::check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
    unfinished_ = false;
  }

  void begin_step(std::int64_t step) {
    CONCERTO_CHECK(graph_ptr_ != nullptr, "nccl::backend: begin_step before prepare");
    if (!aborted_.empty())
      fail("nccl::backend on rank " + std::to_string(rank_) + ": step " + std::to_string(step) +
           " cannot run, the lanes' communicators were aborted when an earlier step failed (" + aborted_ +
           "); prepare the plan again (a new executor, on every rank) to make new ones");
    end_abandoned_capture();
    unfinished_ = true; // until end_step has seen the device finish this step
    options_.kernels.step = step;
    std::fill(enqueued_.begin(), enqueued_.end(), std::uint8_t{0});
    std::fill(record_pending_.begin(), record_pending_.end(), std::uint8_t{0});
    std::fill(last_issued_.begin(), last_issued_.end(), ir::task_id{-1});
    const auto c = compute_->get();
    // The step counter is copied outside any capture, so a replayed graph reads the current one.
    *host_step_ = step;
    cuda::check(cudaMemcpyAsync(words_.data() + sizeof(std::int64_t), host_step_, sizeof(std::int64_t),
                                cudaMemcpyHostToDevice, c),
                "cudaMemcpyAsync");
    start_->record(c);
    mode_ = !options_.capture_graph || eager_steps_ < 1 ? mode::eager : graph_.ready() ? mode::replay : mode::capture;
    if (mode_ == mode::capture) {
      graph_.begin(c);
      fork_->record(c);
      for (std::size_t s = 1; s < lanes_.size(); ++s) fork_->wait_on(lanes_[s].get());
    } else if (mode_ == mode::eager) {
      // Lanes start after the previous step's end and the step counter's copy.
      fork_->record(c);
      for (std::size_t s = 1; s < lanes_.size(); ++s) fork_->wait_on(lanes_[s].get());
    }
  }

  void end_step() {
    const auto c = compute_->get();
    try {
      for (std::size_t i = 0; i < partner_.size(); ++i)
        if (partner_[i] >= 0 && enqueued_[i] == 2)
          fail(std::string(ir::to_string(graph_ptr_->tasks[i].kind)) + " '" + graph_ptr_->tasks[i].name +
               "' was never issued with its partner " + graph_ptr_->tasks[static_cast<std::size_t>(partner_[i])].name);
      if (mode_ != mode::replay) // every lane joins the compute stream, so its end is the step's end
        for (std::size_t s = 1; s < lanes_.size(); ++s) {
          joins_[s].record(lanes_[s].get());
          joins_[s].wait_on(c);
        }
      if (mode_ == mode::capture) graph_.end(c);
      if (mode_ != mode::eager) graph_.launch(c);
    } catch (...) {
      cuda::captured_graph::abandon(c);
      graph_.reset();
      throw;
    }
    stop_->record(c);
    wait_for_step();
    unfinished_ = false; // every collective of the step has completed on this rank
    if (mode_ == mode::eager) ++eager_steps_;
    last_ms_ = cuda::event::elapsed_ms(*start_, *stop_);
    int status = 0;
    cuda::check(cudaMemcpy(&status, words_.data(), sizeof status, cudaMemcpyDeviceToHost), "cudaMemcpy");
    if (status != 0) {
      // Cleared on the compute stream, ahead of the next step's kernels: a cudaMemset runs on
      // the legacy stream, which the non-blocking streams do not wait for, so it could land
      // after a kernel of the next step had set the word and erase that step's error.
      cuda::check(cudaMemsetAsync(words_.data(), 0, sizeof status, c), "cudaMemsetAsync");
      const auto& t = graph_ptr_->tasks.at(static_cast<std::size_t>(status - 1));
      fail("step " + std::to_string(options_.kernels.step) + ": task " + std::to_string(t.id) + " '" + t.name + "' (fn '" +
           std::string(ir::to_string(t.fn)) + "') met a target or id outside its range (the GPU kernel skipped it)");
    }
  }

  void run_compute(const ir::task& t) {
    if (mode_ == mode::replay) return;
    const auto i = static_cast<std::size_t>(t.id);
    cuda::run_kernel(kernels_[i], arena_, options_.kernels, ctx_, t.fn == ir::op::matmul ? &products_[i] : nullptr,
                     &convs_[i]);
  }

  handle start_collective(const ir::task& t) {
    last_issued_.at(static_cast<std::size_t>(t.stream)) = t.id; // a replay issues the same order
    if (mode_ == mode::replay) return {t.id};
    const auto i = static_cast<std::size_t>(t.id);
    const auto partner = partner_[i];
    if (partner >= 0 && enqueued_[static_cast<std::size_t>(partner)] != 2) {
      enqueued_[i] = 2; // deferred until its partner is issued
      return {t.id};
    }
    const auto s = stream_of(t.stream);
    if (partner >= 0) {
      const auto& other = graph_ptr_->tasks[static_cast<std::size_t>(partner)];
      check(ncclGroupStart(), "ncclGroupStart");
      enqueue(other, s);
      enqueue(t, s);
      check(ncclGroupEnd(), "ncclGroupEnd");
      finish_enqueue(other, s);
    } else {
      enqueue(t, s);
    }
    finish_enqueue(t, s);
    return {t.id};
  }

  bool test(handle& h) {
    if (mode_ != mode::eager || h.task < 0) return false; // captured work completes at end_step
    const auto i = static_cast<std::size_t>(h.task);
    return enqueued_[i] == 1 && events_[i].done();
  }

  /// Polls the collectives' completion events until one has finished or the deadline passes.
  std::optional<std::size_t> wait_any(std::span<handle> in_flight, clock::time_point deadline) {
    if (in_flight.empty() || mode_ != mode::eager) return std::nullopt;
    for (std::uint64_t polls = 0;; ++polls) {
      for (std::size_t i = 0; i < in_flight.size(); ++i)
        if (test(in_flight[i])) return i;
      if ((polls & 63) == 0 && clock::now() >= deadline) return std::nullopt;
      std::this_thread::yield();
    }
  }

  void record(const ir::task& t) {
    if (mode_ == mode::replay) return;
    const auto i = static_cast<std::size_t>(t.id);
    if (enqueued_[i] == 2) {
      record_pending_[i] = 1;
      return;
    }
    events_[i].record(stream_of(t.stream));
  }

  void stream_wait(ir::stream_id s, const ir::task& t) {
    if (mode_ == mode::replay) return;
    const auto i = static_cast<std::size_t>(t.id);
    if (enqueued_[i] == 2)
      fail("task '" + t.name + "' waits to be issued with its partner '" +
           graph_ptr_->tasks[static_cast<std::size_t>(partner_[i])].name +
           "', but a task of another stream already needs it; order the pair next to each other in the plan");
    events_[i].wait_on(stream_of(s));
  }

  void broadcast(std::string& bytes, int root, std::string_view what) { control_.broadcast(bytes, root, what); }
  std::int64_t min_all(std::int64_t v, std::string_view what) { return control_.min_all(v, what); }
  void barrier(std::string_view what) { control_.barrier(what); }

private:
  enum class mode : std::uint8_t { eager, capture, replay };

  // Everything an NCCL call needs, resolved once in prepare so a step only switches on it.
  struct call {
    const void* send = nullptr;
    void* recv = nullptr;
    std::size_t count = 0;
    ncclDataType_t type = ncclUint8;
    ncclRedOp_t op = ncclSum;
    int peer = 0;                      ///< broadcast root or send/recv partner, as a lane rank
    void* copy_to = nullptr;           ///< reduce_scatter into the first shard: copy the result there
    std::size_t copy_bytes = 0;
    split_layout pack, unpack;         ///< before the call (input -> lane's send stage), after (recv stage -> output)
    const std::byte* pack_from = nullptr;
    std::byte* pack_to = nullptr;      ///< the lane's send stage (= send) when packing
    std::byte* unpack_to = nullptr;
  };

  // The lane's staging buffers, as large as its largest packed collective: one lane's
  // collectives run in its stream's order, so each pack/call/unpack finishes before the next.
  struct staging {
    cuda::device_buffer send, recv;
  };

  int coord_on(const ir::task& t) const { return coords_[static_cast<std::size_t>(t.axis)]; }

  // NCCL has no tags, and a send waits until its peer posts the matching receive: ranks that
  // all send first (a ring shift) wait on each other for ever unless each send and its receive
  // are one group. Only a send next to a recv in its lane's order becomes one (prepare), so any
  // other send or recv is refused here rather than left to deadlock; except on a one-way lane
  // (every send to a higher coordinate and every receive from a lower one, or the reverse: a
  // pipeline's values going forward, its gradients back), where a rank waits only on ranks
  // further back along the lane, which wait on none of its later messages, so its sends and
  // receives go alone, in the lane's order (the same on both ends: train/pipeline.hpp checks it).
  void refuse_unpaired_point_to_point(const plan::plan& p) const {
    const auto& g = p.graph;
    std::string lone;
    for (std::size_t s = 1; s < p.order.size(); ++s)
      for (const auto id : p.order[s]) {
        if (one_way_[s]) break;
        const auto& t = g.tasks[static_cast<std::size_t>(id)];
        const bool point_to_point = t.kind == ir::op_kind::send || t.kind == ir::op_kind::recv;
        if (point_to_point && partner_[static_cast<std::size_t>(id)] < 0)
          lone += (lone.empty() ? "" : ", ") + runtime::detail::task_label(g, id) + " (task " + std::to_string(id) +
                  ") on lane '" + g.streams[s].name + "'";
      }
    if (!lone.empty())
      fail("the plan of graph '" + g.name + "' has point-to-point tasks without a partner next to them in their " +
           "lane's order: " + lone + ". NCCL would deadlock on them (a send waits for its peer's receive); " +
           "order each send right before or after a recv on the same lane, and the NCCL backend issues the " +
           "pair as one group, or keep a lane's messages one way along its axis (a pipeline with interleaved " +
           "chunks sends back to the first stage: not supported on NCCL)");
  }

  // A step that threw while being captured (a task's check, an NCCL call) leaves the compute
  // stream, and the lanes forked from it, capturing: every later call on them would fail with
  // a capture error that names nothing. Ends that capture and drops the partial graph, so the
  // next step is captured again; throws if a stream cannot be freed.
  void end_abandoned_capture() {
    if (!compute_ || !cuda::captured_graph::capturing(compute_->get())) return;
    cuda::captured_graph::abandon(compute_->get());
    graph_.reset();
    mode_ = mode::eager;
    for (std::size_t s = 0; s < lanes_.size(); ++s) {
      const auto st = s == 0 ? compute_->get() : lanes_[s].get();
      if (cuda::captured_graph::capturing(st)) cuda::captured_graph::abandon(st);
      if (cuda::captured_graph::capturing(st))
        fail("nccl::backend on rank " + std::to_string(rank_) + ": " +
             (s == 0 ? std::string("the compute stream") : "the stream of lane " + std::to_string(s)) +
             " still captures after the capture of a failed step was abandoned; this backend cannot run a step");
    }
  }

  // "lane 'dp' (mesh axis 'dp'), last collective issued: all_reduce 'g' (task 12)"
  std::string lane_label(std::size_t s) const {
    const auto& g = *graph_ptr_;
    std::string text = "lane '" + g.streams[s].name + "' (mesh axis '" +
                       g.axes[static_cast<std::size_t>(g.streams[s].axis)].name + "'), last collective issued: ";
    const auto last = last_issued_[s];
    return text + (last < 0 ? std::string("none this step")
                            : runtime::detail::task_label(g, last) + " (task " + std::to_string(last) + ")");
  }

  // The lanes on which NCCL reports an asynchronous error (a peer died, a network error), or "".
  std::string lane_errors() const {
    std::string text;
    for (std::size_t s = 1; s < comms_.size(); ++s) {
      const auto r = comms_[s].async_error();
      if (r == ncclSuccess || r == ncclInProgress) continue;
      std::string what = ncclGetErrorString(r);
      if (const char* last = ncclGetLastError(comms_[s].get()); last != nullptr && *last != '\0')
        what += std::string(": ") + last;
      text += (text.empty() ? "NCCL reported an error on " : "; on ") + lane_label(s) + " (" + what + ")";
    }
    return text;
  }

  // The lanes whose last collective of the step has not completed. Eager steps know it from the
  // collectives' completion events; a replayed graph does not update them, so every lane that
  // issued a collective is named.
  std::string unfinished_lanes() const {
    std::string text;
    for (std::size_t s = 1; s < last_issued_.size(); ++s) {
      const auto last = last_issued_[s];
      if (last < 0) continue;
      const auto& done = events_[static_cast<std::size_t>(last)];
      if (mode_ == mode::eager && cudaEventQuery(done.get()) == cudaSuccess) continue;
      text += (text.empty() ? "" : "; ") + lane_label(s);
    }
    (void)cudaGetLastError(); // a query's own error must not leak into the next check
    return text.empty() ? "every lane's last collective has completed, the compute stream has not"
                        : "waiting on " + text;
  }

  // Waits for the step's stop event without blocking in the driver: it polls the event and every
  // lane's NCCL error state, so that a failed collective, a device fault or a peer that never
  // joins (whose collective would never complete) ends the step within timeout_s with an error
  // naming the lanes, all communicators aborted. Polled as every wait of the runtime is
  // (runtime::detail::poll_until: yields, then 20 µs sleeps).
  void wait_for_step() {
    const auto deadline = runtime::detail::deadline_after(options_.timeout_s);
    std::string why;
    auto& channel = mpi::channel::get();
    const mpi::channel::waiting here(channel, runtime::detail::step_wait_text(options_.kernels.step));
    std::uint64_t polls = 0;
    try {
      const bool ended = runtime::detail::poll_until(deadline, [&] {
        if ((++polls & 63) == 0) channel.serve(false); // answers other ranks' questions
        if (stop_->done()) return true; // throws on a device error
        why = lane_errors();
        return !why.empty();
      });
      if (!ended)
        why = runtime::detail::timed_out_after(options_.timeout_s) + " (set CONCERTO_TIMEOUT_S to wait longer) " +
              unfinished_lanes();
      if (why.empty()) why = lane_errors(); // a failed collective need not keep the step from ending
    } catch (const std::exception& e) {
      why = e.what(); // a kernel faulted, or NCCL's error query itself failed
      if (why.starts_with("concerto: ")) why.erase(0, 10); // abort_lanes' fail() adds it again
    }
    if (!why.empty()) abort_lanes(why);
  }

  // Aborts every lane's communicator (NCCL's kernels exit, the peers see an error or time out)
  // and throws; the backend runs no further step until prepare makes new communicators.
  [[noreturn]] void abort_lanes(const std::string& why) {
    for (auto& comm : comms_) comm.abort();
    graph_.reset(); // its NCCL nodes belong to the aborted communicators
    aborted_ = why;
    fail("nccl::backend on rank " + std::to_string(rank_) + ": step " + std::to_string(options_.kernels.step) +
         " of graph '" + graph_ptr_->name + "' failed: " + why + "; every lane's communicator was aborted");
  }

  // Allocates each lane's staging buffers and points the packed calls at them.
  void make_staging(const ir::graph& g) {
    staging_.clear();
    staging_.resize(g.streams.size());
    std::vector<std::size_t> send(g.streams.size(), 0), recv(g.streams.size(), 0);
    for (const auto& t : g.tasks) {
      if (!ir::is_collective(t.kind)) continue;
      const auto& c = calls_[static_cast<std::size_t>(t.id)];
      const auto lane = static_cast<std::size_t>(t.stream);
      send[lane] = std::max(send[lane], c.pack.bytes());
      recv[lane] = std::max(recv[lane], c.unpack.bytes());
    }
    for (std::size_t s = 0; s < g.streams.size(); ++s) {
      if (send[s] > 0) staging_[s].send = cuda::device_buffer(send[s]);
      if (recv[s] > 0) staging_[s].recv = cuda::device_buffer(recv[s]);
    }
    for (const auto& t : g.tasks) {
      if (!ir::is_collective(t.kind)) continue;
      auto& c = calls_[static_cast<std::size_t>(t.id)];
      const auto& st = staging_[static_cast<std::size_t>(t.stream)];
      if (c.pack.outer > 0) c.send = c.pack_to = st.send.data();
      if (c.unpack.outer > 0) c.recv = st.recv.data();
    }
  }

  void enqueue(const ir::task& t, cudaStream_t s) {
    const auto& c = calls_[static_cast<std::size_t>(t.id)];
    const auto comm = comms_.at(static_cast<std::size_t>(t.stream)).get();
    const auto what = "starting " + std::string(ir::to_string(t.kind)) + " '" + t.name + "'";
    if (c.pack.outer > 0) // each rank's part along an inner dimension made contiguous, on the lane
      cuda::restride(c.pack_from, c.pack_to, c.pack.outer, c.pack.parts, c.pack.len, true, s);
    switch (t.kind) {
    case ir::op_kind::all_reduce: check(ncclAllReduce(c.send, c.recv, c.count, c.type, c.op, comm, s), what.c_str()); break;
    case ir::op_kind::all_gather: check(ncclAllGather(c.send, c.recv, c.count, c.type, comm, s), what.c_str()); break;
    case ir::op_kind::reduce_scatter:
      check(ncclReduceScatter(c.send, c.recv, c.count, c.type, c.op, comm, s), what.c_str());
      break;
    case ir::op_kind::all_to_all: {
#if NCCL_VERSION_CODE >= NCCL_VERSION(2, 28, 0)
      check(ncclAlltoAll(c.send, c.recv, c.count, c.type, comm, s), what.c_str());
#else
      const int n = comms_.at(static_cast<std::size_t>(t.stream)).size();
      check(ncclGroupStart(), "ncclGroupStart");
      for (int r = 0; r < n; ++r) {
        check(ncclSend(static_cast<const std::byte*>(c.send) + r * c.count, c.count, c.type, r, comm, s), what.c_str());
        check(ncclRecv(static_cast<std::byte*>(c.recv) + r * c.count, c.count, c.type, r, comm, s), what.c_str());
      }
      check(ncclGroupEnd(), "ncclGroupEnd");
#endif
      break;
    }
    case ir::op_kind::broadcast: check(ncclBroadcast(c.send, c.recv, c.count, c.type, c.peer, comm, s), what.c_str()); break;
    case ir::op_kind::send: check(ncclSend(c.send, c.count, c.type, c.peer, comm, s), what.c_str()); break;
    case ir::op_kind::recv: check(ncclRecv(c.recv, c.count, c.type, c.peer, comm, s), what.c_str()); break;
    default: fail("task '" + t.name + "' is not a collective");
    }
  }

  // After the NCCL call (or its group) is enqueued: the post-copy, the completion event and
  // a deferred record.
  void finish_enqueue(const ir::task& t, cudaStream_t s) {
    const auto i = static_cast<std::size_t>(t.id);
    const auto& c = calls_[i];
    if (c.copy_to != nullptr)
      cuda::check(cudaMemcpyAsync(c.copy_to, c.recv, c.copy_bytes, cudaMemcpyDeviceToDevice, s), "cudaMemcpyAsync");
    if (c.unpack.outer > 0) // the received blocks interleaved back along the inner dimension
      cuda::restride(static_cast<const std::byte*>(c.recv), c.unpack_to, c.unpack.outer, c.unpack.parts, c.unpack.len,
                     false, s);
    events_[i].record(s);
    enqueued_[i] = 1;
    record_pending_[i] = 0;
  }

  // The checks and the layout are runtime::describe_collective's; what is left is NCCL's own:
  // its types and ops, in place as equal pointers, and staging in the lane's buffers (make_staging).
  call describe_call(const ir::task& t) {
    const auto& g = *graph_ptr_;
    const auto address_of = [&](ir::buffer_id b) { return arena_.ptr(b); };
    const auto l = describe_collective(g, t, coord_on(t), address_of,
                                       {.backend = "NCCL",
                                        .bad_count = "is not a whole number of elements",
                                        .scatter_to_own_slice = true});
    const auto& bout = g.buffers[static_cast<std::size_t>(l.out)];
    auto* pin = address_of(l.in);
    auto* pout = address_of(l.out);
    call c;
    if (l.reduces) {
      switch (g.buffers[static_cast<std::size_t>(l.in)].type) {
      case ir::dtype::f32: c.type = ncclFloat32; break;
      case ir::dtype::bf16: c.type = ncclBfloat16; break;
      case ir::dtype::f16: c.type = ncclFloat16; break;
      case ir::dtype::i32: c.type = ncclInt32; break;
      case ir::dtype::i64: c.type = ncclInt64; break;
      }
      c.op = l.op == reduction::max ? ncclMax : l.op == reduction::min ? ncclMin : ncclSum;
    }
    c.count = static_cast<std::size_t>(l.count);
    c.peer = l.peer;
    c.send = pin;
    c.recv = pout;
    c.pack = l.pack;
    c.unpack = l.unpack;
    if (l.pack.outer > 0) c.pack_from = pin;
    if (l.unpack.outer > 0) c.unpack_to = pout;
    if (l.place == placement::same) c.send = pout;
    if (l.place == placement::first_shard) { // MPI_IN_PLACE's convention: NCCL reduces into this rank's slice, then copy
      c.recv = pin + static_cast<std::ptrdiff_t>(bout.bytes) * coord_on(t);
      c.copy_to = pout;
      c.copy_bytes = static_cast<std::size_t>(bout.bytes);
    }
    return c;
  }

  backend_options options_;
  mpi::control control_;
  int rank_ = 0, size_ = 1, device_ = 0;
  const ir::graph* graph_ptr_ = nullptr;
  concerto::mesh mesh_;
  std::vector<int> coords_;
  std::optional<cuda::stream> compute_;
  std::optional<cuda::blas_handle> blas_;
  std::optional<cuda::dnn_handle> dnn_;  ///< with backend_options::use_cudnn
  /// cuDNN's fused attention graphs, where this build has its frontend and cuDNN is used.
  std::optional<cuda::cudnn_attention_cache> attention_;
  /// Library workspace bytes the fused attention of `g`'s 16-bit attention tasks needs (builds and
  /// caches their graphs, before the first step); 0 where none can run fused.
  std::size_t fused_attention_bytes(const ir::graph& g) {
    std::size_t most = 0;
    if (!attention_) return most;
    for (const auto& t : g.tasks) {
      if (t.fn != ir::op::attention && t.fn != ir::op::attention_grad) continue;
      const auto c = decode(g, t, coords_);
      const auto type = g.buffer_at(c.in[0]).type;
      const auto pass = t.fn == ir::op::attention ? cuda::cudnn_attention_pass::forward : cuda::cudnn_attention_pass::backward;
      if (const auto bytes = cuda::cudnn_attention_workspace_bytes(*attention_, c.att, type, pass, true)) most = std::max(most, *bytes);
    }
    return most;
  }
  /// The lanes' streams and NCCL communicators of `g`, one per comm stream.
  void make_lanes(const ir::graph& g) {
    const auto range = cuda::stream_priorities();
    lanes_.clear();
    comms_.clear();
    lanes_.reserve(g.streams.size());
    comms_.reserve(g.streams.size());
    lanes_.emplace_back(range.least); // slot 0 unused: the compute stream is compute_
    comms_.emplace_back();
    for (std::size_t s = 1; s < g.streams.size(); ++s) {
      const auto& axis = g.axes.at(static_cast<std::size_t>(g.streams[s].axis));
      lanes_.emplace_back(options_.comm_high_priority ? range.greatest : range.least);
      const auto lane = "the communicator of lane '" + g.streams[s].name + "'";
      const auto group = control_.split(mesh_.group_index(axis.name, rank_),
                                        coords_[static_cast<std::size_t>(g.streams[s].axis)], lane);
      auto o = options_.comm;
      if (o.name.empty()) o.name = g.name + "/" + g.streams[s].name;
      comms_.push_back(communicator::from_mpi(mpi::control(group.get(), options_.timeout_s), o));
      if (comms_.back().size() != axis.size)
        fail("lane '" + g.streams[s].name + "' has " + std::to_string(comms_.back().size()) + " ranks, mesh axis '" +
             axis.name + "' has size " + std::to_string(axis.size));
    }
  }

  std::vector<cuda::stream> lanes_;
  std::string lane_signature_; ///< the lanes make_lanes last made (runtime::lane_signature)
  std::vector<communicator> comms_;
  cuda::device_arena arena_;
  cuda::device_buffer words_;           // [0]: status word (int), [8]: step counter (int64)
  std::int64_t* host_step_ = nullptr;   // pinned, the source of the step counter's copy
  std::vector<kernel_call> kernels_;
  std::vector<cuda::gemm> products_;
  std::vector<cuda::conv_plan> convs_;  ///< per convolution pass: its cuDNN plan (empty: the own kernels)
  std::vector<call> calls_;
  std::vector<staging> staging_;        // per lane (slot 0 unused)
  std::vector<cuda::event> events_;     // per task: recorded after it on its stream
  std::vector<cuda::event> joins_;      // per lane: its end of the step
  std::vector<ir::task_id> partner_;
  std::vector<std::uint8_t> one_way_; ///< per lane: its sends and receives all go one way along its axis
  std::vector<std::uint8_t> enqueued_;  // 0 not yet, 1 enqueued, 2 deferred (waits for its partner)
  std::vector<std::uint8_t> record_pending_;
  std::vector<ir::task_id> last_issued_; // per lane: its last collective issued this step (-1: none)
  bool unfinished_ = false;             // a step (or prepare) began and the device has not been seen to finish it
  std::string aborted_;                 // why the communicators were aborted (empty: they were not)
  cuda::device_context ctx_{};
  std::optional<cuda::event> start_, stop_, fork_; // made in prepare, on the backend's device
  cuda::captured_graph graph_;
  mode mode_ = mode::eager;
  int eager_steps_ = 0;
  float last_ms_ = 0;
};

static_assert(runtime::backend<backend>);

} // namespace concerto::runtime::nccl
