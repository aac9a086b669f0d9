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
#include <concerto/mesh/mesh.hpp>

#include <functional>
#include <map>
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
  ir::dtype type = ir::dtype::f32;
  /// Depth of each `repeat<"name">` of the program, by name: its block is emitted that many times.
  std::map<std::string, int> depth = {};
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
  using graph::node;
  using graph::detail::dims_text;
  using graph::detail::elements;
  const auto n = static_cast<std::size_t>(p.size);

  // Program axis -> mesh axis.
  std::vector<int> axis_of(static_cast<std::size_t>(p.axes.count));
  for (int a = 0; a < p.axes.count; ++a) {
    const auto idx = m.index_of(p.axes.names[a].view());
    if (!idx)
      fail("the program uses mesh axis '" + std::string(p.axes.names[a].view()) +
           "', which the mesh does not have; add it to the mesh (size 1 if unused)");
    axis_of[static_cast<std::size_t>(a)] = *idx;
  }
  const auto axis_size = [&](int a) { return m.axes()[static_cast<std::size_t>(axis_of[static_cast<std::size_t>(a)])].size; };

  // Global shapes: leaves from the map, ops by their rule, everything derived from another value by it.
  std::vector<std::vector<std::int64_t>> global(n);
  for (std::size_t i = 0; i < n; ++i) {
    const node& x = p.nodes[i];
    const auto name = p.name_of(static_cast<int>(i));
    const auto what = p.describe(static_cast<int>(i)); // the op as the user wrote it, for messages
    const auto in = [&](int k) -> const std::vector<std::int64_t>& { return global[static_cast<std::size_t>(x.in[k])]; };
    if (graph::is_leaf(x.op)) {
      const auto it = shapes.find(name);
      if (it == shapes.end()) fail("no shape given for leaf '" + name + "'; add it to the shape map");
      if (static_cast<int>(it->second.size()) != x.spec.rank)
        fail("leaf '" + name + "' has shape " + dims_text(it->second) + " of rank " + std::to_string(it->second.size()) +
             " but its spec " + to_string(p.spec_at(static_cast<int>(i))) + " has rank " + std::to_string(x.spec.rank));
      for (auto d : it->second)
        if (d < 1) fail("leaf '" + name + "' has shape " + dims_text(it->second) + " with a non-positive extent");
      global[i] = it->second;
      continue;
    }
    if (x.of >= 0) {
      global[i] = global[static_cast<std::size_t>(x.of)];
      continue;
    }
    switch (x.op) {
    case op_code::matmul: {
      const auto &a = in(0), &b = in(1);
      const auto k_a = a.back(), k_b = b[b.size() - 2];
      if (k_a != k_b)
        fail(what + ": contracted sizes differ, '" + p.name_of(x.in[0]) + "' " + dims_text(a) + " and '" +
             p.name_of(x.in[1]) + "' " + dims_text(b));
      if (b.size() == a.size() && !std::equal(a.begin(), a.end() - 2, b.begin()))
        fail(what + ": batch dimensions differ, " + dims_text(a) + " and " + dims_text(b));
      global[i] = a;
      global[i].back() = b.back();
      break;
    }
    case op_code::add:
      if (in(0) != in(1))
        fail(what + ": shapes differ, '" + p.name_of(x.in[0]) + "' " + dims_text(in(0)) + " and '" +
             p.name_of(x.in[1]) + "' " + dims_text(in(1)));
      global[i] = in(0);
      break;
    case op_code::mul:
    case op_code::swiglu:
      if (in(0) != in(1))
        fail(what + ": shapes differ, '" + p.name_of(x.in[0]) + "' " +
             dims_text(in(0)) + " and '" + p.name_of(x.in[1]) + "' " + dims_text(in(1)));
      global[i] = in(0);
      break;
    case op_code::rope:
      if (in(1).size() + 1 != in(0).size() || !std::equal(in(1).begin(), in(1).end(), in(0).begin()))
        fail(what + ": positions '" + p.name_of(x.in[1]) + "' " + dims_text(in(1)) +
             " do not match the leading dimensions of '" + p.name_of(x.in[0]) + "' " + dims_text(in(0)));
      global[i] = in(0);
      break;
    case op_code::bias_add:
    case op_code::layernorm:
    case op_code::rmsnorm:
      for (int k = 1; k < x.n_in; ++k)
        if (in(k)[0] != in(0).back())
          fail(what + ": '" + p.name_of(x.in[k]) + "' has " +
               std::to_string(in(k)[0]) + " entries but the last dimension of '" + p.name_of(x.in[0]) + "' is " +
               std::to_string(in(0).back()));
      global[i] = in(0);
      break;
    case op_code::attention: {
      const auto& q = in(0);
      if (in(1) != in(2) || !std::equal(q.begin(), q.end() - 1, in(1).begin()))
        fail(what + ": k " + dims_text(in(1)) + " and v " + dims_text(in(2)) +
             " must have one shape, and q's " + dims_text(q) + " but for the last dimension");
      if (q.back() % options.heads != 0)
        fail(what + ": hidden size " + std::to_string(q.back()) + " is not divisible by " +
             std::to_string(options.heads) + " heads");
      const auto head_dim = q.back() / options.heads;
      if (in(1).back() % head_dim != 0 || options.heads % (in(1).back() / head_dim) != 0)
        fail(what + ": k and v hold " + std::to_string(in(1).back()) + " values per token, not a number " +
             "of heads of " + std::to_string(head_dim) + " (" + std::to_string(q.back()) + " / " +
             std::to_string(options.heads) + " heads) that divides the " + std::to_string(options.heads) + " query heads");
      global[i] = q;
      break;
    }
    case op_code::embedding:
      global[i] = in(0);
      global[i].push_back(in(1)[1]);
      break;
    case op_code::mse:
      if (in(0) != in(1)) fail(what + ": prediction " + dims_text(in(0)) + " and target " + dims_text(in(1)) + " differ");
      global[i] = {};
      break;
    case op_code::cross_entropy:
      if (!std::equal(in(1).begin(), in(1).end(), in(0).begin()))
        fail(what + ": labels " + dims_text(in(1)) + " do not match logits " + dims_text(in(0)));
      global[i] = {};
      break;
    case op_code::vocab_ce_max:
    case op_code::vocab_ce_sumexp: global[i] = std::vector<std::int64_t>(in(0).begin(), in(0).end() - 1); break;
    case op_code::vocab_ce_target:
      if (in(1).size() + 1 != in(0).size() || !std::equal(in(1).begin(), in(1).end(), in(0).begin()))
        fail(what + ": labels " + dims_text(in(1)) + " do not match logits " + dims_text(in(0)));
      global[i] = in(1);
      break;
    case op_code::vocab_ce_loss: global[i] = {}; break;
    default: global[i] = in(0); break;
    }
  }

  // Rope rotates heads of the attention's head_dim; a program without attention has none to rotate.
  std::int64_t head_dim = 0;
  for (std::size_t i = 0; i < n; ++i)
    if (p.nodes[i].op == op_code::attention) head_dim = global[static_cast<std::size_t>(p.nodes[i].in[0])].back() / options.heads;

  // Local shapes.
  std::vector<std::vector<std::int64_t>> local(n);
  for (std::size_t i = 0; i < n; ++i) {
    local[i] = global[i];
    const pspec& s = p.nodes[i].spec;
    for (int d = 0; d < s.rank; ++d)
      for (auto a : s.dims[d]) {
        if (a < 0) continue;
        const int size = axis_size(a);
        auto& extent = local[i][static_cast<std::size_t>(d)];
        if (extent % size != 0) {
          const int src = graph::is_leaf(p.nodes[i].op) || p.nodes[i].of < 0 ? static_cast<int>(i) : p.nodes[i].of;
          fail("tensor '" + p.name_of(src) + "' dimension " + std::to_string(d) + " (size " + std::to_string(extent) +
               ") does not divide over mesh axis '" + std::string(p.axes.names[a].view()) + "' (size " +
               std::to_string(size) + ")");
        }
        extent /= size;
      }
  }

  // Depths and the first layer number of each repeat.
  const auto repeats = static_cast<std::size_t>(p.repeat_count);
  std::vector<int> depth(repeats), first_layer(repeats);
  for (const auto& [rname, d] : options.depth)
    if (p.repeat_index(rname) < 0) fail("a depth is given for repeat '" + rname + "', which the program does not have");
  for (std::size_t k = 0, next = 0; k < repeats; ++k) {
    const auto& r = p.repeats[k];
    const std::string rname(r.name.view());
    const auto it = options.depth.find(rname);
    if (it == options.depth.end())
      fail("no depth given for repeat '" + rname + "'; pass it as lower_options{.depth = {{\"" + rname + "\", L}}}");
    if (it->second < 1) fail("repeat '" + rname + "' has depth " + std::to_string(it->second) + "; give it at least 1");
    if (global[static_cast<std::size_t>(r.out)] != global[static_cast<std::size_t>(r.in)])
      fail("repeat '" + rname + "': the block returns shape " + dims_text(global[static_cast<std::size_t>(r.out)]) +
           " but takes " + dims_text(global[static_cast<std::size_t>(r.in)]) + "; layer i+1 reads layer i's output");
    depth[k] = it->second;
    first_layer[k] = static_cast<int>(next);
    next += static_cast<std::size_t>(it->second);
  }

  ir::builder b(options.name);
  for (const auto& ax : m.axes()) b.axis(ax.name, ax.size, ax.link);
  // Buffers per node, and per layer for the nodes of a block (data leaves of a block are shared).
  std::vector<ir::buffer_id> buf(n, -1);
  std::vector<std::vector<ir::buffer_id>> layer_buf(n);
  const auto per_layer = [&](std::size_t j) { return p.nodes[j].block >= 0 && p.nodes[j].op != op_code::data; };
  for (std::size_t j = 0; j < n; ++j)
    if (per_layer(j)) layer_buf[j].assign(static_cast<std::size_t>(depth[static_cast<std::size_t>(p.nodes[j].block)]), -1);
  int cur_block = -1, cur_layer = -1; // what is being emitted
  const auto slot = [&](std::size_t j) -> ir::buffer_id& {
    return per_layer(j) ? layer_buf[j][static_cast<std::size_t>(cur_layer)] : buf[j];
  };
  // The buffer node j denotes for the task being emitted: inside a block, the same layer's; the
  // last layer's output gradient is the one from outside, the others the next layer's input
  // gradient; outside, the last layer's values, and layer 0's input gradient.
  const auto resolve = [&](std::size_t j) -> ir::buffer_id {
    if (cur_block >= 0) {
      const auto& r = p.repeats[cur_block];
      if (static_cast<int>(j) == r.grad_out && cur_layer < depth[static_cast<std::size_t>(cur_block)] - 1) {
        const auto gi = static_cast<std::size_t>(r.grad_in);
        return per_layer(gi) ? layer_buf[gi][static_cast<std::size_t>(cur_layer + 1)] : buf[gi];
      }
    }
    if (!per_layer(j)) return buf[j];
    const int k = p.nodes[j].block;
    if (k == cur_block) return layer_buf[j][static_cast<std::size_t>(cur_layer)];
    const bool first = static_cast<int>(j) == p.repeats[k].grad_in;
    return layer_buf[j][first ? 0 : static_cast<std::size_t>(depth[static_cast<std::size_t>(k)] - 1)];
  };
  const auto full_name = [&](std::size_t j) {
    auto base = p.name_of(static_cast<int>(j));
    if (!per_layer(j)) return base;
    // A layer's input gradient may also be the gradient of the stack's input leaf ("x.grad"):
    // only layer 0's is.
    const auto& r = p.repeats[p.nodes[j].block];
    if (static_cast<int>(j) == r.grad_in && p.nodes[j].name < 0 && base.ends_with(".grad")) {
      if (cur_layer == 0) return base;
      base = std::string(to_string(p.nodes[j].op)) + "#" + std::to_string(j);
    }
    return std::string(p.repeats[p.nodes[j].block].name.view()) + "." + std::to_string(cur_layer) + "." + base;
  };
  std::vector<std::pair<ir::task_id, std::map<std::string, std::int64_t>>> collective_attrs;
  const auto role_of = [](graph::role r) {
    switch (r) {
    case graph::role::input:
    case graph::role::data: return ir::buffer_role::input;
    case graph::role::param:
    case graph::role::update: return ir::buffer_role::param;
    case graph::role::gradient: return ir::buffer_role::gradient;
    case graph::role::state: return ir::buffer_role::optimizer_state;
    default: return ir::buffer_role::activation;
    }
  };
  const auto new_buffer = [&](std::size_t i, graph::role r) {
    const auto type = p.nodes[i].op == op_code::data ? ir::dtype::i64 : options.type;
    slot(i) = b.buffer(full_name(i), local[i], role_of(r), type);
    return slot(i);
  };
  // The parameter leaf behind an update chain, whose buffer an in-place update writes.
  const auto param_buffer = [&](const node& x) { return resolve(static_cast<std::size_t>(x.of)); };
  // The mesh axis splitting the vocabulary (last) dimension of node j, -1 if none.
  const auto vocab_axis_of = [&](int j) {
    const pspec& s = p.nodes[static_cast<std::size_t>(j)].spec;
    const auto a = s.rank > 0 ? s.dims[s.rank - 1][0] : -1;
    return a >= 0 ? axis_of[static_cast<std::size_t>(a)] : -1;
  };

  const auto emit = [&](std::size_t i) {
    const node& x = p.nodes[i];
    const auto name = full_name(i);
    b.at(x.phase, cur_block >= 0 ? first_layer[static_cast<std::size_t>(cur_block)] + cur_layer : -1);
    const auto I = [&](int k) { return resolve(static_cast<std::size_t>(x.in[k])); };
    const auto L = [&](int k) -> const std::vector<std::int64_t>& { return local[static_cast<std::size_t>(x.in[k])]; };
    const auto& out_shape = local[i];
    const std::int64_t elems = elements(out_shape);
    const auto shape_attrs = [&](const std::vector<std::int64_t>& s) {
      const auto c = s.empty() ? 1 : s.back();
      return std::map<std::string, std::int64_t>{{"n", elements(s)}, {"rows", elements(s) / c}, {"cols", c}};
    };
    const auto compute = [&](ir::op fn, std::vector<ir::buffer_id> reads, std::map<std::string, std::int64_t> attrs) {
      const auto out = slot(i) >= 0 ? slot(i) : new_buffer(i, x.kind);
      b.compute(fn, name, std::move(reads), {out}, std::move(attrs));
    };
    switch (x.op) {
    case op_code::input:
    case op_code::param:
    case op_code::state: new_buffer(i, x.kind); break;
    case op_code::data:
      if (buf[i] < 0) new_buffer(i, x.kind);
      break;
    case op_code::repeat_in: {
      // No task: layer 0 reads the stack's input, layer i the output of layer i-1.
      const auto& r = p.repeats[x.block];
      slot(i) = cur_layer == 0 ? I(0) : layer_buf[static_cast<std::size_t>(r.out)][static_cast<std::size_t>(cur_layer - 1)];
      break;
    }
    case op_code::matmul: {
      // Operands as 2-D (or batched 2-D) matrices; the backward ones read a transposed operand.
      const bool ta = x.has(graph::flag_trans_a), tb = x.has(graph::flag_trans_b);
      const auto &sa = L(0), &sb = L(1);
      const bool batched = sa.size() >= 3 && sb.size() == sa.size();
      const auto rows = [&](const std::vector<std::int64_t>& s) { return batched ? s[s.size() - 2] : elements(s) / s.back(); };
      const std::int64_t batch = batched ? elements(sa) / (sa.back() * sa[sa.size() - 2]) : 1;
      const std::int64_t m_ = ta ? sa.back() : rows(sa), k_ = ta ? rows(sa) : sa.back();
      const std::int64_t n_ = tb ? rows(sb) : sb.back();
      const auto out = new_buffer(i, x.kind);
      b.matmul(name, I(0), I(1), out, m_, n_, k_, batch, ta, tb);
      break;
    }
    case op_code::add:
    case op_code::bias_add:
    case op_code::gelu:
    case op_code::relu:
    case op_code::silu:
    case op_code::mul:
    case op_code::swiglu:
    case op_code::gelu_grad:
    case op_code::relu_grad:
    case op_code::silu_grad:
    case op_code::layernorm:
    case op_code::layernorm_grad:
    case op_code::rmsnorm:
    case op_code::rmsnorm_grad:
    case op_code::softmax:
    case op_code::softmax_grad: {
      std::vector<ir::buffer_id> reads;
      for (int k = 0; k < x.n_in; ++k) reads.push_back(I(k));
      compute(x.op, std::move(reads), shape_attrs(out_shape));
      break;
    }
    case op_code::bias_grad: compute(ir::op::bias_grad, {I(0)}, shape_attrs(L(0))); break;
    case op_code::layernorm_grad_gamma:
    case op_code::rmsnorm_grad_gain: compute(x.op, {I(0), I(1)}, shape_attrs(L(0))); break;
    case op_code::swiglu_grad: {
      // dgate and dup packed; a copy per layer, as attention_grad's.
      auto packed = local[i];
      packed.insert(packed.begin(), 2);
      slot(i) = b.buffer(name, std::move(packed), ir::buffer_role::gradient, options.type);
      b.compute(x.op, name, {I(0), I(1), I(2)}, {slot(i)}, shape_attrs(L(0)));
      break;
    }
    case op_code::rope:
    case op_code::rope_grad: {
      if (head_dim < 1)
        fail(p.describe(static_cast<int>(i)) + ": rope takes head_dim from the program's causal_attention, and it has none");
      auto attrs = shape_attrs(out_shape);
      attrs["head_dim"] = head_dim;
      attrs["theta"] = options.rope_theta;
      compute(x.op, {I(0), I(1)}, attrs);
      break;
    }
    case op_code::attention:
    case op_code::attention_grad: {
      const auto &q = L(0), &k = L(1);
      const auto heads_here = q[2] / head_dim, kv_heads_here = k[2] / head_dim;
      if (heads_here < 1 || kv_heads_here < 1 || q[2] % head_dim != 0 || k[2] % head_dim != 0)
        fail(p.describe(static_cast<int>(i)) + ": " + std::to_string(options.heads) + " heads (" +
             std::to_string(global[static_cast<std::size_t>(x.in[1])][2] / head_dim) +
             " for k and v) cannot be split over the ranks");
      // Grouped-query attention: each rank's k/v heads serve its query heads in groups.
      std::map<std::string, std::int64_t> attrs{{"batch", q[0]},      {"seq", q[1]},
                                                {"heads", heads_here}, {"kv_heads", kv_heads_here},
                                                {"group", heads_here / kv_heads_here}, {"head_dim", head_dim},
                                                {"causal", 1}};
      const bool fwd = x.op == op_code::attention;
      if (!fwd) {
        // dq, dk, dv packed; a copy, because a repeated block lowers this node once per layer.
        slot(i) = b.buffer(name, {elements(q) + 2 * elements(k)}, ir::buffer_role::gradient, options.type);
      }
      const auto out = fwd ? new_buffer(i, x.kind) : slot(i);
      std::vector<ir::buffer_id> reads{I(0), I(1), I(2)};
      if (!fwd) reads.push_back(I(3));
      b.compute(x.op, name, reads, {out}, attrs);
      break;
    }
    case op_code::select: {
      // Part `dim` of a packed gradient: the parts are the gradients of the producer's operands
      // in order, each the size of its operand (k and v are smaller than q under GQA).
      const node& packed = p.nodes[static_cast<std::size_t>(x.in[0])];
      const auto size = static_cast<std::int64_t>(ir::size_of(options.type));
      std::int64_t offset = 0;
      for (int k = 0; k < x.dim; ++k) offset += elements(local[static_cast<std::size_t>(packed.in[k])]) * size;
      slot(i) = b.view(name, I(0), offset, elems * size, out_shape);
      break;
    }
    case op_code::embedding:
    case op_code::embedding_grad: {
      const auto& table = x.op == op_code::embedding ? L(1) : out_shape;
      int vocab_axis = -1;
      const auto& tspec = p.nodes[static_cast<std::size_t>(x.op == op_code::embedding ? x.in[1] : x.of)].spec;
      if (tspec.dims[0][0] >= 0) vocab_axis = axis_of[static_cast<std::size_t>(tspec.dims[0][0])];
      std::map<std::string, std::int64_t> attrs{{"tokens", elements(L(0))}, {"vocab", table[0]}, {"hidden", table[1]},
                                                {"vocab_axis", vocab_axis}};
      compute(x.op, {I(0), I(1)}, attrs);
      break;
    }
    case op_code::mse:
    case op_code::mse_grad: {
      auto attrs = shape_attrs(L(0));
      attrs["global_n"] = elements(global[static_cast<std::size_t>(x.in[0])]);
      compute(x.op, {I(0), I(1)}, attrs);
      break;
    }
    case op_code::cross_entropy:
    case op_code::cross_entropy_grad: {
      auto attrs = shape_attrs(L(0));
      attrs["global_rows"] = elements(global[static_cast<std::size_t>(x.in[1])]);
      compute(x.op, {I(0), I(1)}, attrs);
      break;
    }
    case op_code::vocab_ce_max: compute(x.op, {I(0)}, shape_attrs(L(0))); break;
    case op_code::vocab_ce_target: {
      auto attrs = shape_attrs(L(0));
      attrs["vocab_axis"] = vocab_axis_of(x.in[0]);
      compute(x.op, {I(0), I(1), I(2)}, attrs);
      break;
    }
    case op_code::vocab_ce_sumexp: compute(x.op, {I(0), I(1)}, shape_attrs(L(0))); break;
    case op_code::vocab_ce_loss: {
      auto attrs = shape_attrs(L(0));
      attrs["global_rows"] = elements(global[static_cast<std::size_t>(x.in[0])]);
      compute(x.op, {I(0), I(1)}, attrs);
      break;
    }
    case op_code::vocab_ce_grad: {
      auto attrs = shape_attrs(L(0));
      attrs["vocab_axis"] = vocab_axis_of(x.in[0]);
      attrs["global_rows"] = elements(global[static_cast<std::size_t>(x.in[1])]);
      compute(x.op, {I(0), I(1), I(2), I(3)}, attrs);
      break;
    }
    case op_code::shard_slice:
    case op_code::keep_one: {
      const int axis = axis_of[static_cast<std::size_t>(x.axis)];
      auto attrs = x.op == op_code::shard_slice
                       ? std::map<std::string, std::int64_t>{{"dim", x.dim}, {"parts", axis_size(x.axis)}, {"mesh_axis", axis}}
                       : std::map<std::string, std::int64_t>{{"mesh_axis", axis}};
      for (std::size_t d = 0; d < L(0).size(); ++d) attrs["in_dim" + std::to_string(d)] = L(0)[d];
      compute(x.op, {I(0)}, attrs);
      break;
    }
    case op_code::all_reduce:
    case op_code::all_gather:
    case op_code::reduce_scatter:
    case op_code::all_to_all: {
      const auto kind = x.op == op_code::all_reduce ? ir::op_kind::all_reduce
                        : x.op == op_code::all_gather ? ir::op_kind::all_gather
                        : x.op == op_code::reduce_scatter ? ir::op_kind::reduce_scatter
                                                          : ir::op_kind::all_to_all;
      const auto out = x.has(graph::flag_writes_param) ? (slot(i) = param_buffer(x)) : new_buffer(i, x.kind);
      const auto t = b.collective(kind, name, axis_of[static_cast<std::size_t>(x.axis)], I(0), out, -1,
                                  x.has(graph::flag_max) ? std::optional(ir::op::max) : std::nullopt);
      std::map<std::string, std::int64_t> attrs;
      if (x.op == op_code::all_gather) attrs["dim"] = x.dim2;
      if (x.op == op_code::reduce_scatter) attrs["dim"] = x.dim;
      if (x.op == op_code::all_to_all) {
        attrs["from_dim"] = x.dim2;
        attrs["to_dim"] = x.dim;
      }
      collective_attrs.emplace_back(t, std::move(attrs));
      break;
    }
    case op_code::sgd:
    case op_code::adamw: {
      // In place on the parameter (or on its shard, for ZeRO-1/2, before the gather).
      const bool in_place = x.has(graph::flag_writes_param);
      slot(i) = in_place ? param_buffer(x) : I(0);
      std::vector<ir::buffer_id> reads{I(0), I(1)}, writes{slot(i)};
      if (x.op == op_code::adamw) {
        reads.push_back(I(2));
        reads.push_back(I(3));
        writes.push_back(I(2));
        writes.push_back(I(3));
      }
      b.compute(x.op, name, reads, writes, {{"n", elems}});
      break;
    }
    default: fail("lowering: node " + std::to_string(i) + " '" + name + "' has an op the lowering does not know");
    }
  };

  // Nodes in order; a run of one block's nodes in one phase is emitted once per layer (backward
  // from the last layer down), so the layers chain through repeat_in and grad_in.
  for (std::size_t i = 0; i < n;) {
    const int k = p.nodes[i].block;
    if (k < 0) {
      emit(i++);
      continue;
    }
    std::size_t end = i;
    while (end < n && p.nodes[end].block == k && p.nodes[end].phase == p.nodes[i].phase) ++end;
    const int layers = depth[static_cast<std::size_t>(k)];
    const bool down = p.nodes[i].phase == ir::phase::backward;
    cur_block = k;
    for (int l = 0; l < layers; ++l) {
      cur_layer = down ? layers - 1 - l : l;
      for (std::size_t j = i; j < end; ++j) emit(j);
    }
    cur_block = cur_layer = -1;
    i = end;
  }
  auto g = std::move(b).finish();
  for (auto& [t, attrs] : collective_attrs)
    for (auto& [k, v] : attrs) g.tasks[static_cast<std::size_t>(t)].attrs[k] = v;
  // Only what the step exposes is computed: the loss, the leaves' gradients ("x.grad",
  // train::step::gradient) and the parameters and optimizer state (kept by their buffer role).
  // What goes is a repeat's layer-0 input gradient, with its collectives, when the stack's input
  // has none: the block computes its input's gradient for the layer below, which layer 0 lacks.
  std::vector<ir::buffer_id> observed{buf[static_cast<std::size_t>(p.loss)]};
  for (int l = 0; l < p.name_count; ++l) {
    const auto j = p.grad_of[l];
    if (j < 0) continue;
    if (buf[static_cast<std::size_t>(j)] >= 0) observed.push_back(buf[static_cast<std::size_t>(j)]);
    for (auto layer_grad : layer_buf[static_cast<std::size_t>(j)])
      if (layer_grad >= 0) observed.push_back(layer_grad);
  }
  return ir::remove_dead_tasks(g, observed);
}

} // namespace concerto
