#pragma once
/// @file
/// @brief The numbers that describe a machine to the cost model: compute peak and its
/// small-shape efficiency curve, memory bandwidth, kernel launch overhead, the two link
/// classes, the collective algorithm and the overlap contention factor.
///
/// A `hardware` is plain data: presets fill it (see model.hpp), calibration measures it
/// (calibrate_cpu.hpp), JSON carries it, and its hash goes into the plan cache key, so that a
/// plan made for one set of numbers is never reused for another.

#include <concerto/core/error.hpp>
#include <concerto/core/hash.hpp>

#include <nlohmann/json.hpp>

#include <cmath>
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <string_view>

namespace concerto::cost {

/// @brief One link class as the alpha-beta model sees it.
///
/// `bandwidth_gbps` is in GB/s (10^9 bytes per second, not Gbit/s), per direction, per rank:
/// the bus bandwidth a rank gets when every rank of its node communicates at once, which is
/// what nccl-tests reports as "busbw".
struct link {
  double alpha_us = 0;       ///< latency of one step of a collective algorithm, microseconds
  double bandwidth_gbps = 1; ///< GB/s per direction per rank
  friend bool operator==(const link&, const link&) = default;
};

/// @brief How all-reduce and broadcast are priced: ring, tree, or whichever is cheaper.
enum class collective_algorithm : std::uint8_t { ring, tree, best };

[[nodiscard]] constexpr std::string_view to_string(collective_algorithm a) noexcept {
  return a == collective_algorithm::ring ? "ring" : a == collective_algorithm::tree ? "tree" : "best";
}
[[nodiscard]] inline std::optional<collective_algorithm> collective_algorithm_from_string(std::string_view s) noexcept {
  for (auto a : {collective_algorithm::ring, collective_algorithm::tree, collective_algorithm::best})
    if (to_string(a) == s) return a;
  return std::nullopt;
}

/// @brief A machine (per rank) as the cost model sees it.
///
/// Compute time follows a roofline: max(flops / (peak × efficiency), bytes / mem_bandwidth)
/// + launch_us. For a matmul, efficiency = max_efficiency × d/(d + efficiency_half_dim) ×
/// f/(f + efficiency_half_flops), with d = min(m, n, k) and f its flops: the first factor is
/// tile padding of thin shapes, the second a kernel too small to fill the machine.
///
/// @code
/// auto hw = cost::model::preset("a800x32").hw();
/// hw.overlap_slowdown = 1.0;             // what-if: no contention
/// cost::model m(hw);
/// @endcode
struct hardware {
  std::string name;
  int nodes = 1;                    ///< machines in the preset (world size = nodes × ranks_per_node)
  int ranks_per_node = 1;           ///< ranks (GPUs, or MPI processes) per machine
  double peak_tflops = 1;           ///< dense matmul peak per rank (tensor cores on a GPU)
  double vector_tflops = 1;         ///< peak of the other kernels (CUDA cores on a GPU)
  double mem_bandwidth_gbs = 1;     ///< achievable (stream-like) memory bandwidth, GB/s
  double max_efficiency = 1;        ///< fraction of peak_tflops a large matmul reaches, in (0, 1]
  double efficiency_half_dim = 0;   ///< min(m,n,k) at which the shape factor is 1/2
  double efficiency_half_flops = 0; ///< flops at which the size factor is 1/2
  double launch_us = 0;             ///< fixed cost of every compute kernel
  link intra_node;                  ///< links between ranks of one machine
  link inter_node;                  ///< links between machines
  collective_algorithm algorithm = collective_algorithm::best;
  double overlap_slowdown = 1;      ///< >= 1: compute runs this much slower while a collective runs
  /// >= 1: a collective runs this much slower while a compute task runs (on a CPU cluster the
  /// network stack needs the cores the kernels use: the cluster probe measured 1.1-1.4 on 4 hosts).
  double comm_overlap_slowdown = 1;
  /// Per kernel (a compute task's fn, or its op kind when fn is empty, e.g. "matmul"): measured
  /// time over the roofline's, > 0. Kernels not listed count 1. The roofline knows a kernel's
  /// flops and bytes, not how well it is written (a libm call per element, a reduction that
  /// does not vectorise); runtime/kernel_profile.hpp measures these factors on the machine itself.
  std::map<std::string, double, std::less<>> kernel_scale;

  friend bool operator==(const hardware&, const hardware&) = default;

  /// @brief Stable hash over the name and every number; goes into plan cache keys.
  [[nodiscard]] std::uint64_t hash() const {
    hasher h;
    h.add(std::string_view("concerto.cost.hardware.v1"));
    h.add(std::string_view(name));
    h.add(nodes).add(ranks_per_node);
    h.add(peak_tflops).add(vector_tflops).add(mem_bandwidth_gbs);
    h.add(max_efficiency).add(efficiency_half_dim).add(efficiency_half_flops).add(launch_us);
    h.add(intra_node.alpha_us).add(intra_node.bandwidth_gbps);
    h.add(inter_node.alpha_us).add(inter_node.bandwidth_gbps);
    h.add(algorithm).add(overlap_slowdown);
    // The two below only when they say something, so that the hash of a description without
    // them, and the plan cache keys made from it, stay what they were.
    if (comm_overlap_slowdown != 1) h.add(std::string_view("comm_overlap_slowdown")).add(comm_overlap_slowdown);
    if (!kernel_scale.empty()) {
      h.add(std::string_view("kernel_scale")).add(kernel_scale.size());
      for (const auto& [kernel, scale] : kernel_scale) h.add(std::string_view(kernel)).add(scale);
    }
    return h.value();
  }

  /// @brief Throws concerto::error naming the first field that no machine could have.
  void validate() const {
    const auto bad = [this](std::string_view field, std::string_view why) {
      fail("hardware '" + name + "': field '" + std::string(field) + "' " + std::string(why));
    };
    const auto positive = [&](std::string_view field, double v) {
      if (!std::isfinite(v) || v <= 0) bad(field, "must be a positive number, got " + std::to_string(v));
    };
    const auto non_negative = [&](std::string_view field, double v) {
      if (!std::isfinite(v) || v < 0) bad(field, "must be a finite number >= 0, got " + std::to_string(v));
    };
    if (nodes < 1) bad("nodes", "must be at least 1");
    if (ranks_per_node < 1) bad("ranks_per_node", "must be at least 1");
    positive("peak_tflops", peak_tflops);
    positive("vector_tflops", vector_tflops);
    positive("mem_bandwidth_gbs", mem_bandwidth_gbs);
    positive("max_efficiency", max_efficiency);
    if (max_efficiency > 1) bad("max_efficiency", "must be at most 1, got " + std::to_string(max_efficiency));
    non_negative("efficiency_half_dim", efficiency_half_dim);
    non_negative("efficiency_half_flops", efficiency_half_flops);
    non_negative("launch_us", launch_us);
    non_negative("intra_node.alpha_us", intra_node.alpha_us);
    positive("intra_node.bandwidth_gbps", intra_node.bandwidth_gbps);
    non_negative("inter_node.alpha_us", inter_node.alpha_us);
    positive("inter_node.bandwidth_gbps", inter_node.bandwidth_gbps);
    if (!std::isfinite(overlap_slowdown) || overlap_slowdown < 1)
      bad("overlap_slowdown", "must be >= 1, got " + std::to_string(overlap_slowdown));
    if (!std::isfinite(comm_overlap_slowdown) || comm_overlap_slowdown < 1)
      bad("comm_overlap_slowdown", "must be >= 1, got " + std::to_string(comm_overlap_slowdown));
    for (const auto& [kernel, scale] : kernel_scale) {
      if (kernel.empty()) bad("kernel_scale", "has an entry with an empty kernel name");
      positive("kernel_scale." + kernel, scale);
    }
  }
};

/// @brief The same hardware with other links, e.g. those the MPI runtime measured.
/// @code
/// auto hw = cost::with_links(cost::calibrate_cpu(), {0.8, 6.0}, {45.0, 0.117});
/// @endcode
[[nodiscard]] inline hardware with_links(hardware hw, link intra, link inter) {
  hw.intra_node = intra;
  hw.inter_node = inter;
  hw.validate();
  return hw;
}

inline void to_json(nlohmann::json& j, const link& l) {
  j = nlohmann::json{{"alpha_us", l.alpha_us}, {"bandwidth_gbps", l.bandwidth_gbps}};
}

inline void to_json(nlohmann::json& j, const hardware& hw) {
  j = nlohmann::json{{"name", hw.name},
                     {"nodes", hw.nodes},
                     {"ranks_per_node", hw.ranks_per_node},
                     {"peak_tflops", hw.peak_tflops},
                     {"vector_tflops", hw.vector_tflops},
                     {"mem_bandwidth_gbs", hw.mem_bandwidth_gbs},
                     {"max_efficiency", hw.max_efficiency},
                     {"efficiency_half_dim", hw.efficiency_half_dim},
                     {"efficiency_half_flops", hw.efficiency_half_flops},
                     {"launch_us", hw.launch_us},
                     {"intra_node", hw.intra_node},
                     {"inter_node", hw.inter_node},
                     {"algorithm", std::string(to_string(hw.algorithm))},
                     {"overlap_slowdown", hw.overlap_slowdown}};
  if (hw.comm_overlap_slowdown != 1) j["comm_overlap_slowdown"] = hw.comm_overlap_slowdown;
  if (!hw.kernel_scale.empty()) j["kernel_scale"] = hw.kernel_scale;
}

namespace detail {
// nlohmann's own exceptions say "type must be number" without naming the key; ours name it.
inline const nlohmann::json& field(const nlohmann::json& j, std::string_view key, std::string_view where) {
  if (!j.is_object()) fail(std::string(where) + " must be a JSON object");
  const auto it = j.find(std::string(key));
  if (it == j.end()) fail(std::string(where) + " has no field '" + std::string(key) + "'");
  return *it;
}
inline double number(const nlohmann::json& j, std::string_view key, std::string_view where) {
  const auto& v = field(j, key, where);
  if (!v.is_number()) fail(std::string(where) + ": field '" + std::string(key) + "' must be a number");
  return v.get<double>();
}
inline int integer(const nlohmann::json& j, std::string_view key, std::string_view where) {
  const auto& v = field(j, key, where);
  if (!v.is_number_integer()) fail(std::string(where) + ": field '" + std::string(key) + "' must be an integer");
  return v.get<int>();
}
inline link link_from(const nlohmann::json& j, std::string_view key, std::string_view where) {
  const auto inner = std::string(where) + "." + std::string(key);
  const auto& v = field(j, key, where);
  return link{number(v, "alpha_us", inner), number(v, "bandwidth_gbps", inner)};
}
} // namespace detail

/// @brief Reads a hardware description; throws concerto::error naming a missing or bad field.
inline void from_json(const nlohmann::json& j, hardware& hw) {
  constexpr std::string_view where = "hardware JSON";
  const auto& name = detail::field(j, "name", where);
  if (!name.is_string()) fail("hardware JSON: field 'name' must be a string");
  hardware out;
  out.name = name.get<std::string>();
  out.nodes = detail::integer(j, "nodes", where);
  out.ranks_per_node = detail::integer(j, "ranks_per_node", where);
  out.peak_tflops = detail::number(j, "peak_tflops", where);
  out.vector_tflops = detail::number(j, "vector_tflops", where);
  out.mem_bandwidth_gbs = detail::number(j, "mem_bandwidth_gbs", where);
  out.max_efficiency = detail::number(j, "max_efficiency", where);
  out.efficiency_half_dim = detail::number(j, "efficiency_half_dim", where);
  out.efficiency_half_flops = detail::number(j, "efficiency_half_flops", where);
  out.launch_us = detail::number(j, "launch_us", where);
  out.intra_node = detail::link_from(j, "intra_node", where);
  out.inter_node = detail::link_from(j, "inter_node", where);
  const auto& algo = detail::field(j, "algorithm", where);
  const auto parsed = algo.is_string() ? collective_algorithm_from_string(algo.get<std::string>()) : std::nullopt;
  if (!parsed) fail("hardware JSON: field 'algorithm' must be \"ring\", \"tree\" or \"best\"");
  out.algorithm = *parsed;
  out.overlap_slowdown = detail::number(j, "overlap_slowdown", where);
  if (j.contains("comm_overlap_slowdown")) // optional: absent means collectives do not slow
    out.comm_overlap_slowdown = detail::number(j, "comm_overlap_slowdown", where);
  if (const auto it = j.find("kernel_scale"); it != j.end()) { // optional: absent means every kernel counts 1
    if (!it->is_object()) fail("hardware JSON: field 'kernel_scale' must be an object of kernel name -> factor");
    for (const auto& [kernel, scale] : it->items())
      out.kernel_scale[kernel] = detail::number(*it, kernel, "hardware JSON: field 'kernel_scale'");
  }
  out.validate();
  hw = std::move(out);
}

} // namespace concerto::cost
