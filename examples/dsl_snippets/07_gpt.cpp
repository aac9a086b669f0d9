// A complete small GPT: a vocab-parallel embedding, a stack of identical blocks traced once with
// repeat, a final layernorm, a column-parallel LM head and Megatron-LM's vocab-parallel cross-entropy.
#include <concerto/concerto.hpp>

#include <cstdio>

using namespace concerto;
inline constexpr axis<"dp"> dp;
inline constexpr axis<"tp"> tp;

constexpr auto vec = spec(replicate);
constexpr auto col = spec(replicate, shard(tp));  // column-parallel [in, out]
constexpr auto row = spec(shard(tp), replicate);  // row-parallel
constexpr auto tokens = spec(shard(dp), replicate); // [batch, seq]

// One block, written once: its parameters become layers.<i>.wq, ... when lowered.
constexpr auto gpt_block = [](auto h) {
  auto a = layernorm(h, param<"ln1.g">(vec, init::ones), param<"ln1.b">(vec));
  auto att = causal_attention(matmul(a, param<"wq">(col)), matmul(a, param<"wk">(col)), matmul(a, param<"wv">(col)));
  auto h2 = h + matmul(att, param<"wo">(row));
  auto m = layernorm(h2, param<"ln2.g">(vec, init::ones), param<"ln2.b">(vec));
  return h2 + matmul(gelu(matmul(m, param<"fc1">(col))), param<"fc2">(row));
};

constexpr auto h0 = embedding(data<"ids">(tokens), param<"wte">(spec(shard(tp), replicate))); // [V, h] split on V
constexpr auto hN = repeat<"layers">(gpt_block, h0);
constexpr auto logits = matmul(layernorm(hN, param<"lnf.g">(vec, init::ones), param<"lnf.b">(vec)), param<"head">(col));
constexpr auto gpt = program(cross_entropy(logits, data<"labels">(tokens)), adamw{});

// Per block: Megatron-LM's two all-reduces forward and two backward, whatever the depth.
static_assert(gpt.count_in("layers", collective::all_reduce, tp, ir::phase::forward) == 2);
static_assert(gpt.count_in("layers", collective::all_reduce, tp, ir::phase::backward) == 2);
// Outside the blocks, forward: the embedding's sum, then the row max, target logit and sum of
// exponentials of the cross-entropy; the logits are never gathered.
static_assert(gpt.count(collective::all_reduce, tp, ir::phase::forward) == 2 + 1 + 3);
static_assert(gpt.count(collective::all_gather) == 0);
// With 12 layers the step has 12 times the block's collectives.
static_assert(gpt.count_unrolled({12}, collective::all_reduce, tp) == 12 * 4 + 4 + 1);

#ifndef CONCERTO_SNIPPET_NO_MAIN
int main() {
  const auto m = mesh::from_world(4, {{"dp", 2}, {"tp", 2}});
  const shape_map shapes{{"ids", {4, 32}},   {"labels", {4, 32}}, {"wte", {512, 64}},  {"ln1.g", {64}},
                         {"ln1.b", {64}},    {"wq", {64, 64}},    {"wk", {64, 64}},    {"wv", {64, 64}},
                         {"wo", {64, 64}},   {"ln2.g", {64}},     {"ln2.b", {64}},     {"fc1", {64, 256}},
                         {"fc2", {256, 64}}, {"lnf.g", {64}},     {"lnf.b", {64}},     {"head", {64, 512}}};
  const auto g = lower(gpt, shapes, m, {.name = "gpt", .heads = 4, .depth = {{"layers", 4}}});
  std::printf("%s\n%zu tasks for 4 layers\n", gpt.dump().c_str(), g.tasks.size());
}
#endif
