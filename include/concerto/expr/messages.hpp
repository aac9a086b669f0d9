#pragma once
/// @file
/// @brief The sentence of each mistake a program can contain (errc), shared by the compile-time
/// diagnostics (graph/program.hpp's static_asserts) and the run time (graph::respecify, automatic
/// sharding's refusals). Macros because a static_assert's message must be a string literal in C++20.

#include <concerto/expr/rules.hpp>

#include <string_view>

// clang-format off
#define CONCERTO_MESSAGE_MISMATCHED_CONTRACTION \
  "concerto: mismatched contraction sharding: the contracted dimension of a matmul is split over a " \
  "mesh axis in one operand only; shard the other operand's contracted dimension over the same axis, " \
  "or make both replicated with .to(spec(...))"
#define CONCERTO_MESSAGE_PARTIAL_INTO_NONLINEAR \
  "concerto: partial fed to a nonlinear op: a value pinned as partial(axis) (a leaf or .to(...) with " \
  "partial) reaches an op that is not linear; redistribute it first with .to(spec(...)) without partial"
#define CONCERTO_MESSAGE_RANK_MISMATCH \
  "concerto: spec rank does not match the tensor rank the op needs: give the operand's spec one " \
  "placement per dimension (matmul: rank>=2 and [k,n] or same-rank weights; bias/layernorm gain: rank 1; " \
  "attention: [batch,seq,hidden]; conv2d: x [batch,height,width,in] and w [kernel_h,kernel_w,in,out]; bias: b of " \
  "rank at most x's; flatten<first, last>, transpose<d> (d + 1) and sum/mean<dim>: dims the operand has; " \
  "unflatten<d, inner>: d a dim of a tensor of rank at most 3; add/mse: equal ranks)"
#define CONCERTO_MESSAGE_UNKNOWN_AXIS \
  "concerto: unknown axis: a spec or zero<...>(opt, axis) names a mesh axis that on(...) does not declare; " \
  "add the axis to on(...) or fix the spec"
#define CONCERTO_MESSAGE_TOO_MANY_AXES \
  "concerto: too many mesh axes: a program can use at most 4 distinct axes"
#define CONCERTO_MESSAGE_LEAF_REDEFINED \
  "concerto: leaf redefined: two leaves share a name but differ in kind, spec or initialiser; rename " \
  "one or write both alike"
#define CONCERTO_MESSAGE_LOSS_NOT_SCALAR \
  "concerto: program(...) needs a scalar loss: end the expression with mse(...) or cross_entropy(...) " \
  "(or a sum of such terms)"
#define CONCERTO_MESSAGE_REPEAT_SPEC_CHANGED \
  "concerto: a repeated block returns another spec than it takes: the output of layer i is the input " \
  "of layer i+1; end the block with .to(...) of its input's spec"
#define CONCERTO_MESSAGE_REPEAT_LEAF_SCOPE \
  "concerto: a repeated block reads a leaf that is not its own: inside repeat<...>(block, x) use param " \
  "(one per layer) and data leaves that appear only in the block, and pass other values through x"
#define CONCERTO_MESSAGE_REPEAT_NESTED \
  "concerto: repeat inside a repeated block (or more than 4 repeats): make the inner stack part of the " \
  "outer block, or unroll it"
#define CONCERTO_MESSAGE_MOE_GATES \
  "concerto: moe_dispatch and moe_combine take the gates of a moe_route as their second operand; pass " \
  "moe_route<cfg>(logits)"
#define CONCERTO_MESSAGE_AXIS_ORDER \
  "concerto: a redistribution would need the axes splitting one dimension in another order: a dimension " \
  "split over two axes (shard(dp, ep)) can only gain or lose its second (minor) axis; write the axes in " \
  "the order the redistribution keeps"
#define CONCERTO_MESSAGE_CAPACITY \
  "concerto: the program exceeds its node capacity (128 leaves); use repeat(...) for " \
  "stacks of identical blocks"
#define CONCERTO_MESSAGE_UNBUILDABLE_OP \
  "concerto: internal error: the compiler met a node of an op it has no rule or construction for (an op " \
  "missing from ir/ops.hpp's table); please report it with the program"
// clang-format on

namespace concerto {

/// @brief The sentence that names mistake `e` and its fix, as the compile-time diagnostic says it.
[[nodiscard]] constexpr std::string_view message_of(errc e) noexcept {
  switch (e) {
  case errc::none: return "";
  case errc::no_parameters: return "concerto: the program has no parameter to train: give it at least one param<...> leaf";
  case errc::mismatched_contraction: return CONCERTO_MESSAGE_MISMATCHED_CONTRACTION;
  case errc::partial_into_nonlinear: return CONCERTO_MESSAGE_PARTIAL_INTO_NONLINEAR;
  case errc::rank_mismatch: return CONCERTO_MESSAGE_RANK_MISMATCH;
  case errc::unknown_axis: return CONCERTO_MESSAGE_UNKNOWN_AXIS;
  case errc::too_many_axes: return CONCERTO_MESSAGE_TOO_MANY_AXES;
  case errc::leaf_redefined: return CONCERTO_MESSAGE_LEAF_REDEFINED;
  case errc::loss_not_scalar: return CONCERTO_MESSAGE_LOSS_NOT_SCALAR;
  case errc::repeat_spec_changed: return CONCERTO_MESSAGE_REPEAT_SPEC_CHANGED;
  case errc::repeat_leaf_scope: return CONCERTO_MESSAGE_REPEAT_LEAF_SCOPE;
  case errc::repeat_nested: return CONCERTO_MESSAGE_REPEAT_NESTED;
  case errc::moe_gates: return CONCERTO_MESSAGE_MOE_GATES;
  case errc::axis_order: return CONCERTO_MESSAGE_AXIS_ORDER;
  case errc::capacity: return CONCERTO_MESSAGE_CAPACITY;
  case errc::unbuildable_op: return CONCERTO_MESSAGE_UNBUILDABLE_OP;
  }
  return "concerto: unknown error code";
}

} // namespace concerto
