#pragma once
/// @file
/// @brief The cost model: how long each task of an ir::graph takes on a given hardware.
///
/// Compute is a roofline with a small-shape efficiency curve, so that splitting a matmul into
/// chunks costs more in total than the whole (the price the decomposition search must pay);
/// collectives follow the alpha-beta model per link class and algorithm; `overlap_slowdown`
/// is the factor by which compute slows while a collective is in flight (the simulator and
/// the solver apply it). Formulas and sources: docs/cost-model.md.
///
/// @code
/// auto m = cost::model::preset("a800x32");
/// std::vector<double> d = m.durations_us(graph); // one entry per task, by id
/// double ar = m.collective_us(ir::op_kind::all_reduce, 64e6, 8, ir::link_class::intra_node);
/// @endcode

#include <concerto/cost/presets.hpp>
#include <concerto/ir/graph.hpp>

#include <algorithm>
#include <cmath>
#include <vector>

namespace concerto::cost {

/// @brief Prices tasks on one hardware. Cheap to copy; immutable after construction.
class model {
public:
  /// @brief A model of `hw`; throws concerto::error naming a field no machine could have.
  explicit model(hardware hw) : hw_(std::move(hw)) { hw_.validate(); }

  /// @brief A model of a named preset (see preset_names()); "cpu" uses this machine's cached
  /// calibration if there is one. Throws concerto::error listing the known presets.
  /// @code
  /// auto m = cost::model::preset("h100x64");
  /// @endcode
  [[nodiscard]] static model preset(std::string_view name) { return model(preset_hardware(name)); }

  [[nodiscard]] const hardware& hw() const noexcept { return hw_; }

  /// @brief Factor (>= 1) by which compute slows while any collective is in flight.
  [[nodiscard]] double overlap_slowdown() const noexcept { return hw_.overlap_slowdown; }
  /// @brief Factor (>= 1) by which a collective slows while a compute task runs.
  [[nodiscard]] double comm_overlap_slowdown() const noexcept { return hw_.comm_overlap_slowdown; }

  /// @brief Duration of any task of `g`, in µs, in isolation (no contention applied).
  [[nodiscard]] double task_us(const ir::graph& g, const ir::task& t) const {
    if (!ir::is_collective(t.kind)) return compute_us(t);
    if (t.axis < 0 || static_cast<std::size_t>(t.axis) >= g.axes.size())
      fail("task " + std::to_string(t.id) + " '" + t.name + "' is a " + std::string(ir::to_string(t.kind)) +
           " without a valid mesh axis (axis " + std::to_string(t.axis) + ")");
    const auto& axis = g.axes[static_cast<std::size_t>(t.axis)];
    check_bytes(t);
    return collective_us(t.kind, t.bytes, axis.size, axis.link);
  }

  /// @brief Durations of every task of `g`, indexed by task id.
  [[nodiscard]] std::vector<double> durations_us(const ir::graph& g) const {
    std::vector<double> out;
    out.reserve(g.tasks.size());
    for (const auto& t : g.tasks) out.push_back(task_us(g, t));
    return out;
  }

  /// @brief Fraction of the compute peak a task reaches, in (0, max_efficiency]; matmul and
  /// attention are measured against peak_tflops, other kernels against vector_tflops.
  [[nodiscard]] double efficiency(const ir::task& t) const {
    double e = size_factor(t.flops);
    if (t.kind == ir::op_kind::matmul) {
      const auto m = t.attr("m"), n = t.attr("n"), k = t.attr("k");
      if (m > 0 && n > 0 && k > 0) e *= shape_factor(static_cast<double>(std::min({m, n, k})));
      e *= hw_.max_efficiency;
    } else if (t.kind == ir::op_kind::attention) {
      // Fused attention runs its two GEMMs with K or N = head_dim, the thin side of its tiles.
      if (const auto hd = t.attr("head_dim"); hd > 0) e *= shape_factor(static_cast<double>(hd));
      e *= hw_.max_efficiency;
    }
    return e;
  }

  /// @brief The name a compute task's kernel goes by in hardware::kernel_scale: its fn, or its
  /// op kind when it has none (matmul).
  [[nodiscard]] static std::string_view kernel_name(const ir::task& t) {
    return t.fn == ir::op::none ? ir::to_string(t.kind) : ir::to_string(t.fn);
  }

  /// @brief Duration of a compute task in µs: max(flops / (peak × efficiency), bytes /
  /// mem_bandwidth) × kernel_scale[kernel] + launch_us. Throws concerto::error for a collective.
  [[nodiscard]] double compute_us(const ir::task& t) const {
    if (ir::is_collective(t.kind))
      fail("task " + std::to_string(t.id) + " '" + t.name + "' is a " + std::string(ir::to_string(t.kind)) +
           ", not a compute task; price it with task_us or collective_us");
    if (!std::isfinite(t.flops) || t.flops < 0)
      fail("task " + std::to_string(t.id) + " '" + t.name + "' has an invalid flops count " + std::to_string(t.flops));
    check_bytes(t);
    const bool tensor_core = t.kind == ir::op_kind::matmul || t.kind == ir::op_kind::attention;
    const double peak = tensor_core ? hw_.peak_tflops : hw_.vector_tflops;
    // TFLOP/s × 1e6 = flop per µs; GB/s × 1e3 = byte per µs.
    const double compute = t.flops > 0 ? t.flops / (peak * 1e6 * efficiency(t)) : 0.0;
    const double memory = t.bytes / (hw_.mem_bandwidth_gbs * 1e3);
    const auto scale = hw_.kernel_scale.find(kernel_name(t));
    return std::max(compute, memory) * (scale == hw_.kernel_scale.end() ? 1.0 : scale->second) + hw_.launch_us;
  }

  /// @brief Duration in µs of a collective of `bytes` (convention of ir/graph.hpp) over
  /// `group_size` ranks on a link class, with the hardware's algorithm choice.
  [[nodiscard]] double collective_us(ir::op_kind kind, double bytes, int group_size, ir::link_class link) const {
    return collective_us(kind, bytes, group_size, link, hw_.algorithm);
  }

  /// @brief As above with an explicit algorithm (it matters for all-reduce and broadcast only:
  /// the others are priced as rings, as NCCL runs them).
  /// @code
  /// // 2·7·(3.4 µs + 8 MB / (8 · 155 GB/s)) on a800x32:
  /// m.collective_us(ir::op_kind::all_reduce, 8e6, 8, ir::link_class::intra_node, cost::collective_algorithm::ring);
  /// @endcode
  [[nodiscard]] double collective_us(ir::op_kind kind, double bytes, int group_size, ir::link_class link,
                                     collective_algorithm algorithm) const {
    if (!ir::is_collective(kind))
      fail("collective_us: '" + std::string(ir::to_string(kind)) + "' is not a collective");
    if (!std::isfinite(bytes) || bytes < 0)
      fail("collective_us: " + std::string(ir::to_string(kind)) + " of " + std::to_string(bytes) +
           " bytes; the size must be a finite number >= 0");
    if (group_size < 1)
      fail("collective_us: " + std::string(ir::to_string(kind)) + " over a group of " + std::to_string(group_size) +
           " ranks; the group size must be at least 1");
    if (group_size == 1) return 0.0; // nothing leaves the rank
    const auto& l = link == ir::link_class::intra_node ? hw_.intra_node : hw_.inter_node;
    const auto priced = [&l](alpha_beta_terms t) { return t.latency_steps * l.alpha_us + t.bytes_sent / (l.bandwidth_gbps * 1e3); };
    const auto ring = collective_terms(kind, bytes, group_size, collective_algorithm::ring);
    const auto tree = collective_terms(kind, bytes, group_size, collective_algorithm::tree);
    return algorithm == collective_algorithm::ring   ? priced(ring)
           : algorithm == collective_algorithm::tree ? priced(tree)
                                                     : std::min(priced(ring), priced(tree));
  }

  /// @brief The algorithm `collective_us` prices a collective with on this hardware: the
  /// hardware's choice, or under `best` the cheaper of ring and tree at these sizes.
  [[nodiscard]] collective_algorithm algorithm_for(ir::op_kind kind, double bytes, int group_size, ir::link_class link) const {
    if (hw_.algorithm != collective_algorithm::best) return hw_.algorithm;
    return collective_us(kind, bytes, group_size, link, collective_algorithm::ring) <=
                   collective_us(kind, bytes, group_size, link, collective_algorithm::tree)
               ? collective_algorithm::ring
               : collective_algorithm::tree;
  }

  /// @brief A collective's alpha-beta cost as two numbers, so that its duration is
  /// `latency_steps × alpha + bytes_sent / bandwidth` on any link: linear in the link's two
  /// parameters, which is what lets planner/refit.hpp fit them to measured collectives. `best`
  /// is not an algorithm here (it is a choice between two); it reads as ring.
  struct alpha_beta_terms {
    double latency_steps = 0; ///< sequential message steps, each paying the link's alpha
    double bytes_sent = 0;    ///< bytes each rank sends over its link, one after another
  };
  [[nodiscard]] static alpha_beta_terms collective_terms(ir::op_kind kind, double bytes, int group_size,
                                                         collective_algorithm algorithm) {
    if (group_size <= 1) return {};
    const double p = group_size;
    const double log_p = std::ceil(std::log2(p));
    const bool tree = algorithm == collective_algorithm::tree;
    switch (kind) {
    case ir::op_kind::all_reduce:
      // Ring: reduce-scatter then all-gather, 2(p-1) steps of n/p bytes. Tree: reduce up and
      // broadcast down a binary tree, 2⌈log2 p⌉ steps of the whole buffer (not pipelined, so
      // it only wins where latency dominates, as NCCL's tree does for small messages).
      return tree ? alpha_beta_terms{2 * log_p, 2 * log_p * bytes} : alpha_beta_terms{2 * (p - 1), 2 * (p - 1) * bytes / p};
    case ir::op_kind::all_gather:
    case ir::op_kind::reduce_scatter:
    case ir::op_kind::all_to_all:
      // p-1 steps, each moving one rank's share (n/p) of the per-rank buffer.
      return {p - 1, (p - 1) * bytes / p};
    case ir::op_kind::send:
    case ir::op_kind::recv:
      return {1, bytes};
    case ir::op_kind::broadcast:
      // Ring: a chain pipelined in small chunks, p-1 hops of latency and the buffer crossing
      // each link once (the large-message limit). Tree: ⌈log2 p⌉ hops of the whole buffer.
      return tree ? alpha_beta_terms{log_p, log_p * bytes} : alpha_beta_terms{p - 1, bytes};
    default:
      break;
    }
    // Unreachable for the kinds of ir::op_kind; a value cast from a bad integer lands here.
    fail("collective_us: no cost formula for op kind " + std::to_string(static_cast<int>(kind)));
  }

private:
  [[nodiscard]] double shape_factor(double min_dim) const noexcept {
    return min_dim / (min_dim + hw_.efficiency_half_dim);
  }
  [[nodiscard]] double size_factor(double flops) const noexcept {
    return flops > 0 ? flops / (flops + hw_.efficiency_half_flops) : 1.0;
  }
  static void check_bytes(const ir::task& t) {
    if (!std::isfinite(t.bytes) || t.bytes < 0)
      fail("task " + std::to_string(t.id) + " '" + t.name + "' has an invalid bytes count " + std::to_string(t.bytes));
  }

  hardware hw_;
};

} // namespace concerto::cost
