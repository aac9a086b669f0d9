#pragma once
/// @file
/// @brief Internal: the constexpr passes that turn an expression type into program nodes.
/// Include <concerto/graph/program.hpp> instead.
///
/// 1. trace: the expression type is flattened into `raw` (one node per distinct subexpression;
///    leaves with one name are one node);
/// 2. propagate: raw nodes are re-emitted in order with their specs; each op's rule says which
///    input specs it needs and the redistribution steps are inserted before it;
/// 3. autodiff: nodes are visited in reverse; each gradient is first brought to its value's spec
///    (minus pending sums), backward nodes get specs from the same rules, contributions are summed;
/// 4. optimizer: one update per parameter (plus ZeRO slices and gathers).

#include <concerto/expr/expr.hpp>
#include <concerto/expr/rules.hpp>
#include <concerto/graph/optimizer.hpp>
#include <concerto/ir/graph.hpp>
#include <concerto/spec/redistribute.hpp>

namespace concerto::graph {

/// @brief What a node's value is.
enum class role : std::uint8_t { input, data, param, activation, gradient, state, loss, update };
/// What a state node (node::dim) holds: AdamW's first or second moment, a batch norm's running statistics.
inline constexpr std::int8_t state_m = 0, state_v = 1, state_running = 2;

inline constexpr std::uint8_t flag_trans_a = 1;
inline constexpr std::uint8_t flag_trans_b = 2;
inline constexpr std::uint8_t flag_pinned = 4;       ///< a pending sum the user asked for
inline constexpr std::uint8_t flag_bidirectional = 8; ///< attention without the causal mask
inline constexpr std::uint8_t flag_writes_param = 16; ///< its result is the parameter's new value
inline constexpr std::uint8_t flag_needs_grad = 32;
inline constexpr std::uint8_t flag_max = 64;         ///< an all_reduce that takes the maximum, not the sum
inline constexpr std::uint8_t flag_no_grad = 128;    ///< an input leaf the step does not differentiate

inline constexpr int max_repeats = 4;
using repeat_name = short_name<16>;

/// @brief One `repeat<"name">(block, x)` of a program: where its block starts and ends, and the
/// gradients that cross its boundary (what lowering chains from one layer to the next).
struct repeat_info {
  repeat_name name{};
  std::int16_t raw_in = -1;   ///< trace: the repeat_in raw node, and the stack's input
  std::int16_t raw_x = -1;
  std::int16_t raw_out = -1;  ///< trace: the repeat_out raw node
  std::int16_t in = -1;       ///< repeat_in node: layer i reads layer i-1's `out` (layer 0: the stack's input)
  std::int16_t out = -1;      ///< the block's output node
  std::int16_t grad_out = -1; ///< gradient of the last layer's output (outside the block)
  std::int16_t grad_in = -1;  ///< gradient of a layer's input: layer i-1 reads it as its grad_out
};

inline constexpr int max_leaves = 128;
using leaf_name = short_name<20>;

/// @brief One node of a program.
struct node {
  op_code op{};
  ir::phase phase = ir::phase::forward;
  role kind = role::activation;
  std::uint8_t flags = 0;
  /// `.to` nodes: the dims written auto_ (a bit per dim), which keep the placement the value
  /// arrives in until automatic sharding decides them (graph::kept_where_free).
  std::uint8_t free = 0;
  std::int16_t in[4] = {-1, -1, -1, -1};
  std::int8_t n_in = 0;
  pspec spec{};          ///< the value's spec (a parameter's storage spec)
  pspec use{};           ///< leaves: the spec consumers see (a ZeRO-3 parameter's compute spec)
  std::int16_t name = -1; ///< leaf name index (leaves, their gradients, states and updates)
  std::int16_t of = -1;   ///< forward value this node is a gradient/update of (its global shape)
  std::int8_t axis = -1;  ///< redistributions: the mesh axis
  std::int8_t dim = -1;   ///< redistributions: split dimension after (slice, reduce_scatter, all_to_all); select: index
  std::int8_t dim2 = -1;  ///< redistributions: split dimension before (all_gather, all_to_all)
  std::int8_t block = -1; ///< the repeat this node belongs to (its layers are copies), -1 outside
  /// Parameters under ZeRO: the dimension the stage split over its axis (stage 3: the storage;
  /// stages 1-2: the gradient and update shards), -1 if it added none. Only such a split may
  /// leave the dimension uneven: lowering pads it (graph/lower.hpp), a split the user wrote must divide.
  std::int8_t zero_dim = -1;
  moe_config moe{};       ///< moe_route and its gradient: the routing's settings
  conv_config conv{};     ///< conv2d, max_pool, avg_pool and their gradients: stride and padding
  std::int8_t window = 0; ///< max_pool, avg_pool and their gradients: the window's side
  dim_range dims{};       ///< flatten, unflatten, transpose, sum_dim, mean_dim, concat_dim and their gradients: the dims they work along
  dim_slice part{};       ///< slice_dim and its gradient: the dim and the positions kept
  dropout_config drop{};  ///< dropout and its gradient: the rate and the seed
  /// Gradient tasks: the forward node and which of its operands this is the gradient of (a
  /// concat's part is found by it).
  std::int16_t forward = -1;
  std::int8_t operand = -1;
  bool local_stats = false; ///< batchnorm's tasks: statistics over this rank's rows only (batchnorm_config::sync off)
  float momentum = 0.0f;    ///< batchnorm_track: how far a step moves the running statistics (batchnorm_config::momentum)
  [[nodiscard]] constexpr bool has(std::uint8_t f) const noexcept { return (flags & f) != 0; }
  /// The op's settings (a routing's, a convolution's or pooling's, the dims), which its
  /// compiled node and its gradients' nodes carry as the DSL node had them.
  constexpr void take_settings(const node& from) noexcept {
    moe = from.moe;
    conv = from.conv;
    window = from.window;
    dims = from.dims;
    part = from.part;
    drop = from.drop;
  }
  /// Whether two nodes' op settings (those take_settings copies) are equal.
  [[nodiscard]] constexpr bool same_settings(const node& o) const noexcept {
    return moe == o.moe && conv == o.conv && window == o.window && dims == o.dims && part == o.part && drop == o.drop;
  }
};

[[nodiscard]] constexpr bool is_redistribution(op_code op) noexcept {
  return op >= op_code::all_reduce && op <= op_code::keep_one;
}
[[nodiscard]] constexpr op_code to_op(redist_kind k) noexcept {
  constexpr op_code ops[] = {op_code::shard_slice, op_code::reduce_scatter, op_code::all_to_all,
                             op_code::all_reduce,  op_code::all_gather,     op_code::keep_one};
  return ops[static_cast<int>(k)];
}
[[nodiscard]] constexpr bool is_leaf(op_code op) noexcept { return op >= op_code::input && op <= op_code::param; }
/// @brief Whether the step differentiates leaf `x`: parameters and inputs, unless the input says no_grad.
[[nodiscard]] constexpr bool leaf_needs_grad(const node& x) noexcept { return x.op != op_code::data && !x.has(flag_no_grad); }

/// @brief The layout a `.to(written)` with the dims `free` written auto_ makes of a value that
/// arrives as `arriving`: its written dims as written, each free dim as it arrives less the axes
/// the written dims use, the pending sums made. Until automatic sharding decides its free dims,
/// such a redistribution changes only what it wrote and makes the sums a consumer would (with
/// every dim free, the program is the one without it but for where a pending sum is made).
[[nodiscard]] constexpr pspec kept_where_free(const pspec& written, std::uint8_t free, const pspec& arriving) noexcept {
  if (free == 0) return written;
  pspec out = written;
  const auto written_uses = [&](int a) {
    for (int d = 0; d < written.rank; ++d)
      if ((free >> d & 1u) == 0 && (written.dims[d][0] == a || written.dims[d][1] == a)) return true;
    return false;
  };
  for (int d = 0; d < out.rank; ++d) {
    if ((free >> d & 1u) == 0) continue;
    out.dims[d][0] = out.dims[d][1] = -1;
    int k = 0;
    for (const auto a : arriving.dims[d])
      if (a >= 0 && !written_uses(a)) out.dims[d][k++] = a;
  }
  return out;
}

} // namespace concerto::graph

namespace concerto::graph {

/// @brief What the op table's sharding rule of an op builds beyond one node: most ops are one
/// node with the rule's specs; batch normalisation and the vocab-parallel cross-entropy are
/// built of several (their statistics and their sums), by the compiler.
enum class rule_builds : std::uint8_t { one_node, batchnorm, vocab_parallel_ce };

/// @brief The answer of an op's sharding rule: the spec each operand is brought to, the output's,
/// or the mistake; and what the compiler builds for it.
struct rule_answer {
  rules::result specs{};
  rule_builds builds = rule_builds::one_node;
};

namespace detail {
/// A rule's answer that the op cannot be built so (the reason the program's diagnostic names).
[[nodiscard]] constexpr rule_answer refuse(errc e) noexcept {
  rule_answer out;
  out.specs.err = e;
  return out;
}
[[nodiscard]] constexpr rule_answer answer(const rules::result& r) noexcept { return {r, rule_builds::one_node}; }

/// The rules of the ops that move or reduce values within a layout (convolutions, pooling,
/// flatten, unflatten, sums over a dim, concat, slice, dropout, transpose): the dims each keeps whole.
// g++ 12 at -O3, where the passes run at run time (graph/respecify.hpp), sees a store past a
// spec's dims that the rank checks below exclude (-Wstringop-overflow, a known false positive
// of its value-range analysis through inlined loops).
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wstringop-overflow"
#endif
[[nodiscard]] constexpr rule_answer layout_rule(const node& x, const pspec* in, std::uint8_t pinned, int A) noexcept {
  const auto rank = [&](int k) { return static_cast<int>(in[k].rank); };
  const auto pin = [&](int k) { return (pinned >> k & 1u) != 0; };
  switch (ir::info(x.op).rule) {
  case ir::sharding::convolution:
    if (rank(0) != 4 || rank(1) != 4) return refuse(errc::rank_mismatch);
    return answer(rules::convolution(in[0], in[1], A));
  case ir::sharding::merge:
    if (x.dims.first < 0 || x.dims.last <= x.dims.first || x.dims.last >= rank(0)) return refuse(errc::rank_mismatch);
    return answer(rules::merge(in[0], x.dims.first, x.dims.last, A));
  case ir::sharding::reduce_dim:
    if (x.dims.first < 0 || x.dims.first >= rank(0)) return refuse(errc::rank_mismatch);
    return answer(rules::reduce_dim(in[0], x.dims.first, A));
  case ir::sharding::pooling:
    if (rank(0) != 4) return refuse(errc::rank_mismatch);
    return answer(rules::pooling(in[0], x.op == op_code::avg_pool, pin(0), A));
  case ir::sharding::join: {
    const int full = std::max(rank(0), rank(1)), lower = std::min(rank(0), rank(1));
    if (x.dims.first < full - lower || x.dims.first >= full) return refuse(errc::rank_mismatch);
    return answer(rules::join(in[0], pin(0), in[1], pin(1), x.dims.first, A));
  }
  case ir::sharding::part:
    if (x.part.dim >= rank(0)) return refuse(errc::rank_mismatch);
    return answer(rules::part(in[0], x.part.dim, A));
  case ir::sharding::linear: {
    rules::result rr;
    rr.need[0] = rr.out = in[0];
    return answer(rr);
  }
  case ir::sharding::unmerge:
    if (x.dims.first < 0 || x.dims.first >= rank(0) || rank(0) + 1 > max_rank) return refuse(errc::rank_mismatch);
    return answer(rules::unmerge(in[0], x.dims.first));
  case ir::sharding::swap_dims: { // linear: pending sums go through
    if (x.dims.first < 0 || x.dims.first + 1 >= rank(0)) return refuse(errc::rank_mismatch);
    rules::result rr;
    rr.need[0] = in[0];
    rr.out = rules::swap_dims(in[0], x.dims.first);
    return answer(rr);
  }
  default: break;
  }
  return refuse(errc::unbuildable_op);
}
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif

/// The losses' rules: mse reads its two operands alike; cross-entropy reads whole rows of logits,
/// or logits split over one axis on the vocabulary (Megatron-LM's vocab-parallel loss, built of
/// several nodes), and labels laid out as the rows. The scalar is a pending sum over the axes
/// splitting the rows.
[[nodiscard]] constexpr rule_answer loss_rule(const node& x, const pspec* in, std::uint8_t pinned, int A) noexcept {
  const int rk = in[0].rank;
  const bool pin0 = (pinned & 1u) != 0;
  const auto lead = rules::nonlinear(in[0], pin0);
  if (ir::info(x.op).rule == ir::sharding::mse) {
    if (rk != in[1].rank) return refuse(errc::rank_mismatch);
    auto rr = lead;
    rr.need[1] = rr.need[0];
    rr.out = pspec{};
    rr.out.partial = rules::axes_splitting(rr.need[0], 0, max_rank, A);
    return answer(rr);
  }
  if (rk < 2 || in[1].rank != rk - 1) return refuse(errc::rank_mismatch);
  const bool vocab_split = lead.err == errc::none && lead.need[0].dims[rk - 1][0] >= 0 && lead.need[0].dims[rk - 1][1] < 0;
  auto rr = vocab_split ? lead : rules::rowwise(in[0], pin0, rk - 1, A);
  if (rr.err != errc::none) return answer(rr);
  rr.need[1] = rules::leading_dims_of(rr.need[0], A);
  rr.out = pspec{};
  rr.out.partial = rules::axes_splitting(rr.need[0], 0, rk - 2, A);
  return {rr, vocab_split ? rule_builds::vocab_parallel_ce : rule_builds::one_node};
}
} // namespace detail

/// @brief The sharding rule of node x's op (its table entry's) over operand specs `in`, bit k of
/// `pinned` set when operand k is a pending sum the user pinned: the spec each operand is brought
/// to and the output's, or the mistake. `gates_routed`: x's second operand is a moe_route (what
/// moe_dispatch and moe_combine need). The compiler applies it to the specs it propagates; automatic
/// sharding (autoshard/formulation.hpp) to every layout an operand can have.
[[nodiscard]] constexpr rule_answer op_rule(const node& x, const pspec* in, std::uint8_t pinned, int A,
                                            bool gates_routed) noexcept {
  using detail::refuse;
  using detail::answer;
  const auto rank = [&](int k) { return static_cast<int>(in[k].rank); };
  const auto pin = [&](int k) { return (pinned >> k & 1u) != 0; };
  const auto lead = [&] { return rules::nonlinear(in[0], pin(0)); };
  // A second operand a nonlinear op reads whole: a pinned pending sum cannot be made for it.
  const bool pinned_sum_1 = x.n_in > 1 && pin(1) && in[1].has_partial();
  switch (ir::info(x.op).rule) {
  case ir::sharding::contract: {
    const int ra = rank(0), rb = rank(1);
    if (ra < 2 || rb < 2 || (rb != 2 && rb != ra)) return refuse(errc::rank_mismatch);
    return answer(rules::contract(in[0], rules::make_labels(ra, 'm', 'k'), in[1], rules::make_labels(rb, 'k', 'n'),
                                  rules::make_labels(ra, 'm', 'n'), A));
  }
  case ir::sharding::unify: return answer(rules::unify(in[0], in[1], A));
  case ir::sharding::bias: {
    if (rank(1) < 1 || rank(1) > rank(0)) return refuse(errc::rank_mismatch);
    auto rr = lead();
    rr.need[1] = rules::like_trailing_dims(rr.need[0], rank(1), A);
    return answer(rr);
  }
  case ir::sharding::batchnorm: {
    if (rank(0) < 2 || rank(1) != 1 || rank(2) != 1) return refuse(errc::rank_mismatch);
    if (pinned_sum_1 || (pin(2) && in[2].has_partial())) return refuse(errc::partial_into_nonlinear);
    auto rr = lead();
    if (rr.err != errc::none) return answer(rr);
    rr.need[1] = rr.need[2] = rules::like_last_dim(rr.need[0], A);
    return {rr, rule_builds::batchnorm};
  }
  case ir::sharding::convolution:
  case ir::sharding::merge:
  case ir::sharding::reduce_dim:
  case ir::sharding::pooling:
  case ir::sharding::join:
  case ir::sharding::part:
  case ir::sharding::linear:
  case ir::sharding::unmerge:
  case ir::sharding::swap_dims: return detail::layout_rule(x, in, pinned, A);
  case ir::sharding::pointwise: return answer(lead());
  case ir::sharding::pointwise_two: {
    // Not linear in the pair: both operands whole (pending sums made) and laid out alike.
    if (rank(0) != rank(1)) return refuse(errc::rank_mismatch);
    if (pinned_sum_1) return refuse(errc::partial_into_nonlinear);
    auto rr = lead();
    rr.need[1] = rr.need[0];
    return answer(rr);
  }
  case ir::sharding::rope: {
    // x [..., seq, heads·head_dim] rotated per position: any layout of x whose split of the
    // last dimension keeps heads whole (checked when decoded); positions follow x's leading dims.
    const int rk = rank(0);
    if (rk < 2 || rank(1) != rk - 1) return refuse(errc::rank_mismatch);
    if (in[1].has_partial()) return refuse(errc::partial_into_nonlinear);
    auto rr = lead();
    rr.need[1] = rules::leading_dims_of(rr.need[0], A);
    return answer(rr);
  }
  case ir::sharding::rowwise: {
    for (int k = 1; k < x.n_in; ++k)
      if (rank(k) != 1) return refuse(errc::rank_mismatch);
    if (rank(0) < 1) return refuse(errc::rank_mismatch);
    auto rr = rules::rowwise(in[0], pin(0), rank(0) - 1, A);
    rr.need[1] = rr.need[2] = rules::like_last_dim(rr.need[0], A);
    return answer(rr);
  }
  case ir::sharding::attention: {
    if (rank(0) != 3 || rank(1) != 3 || rank(2) != 3) return refuse(errc::rank_mismatch);
    auto rr = rules::rowwise(in[0], pin(0), 1, A); // causal attention needs the whole sequence
    if (rr.err == errc::none && (pin(1) || pin(2))) return refuse(errc::partial_into_nonlinear);
    rr.need[1] = rr.need[2] = rr.need[0];
    return answer(rr);
  }
  case ir::sharding::embedding: {
    if (rank(1) != 2 || rank(0) < 1 || rank(0) > max_rank - 1) return refuse(errc::rank_mismatch);
    if (in[0].has_partial()) return refuse(errc::partial_into_nonlinear);
    return answer(rules::embedding(in[0], in[1], A));
  }
  case ir::sharding::mse:
  case ir::sharding::cross_entropy: return detail::loss_rule(x, in, pinned, A);
  case ir::sharding::routing: {
    // A group's tokens share the experts' capacity, and a token's probabilities are one row:
    // only the groups may be split.
    if (rank(0) != 3) return refuse(errc::rank_mismatch);
    auto rr = lead();
    rr.need[0] = rules::keep_dims(rr.need[0], 1, A);
    rr.out = rr.need[0];
    return answer(rr);
  }
  case ir::sharding::dispatch:
  case ir::sharding::combine: {
    if (rank(0) != 3 || rank(1) != 3) return refuse(errc::rank_mismatch);
    if (!gates_routed) return refuse(errc::moe_gates);
    if (pinned_sum_1) return refuse(errc::partial_into_nonlinear);
    return answer(ir::info(x.op).rule == ir::sharding::dispatch ? rules::dispatch(in[0], pin(0))
                                                                : rules::combine(in[0], in[1], pin(0), A));
  }
  case ir::sharding::none: break;
  }
  return refuse(errc::unbuildable_op); // an op without a rule: ir::dsl_ready refuses it where the program is written
}

} // namespace concerto::graph

namespace concerto::graph::detail {

template <std::size_t RawCap, std::size_t Cap>
struct work {
  node raw[RawCap]{};
  int raw_n = 0;
  node nodes[Cap]{};
  int n = 0;
  std::int16_t map[RawCap]{};  // raw -> nodes
  std::int16_t acc[Cap]{};     // gradient accumulated so far, per node
  bool unit[Cap]{};            // the loss and the terms of a sum of losses: their gradient is one
  axis_table axes{};
  bool axes_fixed = false;
  leaf_name names[max_leaves]{};
  leaf_init inits[max_leaves]{};
  std::uint8_t free_dims[max_leaves]{}; // per leaf: the dims written auto_ (spec_value::free)
  int name_count = 0;
  std::int16_t leaf_node[max_leaves]{};
  std::int16_t grad_of[max_leaves]{};
  std::int16_t update_of[max_leaves]{};
  int raw_root = -1; // the traced loss expression
  errc err = errc::none;
  axis_name unknown_axis{}; // errc::unknown_axis: the axis the program names and the mesh lacks
  int where = -1; // raw node of the mistake
  int loss = -1;
  int forward_end = 0;
  op_code opt = op_code::sgd;
  int stage = 0;
  int zero_axis = -1;
  repeat_info repeats[max_repeats]{};
  int repeat_count = 0;
  int cur_block = -1; // the repeat whose block is being traced or emitted; stamped on new nodes

  constexpr bool failed(errc e, int raw_index) noexcept {
    if (err == errc::none) {
      err = e;
      where = raw_index;
    }
    return false;
  }

  // ---- helpers ---------------------------------------------------------------------------------
  constexpr int add(node x) noexcept {
    if (n >= static_cast<int>(Cap)) {
      failed(errc::capacity, -1);
      return 0;
    }
    if (cur_block >= 0) x.block = static_cast<std::int8_t>(cur_block);
    nodes[n] = x;
    acc[n] = -1;
    return n++;
  }

  /// The dimension ZeRO splits over `axis` in a tensor of spec `s` (ZeRO's choice of layout):
  /// the first one not split yet, else the first with room for a second (minor) axis; -1 when
  /// `s` is already split or summed over `axis`, or has no dimension to split. From rank 3 on,
  /// the last such one: the leading dims of a convolution's kernel [h, w, in, out] and of the
  /// experts' weights [experts, in, out] are small, and a split that does not divide is padded,
  /// so a 1×1 kernel split on its height over 64 ranks would be stored 64 times over.
  [[nodiscard]] static constexpr int zero_split_dim(const pspec& s, int axis) noexcept {
    if (axis < 0 || s.state(axis) != state_replicated || s.rank == 0) return -1;
    const bool last_first = s.rank >= 3;
    for (int slot = 0; slot < 2; ++slot)
      for (int i = 0; i < s.rank; ++i) {
        const int d = last_first ? s.rank - 1 - i : i;
        if (s.dims[d][slot] < 0) return d;
      }
    return -1;
  }
  /// The spec with `axis` added to the dimension zero_split_dim chooses.
  [[nodiscard]] static constexpr pspec shard_more(pspec s, int axis) noexcept {
    if (const int d = zero_split_dim(s, axis); d >= 0) s.set_state(axis, d);
    return s;
  }
  /// ZeRO-3 keeps a parameter split over its axis between uses: the stored spec of a traced
  /// parameter leaf whose program wrote one spec (use and storage alike).
  constexpr void store_zero3(node& x) const noexcept {
    if (x.op == op_code::param && stage == 3 && x.spec == x.use) {
      x.zero_dim = static_cast<std::int8_t>(zero_split_dim(x.spec, zero_axis));
      x.spec = shard_more(x.spec, zero_axis);
    }
  }

  /// Redistributes node `src` to `target`, reusing identical steps; returns the final node.
  constexpr int convert(int src, const pspec& target, ir::phase ph) noexcept {
    if (err != errc::none) return src;
    const auto plan = plan_redistribution(nodes[src].spec, target, axes.count);
    int cur = src;
    for (int s = 0; s < plan.size; ++s) {
      const auto& step = plan.steps[s];
      if (!keeps_axis_order(nodes[cur].spec, step)) {
        failed(errc::axis_order, -1);
        return cur;
      }
      node c;
      c.op = to_op(step.kind);
      c.phase = ph;
      c.kind = nodes[src].kind == role::gradient ? role::gradient : role::activation;
      c.in[0] = static_cast<std::int16_t>(cur);
      c.n_in = 1;
      c.spec = apply(nodes[cur].spec, step);
      c.axis = step.axis;
      c.dim = step.to_dim;
      c.dim2 = step.from_dim;
      c.of = nodes[src].of >= 0 ? nodes[src].of : static_cast<std::int16_t>(src);
      c.flags = static_cast<std::uint8_t>(nodes[src].flags & flag_needs_grad);
      int found = -1;
      for (int i = 0; i < n && found < 0; ++i)
        if (nodes[i].op == c.op && nodes[i].in[0] == c.in[0] && nodes[i].phase == ph && nodes[i].spec == c.spec &&
            nodes[i].block == cur_block && !nodes[i].has(flag_max))
          found = i;
      cur = found >= 0 ? found : add(c);
    }
    // A step moves an axis in or out of a dimension as its last (minor) one; a target that
    // lists a dimension's axes in another order cannot be reached so.
    if (!(nodes[cur].spec == target)) failed(errc::axis_order, -1);
    return cur;
  }

  // ---- 1. trace ----------------------------------------------------------------------------------
  constexpr bool unknown(const axis_name& a, int raw_index) noexcept {
    if (err == errc::none) unknown_axis = a;
    return failed(errc::unknown_axis, raw_index);
  }
  constexpr bool intern(const spec_value& v, pspec& out, int raw_index) noexcept {
    if (axes_fixed) {
      for (int d = 0; d < v.rank; ++d)
        for (const auto& a : v.dims[d])
          if (!a.empty() && axes.find(a) < 0) return unknown(a, raw_index);
      for (const auto& a : v.partial)
        if (!a.empty() && axes.find(a) < 0) return unknown(a, raw_index);
    }
    if (!to_pspec(v, axes, out)) return failed(errc::too_many_axes, raw_index);
    return true;
  }

  constexpr int raw_add(node x) noexcept {
    if (raw_n >= static_cast<int>(RawCap)) {
      failed(errc::capacity, -1);
      return 0;
    }
    if (cur_block >= 0) x.block = static_cast<std::int8_t>(cur_block);
    raw[raw_n] = x;
    return raw_n++;
  }

  constexpr int leaf(std::string_view name, leaf_kind k, const spec_value& use, const spec_value& stored,
                     leaf_init init = leaf_init::automatic) noexcept {
    if (err != errc::none) return 0;
    node x;
    const bool input = k == leaf_kind::input || k == leaf_kind::constant;
    x.op = input ? op_code::input : k == leaf_kind::data ? op_code::data : op_code::param;
    x.kind = input ? role::input : k == leaf_kind::data ? role::data : role::param;
    if (k == leaf_kind::constant) x.flags |= flag_no_grad;
    const int self = raw_n;
    if (!intern(use, x.use, self) || !intern(stored, x.spec, self)) {
      if (err == errc::unknown_axis && name_count < max_leaves) { // so that the message names the leaf
        names[name_count] = leaf_name(name);
        x.name = static_cast<std::int16_t>(name_count++);
        raw_add(x);
      }
      return 0;
    }
    store_zero3(x);
    if (x.use.has_partial()) x.flags |= flag_pinned;
    // Parameters of a block are per layer and data leaves are shared by its layers: neither can
    // also be a value outside the block, and an input's gradient would mix every layer's.
    if (cur_block >= 0 && x.op == op_code::input && name_count < max_leaves) {
      names[name_count] = leaf_name(name);
      x.name = static_cast<std::int16_t>(name_count++);
      raw_add(x);
      failed(errc::repeat_leaf_scope, self);
      return 0;
    }
    for (int i = 0; i < name_count; ++i)
      if (names[i] == name) {
        const auto& old = raw[leaf_node[i]];
        if (old.block != cur_block) {
          x.name = static_cast<std::int16_t>(i);
          raw_add(x);
          failed(errc::repeat_leaf_scope, self);
          return 0;
        }
        // A leaf with and one without gradient under one name would silently be whichever came first.
        if (old.op != x.op || !(old.spec == x.spec) || !(old.use == x.use) || old.has(flag_no_grad) != x.has(flag_no_grad) ||
            inits[i] != init) {
          x.name = static_cast<std::int16_t>(i);
          raw_add(x);
          failed(errc::leaf_redefined, self);
          return 0;
        }
        return leaf_node[i];
      }
    if (name_count == max_leaves) {
      failed(errc::capacity, self);
      return 0;
    }
    names[name_count] = leaf_name(name);
    inits[name_count] = init;
    free_dims[name_count] = static_cast<std::uint8_t>(use.free | stored.free);
    x.name = static_cast<std::int16_t>(name_count);
    leaf_node[name_count++] = static_cast<std::int16_t>(raw_n);
    return raw_add(x);
  }

  /// `proto` carries what the expression's type adds to its op: a routing's settings, a flag.
  constexpr int raw_op(op_code op, const int* ins, int count, const spec_value* target, const node& proto = {}) noexcept {
    if (err != errc::none) return 0;
    node x = proto;
    x.op = op;
    x.n_in = static_cast<std::int8_t>(count);
    for (int i = 0; i < count; ++i) x.in[i] = static_cast<std::int16_t>(ins[i]);
    if (target) {
      if (!intern(*target, x.use, raw_n)) return 0;
      x.free = target->free;
    }
    for (int i = 0; i < raw_n; ++i) { // one node per distinct subexpression
      const auto& o = raw[i];
      if (o.op == op && o.n_in == x.n_in && o.in[0] == x.in[0] && o.in[1] == x.in[1] && o.in[2] == x.in[2] &&
          o.use == x.use && o.block == cur_block && o.same_settings(x) && o.local_stats == x.local_stats && o.momentum == x.momentum &&
          o.flags == x.flags && o.free == x.free)
        return i;
    }
    return raw_add(x);
  }

  /// The raw node a repeat already traced on this input stands for, or -1.
  [[nodiscard]] constexpr int traced_repeat(std::string_view name, int x) const noexcept {
    for (int k = 0; k < repeat_count; ++k)
      if (repeats[k].name == name && repeats[k].raw_x == x && repeats[k].raw_out >= 0) return repeats[k].raw_out;
    return -1;
  }
  constexpr int begin_repeat(std::string_view name, int x) noexcept {
    if (err != errc::none) return 0;
    if (cur_block >= 0 || repeat_count == max_repeats) {
      failed(errc::repeat_nested, x);
      return 0;
    }
    auto& r = repeats[repeat_count];
    r.name = repeat_name(name);
    r.raw_x = static_cast<std::int16_t>(x);
    cur_block = repeat_count++;
    node in;
    in.op = op_code::repeat_in;
    in.in[0] = static_cast<std::int16_t>(x);
    in.n_in = 1;
    r.raw_in = static_cast<std::int16_t>(raw_add(in));
    return r.raw_in;
  }
  /// The placeholder of the block being traced; a placeholder of another repeat means nesting.
  [[nodiscard]] constexpr int block_input(std::string_view name) noexcept {
    if (err != errc::none) return 0;
    if (cur_block < 0 || !(repeats[cur_block].name == name)) {
      failed(errc::repeat_nested, -1);
      return 0;
    }
    return repeats[cur_block].raw_in;
  }
  constexpr int end_repeat(int body) noexcept {
    if (err != errc::none) return 0;
    node out;
    out.op = op_code::repeat_out;
    out.in[0] = static_cast<std::int16_t>(body);
    out.n_in = 1;
    const int r = raw_add(out);
    repeats[cur_block].raw_out = static_cast<std::int16_t>(r);
    cur_block = -1;
    return r;
  }

  /// Passes 2-4 on the traced program (`raw`, `raw_root`): at compile time after the trace, at
  /// run time after automatic sharding rewrote leaves' specs (graph/respecify.hpp).
  constexpr void run_passes() noexcept {
    propagate();
    if (err != errc::none) return;
    loss = map[raw_root];
    if (nodes[loss].spec.rank != 0) {
      failed(errc::loss_not_scalar, raw_root);
      return;
    }
    autodiff();
    if (err == errc::none) optimize();
  }

  // ---- 2. propagate --------------------------------------------------------------------------------
  constexpr int emit(op_code op, const int* ins, int count, const pspec& spec, ir::phase ph, role k,
                     std::uint8_t flags = 0, int of = -1) noexcept {
    node x;
    x.op = op;
    x.phase = ph;
    x.kind = k;
    x.flags = flags;
    for (int i = 0; i < count; ++i) x.in[x.n_in++] = static_cast<std::int16_t>(ins[i]);
    x.spec = spec;
    x.of = static_cast<std::int16_t>(of);
    return add(x);
  }
  constexpr int emit(op_code op, std::initializer_list<int> ins, const pspec& spec, ir::phase ph, role k,
                     std::uint8_t flags = 0, int of = -1) noexcept {
    return emit(op, ins.begin(), static_cast<int>(ins.size()), spec, ph, k, flags, of);
  }

  [[nodiscard]] constexpr bool pinned(int i) const noexcept { return nodes[i].has(flag_pinned); }
  [[nodiscard]] constexpr const pspec& sp(int i) const noexcept { return nodes[i].spec; }

  constexpr void propagate() noexcept {
    for (int r = 0; r < raw_n && err == errc::none; ++r) {
      const node& x = raw[r];
      cur_block = x.block;
      int in[4] = {-1, -1, -1, -1};
      std::uint8_t ng = 0;
      for (int i = 0; i < x.n_in; ++i) {
        in[i] = map[x.in[i]];
        ng |= nodes[in[i]].flags & flag_needs_grad;
      }
      if (is_leaf(x.op)) {
        node l = x;
        l.in[0] = -1;
        if (leaf_needs_grad(x)) l.flags |= flag_needs_grad;
        const int li = add(l);
        leaf_node[x.name] = static_cast<std::int16_t>(li);
        map[r] = static_cast<std::int16_t>(convert(li, x.use, ir::phase::forward));
        continue;
      }
      if (ir::info(x.op).role == ir::op_role::structural) {
        propagate_structure(r, in[0]);
        continue;
      }
      bool emitted = false;
      const rules::result rr = apply_rule(r, in, ng, emitted);
      if (rr.err != errc::none) failed(rr.err, r);
      if (err != errc::none || emitted) continue;
      int conv[4] = {-1, -1, -1, -1};
      for (int i = 0; i < x.n_in; ++i) conv[i] = convert(in[i], rr.need[i], ir::phase::forward);
      node o;
      o.op = x.op;
      o.kind = ir::info(x.op).kind == ir::op_kind::loss ? role::loss : role::activation;
      o.flags = static_cast<std::uint8_t>(ng | (x.flags & flag_bidirectional));
      o.take_settings(x);
      if (x.op == op_code::conv2d) kernel_initialiser(x.in[1]);
      for (int i = 0; i < x.n_in; ++i) o.in[o.n_in++] = static_cast<std::int16_t>(conv[i]);
      o.spec = rr.out;
      map[r] = static_cast<std::int16_t>(add(o));
    }
  }

  /// A parameter read as a convolution's kernel (through `.to()`) starts scaled by its window's
  /// fan-in, kernel_h·kernel_w·in, unless the program names its initialiser.
  constexpr void kernel_initialiser(int r) noexcept {
    while (raw[r].op == op_code::to) r = raw[r].in[0];
    if (raw[r].op == op_code::param && inits[raw[r].name] == leaf_init::automatic) inits[raw[r].name] = leaf_init::kernel_fan_in;
  }

  /// The compiler's own nodes: a repeated block's bounds and an explicit redistribution.
  constexpr void propagate_structure(int r, int in) noexcept {
    const node& x = raw[r];
    if (x.op == op_code::repeat_in) {
      // A pending sum the program made (a vocab-parallel embedding's) is made once before the
      // stack, not in every layer; the conversion belongs to the outside.
      if (sp(in).has_partial() && !pinned(in)) {
        cur_block = -1;
        in = convert(in, sp(in).without_partial(), ir::phase::forward);
        cur_block = x.block;
      }
      node o;
      o.op = op_code::repeat_in;
      o.in[0] = static_cast<std::int16_t>(in);
      o.n_in = 1;
      o.spec = sp(in);
      // Layers after the first read a value that depends on parameters, whatever the stack's input
      // is. (Layer 0's input gradient, useless when the input has none, goes after lowering:
      // ir::remove_dead_tasks.)
      o.flags = static_cast<std::uint8_t>(flag_needs_grad | (nodes[in].flags & flag_pinned));
      map[r] = static_cast<std::int16_t>(add(o));
      repeats[x.block].in = map[r];
    } else if (x.op == op_code::repeat_out) {
      auto& rep = repeats[x.block];
      int o = in;
      const pspec want = sp(rep.in);
      // A pending sum the block made itself is made here, as any op would; other changes are the user's.
      if (!(sp(o) == want) && !pinned(o) && sp(o).without_partial() == want) o = convert(o, want, ir::phase::forward);
      if (!(sp(o) == want)) {
        failed(errc::repeat_spec_changed, r);
        return;
      }
      rep.out = static_cast<std::int16_t>(o);
      map[r] = static_cast<std::int16_t>(o);
    } else if (x.op == op_code::to) {
      if (x.use.rank != sp(in).rank) {
        failed(errc::rank_mismatch, r);
        return;
      }
      const int res = convert(in, kept_where_free(x.use, x.free, sp(in)), ir::phase::forward);
      if (x.use.has_partial()) nodes[res].flags |= flag_pinned;
      map[r] = static_cast<std::int16_t>(res);
    } else {
      failed(errc::unbuildable_op, r); // a structural op the compiler does not build: unreachable from the DSL
    }
  }

  /// The sharding rule of raw node r's op over its operands `in` (graph::op_rule): the spec each
  /// operand is brought to and the output's. A rule whose op is built of several nodes (batch
  /// normalisation, the vocab-parallel cross-entropy) builds them here and sets `emitted`.
  constexpr rules::result apply_rule(int r, const int* in, std::uint8_t ng, bool& emitted) noexcept {
    const node& x = raw[r];
    pspec specs[4]{};
    std::uint8_t pins = 0;
    for (int k = 0; k < x.n_in; ++k) {
      specs[k] = sp(in[k]);
      if (pinned(in[k])) pins = static_cast<std::uint8_t>(pins | 1u << k);
    }
    const bool routed = x.n_in > 1 && raw[x.in[1]].op == op_code::moe_route;
    const rule_answer a = op_rule(x, specs, pins, axes.count, routed);
    if (a.specs.err != errc::none || a.builds == rule_builds::one_node) return a.specs;
    emitted = true;
    map[r] = static_cast<std::int16_t>(a.builds == rule_builds::batchnorm ? batch_norm(in[0], in[1], in[2], x, ng)
                                                                          : vocab_parallel_ce(in[0], in[1], a.specs.need[0], ng));
    return {};
  }

  /// Megatron-LM's vocab-parallel cross-entropy: the logits stay split over `axis` on the vocabulary;
  /// the row max is all-reduced (max), then the target logit and the sum of exponentials (sums).
  constexpr int vocab_parallel_ce(int logits, int labels, const pspec& lspec, std::uint8_t ng) noexcept {
    const int rk = lspec.rank, axis = lspec.dims[rk - 1][0];
    const pspec rows = rules::leading_dims_of(lspec, axes.count);
    const int lg = convert(logits, lspec, ir::phase::forward), lb = convert(labels, rows, ir::phase::forward);
    const auto fwd = ir::phase::forward;
    const int local_max = emit(op_code::vocab_ce_max, {lg}, rows, fwd, role::activation);
    node c;
    c.op = op_code::all_reduce;
    c.flags = flag_max;
    c.in[0] = static_cast<std::int16_t>(local_max);
    c.n_in = 1;
    c.spec = rows;
    c.axis = static_cast<std::int8_t>(axis);
    c.of = static_cast<std::int16_t>(local_max);
    const int mx = add(c);
    pspec part = rows;
    part.set_state(axis, state_partial);
    const int t = convert(emit(op_code::vocab_ce_target, {lg, lb, mx}, part, fwd, role::activation), rows, fwd);
    const int s = convert(emit(op_code::vocab_ce_sumexp, {lg, mx}, part, fwd, role::activation), rows, fwd);
    pspec loss_spec;
    loss_spec.partial = rules::axes_splitting(rows, 0, max_rank, axes.count);
    return emit(op_code::vocab_ce_loss, {s, t}, loss_spec, fwd, role::loss, ng);
  }

  /// Batch normalisation of x (made whole) by gamma and beta laid out like its channels: the
  /// sums [2, channels] (all-reduced over the axes splitting x's rows unless `local`), the scale
  /// [3, channels] from them and gamma, then the normalisation, which reads x, the scale and beta.
  constexpr int batch_norm(int x_in, int gamma_in, int beta_in, const node& settings, std::uint8_t ng) noexcept {
    const bool local = settings.local_stats;
    const auto fwd = ir::phase::forward;
    const int A = axes.count;
    const pspec xs = sp(x_in).without_partial();
    const pspec channels = rules::like_last_dim(xs, A);
    const int x = convert(x_in, xs, fwd), gamma = convert(gamma_in, channels, fwd), beta = convert(beta_in, channels, fwd);
    pspec stats;
    stats.rank = 2;
    for (int a = 0; a < A; ++a)
      if (xs.state(a) == xs.rank - 1) stats.set_state(a, 1);
    pspec summed = stats;
    if (!local) summed.partial = rules::axes_splitting(xs, 0, xs.rank - 2, A);
    const int sums = emit(op_code::batchnorm_stats, {x}, summed, fwd, role::activation);
    const int reduced = convert(sums, stats, fwd);
    // The running statistics: a state named after the gain (`<gain>.running`), moved by every
    // training step (batchnorm_track) and read by evaluation's scale (its third operand).
    int gain_leaf = gamma_in;
    while (is_redistribution(nodes[gain_leaf].op)) gain_leaf = nodes[gain_leaf].in[0];
    const int running = emit(op_code::state, {}, stats, fwd, role::state, 0, reduced);
    nodes[running].name = nodes[gain_leaf].name;
    nodes[running].dim = state_running;
    const int track = emit(op_code::batchnorm_track, {reduced, running}, stats, fwd, role::activation, 0, reduced);
    nodes[track].momentum = settings.momentum;
    const int scale = emit(op_code::batchnorm_scale, {reduced, gamma, running}, stats, fwd, role::activation);
    const int y = emit(op_code::batchnorm, {x, scale, beta}, xs, fwd, role::activation, ng);
    nodes[sums].local_stats = nodes[track].local_stats = nodes[scale].local_stats = nodes[y].local_stats = local;
    return y;
  }

  // ---- 3. autodiff -----------------------------------------------------------------------------------
  [[nodiscard]] constexpr bool needs_grad(int i) const noexcept { return nodes[i].has(flag_needs_grad); }

  constexpr void accumulate(int target, int contribution) noexcept {
    if (err != errc::none) return;
    if (acc[target] < 0) {
      acc[target] = static_cast<std::int16_t>(contribution);
      return;
    }
    const auto u = rules::unify(sp(acc[target]), sp(contribution), axes.count);
    if (u.err != errc::none) {
      failed(u.err, -1);
      return;
    }
    const int a = convert(acc[target], u.need[0], ir::phase::backward);
    const int b = convert(contribution, u.need[1], ir::phase::backward);
    acc[target] = static_cast<std::int16_t>(emit(op_code::add, {a, b}, u.out, ir::phase::backward, role::gradient, 0, target));
  }

  /// A gathered parameter is gathered again for backward instead of being kept (ZeRO-3 / FSDP).
  constexpr int regather(int i) noexcept {
    int src = i;
    bool gathered = false;
    while (is_redistribution(nodes[src].op) && nodes[src].phase == ir::phase::forward) {
      gathered |= nodes[src].op == op_code::all_gather;
      src = nodes[src].in[0];
    }
    if (!gathered || nodes[src].op != op_code::param) return i;
    return convert(src, sp(i), ir::phase::backward);
  }

  constexpr int bwd(op_code op, std::initializer_list<int> ins, const pspec& spec, int of, std::uint8_t flags = 0) noexcept {
    return emit(op, ins, spec, ir::phase::backward, role::gradient, flags, of);
  }

  /// An einsum-ruled backward product (a matmul, a convolution's gradient): converts its operands and emits it.
  constexpr int bwd_product(op_code op, int a, const rules::labels& la, int b, const rules::labels& lb,
                            const rules::labels& lo, std::uint8_t flags, int of) noexcept {
    const auto rr = rules::contract(sp(a), la, sp(b), lb, lo, axes.count);
    if (rr.err != errc::none) {
      failed(rr.err, -1);
      return 0;
    }
    const int ca = convert(a, rr.need[0], ir::phase::backward), cb = convert(b, rr.need[1], ir::phase::backward);
    return bwd(op, {ca, cb}, rr.out, of, flags);
  }
  constexpr int bwd_matmul(int a, const rules::labels& la, int b, const rules::labels& lb, const rules::labels& lo,
                           std::uint8_t flags, int of) noexcept {
    return bwd_product(op_code::matmul, a, la, b, lb, lo, flags, of);
  }

  constexpr void autodiff() noexcept {
    forward_end = n;
    // The loss may be a sum of scalar losses (cross-entropy + a balance loss): each term's
    // gradient is one, as the loss's; the kernels of a loss's gradient take it as such.
    unit[loss] = true;
    for (int i = loss; i >= 0; --i)
      if (unit[i] && nodes[i].spec.rank == 0 && (nodes[i].op == op_code::add || is_redistribution(nodes[i].op)))
        for (int k = 0; k < nodes[i].n_in; ++k) unit[nodes[i].in[k]] = true;
    bool entered[max_repeats]{};
    for (int i = forward_end - 1; i >= 0 && err == errc::none; --i) {
      cur_block = -1;
      if (const int k = nodes[i].block; k >= 0) {
        auto& rep = repeats[k];
        if (!entered[k] && rep.out >= 0 && acc[rep.out] >= 0) {
          // Every layer but the last receives its output gradient from the next layer's grad_in,
          // so both are brought to one spec.
          acc[rep.out] = static_cast<std::int16_t>(convert(acc[rep.out], sp(rep.out).without_partial(), ir::phase::backward));
          rep.grad_out = acc[rep.out];
        }
        entered[k] = true;
        cur_block = k;
        if (i == rep.in) {
          if (acc[i] < 0) continue;
          const int g = convert(acc[i], sp(i).without_partial(), ir::phase::backward);
          rep.grad_in = static_cast<std::int16_t>(g);
          cur_block = -1;
          if (needs_grad(nodes[i].in[0])) accumulate(nodes[i].in[0], g);
          continue;
        }
      }
      if (!unit[i] && acc[i] < 0) continue;
      const node y = nodes[i];
      if (unit[i] && (y.op == op_code::add || is_redistribution(y.op))) continue; // its terms are units
      if (y.op == op_code::input || y.op == op_code::param) {
        pspec target = y.spec.without_partial();
        if (y.op == op_code::param && stage == 2) target = shard_more(target, zero_axis);
        const int g = convert(acc[i], target, ir::phase::backward);
        grad_of[y.name] = static_cast<std::int16_t>(g);
        continue;
      }
      if (is_redistribution(y.op) || y.op == op_code::repeat_in) {
        accumulate(y.in[0], acc[i]);
        continue;
      }
      const int g = unit[i] ? -1 : convert(acc[i], y.spec.without_partial(), ir::phase::backward);
      differentiate(i, g);
    }
  }

  /// The backward recipe of node i's op (its table entry's), given its output gradient g.
  constexpr void differentiate(int i, int g) noexcept {
    const node y = nodes[i];
    const auto& recipe = ir::info(y.op);
    switch (recipe.grad) {
    case ir::backward::pass_through:
      for (int k = 0; k < y.n_in; ++k)
        if (needs_grad(y.in[k])) accumulate(y.in[k], g);
      return;
    case ir::backward::terms:
      for (int k = 0; k < y.n_in; ++k) {
        const auto& t = recipe.terms[static_cast<std::size_t>(k)];
        const int x = y.in[k];
        if (!needs_grad(x) || (t.fn == op_code::none && t.args[0] == ir::grad_arg::none)) continue;
        accumulate(x, t.fn == op_code::none ? g : gradient_task(t, i, g, term_spec(t, y, k), x, k));
      }
      return;
    case ir::backward::packed: {
      // One task writes every operand's gradient, one after the other; each operand that needs
      // its gradient gets its part as a view.
      const auto& t = recipe.terms[0];
      const int packed = gradient_task(t, i, g, sp(y.in[0]), grad_operand(t.shaped_as, i, g));
      for (int k = 0; k < y.n_in; ++k)
        if (needs_grad(y.in[k])) {
          const int s = bwd(op_code::select, {packed}, sp(y.in[k]), y.in[k]);
          nodes[s].dim = static_cast<std::int8_t>(k);
          accumulate(y.in[k], s);
        }
      return;
    }
    case ir::backward::contract: {
      const int a = y.in[0], b = y.in[1], ra = sp(a).rank, rb = sp(b).rank;
      const auto la = rules::make_labels(ra, 'm', 'k'), lb = rules::make_labels(rb, 'k', 'n'),
                 lo = rules::make_labels(ra, 'm', 'n');
      if (needs_grad(a)) accumulate(a, bwd_matmul(g, lo, regather(b), lb, la, flag_trans_b, a));
      if (needs_grad(b)) accumulate(b, bwd_matmul(regather(a), la, g, lo, lb, flag_trans_a, b));
      return;
    }
    case ir::backward::convolution: {
      // Each operand's gradient is a product of the other operand and dy (the recipe's term k), its
      // spec the einsum rule's over the convolution's labels; a gathered weight is gathered again.
      const auto labels_of = [](ir::grad_arg a) {
        return a == ir::grad_arg::in0 ? rules::conv_image : a == ir::grad_arg::in1 ? rules::conv_kernel : rules::conv_output;
      };
      for (int k = 0; k < 2; ++k) {
        const auto& t = recipe.terms[static_cast<std::size_t>(k)];
        if (!needs_grad(y.in[k])) continue;
        const auto operand = [&](ir::grad_arg a) { return a == ir::grad_arg::dout ? g : regather(grad_operand(a, i, g)); };
        const int d = bwd_product(t.fn, operand(t.args[0]), labels_of(t.args[0]), operand(t.args[1]), labels_of(t.args[1]),
                                  labels_of(k == 0 ? ir::grad_arg::in0 : ir::grad_arg::in1), 0, y.in[k]);
        nodes[d].conv = y.conv;
        accumulate(y.in[k], d);
      }
      return;
    }
    case ir::backward::batchnorm: {
      // Σdy and Σdy·x̂ per channel, summed over the ranks holding the batch's other rows (for dx
      // when synchronised; for dgamma and dbeta always, later with the other gradients when local).
      const int x = y.in[0], scale = y.in[1], beta = y.in[2], gamma = nodes[scale].in[1];
      const auto bwd_phase = ir::phase::backward;
      pspec summed = sp(scale);
      summed.partial = rules::axes_splitting(sp(x), 0, sp(x).rank - 2, axes.count);
      int sums = emit(op_code::batchnorm_grad_stats, {x, scale, g}, summed, bwd_phase, role::gradient);
      nodes[sums].local_stats = y.local_stats;
      if (!y.local_stats) sums = convert(sums, sp(scale), bwd_phase);
      if (needs_grad(x)) {
        const int dx = bwd(op_code::batchnorm_grad, {x, scale, sums, g}, sp(x).without_partial(), x);
        nodes[dx].local_stats = y.local_stats;
        accumulate(x, dx);
      }
      // dbeta is row 0 of the sums, dgamma row 1: views.
      for (const auto& [part, target] : {std::pair{0, beta}, std::pair{1, gamma}}) {
        if (!needs_grad(target)) continue;
        pspec row;
        row.rank = 1;
        for (int k = 0; k < max_dim_axes; ++k) row.dims[0][k] = sp(sums).dims[1][k];
        row.partial = sp(sums).partial;
        const int s = bwd(op_code::select, {sums}, row, target);
        nodes[s].dim = static_cast<std::int8_t>(part);
        accumulate(target, s);
      }
      return;
    }
    case ir::backward::vocab_ce: {
      // The loss of the vocab-parallel cross-entropy: one task from the pieces its forward saved.
      const auto before = [&](int j) {
        while (is_redistribution(nodes[j].op)) j = nodes[j].in[0];
        return j;
      };
      const int sumexp = before(y.in[0]), target = before(y.in[1]);
      const int logits = nodes[sumexp].in[0], labels = nodes[target].in[1], mx = nodes[sumexp].in[1];
      if (needs_grad(logits))
        accumulate(logits, bwd(op_code::vocab_ce_grad, {logits, labels, mx, y.in[0]}, sp(logits), logits));
      return;
    }
    case ir::backward::none: return;
    }
  }

  /// The node a recipe's argument names, for forward node i with output gradient g.
  constexpr int grad_operand(ir::grad_arg a, int i, int g) noexcept {
    switch (a) {
    case ir::grad_arg::in0:
    case ir::grad_arg::in1:
    case ir::grad_arg::in2:
    case ir::grad_arg::in3: return nodes[i].in[static_cast<int>(a)];
    case ir::grad_arg::out: return i;
    case ir::grad_arg::dout: return g;
    case ir::grad_arg::regathered_in1: return regather(nodes[i].in[1]);
    case ir::grad_arg::none: break;
    }
    return -1;
  }

  /// The spec of the gradient term of operand k of node y (see ir::grad_spec).
  [[nodiscard]] constexpr pspec term_spec(const ir::grad_term& t, const node& y, int k) const noexcept {
    pspec s = sp(y.in[k]).without_partial();
    const pspec& rows = sp(y.in[0]);
    // Over the dims x has and the broadcast operand lacks; x is the first operand of the highest
    // rank (a concat's table may come first).
    const pspec& x = y.n_in > 1 && sp(y.in[1]).rank > rows.rank ? sp(y.in[1]) : rows;
    if (t.spec == ir::grad_spec::summed_over_rows) s.partial = rules::axes_splitting(x, 0, x.rank - 1 - s.rank, axes.count);
    if (t.spec == ir::grad_spec::summed_over_ids) s.partial = rules::axes_splitting(rows, 0, max_rank, axes.count);
    return s;
  }

  /// One task of a recipe for forward node i: its operands in the term's order (conversions they
  /// need made first), the forward op's settings (an MoE routing's, a bidirectional attention's).
  constexpr int gradient_task(const ir::grad_term& t, int i, int g, const pspec& spec, int of, int operand = -1) noexcept {
    int args[4] = {-1, -1, -1, -1};
    int count = 0;
    for (const auto a : t.args)
      if (a != ir::grad_arg::none) args[count++] = grad_operand(a, i, g);
    const int d = emit(t.fn, args, count, spec, ir::phase::backward, role::gradient,
                       static_cast<std::uint8_t>(nodes[i].flags & flag_bidirectional), of);
    nodes[d].take_settings(nodes[i]);
    nodes[d].forward = static_cast<std::int16_t>(i);
    nodes[d].operand = static_cast<std::int8_t>(operand);
    return d;
  }

  // ---- 4. optimizer ------------------------------------------------------------------------------------
  constexpr void optimize() noexcept {
    const auto opt_phase = ir::phase::optimizer;
    for (int l = 0; l < name_count && err == errc::none; ++l) {
      const int p = leaf_node[l];
      if (nodes[p].op != op_code::param || grad_of[l] < 0) continue;
      cur_block = nodes[p].block; // a block's parameters are updated layer by layer
      const pspec storage = nodes[p].spec;
      const bool sharded_state = stage == 1 || stage == 2;
      const pspec shard = sharded_state ? shard_more(storage, zero_axis) : storage;
      if (sharded_state) nodes[p].zero_dim = static_cast<std::int8_t>(zero_split_dim(storage, zero_axis));
      const int gs = convert(grad_of[l], shard, opt_phase);
      const int ps = convert(p, shard, opt_phase);
      int m = -1, v = -1;
      if (opt == op_code::adamw) {
        m = emit(op_code::state, {}, shard, opt_phase, role::state, 0, p);
        v = emit(op_code::state, {}, shard, opt_phase, role::state, 0, p);
        nodes[m].name = nodes[v].name = static_cast<std::int16_t>(l);
        nodes[m].dim = state_m;
        nodes[v].dim = state_v;
      }
      const int u = opt == op_code::adamw ? emit(opt, {ps, gs, m, v}, shard, opt_phase, role::update, 0, p)
                                          : emit(opt, {ps, gs}, shard, opt_phase, role::update, 0, p);
      nodes[u].name = static_cast<std::int16_t>(l);
      update_of[l] = static_cast<std::int16_t>(u);
      const int out = convert(u, storage, opt_phase);
      nodes[out].flags |= flag_writes_param;
      nodes[out].name = static_cast<std::int16_t>(l);
    }
    cur_block = -1;
  }
};

// ---- tracing the expression type --------------------------------------------------------------------

template <class E>
struct tracer;

template <fixed_string Name, leaf_kind K, class S, class T, leaf_init I>
struct tracer<leaf_expr<Name, K, S, T, I>> {
  template <class W>
  static constexpr int run(W& w) noexcept {
    return w.leaf(Name.view(), K, S::value, T::value, I);
  }
};

template <op_code Op, class Extra, class... Args>
struct tracer<node_expr<Op, Extra, Args...>> {
  template <class W>
  static constexpr int run(W& w) noexcept {
    const int ins[] = {tracer<Args>::run(w)...};
    if constexpr (std::is_same_v<Extra, concerto::detail::no_extra>) {
      return w.raw_op(Op, ins, static_cast<int>(sizeof...(Args)), nullptr);
    } else if constexpr (concerto::detail::is_settings_extra<Extra>) {
      // The op's settings, into the node's field of their type.
      using settings = std::remove_cvref_t<decltype(Extra::value)>;
      node proto;
      if constexpr (std::is_same_v<settings, moe_config>) proto.moe = Extra::value;
      else if constexpr (std::is_same_v<settings, conv_config>) proto.conv = Extra::value;
      else if constexpr (std::is_same_v<settings, dim_range>) proto.dims = Extra::value;
      else if constexpr (std::is_same_v<settings, dim_slice>) proto.part = Extra::value;
      else if constexpr (std::is_same_v<settings, dropout_config>) proto.drop = Extra::value;
      else if constexpr (std::is_same_v<settings, pool_config>) {
        proto.conv = {Extra::value.step(), Extra::value.padding};
        proto.window = static_cast<std::int8_t>(Extra::value.window);
      }
      else if constexpr (std::is_same_v<settings, batchnorm_config>) {
        proto.local_stats = !Extra::value.sync;
        proto.momentum = Extra::value.momentum;
      }
      else static_assert(std::is_same_v<settings, moe_config>, "an op's settings of a type the node does not hold");
      return w.raw_op(Op, ins, static_cast<int>(sizeof...(Args)), nullptr, proto);
    } else if constexpr (std::is_same_v<Extra, concerto::detail::bidirectional_extra>) {
      node proto;
      proto.flags = flag_bidirectional;
      return w.raw_op(Op, ins, static_cast<int>(sizeof...(Args)), nullptr, proto);
    } else {
      constexpr spec_value target = Extra::value;
      static_assert(target.free == 0 || target.partial[0].empty(),
                    "concerto: .to(spec(...)) with both auto_ and partial(...): a pending sum is pinned by a layout written "
                    "whole; write every dim's placement, or leave the sum to automatic sharding");
      return w.raw_op(Op, ins, static_cast<int>(sizeof...(Args)), &target);
    }
  }
};

template <fixed_string Name>
struct tracer<block_input<Name>> {
  template <class W>
  static constexpr int run(W& w) noexcept {
    return w.block_input(Name.view());
  }
};

template <fixed_string Name, class Body, class In>
struct tracer<repeat_expr<Name, Body, In>> {
  template <class W>
  static constexpr int run(W& w) noexcept {
    const int x = tracer<In>::run(w);
    if (const int done = w.traced_repeat(Name.view(), x); done >= 0) return done;
    w.begin_repeat(Name.view(), x);
    return w.end_repeat(tracer<Body>::run(w));
  }
};

template <class Mesh>
struct mesh_axes;
template <mesh_axis_type... A>
struct mesh_axes<mesh_decl<A...>> {
  static constexpr bool declared = sizeof...(A) > 0;
  template <class W>
  static constexpr void add(W& w) noexcept {
    (w.axes.intern(axis_name(A::name())), ...);
  }
};

/// Runs every pass; the result carries the first mistake, if any.
template <class E, class Opt, class Mesh>
constexpr auto compile() noexcept {
  constexpr std::size_t raw_cap = E::size + 1;
  constexpr std::size_t cap = 24 * E::size + 64;
  work<raw_cap, cap> w;
  using traits = concerto::detail::optimizer_traits<Opt>;
  w.opt = traits::op;
  w.stage = traits::stage;
  for (auto& g : w.grad_of) g = -1;
  for (auto& u : w.update_of) u = -1;
  mesh_axes<Mesh>::add(w);
  w.axes_fixed = mesh_axes<Mesh>::declared;
  if constexpr (traits::stage > 0) {
    if (w.axes_fixed && w.axes.find(axis_name(traits::axis)) < 0) {
      w.unknown(axis_name(traits::axis), -1);
      return w;
    }
    w.zero_axis = w.axes.intern(axis_name(traits::axis));
  }
  w.raw_root = tracer<E>::run(w);
  if (w.err == errc::none) w.run_passes();
  return w;
}

} // namespace concerto::graph::detail
