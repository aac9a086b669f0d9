#pragma once
/// @file
/// @brief The task graph that the planner, the simulator and the executors share.
///
/// A graph is one training step: tasks (compute kernels and collectives), the buffers they
/// read and write, the streams they run on and their dependencies. It carries what an
/// executor needs to run a task (kind, function, shape attributes, buffers, mesh axis), not
/// only its cost. Task ids are indices into `graph::tasks`, buffer ids into `graph::buffers`,
/// stream ids into `graph::streams`; stream 0 is always the compute stream.
///
/// Conventions for `task::bytes`:
/// - compute: bytes read plus written in memory (the roofline's memory term);
/// - all_reduce / broadcast: size of the buffer on each rank;
/// - all_gather: size of the gathered output on each rank (group_size × shard);
/// - reduce_scatter: size of the unreduced input on each rank (group_size × shard);
/// - all_to_all: size of the whole buffer each rank exchanges (sent + kept);
/// - send / recv: size of the message.

#include <concerto/core/error.hpp>
#include <concerto/ir/ops.hpp>

#include <algorithm>
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace concerto::ir {

using task_id = std::int32_t;
using buffer_id = std::int32_t;
using stream_id = std::int32_t;
inline constexpr stream_id compute_stream = 0;

/// @brief Which part of the step a task belongs to; policies and bucketing look at it.
enum class phase : std::uint8_t { forward, backward, optimizer };
[[nodiscard]] constexpr std::string_view to_string(phase p) noexcept {
  return p == phase::forward ? "forward" : p == phase::backward ? "backward" : "optimizer";
}

enum class dtype : std::uint8_t { f32, bf16, f16, i32, i64 };
[[nodiscard]] constexpr std::size_t size_of(dtype t) noexcept {
  return t == dtype::f32 || t == dtype::i32 ? 4 : t == dtype::i64 ? 8 : 2;
}
[[nodiscard]] constexpr std::string_view to_string(dtype t) noexcept {
  constexpr std::string_view names[] = {"f32", "bf16", "f16", "i32", "i64"};
  return names[static_cast<int>(t)];
}
/// @brief bf16 or f16: stored in 16 bits, computed in f32 (a kernel widens and rounds them).
[[nodiscard]] constexpr bool is_16bit_float(dtype t) noexcept { return t == dtype::bf16 || t == dtype::f16; }

/// @brief What a buffer holds; the memory accounting and the checkpoint look at it.
enum class buffer_role : std::uint8_t { input, param, activation, gradient, optimizer_state, workspace };
[[nodiscard]] constexpr std::string_view to_string(buffer_role r) noexcept {
  constexpr std::string_view names[] = {"input", "param", "activation", "gradient", "optimizer_state",
                                        "workspace"};
  return names[static_cast<int>(r)];
}

/// @brief Which links a mesh axis crosses; the cost model prices collectives by it.
enum class link_class : std::uint8_t { intra_node, inter_node };
[[nodiscard]] constexpr std::string_view to_string(link_class l) noexcept {
  return l == link_class::intra_node ? "intra_node" : "inter_node";
}

/// @brief One named axis of the device mesh, with its size bound for this graph.
struct mesh_axis {
  std::string name;
  int size = 1;
  link_class link = link_class::intra_node;
  friend bool operator==(const mesh_axis&, const mesh_axis&) = default;
};

/// @brief A stream: the compute stream, or the communication lane of one mesh axis.
struct stream {
  std::string name;  ///< "compute" or "comm:<axis>"
  int axis = -1;     ///< mesh axis index for a comm lane, -1 for compute
  [[nodiscard]] bool is_compute() const noexcept { return axis < 0; }
  friend bool operator==(const stream&, const stream&) = default;
};

/// @brief A per-rank memory region. A view aliases bytes [offset, offset + bytes) of its root.
struct buffer {
  buffer_id id = -1;
  std::string name;
  std::int64_t bytes = 0;          ///< per-rank size
  dtype type = dtype::f32;
  buffer_role role = buffer_role::activation;
  std::vector<std::int64_t> shape; ///< per-rank (local) shape, may be empty for opaque buffers
  buffer_id view_of = -1;          ///< the buffer this one is a slice of, or -1
  std::int64_t offset = 0;         ///< byte offset inside view_of
  friend bool operator==(const buffer&, const buffer&) = default;
};

/// @brief The buffer global-norm gradient clipping leaves the step's squared gradient norm in
/// (graph/lower.hpp makes it): every update reads it, the pipeline's stage split runs the tasks
/// that sum it on every stage, the training step reports it.
inline constexpr std::string_view grad_norm_sq_buffer = "grad_norm_sq";

/// @brief The buffer holding the step's loss scale under dynamic loss scaling (one f32 value,
/// ir::precision_policy::loss_scaling): the training step writes it before each step, the loss
/// gradients multiply by it and the updates divide by it (graph/lower.hpp makes it).
inline constexpr std::string_view loss_scale_buffer = "loss_scale";

/// @brief One task: a kernel on the compute stream or a collective on a comm lane.
struct task {
  task_id id = -1;
  std::string name;
  op_kind kind = op_kind::elementwise;
  stream_id stream = compute_stream;
  double flops = 0;                  ///< floating point operations (compute), 0 for collectives
  double bytes = 0;                  ///< see the file comment for the convention per kind
  std::vector<buffer_id> reads;
  std::vector<buffer_id> writes;
  std::vector<task_id> deps;         ///< tasks that must finish before this one starts
  op fn = op::none;                  ///< what it computes: a compute op (gelu, layernorm_grad, adamw...),
                                     ///< or a collective's reduction (sum, max); see ir/ops.hpp
  std::map<std::string, std::int64_t> attrs; ///< shape and parameters the kernel needs
  int axis = -1;                     ///< mesh axis of a collective's group, -1 for compute
  phase step_phase = phase::forward;
  int layer = -1;                    ///< model layer the task belongs to, -1 if none
  friend bool operator==(const task&, const task&) = default;

  [[nodiscard]] std::int64_t attr(std::string_view key, std::int64_t fallback = 0) const {
    const auto it = attrs.find(std::string(key));
    return it == attrs.end() ? fallback : it->second;
  }
};

/// @brief The task graph of one training step on one rank (all ranks share it: SPMD).
struct graph {
  std::string name;
  std::vector<mesh_axis> axes;
  std::vector<stream> streams{stream{"compute", -1}};
  std::vector<buffer> buffers;
  std::vector<task> tasks;
  /// Made to be priced, not run (the planner's benchmark workloads): its tasks may use ops no
  /// executor has, such as the workloads' learned positions and block transposes (the op table's
  /// cost-only ops). Executors refuse such a graph.
  bool cost_only = false;
  friend bool operator==(const graph&, const graph&) = default;

  [[nodiscard]] std::size_t size() const noexcept { return tasks.size(); }
  /// A graph with this one's name, mesh axes, streams and cost_only flag, and no buffers or
  /// tasks: what a rewrite starts from.
  [[nodiscard]] graph empty_like() const {
    graph out;
    out.name = name;
    out.axes = axes;
    out.streams = streams;
    out.cost_only = cost_only;
    return out;
  }
  [[nodiscard]] const task& operator[](task_id id) const { return tasks.at(static_cast<std::size_t>(id)); }

  /// Group size of a collective (ranks along its axis).
  [[nodiscard]] int group_size(const task& t) const {
    return t.axis < 0 ? 1 : axes.at(static_cast<std::size_t>(t.axis)).size;
  }
  /// The stream id of the comm lane of an axis, or nullopt.
  [[nodiscard]] std::optional<stream_id> lane_of_axis(int axis) const {
    for (std::size_t s = 0; s < streams.size(); ++s)
      if (streams[s].axis == axis) return static_cast<stream_id>(s);
    return std::nullopt;
  }
  [[nodiscard]] std::optional<int> axis_index(std::string_view axis_name) const {
    for (std::size_t a = 0; a < axes.size(); ++a)
      if (axes[a].name == axis_name) return static_cast<int>(a);
    return std::nullopt;
  }
  /// The task / buffer of an id (ids are indices).
  [[nodiscard]] const ir::task& task_at(task_id t) const { return tasks[static_cast<std::size_t>(t)]; }
  [[nodiscard]] const ir::buffer& buffer_at(buffer_id b) const { return buffers[static_cast<std::size_t>(b)]; }
  /// Root buffer of a view chain.
  [[nodiscard]] buffer_id root_of(buffer_id b) const {
    while (buffers.at(static_cast<std::size_t>(b)).view_of >= 0) b = buffers[static_cast<std::size_t>(b)].view_of;
    return b;
  }
  /// Byte offset of a buffer inside its root.
  [[nodiscard]] std::int64_t root_offset(buffer_id b) const {
    std::int64_t off = 0;
    while (buffers.at(static_cast<std::size_t>(b)).view_of >= 0) {
      off += buffers[static_cast<std::size_t>(b)].offset;
      b = buffers[static_cast<std::size_t>(b)].view_of;
    }
    return off;
  }
  /// Whether two buffers share any byte.
  [[nodiscard]] bool overlap(buffer_id a, buffer_id b) const {
    if (root_of(a) != root_of(b)) return false;
    const auto a0 = root_offset(a), b0 = root_offset(b);
    const auto a1 = a0 + buffers[static_cast<std::size_t>(a)].bytes;
    const auto b1 = b0 + buffers[static_cast<std::size_t>(b)].bytes;
    return a0 < b1 && b0 < a1;
  }

  /// Successor lists (inverse of deps).
  [[nodiscard]] std::vector<std::vector<task_id>> successors() const {
    std::vector<std::vector<task_id>> out(tasks.size());
    for (const auto& t : tasks)
      for (auto d : t.deps) out.at(static_cast<std::size_t>(d)).push_back(t.id);
    return out;
  }

  /// A topological order of the tasks; throws concerto::error naming a task on a cycle.
  [[nodiscard]] std::vector<task_id> topological_order() const;

  /// Checks ids, references, sizes, streams, functions and acyclicity; throws concerto::error
  /// that names the offending task or buffer. A task's fn must fit its kind (a collective's is
  /// a reduction); unless the graph is cost-only, every compute task must name an op both
  /// executors run, with the operands and attrs the op table lists.
  void validate() const;

private:
  void check_function(const task& t) const;
  [[nodiscard]] std::string where(const task& t) const;
};

// ---------------------------------------------------------------------------------------------

inline std::vector<task_id> graph::topological_order() const {
  const auto n = tasks.size();
  std::vector<int> indegree(n, 0);
  for (const auto& t : tasks) indegree[static_cast<std::size_t>(t.id)] = static_cast<int>(t.deps.size());
  const auto succ = successors();
  std::vector<task_id> order;
  order.reserve(n);
  for (std::size_t i = 0; i < n; ++i)
    if (indegree[i] == 0) order.push_back(static_cast<task_id>(i));
  for (std::size_t head = 0; head < order.size(); ++head)
    for (auto s : succ[static_cast<std::size_t>(order[head])])
      if (--indegree[static_cast<std::size_t>(s)] == 0) order.push_back(s);
  if (order.size() != n) {
    for (std::size_t i = 0; i < n; ++i)
      if (indegree[i] > 0)
        fail("graph '" + name + "' has a dependency cycle through task " + std::to_string(i) + " '" +
             tasks[i].name + "'");
  }
  return order;
}

// The messages are built only on failure: validate runs on every rewritten graph the planner
// tries (tens of thousands of tasks each), where a string per task was most of its time.
inline std::string graph::where(const task& t) const {
  return "graph '" + name + "': task " + std::to_string(t.id) + " '" + t.name + "'";
}

inline void graph::check_function(const task& t) const {
  const auto& op = info(t.fn);
  const auto fn = [&] { return "fn '" + std::string(op.name) + "'"; };
  if (is_collective(t.kind)) {
    // A collective's fn is how it combines values; one that only moves them needs none.
    if (op.role != op_role::reduction && t.fn != op::none)
      fail(where(t) + " (" + std::string(to_string(t.kind)) + ") has " + fn() + "; a collective's fn is how it combines "
           "values: sum, max or min");
    if (t.fn == op::none && reduces(t.kind) && !cost_only)
      fail(where(t) + " (" + std::string(to_string(t.kind)) + ") has no fn; say how it combines values: sum, max or min");
    if (t.fn != op::none && !reduces(t.kind))
      fail(where(t) + " (" + std::string(to_string(t.kind)) + ") has " + fn() + "; it moves values without combining them, "
           "so it takes no fn");
    return;
  }
  if (t.fn == op::none) {
    if (!cost_only) fail(where(t) + " names no fn; a graph that is run needs every compute task's op (or mark it cost_only)");
    return;
  }
  if (op.role != op_role::compute) fail(where(t) + " has " + fn() + ", which is not a compute op");
  if (op.kind != t.kind)
    fail(where(t) + " is a " + std::string(to_string(t.kind)) + " task with " + fn() + ", whose tasks are " +
         std::string(to_string(op.kind)));
  if (cost_only) return;
  if (!op.executable) fail(where(t) + " has " + fn() + ", which no executor runs (the graph is not marked cost_only)");
  const auto count = [&](const operand_list& l, std::size_t have, const char* what) {
    const auto lo = static_cast<std::size_t>(l.min()), hi = static_cast<std::size_t>(l.count);
    if (have < lo || (!l.variadic && have > hi)) {
      std::string names;
      for (int i = 0; i < l.count; ++i) names += (i ? ", " : "") + std::string(l.names[static_cast<std::size_t>(i)]);
      fail(where(t) + " (" + fn() + ") " + what + " " + std::to_string(have) + " buffer(s); the op " + what + " " +
           (lo == hi ? std::to_string(lo) : std::to_string(lo) + " to " + std::to_string(hi)) +
           (l.variadic ? " or more" : "") + ": " + names);
    }
  };
  count(op.reads, t.reads.size(), "reads");
  count(op.writes, t.writes.size(), "writes");
  for (const auto key : op.attrs)
    if (!key.empty() && !t.attrs.contains(std::string(key)))
      fail(where(t) + " (" + fn() + ") lacks attr '" + std::string(key) + "'");
}

inline void graph::validate() const {
  CONCERTO_CHECK(!streams.empty() && streams[0].is_compute(),
                 "graph '" + name + "': stream 0 must be the compute stream");
  for (std::size_t s = 1; s < streams.size(); ++s) {
    const auto& st = streams[s];
    if (st.axis < 0 || static_cast<std::size_t>(st.axis) >= axes.size())
      fail("graph '" + name + "': stream " + std::to_string(s) + " '" + st.name +
           "' names no mesh axis of the graph");
  }
  for (const auto& ax : axes)
    if (ax.size < 1) fail("graph '" + name + "': mesh axis '" + ax.name + "' has size " + std::to_string(ax.size));
  for (std::size_t b = 0; b < buffers.size(); ++b) {
    const auto& buf = buffers[b];
    const auto who = [&] { return "graph '" + name + "': buffer " + std::to_string(b) + " '" + buf.name + "'"; };
    if (buf.id != static_cast<buffer_id>(b)) fail(who() + " has id " + std::to_string(buf.id) + ", expected its index");
    if (buf.bytes < 0) fail(who() + " has a negative size");
    if (buf.view_of >= static_cast<buffer_id>(b) || buf.view_of < -1)
      fail(who() + " is a view of buffer " + std::to_string(buf.view_of) + ", which is not an earlier buffer");
    if (buf.view_of >= 0) {
      const auto& parent = buffers[static_cast<std::size_t>(buf.view_of)];
      if (buf.offset < 0 || buf.offset + buf.bytes > parent.bytes)
        fail(who() + " lies outside the buffer it views ('" + parent.name + "')");
    }
  }
  const auto n = static_cast<task_id>(tasks.size());
  for (std::size_t i = 0; i < tasks.size(); ++i) {
    const auto& t = tasks[i];
    if (t.id != static_cast<task_id>(i)) fail(where(t) + " has id " + std::to_string(t.id) + ", expected its index " + std::to_string(i));
    if (t.flops < 0 || t.bytes < 0) fail(where(t) + " has a negative flops or bytes count");
    if (t.stream < 0 || static_cast<std::size_t>(t.stream) >= streams.size())
      fail(where(t) + " runs on stream " + std::to_string(t.stream) + ", which does not exist");
    const auto& st = streams[static_cast<std::size_t>(t.stream)];
    if (is_collective(t.kind)) {
      if (t.axis < 0 || static_cast<std::size_t>(t.axis) >= axes.size())
        fail(where(t) + " is a " + std::string(to_string(t.kind)) + " without a valid mesh axis");
      if (st.is_compute())
        fail(where(t) + " is a collective but runs on the compute stream");
    } else if (!st.is_compute()) {
      fail(where(t) + " is a compute task on communication stream '" + st.name + "'");
    }
    check_function(t);
    for (auto d : t.deps) {
      if (d < 0 || d >= n) fail(where(t) + " depends on task " + std::to_string(d) + ", which does not exist");
      if (d == t.id) fail(where(t) + " depends on itself");
    }
    for (const auto* list : {&t.reads, &t.writes})
      for (auto b : *list)
        if (b < 0 || static_cast<std::size_t>(b) >= buffers.size())
          fail(where(t) + " uses buffer " + std::to_string(b) + ", which does not exist");
  }
  (void)topological_order();
}

} // namespace concerto::ir
