#pragma once
// The example's Wide-ResNet: a 3×3 stem and a ResNet's 3×3 max pooling at stride 2, three stages of bottleneck blocks (1×1 reduce → 3×3 →
// 1×1 expand, each followed by batch normalisation, relu between), the first block of each stage
// with a strided 1×1 projection shortcut (stride 2 from the second stage on), stage 1's further
// blocks a `repeat` with identity shortcuts, then global average pooling and a linear head.
// Widths: stage s has a bottleneck of 16·2^(s−1)·k channels and twice that out (k, the width
// factor, is in the shapes). Data parallel over `dp` with batch statistics synchronised over it;
// over `tp` each bottleneck's first convolution is split by output channels (its batch norm on
// the split channels) and its 3×3 by input channels (a pending sum, made before the next batch
// norm), Megatron-LM's column/row pairing on convolutions.
#include <concerto/concerto.hpp>

namespace wresnet_model {

using namespace concerto;
inline constexpr axis<"dp"> dp;
inline constexpr axis<"tp"> tp;

inline constexpr auto images = spec(shard(dp), replicate, replicate, replicate);
inline constexpr auto kernel = spec(replicate, replicate, replicate, replicate);
inline constexpr auto column = spec(replicate, replicate, replicate, shard(tp)); // output channels split
inline constexpr auto row = spec(replicate, replicate, shard(tp), replicate);    // input channels split
inline constexpr auto channels = spec(replicate);
inline constexpr auto split_channels = spec(shard(tp));

template <fixed_string P, class Spec, class X>
constexpr auto norm(X x, Spec s) {
  return batchnorm(x, param<join<P, "g">()>(s, init::ones), param<join<P, "b">()>(s));
}

/// 1×1 reduce, 3×3 at `Stride`, 1×1 expand, each batch-normalised; relu between.
template <fixed_string P, int Stride, class X>
constexpr auto bottleneck(X x) {
  auto a = relu(norm<join<P, "na.">()>(conv2d(x, param<join<P, "wa">()>(column)), split_channels));
  auto b = relu(norm<join<P, "nb.">()>(conv2d<{.stride = Stride, .padding = 1}>(a, param<join<P, "wb">()>(row)), channels));
  return norm<join<P, "nc.">()>(conv2d(b, param<join<P, "wc">()>(kernel)), channels);
}

/// A stage's first block: the shortcut a strided 1×1 projection to the stage's width.
template <fixed_string P, int Stride, class X>
constexpr auto projected_block(X x) {
  return relu(bottleneck<P, Stride>(x) + conv2d<{.stride = Stride}>(x, param<join<P, "ws">()>(kernel)));
}

inline constexpr auto identity_block = [](auto x) { return relu(bottleneck<"", 1>(x) + x); };

inline constexpr auto net = [] {
  constexpr auto stem = max_pool<{.window = 3, .stride = 2, .padding = 1}>(
      relu(conv2d<{.padding = 1}>(input<"x">(images, no_grad), param<"stem">(kernel))));
  constexpr auto s1 = repeat<"stage1">(identity_block, projected_block<"s1.", 1>(stem));
  constexpr auto s3 = projected_block<"s3.", 2>(projected_block<"s2.", 2>(s1));
  constexpr auto logits = matmul(mean<1>(flatten<1, 2>(s3)), param<"head">(spec(replicate, replicate)));
  return program(cross_entropy(logits, data<"labels">(spec(shard(dp)))), adamw{}, on(dp, tp));
}();

/// Shapes for `batch` images of side × side × 3, width factor k and `classes` classes.
inline shape_map shapes(std::int64_t batch, std::int64_t side, std::int64_t k, std::int64_t classes) {
  constexpr std::int64_t stem = 16;
  shape_map s{{"x", {batch, side, side, 3}}, {"labels", {batch}}, {"stem", {3, 3, 3, stem}}};
  const auto block = [&](const std::string& p, std::int64_t in, std::int64_t mid, std::int64_t out) {
    s[p + "wa"] = {1, 1, in, mid};
    s[p + "wb"] = {3, 3, mid, mid};
    s[p + "wc"] = {1, 1, mid, out};
    s[p + "na.g"] = s[p + "na.b"] = s[p + "nb.g"] = s[p + "nb.b"] = {mid};
    s[p + "nc.g"] = s[p + "nc.b"] = {out};
  };
  std::int64_t in = stem;
  for (int stage = 1; stage <= 3; ++stage) {
    const std::int64_t mid = (16 << (stage - 1)) * k, out = 2 * mid;
    std::string p(1, 's'); // appended piece by piece: g++ 12 warns falsely (-Wrestrict) on "s" + std::to_string(...)
    p += std::to_string(stage);
    p += '.';
    block(p, in, mid, out);
    s[p + "ws"] = {1, 1, in, out};
    if (stage == 1) block("", out, mid, out); // the repeated identity blocks
    in = out;
  }
  s["head"] = {in, classes};
  return s;
}

} // namespace wresnet_model
