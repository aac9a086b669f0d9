#pragma once
/// @file
/// @brief The backend a training step runs on, chosen by the CMake target, never by model code.
///
/// `concerto::mpi` (CPU ranks) is the default. The `concerto::nccl` target defines
/// `CONCERTO_BACKEND_NCCL`, which selects the GPU backend here, so the same model file builds
/// against either target, with g++ in both cases: the GPU branch names
/// runtime::nccl::host_backend, whose bodies live in one nvcc-compiled object of the program
/// (runtime/nccl/host_backend.hpp says why and how). Each branch provides the same
/// three things: the backend type, its name (part of the plan cache key) and how to make one over
/// an MPI communicator. Both backends move values between the host and a plan's buffers through
/// the same pair, `write(id, bytes)` / `read(id, bytes)` (the `host_access` concept): on MPI a
/// memcpy into the host arena, on NCCL a copy to or from device memory ordered after the step.
/// Neither allocates, so a step's steady state stays allocation-free on MPI.
///
/// @code
/// auto be = train::make_backend(MPI_COMM_WORLD, settings);   // runtime::mpi::backend here
/// runtime::executor ex(plan, *be);
/// be->write(x_id, std::as_bytes(std::span(x)));
/// ex.run_step();
/// float loss = 0;
/// be->read(loss_id, std::as_writable_bytes(std::span(&loss, 1)));
/// @endcode

#include <concerto/ir/graph.hpp>
#include <concerto/runtime/backend.hpp>
#include <concerto/runtime/dispatch.hpp>

#include <mpi.h>

#include <concepts>
#include <cstddef>
#include <memory>
#include <optional>
#include <span>
#include <string_view>

#if defined(CONCERTO_BACKEND_NCCL)
#include <concerto/runtime/nccl/host_backend.hpp>
#else
#include <concerto/runtime/mpi/backend.hpp>
#endif

namespace concerto::train {

/// @brief A backend whose buffers the host can fill and read by id, between steps: `write`
/// copies exactly the buffer's size of bytes in, `read` exactly its size out (a size mismatch
/// throws concerto::error naming the buffer).
template <class B>
concept host_access = runtime::backend<B> && requires(B& b, ir::buffer_id id, std::span<const std::byte> in,
                                                      std::span<std::byte> out) {
  { b.write(id, in) } -> std::same_as<void>;
  { b.read(id, out) } -> std::same_as<void>;
};

#if defined(CONCERTO_BACKEND_NCCL)

/// @brief The backend of a concerto::nccl build: one CUDA device per MPI rank, NCCL collectives.
using default_backend = runtime::nccl::host_backend;
/// @brief Its name in the plan cache key.
inline constexpr std::string_view default_backend_name = "nccl";

/// @brief A GPU backend over `world` (device: the rank's index on its node), with the kernels'
/// settings (optimizer hyperparameters). Steps run eagerly: the step object writes inputs
/// between steps, which a captured graph would also see, but changed settings would not.
/// `timeout_s` bounds its waits; unset: CONCERTO_TIMEOUT_S, else runtime::default_timeout_s.
/// `allow_tf32`: fp32 products on the TF32 tensor cores.
inline std::unique_ptr<default_backend> make_backend(MPI_Comm world, const runtime::kernel_settings& settings,
                                                     std::optional<double> timeout_s = std::nullopt, bool allow_tf32 = false) {
  return std::make_unique<default_backend>(runtime::nccl::backend_options{.kernels = settings,
                                                                         .world = world,
                                                                         .allow_tf32 = allow_tf32,
                                                                         .timeout_s = timeout_s.value_or(runtime::default_timeout_s),
                                                                         .timeout_from_env = !timeout_s});
}

#else

/// @brief The backend of a concerto::mpi build: MPI ranks, CPU kernels.
using default_backend = runtime::mpi::backend;
/// @brief Its name in the plan cache key.
inline constexpr std::string_view default_backend_name = "mpi";

/// @brief An MPI backend over `world`, with the kernels' settings (optimizer hyperparameters).
/// `timeout_s` bounds its waits; unset: CONCERTO_TIMEOUT_S, else runtime::default_timeout_s.
/// `allow_tf32` concerns GPUs only (the CPU kernels compute in fp32).
inline std::unique_ptr<default_backend> make_backend(MPI_Comm world, const runtime::kernel_settings& settings,
                                                     std::optional<double> timeout_s = std::nullopt,
                                                     [[maybe_unused]] bool allow_tf32 = false) {
  return std::make_unique<default_backend>(runtime::mpi::backend_options{.kernels = settings,
                                                                         .world = world,
                                                                         .timeout_s = timeout_s.value_or(runtime::default_timeout_s),
                                                                         .timeout_from_env = !timeout_s});
}

#endif

static_assert(host_access<default_backend>, "the build's backend must offer write(id, bytes) / read(id, bytes)");

} // namespace concerto::train
