#pragma once
// The example's Llama-family decoder: RMSNorm before attention and feed-forward, rotary position
// embeddings on q and k, grouped-query attention (fewer k/v heads than query heads), a SwiGLU
// feed-forward block, no biases and an untied LM head; vocab-parallel embedding and
// cross-entropy as in the GPT example. The residual stream is replicated over tp (Megatron TP) or
// split over it on the sequence (SP). The training tests (tests/mpi/train_llama_test.cpp) check
// this very model.
#include <concerto/concerto.hpp>

namespace llama_model {

using namespace concerto;
inline constexpr axis<"dp"> dp;
inline constexpr axis<"tp"> tp;

inline constexpr auto vec = spec(replicate);
inline constexpr auto col = spec(replicate, shard(tp));
inline constexpr auto row = spec(shard(tp), replicate);
inline constexpr auto tokens = spec(shard(dp), replicate);

template <auto Residual, auto Optimizer = adamw{}>
constexpr auto make() {
  constexpr auto block = [](auto h) {
    constexpr auto positions = data<"positions">(tokens);
    auto a = rmsnorm(h, param<"attn_norm.g">(vec, init::ones));
    auto q = rope(matmul(a, param<"wq">(col)), positions);
    auto k = rope(matmul(a, param<"wk">(col)), positions);
    auto v = matmul(a, param<"wv">(col));
    auto h2 = h + matmul(causal_attention(q, k, v), param<"wo">(row)).to(Residual);
    auto m = rmsnorm(h2, param<"ffn_norm.g">(vec, init::ones));
    return h2 + matmul(swiglu(matmul(m, param<"w1">(col)), matmul(m, param<"w3">(col))), param<"w2">(row)).to(Residual);
  };
  constexpr auto h0 = embedding(data<"ids">(tokens), param<"wte">(row)).to(Residual);
  constexpr auto hn = repeat<"layers">(block, h0);
  constexpr auto logits = matmul(rmsnorm(hn, param<"norm.g">(vec, init::ones)), param<"head">(col));
  return program(cross_entropy(logits, data<"labels">(tokens)), Optimizer);
}

inline constexpr auto replicated_residual = spec(shard(dp), replicate, replicate);
inline constexpr auto sequence_parallel_residual = spec(shard(dp), shard(tp), replicate);
inline constexpr auto llama_tp = make<replicated_residual>();
inline constexpr auto llama_sp = make<sequence_parallel_residual>();

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

} // namespace llama_model
