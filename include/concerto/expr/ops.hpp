#pragma once
/// @file
/// @brief The ops a model is written with. Each returns an expression; the sharding rule of
/// each op (which input specs it accepts, what its output spec is) lives in expr/rules.hpp and
/// is applied when a program is extracted.
///
/// @code
/// auto loss = mse(matmul(gelu(matmul(x, w1)), w2), y);
/// @endcode

#include <concerto/expr/expr.hpp>

namespace concerto {

namespace detail {
template <op_code Op, class... Args>
using op_t = node_expr<Op, no_extra, std::remove_cvref_t<Args>...>;
} // namespace detail

/// @brief a[..., m, k] · b[k, n] (or batched: b[..., k, n] with the same leading dimensions).
template <expression A, expression B>
[[nodiscard]] constexpr detail::op_t<op_code::matmul, A, B> matmul(A, B) noexcept {
  return {};
}
/// @brief Elementwise sum of two tensors of the same shape.
template <expression A, expression B>
[[nodiscard]] constexpr detail::op_t<op_code::add, A, B> add(A, B) noexcept {
  return {};
}
template <expression A, expression B>
[[nodiscard]] constexpr detail::op_t<op_code::add, A, B> operator+(A, B) noexcept {
  return {};
}
/// @brief x · t broadcast over x's leading dims, t the shape of x's last dims: a per-channel
/// scale `g[n]` of `x[..., n]` (LayerScale), a table of positions. Sharded as `bias`: t laid out
/// like x's last dims; t's gradient is summed over the others.
template <expression X, expression T>
[[nodiscard]] constexpr detail::op_t<op_code::scale_table, X, T> scale(X, T) noexcept {
  return {};
}
/// @brief x + b broadcast over x's leading dims, b the shape of x's last dims: a bias `b[n]` of
/// `x[..., n]`, a learned position table `p[seq, hidden]` of `x[batch, seq, hidden]`.
template <expression X, expression Bv>
[[nodiscard]] constexpr detail::op_t<op_code::bias_add, X, Bv> bias(X, Bv) noexcept {
  return {};
}
/// @brief GELU (tanh approximation), elementwise.
template <expression X>
[[nodiscard]] constexpr detail::op_t<op_code::gelu, X> gelu(X) noexcept {
  return {};
}
/// @brief max(x, 0), elementwise.
template <expression X>
[[nodiscard]] constexpr detail::op_t<op_code::relu, X> relu(X) noexcept {
  return {};
}
/// @brief Layer normalisation over the last dimension with gain `gamma[n]` and shift `beta[n]`.
template <expression X, expression G, expression Bt>
[[nodiscard]] constexpr detail::op_t<op_code::layernorm, X, G, Bt> layernorm(X, G, Bt) noexcept {
  return {};
}
/// @brief RMS normalisation over the last dimension with gain `gain[n]` (Llama's):
/// `x / √(mean(x²) + eps) · gain`, eps = 1e-6 (`runtime::kernel_settings::rmsnorm_eps`).
template <expression X, expression G>
[[nodiscard]] constexpr detail::op_t<op_code::rmsnorm, X, G> rmsnorm(X, G) noexcept {
  return {};
}
/// @brief SiLU (swish) `x·σ(x)`, elementwise.
template <expression X>
[[nodiscard]] constexpr detail::op_t<op_code::silu, X> silu(X) noexcept {
  return {};
}
/// @brief Elementwise product of two tensors of the same shape.
template <expression A, expression B>
[[nodiscard]] constexpr detail::op_t<op_code::mul, A, B> mul(A, B) noexcept {
  return {};
}
template <expression A, expression B>
[[nodiscard]] constexpr detail::op_t<op_code::mul, A, B> operator*(A, B) noexcept {
  return {};
}
/// @brief SwiGLU's gating `silu(gate)·up` as one op (one task forward, one backward), for the
/// feed-forward block of Llama: `matmul(swiglu(matmul(x, w1), matmul(x, w3)), w2)`.
template <expression G, expression U>
[[nodiscard]] constexpr detail::op_t<op_code::swiglu, G, U> swiglu(G, U) noexcept {
  return {};
}
/// @brief Rotary position embedding of x[batch, seq, heads·head_dim] by integer
/// `positions[batch, seq]` (a `data` leaf): each head's lanes i and i + head_dim/2 rotated by
/// `position·theta^(-2i/head_dim)`. head_dim is the attention's (`lower_options::heads`), theta
/// `lower_options::rope_theta`. Apply it to q and k before `causal_attention`.
template <expression X, expression P>
[[nodiscard]] constexpr detail::op_t<op_code::rope, X, P> rope(X, P) noexcept {
  return {};
}
/// @brief Batch normalisation in training mode over x `[..., channels]` (an NHWC image: over
/// batch, height and width) with gain `gamma[channels]` and shift `beta[channels]`:
/// `(x − mean)/√(var + eps)·gamma + beta`, eps = 1e-5 (`runtime::kernel_settings::batchnorm_eps`),
/// the biased variance. Synchronised by default: the statistics are the whole batch's however it
/// is split (`batchnorm<{.sync = false}>` keeps each rank's own). Channels may be split.
template <batchnorm_config C = batchnorm_config{}, expression X, expression G, expression Bt>
[[nodiscard]] constexpr node_expr<op_code::batchnorm, detail::settings_extra<C>, std::remove_cvref_t<X>, std::remove_cvref_t<G>,
                                  std::remove_cvref_t<Bt>>
batchnorm(X, G, Bt) noexcept {
  return {};
}
/// @brief Softmax over the last dimension.
template <expression X>
[[nodiscard]] constexpr detail::op_t<op_code::softmax, X> softmax(X) noexcept {
  return {};
}
/// @brief Fused causal self-attention on q of shape [batch, seq, heads·head_dim] and k, v of
/// shape [batch, seq, kv_heads·head_dim]: kv_heads < heads is grouped-query attention (each k/v
/// head serves heads / kv_heads query heads; head_dim from `lower_options::heads`). The last
/// dimension may be split over an axis (heads split across ranks, as Megatron-LM does; k and v
/// then hold kv_heads / axis size heads per rank).
template <expression Q, expression K, expression V>
[[nodiscard]] constexpr detail::op_t<op_code::attention, Q, K, V> causal_attention(Q, K, V) noexcept {
  return {};
}
/// @brief Self-attention without a mask (every position sees every other: an encoder's, or
/// AlphaFold's row and column attention over residues), otherwise as `causal_attention`: q
/// `[batch, seq, heads·head_dim]`, k and v `[batch, seq, kv_heads·head_dim]`, the sequence whole.
template <expression Q, expression K, expression V>
[[nodiscard]] constexpr node_expr<op_code::attention, detail::bidirectional_extra, std::remove_cvref_t<Q>,
                                  std::remove_cvref_t<K>, std::remove_cvref_t<V>>
attention(Q, K, V) noexcept {
  return {};
}
/// @brief The logistic function `1 / (1 + e^-x)`, elementwise (a gate).
template <expression X>
[[nodiscard]] constexpr detail::op_t<op_code::sigmoid, X> sigmoid(X) noexcept {
  return {};
}
/// @brief The hyperbolic tangent, elementwise.
template <expression X>
[[nodiscard]] constexpr detail::op_t<op_code::tanh, X> tanh(X) noexcept {
  return {};
}
/// @brief A 2-D convolution of images x `[batch, height, width, in]` (NHWC) by the kernel w
/// `[kernel_h, kernel_w, in, out]` (HWIO): y `[batch, out_h, out_w, out]` with out_h =
/// ⌊(height + 2·padding − kernel_h) / stride⌋ + 1 (likewise out_w), zero outside the image. Its
/// sharding is a product's over (kernel_h, kernel_w, in): the batch split (data parallel), the
/// output channels split (w `spec(replicate, replicate, replicate, shard(tp))`: column-parallel),
/// the input channels split in both (row-parallel: a pending sum); height and width stay whole.
/// @code
/// auto h = relu(conv2d<{.stride = 2, .padding = 1}>(x, param<"conv1">(spec(replicate, replicate, replicate, shard(tp)))));
/// @endcode
template <conv_config C = conv_config{}, expression X, expression W>
[[nodiscard]] constexpr node_expr<op_code::conv2d, detail::settings_extra<C>, std::remove_cvref_t<X>, std::remove_cvref_t<W>>
conv2d(X, W) noexcept {
  static_assert(C.stride >= 1, "conv2d: the stride must be at least 1 (conv_config::stride)");
  static_assert(C.padding >= 0, "conv2d: the padding must not be negative (conv_config::padding)");
  return {};
}
/// @brief The maximum over windows of an image x `[batch, height, width, channels]` (NHWC):
/// y `[batch, out_h, out_w, channels]`, out_h = ⌊(height + 2·padding − window) / stride⌋ + 1
/// (likewise out_w); padding never wins. The batch and the channels may be split; height and
/// width stay whole. A ResNet's stem pooling is `max_pool<{.window = 3, .stride = 2, .padding = 1}>(x)`.
template <pool_config C = pool_config{}, expression X>
[[nodiscard]] constexpr node_expr<op_code::max_pool, detail::settings_extra<C>, std::remove_cvref_t<X>> max_pool(X) noexcept {
  static_assert(C.window >= 1 && C.stride >= 0 && C.padding >= 0, "max_pool: window >= 1, stride >= 0 (0: the window), padding >= 0");
  static_assert(2 * C.padding < C.window + 1, "max_pool: padding at most half the window (a window of padding alone has no maximum)");
  return {};
}
/// @brief The mean over windows of an image x `[batch, height, width, channels]`, as max_pool's
/// shapes; padding counts as zeros (the sum is divided by window²). Linear: a pending sum goes
/// through.
template <pool_config C = pool_config{}, expression X>
[[nodiscard]] constexpr node_expr<op_code::avg_pool, detail::settings_extra<C>, std::remove_cvref_t<X>> avg_pool(X) noexcept {
  static_assert(C.window >= 1 && C.stride >= 0 && C.padding >= 0, "avg_pool: window >= 1, stride >= 0 (0: the window), padding >= 0");
  return {};
}
/// @brief x with dims First..Last (inclusive) as one: `flatten<1, 2>(x)` of `[batch, height,
/// width, channels]` is `[batch, height·width, channels]` (an image's pixels as a sequence). The
/// same values in the same order, a view of x's buffer (no copy). The merged dim is split as its
/// first part was; a split of a later part is gathered first.
template <int First, int Last = First + 1, expression X>
[[nodiscard]] constexpr node_expr<op_code::flatten, detail::settings_extra<dim_range{First, Last}>, std::remove_cvref_t<X>> flatten(X) noexcept {
  static_assert(First >= 0 && Last > First, "flatten<First, Last>: merges dims First..Last, so 0 <= First < Last");
  return {};
}
/// @brief x with dim `Dim` as two, `[n / Inner, Inner]`: `unflatten<1, 4>(x)` of `[batch, 32,
/// c]` is `[batch, 8, 4, c]` (flatten's inverse; with flatten and transpose, any reshape, such
/// as cutting an image into patches). A view of x's buffer (no copy). The first of the two is
/// split as dim `Dim` was (its extent must divide by the split), the second whole.
template <int Dim, int Inner, expression X>
[[nodiscard]] constexpr node_expr<op_code::unflatten, detail::settings_extra<dim_range{Dim, Dim + 1, Inner}>, std::remove_cvref_t<X>>
unflatten(X) noexcept {
  static_assert(Dim >= 0 && Inner >= 1, "unflatten<Dim, Inner>: dim Dim >= 0 becomes [extent / Inner, Inner], Inner >= 1");
  return {};
}
/// @brief a and b joined along dim `Dim`: `[..., la, ...]` and `[..., lb, ...]` give `[..., la + lb, ...]`,
/// every other dim equal. An operand of lower rank is a table of the other's last dims repeated
/// over its leading ones (as `bias` adds one): a ViT's class token `cls [1, hidden]` before the
/// patches `[batch, patches, hidden]` is `concat<1>(param<"cls">(...), patches)`, and its
/// gradient is summed over the batch. `Dim` is whole on every rank (a split is gathered); the
/// other dims are split alike in both.
template <int Dim, expression A, expression B>
[[nodiscard]] constexpr node_expr<op_code::concat_dim, detail::settings_extra<dim_range{Dim, Dim}>, std::remove_cvref_t<A>,
                                  std::remove_cvref_t<B>>
concat(A, B) noexcept {
  static_assert(Dim >= 0, "concat<Dim>: Dim is a dimension of the operands (0 is the first)");
  return {};
}
/// @brief Positions [Begin, End) of dim `Dim` of x: `slice<1, 0, 1>(h)` of `[batch, 1 + patches,
/// hidden]` is the class token's `[batch, 1, hidden]`. `Dim` is whole on every rank (a split is
/// gathered); the gradient is zero outside the part.
template <int Dim, int Begin, int End, expression X>
[[nodiscard]] constexpr node_expr<op_code::slice_dim, detail::settings_extra<dim_slice{Dim, Begin, End}>, std::remove_cvref_t<X>>
slice(X) noexcept {
  static_assert(Dim >= 0 && Begin >= 0 && End > Begin, "slice<Dim, Begin, End>: 0 <= Begin < End along dim Dim >= 0");
  return {};
}
/// @brief x with a fraction `rate` of its values zeroed and the others scaled by 1 / (1 − rate)
/// while training; evaluation passes x through. The mask is drawn from the seed, the op's place,
/// the layer, the step and each value's index in the whole tensor: any split of x (and any
/// replica) draws the values the single rank would, and the gradient redraws it. Linear: a
/// pending sum goes through.
template <dropout_config C = dropout_config{}, expression X>
[[nodiscard]] constexpr node_expr<op_code::dropout, detail::settings_extra<C>, std::remove_cvref_t<X>> dropout(X) noexcept {
  static_assert(C.rate >= 0.0f && C.rate < 1.0f, "dropout: the rate is a fraction in [0, 1) (dropout_config::rate)");
  return {};
}
/// @brief The sum over dim `Dim`: `sum<1>(x)` of `[batch, seq, hidden]` is `[batch, hidden]`.
/// A split of the dim makes the result a pending sum over its axis.
template <int Dim, expression X>
[[nodiscard]] constexpr node_expr<op_code::sum_dim, detail::settings_extra<dim_range{Dim, Dim}>, std::remove_cvref_t<X>> sum(X) noexcept {
  static_assert(Dim >= 0, "sum<Dim>: Dim is a dimension of the operand (0 is the first)");
  return {};
}
/// @brief The mean over dim `Dim` (its whole extent, however it is split): global average
/// pooling is `mean<1>(flatten<1, 2>(x))` of an image `[batch, height, width, channels]`.
template <int Dim, expression X>
[[nodiscard]] constexpr node_expr<op_code::mean_dim, detail::settings_extra<dim_range{Dim, Dim}>, std::remove_cvref_t<X>> mean(X) noexcept {
  static_assert(Dim >= 0, "mean<Dim>: Dim is a dimension of the operand (0 is the first)");
  return {};
}
/// @brief x `[..., a, b, ...]` as `[..., b, a, ...]`: dims `Dim` and `Dim + 1` swapped (by default
/// the two leading ones: column attention as row attention of the transposed pair
/// representation; `transpose<1>` of `[batch·rows, p, cols, p·c]` gathers an image's patches).
/// Each mesh axis follows its dimension. Linear: a pending sum goes through.
template <int Dim = 0, expression X>
[[nodiscard]] constexpr node_expr<op_code::transpose, detail::settings_extra<dim_range{Dim, Dim + 1}>, std::remove_cvref_t<X>>
transpose(X) noexcept {
  static_assert(Dim >= 0, "transpose<Dim>: swaps dims Dim >= 0 and Dim + 1");
  return {};
}
/// @brief Rows of `table[vocab, hidden]` picked by integer `ids[...]`; a vocabulary split over an
/// axis gives a partial result (Megatron-LM's vocab-parallel embedding).
template <expression I, expression T>
[[nodiscard]] constexpr detail::op_t<op_code::embedding, I, T> embedding(I, T) noexcept {
  return {};
}
/// @brief Mean squared error between a prediction and a target of the same shape: a scalar.
template <expression P, expression T>
[[nodiscard]] constexpr detail::op_t<op_code::mse, P, T> mse(P, T) noexcept {
  return {};
}
/// @brief Mean cross-entropy of logits[..., vocab] against integer labels[...]: a scalar.
template <expression L, expression Y>
[[nodiscard]] constexpr detail::op_t<op_code::cross_entropy, L, Y> cross_entropy(L, Y) noexcept {
  return {};
}

// ---- mixture of experts (docs/moe.md) ---------------------------------------------------------------

/// @brief Top-k routing of logits[groups, tokens, experts] (a group is a sequence: its tokens share
/// each expert's capacity): the dense gates [groups, tokens, experts], each token's top_k softmax
/// probabilities where the token keeps a slot, 0 elsewhere. First choices take slots before
/// second ones, in token order; ties go to the lower expert; tokens over capacity are dropped.
/// The load-balancing loss (Switch / GShard: aux_weight · experts · Σ_e f_e·P_e per group, f_e the
/// share of the group's top-k choices naming e, P_e its mean probability, averaged over the
/// groups) is the routing's own: its gradient joins the logits' in backward, as Megatron-LM's
/// MoEAuxLossAutoScaler does, so that a routing inside a `repeat` block needs no second output;
/// its value is not part of the step's loss.
/// @code
/// constexpr moe_config cfg{.top_k = 2, .capacity_factor = 1.25, .aux_weight = 0.01};
/// auto logits = matmul(h, param<"router">(spec(replicate, replicate)));
/// auto gates = moe_route<cfg>(logits);
/// @endcode
template <moe_config C = moe_config{}, expression L>
[[nodiscard]] constexpr node_expr<op_code::moe_route, detail::settings_extra<C>, std::remove_cvref_t<L>> moe_route(L) noexcept {
  static_assert(C.top_k >= 1, "moe_route: top_k must be at least 1 (moe_config::top_k)");
  static_assert(C.capacity_factor > 0, "moe_route: the capacity factor must be positive (moe_config::capacity_factor)");
  static_assert(C.aux_weight >= 0, "moe_route: the balance loss weight must not be negative (moe_config::aux_weight)");
  return {};
}
/// @brief The tokens x[groups, tokens, h] in their experts' slots: [experts, groups·capacity, h],
/// the groups dimension split as x's. Redistribute it to split the experts
/// (`.to(spec(shard(ep), shard(dp), replicate))`: an all-to-all on ep) and run the experts as a
/// batched matmul with weights [experts, h, f].
template <expression X, expression G>
[[nodiscard]] constexpr detail::op_t<op_code::moe_dispatch, X, G> moe_dispatch(X, G) noexcept {
  return {};
}
/// @brief The experts' outputs y[experts, groups·capacity, h] back to the tokens, each the
/// gate-weighted sum of its slots: [groups, tokens, h]. y is redistributed to the gates' split of
/// the groups first (the all-to-all back).
template <expression Y, expression G>
[[nodiscard]] constexpr detail::op_t<op_code::moe_combine, Y, G> moe_combine(Y, G) noexcept {
  return {};
}

} // namespace concerto
