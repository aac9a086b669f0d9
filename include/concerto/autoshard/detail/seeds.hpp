#pragma once
/// @file
/// @brief Internal: the layouts automatic sharding starts from (autoshard/search.hpp): pure data
/// parallelism, tensor parallelism over one axis with data parallelism over the others (Megatron's
/// column/row pairing read from the program's data flow), and each with ZeRO-3.
/// Include <concerto/autoshard/search.hpp> instead.

#include <string>
#include <vector>

namespace concerto::autoshard::detail {

// The raw node a value comes from, looking through explicit redistributions (`.to`).
template <std::size_t N>
int through_to(const graph::program<N>& p, int r) {
  while (r >= 0 && p.raw[r].op == op_code::to) r = p.raw[r].in[0];
  return r;
}

// Per raw node, how many weight products (matmuls whose second operand is a parameter) the value
// went through, counted from its repeated block's input: Megatron's pairing splits a weight on its
// output dimension when its matmul reads an even count (column-parallel, its output stays split)
// and on its input dimension when odd (row-parallel, it consumes that split), so that each pair
// needs one sum.
template <std::size_t N>
std::vector<int> weight_products(const graph::program<N>& p) {
  std::vector<int> depth(static_cast<std::size_t>(p.raw_size), 0);
  for (int r = 0; r < p.raw_size; ++r) {
    const auto& x = p.raw[r];
    if (x.op == op_code::repeat_in) continue; // a block counts from its own input
    int d = 0;
    for (int k = 0; k < x.n_in; ++k) d = std::max(d, depth[static_cast<std::size_t>(x.in[k])]);
    const bool weight_product = x.op == op_code::matmul && x.n_in == 2 && p.raw[through_to(p, x.in[1])].op == op_code::param;
    depth[static_cast<std::size_t>(r)] = d + (weight_product ? 1 : 0);
  }
  return depth;
}

// The split axes that divide `extent` (in the mesh's order, at most two): the batch split of pure
// data parallelism.
inline std::vector<std::string> dividing_axes(const std::vector<ir::mesh_axis>& axes, std::int64_t extent,
                                              const std::string& except = {}) {
  std::vector<std::string> out;
  std::int64_t parts = 1;
  for (const auto& a : axes) {
    if (a.name == except || out.size() == max_dim_axes) continue;
    if (extent > 0 && extent % (parts * a.size) != 0) continue;
    parts *= a.size;
    out.push_back(a.name);
  }
  return out;
}

inline spec_value batch_split(const free_leaf& l, const std::vector<ir::mesh_axis>& axes, const std::string& except) {
  spec_value s = l.written;
  // A leaf of rank 1 is not a batch ([seq] positions, a [classes] weight vector).
  if (!l.is_free(0) || l.written.rank < 2) return s;
  const auto split = dividing_axes(axes, l.extents.empty() ? 0 : l.extents[0], except);
  for (std::size_t i = 0; i < split.size(); ++i) s.dims[0][i] = axis_name(split[i]);
  return s;
}

// Data parallelism over every split axis but `tensor_axis` (none: all of them); with a tensor axis,
// the weights of products split Megatron's way over it and embedding tables on their rows.
template <std::size_t N>
graph::sharding_choice layout_seed(const graph::program<N>& p, const std::vector<free_leaf>& leaves,
                                   const std::vector<ir::mesh_axis>& axes, const std::string& tensor_axis) {
  graph::sharding_choice c;
  const auto depth = weight_products(p);
  for (const auto& l : leaves) {
    spec_value s = l.written;
    if (l.kind == op_code::input || l.kind == op_code::data) s = batch_split(l, axes, tensor_axis);
    if (l.kind == op_code::param && !tensor_axis.empty()) {
      int dim = -1;
      for (int r = 0; r < p.raw_size && dim < 0; ++r) {
        const auto& x = p.raw[r];
        if (x.n_in < 2 || through_to(p, x.in[1]) != l.raw) continue;
        if (x.op == op_code::matmul && l.written.rank >= 2)
          dim = depth[static_cast<std::size_t>(x.in[0])] % 2 == 0 ? l.written.rank - 1 : l.written.rank - 2;
        else if (x.op == op_code::embedding) dim = 0;
      }
      std::int64_t size = 1;
      for (const auto& a : axes)
        if (a.name == tensor_axis) size = a.size;
      const bool divides = l.extents.size() != static_cast<std::size_t>(l.written.rank) ||
                           (dim >= 0 && l.extents[static_cast<std::size_t>(dim)] % size == 0);
      if (dim >= 0 && l.is_free(dim) && divides) s.dims[dim][0] = axis_name(tensor_axis);
    }
    c.leaves.push_back({l.name, s});
  }
  return c;
}

// The seeds: pure DP, then TP over each split axis with DP over the others; with ZeRO decided,
// each also with ZeRO-3 over its first data axis.
template <std::size_t N>
std::vector<named_choice> standard_seeds(const graph::program<N>& p, const std::vector<free_leaf>& leaves,
                                         const std::vector<ir::mesh_axis>& axes, bool decide_zero) {
  std::vector<named_choice> out;
  const auto data_axes = [&](const std::string& tensor) {
    std::string text;
    for (const auto& a : axes)
      if (a.name != tensor) text += (text.empty() ? "" : ",") + a.name;
    return text;
  };
  const auto add = [&](std::string origin, graph::sharding_choice c, const std::string& tensor) {
    std::string zero_axis;
    for (const auto& a : axes)
      if (a.name != tensor && zero_axis.empty()) zero_axis = a.name;
    if (decide_zero) c.zero_stage = 0;
    out.push_back({origin, c});
    if (decide_zero && !zero_axis.empty()) {
      c.zero_stage = 3;
      c.zero_axis = zero_axis;
      out.push_back({origin + " + ZeRO-3 over " + zero_axis, c});
    }
  };
  add("pure DP over " + data_axes({}), layout_seed(p, leaves, axes, {}), {});
  for (const auto& a : axes) {
    const auto rest = data_axes(a.name);
    add("TP over " + a.name + (rest.empty() ? "" : ", DP over " + rest), layout_seed(p, leaves, axes, a.name), a.name);
  }
  return out;
}

} // namespace concerto::autoshard::detail
