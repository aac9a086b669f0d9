#pragma once
/// @file
/// @brief Convolutions on the GPU through cuDNN's graph (backend) API: forward, the image's
/// gradient and the kernel's gradient of one conv2d task, each described once (tensors, the
/// operation, the engine the heuristic offers) and then run any number of times.
///
/// The task's image is NHWC and its kernel HWIO. cuDNN names a convolution's dims in NCHW order
/// (image N, C, H, W; filter K, C, R, S) and takes any layout as strides, so the image needs no
/// copy and the kernel is first described as it lies (HWIO by strides). Engines that do not take
/// that filter layout refuse to finalize; the plan then describes the filter packed as KRSC
/// (`filter_layout::krsc`), which the caller stages with one transpose (the kernel is small next
/// to the images), as runtime/cuda/dispatch.cuh does.
///
/// An engine is taken in the heuristic's order, skipping those whose numerics the run did not
/// allow: TF32 tensor cores on fp32 data unless `allow_tf32`, and non-deterministic ones (atomics
/// in the kernel's gradient): a step repeats bit for bit, which the fault drills' replays and the
/// CPU-equality tests rely on. Host code only; compiles with g++ too.

#include <concerto/core/error.hpp>
#include <concerto/ir/task_attrs.hpp>
#include <concerto/runtime/cuda/blas.hpp>

#include <cuda_runtime_api.h>
#include <cudnn.h>

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace concerto::runtime::cuda {

namespace detail {
[[noreturn]] inline void cudnn_failed(cudnnStatus_t s, const char* call, const char* file, int line) {
  fail(std::string(call) + " failed: " + cudnnGetErrorString(s) + " at " + file + ":" + std::to_string(line));
}
} // namespace detail

} // namespace concerto::runtime::cuda

/// Checks a cuDNN call; throws concerto::error with the call, cuDNN's message and file:line.
#define CONCERTO_CUDNN_CHECK(call)                                                                  \
  do {                                                                                              \
    const cudnnStatus_t concerto_cudnn_s_ = (call);                                                 \
    if (concerto_cudnn_s_ != CUDNN_STATUS_SUCCESS) [[unlikely]]                                     \
      ::concerto::runtime::cuda::detail::cudnn_failed(concerto_cudnn_s_, #call, __FILE__, __LINE__); \
  } while (false)

namespace concerto::runtime::cuda {

/// @brief An owned cuDNN handle (one per backend, as the cuBLASLt handle).
class dnn_handle {
public:
  dnn_handle() {
    cudnnHandle_t h = nullptr;
    CONCERTO_CUDNN_CHECK(cudnnCreate(&h));
    h_ = h;
  }
  dnn_handle(const dnn_handle&) = delete;
  dnn_handle& operator=(const dnn_handle&) = delete;
  ~dnn_handle() { (void)cudnnDestroy(h_); }
  [[nodiscard]] cudnnHandle_t get() const noexcept { return h_; }

private:
  cudnnHandle_t h_ = nullptr;
};

/// @brief Which product of a convolution a plan computes: forward y(x, w), the image's gradient
/// dx(dy, w), or the kernel's gradient dw(x, dy).
enum class conv_pass : std::uint8_t { forward, grad_input, grad_weight };

/// @brief How the plan's filter operand lies in memory: the task's own HWIO, or KRSC staged by the caller.
enum class filter_layout : std::uint8_t { hwio, krsc };

/// @brief What a plan is asked for.
struct conv_request {
  ir::conv_geometry geometry{};
  conv_pass pass = conv_pass::forward;
  bool accumulate = false;            ///< grad_weight: dw += the gradient (beta 1)
  bool allow_tf32 = false;            ///< fp32 on TF32 tensor cores (~1e-3 relative)
  std::size_t workspace_limit = 0;    ///< bytes of workspace the engine may use
  std::uint32_t align = 256;          ///< bytes every operand's address is a multiple of (operand_alignment)
};

namespace detail {

// One backend descriptor, destroyed once.
class dnn_descriptor {
public:
  dnn_descriptor() = default;
  explicit dnn_descriptor(cudnnBackendDescriptorType_t type) { CONCERTO_CUDNN_CHECK(cudnnBackendCreateDescriptor(type, &d_)); }
  dnn_descriptor(dnn_descriptor&& o) noexcept : d_(std::exchange(o.d_, nullptr)) {}
  dnn_descriptor& operator=(dnn_descriptor&& o) noexcept {
    std::swap(d_, o.d_);
    return *this;
  }
  dnn_descriptor(const dnn_descriptor&) = delete;
  dnn_descriptor& operator=(const dnn_descriptor&) = delete;
  ~dnn_descriptor() {
    if (d_ != nullptr) (void)cudnnBackendDestroyDescriptor(d_);
  }
  [[nodiscard]] cudnnBackendDescriptor_t get() const noexcept { return d_; }
  explicit operator bool() const noexcept { return d_ != nullptr; }

  template <class T>
  void set(cudnnBackendAttributeName_t name, cudnnBackendAttributeType_t type, const T* values, std::int64_t count) {
    CONCERTO_CUDNN_CHECK(cudnnBackendSetAttribute(d_, name, type, count, values));
  }
  template <class T>
  void set(cudnnBackendAttributeName_t name, cudnnBackendAttributeType_t type, const T& value) {
    set(name, type, &value, 1);
  }
  void finalize() { CONCERTO_CUDNN_CHECK(cudnnBackendFinalize(d_)); }

private:
  cudnnBackendDescriptor_t d_ = nullptr;
};

// An fp32 tensor of four dims (cuDNN's NCHW / KCRS naming) with the given strides.
inline dnn_descriptor make_tensor(std::int64_t uid, const std::array<std::int64_t, 4>& dims,
                                  const std::array<std::int64_t, 4>& strides, std::int64_t align) {
  dnn_descriptor t(CUDNN_BACKEND_TENSOR_DESCRIPTOR);
  const cudnnDataType_t type = CUDNN_DATA_FLOAT;
  t.set(CUDNN_ATTR_TENSOR_DATA_TYPE, CUDNN_TYPE_DATA_TYPE, type);
  t.set(CUDNN_ATTR_TENSOR_DIMENSIONS, CUDNN_TYPE_INT64, dims.data(), 4);
  t.set(CUDNN_ATTR_TENSOR_STRIDES, CUDNN_TYPE_INT64, strides.data(), 4);
  t.set(CUDNN_ATTR_TENSOR_UNIQUE_ID, CUDNN_TYPE_INT64, uid);
  t.set(CUDNN_ATTR_TENSOR_BYTE_ALIGNMENT, CUDNN_TYPE_INT64, align);
  t.finalize();
  return t;
}

// NHWC images with cuDNN's dims [n, c, h, w].
inline dnn_descriptor make_image(std::int64_t uid, std::int64_t n, std::int64_t c, std::int64_t h, std::int64_t w,
                                 std::int64_t align) {
  return make_tensor(uid, {n, c, h, w}, {h * w * c, 1, w * c, c}, align);
}

// The kernel with cuDNN's dims [k (out), c (in), r, s]: HWIO as the task stores it, or KRSC packed.
inline dnn_descriptor make_filter(const ir::conv_geometry& g, filter_layout layout, std::int64_t align) {
  const auto k = g.out_channels, c = g.in_channels, r = g.kernel_h, s = g.kernel_w;
  const std::array<std::int64_t, 4> strides =
      layout == filter_layout::hwio ? std::array<std::int64_t, 4>{1, k, s * c * k, c * k}
                                    : std::array<std::int64_t, 4>{r * s * c, 1, s * c, c};
  return make_tensor(2, {k, c, r, s}, strides, align);
}

inline dnn_descriptor make_conv_desc(const ir::conv_geometry& g) {
  dnn_descriptor d(CUDNN_BACKEND_CONVOLUTION_DESCRIPTOR);
  const cudnnDataType_t compute = CUDNN_DATA_FLOAT;
  const cudnnConvolutionMode_t mode = CUDNN_CROSS_CORRELATION; // what deep learning calls convolution
  const std::int64_t spatial = 2;
  const std::array<std::int64_t, 2> ones{1, 1}, stride{g.stride, g.stride}, pad{g.padding, g.padding};
  d.set(CUDNN_ATTR_CONVOLUTION_COMP_TYPE, CUDNN_TYPE_DATA_TYPE, compute);
  d.set(CUDNN_ATTR_CONVOLUTION_CONV_MODE, CUDNN_TYPE_CONVOLUTION_MODE, mode);
  d.set(CUDNN_ATTR_CONVOLUTION_SPATIAL_DIMS, CUDNN_TYPE_INT64, spatial);
  d.set(CUDNN_ATTR_CONVOLUTION_DILATIONS, CUDNN_TYPE_INT64, ones.data(), 2);
  d.set(CUDNN_ATTR_CONVOLUTION_FILTER_STRIDES, CUDNN_TYPE_INT64, stride.data(), 2);
  d.set(CUDNN_ATTR_CONVOLUTION_PRE_PADDINGS, CUDNN_TYPE_INT64, pad.data(), 2);
  d.set(CUDNN_ATTR_CONVOLUTION_POST_PADDINGS, CUDNN_TYPE_INT64, pad.data(), 2);
  d.finalize();
  return d;
}

// The pass's operation over x (uid 1), w (uid 2) and y (uid 3), with alpha 1 and the given beta;
// the descriptors it refers to travel with it (the plan keeps them all alive, as cuDNN's own
// frontend does: nothing says the library copies what one descriptor points to).
struct conv_operation {
  dnn_descriptor x, w, y, conv, op;
};
inline conv_operation make_conv_operation(const conv_request& r, filter_layout layout, float beta) {
  const auto& g = r.geometry;
  const auto align = static_cast<std::int64_t>(r.align);
  conv_operation o{make_image(1, g.batch, g.in_channels, g.height, g.width, align), make_filter(g, layout, align),
                   make_image(3, g.batch, g.out_channels, g.out_h(), g.out_w(), align), make_conv_desc(g), {}};
  // Each pass's operation names the same six things by its own attributes.
  struct names {
    cudnnBackendDescriptorType_t type;
    cudnnBackendAttributeName_t x, w, y, conv, alpha, beta;
  };
  static constexpr names by_pass[] = { // in conv_pass order
      {CUDNN_BACKEND_OPERATION_CONVOLUTION_FORWARD_DESCRIPTOR, CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_X,
       CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_W, CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_Y,
       CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_CONV_DESC, CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_ALPHA,
       CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_BETA},
      {CUDNN_BACKEND_OPERATION_CONVOLUTION_BACKWARD_DATA_DESCRIPTOR, CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_DATA_DX,
       CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_DATA_W, CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_DATA_DY,
       CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_DATA_CONV_DESC, CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_DATA_ALPHA,
       CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_DATA_BETA},
      {CUDNN_BACKEND_OPERATION_CONVOLUTION_BACKWARD_FILTER_DESCRIPTOR, CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_FILTER_X,
       CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_FILTER_DW, CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_FILTER_DY,
       CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_FILTER_CONV_DESC, CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_FILTER_ALPHA,
       CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_FILTER_BETA}};
  const auto& n = by_pass[static_cast<int>(r.pass)];
  const float alpha = 1.0f;
  const auto xd = o.x.get(), wd = o.w.get(), yd = o.y.get(), cd = o.conv.get();
  auto& op = o.op;
  op = dnn_descriptor(n.type);
  op.set(n.x, CUDNN_TYPE_BACKEND_DESCRIPTOR, xd);
  op.set(n.w, CUDNN_TYPE_BACKEND_DESCRIPTOR, wd);
  op.set(n.y, CUDNN_TYPE_BACKEND_DESCRIPTOR, yd);
  op.set(n.conv, CUDNN_TYPE_BACKEND_DESCRIPTOR, cd);
  op.set(n.alpha, CUDNN_TYPE_FLOAT, alpha);
  op.set(n.beta, CUDNN_TYPE_FLOAT, beta);
  op.finalize();
  return o;
}

// Whether the engine of a heuristic's configuration computes as the request allows.
inline bool numerics_allowed(const dnn_descriptor& config, const conv_request& r) {
  dnn_descriptor engine(CUDNN_BACKEND_ENGINE_DESCRIPTOR);
  auto raw = engine.get();
  std::int64_t n = 0;
  CONCERTO_CUDNN_CHECK(
      cudnnBackendGetAttribute(config.get(), CUDNN_ATTR_ENGINECFG_ENGINE, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &n, &raw));
  std::array<cudnnBackendNumericalNote_t, CUDNN_NUMERICAL_NOTE_TYPE_COUNT> notes{};
  CONCERTO_CUDNN_CHECK(cudnnBackendGetAttribute(engine.get(), CUDNN_ATTR_ENGINE_NUMERICAL_NOTE, CUDNN_TYPE_NUMERICAL_NOTE,
                                                static_cast<std::int64_t>(notes.size()), &n, notes.data()));
  for (std::int64_t i = 0; i < n; ++i) {
    const auto note = notes[static_cast<std::size_t>(i)];
    if (note == CUDNN_NUMERICAL_NOTE_NONDETERMINISTIC) return false;
    // On fp32 data a tensor-core engine rounds its inputs to TF32.
    if (!r.allow_tf32 && (note == CUDNN_NUMERICAL_NOTE_TENSOR_CORE || note == CUDNN_NUMERICAL_NOTE_DOWN_CONVERT_INPUTS))
      return false;
  }
  return true;
}

} // namespace detail

/// @brief One pass of one convolution, described for cuDNN: the operation graph and the execution
/// plan of the first engine that finalizes with the allowed numerics and the workspace given.
/// An empty plan (`!plan`) says why in `reason()`; the caller then runs its own kernel.
/// @code
/// cuda::dnn_handle dnn;
/// auto fwd = cuda::conv_plan(dnn, {.geometry = g, .pass = cuda::conv_pass::forward, .workspace_limit = ws_bytes});
/// if (fwd && fwd.filter() == cuda::filter_layout::hwio) fwd.run(dnn, x, w, y, ws, stream);
/// @endcode
class conv_plan {
public:
  conv_plan() = default;
  conv_plan(const dnn_handle& h, const conv_request& r) : request_(r) {
    for (const auto layout : {filter_layout::hwio, filter_layout::krsc}) {
      // A staged KRSC gradient is written whole and added to dw by the caller.
      const float beta = r.pass == conv_pass::grad_weight && r.accumulate && layout == filter_layout::hwio ? 1.0f : 0.0f;
      if (try_layout(h, layout, beta)) return;
    }
  }
  conv_plan(conv_plan&&) noexcept = default;
  conv_plan& operator=(conv_plan&&) noexcept = default;
  conv_plan(const conv_plan&) = delete;
  conv_plan& operator=(const conv_plan&) = delete;
  ~conv_plan() = default;

  explicit operator bool() const noexcept { return static_cast<bool>(plan_); }
  [[nodiscard]] const conv_request& request() const noexcept { return request_; }
  [[nodiscard]] filter_layout filter() const noexcept { return layout_; }
  [[nodiscard]] std::size_t workspace_bytes() const noexcept { return workspace_; }
  /// Why no engine was taken (empty for a plan that has one).
  [[nodiscard]] const std::string& reason() const noexcept { return reason_; }

  /// Enqueues the pass on `s`: forward (a = x, b = w, out = y), grad_input (a = dy, b = w,
  /// out = dx), grad_weight (a = x, b = dy, out = dw); w and dw in the plan's filter layout.
  void run(const dnn_handle& h, const float* a, const float* b, float* out, void* workspace, cudaStream_t s) const {
    CONCERTO_CHECK(static_cast<bool>(plan_), "cuda::conv_plan: run on a plan without an engine (" + reason_ + ")");
    for (const void* p : {static_cast<const void*>(a), static_cast<const void*>(b), static_cast<const void*>(out)})
      if (operand_alignment(p) < request_.align)
        fail("cuda::conv_plan: an operand aligned to " + std::to_string(operand_alignment(p)) +
             " bytes, the plan was described for " + std::to_string(request_.align));
    CONCERTO_CHECK(workspace != nullptr || workspace_ == 0, "cuda::conv_plan: its engine needs a workspace");
    const bool image_out = request_.pass == conv_pass::grad_input;
    const bool filter_out = request_.pass == conv_pass::grad_weight;
    // uid 1 is x (dx), 2 w (dw), 3 y (dy).
    void* x = image_out ? static_cast<void*>(out) : const_cast<float*>(a);
    void* w = filter_out ? static_cast<void*>(out) : const_cast<float*>(b);
    void* y = request_.pass == conv_pass::forward ? static_cast<void*>(out)
                                                  : const_cast<float*>(request_.pass == conv_pass::grad_input ? a : b);
    const std::array<void*, 3> pointers{x, w, y};
    // The arena's views do not move between steps: one variant pack serves every run.
    if (!pack_ || pointers != pointers_ || workspace != pack_workspace_) {
      detail::dnn_descriptor pack(CUDNN_BACKEND_VARIANT_PACK_DESCRIPTOR);
      const std::array<std::int64_t, 3> uids{1, 2, 3};
      pack.set(CUDNN_ATTR_VARIANT_PACK_UNIQUE_IDS, CUDNN_TYPE_INT64, uids.data(), 3);
      pack.set(CUDNN_ATTR_VARIANT_PACK_DATA_POINTERS, CUDNN_TYPE_VOID_PTR, pointers.data(), 3);
      pack.set(CUDNN_ATTR_VARIANT_PACK_WORKSPACE, CUDNN_TYPE_VOID_PTR, workspace);
      pack.finalize();
      pack_ = std::move(pack);
      pointers_ = pointers;
      pack_workspace_ = workspace;
    }
    CONCERTO_CUDNN_CHECK(cudnnSetStream(h.get(), s));
    CONCERTO_CUDNN_CHECK(cudnnBackendExecute(h.get(), plan_.get(), pack_.get()));
  }

private:
  // Describes the pass with the filter in `layout` and takes the first engine that suits.
  bool try_layout(const dnn_handle& h, filter_layout layout, float beta) {
    auto op = detail::make_conv_operation(request_, layout, beta);
    detail::dnn_descriptor graph(CUDNN_BACKEND_OPERATIONGRAPH_DESCRIPTOR);
    const auto op_raw = op.op.get();
    const auto handle = h.get();
    graph.set(CUDNN_ATTR_OPERATIONGRAPH_OPS, CUDNN_TYPE_BACKEND_DESCRIPTOR, op_raw);
    graph.set(CUDNN_ATTR_OPERATIONGRAPH_HANDLE, CUDNN_TYPE_HANDLE, handle);
    graph.finalize();
    for (const auto mode : {CUDNN_HEUR_MODE_A, CUDNN_HEUR_MODE_FALLBACK}) {
      detail::dnn_descriptor heuristic(CUDNN_BACKEND_ENGINEHEUR_DESCRIPTOR);
      const auto graph_raw = graph.get();
      heuristic.set(CUDNN_ATTR_ENGINEHEUR_OPERATION_GRAPH, CUDNN_TYPE_BACKEND_DESCRIPTOR, graph_raw);
      heuristic.set(CUDNN_ATTR_ENGINEHEUR_MODE, CUDNN_TYPE_HEUR_MODE, mode);
      if (cudnnBackendFinalize(heuristic.get()) != CUDNN_STATUS_SUCCESS) continue;
      std::int64_t offered = 0;
      CONCERTO_CUDNN_CHECK(cudnnBackendGetAttribute(heuristic.get(), CUDNN_ATTR_ENGINEHEUR_RESULTS,
                                                    CUDNN_TYPE_BACKEND_DESCRIPTOR, 0, &offered, nullptr));
      std::vector<detail::dnn_descriptor> configs;
      std::vector<cudnnBackendDescriptor_t> raw;
      for (std::int64_t i = 0; i < offered; ++i) {
        configs.emplace_back(CUDNN_BACKEND_ENGINECFG_DESCRIPTOR);
        raw.push_back(configs.back().get());
      }
      std::int64_t got = 0;
      if (offered > 0)
        CONCERTO_CUDNN_CHECK(cudnnBackendGetAttribute(heuristic.get(), CUDNN_ATTR_ENGINEHEUR_RESULTS,
                                                      CUDNN_TYPE_BACKEND_DESCRIPTOR, offered, &got, raw.data()));
      for (std::int64_t i = 0; i < got; ++i)
        if (take_engine(h, configs[static_cast<std::size_t>(i)], layout)) {
          kept_ = {std::move(op), std::move(graph), std::move(configs[static_cast<std::size_t>(i)])};
          return true;
        }
    }
    reason_ += std::string(reason_.empty() ? "" : "; ") + "no engine for a " +
               (layout == filter_layout::hwio ? "HWIO" : "KRSC") + " filter with deterministic" +
               (request_.allow_tf32 ? "" : " fp32 (no TF32)") + " numerics in " +
               std::to_string(request_.workspace_limit) + " workspace bytes";
    return false;
  }

  bool take_engine(const dnn_handle& h, const detail::dnn_descriptor& config, filter_layout layout) {
    if (!detail::numerics_allowed(config, request_)) return false;
    detail::dnn_descriptor plan(CUDNN_BACKEND_EXECUTION_PLAN_DESCRIPTOR);
    const auto handle = h.get();
    const auto config_raw = config.get();
    plan.set(CUDNN_ATTR_EXECUTION_PLAN_HANDLE, CUDNN_TYPE_HANDLE, handle);
    plan.set(CUDNN_ATTR_EXECUTION_PLAN_ENGINE_CONFIG, CUDNN_TYPE_BACKEND_DESCRIPTOR, config_raw);
    if (cudnnBackendFinalize(plan.get()) != CUDNN_STATUS_SUCCESS) return false; // not for these tensors
    std::int64_t bytes = 0, n = 0;
    CONCERTO_CUDNN_CHECK(
        cudnnBackendGetAttribute(plan.get(), CUDNN_ATTR_EXECUTION_PLAN_WORKSPACE_SIZE, CUDNN_TYPE_INT64, 1, &n, &bytes));
    if (bytes < 0 || static_cast<std::size_t>(bytes) > request_.workspace_limit) return false;
    plan_ = std::move(plan);
    layout_ = layout;
    workspace_ = static_cast<std::size_t>(bytes);
    reason_.clear();
    return true;
  }

  // What the execution plan was made from, alive as long as it is.
  struct described {
    detail::conv_operation operation;
    detail::dnn_descriptor graph, config;
  };
  conv_request request_{};
  described kept_;
  detail::dnn_descriptor plan_;
  filter_layout layout_ = filter_layout::hwio;
  std::size_t workspace_ = 0;
  std::string reason_;
  mutable detail::dnn_descriptor pack_;
  mutable std::array<void*, 3> pointers_{};
  mutable void* pack_workspace_ = nullptr;
};

} // namespace concerto::runtime::cuda
