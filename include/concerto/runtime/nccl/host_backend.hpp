#pragma once
/// @file
/// @brief runtime::nccl::backend as seen from code that g++ compiles: the same members, whose
/// bodies (the CUDA kernels, NCCL and cuBLASLt calls) are compiled once, by nvcc, in one
/// translation unit of the program.
///
/// Why: model code written in the DSL (string-literal template parameters, partial
/// specialisations over them) is standard C++20 that nvcc's front end rejects (CUDA 13:
/// "no instance of function template concerto::shard matches"), while the backend's kernels
/// need nvcc. So a `concerto::nccl` program compiles its own sources with g++ like a
/// `concerto::mpi` one, and links one extra object: a `.cu` file that defines
/// `CONCERTO_NCCL_HOST_BACKEND_IMPLEMENTATION` before including this header (the examples'
/// CMakeLists.txt generate it). Every call crosses into that object out of line: one call per
/// task or per collective, negligible next to a kernel launch.
///
/// @code
/// // backend.cu, compiled with nvcc, once per program:
/// #define CONCERTO_NCCL_HOST_BACKEND_IMPLEMENTATION
/// #include <concerto/runtime/nccl/host_backend.hpp>
///
/// // model.cpp, compiled with g++:
/// runtime::nccl::host_backend be({.world = MPI_COMM_WORLD});
/// runtime::executor ex(plan, be);
/// be.write(x_id, std::as_bytes(std::span(x)));
/// ex.run_step();
/// @endcode

#include <concerto/ir/graph.hpp>
#include <concerto/plan/plan.hpp>
#include <concerto/runtime/backend.hpp>
#include <concerto/runtime/dispatch.hpp>
#include <concerto/runtime/nccl/options.hpp>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>

namespace concerto::runtime::nccl {

class backend;

/// @brief The NCCL backend behind the runtime::backend concept, usable from g++-compiled code;
/// see the file comment. Members mean what they mean on runtime::nccl::backend.
class host_backend {
public:
  using handle = task_handle;
  static constexpr bool stream_ordered = true;

  /// Picks the device and makes the compute stream; throws when no CUDA device is visible.
  explicit host_backend(backend_options options = {});
  host_backend(const host_backend&) = delete;
  host_backend& operator=(const host_backend&) = delete;
  ~host_backend();

  [[nodiscard]] int rank() const noexcept;
  [[nodiscard]] int world_size() const noexcept;
  [[nodiscard]] int device() const noexcept;
  /// Kernel settings; with a captured graph, call invalidate_graph() after changing them.
  [[nodiscard]] kernel_settings& settings() noexcept;
  /// Device time of the last step in milliseconds.
  [[nodiscard]] float last_step_device_ms() const;
  /// Drops a captured step graph: the next step runs eagerly and is captured again.
  void invalidate_graph() noexcept;
  /// The backend itself, for code compiled with nvcc (the type is incomplete elsewhere).
  [[nodiscard]] backend& get() noexcept { return *impl_; }

  /// Host bytes into buffer b on the device, between steps (exactly the buffer's size).
  void write(ir::buffer_id b, std::span<const std::byte> bytes);
  /// Buffer b from the device into host bytes, after the last step (exactly the buffer's size).
  void read(ir::buffer_id b, std::span<std::byte> out);

  void prepare(const plan::plan& p);
  void begin_step(std::int64_t step);
  void end_step();
  void run_compute(const ir::task& t);
  handle start_collective(const ir::task& t);
  bool test(handle& h);
  std::optional<std::size_t> wait_any(std::span<handle> in_flight, clock::time_point deadline);
  void record(const ir::task& t);
  void stream_wait(ir::stream_id s, const ir::task& t);
  void broadcast(std::string& bytes, int root, std::string_view what);
  std::int64_t min_all(std::int64_t v, std::string_view what);
  void barrier(std::string_view what);

private:
  std::unique_ptr<backend> impl_;
};

static_assert(runtime::backend<host_backend>);

} // namespace concerto::runtime::nccl

#if defined(CONCERTO_NCCL_HOST_BACKEND_IMPLEMENTATION)
// The one translation unit (nvcc) that holds the bodies. Not inline on purpose: a second
// definition in the program is a link error, not a silent ODR violation.
#include <concerto/runtime/nccl/backend.hpp>

namespace concerto::runtime::nccl {

host_backend::host_backend(backend_options options) : impl_(std::make_unique<backend>(std::move(options))) {}
host_backend::~host_backend() = default;
int host_backend::rank() const noexcept { return impl_->rank(); }
int host_backend::world_size() const noexcept { return impl_->world_size(); }
int host_backend::device() const noexcept { return impl_->device(); }
kernel_settings& host_backend::settings() noexcept { return impl_->settings(); }
float host_backend::last_step_device_ms() const { return impl_->last_step_device_ms(); }
void host_backend::invalidate_graph() noexcept { impl_->invalidate_graph(); }
void host_backend::write(ir::buffer_id b, std::span<const std::byte> bytes) { impl_->write(b, bytes); }
void host_backend::read(ir::buffer_id b, std::span<std::byte> out) { impl_->read(b, out); }
void host_backend::prepare(const plan::plan& p) { impl_->prepare(p); }
void host_backend::begin_step(std::int64_t step) { impl_->begin_step(step); }
void host_backend::end_step() { impl_->end_step(); }
void host_backend::run_compute(const ir::task& t) { impl_->run_compute(t); }
host_backend::handle host_backend::start_collective(const ir::task& t) { return impl_->start_collective(t); }
bool host_backend::test(handle& h) { return impl_->test(h); }
std::optional<std::size_t> host_backend::wait_any(std::span<handle> in_flight, clock::time_point deadline) {
  return impl_->wait_any(in_flight, deadline);
}
void host_backend::record(const ir::task& t) { impl_->record(t); }
void host_backend::stream_wait(ir::stream_id s, const ir::task& t) { impl_->stream_wait(s, t); }
void host_backend::broadcast(std::string& bytes, int root, std::string_view what) { impl_->broadcast(bytes, root, what); }
std::int64_t host_backend::min_all(std::int64_t v, std::string_view what) { return impl_->min_all(v, what); }
void host_backend::barrier(std::string_view what) { impl_->barrier(what); }

} // namespace concerto::runtime::nccl
#endif
