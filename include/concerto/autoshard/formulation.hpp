#pragma once
/// @file
/// @brief The sharding problem of a program as one exact model: every op's strategies from the op
/// table's rules, what each costs and holds, solved by Z3 with a proved optimum, and written in the
/// IOPDDL contest's JSON format so that other solvers can be compared on our instances.
///
/// A node per traced subexpression (program::raw): a leaf's strategies are the specs it may take
/// (its free dims over the mesh's axes, its written dims as written); an op's are the layouts its
/// operands can reach it in, each answered by the op's sharding rule (graph::op_rule: the layout
/// each operand is brought to, the output's). An op's strategy thus names its operands' layouts,
/// and an edge from a producer says only that the producer's output is that layout: the
/// redistributions the compiler inserts before an op belong to the op's strategy, priced there.
/// So the model's feasible selections are exactly the shardings the compiler builds from leaf specs
/// (a `repeat` block returns the layout it takes: an edge from its input to its output says so),
/// and a block's layers share one strategy because the block is traced once.
///
/// A strategy's cost, per step in µs on the cost model: its compute forward and backward on this
/// rank's part (matmul, attention and convolution priced as the lowering's tasks are, the others by
/// the bytes they move), the collectives of the redistributions its rule asks for and of the
/// gradient's way back (a weight read replicated over an axis that splits the op sums its gradient
/// over it), and for a parameter its update and its ZeRO collectives; times the depth of its block.
/// Its usage: the bytes per rank it holds while its interval lasts, an activation from its forward
/// to its backward ([t, 2n − t) of a step of n nodes, × depth), a parameter the whole step with its
/// gradient and optimizer state (divided by the ZeRO axis as the stage says).
///
/// This is the additive model Alpa's ILP and the IOPDDL contest solve: no overlap, no contention.
/// autoshard::choose prices its best solutions again by the schedule they achieve (search.hpp).
///
/// @code
/// auto f = autoshard::formulate(step, mesh, shapes, model, {.memory_cap_bytes = 40LL << 30});
/// auto best = autoshard::solve(f, {.solutions = 3});
/// std::ofstream("gpt.json") << autoshard::to_iopddl(f, "gpt").dump();
/// @endcode

#include <concerto/autoshard/detail/leaves.hpp>
#include <concerto/cost/model.hpp>

#include <Cbc_C_Interface.h>
#include <nlohmann/json.hpp>
#include <z3++.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

namespace concerto::autoshard {

/// @brief One way a node runs: its operands' layouts as their producers give them, its output's,
/// what it costs per step and holds per rank.
struct strategy {
  pspec in[4]{};
  pspec out{};
  double cost_us = 0;
  double usage_bytes = 0;
};

/// @brief A traced subexpression and its strategies.
struct problem_node {
  int raw = -1;           ///< its node in program::raw
  std::string name;       ///< a leaf's name, else the op and its raw index ("matmul#12")
  int operands[4]{-1, -1, -1, -1}; ///< the problem nodes its operands are (a repeat's output also names its input)
  int n_in = 0;
  int depth = 1;          ///< the layers of its repeat, 1 outside one
  std::int64_t start = 0; ///< [start, end): when its usage is held, in node steps
  std::int64_t end = 0;
  std::vector<strategy> strategies;
  /// A `.to(...)` written with auto_: the dims written so (a bit per dim) and the layout as
  /// written, from which graph::kept_where_free gives what it makes when a choice leaves it open.
  std::uint8_t free = 0;
  pspec written{};
};

/// @brief The sharding problem of one program for one ZeRO stage.
struct problem {
  std::vector<problem_node> nodes;
  std::optional<std::int64_t> usage_limit; ///< bytes per rank (options::memory_cap_bytes)
  int zero_stage = 0;
  std::string zero_axis;
  axis_table axes{};                        ///< the program's, which the strategies' specs index
  std::vector<std::pair<int, std::string>> leaves; ///< the problem nodes of the leaves written auto_, by name
  /// Nodes formulated with their operands of one rank laid out alike (formulation_options::
  /// align_large_nodes): empty when the problem is the full one.
  std::vector<std::string> aligned;

  [[nodiscard]] std::size_t strategy_count() const noexcept {
    std::size_t n = 0;
    for (const auto& x : nodes) n += x.strategies.size();
    return n;
  }
  /// Whether every operand's layout is its producer's output under `pick` (one strategy per node).
  [[nodiscard]] bool consistent(const std::vector<int>& pick) const {
    for (std::size_t v = 0; v < nodes.size(); ++v)
      for (int k = 0; k < nodes[v].n_in; ++k) {
        const int u = nodes[v].operands[k];
        if (!(nodes[v].strategies[static_cast<std::size_t>(pick[v])].in[k] ==
              nodes[static_cast<std::size_t>(u)].strategies[static_cast<std::size_t>(pick[static_cast<std::size_t>(u)])].out))
          return false;
      }
    return true;
  }
  /// The objective of `pick`: the sum of its strategies' costs (infinite when inconsistent).
  [[nodiscard]] double cost_us(const std::vector<int>& pick) const {
    if (!consistent(pick)) return std::numeric_limits<double>::infinity();
    double total = 0;
    for (std::size_t v = 0; v < nodes.size(); ++v) total += nodes[v].strategies[static_cast<std::size_t>(pick[v])].cost_us;
    return total;
  }
  /// The largest usage at any instant under `pick`.
  [[nodiscard]] double peak_bytes(const std::vector<int>& pick) const {
    std::map<std::int64_t, double> delta;
    for (std::size_t v = 0; v < nodes.size(); ++v) {
      const double u = nodes[v].strategies[static_cast<std::size_t>(pick[v])].usage_bytes;
      delta[nodes[v].start] += u;
      delta[nodes[v].end] -= u;
    }
    double now = 0, peak = 0;
    for (const auto& [t, d] : delta) peak = std::max(peak, now += d);
    return peak;
  }
  /// The selection a sharding of the decided leaves and redistributions stands for, as
  /// graph::respecify reads it: a leaf it does not name as written (its first strategy), a
  /// redistribution it does not name as its value arrives (graph::kept_where_free), each op's
  /// strategy the one reading its producers' outputs; nothing when a spec is not among a node's
  /// strategies or the compiler refuses an op.
  [[nodiscard]] std::optional<std::vector<int>> pick_of(const graph::sharding_choice& c) const {
    std::vector<int> pick(nodes.size(), 0);
    std::vector<std::optional<pspec>> wanted(nodes.size());
    for (const auto& l : c.leaves) {
      const auto it = std::find_if(leaves.begin(), leaves.end(), [&](const auto& x) { return x.second == l.leaf; });
      if (it == leaves.end()) continue;
      pspec want;
      if (!detail::to_known_pspec(l.spec, axes, want)) return std::nullopt;
      wanted[static_cast<std::size_t>(it->first)] = want;
    }
    for (std::size_t v = 0; v < nodes.size(); ++v) {
      const auto& x = nodes[v];
      const auto reads_producers = [&](const strategy& s) {
        for (int k = 0; k < x.n_in; ++k) {
          const auto u = static_cast<std::size_t>(x.operands[k]);
          if (!(s.in[k] == nodes[u].strategies[static_cast<std::size_t>(pick[u])].out)) return false; // producers come first
        }
        return true;
      };
      const auto makes = [&](const strategy& s) {
        if (wanted[v]) return s.out == *wanted[v];
        if (x.free != 0) return s.out == graph::kept_where_free(x.written, x.free, s.in[0]);
        return true;
      };
      const auto& ss = x.strategies;
      const auto found = std::find_if(ss.begin(), ss.end(), [&](const strategy& s) { return reads_producers(s) && makes(s); });
      if (found == ss.end()) return std::nullopt;
      pick[v] = static_cast<int>(found - ss.begin());
    }
    return pick; // consistent: each op's strategy was found reading its producers' outputs
  }
  /// The leaf specs (and ZeRO stage) `pick` stands for: what graph::respecify compiles.
  [[nodiscard]] graph::sharding_choice choice(const std::vector<int>& pick) const {
    graph::sharding_choice c;
    for (const auto& [v, name] : leaves) {
      const auto at = static_cast<std::size_t>(v);
      c.leaves.push_back({name, to_value(nodes[at].strategies[static_cast<std::size_t>(pick[at])].out, axes)});
    }
    c.zero_stage = zero_stage;
    c.zero_axis = zero_stage > 0 ? zero_axis : std::string{};
    for (int a = 0; a < axes.count; ++a) c.axes.emplace_back(axes.names[a].view()); // the order the strategies were laid out in
    return c;
  }
};

/// @brief How large formulate lets one node's strategies grow (formulation_options::limits,
/// options::exact.limits).
struct formulation_limits {
  std::size_t max_strategies = 20000; ///< per node, of those the rules accept: more is refused, naming the node
  /// Per node, the combinations of its operands' layouts tried (attention on three split axes:
  /// 61 layouts of each of q, k and v): more is refused, naming the node.
  std::size_t max_combinations = 2000000;
  /// A node over either limit is formulated again with its operands of one rank laid out alike
  /// (attention's q, k and v: 61 combinations instead of 226981, of which the rule accepted
  /// 64603), and listed in problem::aligned: the problem is then a restriction, and its optimum
  /// an upper bound of the full problem's. Without it such a node is refused.
  bool align_large_nodes = true;
};

/// @brief How formulate builds the problem.
struct formulation_options {
  std::optional<std::int64_t> memory_cap_bytes;
  lower_options lower{};   ///< depths, heads, precision, as the step will be lowered
  int zero_stage = 0;      ///< the ZeRO stage the problem is for (0-3) ...
  std::string zero_axis;   ///< ... over this mesh axis
  formulation_limits limits{};
};

namespace detail {

// The mesh axis (size, link) of each of the program's axes; size 1 for one the mesh lacks.
inline std::vector<ir::mesh_axis> program_axes(const axis_table& t, const mesh& m) {
  std::vector<ir::mesh_axis> out;
  for (int a = 0; a < t.count; ++a) {
    ir::mesh_axis x{std::string(t.names[a].view()), 1, ir::link_class::intra_node};
    for (const auto& ma : m.axes())
      if (ma.name == x.name) x = ma;
    out.push_back(x);
  }
  return out;
}

// The program's axis table with the mesh's axes it does not name yet (a program whose specs are
// all auto_ names none); one that overflows max_axes is left out.
inline axis_table with_mesh_axes(axis_table t, const mesh& m) {
  for (const auto& a : split_axes(m)) t.intern(axis_name(a.name));
  return t;
}

// Prices strategies of one program: shapes, sizes, the cost model.
class strategy_pricer {
public:
  strategy_pricer(std::vector<ir::mesh_axis> axes, const cost::model& model, const lower_options& lower, op_code optimizer)
      : axes_(std::move(axes)), model_(model), lower_(lower), optimizer_(optimizer) {}

  [[nodiscard]] double parts(const pspec& s, int d) const {
    double n = 1;
    for (const auto a : s.dims[d])
      if (a >= 0) n *= axes_[static_cast<std::size_t>(a)].size;
    return n;
  }
  [[nodiscard]] double local_elements(const std::vector<std::int64_t>& shape, const pspec& s) const {
    double n = 1;
    for (std::size_t d = 0; d < shape.size(); ++d) n *= std::ceil(static_cast<double>(shape[d]) / parts(s, static_cast<int>(d)));
    return n;
  }
  [[nodiscard]] double working_bytes() const { return static_cast<double>(ir::size_of(lower_.precision.working)); }

  // The collectives that take a tensor of `shape` from layout `from` to `to`, priced one after
  // the other; infinite when the compiler refuses the redistribution (keeps_axis_order).
  [[nodiscard]] double redistribution_us(const std::vector<std::int64_t>& shape, const pspec& from, const pspec& to,
                                         double bytes_per_element) const {
    if (from == to) return 0;
    const auto plan = plan_redistribution(from, to, static_cast<int>(axes_.size()));
    double total = 0;
    pspec at = from;
    for (int i = 0; i < plan.size; ++i) {
      const auto& st = plan.steps[i];
      if (!keeps_axis_order(at, st)) return std::numeric_limits<double>::infinity();
      const pspec next = apply(at, st);
      const auto& ax = axes_[static_cast<std::size_t>(st.axis)];
      const double before = local_elements(shape, at) * bytes_per_element, after = local_elements(shape, next) * bytes_per_element;
      switch (st.kind) {
      case redist_kind::all_reduce: total += collective(ir::op_kind::all_reduce, before, ax); break;
      case redist_kind::all_gather: total += collective(ir::op_kind::all_gather, after, ax); break;
      case redist_kind::reduce_scatter: total += collective(ir::op_kind::reduce_scatter, before, ax); break;
      case redist_kind::all_to_all: total += collective(ir::op_kind::all_to_all, before, ax); break;
      default: break; // local slices and keep_one move nothing between ranks
      }
      at = next;
    }
    return at == to ? total : std::numeric_limits<double>::infinity();
  }

  // Compute of one op on this rank: its forward task and, when it is differentiated, its
  // gradient tasks (one per operand that takes one, as the op table's recipe says). `split`: how
  // many ranks share the work; `in_elements`, `out_elements`: this rank's parts.
  [[nodiscard]] double compute_us(const graph::node& x, const std::vector<std::vector<std::int64_t>>& in,
                                  const std::vector<std::int64_t>& out, double split, const std::vector<double>& in_elements,
                                  double out_elements, const std::vector<bool>& operand_grads) const {
    const auto elements = [](const std::vector<std::int64_t>& sh) {
      double n = 1;
      for (auto e : sh) n *= static_cast<double>(e);
      return n;
    };
    double moved = out_elements;
    for (const double e : in_elements) moved += e;
    const auto info = ir::info(x.op);
    ir::task t;
    t.kind = info.kind;
    t.fn = x.op;
    t.bytes = moved * working_bytes();
    double backward = 0; // the gradient tasks' time as a multiple of the forward's (products, attention)
    std::size_t grads = 0;
    for (const bool g : operand_grads) grads += g;
    if (info.rule == ir::sharding::contract && !in[0].empty()) {
      t.fn = ir::op::none;
      t.flops = 2 * elements(out) * static_cast<double>(in[0].back()) / split;
      const auto m = static_cast<std::int64_t>(elements(out) / std::max<double>(1, static_cast<double>(out.back())) / split);
      t.attrs = {{"m", std::max<std::int64_t>(1, m)}, {"n", out.back()}, {"k", in[0].back()}};
      backward = static_cast<double>(grads);
    } else if (info.rule == ir::sharding::attention && in[0].size() == 3) {
      const double b = static_cast<double>(in[0][0]), seq = static_cast<double>(in[0][1]), h = static_cast<double>(in[0][2]);
      t.flops = 4 * b * seq * seq * h * (x.has(graph::flag_bidirectional) ? 1.0 : 0.5) / split;
      t.attrs = {{"head_dim", std::max<std::int64_t>(1, in[0][2] / std::max<std::int64_t>(1, lower_.heads))}};
      backward = grads > 0 ? 2.5 : 0.0;
    } else if (info.rule == ir::sharding::convolution && in[1].size() == 4) {
      t.flops = 2 * elements(out) * static_cast<double>(in[1][0] * in[1][1] * in[1][2]) / split;
      backward = static_cast<double>(grads);
    } else {
      t.flops = info.flops == ir::flops_rule::per_input && !in_elements.empty()
                    ? info.flops_per_element *
                          in_elements[std::min<std::size_t>(in_elements.size() - 1, static_cast<std::size_t>(info.flops_read))]
                    : info.flops_per_element * out_elements;
    }
    const double forward = model_.compute_us(t);
    double total = forward * (1 + backward);
    if (backward == 0 && info.grad == ir::backward::terms)
      for (std::size_t k = 0; k < operand_grads.size() && k < info.terms.size(); ++k) {
        if (!operand_grads[k] || info.terms[k].fn == ir::op::none) continue;
        const auto g = ir::info(info.terms[k].fn);
        ir::task gt;
        gt.kind = g.kind;
        gt.fn = info.terms[k].fn;
        gt.flops = g.flops_per_element * in_elements[k];
        gt.bytes = (out_elements + 2 * in_elements[k]) * working_bytes();
        total += model_.compute_us(gt);
      }
    else if (backward == 0 && grads > 0)
      total += forward * 2; // a packed or fused gradient: about twice its forward's traffic
    return total;
  }

  // A parameter's update, and its ZeRO collectives, per step.
  [[nodiscard]] double update_us(double local_elements, double zero_parts, int stage, const ir::mesh_axis* zero) const {
    const auto info = ir::info(optimizer_);
    ir::task t;
    t.kind = info.kind;
    t.fn = optimizer_;
    const double shard = stage >= 1 ? local_elements / zero_parts : local_elements;
    t.flops = info.flops_per_element * shard;
    t.bytes = shard * (optimizer_ == op_code::adamw ? 28.0 : 12.0); // parameter, gradient (and moments) read and written
    double total = model_.compute_us(t);
    if (stage >= 1 && zero) {
      const double bytes = local_elements * working_bytes();
      total += collective(ir::op_kind::all_gather, bytes, *zero) * (stage == 3 ? 2 : 1);
    }
    return total;
  }
  // A parameter's bytes per rank: the working copy, its gradient, the optimizer state and an f32 master.
  [[nodiscard]] double parameter_bytes(double local_elements, double zero_parts, int stage) const {
    const double w = working_bytes(), grad = lower_.precision.accumulate_gradients_in_f32 ? 4.0 : w;
    const double state = (optimizer_ == op_code::adamw ? 8.0 : 0.0) + (lower_.precision.lowered() ? 4.0 : 0.0);
    return local_elements * ((stage >= 3 ? w / zero_parts : w) + (stage >= 2 ? grad / zero_parts : grad) +
                             (stage >= 1 ? state / zero_parts : state));
  }

  [[nodiscard]] double collective(ir::op_kind kind, double bytes, const ir::mesh_axis& ax) const {
    return model_.collective_us(kind, bytes, ax.size, ax.link);
  }
  [[nodiscard]] const std::vector<ir::mesh_axis>& axes() const noexcept { return axes_; }

private:
  std::vector<ir::mesh_axis> axes_;
  const cost::model& model_;
  lower_options lower_;
  op_code optimizer_;
};

// Builds the strategies of one traced node from its operands' layouts.
template <std::size_t N>
class formulator {
public:
  formulator(const graph::program<N>& p, const mesh& m, const shape_map& shapes, const cost::model& model,
             const formulation_options& o)
      : p_(p), m_(m), shapes_(shapes), o_(o), axes_(with_mesh_axes(p.axes, m)),
        pricer_(program_axes(axes_, m), model, o.lower, p.optimizer),
        global_(raw_shapes(p, shapes, o.lower)), node_of_(static_cast<std::size_t>(p.raw_size), -1),
        needs_grad_(static_cast<std::size_t>(p.raw_size), false) {
    if (o.zero_stage < 0 || o.zero_stage > 3) fail("formulate: ZeRO stage " + std::to_string(o.zero_stage) + "; give 0 to 3");
    if (o.zero_stage > 0 && (zero_axis_ = axes_.find(axis_name(o.zero_axis))) < 0)
      fail("formulate: ZeRO over '" + o.zero_axis + "', an axis neither the program nor the mesh has; name one of the mesh's axes");
    for (int k = 0; k < p.repeat_count; ++k) depth_.push_back(graph::detail::repeat_depth(p, k, o.lower));
  }

  problem run() {
    problem f;
    f.axes = axes_;
    f.usage_limit = o_.memory_cap_bytes;
    f.zero_stage = o_.zero_stage;
    f.zero_axis = o_.zero_stage > 0 ? o_.zero_axis : std::string{};
    const auto free = free_leaves(p_, shapes_, global_);
    for (int r = 0; r < p_.raw_size; ++r) {
      const auto& x = p_.raw[r];
      problem_node v;
      v.raw = r;
      v.depth = x.block >= 0 ? depth_[static_cast<std::size_t>(x.block)] : 1;
      if (graph::is_leaf(x.op)) {
        v.name = std::string(p_.names[x.name].view());
        const auto it = std::find_if(free.begin(), free.end(), [&](const free_leaf& l) { return l.raw == r; });
        if (it != free.end()) f.leaves.emplace_back(static_cast<int>(f.nodes.size()), v.name);
        leaf_strategies(v, it != free.end() ? &*it : nullptr);
        needs_grad_[static_cast<std::size_t>(r)] = graph::leaf_needs_grad(x);
      } else {
        v.name = std::string(ir::to_string(x.op)) + "#" + std::to_string(r);
        const auto it = std::find_if(free.begin(), free.end(), [&](const free_leaf& l) { return l.raw == r; });
        std::vector<pspec> decided; // a .to written with auto_: the layouts it may make
        if (it != free.end()) {
          v.name = it->name;
          v.free = x.free;
          v.written = x.use;
          f.leaves.emplace_back(static_cast<int>(f.nodes.size()), v.name);
          decided = layouts_of(*it);
        }
        for (int k = 0; k < x.n_in; ++k) {
          v.operands[v.n_in++] = node_of_[static_cast<std::size_t>(x.in[k])];
          if (needs_grad_[static_cast<std::size_t>(x.in[k])]) needs_grad_[static_cast<std::size_t>(r)] = true;
        }
        if (x.op == op_code::repeat_out) v.operands[v.n_in++] = node_of_[static_cast<std::size_t>(repeat_of_out(r).raw_in)];
        if (!op_strategies(v, f, decided, false) && o_.limits.align_large_nodes) {
          f.aligned.push_back(v.name);
          op_strategies(v, f, decided, true);
        }
        if (v.strategies.empty())
          fail("automatic sharding's formulation: no layout of its operands lets '" + v.name +
               "' be built (the compiler's rules refuse every one)");
      }
      node_of_[static_cast<std::size_t>(r)] = static_cast<int>(f.nodes.size());
      f.nodes.push_back(std::move(v));
    }
    // Usage intervals: an activation from its forward to its backward, a parameter the whole step.
    const auto n = static_cast<std::int64_t>(f.nodes.size());
    for (std::int64_t t = 0; t < n; ++t) {
      auto& v = f.nodes[static_cast<std::size_t>(t)];
      const auto& x = p_.raw[v.raw];
      const bool whole_step = x.op == op_code::param;
      v.start = whole_step ? 0 : t;
      v.end = whole_step ? 2 * n : needs_grad_[static_cast<std::size_t>(v.raw)] ? 2 * n - t : t + 1;
    }
    return f;
  }

private:
  const graph::program<N>& p_;
  const mesh& m_;
  const shape_map& shapes_;
  const formulation_options& o_;
  axis_table axes_; // the program's axes, then the mesh's others: a decided spec may name any
  strategy_pricer pricer_;
  std::vector<std::vector<std::int64_t>> global_;
  std::vector<int> node_of_;
  std::vector<bool> needs_grad_;
  std::vector<int> depth_;
  int zero_axis_ = -1;

  [[nodiscard]] const std::vector<std::int64_t>& shape(int raw) const { return global_[static_cast<std::size_t>(raw)]; }
  [[nodiscard]] const graph::repeat_info& repeat_of_out(int r) const {
    for (int k = 0; k < p_.repeat_count; ++k)
      if (p_.repeats[k].raw_out == r) return p_.repeats[k];
    fail("automatic sharding's formulation: a repeat's end without its repeat (a bug of concerto's)");
  }
  // A pending sum the program pinned, as the compiler marks it (graph::flag_pinned): a leaf or a
  // .to(...) written with partial, and a stack's entry reading one.
  [[nodiscard]] bool pinned(int raw) const {
    const auto& x = p_.raw[raw];
    if (x.op == op_code::repeat_in) return pinned(x.in[0]);
    return (graph::is_leaf(x.op) || x.op == op_code::to) && x.use.has_partial();
  }

  // Every layout a decided leaf or .to may take (leaf_specs), indexed by the problem's axes.
  [[nodiscard]] std::vector<pspec> layouts_of(const free_leaf& l) const {
    std::vector<pspec> out;
    for (const auto& s : leaf_specs(l, split_axes(m_)))
      if (pspec ps; to_known_pspec(s, axes_, ps)) out.push_back(ps);
    return out;
  }

  void leaf_strategies(problem_node& v, const free_leaf* free) {
    const auto& x = p_.raw[v.raw];
    const auto layouts = free ? layouts_of(*free) : std::vector<pspec>{x.use};
    const double bytes = x.op == op_code::data ? 8.0 : pricer_.working_bytes();
    for (const auto& l : layouts) {
      strategy s;
      s.out = l;
      const double local = pricer_.local_elements(shape(v.raw), l);
      if (x.op == op_code::param) {
        const bool zero_applies = zero_axis_ >= 0 && l.state(zero_axis_) == state_replicated;
        const double parts = zero_applies ? pricer_.axes()[static_cast<std::size_t>(zero_axis_)].size : 1.0;
        const ir::mesh_axis* zero = zero_applies ? &pricer_.axes()[static_cast<std::size_t>(zero_axis_)] : nullptr;
        s.cost_us = pricer_.update_us(local, parts, zero ? o_.zero_stage : 0, zero) * v.depth;
        s.usage_bytes = pricer_.parameter_bytes(local, parts, zero ? o_.zero_stage : 0) * v.depth;
      } else {
        s.usage_bytes = local * bytes * v.depth;
      }
      v.strategies.push_back(s);
    }
  }

  // The gradient's way back for operand k: it arrives laid out as the operand was read, summed
  // over the axes that split the op but not the operand, and goes to the producer's layout (a
  // parameter's ZeRO shard from stage 2).
  [[nodiscard]] double gradient_us(const problem_node& v, int k, const pspec& read, const pspec& need, const pspec& out) const {
    const int raw_in = p_.raw[v.raw].in[k];
    if (!needs_grad_[static_cast<std::size_t>(raw_in)]) return 0;
    const int A = axes_.count;
    pspec arrives = need.without_partial();
    for (int a = 0; a < A; ++a)
      if (need.state(a) == state_replicated && out.state(a) != state_replicated)
        arrives.partial = static_cast<std::uint8_t>(arrives.partial | 1u << a);
    pspec target = read.without_partial();
    if (p_.raw[raw_in].op == op_code::param && o_.zero_stage >= 2 && zero_axis_ >= 0)
      if (const int d = graph::detail::work<1, 1>::zero_split_dim(target, zero_axis_); d >= 0)
        target.dims[d][target.dims[d][0] >= 0 ? 1 : 0] = static_cast<std::int8_t>(zero_axis_);
    const double bytes = o_.lower.precision.reduce_gradients_in_f32 ? 4.0 : pricer_.working_bytes();
    return pricer_.redistribution_us(shape(raw_in), arrives, target, bytes);
  }

  // The operand layouts to try: each distinct output layout of each producer.
  [[nodiscard]] std::vector<std::vector<pspec>> operand_layouts(const problem_node& v, const problem& f) const {
    std::vector<std::vector<pspec>> out;
    for (int k = 0; k < v.n_in; ++k) {
      std::vector<pspec> seen;
      for (const auto& s : f.nodes[static_cast<std::size_t>(v.operands[k])].strategies)
        if (std::find(seen.begin(), seen.end(), s.out) == seen.end()) seen.push_back(s.out);
      out.push_back(std::move(seen));
    }
    return out;
  }

  // Fills v.strategies: each combination of its operands' layouts the rules accept; `aligned`:
  // the operands of one rank take one layout together (a layout each of their producers makes).
  // False (v.strategies left empty) when the combinations or the accepted strategies exceed the
  // options' limits and aligning may still help; a node that is over them aligned is refused.
  // `decided`: for a .to written with auto_, the layouts it may make (else empty).
  bool op_strategies(problem_node& v, const problem& f, const std::vector<pspec>& decided, bool aligned) {
    const auto layouts = operand_layouts(v, f);
    // Groups of operands that move together, and the layouts each group may take.
    std::vector<std::vector<int>> groups;
    std::vector<std::vector<pspec>> choices;
    for (int k = 0; k < v.n_in; ++k) {
      const auto& own = layouts[static_cast<std::size_t>(k)];
      const auto joined = std::find_if(groups.begin(), groups.end(), [&](const std::vector<int>& g) {
        return aligned && !own.empty() && !layouts[static_cast<std::size_t>(g.front())].empty() &&
               own.front().rank == layouts[static_cast<std::size_t>(g.front())].front().rank;
      });
      if (joined == groups.end()) {
        groups.push_back({k});
        choices.push_back(own);
        continue;
      }
      joined->push_back(k);
      auto& common = choices[static_cast<std::size_t>(joined - groups.begin())];
      std::erase_if(common, [&](const pspec& l) { return std::find(own.begin(), own.end(), l) == own.end(); });
    }
    std::size_t combos = 1;
    for (const auto& c : choices) combos *= std::max<std::size_t>(1, c.size());
    const auto over = [&](std::size_t n, std::size_t limit, const char* what, const char* option) {
      if (n <= limit) return false;
      v.strategies.clear();
      if (!aligned && o_.limits.align_large_nodes) return true;
      fail("automatic sharding's formulation: '" + v.name + "' has " + std::to_string(n) + " " + what + ", over " +
           std::to_string(limit) + " (formulation_limits::" + option + (aligned ? ", with its operands aligned" : "") +
           "); fix some leaves' specs or raise the limit");
    };
    if (over(combos, o_.limits.max_combinations, "combinations of operand layouts", "max_combinations")) return false;
    std::vector<std::size_t> at(choices.size(), 0);
    for (bool more = std::none_of(choices.begin(), choices.end(), [](const auto& c) { return c.empty(); }); more;) {
      strategy s;
      for (std::size_t g = 0; g < groups.size(); ++g)
        for (const int k : groups[g]) s.in[k] = choices[g][at[g]];
      bool same_producer_alike = true;
      for (int a = 0; a < v.n_in; ++a)
        for (int b = a + 1; b < v.n_in; ++b)
          if (v.operands[a] == v.operands[b] && !(s.in[a] == s.in[b])) same_producer_alike = false;
      if (same_producer_alike && decided.empty() && answer(v, s)) v.strategies.push_back(s);
      for (const auto& out : decided) { // a decided .to (one operand): each layout it may be given
        strategy d = s;
        d.out = out;
        if (answer(v, d)) v.strategies.push_back(d);
      }
      std::size_t i = 0;
      while (i < at.size() && ++at[i] == choices[i].size()) at[i++] = 0;
      more = i < at.size();
    }
    return !over(v.strategies.size(), o_.limits.max_strategies, "strategies the rules accept", "max_strategies");
  }

  // The strategy of v reading s.in: its output and price; false when the compiler refuses it.
  bool answer(const problem_node& v, strategy& s) const {
    const auto& x = p_.raw[v.raw];
    const auto& out_shape = shape(v.raw);
    const double w = pricer_.working_bytes();
    if (x.op == op_code::to) {
      if (s.in[0].rank != x.use.rank) return false;
      if (x.free == 0) s.out = x.use; // else the layout decided (op_strategies)
      s.cost_us = pricer_.redistribution_us(out_shape, s.in[0], s.out, w) + gradient_us(v, 0, s.in[0], s.out, s.out);
    } else if (x.op == op_code::repeat_in) {
      s.out = pinned(x.in[0]) ? s.in[0] : s.in[0].without_partial();
      s.cost_us = pricer_.redistribution_us(out_shape, s.in[0], s.out, w);
    } else if (x.op == op_code::repeat_out) {
      const pspec& want = s.in[1];
      if (!(s.in[0] == want) && (pinned(x.in[0]) || !(s.in[0].without_partial() == want))) return false;
      s.out = want;
      s.cost_us = pricer_.redistribution_us(out_shape, s.in[0], want, w) * v.depth;
    } else {
      return rule_strategy(v, s);
    }
    s.usage_bytes = pricer_.local_elements(out_shape, s.out) * w * v.depth;
    return std::isfinite(s.cost_us);
  }

  bool rule_strategy(const problem_node& v, strategy& s) const {
    const auto& x = p_.raw[v.raw];
    std::uint8_t pins = 0;
    for (int k = 0; k < x.n_in; ++k)
      if (pinned(x.in[k])) pins = static_cast<std::uint8_t>(pins | 1u << k);
    const bool routed = x.n_in > 1 && p_.raw[x.in[1]].op == op_code::moe_route;
    const int A = axes_.count;
    const auto a = graph::op_rule(x, s.in, pins, A, routed);
    if (a.specs.err != errc::none) return false;
    const auto& need = a.specs.need;
    s.out = a.specs.out;
    const double w = pricer_.working_bytes();
    double split = 1, cost = 0;
    std::vector<double> in_elements;
    std::vector<bool> operand_grads;
    for (int ax = 0; ax < A; ++ax) {
      bool splits = s.out.state(ax) >= 0;
      for (int k = 0; k < x.n_in; ++k) splits = splits || need[k].state(ax) >= 0;
      if (splits) split *= pricer_.axes()[static_cast<std::size_t>(ax)].size;
    }
    std::vector<std::vector<std::int64_t>> in_shapes;
    for (int k = 0; k < x.n_in; ++k) {
      const auto& sh = shape(x.in[k]);
      in_shapes.push_back(sh);
      const double bytes = p_.raw[x.in[k]].op == op_code::data ? 8.0 : w;
      cost += pricer_.redistribution_us(sh, s.in[k], need[k], bytes) + gradient_us(v, k, s.in[k], need[k], s.out);
      in_elements.push_back(pricer_.local_elements(sh, need[k]));
      operand_grads.push_back(needs_grad_[static_cast<std::size_t>(x.in[k])]);
    }
    const auto& out_shape = shape(v.raw);
    cost += pricer_.compute_us(x, in_shapes, out_shape, split, in_elements, pricer_.local_elements(out_shape, s.out), operand_grads);
    if (a.builds == graph::rule_builds::vocab_parallel_ce) { // the row maxima, the targets and the sums of exponentials
      const int vocab_axis = need[0].dims[need[0].rank - 1][0];
      const auto& ax = pricer_.axes()[static_cast<std::size_t>(vocab_axis)];
      const double rows = pricer_.local_elements(shape(x.in[1]), need[1]) * 4.0;
      cost += 3 * pricer_.collective(ir::op_kind::all_reduce, rows, ax);
    } else if (a.builds == graph::rule_builds::batchnorm) { // the statistics, summed over the axes splitting the rows
      for (int ax = 0; ax < A; ++ax)
        if (const int st = need[0].state(ax); st >= 0 && st < need[0].rank - 1)
          cost += 2 * pricer_.collective(ir::op_kind::all_reduce, 2.0 * static_cast<double>(out_shape.back()) * 4.0,
                                       pricer_.axes()[static_cast<std::size_t>(ax)]);
    }
    s.cost_us = cost * v.depth;
    s.usage_bytes = pricer_.local_elements(out_shape, s.out) * w * v.depth;
    return std::isfinite(s.cost_us); // a redistribution the compiler refuses
  }

};

} // namespace detail

/// @brief The sharding problem of `p` (its leaves written auto_ free, the others as written) on
/// mesh `m` with `shapes`, priced on `model`, for one ZeRO stage; see the file comment. Throws
/// concerto::error naming what is missing (a shape, a depth) or a node with too many strategies.
template <std::size_t N>
[[nodiscard]] problem formulate(const graph::program<N>& p, const mesh& m, const shape_map& shapes, const cost::model& model,
                                const formulation_options& o = {}) {
  return detail::formulator<N>(p, m, shapes, model, o).run();
}

/// @brief The solver of the integer program: COIN-OR CBC (branch and cut on the LP relaxation,
/// which the consistency rows make tight; Alpa's solver) or Z3's optimizer (MaxSAT, each cost a
/// soft constraint). CBC is the default: on GPT's problem it proves the optimum of every ZeRO
/// stage where Z3 runs out of time (docs/performance.md, "exact formulation").
enum class mip_solver : std::uint8_t { cbc, z3 };

/// @brief How solve searches.
struct solve_options {
  int solutions = 1;          ///< the best this many distinct leaf choices, each the optimum once the ones before are excluded
  double time_limit_s = 20;   ///< per solution; the best found so far is returned with its bound when it ends
  mip_solver solver = mip_solver::cbc;
};

/// @brief One solution: a strategy per node.
struct solution {
  std::vector<int> pick;
  double cost_us = 0;          ///< the objective (problem::cost_us)
  double lower_bound_us = 0;   ///< no consistent selection within the limit costs less (= cost_us when proved)
  bool proved = false;         ///< the solver proved it optimal (among selections unlike the earlier solutions)
  double seconds = 0;
  [[nodiscard]] double gap() const noexcept { return cost_us > 0 ? (cost_us - lower_bound_us) / cost_us : 0.0; }
};

/// @brief What solve found: the solutions, best first (none when nothing fits the cap).
struct solved {
  std::vector<solution> solutions;
  bool infeasible = false; ///< no selection fits the usage limit
};

namespace detail {
// Costs and usages as the integers the IOPDDL format takes (and Z3's weights): nanoseconds, KiB (rounded up).
inline std::int64_t to_ns(double us) { return static_cast<std::int64_t>(std::llround(us * 1000.0)); }
inline std::int64_t to_kib(double bytes) { return static_cast<std::int64_t>(std::ceil(bytes / 1024.0)); }
// Every layout the producer u makes or consumer v reads as operand k.
inline std::vector<pspec> layouts_between(const problem& f, std::size_t u, std::size_t v, int k) {
  std::vector<pspec> out;
  const auto add = [&](const pspec& l) {
    if (std::find(out.begin(), out.end(), l) == out.end()) out.push_back(l);
  };
  for (const auto& s : f.nodes[u].strategies) add(s.out);
  for (const auto& s : f.nodes[v].strategies) add(s.in[k]);
  return out;
}

// The integer program as rows over one 0/1 column per strategy (column = node's offset + index):
// exactly one strategy per node; for each operand and each layout either side has, the consumer
// reads it exactly when the producer makes it (given one strategy per node this is the pair's
// consistency, in its tightest linear form); the usage at every interval start within the
// limit (KiB); one row per excluded leaf choice (at most all but one of its leaves alike).
struct linear_row {
  std::vector<int> cols;
  std::vector<double> coefs;
  char sense = 'E'; // 'E' equal, 'L' at most
  double rhs = 0;
};
struct integer_program {
  std::vector<std::size_t> offset; // first column of each node
  std::size_t columns = 0;
  std::vector<double> cost_us;     // per column
  std::vector<linear_row> rows;
};
inline integer_program to_integer_program(const problem& f, const std::vector<std::vector<int>>& excluded) {
  integer_program ip;
  for (const auto& n : f.nodes) {
    ip.offset.push_back(ip.columns);
    for (const auto& s : n.strategies) ip.cost_us.push_back(s.cost_us);
    ip.columns += n.strategies.size();
  }
  const auto col = [&](std::size_t v, std::size_t i) { return static_cast<int>(ip.offset[v] + i); };
  for (std::size_t v = 0; v < f.nodes.size(); ++v) {
    linear_row one{.sense = 'E', .rhs = 1};
    for (std::size_t i = 0; i < f.nodes[v].strategies.size(); ++i) {
      one.cols.push_back(col(v, i));
      one.coefs.push_back(1);
    }
    ip.rows.push_back(std::move(one));
    for (int k = 0; k < f.nodes[v].n_in; ++k) {
      const auto u = static_cast<std::size_t>(f.nodes[v].operands[k]);
      for (const auto& layout : layouts_between(f, u, v, k)) {
        linear_row r{.sense = 'E', .rhs = 0};
        for (std::size_t j = 0; j < f.nodes[v].strategies.size(); ++j)
          if (f.nodes[v].strategies[j].in[k] == layout) r.cols.push_back(col(v, j)), r.coefs.push_back(1);
        for (std::size_t i = 0; i < f.nodes[u].strategies.size(); ++i)
          if (f.nodes[u].strategies[i].out == layout) r.cols.push_back(col(u, i)), r.coefs.push_back(-1);
        ip.rows.push_back(std::move(r));
      }
    }
  }
  if (f.usage_limit) {
    std::vector<std::int64_t> starts;
    for (const auto& n : f.nodes) starts.push_back(n.start);
    std::sort(starts.begin(), starts.end());
    starts.erase(std::unique(starts.begin(), starts.end()), starts.end());
    for (const auto t : starts) {
      linear_row r{.sense = 'L', .rhs = static_cast<double>(*f.usage_limit / 1024)};
      for (std::size_t v = 0; v < f.nodes.size(); ++v)
        if (f.nodes[v].start <= t && t < f.nodes[v].end)
          for (std::size_t i = 0; i < f.nodes[v].strategies.size(); ++i)
            if (const auto kib = to_kib(f.nodes[v].strategies[i].usage_bytes); kib > 0)
              r.cols.push_back(col(v, i)), r.coefs.push_back(static_cast<double>(kib));
      if (!r.cols.empty()) ip.rows.push_back(std::move(r));
    }
  }
  for (const auto& pick : excluded) {
    linear_row r{.sense = 'L', .rhs = static_cast<double>(f.leaves.size()) - 1};
    for (const auto& [v, name] : f.leaves)
      r.cols.push_back(col(static_cast<std::size_t>(v), static_cast<std::size_t>(pick[static_cast<std::size_t>(v)]))), r.coefs.push_back(1);
    ip.rows.push_back(std::move(r));
  }
  return ip;
}

struct one_solve {
  std::vector<double> columns; // the solution's column values; empty when none was found
  bool proved = false, infeasible = false;
  double lower_bound_us = 0;
};

inline one_solve solve_cbc(const integer_program& ip, double time_limit_s) {
  // CBC 2.10 is not safe to run from two threads at once (two solves in parallel lose solutions):
  // one at a time per process.
  static std::mutex one_at_a_time;
  const std::lock_guard lock(one_at_a_time);
  std::unique_ptr<Cbc_Model, void (*)(Cbc_Model*)> m(Cbc_newModel(), Cbc_deleteModel);
  Cbc_setLogLevel(m.get(), 0);
  for (std::size_t c = 0; c < ip.columns; ++c) Cbc_addCol(m.get(), "", 0.0, 1.0, ip.cost_us[c], 1, 0, nullptr, nullptr);
  for (const auto& r : ip.rows)
    Cbc_addRow(m.get(), "", static_cast<int>(r.cols.size()), r.cols.data(), r.coefs.data(), r.sense, r.rhs);
  Cbc_setMaximumSeconds(m.get(), std::max(0.1, time_limit_s));
  Cbc_setAllowableGap(m.get(), 1e-6); // µs: stop only when the bound meets the best solution
  Cbc_solve(m.get());
  one_solve out;
  out.infeasible = Cbc_isProvenInfeasible(m.get()) != 0;
  if (const double* x = Cbc_bestSolution(m.get()); x && !out.infeasible) out.columns.assign(x, x + ip.columns);
  out.proved = Cbc_isProvenOptimal(m.get()) != 0;
  out.lower_bound_us = Cbc_getBestPossibleObjValue(m.get());
  return out;
}

inline one_solve solve_z3(const integer_program& ip, double time_limit_s) {
  z3::context ctx;
  z3::optimize opt(ctx);
  z3::expr_vector b(ctx);
  for (std::size_t c = 0; c < ip.columns; ++c) b.push_back(ctx.constant(ctx.int_symbol(static_cast<int>(c)), ctx.bool_sort()));
  for (const auto& r : ip.rows) {
    z3::expr_vector terms(ctx);
    std::vector<int> coefs;
    for (std::size_t i = 0; i < r.cols.size(); ++i) {
      terms.push_back(b[static_cast<unsigned>(r.cols[i])]);
      coefs.push_back(static_cast<int>(r.coefs[i]));
    }
    const int rhs = static_cast<int>(r.rhs);
    opt.add(r.sense == 'E' ? z3::pbeq(terms, coefs.data(), rhs) : z3::pble(terms, coefs.data(), rhs));
  }
  std::optional<z3::optimize::handle> objective;
  for (std::size_t c = 0; c < ip.columns; ++c)
    if (const auto ns = to_ns(ip.cost_us[c]); ns > 0) objective = opt.add_soft(!b[static_cast<unsigned>(c)], std::to_string(ns).c_str());
  z3::params prm(ctx);
  prm.set("timeout", static_cast<unsigned>(std::max(1.0, time_limit_s * 1000.0)));
  opt.set(prm);
  const auto r = opt.check();
  one_solve out;
  out.infeasible = r == z3::unsat;
  if (out.infeasible) return out;
  try {
    const auto model = opt.get_model();
    for (std::size_t c = 0; c < ip.columns; ++c) out.columns.push_back(model.eval(b[static_cast<unsigned>(c)], true).is_true() ? 1.0 : 0.0);
  } catch (const z3::exception&) {
    out.columns.clear(); // the time ran out before any model
  }
  out.proved = r == z3::sat;
  std::int64_t lower = 0;
  if (objective && opt.lower(*objective).is_numeral_i64(lower)) out.lower_bound_us = static_cast<double>(lower) / 1000.0;
  return out;
}
} // namespace detail

/// @brief Solves `f` exactly (see mip_solver); with `o.solutions` > 1, again with each earlier
/// solution's leaf choice excluded. A solve that runs out of time returns its best with the
/// solver's bound (solution::gap).
[[nodiscard]] inline solved solve(const problem& f, const solve_options& o = {}) {
  solved out;
  std::vector<std::vector<int>> excluded;
  for (int k = 0; k < std::max(1, o.solutions); ++k) {
    const auto started = std::chrono::steady_clock::now();
    const auto ip = detail::to_integer_program(f, excluded);
    const auto r = o.solver == mip_solver::cbc ? detail::solve_cbc(ip, o.time_limit_s) : detail::solve_z3(ip, o.time_limit_s);
    if (r.infeasible) {
      out.infeasible = out.solutions.empty();
      break;
    }
    if (r.columns.size() != ip.columns) break;
    solution s;
    for (std::size_t v = 0; v < f.nodes.size(); ++v)
      for (std::size_t i = 0; i < f.nodes[v].strategies.size(); ++i)
        if (r.columns[ip.offset[v] + i] > 0.5) s.pick.push_back(static_cast<int>(i));
    if (s.pick.size() != f.nodes.size() || !f.consistent(s.pick)) break;
    s.cost_us = f.cost_us(s.pick);
    s.proved = r.proved;
    s.lower_bound_us = s.proved ? s.cost_us : std::min(s.cost_us, r.lower_bound_us);
    s.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
    excluded.push_back(s.pick);
    out.solutions.push_back(std::move(s));
    if (f.leaves.empty()) break;
  }
  return out;
}

/// @brief The cost of an inconsistent pair of strategies in the IOPDDL export (the format has no
/// hard constraints): far above any step.
inline constexpr std::int64_t iopddl_inconsistent_ns = 1'000'000'000'000'000;

/// @brief `f` in the IOPDDL contest's format: per node its interval, each strategy's cost (ns) and
/// usage (KiB); per edge (producer, consumer) the cost of each pair of strategies, row-major by the
/// producer's, 0 when the consumer reads what the producer makes and iopddl_inconsistent_ns
/// otherwise; the usage limit (KiB).
[[nodiscard]] inline nlohmann::json to_iopddl(const problem& f, const std::string& name) {
  nlohmann::json intervals = nlohmann::json::array(), costs = nlohmann::json::array(), usages = nlohmann::json::array();
  for (const auto& n : f.nodes) {
    intervals.push_back({n.start, n.end});
    nlohmann::json c = nlohmann::json::array(), u = nlohmann::json::array();
    for (const auto& s : n.strategies) {
      c.push_back(detail::to_ns(s.cost_us));
      u.push_back(detail::to_kib(s.usage_bytes));
    }
    costs.push_back(std::move(c));
    usages.push_back(std::move(u));
  }
  nlohmann::json edge_nodes = nlohmann::json::array(), edge_costs = nlohmann::json::array();
  for (std::size_t v = 0; v < f.nodes.size(); ++v)
    for (int k = 0; k < f.nodes[v].n_in; ++k) {
      const auto u = static_cast<std::size_t>(f.nodes[v].operands[k]);
      edge_nodes.push_back({u, v});
      nlohmann::json c = nlohmann::json::array();
      for (const auto& su : f.nodes[u].strategies)
        for (const auto& sv : f.nodes[v].strategies) c.push_back(su.out == sv.in[k] ? std::int64_t{0} : iopddl_inconsistent_ns);
      edge_costs.push_back(std::move(c));
    }
  nlohmann::json problem_json = {{"name", name},
                                 {"nodes", {{"intervals", intervals}, {"costs", costs}, {"usages", usages}}},
                                 {"edges", {{"nodes", edge_nodes}, {"costs", edge_costs}}}};
  if (f.usage_limit) problem_json["usage_limit"] = *f.usage_limit / 1024;
  return {{"problem", problem_json}};
}

/// @brief The objective an IOPDDL instance gives a selection, as the contest defines it: the sum
/// of the chosen strategies' costs and of the edges' costs of the chosen pairs, or nothing when
/// the usage at some instant exceeds the limit. Throws concerto::error for a malformed instance or
/// a selection of the wrong length.
[[nodiscard]] inline std::optional<std::int64_t> evaluate_iopddl(const nlohmann::json& instance, const std::vector<int>& pick) {
  try {
    const auto& pj = instance.at("problem");
    const auto& nodes = pj.at("nodes");
    const auto count = nodes.at("intervals").size();
    if (pick.size() != count) fail("evaluate_iopddl: " + std::to_string(pick.size()) + " choices for " + std::to_string(count) + " nodes");
    std::int64_t total = 0, horizon = 0;
    for (const auto& iv : nodes.at("intervals")) horizon = std::max(horizon, iv.at(1).get<std::int64_t>());
    std::vector<std::int64_t> used(static_cast<std::size_t>(horizon), 0);
    for (std::size_t v = 0; v < count; ++v) {
      const auto s = static_cast<std::size_t>(pick[v]);
      total += nodes.at("costs").at(v).at(s).get<std::int64_t>();
      const auto& iv = nodes.at("intervals").at(v);
      for (auto t = iv.at(0).get<std::int64_t>(); t < iv.at(1).get<std::int64_t>(); ++t)
        used[static_cast<std::size_t>(t)] += nodes.at("usages").at(v).at(s).get<std::int64_t>();
    }
    const auto& edges = pj.at("edges");
    for (std::size_t e = 0; e < edges.at("nodes").size(); ++e) {
      std::size_t index = 0;
      for (const auto& n : edges.at("nodes").at(e)) {
        const auto v = n.get<std::size_t>();
        index = index * nodes.at("costs").at(v).size() + static_cast<std::size_t>(pick[v]);
      }
      total += edges.at("costs").at(e).at(index).get<std::int64_t>();
    }
    if (pj.contains("usage_limit"))
      for (const auto u : used)
        if (u > pj.at("usage_limit").get<std::int64_t>()) return std::nullopt;
    return total;
  } catch (const nlohmann::json::exception& e) {
    fail(std::string("evaluate_iopddl: the instance is malformed: ") + e.what());
  }
}

} // namespace concerto::autoshard
