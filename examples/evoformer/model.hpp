#pragma once
// The example's Evoformer pair stack, the triangle-free core of AlphaFold 2's Evoformer block on
// the pair representation z [N_res, N_res, c_z]: row-wise gated self-attention (each residue i
// attends over j), column-wise gated self-attention (each j over i) and the transition MLP, each
// pre-normalised and added to z. Dynamic axial parallelism (DAP, FastFold) splits z over `dap` on
// one residue dimension: the rows for row attention and the transition, the columns for column
// attention. Column attention runs as row attention of the transposed z; the switch between the
// row and the column split is written as a redistribution (`.to(rows)` of a transposed tensor),
// which lowers to an all-to-all over dap, forward and backward. Every weight is replicated and
// summed over dap. tests/mpi/train_evoformer_test.cpp checks this very model.
#include <concerto/concerto.hpp>

namespace evoformer_model {

using namespace concerto;
inline constexpr axis<"dap"> dap;

inline constexpr auto rows = spec(shard(dap), replicate, replicate); ///< z [i, j, c] split on i
inline constexpr auto vec = spec(replicate);
inline constexpr auto weight = spec(replicate, replicate);

/// Gated self-attention along dimension 1 of z (AlphaFold 2's, without pair bias): q, k, v and a
/// sigmoid gate from the normalised z, heads over the channels, the gated heads projected back.
template <fixed_string Prefix, class Z>
constexpr auto gated_attention(Z z) {
  auto a = layernorm(z, param<join<Prefix, "ln.g">()>(vec, init::ones), param<join<Prefix, "ln.b">()>(vec));
  auto q = matmul(a, param<join<Prefix, "wq">()>(weight));
  auto k = matmul(a, param<join<Prefix, "wk">()>(weight));
  auto v = matmul(a, param<join<Prefix, "wv">()>(weight));
  auto gate = sigmoid(matmul(a, param<join<Prefix, "wg">()>(weight)));
  return matmul(gate * attention(q, k, v), param<join<Prefix, "wo">()>(weight));
}

inline constexpr auto block = [](auto z) {
  auto z1 = z + gated_attention<"row.">(z);
  // Columns: attention over i for each j is row attention of the transposed z; its split moves
  // from j to i (an all-to-all over dap) and back.
  auto zt = transpose(z1).to(rows);
  auto z2 = z1 + transpose(gated_attention<"col.">(zt)).to(rows);
  auto t = layernorm(z2, param<"tr.ln.g">(vec, init::ones), param<"tr.ln.b">(vec));
  return z2 + matmul(relu(matmul(t, param<"tr.w1">(weight))), param<"tr.w2">(weight));
};

/// z0 (an input without gradient, the stack's pair features) through `depth` blocks, regressed on a target.
inline constexpr auto pair_stack = [] {
  constexpr auto z0 = input<"z">(rows, no_grad);
  constexpr auto zn = repeat<"blocks">(block, z0);
  return program(mse(zn, input<"target">(rows, no_grad)), adamw{});
}();

/// Shapes for N residues, c channels, `heads` heads (attention over c / heads lanes) and a
/// transition of factor 4, AlphaFold 2's pair stack widths at c = 128 and 4 heads.
inline shape_map shapes(std::int64_t residues, std::int64_t channels) {
  const auto n = residues, c = channels;
  shape_map s{{"z", {n, n, c}}, {"target", {n, n, c}}, {"tr.ln.g", {c}}, {"tr.ln.b", {c}}, {"tr.w1", {c, 4 * c}},
              {"tr.w2", {4 * c, c}}};
  for (const std::string p : {"row.", "col."}) {
    s[p + "ln.g"] = s[p + "ln.b"] = {c};
    for (const char* w : {"wq", "wk", "wv", "wg", "wo"}) s[p + w] = {c, c};
  }
  return s;
}

} // namespace evoformer_model
