// Tutorial step 4: a GPT block; sequence parallelism is the residual spec split over tp along the sequence.
#include <concerto/concerto.hpp>

#include <cstdio>

using namespace concerto;
inline constexpr axis<"dp"> dp;
inline constexpr axis<"tp"> tp;

constexpr auto vec = spec(replicate);
constexpr auto col = spec(replicate, shard(tp));
constexpr auto row = spec(shard(tp), replicate);

template <class H>
constexpr auto block(H h) {
  auto a = layernorm(h, param<"ln1.g">(vec, init::ones), param<"ln1.b">(vec));
  auto att = causal_attention(matmul(a, param<"wq">(col)), matmul(a, param<"wk">(col)), matmul(a, param<"wv">(col)));
  auto h2 = h + matmul(att, param<"wo">(row));
  auto m = layernorm(h2, param<"ln2.g">(vec, init::ones), param<"ln2.b">(vec));
  return h2 + matmul(gelu(matmul(m, param<"fc1">(col))), param<"fc2">(row));
}

constexpr auto tp_only = spec(shard(dp), replicate, replicate);  // [batch, seq, hidden]
constexpr auto seq_par = spec(shard(dp), shard(tp), replicate);  // the sequence split over tp too
constexpr auto megatron = program(mse(block(input<"x">(tp_only)), data<"y">(tp_only)), adamw{});
constexpr auto megatron_sp = program(mse(block(input<"x">(seq_par)), data<"y">(seq_par)), adamw{});

static_assert(megatron.count(collective::all_reduce, tp, ir::phase::forward) == 2);
static_assert(megatron.count(collective::all_reduce, tp, ir::phase::backward) == 2);
static_assert(megatron_sp.count(collective::all_gather, tp) == 4);
static_assert(megatron_sp.count(collective::reduce_scatter, tp) == 4);

int main() {
  const auto m = mesh::from_world(4, {{"dp", 2}, {"tp", 2}});
  const shape_map shapes{{"x", {4, 128, 256}}, {"y", {4, 128, 256}}, {"ln1.g", {256}}, {"ln1.b", {256}},
                         {"ln2.g", {256}},     {"ln2.b", {256}},     {"wq", {256, 256}}, {"wk", {256, 256}},
                         {"wv", {256, 256}},   {"wo", {256, 256}},   {"fc1", {256, 1024}}, {"fc2", {1024, 256}}};
  const auto g = lower(megatron_sp, shapes, m, {"gpt_block", 8});
  std::printf("%s\n%zu tasks\n", megatron_sp.dump().c_str(), g.tasks.size());
}
