#pragma once
// Stands in for the CUDA Toolkit's cublasLt.h in the emulated test targets: the part of the
// cuBLASLt API that runtime/cuda/blas.hpp calls, with cublasLtMatmul as a plain host loop over
// cuBLAS's own conventions (column-major operands, op() per TRANSA / TRANSB, leading
// dimensions, strided batches, alpha and beta, fp32 accumulation). It checks the shapes as
// cuBLASLt does, so a product whose layouts do not fit fails here as on a device.
#include "../cuda_emulation.hpp"
#include "cuda_bf16.h"
#include "cuda_fp16.h"

#include <cstdint>
#include <cstring>

enum cublasStatus_t {
  CUBLAS_STATUS_SUCCESS = 0,
  CUBLAS_STATUS_NOT_INITIALIZED = 1,
  CUBLAS_STATUS_INVALID_VALUE = 7,
  CUBLAS_STATUS_NOT_SUPPORTED = 15,
};
enum cudaDataType_t { CUDA_R_32F = 0, CUDA_R_16F = 2, CUDA_R_16BF = 14 };
using cudaDataType = cudaDataType_t;
enum cublasComputeType_t { CUBLAS_COMPUTE_32F = 68, CUBLAS_COMPUTE_32F_FAST_TF32 = 77 };
enum cublasOperation_t { CUBLAS_OP_N = 0, CUBLAS_OP_T = 1 };
enum cublasLtMatmulDescAttributes_t { CUBLASLT_MATMUL_DESC_TRANSA = 3, CUBLASLT_MATMUL_DESC_TRANSB = 4 };
enum cublasLtMatrixLayoutAttribute_t { CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT = 5, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET = 6 };
enum cublasLtMatmulPreferenceAttributes_t {
  CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES = 1,
  CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES = 5,
  CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES = 6,
  CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES = 7,
  CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES = 8,
};

struct cublasLtContext {};
struct cublasLtMatmulDescOpaque_t {
  cublasComputeType_t compute;
  cudaDataType_t scale;
  cublasOperation_t trans_a = CUBLAS_OP_N, trans_b = CUBLAS_OP_N;
};
struct cublasLtMatrixLayoutOpaque_t {
  cudaDataType_t type;
  std::uint64_t rows, cols;
  std::int64_t ld;
  std::int32_t batch = 1;
  std::int64_t stride = 0;
};
// The alignments a caller promises (cuBLASLt assumes 256 bytes unless told less); the algorithm
// the heuristic returns relies on them, and cublasLtMatmul refuses pointers that break them.
struct cublasLtMatmulPreferenceOpaque_t {
  std::uint64_t max_workspace = 0;
  std::uint32_t min_alignment[4] = {256, 256, 256, 256}; // A, B, C, D
};
struct cublasLtMatmulAlgo_t {
  std::uint64_t data[8];
};
struct cublasLtMatmulHeuristicResult_t {
  cublasLtMatmulAlgo_t algo;
  std::size_t workspaceSize;
  cublasStatus_t state;
  float wavesCount;
  int reserved[4];
};
using cublasLtHandle_t = cublasLtContext*;
using cublasLtMatmulDesc_t = cublasLtMatmulDescOpaque_t*;
using cublasLtMatrixLayout_t = cublasLtMatrixLayoutOpaque_t*;
using cublasLtMatmulPreference_t = cublasLtMatmulPreferenceOpaque_t*;

inline const char* cublasLtGetStatusName(cublasStatus_t s) {
  switch (s) {
  case CUBLAS_STATUS_SUCCESS: return "CUBLAS_STATUS_SUCCESS";
  case CUBLAS_STATUS_NOT_INITIALIZED: return "CUBLAS_STATUS_NOT_INITIALIZED";
  case CUBLAS_STATUS_INVALID_VALUE: return "CUBLAS_STATUS_INVALID_VALUE";
  case CUBLAS_STATUS_NOT_SUPPORTED: return "CUBLAS_STATUS_NOT_SUPPORTED";
  }
  return "CUBLAS_STATUS_UNKNOWN";
}
inline const char* cublasLtGetStatusString(cublasStatus_t s) {
  switch (s) {
  case CUBLAS_STATUS_SUCCESS: return "success";
  case CUBLAS_STATUS_NOT_INITIALIZED: return "the library was not initialized";
  case CUBLAS_STATUS_INVALID_VALUE: return "an invalid value was used as an argument";
  case CUBLAS_STATUS_NOT_SUPPORTED: return "the functionality requested is not supported";
  }
  return "unknown status";
}

inline cublasStatus_t cublasLtCreate(cublasLtHandle_t* h) {
  *h = new cublasLtContext;
  return CUBLAS_STATUS_SUCCESS;
}
inline cublasStatus_t cublasLtDestroy(cublasLtHandle_t h) {
  delete h;
  return CUBLAS_STATUS_SUCCESS;
}
inline cublasStatus_t cublasLtMatmulDescCreate(cublasLtMatmulDesc_t* d, cublasComputeType_t compute, cudaDataType_t scale) {
  if (scale != CUDA_R_32F) return CUBLAS_STATUS_NOT_SUPPORTED;
  *d = new cublasLtMatmulDescOpaque_t{compute, scale};
  return CUBLAS_STATUS_SUCCESS;
}
inline cublasStatus_t cublasLtMatmulDescDestroy(cublasLtMatmulDesc_t d) {
  delete d;
  return CUBLAS_STATUS_SUCCESS;
}
inline cublasStatus_t cublasLtMatmulDescSetAttribute(cublasLtMatmulDesc_t d, cublasLtMatmulDescAttributes_t a,
                                                     const void* v, std::size_t bytes) {
  if (bytes != sizeof(std::int32_t)) return CUBLAS_STATUS_INVALID_VALUE;
  std::int32_t op;
  std::memcpy(&op, v, sizeof op);
  if (op != CUBLAS_OP_N && op != CUBLAS_OP_T) return CUBLAS_STATUS_INVALID_VALUE;
  if (a == CUBLASLT_MATMUL_DESC_TRANSA) d->trans_a = static_cast<cublasOperation_t>(op);
  else if (a == CUBLASLT_MATMUL_DESC_TRANSB) d->trans_b = static_cast<cublasOperation_t>(op);
  else return CUBLAS_STATUS_NOT_SUPPORTED;
  return CUBLAS_STATUS_SUCCESS;
}
inline cublasStatus_t cublasLtMatrixLayoutCreate(cublasLtMatrixLayout_t* l, cudaDataType_t type, std::uint64_t rows,
                                                 std::uint64_t cols, std::int64_t ld) {
  if (ld < static_cast<std::int64_t>(rows) || ld < 1) return CUBLAS_STATUS_INVALID_VALUE; // column-major: ld >= rows
  *l = new cublasLtMatrixLayoutOpaque_t{type, rows, cols, ld};
  return CUBLAS_STATUS_SUCCESS;
}
inline cublasStatus_t cublasLtMatrixLayoutDestroy(cublasLtMatrixLayout_t l) {
  delete l;
  return CUBLAS_STATUS_SUCCESS;
}
inline cublasStatus_t cublasLtMatrixLayoutSetAttribute(cublasLtMatrixLayout_t l, cublasLtMatrixLayoutAttribute_t a,
                                                       const void* v, std::size_t bytes) {
  if (a == CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT && bytes == sizeof(std::int32_t)) std::memcpy(&l->batch, v, bytes);
  else if (a == CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET && bytes == sizeof(std::int64_t)) std::memcpy(&l->stride, v, bytes);
  else return CUBLAS_STATUS_INVALID_VALUE;
  return CUBLAS_STATUS_SUCCESS;
}
inline cublasStatus_t cublasLtMatmulPreferenceCreate(cublasLtMatmulPreference_t* p) {
  *p = new cublasLtMatmulPreferenceOpaque_t;
  return CUBLAS_STATUS_SUCCESS;
}
inline cublasStatus_t cublasLtMatmulPreferenceDestroy(cublasLtMatmulPreference_t p) {
  delete p;
  return CUBLAS_STATUS_SUCCESS;
}
inline cublasStatus_t cublasLtMatmulPreferenceSetAttribute(cublasLtMatmulPreference_t p,
                                                           cublasLtMatmulPreferenceAttributes_t a, const void* v,
                                                           std::size_t bytes) {
  if (a == CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES && bytes == sizeof(std::uint64_t)) {
    std::memcpy(&p->max_workspace, v, bytes);
    return CUBLAS_STATUS_SUCCESS;
  }
  if (a >= CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES && a <= CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES &&
      bytes == sizeof(std::uint32_t)) {
    std::memcpy(&p->min_alignment[a - CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES], v, bytes);
    return CUBLAS_STATUS_SUCCESS;
  }
  return CUBLAS_STATUS_INVALID_VALUE;
}

namespace cuda_emulation::lt {
// The shapes of a product as cuBLASLt checks them: op(A) is m x k, op(B) k x n, C and D m x n,
// one batch count (or 1) for all, inputs of one type, an output of fp32 or the inputs' type.
inline cublasStatus_t check(const cublasLtMatmulDescOpaque_t& d, const cublasLtMatrixLayoutOpaque_t& a,
                            const cublasLtMatrixLayoutOpaque_t& b, const cublasLtMatrixLayoutOpaque_t& c,
                            const cublasLtMatrixLayoutOpaque_t& out) {
  const auto m = d.trans_a == CUBLAS_OP_N ? a.rows : a.cols, k = d.trans_a == CUBLAS_OP_N ? a.cols : a.rows;
  const auto kb = d.trans_b == CUBLAS_OP_N ? b.rows : b.cols, n = d.trans_b == CUBLAS_OP_N ? b.cols : b.rows;
  if (k != kb || c.rows != m || c.cols != n || out.rows != m || out.cols != n) return CUBLAS_STATUS_INVALID_VALUE;
  if (a.batch != b.batch || a.batch != c.batch || c.batch != out.batch || c.type != out.type) return CUBLAS_STATUS_INVALID_VALUE;
  if (a.type != b.type || (c.type != CUDA_R_32F && c.type != a.type)) return CUBLAS_STATUS_NOT_SUPPORTED;
  if (d.compute != CUBLAS_COMPUTE_32F && !(d.compute == CUBLAS_COMPUTE_32F_FAST_TF32 && a.type == CUDA_R_32F))
    return CUBLAS_STATUS_NOT_SUPPORTED;
  return CUBLAS_STATUS_SUCCESS;
}
inline float load(const void* p, cudaDataType_t t, std::int64_t i) {
  if (t == CUDA_R_32F) return static_cast<const float*>(p)[i];
  if (t == CUDA_R_16F) return __half2float(static_cast<const __half*>(p)[i]);
  return __bfloat162float(static_cast<const __nv_bfloat16*>(p)[i]);
}
inline void store(void* p, cudaDataType_t t, std::int64_t i, float v) {
  if (t == CUDA_R_32F) static_cast<float*>(p)[i] = v;
  else if (t == CUDA_R_16F) static_cast<__half*>(p)[i] = __float2half(v);
  else static_cast<__nv_bfloat16*>(p)[i] = __float2bfloat16(v);
}
inline void run(const cublasLtMatmulDescOpaque_t& d, float al, const void* A, const cublasLtMatrixLayoutOpaque_t& a,
                const void* B, const cublasLtMatrixLayoutOpaque_t& b, float be, const void* C,
                const cublasLtMatrixLayoutOpaque_t& c, void* D, const cublasLtMatrixLayoutOpaque_t& out) {
  const auto m = static_cast<std::int64_t>(out.rows), n = static_cast<std::int64_t>(out.cols);
  const auto k = static_cast<std::int64_t>(d.trans_a == CUBLAS_OP_N ? a.cols : a.rows);
  const auto at = [&](const cublasLtMatrixLayoutOpaque_t& l, bool trans, std::int64_t r, std::int64_t col) {
    return trans ? col + r * l.ld : r + col * l.ld; // element (r, col) of op(X)
  };
  for (std::int64_t q = 0; q < out.batch; ++q)
    for (std::int64_t j = 0; j < n; ++j)
      for (std::int64_t i = 0; i < m; ++i) {
        float acc = 0.0f;
        for (std::int64_t p = 0; p < k; ++p)
          acc += cuda_emulation::lt::load(A, a.type, q * a.stride + at(a, d.trans_a == CUBLAS_OP_T, i, p)) *
                 cuda_emulation::lt::load(B, b.type, q * b.stride + at(b, d.trans_b == CUBLAS_OP_T, p, j));
        const float prior = be == 0.0f ? 0.0f : be * cuda_emulation::lt::load(C, c.type, q * c.stride + i + j * c.ld);
        cuda_emulation::lt::store(D, out.type, q * out.stride + i + j * out.ld, al * acc + prior);
      }
}
} // namespace cuda_emulation::lt

inline cublasStatus_t cublasLtMatmulAlgoGetHeuristic(cublasLtHandle_t h, cublasLtMatmulDesc_t d, cublasLtMatrixLayout_t a,
                                                     cublasLtMatrixLayout_t b, cublasLtMatrixLayout_t c,
                                                     cublasLtMatrixLayout_t out, cublasLtMatmulPreference_t pref,
                                                     int requested, cublasLtMatmulHeuristicResult_t* results, int* found) {
  if (h == nullptr || requested < 1) return CUBLAS_STATUS_INVALID_VALUE;
  *found = 0;
  if (const auto s = cuda_emulation::lt::check(*d, *a, *b, *c, *out); s != CUBLAS_STATUS_SUCCESS) return s;
  results[0] = {};
  for (int i = 0; i < 4; ++i) results[0].algo.data[i] = pref->min_alignment[i];
  results[0].state = CUBLAS_STATUS_SUCCESS;
  *found = 1;
  return CUBLAS_STATUS_SUCCESS;
}

// D = alpha·op(A)·op(B) + beta·C, column-major, per batch, accumulated in fp32.
inline cublasStatus_t cublasLtMatmul(cublasLtHandle_t h, cublasLtMatmulDesc_t d, const void* alpha, const void* A,
                                     cublasLtMatrixLayout_t a, const void* B, cublasLtMatrixLayout_t b, const void* beta,
                                     const void* C, cublasLtMatrixLayout_t c, void* D, cublasLtMatrixLayout_t out,
                                     const cublasLtMatmulAlgo_t* algo, void*, std::size_t, cudaStream_t) {
  if (h == nullptr) return CUBLAS_STATUS_NOT_INITIALIZED;
  if (const auto s = cuda_emulation::lt::check(*d, *a, *b, *c, *out); s != CUBLAS_STATUS_SUCCESS) return s;
  // Every batch's operand must keep the alignment the algorithm was chosen for.
  const auto aligned = [](const void* p, const cublasLtMatrixLayoutOpaque_t& l, std::uint64_t need) {
    const auto stride_bytes = static_cast<std::uint64_t>(l.stride) * (l.type == CUDA_R_32F ? 4u : 2u);
    return reinterpret_cast<std::uintptr_t>(p) % need == 0 && (l.batch <= 1 || stride_bytes % need == 0);
  };
  if (algo == nullptr || !aligned(A, *a, algo->data[0]) || !aligned(B, *b, algo->data[1]) || !aligned(C, *c, algo->data[2]) ||
      !aligned(D, *out, algo->data[3]))
    return CUBLAS_STATUS_NOT_SUPPORTED; // the algorithm needs more alignment than these pointers have
  // alpha and beta are read now (host pointers); the descriptors' values are copied, as a
  // captured graph keeps them.
  const float al = *static_cast<const float*>(alpha), be = *static_cast<const float*>(beta);
  cuda_emulation::enqueue([=, d = *d, a = *a, b = *b, c = *c, out = *out] {
    cuda_emulation::lt::run(d, al, A, a, B, b, be, C, c, D, out);
  });
  return CUBLAS_STATUS_SUCCESS;
}
