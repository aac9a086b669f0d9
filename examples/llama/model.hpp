#pragma once
// The example's Llama-family decoder: RMSNorm before attention and feed-forward, rotary position
// embeddings on q and k, grouped-query attention (fewer k/v heads than query heads), a SwiGLU
// feed-forward block, no biases and an untied LM head; vocab-parallel embedding and
// cross-entropy as in the GPT example. The residual stream is replicated over tp (Megatron TP) or
// split over it on the sequence (SP). The training tests (tests/mpi/train_llama_test.cpp) check
// this very model.
//
// Its mixture-of-experts form (make_moe, Mixtral's shape) replaces the feed-forward block by E
// SwiGLU experts behind a top-k router: tokens are split over dp × ep; moe_route gives the gates
// (capacity, dropped tokens, the balance loss's gradient); the dispatched tokens [experts,
// groups·capacity, h] are redistributed to an expert split over ep (an all-to-all), each rank
// runs its experts as one batched product (column- then row-parallel over tp, as the dense
// block), and the outputs return by the opposite all-to-all to the gate-weighted combine. Expert
// weights [E, h, f] are split over ep and summed over dp; the others are summed over dp and ep.
// tests/mpi/train_moe_test.cpp checks it.
#include "../common/layouts.hpp"

#include <concerto/concerto.hpp>

namespace llama_model {

using namespace concerto;
inline constexpr axis<"dp"> dp;
inline constexpr axis<"tp"> tp;

using examples::layouts::col, examples::layouts::row, examples::layouts::tokens, examples::layouts::vec;
using examples::layouts::decided, examples::layouts::megatron;

// Pre-norm grouped-query self-attention with rotary embeddings, added to the residual h.
template <auto Residual, class H, class P, class Layout = megatron>
constexpr auto attend(H h, P positions, Layout = {}) {
  auto a = rmsnorm(h, param<"attn_norm.g">(Layout::vec, init::ones));
  auto q = rope(matmul(a, param<"wq">(Layout::col)), positions);
  auto k = rope(matmul(a, param<"wk">(Layout::col)), positions);
  auto v = matmul(a, param<"wv">(Layout::col));
  return h + Layout::template residual<Residual>(matmul(causal_attention(q, k, v), param<"wo">(Layout::row)));
}

template <auto Residual, auto Optimizer = adamw{}, class Layout = megatron>
constexpr auto make() {
  constexpr auto block = [](auto h) {
    auto h2 = attend<Residual>(h, data<"positions">(Layout::tokens), Layout{});
    auto m = rmsnorm(h2, param<"ffn_norm.g">(Layout::vec, init::ones));
    return h2 + Layout::template residual<Residual>(
                    matmul(swiglu(matmul(m, param<"w1">(Layout::col)), matmul(m, param<"w3">(Layout::col))), param<"w2">(Layout::row)));
  };
  constexpr auto h0 = Layout::template residual<Residual>(embedding(data<"ids">(Layout::tokens), param<"wte">(Layout::row)));
  constexpr auto hn = repeat<"layers">(block, h0);
  constexpr auto logits = matmul(rmsnorm(hn, param<"norm.g">(Layout::vec, init::ones)), param<"head">(Layout::col));
  return program(cross_entropy(logits, data<"labels">(Layout::tokens)), Optimizer);
}

inline constexpr axis<"ep"> ep;
inline constexpr auto moe_tokens = spec(shard(dp, ep), replicate);
inline constexpr auto moe_residual = spec(shard(dp, ep), replicate, replicate);
inline constexpr auto expert_col = spec(shard(ep), replicate, shard(tp)); ///< [experts, h, f]
inline constexpr auto expert_row = spec(shard(ep), shard(tp), replicate); ///< [experts, f, h]
inline constexpr auto by_expert = spec(shard(ep), shard(dp), replicate);  ///< [experts, groups·capacity, h]

/// The mixture of experts' specs as written above: tokens over dp × ep, experts over ep, each
/// expert's products Megatron's way over tp.
struct moe_written {
  using dense = megatron;
  static constexpr auto tokens = moe_tokens;
  static constexpr auto expert_col = llama_model::expert_col;
  static constexpr auto expert_row = llama_model::expert_row;
  static constexpr auto router = spec(replicate, replicate);
  template <class X>
  static constexpr auto to_experts(X x) {
    return x.to(by_expert);
  }
  template <class X>
  static constexpr auto to_residual(X x) {
    return x.to(moe_residual);
  }
};

/// The same decided by automatic sharding (--auto --experts): where the experts live (over ep,
/// over dp, both, or copied), the tokens' split, the dispatched tokens' layout, each expert's
/// products column- then row-parallel over an axis it chooses (the structure kept: a choice of
/// every dim of a rank-3 weight would multiply the search by thousands).
struct moe_decided {
  using dense = decided;
  static constexpr auto tokens = spec(auto_, replicate);
  static constexpr auto expert_col = spec(auto_, replicate, auto_);
  static constexpr auto expert_row = spec(auto_, auto_, replicate);
  static constexpr auto router = spec(auto_, auto_);
  template <class X>
  static constexpr auto to_experts(X x) {
    return x.to(spec(auto_, auto_, replicate));
  }
  template <class X>
  static constexpr auto to_residual(X x) {
    return x.to(spec(auto_, auto_, replicate));
  }
};

template <moe_config Routing, auto Optimizer = adamw{}, class Layout = moe_written>
constexpr auto make_moe() {
  using dense = typename Layout::dense;
  constexpr auto block = [](auto h) {
    auto h2 = attend<moe_residual>(h, data<"positions">(Layout::tokens), dense{});
    auto m = rmsnorm(h2, param<"ffn_norm.g">(dense::vec, init::ones));
    auto gates = moe_route<Routing>(matmul(m, param<"router">(Layout::router)));
    auto x = Layout::to_experts(moe_dispatch(m, gates));
    auto y = matmul(swiglu(matmul(x, param<"w1">(Layout::expert_col)), matmul(x, param<"w3">(Layout::expert_col))),
                    param<"w2">(Layout::expert_row));
    return h2 + moe_combine(y, gates);
  };
  constexpr auto h0 = Layout::to_residual(embedding(data<"ids">(Layout::tokens), param<"wte">(dense::row)));
  constexpr auto hn = repeat<"layers">(block, h0);
  constexpr auto logits = matmul(rmsnorm(hn, param<"norm.g">(dense::vec, init::ones)), param<"head">(dense::col));
  return program(cross_entropy(logits, data<"labels">(Layout::tokens)), Optimizer);
}

/// Switch Transformer's routing (one expert per token) and GShard's / Mixtral's (two), capacity
/// factor 1.25, balance loss weight 0.01.
inline constexpr moe_config top1{.top_k = 1, .capacity_factor = 1.25, .aux_weight = 0.01};
inline constexpr moe_config top2{.top_k = 2, .capacity_factor = 1.25, .aux_weight = 0.01};

inline constexpr auto replicated_residual = spec(shard(dp), replicate, replicate);
inline constexpr auto sequence_parallel_residual = spec(shard(dp), shard(tp), replicate);
inline constexpr auto llama_tp = make<replicated_residual>();
inline constexpr auto llama_sp = make<sequence_parallel_residual>();
inline constexpr auto llama_auto = make<spec(replicate, replicate, replicate), adamw{}, decided>();

/// Shapes of a model with `heads` query heads and `kv_heads` k/v heads of hidden / heads lanes,
/// and a feed-forward width of `ffn` (Llama: about 8/3 of hidden, rounded).
inline shape_map shapes(std::int64_t batch, std::int64_t seq, std::int64_t vocab, std::int64_t hidden, std::int64_t heads,
                        std::int64_t kv_heads, std::int64_t ffn) {
  const auto h = hidden, kv = hidden / heads * kv_heads;
  return {{"ids", {batch, seq}}, {"labels", {batch, seq}}, {"positions", {batch, seq}}, {"wte", {vocab, h}},
          {"attn_norm.g", {h}},  {"wq", {h, h}},           {"wk", {h, kv}},             {"wv", {h, kv}},
          {"wo", {h, h}},        {"ffn_norm.g", {h}},      {"w1", {h, ffn}},            {"w3", {h, ffn}},
          {"w2", {ffn, h}},      {"norm.g", {h}},          {"head", {h, vocab}}};
}

/// The same with `experts` SwiGLU experts of width `ffn` and a router in place of the feed-forward block.
inline shape_map moe_shapes(std::int64_t batch, std::int64_t seq, std::int64_t vocab, std::int64_t hidden, std::int64_t heads,
                            std::int64_t kv_heads, std::int64_t experts, std::int64_t ffn) {
  auto s = shapes(batch, seq, vocab, hidden, heads, kv_heads, ffn);
  s["router"] = {hidden, experts};
  s["w1"] = s["w3"] = {experts, hidden, ffn};
  s["w2"] = {experts, ffn, hidden};
  return s;
}

} // namespace llama_model
