#pragma once
/// @file
/// @brief Expression templates: leaves (`input`, `data`, `param`) and the op nodes that the
/// functions in ops.hpp build. An expression object is empty: everything (names, specs, the
/// tree) lives in its type, so expressions copy freely, never dangle under `auto`, and
/// `program(loss, ...)` can extract the whole step from `decltype(loss)` at compile time.

#include <concerto/core/fixed_string.hpp>
#include <concerto/ir/ops.hpp>
#include <concerto/spec/spec.hpp>

#include <cstdint>
#include <type_traits>

namespace concerto {

/// @brief Every operation a program node can carry: the ops of the op table (ir/ops.hpp), which
/// says for each its sharding rule, its backward recipe and the task it lowers to.
using op_code = ir::op;

/// @brief What kind of leaf: `input` receives a gradient (like a module's input), `data`
/// does not (token ids, labels), `param` is trained, `constant` is an f32 input the step does
/// not differentiate (`input<"x">(spec, no_grad)`: the features of a model's first layer).
enum class leaf_kind : std::uint8_t { input, data, param, constant };

/// @brief How a parameter starts (train::step draws every parameter from its leaf's rule, from a
/// seed per global element, so every mesh starts from the same model).
enum class leaf_init : std::uint8_t {
  automatic, ///< `kernel_fan_in` for a conv2d's kernel, `fan_in` for another weight of rank ≥ 2, `zeros` for a vector (a bias)
  fan_in,    ///< uniform with standard deviation 1/√fan_in, fan_in the next-to-last dimension (a vector's length)
  kernel_fan_in, ///< as fan_in over every dimension but the last: kernel_h·kernel_w·in of a kernel [kernel_h, kernel_w, in, out]
  zeros,
  ones,      ///< a normalisation's gain
  running_stats, ///< a batch norm's running statistics [2, channels]: mean 0, variance 1 (the compiler's, not a param's)
};

/// @brief The initialisers a `param` can name: `param<"ln.g">(spec(replicate), init::ones)`.
namespace init {
template <leaf_init I>
struct rule_t {
  static constexpr leaf_init value = I;
};
inline constexpr rule_t<leaf_init::fan_in> fan_in{};
inline constexpr rule_t<leaf_init::kernel_fan_in> kernel_fan_in{};
inline constexpr rule_t<leaf_init::zeros> zeros{};
inline constexpr rule_t<leaf_init::ones> ones{};
} // namespace init

/// @brief The settings of a mixture-of-experts routing (`moe_route`, `moe_aux_loss`): experts
/// per token, slots per expert as a multiple of an even share (capacity = ⌈top_k · tokens of a
/// group · capacity_factor / experts⌉, at most the group's tokens), and the weight of the
/// load-balancing loss.
struct moe_config {
  int top_k = 2;
  double capacity_factor = 1.25;
  double aux_weight = 0.01;
  friend constexpr bool operator==(const moe_config&, const moe_config&) = default;
};

/// @brief The settings of a `conv2d`: the kernel's step between output positions and the zeros
/// added on every side of the image (the kernel's size is its weight's shape).
struct conv_config {
  int stride = 1;
  int padding = 0;
  friend constexpr bool operator==(const conv_config&, const conv_config&) = default;
};

/// @brief The settings of a `max_pool` or `avg_pool`: the window's side, its step (0: the
/// window's side, windows that do not overlap) and the padding on every side (ignored by the
/// maximum, counted as zeros by the average, which divides by window²).
struct pool_config {
  int window = 2;
  int stride = 0;
  int padding = 0;
  [[nodiscard]] constexpr int step() const noexcept { return stride > 0 ? stride : window; }
  friend constexpr bool operator==(const pool_config&, const pool_config&) = default;
};

/// @brief The settings of a `batchnorm`: statistics over the whole batch (synchronised: an
/// all-reduce of 2·channels values forward and another backward over the axes splitting the
/// batch; the numbers of one rank), or over each rank's rows (local, as a framework's BatchNorm
/// under data parallelism; the model then depends on the data-parallel degree).
struct batchnorm_config {
  bool sync = true;
  /// How far each training step moves the running statistics (mean, unbiased variance) that
  /// evaluation normalises by towards the batch's: r ← (1 − momentum)·r + momentum·batch.
  float momentum = 0.1f;
  friend constexpr bool operator==(const batchnorm_config&, const batchnorm_config&) = default;
};

/// @brief The dims an op works along: flatten's first..last, the one dim a sum or mean reduces,
/// the pair a transpose swaps, the two an unflatten makes of one (`inner`: the second's extent).
struct dim_range {
  int first = -1;
  int last = -1;
  int inner = 0;
  friend constexpr bool operator==(const dim_range&, const dim_range&) = default;
};

/// @brief The settings of a `dropout`: the fraction of values dropped (each kept one scaled by
/// 1 / (1 − rate)) and a seed the masks are drawn from, with the op's place in the program, the
/// layer, the step and the value's index in the whole tensor (so every mesh draws the same mask).
struct dropout_config {
  float rate = 0.1f;
  unsigned seed = 0;
  friend constexpr bool operator==(const dropout_config&, const dropout_config&) = default;
};

/// @brief The part of one dim an op keeps: `slice<Dim, Begin, End>`'s [begin, end) of dim `dim`.
struct dim_slice {
  int dim = -1;
  int begin = 0;
  int end = 0;
  friend constexpr bool operator==(const dim_slice&, const dim_slice&) = default;
};

namespace detail {
struct expr_tag {};
struct no_extra {};
/// The `Extra` of an op with settings of its own: a routing's (moe_config), a convolution's
/// (conv_config), a pooling's (pool_config), a batch norm's (batchnorm_config), the dims an op works along (dim_range),
/// the part of a dim a slice keeps (dim_slice), a dropout's rate and seed (dropout_config).
/// The compiler copies them into the op's node by their type.
template <auto Settings>
struct settings_extra {
  static constexpr auto value = Settings;
};
template <class T>
inline constexpr bool is_settings_extra = false;
template <auto Settings>
inline constexpr bool is_settings_extra<settings_extra<Settings>> = true;
/// The `Extra` of an attention without the causal mask.
struct bidirectional_extra {};
template <class T>
inline constexpr bool is_expr = std::is_base_of_v<expr_tag, std::remove_cvref_t<T>>;
} // namespace detail

/// @brief Satisfied by every expression type.
template <class T>
concept expression = detail::is_expr<T>;

template <op_code Op, class Extra, class... Args>
struct node_expr;

/// @brief What every expression can do.
template <class Derived>
struct expr_base : detail::expr_tag {
  /// @brief Explicit redistribution: the value with another spec (collectives are inserted).
  /// A target with `partial(...)` pins the pending sum: it must be redistributed again explicitly
  /// before a nonlinear op.
  /// @code
  /// auto y = matmul(h, w2).to(spec(shard(dp), replicate)); // make the all-reduce explicit
  /// @endcode
  template <spec_type S>
  [[nodiscard]] constexpr node_expr<op_code::to, std::remove_cvref_t<S>, Derived> to(S) const noexcept {
    return {};
  }
};

/// @brief A named leaf. `Storage` differs from `Spec` for ZeRO-3/FSDP parameters; `Init` is a
/// parameter's initialiser.
template <fixed_string Name, leaf_kind Kind, class Spec, class Storage, leaf_init Init = leaf_init::automatic>
struct leaf_expr : expr_base<leaf_expr<Name, Kind, Spec, Storage, Init>> {
  static_assert(Name.size() > 0 && Name.size() <= 18, "leaf names must have 1 to 18 characters: shorten the name");
  static constexpr auto name = Name;
  static constexpr leaf_kind kind = Kind;
  static constexpr std::size_t size = 1;
};

/// @brief An op applied to sub-expressions; `Extra` carries a spec for `.to()`, else no_extra.
template <op_code Op, class Extra, class... Args>
struct node_expr : expr_base<node_expr<Op, Extra, Args...>> {
  static_assert(ir::dsl_ready(Op, static_cast<int>(sizeof...(Args))),
                "this op is not one a program can use: its ir/ops.hpp entry lacks the DSL arity, the sharding "
                "rule or the backward recipe (ir::dsl_ready)");
  static constexpr op_code op = Op;
  static constexpr std::size_t size = (std::size_t{1} + ... + Args::size);
};

/// @brief The storage spec of a parameter that is kept sharded and gathered for use.
template <spec_type S>
struct stored_t {};
/// @code
/// auto w1 = param<"w1">(spec(replicate, shard(tp)), stored(spec(shard(dp), shard(tp)))); // ZeRO-3 over dp
/// @endcode
template <spec_type S>
[[nodiscard]] constexpr stored_t<std::remove_cvref_t<S>> stored(S) noexcept {
  return {};
}

/// @brief A tensor the step receives and differentiates (its gradient is an output of the step).
/// @code
/// constexpr auto x = input<"x">(spec(shard(dp), replicate));
/// @endcode
template <fixed_string Name, spec_type S>
[[nodiscard]] constexpr leaf_expr<Name, leaf_kind::input, std::remove_cvref_t<S>, std::remove_cvref_t<S>>
input(S) noexcept {
  return {};
}

/// @brief Tag of `input<"x">(spec, no_grad)`.
struct no_grad_t {};
/// @brief Asks for an input without gradient.
inline constexpr no_grad_t no_grad{};

/// @brief An f32 tensor the step receives and does not differentiate: no `x.grad`, so neither
/// the backward matmul that would produce it nor the collective that would sum it run. Use it
/// for a model's features, as a framework's input tensors that do not require grad.
/// @code
/// constexpr auto x = input<"x">(spec(shard(dp), replicate), no_grad);
/// @endcode
template <fixed_string Name, spec_type S>
[[nodiscard]] constexpr leaf_expr<Name, leaf_kind::constant, std::remove_cvref_t<S>, std::remove_cvref_t<S>>
input(S, no_grad_t) noexcept {
  return {};
}

/// @brief A tensor the step receives and never differentiates (token ids, labels).
template <fixed_string Name, spec_type S>
[[nodiscard]] constexpr leaf_expr<Name, leaf_kind::data, std::remove_cvref_t<S>, std::remove_cvref_t<S>>
data(S) noexcept {
  return {};
}

/// @brief A trained parameter, stored as it is used; it starts by its leaf_init rule (default:
/// `automatic`, i.e. fan-in scaled weights and zero vectors).
/// @code
/// constexpr auto w1 = param<"w1">(spec(replicate, shard(tp))); // column-parallel
/// constexpr auto g = param<"ln.g">(spec(replicate), init::ones); // a norm's gain
/// @endcode
template <fixed_string Name, spec_type S, leaf_init I = leaf_init::automatic>
[[nodiscard]] constexpr leaf_expr<Name, leaf_kind::param, std::remove_cvref_t<S>, std::remove_cvref_t<S>, I>
param(S, init::rule_t<I> = {}) noexcept {
  return {};
}

/// @brief A trained parameter stored with another spec (sharded) and gathered for use.
template <fixed_string Name, spec_type S, spec_type T, leaf_init I = leaf_init::automatic>
[[nodiscard]] constexpr leaf_expr<Name, leaf_kind::param, std::remove_cvref_t<S>, T, I> param(S, stored_t<T>,
                                                                                              init::rule_t<I> = {}) noexcept {
  static_assert(S::rank() == T::rank(),
                "param: the storage spec has another rank than the compute spec; give both one placement per "
                "dimension of the tensor");
  return {};
}

// ---- repeat ------------------------------------------------------------------------------------------

/// @brief The input of a repeated block while it is traced (see `repeat`): stands for the previous
/// layer's output, or for the stack's input in layer 0.
template <fixed_string Name>
struct block_input : expr_base<block_input<Name>> {
  static constexpr auto name = Name;
  static constexpr std::size_t size = 1;
};

/// @brief A stack of identical blocks: `Body` is the block traced once on `block_input<Name>`,
/// `In` the stack's input.
template <fixed_string Name, class Body, class In>
struct repeat_expr : expr_base<repeat_expr<Name, Body, In>> {
  static_assert(Name.size() > 0 && Name.size() <= 15, "repeat names must have 1 to 15 characters: shorten the name");
  static constexpr auto name = Name;
  static constexpr std::size_t size = Body::size + In::size + 2;
};

/// @brief A stack of identical blocks whose depth is given at lowering: `block` is called once, on
/// a placeholder, to trace the block; its `param` leaves are per layer (`wq` is lowered as
/// `layers.<i>.wq`), its `data` leaves are shared by every layer, and it must return a value
/// with the spec of its input (the output of layer i is the input of layer i+1).
/// @code
/// constexpr auto body = [](auto h) { return h + matmul(gelu(matmul(h, param<"fc1">(col))), param<"fc2">(row)); };
/// constexpr auto y = repeat<"layers">(body, x); // lower(..., {.depth = {{"layers", 24}}})
/// @endcode
template <fixed_string Name, class F, expression X>
[[nodiscard]] constexpr auto repeat(F, X) noexcept {
  static_assert(std::is_invocable_v<F, block_input<Name>>,
                "repeat: the block must be callable with one expression (write it as [](auto h) { ... })");
  using body = std::remove_cvref_t<std::invoke_result_t<F, block_input<Name>>>;
  static_assert(expression<body>, "repeat: the block must return an expression built from its argument");
  return repeat_expr<Name, body, std::remove_cvref_t<X>>{};
}

} // namespace concerto
