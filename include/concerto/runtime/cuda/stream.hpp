#pragma once
/// @file
/// @brief RAII for CUDA streams, events and captured graphs.
///
/// Every handle is move-only and released in its destructor; destructors never throw (a
/// failed release during unwinding must not terminate the process), so they ignore errors.
/// Host code only; compiles with g++ as well as with nvcc.

#include <concerto/runtime/cuda/check.hpp>

#include <cuda_runtime_api.h>

#include <algorithm>
#include <utility>

namespace concerto::runtime::cuda {

/// @brief The priorities a stream may have on the current device. CUDA counts downwards:
/// `greatest` (numerically smallest) runs first when both streams have blocks waiting.
struct priority_range {
  int least = 0;
  int greatest = 0;
  /// Clamps `p` into the device's range.
  [[nodiscard]] int clamp(int p) const noexcept { return std::clamp(p, greatest, least); }
};

/// @brief The current device's stream priority range.
[[nodiscard]] inline priority_range stream_priorities() {
  priority_range r;
  check(cudaDeviceGetStreamPriorityRange(&r.least, &r.greatest), "cudaDeviceGetStreamPriorityRange");
  return r;
}

/// @brief An owned, non-blocking CUDA stream (it does not synchronise with the legacy default stream).
/// @code
/// cuda::stream comm(cuda::stream_priorities().greatest);  // communication first
/// my_kernel<<<grid, block, 0, comm.get()>>>(...);
/// comm.synchronize();
/// @endcode
class stream {
public:
  /// A stream with the given priority (clamped to the device's range; 0 is the default).
  explicit stream(int priority = 0) {
    priority_ = stream_priorities().clamp(priority);
    check(cudaStreamCreateWithPriority(&s_, cudaStreamNonBlocking, priority_), "cudaStreamCreateWithPriority");
  }
  stream(stream&& o) noexcept : s_(std::exchange(o.s_, nullptr)), priority_(o.priority_) {}
  stream& operator=(stream&& o) noexcept {
    if (this != &o) {
      reset();
      s_ = std::exchange(o.s_, nullptr);
      priority_ = o.priority_;
    }
    return *this;
  }
  stream(const stream&) = delete;
  stream& operator=(const stream&) = delete;
  ~stream() { reset(); }

  [[nodiscard]] cudaStream_t get() const noexcept { return s_; }
  [[nodiscard]] int priority() const noexcept { return priority_; }
  /// Blocks the host until everything enqueued so far has finished; throws on a device error.
  void synchronize() const { check(cudaStreamSynchronize(s_), "cudaStreamSynchronize"); }

private:
  void reset() noexcept {
    if (s_ != nullptr) (void)cudaStreamDestroy(s_);
    s_ = nullptr;
  }
  cudaStream_t s_ = nullptr;
  int priority_ = 0;
};

/// @brief An owned CUDA event. Without timing (the default) it is the cheap kind that only orders
/// streams (cudaEventDisableTiming); with timing it can measure elapsed time.
/// @code
/// cuda::event produced;
/// produced.record(compute.get());
/// produced.wait_on(comm.get());  // comm runs nothing enqueued later until compute reaches the record
/// @endcode
class event {
public:
  explicit event(bool timing = false) {
    check(cudaEventCreateWithFlags(&e_, timing ? cudaEventDefault : cudaEventDisableTiming), "cudaEventCreateWithFlags");
  }
  event(event&& o) noexcept : e_(std::exchange(o.e_, nullptr)) {}
  event& operator=(event&& o) noexcept {
    if (this != &o) {
      reset();
      e_ = std::exchange(o.e_, nullptr);
    }
    return *this;
  }
  event(const event&) = delete;
  event& operator=(const event&) = delete;
  ~event() { reset(); }

  [[nodiscard]] cudaEvent_t get() const noexcept { return e_; }
  /// Marks the point in `s` reached by the work enqueued so far.
  void record(cudaStream_t s) const { check(cudaEventRecord(e_, s), "cudaEventRecord"); }
  /// Makes `s` wait (on the device, not the host) for the last record.
  void wait_on(cudaStream_t s) const { check(cudaStreamWaitEvent(s, e_, 0), "cudaStreamWaitEvent"); }
  /// True when the work before the last record has finished; throws on a device error.
  [[nodiscard]] bool done() const {
    const auto r = cudaEventQuery(e_);
    if (r == cudaErrorNotReady) return false;
    check(r, "cudaEventQuery");
    return true;
  }
  void synchronize() const { check(cudaEventSynchronize(e_), "cudaEventSynchronize"); }
  /// Milliseconds between two timing events' records.
  [[nodiscard]] static float elapsed_ms(const event& from, const event& to) {
    float ms = 0;
    check(cudaEventElapsedTime(&ms, from.e_, to.e_), "cudaEventElapsedTime");
    return ms;
  }

private:
  void reset() noexcept {
    if (e_ != nullptr) (void)cudaEventDestroy(e_);
    e_ = nullptr;
  }
  cudaEvent_t e_ = nullptr;
};

/// @brief A CUDA graph captured from a stream and instantiated, replayable with `launch`.
///
/// Capture follows the work that other streams join through events recorded on the capturing
/// stream (fork) and must join back (the capturing stream waits on an event of every stream
/// that took part) before `end`.
/// @code
/// cuda::captured_graph g;
/// g.begin(s.get());
/// step_kernels(s.get());
/// g.end(s.get());            // instantiates
/// for (int i = 0; i < n; ++i) g.launch(s.get());
/// @endcode
class captured_graph {
public:
  captured_graph() = default;
  captured_graph(captured_graph&& o) noexcept
      : graph_(std::exchange(o.graph_, nullptr)), exec_(std::exchange(o.exec_, nullptr)) {}
  captured_graph& operator=(captured_graph&& o) noexcept {
    if (this != &o) {
      reset();
      graph_ = std::exchange(o.graph_, nullptr);
      exec_ = std::exchange(o.exec_, nullptr);
    }
    return *this;
  }
  captured_graph(const captured_graph&) = delete;
  captured_graph& operator=(const captured_graph&) = delete;
  ~captured_graph() { reset(); }

  /// Starts capturing `s` (relaxed mode: other threads' unsafe calls are not this capture's business).
  void begin(cudaStream_t s) {
    reset();
    check(cudaStreamBeginCapture(s, cudaStreamCaptureModeRelaxed), "cudaStreamBeginCapture");
  }
  /// Ends the capture of `s` and instantiates the graph. A captured kernel keeps the priority of
  /// the stream it was captured from as a node attribute, but a graph launch ignores node
  /// priorities (every node runs at the launch stream's) unless instantiated with
  /// cudaGraphInstantiateFlagUseNodePriority: without it a replayed step would lose the
  /// communication streams' higher priority.
  void end(cudaStream_t s) {
    check(cudaStreamEndCapture(s, &graph_), "cudaStreamEndCapture");
    check(cudaGraphInstantiate(&exec_, graph_, cudaGraphInstantiateFlagUseNodePriority), "cudaGraphInstantiate");
  }
  /// True while `s` takes part in a capture: active, or invalidated by an error and not yet ended.
  [[nodiscard]] static bool capturing(cudaStream_t s) {
    cudaStreamCaptureStatus st = cudaStreamCaptureStatusNone;
    check(cudaStreamIsCapturing(s, &st), "cudaStreamIsCapturing");
    return st != cudaStreamCaptureStatusNone;
  }
  /// Abandons a capture in progress (after an error), leaving `s` usable.
  static void abandon(cudaStream_t s) noexcept {
    cudaStreamCaptureStatus st = cudaStreamCaptureStatusNone;
    if (cudaStreamIsCapturing(s, &st) == cudaSuccess && st != cudaStreamCaptureStatusNone) {
      cudaGraph_t g = nullptr;
      (void)cudaStreamEndCapture(s, &g);
      if (g != nullptr) (void)cudaGraphDestroy(g);
    }
    (void)cudaGetLastError();
  }
  void launch(cudaStream_t s) const {
    CONCERTO_CHECK(exec_ != nullptr, "captured_graph: launch before a capture ended");
    check(cudaGraphLaunch(exec_, s), "cudaGraphLaunch");
  }
  [[nodiscard]] bool ready() const noexcept { return exec_ != nullptr; }
  /// Number of nodes in the captured graph (kernels, copies, NCCL kernels, event edges).
  [[nodiscard]] std::size_t nodes() const {
    if (graph_ == nullptr) return 0;
    std::size_t n = 0;
    check(cudaGraphGetNodes(graph_, nullptr, &n), "cudaGraphGetNodes");
    return n;
  }
  void reset() noexcept {
    if (exec_ != nullptr) (void)cudaGraphExecDestroy(exec_);
    if (graph_ != nullptr) (void)cudaGraphDestroy(graph_);
    exec_ = nullptr;
    graph_ = nullptr;
  }

private:
  cudaGraph_t graph_ = nullptr;
  cudaGraphExec_t exec_ = nullptr;
};

} // namespace concerto::runtime::cuda
