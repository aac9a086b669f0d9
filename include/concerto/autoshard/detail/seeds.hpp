#pragma once
/// @file
/// @brief Internal: the layouts automatic sharding starts from (autoshard/search.hpp): pure data
/// parallelism, tensor parallelism over one axis with data parallelism over the others (Megatron's
/// column/row pairing read from the program's data flow), and each with ZeRO-3.
/// Include <concerto/autoshard/search.hpp> instead.

#include <algorithm>
#include <string>
#include <vector>

namespace concerto::autoshard::detail {

// The raw node a value comes from, looking through explicit redistributions (`.to`).
template <std::size_t N>
int through_to(const graph::program<N>& p, int r) {
  while (r >= 0 && p.raw[r].op == op_code::to) r = p.raw[r].in[0];
  return r;
}

// Whether raw node r's value is a mixture of experts' router logits (read by moe_route).
template <std::size_t N>
bool routes(const graph::program<N>& p, int r) {
  for (int i = r + 1; i < p.raw_size; ++i)
    if (p.raw[i].op == op_code::moe_route && through_to(p, p.raw[i].in[0]) == r) return true;
  return false;
}

// Per raw node, how many weight products (matmuls whose second operand is a parameter; a
// router's is none: its logits stay whole) the value went through, counted from its repeated
// block's input: Megatron's pairing splits a weight on its output dimension when its matmul reads
// an even count (column-parallel, its output stays split) and on its input dimension when odd
// (row-parallel, it consumes that split), so that each pair needs one sum.
template <std::size_t N>
std::vector<int> weight_products(const graph::program<N>& p) {
  std::vector<int> depth(static_cast<std::size_t>(p.raw_size), 0);
  for (int r = 0; r < p.raw_size; ++r) {
    const auto& x = p.raw[r];
    if (x.op == op_code::repeat_in) continue; // a block counts from its own input
    int d = 0;
    for (int k = 0; k < x.n_in; ++k) d = std::max(d, depth[static_cast<std::size_t>(x.in[k])]);
    const bool weight_product =
        x.op == op_code::matmul && x.n_in == 2 && p.raw[through_to(p, x.in[1])].op == op_code::param && !routes(p, r);
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
    if (l.kind == op_code::to) continue; // open: it keeps the layout the seed's leaves give its value
    spec_value s = l.written;
    if (l.kind == op_code::input || l.kind == op_code::data) s = batch_split(l, axes, tensor_axis);
    if (l.kind == op_code::param && !tensor_axis.empty()) {
      int dim = -1;
      for (int r = 0; r < p.raw_size && dim < 0; ++r) {
        const auto& x = p.raw[r];
        if (x.n_in < 2 || through_to(p, x.in[1]) != l.raw || routes(p, r)) continue; // a router's logits stay whole
        if (x.op == op_code::matmul && l.written.rank >= 2)
          dim = depth[static_cast<std::size_t>(x.in[0])] % 2 == 0 ? l.written.rank - 1 : l.written.rank - 2;
        else if (x.op == op_code::embedding) dim = 0;
      }
      std::int64_t size = 1;
      for (const auto& a : axes)
        if (a.name == tensor_axis) size = a.size;
      if (dim >= 0 && l.is_free(dim) && l.divides(dim, size)) s.dims[dim][0] = axis_name(tensor_axis);
    }
    c.leaves.push_back({l.name, s});
  }
  return c;
}

// Megatron's sequence parallelism over `tensor_axis` on top of its tensor parallelism: each
// `.to` written with auto_ lays its value's rows over the data axes and its sequence (the first
// free dim after the batch, not the last: that is the width) over the tensor axis; a value of
// rank 2 (tokens flattened) splits its rows over both. Empty when the program has no such `.to`.
template <std::size_t N>
graph::sharding_choice sequence_parallel(const graph::program<N>& p, graph::sharding_choice c, const std::vector<free_leaf>& leaves,
                                         const std::vector<ir::mesh_axis>& axes, const ir::mesh_axis& tensor_axis) {
  bool any = false;
  for (const auto& l : leaves) {
    // The tokens dispatched to experts are no sequence: their layout stays open.
    if (l.kind != op_code::to || p.raw[p.raw[l.raw].in[0]].op == op_code::moe_dispatch) continue;
    spec_value s = batch_split(l, axes, tensor_axis.name);
    int d = 1;
    while (d < s.rank - 1 && !(l.is_free(d) && l.divides(d, tensor_axis.size))) ++d;
    if (d < s.rank - 1) s.dims[d][0] = axis_name(tensor_axis.name);
    else if (s.rank == 2 && l.is_free(0) && s.dims[0][max_dim_axes - 1].empty()) {
      std::int64_t parts = tensor_axis.size;
      for (const auto& a : axes)
        for (const auto& x : s.dims[0])
          if (x.view() == a.name) parts *= a.size;
      if (!l.divides(0, parts)) continue;
      int k = 0;
      while (!s.dims[0][k].empty()) ++k;
      s.dims[0][k] = axis_name(tensor_axis.name);
    } else {
      continue;
    }
    c.leaves.push_back({l.name, s});
    any = true;
  }
  return any ? c : graph::sharding_choice{};
}

// Expert parallelism over `expert_axis` on top of data parallelism over every axis: the tokens
// dispatched to experts (a `.to` written with auto_ after moe_dispatch) laid out by expert over it
// and by slot over the other axes, each rank-3 weight (a batch of experts) split by expert over
// it. Empty when the program dispatches no tokens to such a `.to`.
template <std::size_t N>
graph::sharding_choice expert_parallel(const graph::program<N>& p, graph::sharding_choice c, const std::vector<free_leaf>& leaves,
                                       const ir::mesh_axis& expert_axis) {
  // The tokens' batch split (with the expert axis its major one, the compiler refuses the seed: an
  // all-to-all moves only a dimension's minor axis to another dimension).
  axis_name token_axes[max_dim_axes]{};
  for (const auto& l : leaves)
    if ((l.kind == op_code::data || l.kind == op_code::input) && l.written.rank >= 2)
      for (const auto& x : c.leaves)
        if (x.leaf == l.name && !x.spec.dims[0][0].empty()) std::copy(std::begin(x.spec.dims[0]), std::end(x.spec.dims[0]), token_axes);
  bool any = false;
  for (const auto& l : leaves) {
    const bool experts_in = l.kind == op_code::to && p.raw[p.raw[l.raw].in[0]].op == op_code::moe_dispatch;
    const bool experts_weight = l.kind == op_code::param && l.written.rank == 3;
    if (!(experts_in || experts_weight) || !l.is_free(0) || !l.divides(0, expert_axis.size)) continue;
    spec_value s = l.written;
    s.dims[0][0] = axis_name(expert_axis.name);
    if (experts_in && l.is_free(1)) { // the slots over the axes the tokens' batch is split over, but the experts'
      int k = 0;
      for (const auto& a : token_axes)
        if (a.view() != expert_axis.name && !a.empty()) s.dims[1][k++] = a;
    }
    const auto it = std::find_if(c.leaves.begin(), c.leaves.end(), [&](const auto& x) { return x.leaf == l.name; });
    if (it == c.leaves.end()) c.leaves.push_back({l.name, s});
    else it->spec = s;
    any = any || experts_in;
  }
  return any ? c : graph::sharding_choice{};
}

// The seeds: pure DP, then TP over each split axis with DP over the others and, where the
// program has `.to`s written with auto_, the same with sequence parallelism, and DP with the
// experts over each axis; with ZeRO decided, each also with ZeRO-3 over its first data axis.
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
  const auto data_parallel = layout_seed(p, leaves, axes, {});
  add("pure DP over " + data_axes({}), data_parallel, {});
  for (const auto& a : axes)
    if (auto ep = expert_parallel(p, data_parallel, leaves, a); !ep.leaves.empty())
      add("EP over " + a.name + ", DP over " + data_axes({}), std::move(ep), a.name);
  for (const auto& a : axes) {
    const auto rest = data_axes(a.name);
    const auto tensor = layout_seed(p, leaves, axes, a.name);
    const std::string origin = "TP over " + a.name + (rest.empty() ? "" : ", DP over " + rest);
    add(origin, tensor, a.name);
    if (auto sp = sequence_parallel(p, tensor, leaves, axes, a); !sp.leaves.empty()) add(origin + ", SP", std::move(sp), a.name);
  }
  return out;
}

} // namespace concerto::autoshard::detail
