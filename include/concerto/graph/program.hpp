#pragma once
/// @file
/// @brief `program(loss, optimizer)`: the whole training step extracted at compile time from the
/// type of a loss expression, as a constexpr array of nodes (forward ops, the redistributions
/// their sharding implies, backward ops, optimizer updates), with queries usable in
/// `static_assert` and text/DOT dumps.
///
/// @code
/// inline constexpr axis<"dp"> dp;  inline constexpr axis<"tp"> tp;
/// constexpr auto act = spec(shard(dp), replicate);
/// constexpr auto x = input<"x">(act);
/// constexpr auto w1 = param<"w1">(spec(replicate, shard(tp)));
/// constexpr auto w2 = param<"w2">(spec(shard(tp), replicate));
/// constexpr auto loss = mse(matmul(gelu(matmul(x, w1)), w2), input<"target">(act));
/// constexpr auto step = program(loss, sgd{});
/// static_assert(step.count(collective::all_reduce, tp) == 2); // forward and backward
/// static_assert(step.count(collective::all_reduce, dp) == 2); // the two weight gradients
/// @endcode

#include <concerto/expr/messages.hpp>
#include <concerto/graph/detail/compiler.hpp>

#include <string>

namespace concerto {

/// @brief Collective kinds, for queries.
enum class collective : std::uint8_t { all_reduce, all_gather, reduce_scatter, all_to_all };

[[nodiscard]] constexpr op_code to_op(collective c) noexcept {
  return static_cast<op_code>(static_cast<int>(op_code::all_reduce) + static_cast<int>(c));
}

namespace graph {

/// @brief Everything of a program but its nodes: what does not depend on its size.
struct program_info {
  int size = 0;
  axis_table axes{};
  leaf_name names[max_leaves]{};
  leaf_init inits[max_leaves]{}; ///< each parameter's initialiser, by leaf
  std::uint8_t free_dims[max_leaves]{}; ///< each leaf's dims written auto_ (a bit per dim), by leaf
  int name_count = 0;
  std::int16_t leaf_node[max_leaves]{};
  std::int16_t grad_of[max_leaves]{};
  std::int16_t update_of[max_leaves]{};
  int loss = -1;
  op_code optimizer = op_code::sgd;
  int zero_stage = 0;
  int zero_axis = -1;
  repeat_info repeats[max_repeats]{};
  int repeat_count = 0;
  int raw_size = 0;  ///< the traced expression (program::raw), which graph/respecify.hpp compiles again
  int raw_root = -1; ///< its loss
};

/// @brief A compiled training step of N nodes (nodes are in execution order: forward, backward,
/// optimizer).
template <std::size_t N>
struct program : program_info {
  node nodes[N]{};
  /// The expression as traced, one node per distinct subexpression with the specs the program
  /// wrote (the compiler's pass 1): what automatic sharding compiles again with other leaf specs.
  node raw[N]{};

  /// @brief Whether some leaf or `.to(...)` has a dimension written auto_ (automatic sharding decides it).
  [[nodiscard]] constexpr bool has_free_dims() const noexcept {
    for (int l = 0; l < name_count; ++l)
      if (free_dims[l] != 0) return true;
    for (int i = 0; i < raw_size; ++i)
      if (raw[i].free != 0) return true;
    return false;
  }

  /// @brief Index of a repeat by name, -1 if the program has none of that name.
  [[nodiscard]] constexpr int repeat_index(std::string_view name) const noexcept {
    for (int k = 0; k < repeat_count; ++k)
      if (repeats[k].name == name) return k;
    return -1;
  }

  /// @brief Collectives of a kind on an axis inside one repeated block (each block is traced once,
  /// so these are per layer; lowering with depth L emits L times as many). -1 if there is no such repeat.
  /// @code
  /// static_assert(step.count_in("layers", collective::all_reduce, tp, ir::phase::forward) == 2);
  /// @endcode
  template <mesh_axis_type Axis>
  [[nodiscard]] constexpr int count_in(std::string_view block, collective kind, Axis, int phase = -1) const noexcept {
    const int k = repeat_index(block);
    if (k < 0) return -1;
    const int a = axes.find(axis_name(Axis::name()));
    int c = 0;
    for (int i = 0; i < size; ++i)
      c += nodes[i].block == k && nodes[i].op == to_op(kind) && nodes[i].axis == a && a >= 0 &&
           (phase < 0 || static_cast<int>(nodes[i].phase) == phase);
    return c;
  }
  template <mesh_axis_type Axis>
  [[nodiscard]] constexpr int count_in(std::string_view block, collective kind, Axis ax, ir::phase phase) const noexcept {
    return count_in(block, kind, ax, static_cast<int>(phase));
  }
  /// @brief What one stage sends and receives per micro-batch when the layers of repeat `block` are
  /// split over `stages` pipeline stages (a `pp` mesh axis; pipeline/stages.hpp): the stack's
  /// value goes forward to the next stage, its gradient back to the previous one, one tensor each.
  /// {-1, -1} for a repeat the program does not have or a stage outside the pipeline.
  /// @code
  /// static_assert(gpt.pipeline_messages("layers", 1, 4).sends == 2); // a middle stage: forward and back
  /// @endcode
  struct stage_messages {
    int sends = 0, recvs = 0;
  };
  [[nodiscard]] constexpr stage_messages pipeline_messages(std::string_view block, int stage, int stages) const noexcept {
    const int k = repeat_index(block);
    if (k < 0 || stage < 0 || stage >= stages) return {-1, -1};
    const bool later = stage + 1 < stages, earlier = stage > 0;
    const bool gradients = repeats[k].grad_in >= 0;
    return {int{later} + int{earlier && gradients}, int{earlier} + int{later && gradients}};
  }

  /// @brief Collectives of a kind on an axis once the repeats are unrolled to the given depths
  /// (one per repeat, in the order they appear in the program).
  /// @code
  /// static_assert(step.count_unrolled({4}, collective::all_reduce, tp) == 4 * 4 + 3);
  /// @endcode
  template <mesh_axis_type Axis>
  [[nodiscard]] constexpr int count_unrolled(std::initializer_list<int> depths, collective kind, Axis ax,
                                             int phase = -1) const noexcept {
    int total = count(kind, ax, phase), k = 0;
    for (int d : depths) {
      if (k < repeat_count) total += (d - 1) * count_in(repeats[k].name.view(), kind, ax, phase);
      ++k;
    }
    return total;
  }

  /// @brief Number of collectives of a kind on an axis, optionally in one phase.
  /// @code
  /// static_assert(step.count(collective::reduce_scatter, dp, ir::phase::backward) == 2);
  /// @endcode
  template <mesh_axis_type Axis>
  [[nodiscard]] constexpr int count(collective kind, Axis, int phase = -1) const noexcept {
    const int a = axes.find(axis_name(Axis::name()));
    int c = 0;
    for (int i = 0; i < size; ++i)
      c += nodes[i].op == to_op(kind) && nodes[i].axis == a && a >= 0 &&
           (phase < 0 || static_cast<int>(nodes[i].phase) == phase);
    return c;
  }
  template <mesh_axis_type Axis>
  [[nodiscard]] constexpr int count(collective kind, Axis ax, ir::phase phase) const noexcept {
    return count(kind, ax, static_cast<int>(phase));
  }
  /// @brief Number of collectives of a kind on any axis.
  [[nodiscard]] constexpr int count(collective kind) const noexcept { return count(to_op(kind)); }
  /// @brief Number of nodes with an op (compute ops, local slices, updates).
  [[nodiscard]] constexpr int count(op_code op) const noexcept {
    int c = 0;
    for (int i = 0; i < size; ++i) c += nodes[i].op == op;
    return c;
  }

  /// @brief The node of a leaf ("w1"), of its final gradient ("w1.grad") or update ("w1.update"); -1 if none.
  [[nodiscard]] constexpr int find(std::string_view name) const noexcept {
    const auto strip = [&](std::string_view suffix, std::string_view& base) {
      if (name.size() > suffix.size() && name.substr(name.size() - suffix.size()) == suffix) {
        base = name.substr(0, name.size() - suffix.size());
        return true;
      }
      return false;
    };
    std::string_view base = name;
    const bool grad = strip(".grad", base), update = !grad && strip(".update", base);
    for (int l = 0; l < name_count; ++l)
      if (names[l] == base) return grad ? grad_of[l] : update ? update_of[l] : leaf_node[l];
    return -1;
  }
  /// @brief The spec of a named node (see find); rank -1 if there is none.
  [[nodiscard]] constexpr spec_value spec_of(std::string_view name) const noexcept {
    const int i = find(name);
    if (i < 0) {
      spec_value none;
      none.rank = -1;
      return none;
    }
    return to_value(nodes[i].spec, axes);
  }
  /// @brief The spec of node i as names.
  [[nodiscard]] constexpr spec_value spec_at(int i) const noexcept { return to_value(nodes[i].spec, axes); }

  /// @brief A readable name for node i: a leaf's name, "w1.grad", "w1.update", "w1.m", or "op#i".
  [[nodiscard]] std::string name_of(int i) const {
    const node& x = nodes[i];
    if (x.name >= 0) {
      std::string base(names[x.name].view());
      if (is_leaf(x.op)) return base;
      if (x.op == op_code::state) return base + (x.dim == state_m ? ".m" : x.dim == state_v ? ".v" : ".running");
      if (x.op == optimizer && x.kind == role::update) return base + ".update";
      if (x.has(flag_writes_param)) return base + ".new";
    }
    for (int l = 0; l < name_count; ++l)
      if (grad_of[l] == i) {
        std::string out(names[l].view());
        out += ".grad";
        return out;
      }
    std::string out(to_string(x.op));
    out += '#';
    out += std::to_string(i);
    return out;
  }

  /// @brief Node i as the user wrote it, for messages: a named value's name (a leaf, "w1.grad"),
  /// or its op applied to its operands down to `depth` levels, e.g.
  /// "attention(rope(matmul(…, wq), positions), rope(matmul(…, wk), positions), matmul(…, wv))".
  /// The redistributions the compiler inserted are looked through. Inside a repeated block, a
  /// layer after the first (`later_layer`) reads the previous layer's output where layer 0 reads
  /// the stack's input.
  [[nodiscard]] std::string describe(int i, int depth = 3, bool later_layer = false) const {
    while (nodes[i].n_in == 1 && (is_redistribution(nodes[i].op) || nodes[i].op == op_code::repeat_in) && nodes[i].name < 0) {
      if (nodes[i].op == op_code::repeat_in && later_layer) return "the previous layer's output";
      i = nodes[i].in[0];
    }
    const node& x = nodes[i];
    const auto named = name_of(i);
    // name_of's fallback is "op#i"; suffix appended piece by piece (g++ 12 warns falsely,
    // -Wrestrict, on "#" + std::to_string(i)).
    std::string generated(1, '#');
    generated += std::to_string(i);
    if (x.n_in == 0 || !named.ends_with(generated)) return named;
    if (depth <= 0) return "…";
    std::string out(to_string(x.op));
    out += '(';
    for (int k = 0; k < x.n_in; ++k) {
      if (k) out += ", ";
      out += describe(x.in[k], depth - 1, later_layer);
    }
    out += ')';
    return out;
  }

  /// @brief One line per node: index, phase, op (and axis), spec, inputs.
  [[nodiscard]] std::string dump() const {
    std::string out;
    for (int i = 0; i < size; ++i) {
      const node& x = nodes[i];
      std::string line = std::to_string(i);
      line.resize(5, ' ');
      line += ir::to_string(x.phase).substr(0, 3);
      line += "  ";
      if (x.block >= 0) {
        line += repeats[x.block].name.view();
        line += ": ";
      }
      line += name_of(i);
      if (x.axis >= 0) {
        line += '(';
        line += axes.names[x.axis].view();
        line += x.has(flag_max) ? ",max)" : ")";
      }
      line.resize(std::max<std::size_t>(line.size() + 1, 40), ' ');
      line += to_string(spec_at(i));
      if (x.n_in > 0) {
        line.resize(std::max<std::size_t>(line.size() + 1, 58), ' ');
        line += "<-";
        for (int k = 0; k < x.n_in; ++k) {
          line += ' ';
          line += name_of(x.in[k]);
        }
      }
      out += line;
      out += '\n';
    }
    return out;
  }

  /// @brief The program as a GraphViz digraph: collectives as ellipses, compute as boxes.
  [[nodiscard]] std::string dot() const {
    std::string out = "digraph program {\n  rankdir=TB;\n";
    for (int i = 0; i < size; ++i) {
      const node& x = nodes[i];
      const bool comm = is_redistribution(x.op);
      out += "  n";
      out += std::to_string(i);
      out += " [label=\"";
      out += name_of(i);
      if (x.axis >= 0) {
        out += '(';
        out += axes.names[x.axis].view();
        out += ')';
      }
      out += "\\n";
      out += to_string(spec_at(i));
      out += comm ? "\" shape=ellipse" : "\" shape=box";
      out += x.phase == ir::phase::backward ? " style=dashed" : x.phase == ir::phase::optimizer ? " style=dotted" : "";
      out += "];\n";
      for (int k = 0; k < x.n_in; ++k) {
        out += "  n";
        out += std::to_string(x.in[k]);
        out += " -> n";
        out += std::to_string(i);
        out += ";\n";
      }
    }
    return out + "}\n";
  }
};

namespace detail {

using where_text = short_name<64>;

template <class W>
constexpr where_text describe(const W& w) noexcept {
  char buf[64]{};
  int n = 0;
  const auto put = [&](std::string_view s) {
    for (char ch : s)
      if (n < 63) buf[n++] = ch;
  };
  if (w.where < 0 || w.where >= w.raw_n) {
    put("the program");
  } else {
    const node& x = w.raw[w.where];
    if (is_leaf(x.op)) {
      put(to_string(x.op));
      put(" '");
      put(w.names[x.name].view());
      put("'");
    } else {
      put(to_string(x.op));
      put("(");
      for (int k = 0; k < x.n_in; ++k) {
        if (k) put(", ");
        const node& a = w.raw[x.in[k]];
        put(is_leaf(a.op) ? w.names[a.name].view() : to_string(a.op));
      }
      put(")");
    }
  }
  if (w.err == errc::unknown_axis) {
    put(" uses axis '");
    put(w.unknown_axis.view());
    put("'");
  }
  return where_text(std::string_view(buf, static_cast<std::size_t>(n)));
}

/// The compile-time messages: instantiated with the mistake and the node it was found at, so
/// that the compiler prints both. The sentences are expr/messages.hpp's, which the run time shares.
template <errc E, where_text Where>
struct diagnose {
  static_assert(E != errc::mismatched_contraction, CONCERTO_MESSAGE_MISMATCHED_CONTRACTION);
  static_assert(E != errc::partial_into_nonlinear, CONCERTO_MESSAGE_PARTIAL_INTO_NONLINEAR);
  static_assert(E != errc::rank_mismatch, CONCERTO_MESSAGE_RANK_MISMATCH);
  static_assert(E != errc::unknown_axis, CONCERTO_MESSAGE_UNKNOWN_AXIS);
  static_assert(E != errc::too_many_axes, CONCERTO_MESSAGE_TOO_MANY_AXES);
  static_assert(E != errc::leaf_redefined, CONCERTO_MESSAGE_LEAF_REDEFINED);
  static_assert(E != errc::loss_not_scalar, CONCERTO_MESSAGE_LOSS_NOT_SCALAR);
  static_assert(E != errc::repeat_spec_changed, CONCERTO_MESSAGE_REPEAT_SPEC_CHANGED);
  static_assert(E != errc::repeat_leaf_scope, CONCERTO_MESSAGE_REPEAT_LEAF_SCOPE);
  static_assert(E != errc::repeat_nested, CONCERTO_MESSAGE_REPEAT_NESTED);
  static_assert(E != errc::moe_gates, CONCERTO_MESSAGE_MOE_GATES);
  static_assert(E != errc::axis_order, CONCERTO_MESSAGE_AXIS_ORDER);
  static_assert(E != errc::capacity, CONCERTO_MESSAGE_CAPACITY);
  static_assert(E != errc::unbuildable_op, CONCERTO_MESSAGE_UNBUILDABLE_OP);
  static constexpr bool ok = true; // the asserts above speak; a second, silent one would only add noise
};

// The compiler's result into a program (at compile time through finish, at run time into one
// on the heap: graph/respecify.hpp).
template <std::size_t N, class W>
constexpr void fill(program<N>& p, const W& w) noexcept {
  p.size = w.n;
  for (int i = 0; i < w.n; ++i) p.nodes[i] = w.nodes[i];
  p.raw_size = w.raw_n;
  p.raw_root = w.raw_root;
  for (int i = 0; i < w.raw_n; ++i) p.raw[i] = w.raw[i];
  p.axes = w.axes;
  p.name_count = w.name_count;
  for (int l = 0; l < max_leaves; ++l) {
    p.names[l] = w.names[l];
    p.inits[l] = w.inits[l];
    p.free_dims[l] = w.free_dims[l];
    p.leaf_node[l] = w.leaf_node[l];
    p.grad_of[l] = w.grad_of[l];
    p.update_of[l] = w.update_of[l];
  }
  p.loss = w.loss;
  p.optimizer = w.opt;
  p.zero_stage = w.stage;
  p.zero_axis = w.zero_axis;
  p.repeat_count = w.repeat_count;
  for (int k = 0; k < max_repeats; ++k) p.repeats[k] = w.repeats[k];
}

template <std::size_t N, class W>
constexpr program<N> finish(const W& w) noexcept {
  program<N> p;
  fill(p, w);
  return p;
}

// The same program in a larger one (graph/lower.hpp lowers every program through one size).
template <std::size_t M, std::size_t N>
  requires(M >= N)
void widen_into(program<M>& out, const program<N>& p) noexcept {
  static_cast<program_info&>(out) = p;
  for (int i = 0; i < p.size; ++i) out.nodes[i] = p.nodes[i];
  for (int i = 0; i < p.raw_size; ++i) out.raw[i] = p.raw[i];
}

} // namespace detail
} // namespace graph

/// @brief Extracts the training step of `loss` (forward, backward with the collectives its
/// sharding implies, optimizer updates) at compile time. Mistakes are compile errors whose
/// message names the mistake and the fix. Pass `on(axes...)` to check every spec's axes.
/// @code
/// constexpr auto step = program(loss, zero<2>(adamw{}, dp), on(dp, tp));
/// @endcode
template <expression E, optimizer Opt, class Mesh = mesh_decl<>>
[[nodiscard]] constexpr auto program(const E&, Opt = {}, Mesh = {}) noexcept {
  constexpr auto w = graph::detail::compile<E, std::remove_cvref_t<Opt>, Mesh>();
  static_assert(graph::detail::diagnose<w.err, graph::detail::describe(w)>::ok);
  if constexpr (w.err != errc::none) return graph::program<1>{};
  else return graph::detail::finish<static_cast<std::size_t>(w.n > w.raw_n ? w.n : w.raw_n)>(w);
}

} // namespace concerto
