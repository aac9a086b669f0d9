#pragma once
/// @file
/// @brief MPI reductions over 16-bit floats (bf16, f16), which MPI has no types for: the values
/// travel as MPI_UINT16_T and a user-defined op combines each pair in f32 and rounds the result
/// back (to nearest even), as NCCL's bf16 and half reductions do. Made once per process and
/// type, at first use (after MPI_Init), and never freed: MPI_Finalize releases them.
///
/// @code
/// MPI_Iallreduce(send, recv, n, MPI_UINT16_T, runtime::mpi::float16_op(ir::dtype::bf16, reduction::sum), comm, &r);
/// @endcode

#include <concerto/core/bfloat16.hpp>
#include <concerto/core/float16.hpp>
#include <concerto/ir/graph.hpp>
#include <concerto/runtime/collective_layout.hpp>

#include <mpi.h>

#include <algorithm>
#include <cstdint>

namespace concerto::runtime::mpi {

namespace float16_ops {
struct bf16_values {
  static float widen(std::uint16_t v) noexcept { return from_bf16(v); }
  static std::uint16_t round(float v) noexcept { return to_bf16(v); }
};
struct f16_values {
  static float widen(std::uint16_t v) noexcept { return from_f16(v); }
  static std::uint16_t round(float v) noexcept { return to_f16(v); }
};
template <class Values, class Combine>
void combine(void* in, void* inout, int* len, MPI_Datatype*) {
  const auto* a = static_cast<const std::uint16_t*>(in);
  auto* b = static_cast<std::uint16_t*>(inout);
  for (int i = 0; i < *len; ++i) b[i] = Values::round(Combine{}(Values::widen(a[i]), Values::widen(b[i])));
}
struct add_values {
  float operator()(float x, float y) const noexcept { return x + y; }
};
struct larger {
  float operator()(float x, float y) const noexcept { return std::max(x, y); }
};
struct smaller {
  float operator()(float x, float y) const noexcept { return std::min(x, y); }
};
inline MPI_Op make_op(MPI_User_function* f) {
  MPI_Op op = MPI_OP_NULL;
  MPI_Op_create(f, /*commute=*/1, &op);
  return op;
}
template <class Values>
MPI_Op op_for(reduction how) {
  static const MPI_Op sum = make_op(&combine<Values, add_values>);
  static const MPI_Op max = make_op(&combine<Values, larger>);
  static const MPI_Op min = make_op(&combine<Values, smaller>);
  return how == reduction::max ? max : how == reduction::min ? min : sum;
}
} // namespace float16_ops

/// @brief The op that reduces values of 16-bit float type `type` (bf16 or f16, as MPI_UINT16_T)
/// the way `how` says.
[[nodiscard]] inline MPI_Op float16_op(ir::dtype type, reduction how) {
  return type == ir::dtype::f16 ? float16_ops::op_for<float16_ops::f16_values>(how)
                                : float16_ops::op_for<float16_ops::bf16_values>(how);
}

} // namespace concerto::runtime::mpi
