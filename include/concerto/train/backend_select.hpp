#pragma once
/// @file
/// @brief The backend a training step runs on, chosen by the CMake target, never by model code.
///
/// `concerto::mpi` (CPU ranks) is the default. The `concerto::nccl` target defines
/// `CONCERTO_BACKEND_NCCL`, which selects the GPU backend here, so that the same model file
/// builds against either target. Each branch provides the same four things: the backend type,
/// its name (part of the plan cache key), how to make one over an MPI communicator, and the two
/// host copies the step needs (parameters and inputs in, results out).
///
/// @code
/// auto be = train::make_backend(MPI_COMM_WORLD, settings);   // runtime::mpi::backend here
/// train::write_buffer(*be, id, std::as_bytes(std::span(values)));
/// @endcode

#include <concerto/runtime/dispatch.hpp>

#include <cstddef>
#include <cstring>
#include <memory>
#include <span>
#include <string_view>

#if defined(CONCERTO_BACKEND_NCCL)
#include <concerto/runtime/nccl/backend.hpp>
#else
#include <concerto/runtime/mpi/backend.hpp>
#endif

namespace concerto::train {

#if defined(CONCERTO_BACKEND_NCCL)

using default_backend = runtime::nccl::backend;
inline constexpr std::string_view default_backend_name = "nccl";

/// @brief A GPU backend over `world`, with the kernels' settings (optimizer hyperparameters).
inline std::unique_ptr<default_backend> make_backend(MPI_Comm world, const runtime::kernel_settings& settings) {
  return std::make_unique<default_backend>(runtime::nccl::backend_options{.kernels = settings, .world = world});
}
/// @brief Host bytes into a buffer of the plan (valid after the executor prepared the backend).
inline void write_buffer(default_backend& be, ir::buffer_id id, std::span<const std::byte> bytes) { be.upload(id, bytes); }
/// @brief A buffer of the plan into host bytes.
inline void read_buffer(default_backend& be, ir::buffer_id id, std::span<std::byte> bytes) { be.download(id, bytes); }

#else

/// @brief The backend of a concerto::mpi build: MPI ranks, CPU kernels.
using default_backend = runtime::mpi::backend;
/// @brief Its name in the plan cache key.
inline constexpr std::string_view default_backend_name = "mpi";

/// @brief An MPI backend over `world`, with the kernels' settings (optimizer hyperparameters).
inline std::unique_ptr<default_backend> make_backend(MPI_Comm world, const runtime::kernel_settings& settings) {
  return std::make_unique<default_backend>(runtime::mpi::backend_options{.kernels = settings, .world = world});
}
/// @brief Host bytes into a buffer of the plan (valid after the executor prepared the backend).
inline void write_buffer(default_backend& be, ir::buffer_id id, std::span<const std::byte> bytes) {
  const auto dst = be.buffers().bytes(id);
  CONCERTO_CHECK(dst.size() == bytes.size(), "write_buffer: buffer '" + be.buffers().name(id) + "' holds " +
                                                 std::to_string(dst.size()) + " bytes, got " + std::to_string(bytes.size()));
  std::memcpy(dst.data(), bytes.data(), bytes.size());
}
/// @brief A buffer of the plan into host bytes.
inline void read_buffer(default_backend& be, ir::buffer_id id, std::span<std::byte> bytes) {
  const auto src = be.buffers().bytes(id);
  CONCERTO_CHECK(src.size() == bytes.size(), "read_buffer: buffer '" + be.buffers().name(id) + "' holds " +
                                                 std::to_string(src.size()) + " bytes, asked for " + std::to_string(bytes.size()));
  std::memcpy(bytes.data(), src.data(), bytes.size());
}

#endif

} // namespace concerto::train
