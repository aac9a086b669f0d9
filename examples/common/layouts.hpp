#pragma once
// The specs of the transformer examples (GPT, Llama), as written by hand or left to automatic
// sharding: a model takes one of these as its `Layout` and reads its weights', norms' and token
// batches' specs from it, and ends each residual branch with `Layout::residual<R>(x)`.
#include <concerto/concerto.hpp>

namespace examples::layouts {

using namespace concerto;

/// Megatron-LM's specs: a norm's vector whole, a weight split on its columns or rows over tp,
/// token batches split over dp.
inline constexpr auto vec = spec(replicate);
inline constexpr auto col = spec(replicate, shard(axis<"tp">{}));
inline constexpr auto row = spec(shard(axis<"tp">{}), replicate);
inline constexpr auto tokens = spec(shard(axis<"dp">{}), replicate);

/// Megatron-LM's tensor parallelism over tp, data parallelism over dp: q, k, v and the first
/// feed-forward products column-parallel, the others row-parallel, the embedding and the head
/// split over the vocabulary; each branch's sum laid out as the residual stream `R`.
struct megatron {
  static constexpr auto vec = layouts::vec;
  static constexpr auto col = layouts::col;
  static constexpr auto row = layouts::row;
  static constexpr auto tokens = layouts::tokens;
  template <auto R, class X>
  static constexpr auto residual(X x) {
    return x.to(R);
  }
};

/// Every spec decided by automatic sharding (--auto, docs/auto-sharding.md): each weight's and
/// norm's dimensions, the token batches' first one, and the layout each branch's sum takes into
/// the residual stream on its batch and sequence dims (replicated: Megatron's tensor
/// parallelism; the sequence over the tensor axis: its sequence parallelism; open: as the
/// weights leave it).
struct decided {
  static constexpr auto vec = spec(auto_);
  static constexpr auto col = spec(auto_, auto_);
  static constexpr auto row = col;
  static constexpr auto tokens = spec(auto_, replicate);
  template <auto R, class X>
  static constexpr auto residual(X x) {
    if constexpr (to_value(R).rank == 3) return x.to(spec(auto_, auto_, replicate));
    else return x.to(spec(auto_, replicate));
  }
};

} // namespace examples::layouts
