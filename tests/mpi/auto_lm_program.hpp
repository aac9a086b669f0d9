#pragma once
// The automatic-sharding tests' models, every spec written auto_: a small language model (an
// embedding, a stack of residual blocks with a layer norm and a GELU MLP, a head, cross-entropy),
// and an MLP on a dp x tp mesh; the 8-rank mesh they are priced on.
#include <concerto/concerto.hpp>

namespace auto_lm {

using namespace concerto;

inline constexpr auto free2 = spec(auto_, auto_);
inline constexpr auto tokens = spec(auto_, replicate);
inline constexpr auto block = [](auto h) {
  auto a = layernorm(h, param<"ln.g">(spec(auto_), init::ones), param<"ln.b">(spec(auto_)));
  return h + matmul(gelu(matmul(a, param<"fc1">(free2))), param<"fc2">(free2));
};
inline constexpr auto stack = repeat<"layers">(block, embedding(data<"ids">(tokens), param<"wte">(free2)));
inline constexpr auto lm = program(cross_entropy(matmul(stack, param<"head">(free2)), data<"labels">(tokens)), adamw{});

inline shape_map shapes(std::int64_t batch, std::int64_t seq, std::int64_t vocab, std::int64_t hidden) {
  return {{"ids", {batch, seq}},    {"labels", {batch, seq}},      {"wte", {vocab, hidden}},       {"ln.g", {hidden}},
          {"ln.b", {hidden}},       {"fc1", {hidden, 4 * hidden}}, {"fc2", {4 * hidden, hidden}}, {"head", {hidden, vocab}}};
}

inline constexpr axis<"dp"> dp;
inline constexpr axis<"tp"> tp;
inline constexpr auto auto_mlp = program(
    mse(matmul(gelu(matmul(input<"x">(free2), param<"w1">(free2))), param<"w2">(free2)), input<"target">(free2)), adamw{}, on(dp, tp));

inline shape_map mlp_shapes(std::int64_t batch, std::int64_t hidden) {
  return {{"x", {batch, hidden}}, {"target", {batch, hidden}}, {"w1", {hidden, 4 * hidden}}, {"w2", {4 * hidden, hidden}}};
}

// 8 ranks: dp 2 across nodes, tp 4 within one.
inline const mesh eight = mesh::from_world(8, {{"dp", 2, ir::link_class::inter_node}, {"tp", 4}});

} // namespace auto_lm
