#pragma once
/// @file
/// @brief Lowering: a compiled program + the global shapes of its leaves + a bound mesh ->
/// the ir::graph every rank executes (local shapes, kernels with their `fn` and attributes,
/// collectives on their axis's lane, phase stamps). The `fn` and attributes of every task are
/// listed in docs/dsl-reference.md; the executors implement exactly those.
///
/// @code
/// auto m = mesh::from_world(4, {{"dp", 2}, {"tp", 2}});
/// ir::graph g = lower(step, {{"x", {64, 512}}, {"target", {64, 512}}, {"w1", {512, 2048}}, {"w2", {2048, 512}}}, m);
/// @endcode

#include <concerto/graph/program.hpp>
#include <concerto/ir/builder.hpp>
#include <concerto/ir/dead_tasks.hpp>
#include <concerto/ir/precision.hpp>
#include <concerto/mesh/mesh.hpp>

#include <algorithm>
#include <cmath>
#include <functional>
#include <map>
#include <memory>
#include <numeric>
#include <string>
#include <vector>

namespace concerto {

/// @brief Global shapes of the leaves, by leaf name.
using shape_map = std::map<std::string, std::vector<std::int64_t>>;

/// @brief What lowering needs besides shapes and the mesh.
struct lower_options {
  std::string name = "step";
  std::int64_t heads = 1; ///< attention (query) heads over the whole model; head_dim = q's width / heads
  std::int64_t rope_theta = 10000; ///< the base of rope's angles (Llama 2: 10000, Llama 3: 500000)
  /// How values are stored and moved (ir/precision.hpp; train::step_options::precision sets it):
  /// f32 throughout, or a bf16 or f16 working precision beside f32 master parameters. The lowering
  /// makes f32 buffers; the policy's pass retypes them and adds the casts. With the policy's
  /// loss scaling it makes `ir::loss_scale_buffer`, which the loss gradients and the updates read,
  /// and the global gradient norm's tasks (as for clipping), whose sum says whether a step overflowed.
  ir::precision_policy precision = {};
  /// Depth of each `repeat<"name">` of the program, by name: its block is emitted that many times.
  std::map<std::string, int> depth = {};
  /// Global-norm gradient clipping (train::optimizer_settings::clip_norm sets it): tasks that sum
  /// the squared norm of every gradient over every rank before the first update, which each
  /// update reads (`grad_norm_sq`).
  bool clip_gradients = false;
  /// The mesh axis a pipelined step splits the layers over, if any: each stage holds only its own
  /// parameters, so no gradient is held twice along it.
  std::string pipeline_axis = {};
  /// The forward pass alone, up to the loss (evaluation: train::basic_step::evaluate): no
  /// gradient, no update.
  bool forward_only = false;
};

namespace graph::detail {

inline std::string dims_text(const std::vector<std::int64_t>& s) {
  std::string out = "[";
  for (std::size_t i = 0; i < s.size(); ++i) {
    if (i) out += ',';
    out += std::to_string(s[i]);
  }
  out += ']';
  return out;
}
inline std::int64_t elements(const std::vector<std::int64_t>& s) {
  return std::accumulate(s.begin(), s.end(), std::int64_t{1}, std::multiplies<>{});
}

using extents = std::vector<std::int64_t>;

// ---- 1. shape inference: global shapes, leaves from the map, ops by their rule ----------------------

template <std::size_t N>
extents leaf_shape(const program<N>& p, int i, const shape_map& shapes) {
  const node& x = p.nodes[i];
  const auto name = p.name_of(i);
  const auto it = shapes.find(name);
  if (it == shapes.end()) fail("no shape given for leaf '" + name + "'; add it to the shape map");
  if (static_cast<int>(it->second.size()) != x.spec.rank)
    fail("leaf '" + name + "' has shape " + dims_text(it->second) + " of rank " + std::to_string(it->second.size()) +
         " but its spec " + to_string(p.spec_at(i)) + " has rank " + std::to_string(x.spec.rank));
  for (auto d : it->second)
    if (d < 1) fail("leaf '" + name + "' has shape " + dims_text(it->second) + " with a non-positive extent");
  return it->second;
}

// The moe_route whose gates node j is (through redistributions).
template <std::size_t N>
int route_of(const program<N>& p, int j) {
  while (is_redistribution(p.nodes[j].op)) j = p.nodes[j].in[0];
  if (p.nodes[j].op != op_code::moe_route)
    fail(p.describe(j) + ": the gates of an MoE op must come from moe_route"); // the compiler refuses it first
  return j;
}
// Slots per expert and group of a routing with these settings over logits [groups, tokens, experts]:
// ⌈top_k · tokens · capacity_factor / experts⌉, at least 1 and at most the group's tokens.
inline std::int64_t moe_capacity(const moe_config& c, const extents& logits) {
  const auto tokens = logits[1], experts = logits[2];
  const auto even = static_cast<double>(c.top_k) * static_cast<double>(tokens) * c.capacity_factor / static_cast<double>(experts);
  return std::clamp<std::int64_t>(static_cast<std::int64_t>(std::ceil(even - 1e-9)), 1, tokens);
}

// Node j as a message names an operand: 'name' [dims].
template <std::size_t N>
std::string operand_text(const program<N>& p, const std::vector<extents>& global, int j) {
  std::string text = "'"; // built by appending: g++ 12 warns (-Wrestrict) on "'" + std::string&&
  text.append(p.name_of(j)).append("' ").append(dims_text(global[static_cast<std::size_t>(j)]));
  return text;
}

// The shape of attention node i (q's), checked against k, v and the heads.
template <std::size_t N>
extents attention_shape(const program<N>& p, int i, const std::vector<extents>& global, const lower_options& options) {
  const node& x = p.nodes[i];
  const auto in = [&](int k) -> const extents& { return global[static_cast<std::size_t>(x.in[k])]; };
  const auto what = [&] { return p.describe(i); };
  const auto& q = in(0);
  if (in(1) != in(2) || !std::equal(q.begin(), q.end() - 1, in(1).begin()))
    fail(what() + ": k " + dims_text(in(1)) + " and v " + dims_text(in(2)) + " must have one shape, and q's " +
         dims_text(q) + " but for the last dimension");
  if (options.heads < 1)
    fail(what() + ": " + std::to_string(options.heads) + " heads; attention needs at least one (lower_options::heads)");
  if (q.back() % options.heads != 0)
    fail(what() + ": hidden size " + std::to_string(q.back()) + " is not divisible by " + std::to_string(options.heads) +
         " heads");
  const auto head_dim = q.back() / options.heads;
  if (in(1).back() < head_dim || in(1).back() % head_dim != 0 || options.heads % (in(1).back() / head_dim) != 0)
    fail(what() + ": k and v hold " + std::to_string(in(1).back()) + " values per token, not a number of heads of " +
         std::to_string(head_dim) + " (" + std::to_string(q.back()) + " / " + std::to_string(options.heads) +
         " heads) that divides the " + std::to_string(options.heads) + " query heads");
  return q;
}

// The shape of moe_dispatch / moe_combine node i, checked against its gates.
template <std::size_t N>
extents moe_shape(const program<N>& p, int i, const std::vector<extents>& global) {
  const node& x = p.nodes[i];
  const auto in = [&](int k) -> const extents& { return global[static_cast<std::size_t>(x.in[k])]; };
  const auto what = [&] { return p.describe(i); };
  const auto operand = [&](int k) { return operand_text(p, global, x.in[k]); };
  const auto& gates = in(1);
  const auto capacity = moe_capacity(p.nodes[route_of(p, x.in[1])].moe, gates);
  if (x.op == op_code::moe_dispatch) {
    if (in(0)[0] != gates[0] || in(0)[1] != gates[1])
      fail(what() + ": the tokens " + operand(0) + " and the gates " + operand(1) + " differ in groups or tokens");
    return {gates[2], gates[0] * capacity, in(0)[2]};
  }
  if (in(0)[0] != gates[2] || in(0)[1] != gates[0] * capacity)
    fail(what() + ": the experts' output " + operand(0) + " is not [experts, groups·capacity, h] = [" +
         std::to_string(gates[2]) + ", " + std::to_string(gates[0] * capacity) + ", h] for the gates " + operand(1));
  return {gates[0], gates[1], in(0)[2]};
}

// The shape of conv2d / max_pool / avg_pool node i, checked: the image's windows.
template <std::size_t N>
extents window_shape(const program<N>& p, int i, const std::vector<extents>& global) {
  const node& x = p.nodes[i];
  const auto in = [&](int k) -> const extents& { return global[static_cast<std::size_t>(x.in[k])]; };
  const auto what = [&] { return p.describe(i); };
  const auto operand = [&](int k) { return operand_text(p, global, x.in[k]); };
  if (x.op == op_code::conv2d) {
    const auto &img = in(0), &w = in(1);
    if (w[2] != img[3])
      fail(what() + ": the kernel " + operand(1) + " [kernel_h, kernel_w, in, out] takes " + std::to_string(w[2]) +
           " input channels, the image " + operand(0) + " [batch, height, width, in] has " + std::to_string(img[3]));
    const auto side = [&](std::int64_t extent, std::int64_t kernel, const char* dim) {
      const auto out = ir::conv_geometry::output_extent(extent, kernel, x.conv.stride, x.conv.padding);
      if (out < 1)
        fail(what() + ": a kernel of " + std::to_string(kernel) + " does not fit the image's " + dim + " of " +
             std::to_string(extent) + " with padding " + std::to_string(x.conv.padding) +
             "; pad the image (conv_config::padding) or use a smaller kernel");
      return out;
    };
    return {img[0], side(img[1], w[0], "height"), side(img[2], w[1], "width"), w[3]};
  }
  const auto& img = in(0);
  const auto side = [&](std::int64_t extent, const char* dim) {
    const auto out = ir::conv_geometry::output_extent(extent, x.window, x.conv.stride, x.conv.padding);
    if (out < 1)
      fail(what() + ": a window of " + std::to_string(x.window) + " does not fit the image's " + dim + " of " +
           std::to_string(extent) + " with padding " + std::to_string(x.conv.padding) +
           "; pool a larger image or use a smaller window (pool_config::window)");
    return out;
  };
  return {img[0], side(img[1], "height"), side(img[2], "width"), img[3]};
}

// The shape of concat_dim / slice_dim node i, checked: the parts of one dim.
template <std::size_t N>
extents parts_shape(const program<N>& p, int i, const std::vector<extents>& global) {
  const node& x = p.nodes[i];
  const auto in = [&](int k) -> const extents& { return global[static_cast<std::size_t>(x.in[k])]; };
  const auto what = [&] { return p.describe(i); };
  const auto operand = [&](int k) { return operand_text(p, global, x.in[k]); };
  if (x.op == op_code::slice_dim) {
    const auto d = static_cast<std::size_t>(x.part.dim);
    if (x.part.end > in(0)[d])
      fail(what() + ": positions [" + std::to_string(x.part.begin) + ", " + std::to_string(x.part.end) + ") run past dim " +
           std::to_string(d) + " of " + operand(0) + "; slice<Dim, Begin, End> needs End <= " + std::to_string(in(0)[d]));
    auto out = in(0);
    out[d] = x.part.end - x.part.begin;
    return out;
  }
  // concat_dim: equal dims but the joined one; a lower-rank operand is like the other's last dims.
  const bool a_full = in(0).size() >= in(1).size();
  const auto &full = in(a_full ? 0 : 1), &table = in(a_full ? 1 : 0);
  const auto skip = full.size() - table.size(), d = static_cast<std::size_t>(x.dims.first);
  for (std::size_t k = 0; k < table.size(); ++k)
    if (k + skip != d && table[k] != full[k + skip])
      fail(what() + ": " + operand(0) + " and " + operand(1) + " differ in dim " + std::to_string(k + skip) +
           " (only the joined dim " + std::to_string(d) + " may; an operand of lower rank is the other's last dims)");
  auto out = full;
  out[d] += table[d - skip];
  return out;
}

// The shape of node i from its operands' (`global`), checked; messages show the op as written.
// Each sharding rule has its shape rule: the op's table entry decides which applies.
template <std::size_t N>
extents op_shape(const program<N>& p, int i, const std::vector<extents>& global, const lower_options& options) {
  const node& x = p.nodes[i];
  const auto in = [&](int k) -> const extents& { return global[static_cast<std::size_t>(x.in[k])]; };
  const auto what = [&] { return p.describe(i); };
  const auto operand = [&](int k) { return operand_text(p, global, x.in[k]); };
  switch (ir::info(x.op).rule) {
  case ir::sharding::contract: {
    const auto &a = in(0), &b = in(1);
    if (a.back() != b[b.size() - 2]) fail(what() + ": contracted sizes differ, " + operand(0) + " and " + operand(1));
    if (b.size() == a.size() && !std::equal(a.begin(), a.end() - 2, b.begin()))
      fail(what() + ": batch dimensions differ, " + dims_text(a) + " and " + dims_text(b));
    auto out = a;
    out.back() = b.back();
    return out;
  }
  case ir::sharding::unify:
  case ir::sharding::pointwise_two:
    if (in(0) != in(1)) fail(what() + ": shapes differ, " + operand(0) + " and " + operand(1));
    return in(0);
  case ir::sharding::pointwise:
  case ir::sharding::linear: return in(0);
  case ir::sharding::rope:
    if (in(1).size() + 1 != in(0).size() || !std::equal(in(1).begin(), in(1).end(), in(0).begin()))
      fail(what() + ": positions " + operand(1) + " do not match the leading dimensions of " + operand(0));
    return in(0);
  case ir::sharding::bias:
    if (in(1).size() > in(0).size() || !std::equal(in(1).begin(), in(1).end(), in(0).end() - static_cast<std::ptrdiff_t>(in(1).size())))
      fail(what() + ": '" + p.name_of(x.in[1]) + "' " + dims_text(in(1)) + " is not the shape of the last dims of " + operand(0) +
           ", which it is " + (x.op == op_code::scale_table ? "multiplied" : "added") + " to (broadcast over the others)");
    return in(0);
  case ir::sharding::batchnorm: // x, its scale (whose gamma batchnorm_scale checked), beta
    if (in(2).size() != 1 || in(2)[0] != in(0).back())
      fail(what() + ": the shift '" + p.name_of(x.in[2]) + "' " + dims_text(in(2)) +
           " must hold one value per channel, the last dim of " + operand(0));
    return in(0);
  case ir::sharding::merge: {
    auto out = in(0);
    const auto first = out.begin() + x.dims.first, last = out.begin() + x.dims.last + 1;
    *first = std::accumulate(first, last, std::int64_t{1}, std::multiplies<>{});
    out.erase(first + 1, last);
    return out;
  }
  case ir::sharding::unmerge: {
    auto out = in(0);
    const auto d = static_cast<std::size_t>(x.dims.first);
    if (out[d] % x.dims.inner != 0)
      fail(what() + ": dim " + std::to_string(d) + " of " + operand(0) + " does not divide into parts of " +
           std::to_string(x.dims.inner) + " (unflatten<Dim, Inner> needs Inner to divide the dim's extent)");
    out[d] /= x.dims.inner;
    out.insert(out.begin() + x.dims.first + 1, x.dims.inner);
    return out;
  }
  case ir::sharding::reduce_dim: {
    auto out = in(0);
    out.erase(out.begin() + x.dims.first);
    return out;
  }
  case ir::sharding::rowwise:
    for (int k = 1; k < x.n_in; ++k)
      if (in(k)[0] != in(0).back())
        fail(what() + ": '" + p.name_of(x.in[k]) + "' has " + std::to_string(in(k)[0]) + " entries but the last dimension of '" +
             p.name_of(x.in[0]) + "' is " + std::to_string(in(0).back()));
    return in(0);
  case ir::sharding::attention: return attention_shape(p, i, global, options);
  case ir::sharding::embedding: {
    auto out = in(0);
    out.push_back(in(1)[1]);
    return out;
  }
  case ir::sharding::mse:
    if (in(0) != in(1)) fail(what() + ": prediction " + dims_text(in(0)) + " and target " + dims_text(in(1)) + " differ");
    return {};
  case ir::sharding::cross_entropy:
    if (!std::equal(in(1).begin(), in(1).end(), in(0).begin()))
      fail(what() + ": labels " + dims_text(in(1)) + " do not match logits " + dims_text(in(0)));
    return {};
  case ir::sharding::swap_dims: {
    auto out = in(0);
    std::swap(out[static_cast<std::size_t>(x.dims.first)], out[static_cast<std::size_t>(x.dims.first) + 1]);
    return out;
  }
  case ir::sharding::routing:
    if (x.moe.top_k > in(0)[2])
      fail(what() + ": top_k " + std::to_string(x.moe.top_k) + " is more than the " + std::to_string(in(0)[2]) +
           " experts of " + operand(0) + " (logits [groups, tokens, experts])");
    return in(0);
  case ir::sharding::dispatch:
  case ir::sharding::combine: return moe_shape(p, i, global);
  case ir::sharding::convolution:
  case ir::sharding::pooling: return window_shape(p, i, global);
  case ir::sharding::join:
  case ir::sharding::part: return parts_shape(p, i, global);
  case ir::sharding::none: break;
  }
  // Nodes the compiler makes: a redistribution or a repeat's bound keeps its value's shape; the
  // vocab-parallel cross-entropy's pieces are rows of the logits.
  if (is_redistribution(x.op) || x.op == op_code::repeat_in) return in(0);
  switch (x.op) {
  case op_code::vocab_ce_max:
  case op_code::vocab_ce_sumexp: return extents(in(0).begin(), in(0).end() - 1);
  case op_code::vocab_ce_target:
    if (in(1).size() + 1 != in(0).size() || !std::equal(in(1).begin(), in(1).end(), in(0).begin()))
      fail(what() + ": labels " + dims_text(in(1)) + " do not match logits " + dims_text(in(0)));
    return in(1);
  case op_code::vocab_ce_loss: return {};
  case op_code::batchnorm_stats:
  case op_code::batchnorm_grad_stats: return {2, in(0).back()};
  case op_code::batchnorm_scale:
    if (in(1).size() != 1 || in(1)[0] != in(0).back())
      fail(what() + ": the gain '" + p.name_of(x.in[1]) + "' " + dims_text(in(1)) + " must hold one value per channel (" +
           std::to_string(in(0).back()) + ")");
    return {3, in(0).back()};
  default: fail("lowering: " + what() + " has op '" + std::string(ir::to_string(x.op)) + "', whose shape nothing gives");
  }
}

template <std::size_t N>
std::vector<extents> global_shapes(const program<N>& p, const shape_map& shapes, const lower_options& options) {
  std::vector<extents> global(static_cast<std::size_t>(p.size));
  for (int i = 0; i < p.size; ++i) {
    const node& x = p.nodes[i];
    auto& out = global[static_cast<std::size_t>(i)];
    if (is_leaf(x.op)) out = leaf_shape(p, i, shapes);
    else if (x.of >= 0) out = global[static_cast<std::size_t>(x.of)]; // derived from another value (a gradient, an update)
    else out = op_shape(p, i, global, options);
  }
  return global;
}

// ---- 2. local shapes: each split dimension divided by its mesh axis -------------------------------
//
// A split a ZeRO stage added (graph::node::zero_dim) need not divide: as FSDP2 does, each of the
// P ranks then holds ⌈n/P⌉ rows, the last ranks' rows past n being padding that stays zero (the
// optimizer leaves zeros at zero), and the emitter gathers into, and reduce-scatters from,
// buffers of P·⌈n/P⌉ rows whose first n are the value (see emitter::padded_input). A split the
// user wrote must divide: the program says where its rows go, and padding would change that.

// This rank's shapes, and which dimension an uneven ZeRO split padded.
struct local_layout {
  std::vector<extents> shape; // per node: its buffer's shape (the same on every rank)
  std::vector<int> padded;    // per node: the dimension a ZeRO split padded, -1 if none
};

// The parameter node i's value belongs to (itself, its gradient, its optimizer state, its
// gathered copies), or -1.
template <std::size_t N>
int parameter_of(const program<N>& p, int i) {
  while (p.nodes[i].of >= 0 && p.nodes[i].of != i) i = p.nodes[i].of;
  return p.nodes[i].op == op_code::param ? i : -1;
}

// Whether axis `a` splitting dimension d of node i is the split a ZeRO stage added: its axis,
// as the minor one of the dimension the stage chose for the parameter.
template <std::size_t N>
bool zero_split(const program<N>& p, int i, int d, int a) {
  const int w = parameter_of(p, i);
  const auto& axes = p.nodes[i].spec.dims[d];
  return w >= 0 && a == p.zero_axis && p.nodes[w].zero_dim == d && (axes[1] == a || (axes[1] < 0 && axes[0] == a));
}

// Whether dimension d of node i counts a mixture of experts' experts: the dispatched slots
// [experts, groups·capacity, h] (moe_dispatch's layout, runtime/cpu/moe.hpp), and an expert
// stack [experts, in, out]: a parameter of rank 3 that a product reads.
template <std::size_t N>
bool holds_experts(const program<N>& p, int i, int d) {
  if (d != 0) return false;
  while (is_redistribution(p.nodes[i].op) && p.nodes[i].n_in == 1 && p.nodes[i].name < 0) i = p.nodes[i].in[0];
  if (p.nodes[i].op == op_code::moe_dispatch) return true;
  if (p.nodes[i].op != op_code::param || p.nodes[i].spec.rank != 3) return false;
  for (int j = 0; j < p.size; ++j)
    if (p.nodes[j].op == op_code::matmul && (p.nodes[j].in[0] == i || p.nodes[j].in[1] == i)) return true;
  return false;
}

template <std::size_t N>
local_layout local_shapes(const program<N>& p, const std::vector<extents>& global, const mesh& m,
                          const std::vector<int>& axis_of) {
  local_layout out{global, std::vector<int>(static_cast<std::size_t>(p.size), -1)};
  for (int i = 0; i < p.size; ++i) {
    const pspec& s = p.nodes[i].spec;
    for (int d = 0; d < s.rank; ++d)
      for (auto a : s.dims[d]) {
        if (a < 0) continue;
        const int size = m.axes()[static_cast<std::size_t>(axis_of[static_cast<std::size_t>(a)])].size;
        auto& extent = out.shape[static_cast<std::size_t>(i)][static_cast<std::size_t>(d)];
        if (extent % size == 0) {
          extent /= size;
          continue;
        }
        if (zero_split(p, i, d, a)) {
          extent = (extent + size - 1) / size;
          out.padded[static_cast<std::size_t>(i)] = d;
          continue;
        }
        const int src = is_leaf(p.nodes[i].op) || p.nodes[i].of < 0 ? i : p.nodes[i].of;
        const std::string axis(p.axes.names[a].view());
        if (holds_experts(p, src, d))
          fail("the " + std::to_string(extent) + " experts of " + p.describe(src) + " do not divide over mesh axis '" +
               axis + "' (size " + std::to_string(size) + "); give the layer a multiple of " + std::to_string(size) +
               " experts, or '" + axis + "' a size that divides " + std::to_string(extent));
        // A tensor the user did not name is said as written, not by its generated name alone.
        const auto name = p.name_of(src);
        const auto written = p.describe(src);
        fail("tensor '" + name + "'" + (written != name ? " = " + written : std::string()) + " dimension " +
             std::to_string(d) + " (size " + std::to_string(extent) + ") does not divide over mesh axis '" + axis +
             "' (size " + std::to_string(size) + "); give the dimension a size that divides, give '" + axis +
             "' a size that divides it, or leave the dimension whole in the spec (only a split that ZeRO adds is "
             "padded)");
      }
  }
  return out;
}

// ---- 3. repeats: each stack's depth and the number of its first layer ------------------------------

struct repeat_layout {
  std::vector<int> depth, first_layer;
};

// The depth options give repeat k of p, checked.
template <std::size_t N>
int repeat_depth(const program<N>& p, int k, const lower_options& options) {
  const std::string rname(p.repeats[k].name.view());
  const auto it = options.depth.find(rname);
  if (it == options.depth.end())
    fail("no depth given for repeat '" + rname + "'; pass it as lower_options{.depth = {{\"" + rname + "\", L}}}");
  if (it->second < 1) fail("repeat '" + rname + "' has depth " + std::to_string(it->second) + "; give it at least 1");
  return it->second;
}

template <std::size_t N>
repeat_layout repeat_depths(const program<N>& p, const std::vector<extents>& global, const lower_options& options) {
  const auto repeats = static_cast<std::size_t>(p.repeat_count);
  repeat_layout out{std::vector<int>(repeats), std::vector<int>(repeats)};
  for (const auto& [rname, d] : options.depth)
    if (p.repeat_index(rname) < 0) fail("a depth is given for repeat '" + rname + "', which the program does not have");
  for (std::size_t k = 0, next = 0; k < repeats; ++k) {
    const auto& r = p.repeats[k];
    const std::string rname(r.name.view());
    const int depth = repeat_depth(p, static_cast<int>(k), options);
    if (global[static_cast<std::size_t>(r.out)] != global[static_cast<std::size_t>(r.in)])
      fail("repeat '" + rname + "': the block returns shape " + dims_text(global[static_cast<std::size_t>(r.out)]) +
           " but takes " + dims_text(global[static_cast<std::size_t>(r.in)]) + "; layer i+1 reads layer i's output");
    out.depth[k] = depth;
    out.first_layer[k] = static_cast<int>(next);
    next += static_cast<std::size_t>(depth);
  }
  return out;
}

// ---- 4. emission: buffers, then one task (or view) per node, layer by layer ------------------------

inline ir::buffer_role buffer_role_of(role r) {
  switch (r) {
  case role::input:
  case role::data: return ir::buffer_role::input;
  case role::param:
  case role::update: return ir::buffer_role::param;
  case role::gradient: return ir::buffer_role::gradient;
  case role::state: return ir::buffer_role::optimizer_state;
  default: return ir::buffer_role::activation;
  }
}

template <std::size_t N>
class emitter {
public:
  using attrs = std::map<std::string, std::int64_t>;
  /// Every value the emitter makes is f32; lower_options::precision retypes them afterwards.
  static constexpr ir::dtype value_type = ir::dtype::f32;

  emitter(const program<N>& p, const mesh& m, const lower_options& options, std::vector<int> axis_of,
          std::vector<extents> global, local_layout local, repeat_layout layout)
      : p_(p), m_(m), options_(options), axis_of_(std::move(axis_of)), global_(std::move(global)),
        local_(std::move(local.shape)), padded_(std::move(local.padded)), layout_(std::move(layout)), b_(options.name),
        buf_(static_cast<std::size_t>(p.size), -1), layer_buf_(static_cast<std::size_t>(p.size)),
        want_padded_(static_cast<std::size_t>(p.size)) {
    for (const auto& ax : m.axes()) b_.axis(ax.name, ax.size, ax.link);
    for (int j = 0; j < p.size; ++j)
      if (per_layer(j)) layer_buf_[static_cast<std::size_t>(j)].assign(static_cast<std::size_t>(depth(p.nodes[j].block)), -1);
    plan_padded_roots();
    // Rope rotates heads of the attention's head_dim; a program without attention has none to rotate.
    for (int i = 0; i < p.size; ++i)
      if (p.nodes[i].op == op_code::attention) head_dim_ = global_[static_cast<std::size_t>(p.nodes[i].in[0])].back() / options.heads;
  }

  // Nodes in order; a run of one block's nodes in one phase is emitted once per layer (backward
  // from the last layer down), so the layers chain through repeat_in and grad_in.
  // With clipping or loss scaling, the nodes up to the updates first (the gradients' shards
  // complete), then the global norm, then the updates and what follows them (ZeRO's gathers of
  // the updated shards).
  ir::graph run() && {
    if (!options_.forward_only && options_.precision.loss_scaling)
      loss_scale_ = b_.buffer(std::string(ir::loss_scale_buffer), {1}, ir::buffer_role::optimizer_state, ir::dtype::f32);
    if (options_.forward_only) {
      emit_nodes([&](int j) { return p_.nodes[j].phase == ir::phase::forward; });
    } else if (!options_.clip_gradients && !options_.precision.loss_scaling) {
      emit_nodes([](int) { return true; });
    } else {
      const auto after = after_updates();
      emit_nodes([&](int j) { return !after[static_cast<std::size_t>(j)]; });
      emit_global_grad_norm();
      emit_nodes([&](int j) { return after[static_cast<std::size_t>(j)]; });
    }
    auto g = std::move(b_).finish();
    for (auto& [t, extra] : collective_attrs_)
      for (auto& [key, v] : extra) g.tasks[static_cast<std::size_t>(t)].attrs[key] = v;
    if (options_.forward_only)
      return ir::apply_precision(ir::remove_dead_tasks(g, {buf_[static_cast<std::size_t>(p_.loss)]}), options_.precision);
    // Only what the step exposes is computed: the loss, the leaves' gradients ("x.grad",
    // train::step::gradient) and the parameters and optimizer state (kept by their buffer role).
    // What goes is a repeat's layer-0 input gradient, with its collectives, when the stack's input
    // has none: the block computes its input's gradient for the layer below, which layer 0 lacks.
    std::vector<ir::buffer_id> observed{buf_[static_cast<std::size_t>(p_.loss)]};
    for (int l = 0; l < p_.name_count; ++l) {
      const auto j = p_.grad_of[l];
      if (j < 0) continue;
      if (buf_[static_cast<std::size_t>(j)] >= 0) observed.push_back(buf_[static_cast<std::size_t>(j)]);
      for (auto layer_grad : layer_buf_[static_cast<std::size_t>(j)])
        if (layer_grad >= 0) observed.push_back(layer_grad);
    }
    return ir::apply_precision(ir::remove_dead_tasks(g, observed), options_.precision);
  }

private:
  template <class Want>
  void emit_nodes(const Want& want) {
    for (int i = 0; i < p_.size;) {
      const int k = p_.nodes[i].block;
      if (k < 0) {
        if (want(i)) emit(i);
        ++i;
        continue;
      }
      int end = i;
      while (end < p_.size && p_.nodes[end].block == k && p_.nodes[end].phase == p_.nodes[i].phase) ++end;
      const bool down = p_.nodes[i].phase == ir::phase::backward;
      cur_block_ = k;
      for (int l = 0; l < depth(k); ++l) {
        cur_layer_ = down ? depth(k) - 1 - l : l;
        for (int j = i; j < end; ++j)
          if (want(j)) emit(j);
      }
      cur_block_ = cur_layer_ = -1;
      i = end;
    }
  }

  // ---- global-norm clipping ----
  [[nodiscard]] static bool is_update(const node& x) { return ir::info(x.op).form == ir::task_form::update; }
  // The updates and every node that reads one (nodes are in dependency order).
  [[nodiscard]] std::vector<bool> after_updates() const {
    std::vector<bool> after(static_cast<std::size_t>(p_.size), false);
    for (int i = 0; i < p_.size; ++i) {
      const node& x = p_.nodes[i];
      bool a = is_update(x);
      for (int k = 0; k < x.n_in && !a; ++k) a = x.in[k] >= 0 && after[static_cast<std::size_t>(x.in[k])];
      after[static_cast<std::size_t>(i)] = a;
    }
    return after;
  }
  // The ranks holding the same values of node j's shard: the product of the mesh axes that
  // neither split it nor (the pipeline's) hold other parameters.
  [[nodiscard]] std::int64_t replicas_of(int j) const {
    const pspec& spec = p_.nodes[j].spec;
    std::int64_t r = 1;
    for (std::size_t a = 0; a < m_.axes().size(); ++a) {
      const auto& axis = m_.axes()[a];
      if (axis.name == options_.pipeline_axis) continue;
      int state = state_replicated;
      for (std::size_t pa = 0; pa < axis_of_.size(); ++pa)
        if (axis_of_[pa] == static_cast<int>(a)) state = spec.state(static_cast<int>(pa));
      if (state == state_partial)
        fail("global-norm clipping: the gradient '" + p_.name_of(j) + "' an update reads is still a pending sum over '" +
             axis.name + "'");
      if (state == state_replicated) r *= axis.size;
    }
    return r;
  }
  // Each update's gradient shard: Σ g² / replicas into its own slot of one buffer (so each runs
  // as soon as its gradient is complete), their sum, then the sum over every mesh axis: ‖g‖²,
  // which every update reads. On pipeline stages each stage runs the sum and the all-reduces
  // (pipeline/stages.hpp) over its own slots, the others zeroed first, and the sum over the
  // pipeline axis adds the stages' parts.
  void emit_global_grad_norm() {
    struct part {
      int node, block, layer;
    };
    std::vector<part> parts;
    for (int i = 0; i < p_.size; ++i) {
      if (!is_update(p_.nodes[i])) continue;
      const int k = p_.nodes[i].block;
      if (k < 0) parts.push_back({i, -1, -1});
      else
        for (int l = 0; l < depth(k); ++l) parts.push_back({i, k, l});
    }
    if (parts.empty()) return;
    const auto count = static_cast<std::int64_t>(parts.size());
    const auto all = b_.buffer("grad_norm.parts", {count}, ir::buffer_role::activation, ir::dtype::f32);
    if (!options_.pipeline_axis.empty()) {
      b_.at(ir::phase::optimizer, -1);
      b_.compute(ir::op::zero, "grad_norm.zero", {}, {all}, {});
    }
    for (std::size_t k = 0; k < parts.size(); ++k) {
      const auto& [i, block, layer] = parts[k];
      cur_block_ = block;
      cur_layer_ = layer;
      const node& u = p_.nodes[i];
      name_ = full_name(u.in[1]);
      b_.at(ir::phase::optimizer, block >= 0 ? layout_.first_layer[static_cast<std::size_t>(block)] + layer : -1);
      const auto slot = b_.view(name_ + ".sq", all, static_cast<std::int64_t>(k * sizeof(float)), sizeof(float), {1});
      b_.compute(ir::op::grad_sq_norm, name_ + ".sq", {in(u, 1)}, {slot}, {{"replicas", replicas_of(u.in[1])}});
    }
    cur_block_ = cur_layer_ = -1;
    b_.at(ir::phase::optimizer, -1);
    std::vector<int> axes;
    for (std::size_t a = 0; a < m_.axes().size(); ++a)
      if (m_.axes()[a].size > 1) axes.push_back(static_cast<int>(a));
    auto total = b_.buffer(std::string(axes.empty() ? ir::grad_norm_sq_buffer : "grad_norm.local"), {1},
                           ir::buffer_role::activation, ir::dtype::f32);
    b_.compute(ir::op::bias_grad, "grad_norm.sum", {all}, {total}, {}); // the column sum of [parts, 1]
    for (std::size_t n = 0; n < axes.size(); ++n) {
      const auto& axis = m_.axes()[static_cast<std::size_t>(axes[n])];
      const auto summed = b_.buffer(n + 1 == axes.size() ? std::string(ir::grad_norm_sq_buffer) : "grad_norm.over_" + axis.name, {1},
                                    ir::buffer_role::activation, ir::dtype::f32);
      b_.collective(ir::op_kind::all_reduce, "grad_norm.all_reduce." + axis.name, axes[static_cast<std::size_t>(n)], total,
                    summed);
      total = summed;
    }
    grad_norm_sq_ = total;
  }

  // ---- buffers ----
  [[nodiscard]] int depth(int block) const { return layout_.depth[static_cast<std::size_t>(block)]; }
  [[nodiscard]] bool per_layer(int j) const { return p_.nodes[j].block >= 0 && p_.nodes[j].op != op_code::data; }
  // Node j's buffer for the layer being emitted (data leaves of a block are shared by its layers).
  ir::buffer_id& slot(int j) {
    return per_layer(j) ? layer_buf_[static_cast<std::size_t>(j)][static_cast<std::size_t>(cur_layer_)]
                        : buf_[static_cast<std::size_t>(j)];
  }
  // The buffer node j denotes for the task being emitted: inside a block, the same layer's; the
  // last layer's output gradient is the one from outside, the others the next layer's input
  // gradient; outside, the last layer's values, and layer 0's input gradient.
  ir::buffer_id resolve(int j) const {
    if (cur_block_ >= 0) {
      const auto& r = p_.repeats[cur_block_];
      if (j == r.grad_out && cur_layer_ < depth(cur_block_) - 1) {
        const auto gi = static_cast<std::size_t>(r.grad_in);
        return per_layer(r.grad_in) ? layer_buf_[gi][static_cast<std::size_t>(cur_layer_ + 1)] : buf_[gi];
      }
    }
    if (!per_layer(j)) return buf_[static_cast<std::size_t>(j)];
    const int k = p_.nodes[j].block;
    const auto& layers = layer_buf_[static_cast<std::size_t>(j)];
    if (k == cur_block_) return layers[static_cast<std::size_t>(cur_layer_)];
    return layers[j == p_.repeats[k].grad_in ? 0 : static_cast<std::size_t>(depth(k) - 1)];
  }
  [[nodiscard]] std::string full_name(int j) const {
    auto base = p_.name_of(j);
    if (!per_layer(j)) return base;
    // A layer's input gradient may also be the gradient of the stack's input leaf ("x.grad"):
    // only layer 0's is.
    const auto& r = p_.repeats[p_.nodes[j].block];
    if (j == r.grad_in && p_.nodes[j].name < 0 && base.ends_with(".grad")) {
      if (cur_layer_ == 0) return base;
      base = std::string(to_string(p_.nodes[j].op)) + "#" + std::to_string(j);
    }
    return std::string(r.name.view()) + "." + std::to_string(cur_layer_) + "." + base;
  }
  // A data leaf holds ids (i64), and so does every redistribution of one (a batch of ids
  // gathered or sliced for a layout automatic sharding chose); every other value is f32.
  [[nodiscard]] bool holds_ids(int i) const {
    while (is_redistribution(p_.nodes[i].op) || p_.nodes[i].op == op_code::repeat_in) i = p_.nodes[i].in[0];
    return p_.nodes[i].op == op_code::data;
  }
  ir::buffer_id new_buffer(int i) {
    const auto type = holds_ids(i) ? ir::dtype::i64 : value_type;
    const auto& shape = local_of(i);
    const auto role = buffer_role_of(p_.nodes[i].kind);
    if (const auto& want = want_padded_[static_cast<std::size_t>(i)]; want.dim >= 0 && first_rows(shape, want.dim)) {
      const auto root = b_.buffer(full_name(i) + ".padded", padded_shape(shape, want), role, type);
      slot(i) = b_.view(full_name(i), root, 0, elements(shape) * static_cast<std::int64_t>(ir::size_of(type)), shape);
      padded_roots_[slot(i)] = {root, want};
      return slot(i);
    }
    slot(i) = b_.buffer(full_name(i), shape, role, type);
    return slot(i);
  }

  // ---- uneven ZeRO splits (local_shapes): buffers of P·⌈n/P⌉ rows whose first n are the value ----
  struct padding {
    int dim = -1;             // the dimension padded
    std::int64_t extent = 0;  // its padded extent, P·⌈n/P⌉ (of this rank's part before the split)
    bool operator==(const padding&) const = default;
  };
  [[nodiscard]] static extents padded_shape(extents shape, const padding& pad) {
    shape[static_cast<std::size_t>(pad.dim)] = pad.extent;
    return shape;
  }
  // Whether the first `n` along dimension d of a buffer of this shape are its first bytes (every
  // dimension before d has extent 1), so that the value can be a view of the padded buffer.
  [[nodiscard]] static bool first_rows(const extents& shape, int d) {
    return std::all_of(shape.begin(), shape.begin() + d, [](std::int64_t e) { return e == 1; });
  }
  // The padding of redistribution x (node i) over an uneven ZeRO split: its input's when it
  // gathers the split, its output's when it splits (reduce_scatter, shard_slice); none otherwise.
  [[nodiscard]] padding padding_of(int i, const node& x) const {
    const auto parts = static_cast<std::int64_t>(m_.axes()[static_cast<std::size_t>(mesh_axis(x.axis))].size);
    if (x.op == op_code::all_gather && x.dim2 >= 0 && padded_[static_cast<std::size_t>(x.in[0])] == x.dim2)
      return {x.dim2, parts * local_of(x.in[0])[static_cast<std::size_t>(x.dim2)]};
    if ((x.op == op_code::reduce_scatter || x.op == op_code::shard_slice) && x.dim >= 0 &&
        padded_[static_cast<std::size_t>(i)] == x.dim)
      return {x.dim, parts * local_of(i)[static_cast<std::size_t>(x.dim)]};
    return {};
  }
  // Before emission: the nodes whose buffer is best made as the first rows of a padded buffer
  // (what a gather over an uneven split writes, what a split of one reads), so that no copy is
  // needed. A node wanted with two paddings keeps the first; the other copies (padded_input).
  void plan_padded_roots() {
    for (int i = 0; i < p_.size; ++i) {
      const node& x = p_.nodes[i];
      if (!is_redistribution(x.op)) continue;
      const auto pad = padding_of(i, x);
      if (pad.dim < 0) continue;
      const int holder = x.op != op_code::all_gather ? x.in[0] : x.has(flag_writes_param) ? x.of : i;
      auto& want = want_padded_[static_cast<std::size_t>(holder)];
      if (want.dim < 0) want = pad;
    }
  }
  // What a split over an uneven ZeRO split reads in place of `b` (this rank's `shape`): the
  // padded buffer `b` is the first rows of, or else a copy of `b` into a zeroed padded buffer
  // (when a dimension before the padded one is split too, the first rows are not the first
  // bytes, and `b` is a buffer of its own).
  ir::buffer_id padded_input(ir::buffer_id b, const extents& shape, const padding& pad) {
    if (const auto root = padded_root_of(b, pad); root >= 0) return root;
    const auto whole = padded_shape(shape, pad);
    const auto copy = b_.buffer(name_ + ".padded_input", whole, ir::buffer_role::activation, value_type);
    b_.place(name_ + ".pad", b, copy, whole, static_cast<std::size_t>(pad.dim), shape[static_cast<std::size_t>(pad.dim)]);
    return copy;
  }
  // What a gather over an uneven ZeRO split writes for `b` (this rank's `shape`): the padded
  // buffer `b` is the first rows of, or else a padded buffer of its own whose first rows the
  // caller copies into `b`.
  ir::buffer_id padded_output(ir::buffer_id b, const extents& shape, const padding& pad) {
    if (const auto root = padded_root_of(b, pad); root >= 0) return root;
    return b_.buffer(name_ + ".padded", padded_shape(shape, pad), ir::buffer_role::activation, value_type);
  }
  // The padded buffer `b` was made the first rows of (new_buffer) with this padding, or -1.
  [[nodiscard]] ir::buffer_id padded_root_of(ir::buffer_id b, const padding& pad) const {
    const auto it = padded_roots_.find(b);
    return it != padded_roots_.end() && it->second.pad == pad ? it->second.root : -1;
  }
  // A fresh buffer for a gradient that packs its producer's operand gradients one after the other.
  ir::buffer_id packed_buffer(int i, std::int64_t values) {
    // A copy per layer, because a repeated block lowers this node once per layer.
    slot(i) = b_.buffer(full_name(i), {values}, ir::buffer_role::gradient, value_type);
    return slot(i);
  }

  // ---- helpers of the per-op emitters ----
  [[nodiscard]] const extents& local_of(int j) const { return local_[static_cast<std::size_t>(j)]; }
  [[nodiscard]] const extents& global_of(int j) const { return global_[static_cast<std::size_t>(j)]; }
  [[nodiscard]] ir::buffer_id in(const node& x, int k) const { return resolve(x.in[k]); }
  [[nodiscard]] std::vector<ir::buffer_id> ins(const node& x) const {
    std::vector<ir::buffer_id> out;
    for (int k = 0; k < x.n_in; ++k) out.push_back(in(x, k));
    return out;
  }
  [[nodiscard]] int mesh_axis(int program_axis) const { return axis_of_[static_cast<std::size_t>(program_axis)]; }
  [[nodiscard]] static attrs shape_attrs(const extents& s) {
    const auto c = s.empty() ? 1 : s.back();
    return {{"n", elements(s)}, {"rows", elements(s) / c}, {"cols", c}};
  }
  // The mesh axis splitting the vocabulary (last) dimension of node j, -1 if none.
  [[nodiscard]] int vocab_axis_of(int j) const {
    const pspec& s = p_.nodes[j].spec;
    const auto a = s.rank > 0 ? s.dims[s.rank - 1][0] : -1;
    return a >= 0 ? mesh_axis(a) : -1;
  }
  // One compute task writing node i's buffer (made here unless a packed gradient made it).
  void compute(int i, ir::op fn, std::vector<ir::buffer_id> reads, attrs extra) {
    if (loss_scale_ >= 0 && ir::reads_loss_scale(fn)) reads.push_back(loss_scale_); // a loss gradient
    const auto out = slot(i) >= 0 ? slot(i) : new_buffer(i);
    b_.compute(fn, name_, std::move(reads), {out}, std::move(extra));
  }

  // ---- per task form (ir::task_form, the op's table entry) ----
  void emit(int i) {
    const node& x = p_.nodes[i];
    name_ = full_name(i);
    b_.at(x.phase, cur_block_ >= 0 ? layout_.first_layer[static_cast<std::size_t>(cur_block_)] + cur_layer_ : -1);
    // A packed gradient's buffer holds the gradients of its first operands, one after the other.
    if (const int parts = ir::packed_parts(x.op); parts > 0) {
      std::int64_t size = 0;
      for (int k = 0; k < parts; ++k) size += elements(local_of(x.in[k]));
      packed_buffer(i, size);
    }
    switch (ir::info(x.op).form) {
    case ir::task_form::leaf:
      if (slot(i) < 0) new_buffer(i); // a stack's data is one buffer for every layer
      return;
    case ir::task_form::layer_input: {
      const auto& r = p_.repeats[x.block];
      slot(i) = cur_layer_ == 0 ? in(x, 0) : layer_buf_[static_cast<std::size_t>(r.out)][static_cast<std::size_t>(cur_layer_ - 1)];
      return;
    }
    case ir::task_form::view: return select(i, x);
    case ir::task_form::rows: return compute(i, x.op, ins(x), shape_attrs(local_of(x.in[0])));
    case ir::task_form::matmul: return matmul(i, x);
    case ir::task_form::rope: return rope(i, x);
    case ir::task_form::attention: return attention(i, x);
    case ir::task_form::transpose: {
      const auto& s = local_of(x.in[0]);
      const auto d = static_cast<std::size_t>(x.dims.first);
      const auto outer = std::accumulate(s.begin(), s.begin() + x.dims.first, std::int64_t{1}, std::multiplies<>{});
      return compute(i, x.op, ins(x), {{"outer", outer}, {"rows", s[d]}, {"cols", s[d + 1]}, {"inner", elements(s) / (outer * s[d] * s[d + 1])}});
    }
    case ir::task_form::embedding: return embedding(i, x);
    case ir::task_form::loss: return loss(i, x);
    case ir::task_form::moe: return moe(i, x);
    case ir::task_form::convolution: return convolution(i, x);
    case ir::task_form::pooling: return pooling(i, x);
    case ir::task_form::parts: return parts(i, x);
    case ir::task_form::dropout: return dropout(i, x);
    case ir::task_form::reshape: return view_of_operand(i, x);
    case ir::task_form::reduce_dim: return reduce_dim(i, x);
    case ir::task_form::batchnorm: return batchnorm(i, x);
    case ir::task_form::update: return update(i, x);
    case ir::task_form::shard: return local_redistribution(i, x);
    case ir::task_form::collective: return collective(i, x);
    case ir::task_form::none: break;
    }
    fail("lowering: node " + std::to_string(i) + " '" + name_ + "' has op '" + std::string(ir::to_string(x.op)) +
         "', whose task the lowering does not make (its table entry has no task_form)");
  }

  // Operands as 2-D (or batched 2-D) matrices; the backward ones read a transposed operand.
  void matmul(int i, const node& x) {
    const bool ta = x.has(flag_trans_a), tb = x.has(flag_trans_b);
    const auto &sa = local_of(x.in[0]), &sb = local_of(x.in[1]);
    const bool batched = sa.size() >= 3 && sb.size() == sa.size();
    const auto rows = [&](const extents& s) { return batched ? s[s.size() - 2] : elements(s) / s.back(); };
    const std::int64_t batch = batched ? elements(sa) / (sa.back() * sa[sa.size() - 2]) : 1;
    const std::int64_t m = ta ? sa.back() : rows(sa), k = ta ? rows(sa) : sa.back();
    const std::int64_t n = tb ? rows(sb) : sb.back();
    b_.matmul(name_, in(x, 0), in(x, 1), new_buffer(i), m, n, k, batch, ta, tb);
  }

  void rope(int i, const node& x) {
    if (head_dim_ < 1) fail(p_.describe(i) + ": rope takes head_dim from the program's causal_attention, and it has none");
    auto extra = shape_attrs(local_of(i));
    extra["head_dim"] = head_dim_;
    extra["theta"] = options_.rope_theta;
    compute(i, x.op, ins(x), std::move(extra));
  }

  // Grouped-query attention: each rank's k/v heads serve its query heads in groups.
  void attention(int i, const node& x) {
    const auto &q = local_of(x.in[0]), &k = local_of(x.in[1]);
    const auto heads = q[2] / head_dim_, kv_heads = k[2] / head_dim_;
    if (heads < 1 || kv_heads < 1 || q[2] % head_dim_ != 0 || k[2] % head_dim_ != 0) {
      // Name the axes that split the heads, as the user declared them.
      std::string over;
      for (const auto a : p_.nodes[x.in[0]].spec.dims[2])
        if (a >= 0) {
          const auto& axis = m_.axes()[static_cast<std::size_t>(axis_of_[static_cast<std::size_t>(a)])];
          over.append(over.empty() ? "" : " x ").append(axis.name).append(" = ").append(std::to_string(axis.size));
        }
      const auto global_kv = global_of(x.in[1])[2] / head_dim_;
      fail(p_.describe(i) + ": " + std::to_string(options_.heads) + " query heads and " + std::to_string(global_kv) +
           " k/v heads cannot be split over " + (over.empty() ? std::string("no axis") : over) + " (" +
           std::to_string(global_of(x.in[0])[2] / q[2]) +
           " ranks): every rank needs whole heads; make that number of ranks divide both head counts (or change the "
           "heads, lower_options::heads)");
    }
    compute(i, x.op, ins(x),
            {{"batch", q[0]}, {"seq", q[1]}, {"heads", heads}, {"kv_heads", kv_heads}, {"group", heads / kv_heads},
             {"head_dim", head_dim_}, {"causal", x.has(flag_bidirectional) ? 0 : 1}});
  }

  // Part `dim` of a packed gradient: the parts are the gradients of the producer's operands in
  // order, each the size of its operand (k and v are smaller than q under GQA); of another value,
  // its row `dim` (batchnorm's gradient sums: dbeta, dgamma). A view, no task.
  void select(int i, const node& x) {
    const node& packed = p_.nodes[x.in[0]];
    const auto size = static_cast<std::int64_t>(ir::size_of(value_type));
    std::int64_t offset = 0;
    if (ir::packed_parts(packed.op) == 0) offset = x.dim * elements(local_of(i)) * size; // equal rows (batchnorm's sums)
    else
      for (int k = 0; k < x.dim; ++k) offset += elements(local_of(packed.in[k])) * size;
    slot(i) = b_.view(name_, in(x, 0), offset, elements(local_of(i)) * size, local_of(i));
  }

  void embedding(int i, const node& x) {
    const bool forward = x.op == op_code::embedding;
    const auto& table = forward ? local_of(x.in[1]) : local_of(i);
    const auto& table_spec = p_.nodes[forward ? x.in[1] : x.of].spec;
    const int vocab_axis = table_spec.dims[0][0] >= 0 ? mesh_axis(table_spec.dims[0][0]) : -1;
    compute(i, x.op, ins(x),
            {{"tokens", elements(local_of(x.in[0]))}, {"vocab", table[0]}, {"hidden", table[1]}, {"vocab_axis", vocab_axis}});
  }

  // conv2d and its gradients: this rank's image and kernel (a gradient's own node is the one of
  // the operand it is the gradient of), stride and padding from the node.
  void convolution(int i, const node& x) {
    const auto& image = local_of(x.op == op_code::conv2d_grad_input ? i : x.in[0]);
    const auto& kernel = local_of(x.op == op_code::conv2d_grad_weight ? i : x.in[1]);
    const ir::conv_geometry g{image[0], image[1],  image[2],      image[3],      kernel[3],
                              kernel[0], kernel[1], x.conv.stride, x.conv.padding};
    compute(i, x.op, ins(x), g.attrs());
  }

  // max_pool, avg_pool and their gradients (whose node is dx, the image's shape): the image on
  // this rank as a convolution's whose kernel is the window and keeps the channels.
  void pooling(int i, const node& x) {
    const bool forward = x.op == op_code::max_pool || x.op == op_code::avg_pool;
    const auto& image = local_of(forward ? x.in[0] : i);
    const ir::conv_geometry g{image[0], image[1], image[2], image[3], image[3], x.window, x.window, x.conv.stride, x.conv.padding};
    compute(i, x.op, ins(x), g.attrs());
  }

  // concat_dim, slice_dim and their gradients: the tensor with the parts (the concat's output, the
  // slice's input, which a gradient's shape or its forward node gives) as [lead, outer, extent,
  // inner] around the dim; lead is the dims a concat's lower-rank operand is repeated over.
  void parts(int i, const node& x) {
    const bool forward = x.op == op_code::concat_dim || x.op == op_code::slice_dim;
    const node& op = forward ? x : p_.nodes[x.forward];
    const int whole = op.op == op_code::concat_dim ? (forward ? i : x.forward) : (forward ? x.in[0] : i);
    const auto& s = local_of(whole);
    const auto rank_of = [&](int k) { return static_cast<std::int64_t>(local_of(op.in[k]).size()); };
    const auto size = static_cast<std::int64_t>(s.size());
    const std::int64_t dim = op.op == op_code::concat_dim ? op.dims.first : op.part.dim;
    const std::int64_t skip = op.op == op_code::concat_dim ? size - std::min(rank_of(0), rank_of(1)) : 0;
    const auto product = [&](std::int64_t from, std::int64_t to) {
      std::int64_t n = 1;
      for (auto k = from; k < to; ++k) n *= s[static_cast<std::size_t>(k)];
      return n;
    };
    ir::dim_part g{product(0, skip), product(skip, dim), s[static_cast<std::size_t>(dim)], product(dim + 1, size), 0, 0, 0};
    if (op.op == op_code::slice_dim) {
      g.offset = op.part.begin;
      g.length = op.part.end - op.part.begin;
    } else {
      const auto length_of = [&](int k) { return local_of(op.in[k])[static_cast<std::size_t>(dim - (size - rank_of(k)))]; };
      const auto repeated = [&](int k) { return rank_of(k) < size ? std::int64_t{1} : 0; };
      if (forward) {
        g.length = length_of(0);
        g.broadcast = repeated(0) | repeated(1) << 1;
      } else {
        g.offset = x.operand == 0 ? 0 : length_of(0);
        g.length = length_of(x.operand);
        g.broadcast = repeated(x.operand);
      }
    }
    compute(i, x.op, ins(x), g.attrs());
  }

  // Node i as its operand's buffer in its own shape: a view, no task (flatten; evaluation's dropout).
  void view_of_operand(int i, const node& x) {
    const auto src = in(x, 0);
    slot(i) = b_.view(name_, src, 0, b_.peek().buffers.at(static_cast<std::size_t>(src)).bytes, local_of(i));
  }

  // dropout and its gradient: the rate, a seed of the user's seed, the forward node and the layer
  // (a repeat's layers draw their own masks; the gradient the forward's), and this rank's block
  // of the whole tensor: per dim its extents and the mesh axes splitting it (major, minor),
  // whose coordinates the kernel reads. Evaluation passes x through: a view, no task.
  void dropout(int i, const node& x) {
    if (options_.forward_only) return view_of_operand(i, x);
    const auto &local = local_of(i), &global = global_of(i);
    const int forward = x.op == op_code::dropout ? i : x.forward;
    const auto salt = static_cast<std::int64_t>(forward) * 4096 + (cur_layer_ + 1); // the kernel mixes the bits
    attrs a{{"num", ir::fraction_num(x.drop.rate)},
            {"den", ir::fraction_den},
            {"seed", static_cast<std::int64_t>(x.drop.seed) << 31 ^ salt},
            {"rank", static_cast<std::int64_t>(local.size())}};
    const auto& spec = p_.nodes[i].spec;
    for (std::size_t d = 0; d < local.size(); ++d) {
      const auto k = std::to_string(d);
      a["local" + k] = local[d];
      a["global" + k] = global[d];
      const int major = spec.dims[d][0], minor = spec.dims[d][1];
      a["major" + k] = major >= 0 ? mesh_axis(major) : -1;
      a["minor" + k] = minor >= 0 ? mesh_axis(minor) : -1;
      a["minor_size" + k] = minor >= 0 ? m_.axes()[static_cast<std::size_t>(mesh_axis(minor))].size : 1;
    }
    compute(i, x.op, ins(x), std::move(a));
  }

  // The batch normalisation's tasks: the image's rows and channels on this rank, and the rows its
  // statistics count: every rank's when synchronised, this rank's when local. The scale's
  // operand is the sums (reduced), made from the image.
  // The scale reads the batch's sums while training and the running statistics (its third
  // operand) in evaluation; the running statistics move in place while training only.
  void batchnorm(int i, const node& x) {
    int image = x.in[0];
    if (x.op == op_code::batchnorm_scale || x.op == op_code::batchnorm_track) {
      while (is_redistribution(p_.nodes[image].op)) image = p_.nodes[image].in[0];
      image = p_.nodes[image].in[0];
    }
    const auto& s = local_of(image);
    const auto& whole = global_of(image);
    const auto cols = s.back(), rows = elements(s) / cols;
    attrs a{{"rows", rows}, {"cols", cols}, {"count", x.local_stats ? rows : elements(whole) / whole.back()}};
    if (x.op == op_code::batchnorm_track) {
      const auto running = slot(i) = in(x, 1);
      if (options_.forward_only) return;
      a["num"] = ir::fraction_num(x.momentum);
      a["den"] = ir::fraction_den;
      b_.compute(x.op, name_, {in(x, 0), running}, {running}, std::move(a));
      return;
    }
    if (x.op == op_code::batchnorm_scale) {
      if (options_.forward_only) a["running"] = 1;
      return compute(i, x.op, {in(x, options_.forward_only ? 2 : 0), in(x, 1)}, std::move(a));
    }
    compute(i, x.op, ins(x), std::move(a));
  }

  // sum_dim / mean_dim over x and their gradients (the node is dx, x's shape): the values around
  // the dim; a mean divides by the dim's whole extent, however it is split.
  void reduce_dim(int i, const node& x) {
    const bool forward = x.op == op_code::sum_dim || x.op == op_code::mean_dim;
    const bool mean = x.op == op_code::mean_dim || x.op == op_code::mean_dim_grad;
    const int of = forward ? x.in[0] : i;
    const auto& s = local_of(of);
    const auto d = static_cast<std::size_t>(x.dims.first);
    const auto outer = std::accumulate(s.begin(), s.begin() + x.dims.first, std::int64_t{1}, std::multiplies<>{});
    const auto inner = std::accumulate(s.begin() + x.dims.first + 1, s.end(), std::int64_t{1}, std::multiplies<>{});
    compute(i, x.op, ins(x),
            {{"outer", outer}, {"extent", s[d]}, {"inner", inner}, {"num", 1}, {"den", mean ? global_of(of)[d] : 1}});
  }

  // Losses and their gradients: the local rows or values, and what the entry's loss_attrs name:
  // the global count the mean divides by (the prediction's elements, the labels' rows; a labels
  // operand is the second) and the axis splitting the logits' vocabulary.
  void loss(int i, const node& x) {
    auto extra = shape_attrs(local_of(x.in[0]));
    for (const auto name : ir::info(x.op).loss_attrs) {
      if (name == "global_n") extra["global_n"] = elements(global_of(x.in[0]));
      else if (name == "global_rows") extra["global_rows"] = elements(global_of(x.in[1]));
      else if (name == "vocab_axis") extra["vocab_axis"] = vocab_axis_of(x.in[0]);
      else if (!name.empty()) fail("lowering: loss attr '" + std::string(name) + "' of " + p_.describe(i) + " is not one it derives");
    }
    compute(i, x.op, ins(x), std::move(extra));
  }

  // Redistributions that move no data between ranks: take this rank's part, or keep one copy.
  void local_redistribution(int i, const node& x) {
    const int axis = mesh_axis(x.axis);
    attrs extra{{"mesh_axis", axis}};
    if (x.op == op_code::shard_slice) {
      extra["dim"] = x.dim;
      extra["parts"] = m_.axes()[static_cast<std::size_t>(axis)].size;
    }
    auto source = in(x, 0);
    auto shape = local_of(x.in[0]);
    if (const auto pad = padding_of(i, x); pad.dim >= 0) { // this rank's ⌈n/P⌉ rows of the padded value
      source = padded_input(source, shape, pad);
      shape = padded_shape(shape, pad);
    }
    for (std::size_t d = 0; d < shape.size(); ++d) extra["in_dim" + std::to_string(d)] = shape[d];
    compute(i, x.op, {source}, std::move(extra));
  }

  void collective(int i, const node& x) {
    const auto kind = ir::info(x.op).kind;
    // An update's gather (ZeRO) writes the parameter itself.
    const auto out = x.has(flag_writes_param) ? (slot(i) = resolve(x.of)) : new_buffer(i);
    const auto pad = padding_of(i, x);
    const bool gathers = x.op == op_code::all_gather, padded = pad.dim >= 0;
    const auto from = padded && !gathers ? padded_input(in(x, 0), local_of(x.in[0]), pad) : in(x, 0);
    const auto to = padded && gathers ? padded_output(out, local_of(i), pad) : out;
    const auto t = b_.collective(kind, name_, mesh_axis(x.axis), from, to, -1,
                                 x.has(flag_max) ? std::optional(ir::op::max) : std::nullopt);
    if (to != out && to != padded_root_of(out, pad)) // the value: the first rows of what was gathered
      b_.slice(name_ + ".unpad", to, out, padded_shape(local_of(i), pad), static_cast<std::size_t>(pad.dim), 0,
               local_of(i)[static_cast<std::size_t>(pad.dim)]);
    attrs extra;
    if (x.op == op_code::all_gather) extra["dim"] = x.dim2;
    if (x.op == op_code::reduce_scatter) extra["dim"] = x.dim;
    if (x.op == op_code::all_to_all) {
      extra["from_dim"] = x.dim2;
      extra["to_dim"] = x.dim;
    }
    collective_attrs_.emplace_back(t, std::move(extra));
  }

  // The MoE ops (runtime/cpu/moe.hpp): a group is a sequence, whole on every rank; the routing's
  // settings are the node's own (route, balance loss) or its gates' routing's (operand 1).
  void moe(int i, const node& x) {
    attrs extra;
    const bool on_logits = x.op == op_code::moe_route || x.op == op_code::moe_route_grad;
    const int route = on_logits ? -1 : route_of(p_, x.in[1]);
    const auto& logits = global_of(on_logits ? x.in[0] : x.in[1]);
    const moe_config& settings = route >= 0 ? p_.nodes[route].moe : x.moe;
    extra["experts"] = logits[2];
    extra["group"] = logits[1];
    if (x.op != op_code::moe_route_grad) extra["capacity"] = moe_capacity(settings, logits);
    if (on_logits) extra["top_k"] = settings.top_k;
    if (x.op == op_code::moe_route_grad) {
      constexpr std::int64_t parts = 1'000'000; // the weight as a ratio of integers (attrs are integers)
      extra["weight_num"] = std::llround(settings.aux_weight * static_cast<double>(parts));
      extra["weight_den"] = parts;
      extra["global_groups"] = logits[0];
    }
    compute(i, x.op, ins(x), std::move(extra));
  }

  // In place on the parameter (or on its shard, for ZeRO-1/2, before the gather).
  void update(int i, const node& x) {
    slot(i) = x.has(flag_writes_param) ? resolve(x.of) : in(x, 0);
    std::vector<ir::buffer_id> reads{in(x, 0), in(x, 1)}, writes{slot(i)};
    if (x.op == op_code::adamw) {
      reads.insert(reads.end(), {in(x, 2), in(x, 3)});
      writes.insert(writes.end(), {in(x, 2), in(x, 3)});
    }
    if (grad_norm_sq_ >= 0) reads.push_back(grad_norm_sq_); // the clipping factor's norm, or whether the step overflowed
    if (loss_scale_ >= 0) reads.push_back(loss_scale_);
    b_.compute(x.op, name_, reads, writes, {{"n", elements(local_of(i))}});
  }

  const program<N>& p_;
  const mesh& m_;
  const lower_options& options_;
  std::vector<int> axis_of_;
  std::vector<extents> global_, local_;
  std::vector<int> padded_; // per node: local_layout::padded
  repeat_layout layout_;
  ir::builder b_;
  std::vector<ir::buffer_id> buf_;                    // per node
  std::vector<std::vector<ir::buffer_id>> layer_buf_; // per node of a block, per layer
  int cur_block_ = -1, cur_layer_ = -1;              // what is being emitted
  std::string name_;                                  // the task being emitted
  std::int64_t head_dim_ = 0;
  ir::buffer_id grad_norm_sq_ = -1;                   // with clipping or loss scaling: what every update reads
  ir::buffer_id loss_scale_ = -1;                     // with loss scaling: what the loss gradients and updates read
  std::vector<std::pair<ir::task_id, attrs>> collective_attrs_;
  std::vector<padding> want_padded_;                  // per node: plan_padded_roots
  struct padded_root {
    ir::buffer_id root = -1;
    padding pad;
  };
  std::map<ir::buffer_id, padded_root> padded_roots_; // by the view that is its first rows
};

// Every program is lowered as a program of this many nodes (copied into one on the heap), so
// that the lowering's code is generated once per trainer, not once per model size, and can be
// compiled separately (CONCERTO_SEPARATE_COMPILATION). A larger program is lowered as it is.
inline constexpr std::size_t lowering_size = 4096;

template <std::size_t N>
ir::graph lower_sized(const graph::program<N>& p, const shape_map& shapes, const mesh& m, const lower_options& options) {
  std::vector<int> axis_of(static_cast<std::size_t>(p.axes.count)); // program axis -> mesh axis
  for (int a = 0; a < p.axes.count; ++a) {
    const auto idx = m.index_of(p.axes.names[a].view());
    if (!idx) {
      // Name where the user wrote the axis: the first leaf whose spec (stored or used) has it.
      std::string where;
      for (int i = 0; i < p.size && where.empty(); ++i) {
        const auto& x = p.nodes[i];
        if (is_leaf(x.op) && (x.spec.state(a) != state_replicated || x.use.state(a) != state_replicated))
          where = std::string(" (leaf '").append(p.name_of(i)).append("' is split or summed over it)");
      }
      fail(std::string("the program uses mesh axis '")
               .append(p.axes.names[a].view())
               .append("'")
               .append(where)
               .append(", which the mesh does not have; add it to the mesh (size 1 if unused)"));
    }
    axis_of[static_cast<std::size_t>(a)] = *idx;
  }
  auto global = global_shapes(p, shapes, options);
  auto local = local_shapes(p, global, m, axis_of);
  auto layout = repeat_depths(p, global, options);
  return emitter<N>(p, m, options, std::move(axis_of), std::move(global), std::move(local), std::move(layout)).run();
}

#ifdef CONCERTO_SEPARATE_COMPILATION
extern template ir::graph lower_sized<lowering_size>(const graph::program<lowering_size>&, const shape_map&, const mesh&,
                                                     const lower_options&);
#endif

// f(p) with p as a program of lowering_size nodes (a copy on the heap), or as it is if larger.
template <std::size_t N, class F>
auto at_lowering_size(const graph::program<N>& p, F&& f) {
  if constexpr (N <= lowering_size) {
    const auto wide = std::make_unique<graph::program<lowering_size>>();
    widen_into(*wide, p);
    return f(*wide);
  } else {
    return f(p);
  }
}

} // namespace graph::detail

/// @brief Lowers a program to the task graph of one rank (all ranks share it). Throws
/// concerto::error naming the tensor for a missing or wrong shape, a dimension that does not
/// divide over its mesh axis, a mesh that lacks an axis the program uses, or a repeat without a depth.
/// A repeated block is unrolled: layer i's tasks are named `<repeat>.<i>.<name>` and carry
/// `ir::task::layer` (numbered across the repeats of the program in order), forward layers run
/// 0..L-1, backward layers L-1..0. Tasks whose results neither the loss, a leaf's gradient nor
/// an update needs are not in the graph (ir::remove_dead_tasks).
template <std::size_t N>
[[nodiscard]] ir::graph lower(const graph::program<N>& p, const shape_map& shapes, const mesh& m,
                              const lower_options& options = {}) {
  return graph::detail::at_lowering_size(
      p, [&](const auto& sized) { return graph::detail::lower_sized(sized, shapes, m, options); });
}

} // namespace concerto
