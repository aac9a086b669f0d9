#pragma once
/// @file
/// @brief What an executor needs from a backend (MPI on CPU, NCCL + CUDA on GPU).
///
/// The executor owns the schedule: which task of which stream is issued when. A backend owns
/// the resources: memory, kernels, communicators, streams. The split is drawn so that both
/// kinds of backend fit the same loop:
///
/// - On MPI (`stream_ordered == false`) a compute task runs to completion inside
///   `run_compute`, and a collective is a non-blocking MPI request that completes only when
///   tested; a task may start only once every dependency has *completed*.
/// - On a GPU (`stream_ordered == true`) `run_compute` and `start_collective` only enqueue on
///   the task's stream; a dependency is satisfied as soon as it is *issued*, because the
///   device orders work on one stream, and across streams the executor calls
///   `record(dep)` after issuing a task that a task of another stream waits for and
///   `stream_wait(stream, dep)` before issuing that task (an event record and a
///   cudaStreamWaitEvent). Only the plan's cross-stream dependencies produce such waits.
///
/// Plan agreement needs three primitives on the world group: broadcast of bytes from a root,
/// a min-reduction of an integer, and a barrier.

#include <concerto/core/error.hpp>
#include <concerto/ir/graph.hpp>
#include <concerto/mesh/mesh.hpp>
#include <concerto/plan/plan.hpp>
#include <concerto/runtime/deadline.hpp>

#include <chrono>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <optional>
#include <span>
#include <string>
#include <string_view>

namespace concerto::runtime {

/// @brief A backend the executor can drive.
///
/// Members (b a backend, t a task, h a handle):
/// - `B::handle`: an in-flight collective (an MPI_Request, a CUDA event); default-constructible.
/// - `B::stream_ordered`: true when issuing a task orders it after the earlier tasks of its stream.
/// - `b.prepare(plan)`: once, before the first step: allocate the arena from the plan's
///   memory layout, resolve every compute task to a kernel, create one communicator per lane.
/// - `b.begin_step(step)` / `b.end_step()`: around each step (step counts from 1); a GPU
///   backend synchronises its streams in `end_step`.
/// - `b.run_compute(t)`: run (MPI) or enqueue (GPU) a compute task.
/// - `b.start_collective(t) -> handle`: start a non-blocking collective on the task's lane.
/// - `b.test(h) -> bool`: progress and test one collective.
/// - `b.wait_any(in_flight, deadline) -> optional<index>`: block until one completes, or
///   nullopt at the deadline.
/// - `b.record(t)`, `b.stream_wait(stream, t)`: the cross-stream dependency pair (no-ops on MPI).
/// - `b.rank()`, `b.world_size()`, `b.broadcast(bytes, root, what)`, `b.min_all(v, what)`,
///   `b.barrier(what)`: plan distribution and agreement over all ranks, each bounded by the
///   runtime's timeout (runtime/deadline.hpp); `what` names the wait in the timeout's message.
/// @code
/// static_assert(runtime::backend<runtime::mpi::backend>);
/// @endcode
template <class B>
concept backend = requires(B& b, const B& cb, const plan::plan& p, const ir::task& t, ir::stream_id s,
                           typename B::handle& h, std::span<typename B::handle> in_flight, clock::time_point deadline,
                           std::string& bytes, int root, std::int64_t value, std::string_view what) {
  requires std::default_initializable<typename B::handle>;
  { B::stream_ordered } -> std::convertible_to<bool>;
  b.prepare(p);
  b.begin_step(value);
  b.end_step();
  b.run_compute(t);
  { b.start_collective(t) } -> std::same_as<typename B::handle>;
  { b.test(h) } -> std::same_as<bool>;
  { b.wait_any(in_flight, deadline) } -> std::same_as<std::optional<std::size_t>>;
  b.record(t);
  b.stream_wait(s, t);
  { cb.rank() } -> std::convertible_to<int>;
  { cb.world_size() } -> std::convertible_to<int>;
  b.broadcast(bytes, root, what);
  { b.min_all(value, what) } -> std::same_as<std::int64_t>;
  b.barrier(what);
};

/// @brief A value that is not finite (NaN or infinite) in what a compute task wrote: found when
/// executor_options::find_non_finite is on.
namespace detail {
/// What a rank blocked in step `step`'s collectives says it waits for (runtime/mpi/channel.hpp):
/// the same on every rank of that step, whichever of its collectives each waits on.
[[nodiscard]] inline std::string step_wait_text(std::int64_t step) { return "the collectives of step " + std::to_string(step); }
} // namespace detail

struct non_finite_output {
  ir::task_id task = -1;
  std::size_t position = 0; ///< the task's place in the step's compute order
  ir::buffer_id buffer = -1;
  std::int64_t element = 0; ///< index among the buffer's values on this rank
  float value = 0;
};

/// @brief A backend that can look at what a compute task just wrote (between steps' kernels, on
/// the host): `b.first_non_finite(t)` is the first value that is not finite among the task's
/// f32 outputs, workspace aside (task and position left for the executor to fill).
template <class B>
concept finds_non_finite = requires(B& b, const ir::task& t) {
  { b.first_non_finite(t) } -> std::same_as<std::optional<non_finite_output>>;
};

/// @brief Ends together what each rank checked alone: when `problem` is not empty on some rank,
/// every rank throws concerto::collective_error with the problem of the lowest such rank (its
/// "concerto: " prefix dropped). `group` is a backend or an mpi::control: anything with `rank()`
/// and the bounded `min_all` and `broadcast`; `what` names the wait in a timeout. Collective.
/// @code
/// runtime::stop_together(mine_is_bad ? "rank 2 read another file" : "", backend, "the file check");
/// @endcode
template <class Group>
void stop_together(std::string problem, Group& group, std::string_view what) {
  constexpr auto none = std::numeric_limits<std::int64_t>::max();
  const auto first = group.min_all(problem.empty() ? none : std::int64_t{group.rank()}, what);
  if (first == none) return;
  group.broadcast(problem, static_cast<int>(first), what);
  if (problem.starts_with("concerto: ")) problem.erase(0, 10);
  fail_on_every_rank(problem);
}

/// @brief What a backend's lane communicators depend on: each comm stream's name, mesh axis and
/// size. Plans of one graph share it, so a backend that prepares another (the plan choice) keeps
/// its communicators when it is unchanged.
[[nodiscard]] inline std::string lane_signature(const ir::graph& g) {
  std::string out;
  for (std::size_t s = 1; s < g.streams.size(); ++s) {
    const auto& axis = g.axes.at(static_cast<std::size_t>(g.streams[s].axis));
    out.append(g.streams[s].name).append("@").append(axis.name).append(":").append(std::to_string(axis.size)).append(";");
  }
  return out;
}

/// @brief The mesh a plan's graph is for, checked against the world a backend runs on: a plan made
/// for another number of ranks is refused, naming both.
[[nodiscard]] inline concerto::mesh mesh_of_plan(const ir::graph& g, int world_size) {
  concerto::mesh m(g.axes);
  if (m.rank_count() != world_size) {
    std::string dims;
    for (const auto& a : g.axes) dims += (dims.empty() ? "" : "x") + a.name + "=" + std::to_string(a.size);
    fail("the plan of graph '" + g.name + "' is for a mesh of " + std::to_string(m.rank_count()) + " ranks (" +
         (dims.empty() ? "no axes" : dims) + ") but the MPI world has " + std::to_string(world_size));
  }
  return m;
}

} // namespace concerto::runtime
