#pragma once
/// @file
/// @brief Optimizer choices for `program(loss, optimizer)`: plain SGD and AdamW, optionally with
/// ZeRO over a mesh axis. ZeRO-1 keeps the optimizer state sharded (gradients all-reduced, then
/// sliced); ZeRO-2 also shards the gradients (reduce-scatter); ZeRO-3 also stores the parameters
/// sharded (gathered before each use, in forward and again in backward, as FSDP does).
///
/// @code
/// constexpr auto step = program(loss, zero<2>(adamw{}, dp));
/// @endcode

#include <concerto/expr/expr.hpp>
#include <concerto/mesh/axis.hpp>

namespace concerto {

/// @brief Stochastic gradient descent (no state): fn "sgd".
struct sgd {};
/// @brief AdamW (two moments per parameter): fn "adamw".
struct adamw {};

/// @brief An optimizer with its state (stage >= 1), gradients (>= 2) and parameters (3) sharded over an axis.
template <int Stage, class Opt, mesh_axis_type Axis>
struct zero_t {
  static_assert(Stage >= 1 && Stage <= 3, "zero<Stage>: ZeRO has stages 1, 2 and 3");
};
template <int Stage, class Opt, mesh_axis_type Axis>
[[nodiscard]] constexpr zero_t<Stage, Opt, std::remove_cvref_t<Axis>> zero(Opt, Axis) noexcept {
  return {};
}

namespace detail {
template <class O>
struct optimizer_traits {
  static constexpr bool valid = false;
};
template <>
struct optimizer_traits<sgd> {
  static constexpr bool valid = true;
  static constexpr op_code op = op_code::sgd;
  static constexpr int stage = 0;
  static constexpr std::string_view axis = {};
};
template <>
struct optimizer_traits<adamw> {
  static constexpr bool valid = true;
  static constexpr op_code op = op_code::adamw;
  static constexpr int stage = 0;
  static constexpr std::string_view axis = {};
};
template <int S, class O, mesh_axis_type A>
struct optimizer_traits<zero_t<S, O, A>> {
  static constexpr bool valid = optimizer_traits<O>::valid && optimizer_traits<O>::stage == 0;
  static constexpr op_code op = optimizer_traits<O>::op;
  static constexpr int stage = S;
  static constexpr std::string_view axis = A::name();
};
} // namespace detail

/// @brief Satisfied by sgd, adamw and zero<...>(sgd or adamw, axis).
template <class O>
concept optimizer = detail::optimizer_traits<std::remove_cvref_t<O>>::valid;

} // namespace concerto
