#pragma once
// The example's GPT (the block of docs/tutorial.md step 4 in a repeat, a vocab-parallel embedding
// and LM head, Megatron-LM's vocab-parallel cross-entropy), with the residual stream either
// replicated over tp (Megatron TP) or split over it on the sequence (SP), or every spec left to
// automatic sharding (gpt_auto, --auto). The training tests (tests/mpi/train_gpt_test.cpp) check
// this very model.
#include "../common/layouts.hpp"

#include <concerto/concerto.hpp>

namespace gpt_model {

using namespace concerto;
inline constexpr axis<"dp"> dp;
inline constexpr axis<"tp"> tp;

using examples::layouts::col, examples::layouts::row, examples::layouts::tokens, examples::layouts::vec;
using examples::layouts::decided, examples::layouts::megatron;

/// The pre-norm transformer block (attention, then the GELU MLP), q, k, v and fc1 column-parallel
/// over tp, wo and fc2 row-parallel, the residual stream laid out as `Residual`; causal (GPT) or
/// not (examples/vit's encoder).
template <auto Residual, bool Causal = true, class Layout = megatron>
inline constexpr auto block = [](auto h) {
  auto a = layernorm(h, param<"ln1.g">(Layout::vec, init::ones), param<"ln1.b">(Layout::vec));
  auto q = matmul(a, param<"wq">(Layout::col)), k = matmul(a, param<"wk">(Layout::col)), v = matmul(a, param<"wv">(Layout::col));
  auto att = [&] {
    if constexpr (Causal) return causal_attention(q, k, v);
    else return attention(q, k, v);
  }();
  auto h2 = h + Layout::template residual<Residual>(matmul(att, param<"wo">(Layout::row)));
  auto m = layernorm(h2, param<"ln2.g">(Layout::vec, init::ones), param<"ln2.b">(Layout::vec));
  return h2 + Layout::template residual<Residual>(matmul(gelu(matmul(m, param<"fc1">(Layout::col))), param<"fc2">(Layout::row)));
};

template <auto Residual, class Layout = megatron>
constexpr auto make() {
  constexpr auto h0 = Layout::template residual<Residual>(embedding(data<"ids">(Layout::tokens), param<"wte">(Layout::row)));
  constexpr auto hn = repeat<"layers">(block<Residual, true, Layout>, h0);
  constexpr auto logits =
      matmul(layernorm(hn, param<"lnf.g">(Layout::vec, init::ones), param<"lnf.b">(Layout::vec)), param<"head">(Layout::col));
  return program(cross_entropy(logits, data<"labels">(Layout::tokens)), adamw{});
}

inline constexpr auto gpt_tp = make<spec(shard(dp), replicate, replicate)>();
inline constexpr auto gpt_sp = make<spec(shard(dp), shard(tp), replicate)>();
inline constexpr auto gpt_auto = make<spec(replicate, replicate, replicate), decided>();

inline shape_map shapes(std::int64_t batch, std::int64_t seq, std::int64_t vocab, std::int64_t hidden) {
  const auto h = hidden, f = 4 * hidden;
  return {{"ids", {batch, seq}}, {"labels", {batch, seq}}, {"wte", {vocab, h}},   {"ln1.g", {h}},   {"ln1.b", {h}},
          {"wq", {h, h}},        {"wk", {h, h}},          {"wv", {h, h}},         {"wo", {h, h}},   {"ln2.g", {h}},
          {"ln2.b", {h}},        {"fc1", {h, f}},          {"fc2", {f, h}},        {"lnf.g", {h}},   {"lnf.b", {h}},
          {"head", {h, vocab}}};
}

} // namespace gpt_model
