#pragma once
/// @file
/// @brief Internal: the leaves automatic sharding decides and the specs each may take, shared by
/// the search (autoshard/search.hpp) and the exact formulation (autoshard/formulation.hpp).

#include <concerto/graph/lower.hpp>
#include <concerto/graph/respecify.hpp>
#include <concerto/mesh/mesh.hpp>

#include <algorithm>
#include <memory>
#include <string>
#include <vector>

namespace concerto::autoshard::detail {

// The text of a choice, one key per distinct sharding (whatever order its leaves are listed in).
inline std::string key_of(const graph::sharding_choice& c) {
  std::vector<std::string> parts;
  for (const auto& l : c.leaves) parts.push_back(l.leaf + "=" + to_string(l.spec) + " ");
  std::sort(parts.begin(), parts.end());
  std::string k;
  for (const auto& part : parts) k += part;
  if (c.zero_stage.value_or(0) > 0) k.append("ZeRO-").append(std::to_string(*c.zero_stage)).append(" over ").append(c.zero_axis);
  return k;
}

// Every ZeRO choice over `axes`: none, then stages 1-3 over each axis (what the search, the
// exhaustive enumeration and the exact formulation each go through).
inline std::vector<graph::sharding_choice> zero_choices(const std::vector<ir::mesh_axis>& axes) {
  std::vector<graph::sharding_choice> out{{.zero_stage = 0}};
  for (int stage = 1; stage <= 3; ++stage)
    for (const auto& a : axes) out.push_back({.zero_stage = stage, .zero_axis = a.name});
  return out;
}

// `v` indexed by `axes`, false when it names an axis the table lacks (the table stays as it is).
inline bool to_known_pspec(const spec_value& v, const axis_table& axes, pspec& out) {
  axis_table t = axes;
  return to_pspec(v, t, out) && t.count == axes.count;
}

// The mesh axes worth splitting over (size > 1), in the mesh's order.
inline std::vector<ir::mesh_axis> split_axes(const mesh& m) {
  std::vector<ir::mesh_axis> out;
  for (const auto& a : m.axes())
    if (a.size > 1) out.push_back(a);
  return out;
}

// One leaf the search decides: its written spec (free dims replicated), which dims are free, its
// kind and extents.
struct free_leaf {
  std::string name;
  spec_value written;
  std::uint8_t free = 0; // bit per dim written auto_
  op_code kind = op_code::param;
  std::vector<std::int64_t> extents; // empty when the shapes do not give it
  int raw = -1;                      // its node in program::raw
  [[nodiscard]] bool is_free(int d) const noexcept { return (free >> d & 1u) != 0; }
  /// Whether dim d splits evenly into `parts` (true when the shapes do not give its extents).
  [[nodiscard]] bool divides(int d, std::int64_t parts) const noexcept {
    return extents.size() != static_cast<std::size_t>(written.rank) || extents[static_cast<std::size_t>(d)] % parts == 0;
  }
};

// Every spec the leaf's free dims can take: each free dim replicated or split over one or two
// axes the spec does not use yet, the product of their sizes dividing the dim's extent.
inline std::vector<spec_value> leaf_specs(const free_leaf& l, const std::vector<ir::mesh_axis>& axes) {
  std::vector<spec_value> out;
  const auto uses = [](const spec_value& s, const std::string& a) {
    for (int d = 0; d < s.rank; ++d)
      for (const auto& x : s.dims[d])
        if (x.view() == a) return true;
    return false;
  };
  const auto grow = [&](auto&& self, spec_value s, int d) -> void {
    if (d == s.rank) {
      out.push_back(s);
      return;
    }
    if (!l.is_free(d)) return self(self, s, d + 1);
    self(self, s, d + 1); // replicated
    for (const auto& a : axes) {
      if (uses(s, a.name) || !l.divides(d, a.size)) continue;
      spec_value one = s;
      one.dims[d][0] = axis_name(a.name);
      self(self, one, d + 1);
      for (const auto& b : axes) {
        if (b.name == a.name || uses(one, b.name) || !l.divides(d, std::int64_t{a.size} * b.size)) continue;
        spec_value two = one;
        two.dims[d][1] = axis_name(b.name);
        self(self, two, d + 1);
      }
    }
  };
  grow(grow, l.written, 0);
  return out;
}

// Global shapes of the traced nodes (program::raw), by the lowering's shape rules.
template <std::size_t N>
std::vector<std::vector<std::int64_t>> raw_shapes(const graph::program<N>& p, const shape_map& shapes, const lower_options& lo) {
  auto traced = std::make_unique<graph::program<N>>(p);
  std::copy(std::begin(p.raw), std::end(p.raw), std::begin(traced->nodes));
  traced->size = p.raw_size;
  std::vector<std::vector<std::int64_t>> global(static_cast<std::size_t>(p.raw_size));
  for (int i = 0; i < p.raw_size; ++i) {
    const auto& x = p.raw[i];
    auto& out = global[static_cast<std::size_t>(i)];
    if (graph::is_leaf(x.op)) out = graph::detail::leaf_shape(*traced, i, shapes);
    else if (x.op == op_code::to || x.op == op_code::repeat_in || x.op == op_code::repeat_out)
      out = global[static_cast<std::size_t>(x.in[0])];
    else out = graph::detail::op_shape(*traced, i, global, lo);
  }
  return global;
}

// The leaves and `.to(...)`s written with auto_ (a redistribution named by
// graph::redistribution_name), with their extents from `global` (raw_shapes).
template <std::size_t N>
std::vector<free_leaf> free_leaves(const graph::program<N>& p, const shape_map& shapes, const std::vector<std::vector<std::int64_t>>& global) {
  std::vector<free_leaf> out;
  for (int i = 0; i < p.raw_size; ++i) {
    const auto& x = p.raw[i];
    const bool leaf = graph::is_leaf(x.op) && p.free_dims[x.name] != 0;
    if (!leaf && !(x.op == op_code::to && x.free != 0)) continue;
    free_leaf l;
    l.name = leaf ? std::string(p.names[x.name].view()) : graph::redistribution_name(i);
    l.written = to_value(leaf && x.zero_dim < 0 ? x.spec : x.use, p.axes); // a ZeRO-3 leaf's spec as written
    l.free = leaf ? p.free_dims[x.name] : x.free;
    l.kind = x.op;
    l.raw = i;
    l.extents = global[static_cast<std::size_t>(i)];
    if (const auto it = shapes.find(l.name); leaf && l.extents.empty() && it != shapes.end()) l.extents = it->second;
    out.push_back(std::move(l));
  }
  return out;
}
// The same with the shapes of the traced nodes worked out; a program with a shape missing gives
// its leaves no extents (the lowering names what is missing).
template <std::size_t N>
std::vector<free_leaf> free_leaves(const graph::program<N>& p, const shape_map& shapes, const lower_options& lo) {
  std::vector<std::vector<std::int64_t>> global;
  try {
    global = raw_shapes(p, shapes, lo);
  } catch (const error&) {
    global.assign(static_cast<std::size_t>(p.raw_size), {});
  }
  return free_leaves(p, shapes, global);
}

} // namespace concerto::autoshard::detail
