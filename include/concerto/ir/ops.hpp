#pragma once
/// @file
/// @brief The op table: one definition per operation, read by every layer.
///
/// An op is a DSL node (`matmul`, `rmsnorm`, `.to()`, a leaf), the function of a task (`fn`) or
/// both: the DSL's `gelu` node lowers to a task whose fn is `gelu`. Each entry says, in one
/// place, what every layer needs to know of the op:
///
/// | field | read by |
/// |---|---|
/// | name | graph JSON, the plan cache, traces, messages (the only place an op is a string) |
/// | role, task kind | graph validation, the planner (which stream), the cost model |
/// | executable | validation: a graph that is not cost-only may only hold ops both executors run |
/// | operands | validation (counts), the typed decoding of a task (runtime/kernel_call.hpp), messages |
/// | attrs | validation: the attributes a task of the op must carry |
/// | flops | ir::builder (so the DSL lowering and the workloads price an op alike), the cost model |
/// | arity, sharding rule | expr::node_expr (ir::dsl_ready), the DSL compiler's propagation (a switch over the rules, expr/rules.hpp), the lowering's shapes |
/// | backward | the DSL's autodiff (graph/detail/compiler.hpp interprets each recipe) |
/// | accumulates | the pipeline split (a weight gradient summed over micro-batches in place) |
///
/// Adding an op: its enumerator and entry below, its CPU and CUDA kernels with their dispatch
/// cases (runtime/dispatch.hpp, runtime/cuda/dispatch.cuh, which switch over every op, so an op
/// without a case there is a compile error) and typed decoding (runtime/kernel_call.hpp); a DSL
/// op also its three-line function (expr/ops.hpp). Its rule and recipe are the entry's: the
/// compiler and the lowering read them. docs/architecture.md walks through one (tanh), file by file.
///
/// @code
/// static_assert(ir::info(ir::op::rmsnorm).kind == ir::op_kind::norm);
/// const auto fn = ir::op_from_string("gelu");           // the JSON edge
/// ir::builder b("g"); ... b.compute(ir::op::gelu, "act", {x}, {y});   // flops from the table
/// @endcode

#include <concerto/core/error.hpp>

#include <array>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

namespace concerto::ir {

/// @brief What a task does, as far as streams and costs are concerned: compute kinds first,
/// collectives from `all_reduce` on. The precise operation is the task's `fn` (an ir::op).
enum class op_kind : std::uint8_t {
  matmul,           ///< (batched) GEMM; attrs m, n, k, batch, trans_a, trans_b
  elementwise,      ///< add, gelu, bias_add, mul, ...
  norm,             ///< layernorm / rmsnorm and their backward
  softmax,          ///< softmax and its backward
  attention,        ///< fused attention, forward and backward
  loss,             ///< cross_entropy / mse and their gradients
  optimizer_update, ///< sgd / adamw
  copy,             ///< memcpy-like
  slice,            ///< take a chunk of a buffer
  concat,           ///< join chunks
  all_reduce,
  all_gather,
  reduce_scatter,
  all_to_all,
  send,
  recv,
  broadcast,
};
inline constexpr int op_kind_count = 17;

[[nodiscard]] constexpr bool is_collective(op_kind k) noexcept { return k >= op_kind::all_reduce; }
/// @brief Whether a collective combines values (its fn says how: sum, max, min).
[[nodiscard]] constexpr bool reduces(op_kind k) noexcept { return k == op_kind::all_reduce || k == op_kind::reduce_scatter; }

[[nodiscard]] constexpr std::string_view to_string(op_kind k) noexcept {
  constexpr std::string_view names[op_kind_count] = {
      "matmul",     "elementwise", "norm",           "softmax",    "attention", "loss",
      "optimizer_update", "copy",  "slice",          "concat",     "all_reduce", "all_gather",
      "reduce_scatter",   "all_to_all", "send",      "recv",       "broadcast"};
  return names[static_cast<int>(k)];
}

[[nodiscard]] inline std::optional<op_kind> op_kind_from_string(std::string_view s) noexcept {
  for (int i = 0; i < op_kind_count; ++i)
    if (to_string(static_cast<op_kind>(i)) == s) return static_cast<op_kind>(i);
  return std::nullopt;
}

/// @brief Every operation. The order is the table's (checked at compile time).
enum class op : std::uint8_t {
  none, ///< a task priced by its kind alone (cost-only graphs)
  // DSL structure: nodes that lower to no task
  input, data, param, state, to, repeat_in, repeat_out, select,
  // forward
  matmul, add, bias_add, gelu, relu, silu, mul, swiglu, layernorm, rmsnorm, softmax, attention, rope, embedding, mse,
  cross_entropy, vocab_ce_max, vocab_ce_target, vocab_ce_sumexp, vocab_ce_loss, moe_route, moe_dispatch, moe_combine,
  sigmoid, transpose, tanh, conv2d, flatten, batchnorm, batchnorm_stats, batchnorm_scale, batchnorm_track, sum_dim, mean_dim, max_pool, avg_pool,
  concat_dim, slice_dim, dropout, scale_table, unflatten,
  // backward
  bias_grad, gelu_grad, relu_grad, silu_grad, swiglu_grad, layernorm_grad, layernorm_grad_gamma,
  rmsnorm_grad, rmsnorm_grad_gain, softmax_grad, attention_grad, rope_grad, embedding_grad, mse_grad,
  cross_entropy_grad, vocab_ce_grad, moe_route_grad, moe_dispatch_grad, moe_combine_grad, sigmoid_grad,
  tanh_grad, conv2d_grad_input, conv2d_grad_weight, batchnorm_grad_stats, batchnorm_grad, flatten_grad, sum_dim_grad,
  mean_dim_grad, max_pool_grad, avg_pool_grad, concat_dim_grad, slice_dim_grad, dropout_grad, scale_table_grad,
  // redistribution (the DSL inserts them; the first four are collectives)
  all_reduce, all_gather, reduce_scatter, all_to_all, shard_slice, keep_one,
  // optimizer updates, and the global gradient norm that clipping scales them by
  sgd, adamw, grad_sq_norm,
  // kernels only graphs made without the DSL use (ir::builder, the planner's rewrites)
  add_inplace, scale, zero, copy, slice, concat,
  // a lower working precision's conversions (ir/precision.hpp inserts them)
  cast,
  // collectives the DSL does not insert
  send, recv, broadcast,
  // the function of a collective task: how it combines values
  sum, max, min,
  // priced by the cost model, run by no executor (the benchmark workloads' learned positions and block transposes)
  add_position, position_embedding_grad, transpose_blocks,
};
inline constexpr int op_count = static_cast<int>(op::transpose_blocks) + 1;

/// @brief What an op is.
enum class op_role : std::uint8_t {
  structural, ///< a DSL node without a task: leaves, .to(), a repeat's bounds, a view of a packed gradient
  compute,    ///< a kernel on the compute stream (also the redistributions that move no data between ranks)
  collective, ///< a collective; the DSL's redistribution node, never a task's fn (that is its reduction)
  reduction,  ///< the fn of a collective task
};

/// @brief The sharding rule of a DSL op; expr/rules.hpp implements each (rules::apply).
enum class sharding : std::uint8_t {
  none,          ///< not an op a user writes
  contract,      ///< matmul: the einsum rule
  unify,         ///< add: operands of one shape brought to one spec, linear
  bias,          ///< x + b[n]: x whole (no pending sum), b laid out like x's last dim
  pointwise,     ///< one operand, not linear: pending sums made first
  pointwise_two, ///< mul(a, b), swiglu(a, b): two operands of one shape and one spec, not linear
  rowwise,       ///< softmax / layernorm / rmsnorm: the last dim whole; vector operands like it
  attention,     ///< [batch, seq, heads·head_dim] q, k, v: seq whole; k, v split like q or replicated
  rope,          ///< x [..., seq, heads·head_dim] and positions [..., seq] following x's leading dims
  embedding,     ///< ids and a [vocab, hidden] table (vocab split: a pending sum)
  mse,           ///< prediction and target of one shape: a scalar
  cross_entropy, ///< logits and labels: a scalar (vocabulary split over one axis: vocab-parallel)
  routing,       ///< moe_route: logits [groups, tokens, experts], a group's tokens and the experts whole
  dispatch,      ///< moe_dispatch: x [groups, tokens, h] and its gates -> [experts, groups·capacity, h], groups split as x's
  combine,       ///< moe_combine: y [experts, groups·capacity, h] with groups split as the gates' -> [groups, tokens, h]
  swap_dims,     ///< transpose<d>: [..., a, b, ...] -> [..., b, a, ...] at dims d, d + 1, each axis following its dimension; linear
  convolution,   ///< conv2d: the einsum rule over x [batch, h, w, in] and w [kh, kw, in, out], the window's dimensions whole
  merge,         ///< flatten: dims first..last as one, split as the first of them (the others whole); linear
  unmerge,       ///< unflatten: one dim as two, the first split as it was (the second whole); linear
  reduce_dim,    ///< sum_dim / mean_dim: the dim's axes become pending sums, later dims move down; linear
  batchnorm,     ///< x [..., channels] whole (no pending sum), gamma and beta like its channels; the compiler makes the statistics' tasks
  pooling,       ///< max_pool / avg_pool: x [batch, h, w, c] with h and w whole; the average is linear, the maximum is not
  join,          ///< concat_dim: the dim whole, the other dims split alike (a lower-rank operand like the other's last dims)
  part,          ///< slice_dim: the dim whole, the others as they are; linear
  linear,        ///< dropout: any layout, pending sums included (a mask by global index scales every replica and term alike)
};

/// @brief How the DSL's autodiff builds the gradients of an op's operands.
enum class backward : std::uint8_t {
  none,         ///< no gradient (leaves are handled by the compiler; forward-only pieces)
  pass_through, ///< add: the output gradient is each operand's
  terms,        ///< one task per operand that needs a gradient (grad_term)
  packed,       ///< one task writes every operand's gradient, one after the other; each is a view
  contract,     ///< matmul: two products with transposed operands (the einsum rule's backward)
  vocab_ce,     ///< the vocab-parallel cross-entropy's loss: one task from the saved pieces
  convolution,  ///< conv2d: terms[0] the input's gradient, terms[1] the weight's, each spec by the einsum rule (as contract)
  batchnorm,    ///< batchnorm: the gradient's statistics (summed over the batch's ranks when synchronised), dx, and dgamma, dbeta as their parts
};

/// @brief How the DSL's lowering (graph/lower.hpp) makes an op's task: which attrs it derives
/// for the kernel and which buffer the task writes. Most compute ops take the rows of their
/// first operand; an op whose kernel reads attrs of its own names the form that derives them.
enum class task_form : std::uint8_t {
  none,        ///< the lowering never makes it (kernels of graphs made without the DSL, cost-only ops, .to())
  leaf,        ///< input, data, param, state: a buffer, no task
  layer_input, ///< a repeat's input: layer 0 reads the stack's input, layer i layer i-1's output
  view,        ///< one part of a packed gradient: a view, no task
  rows,        ///< n, rows, cols of the first operand (elementwise ops, norms, softmax, their gradients)
  matmul,      ///< m, n, k, batch and the transposes
  rope,        ///< its rows, head_dim (from the program's attention) and theta
  attention,   ///< batch, seq, heads, kv_heads, group, head_dim, causal (whole heads per rank, checked)
  transpose,   ///< the pair's extents (rows, cols), the size after it (inner) and, optional, before it (outer, 1 by default)
  embedding,   ///< tokens, vocab, hidden, and the mesh axis splitting the table's vocabulary
  loss,        ///< rows of the first operand and the entry's `loss_attrs`
  moe,         ///< experts, group, capacity (and top_k, the balance loss's weight) from the routing
  convolution, ///< the image's batch, height, width, channels, the kernel's size and channels, stride, padding
  reshape,     ///< flatten, unflatten and their gradient: the operand's buffer viewed in the node's shape, no task
  reduce_dim,  ///< outer, extent, inner around the reduced dim; a mean's 1/extent over the whole dim as num/den
  batchnorm,   ///< rows and channels of the image, and the rows its statistics count (every rank's when synchronised)
  pooling,     ///< the image's batch, height, width, channels, the window's side as kernel_h and kernel_w, stride, padding
  parts,       ///< lead, outer, extent, inner around the dim, a part's offset and length, the parts repeated over lead (dim_part)
  dropout,     ///< the rate, the seed, and this rank's block of the whole tensor (runtime::dropout_layout); evaluation: a view, no task
  update,      ///< in place on the parameter (or its shard) and the optimizer state
  shard,       ///< shard_slice, keep_one: this rank's part or one copy, moving no data between ranks
  collective,  ///< a collective task on the mesh axis of the node
};

/// @brief An argument of a gradient task: a forward operand, the forward output, or the output's gradient.
/// `regathered_*` is a forward operand gathered again for backward instead of being kept.
enum class grad_arg : std::int8_t { none = -1, in0, in1, in2, in3, out, dout, regathered_in1 };

/// @brief The spec of a gradient term (relative to the operand it is the gradient of).
enum class grad_spec : std::uint8_t {
  of_operand,         ///< the operand's spec without pending sums
  summed_over_rows,   ///< a broadcast operand (a vector, a table of x's last dims): pending over the axes splitting x's other dims
  summed_over_ids,    ///< an embedding table's: pending over the axes splitting the ids
};

/// @brief One gradient task of a recipe: its op, its operands, its spec. `fn = none` with the
/// single argument `dout` passes the output gradient on; `fn = none` without arguments: no gradient.
struct grad_term {
  op fn = op::none;
  std::array<grad_arg, 4> args{grad_arg::none, grad_arg::none, grad_arg::none, grad_arg::none};
  grad_spec spec = grad_spec::of_operand;
  /// backward::packed: the value whose shape the packed task's node takes (its buffer holds every part)
  grad_arg shaped_as = grad_arg::none;
};

/// @brief How a task's FLOPs follow from its operands and attrs (ir::flops_of).
enum class flops_rule : std::uint8_t {
  none,           ///< moves data only
  per_output,     ///< per element of the first write
  per_input,      ///< per element of the first read
  gemm,           ///< 2·m·n·k·batch
  attention,      ///< causal: 2·batch·seq²·heads·head_dim (half of the 4 of a full square); attr causal = 0: 4·…
  attention_grad, ///< 2.5 times the forward
  convolution,    ///< 2 · output positions · out_channels · kernel_h · kernel_w · in_channels (each of the three tasks)
  window,         ///< output positions · channels · kernel_h · kernel_w: one comparison or addition per value of a window
};

/// @brief A list of operand names in their one order. `optional` of the last ones may be absent;
/// a `variadic` list repeats its last name (concat's parts).
struct operand_list {
  std::array<std::string_view, 6> names{};
  std::int8_t count = 0;
  std::int8_t optional = 0;
  bool variadic = false;
  [[nodiscard]] constexpr std::int8_t min() const noexcept { return static_cast<std::int8_t>(count - optional); }
};

/// @brief One entry of the table.
struct op_info {
  op id = op::none;
  std::string_view name;
  op_role role = op_role::structural;
  op_kind kind = op_kind::elementwise;
  bool executable = false;  ///< compute ops: the CPU and the GPU dispatch run it
  std::int8_t arity = -1;   ///< operands of the DSL node; -1: not a DSL op
  operand_list reads{}, writes{};
  std::array<std::string_view, 9> attrs{}; ///< the attrs a task of this op must carry
  flops_rule flops = flops_rule::none;
  double flops_per_element = 0;
  std::int8_t flops_read = 0; ///< flops_rule::per_input: which read's elements count
  sharding rule = sharding::none;
  backward grad = backward::none;
  std::array<grad_term, 3> terms{}; ///< backward::terms: one per operand (none: no gradient);
                                    ///< backward::packed: terms[0] is the task, the parts follow the operands
  task_form form = task_form::none; ///< how the lowering makes its task
  /// task_form::loss: the optional attrs its kernel scales or offsets by, which the lowering sets
  /// (global_n: the prediction's elements; global_rows: the labels' rows; vocab_axis: the mesh
  /// axis splitting the logits' vocabulary)
  std::array<std::string_view, 2> loss_attrs{};
  /// Its kernel adds to its output when the task says so (attr `accumulate`): the weight-gradient
  /// kernels, which a pipelined step runs once per micro-batch into one sum.
  bool accumulates = false;
  /// Its outputs stay f32 under a lower working precision (ir/precision.hpp): a loss and the row
  /// statistics it is summed from, the routing's probabilities, a gradient's squared norm.
  bool full_precision = false;
};

namespace detail::ops {
using a = grad_arg;
using s = grad_spec;
constexpr operand_list list(std::initializer_list<std::string_view> names, int optional = 0, bool variadic = false) {
  operand_list l;
  for (auto n : names) l.names[static_cast<std::size_t>(l.count++)] = n;
  l.optional = static_cast<std::int8_t>(optional);
  l.variadic = variadic;
  return l;
}
constexpr op_info structural(op id, std::string_view name, int arity, task_form form = task_form::none) {
  op_info i{id, name, op_role::structural, op_kind::elementwise, false, static_cast<std::int8_t>(arity)};
  i.form = form;
  return i;
}
constexpr op_info collective(op id, std::string_view name, op_kind kind, bool dsl) {
  op_info i{id, name, op_role::collective, kind, true, static_cast<std::int8_t>(dsl ? 1 : -1)};
  i.reads = list({"in"});
  i.writes = list({"out"});
  i.form = dsl ? task_form::collective : task_form::none;
  return i;
}
constexpr op_info reduction(op id, std::string_view name) { return {id, name, op_role::reduction, op_kind::all_reduce}; }
// A compute op; the DSL fields are set by the caller where the op is one a user writes.
constexpr op_info compute(op id, std::string_view name, op_kind kind, operand_list reads, operand_list writes,
                          flops_rule flops, double per_element, bool executable = true) {
  op_info i{id, name, op_role::compute, kind, executable};
  i.reads = reads;
  i.writes = writes;
  i.flops = flops;
  i.flops_per_element = per_element;
  i.form = executable ? task_form::rows : task_form::none;
  return i;
}
constexpr op_info dsl(op_info i, int arity, sharding rule, backward grad, std::array<grad_term, 3> terms = {}) {
  i.arity = static_cast<std::int8_t>(arity);
  i.rule = rule;
  i.grad = grad;
  i.terms = terms;
  return i;
}
constexpr op_info with_attrs(op_info i, std::array<std::string_view, 9> attrs) {
  i.attrs = attrs;
  return i;
}
constexpr op_info formed(task_form form, op_info i) {
  i.form = form;
  return i;
}
constexpr op_info loss(op_info i, std::array<std::string_view, 2> attrs) {
  i.form = task_form::loss;
  i.loss_attrs = attrs;
  return i;
}
// A kernel the DSL's lowering never makes (ir::builder, the planner's rewrites).
constexpr op_info outside_dsl(op_info i) { return formed(task_form::none, i); }
constexpr op_info accumulating(op_info i) {
  i.accumulates = true;
  return i;
}
// The convolution's three tasks: the geometry their kernels read (ir::conv_geometry).
constexpr op_info conv(op_info i) {
  i.attrs = {"batch", "height", "width", "in_channels", "out_channels", "kernel_h", "kernel_w", "stride", "padding"};
  i.form = task_form::convolution;
  return i;
}
// Pooling's tasks: the geometry of a convolution whose kernel is the window (channels in = out).
constexpr op_info pool(op_info i) {
  i = conv(i);
  i.form = task_form::pooling;
  return i;
}
// The tasks of an op along the parts of one dim (concat_dim, slice_dim, their gradients).
constexpr op_info parts(op_info i) {
  i.attrs = {"lead", "outer", "extent", "inner", "offset", "length", "broadcast"};
  i.form = task_form::parts;
  return i;
}
constexpr op_info in_f32(op_info i) {
  i.full_precision = true;
  return i;
}
constexpr grad_term term(op fn, std::initializer_list<grad_arg> args, grad_spec spec = s::of_operand) {
  grad_term t;
  t.fn = fn;
  std::size_t k = 0;
  for (auto x : args) t.args[k++] = x;
  t.spec = spec;
  return t;
}
// A packed recipe's task, its node shaped as `shaped_as`.
constexpr grad_term packed_term(op fn, std::initializer_list<grad_arg> args, grad_arg shaped_as) {
  grad_term t = term(fn, args);
  t.shaped_as = shaped_as;
  return t;
}
using k = op_kind;
using f = flops_rule;
using r = sharding;
using b = backward;

inline constexpr op_info table[op_count] = {
    structural(op::none, "none", -1),
    structural(op::input, "input", 0, task_form::leaf),
    structural(op::data, "data", 0, task_form::leaf),
    structural(op::param, "param", 0, task_form::leaf),
    structural(op::state, "state", 0, task_form::leaf),
    structural(op::to, "to", 1),
    structural(op::repeat_in, "repeat_in", 1, task_form::layer_input),
    structural(op::repeat_out, "repeat_out", 1),
    structural(op::select, "select", 1, task_form::view),
    // ---- forward ----
    accumulating(dsl(formed(task_form::matmul, with_attrs(compute(op::matmul, "matmul", k::matmul, list({"a", "b", "c"}, 1),
                                                                  list({"c"}), f::gemm, 0),
                                                          {"m", "n", "k"})),
                     2, r::contract, b::contract)),
    dsl(compute(op::add, "add", k::elementwise, list({"a", "b"}), list({"out"}), f::per_output, 1), 2, r::unify,
        b::pass_through),
    // x + b with b the shape of x's last dims (a bias [n], a position table [seq, hidden]),
    // broadcast over the others: the kernel takes b's values as the columns.
    dsl(compute(op::bias_add, "bias_add", k::elementwise, list({"x", "bias"}), list({"out"}), f::per_output, 1), 2, r::bias,
        b::terms, {term(op::none, {a::dout}), term(op::bias_grad, {a::dout}, s::summed_over_rows)}),
    dsl(compute(op::gelu, "gelu", k::elementwise, list({"x"}), list({"out"}), f::per_output, 8), 1, r::pointwise, b::terms,
        {term(op::gelu_grad, {a::in0, a::dout})}),
    dsl(compute(op::relu, "relu", k::elementwise, list({"x"}), list({"out"}), f::per_output, 1), 1, r::pointwise, b::terms,
        {term(op::relu_grad, {a::in0, a::dout})}),
    dsl(compute(op::silu, "silu", k::elementwise, list({"x"}), list({"out"}), f::per_output, 4), 1, r::pointwise, b::terms,
        {term(op::silu_grad, {a::in0, a::dout})}),
    dsl(compute(op::mul, "mul", k::elementwise, list({"a", "b"}), list({"out"}), f::per_output, 1), 2, r::pointwise_two,
        b::terms, {term(op::mul, {a::dout, a::in1}), term(op::mul, {a::dout, a::in0})}),
    dsl(compute(op::swiglu, "swiglu", k::elementwise, list({"gate", "up"}), list({"out"}), f::per_output, 5), 2,
        r::pointwise_two, b::packed, {packed_term(op::swiglu_grad, {a::in0, a::in1, a::dout}, a::out)}),
    dsl(compute(op::layernorm, "layernorm", k::norm, list({"x", "gamma", "beta"}), list({"out"}), f::per_output, 8), 3,
        r::rowwise, b::terms,
        {term(op::layernorm_grad, {a::in0, a::regathered_in1, a::dout}),
         term(op::layernorm_grad_gamma, {a::in0, a::dout}, s::summed_over_rows),
         term(op::bias_grad, {a::dout}, s::summed_over_rows)}),
    dsl(compute(op::rmsnorm, "rmsnorm", k::norm, list({"x", "gain"}), list({"out"}), f::per_output, 5), 2, r::rowwise,
        b::terms,
        {term(op::rmsnorm_grad, {a::in0, a::regathered_in1, a::dout}),
         term(op::rmsnorm_grad_gain, {a::in0, a::dout}, s::summed_over_rows)}),
    dsl(compute(op::softmax, "softmax", k::softmax, list({"x"}), list({"out"}), f::per_output, 5), 1, r::rowwise, b::terms,
        {term(op::softmax_grad, {a::out, a::dout})}),
    dsl(formed(task_form::attention, with_attrs(compute(op::attention, "attention", k::attention, list({"q", "k", "v"}),
                                                        list({"out"}), f::attention, 0),
                                                {"batch", "seq", "heads", "head_dim"})),
        3, r::attention, b::packed, {packed_term(op::attention_grad, {a::in0, a::in1, a::in2, a::dout}, a::out)}),
    dsl(formed(task_form::rope, with_attrs(compute(op::rope, "rope", k::elementwise, list({"x", "positions"}), list({"out"}),
                                                   f::per_output, 6),
                                           {"head_dim", "theta"})),
        2, r::rope, b::terms, {term(op::rope_grad, {a::dout, a::in1})}),
    dsl(formed(task_form::embedding,
               compute(op::embedding, "embedding", k::elementwise, list({"ids", "table"}), list({"out"}), f::none, 0)),
        2, r::embedding, b::terms, {term(op::none, {}), term(op::embedding_grad, {a::in0, a::dout}, s::summed_over_ids)}),
    dsl(in_f32(loss(compute(op::mse, "mse", k::loss, list({"pred", "target"}), list({"loss"}), f::per_input, 3), {"global_n"})), 2,
        r::mse, b::terms,
        {term(op::mse_grad, {a::in0, a::in1})}),
    dsl(in_f32(loss(compute(op::cross_entropy, "cross_entropy", k::loss, list({"logits", "targets"}), list({"loss"}),
                            f::per_input, 5),
                    {"global_rows"})),
        2, r::cross_entropy, b::terms, {term(op::cross_entropy_grad, {a::in0, a::in1})}),
    in_f32(loss(with_attrs(compute(op::vocab_ce_max, "vocab_ce_max", k::loss, list({"logits"}), list({"max"}), f::per_input, 1),
                           {"cols"}),
                {})),
    in_f32(loss(with_attrs(compute(op::vocab_ce_target, "vocab_ce_target", k::loss, list({"logits", "labels", "max"}),
                                   list({"target"}), f::per_output, 1),
                           {"cols"}),
                {"vocab_axis"})),
    in_f32(loss(with_attrs(compute(op::vocab_ce_sumexp, "vocab_ce_sumexp", k::loss, list({"logits", "max"}), list({"sumexp"}),
                                   f::per_input, 3),
                           {"cols"}),
                {})),
    dsl(in_f32(loss(compute(op::vocab_ce_loss, "vocab_ce_loss", k::loss, list({"sumexp", "target"}), list({"loss"}),
                            f::per_input, 2),
                    {"global_rows"})),
        2, r::none, b::vocab_ce),
    // Mixture of experts (runtime/cpu/moe.hpp): the gates are dense [tokens, experts], zero where a
    // token is not routed or was dropped over capacity; a slot is a token's rank among its
    // group's tokens routed to the expert, so every kernel finds it from the gates alone.
    dsl(in_f32(formed(task_form::moe, with_attrs(compute(op::moe_route, "moe_route", k::softmax, list({"logits"}),
                                                         list({"gates"}), f::per_input, 8),
                                                 {"experts", "group", "top_k", "capacity"}))),
        1, r::routing, b::terms, {term(op::moe_route_grad, {a::in0, a::out, a::dout})}),
    dsl(formed(task_form::moe, with_attrs(compute(op::moe_dispatch, "moe_dispatch", k::copy, list({"x", "gates"}),
                                                  list({"out"}), f::none, 0),
                                          {"experts", "group", "capacity"})),
        2, r::dispatch, b::terms, {term(op::moe_dispatch_grad, {a::dout, a::in1}), term(op::none, {})}),
    dsl(formed(task_form::moe, with_attrs(compute(op::moe_combine, "moe_combine", k::elementwise, list({"y", "gates"}),
                                                  list({"out"}), f::per_output, 4),
                                          {"experts", "group", "capacity"})),
        2, r::combine, b::packed, {packed_term(op::moe_combine_grad, {a::in0, a::in1, a::dout}, a::in0)}),
    dsl(compute(op::sigmoid, "sigmoid", k::elementwise, list({"x"}), list({"out"}), f::per_output, 4), 1, r::pointwise,
        b::terms, {term(op::sigmoid_grad, {a::out, a::dout})}),
    dsl(formed(task_form::transpose, with_attrs(compute(op::transpose, "transpose", k::copy, list({"x"}), list({"out"}),
                                                        f::none, 0),
                                                {"rows", "cols", "inner"})),
        1, r::swap_dims, b::terms, {term(op::transpose, {a::dout})}),
    dsl(compute(op::tanh, "tanh", k::elementwise, list({"x"}), list({"out"}), f::per_output, 4), 1, r::pointwise, b::terms,
        {term(op::tanh_grad, {a::out, a::dout})}),
    // A 2-D convolution over NHWC images (runtime/cpu/convolution.hpp): y[n, oh, ow, o] =
    // Σ_{i, j, c} x[n, oh·stride - padding + i, ow·stride - padding + j, c] · w[i, j, c, o], zero
    // outside the image. A product over (i, j, c), so its rule and backward are the einsum's.
    dsl(conv(compute(op::conv2d, "conv2d", k::matmul, list({"x", "w"}), list({"y"}), f::convolution, 0)), 2, r::convolution,
        b::convolution, {term(op::conv2d_grad_input, {a::dout, a::in1}), term(op::conv2d_grad_weight, {a::in0, a::dout})}),
    // Dims first..last of x as one (node::dims): the same values in a view of x's buffer.
    dsl(formed(task_form::reshape, compute(op::flatten, "flatten", k::copy, list({"x"}), list({"out"}), f::none, 0, false)),
        1, r::merge, b::terms, {term(op::flatten_grad, {a::dout})}),
    // Batch normalisation in training mode (runtime/cpu/normalization.hpp) over x [..., channels]:
    // statistics per channel over every other dim. The DSL op (x, gamma, beta) lowers to four
    // tasks: the sums Σx, Σx² [2, channels] (all-reduced over the axes splitting the rows when
    // synchronised: batchnorm_config::sync), the scale (mean, 1/σ, gamma/σ) [3, channels], and the
    // normalisation y = (x − mean)·gamma/σ + beta, which reads x, the scale and beta.
    dsl(formed(task_form::batchnorm, compute(op::batchnorm, "batchnorm", k::norm, list({"x", "scale", "beta"}), list({"y"}),
                                             f::per_output, 2)),
        3, r::batchnorm, b::batchnorm),
    in_f32(formed(task_form::batchnorm,
                  compute(op::batchnorm_stats, "batchnorm_stats", k::norm, list({"x"}), list({"sums"}), f::per_input, 3))),
    in_f32(formed(task_form::batchnorm, compute(op::batchnorm_scale, "batchnorm_scale", k::norm, list({"sums", "gamma"}),
                                                list({"scale"}), f::per_output, 3))),
    // The running statistics [2, channels] (a state: mean, variance) moved towards the batch's by
    // the momentum, in place; evaluation's batchnorm_scale reads them instead of the sums.
    in_f32(formed(task_form::batchnorm, compute(op::batchnorm_track, "batchnorm_track", k::norm, list({"sums", "running"}),
                                                list({"running"}), f::per_output, 6))),
    // The sum and the mean over one dim (node::dims.first); the mean divides by its whole extent.
    dsl(formed(task_form::reduce_dim, with_attrs(compute(op::sum_dim, "sum_dim", k::elementwise, list({"x"}), list({"out"}),
                                                         f::per_input, 1),
                                                 {"outer", "extent", "inner", "num", "den"})),
        1, r::reduce_dim, b::terms, {term(op::sum_dim_grad, {a::dout})}),
    dsl(formed(task_form::reduce_dim, with_attrs(compute(op::mean_dim, "mean_dim", k::elementwise, list({"x"}), list({"out"}),
                                                         f::per_input, 1),
                                                 {"outer", "extent", "inner", "num", "den"})),
        1, r::reduce_dim, b::terms, {term(op::mean_dim_grad, {a::dout})}),
    // The maximum and the mean over each window of an NHWC image (node::window, node::conv's
    // stride and padding; runtime/cpu/pooling.hpp): the maximum skips the padding and routes its
    // gradient to the first maximum of the window, the mean counts the padding as zeros.
    dsl(pool(compute(op::max_pool, "max_pool", k::elementwise, list({"x"}), list({"y"}), f::window, 1)), 1, r::pooling,
        b::terms, {term(op::max_pool_grad, {a::in0, a::dout})}),
    dsl(pool(compute(op::avg_pool, "avg_pool", k::elementwise, list({"x"}), list({"y"}), f::window, 1)), 1, r::pooling,
        b::terms, {term(op::avg_pool_grad, {a::dout})}),
    // a and b joined along node::dims.first (runtime/cpu/parts.hpp); an operand of lower rank is a
    // table repeated over the other's leading dims, its gradient summed over them. Each operand's
    // gradient is its part of dy (node::operand says which).
    dsl(parts(compute(op::concat_dim, "concat_dim", k::copy, list({"a", "b"}), list({"out"}), f::none, 0)), 2, r::join, b::terms,
        {term(op::concat_dim_grad, {a::dout}, s::summed_over_rows), term(op::concat_dim_grad, {a::dout}, s::summed_over_rows)}),
    // Positions [begin, end) of one dim (node::part); the gradient is dy there, zero elsewhere.
    dsl(parts(compute(op::slice_dim, "slice_dim", k::copy, list({"x"}), list({"out"}), f::none, 0)), 1, r::part, b::terms,
        {term(op::slice_dim_grad, {a::dout})}),
    // x times a mask drawn per value of the whole tensor (runtime/dropout_mask.hpp); its gradient
    // redraws the mask (node::drop, the forward node and layer as the seed's salt).
    dsl(formed(task_form::dropout, with_attrs(compute(op::dropout, "dropout", k::elementwise, list({"x"}), list({"y"}),
                                                      f::per_output, 2),
                                              {"num", "den", "seed", "rank"})),
        1, r::linear, b::terms, {term(op::dropout_grad, {a::dout})}),
    // x times a table of its last dims broadcast over the others (bias_add's rule): x's gradient
    // the same product of dy, the table's the column sums of x·dy.
    dsl(compute(op::scale_table, "scale_table", k::elementwise, list({"x", "table"}), list({"out"}), f::per_output, 1), 2, r::bias,
        b::terms, {term(op::scale_table, {a::dout, a::in1}), term(op::scale_table_grad, {a::in0, a::dout}, s::summed_over_rows)}),
    // flatten's inverse, a view; its gradient dy viewed in x's shape, as flatten's is.
    dsl(formed(task_form::reshape, compute(op::unflatten, "unflatten", k::copy, list({"x"}), list({"out"}), f::none, 0, false)),
        1, r::unmerge, b::terms, {term(op::flatten_grad, {a::dout})}),
    // ---- backward ----
    accumulating(compute(op::bias_grad, "bias_grad", k::elementwise, list({"dout"}), list({"dbias"}), f::per_input, 1)),
    compute(op::gelu_grad, "gelu_grad", k::elementwise, list({"x", "dout"}), list({"dx"}), f::per_output, 12),
    compute(op::relu_grad, "relu_grad", k::elementwise, list({"x", "dout"}), list({"dx"}), f::per_output, 1),
    compute(op::silu_grad, "silu_grad", k::elementwise, list({"x", "dout"}), list({"dx"}), f::per_output, 7),
    compute(op::swiglu_grad, "swiglu_grad", k::elementwise, list({"gate", "up", "dout"}), list({"dgate_dup"}), f::per_input,
            10),
    compute(op::layernorm_grad, "layernorm_grad", k::norm, list({"x", "gamma", "dout"}), list({"dx"}), f::per_output, 12),
    accumulating(compute(op::layernorm_grad_gamma, "layernorm_grad_gamma", k::norm, list({"x", "dout"}), list({"dgamma"}),
                         f::per_input, 5)),
    compute(op::rmsnorm_grad, "rmsnorm_grad", k::norm, list({"x", "gain", "dout"}), list({"dx"}), f::per_output, 8),
    accumulating(compute(op::rmsnorm_grad_gain, "rmsnorm_grad_gain", k::norm, list({"x", "dout"}), list({"dgain"}),
                         f::per_input, 4)),
    compute(op::softmax_grad, "softmax_grad", k::softmax, list({"y", "dout"}), list({"dx"}), f::per_output, 4),
    formed(task_form::attention, with_attrs(compute(op::attention_grad, "attention_grad", k::attention,
                                                    list({"q", "k", "v", "dout"}), list({"dqkv"}), f::attention_grad, 0),
                                            {"batch", "seq", "heads", "head_dim"})),
    formed(task_form::rope, with_attrs(compute(op::rope_grad, "rope_grad", k::elementwise, list({"dout", "positions"}),
                                               list({"dx"}), f::per_output, 6),
                                       {"head_dim", "theta"})),
    [] {
      auto i = compute(op::embedding_grad, "embedding_grad", k::elementwise, list({"ids", "dout"}), list({"dtable"}),
                       f::per_input, 1);
      i.flops_read = 1; // the gradient rows, not the ids
      return accumulating(formed(task_form::embedding, i));
    }(),
    loss(compute(op::mse_grad, "mse_grad", k::loss, list({"pred", "target", "loss_scale"}, 1), list({"dpred"}),
                 f::per_input, 3),
         {"global_n"}),
    loss(compute(op::cross_entropy_grad, "cross_entropy_grad", k::loss, list({"logits", "targets", "loss_scale"}, 1),
                 list({"dlogits"}),
                 f::per_input, 5),
         {"global_rows"}),
    loss(with_attrs(compute(op::vocab_ce_grad, "vocab_ce_grad", k::loss, list({"logits", "labels", "max", "sumexp", "loss_scale"}, 1),
                            list({"dlogits"}), f::per_output, 4),
                    {"cols"}),
         {"vocab_axis", "global_rows"}),
    formed(task_form::moe, with_attrs(compute(op::moe_route_grad, "moe_route_grad", k::softmax,
                                              list({"logits", "gates", "dgates", "loss_scale"}, 1), list({"dlogits"}), f::per_input, 12),
                                      {"experts", "group", "top_k", "weight_num", "weight_den"})),
    formed(task_form::moe, with_attrs(compute(op::moe_dispatch_grad, "moe_dispatch_grad", k::copy, list({"dout", "gates"}),
                                              list({"dx"}), f::per_output, 2),
                                      {"experts", "group", "capacity"})),
    formed(task_form::moe, with_attrs(compute(op::moe_combine_grad, "moe_combine_grad", k::elementwise,
                                              list({"y", "gates", "dout"}), list({"dy_dgates"}), f::per_input, 4),
                                      {"experts", "group", "capacity"})),
    compute(op::sigmoid_grad, "sigmoid_grad", k::elementwise, list({"y", "dout"}), list({"dx"}), f::per_output, 3),
    compute(op::tanh_grad, "tanh_grad", k::elementwise, list({"y", "dout"}), list({"dx"}), f::per_output, 3),
    conv(compute(op::conv2d_grad_input, "conv2d_grad_input", k::matmul, list({"dy", "w"}), list({"dx"}), f::convolution, 0)),
    accumulating(conv(compute(op::conv2d_grad_weight, "conv2d_grad_weight", k::matmul, list({"x", "dy"}), list({"dw"}),
                              f::convolution, 0))),
    // Σdy and Σdy·x̂ per channel [2, channels]: dbeta and dgamma, and what dx subtracts.
    in_f32(formed(task_form::batchnorm, compute(op::batchnorm_grad_stats, "batchnorm_grad_stats", k::norm,
                                                list({"x", "scale", "dy"}), list({"sums"}), f::per_input, 5))),
    formed(task_form::batchnorm, compute(op::batchnorm_grad, "batchnorm_grad", k::norm, list({"x", "scale", "sums", "dy"}),
                                         list({"dx"}), f::per_output, 6)),
    formed(task_form::reshape, compute(op::flatten_grad, "flatten_grad", k::copy, list({"dout"}), list({"dx"}), f::none, 0, false)),
    // dx = dy repeated along the reduced dim (times 1/extent for a mean).
    formed(task_form::reduce_dim, with_attrs(compute(op::sum_dim_grad, "sum_dim_grad", k::elementwise, list({"dout"}),
                                                     list({"dx"}), f::per_output, 1),
                                             {"outer", "extent", "inner", "num", "den"})),
    formed(task_form::reduce_dim, with_attrs(compute(op::mean_dim_grad, "mean_dim_grad", k::elementwise, list({"dout"}),
                                                     list({"dx"}), f::per_output, 1),
                                             {"outer", "extent", "inner", "num", "den"})),
    pool(compute(op::max_pool_grad, "max_pool_grad", k::elementwise, list({"x", "dy"}), list({"dx"}), f::window, 1)),
    pool(compute(op::avg_pool_grad, "avg_pool_grad", k::elementwise, list({"dy"}), list({"dx"}), f::window, 1)),
    parts(compute(op::concat_dim_grad, "concat_dim_grad", k::copy, list({"dy"}), list({"dpart"}), f::none, 0)),
    parts(compute(op::slice_dim_grad, "slice_dim_grad", k::copy, list({"dy"}), list({"dx"}), f::none, 0)),
    formed(task_form::dropout, with_attrs(compute(op::dropout_grad, "dropout_grad", k::elementwise, list({"dy"}), list({"dx"}),
                                                  f::per_output, 2),
                                          {"num", "den", "seed", "rank"})),
    accumulating(compute(op::scale_table_grad, "scale_table_grad", k::elementwise, list({"x", "dy"}), list({"dtable"}),
                         f::per_input, 2)),
    // ---- redistribution ----
    collective(op::all_reduce, "all_reduce", k::all_reduce, true),
    collective(op::all_gather, "all_gather", k::all_gather, true),
    collective(op::reduce_scatter, "reduce_scatter", k::reduce_scatter, true),
    collective(op::all_to_all, "all_to_all", k::all_to_all, true),
    dsl(formed(task_form::shard, with_attrs(compute(op::shard_slice, "shard_slice", k::slice, list({"src"}), list({"dst"}),
                                                    f::none, 0),
                                            {"dim", "parts", "mesh_axis"})),
        1, r::none, b::none),
    dsl(formed(task_form::shard, with_attrs(compute(op::keep_one, "keep_one", k::elementwise, list({"src"}), list({"dst"}),
                                                    f::none, 0),
                                            {"mesh_axis"})),
        1, r::none, b::none),
    // ---- optimizer ----
    // An update with global-norm clipping also reads the step's squared gradient norm (one value,
    // summed over every rank: graph/lower.hpp) and scales its gradient by runtime::clip_factor;
    // under dynamic loss scaling it reads the norm and then the loss scale (runtime/grad_clip.hpp).
    // Under a 16-bit policy its `param` is the f32 master and its optional last write the
    // parameter's working copy (bf16 or f16), the updated master rounded (ir/precision.hpp).
    dsl(formed(task_form::update, compute(op::sgd, "sgd", k::optimizer_update, list({"param", "grad", "grad_norm_sq", "loss_scale"}, 2),
                                          list({"param", "momentum", "working"}, 2), f::per_output, 2)),
        2, r::none, b::none),
    dsl(formed(task_form::update, compute(op::adamw, "adamw", k::optimizer_update,
                                          list({"param", "grad", "m", "v", "grad_norm_sq", "loss_scale"}, 2), list({"param", "m", "v", "working"}, 1),
                                          f::per_output, 12)),
        4, r::none, b::none),
    // This rank's share of the squared norm: Σ grad² / replicas, the ranks holding the same shard
    // (so that a sum over every rank counts each gradient value once). No node of a program holds
    // it: the lowering makes it beside the updates it feeds (no task_form).
    in_f32(formed(task_form::none, with_attrs(compute(op::grad_sq_norm, "grad_sq_norm", k::elementwise, list({"grad"}),
                                                      list({"sq"}), f::per_input, 2),
                                              {"replicas"}))),
    // ---- kernels for graphs made without the DSL ----
    outside_dsl(compute(op::add_inplace, "add_inplace", k::elementwise, list({"acc", "x"}), list({"acc"}), f::per_output, 1)),
    outside_dsl(
        with_attrs(compute(op::scale, "scale", k::elementwise, list({"x"}), list({"out"}), f::per_output, 1), {"num", "den"})),
    outside_dsl(compute(op::zero, "zero", k::elementwise, list({}), list({"out"}, 0, true), f::none, 0)),
    outside_dsl(compute(op::copy, "copy", k::copy, list({"src"}), list({"dst"}), f::none, 0)),
    outside_dsl(with_attrs(compute(op::slice, "slice", k::slice, list({"src"}), list({"dst"}), f::none, 0),
                           {"outer", "extent", "inner", "length", "offset"})),
    outside_dsl(with_attrs(compute(op::concat, "concat", k::concat, list({"part"}, 0, true), list({"dst"}), f::none, 0),
                           {"outer", "inner", "length"})),
    // ---- a lower working precision's conversions: the values of one float type in another ----
    outside_dsl(compute(op::cast, "cast", k::copy, list({"x"}), list({"out"}), f::none, 0)),
    collective(op::send, "send", k::send, false),
    collective(op::recv, "recv", k::recv, false),
    collective(op::broadcast, "broadcast", k::broadcast, false),
    reduction(op::sum, "sum"),
    reduction(op::max, "max"),
    reduction(op::min, "min"),
    // ---- cost only ----
    compute(op::add_position, "add_position", k::elementwise, list({"x", "table"}), list({"out"}), f::per_output, 1, false),
    compute(op::position_embedding_grad, "position_embedding_grad", k::elementwise, list({"dout"}), list({"dtable"}),
            f::per_input, 1, false),
    compute(op::transpose_blocks, "transpose_blocks", k::copy, list({"in"}), list({"out"}), f::none, 0, false),
};
} // namespace detail::ops

/// @brief The table entry of an op.
[[nodiscard]] constexpr const op_info& info(op o) noexcept { return detail::ops::table[static_cast<int>(o)]; }
[[nodiscard]] constexpr std::string_view to_string(op o) noexcept { return info(o).name; }

/// @brief The op of a name (graph JSON, the plan cache), or nullopt.
[[nodiscard]] constexpr std::optional<op> op_from_string(std::string_view name) noexcept {
  for (const auto& i : detail::ops::table)
    if (i.name == name) return i.id;
  return std::nullopt;
}

/// @brief The op of a name; throws concerto::error naming `where` and listing the known names.
[[nodiscard]] inline op parse_op(std::string_view name, const std::string& where) {
  if (const auto o = op_from_string(name)) return *o;
  std::string known;
  for (const auto& i : detail::ops::table)
    if (i.role == op_role::compute || i.role == op_role::reduction) known += (known.empty() ? "" : ", ") + std::string(i.name);
  fail(where + ": fn '" + std::string(name) + "' is not an op of concerto (known: " + known + ")");
}

/// @brief Whether `o` may be the fn of a compute task / of a collective task.
[[nodiscard]] constexpr bool is_compute(op o) noexcept { return info(o).role == op_role::compute; }
[[nodiscard]] constexpr bool is_reduction(op o) noexcept { return info(o).role == op_role::reduction; }

/// @brief Whether a DSL node of op `o` with `operands` operands is one the compiler can build:
/// the compiler's own structural nodes, or an op whose entry gives that arity, a sharding rule
/// and a backward recipe (expr::node_expr asserts it, so an op missing either does not build).
[[nodiscard]] constexpr bool dsl_ready(op o, int operands) noexcept {
  const auto& i = info(o);
  if (i.role == op_role::structural) return true;
  return i.arity == operands && i.rule != sharding::none && i.grad != backward::none;
}

/// @brief How many parts the packed gradient task `o` writes: the operands of the forward op
/// whose packed recipe names it (their gradients, one after the other, each its operand's size;
/// they are the task's first operands), or 0 when no recipe packs into `o`.
[[nodiscard]] constexpr int packed_parts(op o) noexcept {
  for (const auto& i : detail::ops::table)
    if (i.grad == backward::packed && i.terms[0].fn == o) return i.arity;
  return 0;
}

/// @brief Whether `o` takes the step's loss scale as its optional last read (dynamic loss
/// scaling, ir/precision.hpp): the loss gradients, which multiply what they write by it, and
/// the updates, which divide by it (runtime/grad_clip.hpp).
[[nodiscard]] constexpr bool reads_loss_scale(op o) noexcept {
  const auto& reads = info(o).reads;
  return reads.count > 0 && reads.names[static_cast<std::size_t>(reads.count - 1)] == "loss_scale";
}

namespace detail::ops {
constexpr bool table_in_order() {
  for (int i = 0; i < op_count; ++i)
    if (static_cast<int>(table[i].id) != i) return false;
  return true;
}
constexpr bool names_unique() {
  for (int i = 0; i < op_count; ++i)
    for (int j = i + 1; j < op_count; ++j)
      if (table[i].name == table[j].name) return false;
  return true;
}
// Every gradient a DSL op's recipe names is a compute op whose operands the recipe fills.
constexpr bool recipes_complete() {
  for (const auto& i : table) {
    if (i.arity > 0 && i.role == op_role::compute && i.rule != sharding::none && i.grad == backward::none) return false;
    if (i.grad == backward::packed && i.terms[0].shaped_as == grad_arg::none) return false;
    if (i.grad != backward::terms && i.grad != backward::packed && i.grad != backward::convolution) continue;
    for (const auto& t : i.terms) {
      if (t.fn == op::none) continue;
      const auto& g = table[static_cast<int>(t.fn)];
      // A kernel both executors run, or a view the lowering makes without a task (flatten's gradient).
      if (g.role != op_role::compute || (!g.executable && g.form != task_form::reshape)) return false;
      int args = 0;
      while (args < 4 && t.args[static_cast<std::size_t>(args)] != grad_arg::none) ++args;
      if (args < g.reads.min() || args > g.reads.count) return false;
    }
  }
  return true;
}
// Every op a DSL program can hold (a user's op, a recipe's gradient task, an inserted
// collective) says how the lowering makes its task, and one taking only its operand's rows
// requires no other attrs.
constexpr bool forms_complete() {
  const auto formed = [](op o) { return o == op::none || table[static_cast<int>(o)].form != task_form::none; };
  for (const auto& i : table) {
    if (i.form == task_form::rows && !i.attrs[0].empty()) return false;
    if (i.arity > 0 && i.role != op_role::structural && !formed(i.id)) return false;
    for (const auto& t : i.terms)
      if (!formed(t.fn)) return false;
  }
  return true;
}
static_assert(table_in_order(), "ir::op and the op table list the ops in different orders");
static_assert(names_unique(), "two ops of the table share a name");
static_assert(recipes_complete(), "a DSL op's backward recipe names an op that is no executable kernel, gives it "
                                  "another number of operands than the kernel reads, or packs gradients without "
                                  "saying what the packed node is shaped as");
static_assert(forms_complete(), "an op a DSL program can hold has no task_form (how graph/lower.hpp makes its task), "
                                "or takes its operand's rows while its kernel requires attrs of its own");
} // namespace detail::ops

} // namespace concerto::ir
