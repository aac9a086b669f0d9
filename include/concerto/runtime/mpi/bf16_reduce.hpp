#pragma once
/// @file
/// @brief MPI reductions over bf16 values, which MPI has no type for: the values travel as
/// MPI_UINT16_T and a user-defined op combines each pair in f32 and rounds the result to bf16 (to
/// nearest even), as NCCL's bf16 reductions do. Made once per process, at first use (after
/// MPI_Init), and never freed: MPI_Finalize releases them.
///
/// @code
/// MPI_Iallreduce(send, recv, n, MPI_UINT16_T, runtime::mpi::bf16_op(reduction::sum), comm, &r);
/// @endcode

#include <concerto/core/bfloat16.hpp>
#include <concerto/runtime/collective_layout.hpp>

#include <mpi.h>

#include <algorithm>
#include <cstdint>

namespace concerto::runtime::mpi {

namespace bf16_ops {
template <class Combine>
void combine_bf16(void* in, void* inout, int* len, MPI_Datatype*) {
  const auto* a = static_cast<const std::uint16_t*>(in);
  auto* b = static_cast<std::uint16_t*>(inout);
  for (int i = 0; i < *len; ++i) b[i] = to_bf16(Combine{}(from_bf16(a[i]), from_bf16(b[i])));
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
} // namespace bf16_ops

/// @brief The op that reduces bf16 values (as MPI_UINT16_T) the way `how` says.
[[nodiscard]] inline MPI_Op bf16_op(reduction how) {
  static const MPI_Op sum = bf16_ops::make_op(&bf16_ops::combine_bf16<bf16_ops::add_values>);
  static const MPI_Op max = bf16_ops::make_op(&bf16_ops::combine_bf16<bf16_ops::larger>);
  static const MPI_Op min = bf16_ops::make_op(&bf16_ops::combine_bf16<bf16_ops::smaller>);
  return how == reduction::max ? max : how == reduction::min ? min : sum;
}

} // namespace concerto::runtime::mpi
