#pragma once
/// @file
/// @brief Matrix products on the GPU through cuBLASLt: fp32, and bf16 inputs with fp32 accumulation.
///
/// Conventions are those of the CPU kernel (runtime/cpu/matmul.hpp): row-major,
/// `C[m,n] = alpha·op(A)·op(B) (+ C with accumulate)`, A stored `[m,k]` (`[k,m]` when trans_a),
/// B stored `[k,n]` (`[n,k]` when trans_b). cuBLASLt is column-major, and a row-major matrix is
/// its transpose in column-major, so the row-major product is computed as the column-major
/// `Cᵀ[n,m] = op(B)ᵀ·op(A)ᵀ`: the operands swap places, the flags stay. A `gemm` is described
/// once (descriptors, layouts, the heuristic's algorithm) and then run any number of times,
/// so a step does no descriptor work. Host code only; compiles with g++ too.

#include <concerto/core/error.hpp>
#include <concerto/runtime/cuda/check.hpp>

#include <cublasLt.h>
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>

namespace concerto::runtime::cuda {

/// @brief An owned cuBLASLt handle (one per backend; handles are not shared between threads).
class blas_handle {
public:
  blas_handle() { CONCERTO_CUBLAS_CHECK(cublasLtCreate(&h_)); }
  blas_handle(blas_handle&& o) noexcept : h_(std::exchange(o.h_, nullptr)) {}
  blas_handle& operator=(blas_handle&& o) noexcept {
    if (this != &o) {
      reset();
      h_ = std::exchange(o.h_, nullptr);
    }
    return *this;
  }
  blas_handle(const blas_handle&) = delete;
  blas_handle& operator=(const blas_handle&) = delete;
  ~blas_handle() { reset(); }
  [[nodiscard]] cublasLtHandle_t get() const noexcept { return h_; }

private:
  void reset() noexcept {
    if (h_ != nullptr) (void)cublasLtDestroy(h_);
    h_ = nullptr;
  }
  cublasLtHandle_t h_ = nullptr;
};

/// @brief Element types of a product: inputs A and B share one, C may differ (bf16 inputs, fp32 C).
enum class gemm_type : std::uint8_t { f32, bf16 };

/// @brief The shape and flags of one (strided-batched) product.
struct gemm_shape {
  std::size_t m = 1, n = 1, k = 1;
  std::size_t batch = 1;     ///< independent products; operand i starts at i·m·k, i·k·n, i·m·n
  bool trans_a = false;
  bool trans_b = false;
  bool accumulate = false;   ///< C += alpha·op(A)·op(B)
  float alpha = 1.0f;
  gemm_type ab = gemm_type::f32;
  gemm_type c = gemm_type::f32;
  bool allow_tf32 = false;   ///< fp32 inputs: let the tensor cores round them to TF32 (faster, ~1e-3 relative)
};

namespace detail {
inline cudaDataType_t cuda_type(gemm_type t) { return t == gemm_type::f32 ? CUDA_R_32F : CUDA_R_16BF; }
inline std::size_t type_bytes(gemm_type t) { return t == gemm_type::f32 ? 4 : 2; }

class layout {
public:
  layout() = default;
  layout(cudaDataType_t type, std::size_t rows, std::size_t cols, std::size_t ld, std::size_t batch, std::int64_t stride) {
    CONCERTO_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&l_, type, rows, cols, static_cast<std::int64_t>(ld)));
    if (batch > 1) {
      const auto count = static_cast<std::int32_t>(batch);
      CONCERTO_CUBLAS_CHECK(cublasLtMatrixLayoutSetAttribute(l_, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &count, sizeof count));
      CONCERTO_CUBLAS_CHECK(
          cublasLtMatrixLayoutSetAttribute(l_, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &stride, sizeof stride));
    }
  }
  layout(layout&& o) noexcept : l_(std::exchange(o.l_, nullptr)) {}
  layout& operator=(layout&& o) noexcept {
    if (this != &o) {
      reset();
      l_ = std::exchange(o.l_, nullptr);
    }
    return *this;
  }
  ~layout() { reset(); }
  [[nodiscard]] cublasLtMatrixLayout_t get() const noexcept { return l_; }

private:
  void reset() noexcept {
    if (l_ != nullptr) (void)cublasLtMatrixLayoutDestroy(l_);
    l_ = nullptr;
  }
  cublasLtMatrixLayout_t l_ = nullptr;
};
} // namespace detail

/// @brief One product described for cuBLASLt: descriptors, layouts and the chosen algorithm.
/// @code
/// cuda::blas_handle lt;
/// cuda::device_buffer ws(cuda::gemm::default_workspace);
/// cuda::gemm y_eq_xwt(lt, {.m = rows, .n = out, .k = in, .trans_b = true}, ws.size());
/// y_eq_xwt.run(lt, x, w, y, ws.data(), stream);
/// @endcode
class gemm {
public:
  /// Workspace cuBLASLt may use per call (32 MiB: what NVIDIA suggests for Hopper).
  static constexpr std::size_t default_workspace = std::size_t{32} << 20;

  gemm() = default;
  gemm(const blas_handle& h, const gemm_shape& s, std::size_t workspace_bytes) : shape_(s) {
    const auto what = [&] {
      return "cuBLASLt product m=" + std::to_string(s.m) + " n=" + std::to_string(s.n) + " k=" + std::to_string(s.k) +
             " batch=" + std::to_string(s.batch);
    };
    CONCERTO_CHECK(s.ab == gemm_type::bf16 || s.c == gemm_type::f32,
                   what() + ": fp32 inputs need an fp32 output");
    const auto compute = s.ab == gemm_type::f32 && s.allow_tf32 ? CUBLAS_COMPUTE_32F_FAST_TF32 : CUBLAS_COMPUTE_32F;
    CONCERTO_CUBLAS_CHECK(cublasLtMatmulDescCreate(&desc_, compute, CUDA_R_32F));
    // Column-major view: C' = op(B)' · op(A)', with B' the row-major B read as column-major.
    const cublasOperation_t ta = s.trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;
    const cublasOperation_t tb = s.trans_a ? CUBLAS_OP_T : CUBLAS_OP_N;
    CONCERTO_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(desc_, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof ta));
    CONCERTO_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(desc_, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof tb));
    const auto mk = static_cast<std::int64_t>(s.m * s.k), kn = static_cast<std::int64_t>(s.k * s.n),
               mn = static_cast<std::int64_t>(s.m * s.n);
    // B' is [n,k] column-major without trans_b (ld n), [k,n] with it (ld k); likewise A'.
    b_ = detail::layout(detail::cuda_type(s.ab), s.trans_b ? s.k : s.n, s.trans_b ? s.n : s.k, s.trans_b ? s.k : s.n,
                        s.batch, kn);
    a_ = detail::layout(detail::cuda_type(s.ab), s.trans_a ? s.m : s.k, s.trans_a ? s.k : s.m, s.trans_a ? s.m : s.k,
                        s.batch, mk);
    c_ = detail::layout(detail::cuda_type(s.c), s.n, s.m, s.n, s.batch, mn);
    cublasLtMatmulPreference_t pref = nullptr;
    CONCERTO_CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&pref));
    const std::uint64_t ws = workspace_bytes;
    const auto set = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof ws);
    cublasLtMatmulHeuristicResult_t result{};
    int found = 0;
    const auto got = set == CUBLAS_STATUS_SUCCESS
                         ? cublasLtMatmulAlgoGetHeuristic(h.get(), desc_, b_.get(), a_.get(), c_.get(), c_.get(), pref, 1,
                                                          &result, &found)
                         : set;
    (void)cublasLtMatmulPreferenceDestroy(pref);
    if (got != CUBLAS_STATUS_SUCCESS || found == 0)
      fail(what() + ": cuBLASLt offers no algorithm (" + cublasLtGetStatusString(got) + ")");
    algo_ = result.algo;
    workspace_ = result.workspaceSize;
  }
  gemm(gemm&& o) noexcept
      : shape_(o.shape_), desc_(std::exchange(o.desc_, nullptr)), a_(std::move(o.a_)), b_(std::move(o.b_)),
        c_(std::move(o.c_)), algo_(o.algo_), workspace_(o.workspace_) {}
  gemm& operator=(gemm&& o) noexcept {
    if (this != &o) {
      reset();
      shape_ = o.shape_;
      desc_ = std::exchange(o.desc_, nullptr);
      a_ = std::move(o.a_);
      b_ = std::move(o.b_);
      c_ = std::move(o.c_);
      algo_ = o.algo_;
      workspace_ = o.workspace_;
    }
    return *this;
  }
  gemm(const gemm&) = delete;
  gemm& operator=(const gemm&) = delete;
  ~gemm() { reset(); }

  [[nodiscard]] const gemm_shape& shape() const noexcept { return shape_; }
  /// Workspace bytes the chosen algorithm needs (at most the size given at construction).
  [[nodiscard]] std::size_t workspace_bytes() const noexcept { return workspace_; }
  /// Enqueues the product on `s`. a, b, c are device pointers of the shape's types.
  void run(const blas_handle& h, const void* a, const void* b, void* c, void* workspace, cudaStream_t s) const {
    CONCERTO_CHECK(desc_ != nullptr, "cuda::gemm: run on an empty product");
    if (shape_.m == 0 || shape_.n == 0) return;
    const float alpha = shape_.alpha, beta = shape_.accumulate ? 1.0f : 0.0f;
    CONCERTO_CUBLAS_CHECK(cublasLtMatmul(h.get(), desc_, &alpha, b, b_.get(), a, a_.get(), &beta, c, c_.get(), c, c_.get(),
                                         &algo_, workspace, workspace_, s));
  }

private:
  void reset() noexcept {
    if (desc_ != nullptr) (void)cublasLtMatmulDescDestroy(desc_);
    desc_ = nullptr;
  }
  gemm_shape shape_{};
  cublasLtMatmulDesc_t desc_ = nullptr;
  detail::layout a_, b_, c_;
  cublasLtMatmulAlgo_t algo_{};
  std::size_t workspace_ = 0;
};

} // namespace concerto::runtime::cuda
