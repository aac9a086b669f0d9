#pragma once
/// @file
/// @brief Builds an ir::graph without the DSL (benchmark workloads, imports, tests).
///
/// Tasks are added in program order. Dependencies are derived from the buffers each task
/// reads and writes (read-after-write, write-after-read, write-after-write, views included),
/// so a graph built here is executable as written; extra ordering can be added with `after`.
///
/// @code
/// ir::builder b("mlp");
/// auto dp = b.axis("dp", 4, ir::link_class::inter_node);
/// auto x = b.buffer("x", {256, 1024}, ir::buffer_role::input);
/// auto w = b.buffer("w", {1024, 1024}, ir::buffer_role::param);
/// auto y = b.buffer("y", {256, 1024});
/// b.matmul("fc", x, w, y, 256, 1024, 1024);
/// auto g = b.buffer("w.grad", {1024, 1024}, ir::buffer_role::gradient);
/// b.collective(ir::op_kind::all_reduce, "w.grad.ar", dp, g, g);
/// ir::graph graph = std::move(b).finish();
/// @endcode

#include <concerto/ir/graph.hpp>
#include <concerto/ir/task_attrs.hpp>

#include <array>
#include <initializer_list>
#include <numeric>
#include <optional>
#include <utility>

namespace concerto::ir {

using attr_map = std::map<std::string, std::int64_t>;

/// @brief Extra description of a compute task beyond its buffers.
struct compute_info {
  op fn = op::none;
  double flops = -1; ///< -1: from the op table (ir::flops_of), 0 for op::none
  double bytes = -1; ///< memory traffic; -1: sum of the sizes of the buffers read and written
  attr_map attrs;
};

/// @brief The FLOPs of a task of op `fn` over these buffers and attrs, by the op table's rule,
/// so that every producer (the DSL lowering, the workloads, imports) prices an op alike.
[[nodiscard]] inline double flops_of(const graph& g, op fn, const std::vector<buffer_id>& reads,
                                     const std::vector<buffer_id>& writes, const attr_map& attrs) {
  const auto& i = info(fn);
  const auto elements = [&](const std::vector<buffer_id>& list, std::size_t at) {
    if (list.size() <= at) return 0.0;
    const auto& b = g.buffers.at(static_cast<std::size_t>(list[at]));
    return static_cast<double>(b.bytes) / static_cast<double>(std::max<std::size_t>(size_of(b.type), 1));
  };
  const auto attr = [&](const char* key, std::int64_t fallback) {
    const auto it = attrs.find(key);
    return static_cast<double>(it == attrs.end() ? fallback : it->second);
  };
  switch (i.flops) {
  case flops_rule::none: return 0;
  case flops_rule::per_output: return i.flops_per_element * elements(writes, 0);
  case flops_rule::per_input: return i.flops_per_element * elements(reads, static_cast<std::size_t>(i.flops_read));
  case flops_rule::gemm: return 2.0 * attr("m", 0) * attr("n", 0) * attr("k", 0) * attr("batch", 1);
  case flops_rule::convolution:
    return conv_geometry::read([&](const char* key, std::int64_t fallback) {
             return static_cast<std::int64_t>(attr(key, fallback));
           }).flops();
  case flops_rule::window:
    return conv_geometry::read([&](const char* key, std::int64_t fallback) {
             return static_cast<std::int64_t>(attr(key, fallback));
           }).window_values();
  case flops_rule::attention:
  case flops_rule::attention_grad: {
    const double seq = attr("seq", 0);
    // Causal: half of the 4·seq² of the two products; without the mask, all of it.
    const double square = attr("causal", 1) != 0 ? 2.0 : 4.0;
    const double forward = square * attr("batch", 1) * seq * seq * attr("heads", 0) * attr("head_dim", 0);
    return i.flops == flops_rule::attention ? forward : 2.5 * forward;
  }
  }
  return 0; // unreachable: the switch covers every rule
}

class builder {
public:
  explicit builder(std::string name) { graph_.name = std::move(name); }

  /// Current phase and layer, stamped on every task added after the call.
  builder& at(phase p, int layer = -1) {
    phase_ = p;
    layer_ = layer;
    return *this;
  }

  /// Marks the graph as made to be priced, not run (ir::graph::cost_only).
  builder& cost_only() {
    graph_.cost_only = true;
    return *this;
  }

  /// Adds a mesh axis (and its communication lane); returns the axis index.
  int axis(std::string name, int size, link_class link = link_class::intra_node) {
    CONCERTO_CHECK(!graph_.axis_index(name), "mesh axis '" + name + "' added twice");
    graph_.axes.push_back({name, size, link});
    const int index = static_cast<int>(graph_.axes.size()) - 1;
    graph_.streams.push_back({"comm:" + name, index});
    return index;
  }

  /// Adds another communication lane of an existing axis (its own stream and communicator), for
  /// collectives that must not wait behind the axis's first lane (a pipeline's gradients flowing
  /// back while values flow forward); returns its stream id. See `on_lane`.
  stream_id lane(int axis, std::string name) {
    CONCERTO_CHECK(axis >= 0 && static_cast<std::size_t>(axis) < graph_.axes.size(),
                   "lane '" + name + "' names mesh axis " + std::to_string(axis) + ", which does not exist");
    graph_.streams.push_back({std::move(name), axis});
    return static_cast<stream_id>(graph_.streams.size() - 1);
  }
  /// Moves a collective onto another lane of its axis (dependencies do not change).
  void on_lane(task_id t, stream_id s) {
    auto& task = graph_.tasks.at(static_cast<std::size_t>(t));
    CONCERTO_CHECK(ir::is_collective(task.kind) && graph_.streams.at(static_cast<std::size_t>(s)).axis == task.axis,
                   "task '" + task.name + "' cannot move to stream " + std::to_string(s) + ": not a lane of its axis");
    task.stream = s;
  }

  /// Adds a buffer with a local shape; bytes = product(shape) × size_of(type).
  buffer_id buffer(std::string name, std::vector<std::int64_t> shape, buffer_role role = buffer_role::activation,
                   dtype type = dtype::f32) {
    const auto elems = std::accumulate(shape.begin(), shape.end(), std::int64_t{1}, std::multiplies<>{});
    CONCERTO_CHECK(elems >= 0, "buffer '" + name + "' has a negative extent");
    return add_buffer(ir::buffer{static_cast<buffer_id>(graph_.buffers.size()), std::move(name),
                                 elems * static_cast<std::int64_t>(size_of(type)), type, role, std::move(shape), -1, 0});
  }

  /// Adds a view of `bytes` bytes at `offset` inside `parent`.
  buffer_id view(std::string name, buffer_id parent, std::int64_t offset, std::int64_t bytes,
                 std::vector<std::int64_t> shape = {}) {
    const auto& p = graph_.buffers.at(static_cast<std::size_t>(parent));
    CONCERTO_CHECK(offset >= 0 && bytes >= 0 && offset + bytes <= p.bytes,
                   "view '" + name + "' lies outside buffer '" + p.name + "'");
    return add_buffer(ir::buffer{static_cast<buffer_id>(graph_.buffers.size()), std::move(name), bytes, p.type, p.role,
                                 std::move(shape), parent, offset});
  }

  /// Adds a compute task of op `fn`, its buffers in the op's operand order (ir/ops.hpp); its
  /// kind and FLOPs come from the op table.
  /// @code
  /// b.compute(ir::op::rmsnorm, "ln1", {x, gain}, {y});
  /// @endcode
  task_id compute(op fn, std::string name, std::vector<buffer_id> reads, std::vector<buffer_id> writes,
                  attr_map attrs = {}) {
    return compute(info(fn).kind, std::move(name), std::move(reads), std::move(writes), {fn, -1, -1, std::move(attrs)});
  }

  /// Adds a compute task of any kind with explicit costs (graphs priced by hand, cost-only
  /// placeholders); with a fn, the kind must be the op's.
  task_id compute(op_kind kind, std::string name, std::vector<buffer_id> reads, std::vector<buffer_id> writes,
                  compute_info info = {}) {
    CONCERTO_CHECK(!is_collective(kind), "task '" + name + "': use builder::collective for collectives");
    CONCERTO_CHECK(info.fn == op::none || (is_compute(info.fn) && ir::info(info.fn).kind == kind),
                   "task '" + name + "': op '" + std::string(to_string(info.fn)) + "' is not a compute op of kind " +
                       std::string(to_string(kind)));
    task t;
    t.name = std::move(name);
    t.kind = kind;
    t.stream = compute_stream;
    t.flops = info.flops >= 0 ? info.flops : info.fn == op::none ? 0.0 : flops_of(graph_, info.fn, reads, writes, info.attrs);
    t.bytes = info.bytes >= 0 ? info.bytes : traffic(reads, writes);
    t.fn = info.fn;
    t.attrs = std::move(info.attrs);
    t.reads = std::move(reads);
    t.writes = std::move(writes);
    return add_task(std::move(t));
  }

  /// C[m×n] = A[m×k] · B[k×n] (batched `batch` times), fp32 FLOPs 2·m·n·k·batch.
  task_id matmul(std::string name, buffer_id a, buffer_id b, buffer_id c, std::int64_t m, std::int64_t n,
                 std::int64_t k, std::int64_t batch = 1, bool trans_a = false, bool trans_b = false,
                 bool accumulate = false) {
    std::vector<buffer_id> reads{a, b};
    if (accumulate) reads.push_back(c);
    return compute(op::matmul, std::move(name), std::move(reads), {c},
                   {{"m", m}, {"n", n}, {"k", k}, {"batch", batch}, {"trans_a", trans_a}, {"trans_b", trans_b},
                    {"accumulate", accumulate}});
  }

  /// Copies the part [offset, offset + length) of dimension `dim` of `src` (of shape `shape`)
  /// into `dst`: the slice op with its explicit row geometry (outer, extent, inner).
  task_id slice(std::string name, buffer_id src, buffer_id dst, const std::vector<std::int64_t>& shape, std::size_t dim,
                std::int64_t offset, std::int64_t length) {
    const auto [outer, extent, inner] = around(shape, dim, name);
    return compute(op::slice, std::move(name), {src}, {dst},
                   {{"outer", outer}, {"extent", extent}, {"inner", inner}, {"length", length}, {"offset", offset}});
  }

  /// Joins equal parts along dimension `dim` of `dst` (of shape `shape`): the concat op with its
  /// explicit row geometry.
  task_id concat(std::string name, std::vector<buffer_id> parts, buffer_id dst, const std::vector<std::int64_t>& shape,
                 std::size_t dim) {
    const auto [outer, extent, inner] = around(shape, dim, name);
    const auto n = static_cast<std::int64_t>(parts.size());
    CONCERTO_CHECK(n > 0 && extent % n == 0, "concat '" + name + "': " + std::to_string(n) + " parts do not split extent " +
                                                 std::to_string(extent) + " evenly");
    return compute(op::concat, std::move(name), std::move(parts), {dst},
                   {{"outer", outer}, {"inner", inner}, {"length", extent / n}, {"parts", n}});
  }

  /// Copies `part` into the first `length` of dimension `dim` of `dst` (of shape `shape`), the
  /// rest of `dst` left as it is (a padded copy: lowering's uneven ZeRO splits): the concat op
  /// of one part with attr extent, the whole's extent.
  task_id place(std::string name, buffer_id part, buffer_id dst, const std::vector<std::int64_t>& shape, std::size_t dim,
                std::int64_t length) {
    const auto [outer, extent, inner] = around(shape, dim, name);
    CONCERTO_CHECK(length >= 0 && length <= extent, "place '" + name + "': a part of " + std::to_string(length) +
                                                        " does not fit extent " + std::to_string(extent));
    return compute(op::concat, std::move(name), {part}, {dst},
                   {{"outer", outer}, {"inner", inner}, {"length", length}, {"parts", 1}, {"extent", extent}});
  }

  /// A collective over the group of `axis`; `bytes` defaults per the graph.hpp convention, `fn`
  /// to sum for a collective that reduces (none for one that only moves values).
  task_id collective(op_kind kind, std::string name, int axis, buffer_id in, buffer_id out, double bytes = -1,
                     std::optional<op> reduction = std::nullopt, attr_map attrs = {}) {
    CONCERTO_CHECK(is_collective(kind), "task '" + name + "' is not a collective");
    CONCERTO_CHECK(axis >= 0 && static_cast<std::size_t>(axis) < graph_.axes.size(),
                   "collective '" + name + "' names mesh axis " + std::to_string(axis) + ", which does not exist");
    task t;
    t.name = std::move(name);
    t.kind = kind;
    t.attrs = std::move(attrs);
    t.axis = axis;
    t.stream = *graph_.lane_of_axis(axis);
    const auto in_bytes = static_cast<double>(graph_.buffers.at(static_cast<std::size_t>(in)).bytes);
    const auto out_bytes = static_cast<double>(graph_.buffers.at(static_cast<std::size_t>(out)).bytes);
    t.bytes = bytes >= 0 ? bytes : std::max(in_bytes, out_bytes);
    const auto fn = reduction.value_or(reduces(kind) ? op::sum : op::none);
    CONCERTO_CHECK(fn == op::none || is_reduction(fn), "collective '" + t.name + "': fn '" + std::string(to_string(fn)) +
                                                           "' is not a reduction (sum, max, min)");
    t.fn = fn;
    t.reads = {in};
    t.writes = {out};
    return add_task(std::move(t));
  }

  /// Adds an explicit ordering edge (before → after) beyond what the buffers imply.
  void after(task_id after_task, task_id before_task) {
    auto& deps = graph_.tasks.at(static_cast<std::size_t>(after_task)).deps;
    if (std::find(deps.begin(), deps.end(), before_task) == deps.end()) deps.push_back(before_task);
  }

  [[nodiscard]] const graph& peek() const noexcept { return graph_; }

  /// Validates and returns the graph.
  [[nodiscard]] graph finish() && {
    graph_.validate();
    return std::move(graph_);
  }

private:
  struct access_log {
    task_id last_writer = -1;
    std::vector<task_id> readers_since_write;
  };

  buffer_id add_buffer(ir::buffer b) {
    const auto id = b.id;
    const auto root = b.view_of >= 0 ? graph_.root_of(b.view_of) : id;
    graph_.buffers.push_back(std::move(b));
    log_.emplace_back();
    sharing_root_.emplace_back();
    sharing_root_[static_cast<std::size_t>(root)].push_back(id);
    return id;
  }

  // A shape seen as [outer, extent, inner] around dimension `dim`.
  static std::array<std::int64_t, 3> around(const std::vector<std::int64_t>& shape, std::size_t dim, const std::string& name) {
    CONCERTO_CHECK(dim < shape.size(), "task '" + name + "': dimension " + std::to_string(dim) + " of a rank-" +
                                           std::to_string(shape.size()) + " shape");
    std::int64_t outer = 1, inner = 1;
    for (std::size_t d = 0; d < dim; ++d) outer *= shape[d];
    for (std::size_t d = dim + 1; d < shape.size(); ++d) inner *= shape[d];
    return {outer, shape[dim], inner};
  }

  double traffic(const std::vector<buffer_id>& reads, const std::vector<buffer_id>& writes) const {
    double sum = 0;
    for (auto b : reads) sum += static_cast<double>(graph_.buffers.at(static_cast<std::size_t>(b)).bytes);
    for (auto b : writes) sum += static_cast<double>(graph_.buffers.at(static_cast<std::size_t>(b)).bytes);
    return sum;
  }

  task_id add_task(task t) {
    t.id = static_cast<task_id>(graph_.tasks.size());
    t.step_phase = phase_;
    t.layer = layer_;
    std::vector<task_id> deps;
    const auto need = [&](task_id d) {
      if (d >= 0 && std::find(deps.begin(), deps.end(), d) == deps.end()) deps.push_back(d);
    };
    // Every buffer that shares bytes with an accessed one constrains the order; only buffers of
    // one root can (a graph of thousands of tasks and buffers would otherwise cost their product).
    std::vector<buffer_id> roots;
    for (const auto* accessed : {&t.reads, &t.writes})
      for (auto a : *accessed) roots.push_back(graph_.root_of(a));
    std::sort(roots.begin(), roots.end());
    roots.erase(std::unique(roots.begin(), roots.end()), roots.end());
    for (const auto root : roots)
      for (const auto id : sharing_root_[static_cast<std::size_t>(root)]) {
        const bool read = std::any_of(t.reads.begin(), t.reads.end(), [&](auto r) { return graph_.overlap(r, id); });
        const bool written = std::any_of(t.writes.begin(), t.writes.end(), [&](auto w) { return graph_.overlap(w, id); });
        if (!read && !written) continue;
        const auto& log = log_[static_cast<std::size_t>(id)];
        need(log.last_writer); // RAW and WAW
        if (written)
          for (auto r : log.readers_since_write) need(r); // WAR
      }
    for (auto b : t.reads) {
      auto& readers = log_[static_cast<std::size_t>(b)].readers_since_write;
      readers.push_back(t.id);
    }
    for (auto b : t.writes) {
      log_[static_cast<std::size_t>(b)].last_writer = t.id;
      log_[static_cast<std::size_t>(b)].readers_since_write.clear();
    }
    std::sort(deps.begin(), deps.end());
    t.deps = std::move(deps);
    graph_.tasks.push_back(std::move(t));
    return graph_.tasks.back().id;
  }

  graph graph_;
  std::vector<access_log> log_;
  std::vector<std::vector<buffer_id>> sharing_root_; ///< by root buffer: it and every view inside it
  phase phase_ = phase::forward;
  int layer_ = -1;
};

} // namespace concerto::ir
