#pragma once
/// @file
/// @brief Matrix products on the GPU through cuBLASLt: fp32, and 16-bit float inputs (bf16 or
/// f16) with fp32 accumulation.
///
/// Conventions are those of the CPU kernel (runtime/cpu/matmul.hpp): row-major,
/// `C[m,n] = alpha·op(A)·op(B) (+ C with accumulate)`, A stored `[m,k]` (`[k,m]` when trans_a),
/// B stored `[k,n]` (`[n,k]` when trans_b). cuBLASLt is column-major, and a row-major matrix is
/// its transpose in column-major, so the row-major product is computed as the column-major
/// `Cᵀ[n,m] = op(B)ᵀ·op(A)ᵀ`: the operands swap places, the flags stay. A `gemm` is described
/// once (descriptors, layouts, the heuristic's algorithm) and then run any number of times,
/// so a step does no descriptor work. The heuristic is told each operand's real alignment
/// (`gemm_shape::align_*`): arena views such as bucket members are not all 256-byte aligned,
/// which is what cuBLASLt assumes otherwise. Host code only; compiles with g++ too.

#include <concerto/core/error.hpp>
#include <concerto/runtime/cuda/check.hpp>

#include <cublasLt.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <type_traits>

namespace concerto::runtime::cuda {

namespace detail {
// Owns one cuBLASLt object (its handles are pointers to opaque structs) and releases it once,
// with the library's own destroy function: also when a constructor throws after making it.
template <class Handle, cublasStatus_t (*Destroy)(Handle)>
struct lt_release {
  void operator()(Handle h) const noexcept { (void)Destroy(h); }
};
template <class Handle, cublasStatus_t (*Destroy)(Handle)>
using lt_owned = std::unique_ptr<std::remove_pointer_t<Handle>, lt_release<Handle, Destroy>>;
} // namespace detail

/// @brief An owned cuBLASLt handle (one per backend; handles are not shared between threads).
class blas_handle {
public:
  blas_handle() {
    cublasLtHandle_t h = nullptr;
    CONCERTO_CUBLAS_CHECK(cublasLtCreate(&h));
    h_.reset(h);
  }
  [[nodiscard]] cublasLtHandle_t get() const noexcept { return h_.get(); }

private:
  detail::lt_owned<cublasLtHandle_t, cublasLtDestroy> h_;
};

/// @brief Element types of a product: inputs A and B share one, C is f32 or the inputs' type
/// (bf16 or f16 inputs, an fp32 C).
enum class gemm_type : std::uint8_t { f32, bf16, f16 };

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
  /// Bytes each operand's address is a multiple of (256: what cudaMalloc gives). cuBLASLt's
  /// heuristic otherwise assumes 256 and may pick a kernel with vector loads that fault on an
  /// arena view (a bucket member, a decomposition chunk); `operand_alignment` computes them.
  /// `gemm` lowers them further for a strided batch whose stride is less aligned, and its `run`
  /// checks the pointers it is given against them.
  std::uint32_t align_a = 256, align_b = 256, align_c = 256;
};

/// @brief The alignment cuBLASLt may assume for an operand at `p`: the largest power of two, at
/// most 256, dividing the address and (for a strided batch, else 0) the batch stride in bytes.
/// @code
/// shape.align_a = cuda::operand_alignment(a_ptr, shape.batch > 1 ? shape.m * shape.k * 4 : 0);
/// @endcode
[[nodiscard]] inline std::uint32_t operand_alignment(const void* p, std::size_t batch_stride_bytes = 0) noexcept {
  const auto bits = reinterpret_cast<std::uintptr_t>(p) | static_cast<std::uintptr_t>(batch_stride_bytes) | 256u;
  return static_cast<std::uint32_t>(bits & (~bits + 1)); // the lowest set bit
}

namespace detail {
inline cudaDataType_t cuda_type(gemm_type t) {
  switch (t) {
  case gemm_type::f32: return CUDA_R_32F;
  case gemm_type::bf16: return CUDA_R_16BF;
  case gemm_type::f16: return CUDA_R_16F;
  }
  return CUDA_R_32F;
}
inline std::size_t type_bytes(gemm_type t) { return t == gemm_type::f32 ? 4 : 2; }

using layout = lt_owned<cublasLtMatrixLayout_t, cublasLtMatrixLayoutDestroy>;
using matmul_desc = lt_owned<cublasLtMatmulDesc_t, cublasLtMatmulDescDestroy>;
using preference = lt_owned<cublasLtMatmulPreference_t, cublasLtMatmulPreferenceDestroy>;

inline layout make_layout(cudaDataType_t type, std::size_t rows, std::size_t cols, std::size_t ld, std::size_t batch,
                          std::int64_t stride) {
  cublasLtMatrixLayout_t raw = nullptr;
  CONCERTO_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&raw, type, rows, cols, static_cast<std::int64_t>(ld)));
  layout l(raw);
  if (batch > 1) {
    const auto count = static_cast<std::int32_t>(batch);
    CONCERTO_CUBLAS_CHECK(cublasLtMatrixLayoutSetAttribute(l.get(), CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &count, sizeof count));
    CONCERTO_CUBLAS_CHECK(
        cublasLtMatrixLayoutSetAttribute(l.get(), CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &stride, sizeof stride));
  }
  return l;
}

// The operation descriptor: compute type, fp32 scale type, and the operations on cuBLAS's A and B.
inline matmul_desc make_matmul_desc(cublasComputeType_t compute, cublasOperation_t ta, cublasOperation_t tb) {
  cublasLtMatmulDesc_t raw = nullptr;
  CONCERTO_CUBLAS_CHECK(cublasLtMatmulDescCreate(&raw, compute, CUDA_R_32F));
  matmul_desc d(raw);
  CONCERTO_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(d.get(), CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof ta));
  CONCERTO_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(d.get(), CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof tb));
  return d;
}

// The heuristic's search preferences, only alive while the constructor asks for an algorithm.
inline preference make_preference() {
  cublasLtMatmulPreference_t raw = nullptr;
  CONCERTO_CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&raw));
  return preference(raw);
}
template <class T>
void set(const preference& p, cublasLtMatmulPreferenceAttributes_t attribute, T value) {
  CONCERTO_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(p.get(), attribute, &value, sizeof value));
}
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
  gemm(const blas_handle& h, const gemm_shape& requested, std::size_t workspace_bytes) : shape_(requested) {
    auto& s = shape_;
    // Matrix i of a strided batch starts i strides further: the stride bounds the alignment too.
    const auto batched = [&](std::uint32_t align, std::size_t values, gemm_type type) {
      return s.batch > 1 ? std::min(align, operand_alignment(nullptr, values * detail::type_bytes(type))) : align;
    };
    s.align_a = batched(s.align_a, s.m * s.k, s.ab);
    s.align_b = batched(s.align_b, s.k * s.n, s.ab);
    s.align_c = batched(s.align_c, s.m * s.n, s.c);
    const auto what = [&] {
      return "cuBLASLt product m=" + std::to_string(s.m) + " n=" + std::to_string(s.n) + " k=" + std::to_string(s.k) +
             " batch=" + std::to_string(s.batch);
    };
    CONCERTO_CHECK(s.c == gemm_type::f32 || s.c == s.ab,
                   what() + ": the output is fp32 or of the inputs' type (fp32 inputs need an fp32 output)");
    const auto compute = s.ab == gemm_type::f32 && s.allow_tf32 ? CUBLAS_COMPUTE_32F_FAST_TF32 : CUBLAS_COMPUTE_32F;
    // Column-major view: C' = op(B)' · op(A)', with B' the row-major B read as column-major.
    desc_ = detail::make_matmul_desc(compute, s.trans_b ? CUBLAS_OP_T : CUBLAS_OP_N, s.trans_a ? CUBLAS_OP_T : CUBLAS_OP_N);
    const auto mk = static_cast<std::int64_t>(s.m * s.k), kn = static_cast<std::int64_t>(s.k * s.n),
               mn = static_cast<std::int64_t>(s.m * s.n);
    // B' is [n,k] column-major without trans_b (ld n), [k,n] with it (ld k); likewise A'.
    b_ = detail::make_layout(detail::cuda_type(s.ab), s.trans_b ? s.k : s.n, s.trans_b ? s.n : s.k, s.trans_b ? s.k : s.n,
                        s.batch, kn);
    a_ = detail::make_layout(detail::cuda_type(s.ab), s.trans_a ? s.m : s.k, s.trans_a ? s.k : s.m, s.trans_a ? s.m : s.k,
                        s.batch, mk);
    c_ = detail::make_layout(detail::cuda_type(s.c), s.n, s.m, s.n, s.batch, mn);
    const auto pref = detail::make_preference();
    detail::set(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, std::uint64_t{workspace_bytes});
    // The operands' real alignment, not the 256 bytes the heuristic assumes by default. The
    // operands swap places in the column-major view: cuBLAS's A is our b, its B our a.
    detail::set(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, s.align_b);
    detail::set(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, s.align_a);
    detail::set(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, s.align_c);
    detail::set(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, s.align_c);
    cublasLtMatmulHeuristicResult_t result{};
    int found = 0;
    const auto got = cublasLtMatmulAlgoGetHeuristic(h.get(), desc_.get(), b_.get(), a_.get(), c_.get(), c_.get(),
                                                    pref.get(), 1, &result, &found);
    if (got != CUBLAS_STATUS_SUCCESS || found == 0)
      fail(what() + ": cuBLASLt offers no algorithm for operands aligned to " + std::to_string(s.align_a) + "/" +
           std::to_string(s.align_b) + "/" + std::to_string(s.align_c) + " bytes (a/b/c) (" +
           cublasLtGetStatusString(got) + ")");
    algo_ = result.algo;
    workspace_ = result.workspaceSize;
  }
  gemm(gemm&&) noexcept = default;
  gemm& operator=(gemm&&) noexcept = default;
  gemm(const gemm&) = delete;
  gemm& operator=(const gemm&) = delete;
  ~gemm() = default;

  [[nodiscard]] const gemm_shape& shape() const noexcept { return shape_; }
  /// Workspace bytes the chosen algorithm needs (at most the size given at construction).
  [[nodiscard]] std::size_t workspace_bytes() const noexcept { return workspace_; }
  /// Enqueues the product on `s`. a, b, c are device pointers of the shape's types.
  void run(const blas_handle& h, const void* a, const void* b, void* c, void* workspace, cudaStream_t s) const {
    CONCERTO_CHECK(desc_.get() != nullptr, "cuda::gemm: run on an empty product");
    if (shape_.m == 0 || shape_.n == 0) return;
    // The algorithm was chosen for the described alignment; a less aligned pointer could fault.
    const auto misaligned = [](const void* p, std::uint32_t align) { return operand_alignment(p) < align; };
    if (misaligned(a, shape_.align_a) || misaligned(b, shape_.align_b) || misaligned(c, shape_.align_c))
      fail("cuda::gemm: operands aligned to " + std::to_string(operand_alignment(a)) + "/" +
           std::to_string(operand_alignment(b)) + "/" + std::to_string(operand_alignment(c)) +
           " bytes (a/b/c), the product was described for " + std::to_string(shape_.align_a) + "/" +
           std::to_string(shape_.align_b) + "/" + std::to_string(shape_.align_c));
    const float alpha = shape_.alpha, beta = shape_.accumulate ? 1.0f : 0.0f;
    CONCERTO_CUBLAS_CHECK(cublasLtMatmul(h.get(), desc_.get(), &alpha, b, b_.get(), a, a_.get(), &beta, c, c_.get(), c,
                                         c_.get(), &algo_, workspace, workspace_, s));
  }

private:
  gemm_shape shape_{};
  detail::matmul_desc desc_;
  detail::layout a_, b_, c_;
  cublasLtMatmulAlgo_t algo_{};
  std::size_t workspace_ = 0;
};

} // namespace concerto::runtime::cuda
