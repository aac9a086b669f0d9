// Tutorial step 10: vision. A convolution is a product over its window, so it shards as a matmul:
// the batch over dp, the output channels over tp (column-parallel), the input channels over tp
// with a pending sum (row-parallel). Batch normalisation's statistics are the whole batch's
// however it is split: an all-reduce of 2·channels values over dp forward and another backward.
#include <concerto/concerto.hpp>

#include <cstdio>

using namespace concerto;
inline constexpr axis<"dp"> dp;
inline constexpr axis<"tp"> tp;

constexpr auto images = spec(shard(dp), replicate, replicate, replicate); // [batch, height, width, channels]
constexpr auto column = spec(replicate, replicate, replicate, shard(tp)); // a kernel [3, 3, in, out] split on out
constexpr auto row = spec(replicate, replicate, shard(tp), replicate);    // ... split on in
// A ResNet's stem: 3×3 convolution, batch norm, relu, 3×3 max pooling at stride 2 (the channels stay split).
constexpr auto h = max_pool<{.window = 3, .stride = 2, .padding = 1}>(
    relu(batchnorm(conv2d<{.padding = 1}>(input<"x">(images, no_grad), param<"k1">(column)),
                   param<"g">(spec(shard(tp)), init::ones), param<"b">(spec(shard(tp))))));
constexpr auto features = conv2d(h, param<"k2">(row)); // a pending sum over tp, made by the next nonlinear op
// Global average pooling: the pixels as a sequence (a view), their mean; then a linear head.
constexpr auto pooled = mean<1>(flatten<1, 2>(relu(features)));
constexpr auto step = program(cross_entropy(matmul(pooled, param<"head">(spec(replicate, replicate))),
                                            data<"labels">(spec(shard(dp)))),
                              adamw{}, on(dp, tp));

static_assert(step.count(collective::all_reduce, dp, ir::phase::forward) == 1); // batch norm's sums
static_assert(step.count(collective::all_reduce, tp, ir::phase::forward) == 1); // the row-parallel sum

int main() {
  const auto m = mesh::from_world(4, {{"dp", 2}, {"tp", 2}});
  const auto g = lower(step,
                       {{"x", {8, 16, 16, 3}}, {"k1", {3, 3, 3, 32}}, {"g", {32}}, {"b", {32}}, {"k2", {3, 3, 32, 32}},
                        {"head", {32, 10}}, {"labels", {8}}},
                       m);
  std::printf("%s\n%zu tasks\n", step.dump().c_str(), g.tasks.size());
}
