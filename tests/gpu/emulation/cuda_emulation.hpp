#pragma once
// A host emulation of the CUDA execution model and of the small part of the CUDA runtime API
// that concerto's kernels (runtime/cuda/kernels.cuh), streams and device buffers use, so that
// the kernel tests (tests/gpu/kernels_test.cu) run in CI, where there is no GPU.
//
// Every CUDA thread of a block is a fiber (its own stack, see concerto_emulation_switch) on the calling thread; the fibers of a
// block run one after the other until each reaches a barrier (__syncthreads, or a warp shuffle,
// which waits for its warp), and the scheduler releases a barrier once every thread it concerns
// is there. Blocks run one after the other, so `__shared__` variables are function statics.
// What this checks: the kernels' indexing, partial blocks and grid-stride loops, reductions
// across warps and barriers, shared-memory sizes, status flags, launch configurations (the
// limits of a real device are enforced), and barrier divergence, which is an error here where
// a GPU would hang or compute garbage. What it cannot check: timing, races between blocks, the
// memory model, and the speed or algorithms of cuBLASLt and NCCL (include/cublasLt.h and
// include/nccl.h compute their results with host loops and MPI).
//
// Work enqueued on a stream (kernels, async copies and sets, event records, NCCL calls) runs
// when it is enqueued, in the host's order, which respects every stream order and event wait.
// One exception: a lone NCCL send or receive (include/nccl.h) is posted when enqueued and
// completes later, as it holds its stream and not the host on a device; it stays pending on its
// stream, an event recorded there after it carries it, and waiting for that event (on a stream,
// cudaEventSynchronize) or for the stream or device waits for it, cudaEventQuery tests it.
// Between cudaStreamBeginCapture and cudaStreamEndCapture it is recorded instead, and a
// launched graph replays it in the same order. Synchronising on a stream, an event or the
// device while a capture is open is an error, as it is on a device.
//
// Included through the headers of tests/gpu/emulation/include (cuda_runtime.h and friends),
// which take the place of the CUDA Toolkit's for the emulated test targets.

#include <ucontext.h>

#include <math.h> // the kernels call the C functions expf, tanhf, ... unqualified, as CUDA code does

#include <atomic>
#include <exception>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <new>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#define CONCERTO_CUDA_EMULATION 1

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
// One block runs at a time, so a function-local static is exactly the block's shared copy.
#define __shared__ static

struct uint3 {
  unsigned x = 0, y = 0, z = 0;
};
struct dim3 {
  unsigned x, y, z;
  constexpr dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};
struct alignas(16) uint4 {
  unsigned x, y, z, w;
};

inline thread_local uint3 threadIdx;
inline thread_local uint3 blockIdx;
inline thread_local dim3 blockDim;
inline thread_local dim3 gridDim;

inline float rsqrtf(float x) { return 1.0f / sqrtf(x); }

// ---- runtime API subset ----------------------------------------------------------------------
enum cudaError_t {
  cudaSuccess = 0,
  cudaErrorInvalidValue = 1,
  cudaErrorMemoryAllocation = 2,
  cudaErrorInvalidConfiguration = 9,
  cudaErrorNotReady = 600,
  cudaErrorNotSupported = 801,
  cudaErrorStreamCaptureUnsupported = 900,
  cudaErrorStreamCaptureInvalidated = 901,
  cudaErrorIllegalState = 401,
};
using cudaError = cudaError_t;
enum cudaMemcpyKind { cudaMemcpyHostToHost, cudaMemcpyHostToDevice, cudaMemcpyDeviceToHost, cudaMemcpyDeviceToDevice, cudaMemcpyDefault };
enum cudaStreamCaptureStatus { cudaStreamCaptureStatusNone, cudaStreamCaptureStatusActive, cudaStreamCaptureStatusInvalidated };
enum cudaStreamCaptureMode { cudaStreamCaptureModeGlobal, cudaStreamCaptureModeThreadLocal, cudaStreamCaptureModeRelaxed };
inline constexpr unsigned cudaStreamNonBlocking = 1;
inline constexpr unsigned cudaEventDefault = 0;
inline constexpr unsigned cudaEventDisableTiming = 2;
inline constexpr unsigned long long cudaGraphInstantiateFlagUseNodePriority = 8;

// A completion that has not been waited for: called with true, waits; with false, tests.
// Returns whether it has completed.
using cuda_emulation_pending = std::function<bool(bool)>;
struct CUstream_st {
  int priority = 0;
  std::vector<cuda_emulation_pending> pending; // point-to-point calls posted on it, not yet seen complete
};
struct CUevent_st {
  std::chrono::steady_clock::time_point at{}; // when the work before it ran
  std::vector<cuda_emulation_pending> pending; // its stream's, when it was recorded
};
struct CUgraph_st {
  std::vector<std::function<void()>> work;
};
struct CUgraphExec_st {
  std::vector<std::function<void()>> work;
};
using cudaStream_t = CUstream_st*;
using cudaEvent_t = CUevent_st*;
using cudaGraph_t = CUgraph_st*;
using cudaGraphExec_t = CUgraphExec_st*;
struct CUgraphNode_st;
using cudaGraphNode_t = CUgraphNode_st*;

namespace cuda_emulation {

inline thread_local cudaError_t last_error = cudaSuccess;
inline cudaError_t fails(cudaError_t e) {
  last_error = e;
  return e;
}

// The open capture, if any: work enqueued while it is open is recorded, not run.
struct capture_state {
  cudaStream_t origin = nullptr;
  std::vector<std::function<void()>> work;
};
inline thread_local std::unique_ptr<capture_state> capture;

inline void enqueue(std::function<void()> work) {
  if (capture) capture->work.push_back(std::move(work));
  else work();
}

// Every pending completion of the process, for cudaDeviceSynchronize.
inline thread_local std::vector<cuda_emulation_pending> all_pending;
// Waits for (or tests) a list of completions, dropping those done; true when none is left.
inline bool settle(std::vector<cuda_emulation_pending>& list, bool wait) {
  std::erase_if(list, [&](auto& done) { return done(wait); });
  return list.empty();
}
// A completion to be waited for on stream `s` (and by the device).
inline void add_pending(cudaStream_t s, cuda_emulation_pending done) {
  settle(all_pending, false);
  all_pending.push_back(done);
  if (s != nullptr) {
    settle(s->pending, false);
    s->pending.push_back(std::move(done));
  }
}
// A call that waits for the device; illegal while a capture is open.
inline cudaError_t synchronising() { return capture ? fails(cudaErrorStreamCaptureUnsupported) : cudaSuccess; }

// Whether [a, a + an) and [b, b + bn) share a byte. Overlapping copies are undefined on a device
// (and NCCL allows only its in-place forms); here they are errors, so that they show.
inline bool overlap(const void* a, std::size_t an, const void* b, std::size_t bn) {
  const auto x = reinterpret_cast<std::uintptr_t>(a), y = reinterpret_cast<std::uintptr_t>(b);
  return an > 0 && bn > 0 && x < y + bn && y < x + an;
}

// Byte pattern of fresh device memory and of dynamic shared memory at the start of a block: as
// floats these are NaN, so a kernel that reads what nobody wrote shows it in its results.
inline constexpr unsigned char uninitialised = 0xff;

// Threads per block, blocks per grid dimension and dynamic shared bytes a device accepts
// without opting in (the limits of every architecture concerto builds for).
inline constexpr unsigned max_threads_per_block = 1024;
inline constexpr unsigned max_grid_y_z = 65535;
inline constexpr std::size_t max_dynamic_shared = 48 * 1024;

enum class fiber_state : std::uint8_t { running, at_block_barrier, at_warp_barrier, done };

// Switching fibers. glibc's swapcontext saves and restores the signal mask with a system call on
// every switch, which was two thirds of the emulated tests' time; on x86-64 (outside the
// sanitizer builds, whose fiber bookkeeping hooks ucontext) a switch saves the callee-saved
// registers and the floating-point control words on the stack it leaves and pops them from the
// one it enters, with no system call. Elsewhere ucontext does it.
#if defined(__x86_64__) && !defined(__SANITIZE_ADDRESS__) && !defined(__SANITIZE_THREAD__)
#define CONCERTO_CUDA_EMULATION_STACK_SWITCH 1
// concerto_emulation_switch(&saved, next): saves the current stack pointer in `saved` and
// continues on `next` (a stack pointer such a call saved, or a fresh stack's, see start_fiber).
// Weak: every translation unit that includes this header defines it.
extern "C" void concerto_emulation_switch(void** saved, void* next);
asm(R"(
  .text
  .weak concerto_emulation_switch
  .type concerto_emulation_switch, @function
concerto_emulation_switch:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  subq $8, %rsp
  stmxcsr (%rsp)
  fnstcw 4(%rsp)
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  ldmxcsr (%rsp)
  fldcw 4(%rsp)
  addq $8, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
  .size concerto_emulation_switch, .-concerto_emulation_switch
)");
#endif

struct fiber {
#if CONCERTO_CUDA_EMULATION_STACK_SWITCH
  void* sp = nullptr; // where it was suspended
#else
  ucontext_t context{};
#endif
  char* stack = nullptr; // fiber_stack_bytes, owned by the thread's stack pool
  fiber_state state = fiber_state::running;
  uint3 index{};
  unsigned linear = 0;
  unsigned shuffles = 0; // parity selects the exchange buffer (see shuffle)
};

struct block_run {
  std::vector<fiber> fibers;
#if CONCERTO_CUDA_EMULATION_STACK_SWITCH
  void* scheduler = nullptr;
#else
  ucontext_t scheduler{};
#endif
  fiber* current = nullptr;
  const std::function<void()>* body = nullptr;
  std::exception_ptr failure; // thrown by a thread; rethrown by the scheduler
  std::vector<unsigned char> dynamic_shared;
  std::vector<std::uint64_t> exchange[2]; // a value per thread, alternating between shuffles
};
inline thread_local block_run* active = nullptr;

inline constexpr std::size_t fiber_stack_bytes = 128 * 1024;

// Fiber stacks outlive a launch: allocating (and faulting in) a stack per thread per launch
// cost as much as running the kernels.
inline char* pooled_stack(std::size_t i) {
  thread_local std::vector<std::unique_ptr<char[]>> pool;
  while (pool.size() <= i) pool.emplace_back(new char[fiber_stack_bytes]);
  return pool[i].get();
}

inline void to_scheduler(fiber& f) {
#if CONCERTO_CUDA_EMULATION_STACK_SWITCH
  concerto_emulation_switch(&f.sp, active->scheduler);
#else
  swapcontext(&f.context, &active->scheduler);
#endif
}

inline void fiber_entry() {
  try {
    (*active->body)();
  } catch (...) {
    if (!active->failure) active->failure = std::current_exception();
  }
  active->current->state = fiber_state::done;
#if CONCERTO_CUDA_EMULATION_STACK_SWITCH
  void* finished = nullptr;
  concerto_emulation_switch(&finished, active->scheduler); // never resumed
  __builtin_unreachable();
#endif
  // with ucontext, returning resumes the scheduler (uc_link)
}

// Makes `f` start at fiber_entry when it is first entered.
inline void start_fiber(fiber& f, [[maybe_unused]] block_run& run) {
#if CONCERTO_CUDA_EMULATION_STACK_SWITCH
  // The frame concerto_emulation_switch pops: control words, r15..rbp, then the return address
  // (fiber_entry), above which fiber_entry sees the stack aligned as after a call.
  auto* top = reinterpret_cast<std::uint64_t*>(
      (reinterpret_cast<std::uintptr_t>(f.stack) + fiber_stack_bytes) & ~std::uintptr_t{15});
  std::uint64_t* sp = top - 9;
  std::uint32_t words[2];
  asm volatile("stmxcsr %0\n\tfnstcw %1" : "=m"(words[0]), "=m"(words[1]));
  std::memcpy(sp, words, sizeof words);
  for (int r = 1; r <= 6; ++r) sp[r] = 0;
  sp[7] = reinterpret_cast<std::uint64_t>(&fiber_entry);
  sp[8] = 0; // fiber_entry never returns
  f.sp = sp;
#else
  getcontext(&f.context);
  f.context.uc_stack.ss_sp = f.stack;
  f.context.uc_stack.ss_size = fiber_stack_bytes;
  f.context.uc_link = &run.scheduler;
  makecontext(&f.context, fiber_entry, 0);
#endif
}

inline void resume(block_run& run, fiber& f) {
  run.current = &f;
  threadIdx = f.index;
#if CONCERTO_CUDA_EMULATION_STACK_SWITCH
  concerto_emulation_switch(&run.scheduler, f.sp);
#else
  swapcontext(&run.scheduler, &f.context);
#endif
}

inline void suspend(fiber_state at) {
  fiber& f = *active->current;
  f.state = at;
  to_scheduler(f);
}

[[noreturn]] inline void divergence(const char* what, unsigned block_linear) {
  throw std::logic_error(std::string("CUDA emulation: ") + what + " in block " + std::to_string(block_linear) +
                         " (every thread of the block, or of the warp for a shuffle, must reach the same barrier)");
}

// Runs one block to completion: fibers run in thread order until each waits or ends; a warp
// whose threads all wait at a shuffle goes on first, then a block barrier that every thread
// reached. Anything else is divergence. A thread's exception ends the block and is rethrown.
inline void run_block(block_run& run, unsigned block_linear) {
  for (auto& f : run.fibers) {
    f.state = fiber_state::running;
    f.shuffles = 0;
    start_fiber(f, run);
  }
  if (!run.dynamic_shared.empty()) std::memset(run.dynamic_shared.data(), uninitialised, run.dynamic_shared.size());
  const std::size_t threads = run.fibers.size();
  for (;;) {
    for (auto& f : run.fibers) {
      if (f.state != fiber_state::running) continue;
      resume(run, f);
      if (run.failure) std::rethrow_exception(std::exchange(run.failure, nullptr));
    }
    std::size_t done = 0, at_block = 0, at_warp = 0;
    for (const auto& f : run.fibers) {
      done += f.state == fiber_state::done;
      at_block += f.state == fiber_state::at_block_barrier;
      at_warp += f.state == fiber_state::at_warp_barrier;
    }
    if (done == threads) return;
    if (at_warp > 0) {
      for (std::size_t w = 0; w < threads; w += 32) {
        const std::size_t end = w + 32 < threads ? w + 32 : threads;
        std::size_t waiting = 0;
        for (std::size_t t = w; t < end; ++t) waiting += run.fibers[t].state == fiber_state::at_warp_barrier;
        if (waiting == 0) continue;
        if (waiting != end - w) divergence("a warp shuffle that not every thread of the warp reached", block_linear);
        for (std::size_t t = w; t < end; ++t) run.fibers[t].state = fiber_state::running;
      }
      continue;
    }
    if (done > 0) divergence("__syncthreads after some threads of the block returned", block_linear);
    for (auto& f : run.fibers) f.state = fiber_state::running; // every thread is at the block barrier
  }
}

inline void run_grid(dim3 grid, dim3 block, std::size_t shared_bytes, const std::function<void()>& body) {
  const std::size_t threads = std::size_t{block.x} * block.y * block.z;
  if (threads == 0 || threads > max_threads_per_block || block.z > 64 || grid.x == 0 || grid.y == 0 || grid.z == 0 ||
      grid.y > max_grid_y_z || grid.z > max_grid_y_z || shared_bytes > max_dynamic_shared) {
    fails(cudaErrorInvalidConfiguration);
    return;
  }
  if (active != nullptr) throw std::logic_error("CUDA emulation: a kernel launched from inside a kernel");
  block_run run;
  run.fibers.resize(threads);
  for (unsigned t = 0; t < threads; ++t) {
    auto& f = run.fibers[t];
    f.stack = pooled_stack(t);
    f.linear = t;
    f.index = {t % block.x, (t / block.x) % block.y, t / (block.x * block.y)};
  }
  run.body = &body;
  run.dynamic_shared.resize(shared_bytes);
  run.exchange[0].resize(threads);
  run.exchange[1].resize(threads);
  blockDim = block;
  gridDim = grid;
  active = &run;
  struct reset_active {
    ~reset_active() { active = nullptr; }
  } reset;
  unsigned linear = 0;
  for (unsigned z = 0; z < grid.z; ++z)
    for (unsigned y = 0; y < grid.y; ++y)
      for (unsigned x = 0; x < grid.x; ++x) {
        blockIdx = {x, y, z};
        run_block(run, linear++);
      }
}

inline void* dynamic_shared() { return active->dynamic_shared.data(); }

// CONCERTO_CUDA_LAUNCH(grid, block, bytes, stream, kernel)(args...): runs the grid now.
template <class... Params>
auto launch(dim3 grid, dim3 block, std::size_t shared_bytes, cudaStream_t, void (*kernel)(Params...)) {
  return [=](auto&&... args) {
    enqueue([=, ... values = std::decay_t<decltype(args)>(args)] {
      const std::function<void()> body = [&] { kernel(values...); };
      run_grid(grid, block, shared_bytes, body);
    });
  };
}

// A shuffle writes the thread's value, waits for its warp, reads the partner's. Two buffers in
// turn: a thread can be one shuffle ahead of a warp-mate still reading, never two.
template <class T>
T shuffle_xor(T v, int lane_mask) {
  static_assert(std::is_trivially_copyable_v<T> && sizeof(T) <= sizeof(std::uint64_t));
  fiber& f = *active->current;
  auto& buffer = active->exchange[f.shuffles++ & 1u];
  std::memcpy(&buffer[f.linear], &v, sizeof(T));
  suspend(fiber_state::at_warp_barrier);
  const unsigned source = (f.linear & ~31u) | ((f.linear & 31u) ^ static_cast<unsigned>(lane_mask & 31));
  if (source >= active->fibers.size()) return v;
  T r;
  std::memcpy(&r, &buffer[source], sizeof(T));
  return r;
}

} // namespace cuda_emulation

#define CONCERTO_CUDA_LAUNCH(grid, block, shared_bytes, stream, ...) \
  ::cuda_emulation::launch(grid, block, shared_bytes, stream, __VA_ARGS__)
#define CONCERTO_CUDA_DYNAMIC_SHARED(type, name) type* name = static_cast<type*>(::cuda_emulation::dynamic_shared())

inline void __syncthreads() { cuda_emulation::suspend(cuda_emulation::fiber_state::at_block_barrier); }
template <class T>
T __shfl_xor_sync(unsigned mask, T v, int lane_mask, int = 32) {
  if (mask != 0xffffffffu) throw std::logic_error("CUDA emulation: only full-warp shuffles are emulated");
  return cuda_emulation::shuffle_xor(v, lane_mask);
}
inline int atomicCAS(int* address, int compare, int value) {
  std::atomic_ref<int>(*address).compare_exchange_strong(compare, value);
  return compare;
}
inline float atomicAdd(float* address, float value) { return std::atomic_ref<float>(*address).fetch_add(value); }
inline int atomicAdd(int* address, int value) { return std::atomic_ref<int>(*address).fetch_add(value); }

inline cudaError_t cudaGetLastError() { return std::exchange(cuda_emulation::last_error, cudaSuccess); }
inline cudaError_t cudaPeekAtLastError() { return cuda_emulation::last_error; }
inline const char* cudaGetErrorName(cudaError_t e) {
  switch (e) {
  case cudaSuccess: return "cudaSuccess";
  case cudaErrorInvalidValue: return "cudaErrorInvalidValue";
  case cudaErrorMemoryAllocation: return "cudaErrorMemoryAllocation";
  case cudaErrorInvalidConfiguration: return "cudaErrorInvalidConfiguration";
  case cudaErrorNotReady: return "cudaErrorNotReady";
  case cudaErrorNotSupported: return "cudaErrorNotSupported";
  case cudaErrorStreamCaptureUnsupported: return "cudaErrorStreamCaptureUnsupported";
  case cudaErrorStreamCaptureInvalidated: return "cudaErrorStreamCaptureInvalidated";
  case cudaErrorIllegalState: return "cudaErrorIllegalState";
  }
  return "cudaErrorUnknown";
}
inline const char* cudaGetErrorString(cudaError_t e) {
  switch (e) {
  case cudaSuccess: return "no error";
  case cudaErrorInvalidValue: return "invalid argument";
  case cudaErrorMemoryAllocation: return "out of memory";
  case cudaErrorInvalidConfiguration: return "invalid configuration argument";
  case cudaErrorNotReady: return "device not ready";
  case cudaErrorNotSupported: return "operation not supported (by the host emulation)";
  case cudaErrorStreamCaptureUnsupported: return "operation not permitted when stream is capturing";
  case cudaErrorStreamCaptureInvalidated: return "operation failed due to a previous error during capture";
  case cudaErrorIllegalState: return "the operation is not permitted in the current state";
  }
  return "unknown error";
}
inline cudaError_t cudaGetDeviceCount(int* n) {
  *n = 1;
  return cudaSuccess;
}
inline cudaError_t cudaDeviceSynchronize() {
  if (const auto r = cuda_emulation::synchronising(); r != cudaSuccess) return r;
  cuda_emulation::settle(cuda_emulation::all_pending, true);
  return cudaSuccess;
}
inline cudaError_t cudaSetDevice(int device) { return device == 0 ? cudaSuccess : cuda_emulation::fails(cudaErrorInvalidValue); }
inline cudaError_t cudaGetDevice(int* device) {
  *device = 0;
  return cudaSuccess;
}

inline cudaError_t cudaMalloc(void** p, std::size_t bytes) {
  *p = ::operator new(bytes == 0 ? 1 : bytes, std::align_val_t{256}, std::nothrow);
  if (*p == nullptr) return cuda_emulation::fails(cudaErrorMemoryAllocation);
  std::memset(*p, cuda_emulation::uninitialised, bytes);
  return cudaSuccess;
}
inline cudaError_t cudaFree(void* p) {
  ::operator delete(p, std::align_val_t{256});
  return cudaSuccess;
}
inline cudaError_t cudaMallocHost(void** p, std::size_t bytes) { return cudaMalloc(p, bytes); }
inline cudaError_t cudaFreeHost(void* p) { return cudaFree(p); }
inline cudaError_t cudaMemcpy(void* to, const void* from, std::size_t bytes, cudaMemcpyKind) {
  if (cuda_emulation::overlap(to, bytes, from, bytes)) return cuda_emulation::fails(cudaErrorInvalidValue);
  if (bytes > 0) std::memcpy(to, from, bytes);
  return cudaSuccess;
}
inline cudaError_t cudaMemcpy2DAsync(void* to, std::size_t to_pitch, const void* from, std::size_t from_pitch,
                                     std::size_t width, std::size_t height, cudaMemcpyKind kind, cudaStream_t) {
  if (width > to_pitch || width > from_pitch) return cuda_emulation::fails(cudaErrorInvalidValue);
  for (std::size_t r = 0; r < height; ++r)
    if (cuda_emulation::overlap(static_cast<char*>(to) + r * to_pitch, width, static_cast<const char*>(from) + r * from_pitch, width))
      return cuda_emulation::fails(cudaErrorInvalidValue);
  cuda_emulation::enqueue([=] {
    for (std::size_t r = 0; r < height; ++r)
      (void)cudaMemcpy(static_cast<char*>(to) + r * to_pitch, static_cast<const char*>(from) + r * from_pitch, width, kind);
  });
  return cudaSuccess;
}
inline cudaError_t cudaMemcpyAsync(void* to, const void* from, std::size_t bytes, cudaMemcpyKind kind, cudaStream_t) {
  if (cuda_emulation::overlap(to, bytes, from, bytes)) return cuda_emulation::fails(cudaErrorInvalidValue);
  cuda_emulation::enqueue([=] { (void)cudaMemcpy(to, from, bytes, kind); });
  return cudaSuccess;
}
inline cudaError_t cudaMemset(void* p, int value, std::size_t bytes) {
  std::memset(p, value, bytes);
  return cudaSuccess;
}
inline cudaError_t cudaMemsetAsync(void* p, int value, std::size_t bytes, cudaStream_t) {
  cuda_emulation::enqueue([=] { std::memset(p, value, bytes); });
  return cudaSuccess;
}

inline cudaError_t cudaDeviceGetStreamPriorityRange(int* least, int* greatest) {
  *least = 0; // as a device has it: lower numbers are higher priorities
  *greatest = -5;
  return cudaSuccess;
}
inline cudaError_t cudaStreamCreateWithPriority(cudaStream_t* s, unsigned, int priority) {
  *s = new CUstream_st{priority};
  return cudaSuccess;
}
inline cudaError_t cudaStreamDestroy(cudaStream_t s) {
  delete s;
  return cudaSuccess;
}
inline cudaError_t cudaStreamSynchronize(cudaStream_t s) {
  if (const auto r = cuda_emulation::synchronising(); r != cudaSuccess) return r;
  if (s != nullptr) cuda_emulation::settle(s->pending, true);
  return cudaSuccess;
}
inline cudaError_t cudaEventCreateWithFlags(cudaEvent_t* e, unsigned) {
  *e = new CUevent_st;
  return cudaSuccess;
}
inline cudaError_t cudaEventDestroy(cudaEvent_t e) {
  delete e;
  return cudaSuccess;
}
inline cudaError_t cudaEventRecord(cudaEvent_t e, cudaStream_t s) {
  cuda_emulation::enqueue([e, s] {
    e->at = std::chrono::steady_clock::now();
    e->pending = s != nullptr ? s->pending : std::vector<cuda_emulation_pending>{};
  });
  return cudaSuccess;
}
// Work runs when it is enqueued, so the event's stream has reached it, except for the
// point-to-point calls it carries: the waiting stream waits for those.
inline cudaError_t cudaStreamWaitEvent(cudaStream_t, cudaEvent_t e, unsigned) {
  cuda_emulation::enqueue([e] { cuda_emulation::settle(e->pending, true); });
  return cudaSuccess;
}
inline cudaError_t cudaEventQuery(cudaEvent_t e) {
  if (const auto r = cuda_emulation::synchronising(); r != cudaSuccess) return r;
  return cuda_emulation::settle(e->pending, false) ? cudaSuccess : cudaErrorNotReady;
}
inline cudaError_t cudaEventSynchronize(cudaEvent_t e) {
  if (const auto r = cuda_emulation::synchronising(); r != cudaSuccess) return r;
  cuda_emulation::settle(e->pending, true);
  return cudaSuccess;
}
inline cudaError_t cudaEventElapsedTime(float* ms, cudaEvent_t from, cudaEvent_t to) {
  *ms = std::chrono::duration<float, std::milli>(to->at - from->at).count();
  return cudaSuccess;
}
inline cudaError_t cudaStreamBeginCapture(cudaStream_t s, cudaStreamCaptureMode) {
  if (cuda_emulation::capture) return cuda_emulation::fails(cudaErrorIllegalState);
  cuda_emulation::capture = std::make_unique<cuda_emulation::capture_state>();
  cuda_emulation::capture->origin = s;
  return cudaSuccess;
}
inline cudaError_t cudaStreamEndCapture(cudaStream_t s, cudaGraph_t* g) {
  *g = nullptr;
  if (!cuda_emulation::capture || cuda_emulation::capture->origin != s) return cuda_emulation::fails(cudaErrorIllegalState);
  *g = new CUgraph_st{std::move(cuda_emulation::capture->work)};
  cuda_emulation::capture.reset();
  return cudaSuccess;
}
inline cudaError_t cudaStreamIsCapturing(cudaStream_t, cudaStreamCaptureStatus* st) {
  *st = cuda_emulation::capture ? cudaStreamCaptureStatusActive : cudaStreamCaptureStatusNone;
  return cudaSuccess;
}
inline cudaError_t cudaGraphInstantiate(cudaGraphExec_t* exec, cudaGraph_t g, unsigned long long) {
  *exec = new CUgraphExec_st{g->work};
  return cudaSuccess;
}
inline cudaError_t cudaGraphLaunch(cudaGraphExec_t exec, cudaStream_t) {
  for (const auto& w : exec->work) cuda_emulation::enqueue(w);
  return cudaSuccess;
}
inline cudaError_t cudaGraphGetNodes(cudaGraph_t g, cudaGraphNode_t*, std::size_t* n) {
  *n = g->work.size();
  return cudaSuccess;
}
inline cudaError_t cudaGraphExecDestroy(cudaGraphExec_t exec) {
  delete exec;
  return cudaSuccess;
}
inline cudaError_t cudaGraphDestroy(cudaGraph_t g) {
  delete g;
  return cudaSuccess;
}
