#pragma once
/// @file
/// @brief What configures the NCCL backend, and its collective handle: host-only, so g++
/// compiles it (runtime/nccl/host_backend.hpp shares it with runtime/nccl/backend.hpp).

#include <concerto/ir/graph.hpp>
#include <concerto/runtime/cuda/blas.hpp>
#include <concerto/runtime/dispatch.hpp>
#include <concerto/runtime/nccl/communicator.hpp>

#include <mpi.h>

#include <cstddef>

namespace concerto::runtime::nccl {

/// @brief How the NCCL backend runs.
/// @code
/// runtime::nccl::backend be({.capture_graph = true, .allow_tf32 = true});
/// @endcode
struct backend_options {
  kernel_settings kernels{};        ///< optimizer hyperparameters and the like (as on MPI)
  MPI_Comm world = MPI_COMM_WORLD;  ///< the ranks the plan's mesh covers
  int device = -1;                  ///< CUDA device; -1: the rank's index on its node modulo the device count
  /// Communication streams at the device's greatest priority: when a collective's kernel and a
  /// compute kernel both wait for SMs, the collective's blocks go first, so that communication
  /// is not starved by a long run of compute kernels. false: every stream at the default priority.
  bool comm_high_priority = true;
  comm_options comm{};              ///< NCCL channels / CTA policy of every lane's communicator
  bool capture_graph = false;       ///< replay each step from step 2 on as one CUDA graph
  bool allow_tf32 = false;          ///< fp32 products and convolutions on TF32 tensor cores (faster, ~1e-3 relative error)
  /// Convolutions through cuDNN (runtime/cuda/convolution.hpp), each pass on the first engine the
  /// heuristic offers that suits; false, or a pass no engine suits: concerto's own kernels.
  bool use_cudnn = true;
  std::size_t blas_workspace_bytes = cuda::gemm::default_workspace;
  /// Longest wait in `end_step` for the device to finish a step (the executor's
  /// executor_options::timeout_s, which bounds every wait on MPI): past it, or as soon as NCCL
  /// reports an error on a lane, every communicator is aborted and the step throws naming the
  /// lanes and their last collective, rather than waiting for ever on a dead peer.
  double timeout_s = 300;
  bool timeout_from_env = true;     ///< CONCERTO_TIMEOUT_S (seconds), when set, overrides timeout_s
};

/// @brief An in-flight collective of the NCCL backend: the task whose completion event `test`
/// queries (the same type for runtime::nccl::backend and runtime::nccl::host_backend, so a span
/// of them passes from one to the other as it is).
struct task_handle {
  ir::task_id task = -1;
};

} // namespace concerto::runtime::nccl
