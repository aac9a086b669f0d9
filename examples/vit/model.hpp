#pragma once
// The example's Vision Transformer: patch embedding as a convolution whose stride is its kernel
// (each patch × its weights; the same numbers as cutting the image into patches with unflatten,
// transpose<1> and flatten and one product, which needs the image's side at compile time:
// docs/tutorial.md, and bench/cpu_kernels times both), the patches as a sequence (flatten: a view) after a learned class token (concat of
// a [1, hidden] table, repeated over the batch) plus a learned position table, the GPT example's
// pre-norm transformer block with bidirectional attention in a `repeat`, the class token's final
// state (slice) normalised into a linear head. Under sequence parallelism (`--sp`) the sequence
// is split over tp, so it stays the patches alone (1 + patches would not divide) and the head
// reads their mean instead. The paper's ViT configuration: ZeRO-2 over `dp` (gradients reduce-scattered,
// optimizer state sharded); over `tp` Megatron-LM's column/row-parallel projections, the
// residual stream either replicated over tp (TP) or split over it on the sequence (SP).
#include "../gpt/model.hpp"

namespace vit_model {

using namespace concerto;
using gpt_model::dp, gpt_model::tp, gpt_model::vec;

inline constexpr int patch = 4; ///< patch side in pixels (the embedding's kernel and stride)

/// The specs the ViT's own leaves take beside the block's (`Layout`'s): written by hand, the images and
/// labels split over dp and the embedding's tables whole; decided (vit_auto), each left to
/// automatic sharding, as the ZeRO stage is.
template <class Layout>
struct vit_specs {
  static constexpr auto images = spec(shard(dp), replicate, replicate, replicate);
  static constexpr auto kernel = spec(replicate, replicate, replicate, replicate);
  static constexpr auto table = spec(replicate, replicate);
  static constexpr auto labels = spec(shard(dp));
};
template <>
struct vit_specs<examples::layouts::decided> {
  static constexpr auto images = spec(auto_, replicate, replicate, replicate);
  static constexpr auto kernel = spec(replicate, replicate, replicate, auto_);
  static constexpr auto table = spec(auto_, auto_);
  static constexpr auto labels = spec(auto_);
};

template <auto Residual, bool ClassToken, class Layout = examples::layouts::megatron>
constexpr auto make() {
  using specs = vit_specs<Layout>;
  constexpr auto patches =
      flatten<1, 2>(conv2d<{.stride = patch}>(input<"x">(specs::images, no_grad), param<"patch">(specs::kernel)));
  constexpr auto sequence = [&] {
    if constexpr (ClassToken) return concat<1>(param<"cls">(specs::table), patches);
    else return patches;
  }();
  constexpr auto tokens = Layout::template residual<Residual>(bias(sequence, param<"pos">(specs::table)));
  constexpr auto hn = repeat<"layers">(gpt_model::block<Residual, false, Layout>, tokens); // GPT's block, no mask
  constexpr auto features = [&] {
    if constexpr (ClassToken) return flatten<1, 2>(slice<1, 0, 1>(hn)); // the class token's state [batch, hidden]
    else return mean<1>(hn);
  }();
  constexpr auto logits = matmul(layernorm(features, param<"lnf.g">(Layout::vec, init::ones), param<"lnf.b">(Layout::vec)),
                                 param<"head">(specs::table));
  constexpr auto loss = cross_entropy(logits, data<"labels">(specs::labels));
  if constexpr (std::is_same_v<Layout, examples::layouts::decided>) return program(loss, adamw{});
  else return program(loss, zero<2>(adamw{}, dp), on(dp, tp));
}

inline constexpr auto vit_tp = make<spec(shard(dp), replicate, replicate), true>();
inline constexpr auto vit_sp = make<spec(shard(dp), shard(tp), replicate), false>();
/// Every spec, each branch's `.to` and the ZeRO stage decided (bench_autoshard --workload vit-zero2).
inline constexpr auto vit_auto = make<spec(replicate, replicate, replicate), true, examples::layouts::decided>();

/// Shapes for `batch` images of side × side × 3 (side a multiple of the patch), width `hidden`,
/// `classes` classes; the class token's with `class_token` (vit_tp), the patches alone without (vit_sp).
inline shape_map shapes(std::int64_t batch, std::int64_t side, std::int64_t hidden, std::int64_t classes, bool class_token = true) {
  const auto h = hidden, f = 4 * hidden, tokens = (side / patch) * (side / patch) + (class_token ? 1 : 0);
  auto s = shape_map{{"x", {batch, side, side, 3}}, {"labels", {batch}}, {"patch", {patch, patch, 3, h}}, {"pos", {tokens, h}},
          {"ln1.g", {h}}, {"ln1.b", {h}}, {"wq", {h, h}}, {"wk", {h, h}}, {"wv", {h, h}}, {"wo", {h, h}}, {"ln2.g", {h}},
          {"ln2.b", {h}}, {"fc1", {h, f}}, {"fc2", {f, h}}, {"lnf.g", {h}}, {"lnf.b", {h}}, {"head", {h, classes}}};
  if (class_token) s["cls"] = {1, h};
  return s;
}

} // namespace vit_model
