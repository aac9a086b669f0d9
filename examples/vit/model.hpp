#pragma once
// The example's Vision Transformer: patch embedding as a convolution whose stride is its kernel
// (each patch × its weights: one product per patch, the same as a reshape and a matmul, without
// the copy), the patches as a sequence (flatten: a view) plus a learned position table, the
// GPT example's pre-norm transformer block with bidirectional attention in a `repeat`, mean
// pooling over the patches, a linear head. The paper's ViT configuration: ZeRO-2 over `dp` (gradients reduce-scattered,
// optimizer state sharded); over `tp` Megatron-LM's column/row-parallel projections, the
// residual stream either replicated over tp (TP) or split over it on the sequence (SP).
#include "../gpt/model.hpp"

namespace vit_model {

using namespace concerto;
using gpt_model::dp, gpt_model::tp, gpt_model::vec;

inline constexpr int patch = 4; ///< patch side in pixels (the embedding's kernel and stride)

template <auto Residual>
constexpr auto make() {
  constexpr auto images = spec(shard(dp), replicate, replicate, replicate);
  constexpr auto patches = conv2d<{.stride = patch}>(input<"x">(images, no_grad), param<"patch">(spec(replicate, replicate, replicate, replicate)));
  constexpr auto tokens = bias(flatten<1, 2>(patches), param<"pos">(spec(replicate, replicate))).to(Residual);
  constexpr auto hn = repeat<"layers">(gpt_model::block<Residual, false>, tokens); // GPT's block, no mask
  constexpr auto pooled = mean<1>(layernorm(hn, param<"lnf.g">(vec, init::ones), param<"lnf.b">(vec)));
  constexpr auto logits = matmul(pooled, param<"head">(spec(replicate, replicate)));
  return program(cross_entropy(logits, data<"labels">(spec(shard(dp)))), zero<2>(adamw{}, dp), on(dp, tp));
}

inline constexpr auto vit_tp = make<spec(shard(dp), replicate, replicate)>();
inline constexpr auto vit_sp = make<spec(shard(dp), shard(tp), replicate)>();

/// Shapes for `batch` images of side × side × 3 (side a multiple of the patch), width `hidden`, `classes` classes.
inline shape_map shapes(std::int64_t batch, std::int64_t side, std::int64_t hidden, std::int64_t classes) {
  const auto h = hidden, f = 4 * hidden, tokens = (side / patch) * (side / patch);
  return {{"x", {batch, side, side, 3}}, {"labels", {batch}}, {"patch", {patch, patch, 3, h}}, {"pos", {tokens, h}},
          {"ln1.g", {h}}, {"ln1.b", {h}}, {"wq", {h, h}}, {"wk", {h, h}}, {"wv", {h, h}}, {"wo", {h, h}}, {"ln2.g", {h}},
          {"ln2.b", {h}}, {"fc1", {h, f}}, {"fc2", {f, h}}, {"lnf.g", {h}}, {"lnf.b", {h}}, {"head", {h, classes}}};
}

} // namespace vit_model
