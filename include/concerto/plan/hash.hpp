#pragma once
/// @file
/// @brief Stable hashes of graphs and plans (FNV-1a over a fixed field order, endian-free).
///
/// The plan hash covers what an executor acts on: the whole graph and the per-stream orders.
/// It leaves out the predicted start times and durations, the stats, the policy and preset
/// names: two ranks that computed the same schedule with slightly different floating-point
/// times must agree, and ranks compare hashes before the first step.

#include <concerto/core/hash.hpp>
#include <concerto/ir/graph.hpp>
#include <concerto/plan/plan.hpp>

#include <cstdint>
#include <string>

namespace concerto::plan {

namespace detail {

inline void hash_into(hasher& h, const ir::graph& g) {
  h.add(std::string_view("concerto.graph/1")); // a new field order must change every hash
  h.add(std::string_view(g.name));
  h.add(g.axes.size());
  for (const auto& a : g.axes) h.add(std::string_view(a.name)).add(a.size).add(a.link);
  h.add(g.streams.size());
  for (const auto& s : g.streams) h.add(std::string_view(s.name)).add(s.axis);
  h.add(g.buffers.size());
  for (const auto& b : g.buffers) {
    h.add(b.id).add(std::string_view(b.name)).add(b.bytes).add(b.type).add(b.role).add(b.view_of).add(b.offset);
    h.add(b.shape.size());
    for (const auto e : b.shape) h.add(e);
  }
  h.add(g.tasks.size());
  for (const auto& t : g.tasks) {
    // flops and bytes come from integer shapes, so they are identical on every rank; bytes
    // sizes the collectives' messages.
    h.add(t.id).add(std::string_view(t.name)).add(t.kind).add(t.stream).add(t.flops).add(t.bytes);
    for (const auto* list : {&t.reads, &t.writes, &t.deps}) {
      h.add(list->size());
      for (const auto x : *list) h.add(x);
    }
    h.add(ir::to_string(t.fn));
    h.add(t.attrs.size());
    for (const auto& [k, v] : t.attrs) h.add(std::string_view(k)).add(v);
    h.add(t.axis).add(t.step_phase).add(t.layer);
  }
}

} // namespace detail

/// @brief Stable hash of a graph: the same on every run, machine and build.
[[nodiscard]] inline std::uint64_t hash(const ir::graph& g) {
  hasher h;
  detail::hash_into(h, g);
  return h.value();
}

/// @brief Stable hash of a plan's graph and stream orders (not its times or stats).
/// @code
/// if (plan::hash_hex(mine) != hash_from_rank0) fail("ranks planned different schedules");
/// @endcode
[[nodiscard]] inline std::uint64_t hash(const plan& p) {
  hasher h;
  h.add(std::string_view("concerto.plan/1"));
  detail::hash_into(h, p.graph);
  h.add(p.order.size());
  for (const auto& o : p.order) {
    h.add(o.size());
    for (const auto id : o) h.add(id);
  }
  return h.value();
}

/// @brief hash(p) as 16 lowercase hex digits.
[[nodiscard]] inline std::string hash_hex(const plan& p) { return hasher::to_hex(hash(p)); }

} // namespace concerto::plan
