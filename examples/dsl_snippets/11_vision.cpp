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
// A ViT's patch embedding without a convolution: 32 × 32 images cut into 4 × 4 patches by views
// and one transpose, each patch's 48 values (row, column, channel) times a [48, hidden] weight.
constexpr int side = 32, p = 4, c = 3;
constexpr auto rows = flatten<0, 1>(unflatten<1, p>(flatten<2, 3>(input<"img">(images, no_grad)))); // [batch·8, 4, 32·3]
constexpr auto cut = flatten<2, 3>(transpose<1>(unflatten<2, p * c>(rows)));                     // [batch·8, 8, 4·4·3]
constexpr auto patches = unflatten<0, (side / p) * (side / p)>(flatten<0, 1>(cut));               // [batch, 64, 48]
constexpr auto embedded = matmul(patches, param<"patch">(spec(replicate, shard(tp))));           // [batch, 64, hidden]
constexpr auto vit = program(cross_entropy(matmul(mean<1>(relu(embedded)), param<"head">(spec(shard(tp), replicate))),
                                           data<"labels">(spec(shard(dp)))),
                             adamw{}, on(dp, tp));
static_assert(vit.count(op_code::transpose) == 1 && vit.count(collective::all_gather) == 0); // views and one copy

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
  const auto v = lower(vit, {{"img", {8, side, side, c}}, {"patch", {p * p * c, 32}}, {"head", {32, 10}}, {"labels", {8}}}, m);
  std::printf("%zu tasks in the patch-embedding classifier\n", v.tasks.size());
}
