#pragma once
/// @file
/// @brief Error checks for the CUDA runtime and cuBLAS(Lt): a failed call throws concerto::error
/// naming the call, CUDA's own message and the file:line of the check.
///
/// Host code only; compiles with g++ as well as with nvcc.

#include <concerto/core/error.hpp>

#include <cublasLt.h>
#include <cuda_runtime_api.h>

#include <string>

namespace concerto::runtime::cuda {

namespace detail {
[[noreturn]] inline void cuda_failed(cudaError_t e, const char* call, const char* file, int line) {
  fail(std::string(call) + " failed: " + cudaGetErrorName(e) + " (" + cudaGetErrorString(e) + ") at " + file + ":" +
       std::to_string(line));
}
[[noreturn]] inline void cublas_failed(cublasStatus_t s, const char* call, const char* file, int line) {
  fail(std::string(call) + " failed: " + cublasLtGetStatusName(s) + " (" + cublasLtGetStatusString(s) + ") at " +
       file + ":" + std::to_string(line));
}
} // namespace detail

/// @brief Throws concerto::error if `e` is an error; `what` names the call.
inline void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) [[unlikely]] {
    (void)cudaGetLastError(); // a sticky error stays; a non-sticky one must not leak into the next check
    fail(std::string(what) + " failed: " + cudaGetErrorName(e) + " (" + cudaGetErrorString(e) + ")");
  }
}

/// @brief Number of CUDA devices, 0 when there is no driver or no device (never throws).
/// @code
/// if (runtime::cuda::device_count() == 0) SKIP("no CUDA device");
/// @endcode
[[nodiscard]] inline int device_count() noexcept {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  return n;
}

} // namespace concerto::runtime::cuda

/// Checks a CUDA runtime call; throws concerto::error with the call, CUDA's message and file:line.
#define CONCERTO_CUDA_CHECK(call)                                                                  \
  do {                                                                                             \
    const cudaError_t concerto_cuda_e_ = (call);                                                   \
    if (concerto_cuda_e_ != cudaSuccess) [[unlikely]]                                              \
      ::concerto::runtime::cuda::detail::cuda_failed(concerto_cuda_e_, #call, __FILE__, __LINE__); \
  } while (false)

/// Checks a cuBLAS / cuBLASLt call the same way.
#define CONCERTO_CUBLAS_CHECK(call)                                                                  \
  do {                                                                                               \
    const cublasStatus_t concerto_cublas_s_ = (call);                                                \
    if (concerto_cublas_s_ != CUBLAS_STATUS_SUCCESS) [[unlikely]]                                    \
      ::concerto::runtime::cuda::detail::cublas_failed(concerto_cublas_s_, #call, __FILE__, __LINE__); \
  } while (false)
