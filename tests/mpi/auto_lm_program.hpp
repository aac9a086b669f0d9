#pragma once
// The automatic-sharding tests' model: a small language model (an embedding, a stack of residual
// blocks with a layer norm and a GELU MLP, a head, cross-entropy) with every spec written auto_.
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

} // namespace auto_lm
