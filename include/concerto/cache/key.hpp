#pragma once
/// @file
/// @brief The plan cache key: everything that changes what the planner would return.
///
/// A cached plan may be reused only when the graph, the mesh, the cost model's numbers, the
/// backend, the library version, the policy and the result-changing planner options are all
/// the same. The key names each of them separately (so that a file can be checked field by
/// field) and hashes them into the 16 hex digits that name the cache file.

#include <concerto/core/hash.hpp>
#include <concerto/cost/model.hpp>
#include <concerto/ir/graph.hpp>
#include <concerto/plan/hash.hpp>

#include <cstdint>
#include <string>
#include <string_view>

namespace concerto::cache {

/// @brief The library version that goes into every key: a new release never reuses the plans
/// of an older one, whose planner may have chosen differently or written another format.
#ifdef CONCERTO_VERSION
inline constexpr std::string_view library_version = CONCERTO_VERSION;
#else
inline constexpr std::string_view library_version = "dev";
#endif

/// @brief What a cached plan was made from.
struct cache_key {
  std::uint64_t graph = 0;      ///< plan::hash of the input graph
  std::uint64_t mesh = 0;       ///< hash of the graph's mesh axes (names, sizes, links)
  std::uint64_t cost_model = 0; ///< cost::hardware::hash of the model's hardware
  std::string backend;          ///< "mpi", "nccl", "sim", ...
  std::string library_version;  ///< CONCERTO_VERSION, or "dev"
  std::string policy;           ///< the planning policy: sync, xla_lhs, concerto, ...
  std::uint64_t options = 0;    ///< hash of the planner options that change the result (0: none)
  friend bool operator==(const cache_key&, const cache_key&) = default;

  /// @brief Stable hash of every field, as 16 lowercase hex digits; names the cache file.
  [[nodiscard]] std::string hex() const {
    hasher h;
    h.add(std::string_view("concerto.cache_key/1")); // a new field list must change every key
    h.add(graph).add(mesh).add(cost_model);
    h.add(std::string_view(backend)).add(std::string_view(library_version)).add(std::string_view(policy));
    h.add(options);
    return h.hex();
  }
};

/// @brief Stable hash of a graph's mesh axes, in order: name, size and link class of each.
[[nodiscard]] inline std::uint64_t mesh_hash(const ir::graph& g) {
  hasher h;
  h.add(std::string_view("concerto.mesh/1"));
  h.add(g.axes.size());
  for (const auto& a : g.axes) h.add(std::string_view(a.name)).add(a.size).add(a.link);
  return h.value();
}

/// @brief The key of planning `g` with `model` for `backend` under `policy`.
/// `options_hash` stands for the planner options that change the plan (window size, rounds,
/// time budget...): the caller hashes them, since only it knows which ones matter.
/// @code
/// auto key = cache::make_key(graph, model, "nccl", "concerto", concerto::hasher{}.add(window).value());
/// @endcode
[[nodiscard]] inline cache_key make_key(const ir::graph& g, const cost::model& model, std::string_view backend,
                                        std::string_view policy, std::uint64_t options_hash = 0) {
  return cache_key{plan::hash(g),
                   mesh_hash(g),
                   model.hw().hash(),
                   std::string(backend),
                   std::string(library_version),
                   std::string(policy),
                   options_hash};
}

} // namespace concerto::cache
