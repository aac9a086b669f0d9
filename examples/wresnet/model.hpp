#pragma once
// The example's Wide-ResNet: a 3×3 stem and a ResNet's 3×3 max pooling at stride 2, three stages of bottleneck blocks (1×1 reduce → 3×3 →
// 1×1 expand, each followed by batch normalisation, relu between), the first block of each stage
// with a strided 1×1 projection shortcut (stride 2 from the second stage on), stage 1's further
// blocks a `repeat` with identity shortcuts, then global average pooling and a linear head.
// Widths: stage s has a bottleneck of 16·2^(s−1)·k channels and twice that out (k, the width
// factor, is in the shapes). Data parallel over `dp` with batch statistics synchronised over it;
// over `tp` each bottleneck's first convolution is split by output channels (its batch norm on
// the split channels) and its 3×3 by input channels (a pending sum, made before the next batch
// norm), Megatron-LM's column/row pairing on convolutions. `wide_resnet_auto` is the planner's
// four-stage wresnet-dp net with every spec left to automatic sharding.
#include <concerto/concerto.hpp>
#include <concerto/ir/workloads.hpp>

#include <map>

namespace wresnet_model {

using namespace concerto;
inline constexpr axis<"dp"> dp;
inline constexpr axis<"tp"> tp;

/// The specs of the net's leaves as written by hand: data parallel over dp, Megatron-LM's
/// column/row pairing over tp.
struct written {
  static constexpr auto images = spec(shard(dp), replicate, replicate, replicate);
  static constexpr auto kernel = spec(replicate, replicate, replicate, replicate);
  static constexpr auto column = spec(replicate, replicate, replicate, shard(tp)); // output channels split
  static constexpr auto row = spec(replicate, replicate, shard(tp), replicate);    // input channels split
  static constexpr auto channels = spec(replicate);
  static constexpr auto split_channels = spec(shard(tp));
  static constexpr auto head = spec(replicate, replicate);
  static constexpr auto labels = spec(shard(dp));
};
/// Every spec left to automatic sharding: the images' and labels' batch, each kernel's input and
/// output channels, each batch norm's channels, the head's two dims.
struct decided {
  static constexpr auto images = spec(auto_, replicate, replicate, replicate);
  static constexpr auto kernel = spec(replicate, replicate, auto_, auto_);
  static constexpr auto column = kernel;
  static constexpr auto row = kernel;
  static constexpr auto channels = spec(auto_);
  static constexpr auto split_channels = channels;
  static constexpr auto head = spec(auto_, auto_);
  static constexpr auto labels = spec(auto_);
};

template <fixed_string P, class Spec, class X>
constexpr auto norm(X x, Spec s) {
  return batchnorm(x, param<join<P, "g">()>(s, init::ones), param<join<P, "b">()>(s));
}

/// 1×1 reduce, 3×3 at `Stride`, 1×1 expand, each batch-normalised; relu between.
template <fixed_string P, int Stride, class S = written, class X>
constexpr auto bottleneck(X x) {
  auto a = relu(norm<join<P, "na.">()>(conv2d(x, param<join<P, "wa">()>(S::column)), S::split_channels));
  auto b = relu(norm<join<P, "nb.">()>(conv2d<{.stride = Stride, .padding = 1}>(a, param<join<P, "wb">()>(S::row)), S::channels));
  return norm<join<P, "nc.">()>(conv2d(b, param<join<P, "wc">()>(S::kernel)), S::channels);
}

/// A stage's first block: the shortcut a strided 1×1 projection to the stage's width.
template <fixed_string P, int Stride, class X>
constexpr auto projected_block(X x) {
  return relu(bottleneck<P, Stride>(x) + conv2d<{.stride = Stride}>(x, param<join<P, "ws">()>(written::kernel)));
}

/// A block with an identity shortcut, its weights named `P`wa, ... (one per repeat).
template <fixed_string P, class S = written>
inline constexpr auto identity = [](auto x) { return relu(bottleneck<P, 1, S>(x) + x); };
inline constexpr auto identity_block = identity<"">;

inline constexpr auto net = [] {
  constexpr auto stem = max_pool<{.window = 3, .stride = 2, .padding = 1}>(
      relu(conv2d<{.padding = 1}>(input<"x">(written::images, no_grad), param<"stem">(written::kernel))));
  constexpr auto s1 = repeat<"stage1">(identity_block, projected_block<"s1.", 1>(stem));
  constexpr auto s3 = projected_block<"s3.", 2>(projected_block<"s2.", 2>(s1));
  constexpr auto logits = matmul(mean<1>(flatten<1, 2>(s3)), param<"head">(written::head));
  return program(cross_entropy(logits, data<"labels">(written::labels)), adamw{}, on(dp, tp));
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

/// A stage's first block as the planner's workload writes it: the shortcut a strided 1×1
/// projection to the stage's width, batch-normalised.
template <class S, fixed_string P, int Stride, class X>
constexpr auto normed_projected_block(X x) {
  auto shortcut = norm<join<P, "ns.">()>(conv2d<{.stride = Stride}>(x, param<join<P, "ws">()>(S::kernel)), S::channels);
  return relu(bottleneck<P, Stride, S>(x) + shortcut);
}

/// The planner's wresnet-dp model (ir::conv_net_spec: Alpa's Wide-ResNet) written in the DSL
/// with every spec decided (`decided`): a 7×7 stride-2 stem, batch norm, relu, 3×3 max pooling at
/// stride 2; four stages whose first block is strided from the second stage on, the stage's other
/// blocks a `repeat` (`stage1` … `stage4`, their weights r1.wa … r4.nc.b); global average
/// pooling, a linear head. The ZeRO stage is decided too (bench_autoshard --workload wresnet-dp).
inline constexpr auto wide_resnet_auto = [] {
  using S = decided;
  constexpr auto stem = max_pool<{.window = 3, .stride = 2, .padding = 1}>(
      relu(norm<"stem.n.">(conv2d<{.stride = 2, .padding = 3}>(input<"x">(S::images, no_grad), param<"stem">(S::kernel)), S::channels)));
  constexpr auto s1 = repeat<"stage1">(identity<"r1.", S>, normed_projected_block<S, "s1.", 1>(stem));
  constexpr auto s2 = repeat<"stage2">(identity<"r2.", S>, normed_projected_block<S, "s2.", 2>(s1));
  constexpr auto s3 = repeat<"stage3">(identity<"r3.", S>, normed_projected_block<S, "s3.", 2>(s2));
  constexpr auto s4 = repeat<"stage4">(identity<"r4.", S>, normed_projected_block<S, "s4.", 2>(s3));
  constexpr auto logits = matmul(mean<1>(flatten<1, 2>(s4)), param<"head">(S::head));
  return program(cross_entropy(logits, data<"labels">(S::labels)), adamw{});
}();

/// wide_resnet_auto's shapes for `batch` images of the spec's side; its repeats' depths are
/// wide_resnet_depths (each stage's blocks but its first).
inline shape_map wide_resnet_shapes(std::int64_t batch, const ir::conv_net_spec& m = {}) {
  shape_map s{{"x", {batch, m.image, m.image, 3}}, {"labels", {batch}}, {"stem", {7, 7, 3, m.stem}}};
  s["stem.n.g"] = s["stem.n.b"] = {m.stem};
  std::int64_t in = m.stem;
  for (std::size_t stage = 0; stage < 4; ++stage) {
    const auto reduce = m.reduce[stage], mid = m.mid[stage], out = m.out[stage];
    const auto block = [&](const std::string& p, std::int64_t from) {
      s[p + "wa"] = {1, 1, from, reduce};
      s[p + "wb"] = {3, 3, reduce, mid};
      s[p + "wc"] = {1, 1, mid, out};
      s[p + "na.g"] = s[p + "na.b"] = {reduce};
      s[p + "nb.g"] = s[p + "nb.b"] = {mid};
      s[p + "nc.g"] = s[p + "nc.b"] = {out};
    };
    const auto digit = static_cast<char>('1' + stage);
    const std::string first{'s', digit, '.'}, repeated{'r', digit, '.'};
    block(first, in);
    s[first + "ws"] = {1, 1, in, out};
    s[first + "ns.g"] = s[first + "ns.b"] = {out};
    block(repeated, out);
    in = out;
  }
  s["head"] = {in, m.classes};
  return s;
}
inline std::map<std::string, int> wide_resnet_depths(const ir::conv_net_spec& m = {}) {
  std::map<std::string, int> depth;
  for (std::size_t stage = 0; stage < 4; ++stage)
    depth["stage" + std::to_string(stage + 1)] = static_cast<int>(m.blocks[stage] - 1);
  return depth;
}

} // namespace wresnet_model
