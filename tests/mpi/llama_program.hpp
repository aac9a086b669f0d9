#pragma once
// The training tests check the Llama example's own model.
#include "../../examples/llama/model.hpp"

#include <concerto/train/options.hpp>

#include <cstdint>
#include <string>
#include <vector>

namespace llama_testing = llama_model;

/// The small Llama the trainer and precision tests train: two layers of width 32, a batch of
/// 4 × 8 tokens of a vocabulary of 32, and the parameters they compare (some of every kind).
namespace small_llama {
inline constexpr std::int64_t batch = 4, seq = 8, vocab = 32, hidden = 32, heads = 4, kv_heads = 2, ffn = 48;
inline const auto shapes = llama_model::shapes(batch, seq, vocab, hidden, heads, kv_heads, ffn);
inline const std::vector<std::string> params{"wte",    "layers.0.wq", "layers.1.wk",         "layers.0.w1", "layers.1.w2",
                                             "layers.0.attn_norm.g", "layers.1.ffn_norm.g", "norm.g",      "head"};

/// A fixed batch: ids, the labels a shift apart, positions.
inline concerto::train::batch data() {
  concerto::train::tensor ids{{batch, seq}}, labels{{batch, seq}}, positions{{batch, seq}};
  for (std::int64_t i = 0; i < batch * seq; ++i) {
    ids.i64.push_back((i * 7 + 3) % vocab);
    labels.i64.push_back((i * 7 + 10) % vocab);
    positions.i64.push_back(i % seq);
  }
  return {{"ids", ids}, {"labels", labels}, {"positions", positions}};
}
} // namespace small_llama

/// The small MoE form the MoE and precision tests train: 4 experts of width 24 in two layers of
/// width 32, a batch of 8 × 16 tokens (each sequence's pattern shifted, so routing varies).
namespace small_moe {
inline constexpr std::int64_t batch = 8, seq = 16, vocab = 32, hidden = 32, heads = 4, kv_heads = 2, experts = 4, ffn = 24;
inline const auto shapes = llama_model::moe_shapes(batch, seq, vocab, hidden, heads, kv_heads, experts, ffn);

inline concerto::train::batch data() {
  concerto::train::tensor ids{{batch, seq}}, labels{{batch, seq}}, positions{{batch, seq}};
  for (std::int64_t i = 0; i < batch * seq; ++i) {
    ids.i64.push_back((i * 7 + 3 + i / seq) % vocab);
    labels.i64.push_back((i * 7 + 10 + i / seq) % vocab);
    positions.i64.push_back(i % seq);
  }
  return {{"ids", ids}, {"labels", labels}, {"positions", positions}};
}
} // namespace small_moe
